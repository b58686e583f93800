"""Every token counted once under every combination of degrees (METRICS.md, "Setups that change the counting")."""

from __future__ import annotations

import pytest

from mlflow_llmeff import parallel
from mlflow_llmeff.parallel.degrees import Degrees, token_counting, tokens_per_step

# Per data-parallel rank and step: micro-batch b = 4 sequences of T = 1024 tokens, grad_accum 2,
# so each data-parallel rank trains 4 * 1024 * 2 = 8192 tokens a step; a context-parallel rank
# holds 1/cp of each sequence (8192 / cp tokens) and a tensor-parallel peer a copy.
PER_DP_RANK = 4 * 1024 * 2

# (dp_replicate, dp_shard, cp, tp, tokens each rank counts, hand-computed global tokens per step)
TABLE = [
    (1, 1, 1, 1, 8192, 8192),           # single
    (8, 1, 1, 1, 8192, 65536),          # ddp 8: 8 x 8192
    (1, 8, 1, 1, 8192, 65536),          # fsdp / ZeRO 8: shards are data-parallel ranks
    (2, 4, 1, 1, 8192, 65536),          # hsdp 2 x 4
    (1, 1, 1, 2, 8192, 8192),           # tp 2: two copies of one batch
    (1, 4, 1, 2, 8192, 32768),          # fsdp_tp 4 x 2: 4 x 8192
    (1, 1, 2, 1, 4096, 8192),           # cp 2: two halves of one batch (the fault gave 4096)
    (1, 1, 4, 1, 2048, 8192),           # cp 4
    (2, 1, 2, 1, 4096, 16384),          # dp 2 x cp 2
    (1, 2, 2, 2, 4096, 16384),          # shard 2 x cp 2 x tp 2: 8 ranks
    (2, 2, 2, 2, 4096, 32768),          # replicate 2 x shard 2 x cp 2 x tp 2: 16 ranks
    (1, 1, 2, 4, 4096, 8192),           # cp 2 x tp 4
    (4, 1, 4, 2, 2048, 32768),          # dp 4 x cp 4 x tp 2: 32 ranks
]


@pytest.mark.parametrize("rep, shard, cp, tp, per_rank, expected", TABLE)
def test_tokens_per_step_for_dp_cp_tp_combinations(rep, shard, cp, tp, per_rank, expected):
    d = Degrees(dp_replicate=rep, dp_shard=shard, cp=cp, tp=tp)
    assert per_rank == PER_DP_RANK // cp  # the slice each rank holds
    assert tokens_per_step(d, per_rank) == expected == d.dp * PER_DP_RANK


@pytest.mark.parametrize("rep, shard, cp, tp, per_rank, expected", TABLE)
def test_cp_ranks_counting_whole_sequences_are_copies(rep, shard, cp, tp, per_rank, expected):
    # the batch counted before the context-parallel split: every cp rank counted all 8192
    d = Degrees(dp_replicate=rep, dp_shard=shard, cp=cp, tp=tp)
    assert tokens_per_step(d, PER_DP_RANK, cp_counts_slices=False) == expected


def test_counting_ranks_and_copies():
    d = Degrees(dp_replicate=2, dp_shard=2, cp=2, tp=2)
    c = token_counting(d)
    assert (c.copies, c.counting_ranks, c.slices) == (2, 8, 2)
    c = token_counting(d, cp_counts_slices=False)
    assert (c.copies, c.counting_ranks, c.slices) == (4, 4, 1)


def test_sums_over_ranks_become_the_global_counts():
    # dp 2 x cp 2 x tp 2; each dp rank trains 3 sequences of 8 tokens (no padding, one loss
    # token fewer per sequence); a cp rank holds 3 slices of 4, counting 12 tokens, sum(l^2) 3 * 16
    d = Degrees(dp_replicate=2, cp=2, tp=2)
    ranks = d.world
    got = token_counting(d).apply(ranks * 12, ranks * 12, ranks * 9, ranks * 3, ranks * 48)
    # global: 2 x 3 = 6 sequences of 8: 48 tokens, sum(l^2) = 6 * 64 = 384 (full-length attention)
    assert got[0] == 48 and got[1] == 48 and got[3] == 6 and got[4] == 384
    assert got[4] / got[0] == 8.0  # effective length: the full sequence, not the slice


def test_every_strategy_counts_its_batch_once():
    # each strategy's own degrees (parallel/<strategy>.py) through the one rule
    cases = [("single", 1, {}, 1), ("ddp", 8, {}, 8), ("fsdp", 8, {}, 8),
             ("hsdp", 8, dict(dp_shard=4), 8), ("tp", 4, {}, 1), ("fsdp_tp", 8, dict(tp_size=2), 4),
             ("cp", 4, {}, 1), ("deepspeed_zero1", 4, {}, 4), ("deepspeed_zero2", 4, {}, 4),
             ("deepspeed_zero3", 4, {}, 4)]
    for name, world, kw, dp in cases:
        d = parallel.get(name).degrees(world, **kw)
        per_rank = PER_DP_RANK // d.cp
        assert tokens_per_step(d, per_rank) == dp * PER_DP_RANK, name


def test_negative_tokens_are_refused():
    with pytest.raises(ValueError, match="tokens_per_rank=-1 must be >= 0"):
        tokens_per_step(Degrees(), -1)
