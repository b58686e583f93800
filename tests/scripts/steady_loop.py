"""A fixed amount of CPU work per step, measured by EfficiencyMonitor: the real run of the contention tests.

``--progress FILE`` is rewritten with the step number after every step, so the test can start and
stop other processes at chosen steps. ``--hold-at N --go FILE`` waits after step N until FILE exists,
inside a declared pause (``monitor.pause("other")``: not a step's time), so a test can start other
processes before the loop goes on however fast it runs. Prints ``run_id=<id>`` at the end.
"""

import argparse
import os
import time

import torch

from mlflow_llmeff import EfficiencyMonitor

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=150)
p.add_argument("--size", type=int, default=192, help="matrix side: the step's work")
p.add_argument("--progress", default=None)
p.add_argument("--nice", type=int, default=0)
p.add_argument("--hold-at", type=int, default=0, help="after this step, wait (paused) until --go exists")
p.add_argument("--go", default=None)
p.add_argument("--sleep-ms", type=float, default=0.0,
               help="each step sleeps this long instead of computing: its time is the timer's, not a CPU share")
p.add_argument("--jitter-ms", type=float, default=0.0,
               help="and this much more, drawn uniformly and independently each step (seeded): independent "
                    "step-to-step spread that swamps the timer's slow drift")
args = p.parse_args()
jitter = __import__("random").Random(0)
if args.nice:
    os.nice(args.nice)
torch.manual_seed(0)
torch.set_num_threads(1)
model = torch.nn.Linear(args.size, args.size)
x = torch.randn(args.size, args.size)
mon = EfficiencyMonitor(model=model, log_every_n_steps=10, warmup_steps=3, measure_energy="none",
                        measure_peak=False, report=False)
for step in range(1, args.steps + 1):
    if args.sleep_ms > 0:
        time.sleep((args.sleep_ms + jitter.uniform(0.0, args.jitter_ms)) / 1000)
    else:
        y = x
        for _ in range(4):
            y = model(y)
        y.sum().backward()
    mon.step(tokens=1024, samples=8)
    if args.progress:
        with open(args.progress + ".tmp", "w") as f:
            f.write(str(step))
        os.replace(args.progress + ".tmp", args.progress)
    if step == args.hold_at:
        with mon.pause("other"):  # declared: the wait is no step's time
            while not os.path.exists(args.go):
                time.sleep(0.005)
mon.finish()
print(f"run_id={mon.run_id}")
