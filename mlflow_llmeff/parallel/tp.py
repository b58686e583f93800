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

from mlflow_llmeff.parallel.base import MeshStrategy
from mlflow_llmeff.parallel.degrees import Degrees
from mlflow_llmeff.parallel.mesh import apply_tp, tp_plan  # noqa: F401 - apply_tp re-exported


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


STRATEGIES = (TP(),)
