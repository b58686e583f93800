"""Repeats as samples of a configuration: intervals across repeats, within-noise comparisons, the
baseline choice and scaling efficiency with its interval (hand-computed)."""

from __future__ import annotations

import dataclasses
import math

import pytest

from mlflow_llmeff import names
from mlflow_llmeff.report.calc import RunRecord
from mlflow_llmeff.report.repeats import (Estimate, configurations, noisy_pareto_front, standing_order,
                                          t_quantile_975, versus_best, within_noise)
from mlflow_llmeff.report.scaling import scaling_efficiency

BASE = {names.ACCEL_SHORT: "cpu", names.ACCEL_NAME: "Test CPU", names.PRECISION: "fp32",
        names.MODEL_NAME: "llama-tiny", names.SEQ_LEN: "128", names.MICRO_BATCH_SIZE: "8", names.GRAD_ACCUM: "1",
        names.ACT_CKPT: "false", names.COMPILE: "false", names.DATASET: "python-docs",
        names.FLOPS_FORMULA: "megatron", names.V_LLMEFF: "0.1.0"}
STALLED = "unstable: 2 stalls = 3.4 s of 4.38 s step time (steps > 5x the median 0.01 s)"


def run(run_id, devices, tps, low=None, high=None, *, stability="stable", **tags):
    t = {**BASE, names.ACCEL_COUNT: str(devices), names.PAR_STRATEGY: "single" if devices == 1 else "ddp",
         names.GLOBAL_BATCH_TOKENS: str(1024 * devices), names.STABILITY: stability, **tags}
    m = {names.SUM_TOKENS_PER_SEC: tps, names.SUM_DEVICE_TOKENS_PER_SEC: tps / devices}
    if low is not None:
        m[names.SUM_TPS_CI95_LOW], m[names.SUM_TPS_CI95_HIGH] = low, high
    return RunRecord(run_id, f"run-{run_id}", metrics=m, tags=t)


def test_t_quantiles_from_the_table():
    assert t_quantile_975(1) == 12.706 and t_quantile_975(2) == 4.303 and t_quantile_975(30) == 2.042
    assert t_quantile_975(31) == 1.96
    with pytest.raises(ValueError, match="df=0"):
        t_quantile_975(0)


def test_repeats_give_a_mean_and_a_t_interval_across_them():
    c, = configurations([run("a", 1, 100.0, 99, 101), run("b", 1, 110.0, 109, 111), run("c", 1, 120.0, 119, 121)])
    e = c.estimate(names.SUM_TOKENS_PER_SEC)
    # mean 110, sample sd 10, half width t(0.975, 2) x 10 / sqrt(3) = 4.303 x 5.7735 = 24.843
    assert (e.mean, e.n, e.method) == (110.0, 3, "repeats")
    assert e.low == pytest.approx(110 - 4.303 * 10 / math.sqrt(3)) and e.high == pytest.approx(110 + 24.8434, abs=1e-3)


def test_runs_of_different_lengths_are_two_configurations_and_equal_lengths_are_repeats():
    # a trial: a 50-step and a 300-step run of one setting were one row, its val loss 3.06 the mean of 2.378
    # and 3.750 (neither run's), beside the warning that their lengths differ
    def sized(run_id, steps):
        r = run(run_id, 1, 1000.0)
        r.metrics[names.SUM_STEPS] = float(steps)
        return r

    cs = configurations([sized("a", 50), sized("b", 300), sized("c", 50)])
    assert [[r.run_id for r in c.runs] for c in cs] == [["a", "c"], ["b"]]


def _started(r: RunRecord, ms: int | None, seed: str | None = None) -> RunRecord:
    import dataclasses

    return dataclasses.replace(r, start_time_ms=ms, params={} if seed is None else {"seed": seed})


def test_a_configuration_is_named_after_its_oldest_stable_run_and_counts_seeds_as_seeds():
    # newest first, as the store gives them; the oldest (c) is unstable, so the oldest stable one (b) names it
    runs = [_started(run("a", 1, 100.0), 3_000, "2"), _started(run("b", 1, 110.0), 2_000, "1"),
            _started(run("c", 1, 120.0, stability=STALLED), 1_000, "0")]
    c, = configurations(runs)
    assert c.first.run_id == "b" and c.label == "run-b (+2 seeds)"
    c, = configurations(list(reversed(runs)))  # the order read in does not change the name
    assert c.label == "run-b (+2 seeds)"
    # the interval's words and the note call them seeds too (mean 110, sd 10: +- 4.303 x 10 / sqrt(3))
    e = c.estimate(names.SUM_TOKENS_PER_SEC)
    assert e.text() == "110 [85.16, 135] (3 seeds, t)"  # 110 - 24.84 = 85.16
    assert e.how() == "mean of 3 seeds, 95% Student-t interval across them (df 2)"
    assert c.note().startswith("1 unstable seed kept in the figures: run-c 120 tokens/s per device (unstable: ")
    # one seed twice, or a run without a seed param: repeats, not seeds
    runs[0].params["seed"] = "1"
    assert configurations(runs)[0].label == "run-b (+2 repeats)"
    assert configurations(runs)[0].estimate(names.SUM_TOKENS_PER_SEC).text().endswith(" (3 repeats, t)")
    runs[0].params.pop("seed")
    assert configurations(runs)[0].label == "run-b (+2 repeats)"
    # no start times known: the first stable run given
    two = [run("x", 1, 100.0), run("y", 1, 100.0)]
    assert configurations(two)[0].label == "run-x (+1 repeat)"
    assert configurations(list(reversed(two)))[0].label == "run-y (+1 repeat)"


def test_two_repeats_give_a_student_t_interval_with_one_degree_of_freedom():
    c, = configurations([run("a", 2, 1000.0, 990.0, 1010.0), run("b", 2, 1200.0, 1190.0, 1210.0)])
    e = c.estimate(names.SUM_DEVICE_TOKENS_PER_SEC)
    # per device 500 and 600: mean 550, s = 100 / sqrt(2) = 70.711, half = 12.706 x 70.711 / sqrt(2) = 635.3;
    # the runs' own narrow intervals play no part; the low end is clipped at 0
    assert (e.mean, e.n, e.method) == (550.0, 2, "repeats")
    assert e.high == pytest.approx(550 + 635.3) and e.low == 0.0
    assert e.how() == "mean of 2 repeats, 95% Student-t interval across them (df 1)"


def test_a_single_run_carries_the_between_run_floor_not_its_own_interval():
    c, = configurations([run("a", 2, 1000.0, 900.0, 1100.0)])
    e = c.estimate(names.SUM_DEVICE_TOKENS_PER_SEC)
    # per device 500 +- 81% (the cpu floor), not the run's own [450, 550]
    assert (e.mean, e.method, e.floor.half_width) == (500.0, "floor", 0.81)
    assert (e.low, e.high) == (pytest.approx(95.0), pytest.approx(905.0))
    assert e.text() == "500 [95, 905] (1 run, between-run floor of cpu)"
    # a per-token cost moves against throughput: 50 / (1 + 0.81) .. 50 / (1 - 0.81)
    c.runs[0].metrics[names.SUM_USD_PER_BTOK] = 50.0
    usd = c.estimate(names.SUM_USD_PER_BTOK)
    assert (usd.low, usd.high) == (pytest.approx(27.624, abs=1e-3), pytest.approx(263.158, abs=1e-3))
    # its bounds are printed: -45% / +426% is not "+-81%" (a trial read 0.084 +-81% as [0.016, 0.152])
    assert usd.text() == "50 [27.62, 263] (1 run, between-run floor of cpu)"
    assert usd.how().startswith("one run: its throughput +-81%, the between-run floor of cpu (")
    assert usd.how().endswith("), so this figure / (1 -+ 0.81); not its own interval")
    assert e.how().endswith("), so this figure x (1 +- 0.81); not its own interval")
    # the direction is recorded, not read off the bounds: a trial's 2,014 [383, 3,646] (symmetric up to
    # rounding) was called '/ (1 -+ 0.81)' when its high side came out a hair wider
    c2, = configurations([run("b", 1, 2014.0)])
    e2 = c2.estimate(names.SUM_TOKENS_PER_SEC)
    assert not e2.inverse and e2.how().endswith("x (1 +- 0.81); not its own interval")
    assert c.estimate(names.SUM_STEP_TIME_P50_S) is None


def test_a_single_run_of_a_machine_without_a_measured_floor_has_no_interval_and_is_not_ranked():
    gpu = {names.ACCEL_SHORT: "H100-SXM"}
    cs = configurations([run("a", 1, 100.0, 99.0, 101.0, **gpu),
                         run("b", 1, 300.0, 299.0, 301.0, **gpu, **{names.PRECISION: "bf16"})])
    e = cs[0].estimate(names.SUM_TOKENS_PER_SEC)
    assert (e.method, e.has_interval) == ("no interval", False)
    assert "no between-run floor measured for H100-SXM" in e.how()
    # 3x apart, each run's own interval +-1%: still no ranking, the next run could differ as much
    assert versus_best(cs, names.SUM_TOKENS_PER_SEC) == {0: "not ranked (no interval)",
                                                         1: "best (1 not ranked: no interval)"}


def _documented_repeats() -> tuple[list[list[float]], list[list[float]], list[int]]:
    """docs/stability.md, "Between-run floor": the tokens/s of the repeats the cpu floor pools (first table),
    the shorter runs' sets (second table) and their steady steps, read from the page as a reader sees them."""
    import pathlib
    import re

    text = pathlib.Path(__file__).parents[1].joinpath("docs", "stability.md").read_text()
    section = text[text.index("## Between-run floor"):]
    tables, rows = [], None
    for line in section.splitlines():
        if line.startswith("| repeats of one configuration"):
            rows = []
            tables.append(rows)
        elif rows is not None and line.startswith("| ") and not line.startswith("| ---"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            rows.append(([float(v.replace(",", "")) for v in cells[1].split(", ")], cells[0], float(cells[2])))
        elif rows is not None and not line.startswith("|"):
            rows = None
    pooled, short = tables[0], tables[1]
    for values, _, cv in pooled + short:  # each row's CV as printed is its sample CV
        m = sum(values) / len(values)
        assert math.sqrt(sum((v - m) ** 2 for v in values) / (len(values) - 1)) / m == pytest.approx(cv, abs=5e-4)
    steady = [int(re.search(r"\((\d+) steady", label).group(1)) for _, label, _ in short]
    return [v for v, _, _ in pooled], [v for v, _, _ in short], steady


def _pooled_half_width(groups: list[list[float]]) -> tuple[float, int]:
    """``t(0.975, df) x s`` over ``groups`` (the page's formula: s^2 = sum of squared relative deviations / df),
    with t from the product's table, and df."""
    ss = sum(sum((v / (sum(g) / len(g)) - 1) ** 2 for v in g) for g in groups)
    df = sum(len(g) - 1 for g in groups)
    return t_quantile_975(df) * math.sqrt(ss / df), df


def test_the_cpu_floor_is_what_the_repeats_on_the_page_give():
    from mlflow_llmeff.report.repeats import BETWEEN_RUN_FLOOR

    pooled, _, _ = _documented_repeats()
    f, df = _pooled_half_width(pooled)
    # df 4 + 4 + 1 = 9, s = 0.3565, t(0.975, 9) = 2.262: f = 0.806, rounded up to two places
    assert df == 9 and f == pytest.approx(0.806, abs=1e-3)
    assert BETWEEN_RUN_FLOOR["cpu"].half_width == math.ceil(f * 100) / 100
    assert "docs/stability.md" in BETWEEN_RUN_FLOOR["cpu"].source


def test_the_trial_configuration_with_an_unstable_repeat_covers_it():
    # the trial: repeats of one configuration measured 6,761 (stable, own interval [6,470, 7,051]) and
    # 5,993 (unstable, +-11%); the table showed [6,470, 7,051] alone
    unstable = "unstable: 95% interval +-11% of the mean (> 10%)"
    c, = configurations([run("s", 1, 6761.0, 6470.0, 7051.0), run("u", 1, 5993.0, 5330.0, 6660.0, stability=unstable)])
    e = c.estimate(names.SUM_TOKENS_PER_SEC)
    # mean 6,377; s = 768 / sqrt(2) = 543.06; half = 12.706 x 543.06 / sqrt(2) = 4,879.1
    assert (e.mean, e.n, e.method) == (6377.0, 2, "repeats")
    assert e.low == pytest.approx(1497.9, abs=0.1) and e.high == pytest.approx(11256.1, abs=0.1)
    assert e.low <= 5993.0 <= e.high
    assert c.note() == f"1 unstable repeat kept in the figures: run-u 5,993 tokens/s per device ({unstable})"


def test_a_repeat_without_the_figure_is_named_as_left_out():
    a, b = run("a", 1, 100.0), run("b", 1, 110.0)
    a.metrics[names.SUM_MFU] = 0.3
    c, = configurations([a, b])
    e = c.estimate(names.SUM_MFU)
    assert (e.n, e.method, e.left_out) == (1, "floor", (f"run-b: no finite {names.SUM_MFU}",))
    assert e.how().endswith(f"; left out: run-b: no finite {names.SUM_MFU}")


def test_both_repeats_unstable_are_both_in_the_figure():
    both, = configurations([run("x", 1, 10.0, stability=STALLED), run("y", 1, 12.0, stability=STALLED)])
    assert len(both.used) == 2 and both.estimate(names.SUM_TOKENS_PER_SEC).mean == 11.0
    assert both.note().startswith("no stable repeat, all 2 in the figures: run-x 10 tokens/s per device")


def test_conditions_that_differ_make_different_configurations():
    cs = configurations([run("a", 1, 10.0), run("b", 1, 10.0, **{names.PRECISION: "bf16"}),
                         run("c", 1, 11.0, **{names.GIT_COMMIT: "abc"})])  # a commit alone is not a condition
    assert [[r.run_id for r in c.runs] for c in cs] == [["a", "c"], ["b"]]


DYNAMIC = {names.SEQ_LEN: "dynamic", names.GLOBAL_BATCH_TOKENS: "dynamic"}  # dynamic padding (docs/autolog.md)


def test_dynamic_padding_runs_are_one_configuration_apart_from_fixed_length_runs():
    cs = configurations([run("d1", 1, 10.0, **DYNAMIC, **{names.SEQ_LEN_RANGE: "23-25"}),
                         run("fixed", 1, 10.0),
                         run("d2", 1, 11.0, **DYNAMIC, **{names.SEQ_LEN_RANGE: "23-32"})])  # the range is measured
    assert [[r.run_id for r in c.runs] for c in cs] == [["d1", "d2"], ["fixed"]]


def test_two_dynamic_batches_are_not_taken_for_one_batch_in_scaling():
    row, = scaling_efficiency([run("one", 1, 1000.0, **DYNAMIC), run("two", 2, 1800.0, **DYNAMIC)])
    assert row.kind == "batch varies" and row.efficiency == pytest.approx(0.9)  # 1800 / (1000 x 2)
    row, = scaling_efficiency([run("one", 1, 1000.0, **DYNAMIC), run("two", 2, 2400.0, **DYNAMIC)])
    assert any(f.startswith("the batch shape varied within runs") for f in row.flags)  # 1.2: flagged


def test_overlapping_intervals_are_within_noise_and_not_ranked():
    a, b, c = (Estimate(100, 90, 110, 2, "repeats"), Estimate(105, 95, 115, 2, "repeats"),
               Estimate(200, 190, 210, 2, "repeats"))
    assert within_noise(a, b) and not within_noise(a, c)
    assert within_noise(a, Estimate(100, None, None, 1, "no interval"))  # no interval: cannot be ranked
    # two repeats each; per device: a 100 and 102 (mean 101, half 12.706 x 1.414 / 1.414 = 12.706),
    # b 105 and 107 (mean 106), c 200 and 202 (mean 201): c best; a and b apart from it, within noise of each other
    cs = configurations([run("a1", 1, 100.0), run("a2", 1, 102.0), run("b1", 2, 210.0), run("b2", 2, 214.0),
                         run("c1", 4, 800.0), run("c2", 4, 808.0)])
    assert versus_best(cs, names.SUM_DEVICE_TOKENS_PER_SEC) == {0: "0.502x best", 1: "0.527x best", 2: "best"}
    assert within_noise(cs[0].estimate(names.SUM_DEVICE_TOKENS_PER_SEC), cs[1].estimate(names.SUM_DEVICE_TOKENS_PER_SEC))


def test_two_single_runs_closer_than_the_floor_are_not_ranked():
    # cpu floor +-81%: per device 100 [19, 181] and 900 [171, 1629] overlap (9x apart is still
    # within the between-run noise of this machine); the runs' own +-1% intervals are not used
    cs = configurations([run("a", 1, 100.0, 99.0, 101.0), run("b", 1, 900.0, 891.0, 909.0, **{names.PRECISION: "bf16"})])
    assert versus_best(cs, names.SUM_DEVICE_TOKENS_PER_SEC) == {0: "within noise of best", 1: "best (1 within noise)"}
    pts = [(Estimate(1.0, 1.0, 1.0, 1, "measured peak"), c.estimate(names.SUM_DEVICE_TOKENS_PER_SEC)) for c in cs]
    assert noisy_pareto_front(pts, maximize_x=False, maximize_y=True) == [0, 1]  # neither drawn as beaten


def test_two_single_runs_further_apart_than_the_floor_are_ranked():
    # 100 [19, 181] and 1000 [190, 1810]: apart beyond the floor (190 > 181)
    cs = configurations([run("a", 1, 100.0), run("b", 1, 1000.0, **{names.PRECISION: "bf16"})])
    assert versus_best(cs, names.SUM_DEVICE_TOKENS_PER_SEC) == {0: "0.1x best", 1: "best"}
    pts = [(Estimate(1.0, 1.0, 1.0, 1, "measured peak"), c.estimate(names.SUM_DEVICE_TOKENS_PER_SEC)) for c in cs]
    assert noisy_pareto_front(pts, maximize_x=False, maximize_y=True) == [1]


def test_the_only_configuration_with_a_figure_is_not_called_best():
    # one configuration (a trial's compare of one experiment labelled it "best", against nothing; the next
    # read "only one with this figure", odd where there is no other at all)
    assert versus_best(configurations([run("a", 1, 100.0)]), names.SUM_DEVICE_TOKENS_PER_SEC) == {0: "no other configuration"}
    # two configurations, one without the figure: still nothing to be best against
    cs = configurations([run("a", 1, 100.0), run("b", 2, 300.0)])
    del cs[1].runs[0].metrics[names.SUM_DEVICE_TOKENS_PER_SEC]
    assert versus_best(cs, names.SUM_DEVICE_TOKENS_PER_SEC) == {0: "only one with this figure"}


@pytest.mark.parametrize("label, order", [
    ("best", 0), ("best (2 within noise, 1 not ranked: no interval)", 0), ("only one with this figure", 0), ("no other configuration", 0),
    ("within noise of best", 1), ("not ranked (no interval)", 1), ("not ranked (best has no interval)", 1),
    ("0.62x best", 2), ("", 2)])
def test_one_predicate_sorts_every_standing_label_for_the_table_and_the_hatching(label, order):
    # the headline table sorts by it and the throughput bars hatch order 1: both read it here, not by
    # matching words of their own
    assert standing_order(label) == order


def test_two_repeats_one_stalled_and_a_two_process_configuration():
    # the trial: equal settings gave 1,494 (stalled) and 19,272 tokens/s: both are samples of the
    # configuration, and its interval says how little two such repeats pin it down
    runs = [run("stalled", 1, 1494.0, 700.0, 19000.0, stability=STALLED),
            run("ok", 1, 19272.0, 19000.0, 19544.0),
            run("ddp", 2, 34000.0, 33000.0, 35000.0)]
    row, = scaling_efficiency(runs)
    assert set(row.baseline_run_ids) == {"ok", "stalled"} and row.run_ids == ("ddp",)
    assert row.kind == "weak"
    # baseline mean 10,383, s = 17,778 / sqrt(2) = 12,570.9, half = 12.706 x 12,570.9 / sqrt(2) = 112,947:
    # [0 (clipped), 123,330]; ddp one run +- 81%: [6,460, 61,540]
    assert row.baseline_tokens_per_sec.mean == 10383.0
    assert row.baseline_tokens_per_sec.high == pytest.approx(10383 + 12.706 * 17778 / 2, rel=1e-6)
    assert row.efficiency == pytest.approx(34000 / (10383 * 2))  # 1.637
    # interval arithmetic: low = 6,460 / 123,330 / 2; no upper end from a baseline interval reaching 0
    assert row.low == pytest.approx(34000 * 0.19 / (10383 + 12.706 * 17778 / 2) / 2)
    assert row.high is None
    assert any("within noise of linear scaling" in f for f in row.flags)


def test_an_efficiency_above_1_05_is_flagged_with_what_could_explain_it():
    runs = [run("a", 1, 1000.0, 600.0, 1500.0, stability=STALLED), run("b", 2, 2340.0, 2200.0, 2400.0)]
    row, = scaling_efficiency(runs)
    assert row.efficiency == pytest.approx(1.17)
    assert any("within noise of linear scaling" in f for f in row.flags)
    assert any(f.startswith("baseline run-a has no stable repeat") for f in row.flags)


def test_a_stable_baseline_is_preferred_among_equal_device_counts_and_can_be_named():
    runs = [run("u", 1, 500.0, 100.0, 900.0, stability=STALLED, **{names.PRECISION: "fp32", names.V_TORCH: "2.12"}),
            run("s", 1, 1000.0, 990.0, 1010.0, **{names.V_TORCH: "2.13"}),
            run("d", 2, 1800.0, 1790.0, 1810.0, **{names.V_TORCH: "2.13"})]
    # two 1-device configurations (torch versions differ): the stable one is the baseline; equal counts: no row
    assert [(r.run_id, r.baseline_id) for r in scaling_efficiency(runs)] == [("d", "s")]
    assert [(r.run_id, r.baseline_id) for r in scaling_efficiency(runs, baseline="u")] == [("d", "u")]


def test_a_point_beaten_only_within_noise_stays_on_the_front():
    e = lambda m, h: Estimate(m, m - h, m + h, 2, "repeats")  # noqa: E731
    # (cost: less is better, tokens/s: more is better)
    pts = [(e(10, 0.5), e(100, 5)), (e(10.2, 0.5), e(98, 5)), (e(20, 1), e(50, 2))]
    # 1 is worse than 0 on both means but within noise on both: kept; 2 is beaten beyond noise
    assert noisy_pareto_front(pts, maximize_x=False, maximize_y=True) == [0, 1]


def _layout(strategy, dp, shard, tp):
    return {names.PAR_STRATEGY: strategy, names.PAR_DP: str(dp), names.PAR_DP_SHARD: str(shard),
            names.PAR_DP_REPLICATE: str(dp // shard), names.PAR_TP: str(tp), names.PAR_PP: "1", names.PAR_CP: "1"}


def test_the_layout_column_gives_the_strategy_and_its_degrees_above_one():
    from mlflow_llmeff.report.headline import headline, layout_cell

    cs = configurations([run("d", 2, 100.0, **_layout("ddp", 2, 1, 1)), run("f", 2, 90.0, **_layout("fsdp", 2, 2, 1)),
                         run("h", 4, 150.0, **_layout("hsdp", 4, 2, 1)), run("t", 4, 120.0, **_layout("fsdp_tp", 2, 2, 2)),
                         run("s", 1, 60.0, **_layout("single", 1, 1, 1))])
    assert [layout_cell(c).text for c in cs] == ["ddp dp2", "fsdp dp2 shard2", "hsdp dp4 shard2", "fsdp_tp dp2 shard2 tp2",
                                                  "single"]
    assert layout_cell(cs[3]).title == "dp 2, dp_shard 2, tp 2, pp 1, cp 1"
    h = headline(cs)
    assert h.columns[:3] == ["configuration", "devices", "layout"]
    assert [row[2].text for row in h.rows][:2] == ["ddp dp2", "fsdp dp2 shard2"]
    # a shard degree alone makes another configuration: ddp and fsdp over 2 ranks are not repeats
    assert len(configurations([run("a", 2, 1.0, **_layout("fsdp", 2, 2, 1)),
                               run("b", 2, 1.0, **{**_layout("fsdp", 2, 2, 1), names.PAR_DP_SHARD: "1"})])) == 2


def test_the_memory_pareto_keeps_what_sharding_buys_and_drops_what_is_beaten_on_both():
    from mlflow_llmeff.report import plots

    def with_mem(r, gib):
        r.metrics[names.MEM_MAX_ALLOC] = gib
        return r

    # two repeats each. ddp: fastest, most memory; fsdp: 8% slower (beyond noise), half the memory: both
    # on the front; zero3: slower than fsdp beyond noise and no less memory: beaten
    def two(name, tps, layout, gib):
        return [with_mem(run(f"{name}{i}", 2, tps + d, **layout), gib) for i, d in ((1, -2.0), (2, 2.0))]

    cs = configurations(two("d", 1000.0, _layout("ddp", 2, 1, 1), 2.0) + two("f", 920.0, _layout("fsdp", 2, 2, 1), 1.0)
                        + two("z", 700.0, _layout("deepspeed_zero3", 2, 2, 1), 1.0))
    mems = [plots._memory(c) for c in cs]
    # equal peaks over two repeats: a t interval of zero width
    assert [(m.mean, m.low, m.high, m.method) for m in mems] == [(2.0, 2.0, 2.0, "repeats"), (1.0, 1.0, 1.0, "repeats"),
                                                               (1.0, 1.0, 1.0, "repeats")]
    tps = [c.estimate(names.SUM_DEVICE_TOKENS_PER_SEC) for c in cs]
    assert noisy_pareto_front(list(zip(mems, tps)), maximize_x=False, maximize_y=True) == [1, 0]
    # one run of each: zero3 is within the between-run floor (+-81%) of fsdp, so it is not drawn as beaten
    singles = configurations([with_mem(run("d", 2, 1000.0, **_layout("ddp", 2, 1, 1)), 2.0),
                              with_mem(run("f", 2, 920.0, **_layout("fsdp", 2, 2, 1)), 1.0),
                              with_mem(run("z", 2, 700.0, **_layout("deepspeed_zero3", 2, 2, 1)), 1.0)])
    assert [(m.mean, m.low, m.high, m.method) for m in map(plots._memory, singles)] == [
        (2.0, 2.0, 2.0, "measured peak"), (1.0, 1.0, 1.0, "measured peak"), (1.0, 1.0, 1.0, "measured peak")]
    assert noisy_pareto_front(list(zip(map(plots._memory, singles),
                                       [c.estimate(names.SUM_DEVICE_TOKENS_PER_SEC) for c in singles])),
                              maximize_x=False, maximize_y=True) == [1, 2, 0]

    class Rep:
        configs = cs
    # on CPU one run's peak is process RSS, within +-5%: a 4 MiB difference of 640 MiB workers is noise
    rss = configurations([with_mem(run("d", 2, 1000.0, 980.0, 1020.0, **_layout("ddp", 2, 1, 1),
                                       **{names.MEMORY_SOURCE: "cpu: peak process RSS"}), 0.6376),
                          with_mem(run("f", 2, 1000.0, 980.0, 1020.0, **_layout("fsdp", 2, 2, 1),
                                       **{names.MEMORY_SOURCE: "cpu: peak process RSS"}), 0.6417)])
    m = [plots._memory(c) for c in rss]
    assert (m[0].low, m[0].high, m[0].method) == (pytest.approx(0.6376 * 0.95), pytest.approx(0.6376 * 1.05),
                                                  "process RSS +-5%")
    assert noisy_pareto_front(list(zip(m, [c.estimate(names.SUM_DEVICE_TOKENS_PER_SEC) for c in rss])),
                              maximize_x=False, maximize_y=True) == [0, 1]
    fig = plots.fig_pareto_memory(Rep(), None)
    assert fig.axes[0].get_xlabel() == "peak memory per device, GiB"
    assert sorted(t.get_text() for t in fig.axes[0].texts) == ["run-d1 (+1 repeat)", "run-f1 (+1 repeat)",
                                                                "run-z1 (+1 repeat)"]


def test_the_headline_states_its_method_once_and_names_the_unstable_repeat_with_its_value():
    from mlflow_llmeff.report.headline import headline
    from mlflow_llmeff.report.repeats import METHOD_NOTE

    unstable = "unstable: 95% interval +-11% of the mean (> 10%)"
    cs = configurations([run("s", 1, 6761.0, 6470.0, 7051.0), run("u", 1, 5993.0, 5330.0, 6660.0, stability=unstable),
                         run("one", 1, 1000.0, 990.0, 1010.0, **{names.PRECISION: "bf16"})])
    h = headline(cs)
    tps = h.columns.index("tokens/s per device [95%]")
    # the t interval over both repeats (hand-computed above), and the single run +- the cpu floor
    assert [row[tps].text for row in h.rows] == ["6,377 [1,498, 11,256]", "1,000 [190, 1,810] floor"]
    assert h.rows[0][tps].title == "mean of 2 repeats, 95% Student-t interval across them (df 1)"
    assert "own interval" not in h.rows[1][tps].title.replace("not its own interval", "")
    assert h.footnotes[0] == METHOD_NOTE
    assert f"run-s (+1 repeat): 1 unstable repeat kept in the figures: run-u 5,993 tokens/s per device ({unstable})" in h.footnotes
    stability = h.columns.index("stability")
    assert h.rows[0][stability].text == "1 of 2 unstable (kept)"


def test_an_empty_mfu_and_an_empty_quality_say_why_as_the_run_does():
    from mlflow_llmeff.report.headline import headline

    # a trial: a run that never left warm-up was footnoted 'neither a datasheet peak nor a measured
    # peak' although it had a measured peak; its MFU is empty because it has no steady tokens/s
    warm = run("w", 1, 0.0)
    del warm.metrics[names.SUM_TOKENS_PER_SEC], warm.metrics[names.SUM_DEVICE_TOKENS_PER_SEC]
    why = "no steady-state step time (all 3 steps were warm-up, or took no time)"
    warm.tags[names.SUMMARY_ABSENT] = f"{names.SUM_TOKENS_PER_SEC}, {names.SUM_DEVICE_TOKENS_PER_SEC}: {why}"
    warm.metrics[names.SUM_WALL_S] = 0.030  # a config needs a figure to be one: its wall time is measured (goodput is not)
    h = headline(configurations([warm]))
    assert f"an empty tokens/s and MFU (run-w): {why}" in h.footnotes
    assert not any(n.startswith("an empty MFU: neither") for n in h.footnotes)
    assert ("an empty quality reached: no HellaSwag or MMLU score, eval/val_loss or time-to-quality target was "
            "logged (llmeff train: --eval-tasks, --targets; docs/evals.md)") in h.footnotes
    # a run with tokens/s but no peak at all: the peak note, and a quality figure: no quality note
    r = run("p", 1, 100.0)
    r.metrics[names.EVAL_VAL_LOSS] = 2.5
    h = headline(configurations([r]))
    assert "an empty MFU: neither a datasheet peak nor a measured peak (see llmeff.peak.source)" in h.footnotes
    assert not any(n.startswith("an empty quality") for n in h.footnotes)


def test_the_carbon_pareto_draws_no_single_run_as_beaten_within_the_floor():
    from mlflow_llmeff.report import plots

    # the trial: two single DDP-like runs, one 1.6x the other's throughput and lower carbon per token
    # (11,745 and 19,279 tokens/s of identical settings): the floor says neither beats the other
    a, b = run("a", 2, 11745.0, 10756.0, 12933.0), run("b", 2, 19279.0, 18338.0, 20530.0, **{names.PRECISION: "bf16"})
    for r in (a, b):
        r.metrics[names.SUM_ESTIMATE_KG_CO2E_PER_BTOK] = 5e3 / r.metrics[names.SUM_TOKENS_PER_SEC]

    class Rep:
        configs = configurations([a, b])

    fig = plots.fig_pareto_carbon(Rep(), None)
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert labels == ["front (within noise)"]
    assert "between-run floor" in fig.axes[0].get_title()


def test_a_configuration_splits_its_repeats_and_estimates_each_figure_once(monkeypatch):
    from mlflow_llmeff.report import repeats

    calls = []
    real = repeats.is_stable
    monkeypatch.setattr(repeats, "is_stable", lambda r: calls.append(r) or real(r))
    c, = configurations([run(f"r{i}", 1, 1000.0 + i, 900.0, 1100.0) for i in range(10)])
    first = c.estimate(names.SUM_TOKENS_PER_SEC)
    for _ in range(5):  # the headline, scaling and notes ask again and again
        assert c.estimate(names.SUM_TOKENS_PER_SEC) is first and len(c.used) == 10 and c.unstable == []
    assert len(calls) == 10  # one question a repeat (each its own kind: alike None), not one per question asked
    c.runs.append(run("r10", 1, 2000.0, 900.0, 1100.0))  # a repeat added: split and estimate again
    assert len(c.used) == 11 and c.estimate(names.SUM_TOKENS_PER_SEC).n == 11
    calls.clear()  # repeats read alike (RunRecord.alike: tags but the name): one question for all of them
    c, = configurations([dataclasses.replace(run(f"r{i}", 1, 1000.0 + i, 900.0, 1100.0), alike=1) for i in range(10)])
    assert len(c.used) == 10 and c.estimate(names.SUM_TOKENS_PER_SEC).n == 10 and len(calls) == 1


def test_the_cpu_floor_holds_down_to_the_shortest_runs_it_was_measured_on():
    from mlflow_llmeff.report.repeats import BETWEEN_RUN_FLOOR, steady_steps

    # docs/stability.md, "How short a run it holds for": the three pooled sets and two sets of shorter
    # runs (57 and 47 steady steps) pool to 0.69 (df 17, t(0.975, 17) = 2.110): inside 0.81, which
    # therefore holds from the shortest of them, 47 steady steps
    pooled, short, steady = _documented_repeats()
    f, df = _pooled_half_width(pooled + short)
    assert df == 17 and f == pytest.approx(0.6945, abs=1e-3) and f <= BETWEEN_RUN_FLOOR["cpu"].half_width
    assert steady == [57, 47] and BETWEEN_RUN_FLOOR["cpu"].min_steady_steps == min(steady)

    def short(run_id, tps, steps, devices=1):  # a run of `steps` optimizer steps, 3 of them warm-up
        r = run(run_id, devices, tps, **{names.WARMUP_STEPS: "3"})
        r.metrics[names.SUM_STEPS] = float(steps)
        return r

    # the trial: autolog examples of 10 steps (7 steady) were given +-81% and could be ranked
    a, b = short("a", 1000.0, 10), short("b", 9000.0, 10, devices=2)
    assert steady_steps(a) == 7
    cs = configurations([a, b])
    e = cs[0].estimate(names.SUM_TOKENS_PER_SEC)
    assert (e.method, e.has_interval, e.short_of) == ("no interval", False, (7, 47))
    assert e.how() == ("one run of 7 steady steps: the between-run floor of cpu was measured on runs of 47 or "
                       "more, so no interval, not ranked (repeat it, or run longer)")
    assert cs[0].estimate(names.SUM_USD_PER_BTOK) is None  # not logged: no estimate at all
    # 9x apart, and still not ranked: neither has an interval (and neither is called within noise of the other)
    assert versus_best(cs, names.SUM_TOKENS_PER_SEC) == {0: "not ranked (no interval)",
                                                         1: "best (1 not ranked: no interval)"}
    # 50 steps (47 steady, the README's first run) carry the floor: 1,000 x (1 +- 0.81)
    e = configurations([short("c", 1000.0, 50)])[0].estimate(names.SUM_TOKENS_PER_SEC)
    assert (e.method, e.low, e.high) == ("floor", pytest.approx(190.0), pytest.approx(1810.0))
    # the headline table footnotes the short run
    from mlflow_llmeff.report.headline import headline

    h = headline(cs)
    assert ("a single run shorter than the runs its machine's between-run floor was measured on has no interval "
            "and is not ranked (repeat it, or run longer): run-a (7 steady steps, the floor's runs 47 or more), "
            "run-b (7 steady steps, the floor's runs 47 or more)") in h.footnotes


def test_a_configuration_without_an_interval_is_not_ranked_and_not_called_within_noise():
    # the trial: three 5-7-step example runs beside one 47-step run read 'within noise of best',
    # the best 'best (3 within noise)', though the footnote said they had no interval
    def steps(run_id, tps, n, **tags):
        r = run(run_id, 1, tps, **{names.WARMUP_STEPS: "3"}, **tags)
        r.metrics[names.SUM_STEPS] = float(n)
        return r

    cs = configurations([steps("best", 30_000.0, 50), steps("near", 25_000.0, 50, **{names.PRECISION: "bf16"}),
                         steps("short", 2_729.0, 10, **{names.MODEL_NAME: "llama"}),
                         steps("far", 3_000.0, 50, **{names.MODEL_NAME: "llama-1b"})])
    # floors: best 30,000 x (1 +- 0.81) = [5,700, 54,300], near [4,750, 45,250] overlap; far [570, 5,430] does not
    assert versus_best(cs, names.SUM_TOKENS_PER_SEC) == {
        0: "best (1 within noise, 1 not ranked: no interval)", 1: "within noise of best",
        2: "not ranked (no interval)", 3: "0.1x best"}
    # the best by mean without an interval: the others, with theirs, are not ranked against it either
    cs = configurations([steps("short", 90_000.0, 10), steps("long", 30_000.0, 50, **{names.PRECISION: "bf16"})])
    assert versus_best(cs, names.SUM_TOKENS_PER_SEC) == {0: "best (1 not ranked: no interval)",
                                                         1: "not ranked (best has no interval)"}


def test_a_single_unstable_runs_note_gives_its_per_device_figure_once_with_its_reason():
    # the trial: 'llama-ddp2-...: the run is unstable: llama-ddp2-... 22,668 tokens/s (unstable: ...)' under
    # a table of 11,334 tokens/s per device: the name twice, 'unstable' twice, the global figure
    why = "unstable: only 5 steady steps (fewer than 10: no interval); p90/p50 step time 1.61 (> 1.5)"
    c, = configurations([run("ddp", 2, 22_668.0, stability=why)])
    assert c.note() == ("the run is unstable at 11,334 tokens/s per device: only 5 steady steps "
                        "(fewer than 10: no interval); p90/p50 step time 1.61 (> 1.5)")


def test_goodput_across_repeats_has_a_t_interval_clipped_at_1_and_one_run_says_so():
    from mlflow_llmeff.report.headline import headline

    def good(run_id, g):
        r = run(run_id, 1, 100.0)
        r.metrics[names.SUM_GOODPUT] = g
        return r

    col = headline(configurations([good("a", 0.5)])).columns.index("goodput")
    # 0.5, 0.6, 0.7: mean 0.6, sd 0.1, half width t(0.975, 2) x 0.1 / sqrt(3) = 4.303 x 0.057735 = 0.2484
    row, = headline(configurations([good("a", 0.5), good("b", 0.6), good("c", 0.7)])).rows
    assert row[col].text == "0.60 [0.35, 0.85]" and row[col].sort == pytest.approx(0.6)
    # 0.9, 0.95, 1.0: mean 0.95 + 0.1242 passes 1, and a share of time cannot
    row, = headline(configurations([good("a", 0.9), good("b", 0.95), good("c", 1.0)])).rows
    assert row[col].text == "0.95 [0.83, 1.00]"
    row, = headline(configurations([good("a", 0.88)])).rows
    assert row[col].text == "0.88 (1 run)"  # a count of one run's time: no interval, said
    # on the page the interval goes under the value: the wider cell broke the first 1600-px screen (CI)
    from mlflow_llmeff.report.render import build_report, to_html
    from mlflow_llmeff.report.source import Selection

    runs = [good("a", 0.5), good("b", 0.6), good("c", 0.7)]
    page = to_html(build_report(None, Selection("1", "g", "", runs), plots=False))
    assert "<td class='w' data-v='0.6'" in page and ">0.60<br>[0.35, 0.85]</td>" in page


def test_scaling_between_different_threads_per_process_is_refused_in_one_line():
    # a trial: one process with torch's 2 threads against 2 DDP processes of 1 thread each read a scaling
    # efficiency of 7.44 on a 2-core machine; the ratio measured threads, not scaling
    from mlflow_llmeff.report.render import Report, scaling_lines

    one = run("a", 1, 100.0, 99, 101, **{names.THREADS: "intra-op 2, inter-op 2"})
    two = run("b", 2, 190.0, 189, 191, **{names.THREADS: "intra-op 1, inter-op 1"})
    row, = scaling_efficiency([one, two])
    assert row.refused and math.isnan(row.efficiency) and row.low is None
    rep = Report.__new__(Report)
    rep.scaling = [row]
    assert scaling_lines(rep) == [
        f"{row.group}: run-b (2 devices) vs baseline run-a (1): no scaling efficiency: intra-op 1, inter-op 1 "
        "threads a process against intra-op 2, inter-op 2 (llmeff.threads): a process's speed moves with its "
        "threads, so the ratio would not be scaling; run both with the same OMP_NUM_THREADS"]
    same = run("c", 2, 190.0, 189, 191, **{names.THREADS: "intra-op 2, inter-op 2"})
    assert scaling_efficiency([one, same])[0].efficiency == pytest.approx(0.95)


def test_the_scaling_line_prints_tokens_per_second_as_the_tables_do():
    # a trial read '2.009e+04 vs 2.873e+04 tokens/s' beside tables printing 20,090
    from mlflow_llmeff.report.render import Report, scaling_lines

    rep = Report.__new__(Report)
    rep.scaling = scaling_efficiency([run("a", 1, 20090.0), run("b", 1, 20090.0), run("c", 2, 28730.0),
                                      run("d", 2, 28730.0)])
    line, = scaling_lines(rep)
    assert line.endswith("(28,730 vs 20,090 tokens/s)") and "e+04" not in line


def test_an_mfu_column_over_different_peaks_names_each_rows_denominator_and_ranks_none():
    # a trial's compare on CPU: fp32 rows against 0.174 TFLOP/s, bf16 rows against 0.00135, one column,
    # '3.4%' beside '122.7%' under one footnote claiming one denominator
    from mlflow_llmeff.report.headline import MFU_NOTE, headline
    from mlflow_llmeff.report.memory import memory_table
    fp32 = run("a", 1, 100.0, **{names.PEAK_MEASURED_TFLOPS: "0.174"})
    bf16 = run("b", 1, 50.0)
    bf16.tags[names.PRECISION], bf16.tags[names.PEAK_MEASURED_TFLOPS] = "bf16", "0.00135"
    fp32.metrics.update({names.SUM_MFU_MEASURED_PEAK: 0.034, names.SUM_MEM_PEAK_GIB: 1.0})
    bf16.metrics.update({names.SUM_MFU_MEASURED_PEAK: 1.227, names.SUM_MEM_PEAK_GIB: 1.0})
    cs = configurations([fp32, bf16])
    h = headline(cs)
    mixed = [n for n in h.footnotes if n.startswith("MFU: the rows do not share one denominator")]
    assert mixed == ["MFU: the rows do not share one denominator, so the column is not a ranking (its cells do not "
                     "sort): run-a: fp32 measured peak 0.174 TFLOP/s; run-b: bf16 measured peak 0.00135 TFLOP/s"]
    assert not any(n.startswith("* MFU against the measured") for n in h.footnotes) and MFU_NOTE not in h.footnotes
    assert [r[5].text.split(" ")[0] for r in h.rows] == ["3.4%", "122.7%"] and [r[5].sort for r in h.rows] == [None, None]
    m = memory_table(cs)
    assert [r[-1].sort for r in m.rows] == [None, None] and mixed[0] in m.footnotes
    # one denominator: the old footnote, cells that sort
    short, long_ = run("c", 1, 90.0, **{names.PEAK_MEASURED_TFLOPS: "0.174"}), run("d", 1, 80.0, **{names.PEAK_MEASURED_TFLOPS: "0.174"})
    long_.tags[names.SEQ_LEN] = "256"
    short.metrics[names.SUM_MFU_MEASURED_PEAK], long_.metrics[names.SUM_MFU_MEASURED_PEAK] = 0.034, 0.05
    h1 = headline(configurations([short, long_]))
    assert not any(n.startswith("MFU: the rows") for n in h1.footnotes)
    assert any(n.startswith("* MFU against the measured") for n in h1.footnotes)
    assert sorted(r[5].sort for r in h1.rows) == [0.034, 0.05]


def test_an_empty_mfu_cell_says_why_the_run_left_its_figure_out():
    from mlflow_llmeff.report.headline import headline
    why = "the run's 0.0041 TFLOP/s per device is 3.04x the measured matmul peak"
    r = run("a", 1, 100.0, **{names.SUMMARY_ABSENT: f"{names.SUM_MFU_MEASURED_PEAK}: {why}"})
    h = headline(configurations([r]))
    assert h.rows[0][5].text == ""
    assert f"an empty MFU (run-a): summary/mfu_measured_peak left out: {why}" in h.footnotes


def test_an_mfu_or_hfu_interval_is_clipped_at_one_as_goodputs_is():
    # a trial's compare: goodput '[0.00, 1.00]' beside MFU '[0.0%, 128.9%]' and '122.7% [0.0%, 437.6%]'
    from mlflow_llmeff.report.repeats import floor_for
    a, b = run("a", 1, 100.0), run("b", 1, 100.0)
    for r, v in ((a, 0.3), (b, 0.9)):
        r.metrics.update({names.SUM_MFU_MEASURED_PEAK: v, names.SUM_HFU: v, names.SUM_GOODPUT: v, names.SUM_STEP_TIME_S: v,
                          names.EVAL_HELLASWAG_ACC_NORM: v})
    c, = configurations([a, b])
    # mean 0.6, sd 0.4243, half 12.706 x 0.4243 / sqrt(2) = 3.81: [0, 4.41] unclipped
    for key in (names.SUM_MFU_MEASURED_PEAK, names.SUM_HFU, names.SUM_GOODPUT, names.EVAL_HELLASWAG_ACC_NORM):
        e = c.estimate(key)
        assert (e.mean, e.low, e.high) == (pytest.approx(0.6), 0.0, 1.0)
    assert c.estimate(names.SUM_STEP_TIME_S).high == pytest.approx(0.6 + 12.706 * math.sqrt(0.18) / math.sqrt(2))
    one = run("c", 1, 100.0)
    one.metrics[names.SUM_MFU_MEASURED_PEAK] = 0.9
    f = floor_for("cpu").half_width
    e = configurations([one])[0].estimate(names.SUM_MFU_MEASURED_PEAK)
    assert e.method == "floor" and (e.low, e.high) == (pytest.approx(0.9 * (1 - f)), min(1.0, 0.9 * (1 + f)))
    old = run("d", 1, 100.0)
    old.metrics[names.SUM_MFU_MEASURED_PEAK] = 1.227  # an older run's mean above 1: the interval holds it
    e = configurations([old])[0].estimate(names.SUM_MFU_MEASURED_PEAK)
    assert e.high == 1.227


def test_quality_reached_is_the_mean_of_the_repeats_holding_it_with_their_interval_and_count():
    # a trial: 'HellaSwag 0.27' of a two-repeat configuration came from one repeat, with no interval
    from mlflow_llmeff.report.headline import headline
    a, b, c3 = run("a", 1, 100.0), run("b", 1, 100.0), run("c", 1, 100.0)
    a.metrics[names.EVAL_HELLASWAG_ACC_NORM], b.metrics[names.EVAL_HELLASWAG_ACC_NORM] = 0.25, 0.29
    a.metrics[names.EVAL_VAL_LOSS], b.metrics[names.EVAL_VAL_LOSS], c3.metrics[names.EVAL_VAL_LOSS] = 3.0, 3.2, 3.4
    h = headline(configurations([a, b, c3]))
    cell = h.rows[0][9]
    # HellaSwag: mean 0.27, sd 0.02828, half 12.706 x 0.02828 / sqrt(2) = 0.2541: [0.0159, 0.524], 1 repeat left out;
    # val loss: mean 3.2, sd 0.2, half 4.303 x 0.2 / sqrt(3) = 0.497: [2.70, 3.70]
    assert cell.text == "HellaSwag 0.27 [0.0159, 0.524] (1 left out), val loss 3.2 [2.7, 3.7]"
    assert cell.sort == pytest.approx(0.27) and "HellaSwag: mean of 2 repeats" in cell.title
    assert any(n.startswith("run-a (+2 repeats): HellaSwag from 2 of 3 repeats; left out: run-c: no finite")
               for n in h.footnotes), h.footnotes
    one = run("d", 1, 100.0)
    one.metrics[names.EVAL_HELLASWAG_ACC_NORM] = 0.27
    assert headline(configurations([one])).rows[0][9].text == "HellaSwag 0.27 (1 run)"
