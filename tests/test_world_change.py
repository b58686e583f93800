"""A job whose attempts hold different numbers of devices (an elastic restart on fewer machines):
device-hours, cost and per-device figures count each attempt at its own devices; which checkpoints
another world size may resume. Hand-computed with fake clocks."""

from __future__ import annotations

import json
import os

import mlflow
import pytest

from mlflow_llmeff import names
from mlflow_llmeff.calc import cost, reliability as rel
from mlflow_llmeff.calc.throughput import Counts, ThroughputMeter
from mlflow_llmeff.meters import collectives
from mlflow_llmeff.monitor import lifecycle
from mlflow_llmeff.monitor.consumption import Consumption
from mlflow_llmeff.monitor.meter import EfficiencyMonitor
from mlflow_llmeff.testing import FakeClock
from mlflow_llmeff.train import checkpoint as ckpt
from mlflow_llmeff.train.job import carry

from conftest import empty_store, use_store


@pytest.fixture
def tracking_uri(module_store, monkeypatch):
    yield from use_store(module_store, monkeypatch)


# ------------------------------------------------------------------------------ pure arithmetic
def test_device_hours_sum_each_span_at_its_devices():
    # 2 devices for 30 min, then 1 device for 15 min: 1.0 + 0.25 device-hours
    assert cost.device_hours([(2, 1800.0), (1, 900.0)]) == 1.25
    assert cost.device_hours_cost_usd(device_hour_usd=4.0, device_hours=1.25) == 5.0
    assert cost.device_hours_cost_usd(device_hour_usd=4.0, device_hours=1.25, kwh=2.0, usd_per_kwh=0.5) == 6.0


@pytest.mark.parametrize("spans, match", [([(0, 10.0)], r"devices=0 must be a positive count"),
                                          ([(2, -1.0)], r"seconds=-1.0 must be a finite number of seconds >= 0")])
def test_device_hours_refuse_bad_spans(spans, match):
    with pytest.raises(ValueError, match=match):
        cost.device_hours(spans)


def test_reliability_device_hours_leave_the_down_time_out():
    # attempt 1: 2 devices, 0..3600 s; down 600 s; attempt 2: 1 device, 4200..6000 s
    attempts = [rel.Attempt(start=0.0, last_alive=3600.0, end="unknown", devices=2),
                rel.Attempt(start=4200.0, last_alive=6000.0, devices=1)]
    assert rel.device_hours(attempts) == pytest.approx((2 * 3600 + 1 * 1800) / 3600)  # 2.5
    assert rel.compute(attempts).down_s == 600.0
    assert rel.device_hours([rel.Attempt(start=0.0, last_alive=1.0)]) is None  # devices not recorded


def test_throughput_per_device_over_attempts_with_different_devices():
    # attempt 1: 2 devices, 4 steady steps of 1 s and 100 tokens; attempt 2 (1 device) resumes: 4 steps of 2 s
    first = ThroughputMeter(num_devices=2, warmup_steps=0)
    for _ in range(4):
        first.add(Counts(steps=1, tokens=100, samples=1), 1.0)
    second = ThroughputMeter(num_devices=1, warmup_steps=0)
    second.load_state_dict(json.loads(json.dumps(first.state_dict())))
    for _ in range(4):
        second.add(Counts(steps=1, tokens=100, samples=1), 2.0)
    r = second.summary()
    assert r.tokens_per_sec == 800 / 12  # global: tokens over the steady seconds
    assert r.device_tokens_per_sec == 800 / (2 * 4 + 1 * 8)  # 50 tokens per device-second, not 66.7 / 1
    assert r.device_tflops_per_sec(lambda s: 1e12) == 50.0  # 1 TFLOP a token: 50 TFLOP/s per device


def test_an_old_checkpoint_without_device_seconds_counts_its_steps_at_this_meters_devices():
    old = {"total": {"steps": 2, "tokens": 20}, "steady": {"steps": 2, "tokens": 20}, "steady_s": 4.0,
           "warmup_s": 0.0, "step": 2}
    m = ThroughputMeter(num_devices=2, warmup_steps=0)
    m.load_state_dict(old)
    assert m.steady_device_s == 8.0


def test_consumption_prices_earlier_seconds_at_their_devices():
    c = Consumption(devices=1, device_hour_usd=3.6)
    c.add_earlier(3600.0, 2, init_s=100.0)  # a checkpoint's hour on 2 devices, 100 s of it set-up
    assert c.device_s(5400.0) == 2 * 3600 + 1 * 1800  # 9000 device-seconds
    assert c.cost_usd(5400.0) == pytest.approx(3.6 * 9000 / 3600)  # 9.0 USD, not 3.6 x 1 x 1.5 h = 5.4
    assert c.device_s(5400.0, init_s=150.0) == 9000 - (2 * 100 + 1 * 50)  # set-up left out: 8750
    assert c.devices_changed and c.summary(5400.0, 0, None)[names.SUM_DEVICE_HOURS] == 2.5


# ------------------------------------------------------------------------------ the meter, two attempts
def test_a_restart_on_fewer_devices_counts_device_hours_cost_and_per_device_rates_per_attempt(tracking_uri,
                                                                                           monkeypatch):
    """Attempt 1 on 2 devices: 4 steps of 1 s x 100 tokens, checkpoint at step 4, then 5 s more until it
    was lost. An attempt without a step held 2 devices for 2 s (init), then 3 s down. Attempt 2 on 1
    device resumes step 4: 4 steps of 2 s. By hand: ledger wall 4 + 5 + 2 + 8 = 19 s, summary/wall_s
    22 s with the down time; device-seconds 2x4 + 2x5 + 2x2 + 1x8 = 30 (0.008333 device-h), cost
    3.6 USD/device-h x 30/3600 = 0.03 USD; per-device tokens/s 800 / (2x4 + 1x8) = 50."""
    clock = FakeClock()
    monkeypatch.setattr(collectives, "world_and_rank", lambda: (2, 0))  # rank 0 of 2 (no process group)
    first = EfficiencyMonitor(log_every_n_steps=1, warmup_steps=0, clock=clock, started_at=0.0,
                              measure_energy="none", measure_peak=False, device_hour_usd=3.6)
    assert first.world_size == 2
    for _ in range(4):
        clock.t += 1.0
        first.step(tokens=100, samples=1)
    state = json.loads(json.dumps(first.state_dict()))  # the checkpoint at step 4 (t = 4 s)
    first.flush()
    run_id = first.run_id
    lifecycle.unregister(first)
    mlflow.end_run("KILLED")
    last_ts = max(m.timestamp for m in mlflow.MlflowClient().get_metric_history(run_id, names.TRAIN_TOKENS)) / 1000
    state["saved_at_unix"] = last_ts - 5.0  # it ran 5 s past its checkpoint (lost progress)
    monkeypatch.undo()

    clock.t = 100.0
    second = EfficiencyMonitor(log_every_n_steps=1, warmup_steps=0, clock=clock, started_at=100.0,
                               measure_energy="none", measure_peak=False, device_hour_usd=3.6, run_id=run_id,
                               resume_state=state)
    assert second.world_size == 1
    second.continue_job(down_s=3.0, earlier_s={"init": 2.0}, earlier_device_s={"init": 4.0}, attempts=3)
    for _ in range(4):
        clock.t += 2.0
        second.step(tokens=100, samples=1)
    s = second.finish()
    assert s[names.SUM_WALL_S] == pytest.approx(4 + 5 + 2 + 8 + 3, abs=1e-9)
    assert s[names.SUM_DEVICE_HOURS] == pytest.approx(30 / 3600, rel=1e-12)
    assert s[names.SUM_COST_USD] == pytest.approx(0.03, rel=1e-12)  # one device count would say 3.6 x 19/3600
    assert s[names.SUM_TOKENS_PER_SEC] == pytest.approx(800 / 12, rel=1e-12)
    assert s[names.SUM_DEVICE_TOKENS_PER_SEC] == pytest.approx(50.0, rel=1e-12)
    tags = mlflow.MlflowClient().get_run(run_id).data.tags
    assert tags[names.RESUME_DEVICES].startswith("2, 1 devices across the attempts (this one 1)")


# ------------------------------------------------------------------------------ which checkpoints resume
def _checkpoint(tmp_path, world: int, parallelism: str, step: int = 4, dp_world: int | None = None) -> str:
    d = tmp_path / "ckpt"
    path = d / f"step_{step:08d}"
    os.makedirs(path)
    state = {"step": step, "run_id": "r", "monitor": {}, "world_size": world, "params": {"parallelism": parallelism}}
    if dp_world:
        state["dp_world"] = dp_world
    (path / ckpt.STATE_FILE).write_text(json.dumps(state))
    return str(d)


@pytest.mark.parametrize("written, now", [("auto", "auto"), ("ddp", "ddp"), ("fsdp", "fsdp"), ("tp", "tp"),
                                          ("hsdp", "hsdp")])
def test_a_checkpoint_of_full_or_dcp_state_resumes_on_another_world_size(tmp_path, written, now):
    found = ckpt.find_resume(_checkpoint(tmp_path, 2, written), "auto", 1, now)
    assert found is not None and found[1]["world_size"] == 2


def test_a_deepspeed_checkpoint_on_another_world_size_is_refused_in_one_line(tmp_path):
    d = _checkpoint(tmp_path, 2, "deepspeed_zero2")
    with pytest.raises(ValueError, match=r"^checkpoint .*step_00000004 was written by 2 processes, this run has 1: "
                       r"deepspeed_zero2 checkpoints hold the optimizer state partitioned over the processes that "
                       r"wrote them .*; resume with 2 processes \(num_processes x num_machines\) or resume=never$"):
        ckpt.find_resume(d, "auto", 1, "deepspeed_zero2")
    assert ckpt.find_resume(d, "auto", 2, "deepspeed_zero2") is not None  # the same world size resumes


@pytest.mark.parametrize("step, then, now, ga, expected", [
    (4, 2, 2, 1, 4),   # the same data-parallel world: step x grad_accum
    (4, 2, 1, 1, 8),   # 4 global micro-batches of 2 ranks = 8 of 1 rank
    (3, 2, 4, 2, 3),   # 6 micro-steps x 2 ranks = 12 rank-batches = 3 micro-steps of 4 ranks
    (5, 2, 3, 1, 4),   # 10 rank-batches over 3 ranks: 3.33, rounded up (no block trained on twice)
])
def test_the_data_order_continues_at_the_same_block_on_another_world(step, then, now, ga, expected):
    assert ckpt.resumed_position({"step": step, "dp_world": then}, now, ga) == expected


def test_an_old_checkpoint_without_its_data_parallel_world_continues_at_step_times_grad_accum():
    assert ckpt.resumed_position({"step": 4}, 1, 2) == 8


# ------------------------------------------------------------------------------ the job ledger
def test_carry_gives_the_device_seconds_of_attempts_no_checkpoint_holds():
    # attempt 1 (2 devices) wrote checkpoint 4 and died; attempt 2 (2 devices) died in set-up after 2 s;
    # attempt 3 (1 device) resumes step 4
    a1 = rel.Attempt(start=0.0, last_alive=10.0, end="unknown", steps=6, checkpoints=(4,), checkpoint_step=4,
                     devices=2)
    a2 = rel.Attempt(start=13.0, last_alive=15.0, end="unknown", steps=4, start_step=4, checkpoint_step=4, devices=2)
    a3 = rel.Attempt(start=20.0, last_alive=20.0, end=rel.RUNNING, start_step=4, checkpoint_step=4, devices=1)
    c = carry([a1, a2, a3], 4)
    assert c["earlier_s"] == {"init": 2.0} and c["earlier_device_s"] == {"init": 4.0}
    assert c["down_s"] == 3.0 + 5.0 and c["tail_end_unix"] == 10.0
    unknown = carry([a1, rel.Attempt(start=13.0, last_alive=15.0, end="unknown", steps=4, start_step=4), a3], 4)
    assert "earlier_device_s" not in unknown  # an attempt without its devices: the meter's own count


@pytest.mark.slow
def test_an_fsdp_checkpoint_of_two_processes_resumes_on_one(tmp_path, monkeypatch):
    """torch.distributed.checkpoint reshards FSDP2's model and optimizer shards to the layout that loads
    them: 2 processes write checkpoint 2 and are killed after step 3; 1 process resumes it and finishes."""
    import math
    import subprocess
    import sys

    from mlflow_llmeff.train import faults

    from test_train_e2e import env_for, only_run

    tracking_uri = next(use_store(empty_store(tmp_path / "mlflow.db"), monkeypatch))  # this run alone
    ck = tmp_path / "ck"
    args = [sys.executable, "-m", "mlflow_llmeff", "train", "--max-steps", "6", "--log-every-n-steps", "2",
            "--seq-len", "32", "--micro-batch-size", "2", "--warmup-steps", "1", "--measure-energy", "none",
            "--measure-comm", "false", "--parallelism", "fsdp", "--checkpoint-dir", str(ck), "--checkpoint-every", "2"]
    first = subprocess.run(args + ["--num-processes", "2"], env={**env_for(tracking_uri), faults.ENV["kill_at_step"]: "3"},
                           capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert first.returncode != 0 and (ck / "step_00000002").is_dir(), first.stderr[-3000:]
    second = subprocess.run(args + ["--num-processes", "1"], env=env_for(tracking_uri), capture_output=True, text=True,
                            timeout=600, cwd=tmp_path)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "the checkpoint was written by 2 processes, this attempt has 1 (fsdp: its state loads on any number)" \
        in second.stdout
    mlflow.set_tracking_uri(tracking_uri)
    run = only_run()
    m = run.data.metrics
    assert run.info.status == "FINISHED" and m[names.SUM_STEPS] == 6.0 and m[names.SUM_ATTEMPTS] == 2.0
    assert math.isfinite(m[names.TRAIN_LOSS])
    assert run.data.tags[names.RESUME_DEVICES].startswith("2, 1 devices across the attempts (this one 1)")
