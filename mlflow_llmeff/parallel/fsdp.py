"""``fsdp`` (FSDP2 full shard over every data-parallel rank) and ``hsdp`` (hybrid: replicas of a
group that shards), with torch's ``fully_shard`` (see :class:`~mlflow_llmeff.parallel.base.MeshStrategy`).

``reshard_after_forward`` (a training setting) is FSDP2's own: True frees the gathered layer
parameters after each layer's forward and gathers them again for its backward (ZeRO-3's
traffic, the least memory); False keeps them until the backward (one gather fewer, ZeRO-2-like
memory).
"""

from __future__ import annotations

from mlflow_llmeff.calc.comm import CommEstimate, TrafficShape, bus_factor
from mlflow_llmeff.parallel.base import MeshStrategy, per_param_bytes, tp_local
from mlflow_llmeff.parallel.degrees import Degrees


def sharded_bus_parts(shape: TrafficShape, degrees: Degrees) -> dict[str, float]:
    """FSDP2's collectives per step (full shard over ``dp_shard`` ranks, per micro-batch): an all-gather
    of every parameter in the forward, again of the decoder layers' parameters in the backward when
    ``reshard_after_forward`` (the root keeps its own), a reduce-scatter of the fp32 gradients; bf16
    gathers 2-byte parameters. With replicas (HSDP), an all-reduce of each shard's gradients across
    them. Under tensor parallelism each rank gathers its own part (:func:`~mlflow_llmeff.parallel.base.tp_local`)."""
    n, ga, P = degrees.dp_shard, shape.grad_accum, float(shape.params)
    local = tp_local(P, degrees.tp, shape.tp_params)  # one TP rank's part
    local_layers = shape.layer_params if degrees.tp == 1 else shape.layer_params - shape.tp_params + shape.tp_params / degrees.tp
    pb = 2 if shape.precision == "bf16" else 4
    gathered = local + (local_layers if shape.reshard_after_forward else 0.0)
    parts = {"parameter all-gather": bus_factor("all_gather", n) * pb * gathered * ga,
             "gradient reduce-scatter": bus_factor("reduce_scatter", n) * 4 * local * ga}
    if degrees.dp_replicate > 1:
        parts["gradient all-reduce across replicas"] = bus_factor("all_reduce", degrees.dp_replicate) * 4 * local / n * ga
    return parts


def sharded_state_bytes(params: int, dp: int, dp_shard: int | None, tp: int, tp_params: int, *,
                        optimizer: str = "adamw", weights: str = "fp32",
                        optimizer_per_param: float | None = None) -> tuple[float, float, float]:
    """FSDP's model state per device: the bytes per parameter of :func:`~mlflow_llmeff.parallel.base.per_param_bytes`
    (fp32 AdamW under torch AMP: 4 + 4 + 8 = 16 B) of one tensor-parallel rank's parameters, divided
    over the shard group (``dp_shard``, default ``dp``): FSDP2 shards weights, gradients and every
    state tensor the optimizer makes from the sharded parameters.

    Raises:
        ValueError: an unknown ``optimizer`` or ``weights``.
    """
    w, g, o = per_param_bytes(optimizer, weights, optimizer_per_param)
    local, shard = tp_local(float(params), tp, tp_params), float(dp_shard or dp)
    return w * local / shard, g * local / shard, o * local / shard


class Sharded(MeshStrategy):
    """What FSDP and HSDP share: their traffic, model state and how it is divided."""

    def bus_bytes(self, shape: TrafficShape, degrees: Degrees) -> CommEstimate:
        return CommEstimate(sharded_bus_parts(shape, degrees))

    def model_state_bytes(self, params, dp, *, dp_shard=None, tp=1, tp_params=0, precision="bf16",
                          persistent_params=0, optimizer="adamw", weights="fp32", optimizer_per_param=None):
        return sharded_state_bytes(params, dp, dp_shard, tp, tp_params, optimizer=optimizer, weights=weights,
                                   optimizer_per_param=optimizer_per_param)

    def state_sharding(self, degrees: Degrees) -> str:
        return f"all of it divided over the {degrees.dp_shard} ranks of a shard group"


class FSDP(Sharded):
    name = "fsdp"
    summary = "FSDP2 full shard: weights, gradients and optimizer state sharded over every rank"
    fsdp_dims = ("dp_shard",)

    def degrees(self, world: int, *, tp_size: int = 0, dp_shard: int = 0, processes_per_node: int = 0) -> Degrees:
        if dp_shard not in (0, world):
            raise ValueError(f"parallelism='fsdp' shards over all {world} processes (dp_shard={dp_shard} given); "
                             "use hsdp to shard over fewer and replicate the rest")
        return Degrees(dp_shard=world)

    def wraps(self, module) -> bool:
        """FSDP1's ``FullyShardedDataParallel``, or the class FSDP2's ``fully_shard`` makes (``FSDP<Model>``)."""
        cls = type(module).__name__
        return "FullyShardedDataParallel" in cls or cls.startswith("FSDP")

    def named_by(self, environ) -> bool:
        return environ.get("ACCELERATE_USE_FSDP", "").lower() in ("1", "true")


class HSDP(Sharded):
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
