"""The training loop: Accelerate, AdamW + cosine, checkpoints and resume, standard metrics.

Reads top to bottom as one story: set up (devices, data, model, optimizer), attach the MLflow run
(main process only), train with windowed measurement, summarize. Every rank runs this function;
only the main process logs. Counts that need all ranks are reduced at window edges (end of
warm-up, logged steps, checkpoints, the last step), where the device is also synchronized.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import sys
import time
from contextlib import nullcontext

from .. import names, probes
from ..energy import EnergyReading, make_meter, sum_over_ranks
from ..goodput import TimeAccount, goodput
from ..counting import BatchCounter
from ..throughput import ThroughputMeter
from ..tracking.logger import NullLogger, RunLogger, default_run_name, ensure_experiment_kind
from . import checkpoint as ckpt
from .config import TrainConfig, resolve_precision, resolve_strategy, validate
from .data import epoch_order, prepare_data
from .models import build_model, load_config, load_tokenizer, tokenizer_name

log = logging.getLogger(__name__)

# Test hooks: right after this optimizer step the process SIGKILLs itself (a crash), or raises
# RuntimeError (a failure inside training).
KILL_AT_STEP_ENV = "LLMEFF_FAULT_KILL_AT_STEP"
RAISE_AT_STEP_ENV = "LLMEFF_FAULT_RAISE_AT_STEP"
WARMUP_NOTE = ("first warmup_steps optimizer steps of every attempt (torch.compile, allocator and "
               "kernel warm-up, the FlopCounterMode step) excluded from throughput/*, summary/*")


def _micro_batches(n: int, micro_batch_size: int, world: int, rank: int, seed: int, start: int):
    """Yield index lists of this rank's micro-batches from global micro-step ``start`` on.

    Every epoch is a fresh seeded permutation; micro-step ``k`` of rank ``r`` takes the
    ``(k * world + r)``-th slice of ``micro_batch_size`` samples, so data order depends only on
    ``(seed, k)`` and resuming at a step boundary continues it exactly.
    """
    per_epoch = n // (micro_batch_size * world)
    if per_epoch < 1:
        raise ValueError(f"{n} training blocks are fewer than one global micro-batch "
                         f"(micro_batch_size={micro_batch_size} x {world} processes); use more text or smaller batches")
    k, cached = start, (None, None)
    while True:
        epoch, off = divmod(k, per_epoch)
        if cached[0] != epoch:
            cached = (epoch, epoch_order(n, epoch, seed))
        base = (off * world + rank) * micro_batch_size
        yield cached[1][base: base + micro_batch_size]
        k += 1


def _build_accelerator(cfg: TrainConfig, precision: str, cuda: bool):
    from accelerate import Accelerator
    from accelerate.utils import GradientAccumulationPlugin

    kwargs = {}
    if cfg.parallelism == "fsdp":
        from accelerate import FullyShardedDataParallelPlugin

        kwargs["fsdp_plugin"] = FullyShardedDataParallelPlugin(
            auto_wrap_policy="transformer_based_wrap", activation_checkpointing=cfg.activation_checkpointing,
            state_dict_type="SHARDED_STATE_DICT")
    elif cfg.parallelism.startswith("deepspeed_zero"):
        from accelerate.utils import DeepSpeedPlugin

        kwargs["deepspeed_plugin"] = DeepSpeedPlugin(zero_stage=int(cfg.parallelism[-1]),
                                                     gradient_accumulation_steps=cfg.grad_accum,
                                                     gradient_clipping=cfg.max_grad_norm or None)
    # AcceleratorState is process-wide and keeps the first run's settings (precision, ...): a second
    # run in the same process (a notebook, a sweep, tests) would silently inherit them. The
    # distributed PartialState is kept.
    from accelerate.state import AcceleratorState

    if hasattr(AcceleratorState, "_reset_state"):
        AcceleratorState._reset_state()
    return Accelerator(
        mixed_precision={"fp32": "no", "bf16": "bf16", "fp16": "fp16"}[precision],
        gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=cfg.grad_accum, sync_with_dataloader=False),
        cpu=not cuda, **kwargs)


def run_training(cfg: TrainConfig) -> dict | None:
    """Train per ``cfg`` on this process's devices and log to MLflow from the main process.

    A run that fails after its MLflow run started is ended FAILED (KILLED on Ctrl-C or SIGTERM);
    its checkpoints stay, so rerunning the same command resumes it.

    Returns:
        On the main process, ``{"run_id": ..., "summary": {key: value}}``; None on other ranks.

    Raises:
        ValueError: for bad settings (before any heavy work).
    """
    holder: dict = {}
    previous = None
    if threading_main():
        previous = signal.signal(signal.SIGTERM, _sigterm_to_exit)
    try:
        return _run_training(cfg, holder)
    except BaseException as e:
        logger = holder.get("logger")
        if logger is not None:
            logger.close("KILLED" if isinstance(e, (KeyboardInterrupt, SystemExit)) else "FAILED")
        raise
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def threading_main() -> bool:
    """True in the main thread (only there can signal handlers be installed)."""
    import threading

    return threading.current_thread() is threading.main_thread()


def _sigterm_to_exit(signum, frame):  # noqa: ARG001
    raise SystemExit(128 + signum)


def _run_training(cfg: TrainConfig, holder: dict) -> dict | None:
    import torch
    from accelerate.utils import broadcast_object_list, set_seed

    account = TimeAccount()
    account.start()
    t_init = time.perf_counter()
    cuda = torch.cuda.is_available()
    validate(cfg)
    bf16_ok = torch.cuda.is_bf16_supported() if cuda else True
    precision = resolve_precision(cfg, cuda_available=cuda, bf16_supported=bf16_ok)

    accelerator = _build_accelerator(cfg, precision, cuda)
    world, rank, main = accelerator.num_processes, accelerator.process_index, accelerator.is_main_process
    device = accelerator.device
    strategy = resolve_strategy(cfg, world)
    set_seed(cfg.seed)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    # ---- data and model -------------------------------------------------------------------
    model_config = load_config(cfg.model)
    tokenizer = load_tokenizer(cfg.model)
    data = prepare_data(cfg.dataset, tokenizer, cfg.seq_len, packing=cfg.packing, val_fraction=cfg.val_fraction,
                        seed=cfg.seed, text_field=cfg.text_field,
                        synthetic_blocks=max(64, 2 * cfg.micro_batch_size * world * cfg.grad_accum),
                        vocab_size=min(len(tokenizer), model_config.vocab_size))
    model = build_model(cfg.model, model_config, attn_implementation=cfg.attn_implementation)
    params_total, params_non_emb = probes.param_counts(model)
    if cfg.activation_checkpointing and cfg.parallelism != "fsdp":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if hasattr(model.config, "use_cache"):
        model.config.use_cache = False
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=cfg.learning_rate, betas=(0.9, 0.95), eps=1e-8)
    from transformers import get_cosine_schedule_with_warmup

    scheduler = get_cosine_schedule_with_warmup(optimizer, cfg.resolved_lr_warmup_steps(), cfg.max_steps)
    if cfg.compile:  # compiled here rather than through Accelerate's dynamo plugin (see _build_accelerator)
        model = torch.compile(model)
    model, optimizer = accelerator.prepare(model, optimizer)
    # The scheduler is stepped by us once per optimizer step (Accelerate's wrapper would step it
    # num_processes times per call), and registered so save_state/load_state carry it.
    accelerator.register_for_checkpointing(scheduler)

    # ---- resume ------------------------------------------------------------------------------
    state, load_s = None, 0.0
    if cfg.checkpoint_dir and cfg.resume == "auto":
        found = ckpt.latest(cfg.checkpoint_dir)
        if found:
            path, state = found
            if state["world_size"] != world:
                raise ValueError(f"checkpoint {path} was written by {state['world_size']} processes, this run has "
                                 f"{world}; resume with num_processes={state['world_size']} or resume=never")
            account.load_state_dict(state["account"])
            t_load = time.perf_counter()
            accelerator.load_state(path)
            load_s = time.perf_counter() - t_load
            account.add("checkpoint_load", load_s)
    start_step = int(state["step"]) if state else 0
    if state and (start_step >= cfg.max_steps or state.get("stopped_at_targets")):
        if accelerator.is_main_process:
            print(f"llmeff: checkpoint {ckpt.step_dir(cfg.checkpoint_dir, start_step)} is already the end of this run "
                  f"(step {start_step}, max_steps={cfg.max_steps}); nothing to do")
        accelerator.end_training()
        return {"run_id": state.get("run_id"), "summary": {}} if accelerator.is_main_process else None
    from ..evals.targets import parse_targets

    targets = parse_targets(cfg.targets)
    reached: dict[str, int] = dict(state.get("ttq_reached", {})) if state else {}
    meter = ThroughputMeter(num_devices=world, warmup_steps=cfg.warmup_steps, start_step=start_step)
    if state:
        meter.load_state_dict(state["meter"])
    attempts = (int(state["attempts"]) + 1) if state else 1

    # ---- FLOPs and peak ------------------------------------------------------------------------
    from .. import flops as fl
    from .. import hardware as hw

    accel = hw.detect_accelerator(count=world, device_type=device.type)
    peak, peak_source = hw.resolve_peak(accel, precision, cfg.peak_tflops or None)

    model_shape = fl.model_shape(model_config)  # parsed once: the formula runs at every logged step

    def model_flops_per_token(s: float, convention: str = "megatron") -> float:
        return fl.flops_per_token(model_shape, s, convention)

    measured_peak, measured_peak_note = None, ""
    try:  # cached per device and dtype after the first measurement (llmeff peak)
        measured_peak = hw.measure_matmul_peak("fp32" if precision == "fp32" else precision,
                                               "cpu" if device.type == "cpu" else str(device))
        measured_peak_note = f"{measured_peak:.4g}"
    except Exception as e:  # noqa: BLE001 - an unmeasurable peak leaves mfu_measured_peak out, with the reason
        measured_peak_note = f"unknown: {type(e).__name__}: {e}"
    if device.type == "cuda":  # the peak measurement's matrices must not count in the run's peak memory
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)

    # ---- energy, carbon, cost -----------------------------------------------------------------
    from ..carbon import CarbonTracker
    from ..cost import cost_tags, device_hour_price

    energy = _EnergyBook(make_meter(cfg.measure_energy, device_indices=[device.index or 0] if device.type == "cuda" else None),
                         world, prior_j=float(state.get("energy_j", 0.0)) if state else 0.0)
    carbon = CarbonTracker(country_iso_code=cfg.country_iso_code or None, cloud_provider=cfg.cloud_provider or None,
                           cloud_region=cfg.cloud_region or None, enabled=cfg.measure_energy != "none")
    price, price_source = device_hour_price(accel.short, cfg.device_hour_usd or None)
    usd_per_kwh = cfg.usd_per_kwh or None

    def cost_usd(wall_s: float, kwh: float | None) -> float | None:
        if price is None:
            return None
        from ..cost import total_cost_usd

        return total_cost_usd(device_hour_usd=price, devices=world, wall_s=wall_s, kwh=kwh or 0.0, usd_per_kwh=usd_per_kwh)

    # ---- MLflow run (main process only) ----------------------------------------------------
    logger: NullLogger = NullLogger()
    run_id = None
    if main:
        import mlflow

        env_run = os.environ.get("MLFLOW_RUN_ID")
        run_id = state.get("run_id") if state else None
        client = mlflow.MlflowClient()
        if run_id is None and env_run:
            run_id = env_run
        if run_id is None:
            exp_id = None
            if cfg.experiment_name:
                exp = client.get_experiment_by_name(cfg.experiment_name)
                exp_id = exp.experiment_id if exp else client.create_experiment(cfg.experiment_name)
            else:
                from mlflow.tracking.fluent import _get_experiment_id

                exp_id = _get_experiment_id()
            run_id = client.create_run(exp_id).info.run_id
        else:
            client.update_run(run_id, status="RUNNING")
            if env_run and env_run != run_id:
                client.set_tag(env_run, names.RESUME_CONTINUED_IN, run_id)
        ensure_experiment_kind(client, client.get_run(run_id).info.experiment_id)
        logger = RunLogger(run_id, client, resume=state is not None)
        holder["logger"] = logger
        if state and logger.last_timestamp_s and state.get("saved_at_unix"):
            # The crashed attempt ran on after its last checkpoint until its last logged metric:
            # that time (work lost with it) is lost progress, and wall time of the run.
            lost = max(0.0, logger.last_timestamp_s - float(state["saved_at_unix"]))
            account.add("lost_progress", lost)
            account.previous_wall_s += lost
        if state:
            print(f"llmeff: resuming MLflow run {run_id} from checkpoint step {start_step} (attempt {attempts})")
        changed = logger.log_params(cfg.to_params())
        tags = {**accel.tags(), **probes.software_versions()}
        tags.update({
            names.NODES: str(int(os.environ.get("NUM_MACHINES", 0)) or max(1, world // int(os.environ.get("LOCAL_WORLD_SIZE", world)))),
            names.PAR_STRATEGY: strategy, names.PAR_DP: str(world), names.PAR_TP: "1", names.PAR_PP: "1", names.PAR_CP: "1",
            names.PRECISION: precision, names.MODEL_NAME: cfg.model, names.MODEL_PARAMS: str(params_total),
            names.MODEL_NON_EMB_PARAMS: str(params_non_emb),
            names.MODEL_LAYERS: str(getattr(model_config, "num_hidden_layers", getattr(model_config, "n_layer", "unknown"))),
            names.MODEL_HIDDEN: str(getattr(model_config, "hidden_size", getattr(model_config, "n_embd", "unknown"))),
            names.SEQ_LEN: str(cfg.seq_len), names.MICRO_BATCH_SIZE: str(cfg.micro_batch_size),
            names.GRAD_ACCUM: str(cfg.grad_accum),
            names.GLOBAL_BATCH_TOKENS: str(cfg.seq_len * cfg.micro_batch_size * cfg.grad_accum * world),
            names.ACT_CKPT: str(cfg.activation_checkpointing).lower(), names.COMPILE: str(cfg.compile).lower(),
            names.FLOPS_FORMULA: "megatron: L*h^2*(12+12g/n+18f/h+6s/h)+6hV per token, causal attention counted once "
                                 "(Megatron-LM num_floating_point_operations); palm beside it",
            names.PEAK_TFLOPS: f"{peak:g}" if peak else "unknown", names.PEAK_SOURCE: peak_source,
            names.WARMUP_STEPS: str(cfg.warmup_steps), names.WARMUP_NOTE: WARMUP_NOTE,
            names.DATASET: cfg.dataset, names.DATASET_KIND: data.kind, names.TOKENIZER: tokenizer_name(cfg.model),
            names.GIT_COMMIT: probes.git_commit(os.path.dirname(os.path.abspath(__file__))), names.RESUME_ATTEMPTS: str(attempts),
            names.PEAK_MEASURED_TFLOPS: measured_peak_note,
            names.ENERGY_SOURCE: energy.source, names.ENERGY_WHY: energy.why or "measured",
        })
        tags.update(cost_tags(price, price_source, usd_per_kwh))
        if state:
            tags[names.RESUMED_FROM] = str(start_step)
        if changed:
            tags[names.RESUME_CHANGED] = ", ".join(f"{k}: {a} -> {b} (not re-logged)" for k, (a, b) in changed.items())
        if not state:
            tags["mlflow.runName"] = cfg.run_name or default_run_name(cfg.model, accel.short, world, strategy, precision)
        logger.set_tags(tags)
    # Steps up to the last one logged before a crash are replays: not logged again, and their
    # time counts as lost progress.
    replay_until = [max(start_step, logger.last_logged_step(names.TRAIN_LOSS)) if main and state else start_step]
    if world > 1:
        broadcast_object_list(replay_until)
    replay_until = replay_until[0]
    account.add("init", time.perf_counter() - t_init - load_s)

    # ---- train ------------------------------------------------------------------------------------
    from tqdm.auto import tqdm

    batches = _micro_batches(len(data.train), cfg.micro_batch_size, world, rank, cfg.seed, start_step * cfg.grad_accum)
    bar = tqdm(total=cfg.max_steps, initial=start_step, disable=None if main else True, unit="step", dynamic_ncols=True)
    counter = BatchCounter(device)
    loss_sum = torch.zeros(2, dtype=torch.float64, device=device)  # sum of step losses, steps
    hw_flops_per_step = None
    hfu_note = "warmup_steps=0: no warm-up step to count hardware FLOPs on"
    last_boundary = start_step
    mfu_warned = False
    kill_at = int(os.environ.get(KILL_AT_STEP_ENV, "0") or 0)
    model.train()
    carbon.start()
    energy.start(meter.total.tokens)
    sync()
    meter.begin()
    for step in range(start_step + 1, cfg.max_steps + 1):
        lr = scheduler.get_last_lr()[0]
        # FlopCounterMode on a compiled model stops dynamo from ever compiling it: under compile
        # hardware FLOPs are analytic (below) instead.
        count_flops = (step == start_step + 1 and cfg.warmup_steps > 0 and not cfg.compile)
        flop_counter = None
        if count_flops:
            from torch.utils.flop_counter import FlopCounterMode

            flop_counter = FlopCounterMode(display=False)
        with flop_counter if flop_counter is not None else nullcontext():
            for _ in range(cfg.grad_accum):
                t0 = time.perf_counter()
                idx = next(batches)
                batch = {k: v[idx].to(device, non_blocking=True) for k, v in data.train[:].items()}
                account.add("data_wait", time.perf_counter() - t0)
                with accelerator.accumulate(model):
                    out = model(**batch)
                    accelerator.backward(out.loss)
                    if accelerator.sync_gradients and cfg.max_grad_norm > 0 and not cfg.parallelism.startswith("deepspeed"):
                        accelerator.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                counter.add(batch["input_ids"], batch["attention_mask"], batch["labels"])
                loss_sum[0] += out.loss.detach().double() / cfg.grad_accum
        loss_sum[1] += 1
        scheduler.step()
        if flop_counter is not None:
            hw_flops_per_step = float(flop_counter.get_total_flops())
            if cfg.attn_implementation == "sdpa" and device.type == "cpu":
                # FlopCounterMode does not count CPU scaled-dot-product attention: add its FLOPs
                # analytically (PaLM convention, full s x s score and value matmuls, fwd + bwd,
                # x4/3 when checkpointing recomputes the forward).
                local_tokens, local_len_sq = counter.peek_tokens()
                s_eff = local_len_sq / max(1, local_tokens)
                attn = fl.attention_flops_per_token(model_shape, s_eff, "palm") * local_tokens
                hw_flops_per_step += attn * (4 / 3 if cfg.activation_checkpointing else 1)
                hfu_note = "FlopCounterMode on the first step; CPU SDPA attention added analytically (palm, no causal discount)"
            else:
                hfu_note = "FlopCounterMode on the first step of the attempt (eager attention counted)"
        elif cfg.compile and step == start_step + 1:
            local_tokens, local_len_sq = counter.peek_tokens()
            hw_flops_per_step = (model_flops_per_token(local_len_sq / max(1, local_tokens), "palm") * local_tokens
                                 * (4 / 3 if cfg.activation_checkpointing else 1))
            hfu_note = ("analytic: compile=true (FlopCounterMode would stop torch.compile); palm-convention FLOPs "
                        "of the first step's tokens, x4/3 under activation checkpointing")

        log_now = step % cfg.log_every_n_steps == 0 or step == cfg.max_steps
        ckpt_now = bool(cfg.checkpoint_dir) and ((cfg.checkpoint_every and step % cfg.checkpoint_every == 0) or step == cfg.max_steps)
        eval_now = (data.val is not None or bool(cfg.eval_tasks)) and (
            (cfg.eval_every and step % cfg.eval_every == 0) or step == cfg.max_steps)
        if log_now or ckpt_now or eval_now or step == meter.warmup_end_step or step == replay_until:
            sync()
            meter.add(counter.take(step - last_boundary,
                                   (lambda t: accelerator.reduce(t, reduction="sum")) if world > 1 else None))
            last_boundary = step
        if log_now:
            ls = accelerator.reduce(loss_sum, reduction="sum") if world > 1 else loss_sum
            loss = float(ls[0] / ls[1])
            loss_sum.zero_()
            alloc, reserved, mem_source = probes.peak_memory_gib(device)
            mem = torch.tensor([alloc, reserved], dtype=torch.float64, device=device)
            if world > 1:
                mem = accelerator.gather(mem.unsqueeze(0)).max(dim=0).values
            metrics = {names.TRAIN_LOSS: loss, names.TRAIN_LR: lr, names.TRAIN_TOKENS: meter.total.tokens,
                       names.TRAIN_PADDED_TOKENS: meter.total.padded_tokens,
                       names.TRAIN_LOSS_TOKENS: meter.total.loss_tokens,
                       names.MEM_MAX_ALLOC: float(mem[0]), names.MEM_MAX_RESERVED: float(mem[1])}
            rates = meter.interval()
            if rates is not None:
                metrics.update(rates.interval_metrics(model_flops_per_token, peak))
                if hw_flops_per_step is not None:
                    metrics[names.TPUT_DEVICE_HFU] = fl.utilization(hw_flops_per_step / rates.step_time_s / 1e12, peak)
                warn = fl.mfu_warning(metrics.get(names.TPUT_DEVICE_MFU))
                if warn and not mfu_warned:  # reported, never clipped
                    mfu_warned = True
                    log.warning(warn)
                    logger.set_tags({names.MFU_WARNING: f"step {step}: {warn}"})
            e = energy.interval(accelerator, meter.total.tokens)
            if e is not None:
                metrics.update(e)
                kg = carbon.kg_co2e(e[names.ENERGY_TOTAL_KWH])
                if kg is not None:
                    metrics[names.CARBON_TOTAL_KG] = kg
            metrics[names.COST_TOTAL_USD] = cost_usd(account.wall_s(), energy.total_kwh)
            if step > replay_until:
                logger.log_metrics(metrics, step)
            if main:
                bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{rates.tokens_per_sec:,.0f}" if rates else "warm-up")
        stop_now = False
        if eval_now:
            with account.measure("eval"):
                values, eval_metrics = _evaluate(cfg, accelerator, model, tokenizer, data.val, world, rank)
            if step > replay_until:
                logger.log_metrics(eval_metrics, step)
            for t in targets:
                if t.key not in reached and t.reached(values.get(t.metric)):
                    reached[t.key] = step
                    wall = account.wall_s() - account.seconds["init"]
                    kwh = energy.total_kwh if energy.measures else None
                    ttq = {"wall_s": wall, "train_s": meter.warmup_s + meter.steady_s, "tokens": meter.total.tokens,
                           "device_hours": world * wall / 3600, "kwh": kwh, "usd": cost_usd(wall, kwh),
                           "kg_co2e": carbon.kg_co2e(kwh) if kwh is not None else None}
                    logger.log_metrics({t.metric_keys()[k]: v for k, v in ttq.items()}, step)
                    logger.set_tags({t.not_reached_tag: f"reached_at_step_{step}"})
            stop_now = cfg.stop_at_targets and bool(targets) and all(t.key in reached for t in targets)
            if stop_now and not log_now:  # the counters at the last step, which was not a logged step
                logger.log_metrics({names.TRAIN_TOKENS: meter.total.tokens, names.TRAIN_PADDED_TOKENS: meter.total.padded_tokens,
                                    names.TRAIN_LOSS_TOKENS: meter.total.loss_tokens}, step)
            ckpt_now = ckpt_now or (stop_now and bool(cfg.checkpoint_dir))
        if ckpt_now:
            with account.measure("checkpoint_save"):
                if isinstance(logger, RunLogger):
                    logger.flush()  # metrics up to this step reach the server before the checkpoint exists
                _save_checkpoint(accelerator, cfg, step, run_id, meter, account, attempts, world, energy.total_j,
                                 {"ttq_reached": reached, "stopped_at_targets": stop_now})
        bar.update(1)
        if kill_at and step == kill_at and main:
            if isinstance(logger, RunLogger):
                logger.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        if step == int(os.environ.get(RAISE_AT_STEP_ENV, "0") or 0):
            raise RuntimeError(f"{RAISE_AT_STEP_ENV}={step}: injected failure")
        if stop_now:
            if main:
                print(f"llmeff: every target reached at step {step}; stopping (stop_at_targets=true)")
            break
    bar.close()

    # ---- summary --------------------------------------------------------------------------------
    summary = _summary(cfg, meter, account, model, optimizer, device, world, peak, model_flops_per_token,
                       hw_flops_per_step, accelerator)
    energy.interval(accelerator, meter.total.tokens)  # final reading (a collective: every rank)
    energy.close()
    carbon.stop()
    if measured_peak and names.SUM_DEVICE_TFLOPS in summary:
        summary[names.SUM_MFU_MEASURED_PEAK] = fl.utilization(summary[names.SUM_DEVICE_TFLOPS], measured_peak)
    tokens = meter.total.tokens
    if energy.measures and tokens:
        kwh = energy.total_kwh
        summary[names.ENERGY_TOTAL_KWH] = kwh
        summary[names.SUM_J_PER_TOKEN] = energy.total_j / tokens
        summary[names.SUM_KWH_PER_BTOK] = kwh * 1e9 / tokens
        if names.SUM_DEVICE_TFLOPS in summary and energy.avg_device_power_w:
            summary[names.SUM_TFLOPS_PER_W] = summary[names.SUM_DEVICE_TFLOPS] / energy.avg_device_power_w
    summary.update(carbon.metrics(measured_kwh=energy.total_kwh if energy.measures else None, tokens=tokens))
    total_usd = cost_usd(summary[names.SUM_WALL_S], energy.total_kwh)
    if total_usd is not None and tokens:
        summary[names.SUM_USD_PER_BTOK] = total_usd * 1e9 / tokens
    for key in (names.ENERGY_TOTAL_KWH, names.CARBON_TOTAL_KG, names.COST_TOTAL_USD):
        summary.pop(key, None)  # interval metrics, already logged at the last step
    if main:
        end_tags = {names.MEMORY_SOURCE: probes.peak_memory_gib(device)[2], names.HFU_METHOD: hfu_note,
                    **carbon.tags(energy_source=energy.source if energy.measures else None)}
        if energy.measures:
            end_tags[names.ENERGY_SOURCE] = energy.source
        elif carbon.estimate is not None:
            end_tags[names.ENERGY_SOURCE] = "codecarbon_estimate"
            end_tags[names.ENERGY_WHY] = (f"no measured energy ({energy.why}); only codecarbon's CPU/RAM estimate is "
                                          f"logged, under energy/estimate/* and carbon/estimate_kg_co2e")
        for t in targets:
            if t.key not in reached:
                end_tags[t.not_reached_tag] = "not_reached"
        logger.set_tags(end_tags)
        logger.log_metrics(summary, meter.step)
        tps = summary.get(names.SUM_TOKENS_PER_SEC)
        print(f"llmeff: run {run_id}: {meter.step} steps, {meter.total.tokens:,} tokens, "
              + (f"{tps:,.0f} tokens/s steady state, " if tps else "")
              + f"wall {summary[names.SUM_WALL_S]:.1f} s, goodput {summary[names.SUM_GOODPUT]:.2f}")
        warn = fl.mfu_warning(summary.get(names.SUM_MFU))
        if warn and not mfu_warned:
            log.warning(warn)
            logger.set_tags({names.MFU_WARNING: f"summary: {warn}"})
        logger.close("FINISHED")
    accelerator.wait_for_everyone()
    # Free the DDP/FSDP model while its process group is alive: a gloo group whose last reference goes
    # at interpreter exit can deadlock there (its worker thread needs the GIL the exiting thread holds).
    accelerator.free_memory()
    del model, optimizer
    accelerator.end_training()
    return {"run_id": run_id, "summary": summary} if main else None


class _EnergyBook:
    """Energy of every rank's own devices, gathered at logged steps and summed on the main process.

    Each rank reads only its own meter (``make_meter`` resolves the devices it owns); readings are
    gathered with ``gather_object`` (a collective: every rank calls :meth:`interval`) and summed
    by device id, so nothing is counted twice. ``prior_j`` carries the energy of earlier attempts.
    """

    def __init__(self, meter, world: int, prior_j: float = 0.0) -> None:
        self.meter, self.world, self.prior_j = meter, world, prior_j
        self.source, self.why = meter.source, meter.why
        self.total_j, self._last_j, self._last_t, self._last_tokens = prior_j, 0.0, 0.0, None
        self.measures = False
        self.devices = 0
        self._elapsed = 0.0

    def start(self, tokens: int) -> None:
        self._last_tokens = tokens
        self.meter.start()

    def close(self) -> None:
        self.meter.close()

    @property
    def total_kwh(self) -> float:
        return self.total_j / 3.6e6

    @property
    def avg_device_power_w(self) -> float | None:
        if not self.devices or self._elapsed <= 0:
            return None
        return (self.total_j - self.prior_j) / self._elapsed / self.devices

    def interval(self, accelerator, tokens: int) -> dict[str, float] | None:
        """Gather readings; returns the interval's energy metrics on the main process, else None."""
        mine = {"reading": self.meter.read().as_dict(), "devices": self.meter.num_devices if self.meter.measures else 0,
                "source": self.meter.source}
        if self.world > 1:
            from accelerate.utils import gather_object

            allr = gather_object([mine])
        else:
            allr = [mine]
        self.devices = sum(r["devices"] for r in allr)
        if self.devices == 0:
            return None
        self.measures = True
        self.source = next(r["source"] for r in allr if r["devices"])
        total = sum_over_ranks(EnergyReading.from_dict(r["reading"]) for r in allr if r["devices"])
        self._elapsed = total.elapsed_s
        self.total_j = self.prior_j + total.joules
        dj, dt = total.joules - self._last_j, total.elapsed_s - self._last_t
        dtok = tokens - self._last_tokens if self._last_tokens is not None else None
        self._last_j, self._last_t, self._last_tokens = total.joules, total.elapsed_s, tokens
        out = {names.ENERGY_TOTAL_KWH: self.total_kwh}
        if dt > 0:
            out[names.ENERGY_DEVICE_AVG_POWER_W] = dj / dt / self.devices
        if dtok:
            out[names.ENERGY_J_PER_TOKEN] = dj / dtok
        return out


def _validation_loss(accelerator, model, val, micro_batch_size: int, world: int, rank: int) -> float:
    """Token-weighted mean loss over the held-out blocks (each rank scores its strided share)."""
    import torch

    model.eval()
    tot = torch.zeros(2, dtype=torch.float64, device=accelerator.device)
    with torch.no_grad(), accelerator.autocast():
        idx_all = list(range(rank, len(val), world))
        for i in range(0, len(idx_all), micro_batch_size):
            idx = idx_all[i: i + micro_batch_size]
            b = {k: v[idx].to(accelerator.device) for k, v in val[:].items()}
            out = model(**b)
            n = (b["labels"][:, 1:] != -100).sum()
            tot[0] += out.loss.double() * n
            tot[1] += n
    model.train()
    if world > 1:
        tot = accelerator.reduce(tot, reduction="sum")
    return float(tot[0] / tot[1])


def _evaluate(cfg, accelerator, model, tokenizer, val, world: int, rank: int) -> tuple[dict[str, float], dict[str, float]]:
    """Validation loss and the benchmark tasks; returns (values by target metric, MLflow metrics).

    Benchmarks run on every rank (FSDP needs all ranks in each forward; with DDP the ranks
    compute the same numbers) on the fixed seeded subset of ``eval_limit`` documents per task.
    """
    values: dict[str, float] = {}
    metrics: dict[str, float] = {}
    if val is not None:
        vl = _validation_loss(accelerator, model, val, cfg.micro_batch_size, world, rank)
        values.update({"val_loss": vl, "val_perplexity": math.exp(min(vl, 700))})
        metrics.update({names.EVAL_VAL_LOSS: vl, names.EVAL_VAL_PPL: values["val_perplexity"]})
    if cfg.eval_tasks:
        from ..evals.api import evaluate, mlflow_metrics

        eval_model = model if cfg.parallelism == "fsdp" else accelerator.unwrap_model(model)
        res = evaluate(eval_model, tokenizer, cfg.eval_tasks, data_dir=cfg.eval_data_dir or None,
                       num_fewshot=cfg.eval_num_fewshot, limit=cfg.eval_limit or None,
                       batch_size=cfg.micro_batch_size, device=accelerator.device, subset_seed=cfg.seed)
        values.update(res.metrics)
        metrics.update(mlflow_metrics(res))
    return values, metrics


def _save_checkpoint(accelerator, cfg, step, run_id, meter, account, attempts, world, energy_j, extra) -> None:
    path = ckpt.step_dir(cfg.checkpoint_dir, step)
    accelerator.save_state(path)
    if accelerator.is_main_process:
        ckpt.write_state(path, {"step": step, "run_id": run_id, "saved_at_unix": time.time(), "meter": meter.state_dict(),
                                "account": account.state_dict(), "attempts": attempts, "world_size": world,
                                "energy_j": energy_j, "params": cfg.to_params(), **extra})
        ckpt.prune(cfg.checkpoint_dir, cfg.checkpoint_keep)
    accelerator.wait_for_everyone()


def _summary(cfg, meter, account, model, optimizer, device, world, peak, model_flops_per_token, hw_flops_per_step,
             accelerator) -> dict[str, float]:
    """Steady-state figures of the whole run (all attempts), identical on every rank."""
    import torch

    from .. import flops as fl

    out: dict[str, float] = {names.SUM_TOKENS: float(meter.total.tokens), names.SUM_STEPS: float(meter.step)}
    rates = meter.summary()
    if rates is not None:
        tflops = rates.device_tflops_per_sec(model_flops_per_token)
        tflops_palm = rates.device_tflops_per_sec(lambda s: model_flops_per_token(s, "palm"))
        out.update({names.SUM_TOKENS_PER_SEC: rates.tokens_per_sec, names.SUM_DEVICE_TOKENS_PER_SEC: rates.device_tokens_per_sec,
                    names.SUM_DEVICE_TFLOPS: tflops, names.SUM_STEP_TIME_S: rates.step_time_s,
                    names.SUM_MFU: fl.utilization(tflops, peak), names.SUM_MFU_PALM: fl.utilization(tflops_palm, peak)})
        if hw_flops_per_step is not None:
            out[names.SUM_HFU] = fl.utilization(hw_flops_per_step / rates.step_time_s / 1e12, peak)
    alloc, _, _ = probes.peak_memory_gib(device)
    state_bytes, local_params = probes.model_state_bytes(model, optimizer)
    t = torch.tensor([[alloc, state_bytes / max(1, local_params)]], dtype=torch.float64, device=device)
    if world > 1:
        t = accelerator.gather(t)
    alloc_max, state_bpp = float(t[:, 0].max()), float(t[:, 1].max())
    out[names.SUM_BYTES_PER_PARAM] = alloc_max * 2**30 / max(1, local_params)
    out[names.SUM_MODEL_STATE_BYTES_PER_PARAM] = state_bpp
    steady_step = rates.step_time_s if rates is not None else None
    bd = account.breakdown(step_s=meter.warmup_s + meter.steady_s, warmup_s=meter.warmup_s,
                           warmup_steps=min(cfg.warmup_steps, meter.step), steady_step_s=steady_step)
    out[names.SUM_WALL_S] = bd["wall"]
    out[names.SUM_GOODPUT] = goodput(bd)
    for c in names.BADPUT_CATEGORIES:
        out[names.SUM_BADPUT[c]] = bd[c]
    return {k: v for k, v in out.items() if v is not None}


def main(argv: list[str] | None = None) -> None:
    """Per-process entry used by ``accelerate launch``: ``python -m mlflow_llmeff.train.loop --config-json J``."""
    import argparse
    import json

    p = argparse.ArgumentParser(prog="mlflow_llmeff.train.loop")
    p.add_argument("--config-json", required=True)
    args = p.parse_args(argv)
    cfg = TrainConfig(**json.loads(args.config_json))
    try:
        run_training(cfg)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
