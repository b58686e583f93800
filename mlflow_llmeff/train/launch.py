"""Start training: in this process for one device, through ``accelerate launch`` for several.

On a machine without CUDA, several processes train over gloo; each strategy
(:mod:`mlflow_llmeff.parallel`) gives the launcher flags and environment it needs there (DDP,
FSDP2 and tensor parallelism ``ACCELERATE_USE_CPU=1``, DeepSpeed ``DS_ACCELERATOR=cpu``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time

from mlflow_llmeff.train.config import TrainConfig, validate
from mlflow_llmeff.train.messages import message_style


def accelerate_command(cfg: TrainConfig, *, cuda: bool) -> tuple[list[str], dict[str, str]]:
    """The ``accelerate launch`` command line and environment for ``cfg.num_processes`` processes on
    each of ``cfg.num_machines`` machines (Accelerate counts processes over all machines); the
    strategy adds its flags (``--multi_gpu``, ``--use_deepspeed --zero_stage N``) and environment."""
    from mlflow_llmeff.train.config import get_strategy

    strategy = get_strategy(cfg)
    flags = strategy.launcher_args(cuda=cuda)
    script = _loop_script(cfg)
    if cfg.num_processes * cfg.num_machines == 1 and "--multi_gpu" in flags:
        # one process that needs a process group (FSDP2 on one GPU): accelerate launch refuses
        # --multi_gpu below 2 processes; its multi-GPU launcher is torchrun, so run that directly
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1", *script]
    else:
        cmd = [sys.executable, "-m", "accelerate.commands.launch",
               "--num_processes", str(cfg.num_processes * cfg.num_machines),
               "--num_machines", str(cfg.num_machines), "--dynamo_backend", "no", "--mixed_precision", "no"]
        if cfg.num_machines > 1:
            cmd += ["--machine_rank", str(cfg.machine_rank), "--main_process_ip", cfg.main_process_ip]
        cmd += ["--main_process_port", str(cfg.main_process_port)]  # the rendezvous port (default 29500)
        cmd += flags + script
    env = dict(os.environ)
    env.update(strategy.launcher_env(cuda=cuda))
    return cmd, env


class FitError(ValueError):
    """The run would not fit the device's memory (the message says what would)."""


def fit_here(cfg: TrainConfig):
    """The memory verdict of ``cfg`` on this machine's devices (:func:`mlflow_llmeff.planning.fit.verdict`)."""
    import torch

    from mlflow_llmeff.planning import fit
    from mlflow_llmeff.train.config import resolve_precision, resolve_strategy

    cuda = torch.cuda.is_available()
    bf16 = torch.cuda.is_bf16_supported() if cuda else True
    precision = resolve_precision(cfg, cuda_available=cuda, bf16_supported=bf16)
    strategy = resolve_strategy(cfg, cfg.num_processes)
    if cuda:
        available = fit.cuda_free_bytes()
        total = torch.cuda.get_device_properties(0).total_memory / 2**30
        where = f"this {torch.cuda.get_device_name(0)} ({total:.0f} GiB, the free part counted)"
    else:
        available, where = fit.host_available_bytes(), "this CPU (host memory, shared by all processes)"
    return fit.verdict(cfg, precision=precision, strategy=strategy, available_bytes=available, where=where,
                       cpu=not cuda, bf16_ok=bf16)


def launch(cfg: TrainConfig, *, started_unix: float | None = None, own_process: bool = False) -> int:
    """Validate ``cfg`` and check that it fits (cheap, before heavy work), then train. Returns the exit code.

    Args:
        cfg: the settings.
        started_unix: the attempt's start, unix seconds: where its ``summary/wall_s`` and the job's clock
            begin. Default: this process's start (``llmeff train``: imports and set-up are ``init``).
            ``llmeff study`` (train/study.py) passes each child's own start, so a repeat's wall time
            never holds the repeats before it.
        own_process: train one device in a process of its own (``python -m mlflow_llmeff.train.loop``),
            as several devices always are, instead of in this one. ``llmeff study`` sets it: in one
            process only the first repeat would pay the imports and set-up that every real job pays
            (a trial: 6.45 s of init and goodput 0.20 on the first child, 0.09-0.17 s and 0.79-0.85
            on the three after it), so repeats would differ by their place in the order.

    Raises:
        ValueError: bad settings, as one line naming the value and the accepted ones.
        FitError: the run would not fit the device (unless ``cfg.force``), naming what would.
    """
    import logging

    import torch

    for noisy in ("mlflow.store.db.utils", "alembic"):  # table-creation chatter of a new sqlite store
        logging.getLogger(noisy).setLevel(logging.WARNING)
    from mlflow_llmeff.train.placement import from_scheduler

    cfg = from_scheduler(cfg)  # under srun or a PyTorchJob: the machines' layout the scheduler gives
    if cfg.dry_run:
        return dry_run(cfg)
    validate(cfg)
    verdict = fit_here(cfg)
    if verdict.fits is False and not cfg.force:
        raise FitError(verdict.line(message_style()))
    from mlflow_llmeff.train.config import get_strategy

    single = cfg.num_processes == 1 and cfg.num_machines == 1 and not get_strategy(cfg).needs_launcher
    if single and own_process:
        return _train_in_own_process(cfg, time.time() if started_unix is None else float(started_unix))
    if single:
        from mlflow_llmeff.meters.probes import process_start_perf_counter
        from mlflow_llmeff.train.loop import run_training

        if started_unix is None:
            started_at = process_start_perf_counter()
        else:  # the same instant on the perf_counter clock the meter reads
            started_at = time.perf_counter() - max(0.0, time.time() - started_unix)
        result = run_training(cfg, started_at=started_at)
        return _after_preemption(cfg) if result and result.get("preempted") is not None else 0
    from mlflow_llmeff.train import job as jobs

    cmd, env = accelerate_command(cfg, cuda=torch.cuda.is_available())
    env["LLMEFF_NUM_MACHINES"] = str(cfg.num_machines)  # for the nodes tag, whatever the launcher sets
    # the job's clock starts at this command (or at the start the caller gave)
    env[jobs.START_ENV] = repr(jobs.attempt_start_unix() if started_unix is None else float(started_unix))
    from mlflow_llmeff.train import elastic

    # the launcher runs inside train/elastic.py, which keeps torch elastic's record of failed workers
    # (in the job's folder) and returns without the interpreter's teardown
    job = cfg.checkpoint_dir and cfg.machine_rank == 0
    failures_path = os.path.join(cfg.checkpoint_dir, jobs.LAUNCH_FILE) if job else elastic.NO_FILE
    if job and os.path.exists(failures_path):
        os.remove(failures_path)
    from mlflow_llmeff.train import preempt

    # the scheduler's warning signal must not end this launcher: it is recorded for the workers to agree on a stop
    caught = preempt.forward_to_file(cfg.checkpoint_dir)
    try:
        rc = subprocess.run([cmd[0], "-m", "mlflow_llmeff.train.elastic", failures_path, *cmd[2:]], env=env).returncode
    finally:
        preempt.restore(caught)
    if job:  # how the attempt ended where rank 0 could not say (killed, or stopped after another rank was lost)
        jobs.Job(cfg.checkpoint_dir).close_open(rc, elastic.read_failures(failures_path))
    if rc == 0 and cfg.checkpoint_dir and _last_end(cfg.checkpoint_dir) == "preempted":
        return _after_preemption(cfg)
    return rc


def _last_end(checkpoint_dir: str) -> str | None:
    """How the job's newest attempt ended (its ledger's last ``end``), or None."""
    from mlflow_llmeff.train import job as jobs

    ends = [e for e in jobs.Job(checkpoint_dir).events() if e.get("event") == "end"]
    return ends[-1].get("kind") if ends else None


def _after_preemption(cfg: TrainConfig) -> int:
    """A preempted attempt ended (its checkpoint written): machine 0 asks SLURM to requeue the job;
    returns :data:`~mlflow_llmeff.train.preempt.EXIT_PREEMPTED`."""
    from mlflow_llmeff.train import preempt

    if cfg.machine_rank == 0:
        print(f"llmeff: {preempt.requeue()}", file=sys.stderr, flush=True)
    return preempt.EXIT_PREEMPTED


def _loop_script(cfg: TrainConfig) -> list[str]:
    """``-m mlflow_llmeff.train.loop --config-json <cfg>``: the per-process entry every launcher runs."""
    return ["-m", "mlflow_llmeff.train.loop", "--config-json", json.dumps(dataclasses.asdict(cfg))]


def own_process_command(cfg: TrainConfig, started_unix: float) -> tuple[list[str], dict[str, str]]:
    """The command and environment that train ``cfg`` on one device in a process of its own: the
    per-process entry ``accelerate launch`` runs, with the attempt's start in ``$LLMEFF_ATTEMPT_START_UNIX``
    (its ``summary/wall_s`` and ``init`` begin there, the interpreter's start and imports inside them)."""
    from mlflow_llmeff.train import job as jobs

    env = dict(os.environ)
    env[jobs.START_ENV] = repr(float(started_unix))
    return [sys.executable, *_loop_script(cfg)], env


def _train_in_own_process(cfg: TrainConfig, started_unix: float) -> int:
    """Run :func:`own_process_command`; its stderr passes through line by line, and a last ``error: <line>``
    it printed (a refused setting, a known ending) is raised here as that line.

    Raises:
        ValueError: the child's one-line error (exit code 2: bad settings; others: the line as printed).
    """
    cmd, env = own_process_command(cfg, started_unix)
    last = None
    with subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True, bufsize=1) as proc:
        for line in proc.stderr:
            sys.stderr.write(line)
            if line.startswith("error: "):
                last = line[len("error: "):].rstrip("\n")
        rc = proc.wait()
    if rc != 0 and last:
        raise ChildError(last, rc)
    return rc


class ChildError(ValueError):
    """A training process of its own ended with ``error: <line>`` (:func:`_train_in_own_process`);
    ``code`` is its exit status."""

    def __init__(self, line: str, code: int) -> None:
        super().__init__(line)
        self.code = code


def dry_run(cfg: TrainConfig, *, accelerator_short: str | None = None, as_json: bool = False) -> int:
    """Print the plan (no training, no weights): parameters, FLOPs, memory, fit, predictions.

    Works on a CPU machine for any preset (the model is built on the meta device). Planning for
    an accelerator other than this machine's (``accelerator_short``, e.g. ``H100-SXM``) resolves
    ``precision=auto`` as bf16 where its datasheet row lists bf16 matrix units (else fp32) and checks
    the fit against its datasheet memory. What the plan takes for the user (an alias such as
    ``H100`` for ``H100-SXM``, that precision, a price from the dated default table) is its field
    ``assumed`` (``<input>: <what was taken and why>``), beside ``device_hour_usd`` and its
    ``device_hour_usd_source``. Under ``mlflow run`` the plan is logged to the run as ``plan/*``
    metrics and the tags ``llmeff.dry_run=true``, ``llmeff.plan.fit`` and ``llmeff.assumed``.
    """
    import json as _json

    import mlflow

    from mlflow_llmeff.planning import fit
    from mlflow_llmeff.meters import hardware as hw
    from mlflow_llmeff import names
    from mlflow_llmeff.calc.cost import device_hour_price
    from mlflow_llmeff.planning.plan import format_plan, make_plan
    from mlflow_llmeff.planning.predict import add_predictions
    from mlflow_llmeff.train.config import resolve_precision, resolve_strategy

    here = accelerator_short is None
    given, alias = accelerator_short, None
    if here:
        import torch

        cuda = torch.cuda.is_available()
        accelerator_short = hw.detect_accelerator(count=cfg.num_processes).short
        bf16 = torch.cuda.is_bf16_supported() if cuda else True
    else:
        accelerator_short, alias = hw.resolve_short(accelerator_short)  # H100 -> H100-SXM, with a note
        if alias:
            print(f"llmeff: accelerator {alias}", file=sys.stderr)  # stdout stays the plan (--json parses)
        cuda = accelerator_short.lower() != "cpu"
        row = next((r for r in hw.PEAK_TABLE if r.short == accelerator_short), None)
        bf16 = not cuda or (row is not None and "bf16" in row.tflops)  # its datasheet's matrix units
    validate(cfg, cuda_available=cuda, bf16_supported=bf16, engine=False)  # the plan is arithmetic
    precision = resolve_precision(cfg, cuda_available=cuda, bf16_supported=bf16)
    strategy = resolve_strategy(cfg, cfg.num_processes)
    price, price_source = device_hour_price(accelerator_short, cfg.device_hour_usd or None)
    assumed = {}  # input -> what the plan took and why (also the plan run's llmeff.assumed)
    if alias:
        assumed["accelerator"] = alias
    if not here and cfg.precision == "auto":
        units = ("is a CPU" if not cuda else
                 f"datasheet {'lists' if bf16 else 'lists no'} bf16 matrix units")
        assumed["precision"] = (f"auto taken as {precision} ({accelerator_short} {units}, not probed: llmeff train "
                                "resolves auto on the machine itself)")
    if not cfg.device_hour_usd and price is not None:
        assumed["device_hour_usd"] = f"{price:g} USD per device-hour ({price_source}: pass device_hour_usd for yours)"
    plan = add_predictions(make_plan(cfg, accelerator_short=accelerator_short, precision=precision, strategy=strategy,
                                     accelerator_given=given, accelerator_alias=alias),
                           cfg, client=mlflow.MlflowClient(), accelerator_short=accelerator_short, strategy=strategy,
                           device_hour_usd=price)
    plan["device_hour_usd"] = price  # None (JSON null): no price, no predicted_usd
    plan["device_hour_usd_source"] = price_source
    plan["assumed"] = assumed
    if here:
        verdict = fit_here(cfg)
    else:
        gb = hw.MEMORY_GB.get(accelerator_short)
        verdict = fit.verdict(cfg, precision=precision, strategy=strategy,
                              available_bytes=gb * 2**30 if gb else None,
                              where=f"an {gb:g} GiB {accelerator_short}" if gb else f"a {accelerator_short}",
                              cpu=not cuda, bf16_ok=bf16)
    line = verdict.line(message_style())
    plan["memory_needed_gib"] = verdict.needed_bytes / 2**30
    if verdict.available_bytes is not None:
        plan["memory_available_gib"] = verdict.available_bytes / 2**30
        plan["fits"] = bool(verdict.fits)
    print(_json.dumps({**plan, "fit": line}, indent=1) if as_json else format_plan(plan) + "\n" + line)
    run_id = os.environ.get("MLFLOW_RUN_ID")
    if run_id:
        _log_plan(run_id, cfg, plan, line, accelerator_short, strategy, precision)
    return 0


def assumed_text(assumed: dict[str, str]) -> str:
    """``llmeff.assumed``'s value: ``<input>: <value> (<why>)`` joined by ``; ``."""
    return "; ".join(f"{k}: {v}" for k, v in assumed.items())


def _log_plan(run_id, cfg, plan, line, accelerator_short, strategy, precision) -> None:
    import mlflow

    from mlflow_llmeff import names
    from mlflow_llmeff.tracking.naming import parts_from_tags, study_name
    from mlflow_llmeff.train.config import global_batch_tokens

    client = mlflow.MlflowClient()
    client.set_tag(run_id, names.DRY_RUN, "true")
    tags = {names.MODEL_NAME: cfg.model, names.ACCEL_SHORT: accelerator_short,
            names.ACCEL_COUNT: str(cfg.num_processes * cfg.num_machines), names.PAR_STRATEGY: strategy,
            names.PRECISION: precision, names.SEQ_LEN: str(cfg.seq_len),
            names.GLOBAL_BATCH_TOKENS: str(global_batch_tokens(cfg))}
    # the stem llmeff train gives the configuration (tracking/naming.py), after "plan-"
    name = "plan-" + study_name(parts_from_tags(tags, cfg.eval_tasks))
    if plan.get("assumed"):  # what the plan took for the user: an alias, auto precision there, a list price
        tags[names.ASSUMED] = assumed_text(plan["assumed"])
    for k, v in {"mlflow.runName": name, **tags, names.PLAN_FIT: line}.items():
        client.set_tag(run_id, k, v)
    for k, v in plan.items():
        if isinstance(v, (int, float)):
            client.log_metric(run_id, f"plan/{k}", float(v))
