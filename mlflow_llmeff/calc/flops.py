"""Training FLOPs per token from a model config, parameter counts, and MFU / HFU arithmetic.

Pure arithmetic: nothing here touches a device, and torch is imported only inside
:func:`measure_step_flops`. Every term is derived in ``docs/formulas.md``; the short version:

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
    ``flops_formulas.llama3``). For a SwiGLU decoder this is exactly the METRICS.md formula
    ``L*h^2*(12 + 12*g/n + 18*f/h + 6*s/h) + 6*h*V``.
  * ``palm``: no causal discount, ``6N + 12*L*h*s`` (PaLM App. B; nanoGPT, torchtitan,
    llm-foundry). Norm weights and biases are left out of ``N``, as in the METRICS.md table.

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
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

__all__ = [
    "CONVENTIONS",
    "FORMULA_TAGS",
    "FORMULA_TYPES",
    "ModelShape",
    "CountedFlops",
    "Recompute",
    "model_shape",
    "attention_windows",
    "flops_per_token",
    "flops_summary",
    "attention_flops_per_token",
    "recompute_flops_per_token",
    "hardware_flops_per_token",
    "hardware_model_ratio",
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

#: Hugging Face ``model_type`` values whose config fields the formula reads. Each is checked
#: against a FlopCounterMode count of the real transformers model on the meta device (tests,
#: within 1%; exact today), parameters against ``sum(p.numel())``. Any other type is counted on
#: the meta device (:mod:`mlflow_llmeff.meters.flopcount`) or gets no figure.
FORMULA_TYPES = ("llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gemma", "gemma2",
                 "gemma3_text", "phi3", "olmo2", "olmoe", "granite", "granitemoe", "gpt_neox", "gpt2", "deepseek_v3")


@dataclass(frozen=True)
class ModelShape:
    """The shapes that decide FLOPs and parameter counts of a decoder-only transformer.

    Attributes:
        layers: decoder layers ``L``.
        hidden: model width ``h``.
        heads: query heads ``n``.
        kv_heads: key/value heads ``g`` (``g == n``: multi-head; ``g < n``: GQA/MQA).
        head_dim: width ``d`` of one query/key head (``n*d`` is usually ``h``, not always: Qwen3,
            Gemma); for MLA the query/key head including its rotary part.
        ffn: MLP width ``f``: the dense MLP's, or each routed expert's in an MoE model.
        vocab: vocabulary ``V``.
        gated_mlp: True for SwiGLU-style 3-matrix MLPs, False for plain 2-matrix MLPs.
        experts: routed experts per MoE layer ``E`` (0 for a dense model).
        top_k: routed experts each token uses (0 for a dense model).
        tied_embeddings: LM head shares the input embedding matrix (counted once in parameters,
            still costs FLOPs).
        learned_positions: rows of a learned position embedding (0 for RoPE models).
        windows: per layer, the sliding-window size in tokens, or None for full attention.
        qkv_bias, o_bias, mlp_bias: whether those linear layers carry a bias (parameters only).
        layer_norm: True for LayerNorm (weight and bias), False for RMSNorm (weight only).
        model_type: the Hugging Face ``model_type`` or ``"shape"`` for a plain shape object.
        v_head_dim: width of one value head (0: ``head_dim``; MLA sets it apart).
        q_lora_rank, kv_lora_rank, qk_rope_head_dim: MLA (DeepSeek-V2/V3) low-rank query and
            key/value projections: ``h -> q_lora_rank -> n*head_dim`` (0: a direct ``h -> n*head_dim``),
            ``h -> kv_lora_rank + qk_rope_head_dim`` then ``kv_lora_rank -> n*(nope + v_head_dim)``.
            ``kv_lora_rank == 0`` means ordinary attention.
        moe_layers: per layer, True where the MLP is the MoE block (empty: every layer of an MoE
            model, none of a dense one).
        dense_ffn: width of the dense MLP in the dense layers of an MoE model (0: ``ffn``).
        shared_ffn: total width of the shared expert(s) every token goes through in an MoE layer.
        shared_gate: the shared expert output is scaled by a learned ``h -> 1`` gate (Qwen2-MoE).
        chunks: per layer, the chunk size of chunked attention (a query sees only its chunk), or None.
        layer_norms: norms of width ``h`` in one layer (2: before attention and MLP; Gemma-2/3: 4).
        extra_layer_params: further norm parameters of one layer (q/k norms, MLA latent norms).
        dense_tail_bare: in a dense layer the MLP's last matmul output only feeds a residual add,
            so PyTorch's non-reentrant checkpoint (early stop) does not recompute it (False when a
            norm or dropout follows it: Gemma-2/3, OLMo-2, GPT-2 with dropout).
        moe_tail_bare: likewise for an MoE layer's last matmul (DeepSeek-V3: the shared experts'
            down projection runs last); routed experts scale their output by the router weights,
            which keeps it, so by default nothing is skipped there.
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
    v_head_dim: int = 0
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    moe_layers: tuple[bool, ...] = ()
    dense_ffn: int = 0
    shared_ffn: int = 0
    shared_gate: bool = False
    chunks: tuple[int | None, ...] = ()
    layer_norms: int = 2
    extra_layer_params: int = 0
    dense_tail_bare: bool = True
    moe_tail_bare: bool = False

    @property
    def q_width(self) -> int:
        """``n*d``: width of the query projection output (and of attention scores' contraction)."""
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        """``g*d``: width of the key projection output (same for values)."""
        return self.kv_heads * self.head_dim

    @property
    def v_width(self) -> int:
        """``n*d_v``: width of the attention output that the output projection reads."""
        return self.heads * (self.v_head_dim or self.head_dim)

    @property
    def mla(self) -> bool:
        """True for multi-head latent attention (DeepSeek-V2/V3)."""
        return self.kv_lora_rank > 0

    def attention_weight_params(self) -> int:
        """Weights of the attention projections in one layer (no biases).

        Ordinary: ``h*n*d`` (Q) + ``h*g*d`` (K) + ``h*g*d_v`` (V) + ``n*d_v*h`` (O). MLA:
        ``h*r_q + r_q*n*d`` (or ``h*n*d``) + ``h*(r_kv + d_rope)`` + ``r_kv*n*(d - d_rope + d_v)`` + O.
        """
        h, n = self.hidden, self.heads
        dv = self.v_head_dim or self.head_dim
        if self.mla:
            q = (h * self.q_lora_rank + self.q_lora_rank * n * self.head_dim) if self.q_lora_rank else h * n * self.head_dim
            kv_a = h * (self.kv_lora_rank + self.qk_rope_head_dim)
            kv_b = self.kv_lora_rank * n * (self.head_dim - self.qk_rope_head_dim + dv)
            return q + kv_a + kv_b + n * dv * h
        return h * self.q_width + h * self.kv_width + h * self.kv_heads * dv + self.v_width * h

    def expert_weight_params(self) -> int:
        """Weights of one MLP (one routed expert for MoE): ``3*h*f`` gated, ``2*h*f`` plain."""
        return self._mlp(self.ffn)

    def router_params(self) -> int:
        """Weights of the MoE router ``h x E`` in one layer (0 for a dense model)."""
        return self.hidden * self.experts

    def _mlp(self, width: int) -> int:
        return (3 if self.gated_mlp else 2) * self.hidden * width

    def is_moe(self, layer: int) -> bool:
        """True when layer ``layer``'s MLP is the MoE block."""
        if not self.experts:
            return False
        return self.moe_layers[layer] if self.moe_layers else True

    def layer_weights(self, layer: int) -> int:
        """Matmul weights one token goes through in layer ``layer`` (routed: ``top_k`` experts only)."""
        if self.is_moe(layer):
            mlp = (self.top_k * self.expert_weight_params() + self.router_params() + self._mlp(self.shared_ffn)
                   + (self.hidden if self.shared_gate else 0))
        else:
            mlp = self._mlp(self.dense_ffn or self.ffn)
        return self.attention_weight_params() + mlp

    def attention_width(self) -> int:
        """``n*(d_qk + d_v)``: the attention matmuls cost ``2 x`` this per token and attended key, forward."""
        return self.heads * (self.head_dim + (self.v_head_dim or self.head_dim))

    def tail_weights(self, layer: int) -> int:
        """Weights of layer ``layer``'s last matmul when early-stopped recomputation skips it, else 0."""
        if self.is_moe(layer):
            return self.hidden * self.shared_ffn if self.moe_tail_bare else 0
        return self.hidden * (self.dense_ffn or self.ffn) if self.dense_tail_bare else 0


@dataclass(frozen=True)
class CountedFlops:
    """FLOPs per token of a model counted with FlopCounterMode (one forward and backward, meta device).

    The count runs eager attention, which computes every query-key pair, at several sequence
    lengths, so per layer the counted training FLOPs per token are ``a_l + b_l * s``: ``b_l`` is the
    attention matmuls' cost per attended key. Model FLOPs then take each layer's attended keys
    from :func:`mean_attended_keys` (causal discount, windows and chunks from the config), exactly
    as the formula does. Built by :func:`mlflow_llmeff.meters.flopcount.count_on_meta`.

    Attributes:
        model_type: the config's ``model_type``.
        weight_flops: training FLOPs per token that do not grow with the sequence (all matmuls
            outside attention scores: projections, MLP/experts, router, LM head).
        attention_per_key: per layer, training FLOPs per token per attended key.
        windows, chunks: per layer, sliding-window / chunk size or None (from the config).
        lengths: the sequence lengths counted.
        recompute: the checkpointing the recomputation below was counted under, or None.
        recompute_weight_flops: forward FLOPs per token recomputed outside attention (counted).
        recompute_per_key: per layer, recomputed attention forward FLOPs per token per key.
        params_total, params_non_embedding: ``sum(p.numel())`` of the meta model, and without the
            input embedding; ``params_active``: equal to the total for a dense model, None for MoE.
    """

    model_type: str
    weight_flops: float
    attention_per_key: tuple[float, ...]
    windows: tuple[int | None, ...]
    chunks: tuple[int | None, ...]
    lengths: tuple[int, ...] = ()
    recompute: "Recompute | None" = None
    recompute_weight_flops: float = 0.0
    recompute_per_key: tuple[float, ...] = ()
    params_total: int = 0
    params_non_embedding: int = 0
    params_active: int | None = None

    @property
    def layers(self) -> int:
        return len(self.attention_per_key)


@dataclass(frozen=True)
class Recompute:
    """What activation checkpointing re-executes during backward.

    Attributes:
        layers: indices of the checkpointed decoder layers, or None for every layer (Hugging Face
            ``activation_checkpointing_enable()``; ``every_n_layers=k`` checkpoints layers ``0, k, 2k, ...``).
        early_stop: PyTorch's non-reentrant checkpoint (the default of transformers 5 and of
            ``torch.utils.checkpoint``) stops recomputing once the last tensor backward needs is
            recomputed, so a layer's last matmul whose output only feeds a residual add is not run
            again (:attr:`ModelShape.dense_tail_bare`). False for the reentrant checkpoint or
            ``early_stop=False``: the whole layer forward runs again.
    """

    layers: tuple[int, ...] | None = None
    early_stop: bool = True

    def checkpointed(self, layer: int) -> bool:
        return self.layers is None or layer in self.layers

    def describe(self) -> str:
        which = "every decoder layer" if self.layers is None else f"{len(self.layers)} decoder layers"
        how = ("non-reentrant, early stop: a last matmul feeding only the residual is not rerun" if self.early_stop
               else "whole layer forward rerun")
        return f"{which} ({how})"


def _get(config, *names, default=None):
    for name in names:
        v = getattr(config, name, None)
        if v is not None:
            return v
    return default


def attention_windows(config) -> tuple[tuple[int | None, ...], tuple[int | None, ...]]:
    """Per layer, the sliding window and the attention chunk in tokens (None: full causal attention).

    Read from the config the way transformers 5 models use it: ``layer_types`` when present
    (``sliding_attention`` -> ``sliding_window``, ``chunked_attention`` -> ``attention_chunk_size``,
    anything else full), else ``sliding_window`` on every layer (Mistral, Phi-3, Qwen3-MoE) unless
    ``use_sliding_window`` is False or the window is 0.

    Returns:
        ``(windows, chunks)``, one entry per layer each.
    """
    layers = int(_get(config, "num_hidden_layers", "n_layer", default=0) or 0)
    window = _get(config, "sliding_window")
    if getattr(config, "use_sliding_window", True) is False or not window:
        window = None
    chunk = _get(config, "attention_chunk_size") or None
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        windows = tuple(window if t == "sliding_attention" else None for t in layer_types)
        chunks = tuple(chunk if t == "chunked_attention" else None for t in layer_types)
        return windows, chunks
    return (window,) * layers, (None,) * layers


def _moe_layers(config, layers: int, experts: int) -> tuple[bool, ...]:
    """Per layer, whether the MLP is the MoE block (Qwen-MoE ``decoder_sparse_step`` /
    ``mlp_only_layers``, DeepSeek ``first_k_dense_replace``)."""
    if not experts:
        return ()
    if hasattr(config, "first_k_dense_replace"):
        k = int(config.first_k_dense_replace or 0)
        return tuple(i >= k for i in range(layers))
    step = int(_get(config, "decoder_sparse_step", default=1) or 1)
    only = set(_get(config, "mlp_only_layers", default=()) or ())
    return tuple(i not in only and (i + 1) % step == 0 for i in range(layers))


def model_shape(config) -> ModelShape:
    """Read the FLOPs-relevant shapes from a Hugging Face config or an equivalent shape object.

    Args:
        config: a ``transformers`` config whose ``model_type`` is in :data:`FORMULA_TYPES`; a
            :class:`ModelShape`; or any object with the Llama attribute names
            (``num_hidden_layers``, ``hidden_size``, ``num_attention_heads``,
            ``intermediate_size``, ``vocab_size``; optional ``num_key_value_heads``, ``head_dim``,
            ``tie_word_embeddings``, ``sliding_window``, ``num_local_experts``,
            ``num_experts_per_tok``, ``mlp_gated``), read as a Llama-like SwiGLU decoder.

    Returns:
        The :class:`ModelShape`.

    Raises:
        ValueError: for a ``model_type`` outside :data:`FORMULA_TYPES` (its layers may differ in
            ways the formula would silently miscount: count it on the meta device instead), or a
            missing shape.
    """
    if isinstance(config, ModelShape):
        return config
    if isinstance(config, CountedFlops):
        raise ValueError(f"model_type {config.model_type!r} was counted on the meta device; it has no ModelShape")
    model_type = getattr(config, "model_type", None) or "shape"
    if model_type not in FORMULA_TYPES + ("shape",):
        raise ValueError(f"model_type {model_type!r} is not supported by the FLOPs formula; accepted: "
                         f"{', '.join(FORMULA_TYPES)}, or a shape object with Llama attribute names "
                         "(other types are counted on the meta device: mlflow_llmeff.meters.flopcount)")
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
            model_type=model_type,
            dense_tail_bare=not _get(config, "resid_pdrop", default=0.0))  # dropout keeps c_proj's output
    if model_type == "gpt_neox":
        bias = bool(getattr(config, "attention_bias", True))
        return ModelShape(
            layers=layers, hidden=hidden, heads=heads, kv_heads=heads, head_dim=hidden // heads,
            ffn=config.intermediate_size, vocab=vocab, gated_mlp=False,
            tied_embeddings=bool(_get(config, "tie_word_embeddings", default=False)),
            windows=(None,) * layers, qkv_bias=bias, o_bias=bias, mlp_bias=True, layer_norm=True,
            model_type=model_type, dense_tail_bare=not _get(config, "hidden_dropout", default=0.0))

    ffn = _get(config, "intermediate_size")
    if ffn is None:
        raise ValueError(f"config {type(config).__name__} lacks intermediate_size")
    experts = int(_get(config, "n_routed_experts", "num_local_experts", "num_experts", default=0) or 0)
    top_k = int(_get(config, "num_experts_per_tok", default=0) or 0) if experts else 0
    if experts and not 0 < top_k <= experts:
        raise ValueError(f"num_experts_per_tok={top_k} must be in 1..{experts} (num experts)")
    dense_ffn, expert_ffn = 0, ffn
    moe_ffn = _get(config, "moe_intermediate_size")
    if experts and moe_ffn:  # Qwen-MoE, DeepSeek: intermediate_size is the dense layers' MLP
        dense_ffn, expert_ffn = ffn, moe_ffn
    shared_ffn = 0
    if experts and model_type == "deepseek_v3":
        shared_ffn = int(config.n_shared_experts or 0) * expert_ffn
    elif experts and model_type == "qwen2_moe":
        shared_ffn = int(_get(config, "shared_expert_intermediate_size", default=0) or 0)
    windows, chunks = attention_windows(config)
    attn_bias = bool(getattr(config, "attention_bias", False))
    extra, norms = 0, 2
    if model_type in ("qwen3", "qwen3_moe", "gemma3_text"):
        extra = 2 * head_dim  # q_norm, k_norm over one head
    elif model_type in ("olmo2", "olmoe"):
        extra = heads * head_dim + kv_heads * head_dim  # q_norm, k_norm over all heads
    if model_type in ("gemma2", "gemma3_text"):
        norms = 4  # input, post-attention, pre- and post-feedforward
    mla = {}
    if model_type == "deepseek_v3":
        rope, nope = int(config.qk_rope_head_dim), int(config.qk_nope_head_dim)
        mla = dict(head_dim=nope + rope, v_head_dim=int(config.v_head_dim), q_lora_rank=int(config.q_lora_rank or 0),
                   kv_lora_rank=int(config.kv_lora_rank), qk_rope_head_dim=rope, kv_heads=heads)
        extra = mla["q_lora_rank"] + mla["kv_lora_rank"]  # q_a_layernorm, kv_a_layernorm
    # A norm after the MLP (Gemma-2/3, OLMo-2) keeps the last matmul's output for backward.
    tail_bare = model_type not in ("gemma2", "gemma3_text", "olmo2")
    shape = dict(
        layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, head_dim=head_dim, ffn=expert_ffn,
        vocab=vocab, gated_mlp=bool(getattr(config, "mlp_gated", True)), experts=experts, top_k=top_k,
        tied_embeddings=bool(_get(config, "tie_word_embeddings", default=False)),
        windows=windows, chunks=chunks, qkv_bias=attn_bias or model_type == "qwen2" or model_type == "qwen2_moe",
        o_bias=attn_bias, mlp_bias=bool(getattr(config, "mlp_bias", False)), model_type=model_type,
        moe_layers=_moe_layers(config, layers, experts), dense_ffn=dense_ffn, shared_ffn=shared_ffn,
        shared_gate=model_type == "qwen2_moe" and shared_ffn > 0, layer_norms=norms, extra_layer_params=extra,
        dense_tail_bare=tail_bare, moe_tail_bare=model_type == "deepseek_v3" and shared_ffn > 0)
    shape.update(mla)
    return ModelShape(**shape)


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


def _layer_keys(model, seq_len, convention: str) -> list[float]:
    """Mean attended keys per layer of a :class:`ModelShape` or :class:`CountedFlops`."""
    layers = model.layers
    windows = model.windows or (None,) * layers
    chunks = model.chunks or (None,) * layers
    cache: dict[tuple, float] = {}
    out = []
    for w, c in zip(windows, chunks):
        if (w, c) not in cache:
            cache[(w, c)] = mean_attended_keys(seq_len, w, convention, c)
        out.append(cache[(w, c)])
    return out


def _model(config):
    """A :class:`CountedFlops` as it is, else the config's :class:`ModelShape`."""
    return config if isinstance(config, CountedFlops) else model_shape(config)


def attention_flops_per_token(config, seq_len: float | Sequence[float],
                              convention: str = "megatron") -> float:
    """Training FLOPs per token of the attention-score matmuls alone (QK^T and scores @ V).

    ``sum over layers of 6 * n*(d_qk + d_v) * k_layer`` (``12*(n*d)*k`` for equal head widths):
    forward ``2*n*d_qk*k`` for QK^T and ``2*n*d_v*k`` for the weighted sum of values, times 3 for
    forward + backward. Useful where the flop counter cannot see attention (CPU scaled-dot-product
    attention) or sees it without the causal discount (fused GPU kernels are counted as the full
    square).

    Args:
        config: as for :func:`model_shape`, or a :class:`CountedFlops`.
        seq_len: as for :func:`mean_attended_keys`.
        convention: ``megatron`` or ``palm``.
    """
    m = _model(config)
    keys = _layer_keys(m, seq_len, convention)
    if isinstance(m, CountedFlops):
        return sum(b * k for b, k in zip(m.attention_per_key, keys))
    return sum(6.0 * m.attention_width() * k for k in keys)


def flops_per_token(config, seq_len: float | Sequence[float], convention: str = "megatron") -> float:
    """Training FLOPs per token (forward + backward) of a decoder-only transformer.

    ``F = sum_layers [6*W_l + 6*n*(d_qk + d_v)*k_l] + 6*h*V``, where ``W_l`` are the matmul weights
    one token goes through in layer ``l`` (:meth:`ModelShape.layer_weights`: Q/K/V/O or the MLA
    projections; the dense MLP, or the router, the ``top_k`` routed experts and the shared
    experts) and ``k_l`` its mean attended keys (:func:`mean_attended_keys`, with the layer's
    window or chunk). For Llama with ``n*d = h`` this is the METRICS.md formula
    ``L*h^2*(12 + 12*g/n + 18*f/h + 6*s/h) + 6*h*V``. Derivation and sources in the module
    docstring and ``docs/formulas.md``. A :class:`CountedFlops` gives its counted weight FLOPs plus
    its counted attention cost per key times the same ``k_l``.

    Args:
        config: a Hugging Face config, shape object or :class:`CountedFlops` (see :func:`model_shape`).
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
    m = _model(config)
    if isinstance(m, CountedFlops):
        return m.weight_flops + attention_flops_per_token(m, seq_len, convention)
    weights = sum(m.layer_weights(i) for i in range(m.layers)) + m.hidden * m.vocab  # LM head always counted
    return 6.0 * weights + attention_flops_per_token(m, seq_len, convention)


def recompute_flops_per_token(config, seq_len: float | Sequence[float], recompute: "Recompute | None", *,
                              attention_only: bool = False) -> float:
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

    Raises:
        ValueError: for a :class:`CountedFlops` counted without this recomputation.
    """
    if recompute is None:
        return 0.0
    m = _model(config)
    keys = _layer_keys(m, seq_len, "palm")
    if isinstance(m, CountedFlops):
        if m.recompute != recompute:
            raise ValueError(f"the meta-device count of {m.model_type!r} was made with recompute={m.recompute!r}, "
                             f"not {recompute!r}; count it again with this checkpointing")
        attention = sum(b * k for b, k in zip(m.recompute_per_key, keys))
        return attention if attention_only else m.recompute_weight_flops + attention
    total = 0.0
    for i in range(m.layers):
        if recompute.checkpointed(i):
            weights = 0 if attention_only else m.layer_weights(i) - (m.tail_weights(i) if recompute.early_stop else 0)
            total += 2.0 * weights + 2.0 * m.attention_width() * keys[i]
    return total


def hardware_flops_per_token(config, seq_len: float | Sequence[float], recompute: "Recompute | None" = None) -> float:
    """Training FLOPs per token the device executes: ``palm`` FLOPs plus the recomputed forward.

    Dense attention kernels (eager, SDPA math, CPU SDPA, flash as the flop counter counts it)
    compute every query-key pair of the causal square, so executed FLOPs follow the ``palm``
    convention; activation checkpointing adds :func:`recompute_flops_per_token`.
    """
    return flops_per_token(config, seq_len, "palm") + recompute_flops_per_token(config, seq_len, recompute)


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
        ``active``: parameters a token uses (MoE: router, shared experts and ``top_k`` routed
        experts per MoE layer, other experts excluded; equals ``total`` for a dense model).
        A :class:`CountedFlops` gives the meta model's counts (``active`` None for MoE).
    """
    if isinstance(config, CountedFlops):
        return {"total": config.params_total, "non_embedding": config.params_non_embedding,
                "active": config.params_active}
    s = model_shape(config)
    h = s.hidden
    attn = s.attention_weight_params()
    if s.qkv_bias:
        attn += (s.q_lora_rank + s.kv_lora_rank + s.qk_rope_head_dim) if s.mla else s.q_width + 2 * s.kv_width
    if s.o_bias:
        attn += h
    norm = (2 * h) if s.layer_norm else h  # one norm

    def mlp(width: int) -> int:
        bias = ((2 if s.gated_mlp else 1) * width + h) if s.mlp_bias and width else 0
        return s._mlp(width) + bias

    expert = mlp(s.ffn)
    total_layers = inactive = 0
    for i in range(s.layers):
        if s.is_moe(i):
            block = (s.experts * expert + s.router_params() + mlp(s.shared_ffn)
                     + (h if s.shared_gate else 0))
            inactive += (s.experts - s.top_k) * expert
        else:
            block = mlp(s.dense_ffn or s.ffn)
        total_layers += attn + block + s.layer_norms * norm + s.extra_layer_params
    embedding = s.vocab * h + s.learned_positions * h
    lm_head = 0 if s.tied_embeddings else s.vocab * h
    total = embedding + total_layers + norm + lm_head  # + the final norm
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


#: Full activation checkpointing of a whole model, in the rule-of-thumb form: forward + backward
#: is three forward-equivalents of GEMM FLOPs, recomputing every forward adds a fourth (Korthikanti
#: et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", Sec. 5). Only the
#: checkpointed layers' share rises so; :func:`recompute_flops_per_token` counts what really runs.
RECOMPUTE_FACTOR = 4.0 / 3.0


def hardware_model_ratio(config, seq_len: float, *, recompute: "bool | Recompute | None" = False) -> float:
    """Hardware FLOPs per model FLOP, analytic: what HFU is to MFU when no step was counted.

    ``hardware_flops_per_token(s, recompute) / flops_per_token(s, "megatron")``: dense attention
    kernels compute the full ``s x s`` score matrix, so executed FLOPs follow the ``palm``
    convention (no causal discount) while model FLOPs follow ``megatron``; activation checkpointing
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
    """
    rc = Recompute() if recompute is True else (recompute or None)
    return hardware_flops_per_token(config, seq_len, rc) / flops_per_token(config, seq_len, "megatron")


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
