"""Which rank the others wait for, on which host and in which phase (calc/stragglers.py), hand-computed."""

from __future__ import annotations

import pytest

from mlflow_llmeff.calc.stragglers import RankTimes, stragglers


def rank(host, forward, backward, optimizer, step_s=None):
    return RankTimes(host, {"forward": forward, "backward": backward, "optimizer": optimizer}, step_s)


def test_a_rank_slow_only_in_backward_is_named_in_backward_with_its_host():
    # 4 ranks, 2 a host; rank 3 takes 46 ms in backward where the others take 20 ms, and the same forward
    # and optimizer: compute 10 + 46 + 2 = 58 ms vs a median of 32 ms; the others wait for it (steps of 60 ms)
    ranks = [rank("node-0", 0.010, 0.020, 0.002, 0.060), rank("node-0", 0.010, 0.020, 0.002, 0.060),
             rank("node-1", 0.010, 0.020, 0.002, 0.060), rank("node-1", 0.010, 0.046, 0.002, 0.060)]
    s = stragglers(ranks)
    assert (s.rank, s.host, s.phase) == (3, "node-1", "backward")
    assert s.phase_ratio == pytest.approx(2.3) and s.ratio == pytest.approx(0.058 / 0.032)
    assert s.phase_ratios == pytest.approx({"forward": 1.0, "backward": 2.3, "optimizer": 1.0})
    assert s.wait_s == pytest.approx([0.028, 0.028, 0.028, 0.002])  # the fast ranks wait longest: not named for it


def test_a_forward_slower_in_ratio_but_fewer_seconds_does_not_hide_the_backward():
    # rank 1: forward 2x (2 ms -> 4 ms, +2 ms) and backward 1.5x (20 ms -> 30 ms, +10 ms): backward, by seconds
    s = stragglers([rank("a", 0.002, 0.020, 0.001), rank("b", 0.004, 0.030, 0.001), rank("c", 0.002, 0.020, 0.001)])
    assert (s.rank, s.phase, s.phase_ratio) == (1, "backward", 1.5)
    assert s.phase_ratios["forward"] == 2.0 and s.wait_s == [None, None, None]


def test_a_uniformly_slowed_host_is_named_in_its_longest_phase():
    # a host at a third of a core: every phase 3x; with 2 ranks the median is their mean (2x), so 1.5x
    s = stragglers([rank("fast", 0.004, 0.008, 0.001, 0.040), rank("slow", 0.012, 0.024, 0.003, 0.040)])
    assert (s.rank, s.host, s.phase) == (1, "slow", "backward")
    assert s.ratio == pytest.approx(0.039 / 0.026) and s.phase_ratio == pytest.approx(1.5)


def test_only_phases_every_rank_timed_are_summed():
    a = RankTimes("a", {"forward": 0.01, "backward": 0.02})
    b = RankTimes("b", {"forward": 0.01, "backward": 0.03, "optimizer": 0.5})  # b's optimizer: not compared
    s = stragglers([a, b])
    assert s.phases == ("forward", "backward") and s.ratio == pytest.approx(0.04 / 0.035)


@pytest.mark.parametrize("ranks", [
    [rank("a", 0.01, 0.02, 0.0)],                                   # one rank
    [rank("a", 0.0, 0.0, 0.0), rank("b", 0.0, 0.0, 0.0)],           # nothing timed: a ratio over 0
    [RankTimes("a", {}), RankTimes("b", {"forward": 0.1})],         # no phase both timed
])
def test_no_straggler_where_the_ratio_is_undefined(ranks):
    assert stragglers(ranks) is None


def test_a_negative_time_is_one_line():
    with pytest.raises(ValueError, match=r"phase seconds \{'backward': -0.1\} on host 'b' are negative"):
        stragglers([rank("a", 0.1, 0.1, 0.1), rank("b", 0.1, -0.1, 0.1)])


def test_each_ranks_data_wait_share_names_the_rank_that_waited_most():
    from mlflow_llmeff.monitor.summary import data_wait_text

    got = [{"data_wait_s": 1.0, "train_s": 20.0}, {"data_wait_s": 6.2, "train_s": 20.0}]
    assert data_wait_text(got) == "rank 1 waited most: 0.31 of its step time; rank 0 0.05 (1 s), rank 1 0.31 (6.2 s)"
    same = [{"data_wait_s": 0.0, "train_s": 4.0}, {"data_wait_s": 0.0, "train_s": 5.0}]
    assert data_wait_text(same) == "every rank alike: rank 0 0 (0 s), rank 1 0 (0 s)"
    assert data_wait_text([{"data_wait_s": 0.0, "train_s": 0.0}]) is None
