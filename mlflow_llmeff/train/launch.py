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

from mlflow_llmeff.planning.spec import Machine, RunSpec
from mlflow_llmeff.train.config import TrainConfig, validate
from mlflow_llmeff.train.messages import message_style


def settle(cfg: TrainConfig) -> RunSpec:
    """Check ``cfg`` and resolve it on this machine, once (:func:`~mlflow_llmeff.train.config.validate`),
    with the machines' layout a scheduler gives where ``cfg`` does not (:mod:`mlflow_llmeff.train.placement`):
    the :class:`~mlflow_llmeff.planning.spec.RunSpec` every later step of the launch reads. A dry run's
    strategy engine need not be installed and its machine's accelerator is looked up (the plan is for it).

    Raises:
        ValueError: bad settings, as one line naming the value and the accepted ones.
    """
    from mlflow_llmeff.train.config import probe_machine
    from mlflow_llmeff.train.placement import from_scheduler

    cfg = from_scheduler(cfg)  # under srun or a PyTorchJob: the machines' layout the scheduler gives
    return validate(cfg, probe_machine(cfg.num_processes if cfg.dry_run else None), engine=not cfg.dry_run)


def accelerate_command(spec: RunSpec) -> tuple[list[str], dict[str, str]]:
    """The ``accelerate launch`` command line and environment for ``num_processes`` processes on
    each of ``num_machines`` machines (Accelerate counts processes over all machines: ``spec.world``);
    the strategy adds its flags (``--multi_gpu``, ``--use_deepspeed --zero_stage N``) and environment.
    Every process reads the resolved spec from the command (``--resolved-json``)."""
    cfg, cuda = spec.options, spec.machine.cuda
    flags = spec.strategy.launcher_args(cuda=cuda)
    script = _loop_script(spec)
    if spec.world == 1 and "--multi_gpu" in flags:
        # one process that needs a process group (FSDP2 on one GPU): accelerate launch refuses
        # --multi_gpu below 2 processes; its multi-GPU launcher is torchrun, so run that directly
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1", *script]
    else:
        cmd = [sys.executable, "-m", "accelerate.commands.launch",
               "--num_processes", str(spec.world),
               "--num_machines", str(spec.nodes), "--dynamo_backend", "no", "--mixed_precision", "no"]
        if spec.nodes > 1:
            cmd += ["--machine_rank", str(cfg.machine_rank), "--main_process_ip", cfg.main_process_ip]
        cmd += ["--main_process_port", str(cfg.main_process_port)]  # the rendezvous port (default 29500)
        cmd += flags + script
    env = dict(os.environ)
    env.update(spec.strategy.launcher_env(cuda=cuda))
    return cmd, env


class FitError(ValueError):
    """The run would not fit the device's memory (the message says what would)."""


def fit_here(spec: RunSpec):
    """The memory verdict of the resolved run on this machine's devices
    (:func:`mlflow_llmeff.planning.fit.check`): its strategy, degrees and precision as resolved."""
    from mlflow_llmeff.planning import fit

    if spec.machine.cuda:
        import torch

        available = fit.cuda_free_bytes()
        total = torch.cuda.get_device_properties(0).total_memory / 2**30
        where = f"this {torch.cuda.get_device_name(0)} ({total:.0f} GiB, the free part counted)"
    else:
        available, where = fit.host_available_bytes(), "this CPU (host memory, shared by all processes)"
    return fit.check(spec, available_bytes=available, where=where)


def launch(run: TrainConfig | RunSpec, *, started_unix: float | None = None, own_process: bool = False) -> int:
    """Validate the settings and check that they fit (cheap, before heavy work), then train. Returns the exit code.

    Args:
        run: the settings, checked and resolved here (:func:`settle`), or a
            :class:`~mlflow_llmeff.planning.spec.RunSpec` the caller resolved (``llmeff train``,
            ``llmeff study``): then nothing is checked or resolved again.
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
        ValueError: bad settings, as one line naming the value and the accepted ones;
            :class:`~mlflow_llmeff.train.rendezvous.RendezvousError` when the machines do not meet.
        FitError: the run would not fit the device (unless ``force``), naming what would.
    """
    import logging

    for noisy in ("mlflow.store.db.utils", "alembic"):  # table-creation chatter of a new sqlite store
        logging.getLogger(noisy).setLevel(logging.WARNING)
    spec = run if isinstance(run, RunSpec) else settle(run)
    cfg = spec.options
    if cfg.dry_run:
        return dry_run(spec)
    verdict = fit_here(spec)
    if verdict.fits is False and not cfg.force:
        raise FitError(verdict.line(message_style()))
    if spec.in_this_process and own_process:
        return _train_in_own_process(spec, time.time() if started_unix is None else float(started_unix))
    if spec.in_this_process:
        from mlflow_llmeff.meters.probes import process_start_perf_counter
        from mlflow_llmeff.train.loop import run_training

        if started_unix is None:
            started_at = process_start_perf_counter()
        else:  # the same instant on the perf_counter clock the meter reads
            started_at = time.perf_counter() - max(0.0, time.time() - started_unix)
        result = run_training(spec, started_at=started_at)
        return _after_preemption(cfg, result.get("signal")) if result and result.get("preempted") is not None else 0
    from mlflow_llmeff.train import job as jobs

    met = None
    if cfg.num_machines > 1:  # every machine meets machine 0 in time, given the same job, or one line says why not
        from mlflow_llmeff.train.rendezvous import handshake

        met = handshake(spec)
        via = f" through {met.interface} ({met.address})" if met.interface else ""
        print(f"llmeff: machine {cfg.machine_rank} of {cfg.num_machines} met the others at "
              f"{cfg.main_process_ip}:{cfg.main_process_port}{via} with the same settings", file=sys.stderr)
    cmd, env = accelerate_command(spec)
    if met is not None:
        env.update(interface_env(met, env))
    env["LLMEFF_NUM_MACHINES"] = str(spec.nodes)  # for the nodes tag, whatever the launcher sets
    # the job's clock starts at this command (or at the start the caller gave)
    env[jobs.START_ENV] = repr(jobs.attempt_start_unix() if started_unix is None else float(started_unix))
    if cfg.num_machines > 1 and cfg.machine_rank > 0:
        import tempfile

        fd, env[JOB_RUN_ENV] = tempfile.mkstemp(prefix="llmeff-job-run-")
        os.close(fd)
    if met is not None and met.address:
        env[HOST_ADDRESS_ENV] = met.address  # llmeff.hosts tells apart machines that share a host name
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
        rc = run_tree([cmd[0], "-m", "mlflow_llmeff.train.elastic", failures_path, *cmd[2:]], env=env)
    finally:
        preempt.restore(caught)
    if job:  # how the attempt ended where rank 0 could not say (killed, or stopped after another rank was lost)
        jobs.Job(cfg.checkpoint_dir).close_open(rc, elastic.read_failures(failures_path))
    if cfg.num_machines > 1 and cfg.machine_rank > 0:  # machine 0 prints the run's report; the others say this
        print(f"llmeff: {machine_end_line(cfg, rc, _read_job_run(env.get(JOB_RUN_ENV)))}", file=sys.stderr, flush=True)
    if cfg.checkpoint_dir and _last_end(cfg.checkpoint_dir) == "preempted":
        stop = preempt.stop_step(cfg.checkpoint_dir) or {}
        if rc == 0 or stop.get("signal") in preempt.STOP_SIGNALS:  # (the agent dies of a SIGTERM it got too)
            return _after_preemption(cfg, stop.get("signal"))
    return rc


#: The file a machine's launcher names to its first worker, which writes the job's run id there
#: (train/comm.py, once rank 0 made the run): machines 1.. say which run they were part of.
JOB_RUN_ENV = "LLMEFF_JOB_RUN_FILE"
#: This machine's address toward the others (the handshake's), for the workers' ``llmeff.hosts`` entry.
HOST_ADDRESS_ENV = "LLMEFF_HOST_ADDRESS"


def interface_env(met, env: dict[str, str]) -> dict[str, str]:
    """``GLOO_SOCKET_IFNAME`` and ``NCCL_SOCKET_IFNAME`` set to the interface the handshake crossed
    (:class:`~mlflow_llmeff.train.rendezvous.Met`), each unless ``env`` (the user's) sets it already.

    Without them gloo binds the address this machine's host name resolves to: loopback where the name
    does not resolve to the machine's address (containers, network namespaces), and the job's first
    collective fails (machine 0 after 14 s with ~90 lines of traceback, machine 1 hanging). NCCL picks
    its own interface by prefix (``ib``, then not ``docker``/``lo``), which may not route to the others.
    Returns the variables to add (none when the interface is unknown)."""
    if not met.interface:
        return {}
    return {k: met.interface for k in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME") if not env.get(k)}


def machine_end_line(cfg: TrainConfig, rc: int, run_id: str | None) -> str:
    """The line machines 1.. print at their end (machine 0 prints the run's report): how this machine's
    part of the job ended and the job's run, e.g. ``machine 1 of 2 (host-b): its part of the job
    finished (exit 0); the job's run is 3f2a... (logged by machine 0 at 10.0.0.1)``."""
    import socket

    from mlflow_llmeff.train import preempt

    how = ("finished" if rc == 0 else "was preempted (checkpointed; rerun the same command to resume)"
           if rc == preempt.EXIT_PREEMPTED else "failed")
    run = (f"the job's run is {run_id} (logged by machine 0 at {cfg.main_process_ip})" if run_id else
           f"the job's run was not reported to this machine (machine 0 at {cfg.main_process_ip} logs it)")
    return (f"machine {cfg.machine_rank} of {cfg.num_machines} ({socket.gethostname()}): its part of the job "
            f"{how} (exit {rc}); {run}")


def _read_job_run(path: str | None) -> str | None:
    if not path:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().strip() or None
    except OSError:
        return None
    finally:
        try:
            os.remove(path)
        except OSError:
            pass


#: Seconds the launcher's process tree has, after a SIGTERM or SIGINT reached the launcher, to end on its own
#: (the workers end their runs KILLED with their points flushed; torch elastic stops its workers) before
#: the launcher kills what is left of it.
STOP_GRACE_S = 20.0


def run_tree(cmd: list[str], env: dict[str, str], grace_s: float = STOP_GRACE_S, **popen) -> int:
    """Run ``cmd`` as the head of a process group of its own and return its exit status; a SIGTERM or
    SIGINT this process receives (``scancel``, a Kubernetes pod's stop, Ctrl-C) goes to the whole group
    (the elastic agent and every worker, as SLURM signals every process of a step), and whatever of the
    group is still alive ``grace_s`` seconds later is killed (SIGKILL), so no launcher or worker outlives
    ``llmeff train``. Without a signal it is ``subprocess.run``. ``popen``: more ``subprocess.Popen``
    arguments (``stderr=PIPE`` for a caller that reads it through :func:`read_tree`)."""
    proc = subprocess.Popen(cmd, env=env, start_new_session=True, **popen)
    return read_tree(proc, grace_s)


def read_tree(proc: subprocess.Popen, grace_s: float = STOP_GRACE_S, on_line=None) -> int:
    """Wait for ``proc`` (the head of its own process group, :func:`run_tree`), forwarding SIGTERM and SIGINT
    to its group and killing the group ``grace_s`` seconds after one came; ``on_line`` takes each line of
    its piped stderr meanwhile. Returns its exit status."""
    import signal
    import threading

    stopping: dict[str, float] = {}

    def forward(signum, frame):  # noqa: ARG001
        stopping.setdefault("at", time.monotonic())
        try:
            os.killpg(proc.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass

    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous[sig] = signal.signal(sig, forward)
    reader = None
    if on_line is not None and proc.stderr is not None:
        reader = threading.Thread(target=lambda: [on_line(line) for line in proc.stderr], daemon=True)
        reader.start()
    try:
        while True:
            try:
                rc = proc.wait(timeout=0.5)
                break
            except subprocess.TimeoutExpired:
                if "at" in stopping and time.monotonic() - stopping["at"] > grace_s:
                    try:
                        os.killpg(proc.pid, signal.SIGKILL)
                    except (ProcessLookupError, PermissionError):
                        pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if "at" in stopping:  # the rest of the group (workers the agent left) goes with it
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    if reader is not None:
        reader.join(timeout=5)
    return rc


def _last_end(checkpoint_dir: str) -> str | None:
    """How the job's newest attempt ended (its ledger's last ``end``), or None."""
    from mlflow_llmeff.train import job as jobs

    ends = [e for e in jobs.Job(checkpoint_dir).events() if e.get("event") == "end"]
    return ends[-1].get("kind") if ends else None


def _after_preemption(cfg: TrainConfig, signame: str | None = None) -> int:
    """A preempted attempt ended (its checkpoint written): machine 0 asks SLURM to requeue the job;
    returns :data:`~mlflow_llmeff.train.preempt.EXIT_PREEMPTED`. After a stop request (``signame`` in
    :data:`~mlflow_llmeff.train.preempt.STOP_SIGNALS`: ``scancel``, a pod's stop) nothing is requeued and
    the status is 143 (128 + SIGTERM), as a process killed by it (the line before said to run it again)."""
    from mlflow_llmeff.train import preempt

    if signame in preempt.STOP_SIGNALS:
        import signal

        return 128 + int(getattr(signal, signame))
    if cfg.machine_rank == 0:
        print(f"llmeff: {preempt.requeue()}", file=sys.stderr, flush=True)
    return preempt.EXIT_PREEMPTED


def _loop_script(spec: RunSpec) -> list[str]:
    """``-m mlflow_llmeff.train.loop --config-json <options> --resolved-json <resolved>``: the per-process
    entry every launcher runs, handed the settings and what this launch resolved of them
    (:meth:`~mlflow_llmeff.planning.spec.RunSpec.resolved`), so no process resolves or validates again."""
    return ["-m", "mlflow_llmeff.train.loop", "--config-json", json.dumps(dataclasses.asdict(spec.options)),
            "--resolved-json", json.dumps(spec.resolved())]


def own_process_command(spec: RunSpec, started_unix: float) -> tuple[list[str], dict[str, str]]:
    """The command and environment that train ``spec`` on one device in a process of its own: the
    per-process entry ``accelerate launch`` runs, with the attempt's start in ``$LLMEFF_ATTEMPT_START_UNIX``
    (its ``summary/wall_s`` and ``init`` begin there, the interpreter's start and imports inside them)."""
    from mlflow_llmeff.train import job as jobs

    env = dict(os.environ)
    env[jobs.START_ENV] = repr(float(started_unix))
    return [sys.executable, *_loop_script(spec)], env


def _train_in_own_process(spec: RunSpec, started_unix: float) -> int:
    """Run :func:`own_process_command`; its stderr passes through line by line, and a last ``error: <line>``
    it printed (a refused setting, a known ending) is raised here as that line.

    Raises:
        ValueError: the child's one-line error (exit code 2: bad settings; others: the line as printed).
    """
    cmd, env = own_process_command(spec, started_unix)
    said: list[str] = []

    def on_line(line: str) -> None:
        sys.stderr.write(line)
        if line.startswith("error: "):
            said.append(line[len("error: "):].rstrip("\n"))

    with subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True, bufsize=1, start_new_session=True) as proc:
        rc = read_tree(proc, on_line=on_line)
    last = said[-1] if said else None
    if rc != 0 and last:
        raise ChildError(last, rc)
    return rc


class ChildError(ValueError):
    """A training process of its own ended with ``error: <line>`` (:func:`_train_in_own_process`);
    ``code`` is its exit status."""

    def __init__(self, line: str, code: int) -> None:
        super().__init__(line)
        self.code = code


def planned_machine(accelerator_short: str) -> tuple[Machine, str | None]:
    """The :class:`~mlflow_llmeff.planning.spec.Machine` of a named accelerator, from its datasheet
    (``H100`` taken as ``H100-SXM``: the note of the alias is returned beside it, else None): CUDA
    unless it is ``cpu``; bf16 where its datasheet row lists bf16 matrix units."""
    from mlflow_llmeff.meters import hardware as hw
    from mlflow_llmeff.meters.accelerator_names import resolve_short

    short, alias = resolve_short(accelerator_short)  # H100 -> H100-SXM, with a note
    cuda = short.lower() != "cpu"
    row = next((r for r in hw.PEAK_TABLE if r.short == short), None)
    bf16 = not cuda or (row is not None and "bf16" in row.tflops)  # its datasheet's matrix units
    return Machine(cuda=cuda, bf16=bf16, accelerator=short), alias


def dry_run(run: TrainConfig | RunSpec, *, accelerator_short: str | None = None, as_json: bool = False) -> int:
    """Print the plan (no training, no weights): parameters, FLOPs, memory, fit, predictions.

    Works on a CPU machine for any preset (the model is built on the meta device). ``run``: the
    settings (checked and resolved here, once, for this machine or for ``accelerator_short``), or
    the spec :func:`settle` resolved for this machine. Planning for an accelerator other than this
    machine's (``accelerator_short``, e.g. ``H100-SXM``) resolves
    ``precision=auto`` as bf16 where its datasheet row lists bf16 matrix units (else fp32) and checks
    the fit against its datasheet memory. What the plan takes for the user (an alias such as
    ``H100`` for ``H100-SXM``, that precision, a price from the dated default table) is its field
    ``assumed`` (``<input>: <what was taken and why>``), beside ``device_hour_usd`` and its
    ``device_hour_usd_source``. Under ``mlflow run`` the plan is logged to the run as ``plan/*``
    metrics and the tags ``llmeff.dry_run=true``, ``llmeff.plan.fit`` and ``llmeff.assumed``
    (:func:`log_plan`).

    Raises:
        ValueError: bad settings, or an accelerator the tables do not know (one line).
    """
    import json as _json

    from mlflow_llmeff.calc.cost import device_hour_price
    from mlflow_llmeff.meters import hardware as hw
    from mlflow_llmeff.planning import fit
    from mlflow_llmeff.planning.plan import format_plan, plan_run
    from mlflow_llmeff.planning.predict import add_predictions
    from mlflow_llmeff.tracking import store

    given, alias = accelerator_short, None
    if isinstance(run, RunSpec):
        spec = run
        if spec.machine.accelerator is None:  # resolved for training: the plan is for this machine's devices
            import dataclasses as dc

            spec = dc.replace(spec, machine=dc.replace(
                spec.machine, accelerator=hw.detect_accelerator(count=spec.processes_per_node).short))
    elif given is None:
        from mlflow_llmeff.train.config import probe_machine

        spec = validate(run, probe_machine(run.num_processes), engine=False)  # the plan is arithmetic
    else:
        machine, alias = planned_machine(given)
        if alias:
            print(f"llmeff: accelerator {alias}", file=sys.stderr)  # stdout stays the plan (--json parses)
        spec = validate(run, machine, engine=False)
    here = given is None
    cfg, accelerator_short = spec.options, spec.machine.accelerator
    price, price_source = device_hour_price(accelerator_short, cfg.device_hour_usd or None)
    assumed = {}  # input -> what the plan took and why (also the plan run's llmeff.assumed)
    if alias:
        assumed["accelerator"] = alias
    if not here and cfg.precision == "auto":
        units = ("is a CPU" if not spec.machine.cuda else
                 f"datasheet {'lists' if spec.machine.bf16 else 'lists no'} bf16 matrix units")
        assumed["precision"] = (f"auto taken as {spec.precision} ({accelerator_short} {units}, not probed: llmeff train "
                                "resolves auto on the machine itself)")
    if not cfg.device_hour_usd and price is not None:
        assumed["device_hour_usd"] = f"{price:g} USD per device-hour ({price_source}: pass device_hour_usd for yours)"
    plan = add_predictions(plan_run(spec, accelerator_given=given, accelerator_alias=alias), cfg,
                           client=store.reader(), accelerator_short=accelerator_short, strategy=spec.strategy_name,
                           device_hour_usd=price)
    plan["device_hour_usd"] = price  # None (JSON null): no price, no predicted_usd
    plan["device_hour_usd_source"] = price_source
    plan["assumed"] = assumed
    if here:
        verdict = fit_here(spec)
    else:
        gb = hw.MEMORY_GB.get(accelerator_short)
        verdict = fit.check(spec, available_bytes=gb * 2**30 if gb else None,
                            where=f"{_a(f'{gb:g}')} {gb:g} GiB {accelerator_short}" if gb
                            else f"{_a(accelerator_short)} {accelerator_short}")
    line = verdict.line(message_style())
    plan["memory_needed_gib"] = verdict.needed_bytes / 2**30
    if verdict.available_bytes is not None:
        plan["memory_available_gib"] = verdict.available_bytes / 2**30
        plan["fits"] = bool(verdict.fits)
    print(_json.dumps({**plan, "fit": line}, indent=1) if as_json else format_plan(plan) + "\n" + line)
    run_id = os.environ.get("MLFLOW_RUN_ID")
    if run_id:
        log_plan(run_id, plan_tags(spec), plan, line, eval_tasks=cfg.eval_tasks)
    return 0


def log_plan(run_id: str, tags: dict[str, str], plan: dict, fit_line: str, *, eval_tasks: str = "", client=None) -> None:
    """Write ``plan`` onto run ``run_id`` through the one door (:class:`~mlflow_llmeff.tracking.writer.RunWriter`:
    key checks, masking, one batch, at most the delivery wait ``LLMEFF_DELIVERY_WAIT_S``, else the outbox;
    never raises): ``llmeff.dry_run=true``, the condition ``tags``, the name ``plan-<stem>`` (the stem
    ``llmeff train`` gives the configuration, :mod:`mlflow_llmeff.tracking.naming`), ``llmeff.assumed`` when
    the plan took something for the user (an alias, auto precision there, a list price: ``<input>: <value>
    (<why>)`` joined by ``; ``), ``llmeff.plan.fit`` (``fit_line``) and every number of the plan as ``plan/<field>``.

    Args:
        run_id: the launcher's run.
        tags: the plan's condition tags (model, accelerator, count, strategy, precision, sequence
            length, global batch).
        plan: :func:`mlflow_llmeff.planning.plan.make_plan`'s dict with predictions and ``assumed``.
        fit_line: the fit verdict's line.
        eval_tasks: the run's eval tasks (a part of the name).
        client: an ``MlflowClient`` (default: one for the current tracking URI).
    """
    from mlflow_llmeff import names
    from mlflow_llmeff.tracking.naming import parts_from_tags, study_name
    from mlflow_llmeff.tracking.writer import RunWriter

    tags = dict(tags)
    name = "plan-" + study_name(parts_from_tags(tags, eval_tasks))
    if plan.get("assumed"):
        tags[names.ASSUMED] = "; ".join(f"{k}: {v}" for k, v in plan["assumed"].items())
    writer = RunWriter.attach(run_id, client=client)
    writer.set_tags({names.DRY_RUN: "true", "mlflow.runName": name, **tags, names.PLAN_FIT: fit_line}, synchronous=False)
    writer.log_metrics({f"plan/{k}": float(v) for k, v in plan.items() if isinstance(v, (int, float))}, step=0)
    writer.end(None)


def _a(word: str) -> str:
    """``a`` or ``an`` before ``word`` as it is read aloud: a number (``an 80``, ``a 40``, ``an 11``) or an
    accelerator's name spelled letter by letter (``an A100``, ``an H200``, ``a B200``, ``a GB200``)."""
    digits = word[:len(word) - len(word.lstrip("0123456789"))]
    if digits:
        return "an" if digits.startswith("8") or digits in ("11", "18") else "a"
    return "an" if word[:1].upper() in "AEFHILMNORSX" and word[:1] else "a"


def plan_tags(spec: RunSpec) -> dict[str, str]:
    """The condition tags of a dry run's plan run: the model, the accelerator planned for and its count
    (every machine's devices), the sequence length and what was resolved (:meth:`RunSpec.tags`)."""
    from mlflow_llmeff import names

    return {names.MODEL_NAME: spec.options.model, names.ACCEL_SHORT: spec.machine.accelerator,
            names.ACCEL_COUNT: str(spec.world), names.SEQ_LEN: str(spec.options.seq_len), **spec.tags()}


def threads_per_process(counts, given: int = 0) -> tuple[int, str]:
    """Torch intra-op threads (``OMP_NUM_THREADS``) for every process of runs launched with process counts
    ``counts`` that are to be compared: ``given`` when > 0, else ``OMP_NUM_THREADS`` when set, else the
    CPUs this process may use (affinity, cgroup quota: :func:`~mlflow_llmeff.evals.threads.usable_cpus`)
    divided by the largest count (at least 1), so the largest run does not oversubscribe them. Accelerate's
    launcher gives each of several processes 1 thread unless set and a single process keeps all: compare
    refuses the scaling of runs whose ``llmeff.threads`` differ, as a trial found twice.

    Returns:
        ``(threads, why)``, ``why`` e.g. ``"affinity 2 of 2 over 2 processes"``.

    Raises:
        ValueError: ``OMP_NUM_THREADS`` set to something that is not a count >= 1 (one line naming it).
    """
    if given > 0:
        return given, "given"
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    if env:
        if env.isdigit() and int(env) > 0:
            return int(env), "OMP_NUM_THREADS"
        raise ValueError(f"OMP_NUM_THREADS={env!r} is not accepted; give a thread count >= 1")
    from mlflow_llmeff.evals.threads import usable_cpus

    usable, where = usable_cpus()
    return max(1, usable // max(counts)), f"{where} over {max(counts)} processes"
