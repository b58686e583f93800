"""Repeats as samples of a configuration: intervals across repeats, within-noise comparisons, the
baseline choice and scaling efficiency with its interval (hand-computed)."""

from __future__ import annotations

import math

import pytest

from mlflow_llmeff import names
from mlflow_llmeff.report.calc import RunRecord
from mlflow_llmeff.report.repeats import (Estimate, configurations, noisy_pareto_front, scaling_efficiency,
                                          t_quantile_975, versus_best, within_noise)

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


def test_a_single_run_shows_its_own_interval_scaled_to_per_device():
    c, = configurations([run("a", 2, 1000.0, 900.0, 1100.0)])
    e = c.estimate(names.SUM_DEVICE_TOKENS_PER_SEC)
    assert (e.mean, e.low, e.high, e.method) == (500.0, 450.0, 550.0, "run interval")
    assert c.estimate(names.SUM_STEP_TIME_P50_S) is None


def test_an_unstable_repeat_is_left_out_while_a_stable_one_exists():
    c, = configurations([run("stalled", 1, 1494.0, 700.0, 19000.0, stability=STALLED),
                         run("ok", 1, 19272.0, 19000.0, 19500.0)])
    assert [r.run_id for r in c.used] == ["ok"]
    assert c.estimate(names.SUM_TOKENS_PER_SEC).mean == 19272.0
    assert c.note() == f"1 unstable repeat left out: run-stalled: {STALLED}"
    both, = configurations([run("x", 1, 10.0, stability=STALLED), run("y", 1, 12.0, stability=STALLED)])
    assert len(both.used) == 2 and both.note().startswith("no stable repeat, figures from unstable runs")


def test_conditions_that_differ_make_different_configurations():
    cs = configurations([run("a", 1, 10.0), run("b", 1, 10.0, **{names.PRECISION: "bf16"}),
                         run("c", 1, 11.0, **{names.GIT_COMMIT: "abc"})])  # a commit alone is not a condition
    assert [[r.run_id for r in c.runs] for c in cs] == [["a", "c"], ["b"]]


def test_overlapping_intervals_are_within_noise_and_not_ranked():
    a, b, c = (Estimate(100, 90, 110, 2, "repeats"), Estimate(105, 95, 115, 2, "repeats"),
               Estimate(200, 190, 210, 2, "repeats"))
    assert within_noise(a, b) and not within_noise(a, c)
    assert within_noise(a, Estimate(100, None, None, 1, "no interval"))  # no interval: cannot be ranked
    cs = configurations([run("a", 1, 100.0, 90, 110), run("b", 2, 210.0, 190, 230), run("c", 4, 800.0, 780, 820)])
    standing = versus_best(cs, names.SUM_DEVICE_TOKENS_PER_SEC)
    # per device: a 100 [90, 110], b 105 [95, 115], c 200 [195, 205]: c best; a and b apart from it
    assert standing == {0: "0.5x best", 1: "0.525x best", 2: "best"}
    cs2 = configurations([run("a", 1, 100.0, 90, 110), run("b", 2, 210.0, 190, 230)])
    assert versus_best(cs2, names.SUM_DEVICE_TOKENS_PER_SEC) == {0: "within noise of best", 1: "best (1 within noise)"}


def test_two_repeats_one_stalled_and_a_two_process_configuration():
    # the trial: equal settings gave 1,494 and 19,272 tokens/s; the stalled one must not be the baseline
    runs = [run("stalled", 1, 1494.0, 700.0, 19000.0, stability=STALLED),
            run("ok", 1, 19272.0, 19000.0, 19544.0),
            run("ddp", 2, 34000.0, 33000.0, 35000.0)]
    row, = scaling_efficiency(runs)
    assert row.baseline_run_ids == ("ok",) and row.run_ids == ("ddp",)
    assert row.kind == "weak"
    assert row.efficiency == pytest.approx(34000 / (19272 * 2))  # 0.8821
    # interval arithmetic: [33000 / 19544, 35000 / 19000] / 2 = [0.8442, 0.9211]
    assert row.low == pytest.approx(33000 / 19544 / 2) and row.high == pytest.approx(35000 / 19000 / 2)
    assert row.flags == ()
    # the stalled run alone as baseline would have given 11.4: the repeat logic is what prevents it
    assert 34000 / (1494 * 2) > 11


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

    # ddp: fastest, most memory; fsdp: 8% slower (beyond noise), half the memory: both on the front;
    # zero3: slower than fsdp beyond noise and no less memory: beaten
    cs = configurations([with_mem(run("d", 2, 1000.0, 980.0, 1020.0, **_layout("ddp", 2, 1, 1)), 2.0),
                         with_mem(run("f", 2, 920.0, 900.0, 940.0, **_layout("fsdp", 2, 2, 1)), 1.0),
                         with_mem(run("z", 2, 700.0, 690.0, 710.0, **_layout("deepspeed_zero3", 2, 2, 1)), 1.0)])
    mems = [plots._memory(c) for c in cs]
    assert [(m.mean, m.low, m.high, m.method) for m in mems] == [(2.0, 2.0, 2.0, "measured peak"),
                                                               (1.0, 1.0, 1.0, "measured peak"),
                                                               (1.0, 1.0, 1.0, "measured peak")]
    tps = [c.estimate(names.SUM_DEVICE_TOKENS_PER_SEC) for c in cs]
    assert noisy_pareto_front(list(zip(mems, tps)), maximize_x=False, maximize_y=True) == [1, 0]

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
    assert sorted(t.get_text() for t in fig.axes[0].texts) == ["run-d", "run-f", "run-z"]
