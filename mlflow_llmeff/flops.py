"""Training FLOPs per token from a model config, parameter counts, and MFU / HFU arithmetic.

Pure arithmetic: nothing here touches a device, and torch is imported only inside
:func:`measure_step_flops`. Every term is derived in ``docs/formulas.md``; the short version:

For one token and one decoder layer, a matrix multiply ``(1 x a) @ (a x b)`` costs ``2ab`` FLOPs
forward (one multiply and one add per weight) and ``4ab`` backward (gradient w.r.t. the input and
w.r.t. the weight), so every weight matrix costs ``6ab`` per trained token. Summing over the weight
matrices of a layer gives the ``6N`` of Kaplan et al. 2020 (Sec. 2.1) and PaLM (Chowdhery et al.
2022, App. B); attention scores and the weighted sum of values add ``12 * (n*d) * k`` per layer,
where ``k`` is the number of keys a query attends to (training: 3 x the forward ``2 * 2 * n*d*k``).

Conventions (``convention=``):
  * ``megatron`` (default): causal attention counted once, i.e. a query attends on average
    ``s/2`` keys (Megatron-LM ``num_floating_point_operations`` since 2025-03; NeMo
    ``flops_formulas.llama3``). For a SwiGLU decoder this is exactly the METRICS.md formula
    ``L*h^2*(12 + 12*g/n + 18*f/h + 6*s/h) + 6*h*V``.
  * ``palm``: no causal discount, ``6N + 12*L*h*s`` (PaLM App. B; nanoGPT, torchtitan,
    llm-foundry). Norm weights and biases are left out of ``N``, as in the METRICS.md table.

What is counted: every weight matmul (attention projections with GQA widths, gated or plain MLP,
the MoE router and the ``top_k`` experts a token is routed to, the LM head, which is counted even
when tied to the input embedding), and the two attention matmuls. What is not: the input
embedding lookup and learned positions (a gather, no FLOPs), norms, activations, softmax, residual
adds, biases and RoPE (O(h) per token against O(h^2), well under 1% for real models).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

__all__ = [
    "CONVENTIONS",
    "FORMULA_TAGS",
    "ModelShape",
    "model_shape",
    "flops_per_token",
    "flops_summary",
    "attention_flops_per_token",
    "mean_attended_keys",
    "effective_seq_len",
    "param_counts",
    "measure_step_flops",
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

# Model types whose MLP is two matrices (up, down) with a non-gated activation, learned positions
# and biases everywhere (GPT-2 family). Everything else supported here is Llama-like (SwiGLU).
_SUPPORTED_TYPES = ("llama", "mistral", "qwen2", "gpt2", "mixtral")


@dataclass(frozen=True)
class ModelShape:
    """The shapes that decide FLOPs and parameter counts of a decoder-only transformer.

    Attributes:
        layers: decoder layers ``L``.
        hidden: model width ``h``.
        heads: query heads ``n``.
        kv_heads: key/value heads ``g`` (``g == n``: multi-head; ``g < n``: GQA/MQA).
        head_dim: width ``d`` of one head (``n*d`` is usually ``h``, not always).
        ffn: MLP width ``f`` (per expert for MoE).
        vocab: vocabulary ``V``.
        gated_mlp: True for SwiGLU-style 3-matrix MLPs, False for plain 2-matrix MLPs.
        experts: routed experts per MoE layer (0 for a dense model).
        top_k: experts each token is routed to (0 for a dense model).
        tied_embeddings: LM head shares the input embedding matrix (counted once in parameters,
            still costs FLOPs).
        learned_positions: rows of a learned position embedding (0 for RoPE models).
        windows: per layer, the sliding-window size in tokens, or None for full attention.
        qkv_bias, o_bias, mlp_bias: whether those linear layers carry a bias (parameters only).
        layer_norm: True for LayerNorm (weight and bias), False for RMSNorm (weight only).
        model_type: the Hugging Face ``model_type`` or ``"shape"`` for a plain shape object.
    """

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    gated_mlp: bool = True
    experts: int = 0
    top_k: int = 0
    tied_embeddings: bool = False
    learned_positions: int = 0
    windows: tuple[int | None, ...] = ()
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    layer_norm: bool = False
    model_type: str = "shape"

    @property
    def q_width(self) -> int:
        """``n*d``: width of the query projection output (and of attention scores' contraction)."""
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        """``g*d``: width of the key projection output (same for values)."""
        return self.kv_heads * self.head_dim

    def attention_weight_params(self) -> int:
        """Weights of Q, K, V and O projections in one layer (no biases)."""
        return 2 * self.hidden * self.q_width + 2 * self.hidden * self.kv_width

    def expert_weight_params(self) -> int:
        """Weights of one MLP (one expert for MoE): ``3*h*f`` gated, ``2*h*f`` plain."""
        return (3 if self.gated_mlp else 2) * self.hidden * self.ffn

    def router_params(self) -> int:
        """Weights of the MoE router ``h x E`` in one layer (0 for a dense model)."""
        return self.hidden * self.experts


def _get(config, *names, default=None):
    for name in names:
        v = getattr(config, name, None)
        if v is not None:
            return v
    return default


def model_shape(config) -> ModelShape:
    """Read the FLOPs-relevant shapes from a Hugging Face config or an equivalent shape object.

    Args:
        config: a ``transformers`` ``LlamaConfig``, ``MistralConfig``, ``Qwen2Config``,
            ``GPT2Config`` or ``MixtralConfig``; a :class:`ModelShape`; or any object with the
            Llama attribute names (``num_hidden_layers``, ``hidden_size``,
            ``num_attention_heads``, ``intermediate_size``, ``vocab_size``; optional
            ``num_key_value_heads``, ``head_dim``, ``tie_word_embeddings``, ``sliding_window``,
            ``num_local_experts``, ``num_experts_per_tok``, ``mlp_gated``), read as a Llama-like
            SwiGLU decoder.

    Returns:
        The :class:`ModelShape`.

    Raises:
        ValueError: for a ``model_type`` other than llama, mistral, qwen2, gpt2, mixtral (their
            layers differ in ways these formulas would silently miscount), or a missing shape.
    """
    if isinstance(config, ModelShape):
        return config
    model_type = getattr(config, "model_type", None) or "shape"
    if model_type not in _SUPPORTED_TYPES + ("shape",):
        raise ValueError(f"model_type {model_type!r} is not supported by flops_per_token; accepted: "
                         f"{', '.join(_SUPPORTED_TYPES)}, or a shape object with Llama attribute names")
    layers = _get(config, "num_hidden_layers", "n_layer")
    hidden = _get(config, "hidden_size", "n_embd")
    heads = _get(config, "num_attention_heads", "n_head")
    vocab = _get(config, "vocab_size")
    missing = [k for k, v in dict(num_hidden_layers=layers, hidden_size=hidden,
                                  num_attention_heads=heads, vocab_size=vocab).items() if v is None]
    if missing:
        raise ValueError(f"config {type(config).__name__} lacks {', '.join(missing)}; "
                         "flops_per_token needs the decoder's shapes")
    kv_heads = _get(config, "num_key_value_heads", default=heads)
    head_dim = _get(config, "head_dim", default=hidden // heads)

    if model_type == "gpt2":
        ffn = _get(config, "n_inner", default=4 * hidden)
        return ModelShape(
            layers=layers, hidden=hidden, heads=heads, kv_heads=heads, head_dim=hidden // heads,
            ffn=ffn, vocab=vocab, gated_mlp=False,
            tied_embeddings=bool(_get(config, "tie_word_embeddings", default=True)),
            learned_positions=_get(config, "n_positions", "max_position_embeddings", default=0),
            windows=(None,) * layers, qkv_bias=True, o_bias=True, mlp_bias=True, layer_norm=True,
            model_type=model_type)

    ffn = _get(config, "intermediate_size")
    if ffn is None:
        raise ValueError(f"config {type(config).__name__} lacks intermediate_size")
    experts = int(_get(config, "num_local_experts", "num_experts", default=0) or 0)
    top_k = int(_get(config, "num_experts_per_tok", default=0) or 0) if experts else 0
    if experts and not 0 < top_k <= experts:
        raise ValueError(f"num_experts_per_tok={top_k} must be in 1..{experts} (num experts)")

    window = _get(config, "sliding_window")
    if model_type == "qwen2" and not getattr(config, "use_sliding_window", False):
        window = None
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        windows = tuple(window if t == "sliding_attention" else None for t in layer_types)
    else:
        windows = (window,) * layers
    attn_bias = bool(getattr(config, "attention_bias", False))
    return ModelShape(
        layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, head_dim=head_dim, ffn=ffn,
        vocab=vocab, gated_mlp=bool(getattr(config, "mlp_gated", True)), experts=experts, top_k=top_k,
        tied_embeddings=bool(_get(config, "tie_word_embeddings", default=False)),
        windows=windows, qkv_bias=attn_bias or model_type == "qwen2", o_bias=attn_bias,
        mlp_bias=bool(getattr(config, "mlp_bias", False)), model_type=model_type)


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
                       convention: str = "megatron") -> float:
    """Mean number of keys a query attends to, per token (the ``k`` of the attention term).

    ``megatron`` counts the causal mask as the continuous triangle: a sequence of ``l`` tokens
    attends ``l^2/2`` query-key pairs (mean ``l/2``, the "causal attention counted once" of
    Megatron-LM). With a sliding window ``w < l`` the band of the triangle holds
    ``w*l - w^2/2`` pairs (the triangle minus the ``(l-w)^2/2`` corner the window cuts off), which
    equals ``l^2/2`` at ``w = l``, so the two agree at the boundary. ``palm`` does not discount
    the mask: every query attends ``min(l, w)`` keys.

    Args:
        seq_len: one (effective) sequence length in tokens, or the real lengths ``l_i`` of every
            sequence in a batch (then the pairs are summed per sequence: exact for packed and
            variable-length batches, sliding window included).
        window: sliding-window size in tokens, or None for full attention.
        convention: ``megatron`` or ``palm``.

    Returns:
        Keys per token; for lengths ``l_i`` and no window, ``megatron`` gives
        ``effective_seq_len(l)/2`` and ``palm`` gives ``effective_seq_len(l)``.
    """
    _check_convention(convention)
    lengths = _lengths(seq_len)
    if window is not None and window <= 0:
        raise ValueError(f"window {window!r} is not accepted; give a positive number of tokens or None")
    pairs = 0.0
    for l in lengths:
        w = l if window is None else min(float(window), l)
        pairs += (w * l - w * w / 2.0) if convention == "megatron" else w * l
    return pairs / sum(lengths)


def attention_flops_per_token(config, seq_len: float | Sequence[float],
                              convention: str = "megatron") -> float:
    """Training FLOPs per token of the attention-score matmuls alone (QK^T and scores @ V).

    ``sum over layers of 12 * (n*d) * k_layer``: forward ``2*(n*d)*k`` for QK^T and the same for
    the weighted sum of values, times 3 for forward + backward. Useful where the flop counter
    cannot see attention (CPU scaled-dot-product attention) or sees it without the causal
    discount (fused GPU kernels are counted as the full square).

    Args:
        config: as for :func:`model_shape`.
        seq_len: as for :func:`mean_attended_keys`.
        convention: ``megatron`` or ``palm``.
    """
    shape = model_shape(config)
    windows = shape.windows or (None,) * shape.layers
    return sum(12.0 * shape.q_width * mean_attended_keys(seq_len, w, convention) for w in windows)


def flops_per_token(config, seq_len: float | Sequence[float], convention: str = "megatron") -> float:
    """Training FLOPs per token (forward + backward) of a decoder-only transformer.

    ``F = sum_layers [6*(2*h*n*d + 2*h*g*d) + 6*m*h*f*a + 6*h*E + 12*n*d*k] + 6*h*V``, where
    ``m`` is 3 for gated MLPs and 2 for plain ones, ``a`` the experts a token uses (``top_k``, or 1
    when dense), ``E`` the router width (0 when dense) and ``k`` the mean attended keys
    (:func:`mean_attended_keys`). For Llama with ``n*d = h`` this is the METRICS.md formula
    ``L*h^2*(12 + 12*g/n + 18*f/h + 6*s/h) + 6*h*V``. Derivation and sources in the module
    docstring and ``docs/formulas.md``.

    Args:
        config: a Hugging Face config or shape object (see :func:`model_shape`).
        seq_len: tokens per sequence, or the effective length ``sum(l^2)/sum(l)`` of a
            variable-length / packed batch (:func:`effective_seq_len`), or the list of real lengths
            (exact also under a sliding window).
        convention: ``megatron`` (causal attention counted once) or ``palm`` (no causal discount).

    Returns:
        FLOPs per trained token (float; multiply by tokens for FLOPs per step).

    Raises:
        ValueError: for an unknown convention, a bad length or an unsupported config.
    """
    _check_convention(convention)
    shape = model_shape(config)
    dense_or_active = shape.top_k if shape.experts else 1
    per_layer_weights = (shape.attention_weight_params()
                         + dense_or_active * shape.expert_weight_params()
                         + shape.router_params())
    weights = shape.layers * per_layer_weights + shape.hidden * shape.vocab  # LM head always counted
    return 6.0 * weights + attention_flops_per_token(shape, seq_len, convention)


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


def param_counts(config) -> dict[str, int]:
    """Parameter counts of the model a config describes (matches ``sum(p.numel())`` of the HF model).

    Returns:
        ``total``: every parameter once (a tied LM head is the embedding, counted once);
        ``non_embedding``: total minus the input embedding and learned positions;
        ``active``: parameters a token uses (MoE: router plus ``top_k`` experts per layer, other
        experts excluded; equals ``total`` for a dense model).
    """
    s = model_shape(config)
    h = s.hidden
    attn = s.attention_weight_params()
    if s.qkv_bias:
        attn += s.q_width + 2 * s.kv_width
    if s.o_bias:
        attn += h
    expert = s.expert_weight_params()
    if s.mlp_bias:
        expert += ((2 if s.gated_mlp else 1) * s.ffn) + h
    norm = (2 * h) if s.layer_norm else h  # one norm; two per layer plus a final one
    n_experts = s.experts or 1
    layer = attn + n_experts * expert + s.router_params() + 2 * norm
    embedding = s.vocab * h + s.learned_positions * h
    lm_head = 0 if s.tied_embeddings else s.vocab * h
    total = embedding + s.layers * layer + norm + lm_head
    inactive = s.layers * (n_experts - (s.top_k if s.experts else 1)) * expert
    return {"total": total, "non_embedding": total - embedding, "active": total - inactive}


def measure_step_flops(step_fn: Callable[[], object]) -> int:
    """Count the FLOPs one real training step executes, with ``torch.utils.flop_counter``.

    These are hardware FLOPs (HFU's numerator): activation-checkpointing recomputation is counted
    because it runs. The counter counts matmuls, convolutions and the fused GPU attention kernels
    (flash, memory-efficient, cuDNN; as the full square, without causal discount). It does NOT count
    CPU scaled-dot-product attention (``_scaled_dot_product_flash_attention_for_cpu`` has no
    formula), elementwise ops, norms or softmax. Build models with ``attn_implementation="eager"``
    to have attention counted as the two matmuls it is, or add
    :func:`attention_flops_per_token` analytically.

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


#: Full activation checkpointing runs every layer's forward twice: forward + backward is three
#: forward-equivalents of GEMM FLOPs, recomputation adds a fourth (Korthikanti et al. 2022,
#: "Reducing Activation Recomputation in Large Transformer Models", Sec. 5; METRICS.md).
RECOMPUTE_FACTOR = 4.0 / 3.0


def hardware_model_ratio(config, seq_len: float, *, recompute: bool = False) -> float:
    """Hardware FLOPs per model FLOP, analytic: what HFU is to MFU when no step was counted.

    Dense attention kernels (eager, SDPA math, CPU SDPA) compute the full ``s x s`` score
    matrix, so the executed FLOPs follow the ``palm`` convention (no causal discount), while model
    FLOPs follow ``megatron``; full activation checkpointing multiplies by
    :data:`RECOMPUTE_FACTOR`. HFU = MFU x this ratio.

    Args:
        config: as for :func:`model_shape`.
        seq_len: effective sequence length (tokens, > 0).
        recompute: full activation checkpointing is on.
    """
    ratio = flops_per_token(config, seq_len, "palm") / flops_per_token(config, seq_len, "megatron")
    return ratio * (RECOMPUTE_FACTOR if recompute else 1.0)


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


def mfu_warning(value: float | None) -> str | None:
    """Say why a utilization above 1 is an error in the inputs; None when the value is plausible.

    Args:
        value: MFU or HFU as a fraction, or None.
    """
    if value is None or value <= 1.0:
        return None
    return (f"utilization {value:.4f} > 1 is impossible: an input is wrong (peak for another dtype or "
            "device, sparse peak, tokens counted on several ranks, or a FLOPs formula that does not "
            "match the model); logged unclipped")


def flops_summary(config, seq_len: float, micro_batch_size: int = 1, grad_accum: int = 1,
                  num_processes: int = 1) -> dict[str, float | int]:
    """Parameters and FLOPs of one optimizer step, as ``llmeff flops`` prints them.

    Assumes full-length sequences of ``seq_len`` tokens and pure data parallelism over
    ``num_processes`` devices: tokens per step ``= seq_len * micro_batch_size * grad_accum *
    num_processes``.

    Returns:
        ``params_total``, ``params_non_embedding``, ``params_active``, ``seq_len``,
        ``tokens_per_step``, ``flops_per_token_megatron``, ``flops_per_token_palm``,
        ``flops_per_step_megatron``, ``flops_per_step_palm`` (global), and
        ``flops_per_step_per_device_megatron`` / ``_palm``.

    Raises:
        ValueError: for a non-positive batch dimension (and as :func:`flops_per_token`).
    """
    for label, v in (("micro_batch_size", micro_batch_size), ("grad_accum", grad_accum),
                     ("num_processes", num_processes)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{label} {v!r} is not accepted; give an integer >= 1")
    p = param_counts(config)
    tokens = seq_len * micro_batch_size * grad_accum * num_processes
    out: dict[str, float | int] = {
        "params_total": p["total"], "params_non_embedding": p["non_embedding"], "params_active": p["active"],
        "seq_len": seq_len, "tokens_per_step": tokens,
    }
    for conv in CONVENTIONS:
        f = flops_per_token(config, seq_len, conv)
        out[f"flops_per_token_{conv}"] = f
        out[f"flops_per_step_{conv}"] = f * tokens
        out[f"flops_per_step_per_device_{conv}"] = f * tokens / num_processes
    return out
