"""``fsdp_tp``: 2-D parallelism, tensor parallel within groups of ``tp_size`` consecutive ranks
(one machine's fast links) and FSDP2 across the groups (torchtitan's FSDP + TP): the layer
matrices are split by the tensor-parallel plan, then each rank's part is fully sharded over the
``world / tp_size`` data-parallel ranks."""

from __future__ import annotations

from mlflow_llmeff.calc.comm import CommEstimate, TrafficShape
from mlflow_llmeff.parallel.base import MeshStrategy
from mlflow_llmeff.parallel.degrees import Degrees
from mlflow_llmeff.parallel.fsdp import sharded_bus_parts, sharded_state_bytes
from mlflow_llmeff.parallel.tp import activation_bus_parts, check_shape


class FSDPTP(MeshStrategy):
    name = "fsdp_tp"
    summary = "2-D: tensor parallel over tp_size ranks x FSDP2 over the data-parallel groups"
    tp_dim = "tp"
    fsdp_dims = ("dp_shard",)

    def degrees(self, world: int, *, tp_size: int = 0, dp_shard: int = 0, processes_per_node: int = 0) -> Degrees:
        if tp_size < 2 or world % tp_size or tp_size == world:
            raise ValueError(f"parallelism='fsdp_tp' needs tp_size > 1 dividing the {world} processes and smaller "
                             f"than them (tp_size={tp_size}); e.g. tp_size=2 with 4 processes")
        if dp_shard not in (0, world // tp_size):
            raise ValueError(f"parallelism='fsdp_tp' shards over the {world // tp_size} tensor-parallel groups "
                             f"(dp_shard={dp_shard} given)")
        return Degrees(dp_shard=world // tp_size, tp=tp_size)

    def check_model(self, config, degrees: Degrees) -> None:
        check_shape(config, degrees.tp)

    def bus_bytes(self, shape: TrafficShape, degrees: Degrees) -> CommEstimate:
        """FSDP2's collectives over each rank's tensor-parallel part, then tensor parallelism's."""
        return CommEstimate({**sharded_bus_parts(shape, degrees), **activation_bus_parts(shape, degrees.tp)})

    def model_state_bytes(self, params, dp, *, dp_shard=None, tp=1, tp_params=0, precision="bf16",
                          persistent_params=0, optimizer="adamw", weights="fp32", optimizer_per_param=None):
        """Each rank's tensor-parallel part, fully sharded over the data-parallel groups (:func:`sharded_state_bytes`)."""
        return sharded_state_bytes(params, dp, dp_shard, tp, tp_params, optimizer=optimizer, weights=weights,
                                   optimizer_per_param=optimizer_per_param)

    def state_sharding(self, degrees: Degrees) -> str:
        return f"all of it divided over the {degrees.dp_shard} ranks of a shard group"


STRATEGIES = (FSDPTP(),)
