"""Training FLOPs per token from a model config, parameter counts, and MFU / HFU arithmetic.

Pure arithmetic: nothing here touches a device, and there is no torch here (a real step's FLOPs are
counted by :func:`mlflow_llmeff.meters.flopcount.measure_step_flops`). Every term is derived in
``docs/formulas.md``; the short version:

For one token and one decoder layer, a matrix multiply ``(1 x a) @ (a x b)`` costs ``2ab`` FLOPs
forward (one multiply and one add per weight) and ``4ab`` backward (gradient w.r.t. the input and
w.r.t. the weight), so every weight matrix costs ``6ab`` per trained token. Summing over the weight
matrices of a layer gives the ``6N`` of Kaplan et al. 2020 (Sec. 2.1) and PaLM (Chowdhery et al.
2022, App. B); attention scores and the weighted sum of values add ``6 * n*(d_qk + d_v) * k`` per
layer, where ``k`` is the number of keys a query attends to (training: 3 x the forward
``2*n*d_qk*k + 2*n*d_v*k``; ``12*(n*d)*k`` when the key and value heads are as wide).

Conventions (``convention=``):
  * ``megatron`` (default): causal attention counted once, i.e. a query attends on average
    ``s/2`` keys (Megatron-LM ``num_floating_point_operations`` since 2025-03; NeMo
    ``flops_formulas.llama3``). For a SwiGLU decoder this is exactly the formula of ``docs/formulas.md``
    ``L*h^2*(12 + 12*g/n + 18*f/h + 6*s/h) + 6*h*V``.
  * ``palm``: no causal discount, ``6N + 12*L*h*s`` (PaLM App. B; nanoGPT, torchtitan,
    llm-foundry). Norm weights and biases are left out of ``N``, as in ``docs/formulas.md``'s reference values.

The formula reads each family's own config fields (:data:`FORMULA_TYPES`): head width apart from
hidden/heads, query and key/value heads, gated or plain MLP and its width, MoE routed experts with
``top_k`` and shared experts (DeepSeek-V3, Qwen2-MoE), dense layers before or between MoE layers,
MLA low-rank query and key/value projections (DeepSeek-V3), tied embeddings, sliding-window and
chunked attention per layer. What is counted: every weight matmul (the LM head always, even when
tied to the input embedding) and the two attention matmuls. What is not: the input embedding
lookup and learned positions (a gather, no FLOPs), norms, activations, softmax, residual adds,
biases and RoPE (O(h) per token against O(h^2), well under 1% for real models). A model type the
formula does not know is counted once on the meta device (:mod:`mlflow_llmeff.meters.flopcount`), which
yields a :class:`CountedFlops` that every function here accepts in place of a config.

Frozen weights and adapters (``trainable=``, a :class:`Trainable`): a frozen weight costs no
weight gradient, an input gradient only above the lowest trainable weight, and LoRA adapters add
their own matmuls (:func:`flops_per_token`). Hardware FLOPs (HFU) count attention as the kernel
executes it: the dense square, or the causal triangle ``l(l+1)/2`` of a kernel that skips the mask
(:func:`executed_attended_keys`, :func:`hardware_flops_per_token`).

The model's shapes and parameter counts (:class:`ModelShape`, :func:`model_shape`,
:func:`attention_windows`, :func:`param_counts`, :class:`CountedFlops`, :class:`Recompute`) are read in
:mod:`mlflow_llmeff.calc.model_shape` and re-exported here.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from mlflow_llmeff.calc.model_shape import (
    _NORM_STAGES,
    ATTENTION,
    FORMULA_TYPES,
    MLP_OUT,
    QKV,
    Adapter,
    CountedFlops,
    ModelShape,
    Recompute,
    Trainable,
    attention_windows,
    model_shape,
    param_counts,
)

__all__ = [
    "CONVENTIONS",
    "FORMULA_TAGS",
    "FORMULA_TYPES",
    "ModelShape",
    "CountedFlops",
    "Recompute",
    "Trainable",
    "Adapter",
    "model_shape",
    "attention_windows",
    "flops_per_token",
    "flops_summary",
    "attention_flops_per_token",
    "recompute_flops_per_token",
    "hardware_flops_per_token",
    "hardware_model_ratio",
    "mean_attended_keys",
    "executed_attended_keys",
    "effective_seq_len",
    "param_counts",
    "utilization",
    "mfu_warning",
]

CONVENTIONS = ("megatron", "palm")

#: Text for the ``llmeff.flops.formula`` tag, per convention.
FORMULA_TAGS = {
    "megatron": "megatron: causal attention counted once; per layer 6*(attn+mlp weights) + 6*h_attn*s, "
                "+ 6*h*V LM head (Megatron-LM num_floating_point_operations 2025-03, NeMo flops_formulas.llama3)",
    "palm": "palm: 6*N (matmul weights, LM head included) + 12*L*h_attn*s, no causal discount "
            "(Chowdhery et al. 2022, PaLM App. B)",
}


def _check_convention(convention: str) -> None:
    if convention not in CONVENTIONS:
        raise ValueError(f"convention {convention!r} is not accepted; use one of {', '.join(CONVENTIONS)}")


def _lengths(seq_len) -> list[float]:
    if isinstance(seq_len, (int, float)):
        lengths = [float(seq_len)]
    else:
        lengths = [float(x) for x in seq_len]
    if not lengths or any(not math.isfinite(x) or x < 0 for x in lengths) or sum(lengths) <= 0:
        raise ValueError(f"seq_len {seq_len!r} is not accepted; give a positive length or a "
                         "non-empty sequence of non-negative lengths with a positive sum")
    return lengths


def mean_attended_keys(seq_len: float | Sequence[float], window: int | None = None,
                       convention: str = "megatron", chunk: int | None = None) -> float:
    """Mean number of keys a query attends to, per token (the ``k`` of the attention term).

    ``megatron`` counts the causal mask as the continuous triangle: a sequence of ``l`` tokens
    attends ``l^2/2`` query-key pairs (mean ``l/2``, the "causal attention counted once" of
    Megatron-LM). With a sliding window ``w < l`` the band of the triangle holds
    ``w*l - w^2/2`` pairs (the triangle minus the ``(l-w)^2/2`` corner the window cuts off), which
    equals ``l^2/2`` at ``w = l``, so the two agree at the boundary. With chunked attention
    (Llama-4: a query sees only the keys of its own chunk of ``c`` tokens) the ``q = floor(l/c)``
    full chunks hold ``q*c^2/2`` pairs and the remainder ``r = l - q*c`` holds ``r^2/2``. ``palm``
    does not discount the mask: every query attends ``min(l, w)`` keys, or its whole chunk
    (``q*c^2 + r^2`` pairs).

    Args:
        seq_len: one (effective) sequence length in tokens, or the real lengths ``l_i`` of every
            sequence in a batch (then the pairs are summed per sequence: exact for packed and
            variable-length batches, sliding window included).
        window: sliding-window size in tokens, or None for full attention.
        convention: ``megatron`` or ``palm``.
        chunk: chunk size of chunked attention in tokens, or None.

    Returns:
        Keys per token; for lengths ``l_i`` and no window, ``megatron`` gives
        ``effective_seq_len(l)/2`` and ``palm`` gives ``effective_seq_len(l)``.
    """
    _check_convention(convention)
    lengths = _lengths(seq_len)
    for label, v in (("window", window), ("chunk", chunk)):
        if v is not None and v <= 0:
            raise ValueError(f"{label} {v!r} is not accepted; give a positive number of tokens or None")
    half = convention == "megatron"
    pairs = 0.0
    for l in lengths:
        if chunk is not None and chunk < l:
            q = math.floor(l / chunk)
            r = l - q * chunk
            pairs += (q * chunk * chunk + r * r) * (0.5 if half else 1.0)
            continue
        w = l if window is None else min(float(window), l)
        pairs += (w * l - w * w / 2.0) if half else w * l
    return pairs / sum(lengths)


#: Internal key conventions for hardware FLOPs: what a causal or a dense kernel computes.
_KERNEL_KEYS = {"causal_kernel": True, "dense_kernel": False}


def _layer_keys(model, seq_len, convention: str) -> list[float]:
    """Mean attended keys per layer of a :class:`ModelShape` or :class:`CountedFlops` (``convention``
    also ``causal_kernel`` / ``dense_kernel``: :func:`executed_attended_keys`)."""
    layers = model.layers
    windows = model.windows or (None,) * layers
    chunks = model.chunks or (None,) * layers
    cache: dict[tuple, float] = {}
    out = []
    for w, c in zip(windows, chunks):
        if (w, c) not in cache:
            cache[(w, c)] = (executed_attended_keys(seq_len, w, causal=_KERNEL_KEYS[convention], chunk=c)
                             if convention in _KERNEL_KEYS else mean_attended_keys(seq_len, w, convention, c))
        out.append(cache[(w, c)])
    return out


def _model(config):
    """A :class:`CountedFlops` as it is, else the config's :class:`ModelShape`."""
    return config if isinstance(config, CountedFlops) else model_shape(config)


def attention_flops_per_token(config, seq_len: float | Sequence[float],
                              convention: str = "megatron", *, causal_kernel: bool | None = None,
                              trainable: Trainable | None = None) -> float:
    """Training FLOPs per token of the attention-score matmuls alone (QK^T and scores @ V).

    ``sum over layers of 6 * n*(d_qk + d_v) * k_layer`` (``12*(n*d)*k`` for equal head widths):
    forward ``2*n*d_qk*k`` for QK^T and ``2*n*d_v*k`` for the weighted sum of values, times 3 for
    forward + backward. Useful where the flop counter cannot see attention (CPU scaled-dot-product
    attention), at the share its kernel computes (``causal_kernel``).

    Args:
        config: as for :func:`model_shape`, or a :class:`CountedFlops`.
        seq_len: as for :func:`mean_attended_keys`.
        convention: ``megatron`` or ``palm``.
        causal_kernel: None for model FLOPs (``convention``); True / False for what a causal /
            dense kernel executes (:func:`executed_attended_keys`; ``convention`` is then ignored).
        trainable: what trains (None: everything): a layer whose attention has nothing trainable
            below it runs the forward only (a third of the above).

    Raises:
        ValueError: as :func:`flops_per_token`.
    """
    m = _model(config)
    if causal_kernel is not None:
        convention = "causal_kernel" if causal_kernel else "dense_kernel"
    keys = _layer_keys(m, seq_len, convention)
    if isinstance(m, CountedFlops):
        if trainable is not None:
            flops_per_token(m, seq_len, "palm", trainable)  # raises: no per-matrix breakdown
        return sum(b * k for b, k in zip(m.attention_per_key, keys))
    backward = _attention_backward(m, trainable)
    return sum(2.0 * m.attention_width() * k * (3.0 if b else 1.0) for k, b in zip(keys, backward))


def _attention_backward(m: ModelShape, trainable: Trainable | None) -> list[bool]:
    """Per layer, whether the attention matmuls' inputs need gradients (something trainable below them)."""
    if trainable is None:
        return [True] * m.layers
    flags, grad = [], trainable.embedding
    with_adapter = {(a.layer, a.matrix) for a in trainable.adapters}
    for i in range(m.layers):
        names = trainable.layers[i]
        early = {x.name for x in m.layer_matrices(i) if x.stage < ATTENTION}
        grad = grad or any(_NORM_STAGES.get(n, ATTENTION) < ATTENTION or n in early for n in names) \
            or any((i, e) in with_adapter for e in early)
        flags.append(grad)
        grad = grad or bool(names) or any(layer == i for layer, _ in with_adapter)
    return flags


def executed_attended_keys(seq_len: float | Sequence[float], window: int | None = None, *, causal: bool,
                           chunk: int | None = None) -> float:
    """Mean keys per query an attention kernel computes, per token (hardware FLOPs' ``k``).

    A dense kernel (eager attention with a mask tensor, SDPA given an explicit mask) computes the
    whole ``l x l`` square (or ``l x w`` band): :func:`mean_attended_keys` ``palm``. A causal kernel
    (SDPA with ``is_causal=True``, Flash-Attention ``causal=True``, flex attention's block mask)
    skips the masked upper triangle (Dao 2023, "FlashAttention-2", Sec. 3.1.1 "Causal masking":
    blocks above the diagonal are skipped). Counted here as the exact triangle with its diagonal,
    ``l(l+1)/2`` pairs per sequence (``megatron``'s ``l^2/2`` plus ``l/2``; a window ``w`` adds
    ``w/2``): a tiled kernel also computes the masked half of each diagonal tile of ``B x B``, about
    ``l*B/2`` pairs more (``B/l``: 3% at ``l = 4096``, ``B = 128``), but ``B`` depends on the kernel,
    the head width, the GPU and the direction (forward, backward), none of which the monitor can
    read, so the count stays the kernel-independent lower bound.

    Args:
        seq_len, window, chunk: as for :func:`mean_attended_keys`.
        causal: True for a causal kernel, False for a dense one.

    Raises:
        ValueError: as :func:`mean_attended_keys`.
    """
    if not causal:
        return mean_attended_keys(seq_len, window, "palm", chunk)
    keys = mean_attended_keys(seq_len, window, "megatron", chunk)
    lengths = _lengths(seq_len)
    diagonal = sum(l if (chunk is not None and chunk < l) or window is None else min(float(window), l)
                   for l in lengths)
    return keys + diagonal / 2.0 / sum(lengths)


#: Which of Q, K, V each attention projection feeds (MLA's latent key/value projections feed both K and V).
_FEEDS = {"q_proj": "q", "q_a_proj": "q", "q_b_proj": "q", "k_proj": "k", "v_proj": "v",
          "kv_a_proj_with_mqa": "kv", "kv_b_proj": "kv"}


def _trained_flops(m: ModelShape, keys: list[float], trainable: Trainable, autograd_attention: bool = False) -> float:
    """Training FLOPs per token of ``m`` when only ``trainable`` trains (see :func:`flops_per_token`).

    ``autograd_attention``: the attention matmuls' backward as eager autograd runs it, each input
    gradient only where its operand needs one (``dQ``, ``dK`` of ``Q K^T``; ``dP``, ``dV`` of ``P V``),
    instead of all of them (what the fused kernels compute, and the model-FLOPs rule)."""
    if len(trainable.layers) != m.layers:
        raise ValueError(f"the trainable description has {len(trainable.layers)} layers, the model {m.layers}")
    adapters: dict[tuple[int, str], list[Adapter]] = {}
    for a in trainable.adapters:
        adapters.setdefault((a.layer, a.matrix), []).append(a)
    grad = trainable.embedding  # the residual stream entering the layer needs a gradient
    total = 0.0
    for i in range(m.layers):
        names = trainable.layers[i]
        mats = m.layer_matrices(i)
        unknown = [a.matrix for (layer, _), ads in adapters.items() if layer == i for a in ads
                   if a.matrix not in {x.name for x in mats}]
        if unknown:
            raise ValueError(f"adapters on {', '.join(unknown)} match no matrix of layer {i}")
        for stage in range(MLP_OUT + 1):
            # a trainable norm or the whole layer marked from this stage on: later inputs need gradients
            here = any(_NORM_STAGES.get(n) == stage for n in names)
            if stage == QKV:
                fed = {c for x in mats if x.stage == QKV and (x.name in names or "*" in names or (i, x.name) in adapters)
                       for c in _FEEDS.get(x.name, "qkv")}
                needs = {c: grad or c in fed for c in "qkv"}  # Q, K, V need gradients
            if stage == ATTENTION:  # scores and context: forward, plus both input gradients below something trainable
                total += 2.0 * m.attention_width() * keys[i] * (1.0 if autograd_attention else (3.0 if grad else 1.0))
                if autograd_attention:
                    d_qk, d_v = m.heads * m.head_dim, m.attention_width() - m.heads * m.head_dim
                    scores = needs["q"] or needs["k"]  # P needs a gradient
                    total += 2.0 * keys[i] * (d_qk * (needs["q"] + needs["k"]) + d_v * (scores + needs["v"]))
            for mat in (x for x in mats if x.stage == stage):
                w = mat.weights
                trains = mat.name in names or "*" in names
                total += 2.0 * w + (2.0 * w if grad else 0.0) + (2.0 * w if trains else 0.0)
                for a in adapters.get((i, mat.name), ()):
                    # A: forward, weight gradient, input gradient where x needs one; B: forward, weight
                    # gradient and input gradient (its input x A^T always depends on A)
                    total += 2.0 * a.rank * a.d_in * (3.0 if grad else 2.0) + 6.0 * a.rank * a.d_out
                    here = True
                here = here or trains
            grad = grad or here
    lm = m.hidden * m.vocab
    return total + 2.0 * lm + (2.0 * lm if grad else 0.0) + (2.0 * lm if trainable.lm_head else 0.0)


def flops_per_token(config, seq_len: float | Sequence[float], convention: str = "megatron",
                    trainable: Trainable | None = None) -> float:
    """Training FLOPs per token (forward + backward) of a decoder-only transformer.

    ``F = sum_layers [6*W_l + 6*n*(d_qk + d_v)*k_l] + 6*h*V``, where ``W_l`` are the matmul weights
    one token goes through in layer ``l`` (:meth:`ModelShape.layer_weights`: Q/K/V/O or the MLA
    projections; the dense MLP, or the router, the ``top_k`` routed experts and the shared
    experts) and ``k_l`` its mean attended keys (:func:`mean_attended_keys`, with the layer's
    window or chunk). For Llama with ``n*d = h`` this is the formula of ``docs/formulas.md``
    ``L*h^2*(12 + 12*g/n + 18*f/h + 6*s/h) + 6*h*V``. Derivation and sources in the module
    docstring and ``docs/formulas.md``. A :class:`CountedFlops` gives its counted weight FLOPs plus
    its counted attention cost per key times the same ``k_l``.

    Args:
        config: a Hugging Face config, shape object or :class:`CountedFlops` (see :func:`model_shape`).
        seq_len: tokens per sequence, or the effective length ``sum(l^2)/sum(l)`` of a
            variable-length / packed batch (:func:`effective_seq_len`), or the list of real lengths
            (exact also under a sliding window).
        convention: ``megatron`` (causal attention counted once) or ``palm`` (no causal discount).
        trainable: what trains (:class:`Trainable`), or None for every weight (the ``6`` above).
            With frozen weights, per token and weight: forward 2, input gradient 2 where
            something trainable lies below (every stage above the lowest trainable weight, never
            a layer below it; the LM head whenever anything below it trains), weight gradient 2
            for a trainable weight only; attention's two matmuls cost 2x their forward in backward
            where something trainable lies below them, nothing otherwise; a LoRA adapter of rank
            ``r`` on a ``d_in x d_out`` matrix adds ``2r(d_in + d_out)`` forward, as much in weight
            gradients, ``2r*d_out`` input gradient of ``B`` and ``2r*d_in`` of ``A`` where its input
            needs one (Hu et al. 2021; NeMo Automodel PR #786, VeOmni PR #983). Everything
            trainable (embedding included) gives the ``6N`` count exactly.

    Returns:
        FLOPs per trained token (float; multiply by tokens for FLOPs per step).

    Raises:
        ValueError: for an unknown convention, a bad length, an unsupported config, or a
            ``trainable`` that does not fit the model (or a meta-device count, which has no
            per-matrix breakdown).
    """
    _check_convention(convention)
    m = _model(config)
    if trainable is not None:
        if isinstance(m, CountedFlops):
            raise ValueError(f"model_type {m.model_type!r} was counted on the meta device, which has no per-matrix "
                             "breakdown for frozen weights; pass trainable=None")
        return _trained_flops(m, _layer_keys(m, seq_len, convention), trainable)
    if isinstance(m, CountedFlops):
        return m.weight_flops + attention_flops_per_token(m, seq_len, convention)
    weights = sum(m.layer_weights(i) for i in range(m.layers)) + m.hidden * m.vocab  # LM head always counted
    return 6.0 * weights + attention_flops_per_token(m, seq_len, convention)


def recompute_flops_per_token(config, seq_len: float | Sequence[float], recompute: "Recompute | None", *,
                              attention_only: bool = False, causal_kernel: bool = False,
                              trainable: Trainable | None = None) -> float:
    """Forward FLOPs per token that activation checkpointing runs a second time (hardware, not model FLOPs).

    The checkpointing wrapper re-executes each checkpointed decoder layer's forward during
    backward: ``2*W_l + 2*n*(d_qk + d_v)*k_l`` per token (attention with every key the dense
    kernel computes: ``palm`` keys). The LM head, the final norm and the embedding are outside the
    layers and never recomputed. PyTorch's non-reentrant checkpoint stops early (``early_stop``,
    its default): once the last tensor that backward needs is recomputed, the rest of the layer
    is skipped, i.e. the layer's last matmul when its output only feeds a residual add
    (:meth:`ModelShape.tail_weights`; ``2*h*f`` of the down projection in a Llama layer). A
    :class:`CountedFlops` returns the recomputation counted on the meta device under the same
    :class:`Recompute`.

    Args:
        config: as for :func:`flops_per_token`.
        seq_len: as for :func:`mean_attended_keys`.
        recompute: what is checkpointed, or None for no checkpointing (0 FLOPs).
        attention_only: only the recomputed attention matmuls (what a counter blind to the
            attention kernel misses).
        causal_kernel: the attention kernel skips the masked triangle (:func:`executed_attended_keys`);
            False: it computes the dense square.
        trainable: what trains (None: everything). A checkpointed layer that backward never
            reaches (frozen, below every trainable weight) is not recomputed; adapters' forward
            (``2r(d_in + d_out)``) is recomputed with their layer.

    Raises:
        ValueError: for a :class:`CountedFlops` counted without this recomputation.
    """
    if recompute is None:
        return 0.0
    m = _model(config)
    keys = _layer_keys(m, seq_len, "causal_kernel" if causal_kernel else "dense_kernel")
    reached = _reached_layers(m.layers, trainable)
    if isinstance(m, CountedFlops):
        if trainable is not None:
            raise ValueError(f"model_type {m.model_type!r} was counted on the meta device, which has no per-matrix "
                             "breakdown for frozen weights; pass trainable=None")
        if m.recompute != recompute:
            raise ValueError(f"the meta-device count of {m.model_type!r} was made with recompute={m.recompute!r}, "
                             f"not {recompute!r}; count it again with this checkpointing")
        attention = sum(b * k for b, k in zip(m.recompute_per_key, keys))
        return attention if attention_only else m.recompute_weight_flops + attention
    total = 0.0
    for i in range(m.layers):
        if recompute.checkpointed(i) and reached[i]:
            weights = 0 if attention_only else m.layer_weights(i) - (m.tail_weights(i) if recompute.early_stop else 0)
            if trainable is not None and not attention_only:
                weights += sum(a.params for a in trainable.adapters if a.layer == i)
            total += 2.0 * weights + 2.0 * m.attention_width() * keys[i]
    return total


def _reached_layers(layers: int, trainable: Trainable | None) -> list[bool]:
    """Per layer, whether backward runs through it (something trainable in it or below it)."""
    if trainable is None:
        return [True] * layers
    with_adapter = {a.layer for a in trainable.adapters}
    out, grad = [], trainable.embedding
    for i in range(layers):
        grad = grad or bool(trainable.layers[i]) or i in with_adapter
        out.append(grad)
    return out


def hardware_flops_per_token(config, seq_len: float | Sequence[float], recompute: "Recompute | None" = None, *,
                             causal_kernel: bool = False, trainable: Trainable | None = None,
                             autograd_attention: bool = False) -> float:
    """Training FLOPs per token the device executes: the weight matmuls, attention as the kernel runs
    it, and the recomputed forward.

    A dense attention kernel (eager attention with its mask tensor, SDPA given an explicit mask)
    computes every query-key pair of the square, so attention follows the ``palm`` convention; a
    causal kernel (SDPA ``is_causal=True``, Flash-Attention ``causal=True``) skips the masked
    triangle and computes ``l(l+1)/2`` pairs (:func:`executed_attended_keys`). Activation
    checkpointing adds :func:`recompute_flops_per_token`; frozen weights and adapters are counted
    as in :func:`flops_per_token` (``trainable``).

    Args:
        config, seq_len: as for :func:`flops_per_token`.
        recompute: what activation checkpointing re-executes, or None.
        causal_kernel: True when the attention kernel is causal (default False: the dense square).
        trainable: what trains (None: everything).
        autograd_attention: eager attention (two autograd matmuls): with frozen weights its backward
            computes each input gradient only where that operand needs one (``dK`` of ``Q K^T`` is
            skipped where only ``Q`` trains below it); False: a fused kernel's backward, all of them.

    Raises:
        ValueError: as :func:`flops_per_token`.
    """
    m = _model(config)
    conv = "causal_kernel" if causal_kernel else "dense_kernel"
    if trainable is not None:
        if isinstance(m, CountedFlops):
            flops_per_token(m, seq_len, "palm", trainable)  # raises: no per-matrix breakdown
        base = _trained_flops(m, _layer_keys(m, seq_len, conv), trainable, autograd_attention)
    elif isinstance(m, CountedFlops):
        base = m.weight_flops + attention_flops_per_token(m, seq_len, causal_kernel=causal_kernel)
    else:
        weights = sum(m.layer_weights(i) for i in range(m.layers)) + m.hidden * m.vocab
        base = 6.0 * weights + attention_flops_per_token(m, seq_len, causal_kernel=causal_kernel)
    return base + recompute_flops_per_token(m, seq_len, recompute, causal_kernel=causal_kernel, trainable=trainable)


def effective_seq_len(lengths: Iterable[float]) -> float:
    """Effective sequence length ``sum(l_i^2) / sum(l_i)`` of a variable-length or packed batch.

    Attention work grows with ``l^2`` per sequence while tokens grow with ``l``, so attention FLOPs
    per token of the batch equal those of uniform sequences of this length (with document masking
    in packed batches, each document counts as its own sequence).

    Args:
        lengths: real (non-padding) lengths in tokens of every sequence or document in the batch.

    Raises:
        ValueError: for an empty batch, a negative length or an all-zero batch.
    """
    ls = _lengths(list(lengths))
    return sum(l * l for l in ls) / sum(ls)


#: Full activation checkpointing of a whole model, in the rule-of-thumb form: forward + backward
#: is three forward-equivalents of GEMM FLOPs, recomputing every forward adds a fourth (Korthikanti
#: et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", Sec. 5). Only the
#: checkpointed layers' share rises so; :func:`recompute_flops_per_token` counts what really runs.
RECOMPUTE_FACTOR = 4.0 / 3.0


def hardware_model_ratio(config, seq_len: float, *, recompute: "bool | Recompute | None" = False,
                         causal_kernel: bool = False, trainable: Trainable | None = None,
                         autograd_attention: bool = False) -> float:
    """Hardware FLOPs per model FLOP, analytic: what HFU is to MFU when no step was counted.

    ``hardware_flops_per_token(s, recompute, causal_kernel) / flops_per_token(s, "megatron")``: dense
    attention kernels compute the full ``s x s`` score matrix, so executed FLOPs follow the ``palm``
    convention (no causal discount) while model FLOPs follow ``megatron``; a causal kernel computes
    ``s(s+1)/2`` pairs, i.e. ``megatron``'s ``s^2/2`` and the diagonal; activation checkpointing
    adds the recomputed forward of the checkpointed layers only (LM head and embedding are not
    recomputed; early stop skips a last bare matmul). HFU = MFU x this ratio. On a dense model it
    equals the ratio a FlopCounterMode step measures with eager attention (tests: exact, asserted
    within 1%).

    Args:
        config: as for :func:`model_shape`, or a :class:`CountedFlops`.
        seq_len: effective sequence length (tokens, > 0).
        recompute: a :class:`Recompute`; True means ``Recompute()`` (every decoder layer,
            non-reentrant with early stop: what ``activation_checkpointing_enable()`` does in
            transformers 5); False or None, no checkpointing.
        causal_kernel: the attention kernel is causal (:func:`hardware_flops_per_token`).
        trainable: what trains (None: everything), in both counts.
        autograd_attention: eager attention's backward (:func:`hardware_flops_per_token`).
    """
    rc = Recompute() if recompute is True else (recompute or None)
    return (hardware_flops_per_token(config, seq_len, rc, causal_kernel=causal_kernel, trainable=trainable,
                                     autograd_attention=autograd_attention)
            / flops_per_token(config, seq_len, "megatron", trainable))


def utilization(achieved_tflops_per_device: float, peak_tflops: float | None) -> float | None:
    """MFU or HFU: achieved TFLOP/s per device over the dense peak TFLOP/s per device.

    Model FLOPs give MFU, hardware FLOPs (recomputation included) give HFU; the ratio HFU/MFU is
    therefore hardware FLOPs / model FLOPs per step. The value is NOT clipped: above 1 means an
    input is wrong (see :func:`mfu_warning`).

    Args:
        achieved_tflops_per_device: achieved TFLOP/s per device (>= 0).
        peak_tflops: dense peak TFLOP/s per device for the compute dtype, or None when unknown.

    Returns:
        The fraction, or None when the peak is unknown.

    Raises:
        ValueError: for a negative achieved rate or a non-positive peak.
    """
    if achieved_tflops_per_device < 0 or not math.isfinite(achieved_tflops_per_device):
        raise ValueError(f"achieved_tflops_per_device {achieved_tflops_per_device!r} is not accepted; "
                         "give a finite rate >= 0")
    if peak_tflops is None:
        return None
    if not peak_tflops > 0 or not math.isfinite(peak_tflops):
        raise ValueError(f"peak_tflops {peak_tflops!r} is not accepted; give a finite rate > 0 or None")
    return achieved_tflops_per_device / peak_tflops


def mfu_warning(value: float | None, fate: str = "logged unclipped") -> str | None:
    """Say why a utilization above 1 is an error in the inputs; None when the value is plausible.

    Args:
        value: MFU or HFU as a fraction, or None.
        fate: what became of the figure, the message's last words (``left out`` for MFU against the
            measured peak, which a rate above it shows to bound nothing).
    """
    if value is None or value <= 1.0:
        return None
    return (f"utilization {value:.4f} > 1 is impossible: an input is wrong (peak for another dtype or "
            "device, a measured peak timed on shapes slower than the model's, sparse peak, tokens counted on "
            f"several ranks, or a FLOPs formula that does not match the model); {fate}")


def flops_summary(config, seq_len: float, micro_batch_size: int = 1, grad_accum: int = 1,
                  num_processes: int = 1, trainable: Trainable | None = None) -> dict[str, float | int | None]:
    """Parameters and FLOPs of one optimizer step, as ``llmeff flops`` prints them.

    Assumes full-length sequences of ``seq_len`` tokens and pure data parallelism over
    ``num_processes`` devices: tokens per step ``= seq_len * micro_batch_size * grad_accum *
    num_processes``. ``trainable`` (None: everything trains) enters both conventions
    (:func:`flops_per_token`).

    Returns:
        ``params_total``, ``params_non_embedding``, ``params_active``, ``seq_len``,
        ``tokens_per_step``, ``flops_per_token_megatron``, ``flops_per_token_palm``,
        ``flops_per_step_megatron``, ``flops_per_step_palm`` (global), and
        ``flops_per_step_per_device_megatron`` / ``_palm``, ``params_trainable`` and
        ``trainable_share`` (a fraction; the adapters' parameters count in both parts).

    Raises:
        ValueError: for a non-positive batch dimension (and as :func:`flops_per_token`).
    """
    for label, v in (("micro_batch_size", micro_batch_size), ("grad_accum", grad_accum),
                     ("num_processes", num_processes)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{label} {v!r} is not accepted; give an integer >= 1")
    p = param_counts(config)
    tokens = seq_len * micro_batch_size * grad_accum * num_processes
    out: dict[str, float | int | None] = {
        "params_total": p["total"], "params_non_embedding": p["non_embedding"], "params_active": p["active"],
        "seq_len": seq_len, "tokens_per_step": tokens,
        "params_trainable": p["total"] if trainable is None else trainable.trainable_params,
        "trainable_share": 1.0 if trainable is None else trainable.share,
    }
    for conv in CONVENTIONS:
        f = flops_per_token(config, seq_len, conv, trainable)
        out[f"flops_per_token_{conv}"] = f
        out[f"flops_per_step_{conv}"] = f * tokens
        out[f"flops_per_step_per_device_{conv}"] = f * tokens / num_processes
    return out
