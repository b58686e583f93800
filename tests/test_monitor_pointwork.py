"""A logged point's figures built off the training thread (monitor/pointwork.py, issue 53): the same keys,
values, steps and time stamps as built on it, in step order, all of them in the logger before the summary."""

from __future__ import annotations

import threading
import time
import types

import mlflow
import pytest

from mlflow_llmeff import names
from mlflow_llmeff.monitor import points
from mlflow_llmeff.monitor.meter import EfficiencyMonitor
from mlflow_llmeff.monitor.pointwork import PointWorker
from mlflow_llmeff.testing import FakeClock, FakeEnergyMeter
from mlflow_llmeff.tracking.logger import RunLogger

UNIX = 1_700_000_000.125  # the step's time the fake time.time() of points.py reads


def _taken(w: PointWorker) -> None:
    """Wait until the worker thread has taken every job handed over (a drain runs those it has not)."""
    deadline = time.monotonic() + 30
    while w._jobs and time.monotonic() < deadline:
        time.sleep(0.001)


def test_jobs_run_in_order_on_one_thread_and_drain_waits_for_them():
    w = PointWorker()
    done, where = [], set()

    def job(i):
        time.sleep(0.01)
        done.append(i)
        where.add(threading.current_thread().name)

    for i in range(5):
        w.submit(lambda i=i: job(i))
        _taken(w)
    assert w.drain() is None  # waits for the last one, in progress on the thread
    assert done == [0, 1, 2, 3, 4] and where == {"llmeff-points"} and w.pending == 0
    w.close(timeout_s=5)
    w.submit(lambda: job(5))  # closed: run here, at once
    assert done[-1] == 5 and where == {"llmeff-points", threading.current_thread().name}
    assert not any(t.name == "llmeff-points" for t in threading.enumerate())


def test_a_drain_runs_the_jobs_the_thread_has_not_reached_in_order_never_twice():
    w = PointWorker()
    go, done = threading.Event(), []
    w.submit(lambda: (go.wait(10), done.append(0)))  # the thread holds this one
    _taken(w)
    for i in (1, 2, 3):
        w.submit(lambda i=i: done.append(i))
    threading.Timer(0.1, go.set).start()
    assert w.drain() is None
    assert done == [0, 1, 2, 3] and w.pending == 0
    w.close(timeout_s=5)
    assert done == [0, 1, 2, 3]


def test_an_idle_thread_sleeps_until_the_next_job_wakes_it(monkeypatch):
    from mlflow_llmeff.monitor import pointwork

    monkeypatch.setattr(pointwork, "IDLE_S", 0.05)
    w = PointWorker()
    where = []
    w.submit(lambda: where.append(threading.current_thread().name))
    deadline = time.monotonic() + 30
    while not w._asleep and time.monotonic() < deadline:  # no job for IDLE_S: asleep until woken
        time.sleep(0.01)
    assert w._asleep and w.pending == 0
    w.submit(lambda: where.append(threading.current_thread().name))
    _taken(w)
    assert w.drain() is None and where == ["llmeff-points", "llmeff-points"]
    w.close(timeout_s=5)


class _CountedLock:
    """A lock whose timed acquires (the worker thread's looks for jobs) are counted."""

    def __init__(self, lock):
        self.lock, self.looks = lock, 0

    def acquire(self, blocking=True, timeout=-1):
        if timeout is not None and timeout >= 0:
            self.looks += 1
        return self.lock.acquire(blocking, timeout)

    def release(self):
        self.lock.release()


def test_the_thread_looks_for_jobs_about_twice_per_interval_between_them_not_every_10_ms():
    # jobs every 0.1 s for 1 s: looking every POLL_S (10 ms) would be ~100 looks; twice an interval ~20
    # (a loaded machine stretches the sleeps, which only makes fewer)
    w = PointWorker()
    w._wake = counted = _CountedLock(w._wake)  # before the thread starts (it reads the lock once)
    done = []
    w.submit(lambda: done.append(0))
    for i in range(1, 11):
        time.sleep(0.1)
        w.submit(lambda i=i: done.append(i))
    _taken(w)
    w.drain()
    assert done == list(range(11))
    w.close(timeout_s=5)
    assert counted.looks <= 40, counted.looks


def test_a_jobs_error_is_returned_by_the_next_drain_once_and_later_jobs_still_run():
    w = PointWorker()
    done = []
    w.submit(lambda: 1 / 0)
    w.submit(lambda: done.append("after"))
    e = w.drain()
    assert isinstance(e, ZeroDivisionError) and done == ["after"]
    assert w.drain() is None
    w.close(timeout_s=5)


def _run(tracking_uri, monkeypatch, off_thread: bool, slow_s: float = 0.0):
    """Six steps of 100 tokens (4 sequences) and 1 s on a fake clock with a 300 W fake meter, logged every 2;
    returns (run id, [(step, metrics, timestamp ms, thread name)] as handed to the logger, summary,
    latest_metrics right after step 4)."""
    monkeypatch.setattr(points, "time", types.SimpleNamespace(time=lambda: UNIX, monotonic=time.monotonic))
    calls = []
    original = RunLogger.log_metrics

    def recorded(self, metrics, step, *, timestamp_ms=None):
        time.sleep(slow_s)  # a slow worker: the end of the run must still wait for every point
        calls.append((step, dict(metrics), timestamp_ms, threading.current_thread().name))
        return original(self, metrics, step, timestamp_ms=timestamp_ms)

    monkeypatch.setattr(RunLogger, "log_metrics", recorded)
    clock = FakeClock()
    mon = EfficiencyMonitor(log_every_n_steps=2, warmup_steps=1, clock=clock, measure_energy="none",
                            energy_meter=FakeEnergyMeter(300.0, clock=clock), device_hour_usd=3.6, report=False)
    if not off_thread:
        mon._points = None  # the path of several ranks: every figure on the training thread
    latest = None
    for step in range(1, 7):
        clock.t += 1.0
        mon.step(tokens=100, samples=4, loss=2.0)
        if off_thread and mon._points is not None:
            _taken(mon._points)  # (else the next edge's drain builds it here: the same figures)
        if step == 4:
            latest = dict(mon.latest_metrics)
    summary = mon.finish()
    monkeypatch.setattr(RunLogger, "log_metrics", original)
    return mon.run_id, calls, summary, latest


def _steady(metrics: dict) -> dict:
    """A point without what reads this host (peak RSS, /proc): those differ from run to run."""
    return {k: v for k, v in metrics.items() if not k.startswith(("memory/", "system/"))}


def test_points_built_off_the_training_thread_equal_those_built_on_it(tracking_uri, monkeypatch):
    on = _run(tracking_uri, monkeypatch, off_thread=False)
    off = _run(tracking_uri, monkeypatch, off_thread=True)
    # the interval points (steps 2, 4, 6), then the summary's own points, at the same steps, keys and values
    assert [(s, _steady(m), ts) for s, m, ts, _ in on[1]] == [(s, _steady(m), ts) for s, m, ts, _ in off[1]]
    interval = [(s, ts, thread) for s, m, ts, thread in off[1] if names.TRAIN_TOKENS in m and s in (2, 4, 6)]
    assert interval == [(2, 1_700_000_000_125, "llmeff-points"), (4, 1_700_000_000_125, "llmeff-points"),
                        (6, 1_700_000_000_125, "llmeff-points")]  # stamped with the step's time, built off it
    assert {thread for _, _, _, thread in on[1]} == {"MainThread"}
    pt = off[1][0][1]
    assert (pt[names.TRAIN_TOKENS], pt[names.TPUT_TOKENS], pt[names.TRAIN_LOSS]) == (200.0, 100.0, 2.0)
    assert pt[names.ENERGY_DEVICE_AVG_POWER_W] == 300.0 and pt[names.COST_TOTAL_USD] == pytest.approx(0.002)
    assert _steady(on[2]) == _steady(off[2])  # the same summary
    assert on[3][names.TRAIN_TOKENS] == off[3][names.TRAIN_TOKENS] == 400.0  # latest_metrics waits for step 4's
    hist = mlflow.MlflowClient().get_metric_history(off[0], names.TRAIN_TOKENS)
    assert [(m.step, m.value, m.timestamp) for m in hist][:3] == [(2, 200.0, 1_700_000_000_125),
                                                                  (4, 400.0, 1_700_000_000_125),
                                                                  (6, 600.0, 1_700_000_000_125)]


def test_the_end_of_the_run_waits_for_slow_points_and_the_summary_sees_them(tracking_uri, monkeypatch):
    run_id, calls, summary, _ = _run(tracking_uri, monkeypatch, off_thread=True, slow_s=0.2)
    steps = [s for s, m, _, thread in calls if thread == "llmeff-points"]
    assert steps == [2, 4, 6]  # in step order, each handed over before the run ended
    assert summary[names.SUM_TOKENS] == 600.0
    hist = mlflow.MlflowClient().get_metric_history(run_id, names.TRAIN_TOKENS)
    assert sorted((m.step, m.value) for m in hist)[:3] == [(2, 200.0), (4, 400.0), (6, 600.0)]
    assert not any(t.name == "llmeff-points" for t in threading.enumerate())  # finish ended the thread


def test_a_failure_while_building_a_point_stops_the_monitor_and_training_goes_on(tracking_uri, monkeypatch):
    def broken(p, step, reading):
        raise RuntimeError("figures")

    monkeypatch.setattr(points, "publish_interval", broken)
    clock = FakeClock()
    mon = EfficiencyMonitor(log_every_n_steps=1, warmup_steps=0, clock=clock, measure_energy="none", report=False)
    clock.t += 1.0
    mon.step(tokens=10, samples=1)  # step 1's point fails on the worker thread
    with pytest.warns(UserWarning, match=r"EfficiencyMonitor stopped \(RuntimeError: figures\)"):
        clock.t += 1.0
        mon.step(tokens=10, samples=1)  # the next edge waits for it and finds the failure
    assert mon.finish() == {}
