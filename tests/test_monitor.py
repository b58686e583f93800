"""EfficiencyMonitor: hand-computed counts and rates with a fake clock, run ownership, errors."""

from __future__ import annotations

import mlflow
import pytest
import torch

from mlflow_llmeff import names
from mlflow_llmeff.energy import FakeEnergyMeter
from mlflow_llmeff.flops import flops_per_token
from mlflow_llmeff.monitor import EfficiencyMonitor
from mlflow_llmeff.train.models import load_config


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """One sqlite store for the module (creating an MLflow database costs ~2 s)."""
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"


@pytest.fixture
def tracking_uri(store, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    mlflow.set_tracking_uri(store)
    yield store
    mlflow.set_tracking_uri(None)


class Clock:
    """A fake monotonic clock the test advances by hand."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def history(run_id: str, key: str) -> list[tuple[int, float]]:
    return [(m.step, m.value) for m in mlflow.MlflowClient().get_metric_history(run_id, key)]


def test_rates_from_explicit_counts_with_a_fake_clock(tracking_uri):
    # 4 steps of 1 s and 100 tokens (4 sequences of 25); warm-up = step 1; logged at steps 2 and 4.
    clock = Clock()
    mon = EfficiencyMonitor(log_every_n_steps=2, warmup_steps=1, clock=clock, measure_energy="none")
    for _ in range(4):
        clock.t += 1.0
        mon.step(tokens=100, samples=4)
    summary = mon.finish()
    assert history(mon.run_id, names.TRAIN_TOKENS) == [(2, 200.0), (4, 400.0)]
    # Step 2's window holds step 2 only (step 1 is warm-up): 100 tokens in 1 s.
    assert history(mon.run_id, names.TPUT_TOKENS) == [(2, 100.0), (4, 100.0)]
    assert history(mon.run_id, names.TPUT_SAMPLES) == [(2, 4.0), (4, 4.0)]
    assert history(mon.run_id, names.TRAIN_STEP_TIME_S) == [(2, 1.0), (4, 1.0)]
    # loss tokens default to tokens - samples (the causal shift drops one per sequence)
    assert history(mon.run_id, names.TRAIN_LOSS_TOKENS) == [(2, 192.0), (4, 384.0)]
    assert summary[names.SUM_TOKENS] == 400.0 and summary[names.SUM_STEPS] == 4.0
    assert summary[names.SUM_TOKENS_PER_SEC] == 100.0  # 300 steady tokens in 3 s
    assert summary[names.SUM_WALL_S] == 4.0


def test_mfu_equals_tokens_per_sec_times_flops_per_token_over_peak(tracking_uri):
    cfg = load_config("llama-tiny")
    clock = Clock()
    mon = EfficiencyMonitor(log_every_n_steps=2, warmup_steps=0, model_config=cfg, peak_tflops=2.0, clock=clock,
                            measure_energy="none")
    for _ in range(2):
        clock.t += 0.5
        mon.step(tokens=64, samples=2)  # two sequences of 32: effective seq len 32
    s = mon.finish()
    expected = 128 / 1.0 * flops_per_token(cfg, 32.0) / 1e12
    assert s[names.SUM_DEVICE_TFLOPS] == pytest.approx(expected, rel=1e-12)
    assert s[names.SUM_MFU] == pytest.approx(expected / 2.0, rel=1e-12)
    assert s[names.SUM_MFU_PALM] == pytest.approx(128 * flops_per_token(cfg, 32.0, "palm") / 1e12 / 2.0, rel=1e-12)


def test_batches_count_non_padding_padded_and_loss_tokens(tracking_uri):
    ids = torch.arange(12).view(2, 6)
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0]])
    labels = ids.masked_fill(mask == 0, -100)
    mon = EfficiencyMonitor(log_every_n_steps=1, warmup_steps=0, measure_energy="none")
    mon.count({"input_ids": ids, "attention_mask": mask, "labels": labels})  # micro-batch 1
    mon.step(batch={"input_ids": ids, "attention_mask": mask, "labels": labels}, loss=torch.tensor(2.0))
    mon.finish()
    assert history(mon.run_id, names.TRAIN_TOKENS) == [(1, 18.0)]  # 2 x (6 + 3)
    assert history(mon.run_id, names.TRAIN_PADDED_TOKENS) == [(1, 24.0)]  # 2 x 12
    assert history(mon.run_id, names.TRAIN_LOSS_TOKENS) == [(1, 14.0)]  # 2 x (5 + 2)
    assert history(mon.run_id, names.TRAIN_LOSS) == [(1, 2.0)]
    tags = mlflow.MlflowClient().get_run(mon.run_id).data.tags
    assert (tags[names.SEQ_LEN], tags[names.MICRO_BATCH_SIZE], tags[names.GRAD_ACCUM]) == ("6", "2", "2")
    assert tags[names.GLOBAL_BATCH_TOKENS] == "24"


def test_energy_and_cost_from_a_fake_meter(tracking_uri):
    clock = Clock()
    meter = FakeEnergyMeter(300.0, clock=clock)  # 300 W on one device
    mon = EfficiencyMonitor(log_every_n_steps=2, warmup_steps=0, clock=clock, energy_meter=meter,
                            device_hour_usd=3.6, measure_energy="none")
    for _ in range(2):
        clock.t += 1.0
        mon.step(tokens=100, samples=1)
    s = mon.finish()
    assert history(mon.run_id, names.ENERGY_J_PER_TOKEN) == [(2, 3.0)]  # 600 J / 200 tokens
    assert history(mon.run_id, names.ENERGY_DEVICE_AVG_POWER_W) == [(2, 300.0)]
    assert history(mon.run_id, names.COST_TOTAL_USD) == [(2, pytest.approx(0.002))]  # 3.6 USD/h x 2 s
    assert s[names.SUM_J_PER_TOKEN] == 3.0
    assert s[names.SUM_USD_PER_BTOK] == pytest.approx(0.002 * 1e9 / 200)
    assert s[names.SUM_USD_PER_BTOK] == pytest.approx(3.6 * s[names.SUM_WALL_S] / 3600 / 200 * 1e9)
    tags = mlflow.MlflowClient().get_run(mon.run_id).data.tags
    assert tags[names.ENERGY_SOURCE] == "fake" and tags[names.COST_DEVICE_HOUR_USD] == "3.6"


def test_logs_into_the_active_run_and_leaves_it_open(tracking_uri):
    with mlflow.start_run() as run:
        with EfficiencyMonitor(log_every_n_steps=1, warmup_steps=0, measure_energy="none") as mon:
            mon.step(tokens=10, samples=1)
        assert mon.run_id == run.info.run_id
        assert mlflow.active_run().info.run_id == run.info.run_id
    assert history(run.info.run_id, names.SUM_TOKENS) == [(1, 10.0)]


def test_creates_and_ends_its_own_run_with_the_standard_name(tracking_uri):
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM(load_config("llama-tiny"))
    with EfficiencyMonitor(model=model, log_every_n_steps=1, warmup_steps=0, measure_energy="none") as mon:
        mon.step(tokens=10, samples=1)
    run = mlflow.MlflowClient().get_run(mon.run_id)
    assert run.info.status == "FINISHED" and mlflow.active_run() is None
    assert run.info.run_name == "llama-cpu-1x-single-fp32"
    assert run.data.tags[names.MODEL_PARAMS] == str(sum(p.numel() for p in model.parameters()))
    assert run.data.tags[names.AUTOLOG_INTEGRATION] == "monitor"


@pytest.mark.parametrize("kwargs, match", [
    ({"log_every_n_steps": 0}, "log_every_n_steps=0"),
    ({"warmup_steps": -1}, "warmup_steps=-1"),
    ({"precision": "int4"}, "precision='int4'.*fp32, bf16, fp16, fp8"),
    ({"measure_energy": "magic"}, "measure_energy='magic'"),
    ({"peak_tflops": -1.0}, "peak_tflops"),
    ({"device_hour_usd": -2.0}, "device_hour_usd"),
])
def test_bad_arguments_raise_value_error_naming_them(tracking_uri, kwargs, match):
    with pytest.raises(ValueError, match=match):
        EfficiencyMonitor(**kwargs)


def test_a_failure_inside_the_monitor_warns_and_never_raises(tracking_uri, monkeypatch):
    mon = EfficiencyMonitor(log_every_n_steps=1, warmup_steps=0, measure_energy="none")

    def boom(*a, **k):
        raise RuntimeError("broken meter")

    monkeypatch.setattr(mon._meter, "add", boom)
    with pytest.warns(UserWarning, match="broken meter"):
        mon.step(tokens=10, samples=1)
    mon.step(tokens=10, samples=1)  # now a no-op
    assert mon.finish() == {}
