"""Plan a run before paying for it: parameters, FLOPs, memory per device, and predictions.

Memory per device (bytes) is estimated from the model shape, not measured:

* Model state, mixed precision as Accelerate/torch AMP runs it (fp32 master weights 4 B, fp32
  gradients 4 B, AdamW's two fp32 moments 8 B: 16 B/param), divided over data-parallel ranks by
  the sharding strategy. DeepSpeed ZeRO keeps 16-bit weights and gradients (2 + 2 B) plus K = 12 B
  of fp32 master weights and moments per parameter; stage 1 shards the 12, stage 2 also the
  gradients, stage 3 everything (Rajbhandari et al. 2020, "ZeRO", Sec. 5, Fig. 1). FSDP full
  shard divides all 16 B.
* Activations kept for the backward pass, per layer and token (16-bit activations; x2 for fp32),
  following the accounting of Korthikanti et al. 2022 ("Reducing Activation Recomputation in
  Large Transformer Models", Sec. 4.1) without dropout masks and generalised to GQA and gated
  MLPs: attention ``2h + 2hq + 4hk + 2hq`` (input, Q, K and V, attention output), MLP ``2h + 6f``
  (gated: input, gate and up outputs, their product) or ``2h + 4f`` (plain), two norms ``4h``; eager
  attention adds the softmax output ``2ns`` (fused SDPA/flash kernels recompute it). For GPT-2
  shapes this gives 32h per token where Korthikanti's eq. 1 gives 34h (its two dropout masks).
  Full activation checkpointing keeps only each layer's input (``2h``) plus one layer's full
  activations during recomputation. The fp32 logits (``4V`` per token) are added in both cases.

Predictions use earlier runs on the same accelerator in the tracking server: their measured
achieved model TFLOP/s per device (MFU x peak), median, preferring runs of the same model.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from . import names
from .flops import flops_per_token, model_shape, param_counts

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


def model_state_bytes(params: int, strategy: str, dp: int) -> tuple[float, float, float]:
    """(weights, gradients, optimizer) bytes per device for ``params`` parameters.

    Raises:
        ValueError: for an unknown strategy or ``dp < 1``.
    """
    if dp < 1:
        raise ValueError(f"dp={dp} must be >= 1")
    p = float(params)
    if strategy in ("single", "ddp", "auto"):
        return 4 * p, 4 * p, 8 * p
    if strategy == "fsdp":
        return 4 * p / dp, 4 * p / dp, 8 * p / dp
    if strategy == "deepspeed_zero1":
        return 2 * p, 2 * p, 12 * p / dp
    if strategy == "deepspeed_zero2":
        return 2 * p, 2 * p / dp, 12 * p / dp
    if strategy == "deepspeed_zero3":
        return 2 * p / dp, 2 * p / dp, 12 * p / dp
    raise ValueError(f"strategy={strategy!r} is not accepted; use one of: single, ddp, fsdp, deepspeed_zero1/2/3")


def activation_bytes(config, seq_len: int, micro_batch_size: int, *, precision: str = "bf16",
                     eager_attention: bool = False) -> tuple[float, float]:
    """(without, with full checkpointing) activation bytes per device for one micro-batch."""
    sh = model_shape(config)
    h, hq, hk, f, n, L, V = sh.hidden, sh.q_width, sh.kv_width, sh.ffn, sh.heads, sh.layers, sh.vocab
    f_active = f * max(1, sh.top_k) if sh.experts else f
    mlp = 2 * h + (6 * f_active if sh.gated_mlp else 4 * f_active)
    per_token_layer = (2 * h + 2 * hq + 4 * hk + 2 * hq) + mlp + 4 * h + (2 * n * seq_len if eager_attention else 0)
    scale = 2.0 if precision == "fp32" else 1.0
    tokens = seq_len * micro_batch_size
    logits = 4.0 * V * tokens
    full = per_token_layer * scale * tokens * L + logits
    ckpt = 2 * h * scale * tokens * L + per_token_layer * scale * tokens + logits
    return full, ckpt


def estimate_memory(config, *, seq_len: int, micro_batch_size: int, strategy: str, dp: int,
                    precision: str = "bf16", eager_attention: bool = False) -> MemoryEstimate:
    """Bytes per device for the model state and activations (see the module docstring)."""
    params = param_counts(config)["total"]
    w, g, o = model_state_bytes(params, strategy, dp)
    a, ac = activation_bytes(config, seq_len, micro_batch_size, precision=precision, eager_attention=eager_attention)
    return MemoryEstimate(w, g, o, a, ac)


def history_tflops(client, accelerator_short: str, model: str, strategy: str | None = None,
                   devices: int | None = None, shape: dict[str, str] | None = None, seq_len: int | None = None,
                   micro_batch_size: int | None = None) -> tuple[float | None, int, str]:
    """Median achieved model TFLOP/s per device of earlier runs on ``accelerator_short``.

    Args:
        shape: ``{tag: value}`` of the planned model's shape (``llmeff.model.params``, ``.layers``,
            ``.hidden``); a run with the same values (or the same model name) has the same shape.
        seq_len / micro_batch_size: the planned run's; achieved TFLOP/s changes with both (matrix
            sizes, attention's share of the FLOPs).

    Returns:
        ``(tflops or None, runs used, basis)``. Preferred, in order: runs of the same shape with the
        same strategy, device count, sequence length and micro batch size; the same without the
        last two; runs of the same shape; runs of other models, whose TFLOP/s are scaled by this
        model's FLOPs per token, and the basis says so.
    """
    try:
        exps = [e.experiment_id for e in client.search_experiments()]
        runs = client.search_runs(exps, filter_string=f"tags.`{names.ACCEL_SHORT}` = '{accelerator_short}' and attributes.status = 'FINISHED'",
                                  max_results=500)
    except Exception:  # noqa: BLE001 - no tracking server: no prediction
        return None, 0, "no tracking server reachable"
    runs = [r for r in runs if r.data.metrics.get(names.SUM_DEVICE_TFLOPS, 0) > 0]

    def same_shape(r) -> bool:
        if r.data.tags.get(names.MODEL_NAME) == model:
            return True
        return bool(shape) and all(r.data.tags.get(k) == v for k, v in shape.items())

    same = [r for r in runs if same_shape(r)]
    alike = [r for r in same if r.data.tags.get(names.PAR_STRATEGY) == strategy
             and r.data.tags.get(names.ACCEL_COUNT) == str(devices)]
    exact = [r for r in alike if r.data.tags.get(names.SEQ_LEN) == str(seq_len)
             and r.data.tags.get(names.MICRO_BATCH_SIZE) == str(micro_batch_size)]
    on = f"{strategy} on {devices} device{'s' if devices != 1 else ''}"
    for use, which in ((exact, f"runs of {model}'s shape with {on}, seq_len {seq_len}, micro batch {micro_batch_size}"),
                       (alike, f"runs of {model}'s shape with {on} (other sequence lengths or micro batches)"),
                       (same, f"runs of {model}'s shape")):
        if use:
            return statistics.median(r.data.metrics[names.SUM_DEVICE_TFLOPS] for r in use), len(use), which
    if runs:
        big = max(runs, key=lambda r: int(r.data.tags.get(names.MODEL_PARAMS, "0") or 0))
        which = (f"runs of other models on {accelerator_short}, scaled by FLOPs per token (largest: "
                 f"{big.data.tags.get(names.MODEL_NAME, '?')}, {int(big.data.tags.get(names.MODEL_PARAMS, '0') or 0):,} "
                 "params); models of another size reach other TFLOP/s, so this is a rough guess")
        return statistics.median(r.data.metrics[names.SUM_DEVICE_TFLOPS] for r in runs), len(runs), which
    return None, 0, f"no earlier run on {accelerator_short}"


def history_power_w(client, accelerator_short: str) -> float | None:
    """Median measured average power per device (W) of earlier runs on the accelerator."""
    try:
        exps = [e.experiment_id for e in client.search_experiments()]
        runs = client.search_runs(exps, filter_string=f"tags.`{names.ACCEL_SHORT}` = '{accelerator_short}' and attributes.status = 'FINISHED'",
                                  max_results=500)
    except Exception:  # noqa: BLE001
        return None
    w = [r.data.metrics[names.SUM_DEVICE_TFLOPS] / r.data.metrics[names.SUM_TFLOPS_PER_W] for r in runs
         if r.data.metrics.get(names.SUM_TFLOPS_PER_W, 0) > 0 and names.SUM_DEVICE_TFLOPS in r.data.metrics]
    return statistics.median(w) if w else None


def meta_param_count(config) -> int:
    """Parameters of the model built from ``config`` on the meta device (no memory is allocated)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def make_plan(cfg, *, accelerator_short: str, precision: str, strategy: str, client=None,
              device_hour_usd: float | None = None) -> dict:
    """Everything ``llmeff plan`` prints, as a dict (numbers in bytes, FLOPs, seconds, USD, kWh).

    Args:
        cfg: a :class:`~mlflow_llmeff.train.config.TrainConfig`.
        accelerator_short: accelerator to plan for (history and price are looked up by it).
        precision / strategy: resolved precision and parallelism strategy.
        client: an ``MlflowClient`` for predictions from history (None: no prediction).
        device_hour_usd: price per device-hour (None: no cost prediction).
    """
    from .presets import load_config

    config = load_config(cfg.model)
    dp = cfg.num_processes
    counts = param_counts(config)
    counts["total"] = meta_param_count(config)  # the built model's own count (tied weights once)
    tokens_per_step = cfg.seq_len * cfg.micro_batch_size * cfg.grad_accum * dp
    fpt = flops_per_token(config, cfg.seq_len, "megatron")
    mem = estimate_memory(config, seq_len=cfg.seq_len, micro_batch_size=cfg.micro_batch_size, strategy=strategy, dp=dp,
                          precision=precision, eager_attention=cfg.attn_implementation == "eager")
    out = {
        "model": cfg.model, "accelerator": accelerator_short, "devices": dp, "strategy": strategy,
        "precision": precision, "params_total": counts["total"], "params_non_embedding": counts["non_embedding"],
        "params_active": counts["active"], "tokens_per_step": tokens_per_step,
        "flops_per_token_megatron": fpt, "flops_per_token_palm": flops_per_token(config, cfg.seq_len, "palm"),
        "flops_per_step": fpt * tokens_per_step,
        "memory_weights_gib": mem.weights / GIB, "memory_gradients_gib": mem.gradients / GIB,
        "memory_optimizer_gib": mem.optimizer / GIB, "memory_activations_gib": mem.activations / GIB,
        "memory_activations_ckpt_gib": mem.activations_ckpt / GIB,
        "memory_total_gib": mem.total(False) / GIB, "memory_total_ckpt_gib": mem.total(True) / GIB,
    }
    if client is not None:
        shape = {names.MODEL_PARAMS: str(counts["total"]), names.MODEL_LAYERS: str(model_shape(config).layers),
                 names.MODEL_HIDDEN: str(model_shape(config).hidden)}
        tflops, n, which = history_tflops(client, accelerator_short, cfg.model, strategy, dp, shape,
                                          cfg.seq_len, cfg.micro_batch_size)
        out["prediction_basis"] = f"median of {n} {which}" if tflops else which
        if tflops:
            tps = tflops * 1e12 * dp / fpt
            wall = cfg.max_steps * tokens_per_step / tps
            out.update({"predicted_tokens_per_sec": tps, "predicted_wall_s": wall,
                        "predicted_wall_covers": f"{cfg.max_steps} steps at the steady-state rate; start-up "
                                                 "(imports, model build, data set-up), warm-up and evals excluded"})
            if device_hour_usd is not None:
                out["predicted_usd"] = device_hour_usd * dp * wall / 3600
            power = history_power_w(client, accelerator_short)
            if power:
                out["predicted_kwh"] = power * dp * wall / 3.6e6
    return out


def format_plan(plan: dict) -> str:
    """Human-readable table of :func:`make_plan`'s output."""
    rows = []
    for k, v in plan.items():
        if isinstance(v, bool):
            v = "yes" if v else "no"
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
    from .presets import PRESETS, load_config, max_positions

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
