"""Reliability in compare, the report and the page: fleet MTBF with its chi-square interval per
configuration and for the experiment, and failures by cause (issue 29). Hand-computed values; the
chi-square quantiles are table values (NIST/SEMATECH e-Handbook 1.3.6.7.4)."""

from __future__ import annotations

import pytest

from mlflow_llmeff import names
from mlflow_llmeff.report.calc import RunRecord, failures_by_cause, fleet_reliability, parse_failures
from mlflow_llmeff.report.render import build_report, reliability, reliability_text, to_html, to_markdown
from mlflow_llmeff.report.source import Selection

# chi-square quantiles (table): chi2(0.975, 8) = 17.535, chi2(0.025, 6) = 1.2373, chi2(0.975, 2) = 7.3778
CHI2_975_8, CHI2_025_6, CHI2_975_2 = 17.535, 1.2373, 7.3778

A_TAG = ("attempt 1: signal (SIGKILL) at step 7, 12.0 s into the job, checkpoint 4, 3 steps redone, "
         "down 20.0 s, recovery 25.0 s")
B_TAG = ("attempt 1: signal (SIGKILL) at step 9, 30.0 s into the job, checkpoint 5, 4 steps redone, "
         "down 10.0 s, recovery 14.0 s; attempt 2: nan at step 15, 60.0 s into the job, checkpoint 10, "
         "5 steps redone, down 5.0 s, recovery 8.0 s")


def rec(name, wall, down, failures, attempts, tag=None, cost=None, device="cpu"):
    m = {names.SUM_WALL_S: wall, names.SUM_BADPUT_DOWN_S: down, names.SUM_FAILURES: float(failures),
         names.SUM_ATTEMPTS: float(attempts), names.SUM_DEVICE_TOKENS_PER_SEC: 100.0}
    if cost is not None:
        m[names.SUM_FAILURE_COST_S] = cost
    tags = {names.ACCEL_SHORT: device, names.ACCEL_COUNT: "1"}
    if tag is not None:
        tags[names.RELIABILITY_FAILURES] = tag
    return RunRecord(run_id=name * 4, name=name, metrics=m, tags=tags)


def report(runs):
    return build_report(None, Selection("1", "exp", "", runs), plots=False)


def test_fleet_mtbf_sums_operating_time_and_failures_with_the_chi_square_interval():
    # operating = (1020 - 20) + (2050 - 50) = 3000 s over 1 + 2 = 3 failures
    f = fleet_reliability([rec("a", 1020.0, 20.0, 1, 2), rec("b", 2050.0, 50.0, 2, 3)])
    assert (f.runs, f.attempts, f.failures, f.operating_s) == (2, 5, 3, 3000.0)
    assert f.mtbf_s == pytest.approx(1000.0)
    assert f.low_s == pytest.approx(6000.0 / CHI2_975_8, rel=1e-4)  # 342.2 s
    assert f.high_s == pytest.approx(6000.0 / CHI2_025_6, rel=1e-4)  # 4849 s


def test_no_failure_gives_only_the_lower_bound():
    f = fleet_reliability([rec("a", 1000.0, 0.0, 0, 1)])
    assert (f.failures, f.mtbf_s, f.high_s) == (0, None, None)
    assert f.low_s == pytest.approx(2000.0 / CHI2_975_2, rel=1e-4)  # 271.1 s


def test_a_run_without_reliability_figures_takes_no_part_and_alone_gives_nothing():
    old = RunRecord("old1", "old", metrics={names.SUM_WALL_S: 500.0, names.SUM_DEVICE_TOKENS_PER_SEC: 1.0})
    assert fleet_reliability([old]) is None
    f = fleet_reliability([old, rec("a", 1020.0, 20.0, 1, 2)])
    assert (f.runs, f.operating_s, f.left_out) == (1, 1000.0, ("old",))


def test_failures_tag_is_parsed_entry_by_entry():
    fs = parse_failures(rec("b", 100.0, 15.0, 2, 3, B_TAG))
    assert [(x.attempt, x.cause, x.detail, x.step, x.at_s, x.lost_steps, x.down_s, x.recovery_s) for x in fs] == [
        (1, "signal", "SIGKILL", 9, 30.0, 4, 10.0, 14.0), (2, "nan", "", 15, 60.0, 5, 5.0, 8.0)]
    assert parse_failures(rec("c", 100.0, 0.0, 0, 1, "none in 1 attempt")) == []
    assert parse_failures(rec("d", 100.0, 0.0, 0, 1)) is None


def test_a_malformed_failures_tag_is_one_line_naming_the_run():
    with pytest.raises(ValueError, match="run x: llmeff.reliability.failures entry 'garbage'"):
        parse_failures(rec("x", 100.0, 0.0, 1, 2, "garbage"))


def test_failures_by_cause_from_two_runs_tags():
    # run a: one SIGKILL, failure cost 31 s (recovery 25 + lost 6): all of it is the signal's.
    # run b: SIGKILL and NaN: its lost seconds cannot be split between the causes from the tag.
    rows = failures_by_cause([rec("a", 1020.0, 20.0, 1, 2, A_TAG, cost=31.0),
                              rec("b", 2050.0, 15.0, 2, 3, B_TAG, cost=40.0)])
    assert [(r.cause, r.count, r.details, r.lost_steps, r.down_s, r.recovery_s, r.cost_s) for r in rows] == [
        ("signal", 2, {"SIGKILL": 2}, 7, 30.0, 39.0, None), ("nan", 1, {"nan": 1}, 5, 5.0, 8.0, None)]
    assert [(r.down_known, r.recovery_known) for r in rows] == [(2, 2), (1, 1)]
    assert [r.share for r in rows] == pytest.approx([2 / 3, 1 / 3])


def test_failure_cost_per_cause_when_each_run_fails_of_one_cause():
    b_kill = ("attempt 1: signal (SIGKILL) at step 9, 30.0 s into the job, checkpoint 5, 4 steps redone, "
              "down 10.0 s, recovery 14.0 s")
    rows = failures_by_cause([rec("a", 1020.0, 20.0, 1, 2, A_TAG, cost=31.0),
                              rec("b", 2010.0, 10.0, 1, 2, b_kill, cost=20.0)])
    assert [(r.cause, r.count, r.share, r.cost_s) for r in rows] == [("signal", 2, 1.0, 51.0)]


def test_failure_cost_from_each_failure_s_lost_seconds_when_the_tag_gives_them():
    tag = B_TAG.replace("recovery 14.0 s", "recovery 14.0 s, lost 3.0 s").replace("recovery 8.0 s", "recovery 8.0 s, lost 2.5 s")
    rows = failures_by_cause([rec("b", 2050.0, 15.0, 2, 3, tag, cost=27.5)])
    assert [(r.cause, r.cost_s) for r in rows] == [("nan", 10.5), ("signal", 17.0)]


def test_report_shows_experiment_configurations_and_causes():
    rep = report([rec("a", 1020.0, 20.0, 1, 2, A_TAG, cost=31.0), rec("b", 2050.0, 50.0, 2, 3, B_TAG, cost=40.0,
                                                                      device="h200")])
    rel = reliability(rep)
    assert rel.lines[0].startswith("Experiment: 3 failures, 5 attempts in 2 runs, 3,000 s of operation; "
                                   "fleet MTBF 1,000 s [342, 4,849]")
    assert sorted(r[:5] for r in rel.config_rows) == [["a", "1", "2", "1", "1,000"], ["b", "1", "3", "2", "2,000"]]
    a_row = next(r for r in rel.config_rows if r[0] == "a")
    assert a_row[5] == "1,000 s [179, 39,498]"  # 2000/chi2(0.975, 4) = 2000/11.143, 2000/chi2(0.025, 2) = 2000/0.050636
    # run b's lost progress cannot be split between its two causes: the cost is unknown, said so (was "")
    assert rel.cause_rows[0] == ["signal", "2", "66.7%", "SIGKILL x2", "7", "30", "39", "unknown"]
    md, page = to_markdown(rep), to_html(rep)
    assert "## Reliability" in md and "| signal | 2 | 66.7% | SIGKILL x2 |" in md
    assert "<table id='failures-by-cause'>" in page and "<table id='reliability'>" in page
    assert "signal  2" in reliability_text(rep)


def test_a_failure_no_attempt_followed_has_unknown_down_and_recovery_never_summed_as_0():
    # run c failed at attempt 2 and no third attempt has started: its down and recovery time are unknown.
    # The fault: they were summed as 0, so the signal row read down 20 s, recovery 25 s for two failures
    c_tag = ("attempt 1: signal (SIGKILL) at step 7, 12.0 s into the job, checkpoint 4, 3 steps redone, "
             "down 20.0 s, recovery 25.0 s; attempt 2: signal (SIGTERM) at step 12, 70.0 s into the job, "
             "checkpoint 10, 2 steps redone")
    open_run = rec("c", 90.0, 20.0, 2, 2, c_tag)  # no summary/failure_cost_s: a failure has no recovery yet
    (row,) = failures_by_cause([open_run])
    assert (row.count, row.down_s, row.down_known, row.recovery_s, row.recovery_known, row.cost_s) == (
        2, 20.0, 1, 25.0, 1, None)
    assert reliability(report([open_run])).cause_rows == [
        ["signal", "2", "100.0%", "SIGKILL x1, SIGTERM x1", "5", "20 (1 of 2 known)", "25 (1 of 2 known)", "unknown"]]
    # none known: unknown, not 0
    only_open = rec("d", 90.0, 0.0, 1, 1, "attempt 1: nan at step 12, 70.0 s into the job, checkpoint 10, "
                                          "2 steps redone")
    (row,) = failures_by_cause([only_open])
    assert (row.down_s, row.recovery_s, row.down_known, row.recovery_known) == (None, None, 0, 0)
    assert reliability(report([only_open])).cause_rows[0][5:] == ["unknown", "unknown", "unknown"]
    # every one known: the plain sum (test_failures_by_cause_from_two_runs_tags: 30 s and 39 s)


def test_no_failure_is_one_line_and_no_table():
    rep = report([rec("a", 1000.0, 0.0, 0, 1, "none in 1 attempt")])
    rel = reliability(rep)
    assert rel.lines == ["No run failed: 1 attempt in 1 run, 1,000 s of operation; fleet MTBF > 271 s "
                         "(95% lower bound, 2T/chi2(0.975, 2))."]
    assert (rel.config_rows, rel.cause_rows) == ([], [])
    assert "<table id='reliability'>" not in to_html(rep)


def test_old_runs_without_reliability_figures_show_no_section():
    old = RunRecord("old1", "old", metrics={names.SUM_WALL_S: 500.0, names.SUM_DEVICE_TOKENS_PER_SEC: 1.0})
    rep = report([old])
    assert reliability(rep).lines == []
    assert "Reliability" not in to_markdown(rep) and "Reliability" not in to_html(rep)


# ------------------------------------------------------------------------------ bench/faults.py's plan
def _faults_bench():
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).parents[1] / "bench" / "faults.py"
    spec = importlib.util.spec_from_file_location("bench_faults", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("seed", range(20))
def test_fault_plan_kills_each_attempt_after_it_made_progress_past_its_resume_point(seed):
    import random

    bench = _faults_bench()
    plan = bench.plan(random.Random(seed), 5, 60, 5)
    resume = 0
    for hook, step in plan:
        done = step if hook == "kill_at_step" else step - 1
        assert done > resume and step < 60  # at least one step of new work, and the job not yet finished
        resume = done // 5 * 5


def test_newest_checkpoint_is_the_newest_complete_folder(tmp_path):
    bench = _faults_bench()
    for name, complete in (("step_00000004", True), ("step_00000008", True), ("step_00000012.partial", True),
                           ("step_00000016", False)):
        (tmp_path / name).mkdir()
        if complete:
            (tmp_path / name / "llmeff_state.json").write_text("{}")
    assert bench.newest_checkpoint(str(tmp_path)) == 8
    assert bench.newest_checkpoint(str(tmp_path / "absent")) == 0


def test_a_detail_holding_parentheses_is_read_whole():
    tag = ("attempt 1: unknown (no exit record (killed or lost)) at step 10, 18.1 s into the job, checkpoint 8, "
           "2 steps redone, down 1.4 s, recovery 17.6 s")
    (f,) = parse_failures(rec("q", 60.0, 1.4, 1, 2, tag))
    assert (f.cause, f.detail, f.step, f.lost_steps, f.down_s) == ("unknown", "no exit record (killed or lost)", 10, 2, 1.4)
