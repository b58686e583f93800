"""MLPerf-style results from ordinary runs: the olympic score (hand-computed), seeds run to a target as one
configuration whose time, energy and cost to it are scored as MLPerf Training scores a benchmark (the
report, the efficiency page, llmeff compare), and one MFU denominator for FP8 and BF16 runs."""

from __future__ import annotations

import math

import mlflow
import pytest

from conftest import empty_store
from five_runs import COMMON
from mlflow_llmeff import names
from mlflow_llmeff.calc.mlperf import MIN_RUNS, olympic
from mlflow_llmeff.report.calc import RunRecord, comparability_warnings, run_length
from mlflow_llmeff.report.repeats import configurations

TARGET = "val_loss_le_3.0"

#: Five seeds run to val_loss<=3.0 with a 300-step cap: seconds, kWh and USD to the target, and the steps each ran.
#: Seed 2 never reached it: it ran its 300 steps (1,050 s of wall, 10 s of it set-up).
SEEDS = (  # seed, wall_s, kwh, usd, steps
    (0, 412.0, 0.0412, 1.03, 120),
    (1, 380.5, 0.0381, 0.95, 110),
    (2, None, None, None, 300),
    (3, 455.25, 0.0455, 1.14, 135),
    (4, 398.0, 0.0398, 1.00, 115),
)


# --------------------------------------------------------------------------- the score (calc/mlperf.py)
def test_the_olympic_mean_drops_the_fastest_and_counts_a_run_that_never_converged_as_the_slowest():
    o = olympic([s[1] for s in SEEDS])
    # sorted: 380.5, 398, 412, 455.25, inf; 380.5 and inf dropped; (398 + 412 + 455.25) / 3 = 1265.25 / 3
    assert o.score == 421.75 and o.kept == (398.0, 412.0, 455.25)
    assert (o.n, o.not_converged, o.dropped_low, o.dropped_high) == (5, 1, (380.5,), ())
    assert (o.low, o.high) == (398.0, 455.25)
    # the old figure, the mean of the four that converged, hid the failure: (380.5 + 398 + 412 + 455.25) / 4
    assert sum(o.converged) / 4 == 411.4375 < o.score


def test_every_run_converged_drops_the_fastest_and_the_slowest():
    o = olympic([30.0, 10.0, 50.0, 20.0, 40.0])
    assert (o.score, o.dropped_low, o.dropped_high, o.why) == (30.0, (10.0,), (50.0,), "")


def test_two_runs_that_never_converged_make_the_result_invalid():
    o = olympic([100.0, None, 120.0, None, 90.0])
    assert o.score is None and o.not_converged == 2 and not o.valid
    assert o.why == ("2 of 5 runs did not reach the target: at most 1 may (dropped as the slowest); the result "
                     "is invalid (MLPerf Training Rules, 'Benchmark Results')")


def test_fewer_than_three_runs_have_no_olympic_mean():
    assert olympic([100.0, 120.0]).why == ("2 runs: an olympic mean drops the 1 fastest and the 1 slowest, so it "
                                           "needs at least 3")


def test_unet3ds_rule_drops_four_at_each_end():
    # the deprecated UNET3D rule: 40 runs, the 4 fastest and 4 slowest dropped, at most 4 non-converging
    o = olympic([float(v) for v in range(1, 37)] + [None] * 4, drop=4)
    assert o.score == sum(range(5, 37)) / 32 == 20.5
    assert olympic([1.0] * 35 + [None] * 5, drop=4).score is None


@pytest.mark.parametrize("values, drop, match", [
    ([1.0, -2.0, 3.0], 1, r"^value -2.0 is not accepted; give a finite value >= 0, or None"),
    ([1.0, math.nan, 3.0], 1, r"^value nan is not accepted"),
    ([1.0, math.inf, 3.0], 1, r"^value inf is not accepted"),
    ([1.0, 2.0, 3.0], 0, r"^drop=0 is not accepted; give the runs dropped at each end, an integer >= 1$"),
])
def test_bad_values_are_one_line_naming_them(values, drop, match):
    with pytest.raises(ValueError, match=match):
        olympic(values, drop)


def test_the_minimum_runs_are_the_rules_llm_rows():
    assert MIN_RUNS["llama31_8b"] == 10 and MIN_RUNS["llama31_405b"] == 3


# --------------------------------------------------------------------------- energy and cost on the runs time keeps
#: Five runs whose fastest (90 s) is also the most energy-hungry (4.0 kWh) and the dearest (8.0 USD).
HUNGRY = ((100.0, 1.5, 3.0), (90.0, 4.0, 8.0), (110.0, 2.0, 4.0), (120.0, 2.5, 5.0), (130.0, 3.0, 6.0))


def test_energy_is_scored_on_the_runs_the_time_score_keeps():
    from mlflow_llmeff.calc.mlperf import olympic_on_kept

    times, kwh = [h[0] for h in HUNGRY], [h[1] for h in HUNGRY]
    o = olympic_on_kept(times, kwh)
    # time drops 90 s (4.0 kWh) and 130 s (3.0 kWh); energy keeps 1.5, 2.0, 2.5: 6.0 / 3 = 2.0 kWh
    assert (o.score, o.kept, o.dropped_low, o.dropped_high) == (2.0, (1.5, 2.0, 2.5), (4.0,), (3.0,))
    # the old per-figure olympic mean dropped 1.5 and 4.0 instead: (2.0 + 2.5 + 3.0) / 3 = 2.5 kWh
    assert olympic(kwh).score == 2.5 != o.score


def test_a_run_the_time_score_drops_as_not_converged_has_no_energy_to_average():
    from mlflow_llmeff.calc.mlperf import olympic_on_kept

    o = olympic_on_kept([100.0, None, 90.0, 110.0], [1.0, None, 5.0, 2.0])
    # time: 90 s dropped as the fastest, the unconverged run as the slowest; energy (1.0 + 2.0) / 2
    assert (o.score, o.not_converged, o.dropped_low, o.dropped_high) == (1.5, 1, (5.0,), ())


def test_no_time_score_is_no_energy_score_and_says_why():
    from mlflow_llmeff.calc.mlperf import olympic_on_kept

    o = olympic_on_kept([100.0, None, None, 90.0, 80.0], [1.0, None, None, 2.0, 3.0])
    assert o.score is None and o.why.startswith("2 of 5 runs did not reach the target")
    assert olympic_on_kept([1.0, 2.0, 3.0], [1.0, None, 1.0]).why == (
        "a run the time score kept has no value for this figure")


def test_equal_times_drop_in_the_order_given():
    from mlflow_llmeff.calc.mlperf import olympic_on_kept

    assert olympic_on_kept([5.0, 5.0, 5.0], [1.0, 2.0, 4.0]).kept == (2.0,)


@pytest.mark.parametrize("times, values, match", [
    ([1.0, 2.0, 3.0], [1.0, 2.0], r"^3 times and 2 values are not accepted; give one value per run$"),
    ([1.0, 2.0, 3.0], [1.0, -2.0, 3.0], r"^value -2.0 is not accepted"),
])
def test_bad_second_figures_are_one_line_naming_them(times, values, match):
    from mlflow_llmeff.calc.mlperf import olympic_on_kept

    with pytest.raises(ValueError, match=match):
        olympic_on_kept(times, values)


def test_the_configurations_energy_and_cost_leave_out_the_run_its_time_dropped():
    from mlflow_llmeff.report.mlperf import RULE_NOTE, target_scores

    recs = [_seed_record(i, t, k, u, 100 + i) for i, (t, k, u) in enumerate(HUNGRY)]
    ts, = target_scores(configurations(recs))
    assert ts.wall.score == 110.0  # (100 + 110 + 120) / 3
    assert ts.scores["kwh"].score == 2.0 and ts.scores["usd"].score == 4.0  # (3 + 4 + 5) / 3
    assert "Energy and cost are the mean over the runs the time score keeps" in RULE_NOTE


# --------------------------------------------------------------------------- a target's runs are one configuration
def _seed_record(seed, wall, kwh, usd, steps, cap=300, stop="true", targets="val_loss<=3.0"):
    tags = {**COMMON, names.ACCEL_COUNT: "1", names.PAR_STRATEGY: "single", names.GRAD_ACCUM: "1",
            names.GLOBAL_BATCH_TOKENS: "1024", names.MODEL_NAME: "llama-tiny",
            names.TTQ_TAG_PREFIX + TARGET: f"reached_at_step_{steps}" if wall is not None else "not_reached"}
    m = {names.SUM_TOKENS_PER_SEC: 40_000.0 + 100 * seed, names.SUM_DEVICE_TOKENS_PER_SEC: 40_000.0 + 100 * seed,
         names.SUM_STEPS: float(steps), names.SUM_WALL_S: 1050.0 if wall is None else wall + 20.0,
         names.SUM_BADPUT["init"]: 10.0, names.SUM_GOODPUT: 0.8}
    if wall is not None:
        m.update({f"ttq/{TARGET}_wall_s": wall, f"ttq/{TARGET}_kwh": kwh, f"ttq/{TARGET}_usd": usd})
    params = {"seed": str(seed), "max_steps": str(cap), "stop_at_targets": stop, "targets": targets}
    return RunRecord(f"run{seed}", f"tiny-seed{seed}", metrics=m, tags=tags, params=params)


def test_seeds_stopped_at_a_target_are_one_configuration_whatever_their_length():
    runs = [_seed_record(*s) for s in SEEDS]
    c, = configurations(runs)
    assert len(c.runs) == 5 and run_length(runs[0]) == "to val_loss<=3.0, at most 300 steps"
    # their lengths differ by design: no 'run length differs' warning on their goodput
    assert comparability_warnings(runs) == []


def test_plain_runs_of_different_lengths_stay_apart_and_so_do_other_caps_and_targets():
    plain = [_seed_record(0, 412.0, 0.04, 1.0, 50, stop="false"), _seed_record(1, 380.5, 0.04, 1.0, 300, stop="false")]
    assert [len(c.runs) for c in configurations(plain)] == [1, 1]  # a 50-step and a 300-step run: two
    capped = [_seed_record(0, 412.0, 0.04, 1.0, 120), _seed_record(1, 380.5, 0.04, 1.0, 110, cap=200),
              _seed_record(2, 398.0, 0.04, 1.0, 110, targets="val_loss<=2.5")]
    assert [len(c.runs) for c in configurations(capped)] == [1, 1, 1]


def test_the_configurations_scores_to_its_target_follow_the_rules():
    from mlflow_llmeff.report.mlperf import target_scores

    c, = configurations([_seed_record(*s) for s in SEEDS])
    ts, = target_scores([c])
    assert ts.target == TARGET and [r.reached for r in ts.runs] == [True, True, False, True, True]
    assert ts.wall.score == 421.75
    # kWh: .0381 dropped as the fastest, the unconverged run as the slowest: (.0398 + .0412 + .0455) / 3
    assert ts.scores["kwh"].score == pytest.approx(0.1265 / 3, rel=1e-12)
    assert ts.scores["usd"].score == pytest.approx(3.17 / 3, rel=1e-12)  # (1.00 + 1.03 + 1.14) / 3
    assert ts.not_reached[0].end_s == 1040.0 and ts.not_reached[0].steps == 300


def test_a_failed_run_of_the_configuration_counts_as_not_converged():
    from mlflow_llmeff.report.mlperf import target_scores

    runs = [_seed_record(*s) for s in SEEDS if s[1] is not None]
    crashed = _seed_record(9, None, None, None, 40)
    crashed = RunRecord("crashed", "tiny-seed9", "FAILED", metrics={}, tags=crashed.tags, params=crashed.params)
    ts, = target_scores(configurations(runs + [crashed]), [crashed])
    assert [r.status for r in ts.runs][-1] == "FAILED" and ts.wall.score == 421.75  # as the unconverged seed
    ts2, = target_scores(configurations(runs + [crashed, crashed]), [crashed, crashed])
    assert ts2.wall.score is None and ts2.wall.not_converged == 2
    # on the terminal the invalid cell says why once (no scoring words beside a score that is not one)
    from mlflow_llmeff.report.mlperf import text_lines

    line = text_lines([ts2])[0]
    assert line.startswith("tiny-seed0 (+3 seeds): to val_loss_le_3.0: 4 of 6 runs reached it; time from training "
                           "start invalid: 2 of 6 not reached; energy invalid: 2 of 6 not reached; cost invalid: "), line
    assert line.endswith("; tiny-seed9 failed; tiny-seed9 failed") and "dropped" not in line


def test_three_runs_show_the_middle_one_without_a_range_of_one_value():
    from mlflow_llmeff.report.mlperf import rows, target_scores

    three = [_seed_record(0, 412.0, 0.0412, 1.03, 120), _seed_record(1, 380.5, 0.0381, 0.95, 110),
             _seed_record(2, 455.0, 0.0455, 1.14, 130)]
    ts, = target_scores(configurations(three))
    row = rows([ts])[0]
    # 380.5 dropped as the fastest, 455 as the slowest: 412 alone, not "412 s [412, 412]"
    assert row[3] == "412 s" and row[4] == "0.0412 kWh" and row[5] == "1.03 USD"
    assert row[6] == "the middle run of 3 (dropped: 380 s fastest, 455 s slowest)"


def test_one_or_two_runs_show_their_mean_only_when_every_one_reached_the_target():
    from mlflow_llmeff.report.mlperf import rows, target_scores

    two = [_seed_record(0, 412.0, 0.0412, 1.03, 120), _seed_record(1, 380.5, 0.0381, 0.95, 110)]
    ts, = target_scores(configurations(two))
    # too few to drop the fastest and the slowest: (412 + 380.5) / 2, said so
    assert ts.figure() == (396.25, 380.5, 412.0, "mean of 2 runs: too few to drop the fastest and the slowest")
    assert rows([ts])[0][3] == "396 s [380, 412] (mean of 2 runs: too few to drop the fastest and the slowest)"
    failed = [_seed_record(0, 412.0, 0.0412, 1.03, 120), _seed_record(2, None, None, None, 300)]
    ts, = target_scores(configurations(failed))
    assert ts.figure() is None and rows([ts])[0][3] == "none: 2 runs, 3 needed"  # never 412 s alone


# --------------------------------------------------------------------------- the report, the page, llmeff compare
def _log(client, exp: str, records) -> str:
    from mlflow.entities import Metric, Param, RunTag

    exp_id = client.create_experiment(exp)
    for r in records:
        run = client.create_run(exp_id, run_name=r.name)
        ts = run.info.start_time
        client.log_batch(run.info.run_id, metrics=[Metric(k, v, ts + 1000, 0) for k, v in r.metrics.items()],
                         params=[Param(k, v) for k, v in r.params.items()],
                         tags=[RunTag(k, v) for k, v in r.tags.items()])
        client.set_terminated(run.info.run_id, r.status)
    return exp_id


@pytest.fixture
def seeds_store(tmp_path, monkeypatch):
    uri = empty_store(tmp_path / "m.db")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    client = mlflow.MlflowClient(uri)
    exp_id = _log(client, "seeds", [_seed_record(*s) for s in SEEDS])
    return client, exp_id, uri


def test_five_seeds_are_one_configuration_in_llmeff_compare_with_the_olympic_time(seeds_store, tmp_path):
    from click.testing import CliRunner

    from mlflow_llmeff.cli import main

    client, exp_id, uri = seeds_store
    out = tmp_path / "cmp"
    res = CliRunner().invoke(main, ["compare", "--experiment", "seeds", "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert "tiny-seed0 (+4 seeds)" in res.output  # one configuration of five runs
    line = next(s for s in res.output.splitlines() if s.startswith("tiny-seed0 (+4 seeds): to val_loss_le_3.0:"))
    # the scoring beside the time it explains, one level of brackets (a trial found it after energy and cost,
    # in brackets within brackets); three kept runs of different times: a range, and the words say what it is
    assert line == ("tiny-seed0 (+4 seeds): to val_loss_le_3.0: 4 of 5 runs reached it; time from training start "
                    "422 s [398, 455] (mean of the middle 3 of 5 runs; dropped: 380 s fastest, the one not reached as "
                    "the slowest; [lowest, highest] of those); energy 0.0422 kWh [0.0398, 0.0455]; cost 1.06 USD "
                    "[1, 1.14]; tiny-seed2 did not reach it (1,040 s, 300 steps)")
    md = (out / "report.md").read_text()
    assert md.count("| tiny-seed0 (+4 seeds) |") == 2  # the headline's one row and the time-to-target row
    assert "## Time to target (MLPerf scoring)" in md and "| 422 s [398, 455] |" in md
    # the header says what the cell holds, and the rule below says from when the time runs
    assert "| time to target from training start [range of the runs kept] |" in md
    assert "The time runs from training start, the run's set-up excluded, as MLPerf's run_start does." in md
    assert "| 0/1 targets, val_loss_le_3.0 by 4 of 5 runs |" in md  # the headline's quality reached
    assert "MLPerf Training Rules, Dec 9, 2025 (v6.0), 'Benchmark Results'" in md
    assert (out / "ttq.png").exists()


def test_the_ttq_figure_draws_the_olympic_mean_not_the_mean_of_the_runs_that_converged(seeds_store):
    from mlflow_llmeff.report.plots import fig_ttq
    from mlflow_llmeff.report.render import build_report
    from mlflow_llmeff.report.source import select_runs

    client, exp_id, _ = seeds_store
    rep = build_report(client, select_runs(client, "seeds"), plots=False)
    fig = fig_ttq(rep, None)
    [bar] = fig.axes[0].patches
    assert bar.get_width() == 421.75  # not 411.4375, the mean of the four that reached it
    import matplotlib.pyplot as plt

    plt.close(fig)


def test_the_efficiency_page_shows_one_configuration_and_its_olympic_time(seeds_store, monkeypatch):
    from flask import Flask

    from mlflow_llmeff.report import server as srv

    client, exp_id, _ = seeds_store
    monkeypatch.setattr(srv, "_store", lambda: client)
    app = Flask("t")
    srv.register(app)
    page = app.test_client().get(f"/llmeff/experiments/{exp_id}").get_data(as_text=True)
    headline = page.split("<table id='headline'", 1)[1].split("</table>", 1)[0]
    assert headline.count("</tr>") == 2  # the header and ONE configuration
    ttq = page.split("<table id='ttq'>", 1)[1].split("</table>", 1)[0]
    assert "<td class=''>422 s [398, 455]</td>" in ttq and "<td class=''>4 of 5</td>" in ttq


# --------------------------------------------------------------------------- one MFU denominator
def test_an_fp8_and_a_bf16_run_share_the_bf16_denominator_named_in_the_header(tmp_path):
    from mlflow_llmeff.report.headline import MFU_COLUMN, MFU_NOTE, headline
    from mlflow_llmeff.report.render import to_html

    base = {**COMMON, names.ACCEL_COUNT: "1", names.PAR_STRATEGY: "single", names.MODEL_NAME: "llama-8b",
            names.ACCEL_SHORT: "H100-SXM", names.PEAK_SOURCE: "datasheet"}
    # 700 achieved TFLOP/s per device in FP8: 700 / 1978.9 against its own peak, 700 / 989.4 against BF16's;
    # 500 in BF16: 500 / 989.4 either way
    fp8 = RunRecord("a", "fp8", metrics={names.SUM_DEVICE_TOKENS_PER_SEC: 9000.0, names.SUM_MFU: 700 / 1978.9,
                                         names.SUM_MFU_BF16_PEAK: 700 / 989.4},
                    tags={**base, names.PRECISION: "fp8", names.PEAK_PRECISION: "fp8"})
    bf16 = RunRecord("b", "bf16", metrics={names.SUM_DEVICE_TOKENS_PER_SEC: 6500.0, names.SUM_MFU: 500 / 989.4,
                                           names.SUM_MFU_BF16_PEAK: 500 / 989.4},
                     tags={**base, names.PRECISION: "bf16", names.PEAK_PRECISION: "bf16"})
    h = headline(configurations([fp8, bf16]))
    col = h.columns.index(MFU_COLUMN)
    assert MFU_COLUMN == "MFU (BF16 peak)"
    # 70.7% (not the 35.4% of its own FP8 peak) beside 50.5%: one denominator
    assert [row[col].text for row in h.rows] == ["70.7% (1 run)", "50.5% (1 run)"]
    assert MFU_NOTE in h.footnotes
    assert MFU_NOTE.startswith("MFU (BF16 peak): achieved model TFLOP/s per device / the device's dense BF16 "
                               "datasheet peak (summary/mfu_bf16_peak), for every precision")
    # CPU runs, MFU only against the measured matmul peak: the header does not claim a BF16 peak
    cpu = [RunRecord(r.run_id, r.name, metrics={names.SUM_DEVICE_TOKENS_PER_SEC: 100.0,
                                                names.SUM_MFU_MEASURED_PEAK: 0.28}, tags={**r.tags, names.ACCEL_SHORT: "cpu"})
           for r in (fp8, bf16)]
    h = headline(configurations(cpu))
    assert h.columns[5] == "MFU" and MFU_COLUMN not in h.columns
    assert [(row[5].text[:5], row[5].text[-2:]) for row in h.rows] == [("28.0%", " *")] * 2  # marked: measured peak


def test_the_pages_mfu_header_names_the_bf16_denominator(seeds_store, monkeypatch):
    from flask import Flask

    from mlflow_llmeff.report import server as srv

    client, exp_id, _ = seeds_store
    monkeypatch.setattr(srv, "_store", lambda: client)
    app = Flask("t")
    srv.register(app)
    page = app.test_client().get(f"/llmeff/experiments/{exp_id}").get_data(as_text=True)
    # no run has an MFU against a BF16 peak: the header claims none
    assert "<th class=''>MFU</th>" in page and "MFU (BF16 peak)" not in page
    run = client.search_runs([exp_id], max_results=1)[0]
    client.log_metric(run.info.run_id, names.SUM_MFU_BF16_PEAK, 0.35)
    page = app.test_client().get(f"/llmeff/experiments/{exp_id}").get_data(as_text=True)
    assert "<th class=''>MFU (BF16 peak)</th>" in page
