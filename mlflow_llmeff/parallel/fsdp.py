"""``fsdp`` (FSDP2 full shard over every data-parallel rank) and ``hsdp`` (hybrid: replicas of a
group that shards), with torch's ``fully_shard`` (see :class:`~mlflow_llmeff.parallel.base.MeshStrategy`).

``reshard_after_forward`` (a training setting) is FSDP2's own: True frees the gathered layer
parameters after each layer's forward and gathers them again for its backward (ZeRO-3's
traffic, the least memory); False keeps them until the backward (one gather fewer, ZeRO-2-like
memory).
"""

from __future__ import annotations

from mlflow_llmeff.parallel.base import MeshStrategy
from mlflow_llmeff.parallel.degrees import Degrees


class FSDP(MeshStrategy):
    name = "fsdp"
    summary = "FSDP2 full shard: weights, gradients and optimizer state sharded over every rank"
    fsdp_dims = ("dp_shard",)

    def degrees(self, world: int, *, tp_size: int = 0, dp_shard: int = 0, processes_per_node: int = 0) -> Degrees:
        if dp_shard not in (0, world):
            raise ValueError(f"parallelism='fsdp' shards over all {world} processes (dp_shard={dp_shard} given); "
                             "use hsdp to shard over fewer and replicate the rest")
        return Degrees(dp_shard=world)


class HSDP(MeshStrategy):
    name = "hsdp"
    summary = ("hybrid sharding: the model state is sharded over dp_shard ranks (default: one machine) and "
               "replicated across the groups (FSDP2 on a 2-D mesh)")
    fsdp_dims = ("dp_replicate", "dp_shard")

    def degrees(self, world: int, *, tp_size: int = 0, dp_shard: int = 0, processes_per_node: int = 0) -> Degrees:
        shard = dp_shard or processes_per_node or world
        if shard < 1 or world % shard:
            raise ValueError(f"parallelism='hsdp': dp_shard={shard} must divide the {world} processes")
        if shard == world:
            raise ValueError(f"parallelism='hsdp' with dp_shard={shard} of {world} processes replicates nothing; "
                             "use fsdp, or a dp_shard that leaves at least 2 replicas")
        if shard == 1:
            raise ValueError("parallelism='hsdp' with dp_shard=1 shards nothing; use ddp")
        return Degrees(dp_replicate=world // shard, dp_shard=shard)


STRATEGIES = (FSDP(), HSDP())
