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
