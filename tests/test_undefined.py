"""Figures that are undefined for a run are absent, never 0 or 1.0, and ``llmeff.summary.absent`` says why
(METRICS.md, "Intervals that hold their level"): the spread of one steady step, the goodput of no wall
time, an interval with no steady tokens/s to centre it on or too few steps, rates of a run that never
left warm-up, a straggler ratio over a rank without a timed step, bytes per parameter of a model
without parameters, a cost whose energy part has no measured energy; compare names a repeat left out
of a figure with its run's why, and sorts an unknown device count last, not as 0."""

from __future__ import annotations

from types import SimpleNamespace

import mlflow
import pytest

from mlflow_llmeff import names
from mlflow_llmeff.monitor import summary
from mlflow_llmeff.monitor.meter import EfficiencyMonitor
from mlflow_llmeff.monitor.steptimes import StepTimes

from conftest import use_store


@pytest.fixture
def tracking_uri(module_store, monkeypatch):
    yield from use_store(module_store, monkeypatch)


def _static_proc_stat() -> str:
    """A /proc/stat that never moves: these runs' host share is then deterministic (0 CPU ticks in the
    steady window: absent, and said why), not whatever the real machine's few ticks were."""
    import tempfile

    f = tempfile.NamedTemporaryFile("w", prefix="llmeff-stat-", delete=False)
    f.write("cpu  0 0 0 0 0 0 0 0\n")
    f.close()
    return f.name


STAT = _static_proc_stat()
#: a monitor without a model: no FLOPs figure, each named (a trial found HFU gone with no word of why)
NO_FLOPS = ("summary/device_tflops_per_sec, summary/mfu, summary/mfu_palm, summary/hfu, summary/mfu_measured_peak: "
            "no FLOPs per token (no model config (pass model= or model_config=)); ")
NO_TICKS = ("summary/host_other_cpu_fraction, summary/host_steal_fraction: 0 CPU ticks in the steady window "
            "(a host share needs at least 100, 1% resolution)")


def monitor(clock, **kw) -> EfficiencyMonitor:
    from mlflow_llmeff.monitor.contention import ContentionMeter

    return EfficiencyMonitor(clock=clock, measure_energy="none", measure_peak=False, report=False,
                             contention_meter=ContentionMeter(proc_stat=STAT, env={}), **kw)


def test_one_steady_step_logs_no_step_time_cv_and_says_why(tracking_uri):
    t = [0.0]
    mon = monitor(lambda: t[0], log_every_n_steps=10, warmup_steps=3)
    for _ in range(4):  # 3 warm-up steps and 1 steady step of 10 ms
        t[0] += 0.010
        mon.step(tokens=1000)
    out = mon.finish()
    run = mlflow.MlflowClient().get_run(mon.run_id)
    assert names.SUM_STEP_TIME_CV not in out and names.SUM_STEP_TIME_CV not in run.data.metrics
    assert run.data.metrics[names.SUM_STEP_TIME_P50_S] == pytest.approx(0.010)  # one step has a median
    assert run.data.tags[names.SUMMARY_ABSENT] == (
        NO_FLOPS + "summary/step_time_cv: 1 steady step (a spread needs at least 2); "
        "summary/stall_s, summary/stalls: 1 steady step (a stall is a step over 5x the median: none can be among "
        "fewer than 3); summary/tokens_per_sec_ci95_low, summary/tokens_per_sec_ci95_high: 1 steady step (an interval needs at least 10); "
        + NO_TICKS)


def test_two_steady_steps_log_the_spread_and_only_the_interval_is_absent(tracking_uri):
    t = [0.0]
    mon = monitor(lambda: t[0], log_every_n_steps=10, warmup_steps=1)
    for dt in (0.010, 0.010, 0.030):  # steady steps of 10 and 30 ms: sd sqrt(2) x 10 ms over mean 20 ms
        t[0] += dt
        mon.step(tokens=1000)
    out = mon.finish()
    assert out[names.SUM_STEP_TIME_CV] == pytest.approx(2 ** 0.5 * 0.010 / 0.020, rel=1e-6)
    # the spread is defined; a stall count (none can exist in 2 steps) and the interval are not, and the tag says so
    assert mlflow.MlflowClient().get_run(mon.run_id).data.tags[names.SUMMARY_ABSENT] == (
        NO_FLOPS + "summary/stall_s, summary/stalls: 2 steady steps (a stall is a step over 5x the median: none can be "
        "among fewer than 3); "
        "summary/tokens_per_sec_ci95_low, summary/tokens_per_sec_ci95_high: 2 steady steps (an interval needs at least 10); "
        + NO_TICKS)


def test_a_monitored_loop_logs_no_attempts_and_says_why(tracking_uri):
    # the trial: no summary/attempts and no why; docs/metrics.md's '1 = never restarted' read as always there
    t = [0.0]
    mon = monitor(lambda: t[0], log_every_n_steps=10, warmup_steps=1)
    for _ in range(3):
        t[0] += 0.010
        mon.step(tokens=1000)
    out = mon.finish()
    run = mlflow.MlflowClient().get_run(mon.run_id)
    assert names.SUM_ATTEMPTS not in out and names.SUM_FAILURES not in run.data.metrics
    assert run.data.tags[names.RELIABILITY_WHY] == (
        "a monitored loop sees one process, not its job's restarts: no summary/attempts, failures, down time "
        "or MTBF (llmeff train with --checkpoint-dir counts them)")


def test_no_wall_time_logs_no_goodput_and_says_why(tracking_uri):
    mon = monitor(lambda: 5.0, log_every_n_steps=10, warmup_steps=1)  # a clock that never moves
    for _ in range(3):
        mon.step(tokens=1000)
    out = mon.finish()
    run = mlflow.MlflowClient().get_run(mon.run_id)
    assert out[names.SUM_WALL_S] == 0.0
    assert names.SUM_GOODPUT not in out and names.SUM_GOODPUT not in run.data.metrics
    assert "summary/goodput: no wall time (a share of no time is undefined)" in run.data.tags[names.SUMMARY_ABSENT]


def test_an_interval_without_a_steady_tokens_per_sec_to_centre_on_is_absent_not_scaled_by_1():
    # the step times carry an interval, but the meter has no steady-state mean (no window was summed)
    steps = StepTimes()
    steps.add_window([0.010 + 0.0003 * (i % 3) for i in range(40)], 40_000)
    mon = SimpleNamespace(_steps=steps, _meter=SimpleNamespace(summary=lambda: None),
                          _contention=SimpleNamespace(finish=lambda collective: ({}, {})), world_size=1)
    out = summary.stability_figures(mon, collective=False)
    assert steps.analyse().ci95 is not None
    assert names.SUM_TPS_CI95_LOW not in out and names.SUM_TPS_CI95_HIGH not in out
    why = "no steady-state tokens/s to centre the interval on"
    assert mon._absent == {names.SUM_TPS_CI95_LOW: why, names.SUM_TPS_CI95_HIGH: why}


def test_a_run_that_never_left_warm_up_logs_no_rate_and_says_why(tracking_uri):
    t = [0.0]
    mon = monitor(lambda: t[0], log_every_n_steps=10, warmup_steps=3)
    for _ in range(3):  # every step is a warm-up step: no steady time to divide by
        t[0] += 0.010
        mon.step(tokens=1000)
    out = mon.finish()
    tags = mlflow.MlflowClient().get_run(mon.run_id).data.tags
    assert out[names.SUM_TOKENS] == 3000.0
    for key in (names.SUM_TOKENS_PER_SEC, names.SUM_STEP_TIME_S, names.SUM_STEP_TIME_P50_S, names.SUM_TPS_CI95_LOW):
        assert key not in out
    # the warm-up excess is warm-up time above as many steady steps: with no steady step it is unknown,
    # and so is the productive time (goodput was logged 0.0: a trial); the wall time is still measured,
    # 3 x 10 ms of steps on the injected clock
    assert names.SUM_GOODPUT not in out and names.SUM_BADPUT["warmup"] not in out
    assert out[names.SUM_WALL_S] == pytest.approx(0.030, abs=1e-9)
    assert tags[names.SUMMARY_ABSENT] == (
        "summary/goodput, summary/badput_warmup_s: no steady-state step (all 3 steps were warm-up): the warm-up "
        "excess over steady speed, and so the productive time, is unknown; "
        "summary/tokens_per_sec, summary/device_tokens_per_sec, summary/step_time_s: no steady-state step time "
        "(all 3 steps were warm-up, or took no time); summary/step_time_p50_s, summary/step_time_p90_s, "
        "summary/step_time_cv, summary/stall_s, summary/stalls, summary/tokens_per_sec_ci95_low, "
        "summary/tokens_per_sec_ci95_high: no steady-state step time; " + NO_TICKS)


def _stub(**kw):
    """A monitor's state as stability_figures reads it: 12 steady steps of 10 ms, 1,000 tokens each."""
    steps = StepTimes()
    steps.add_window([0.010] * 12, 12_000)
    base = dict(_steps=steps, _meter=SimpleNamespace(summary=lambda: None),
                _contention=SimpleNamespace(finish=lambda collective: ({}, {})), world_size=1, rank=0,
                _phase_s={"forward": 0.0, "backward": 0.0, "optimizer": 0.0}, _phase_steps=0, _phase_step_s=0.0,
                _phases=SimpleNamespace(timed={"forward": True, "backward": True, "optimizer": True}))
    return SimpleNamespace(**{**base, **kw})


def _ranks(*phases, steps=12):
    """Every rank's gathered times (summary._rank_times' shape): ``phases`` = (forward, backward, optimizer) s/step."""
    return [{"host": f"h{r}", "steps": steps if p else 0, "step_s": 0.05 if p else None,
             "phases": dict(zip(("forward", "backward", "optimizer"), p)) if p else {}} for r, p in enumerate(phases)]


def test_a_straggler_ratio_over_a_rank_without_a_timed_step_is_absent_not_computed(monkeypatch):
    from mlflow_llmeff.meters import collectives

    # rank 0 timed no step (no model hooked); rank 1 did: the ratio would be over a 0, and is not logged
    monkeypatch.setattr(collectives, "all_gather_object", lambda obj: _ranks((), (0.004, 0.008, 0.001)))
    mon = _stub(world_size=2)
    out = summary.stability_figures(mon, collective=True)
    assert names.SUM_STRAGGLER_RATIO not in out and names.SUM_PHASE_STRAGGLER["backward"] not in out
    assert mon._absent[names.SUM_STRAGGLER_RATIO] == "no timed steady step on rank 0"
    # both ranks timed theirs: compute 12 ms vs a median of (10 + 12) / 2 ms
    monkeypatch.setattr(collectives, "all_gather_object",
                        lambda obj: _ranks((0.003, 0.006, 0.001), (0.003, 0.008, 0.001)))
    mon = _stub(world_size=2)
    out = summary.stability_figures(mon, collective=True)
    assert out[names.SUM_STRAGGLER_RATIO] == pytest.approx(0.012 / 0.011)
    assert out[names.SUM_PHASE_STRAGGLER["backward"]] == pytest.approx(0.008 / 0.007)
    assert out[names.SUM_PHASE_STRAGGLER["forward"]] == 1.0
    assert not hasattr(mon, "_absent") or names.SUM_STRAGGLER_RATIO not in mon._absent


def test_a_phase_not_timed_on_some_rank_has_no_ratio_and_says_why(monkeypatch):
    from mlflow_llmeff.meters import collectives

    got = _ranks((0.003, 0.006, 0.001), (0.003, 0.008, 0.001))
    del got[1]["phases"]["optimizer"]  # rank 1's optimizer had no step hooks
    monkeypatch.setattr(collectives, "all_gather_object", lambda obj: got)
    mon = _stub(world_size=2)
    out = summary.stability_figures(mon, collective=True)
    assert out[names.SUM_STRAGGLER_RATIO] == pytest.approx(0.011 / 0.010)  # forward + backward only
    assert mon._absent[names.SUM_PHASE_STRAGGLER["optimizer"]] == "optimizer not timed on rank 1 (its optimizer has no step hooks)"


def test_model_state_bytes_per_param_of_a_model_without_parameters_is_absent_not_0():
    import torch

    mon = SimpleNamespace(_model=torch.nn.Module(), _device=None, _optimizer=SimpleNamespace(state={}))
    assert summary._memory_figures(mon, collective=False) == {}  # was {summary/model_state_bytes_per_param: 0.0}
    assert mon._absent == {names.SUM_MODEL_STATE_BYTES_PER_PARAM: "the model has no parameters"}
    mon = SimpleNamespace(_model=torch.nn.Linear(4, 2, bias=False), _device=None, _optimizer=SimpleNamespace(state={}))
    # 8 fp32 weights and their 8 gradients (counted at their size), no optimizer state: 8 bytes a parameter
    assert summary._memory_figures(mon, collective=False) == {names.SUM_MODEL_STATE_BYTES_PER_PARAM: 8.0}


def test_an_energy_price_without_measured_energy_gives_no_cost_rather_than_0_kwh_priced():
    from mlflow_llmeff.monitor.consumption import Consumption

    c = Consumption(devices=2, device_hour_usd=3.6, usd_per_kwh=0.2)
    c.update(joules=0.0, energy_devices=0)  # nothing measured (no NVML, no RAPL)
    assert c.cost_usd(1000.0) is None  # was 3.6 x 2 x 1000 / 3600 = 2.0 USD, the energy priced as 0 kWh
    s = c.summary(1000.0, tokens=10_000, device_tflops=None)
    assert names.SUM_COST_USD not in s and names.SUM_USD_PER_BTOK not in s
    why = "usd_per_kwh given but no energy is measured to price"
    assert c.absent() == {names.SUM_COST_USD: why, names.SUM_USD_PER_BTOK: why}
    assert c.tags(1000.0)[names.COST_USD_PER_KWH] == "0.2 (cost/* omitted: no energy is measured to price)"
    # without an energy price the device-hours are the cost, measured or not
    plain = Consumption(devices=2, device_hour_usd=3.6)
    plain.update(joules=0.0, energy_devices=0)
    assert plain.cost_usd(1000.0) == pytest.approx(2.0) and plain.absent() == {}
    # every device measured: device-hours plus 1 kWh x 0.2
    c.set_devices(2)
    c.update(joules=3.6e6, energy_devices=2, measured_domains=2, wall_s=1000.0)
    assert c.cost_usd(1000.0) == pytest.approx(2.2) and c.absent() == {}


def test_compare_names_a_repeat_left_out_with_the_why_its_run_gives():
    from mlflow_llmeff.report.calc import RunRecord, absent_why
    from mlflow_llmeff.report.repeats import configurations

    tags = {names.ACCEL_SHORT: "cpu", names.ACCEL_COUNT: "1", names.STABILITY: "stable"}
    a = RunRecord("a" * 32, "run-a", metrics={names.SUM_TOKENS_PER_SEC: 100.0, names.SUM_GOODPUT: 0.5}, tags=tags)
    b = RunRecord("b" * 32, "run-b", metrics={names.SUM_TOKENS_PER_SEC: 110.0}, tags={
        **tags, names.SUMMARY_ABSENT: "summary/step_time_cv: 1 steady step (a spread needs at least 2); "
                                      "summary/goodput: no wall time (a share of no time is undefined)"})
    assert absent_why(b, names.SUM_GOODPUT) == "no wall time (a share of no time is undefined)"
    assert absent_why(b, names.SUM_MFU) is None and absent_why(a, names.SUM_GOODPUT) is None
    (c,) = configurations([a, b])
    assert c.estimate(names.SUM_GOODPUT).left_out == (
        "run-b: no summary/goodput (no wall time (a share of no time is undefined))",)


def test_the_headline_sorts_an_unknown_device_count_last_not_as_0():
    from mlflow_llmeff.report.calc import RunRecord
    from mlflow_llmeff.report.headline import headline
    from mlflow_llmeff.report.repeats import configurations

    run = RunRecord("c" * 32, "run-c", metrics={names.SUM_DEVICE_TOKENS_PER_SEC: 50.0}, tags={names.STABILITY: "stable"})
    h = headline(configurations([run]))
    devices = h.rows[0][h.columns.index("devices")]
    assert (devices.text, devices.sort) == ("", None)  # was sort 0.0: first in an ascending sort
