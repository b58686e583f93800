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


def test_notices_say_each_thing_once():
    from mlflow_llmeff.monitor.notes import Notices

    n = Notices()
    assert [n.first("mfu"), n.first("mfu"), n.first("replica counts"), n.first("mfu")] == [True, False, True, False]


def test_absences_name_keys_with_one_why_together_in_the_order_found():
    from mlflow_llmeff.monitor.notes import Absences

    a = Absences()
    assert not a and a.text() == ""
    a.add("summary/a", "no steady step")
    a.add("summary/b", "no wall time")
    a.add("summary/c", "no steady step")
    assert a.text() == "summary/a, summary/c: no steady step; summary/b: no wall time"
    a.clear()
    assert a.why == {}


def test_absences_note_says_whether_the_tag_changed():
    from mlflow_llmeff.monitor.notes import Absences

    a = Absences()
    assert a.note({"train/padded_tokens": "padded positions unknown"}) is True
    assert a.note({"train/padded_tokens": "padded positions unknown"}) is False  # nothing new: no tag again
    assert a.note({}) is False
    assert a.note({"train/padded_tokens": "other"}) is True
    assert a.why == {"train/padded_tokens": "other"}


def test_last_point_keeps_the_first_nonfinite_loss_and_the_last_logged_step():
    from mlflow_llmeff.monitor.notes import LastPoint

    last = LastPoint()
    assert (last.step, last.metrics, last.nonfinite) == (-1, {}, None)
    last.note_nonfinite(20, float("inf"))
    last.note_nonfinite(30, 7.0)
    last.logged(30, {"train/loss": 7.0})
    assert (last.step, last.metrics, last.nonfinite) == (30, {"train/loss": 7.0}, (20, float("inf")))


def test_reached_targets_survive_a_checkpoint():
    from types import SimpleNamespace

    from mlflow_llmeff.monitor.notes import Reached

    a, b = SimpleNamespace(key="val_loss_le_2"), SimpleNamespace(key="acc_ge_0.3")
    r = Reached()
    assert not r.every([]) and not r.every([a])
    r.reach(a.key, 40)
    assert a.key in r and b.key not in r and r.every([a]) and not r.every([a, b])
    resumed = Reached()
    resumed.load({"val_loss_le_2": "40"})  # a JSON checkpoint's values
    assert resumed.state() == {"val_loss_le_2": 40}


def test_job_history_moves_the_lost_tail_to_the_last_completed_step():
    from mlflow_llmeff.monitor.notes import JobHistory

    job = JobHistory()
    assert job.move_tail_end(1000.0) is None  # no tail lost: nothing to move
    job.written_on(4)
    job.lose_tail(30.0, 900.0)  # 30 s after the checkpoint written at Unix 900 (its newest point)
    assert job.move_tail_end(None) is None
    assert job.move_tail_end(920.0) == -10.0  # the last completed step ended at 920: 20 s lost, not 30
    assert (job.tail_lost, job.tail_devices) == ((20.0, 900.0), 4)


def test_job_history_keeps_the_figures_line_as_its_note():
    from mlflow_llmeff.monitor.notes import JobHistory

    job = JobHistory()
    assert not job.has_figures and job.attempts == 1
    job.set_figures(lambda end: ({"summary/attempts": 3}, {"llmeff.reliability.why": "x"}, f"ended {end:g}"))
    assert job.figures(1234.0) == ({"summary/attempts": 3}, {"llmeff.reliability.why": "x"})
    assert job.note == "ended 1234"


def test_ending_collects_status_stability_and_outside_figures():
    from mlflow_llmeff.monitor.notes import Ending

    e = Ending()
    e.add_figures({"summary/comm_bus_gbps": 12})
    e.start_stability({"llmeff.stability": "stable"})
    e.add_stability({"llmeff.hosts": "a: rank 0"})
    e.ended("FINISHED")
    assert e.figures == {"summary/comm_bus_gbps": 12.0} and isinstance(e.figures["summary/comm_bus_gbps"], float)
    assert e.stability == {"llmeff.stability": "stable", "llmeff.hosts": "a: rank 0"}
    assert e.status == "FINISHED"


def test_run_naming_keeps_a_copy_of_the_callers_tags_and_the_shape_flags():
    from mlflow_llmeff.monitor.conditions import RunNaming

    given = {"llmeff.seq_len": "128"}
    n = RunNaming()
    assert (n.shape_pending, n.shape_varied, n.parts) == (True, False, None)
    n.given_by_caller(given, "hellaswag")
    given["other"] = "x"  # the caller's dict changing later changes nothing
    assert (n.given, n.given_keys, n.eval_tasks) == ({"llmeff.seq_len": "128"}, frozenset({"llmeff.seq_len"}), "hellaswag")
    n.shape_tagged()
    n.shape_varies()
    assert (n.shape_pending, n.shape_varied) == (False, True)


def test_held_peak_is_reused_until_it_is_refresh_s_old():
    from mlflow_llmeff.monitor.memwatch import HeldPeak

    peak = HeldPeak()
    assert peak.reuse(0.0, 1.0) is None and peak.source is None
    peak.read(10.0, 1.5, 2.0, "ru_maxrss", hold=True)
    assert peak.reuse(10.9, 1.0) == (1.5, 2.0, "ru_maxrss")
    assert peak.reuse(11.0, 1.0) is None
    peak.read(12.0, 3.0, 4.0, "cuda allocator", hold=False)  # not held: the CPU reading stays
    assert peak.source == "cuda allocator" and peak.reuse(10.5, 1.0) == (1.5, 2.0, "cuda allocator")


def test_energy_share_is_gathered_again_when_a_device_leaves_the_measurement():
    from mlflow_llmeff.monitor.consumption import EnergyShare

    share = EnergyShare()
    assert share.ids is None and share.check(0.0) is True  # never gathered
    share.gathered({"gpu:0"}, 0.0)
    assert share.check(0.0) is False and share.ids == {"gpu:0"}
    assert share.check(1.0) is True and share.ids is None


def test_memory_watch_learns_its_device_late_and_keeps_the_callers_tags():
    import torch

    from mlflow_llmeff.monitor.memwatch import MemoryWatch

    watch = MemoryWatch(None)
    watch.learn_device(None)  # not known yet: nothing changes
    assert watch.device is None
    watch.learn_device(torch.device("cpu"))
    watch.learn_device(None)
    assert watch.device == torch.device("cpu")
    watch.note_given({"llmeff.error": "OOM at step 3"})
    watch.keep_end_tags({"llmeff.memory.capacity": "16 GiB"})
    assert watch.given == {"llmeff.error": "OOM at step 3"} and watch.end_tags == {"llmeff.memory.capacity": "16 GiB"}
