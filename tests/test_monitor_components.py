"""The monitor's small components, each alone: what each owns of the run, read through its methods
(mlflow_llmeff/monitor/parts.py lists them; issue 52)."""

from __future__ import annotations

import pytest

from mlflow_llmeff.monitor.steptimes import PhaseTotals, Window


def test_a_window_holds_its_steps_seconds_and_steady_seconds_until_the_edge():
    t = iter([0.0, 0.5, 1.25, 2.0])  # an injected clock: steps of 0.5, 0.75 and 0.75 s
    w = Window()
    before = next(t)
    for i, warmup in enumerate((True, False, False)):
        now = next(t)
        w.add(now - before, warmup, lr=1e-3 * (i + 1) if i < 2 else None)
        before = now
    assert (w.steps, w.seconds) == (3, 2.0)
    assert w.lr == 2e-3  # the last given; a step without one keeps it
    assert w.take_steady() == [0.75, 0.75]  # the warm-up step is left out
    assert w.take_steady() == []
    w.close()
    assert (w.steps, w.seconds, w.lr) == (0, 0.0, 2e-3)


def test_phase_totals_give_mean_seconds_per_timed_step():
    totals = PhaseTotals()
    assert totals.per_step(("forward",)) == ({}, None)
    totals.add({"forward": 0.3, "backward": 0.6, "optimizer": 0.0}, 3, [0.5, 0.5, 0.5])
    totals.add({"forward": 0.1, "backward": 0.2, "optimizer": 0.1}, 1, [0.5])
    assert totals.steps == 4
    phases, step_s = totals.per_step(("forward", "backward"))
    assert phases == pytest.approx({"forward": 0.1, "backward": 0.2})
    assert step_s == 0.5
