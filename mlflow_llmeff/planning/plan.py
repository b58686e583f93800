"""Plan a run before paying for it: parameters, FLOPs, memory and communication per device (pure estimates).

Memory per device (bytes) is estimated from the model shape, not measured:

* Model state, mixed precision as Accelerate/torch AMP runs it (fp32 master weights 4 B, fp32
  gradients 4 B, AdamW's two fp32 moments 8 B: 16 B/param), divided by the sharding strategy.
  FSDP full shard divides all 16 B over the data-parallel ranks, HSDP over its shard group.
  DeepSpeed ZeRO keeps its working weights and gradients in the run's precision (2 + 2 B in
  16-bit, 4 + 4 B in fp32) plus K = 12 B of fp32 master weights and moments per parameter; stage 1
  shards the 12, stage 2 also the gradients, stage 3 everything (Rajbhandari et al. 2020, "ZeRO",
  Sec. 5, Fig. 1). As DeepSpeed 0.19 runs it (read in its source, checked on CPU engines): 16-bit
  stages 1 and 2 add the fp32 copy of the rank's gradient partition the step makes (4 B / dp);
  stage 3 holds, in forward and backward, its tensors of at most 1e5 elements whole on every rank
  (``stage3_param_persistence_threshold``) and, at the step, an fp32 copy of the gradient partition
  (4 B / dp, fp32 runs too), whichever is larger (:func:`model_state_bytes`). Tensor parallelism splits the parameters of the layer matrices its plan names
  over ``tp`` ranks (embeddings, norms and the LM head stay whole); 2-D (fsdp_tp) then shards each
  rank's part over ``dp_shard``.
* Activations kept for the backward pass, per layer and token (16-bit activations; x2 for fp32),
  following the accounting of Korthikanti et al. 2022 ("Reducing Activation Recomputation in
  Large Transformer Models", Sec. 4.1) without dropout masks and generalised to GQA and gated
  MLPs: attention ``2h + 2hq + 4hk + 2hq`` (input, Q, K and V, attention output), MLP ``2h + 6f``
  (gated: input, gate and up outputs, their product) or ``2h + 4f`` (plain), two norms ``4h``; eager
  attention adds the softmax output ``2ns`` (fused SDPA/flash kernels recompute it). For GPT-2
  shapes this gives 32h per token where Korthikanti's eq. 1 gives 34h (its two dropout masks).
  Full activation checkpointing keeps only each layer's input (``2h``) plus one layer's full
  activations during recomputation. The fp32 logits (``4V`` per token) are added in both cases.
  Tensor parallelism divides what lies inside the attention and MLP blocks (Q, K, V, attention
  output, the MLP's inner widths, the softmax) by ``tp``; the layer inputs and norms stay whole
  (Korthikanti et al. 2022, eq. 2, without sequence parallelism). Context parallelism divides all
  of it by ``cp``.

Model state and communication per device and step are each strategy's own arithmetic, in its module
of :mod:`mlflow_llmeff.parallel` (:meth:`~mlflow_llmeff.parallel.base.Strategy.model_state_bytes`,
:meth:`~mlflow_llmeff.parallel.base.Strategy.bus_bytes`: nccl-tests bus bytes of every collective it
runs); this module asks the strategy. Predictions from earlier runs (time, cost, energy)
read the tracking server and live in :mod:`mlflow_llmeff.planning.predict`.
"""

from __future__ import annotations

from dataclasses import dataclass

from mlflow_llmeff.calc.comm import TrafficShape
from mlflow_llmeff.calc.flops import flops_per_token, model_shape, param_counts
from mlflow_llmeff.calc.throughput import global_batch_tokens
from mlflow_llmeff.parallel import Degrees, get
from mlflow_llmeff.parallel.deepspeed import ZERO3_PERSISTENCE_THRESHOLD

GIB = 2**30


@dataclass(frozen=True)
class MemoryEstimate:
    """Estimated bytes per device. ``activations_ckpt`` is with full activation checkpointing."""

    weights: float
    gradients: float
    optimizer: float
    activations: float
    activations_ckpt: float

    def total(self, activation_checkpointing: bool) -> float:
        act = self.activations_ckpt if activation_checkpointing else self.activations
        return self.weights + self.gradients + self.optimizer + act


def model_state_bytes(params: int, strategy: str, dp: int, *, dp_shard: int | None = None, tp: int = 1,
                      tp_params: int = 0, precision: str = "bf16",
                      persistent_params: int = 0) -> tuple[float, float, float]:
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

    Raises:
        ValueError: for an unknown strategy or ``dp < 1``.
    """
    if dp < 1:
        raise ValueError(f"dp={dp} must be >= 1")
    return _strategy(strategy).model_state_bytes(params, dp, dp_shard=dp_shard, tp=tp, tp_params=tp_params,
                                                 precision=precision, persistent_params=persistent_params)


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


def state_assumptions(strategy: str, precision: str, degrees=None) -> dict:
    """What the model-state bytes assume, for the plan's text and JSON (every figure says its basis).

    Returns:
        ``master_weights`` (the dtype of the weights the optimizer updates), ``optimizer``,
        ``bytes_per_param_weights`` / ``_gradients`` / ``_optimizer`` / ``_model_state`` (bytes per
        parameter of the whole model, before sharding: :func:`model_state_bytes` of one parameter
        on one rank), ``weights_held_as`` / ``gradients_held_as`` / ``optimizer_state`` (what those
        bytes are: the strategy's :meth:`~mlflow_llmeff.parallel.base.Strategy.state_held`) and
        ``model_state_sharding`` (how a device's share follows: its
        :meth:`~mlflow_llmeff.parallel.base.Strategy.state_sharding`).

    Raises:
        ValueError: for an unknown strategy (as :func:`model_state_bytes`).
    """
    w, g, o = model_state_bytes(1, strategy, 1, precision=precision)
    s = _strategy(strategy)
    degrees = degrees if degrees is not None else Degrees()
    how = s.state_sharding(degrees)
    if degrees.tp > 1:
        how += f"; the tensor-parallel plan's matrices split over {degrees.tp} ranks first"
    return {"master_weights": "fp32", "optimizer": "AdamW (torch.optim.AdamW, two fp32 moments)",
            "bytes_per_param_weights": w, "bytes_per_param_gradients": g, "bytes_per_param_optimizer": o,
            "bytes_per_param_model_state": w + g + o, **s.state_held(precision, w, g, o),
            "model_state_sharding": how}


_PERSISTENT: dict[tuple[str, int], int] = {}


def persistent_param_count(config, threshold: int = ZERO3_PERSISTENCE_THRESHOLD) -> int:
    """Parameters in the tensors DeepSpeed ZeRO-3 keeps whole on every rank: those of at most
    ``threshold`` elements (:data:`ZERO3_PERSISTENCE_THRESHOLD`; DeepSpeed 0.19
    ``parameter_offload.py`` ``mark_persistent_parameters``: ``ds_numel <= param_threshold``, tied
    tensors once), counted on the model built from ``config`` on the meta device (cached per config)."""
    key = (config.to_json_string(use_diff=False), threshold)
    if key not in _PERSISTENT:
        import torch
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        _PERSISTENT[key] = sum(p.numel() for p in model.parameters() if p.numel() <= threshold)
    return _PERSISTENT[key]


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


def activation_bytes(config, seq_len: int, micro_batch_size: int, *, precision: str = "bf16",
                     eager_attention: bool = False, tp: int = 1, cp: int = 1) -> tuple[float, float]:
    """(without, with full checkpointing) activation bytes per device for one micro-batch (``tp``:
    tensor-parallel degree, ``cp``: context-parallel degree; see the module docstring)."""
    sh = model_shape(config)
    h, hq, hk, f, n, L, V = sh.hidden, sh.q_width, sh.kv_width, sh.ffn, sh.heads, sh.layers, sh.vocab
    f_active = f * max(1, sh.top_k) if sh.experts else f
    inner = (2 * hq + 4 * hk + 2 * hq) + (6 * f_active if sh.gated_mlp else 4 * f_active) \
        + (2 * n * seq_len if eager_attention else 0)
    per_token_layer = 2 * h + 2 * h + inner / tp + 4 * h  # attention and MLP inputs, their insides, two norms
    scale = 2.0 if precision == "fp32" else 1.0
    tokens = seq_len * micro_batch_size / cp
    logits = 4.0 * V * tokens
    full = per_token_layer * scale * tokens * L + logits
    ckpt = 2 * h * scale * tokens * L + per_token_layer * scale * tokens + logits
    return full, ckpt


def estimate_memory(config, *, seq_len: int, micro_batch_size: int, strategy: str, dp: int,
                    precision: str = "bf16", eager_attention: bool = False, degrees=None) -> MemoryEstimate:
    """Bytes per device for the model state and activations (see the module docstring).

    Args:
        degrees: the run's :class:`~mlflow_llmeff.parallel.degrees.Degrees` (tensor, context and
            shard degrees); without it every rank is a data-parallel rank (``dp``).
    """
    split = parameter_split(config)
    tp = degrees.tp if degrees is not None else 1
    cp = degrees.cp if degrees is not None else 1
    shard = degrees.dp_shard if degrees is not None and degrees.dp_shard > 1 else None
    persistent = persistent_param_count(config) if strategy == "deepspeed_zero3" else 0
    w, g, o = model_state_bytes(split["total"], strategy, degrees.dp if degrees is not None else dp, dp_shard=shard,
                                tp=tp, tp_params=split["tensor_parallel"], precision=precision,
                                persistent_params=persistent)
    a, ac = activation_bytes(config, seq_len, micro_batch_size, precision=precision, eager_attention=eager_attention,
                             tp=tp, cp=cp)
    return MemoryEstimate(w, g, o, a, ac)


def meta_param_count(config) -> int:
    """Parameters of the model built from ``config`` on the meta device (no memory is allocated)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def make_plan(cfg, *, accelerator_short: str, precision: str, strategy: str, accelerator_given: str | None = None,
              accelerator_alias: str | None = None, degrees=None) -> dict:
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

    The plan states its assumptions (:func:`state_assumptions`: master-weight precision,
    optimizer, bytes per parameter of weights, gradients and optimizer state) and the accelerator:
    ``accelerator`` (assumed, as before), ``accelerator_given``, ``accelerator_assumed``,
    ``accelerator_alias_taken`` and, when one was, ``accelerator_alias``. ``engine_installed``
    says whether the strategy's engine (DeepSpeed for ``deepspeed_zero*``) can be imported here,
    and ``engine_missing``, only when it cannot, the line naming how to install it: the figures
    do not need it.

    Raises:
        ValueError: for degrees that do not fit the processes.
    """
    from mlflow_llmeff.models.presets import load_config

    config = load_config(cfg.model)
    world = cfg.num_processes * cfg.num_machines
    missing = get(strategy).engine_missing()  # looked up, not imported: the plan needs no engine
    if degrees is None:
        degrees = get(strategy).degrees(world, tp_size=cfg.tp_size, dp_shard=cfg.dp_shard,
                                        processes_per_node=cfg.num_processes)
    counts = param_counts(config)
    counts["total"] = meta_param_count(config)  # the built model's own count (tied weights once)
    split = parameter_split(config)
    tokens_per_step = global_batch_tokens(cfg.seq_len, cfg.micro_batch_size, cfg.grad_accum, degrees.dp)
    fpt = flops_per_token(config, cfg.seq_len, "megatron")
    mem = estimate_memory(config, seq_len=cfg.seq_len, micro_batch_size=cfg.micro_batch_size, strategy=strategy,
                          dp=degrees.dp, precision=precision, eager_attention=cfg.attn_implementation == "eager",
                          degrees=degrees)
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
        "precision": precision, **state_assumptions(strategy, precision, degrees),
        "params_total": counts["total"],
        "params_non_embedding": counts["non_embedding"],
        "params_active": counts["active"], "layers": shape.layers, "hidden": shape.hidden,
        "tokens_per_step": tokens_per_step,
        "flops_per_token_megatron": fpt, "flops_per_token_palm": flops_per_token(config, cfg.seq_len, "palm"),
        "flops_per_step": fpt * tokens_per_step,
        "memory_weights_gib": mem.weights / GIB, "memory_gradients_gib": mem.gradients / GIB,
        "memory_optimizer_gib": mem.optimizer / GIB, "memory_activations_gib": mem.activations / GIB,
        "memory_activations_ckpt_gib": mem.activations_ckpt / GIB,
        "memory_total_gib": mem.total(False) / GIB, "memory_total_ckpt_gib": mem.total(True) / GIB,
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
                     accelerator_alias=accelerator_alias, degrees=spec.degrees)


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

    ``train_memory_gib``: one device, bf16 mixed precision, AdamW (16 B/param of model state),
    activations of one sequence of ``min(seq_len, positions)`` tokens (:func:`estimate_memory`).
    """
    from mlflow_llmeff.models.presets import PRESETS, load_config, max_positions

    rows = []
    for name, (_, _, source) in PRESETS.items():
        config = load_config(name)
        s = min(seq_len, max_positions(config) or seq_len)
        shape = model_shape(config)
        mem = estimate_memory(config, seq_len=s, micro_batch_size=1, strategy="single", dp=1, precision="bf16")
        rows.append({"preset": name, "params": param_counts(config)["total"], "layers": shape.layers,
                     "hidden": shape.hidden, "seq_len": s, "flops_per_token": flops_per_token(config, s),
                     "train_memory_gib": mem.total(False) / GIB, "source": source})
    return rows
