"""Plan a run before paying for it: parameters, FLOPs, memory and communication per device (pure estimates).

Memory per device (bytes) is estimated from the model shape, not measured; the figure that must
fit is the PEAK of a step, the largest of its phases (:meth:`MemoryEstimate.phases`), not the sum of
every term. docs/memory.md ("The plan: what a step holds at its peak") gives each term, its source
and the plan against the measured peak.

* Model state, per lever: weights and gradients in the weights' dtype (``--weights fp32``: 4 + 4 B,
  the master copy torch AMP autocasts from; ``bf16``: 2 + 2 B, no master), the optimizer's state
  counted over the model's tensors by :func:`mlflow_llmeff.calc.optimizers.state_bytes` (fp32
  AdamW: 8 B; 8-bit: about 2.03 B; small tensors kept plain), divided by the sharding strategy.
  FSDP full shard divides all of it over the data-parallel ranks, HSDP over its shard group.
  DeepSpeed ZeRO keeps its working weights and gradients in the run's precision (2 + 2 B in
  16-bit, 4 + 4 B in fp32) plus K = 12 B of fp32 master weights and moments per parameter; stage 1
  shards the 12, stage 2 also the gradients, stage 3 everything (Rajbhandari et al. 2020, "ZeRO",
  Sec. 5, Fig. 1). As DeepSpeed 0.19 runs it (read in its source, checked on CPU engines): 16-bit
  stages 1 and 2 add the fp32 copy of the rank's gradient partition the step makes (4 B / dp);
  stage 3 holds, in forward and backward, its tensors of at most 1e5 elements whole on every rank
  (``stage3_param_persistence_threshold``) and, at the step, an fp32 copy of the gradient partition
  (4 B / dp, fp32 runs too), whichever is larger (:func:`model_state_bytes`); ZeRO is planned for
  AdamW with fp32 weights only. Tensor parallelism splits the parameters of the layer matrices its
  plan names over ``tp`` ranks (embeddings, norms and the LM head stay whole); 2-D (fsdp_tp) then
  shards each rank's part over ``dp_shard``.
* Activations kept for the backward pass, as transformers 5's Llama keeps them (read in
  ``modeling_llama.py``, measured on CPU in tests/test_plan_memory.py), in the accounting of
  Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", Sec.
  4.1) without dropout, per layer and token, with ``c`` the compute dtype's bytes and ``r`` the
  weights' (the residual stream's): two RMSNorms ``2 (4h + r h + c h)`` (the fp32 upcast of the
  input, the normalized input, the output the projections save), attention ``(2hq + 2hk) c``
  (rotated Q and K, V, the output ``o_proj`` saves; the CPU flash kernel's output is already
  contiguous, its logsumexp O(s)), a gated MLP ``4 f c`` (gate output for SiLU, SiLU output, up
  output, their product for ``down_proj``; Korthikanti's count has three), a plain MLP ``2 f c``.
  Eager attention adds the softmax probabilities, ``n s`` per token in fp32
  (``softmax(dtype=float32)``) plus their cast to ``c`` when ``c`` is 2. Outside the layers: the
  final norm and the fp32 RoPE tables (``8 d``). Full activation checkpointing keeps each layer's
  input (``r h``), the final norm and, with eager attention, the 4-D causal mask (``s^2 r`` per
  sequence, an input of every checkpointed layer); one layer is recomputed at a time in the
  backward. Tensor parallelism divides what lies inside the attention and MLP blocks by ``tp``
  (Korthikanti et al. 2022, eq. 2, without sequence parallelism); context parallelism divides the
  tokens by ``cp``.
* The loss path at the vocabulary ``V`` (transformers 5 ``LlamaForCausalLM.forward`` and
  ``loss/loss_utils.py`` ``ForCausalLMLoss``; transformers PR #33902 is about this gradient): the
  logits in the compute dtype, held by the training loop's ``out`` until the micro-step ends
  (train/loop.py ``_micro_step``), ``T V c``; in the forward the ``.float()`` upcast (an fp32 copy
  in 16-bit runs, none in fp32) and ``cross_entropy``'s ``log_softmax`` output (``4 T V``, kept for
  the backward); at the backward's start that output, ``nll_loss``'s fp32 gradient and
  ``log_softmax_backward``'s fp32 output: ``12 T V``.
* Under autocast (16-bit precision, fp32 weights, strategies that keep whole weights), the 16-bit
  copy of every weight that autocast caches and the backward keeps: 2 B/param.
* The optimizer step's temporaries (:func:`mlflow_llmeff.calc.optimizers.step_temporary_bytes`:
  torch's foreach AdamW one model in the state dtype on CUDA; on a CPU the single-tensor loop, two
  tensors of the largest parameter) on top of weights, gradients, state and the held logits.

Model state and communication per device and step are each strategy's own arithmetic, in its module
of :mod:`mlflow_llmeff.parallel` (:meth:`~mlflow_llmeff.parallel.base.Strategy.model_state_bytes`,
:meth:`~mlflow_llmeff.parallel.base.Strategy.bus_bytes`: nccl-tests bus bytes of every collective it
runs); this module asks the strategy. Predictions from earlier runs (time, cost, energy)
read the tracking server and live in :mod:`mlflow_llmeff.planning.predict`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mlflow_llmeff.calc import optimizers as opt
from mlflow_llmeff.calc.comm import TrafficShape
from mlflow_llmeff.calc.flops import flops_per_token, model_shape, param_counts
from mlflow_llmeff.calc.throughput import global_batch_tokens
from mlflow_llmeff.parallel import Degrees, get
from mlflow_llmeff.parallel.deepspeed import ZERO3_PERSISTENCE_THRESHOLD

GIB = 2**30


@dataclass(frozen=True)
class MemoryEstimate:
    """Estimated bytes per device of one micro-batch's step (see the module docstring).

    Attributes:
        weights / gradients / optimizer: model state held by the device.
        activations / activations_ckpt: kept for the backward, without / with full activation
            checkpointing (layers, final norm, RoPE tables; not the loss path).
        logits: the logits in the compute dtype, held by the loop's ``out`` through the step.
        loss_forward: on top of them while the loss is computed: the fp32 upcast (16-bit runs) and
            ``log_softmax``'s output.
        loss_backward: on top of them at the backward's start: ``log_softmax``'s output, the fp32
            gradient of the logits and ``log_softmax_backward``'s output (12 B per token and word).
        layer_backward: one layer's backward working set on top of what is kept (gradients of its
            activations, taken as one layer of activations; eager attention's two ``n s^2`` gradients).
        layer_recompute: one layer's activations, recomputed under checkpointing.
        autocast_copies: 16-bit weight copies autocast caches for forward and backward.
        step_temporaries: what ``optimizer.step()`` allocates on top of the state.
        accumulated_gradients: gradients alive during a forward (gradient accumulation: the earlier
            micro-batches'; 0 with one micro-batch, as ``zero_grad(set_to_none=True)`` frees them).
    """

    weights: float
    gradients: float
    optimizer: float
    activations: float
    activations_ckpt: float
    logits: float = 0.0
    loss_forward: float = 0.0
    loss_backward: float = 0.0
    layer_backward: float = 0.0
    layer_recompute: float = 0.0
    autocast_copies: float = 0.0
    step_temporaries: float = 0.0
    accumulated_gradients: float = 0.0

    def phases(self, activation_checkpointing: bool) -> dict[str, float]:
        """Bytes held at the high point of each phase of a step, from the second step on (the
        optimizer's state exists from the first step's end; the first step holds less).

        ``forward`` (at the loss), ``backward (loss)`` (its first nodes: every activation and autocast
        weight copy still kept), ``backward (layers)`` (gradients complete; the activations and the
        autocast copies the nodes saved are freed as the backward passes them; one layer's working
        set), ``optimizer step`` (the logits are still held by the loop's ``out``).
        """
        kept = self.activations_ckpt if activation_checkpointing else self.activations
        base = self.weights + self.optimizer + self.logits
        during = base + self.accumulated_gradients + kept + self.autocast_copies
        work = self.layer_backward + (self.layer_recompute if activation_checkpointing else 0.0)
        return {"forward": during + self.loss_forward,
                "backward (loss)": during + self.loss_backward,
                "backward (layers)": (base + self.gradients + work
                                      + (self.activations_ckpt if activation_checkpointing else 0.0)),
                "optimizer step": base + self.gradients + self.step_temporaries}

    def peak(self, activation_checkpointing: bool) -> tuple[float, str]:
        """(bytes, phase name) of the step's peak: the largest of :meth:`phases`."""
        phases = self.phases(activation_checkpointing)
        name = max(phases, key=phases.get)
        return phases[name], name

    def total(self, activation_checkpointing: bool) -> float:
        """The step's peak bytes (:meth:`peak`): what must fit."""
        return self.peak(activation_checkpointing)[0]


def model_state_bytes(params: int, strategy: str, dp: int, *, dp_shard: int | None = None, tp: int = 1,
                      tp_params: int = 0, precision: str = "bf16", persistent_params: int = 0,
                      optimizer: str = "adamw", weights: str = "fp32",
                      optimizer_per_param: float | None = None) -> tuple[float, float, float]:
    """(weights, gradients, optimizer) bytes per device for ``params`` parameters under the strategy
    called ``strategy`` (see the module docstring): its
    :meth:`~mlflow_llmeff.parallel.base.Strategy.model_state_bytes`, which holds the accounting.

    Args:
        params: model parameters.
        strategy: a strategy name (``auto`` counts as replicated).
        dp: data-parallel ranks.
        dp_shard: ranks the state is sharded over (HSDP's shard group; default ``dp``).
        tp: tensor-parallel degree.
        tp_params: parameters the tensor-parallel plan splits.
        precision: the run's precision (DeepSpeed keeps its working weights and gradients in it).
        persistent_params: parameters in tensors ZeRO-3 keeps whole (:func:`persistent_param_count`).
        optimizer: an ``--optimizer`` value (:data:`mlflow_llmeff.calc.optimizers.OPTIMIZER_NAMES`).
        weights: ``fp32`` or ``bf16``.
        optimizer_per_param: optimizer-state bytes per parameter counted over the model's tensors
            (:func:`optimizer_bytes_per_param`); None: large tensors' figure.

    Raises:
        ValueError: for an unknown strategy, optimizer or weights, ``dp < 1``, or a ZeRO strategy
            with an optimizer other than ``adamw`` or weights other than ``fp32`` (one line).
    """
    if dp < 1:
        raise ValueError(f"dp={dp} must be >= 1")
    opt.choice(optimizer)
    opt.weight_bytes(weights)
    return _strategy(strategy).model_state_bytes(params, dp, dp_shard=dp_shard, tp=tp, tp_params=tp_params,
                                                 precision=precision, persistent_params=persistent_params,
                                                 optimizer=optimizer, weights=weights,
                                                 optimizer_per_param=optimizer_per_param)


def _strategy(name: str):
    """The :class:`~mlflow_llmeff.parallel.base.Strategy` called ``name`` (``auto``: replicated, as ddp).

    Raises:
        ValueError: for an unknown name.
    """
    try:
        return get("ddp" if name == "auto" else name)
    except ValueError:
        raise ValueError(f"strategy={name!r} is not accepted; use one of: single, ddp, fsdp, hsdp, tp, fsdp_tp, "
                         "deepspeed_zero1/2/3") from None


def state_assumptions(strategy: str, precision: str, degrees=None, *, optimizer: str = "adamw",
                      weights: str = "fp32", optimizer_per_param: float | None = None) -> dict:
    """What the model-state bytes assume, for the plan's text and JSON (every figure says its basis).

    Returns:
        ``master_weights`` (the dtype of the weights the optimizer updates: ``fp32``, or ``none
        (pure bf16 weights)``), ``weights`` (the ``--weights`` value), ``optimizer`` (the class and
        its state), ``optimizer_states`` (the layout, :data:`mlflow_llmeff.calc.optimizers.OPTIMIZERS`),
        ``bytes_per_param_weights`` / ``_gradients`` / ``_optimizer`` / ``_model_state`` (bytes per
        parameter of large tensors, before sharding: :func:`model_state_bytes` of one parameter on
        one rank; the memory figures count the model's own tensors, small ones kept plain, with the
        per-tensor steps and tables: :func:`optimizer_bytes_per_param`), ``weights_held_as`` / ``gradients_held_as`` / ``optimizer_state`` (what those
        bytes are: the strategy's :meth:`~mlflow_llmeff.parallel.base.Strategy.state_held`) and
        ``model_state_sharding`` (how a device's share follows: its
        :meth:`~mlflow_llmeff.parallel.base.Strategy.state_sharding`).

    Raises:
        ValueError: as :func:`model_state_bytes`.
    """
    w, g, o = model_state_bytes(1, strategy, 1, precision=precision, optimizer=optimizer, weights=weights,
                                optimizer_per_param=optimizer_per_param)
    s = _strategy(strategy)
    degrees = degrees if degrees is not None else Degrees()
    how = s.state_sharding(degrees)
    if degrees.tp > 1:
        how += f"; the tensor-parallel plan's matrices split over {degrees.tp} ranks first"
    c = opt.choice(optimizer)
    named = ("AdamW (torch.optim.AdamW, two fp32 moments)" if optimizer == "adamw" and weights == "fp32"
             else f"{optimizer} ({c.cls})")
    return {"master_weights": "fp32" if weights == "fp32" else "none (pure bf16 weights)", "weights": weights,
            "optimizer": named, "optimizer_states": c.states,
            "bytes_per_param_weights": w, "bytes_per_param_gradients": g, "bytes_per_param_optimizer": o,
            "bytes_per_param_model_state": w + g + o,
            **s.state_held(precision, w, g, o, optimizer_name=optimizer, weights_dtype=weights),
            "model_state_sharding": how}


_SHAPES: dict[str, list[tuple[int, ...]]] = {}


def param_shapes(config) -> list[tuple[int, ...]]:
    """Shapes of the parameter tensors of the model built from ``config`` on the meta device (tied
    tensors once; cached per config; no memory is allocated). A preset's
    (:class:`~mlflow_llmeff.models.presets.PresetShape`) are its recorded ones: no torch or transformers."""
    recorded = getattr(config, "param_shapes", None)
    if callable(recorded):
        return recorded()
    key = config.to_json_string(use_diff=False)
    if key not in _SHAPES:
        import torch
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        _SHAPES[key] = [tuple(p.shape) for p in model.parameters()]
    return _SHAPES[key]


def optimizer_bytes_per_param(config, optimizer: str = "adamw", weights: str = "fp32") -> float:
    """Optimizer-state bytes per parameter of the model built from ``config``, counted tensor by tensor
    (:func:`mlflow_llmeff.calc.optimizers.state_bytes`: small tensors kept plain, steps, tables).

    Raises:
        ValueError: an unknown ``optimizer`` or ``weights``.
    """
    shapes = param_shapes(config)
    n = sum(math.prod(s) for s in shapes)
    return opt.state_bytes(optimizer, shapes, opt.weight_bytes(weights)) / n if n else 0.0


def persistent_param_count(config, threshold: int = ZERO3_PERSISTENCE_THRESHOLD) -> int:
    """Parameters in the tensors DeepSpeed ZeRO-3 keeps whole on every rank: those of at most
    ``threshold`` elements (:data:`ZERO3_PERSISTENCE_THRESHOLD`; DeepSpeed 0.19
    ``parameter_offload.py`` ``mark_persistent_parameters``: ``ds_numel <= param_threshold``, tied
    tensors once), counted on the model built from ``config`` on the meta device (cached per config)."""
    return sum(n for n in (math.prod(s) for s in param_shapes(config)) if n <= threshold)


def parameter_split(config) -> dict[str, int]:
    """``total`` parameters, those inside the decoder ``layers`` (the rest is embeddings, final norm,
    LM head: FSDP's root) and those the ``tensor_parallel`` plan splits (the attention and MLP
    weight matrices of every layer)."""
    s = model_shape(config)
    total = param_counts(config)["total"]
    norm = (2 * s.hidden) if s.layer_norm else s.hidden
    outside = s.vocab * s.hidden + s.learned_positions * s.hidden + norm + (0 if s.tied_embeddings else s.vocab * s.hidden)
    tp = s.layers * (s.attention_weight_params() + s.expert_weight_params() * (s.experts or 1))
    return {"total": total, "layers": total - outside, "tensor_parallel": tp}


def _bytes_per_element(precision: str, weights: str) -> tuple[int, int]:
    """(c, r): bytes of the compute dtype (2 under 16-bit autocast or pure bf16 weights, else 4) and of
    the weights, which the residual stream keeps (4 fp32, 2 bf16)."""
    r = opt.weight_bytes(weights)
    return (2 if precision in ("bf16", "fp16") or r == 2 else 4), r


def _per_token(config, seq_len: int, *, precision: str, weights: str, eager_attention: bool,
               tp: int) -> tuple[float, float, float]:
    """(one layer's kept bytes per token, the kept bytes per token outside the layers, eager
    attention's probabilities per token and layer) in the module docstring's accounting."""
    sh = model_shape(config)
    h, hq, hk, f, n = sh.hidden, sh.q_width, sh.kv_width, sh.ffn, sh.heads
    c, r = _bytes_per_element(precision, weights)
    f_active = f * max(1, sh.top_k) if sh.experts else f
    norm = 4 * h + r * h + c * h                        # fp32 upcast of the input, normalized, output
    attention = (2 * hq + 2 * hk) * c                    # rotated Q, K; V; the output o_proj saves
    probs = n * seq_len * (4 + (c if c != 4 else 0)) if eager_attention else 0.0  # softmax (fp32) + its cast
    mlp = (4 if sh.gated_mlp else 2) * f_active * c      # gate, SiLU, up, product (plain: fc, GELU)
    layer = 2 * norm + (attention + probs + mlp) / tp
    outside = norm + 2 * sh.head_dim * r                  # final norm; RoPE cos and sin tables
    return layer, outside, probs / tp


def activation_bytes(config, seq_len: int, micro_batch_size: int, *, precision: str = "bf16",
                     eager_attention: bool = False, tp: int = 1, cp: int = 1,
                     weights: str = "fp32") -> tuple[float, float]:
    """(without, with full checkpointing) bytes of activations kept for the backward, per device and
    micro-batch: the layers, the final norm and the RoPE tables (the loss path is
    :func:`loss_path_bytes`; the accounting is the module docstring's).

    Args:
        config: a transformers config or a :class:`~mlflow_llmeff.calc.flops.ModelShape`.
        seq_len: tokens per sequence; micro_batch_size: sequences per micro-batch.
        precision: the run's precision (``bf16``/``fp16``: 2-byte compute dtype under autocast).
        eager_attention: the eager kernel (keeps the softmax probabilities, ``n s`` per token).
        tp: tensor-parallel degree (divides the blocks' insides); cp: context-parallel degree
            (divides the tokens).
        weights: ``fp32`` or ``bf16`` (the residual stream's dtype).

    Returns:
        (bytes without, bytes with full activation checkpointing).

    Raises:
        ValueError: unknown ``weights``.
    """
    layer, outside, _ = _per_token(config, seq_len, precision=precision, weights=weights,
                                   eager_attention=eager_attention, tp=tp)
    sh = model_shape(config)
    _, r = _bytes_per_element(precision, weights)
    tokens = seq_len * micro_batch_size / cp
    full = tokens * (layer * sh.layers + outside)
    mask = micro_batch_size * seq_len * seq_len / cp * r if eager_attention else 0.0  # 4-D causal mask, a layer input
    ckpt = tokens * (r * sh.hidden * sh.layers + outside) + mask
    return full, ckpt


def loss_path_bytes(config, seq_len: int, micro_batch_size: int, *, precision: str = "bf16",
                    weights: str = "fp32", cp: int = 1) -> tuple[float, float, float]:
    """(logits, on top at the loss forward, on top at the backward's start) bytes per device and
    micro-batch at the vocabulary ``V`` over ``T`` tokens, as transformers 5 computes the causal-LM
    loss (``ForCausalLMLoss``: ``logits.float()``, then ``cross_entropy`` = ``log_softmax`` + ``nll_loss``):

    * logits ``T V c`` (the LM head's output in the compute dtype, held by the loop's ``out``);
    * forward: ``log_softmax``'s fp32 output ``4 T V`` (kept for its backward) plus, in 16-bit runs,
      the ``.float()`` copy ``4 T V`` (fp32 runs: ``.float()`` returns the logits themselves);
    * backward start: the kept output, ``nll_loss_backward``'s fp32 gradient and
      ``log_softmax_backward``'s fp32 output, ``12 T V`` (the later cast to ``c`` is smaller).

    Raises:
        ValueError: unknown ``weights``.
    """
    V = model_shape(config).vocab
    c, _ = _bytes_per_element(precision, weights)
    tv = seq_len * micro_batch_size / cp * V
    return c * tv, (4 + (4 if c != 4 else 0)) * tv, 12 * tv


_SHARDED = ("fsdp", "hsdp", "fsdp_tp", "deepspeed_zero1", "deepspeed_zero2", "deepspeed_zero3")


def estimate_memory(config, *, seq_len: int, micro_batch_size: int, strategy: str, dp: int,
                    precision: str = "bf16", eager_attention: bool = False, degrees=None,
                    optimizer: str = "adamw", weights: str = "fp32", cuda: bool = True,
                    grad_accum: int = 1, trainable=None) -> MemoryEstimate:
    """Bytes per device of every term of a step (see the module docstring and :class:`MemoryEstimate`).

    Args:
        config: a transformers config.
        seq_len / micro_batch_size: tokens per sequence, sequences per micro-batch.
        strategy / dp: the parallelism strategy and its data-parallel ranks.
        precision: the run's precision; eager_attention: the eager attention kernel.
        degrees: the run's :class:`~mlflow_llmeff.parallel.degrees.Degrees` (tensor, context and
            shard degrees); without it every rank is a data-parallel rank (``dp``).
        optimizer / weights: the ``--optimizer`` and ``--weights`` levers.
        cuda: the step runs on CUDA (torch's foreach optimizer path; bitsandbytes' fused kernels);
            False: a CPU (the single-tensor loop; bitsandbytes' CPU backend).
        grad_accum: micro-batches per optimizer step (above 1, the gradients live through forwards).
        trainable: a :class:`~mlflow_llmeff.calc.model_shape.Trainable` with LoRA adapters (``--lora-rank``,
            :func:`lora_trainable`): the base weights are held frozen beside the adapters' ``r (d_in + d_out)``
            weights a matrix, and only the adapters have gradients, optimizer state and step temporaries
            (a replicated strategy: LoRA trains with single or ddp). None: every weight trains.

    Raises:
        ValueError: unknown strategy, optimizer or weights; a ZeRO strategy with another optimizer
            than ``adamw`` or weights other than ``fp32``.
    """
    split = parameter_split(config)
    tp = degrees.tp if degrees is not None else 1
    cp = degrees.cp if degrees is not None else 1
    shard = degrees.dp_shard if degrees is not None and degrees.dp_shard > 1 else None
    ranks = degrees.dp if degrees is not None else dp
    persistent = persistent_param_count(config) if strategy == "deepspeed_zero3" else 0
    per_param = optimizer_bytes_per_param(config, optimizer, weights)
    w, g, o = model_state_bytes(split["total"], strategy, ranks, dp_shard=shard, tp=tp,
                                tp_params=split["tensor_parallel"], precision=precision,
                                persistent_params=persistent, optimizer=optimizer, weights=weights,
                                optimizer_per_param=per_param)
    adapters = [n for a in (trainable.adapters if trainable is not None else ()) for n in (a.rank * a.d_in,
                                                                                             a.d_out * a.rank)]
    if adapters:  # LoRA: the frozen base's weights, and the adapters' weights, gradients and state
        w1, g1, _ = model_state_bytes(1, strategy, ranks, precision=precision, optimizer=optimizer, weights=weights,
                                      optimizer_per_param=per_param)
        w, g = w1 * (split["total"] + sum(adapters)), g1 * sum(adapters)
        o = opt.state_bytes(optimizer, adapters, opt.weight_bytes(weights))
    a, ac = activation_bytes(config, seq_len, micro_batch_size, precision=precision, eager_attention=eager_attention,
                             tp=tp, cp=cp, weights=weights)
    layer, _, probs = _per_token(config, seq_len, precision=precision, weights=weights,
                                 eager_attention=eager_attention, tp=tp)
    tokens = seq_len * micro_batch_size / cp
    logits, loss_fwd, loss_bwd = loss_path_bytes(config, seq_len, micro_batch_size, precision=precision,
                                                 weights=weights, cp=cp)
    wb = opt.weight_bytes(weights)
    if strategy.startswith("deepspeed"):  # AdamW on the rank's flat fp32 partition, one tensor
        temps = opt.step_temporary_bytes("adamw", [int(split["total"] / ranks)], 4, foreach=cuda, cpu=not cuda)
    elif adapters:  # only the adapters step
        temps = opt.step_temporary_bytes(optimizer, adapters, wb, foreach=cuda, cpu=not cuda)
    else:  # the whole model's temporaries, scaled to this device's share of the state
        whole = per_param * split["total"]
        temps = opt.step_temporary_bytes(optimizer, param_shapes(config), wb, foreach=cuda, cpu=not cuda)
        temps *= (o / whole) if whole else 0.0
    c, _ = _bytes_per_element(precision, weights)
    autocast = w / wb * c if (c < wb and strategy not in _SHARDED) else 0.0
    return MemoryEstimate(w, g, o, a, ac, logits=logits, loss_forward=loss_fwd, loss_backward=loss_bwd,
                          layer_backward=tokens * (layer + probs), layer_recompute=tokens * layer,
                          autocast_copies=autocast, step_temporaries=temps,
                          accumulated_gradients=g if grad_accum > 1 else 0.0)


def meta_param_count(config) -> int:
    """Parameters of the model built from ``config`` on the meta device (no memory is allocated); a preset's
    from its recorded shapes (:func:`param_shapes`)."""
    if callable(getattr(config, "param_shapes", None)):
        return sum(math.prod(s) for s in param_shapes(config))
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def lora_trainable(cfg, config):
    """The :class:`~mlflow_llmeff.calc.model_shape.Trainable` of a run with ``--lora-rank`` (adapters of rank r on
    ``--lora-targets`` of every layer, the base frozen), or None when every weight trains.

    Raises:
        ValueError: a target that names no matrix of the model (one line naming the accepted ones).
    """
    if not getattr(cfg, "lora_rank", 0):
        return None
    from mlflow_llmeff.calc.model_shape import Trainable

    return Trainable.lora(model_shape(config), cfg.lora_rank, cfg.lora_targets)


def levers(cfg) -> tuple[str, str]:
    """(optimizer, weights) of a :class:`~mlflow_llmeff.train.config.TrainConfig`."""
    return cfg.optimizer, cfg.weights


def make_plan(cfg, *, accelerator_short: str, precision: str, strategy: str, accelerator_given: str | None = None,
              accelerator_alias: str | None = None, degrees=None, cuda: bool | None = None) -> dict:
    """Everything ``llmeff plan`` prints before predictions, as a dict (bytes, FLOPs, degrees).

    Pure estimates from the model's shape (the model is built on the meta device for its exact
    parameter count); :func:`mlflow_llmeff.planning.predict.add_predictions` adds what earlier runs
    predict.

    Args:
        cfg: a :class:`~mlflow_llmeff.train.config.TrainConfig`.
        accelerator_short: accelerator planned for (the table's short name it was resolved to).
        precision / strategy: resolved precision and parallelism strategy.
        accelerator_given: the accelerator as the user gave it (``--accelerator``), None when the
            plan is for this machine's.
        accelerator_alias: the note of an alias taken (``'H100' taken as H100-SXM ...``), or None.
        degrees: the run's resolved :class:`~mlflow_llmeff.parallel.degrees.Degrees` (:func:`plan_run`
            passes its spec's); None: the strategy's degrees over the processes (a what-if, as
            :func:`strategy_table` asks for each strategy).
        cuda: the run's devices are CUDA devices (the optimizer step's temporaries differ); None:
            all but ``accelerator_short='cpu'``.

    The plan states its assumptions (:func:`state_assumptions`: master-weight precision, the
    optimizer and its state layout, the weights, bytes per parameter of weights, gradients and
    optimizer state), every memory term (:class:`MemoryEstimate`) and ``memory_peak_gib`` with
    ``memory_peak_phase``: the step's peak under the run's activation checkpointing, the figure the
    fit check uses (``memory_total_gib`` / ``memory_total_ckpt_gib``: the peak without / with
    checkpointing). It states the accelerator:
    ``accelerator`` (assumed, as before), ``accelerator_given``, ``accelerator_assumed``,
    ``accelerator_alias_taken`` and, when one was, ``accelerator_alias``. ``engine_installed``
    says whether the strategy's engine (DeepSpeed for ``deepspeed_zero*``) can be imported here,
    and ``engine_missing``, only when it cannot, the line naming how to install it: the figures
    do not need it.

    Raises:
        ValueError: for degrees that do not fit the processes; an unknown optimizer or weights; a
            ZeRO strategy with an optimizer other than ``adamw`` or weights other than ``fp32``.
    """
    from mlflow_llmeff.models.presets import shape_config

    config = shape_config(cfg.model)
    world = cfg.num_processes * cfg.num_machines
    missing = get(strategy).engine_missing()  # looked up, not imported: the plan needs no engine
    if degrees is None:
        degrees = get(strategy).degrees(world, tp_size=cfg.tp_size, dp_shard=cfg.dp_shard,
                                        processes_per_node=cfg.num_processes)
    counts = param_counts(config)
    counts["total"] = meta_param_count(config)  # the built model's own count (tied weights once)
    split = parameter_split(config)
    tokens_per_step = global_batch_tokens(cfg.seq_len, cfg.micro_batch_size, cfg.grad_accum, degrees.dp)
    trainable = lora_trainable(cfg, config)
    fpt = flops_per_token(config, cfg.seq_len, "megatron", trainable=trainable)
    optimizer, weights = levers(cfg)
    cuda = accelerator_short != "cpu" if cuda is None else cuda
    mem = estimate_memory(config, seq_len=cfg.seq_len, micro_batch_size=cfg.micro_batch_size, strategy=strategy,
                          dp=degrees.dp, precision=precision, eager_attention=cfg.attn_implementation == "eager",
                          degrees=degrees, optimizer=optimizer, weights=weights, cuda=cuda, grad_accum=cfg.grad_accum,
                          trainable=trainable)
    peak, phase = mem.peak(cfg.activation_checkpointing)
    shape = model_shape(config)
    comm = get(strategy).bus_bytes(TrafficShape(
        params=counts["total"], layer_params=split["layers"], tp_params=split["tensor_parallel"],
        grad_accum=cfg.grad_accum, tokens_per_micro_batch=cfg.seq_len * cfg.micro_batch_size, hidden=shape.hidden,
        layers=shape.layers, precision=precision, reshard_after_forward=cfg.reshard_after_forward,
        activation_checkpointing=cfg.activation_checkpointing), degrees)
    accel = {"accelerator_given": accelerator_given if accelerator_given is not None else "(this machine)",
             "accelerator_assumed": accelerator_short, "accelerator_alias_taken": accelerator_alias is not None}
    if accelerator_alias is not None:
        accel["accelerator_alias"] = accelerator_alias
    out = {
        "model": cfg.model, "accelerator": accelerator_short, **accel, "devices": world, "machines": cfg.num_machines, "strategy": strategy,
        "degrees": degrees.describe(), "engine_installed": missing is None,
        **({"engine_missing": missing} if missing else {}),
        "precision": precision,
        **state_assumptions(strategy, precision, degrees, optimizer=optimizer, weights=weights),
        "params_total": counts["total"],
        "params_non_embedding": counts["non_embedding"],
        "params_active": counts["active"], "layers": shape.layers, "hidden": shape.hidden,
        "tokens_per_step": tokens_per_step,
        "flops_per_token_megatron": fpt,
        "flops_per_token_palm": flops_per_token(config, cfg.seq_len, "palm", trainable=trainable),
        **({"trainable": f"LoRA {trainable.lora_summary()}: {trainable.trainable_params:,} adapter weights trained, "
                         "the base frozen (no gradients or optimizer state)"} if trainable is not None else {}),
        "flops_per_step": fpt * tokens_per_step,
        "memory_weights_gib": mem.weights / GIB, "memory_gradients_gib": mem.gradients / GIB,
        "memory_optimizer_gib": mem.optimizer / GIB, "memory_activations_gib": mem.activations / GIB,
        "memory_activations_ckpt_gib": mem.activations_ckpt / GIB,
        "memory_logits_gib": mem.logits / GIB, "memory_loss_backward_gib": mem.loss_backward / GIB,
        "memory_autocast_copies_gib": mem.autocast_copies / GIB,
        "memory_step_temporaries_gib": mem.step_temporaries / GIB,
        "memory_total_gib": mem.total(False) / GIB, "memory_total_ckpt_gib": mem.total(True) / GIB,
        "memory_peak_gib": peak / GIB, "memory_peak_phase": phase,
        "comm_bytes_per_step": comm.total,
    }
    for part, v in comm.parts.items():
        out[f"comm_bytes_per_step_{part.split(' (')[0].replace(' ', '_').replace('-', '_')}"] = v
    return out


def plan_run(spec, *, accelerator_given: str | None = None, accelerator_alias: str | None = None) -> dict:
    """:func:`make_plan` of a resolved run (a :class:`~mlflow_llmeff.planning.spec.RunSpec`): its
    strategy, degrees and precision as resolved, for the accelerator of its machine."""
    return make_plan(spec.options, accelerator_short=spec.machine.accelerator, precision=spec.precision,
                     strategy=spec.strategy_name, accelerator_given=accelerator_given,
                     accelerator_alias=accelerator_alias, degrees=spec.degrees, cuda=spec.machine.cuda)


def strategy_table(cfg, *, precision: str) -> list[dict]:
    """Memory and communication per device of ``cfg`` under every strategy its processes allow
    (one row each; strategies whose degrees do not fit are left out with the reason)."""
    import dataclasses

    from mlflow_llmeff.parallel import all_strategies

    rows = []
    for s in all_strategies():
        try:
            plan = make_plan(dataclasses.replace(cfg, parallelism=s.name), accelerator_short="-",
                             precision=precision, strategy=s.name)
        except ValueError as e:
            rows.append({"strategy": s.name, "why_not": str(e)})
            continue
        rows.append({"strategy": s.name, "degrees": plan["degrees"], "memory_total_gib": plan["memory_total_gib"],
                     "comm_bytes_per_step": plan["comm_bytes_per_step"]})
    return rows


def format_plan(plan: dict) -> str:
    """Human-readable table of :func:`make_plan`'s output."""
    rows = []
    for k, v in plan.items():
        if isinstance(v, bool):
            v = "yes" if v else "no"
        elif isinstance(v, dict):  # e.g. assumed: '<input>: <what was taken>' joined by '; '
            v = "; ".join(f"{a}: {b}" for a, b in v.items()) or "nothing"
        elif isinstance(v, float):
            v = f"{v:,.4g}" if abs(v) < 1e6 else f"{v:.4e}"
        elif isinstance(v, int):
            v = f"{v:,}"
        rows.append((k, str(v)))
    w = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{w}}  {v}" for k, v in rows)


def models_table(seq_len: int = 2048) -> list[dict]:
    """One row per preset: parameters, layers, hidden size, FLOPs per token and training memory.

    ``train_memory_gib``: the step's peak on one CUDA device, bf16 mixed precision, fp32 AdamW (16
    B/param of model state), one sequence of ``min(seq_len, positions)`` tokens (:func:`estimate_memory`).
    """
    from mlflow_llmeff.models.presets import PRESETS, max_positions, shape_config

    rows = []
    for name, (_, _, source) in PRESETS.items():
        config = shape_config(name)
        s = min(seq_len, max_positions(config) or seq_len)
        shape = model_shape(config)
        mem = estimate_memory(config, seq_len=s, micro_batch_size=1, strategy="single", dp=1, precision="bf16")
        rows.append({"preset": name, "params": param_counts(config)["total"], "layers": shape.layers,
                     "hidden": shape.hidden, "seq_len": s, "flops_per_token": flops_per_token(config, s),
                     "train_memory_gib": mem.total(False) / GIB, "source": source})
    return rows
