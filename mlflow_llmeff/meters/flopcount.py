"""FLOPs of any Hugging Face causal LM: the formula where it knows the family, else a meta-device count.

:func:`resolve` is the one entry point (the monitor and ``llmeff flops`` use it):

1. ``formula``: the config's ``model_type`` is one of :data:`mlflow_llmeff.calc.flops.FORMULA_TYPES`
   (or the config is a plain shape object): :func:`mlflow_llmeff.calc.flops.model_shape` reads its fields.
2. ``meta_count``: any other type transformers can build. :func:`count_on_meta` builds the model from
   its config under ``torch.device("meta")`` (no weight is allocated, nothing is downloaded) with
   eager attention and the data-independent ``batched_mm`` expert kernel, and counts one forward
   and backward of a batch of one sequence with ``torch.utils.flop_counter.FlopCounterMode`` at
   two sequence lengths. Per token the count is ``a + b*s`` (eager attention computes every
   query-key pair), so ``a`` is every matmul outside the attention scores (LM head included) and
   ``b`` the attention matmuls' cost per attended key; model FLOPs then apply the causal discount,
   windows and chunks of the config exactly as the formula does (:class:`~mlflow_llmeff.calc.flops.CountedFlops`).
   A third length checks that the count is affine in ``s``. For a mixture of experts the count is
   repeated with one expert more per token: if it does not change, the implementation runs every
   expert on every token (e.g. Llama-4 in transformers 5), the count is hardware FLOPs and not the
   ``top_k`` model FLOPs, and the type gets no figure.
3. ``none``: neither works; no figure is invented and the note says why.

:func:`measure_step_flops` counts the FLOPs one real training step executes (hardware FLOPs,
recomputation included), with the same counter.

Cost: a few forward/backward passes of Python and shape arithmetic (under a second for a tiny
model, seconds for a 100-layer one), once per run.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

from mlflow_llmeff.calc import flops as fl
from mlflow_llmeff.calc.model_shape import _get

__all__ = ["METHOD_FORMULA", "METHOD_META", "METHOD_NONE", "FlopsSource", "resolve", "count_on_meta",
           "measure_step_flops"]

METHOD_FORMULA = "formula"
METHOD_META = "meta_count"
METHOD_NONE = "none"

#: Sequence lengths of the meta-device count (two for the fit, one to check it).
LENGTHS = (16, 32, 48)
_AFFINE_TOLERANCE = 1e-9


@dataclass(frozen=True)
class FlopsSource:
    """Where a model's FLOPs per token come from.

    Attributes:
        flops: a :class:`~mlflow_llmeff.calc.flops.ModelShape` (formula) or
            :class:`~mlflow_llmeff.calc.flops.CountedFlops` (meta count), which every function of
            :mod:`mlflow_llmeff.calc.flops` accepts; None when neither can count the model.
        method: ``formula``, ``meta_count`` or ``none``.
        note: one line for the ``llmeff.flops.method`` tag and ``llmeff flops``: the method and
            its source, or why there is no figure.
    """

    flops: fl.ModelShape | fl.CountedFlops | None
    method: str
    note: str


def resolve(config, *, recompute: fl.Recompute | None = None, count: bool = True) -> FlopsSource:
    """The FLOPs of the model ``config`` describes: formula, else meta-device count, else none (never raises).

    Args:
        config: a Hugging Face config, a :class:`~mlflow_llmeff.calc.flops.ModelShape` or a shape object.
        recompute: the activation checkpointing of the run, so that a meta count also counts what it
            re-executes (the formula computes it for any :class:`~mlflow_llmeff.calc.flops.Recompute`).
        count: allow the meta-device count (False: formula or none).
    """
    model_type = getattr(config, "model_type", None) or "shape"
    try:
        shape = fl.model_shape(config)
        return FlopsSource(shape, METHOD_FORMULA,
                           f"formula: {model_type} config fields (flops.flops_per_token; docs/formulas.md)")
    except ValueError as e:
        formula_why = str(e)
    if not count or model_type == "shape" or isinstance(config, fl.ModelShape):
        return FlopsSource(None, METHOD_NONE, f"none: {formula_why}")
    try:
        counted = count_on_meta(config, recompute=recompute)
    except ValueError as e:
        return FlopsSource(None, METHOD_NONE, f"none: the formula does not know model_type {model_type!r} and {e}")
    except Exception as e:  # noqa: BLE001 - never a crash for a figure we cannot make
        return FlopsSource(None, METHOD_NONE, f"none: the formula does not know model_type {model_type!r} and "
                                              f"its meta-device count failed ({_first_line(e)})")
    return FlopsSource(counted, METHOD_META,
                       f"meta_count: model_type {model_type!r} is not in the formula; FlopCounterMode over one "
                       f"forward+backward of the transformers model built on the meta device (eager attention), fitted "
                       f"at s = {counted.lengths[0]}, {counted.lengths[1]} and checked at s = {counted.lengths[-1]}; "
                       "causal discount and windows from the config")


def _experts(config) -> int:
    return int(_get(config, "n_routed_experts", "num_local_experts", "num_experts", default=0) or 0)


def count_on_meta(config, *, recompute: fl.Recompute | None = None, lengths=LENGTHS) -> fl.CountedFlops:
    """Count the training FLOPs per token of ``config``'s causal LM on the meta device (see the module docstring).

    Args:
        config: a ``transformers`` config of a causal LM (any ``model_type`` transformers knows).
        recompute: also count what this activation checkpointing re-executes.
        lengths: three increasing sequence lengths (two to fit ``a + b*s``, one to check it).

    Returns:
        The :class:`~mlflow_llmeff.calc.flops.CountedFlops`.

    Raises:
        ValueError: one line saying why it cannot be counted (transformers cannot build or run it on
            the meta device, the count is not affine in the sequence length, or its experts do not
            follow ``num_experts_per_tok``).
    """
    with _quiet_transformers():
        return _count_on_meta(config, recompute, tuple(lengths))


@contextmanager
def _quiet_transformers():
    """transformers' warnings about the meta model (cache under checkpointing, token ids) are noise here."""
    import transformers

    level = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        yield
    finally:
        transformers.logging.set_verbosity(level)


def _count_on_meta(config, recompute, lengths) -> fl.CountedFlops:
    model_type = getattr(config, "model_type", "?")
    layers = int(_get(config, "num_hidden_layers", "n_layer", default=0) or 0)
    s1, s2, s3 = lengths
    model = _build(config)
    per_token = {s: _count(model, s) / s for s in (s1, s2, s3)}
    b = (per_token[s2] - per_token[s1]) / (s2 - s1)  # training FLOPs per token per key, all layers
    a = per_token[s1] - b * s1
    predicted = a + b * s3
    if abs(per_token[s3] - predicted) > _AFFINE_TOLERANCE * max(1.0, abs(per_token[s3])):
        raise ValueError(f"its meta-device count is not affine in the sequence length ({per_token[s3]:.6g} FLOPs/token "
                         f"at s={s3}, {predicted:.6g} expected), so it cannot be extrapolated")
    experts = _experts(config)
    top_k = int(getattr(config, "num_experts_per_tok", 0) or 0)
    if experts > 1 and top_k:
        other = copy.deepcopy(config)
        other.num_experts_per_tok = top_k + 1 if top_k < experts else top_k - 1
        if _count(_build(other), s1) == per_token[s1] * s1:
            raise ValueError(f"its FLOPs do not change with num_experts_per_tok: the implementation runs every "
                             f"expert on every token, so the count is hardware FLOPs, not the top-{top_k} model FLOPs")
    layer_count = len(_decoder_layers(model)) or layers
    if not layer_count:
        raise ValueError("no decoder layers were found in the meta model")
    windows, chunks = fl.attention_windows(config)
    if len(windows) != layer_count:
        windows, chunks = (None,) * layer_count, (None,) * layer_count
    # Layers are assumed to share one attention width: b is split evenly (true of every family here).
    per_key = (b / layer_count,) * layer_count
    rc_weights, rc_per_key = 0.0, ()
    if recompute is not None:
        ckpt = _build(config)
        _checkpoint(ckpt, recompute)
        r = {s: _count(ckpt, s) / s - per_token[s] for s in (s1, s2)}
        rb = (r[s2] - r[s1]) / (s2 - s1)
        rc_weights = r[s1] - rb * s1
        marked = [i for i in range(layer_count) if recompute.checkpointed(i)]
        rc_per_key = tuple(rb / len(marked) if i in marked else 0.0 for i in range(layer_count)) if marked else ()
    total = sum(p.numel() for p in model.parameters())
    emb = model.get_input_embeddings()
    non_emb = total - (emb.weight.numel() if emb is not None and hasattr(emb, "weight") else 0)
    return fl.CountedFlops(model_type=model_type, weight_flops=a, attention_per_key=per_key, windows=windows,
                           chunks=chunks, lengths=(s1, s2, s3), recompute=recompute, recompute_weight_flops=rc_weights,
                           recompute_per_key=rc_per_key, params_total=total, params_non_embedding=non_emb,
                           params_active=None if experts > 1 else total)


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200]}" if text else type(e).__name__


def _build(config):
    """The causal LM of ``config`` on the meta device, eager attention, in train mode."""
    import torch
    from transformers import AutoModelForCausalLM

    cfg = copy.deepcopy(config)
    try:
        with torch.device("meta"):
            try:
                model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager",
                                                         experts_implementation="batched_mm")
            except (TypeError, ValueError):  # older transformers, or no expert kernels to choose
                model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    except Exception as e:  # noqa: BLE001 - any failure is one line for the user
        raise ValueError(f"transformers cannot build it on the meta device ({_first_line(e)})") from None
    model.train()
    return model


def _count(model, seq_len: int) -> float:
    """FLOPs FlopCounterMode counts over one forward and backward of one sequence of ``seq_len`` tokens."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    ids = torch.zeros(1, seq_len, dtype=torch.long, device="meta")
    # An explicit mask keeps transformers from inspecting position ids for packed sequences, a
    # data-dependent check the meta device cannot answer.
    mask = torch.ones(1, seq_len, dtype=torch.long, device="meta")
    counter = FlopCounterMode(display=False)
    try:
        with counter:
            out = model(input_ids=ids, attention_mask=mask, labels=ids)
            loss = out.loss if getattr(out, "loss", None) is not None else out[0]
            loss.backward()
    except Exception as e:  # noqa: BLE001
        raise ValueError(f"its forward and backward cannot run on the meta device ({_first_line(e)})") from None
    model.zero_grad(set_to_none=True)
    return float(counter.get_total_flops())


def _decoder_layers(model) -> list:
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:  # transformers < 4.52
        return []
    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def _checkpoint(model, recompute: fl.Recompute) -> None:
    """Turn on the activation checkpointing ``recompute`` describes (non-reentrant, its early stop)."""
    try:
        model.activation_checkpointing_enable(
            activation_checkpointing_kwargs={"use_reentrant": False, "early_stop": recompute.early_stop})
    except AttributeError:  # transformers < 5
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False, "early_stop": recompute.early_stop})
    except Exception as e:  # noqa: BLE001
        raise ValueError(f"activation checkpointing cannot be turned on for it ({_first_line(e)})") from None
    if recompute.layers is not None:
        for i, layer in enumerate(_decoder_layers(model)):
            layer.gradient_checkpointing = i in recompute.layers


def measure_step_flops(step_fn: Callable[[], object]) -> int:
    """Count the FLOPs one real training step executes, with ``torch.utils.flop_counter``.

    These are hardware FLOPs (HFU's numerator): activation-checkpointing recomputation is counted
    because it runs. The counter counts matmuls, convolutions and the fused GPU attention kernels
    (flash, memory-efficient, cuDNN; as the full square, without causal discount). It does NOT count
    CPU scaled-dot-product attention (``_scaled_dot_product_flash_attention_for_cpu`` has no
    formula), elementwise ops, norms or softmax. Build models with ``attn_implementation="eager"``
    to have attention counted as the two matmuls it is, or add
    :func:`~mlflow_llmeff.calc.flops.attention_flops_per_token` analytically.

    Args:
        step_fn: a callable that runs one full training step (forward, backward, optimizer step)
            of every micro-batch on this process.

    Returns:
        FLOPs counted on this process (int).
    """
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter:
        step_fn()
    return int(counter.get_total_flops())
