"""Parallelism degrees of a run: a pure calculator (no torch, no I/O).

The layout follows torchtitan's ``ParallelDims`` and Accelerate's ``ParallelismConfig``: the world
is ``dp_replicate x dp_shard x cp x tp`` (x ``pp``), with tensor parallelism innermost (the ranks
of one tensor-parallel group are consecutive, so on one machine they share its fast links).
``dp = dp_replicate x dp_shard`` ranks see different data. The ranks of one tensor- or
pipeline-parallel group hold copies of the same tokens; the ``cp`` ranks of a context-parallel
group each hold a different slice of the same sequences. Every token of the global batch is counted
exactly once (``docs/parallelism.md``, "What changes with the strategy, and what does not"):
:func:`token_counting` is the one rule, for every strategy and combination of degrees.
"""

from __future__ import annotations

from dataclasses import dataclass

from mlflow_llmeff import names

__all__ = ["Degrees", "TokenCounting", "token_counting", "tokens_per_step"]


@dataclass(frozen=True)
class Degrees:
    """How a run's processes are split.

    Attributes:
        dp_replicate: data-parallel replicas (gradients all-reduced across them: DDP, the replicate
            dimension of HSDP).
        dp_shard: data-parallel ranks each replica's model state is sharded over (FSDP, ZeRO); 1
            when nothing is sharded.
        tp: tensor-parallel degree (Megatron-style column/row split of the layer matrices).
        pp: pipeline-parallel degree (1: no pipeline strategy exists yet).
        cp: context-parallel degree (the sequence split over ranks).

    Raises:
        ValueError: for a degree < 1.
    """

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1

    def __post_init__(self) -> None:
        for name in ("dp_replicate", "dp_shard", "tp", "pp", "cp"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"parallelism degree {name}={v!r} is not accepted; give an int >= 1")

    @property
    def dp(self) -> int:
        """Data-parallel degree: ranks that see different data (``dp_replicate x dp_shard``)."""
        return self.dp_replicate * self.dp_shard

    @property
    def model_parallel(self) -> int:
        """Ranks of one model-parallel group (``tp x cp x pp``): the ranks that share one
        data-parallel index (the same sequences; cp ranks hold different slices of them, see
        :func:`token_counting` for what counts each token once)."""
        return self.tp * self.cp * self.pp

    @property
    def world(self) -> int:
        """Processes (devices) in all: ``dp x tp x cp x pp``."""
        return self.dp * self.model_parallel

    def tags(self) -> dict[str, str]:
        """The ``llmeff.parallelism.*`` degree tags (see ``docs/parallelism.md``)."""
        return {names.PAR_DP: str(self.dp), names.PAR_DP_SHARD: str(self.dp_shard),
                names.PAR_DP_REPLICATE: str(self.dp_replicate), names.PAR_TP: str(self.tp),
                names.PAR_PP: str(self.pp), names.PAR_CP: str(self.cp)}

    def describe(self) -> str:
        """E.g. ``dp 4 (replicate 2 x shard 2) x tp 2 = 8``."""
        dp = (f"dp {self.dp}" + (f" (replicate {self.dp_replicate} x shard {self.dp_shard})"
                                 if self.dp_replicate > 1 and self.dp_shard > 1 else ""))
        rest = "".join(f" x {n} {v}" for n, v in (("tp", self.tp), ("cp", self.cp), ("pp", self.pp)) if v > 1)
        return f"{dp}{rest} = {self.world}"


@dataclass(frozen=True)
class TokenCounting:
    """How per-rank counts summed over every rank become the global batch's counts.

    Attributes:
        copies: ranks that counted the very same tokens (``tp x pp``, and ``x cp`` when each
            context-parallel rank counted whole sequences): the all-rank sums are divided by it.
        counting_ranks: ranks whose counts sum to the global batch once (``world / copies``: one
            per data-parallel rank and, when they counted slices, per context-parallel rank).
        slices: ``cp`` when the context-parallel ranks counted slices of each sequence, else 1.
            Each sequence then appears as one row on each of its ``slices`` ranks (samples are
            divided by it) and a slice of ``l/cp`` tokens counts ``(l/cp)^2``, so the cp slices of
            one sequence sum to ``l^2/cp``; attention FLOPs use the full length (``docs/formulas.md``), so
            ``sum(l^2)`` is multiplied by it. Exact for sequences split into equal slices (torch's
            ``context_parallel`` and Megatron's load-balanced split of full rows).
    """

    copies: int
    counting_ranks: int
    slices: int

    def apply(self, tokens: int, padded_tokens: int, loss_tokens: int, samples: int, sum_len_sq: int):
        """The global ``(tokens, padded_tokens, loss_tokens, samples, sum_len_sq)`` from all-rank sums.

        Works on ints and on int64 tensors alike (integer division).
        """
        c, k = self.copies, self.slices
        return (tokens // c, padded_tokens // c, loss_tokens // c, samples // (c * k), sum_len_sq * k // c)


def token_counting(degrees: Degrees, *, cp_counts_slices: bool = True) -> TokenCounting:
    """The one token-counting rule for ``degrees`` (every strategy; ``docs/formulas.md``, "Counting rules").

    Data-parallel ranks (replicas and shards alike: DDP, FSDP, HSDP, ZeRO) hold different
    sequences; tensor- and pipeline-parallel peers hold copies of them; context-parallel ranks hold
    different slices of the same sequences. Summing every rank's counts and dividing by the copies
    counts each token once: at ``dp=2, cp=2, tp=2`` with ``b`` sequences of ``T`` tokens per data-
    parallel rank, each rank counts ``b*T/2`` tokens (its slice), the 8 ranks sum ``4*b*T``, and
    dividing by the 2 tensor-parallel copies gives ``2*b*T`` (treating cp ranks as copies, the
    former rule, gave ``b*T``: half).

    Args:
        degrees: the run's degrees.
        cp_counts_slices: True when each context-parallel rank counted its own slice of the
            sequences (the batch after the split: what a forward hook or a loop inside torch's
            ``context_parallel`` sees); False when every cp rank counted the whole sequences
            (the batch before the split), so cp ranks are copies too.
    """
    copies = degrees.tp * degrees.pp * (1 if cp_counts_slices else degrees.cp)
    return TokenCounting(copies=copies, counting_ranks=degrees.world // copies,
                         slices=degrees.cp if cp_counts_slices else 1)


def tokens_per_step(degrees: Degrees, tokens_per_rank: int, *, cp_counts_slices: bool = True) -> int:
    """Global tokens per optimizer step when every rank counted ``tokens_per_rank`` (tokens).

    ``world * tokens_per_rank / copies`` with :func:`token_counting`'s copies.

    Raises:
        ValueError: when ``tokens_per_rank`` is negative.
    """
    if tokens_per_rank < 0:
        raise ValueError(f"tokens_per_rank={tokens_per_rank} must be >= 0")
    return token_counting(degrees, cp_counts_slices=cp_counts_slices).counting_ranks * tokens_per_rank
