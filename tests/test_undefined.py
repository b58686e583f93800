"""Figures that are undefined for a run are absent, never 0 or 1.0, and ``llmeff.summary.absent`` says why
(METRICS.md, "Intervals that hold their level"): the spread of one steady step, the goodput of no wall
time, an interval with no steady tokens/s to centre it on."""

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


def monitor(clock, **kw) -> EfficiencyMonitor:
    return EfficiencyMonitor(clock=clock, measure_energy="none", measure_peak=False, report=False, **kw)


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
    assert run.data.tags[names.SUMMARY_ABSENT] == "summary/step_time_cv: 1 steady step (a spread needs at least 2)"


def test_two_steady_steps_log_the_spread_and_no_absent_tag(tracking_uri):
    t = [0.0]
    mon = monitor(lambda: t[0], log_every_n_steps=10, warmup_steps=1)
    for dt in (0.010, 0.010, 0.030):  # steady steps of 10 and 30 ms: sd sqrt(2) x 10 ms over mean 20 ms
        t[0] += dt
        mon.step(tokens=1000)
    out = mon.finish()
    assert out[names.SUM_STEP_TIME_CV] == pytest.approx(2 ** 0.5 * 0.010 / 0.020, rel=1e-6)
    assert names.SUMMARY_ABSENT not in mlflow.MlflowClient().get_run(mon.run_id).data.tags


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
