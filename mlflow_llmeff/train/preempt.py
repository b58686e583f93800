"""Preemption: a scheduler's warning signal (SLURM's ``--signal=USR1@N``) becomes a checkpoint, an attempt
that ends ``preempted``, and under SLURM a requeue of the job, which continues the same MLflow run.

Every process of the job may receive the signal (SLURM signals every process of a step with
``proctrack/linuxproc`` or cgroups, and the batch shell with ``B:``), at any point of a step, and the
ranks must all stop after the same step: the checkpoint is a collective. They agree through two files
in the checkpoint folder (shared by the machines, as the checkpoint is), without a collective per
step:

``llmeff_preempt_request``
    written by any process that got the signal (a launcher, a worker at its next step's end);
``llmeff_preempt_at``
    the step to stop after, ``s + 1`` for the step ``s`` the first rank to see a request had just
    completed (``s`` itself for a job of one process), created once (``O_EXCL``; the first writer wins and every rank reads its step). A rank
    completes step ``s + 1`` only after that rank took part in its collectives, which it did after
    writing the file, so every rank reads the file at the latest at the end of ``s + 1`` and stops
    there. A rank that reached it already (a later request) stops at once.

Each rank checks at the end of every step (two ``stat`` calls, microseconds). Rank 0 removes both
files when an attempt begins (:func:`watch`). At the agreed step the loop writes a checkpoint (unless
one was just written), then :func:`end_preempted` ends the run KILLED with why, records the attempt's end ``preempted`` (no failure:
``calc/reliability.py``), and ``llmeff train`` exits :data:`EXIT_PREEMPTED` after asking SLURM to
requeue the job (:func:`requeue`): the requeued job resumes the checkpoint in the same run, and the
time it waited in the queue is down time (``summary/badput_down_s``).
"""

from __future__ import annotations

import _thread
import json
import os
import signal
import socket
import subprocess
import threading
import time

from mlflow_llmeff import names

REQUEST_FILE = "llmeff_preempt_request"
STOP_FILE = "llmeff_preempt_at"
#: ``llmeff train``'s exit status after a preempted attempt: EX_TEMPFAIL of sysexits.h (temporary
#: failure; run the same command again to resume). A PyTorchJob's ``restartPolicy: OnFailure`` restarts it.
EXIT_PREEMPTED = 75
SIGNALS = ("SIGUSR1",)  # the scheduler's warning signal (SLURM --signal=USR1@<seconds>)
#: The stop request: what ``scancel``, a Kubernetes pod's stop and a spot node's drain send (SLURM's KillWait and
#: Kubernetes' terminationGracePeriodSeconds, 30 s by default, pass before their SIGKILL). With a checkpoint
#: folder a worker that gets it stops as at the warning signal (a checkpoint at the agreed step, the attempt
#: ``preempted``), but the job is not requeued and ``llmeff train`` exits 143 (128 + SIGTERM), as killed by it.
STOP_SIGNALS = ("SIGTERM",)
#: Seconds after a SIGTERM within which a rank must have reached the agreed stop; past them (a long eval, a
#: step that does not end) it ends as it would without a checkpoint folder, KILLED by the signal
#: (``SystemExit(143)``, monitor/lifecycle.py), before the launcher's SIGKILL
#: (train/launch.py ``STOP_GRACE_S``, 20 s) would leave its run RUNNING.
STOP_DEADLINE_S = 10.0


class Preempted(Exception):
    """The attempt stopped at ``step`` because the scheduler asked (``detail`` says how)."""

    def __init__(self, step: int, detail: str) -> None:
        super().__init__(f"preempted after step {step} ({detail})")
        self.step, self.detail = step, detail


def request(checkpoint_dir: str, signame: str = "SIGUSR1") -> None:
    """Record that the job was asked to stop (never raises: called from a signal handler)."""
    try:
        fd = os.open(os.path.join(checkpoint_dir, REQUEST_FILE), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.write(fd, f"{time.time():.6f} {signame} {socket.gethostname()} {os.getpid()}\n".encode())
        finally:
            os.close(fd)
    except OSError:
        pass


def stop_step(checkpoint_dir: str) -> dict | None:
    """The agreed stop (``{"step", "unix", "signal"}``) of this attempt, or None."""
    try:
        with open(os.path.join(checkpoint_dir, STOP_FILE), encoding="utf-8") as f:
            return json.loads(f.read())
    except (OSError, ValueError):
        return None


class Preemption:
    """One rank's side of the agreement (see the module docstring).

    Args:
        checkpoint_dir: the job's checkpoint folder (shared by the machines).
        main: rank 0 (clears the files of an earlier attempt).
        world: processes of the job; one process stops after the step it sees the request at (no one
            to agree with), several after the next.
    """

    def __init__(self, checkpoint_dir: str, main: bool, world: int = 1, deadline_s: float = STOP_DEADLINE_S) -> None:
        self.dir, self.main, self.world = checkpoint_dir, main, int(world)
        self.signalled: str | None = None
        self.stopping = False  # the agreed stop reached: its checkpoint and the run's end are under way
        self.deadline_s = float(deadline_s)
        self._expired = False
        self._timer = None
        self._previous = None

    def begin(self) -> None:
        """Rank 0, as the attempt begins: the earlier attempt's request and stop no longer hold."""
        if self.main:
            for name in (REQUEST_FILE, STOP_FILE):
                try:
                    os.remove(os.path.join(self.dir, name))
                except OSError:
                    pass

    def install(self) -> None:
        """Catch the warning signal (:data:`SIGNALS`) and the stop request (:data:`STOP_SIGNALS`) in this (main)
        thread: each only sets a flag, read at the next step's end. A stop request also starts a
        :attr:`deadline_s` timer: a rank that has not reached the agreed stop by then ends as SIGTERM ends it
        without a checkpoint folder (:func:`mlflow_llmeff.monitor.lifecycle.sigterm_to_exit`)."""
        def handler(signum, frame):
            name = signal.Signals(signum).name
            if name in STOP_SIGNALS and self._expired:  # the deadline passed before the stop was reached
                from mlflow_llmeff.monitor import lifecycle

                lifecycle.sigterm_to_exit(signum, frame)
            if name in STOP_SIGNALS and self._timer is None and not self.stopping:
                self._timer = threading.Timer(self.deadline_s, self._expire, args=(signum,))
                self._timer.daemon = True
                self._timer.start()
            if self.signalled is None or name in STOP_SIGNALS:  # a stop request outranks a warning
                self.signalled = name

        try:
            self._previous = {s: signal.signal(getattr(signal, s), handler) for s in SIGNALS + STOP_SIGNALS}
        except ValueError:  # not the main thread: the launcher's request file still reaches this rank
            self._previous = None

    def _expire(self, signum: int) -> None:
        """The stop request's deadline: unless the stop was reached, the signal again, now ending the process."""
        if not self.stopping:
            self._expired = True
            _thread.interrupt_main(signum)

    def uninstall(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        for s, h in (self._previous or {}).items():
            try:
                signal.signal(getattr(signal, s), h)
            except (ValueError, TypeError):
                pass
        self._previous = None

    def due(self, step: int) -> dict | None:
        """At the end of ``step``: the agreed stop once this rank should stop now (``{"step", "signal", ...}``),
        else None. The first rank to see a request fixes the stop at ``step + 1`` (one process: ``step``)."""
        stop = stop_step(self.dir)
        if stop is None:
            if self.signalled:
                request(self.dir, self.signalled)
            if not (self.signalled or os.path.exists(os.path.join(self.dir, REQUEST_FILE))):
                return None
            stop = self._agree(step + (1 if self.world > 1 else 0))
        due = stop if stop is not None and step >= int(stop["step"]) else None
        if due is not None:
            self.stopping = True  # from here the checkpoint and the run's end: no deadline cuts them
        return due

    def _agree(self, step: int) -> dict | None:
        path = os.path.join(self.dir, STOP_FILE)
        rec = {"step": step, "unix": time.time(), "signal": self.signalled or _requested_signal(self.dir),
               "host": socket.gethostname(), "pid": os.getpid()}
        try:
            fd = os.open(path + f".{os.getpid()}.tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(rec))
            try:
                os.link(path + f".{os.getpid()}.tmp", path)  # atomic and exclusive: the first rank's step wins
            except FileExistsError:
                pass
            finally:
                os.remove(path + f".{os.getpid()}.tmp")
        except OSError:
            return None
        return stop_step(self.dir)


def _requested_signal(checkpoint_dir: str) -> str:
    try:
        with open(os.path.join(checkpoint_dir, REQUEST_FILE), encoding="utf-8") as f:
            first = f.readline().split()
        return first[1] if len(first) > 1 else "signal"
    except OSError:
        return "signal"


def forward_to_file(checkpoint_dir: str):
    """Make this process (``llmeff train``'s launcher, or torch elastic's agent) record the warning signal
    in ``checkpoint_dir`` instead of dying of it (SIGUSR1's default action ends a process); returns the
    previous handlers for :func:`restore`."""
    def handler(signum, frame):  # noqa: ARG001
        if checkpoint_dir:
            request(checkpoint_dir, signal.Signals(signum).name)

    previous = {}
    for s in SIGNALS:
        try:
            previous[s] = signal.signal(getattr(signal, s), handler)
        except ValueError:
            pass
    return previous


def restore(previous: dict) -> None:
    for s, h in previous.items():
        try:
            signal.signal(getattr(signal, s), h)
        except (ValueError, TypeError):
            pass


def requeue(env: dict | None = None, run=None) -> str:
    """Ask SLURM to requeue this job (``scontrol requeue $SLURM_JOB_ID``); returns the line to print.

    Outside SLURM nothing is asked: the line says to run the same command again. A refusal
    (a job submitted with ``--no-requeue``, ``JobRequeue=0``) is named in the line, never raised.
    """
    env = os.environ if env is None else env
    job = env.get("SLURM_JOB_ID")
    if not job:
        return "run the same command again to resume from the checkpoint"
    run = run or subprocess.run
    try:
        r = run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        return f"scontrol requeue {job} failed ({type(e).__name__}: {e}); resubmit the job to resume"
    if r.returncode != 0:
        why = (r.stderr or r.stdout).strip().splitlines()
        return (f"scontrol requeue {job} refused ({why[-1] if why else f'exit {r.returncode}'}); submit with "
                "sbatch --requeue, or resubmit the job, to resume")
    return f"SLURM job {job} requeued: it resumes from the checkpoint in the same MLflow run"


def watch(cfg, t, holder: dict) -> Preemption | None:
    """With a checkpoint folder (``cfg.checkpoint_dir``): catch the scheduler's warning signal on every rank
    of the training set-up ``t`` (train/setup.py); rank 0 clears an earlier attempt's request. Kept in
    ``holder["preemption"]``. None without a folder (nowhere to checkpoint to)."""
    if not cfg.checkpoint_dir:
        return None
    p = Preemption(cfg.checkpoint_dir, t.accelerator.is_main_process, t.world)
    p.begin()
    p.install()
    holder["preemption"] = p
    return p


def end_preempted(t, monitor, job, stop: dict, said: dict) -> dict | None:
    """End a preempted attempt after its checkpoint: the run KILLED with why, the attempt ``preempted`` in the
    job's ledger (``job``, after the summary, as a finished one), the terminal told, the set-up ``t`` torn
    down; ``stop``: the agreed stop (:meth:`Preemption.due`), ``said``: the job figures' holder. Returns
    the result with ``"preempted"`` (its step) and ``"signal"`` (the signal's name) on the main process,
    else None."""
    step = monitor.step_count
    sig = stop.get("signal") or "signal"
    if sig in STOP_SIGNALS:  # scancel, a pod's stop: not requeued (train/launch.py), run again to go on
        detail = f"{sig} (a stop request: scancel, a pod's stop), stopped after step {step}"
        then = "the job continues in this run when run again"
    else:
        detail = f"{sig} from the scheduler, stopped after step {step}"
        then = "the job continues in this run when requeued or run again"
    why = f"preempted: {detail}; checkpoint step {step} written, {then}"
    said["end"] = "preempted"
    monitor.set_tags({names.ERROR: why, "mlflow.note.content": f"Killed: {why}"})
    summary = monitor.finish("KILLED")
    if job is not None:
        job.end("preempted", step, detail)
    if t.accelerator.is_main_process:
        print(f"llmeff: {why}")
    from mlflow_llmeff.train.setup import teardown

    teardown(t)
    return {"run_id": monitor.run_id, "summary": summary, "preempted": step, "signal": sig} \
        if t.accelerator.is_main_process else None
