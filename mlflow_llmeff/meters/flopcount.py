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
from mlflow_llmeff.names import shorten

__all__ = ["METHOD_FORMULA", "METHOD_META", "METHOD_NONE", "FlopsSource", "resolve", "count_on_meta",
           "measure_step_flops", "step_counter", "sdpa_flops", "sdpa_backward_flops", "causal_pairs",
           "attention_kernel"]

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
    return f"{type(e).__name__}: {shorten(text[0], 200)}" if text else type(e).__name__


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


# --------------------------------------------------------------------------- which attention kernel runs
#: transformers attention implementations (``config._attn_implementation``) whose kernel skips the
#: masked triangle of a causal decoder, with what is assumed of each.
CAUSAL_KERNELS = {
    "sdpa": "causal kernel assumed: transformers calls it with is_causal=True and no mask when a batch has no "
            "padding and no packed documents; a padding or document mask makes it compute the full square",
    "flash_attention_2": "causal kernel (causal=True; packed documents run varlen, each its own triangle)",
    "flash_attention_3": "causal kernel (causal=True; packed documents run varlen, each its own triangle)",
    "flex_attention": "causal block mask: fully masked blocks are skipped",
}


def attention_kernel(impl: str | None) -> tuple[bool, str]:
    """Whether a decoder's attention kernel skips the masked triangle.

    ``impl`` is the config's ``_attn_implementation`` (what transformers runs); every model type
    the formula knows is a causal decoder. Eager attention builds the score matrix of every pair and
    then masks it: the full square; an unknown or unset kernel is counted as the full square too
    (the count that cannot be below what ran).

    Args:
        impl: ``sdpa``, ``eager``, ``flash_attention_2``, ... or None when unknown.

    Returns:
        ``(causal, note)``: True for a causal kernel, and one line naming the kernel and what was assumed.
    """
    if impl in CAUSAL_KERNELS:
        return True, f"{impl}: {CAUSAL_KERNELS[impl]}"
    if impl == "eager":
        return False, "eager: the full square (scores of every query-key pair computed, then masked)"
    return False, f"{impl or 'unset'}: kernel unknown, the full square assumed"


# --------------------------------------------------------------------------- a counter that never stops a step
def causal_pairs(s_q: int, s_k: int) -> int:
    """Query-key pairs a causal kernel computes for ``s_q`` queries and ``s_k`` keys (one head).

    The mask of ``is_causal=True`` in ``torch.nn.functional.scaled_dot_product_attention`` is the
    top-left lower triangle (query ``i`` sees keys ``0..i``): ``s_q(s_q+1)/2`` pairs when
    ``s_q <= s_k``, plus ``s_k`` per further query. The diagonal is included; the masked half of
    the diagonal tiles a tiled kernel also computes is not (:func:`mlflow_llmeff.calc.flops.executed_attended_keys`).
    """
    if s_q <= s_k:
        return s_q * (s_q + 1) // 2
    return s_k * (s_k + 1) // 2 + (s_q - s_k) * s_k


def sdpa_flops(query_shape, key_shape, value_shape, is_causal: bool = False) -> int:
    """Forward FLOPs of one scaled-dot-product attention call, grouped-query attention included.

    ``2 b h_q P (d_qk + d_v)`` with ``P = s_q s_k`` pairs (a dense kernel) or :func:`causal_pairs`
    (``is_causal``: the kernel skips the masked triangle; Dao 2023, FlashAttention-2, Sec. 3.1.1):
    the score matmul ``Q K^T`` and the weighted sum ``P V``, each key/value head broadcast to the
    ``h_q / h_kv`` query heads of its group (the kernels do the same work as for ``h_q`` key/value
    heads). Dense, it is ``torch.utils.flop_counter.sdpa_flop_count`` of torch >= 2.12, which has no
    causal discount; torch 2.11 asserts equal head counts there, and a GQA model (Llama-1B's 32/4
    heads) stopped its first training step on an H200 inside the counter (bench/gpu_check.sh, 2026-12-04).

    Args:
        query_shape: ``(b, h_q, s_q, d_qk)``; key_shape ``(b, h_kv, s_k, d_qk)``; value_shape ``(b, h_kv, s_k, d_v)``.
        is_causal: the call's ``is_causal``.

    Raises:
        ValueError: shapes that do not fit together (``h_q`` not a multiple of ``h_kv``, ...).
    """
    b, h_q, s_q, d_q = query_shape
    b2, h_kv, s_k, d_k = key_shape
    b3, h_v, s_v, d_v = value_shape
    if not (b == b2 == b3 and h_kv == h_v and d_q == d_k and s_k == s_v) or h_kv < 1 or h_q % h_kv:
        raise ValueError(f"attention shapes q={tuple(query_shape)} k={tuple(key_shape)} v={tuple(value_shape)} "
                         "do not fit (query heads a multiple of key/value heads)")
    return 2 * b * h_q * (causal_pairs(s_q, s_k) if is_causal else s_q * s_k) * (d_q + d_v)


def sdpa_backward_flops(grad_out_shape, query_shape, key_shape, value_shape, is_causal: bool = False) -> int:
    """Backward FLOPs of one scaled-dot-product attention call, grouped-query attention included.

    ``2 b h_q P (3 d_qk + 2 d_v)``, ``P`` as in :func:`sdpa_flops`: the scores recomputed
    (``Q K^T``), ``dP = dO V^T``, ``dV = P^T dO``, ``dQ = dS K`` and ``dK = dS^T Q``
    (torch.utils.flop_counter's ``sdpa_backward_flop_count``, with grouped key/value heads as in
    :func:`sdpa_flops` and the causal triangle where the call is causal).

    Raises:
        ValueError: shapes that do not fit together.
    """
    b, h_q, s_q, d_q = query_shape
    _, _, s_k, _ = key_shape
    d_v = value_shape[3]
    sdpa_flops(query_shape, key_shape, value_shape)  # the same shape checks
    if tuple(grad_out_shape) != (b, h_q, s_q, d_v):
        raise ValueError(f"attention gradient shape {tuple(grad_out_shape)} is not (b, h_q, s_q, d_v)")
    return 2 * b * h_q * (causal_pairs(s_q, s_k) if is_causal else s_q * s_k) * (3 * d_q + 2 * d_v)


#: Where ``is_causal`` sits among the positional arguments of each attention op (their schemas in
#: ``aten/src/ATen/native/native_functions.yaml``, torch 2.13; a test checks them against the schemas).
CAUSAL_ARG = {"_scaled_dot_product_flash_attention": 4, "_scaled_dot_product_flash_attention_backward": 11,
              "_scaled_dot_product_efficient_attention": 6, "_scaled_dot_product_efficient_attention_backward": 11,
              "_scaled_dot_product_cudnn_attention": 6, "_scaled_dot_product_cudnn_attention_backward": 14,
              "_scaled_dot_product_flash_attention_for_cpu": 4,
              "_scaled_dot_product_flash_attention_for_cpu_backward": 7}


def _is_causal(op_name: str, args, kwargs) -> bool:
    """The ``is_causal`` argument of one call of the attention op ``op_name`` (False where it defaults)."""
    if "is_causal" in kwargs:
        return bool(kwargs["is_causal"])
    index = CAUSAL_ARG[op_name]
    return bool(args[index]) if index < len(args) else False


def step_counter():
    """A ``torch.utils.flop_counter.FlopCounterMode`` for counting a real training step that never
    stops the step it counts.

    Every formula torch registers runs inside the step's own dispatch; one that raises (a shape it
    does not expect, as torch 2.11's attention formula does for grouped-query attention) would end
    the user's training in its first step. Here each formula that raises counts 0 for that call and
    names its op in the counter's ``llmeff_failed_ops`` (a set), so the count comes out below the
    formula and is treated as a counter gap (HFU keeps the analytic ratio, never a lower count);
    the fused attention kernels (flash, memory-efficient, cuDNN; forward and backward) are counted
    with :func:`sdpa_flops` / :func:`sdpa_backward_flops`, which know grouped key/value heads and
    count a causal call (``is_causal=True``) at the triangle it computes. Every forward attention
    call it sees, CPU SDPA's included (which it still counts 0: the caller adds it analytically),
    is listed in the counter's ``llmeff_attention`` as ``(kernel, is_causal)``: what the step ran.
    """
    import torch
    from torch.utils import flop_counter as tfc

    failed: set[str] = set()
    seen: list[tuple[str, bool]] = []

    def never_raises(formula, op):
        def count(*args, **kwargs):
            try:
                return formula(*args, **kwargs)
            except Exception:  # noqa: BLE001 - a count is never worth the step
                failed.add(str(op))
                return 0
        count._get_raw = True  # already takes tensors (torch's shape_wrapper), FlopCounterMode calls it as is
        return count

    aten = torch.ops.aten
    own = {}

    def forward(op_name, cpu):
        def count(q, k, v, *a, out_shape=None, **kw):
            causal = _is_causal(op_name, (q, k, v, *a), kw)
            seen.append((op_name.removeprefix("_scaled_dot_product_"), causal))
            return 0 if cpu else sdpa_flops(q, k, v, causal)
        return tfc.shape_wrapper(count)

    def backward(op_name, cpu):
        def count(g, q, k, v, *a, out_shape=None, **kw):
            return 0 if cpu else sdpa_backward_flops(g, q, k, v, _is_causal(op_name, (g, q, k, v, *a), kw))
        return tfc.shape_wrapper(count)

    for name in ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                 "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu"):
        cpu = name.endswith("_for_cpu")  # invisible to torch's counter: counted 0, seen, added by the caller
        if hasattr(aten, name):
            own[getattr(aten, name)] = forward(name, cpu)
        if hasattr(aten, name + "_backward"):
            own[getattr(aten, name + "_backward")] = backward(name + "_backward", cpu)
    mapping = {op: never_raises(own.get(op, f), op) for op, f in tfc.flop_registry.items()}
    mapping.update({op: never_raises(f, op) for op, f in own.items() if op not in mapping})
    counter = tfc.FlopCounterMode(display=False, custom_mapping=mapping)
    counter.llmeff_failed_ops = failed
    counter.llmeff_attention = seen
    return counter


def measure_step_flops(step_fn: Callable[[], object]) -> int:
    """Count the FLOPs one real training step executes, with ``torch.utils.flop_counter``.

    These are hardware FLOPs (HFU's numerator): activation-checkpointing recomputation is counted
    because it runs. The counter counts matmuls, convolutions and the fused GPU attention kernels
    (flash, memory-efficient, cuDNN; the full square, or the triangle of a call with ``is_causal=True``:
    :func:`sdpa_flops`). It does NOT count
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
    counter = step_counter()
    with counter:
        step_fn()
    return int(counter.get_total_flops())


# --------------------------------------------------------------------------- what a real-step count cannot see
#: A real-step count below the formula's hardware FLOPs by more than this fraction is a measurement
#: gap, not a lower HFU: counted and analytic agree within 1% where the counter sees every kernel
#: (docs/formulas.md, "MFU and HFU"; tests/test_monitor.py).
GAP_TOLERANCE = 0.01


@dataclass(frozen=True)
class CounterGap:
    """A ``FlopCounterMode`` count of a real step that came out below the formula.

    Attributes:
        counted: FLOPs the counter saw (plus what was added analytically, e.g. CPU SDPA).
        expected: hardware FLOPs the formula gives for the same tokens (recomputation included).
        unseen: modules holding weight matrices that ran in the step and counted no FLOPs (their
            kernels are invisible to the counter: custom ops, fused expert kernels), by name.
    """

    counted: float
    expected: float
    unseen: tuple[str, ...] = ()
    failed_ops: tuple[str, ...] = ()

    def note(self) -> str:
        """One line for the ``llmeff.flops.counter_gap`` tag."""
        share = self.counted / self.expected if self.expected else 0.0
        seen = (f"modules it could not see: {', '.join(self.unseen[:8])}"
                + (f" and {len(self.unseen) - 8} more" if len(self.unseen) > 8 else "")) if self.unseen else \
            "no module with weights counted zero (a kernel inside a counted module is invisible)"
        if self.failed_ops:
            seen += f"; ops whose FLOPs formula failed (counted 0): {', '.join(self.failed_ops)}"
        return (f"FlopCounterMode counted {share:.1%} of the formula's hardware FLOPs on a real step; {seen}; "
                "HFU uses the analytic ratio (the count is a measurement gap, not lower hardware FLOPs)")


def counter_gap(counted: float, expected: float, unseen=(), *, tolerance: float = GAP_TOLERANCE,
                failed_ops=()) -> CounterGap | None:
    """The gap when ``counted`` is below ``expected`` by more than ``tolerance`` (a fraction), or when
    any op's formula failed inside the count (``failed_ops``: the count is incomplete whatever its
    size), else None.

    Args:
        counted: FLOPs a real step counted (this rank's, scaled as the caller compares them).
        expected: the formula's hardware FLOPs for the same tokens
            (:func:`~mlflow_llmeff.calc.flops.hardware_flops_per_token` x tokens).
        unseen: :func:`unseen_modules` of the step.
        failed_ops: ops whose formula raised and counted 0 (:func:`step_counter`'s ``llmeff_failed_ops``).

    Raises:
        ValueError: for a negative count or a non-positive expectation.
    """
    if counted < 0 or not expected > 0:
        raise ValueError(f"counted={counted!r} must be >= 0 and expected={expected!r} > 0 FLOPs")
    if counted >= expected * (1.0 - tolerance) and not failed_ops:
        return None
    return CounterGap(float(counted), float(expected), tuple(unseen), tuple(sorted(failed_ops)))


@contextmanager
def modules_that_run():
    """Collect the modules whose forward runs inside, with the rows they took (a global forward
    hook, removed on exit).

    Yields:
        A dict that fills with ``id(module) -> rows``: the rows (``numel / last dim`` of the first
        tensor argument, i.e. tokens) summed over every call of the module.
    """
    import torch
    from torch.nn.modules.module import register_module_forward_hook

    rows: dict[int, int] = {}

    def hook(m, args, kwargs, out):
        x = next((a for a in list(args) + list(kwargs.values()) if torch.is_tensor(a) and a.dim() >= 1), None)
        n = x.numel() // max(1, x.shape[-1]) if x is not None else 0
        rows[id(m)] = rows.get(id(m), 0) + int(n)

    handle = register_module_forward_hook(hook, with_kwargs=True)
    try:
        yield rows
    finally:
        handle.remove()


def unseen_modules(model, flop_counts, rows, *, top_k: int | None = None) -> tuple[str, ...]:
    """Modules of ``model`` whose matrices ran but whose counted FLOPs are under half of what they did.

    A module multiplies every row it takes by each weight matrix of its own: a training step
    costs ``6 x rows x numel`` FLOPs for a 2-D weight (forward, input and weight gradients), and
    ``6 x rows x top_k x numel / E`` for a stack of ``E`` matrices (an experts block's
    ``(E, f, h)`` weights, ``top_k`` experts a token). A module that counted less than half of that
    (frozen weights and the first layer's missing input gradient still count 2/3) runs a kernel
    ``FlopCounterMode`` has no formula for: a custom op, a fused mixture-of-experts kernel such as
    ``torch._grouped_mm`` on CPU. Embeddings (lookups) multiply nothing.

    Args:
        model: the module the counted step ran (wrappers are looked through by name suffix).
        flop_counts: ``FlopCounterMode.get_flop_counts()`` (``{module path: {op: FLOPs}}``, paths
            ``<RootClass>.<name in the model>``).
        rows: :func:`modules_that_run`'s ``id(module) -> rows``; a module absent did not run.
        top_k: experts a token uses (default: the model config's ``num_experts_per_tok``, else 1).

    Returns:
        The names (``model.named_modules()``) of the modules the counter could not see.
    """
    import torch

    if top_k is None:
        top_k = int(getattr(getattr(model, "config", None), "num_experts_per_tok", None) or 1)
    counted = [(k, sum(v.values())) for k, v in flop_counts.items()]
    out = []
    for name, m in model.named_modules():
        n_rows = rows.get(id(m), 0)
        if not name or isinstance(m, torch.nn.Embedding) or n_rows == 0:
            continue
        per_row = sum(p.numel() * top_k // p.shape[0] if p.dim() >= 3 else p.numel()
                      for p in m.parameters(recurse=False) if p.dim() >= 2)
        if per_row == 0:
            continue
        got = max((n for k, n in counted if k == name or k.endswith("." + name)), default=0)
        if got < 0.5 * 6 * n_rows * per_row:
            out.append(name)
    return tuple(out)
