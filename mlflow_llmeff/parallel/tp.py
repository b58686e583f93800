"""``tp``: tensor parallelism (Megatron-LM's column/row split of each layer's matrices) over every
rank, with the model's own tensor-parallel plan (transformers' ``base_model_tp_plan``, e.g.
Llama's ``q/k/v/gate/up_proj: colwise``, ``o/down_proj: rowwise``) applied with torch's
``parallelize_module`` (``ColwiseParallel`` / ``RowwiseParallel``).

Per layer and micro-batch the forward all-reduces the attention and MLP outputs and the backward
the gradients of their inputs (Shoeybi et al. 2019, "Megatron-LM", Sec. 3, Fig. 3). Embeddings,
norms and the LM head stay replicated (the base plan shards the decoder layers only). Every rank
sees the same batch: the data-parallel degree is 1 and tokens count once.
"""

from __future__ import annotations

from mlflow_llmeff.calc.comm import CommEstimate, TrafficShape, bus_factor
from mlflow_llmeff.parallel.base import MeshStrategy, per_param_bytes, tp_local
from mlflow_llmeff.parallel.degrees import Degrees
from mlflow_llmeff.parallel.mesh import apply_tp, tp_plan  # noqa: F401 - apply_tp re-exported


def activation_bus_parts(shape: TrafficShape, tp: int) -> dict[str, float]:
    """Tensor parallelism's collectives per step (per micro-batch and layer): torch's ColwiseParallel /
    RowwiseParallel all-reduce the two row-parallel outputs in the forward and the five column-parallel
    inputs' gradients (q, k, v, gate, up) in the backward, ``tokens x hidden`` activations each (bf16:
    2 bytes under autocast); activation checkpointing repeats the forward's two. Nothing for ``tp`` 1."""
    if tp <= 1:
        return {}
    per_layer = 7 + (2 if shape.activation_checkpointing else 0)
    ab = 2 if shape.half else 4
    return {"activation all-reduce (tensor parallel)": (bus_factor("all_reduce", tp) * per_layer * shape.layers
                                                        * shape.tokens_per_micro_batch * shape.hidden * ab
                                                        * shape.grad_accum)}


def check_shape(config, tp: int) -> None:
    """Heads, key-value heads and the MLP width must divide over ``tp`` ranks.

    Raises:
        ValueError: one line naming the value that does not divide.
    """
    tp_plan(config)
    for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        v = getattr(config, name, None)
        if isinstance(v, int) and v % tp:
            raise ValueError(f"tensor parallelism over {tp} ranks needs {name} divisible by {tp}; the model has {v}")


class TP(MeshStrategy):
    name = "tp"
    summary = "tensor parallel over every rank (tp_size = processes): the model's colwise/rowwise plan"
    tp_dim = "tp"

    def degrees(self, world: int, *, tp_size: int = 0, dp_shard: int = 0, processes_per_node: int = 0) -> Degrees:
        tp = tp_size or world
        if tp != world:
            raise ValueError(f"parallelism='tp' uses every process (tp_size={tp}, {world} processes); "
                             "use fsdp_tp to shard data-parallel groups of tensor-parallel ranks")
        return Degrees(tp=tp)

    def check_model(self, config, degrees: Degrees) -> None:
        check_shape(config, degrees.tp)

    def bus_bytes(self, shape: TrafficShape, degrees: Degrees) -> CommEstimate:
        return CommEstimate(activation_bus_parts(shape, degrees.tp))

    def model_state_bytes(self, params, dp, *, dp_shard=None, tp=1, tp_params=0, precision="bf16",
                          persistent_params=0, optimizer="adamw", weights="fp32", optimizer_per_param=None):
        """The bytes per parameter of :func:`~mlflow_llmeff.parallel.base.per_param_bytes` (fp32 AdamW
        under torch AMP: 16 B) of one tensor-parallel rank's parameters, replicated otherwise."""
        w, g, o = per_param_bytes(optimizer, weights, optimizer_per_param)
        local = tp_local(float(params), tp, tp_params)
        return w * local, g * local, o * local


STRATEGIES = (TP(),)
