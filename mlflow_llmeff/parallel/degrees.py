"""Parallelism degrees of a run: a pure calculator (no torch, no I/O).

The layout follows torchtitan's ``ParallelDims`` and Accelerate's ``ParallelismConfig``: the world
is ``dp_replicate x dp_shard x cp x tp`` (x ``pp``), with tensor parallelism innermost (the ranks
of one tensor-parallel group are consecutive, so on one machine they share its fast links).
``dp = dp_replicate x dp_shard`` ranks see different data; the ``world / dp`` ranks of one
model-parallel group (tensor, context, pipeline) see the same tokens, so tokens count over the
``dp`` data-parallel ranks only (``../shared/METRICS.md``, "Parallelism and communication").
"""

from __future__ import annotations

from dataclasses import dataclass

from mlflow_llmeff import names

__all__ = ["Degrees"]


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
        """Ranks that see the same tokens (``tp x cp x pp``): the factor a sum of token counts over
        every rank counts each token."""
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
