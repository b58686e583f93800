"""What a model is, for FLOPs and parameter counts: its shapes read from a Hugging Face config.

:func:`model_shape` reads a :class:`ModelShape` from a config of one of :data:`FORMULA_TYPES` (or
a shape object with Llama attribute names); :func:`attention_windows` reads each layer's sliding
window and attention chunk; :func:`param_counts` counts total, non-embedding and active
parameters. A model type the formula does not know is counted on the meta device instead
(:mod:`mlflow_llmeff.meters.flopcount`), which yields a :class:`CountedFlops`; :class:`Recompute`
says which layers activation checkpointing re-executes. The FLOPs these shapes cost are in
:mod:`mlflow_llmeff.calc.flops` (which re-exports every name here); derivations in ``docs/formulas.md``.

Pure arithmetic: standard library only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

__all__ = [
    "FORMULA_TYPES",
    "ModelShape",
    "CountedFlops",
    "Recompute",
    "Matrix",
    "Adapter",
    "Trainable",
    "model_shape",
    "attention_windows",
    "param_counts",
]

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

    def layer_matrices(self, layer: int) -> tuple["Matrix", ...]:
        """The weight matrices one token goes through in layer ``layer``, in forward order by stage.

        Canonical names (Llama's module names): ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``
        (MLA: ``q_a_proj``/``q_b_proj`` or ``q_proj``, ``kv_a_proj_with_mqa``, ``kv_b_proj``,
        ``o_proj``); dense MLP ``gate_proj``, ``up_proj``, ``down_proj`` (plain MLP: ``up_proj``,
        ``down_proj``); MoE ``router``, ``experts_in`` / ``experts_out`` (``count = top_k``),
        ``shared_in`` / ``shared_out`` / ``shared_gate``. Their weights sum to :meth:`layer_weights`.
        """
        h, n, dv = self.hidden, self.heads, self.v_head_dim or self.head_dim
        if self.mla:
            q = ((Matrix("q_a_proj", QKV, h, self.q_lora_rank), Matrix("q_b_proj", QKV, self.q_lora_rank, self.q_width))
                 if self.q_lora_rank else (Matrix("q_proj", QKV, h, self.q_width),))
            attn = q + (Matrix("kv_a_proj_with_mqa", QKV, h, self.kv_lora_rank + self.qk_rope_head_dim),
                        Matrix("kv_b_proj", QKV, self.kv_lora_rank, n * (self.head_dim - self.qk_rope_head_dim + dv)))
        else:
            attn = (Matrix("q_proj", QKV, h, self.q_width), Matrix("k_proj", QKV, h, self.kv_width),
                    Matrix("v_proj", QKV, h, self.kv_heads * dv))
        attn += (Matrix("o_proj", O, self.v_width, h),)
        k = 2 if self.gated_mlp else 1
        if self.is_moe(layer):
            mlp = (Matrix("router", MLP_IN, h, self.experts), Matrix("experts_in", MLP_IN, h, k * self.ffn, self.top_k),
                   Matrix("experts_out", MLP_OUT, self.ffn, h, self.top_k))
            if self.shared_ffn:
                mlp += (Matrix("shared_in", MLP_IN, h, k * self.shared_ffn), Matrix("shared_out", MLP_OUT, self.shared_ffn, h))
            if self.shared_gate:
                mlp += (Matrix("shared_gate", MLP_IN, h, 1),)
        else:
            f = self.dense_ffn or self.ffn
            mlp = ((Matrix("gate_proj", MLP_IN, h, f),) if self.gated_mlp else ()) + (
                Matrix("up_proj", MLP_IN, h, f), Matrix("down_proj", MLP_OUT, f, h))
        return attn + mlp

    def tail_weights(self, layer: int) -> int:
        """Weights of layer ``layer``'s last matmul when early-stopped recomputation skips it, else 0."""
        if self.is_moe(layer):
            return self.hidden * self.shared_ffn if self.moe_tail_bare else 0
        return self.hidden * (self.dense_ffn or self.ffn) if self.dense_tail_bare else 0


#: Stages of a decoder layer in forward order. A matrix's input needs a gradient exactly when
#: something trainable lies in an earlier stage, this layer or below (matrices of one stage read
#: the same input: a trainable q_proj does not make k_proj's input need one).
INPUT_NORM, QKV, ATTENTION, O, POST_NORM, MLP_IN, MLP_OUT = range(7)

#: Stage of each trainable name that is no counted matrix: norms (0 FLOPs, but a trainable norm
#: makes every later matmul's input need a gradient); ``*`` is the whole layer (from its first stage).
_NORM_STAGES = {"input_norm": INPUT_NORM, "post_norm": POST_NORM, "*": INPUT_NORM}


class Matrix(NamedTuple):
    """One weight matrix of a decoder layer: ``(1 x d_in) @ (d_in x d_out)`` per token, ``count`` times
    (``top_k`` for routed experts)."""

    name: str
    stage: int
    d_in: int
    d_out: int
    count: int = 1

    @property
    def weights(self) -> int:
        return self.d_in * self.d_out * self.count


@dataclass(frozen=True)
class Adapter:
    """A LoRA adapter on one weight matrix: ``x -> (x A^T) B^T * alpha/r`` beside the frozen ``x W^T``
    (Hu et al. 2021, "LoRA", Sec. 4.1), ``A: (r, d_in)``, ``B: (d_out, r)``: ``r*(d_in + d_out)`` parameters.

    Attributes:
        layer: decoder layer index (0-based).
        matrix: the canonical name of the matrix it adapts (:meth:`ModelShape.layer_matrices`).
        d_in, d_out: the adapted matrix's input and output widths.
        rank: ``r`` (>= 1).
    """

    layer: int
    matrix: str
    d_in: int
    d_out: int
    rank: int

    def __post_init__(self) -> None:
        if self.rank < 1 or self.d_in < 1 or self.d_out < 1 or self.layer < 0:
            raise ValueError(f"adapter {self!r} is not accepted; give rank, d_in, d_out >= 1 and layer >= 0")

    @property
    def params(self) -> int:
        return self.rank * (self.d_in + self.d_out)


@dataclass(frozen=True)
class Trainable:
    """What a run trains, for FLOPs: which matrices get a weight gradient, and the LoRA adapters.

    A frozen weight (``requires_grad=False``) costs no weight-gradient matmul; a matmul's input
    gradient is computed only where something trainable lies below it (``docs/formulas.md``,
    "Frozen weights and adapters"). Pure description, built by
    :func:`mlflow_llmeff.meters.trainable.read_trainable` from a real model or :meth:`lora` from a
    shape. ``None`` in place of a Trainable means everything trains.

    Attributes:
        layers: per decoder layer, the trainable names: canonical matrix names
            (:meth:`ModelShape.layer_matrices`), ``input_norm`` / ``post_norm`` for a trainable norm,
            ``*`` for the whole layer.
        embedding: the input embedding is trainable (layer 0's input then needs a gradient).
        lm_head: the LM head weight is trainable (tied to a trainable embedding counts as trainable).
        adapters: LoRA adapters (always trainable).
        trainable_params, total_params: ``requires_grad`` parameters and all parameters (adapters
            included), for the share; None when unknown.
        source: where this was read (``requires_grad of the model``, ``--lora-rank``, ...).
    """

    layers: tuple[frozenset[str], ...]
    embedding: bool = False
    lm_head: bool = False
    adapters: tuple[Adapter, ...] = ()
    trainable_params: int | None = None
    total_params: int | None = None
    source: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(frozenset(x) for x in self.layers))
        bad = [a.layer for a in self.adapters if a.layer >= len(self.layers)]
        if bad:
            raise ValueError(f"adapter layers {bad} are not accepted; the description has {len(self.layers)} layers")
        if (self.trainable_params is not None and self.total_params is not None
                and not 0 <= self.trainable_params <= self.total_params):
            raise ValueError(f"trainable_params={self.trainable_params} must be in 0..total_params={self.total_params}")

    @classmethod
    def lora(cls, shape: "ModelShape", rank: int, targets, *, params_total: int | None = None) -> "Trainable":
        """LoRA of rank ``rank`` on the ``targets`` matrices of every layer, everything else frozen
        (peft's ``get_peft_model`` with ``LoraConfig(r=rank, target_modules=targets)``).

        Args:
            shape: the model's :class:`ModelShape`.
            rank: ``r`` (>= 1).
            targets: canonical matrix names (e.g. ``("q_proj", "v_proj")``), or one comma-separated string.
            params_total: the base model's parameters (for the share), or None.

        Raises:
            ValueError: a rank below 1, no target, or a target no layer has.
        """
        if isinstance(targets, str):
            targets = [t.strip() for t in targets.split(",") if t.strip()]
        targets = tuple(dict.fromkeys(targets))
        if not isinstance(rank, int) or rank < 1:
            raise ValueError(f"LoRA rank {rank!r} is not accepted; give an integer >= 1")
        if not targets:
            raise ValueError("LoRA targets are empty; give module names such as q_proj,v_proj")
        adapters = []
        for i in range(shape.layers):
            mats = {m.name: m for m in shape.layer_matrices(i)}
            adapters += [Adapter(i, t, mats[t].d_in, mats[t].d_out, rank) for t in targets if t in mats]
        missing = [t for t in targets if not any(a.matrix == t for a in adapters)]
        if missing:
            known = sorted({m.name for i in range(shape.layers) for m in shape.layer_matrices(i)})
            raise ValueError(f"LoRA targets {', '.join(missing)} match no matrix of this model; accepted: {', '.join(known)}")
        extra = sum(a.params for a in adapters)
        return cls(layers=(frozenset(),) * shape.layers, adapters=tuple(adapters), trainable_params=extra,
                   total_params=None if params_total is None else params_total + extra,
                   source=f"LoRA r={rank} on {','.join(targets)} (every layer), base model frozen")

    @property
    def share(self) -> float | None:
        """Trainable parameters over all parameters (a fraction in [0, 1]), or None when unknown."""
        if self.trainable_params is None or not self.total_params:
            return None
        return self.trainable_params / self.total_params

    def lora_summary(self) -> str | None:
        """``r=8 on q_proj,v_proj`` (ranks and targets of the adapters), or None without adapters."""
        if not self.adapters:
            return None
        ranks = sorted({a.rank for a in self.adapters})
        targets = ",".join(dict.fromkeys(a.matrix for a in self.adapters))
        return f"r={'/'.join(map(str, ranks))} on {targets}"

    def describe(self) -> str:
        """One line for the ``llmeff.flops.trainable`` tag and ``llmeff flops``: the trainable share,
        the LoRA rank and targets, and where it was read."""
        share = self.share
        head = (f"{self.trainable_params:,} of {self.total_params:,} parameters trainable ({share:.4%})"
                if share is not None else "trainable share unknown")
        lora = self.lora_summary()
        frozen = [i for i, names in enumerate(self.layers) if not names] if not lora else []
        parts = [head]
        if lora:
            parts.append(f"LoRA {lora} in {len({a.layer for a in self.adapters})} layers")
        elif frozen:
            parts.append(f"{len(frozen)} of {len(self.layers)} decoder layers frozen")
        parts.append(f"embedding {'trainable' if self.embedding else 'frozen'}, "
                     f"LM head {'trainable' if self.lm_head else 'frozen'}")
        if self.source:
            parts.append(f"read from {self.source}")
        return "; ".join(parts) + ("; FLOPs: forward 2/weight, input gradient 2/weight above the lowest trainable "
                                   "weight, weight gradient 2/trainable weight, adapters' own matmuls added "
                                   "(docs/formulas.md; NeMo Automodel #786, VeOmni #983, Hu et al. 2021)")


@dataclass(frozen=True)
class CountedFlops:
    """FLOPs per token of a model counted with FlopCounterMode (one forward and backward, meta device).

    The count runs eager attention, which computes every query-key pair, at several sequence
    lengths, so per layer the counted training FLOPs per token are ``a_l + b_l * s``: ``b_l`` is the
    attention matmuls' cost per attended key. Model FLOPs then take each layer's attended keys
    from :func:`~mlflow_llmeff.calc.flops.mean_attended_keys` (causal discount, windows and chunks from the config), exactly
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
