"""GPU checks of the training entrypoint (skipped on CPU; bench/gpu_check.sh runs them)."""

import pytest
import torch

from mlflow_llmeff import names
from mlflow_llmeff.train.config import TrainConfig
from mlflow_llmeff.train.loop import run_training

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_bf16_run_reports_mfu_cuda_memory_and_measured_energy(tracking_uri):
    out = run_training(TrainConfig(model="llama-160m", dataset="synthetic", seq_len=512, micro_batch_size=8,
                                   max_steps=20, log_every_n_steps=5, precision="bf16"))
    s = out["summary"]
    assert 0 < s[names.SUM_MFU] < 1 and 0 < s[names.SUM_HFU] < 1
    assert s[names.SUM_MFU_PALM] > s[names.SUM_MFU]
    assert s[names.SUM_MODEL_STATE_BYTES_PER_PARAM] == 16.0
    import mlflow

    run = mlflow.MlflowClient().search_runs(["0"])[0]
    assert run.data.tags[names.MEMORY_SOURCE].startswith("torch.cuda")
    assert run.data.tags[names.ENERGY_SOURCE] in ("nvml_counter", "nvml_power")
    assert s[names.SUM_J_PER_TOKEN] > 0 and s[names.SUM_TFLOPS_PER_W] > 0


def test_cuda_memory_split_capacity_allocator_and_nvml_figures(tracking_uri):
    # where the bytes go on a real device: the split as stored, the peak's share of the device, the
    # allocator's retries and OOM count, and NVML's view of the process (tests/test_memory.py fakes each)
    from conftest import require

    require("bitsandbytes", "pip install 'mlflow-llmeff[bnb]'")
    out = run_training(TrainConfig(model="llama-160m", dataset="synthetic", seq_len=512, micro_batch_size=4,
                                   max_steps=8, log_every_n_steps=4, precision="bf16", optimizer="bnb-adamw8bit"))
    s = out["summary"]
    split = s[names.SUM_MEM_WEIGHTS_GIB] + s[names.SUM_MEM_GRADIENTS_GIB] + s[names.SUM_MEM_OPT_STATE_GIB]
    assert s[names.SUM_MEM_PEAK_GIB] > split > 0 and s[names.SUM_MEM_OTHER_GIB] > 0
    assert 2.0 < s[names.SUM_OPT_STATE_BYTES_PER_PARAM] < 2.1  # 8-bit moments with block scales, as stored
    assert 0 < s[names.SUM_MEM_PEAK_FRACTION] < 1
    assert s[names.SUM_MEM_OOMS] == 0 and s[names.SUM_MEM_ALLOC_RETRIES] >= 0
    assert s[names.SUM_MEM_NVML_PROCESS_GIB] >= s[names.SUM_MEM_PEAK_GIB]  # the CUDA context lies outside torch


def test_an_out_of_memory_failure_leaves_a_snapshot_and_names_the_largest_term(tracking_uri):
    import mlflow

    from mlflow_llmeff.monitor.meter import EfficiencyMonitor

    model = torch.nn.Linear(1024, 1024, device="cuda")
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(torch.OutOfMemoryError):
        with EfficiencyMonitor(model=model, optimizer=opt, log_every_n_steps=1, warmup_steps=0,
                               measure_energy="none", measure_peak=False) as mon:
            model(torch.randn(8, 1024, device="cuda")).sum().backward()
            opt.step()
            mon.step(tokens=8, samples=8)
            torch.empty(1 << 50, dtype=torch.uint8, device="cuda")  # 1 PiB: the allocator raises
    run = mlflow.MlflowClient().get_run(mon.run_id)
    assert run.info.status == "FAILED"
    assert "memory/oom_snapshot.pickle" in run.data.tags[names.MEMORY_SNAPSHOT]
    assert [f.path for f in mlflow.MlflowClient().list_artifacts(mon.run_id, "memory")] == ["memory/oom_snapshot.pickle"]
    assert "largest" in run.data.tags[names.ERROR]
