"""The training entrypoint's loop: set up, train step by step, evaluate and checkpoint, finish.

It measures nothing itself. Every figure comes from the same
:class:`~mlflow_llmeff.monitor.meter.EfficiencyMonitor` a user's loop uses: the loop counts each
micro-batch, ends each step, and declares what is not a step (``data_wait``, ``eval``,
``checkpoint_save``, ``checkpoint_load``). Every rank runs this; only rank 0 logs.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from contextlib import nullcontext

from mlflow_llmeff.monitor import lifecycle
from mlflow_llmeff import names
from mlflow_llmeff.train import checkpoint as ckpt
from mlflow_llmeff.train import comm, faults, preempt
from mlflow_llmeff.train.batches import loss_shares, loss_token_counts  # noqa: F401 - the loop's; tests import it here
from mlflow_llmeff.planning.spec import RunSpec
from mlflow_llmeff.train.config import TrainConfig, validate
from mlflow_llmeff.train.messages import message_style
from mlflow_llmeff.names import shorten

# test hooks: see train/faults.py
KILL_AT_STEP_ENV, RAISE_AT_STEP_ENV = faults.ENV["kill_at_step"], faults.ENV["raise_at_step"]
SIGTERM_AT_STEP_ENV = faults.ENV["sigterm_at_step"]


class NonFiniteLoss(RuntimeError):
    """The training loss became NaN or infinite (``nan_policy=fail``); the message is the run's one line."""

    one_line = True


class DataError(RuntimeError):
    """Fetching a batch failed; the message names the step and the underlying error."""

    one_line = True


def run_training(run: TrainConfig | RunSpec, started_at: float | None = None) -> dict | None:
    """Train per ``run`` on this process's devices and log to MLflow from the main process.

    A run that fails after its MLflow run started ends FAILED (KILLED on Ctrl-C or SIGTERM), with
    what was measured flushed; its checkpoints stay, so rerunning the same command resumes it.

    Args:
        run: the resolved run (:class:`~mlflow_llmeff.planning.spec.RunSpec`: ``llmeff train``, and in
            a launched process the launcher's, read from ``--resolved-json``), or the settings, then
            checked and resolved here, once (:func:`~mlflow_llmeff.train.config.validate`).
        started_at: ``time.perf_counter()`` at which this attempt began (the command line passes the
            process start, so imports are ``init``); default: now.

    Returns:
        On the main process, ``{"run_id": ..., "summary": {key: value}}``; None on other ranks.

    Raises:
        ValueError: for bad settings (before any heavy work).
    """
    holder: dict = {}
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, lifecycle.sigterm_to_exit)
    try:
        spec = run if isinstance(run, RunSpec) else validate(run)
        if started_at is None:  # now; the job's ledger keeps the process's start (train/job.py)
            return _run_training(spec, holder, time.perf_counter())
        # a given start is the attempt's start on the job's clock too (unix seconds)
        return _run_training(spec, holder, started_at, time.time() - (time.perf_counter() - started_at))
    except BaseException as e:
        monitor = holder.get("monitor")
        _end_attempt(holder, e, monitor)
        if monitor is not None:
            status = lifecycle.status_for(e)
            if status != "FINISHED":  # the run says why it stopped
                why = (f"stopped by {lifecycle.signalled() or 'Ctrl-C'}" if status == "KILLED"
                       else _why(e, monitor.step_count + 1))
                monitor.set_tags({names.ERROR: why, "mlflow.note.content": f"{status.title()}: {why}"})
            monitor.finish(status, collective=False)
        elif holder.get("carbon") is not None:
            holder["carbon"].stop()
        raise
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        if holder.get("preemption") is not None:
            holder["preemption"].uninstall()


def _run_training(spec: RunSpec, holder: dict, started: float, start_unix: float | None = None) -> dict | None:
    from mlflow_llmeff.train.setup import build, teardown

    cfg = spec.options
    holder["carbon"] = carbon = _carbon_tracker(cfg)  # from the start, so its estimate spans the set-up too
    t = build(spec)
    if t.accelerator.is_main_process:
        for name in ckpt.clean_partial(cfg.checkpoint_dir):
            print(f"llmeff: removed the half-written checkpoint {name} left by an interrupted save")
    t.accelerator.wait_for_everyone()
    found = ckpt.find_resume(cfg.checkpoint_dir, cfg.resume, t.world, cfg.parallelism)
    if found and (found[1]["step"] >= cfg.max_steps or found[1].get("stopped_at_targets")) and not _unclosed(cfg):
        return _already_done(cfg, t, found)
    # (a job killed after its final checkpoint, before its run was closed, goes on: this attempt trains no step
    # and closes the run, FINISHED with every attempt counted, instead of leaving it RUNNING for ever)
    job, job_run = _begin_attempt(cfg, t, found, holder, start_unix)
    preemption = preempt.watch(cfg, t, holder)
    if job is not None:  # an elastic restart starts at its own process start, not the launcher's
        started = max(started, time.perf_counter() - max(0.0, time.time() - job.start_unix))
    monitor = _open_monitor(spec, t, found, started, carbon, job_run)
    holder["monitor"] = monitor
    if t.op_build_s:  # DeepSpeed's JIT build, timed in setup before the meter existed: compile, not init
        monitor.credit_build(t.op_build_s)
    if job is not None:
        from mlflow_llmeff.train.job import carry

        job.record_run(monitor.run_id, tracking_uri=_tracking_uri())
        monitor.continue_job(**carry(job.attempts(), found[1]["step"] if found else None))
    if cfg.num_machines > 1:
        comm.mark_machine_runs(cfg, monitor)
    if monitor.is_main and monitor.run_id and not found:
        _log_dataset(cfg, t, monitor)
    if not found:
        comm.probe_comm(spec, t, monitor)
    if found:
        loading = time.time()
        with monitor.pause("checkpoint_load"):
            t.parallel.load(t.accelerator, t.model, t.optimizer, found[0])
        if job is not None:
            job.loaded(time.time() - loading)
    _announce_compiled_step(cfg, t)
    stopped = _train(spec, t, monitor, start_step=monitor.step_count,
                     skipped=int(found[1].get("skipped_steps", 0)) if found else 0, job=job,
                     position=ckpt.resumed_position(found[1], t.dp_world, cfg.grad_accum) if found else None,
                     preemption=preemption)
    said = _job_figures(job, monitor)
    if stopped is not None:  # the scheduler's warning: checkpointed, this attempt ends preempted
        return preempt.end_preempted(t, monitor, job, stopped, said)
    summary = monitor.finish()
    if job is not None:
        job.end("finished", monitor.step_count)
    if t.accelerator.is_main_process:
        _print_summary(monitor, summary, said.get("line"))
    if cfg.save_model:  # after the run's wall time: saving is not training
        _save_model(cfg.save_model, t)
    teardown(t)
    return {"run_id": monitor.run_id, "summary": summary} if t.accelerator.is_main_process else None


def _begin_attempt(cfg: TrainConfig, t, found, holder: dict, start_unix: float | None = None):
    """Rank 0 with a checkpoint folder: this attempt in the job's ledger (train/job.py), started at
    ``start_unix`` (default: the launcher's or this process's start); returns ``(job, run id of the
    job)`` (the run id None for a new job; ``(None, None)`` elsewhere)."""
    if not cfg.checkpoint_dir or not t.accelerator.is_main_process:
        return None, None
    from mlflow_llmeff.train import job as jobs

    job = jobs.Job(cfg.checkpoint_dir)
    recorded = (job.record() or {}).get("tracking_uri")
    elsewhere = not found and recorded and recorded != _tracking_uri()  # the job's run is on another server
    if elsewhere:
        print(f"llmeff: the job's run {job.record()['run_id']} was logged to {recorded}, not {_tracking_uri()}: "
              "a new job and run start")
    if cfg.resume == "never" or elsewhere or (not found and job.finished()):  # a finished job is not continued
        job.reset()
    start = jobs.attempt_start_unix() if start_unix is None else start_unix
    run_id = job.begin(start, found[1]["step"] if found else 0, cfg.warmup_steps, devices=t.world)
    holder["job"] = job
    if run_id and not found:
        print(f"llmeff: continuing MLflow run {run_id} (attempt {job.attempt}; no checkpoint was written: "
              "training restarts from step 0)")
    earlier = job.attempts()[:-1]
    if earlier:
        a = earlier[-1]
        how = "finished" if a.end == "finished" else f"ended {a.end}{' (' + a.detail + ')' if a.detail else ''}"
        print(f"llmeff: attempt {job.attempt} of this job; attempt {len(earlier)} {how} at step {a.steps}, "
              f"{job.start_unix - a.last_alive:.1f} s before this attempt started")
    return job, run_id


def _tracking_uri() -> str | None:
    try:
        from mlflow_llmeff.tracking import store
        from mlflow_llmeff.tracking.redact import strip_uri_secrets

        return strip_uri_secrets(store.tracking_uri())  # no password in the checkpoint folder
    except Exception:  # noqa: BLE001 - only a record
        return None


def _end_attempt(holder: dict, e: BaseException, monitor) -> None:
    """Record how this attempt ended in the job's ledger (never raises)."""
    job = holder.get("job")
    if job is None:
        return
    try:
        from mlflow_llmeff.train.job import classify

        kind, detail = classify(e, lifecycle.signalled())
        job.end(kind, monitor.step_count if monitor is not None else 0, detail)
    except Exception:  # noqa: BLE001 - the ledger never hides the error that ended the run
        pass


def _job_figures(job, monitor) -> dict:
    """Hand the meter the job's reliability figures (calc/reliability.py), computed when its clock stops
    (so they end where summary/wall_s ends); returns a holder whose "line" the terminal summary prints."""
    said: dict = {}
    if job is None:
        return said
    from mlflow_llmeff.calc import reliability as rel

    def figures(end_unix: float):
        job.settle()  # a short resumed attempt: its set-up and load are part of the recovery
        r = rel.compute(job.attempts(now=end_unix, step=monitor.step_count, end=said.get("end", rel.FINISHED)))
        said["line"] = rel.describe(r)
        return rel.summary_metrics(r), rel.summary_tags(r), said["line"] if r.attempts > 1 else None

    monitor.set_job_figures(figures)
    return said


def _carbon_tracker(cfg: TrainConfig):
    from mlflow_llmeff.meters.carbon import CarbonTracker

    tracker = CarbonTracker(country_iso_code=cfg.country_iso_code or None, cloud_provider=cfg.cloud_provider or None,
                            cloud_region=cfg.cloud_region or None, enabled=cfg.measure_energy != "none")
    tracker.start()
    return tracker


def run_tags(spec: RunSpec, data_kind: str) -> dict[str, str]:
    """The tags ``llmeff train`` gives its run besides the meter's conditions: the model, the batch's
    shape and the global batch as resolved (:attr:`RunSpec.global_batch_tokens`), the degrees, the
    data and tokenizer, the eval settings and the code's commit."""
    from mlflow_llmeff.meters.probes import git_commit
    from mlflow_llmeff.models.build import tokenizer_name
    from mlflow_llmeff.train.data import dataset_label

    cfg = spec.options
    tags = {names.MODEL_NAME: cfg.model, names.SEQ_LEN: str(cfg.seq_len),
            names.MICRO_BATCH_SIZE: str(cfg.micro_batch_size), names.GRAD_ACCUM: str(cfg.grad_accum),
            names.GLOBAL_BATCH_TOKENS: spec.tags()[names.GLOBAL_BATCH_TOKENS], **spec.degrees.tags(),
            names.DATASET: dataset_label(cfg.dataset), names.DATASET_KIND: data_kind, names.TOKENIZER: tokenizer_name(cfg.model),
            names.EVAL_BATCH_SIZE: str(cfg.micro_batch_size),  # evaluate.py scores micro_batch_size sequences a pass
            names.LOSS_WEIGHTING: ("token-weighted: llmeff train divides each step's summed loss by its loss-bearing "
                                   "tokens over every micro-batch and data-parallel rank (loss_shares)"),
            names.GIT_COMMIT: git_commit(os.path.dirname(os.path.abspath(__file__)))}
    if cfg.eval_tasks:
        tags[names.EVAL_NUM_FEWSHOT] = str(cfg.eval_num_fewshot)
        from mlflow_llmeff.evals.api import eval_documents

        tags[names.EVAL_DOCUMENTS] = eval_documents(cfg.eval_limit, cfg.seed)
    return tags


def _announce_compiled_step(cfg: TrainConfig, t) -> None:
    """Rank 0 says, before the first optimizer step, that the optimizer compiles its step then (torchao)."""
    from mlflow_llmeff.calc.optimizers import choice
    from mlflow_llmeff.train.optimizers import COMPILE_NOTE, compiles_step

    if t.accelerator.is_main_process and compiles_step(cfg.optimizer):
        print(COMPILE_NOTE.format(cls=choice(cfg.optimizer).cls.rsplit(".", 1)[1]), flush=True)


def _open_monitor(spec: RunSpec, t, found, started: float, carbon, job_run: str | None = None):
    """The run's meter: conditions as tags, settings as params, the checkpoint's counters continued."""
    from mlflow_llmeff.monitor.meter import EfficiencyMonitor
    from mlflow_llmeff.train.optimizers import compiles_step

    cfg = spec.options
    state = found[1] if found else None
    if state and t.accelerator.is_main_process:
        print(f"llmeff: resuming MLflow run {state['run_id']} from checkpoint step {state['step']}")
        if state.get("world_size") != t.world:  # an elastic restart on another number of devices
            print(f"llmeff: the checkpoint was written by {state.get('world_size')} processes, this attempt has "
                  f"{t.world} ({t.strategy}: its state loads on any number); the global batch is now "
                  f"{cfg.micro_batch_size * cfg.grad_accum * t.dp_world} sequences, device-hours and per-device "
                  "figures count each attempt at its own devices")
    tags = run_tags(spec, t.data.kind)
    # torchao's low-bit optimizers torch.compile their step on its first call (a warm-up step: validate
    # refuses warmup_steps=0 with them). compile=True is how the meter books that: the warm-up excess
    # becomes summary/badput_compile_s, llmeff.compile says torch.compile ran, and the FlopCounterMode
    # step is skipped (it would stop dynamo compiling the optimizer step; HFU is then analytic).
    compiled = cfg.compile or compiles_step(cfg.optimizer)
    return EfficiencyMonitor(
        log_every_n_steps=cfg.log_every_n_steps, warmup_steps=cfg.warmup_steps, model=t.model,
        model_config=t.model_config, optimizer=t.optimizer, precision=t.precision, strategy=t.strategy,
        compile=compiled, activation_checkpointing=cfg.activation_checkpointing,
        peak_tflops=cfg.peak_tflops or None, device_hour_usd=cfg.device_hour_usd or None,
        usd_per_kwh=cfg.usd_per_kwh or None, measure_energy=cfg.measure_energy,
        country_iso_code=cfg.country_iso_code or None, cloud_provider=cfg.cloud_provider or None,
        cloud_region=cfg.cloud_region or None, carbon_tracker=carbon, targets=cfg.targets, run_id=state["run_id"] if state else job_run,
        run_name=cfg.run_name or None, experiment_name=cfg.experiment_name or None, tags=tags,
        params=cfg.to_params(), resume_state=state["monitor"] if state else None, started_at=started,
        integration="train", heartbeat_path=ckpt.heartbeat_path(cfg.checkpoint_dir),
        outbox_dir=os.path.join(cfg.checkpoint_dir, "outbox") if cfg.checkpoint_dir else None,
        data_parallel_size=t.dp_world, eval_subject_metrics=_subject_metrics(cfg),
        optimizer_origin=f"llmeff train --optimizer {cfg.optimizer}")


def _subject_metrics(cfg: TrainConfig) -> bool:
    """Per-subject MMLU scores as metrics: when asked, or when the tasks name subjects, not all of MMLU
    (a few named subjects are a few charts; all 57 are the table artifact, docs/evals.md)."""
    tasks = [x.strip() for x in cfg.eval_tasks.split(",") if x.strip()]
    return cfg.eval_subject_metrics or "mmlu" not in tasks


def _log_dataset(cfg: TrainConfig, t, monitor) -> None:
    """The training data as the run's MLflow dataset input (rank 0; a failure is a warning, never fatal)."""
    try:
        from mlflow_llmeff.train.dataset_input import training_dataset

        monitor.log_input([training_dataset(cfg.dataset, t.data, cfg.seq_len, cfg.packing)])  # delivered in order
    except Exception as e:  # noqa: BLE001 - a missing Dataset column must not stop training
        import warnings

        warnings.warn(f"mlflow_llmeff: training data not logged as an MLflow dataset input ({type(e).__name__}: {e})",
                      stacklevel=2)


def _train(spec: RunSpec, t, monitor, start_step: int, skipped: int = 0, job=None, position: int | None = None,
           preemption=None) -> dict | None:
    """The step loop: micro-batches, optimizer step, then evals and checkpoints when due; ``position``: the
    global micro-step the data order continues at (default: ``start_step x grad_accum``). Returns the agreed
    stop when the scheduler's warning ended it early (after a checkpoint of that step), else None."""
    from tqdm.auto import tqdm

    from mlflow_llmeff.train.batches import BatchStream

    from mlflow_llmeff.meters.commprobe import StepSampler

    cfg = spec.options
    batches = BatchStream(t.data, cfg.micro_batch_size, t.dp_world, t.dp_rank, cfg.seed,
                          start_step * cfg.grad_accum if position is None else position, t.device,
                          num_workers=spec.data_workers)
    sampler = StepSampler(world=t.world, warmup_steps=cfg.warmup_steps, start_step=start_step, device=t.device,
                          enabled=cfg.measure_comm, compiled=cfg.compile)
    if not sampler.active:
        monitor.set_tags(StepSampler.inactive_tag(t.world, cfg.measure_comm, cfg.warmup_steps))
    bar = tqdm(total=cfg.max_steps, initial=start_step, disable=None if t.accelerator.is_main_process else True,
               unit="step", dynamic_ncols=True)
    now = {"step": start_step + 1}
    oom = faults.oom_hook(t.model, lambda: now["step"])
    skip_bad = cfg.nan_policy == "skip_step"
    armed = any(faults.fault_step(point) for point in faults.ENV)  # a test's fault point is set (read once)
    shown = [None]  # the monitor's latest point on the progress bar
    t.model.train()
    for step in range(start_step + 1, cfg.max_steps + 1):
        now["step"] = step
        if job is not None:
            job.step_started()
        lr = t.scheduler.get_last_lr()[0]  # the rate this step uses
        first = step == start_step + 1 and cfg.warmup_steps > 0
        bad_step = False  # a micro-batch of this step had a non-finite loss (skip_step only)
        with sampler.around(step), (monitor.counting_hardware_flops() if first else nullcontext()):
            with monitor.pause("data_wait"):  # the step's micro-batches first: their loss tokens weigh each
                micro = [_next_batch(batches, step, first_micro=armed and i == 0) for i in range(cfg.grad_accum)]
            n_loss = loss_token_counts(micro)  # counted once: the shares' weights and the meter's loss tokens
            shares, dp_scale = loss_shares(micro, t.world, t.dp_world, counts=n_loss)
            step_loss = None
            for i, batch in enumerate(micro):
                loss, bad = _micro_step(cfg, t, batch, step, skip_bad, bad_step, shares[i], armed)
                bad_step = bad_step or bad
                # this micro-batch's summed loss / the step's loss tokens (a float share: its loss read as a number)
                part = (loss.item() if isinstance(shares[i], float) else loss) * shares[i] * dp_scale
                step_loss = part if step_loss is None else step_loss + part
                last = i == cfg.grad_accum - 1
                monitor.count(batch, loss=step_loss if last and not bad_step else None,
                              loss_tokens=n_loss[i] if "labels" in batch else None)  # (else: the meter's own rule)
        t.scheduler.step()
        if sampler.due(step):
            comm.sampled_comm(sampler, monitor)
        eval_now = _due(step, cfg.eval_every, cfg.max_steps) and (t.data.val is not None or bool(cfg.eval_tasks))
        ckpt_now = bool(cfg.checkpoint_dir) and _due(step, cfg.checkpoint_every, cfg.max_steps)
        monitor.step(learning_rate=lr, edge=eval_now or ckpt_now)
        if job is not None:
            job.step_done(step)  # the heartbeat: the last completed step
        if skip_bad:
            skipped += bad_step
            if bad_step or step % cfg.log_every_n_steps == 0 or step == cfg.max_steps:
                monitor.log_metrics({names.TRAIN_SKIPPED_STEPS: skipped}, step)
        else:
            _check_loss(cfg, monitor, edge=eval_now or ckpt_now)
        if eval_now:
            _evaluate(cfg, t, monitor, step)
        stop = cfg.stop_at_targets and monitor.targets_reached
        if ckpt_now or (stop and cfg.checkpoint_dir):
            ckpt.save(t.accelerator, cfg, step, monitor, {"stopped_at_targets": stop, "skipped_steps": skipped,
                                                           "dp_world": t.dp_world}, t.parallel, t.model, t.optimizer)
            if job is not None:
                job.checkpoint(step)
        stopped = preemption.due(step) if preemption is not None and step < cfg.max_steps else None
        if stopped is not None:  # every rank stops after this same step (train/preempt.py)
            if not ckpt_now:
                ckpt.save(t.accelerator, cfg, step, monitor, {"stopped_at_targets": False, "skipped_steps": skipped,
                                                               "dp_world": t.dp_world}, t.parallel, t.model, t.optimizer)
                if job is not None:
                    job.checkpoint(step)
            if oom is not None:
                oom.remove()
            bar.close()
            return stopped
        _progress(bar, monitor, shown)
        if armed:
            _inject_faults(step, monitor)
        if stop:
            if t.accelerator.is_main_process:
                print(f"llmeff: every target reached at step {step}; stopping (stop_at_targets=true)")
            break
    if oom is not None:
        oom.remove()
    bar.close()
    return None


def _next_batch(batches, step: int, first_micro: bool) -> dict:
    """The next micro-batch; a failure becomes a :class:`DataError` naming the step."""
    try:
        if first_micro:
            faults.maybe_fault("data_at_step", step)
        return next(batches)
    except Exception as e:  # noqa: BLE001 - any loader failure ends the run with one line
        raise DataError(f"data loading failed at step {step}: {type(e).__name__}: {e}") from e


def _micro_step(cfg: TrainConfig, t, batch, step: int, skip_bad: bool, bad_before: bool, share=None,
                armed: bool = True):
    """Forward, backward and (at the accumulation boundary) the optimizer step.

    The loss backpropagated is the micro-batch's mean loss x ``share`` (its loss-bearing tokens over the
    step's, :func:`loss_shares`) x ``grad_accum`` x data-parallel ranks: Accelerate (and DeepSpeed) divide
    the loss by ``grad_accum`` and the data-parallel reduction averages gradients over the ranks, so the
    step's gradient is that of the summed loss over every loss-bearing token of the step divided by their
    count. A micro-batch without loss-bearing tokens adds nothing (its mean, 0/0, is not used).

    Where :attr:`Training.direct_optimizer` is set (one process or DDP, no gradient scaler) the loss is
    backpropagated and the optimizer stepped and zeroed here, as Accelerate's wrappers would, without their
    per-call work (train/setup.py :func:`~mlflow_llmeff.train.setup.direct_optimizer`). ``armed``: a fault
    point is set (train/faults.py; read once a run, not at every micro-batch).

    Returns ``(loss, bad)``: the detached mean loss, and whether it was not finite (checked, with
    one device sync and a flag reduced over ranks, only when ``skip_bad``). At the boundary, a
    step with a bad micro-batch (``bad`` or ``bad_before``) drops its gradients instead of stepping.
    """
    import numpy
    import torch

    with t.accelerator.accumulate(t.model):
        out = t.model(**batch)
        loss = out.loss.detach()
        bad = skip_bad and _not_finite(loss, t.world)
        scaled = out.loss
        if isinstance(share, float) and share > 0:  # (CPU, one data-parallel rank): the weight as a number
            weight = float(numpy.float32(share * (cfg.grad_accum * t.dp_world)))  # as .to(float32) rounds it
            scaled = out.loss if weight == 1.0 else out.loss * weight  # x 1.0 would change no bit of a gradient
        elif share is not None:
            share = torch.as_tensor(share, dtype=torch.float64)  # a float 0: the NaN mean is masked below
            weight = (share * (cfg.grad_accum * t.dp_world)).to(out.loss.dtype)
            scaled = torch.where(share > 0, out.loss, torch.zeros_like(out.loss)) * weight
            loss = torch.where(share > 0, loss, torch.zeros_like(loss))
        direct = t.direct_optimizer  # (train/setup.py direct_optimizer: the wrapper would add only its own work)
        if direct is None:
            t.accelerator.backward(scaled)
        else:  # Accelerator.backward's arithmetic: / grad_accum (/ 1 changes no bit, so it is left out)
            (scaled / cfg.grad_accum if cfg.grad_accum > 1 else scaled).backward()
        if armed:
            faults.maybe_fault("kill_in_step", step)
        sync = t.accelerator.sync_gradients  # the accumulation boundary (set by accumulate() above)
        if sync and (bad or bad_before):
            t.optimizer.zero_grad(set_to_none=True)  # skip: these gradients come from a non-finite loss
        elif direct is not None:
            if sync:  # where Accelerate's wrapper steps and zeroes: at the boundary only
                if cfg.max_grad_norm > 0:
                    _clip_gradients(t, cfg.max_grad_norm)
                direct.step()
                direct.zero_grad(set_to_none=True)
        else:
            if sync and cfg.max_grad_norm > 0 and not t.parallel.clips_in_engine:
                _clip_gradients(t, cfg.max_grad_norm)
            t.optimizer.step()  # Accelerate's optimizer wrapper steps at the accumulation boundary only
            t.optimizer.zero_grad(set_to_none=True)
    return loss, bad


def _clip_gradients(t, max_norm: float) -> None:
    """Clip the gradients' global 2-norm to ``max_norm``: single and DDP without a gradient scaler through
    torch's multi-tensor path (``foreach=True``: one call for every gradient, where Accelerate's
    ``clip_grad_norm_`` lets torch loop over them in Python on a CPU: 0.75 ms -> 0.17 ms a step for llama-tiny
    on a 2-core CPU; the same per-tensor norms, so the same total); every other strategy through Accelerate,
    which unscales fp16 gradients and reduces sharded (DTensor, FSDP) norms."""
    import torch

    if t.strategy in ("single", "ddp") and getattr(t.accelerator, "scaler", None) is None:
        torch.nn.utils.clip_grad_norm_(t.model.parameters(), max_norm, foreach=True)
    else:
        t.accelerator.clip_grad_norm_(t.model.parameters(), max_norm)


def _not_finite(loss, world: int) -> bool:
    """True when ``loss`` is NaN or infinite on any rank (synchronizes the device)."""
    import torch

    from mlflow_llmeff.meters import collectives

    bad = 0.0 if bool(torch.isfinite(loss).item()) else 1.0
    if world > 1:
        bad = collectives.all_reduce([bad], op="max")[0]
    return bool(bad)


def _check_loss(cfg: TrainConfig, monitor, edge: bool) -> None:
    """Raise :class:`NonFiniteLoss` once the meter has seen a NaN or infinite loss (``nan_policy=fail``).

    At logged steps the meter has read the loss anyway; before an eval or checkpoint (``edge``)
    it also looks at the steps since, so no checkpoint holds diverged weights.
    """
    bad = monitor.check_loss() if edge else monitor.nonfinite_loss
    if bad is not None:
        at, value = bad
        opt = "-P " if message_style() == "mlflow" else "--"
        name = (lambda n: n) if opt == "-P " else (lambda n: n.replace("_", "-"))
        kept = " the last checkpoint before it is kept." if cfg.checkpoint_dir else ""
        raise NonFiniteLoss(
            f"train/loss is {value} at step {at} (nan_policy=fail): training diverged;{kept} Lower "
            f"{opt}{name('learning_rate')} (now {cfg.learning_rate:g}), keep {opt}{name('max_grad_norm')} > 0, or "
            f"pass {opt}{name('nan_policy')}{'=' if opt == '-P ' else ' '}skip_step")


def _due(step: int, every: int, last: int) -> bool:
    """True every ``every`` steps (0: never) and at the last step."""
    return (every > 0 and step % every == 0) or step == last


def _evaluate(cfg: TrainConfig, t, monitor, step: int) -> None:
    from mlflow_llmeff.train.evaluate import evaluate

    with monitor.pause("eval"):
        values = evaluate(cfg, t)
        faults.maybe_fault("kill_in_eval", step)
    monitor.log_eval(values, step)


def _progress(bar, monitor, shown: list) -> None:
    """Advance the bar one step; its loss and tokens/s change only at a logged step (``shown[0]``: the latest
    point already on the bar), so they are formatted then, not at every step."""
    latest = monitor.latest_built  # (a point built off the training thread shows a step later: no wait)
    if latest is not shown[0]:
        shown[0] = latest
        loss, tps = latest.get(names.TRAIN_LOSS), latest.get(names.TPUT_TOKENS)
        if loss is not None:
            bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tps:,.0f}" if tps else "warm-up", refresh=False)
    bar.update(1)


def _inject_faults(step: int, monitor) -> None:
    """The after-step test hooks (train/faults.py); the kill and the hold (rank 0, or ``$LLMEFF_FAULT_RANK``)
    flush rank 0's metrics first."""
    for point in ("kill_at_step", "hold_at_step"):
        if faults.fires(point, step) and faults.on_this_rank(monitor.is_main):
            if monitor.is_main:
                monitor.flush()
            faults.maybe_fault(point, step)
    faults.maybe_fault("raise_at_step", step)
    faults.maybe_fault("sigterm_at_step", step)


def stopped_with_one_line(e: BaseException) -> str | None:
    """The one line for an ending the loop knows (NonFiniteLoss, DataError, out of memory), else None."""
    if getattr(e, "one_line", False):
        return str(e)
    try:
        import torch

        if isinstance(e, torch.OutOfMemoryError):
            return _why(e, int(getattr(e, "llmeff_step", 0)) or 0)
    except ImportError:
        pass
    return None


def _why(e: BaseException, step: int) -> str:
    """The one line a failed run carries: our own errors as they are, OOM with what to try."""
    from mlflow_llmeff.tracking.runs import error_line

    import torch

    if isinstance(e, torch.OutOfMemoryError):
        e.llmeff_step = step  # for the command line's one line
        first = shorten((str(e).strip().splitlines() or [""])[0], 300)
        return (f"out of memory at step {step} ({first}); a smaller micro_batch_size with more grad_accum, "
                "activation_checkpointing=true, bf16, or more devices with fsdp need less (see llmeff plan)")
    return error_line(e)


def _unclosed(cfg: TrainConfig) -> bool:
    """True when the job in ``cfg.checkpoint_dir`` has attempts on record (train/job.py) and its last one did
    not finish: its final checkpoint was written, then it was killed before its run was closed. Every rank
    reads the same folder (the checkpoint folder is shared, as resuming needs)."""
    from mlflow_llmeff.train import job as jobs

    job = jobs.Job(cfg.checkpoint_dir)
    return any(e.get("event") == "start" for e in job.events()) and not job.finished()


def _already_done(cfg: TrainConfig, t, found) -> dict | None:
    path, state = found
    if t.accelerator.is_main_process:
        print(f"llmeff: checkpoint {path} is already the end of this run (step {state['step']}, "
              f"max_steps={cfg.max_steps}); nothing to do")
    t.accelerator.end_training()
    return {"run_id": state.get("run_id"), "summary": {}} if t.accelerator.is_main_process else None


def _save_model(path: str, t) -> None:
    """Write the trained model (``save_pretrained``: config + safetensors) and its tokenizer to ``path``.

    Every rank takes part in gathering the weights (sharded under FSDP/DeepSpeed); the main process
    writes them.
    """
    state = t.parallel.full_state_dict(t.accelerator, t.model)
    if t.accelerator.is_main_process:
        t.accelerator.unwrap_model(t.model).save_pretrained(path, state_dict=state)
        t.tokenizer.save_pretrained(path)
        print(f"llmeff: model saved to {path} (score it: llmeff eval --model {path})")
    t.accelerator.wait_for_everyone()


def _print_summary(monitor, summary: dict, reliability: str | None = None) -> None:
    """The run's report on stdout: the closing report every path prints (monitor/closing.py: the closing
    line, its stability, what was assumed, where to open the run), with the job's reliability line after
    a restart."""
    from mlflow_llmeff.monitor.closing import report_lines

    restarted = reliability and summary.get(names.SUM_ATTEMPTS, 1) > 1
    print("\n".join(report_lines(monitor, summary, reliability if restarted else None)))


def main(argv: list[str] | None = None) -> None:
    """Per-process entry used by ``accelerate launch``: ``python -m mlflow_llmeff.train.loop --config-json J
    [--resolved-json R]`` (R: the launcher's resolution, read, not redone)."""
    import argparse
    import json

    from mlflow_llmeff.train.job import attempt_start_perf

    p = argparse.ArgumentParser(prog="mlflow_llmeff.train.loop")
    p.add_argument("--config-json", required=True)
    p.add_argument("--resolved-json", default=None, help="what the launcher resolved of the settings "
                   "(RunSpec.resolved); without it this process checks and resolves them itself")
    args = p.parse_args(argv)
    cfg = TrainConfig(**json.loads(args.config_json))
    try:
        run = RunSpec.read(cfg, json.loads(args.resolved_json)) if args.resolved_json else cfg
        run_training(run, started_at=attempt_start_perf())
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except Exception as e:  # noqa: BLE001 - known endings as one line; others with their traceback
        line = stopped_with_one_line(e)
        if not line:
            raise
        print(f"error: {line}", file=sys.stderr)
        sys.exit(1)
    # the run is logged and torn down: end now, not after torch's module teardown (seconds of the
    # user's command that no summary/wall_s holds; monitor/lifecycle.py exit_now)
    lifecycle.exit_now(0)


if __name__ == "__main__":
    main()
