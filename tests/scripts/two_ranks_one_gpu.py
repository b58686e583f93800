"""Two ranks that own the same GPU (one NVML UUID): its energy must be counted once.

Run by tests/test_monitor.py under ``torchrun --nproc_per_node 2`` on CPU (gloo). Every rank reads a
fake NVML device ``GPU-shared`` drawing 200 W on its own fake clock, which every rank advances alike;
rank 0 prints the summary and run id as one JSON line.
"""

import json

import torch.distributed as dist

from mlflow_llmeff.meters.energy import make_meter
from mlflow_llmeff.monitor.meter import EfficiencyMonitor
from mlflow_llmeff.testing import FakeClock, FakeGpu, fake_nvml


def main() -> None:
    dist.init_process_group("gloo")
    clock = FakeClock()
    gpu = FakeGpu("GPU-shared", "00000000:01:00.0", 200.0, clock)
    meter = make_meter("nvml", device_indices=[0], nvml=fake_nvml([gpu]), env={}, clock=clock, sampling_thread=False)
    mon = EfficiencyMonitor(log_every_n_steps=2, warmup_steps=0, clock=clock, energy_meter=meter,
                            measure_energy="none", measure_peak=False)
    for _ in range(4):
        clock.t += 1.0
        mon.step(tokens=100, samples=1)
    summary = mon.finish()
    if dist.get_rank() == 0:
        print(json.dumps({"summary": summary, "run_id": mon.run_id}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
