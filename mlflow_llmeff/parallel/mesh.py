"""What the device-mesh strategies apply to a model: FSDP2 sharding, tensor parallelism, autocast.

Shared by :class:`~mlflow_llmeff.parallel.base.MeshStrategy` (which applies them in order: tensor
parallelism, then FSDP2 or autocast) and the strategy modules (``tp.py``, ``fsdp_tp.py``), so it
imports none of them. Torch is imported inside each function: importing this module imports no torch.
"""

from __future__ import annotations

__all__ = ["decoder_layers", "apply_fsdp", "autocast_forward", "tp_plan", "apply_tp"]


def decoder_layers(model):
    """The decoder's layers (``model.model.layers`` for Llama/Mistral, ``transformer.h`` for GPT-2)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    layers = getattr(decoder, "layers", None) if decoder is not None else None
    if layers is None:
        layers = getattr(getattr(model, "transformer", None), "h", None)
    if layers is None:
        raise ValueError(f"cannot find the decoder layers of {type(model).__name__} to shard them one by one")
    return layers


def apply_fsdp(model, mesh, *, precision: str, reshard_after_forward: bool):
    """torch's FSDP2 ``fully_shard`` on each decoder layer, then on the whole model (the root: the
    embeddings, final norm and LM head), over ``mesh`` (2-D ``(replicate, shard)``: HSDP).

    bf16 runs all-gather bf16 parameters and reduce-scatter fp32 gradients
    (``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``, as Accelerate's FSDP2 plugin
    sets it); the sharded master parameters and optimizer state stay fp32. The root keeps its
    parameters unsharded between forward and backward.
    """
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
          if precision == "bf16" else MixedPrecisionPolicy())
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp)
    # the root's parameters (embeddings, final norm, LM head) are used at the end of the forward and
    # the start of the backward: resharding them in between would gather them twice for nothing
    fully_shard(model, mesh=mesh, reshard_after_forward=False, mp_policy=mp)
    return model


def autocast_forward(model, device, precision: str):
    """Run ``model.forward`` under ``torch.autocast`` (what ``accelerator.prepare`` does for a model it wraps)."""
    import torch

    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    model.forward = torch.autocast(device_type=device.type, dtype=dtype)(model.forward)
    return model


def tp_plan(config) -> dict[str, str]:
    """The model's tensor-parallel plan (``{"layers.*.self_attn.q_proj": "colwise", ...}``).

    Raises:
        ValueError: when the model has none (its config lacks ``base_model_tp_plan``).
    """
    plan = getattr(config, "base_model_tp_plan", None)
    if not plan:
        raise ValueError(f"model type {getattr(config, 'model_type', '?')!r} has no tensor-parallel plan "
                         "(transformers' base_model_tp_plan); tp and fsdp_tp need one (Llama, Mistral have it)")
    bad = {k: v for k, v in plan.items() if v not in ("colwise", "rowwise")}
    if bad:
        raise ValueError(f"tensor-parallel plan entries {bad} are not colwise/rowwise; only those are applied")
    return dict(plan)


def apply_tp(model, tp_mesh):
    """Shard ``model``'s decoder layers over ``tp_mesh`` with its plan (:func:`tp_plan`; the split is
    described in :mod:`mlflow_llmeff.parallel.tp`): each ``layers.*.<module>`` entry becomes torch's
    ``ColwiseParallel`` / ``RowwiseParallel`` on that module of every layer (``parallelize_module``)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    layers = decoder_layers(model)
    plan = {}
    for key, style in tp_plan(model.config).items():
        prefix, _, rest = key.partition("*.")
        if not rest:
            raise ValueError(f"tensor-parallel plan key {key!r} is not per layer ('layers.*.<module>')")
        for i in range(len(layers)):
            plan[f"{i}.{rest}"] = styles[style]()
    parallelize_module(layers, tp_mesh, plan)
    return model
