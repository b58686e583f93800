"""The job across its attempts: which MLflow run it is, how each attempt ended, a per-step heartbeat.

A *job* is one MLflow run; every process start that continues it is an *attempt*
(``docs/time.md``, "Reliability across a job's life"). Rank 0 keeps three
files in the checkpoint directory (and the launcher a fourth):

``llmeff_job.json``
    the run id, its experiment and tracking URI, and the job's start (Unix seconds), written as
    soon as the run exists, so a restart before the first checkpoint continues the same run
    (temp file + rename).
``llmeff_attempts.jsonl``
    the attempts ledger, one JSON event a line, appended and fsynced (a handful per attempt):
    ``start`` (attempt, pid, start time, step resumed from, devices), ``warm`` (set-up, checkpoint load and
    re-warm-up seconds, once the warm-up is over), ``checkpoint`` (step, time written), ``end``
    (how it ended: ``finished``, ``preempted`` or a cause of :data:`mlflow_llmeff.calc.reliability.CAUSES`, the
    step reached, the time). An attempt with no ``end`` (SIGKILL, a lost machine) gets one from the
    next attempt: ``unknown``, at its last heartbeat.
``llmeff_launch_failures.json``
    written by the launcher's wrapper (:mod:`mlflow_llmeff.train.elastic`) when torch elastic saw
    workers fail: each failed rank, its exit code or signal, when; the launcher then records
    the attempt's end from it (:func:`launch_ending`).
``llmeff_progress``
    the heartbeat: the attempt, its last completed step and the time, one fixed-length record with
    a CRC32 rewritten in place at every step (one ``pwrite``: 2-5 us a step on the development
    machine, against about 0.8 ms for a temp file and a rename, so it runs every step). A
    process killed between steps leaves the previous record whole; a record whose CRC does not
    match (a torn write after a power loss) is ignored.

The launcher (``llmeff train`` with several processes) passes its own start to the workers in
``$LLMEFF_ATTEMPT_START_UNIX``, so the attempt (and the job's clock) starts at the user's command.
"""

from __future__ import annotations

import json
import os
import time
import zlib

from mlflow_llmeff.calc import reliability as rel
from mlflow_llmeff.meters import probes

JOB_FILE = "llmeff_job.json"
LEDGER_FILE = "llmeff_attempts.jsonl"
PROGRESS_FILE = "llmeff_progress"
START_ENV = "LLMEFF_ATTEMPT_START_UNIX"
LAUNCH_FILE = "llmeff_launch_failures.json"  # torch elastic's failed workers of the last launch (train/elastic.py)
_RECORD = 96  # bytes of a heartbeat record


def attempt_start_unix() -> float:
    """The attempt's start: the launcher's start when it passed one (``$LLMEFF_ATTEMPT_START_UNIX``,
    earlier than this process), else this process's start."""
    own = probes.process_start_unix()
    try:
        given = float(os.environ.get(START_ENV, ""))
    except ValueError:
        return own
    return min(own, given) if given > 0 else own


def attempt_start_perf() -> float:
    """``time.perf_counter()`` of this attempt's start: the launcher's (``llmeff train`` passes its
    start in ``$LLMEFF_ATTEMPT_START_UNIX``), else this process's."""
    own = probes.process_start_perf_counter()
    try:
        given = float(os.environ.get(START_ENV, ""))
    except ValueError:
        return own
    return min(own, time.perf_counter() - max(0.0, time.time() - given))


# ------------------------------------------------------------------------------ heartbeat
class Heartbeat:
    """Rank 0's per-step heartbeat (:data:`PROGRESS_FILE`): ``beat(step)`` costs one ``pwrite``."""

    def __init__(self, path: str, attempt: int, clock=time.time) -> None:
        self.path, self.attempt, self._clock = path, attempt, clock
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)

    def beat(self, step: int, unix: float | None = None) -> None:
        """Record ``step`` as the last completed step, at ``unix`` (default: now)."""
        body = f"{self.attempt} {step} {self._clock() if unix is None else unix:.6f}"
        rec = f"{body} {zlib.crc32(body.encode()):08x}".ljust(_RECORD - 1) + "\n"
        try:
            os.pwrite(self._fd, rec.encode(), 0)
        except OSError:  # a full disk must not stop training
            pass

    def close(self) -> None:
        try:
            os.close(self._fd)
        except OSError:
            pass


def read_heartbeat(path: str) -> dict | None:
    """``{"attempt", "step", "unix"}`` of the heartbeat file, or None (absent, empty or torn)."""
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            parts = f.read(_RECORD).split()
        attempt, step, unix, crc = parts[:4]
        if f"{zlib.crc32(f'{attempt} {step} {unix}'.encode()):08x}" != crc:
            return None
        return {"attempt": int(attempt), "step": int(step), "unix": float(unix)}
    except (OSError, ValueError):
        return None


# ------------------------------------------------------------------------------ the job
class Job:
    """The job record in ``checkpoint_dir`` (rank 0 writes; see the module docstring)."""

    def __init__(self, checkpoint_dir: str, clock=time.time) -> None:
        self.dir, self._clock = checkpoint_dir, clock
        self.attempt = 0  # this attempt's number once begun
        self.heartbeat: Heartbeat | None = None
        self._warm: dict | None = None
        self._durations: list[float] = []
        self._step_started: float | None = None
        self._first_step_unix: float | None = None
        self.warmup_steps = 0
        self.load_s = 0.0
        self.start_unix = 0.0
        self._ended = False

    def _path(self, name: str) -> str:
        return os.path.join(self.dir, name)

    # ------------------------------------------------------------------ reading
    def record(self) -> dict | None:
        """``llmeff_job.json`` (run id, experiment, tracking URI, start), or None."""
        try:
            with open(self._path(JOB_FILE), encoding="utf-8") as f:
                return json.load(f)
        except (OSError, ValueError):
            return None

    def events(self) -> list[dict]:
        """The ledger's events, oldest first (a torn last line is skipped)."""
        out = []
        try:
            with open(self._path(LEDGER_FILE), encoding="utf-8") as f:
                for line in f:
                    try:
                        out.append(json.loads(line))
                    except ValueError:
                        continue
        except OSError:
            pass
        return out

    def _append(self, event: dict) -> None:
        os.makedirs(self.dir, exist_ok=True)
        with open(self._path(LEDGER_FILE), "a", encoding="utf-8") as f:
            f.write(json.dumps(event, sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def finished(self) -> bool:
        """True when the job's last attempt finished (a new command in this folder is then a new job
        unless it resumes a checkpoint)."""
        events = self.events()
        starts = [e for e in events if e.get("event") == "start"]
        if not starts:
            return False
        n = int(starts[-1]["attempt"])
        return any(e.get("event") == "end" and int(e.get("attempt", -1)) == n and e.get("kind") == rel.FINISHED
                   for e in events)

    # ------------------------------------------------------------------ writing
    def reset(self) -> None:
        """Start a new job (``resume=never``): the old record and ledger are kept with a ``.old`` suffix."""
        for name in (JOB_FILE, LEDGER_FILE, PROGRESS_FILE):
            if os.path.exists(self._path(name)):
                os.replace(self._path(name), self._path(name) + ".old")

    def begin(self, start_unix: float, start_step: int, warmup_steps: int, devices: int | None = None) -> str | None:
        """Start this attempt: close the previous one if it left no ``end`` (``unknown``, at its
        heartbeat), append ``start``, open the heartbeat. Returns the job's run id (None: a new job).

        ``start_unix`` earlier than the previous attempt's end (the launcher's start passed to an
        elastic restart's workers) becomes this process's start (:attr:`start_unix` holds the one used)."""
        events = self.events()
        starts = [e for e in events if e.get("event") == "start"]
        if starts:
            prev = int(starts[-1]["attempt"])
            if not any(e.get("event") == "end" and int(e.get("attempt", -1)) == prev for e in events):
                beat = read_heartbeat(self._path(PROGRESS_FILE))
                beat = beat if beat and beat["attempt"] == prev else None
                seen = [float(starts[-1]["start_unix"])] + [float(e["unix"]) for e in events
                                                          if int(e.get("attempt", -1)) == prev and "unix" in e]
                last = max(seen + ([beat["unix"]] if beat else []))
                step = beat["step"] if beat else max([int(starts[-1].get("start_step", 0))] + [
                    int(e["step"]) for e in events if e.get("event") == "checkpoint" and int(e["attempt"]) == prev])
                self._append({"event": "end", "attempt": prev, "kind": "unknown",
                              "detail": "no exit record (killed or lost)", "step": step, "unix": last,
                              "by": "next attempt" + (" (heartbeat)" if beat else " (no heartbeat)")})
            self.attempt = prev + 1
            prev_end = max(float(e["unix"]) for e in self.events()
                           if e.get("event") == "end" and int(e.get("attempt", -1)) == prev)
            if start_unix < prev_end:  # an elastic restart inside one launch: the launcher's start is older
                start_unix = max(prev_end, probes.process_start_unix())
        else:
            self.attempt = 1
        self.start_unix, self.warmup_steps = float(start_unix), int(warmup_steps)
        start = {"event": "start", "attempt": self.attempt, "pid": os.getpid(), "start_unix": self.start_unix,
                 "start_step": int(start_step), "now_unix": self._clock()}
        if devices is not None:  # its world size: an elastic restart may hold fewer (device-hours per attempt)
            start["devices"] = int(devices)
        self._append(start)
        self.heartbeat = Heartbeat(self._path(PROGRESS_FILE), self.attempt, self._clock)
        rec = self.record()
        return rec.get("run_id") if rec else None

    def record_run(self, run_id: str | None, experiment_id: str | None = None, tracking_uri: str | None = None) -> None:
        """Write ``llmeff_job.json`` for ``run_id`` (once per run id; temp file + rename)."""
        if not run_id:
            return
        rec = self.record() or {}
        if rec.get("run_id") == run_id:
            return
        first = [e for e in self.events() if e.get("event") == "start"]
        rec = {"run_id": run_id, "experiment_id": experiment_id, "tracking_uri": tracking_uri,
               "job_start_unix": float(first[0]["start_unix"]) if first else self.start_unix,
               "mlflow_run_id_env": os.environ.get("MLFLOW_RUN_ID")}
        tmp = self._path(JOB_FILE + ".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(rec, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self._path(JOB_FILE))

    def loaded(self, seconds: float) -> None:
        """The checkpoint load took ``seconds``."""
        self.load_s = float(seconds)

    def step_started(self) -> None:
        """The next optimizer step begins now (after the previous step's eval and checkpoint)."""
        self._step_started = self._clock()
        if self._first_step_unix is None:
            self._first_step_unix = self._step_started

    def step_done(self, step: int) -> None:
        """``step`` completed: the heartbeat, and the re-warm-up once enough steady steps ran."""
        now = self._clock()
        if self.heartbeat is not None:
            self.heartbeat.beat(step, now)
        if self._warm is not None or self._step_started is None:
            return
        self._durations.append(now - self._step_started)
        if len(self._durations) >= self.warmup_steps + max(1, self.warmup_steps):
            self._write_warm()

    def _write_warm(self) -> None:
        w = self.warmup_steps
        warm, steady = self._durations[:w], self._durations[w:]
        rewarm = max(0.0, sum(warm) - w * sum(steady) / len(steady)) if steady else sum(warm)
        setup = max(0.0, (self._first_step_unix or self.start_unix) - self.start_unix - self.load_s)
        self._warm = {"event": "warm", "attempt": self.attempt, "setup_s": setup, "load_s": self.load_s,
                      "rewarm_s": rewarm, "unix": self._clock()}
        self._append(self._warm)

    def settle(self) -> None:
        """Write this attempt's ``warm`` record now (set-up, load, re-warm-up) if it ran too few steps
        to have written it: the job's figures are computed before the attempt's ``end``."""
        if self._warm is None and self._durations:
            self._write_warm()

    def checkpoint(self, step: int) -> None:
        """A checkpoint of ``step`` is complete now."""
        self._append({"event": "checkpoint", "attempt": self.attempt, "step": int(step), "unix": self._clock()})

    def end(self, kind: str, step: int, detail: str = "") -> None:
        """This attempt ends: ``finished`` or a cause (:data:`~mlflow_llmeff.calc.reliability.CAUSES`). Once."""
        if self._ended or not self.attempt:
            return
        self._ended = True
        self.settle()
        if self.heartbeat is not None:
            self.heartbeat.beat(step)
            self.heartbeat.close()
        self._append({"event": "end", "attempt": self.attempt, "kind": kind, "detail": detail, "step": int(step),
                      "unix": self._clock(), "by": "itself"})

    def close_open(self, returncode: int, failures: list[dict] | tuple = ()) -> None:
        """The launcher, after its workers ended: how the attempt ended, from what it can know.

        ``failures`` are torch elastic's failed workers (:func:`mlflow_llmeff.train.elastic.failure_records`).
        An attempt that left no ``end`` (rank 0 killed or lost) ends at its heartbeat; one whose rank 0
        wrote its own end but did not finish (SIGTERM from the agent, a collective error) gets the
        launcher's end when the first failure was another rank's (``lost rank 1 (SIGKILL)``): the
        newest ``end`` of an attempt is the one read (:func:`launch_ending`). Never raises.
        """
        try:
            events = self.events()
            starts = [e for e in events if e.get("event") == "start"]
            if not starts:
                return
            n = int(starts[-1]["attempt"])
            own = [e for e in events if e.get("event") == "end" and int(e.get("attempt", -1)) == n]
            ending = launch_ending(returncode, list(failures), own[-1] if own else None)
            if ending is None:
                return
            kind, detail = ending
            if own:  # rank 0's own record: its step and its last sign of life stay
                step, unix = int(own[-1]["step"]), float(own[-1]["unix"])
                rank0 = f"{own[-1].get('kind')}{' (' + own[-1]['detail'] + ')' if own[-1].get('detail') else ''}"
            else:
                beat = read_heartbeat(self._path(PROGRESS_FILE))
                beat = beat if beat and beat["attempt"] == n else None
                step = beat["step"] if beat else int(starts[-1].get("start_step", 0))
                unix = beat["unix"] if beat else float(starts[-1]["start_unix"])
                rank0 = None
            event = {"event": "end", "attempt": n, "kind": kind, "detail": detail, "step": step, "unix": unix,
                     "by": "launcher" + (" (torch elastic)" if failures else "")}
            if rank0:
                event["rank0"] = rank0
            self._append(event)
        except (OSError, ValueError, KeyError):
            pass

    # ------------------------------------------------------------------ the ledger
    def attempts(self, *, now: float | None = None, step: int | None = None, end: str = rel.RUNNING) -> list[rel.Attempt]:
        """The attempts ledger as :class:`~mlflow_llmeff.calc.reliability.Attempt` rows, oldest first.

        The current attempt, if it has no ``end`` yet, ends ``end`` (default running) at ``now``
        (default: the clock) with ``step`` (default: its heartbeat's).
        """
        return attempts_from_events(self.events(), read_heartbeat(self._path(PROGRESS_FILE)),
                                    now=self._clock() if now is None else now, step=step, end=end)


def attempts_from_events(events: list[dict], beat: dict | None, *, now: float, step: int | None = None,
                         end: str = rel.RUNNING) -> list[rel.Attempt]:
    """Rebuild the attempts from the ledger's events (see :class:`Job`); an attempt without ``end``
    ends ``end`` at ``now`` (``step``, else its heartbeat's, else the step it started from)."""
    by: dict[int, dict] = {}
    for e in events:
        a = by.setdefault(int(e.get("attempt", 0)), {"checkpoints": []})
        kind = e.get("event")
        if kind == "checkpoint":
            a["checkpoints"].append((int(e["step"]), float(e["unix"])))
        elif kind in ("start", "warm", "end"):
            a[kind] = e
    out: list[rel.Attempt] = []
    newest: tuple[int, float] | None = None  # the newest checkpoint so far (step, time)
    for n in sorted(k for k in by if "start" in by[k]):
        a = by[n]
        start = float(a["start"]["start_unix"])
        if a["checkpoints"]:
            newest = max(([newest] if newest else []) + a["checkpoints"])
        warm = a.get("warm", {})
        e = a.get("end")
        if e is not None:
            kind, detail, reached, last = e["kind"], e.get("detail", ""), int(e["step"]), float(e["unix"])
        else:
            reached = step if step is not None else (beat["step"] if beat and beat["attempt"] == n
                                                     else int(a["start"].get("start_step", 0)))
            kind, detail, last = end, "", now
        own = bool(a["checkpoints"]) and newest is not None and newest in a["checkpoints"]
        out.append(rel.Attempt(start=start, last_alive=max(start, last), end=kind, detail=detail, steps=reached,
                               start_step=int(a["start"].get("start_step", 0)),
                               checkpoint_step=newest[0] if newest else None,
                               checkpoint_at=newest[1] if own else None,
                               checkpoints=tuple(s for s, _ in a["checkpoints"]),
                               setup_s=float(warm.get("setup_s", 0.0)), load_s=float(warm.get("load_s", 0.0)),
                               rewarm_s=float(warm.get("rewarm_s", 0.0)),
                               devices=int(a["start"]["devices"]) if a["start"].get("devices") else None))
    return out


def carry(attempts: list[rel.Attempt], resumed_step: int | None) -> dict:
    """What the meter of the current (last) attempt must add to its clock for the whole job.

    A checkpoint's meter state holds the attempts up to its write; the attempt that wrote it ran on
    until its last sign of life (lost progress, ``tail_end_unix``); every later attempt before this
    one ran without a checkpoint and is in no meter state at all (``earlier_s``: its set-up as
    ``init``, its load as ``checkpoint_load``, the rest as ``lost_progress``, all ``init`` when it
    never completed a step); the gaps between attempts are ``down_s``.

    Args:
        attempts: the job's attempts, oldest first, the current one last.
        resumed_step: the checkpoint step the current attempt resumed from (None: none).

    Returns:
        ``{"down_s", "earlier_s": {category: s}, "tail_end_unix": float | None, "attempts": int}``, and
        ``"earlier_device_s"`` (``earlier_s``'s device-seconds, each attempt at the devices it held) when
        every one of those attempts recorded its devices.
    """
    prev = attempts[:-1]
    down = sum(n.start - p.last_alive for p, n in zip(attempts, attempts[1:]))
    writer = None
    if resumed_step is not None:
        for i in range(len(prev) - 1, -1, -1):
            if resumed_step in prev[i].checkpoints:
                writer = i
                break
    earlier: dict[str, float] = {"init": 0.0, "checkpoint_load": 0.0, "lost_progress": 0.0}
    held: dict[str, float] = dict.fromkeys(earlier, 0.0)  # the same seconds x the devices of their attempt
    uncounted = prev[(writer + 1 if writer is not None else 0):]
    for a in uncounted:
        span = a.last_alive - a.start
        if a.steps <= a.start_step:
            parts = {"init": span}
        else:
            setup, load = min(a.setup_s, span), min(a.load_s, max(0.0, span - a.setup_s))
            parts = {"init": setup, "checkpoint_load": load, "lost_progress": max(0.0, span - setup - load)}
        for k, v in parts.items():
            earlier[k] += v
            held[k] += v * (a.devices or 0)
    out = {"down_s": down, "earlier_s": {k: v for k, v in earlier.items() if v},
           "tail_end_unix": prev[writer].last_alive if writer is not None else None, "attempts": len(attempts)}
    if uncounted and all(a.devices for a in uncounted):
        out["earlier_device_s"] = {k: held[k] for k in out["earlier_s"]}
    return out


def signal_of(exitcode: int) -> str | None:
    """The signal an exit status says killed the process: ``-9`` (Python's ``returncode``) or ``137``
    (a shell's 128 + 9) -> ``"SIGKILL"``; None for an ordinary exit code."""
    import signal

    number = -exitcode if exitcode < 0 else exitcode - 128 if 128 < exitcode < 128 + 65 else 0
    try:
        return signal.Signals(number).name if number else None
    except ValueError:
        return None


def launch_ending(returncode: int, failures: list[dict], own_end: dict | None) -> tuple[str, str] | None:
    """How a launch's attempt ended, as the launcher knows it: ``(kind, detail)``, or None to keep the
    attempt's own record.

    Args:
        returncode: the launcher's exit status (negative: killed by that signal; 128 + N: a shell's signal N).
        failures: torch elastic's failed workers, first seen first (``rank``, ``exitcode``, ``signal``,
            ``unix``; :func:`mlflow_llmeff.train.elastic.failure_records`).
        own_end: rank 0's own ``end`` record of the attempt, or None when it wrote none.

    The first failure is the cause (the agent stops the other workers after it: rank 0's SIGTERM or
    its collective error is a consequence). Among failures seen in the same second a rank killed by a
    signal goes first, then the lowest rank; rank 0 is not the cause when its own record says it lost
    a peer. A rank other than 0 gives ``lost_rank``, ``"lost rank 1 (SIGKILL)"`` (or ``(exit 3)``);
    rank 0 killed gives ``signal``. A finished attempt, or rank 0's own record of its own failure
    (NaN, OOM, ...), is kept. Without failures: a signal in ``returncode``, else its exit status.
    """
    if own_end is not None and own_end.get("kind") == "finished":
        return None
    candidates = [f for f in failures if not (int(f.get("rank", 0)) == 0 and own_end is not None
                                              and own_end.get("kind") == "lost_rank")]
    if candidates:
        first = min(candidates, key=lambda f: (int(f.get("unix", 0) or 0), signal_of(int(f.get("exitcode", 0))) is None,
                                               int(f.get("rank", 0))))
        rank, code = int(first.get("rank", 0)), int(first.get("exitcode", 0))
        how = first.get("signal") or signal_of(code) or f"exit {code}"
        if rank != 0:
            return "lost_rank", f"lost rank {rank} ({how})"
        if own_end is not None:  # rank 0 said how it ended itself
            return None
        return ("signal", how) if signal_of(code) else ("exit_code", f"rank 0 {how}")
    if own_end is not None:
        return None
    sig = signal_of(returncode)
    if sig:
        return "signal", sig if returncode < 0 else f"{sig} (exit {returncode})"
    if returncode:
        return "exit_code", f"launcher exit {returncode}, rank 0 left no exit record"
    return "unknown", "launcher exit 0 without the workers' exit record"


def classify(e: BaseException | None, signalled: str | None = None) -> tuple[str, str]:
    """How an attempt ended, from the exception that ended it: ``(kind, detail)``.

    ``finished`` for none (or ``SystemExit(0)``); ``signal`` for SIGTERM/Ctrl-C (``signalled``
    names the signal); ``nan`` for a non-finite loss; ``oom`` for out of memory; ``lost_rank``
    for a collective whose peer went away; ``tracking_server`` for an MLflow error; else
    ``exit_code`` with the exception's type.
    """
    if e is None:
        return rel.FINISHED, ""
    if signalled:
        return "signal", signalled
    if isinstance(e, KeyboardInterrupt):
        return "signal", "SIGINT"
    if isinstance(e, SystemExit):
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        return (rel.FINISHED, "") if code == 0 else ("exit_code", f"exit {code}")
    name = type(e).__name__
    text = str(e)
    if name == "NonFiniteLoss":
        return "nan", "NaN loss" if "nan" in text.lower() else "non-finite loss"
    if name == "OutOfMemoryError" or "out of memory" in text.lower():
        return "oom", "out of memory"
    lowered = text.lower()
    if name in ("DistBackendError", "DistNetworkError") or any(s in lowered for s in (
            "connection closed by peer", "connection reset by peer", "broken pipe", "nccl communicator",
            "socket timeout", "recvbytes", "sendbytes")):
        return "lost_rank", f"a peer rank was lost ({name})"
    if type(e).__module__.startswith("mlflow"):
        return "tracking_server", f"{name}"
    return "exit_code", f"{name}"
