"""Reliability across a job's life: down time, MTBF with its Poisson interval, recovery, TOR.

A *job* is one MLflow run; each process start that continues it (after a crash, a kill, a
preemption, an elastic restart) is an *attempt*. This module is a pure calculator over the job's
attempts ledger (one :class:`Attempt` per process start, oldest first, all times on one clock in
seconds, e.g. Unix time); it reads no clock and no file. The figures (``docs/time.md``,
"Reliability across a job's life"):

* ``down`` (``summary/badput_down_s``): the sum over gaps of the next attempt's process start
  minus the failed attempt's last sign of life (its last completed step, heartbeat or exit
  record). Time no attempt ran.
* ``wall``: first attempt's start to the last attempt's last sign of life; ``operating`` = wall -
  down.
* ``failures``: attempts that ended without finishing (exit code, signal, NaN, OOM, lost rank,
  tracking server, unknown). An attempt still running (the last one, while the job runs) is no
  failure, nor is one the scheduler preempted (:data:`PREEMPTED`: it checkpointed its last step on
  the scheduler's warning and ended; ``preemptions``); the wait until the next attempt (the
  requeued job's time in the queue) is down time all the same.
* ``mtbf`` = operating / failures (failures >= 1), with the two-sided 95% interval of a
  time-truncated (Type I censored) test of a homogeneous Poisson process, the variant with
  2r + 2 degrees of freedom for the lower bound and 2r for the upper::

      low  = 2 T / chi2.ppf(0.975, 2 r + 2)
      high = 2 T / chi2.ppf(0.025, 2 r)

  (NIST/SEMATECH e-Handbook of Statistical Methods, chapter 8, "Exponential life distribution
  (or HPP model) tests", confidence bounds for time-censored data; MIL-HDBK-781A uses the same
  degrees of freedom for fixed-duration tests). With no failure there is no MTBF and no upper
  bound; the lower bound ``2 T / chi2.ppf(0.975, 2)`` is still given (the same formula at r = 0).
* ``recovery`` per failure: from the failed attempt's last sign of life to the next attempt's
  first productive step = down + the next attempt's set-up + checkpoint load + re-warm-up (its
  warm-up excess); ``recovery_s`` and each part are means over the failures that a next attempt
  followed (a failure with no next attempt yet has no recovery).
* ``lost`` per failure: the work redone, from the newest checkpoint written by the failed attempt
  (or, when it wrote none, from its first productive step) to its last sign of life.
* ``failure_cost`` = sum over failures of recovery + lost progress.
* ``tor`` = (wall - failure_cost) / wall: the training overhead ratio of arXiv 2408.07482
  (Lu et al., "Training Overhead Ratio: A Practical Reliability Metric for Large Language Model
  Training Systems"): optimal (failure-free) time over observed time.
* ``successful_interval_ratio``: the successful-epoch ratio over checkpoint intervals: intervals
  completed (ending at a checkpoint, or at the job's last step when it finished) without a retry,
  over intervals completed. An interval was retried when an attempt failed inside it (after the
  checkpoint that starts it, with at least one step of it done).

Undefined figures are None in :class:`Reliability` with the reason in :attr:`Reliability.why`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from mlflow_llmeff import names

__all__ = ["FINISHED", "RUNNING", "PREEMPTED", "CAUSES", "Attempt", "Reliability", "compute", "mtbf_interval",
           "device_hours", "fleet_mtbf", "with_down", "describe", "failures_line", "summary_metrics", "summary_tags"]

FINISHED = "finished"
#: an attempt still running (the current one, while the job runs): neither a failure nor finished
RUNNING = "running"
#: an attempt the scheduler stopped with a warning (SLURM's --signal): it wrote a checkpoint of its last
#: step and ended; the job goes on when requeued. An interruption, not a failure: no MTBF, no failure cost,
#: no work redone; the time until the next attempt is down time all the same.
PREEMPTED = "preempted"
#: the ways an attempt can end without finishing
CAUSES = ("exit_code", "signal", "nan", "oom", "lost_rank", "tracking_server", "unknown")


@dataclass(frozen=True)
class Attempt:
    """One process start of the job (all times on the job's clock, seconds).

    Args:
        start: the attempt's process start (for the first attempt: the user's command, e.g. the
            launcher's start).
        last_alive: its last sign of life: the end of the run for a finished attempt, else the
            newest of its last completed step, its heartbeat and its exit record.
        end: :data:`FINISHED`, :data:`RUNNING`, :data:`PREEMPTED` or a cause from :data:`CAUSES`.
        detail: what the cause was, e.g. ``"SIGKILL"``, ``"exit 1"``, ``"rank 1 lost"``.
        steps: the last optimizer step it completed (absolute, counted from the job's start).
        start_step: the step it resumed from (0: from the start).
        checkpoint_step: the newest complete checkpoint's step when it ended (None: none).
        checkpoint_at: when that checkpoint was complete (None: none, or written by an earlier
            attempt).
        checkpoints: steps of the checkpoints this attempt wrote.
        setup_s: seconds from its start to its first step, the checkpoint load excluded.
        load_s: seconds loading the checkpoint it resumed from.
        rewarm_s: its warm-up excess (the first steps' time above steady-state speed).
        devices: devices it held (its world size; None: not recorded). An elastic restart on fewer
            machines is an attempt with fewer devices; :func:`device_hours` counts each at its own.
    """

    start: float
    last_alive: float
    end: str = FINISHED
    detail: str = ""
    steps: int = 0
    start_step: int = 0
    checkpoint_step: int | None = None
    checkpoint_at: float | None = None
    checkpoints: tuple[int, ...] = ()
    setup_s: float = 0.0
    load_s: float = 0.0
    rewarm_s: float = 0.0
    devices: int | None = None

    def __post_init__(self) -> None:
        if self.end not in (FINISHED, RUNNING, PREEMPTED) + CAUSES:
            raise ValueError(f"attempt end {self.end!r} is not accepted; use one of: "
                             f"{', '.join((FINISHED, RUNNING, PREEMPTED) + CAUSES)}")
        if self.last_alive < self.start:
            raise ValueError(f"attempt's last sign of life ({self.last_alive}) is before its start ({self.start})")

    @property
    def failed(self) -> bool:
        """True when the attempt ended without finishing."""
        return self.end in CAUSES

    @property
    def productive_from(self) -> float:
        """Its first productive step: start + set-up + checkpoint load + re-warm-up (seconds)."""
        return self.start + self.setup_s + self.load_s + self.rewarm_s

    @property
    def lost_s(self) -> float:
        """Seconds of work redone after it failed: from its own newest checkpoint (else its first
        productive step) to its last sign of life; 0 when it did not fail."""
        if not self.failed:
            return 0.0
        since = self.checkpoint_at if self.checkpoint_at is not None and self.checkpoint_at >= self.start \
            else self.productive_from
        return max(0.0, self.last_alive - since)


@dataclass
class Reliability:
    """The job's reliability figures (seconds unless said); None = undefined, see :attr:`why`."""

    attempts: int
    failures: int
    wall_s: float
    down_s: float
    operating_s: float
    mtbf_s: float | None
    mtbf_ci95_low_s: float | None
    mtbf_ci95_high_s: float | None
    recovery_s: float | None
    recovery_parts_s: dict[str, float] | None  # down, setup, load, rewarm (means)
    lost_s: float
    failure_cost_s: float | None
    tor: float | None
    successful_interval_ratio: float | None
    failed: list[dict] = field(default_factory=list)  # per failure: attempt, cause, detail, step, at, ...
    why: dict[str, str] = field(default_factory=dict)
    preempted: list[dict] = field(default_factory=list)  # per preemption: attempt, detail, step, at, down to the next


def mtbf_interval(operating_s: float, failures: int, confidence: float = 0.95) -> tuple[float | None, float | None]:
    """Two-sided Poisson (chi-square) bounds of the MTBF of a time-truncated observation.

    ``low = 2T / chi2.ppf(1 - a/2, 2r + 2)``, ``high = 2T / chi2.ppf(a/2, 2r)`` with ``a = 1 -
    confidence`` (NIST/SEMATECH e-Handbook, chapter 8, HPP tests, time-censored data;
    MIL-HDBK-781A). With ``failures == 0`` the upper bound is None (unbounded).

    Args:
        operating_s: operating time T, seconds (>= 0).
        failures: r >= 0.

    Raises:
        ValueError: negative T or r, or a confidence outside (0, 1).
    """
    if operating_s < 0 or failures < 0:
        raise ValueError(f"operating time ({operating_s}) and failures ({failures}) must be >= 0")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence {confidence} must lie in (0, 1)")
    from scipy.stats import chi2

    a = 1.0 - confidence
    low = 2.0 * operating_s / float(chi2.ppf(1 - a / 2, 2 * failures + 2))
    high = 2.0 * operating_s / float(chi2.ppf(a / 2, 2 * failures)) if failures > 0 else None
    return low, high


def _intervals(attempts: Sequence[Attempt]) -> tuple[int, int, str | None]:
    """(completed intervals, completed without a retry, why undefined)."""
    ends = {s for a in attempts for s in a.checkpoints}
    last = attempts[-1]
    if last.end == FINISHED:
        ends.add(last.steps)
    ends.discard(0)
    if not ends:
        return 0, 0, "no checkpoint interval completed (no checkpoint written and the job not finished)"
    retried = {a.checkpoint_step or 0 for a in attempts if a.failed and a.steps > (a.checkpoint_step or 0)}
    bounds = sorted(ends)
    starts = [0] + bounds[:-1]
    clean = sum(1 for s in starts if s not in retried)
    return len(bounds), clean, None


def compute(attempts: Sequence[Attempt]) -> Reliability:
    """The reliability figures of a job from its attempts, oldest first.

    Raises:
        ValueError: no attempt, attempts out of order or overlapping, or a :data:`RUNNING` attempt
            that is not the last.
    """
    if not attempts:
        raise ValueError("a job has at least one attempt")
    for prev, nxt in zip(attempts, attempts[1:]):
        if prev.end == RUNNING:
            raise ValueError("a running attempt is followed by another; only the last attempt can be running")
        if nxt.start < prev.last_alive:
            raise ValueError(f"attempt starting at {nxt.start} overlaps the previous one (alive until {prev.last_alive})")
    why: dict[str, str] = {}
    gaps = [nxt.start - prev.last_alive for prev, nxt in zip(attempts, attempts[1:])]
    down = sum(gaps)
    wall = attempts[-1].last_alive - attempts[0].start
    operating = wall - down
    failed = [i for i, a in enumerate(attempts) if a.failed]
    r = len(failed)
    if r:
        mtbf = operating / r
        low, high = mtbf_interval(operating, r)
    else:
        mtbf, high = None, None
        low = mtbf_interval(operating, 0)[0] if operating > 0 else None
        why["mtbf_s"] = (f"no failure in {operating:.0f} s of operation: no MTBF; the 95% lower bound "
                         "2T/chi2(0.975, 2) is given" if operating > 0 else "no operating time")
        why["mtbf_ci95_high_s"] = "no failure: the upper bound is unbounded"
    recovered = [i for i in failed if i + 1 < len(attempts)]
    parts_each = []
    rows = []
    for i in failed:
        a = attempts[i]
        row = {"attempt": i + 1, "cause": a.end, "detail": a.detail, "step": a.steps,
               "at_s": a.last_alive - attempts[0].start, "checkpoint_step": a.checkpoint_step,
               "lost_steps": a.steps - (a.checkpoint_step or 0), "lost_s": a.lost_s}
        if i + 1 < len(attempts):
            n = attempts[i + 1]
            p = {"down": n.start - a.last_alive, "setup": n.setup_s, "load": n.load_s, "rewarm": n.rewarm_s}
            parts_each.append(p)
            row.update(down_s=p["down"], recovery_s=sum(p.values()))
        rows.append(row)
    if parts_each:
        parts = {k: sum(p[k] for p in parts_each) / len(parts_each) for k in ("down", "setup", "load", "rewarm")}
        recovery = sum(parts.values())
    else:
        parts, recovery = None, None
        why["recovery_s"] = "no failure" if not r else "no attempt followed the failure yet"
    lost = sum(attempts[i].lost_s for i in failed)
    if r and len(recovered) == r:
        cost = sum(sum(p.values()) for p in parts_each) + lost
    elif not r:
        cost = 0.0
    else:
        cost = None
        why["failure_cost_s"] = "a failure has no next attempt yet: its recovery is unknown"
    if wall > 0 and cost is not None:
        tor = (wall - cost) / wall
    else:
        tor = None
        why.setdefault("tor", "no wall time" if wall <= 0 else why.get("failure_cost_s", ""))
    stops = []
    for i, a in enumerate(attempts):
        if a.end == PREEMPTED:
            row = {"attempt": i + 1, "detail": a.detail, "step": a.steps, "at_s": a.last_alive - attempts[0].start}
            if i + 1 < len(attempts):
                row["down_s"] = attempts[i + 1].start - a.last_alive
            stops.append(row)
    done, clean, why_int = _intervals(attempts)
    sir = clean / done if done else None
    if why_int:
        why["successful_interval_ratio"] = why_int
    return Reliability(attempts=len(attempts), failures=r, wall_s=wall, down_s=down, operating_s=operating,
                       mtbf_s=mtbf, mtbf_ci95_low_s=low, mtbf_ci95_high_s=high, recovery_s=recovery,
                       recovery_parts_s=parts, lost_s=lost, failure_cost_s=cost, tor=tor,
                       successful_interval_ratio=sir, failed=rows, why=why, preempted=stops)


def device_hours(attempts: Sequence[Attempt]) -> float | None:
    """The job's device-hours: sum over attempts of devices x (last sign of life - start) / 3600.

    Each attempt at the devices it held, so a restart on fewer machines is billed for fewer; the
    gaps between attempts (down time, a queue wait) hold no device. None when an attempt's devices
    were not recorded (a ledger older than the record).
    """
    if any(a.devices is None for a in attempts):
        return None
    from mlflow_llmeff.calc.cost import device_hours as spans_hours

    return spans_hours([(int(a.devices), a.last_alive - a.start) for a in attempts])


def fleet_mtbf(runs: Sequence[tuple[float, int]]) -> tuple[float | None, float | None, float | None]:
    """The MTBF of several jobs together (a configuration, an experiment): summed operating time over
    summed failures, with the same time-truncated Poisson 95% interval (:func:`mtbf_interval`).

    Args:
        runs: ``(operating seconds, failures)`` per job, e.g. ``summary/wall_s - summary/badput_down_s``
            and ``summary/failures``.

    Returns:
        ``(mtbf, low, high)``; mtbf and high are None with no failure (low is still defined).

    Raises:
        ValueError: for a negative time or count.
    """
    t = sum(float(op) for op, _ in runs)
    r = sum(int(f) for _, f in runs)
    low, high = mtbf_interval(t, r)
    return (t / r if r else None), low, high


def with_down(parts: dict[str, float], down_s: float) -> dict[str, float]:
    """A :func:`mlflow_llmeff.calc.goodput.breakdown` extended by the job's down time.

    Returns a copy with ``down`` = ``down_s`` and ``wall`` grown by it, so productive plus every
    badput (down included) is still the wall time; goodput over it is productive / whole-job wall.

    Raises:
        ValueError: for negative ``down_s``.
    """
    if down_s < 0:
        raise ValueError(f"down time {down_s} s is negative")
    out = dict(parts)
    out["down"] = out.get("down", 0.0) + float(down_s)
    out["wall"] = parts["wall"] + float(down_s)
    return out


def _cause_word(row: dict) -> str:
    return row["detail"] or {"nan": "NaN loss", "oom": "out of memory", "lost_rank": "lost rank",
                             "tracking_server": "tracking server", "unknown": "unknown cause",
                             "exit_code": "exit", "signal": "signal"}.get(row["cause"], row["cause"])


def describe(rel: Reliability) -> str:
    """One line for the run's description and the terminal, e.g.
    ``"2 attempts, 1 failure (SIGKILL at step 31), recovery 43 s"``."""
    att = f"{rel.attempts} attempt{'s' if rel.attempts != 1 else ''}"
    if rel.preempted:  # the scheduler's stops: no failure, their waits are down time
        n = len(rel.preempted)
        att += (f", {n} preemption{'s' if n != 1 else ''} ("
                + ", ".join(f"at step {r['step']}" for r in rel.preempted[:4]) + (", ..." if n > 4 else "") + ")")
        if not rel.failures:
            return f"{att}, no failure" + (f", down {rel.down_s:.0f} s" if rel.down_s else "")
    if not rel.failures:
        return f"{att}, no failure"
    causes = ", ".join(f"{_cause_word(r)} at step {r['step']}" for r in rel.failed[:4])
    more = f", +{len(rel.failed) - 4} more" if len(rel.failed) > 4 else ""
    line = f"{att}, {rel.failures} failure{'s' if rel.failures != 1 else ''} ({causes}{more})"
    if rel.recovery_s is not None:
        line += f", recovery {rel.recovery_s:.0f} s"
    if rel.down_s:
        line += f", down {rel.down_s:.0f} s"
    return line


def failures_line(rel: Reliability) -> str:
    """The ``llmeff.reliability.failures`` tag: each failure's attempt, time, cause and step, ``; ``-separated."""
    if not rel.failed:
        return f"none in {rel.attempts} attempt{'s' if rel.attempts != 1 else ''}"
    out = []
    for r in rel.failed:
        s = (f"attempt {r['attempt']}: {r['cause']}{' (' + r['detail'] + ')' if r['detail'] else ''} at step "
             f"{r['step']}, {r['at_s']:.1f} s into the job, checkpoint {r['checkpoint_step'] or 'none'}, "
             f"{r['lost_steps']} steps redone")
        if "down_s" in r:
            s += f", down {r['down_s']:.1f} s, recovery {r['recovery_s']:.1f} s"
        s += f", lost {r['lost_s']:.1f} s"
        out.append(s)
    return "; ".join(out)


def summary_metrics(r: Reliability) -> dict[str, float]:
    """The ``summary/*`` reliability metrics of ``r`` (names.py's reliability block); undefined ones left out."""
    out = {names.SUM_ATTEMPTS: float(r.attempts), names.SUM_FAILURES: float(r.failures),
           names.SUM_PREEMPTIONS: float(len(r.preempted)),
           names.SUM_BADPUT_DOWN_S: r.down_s, names.SUM_MTBF_S: r.mtbf_s,
           names.SUM_MTBF_CI95_LOW_S: r.mtbf_ci95_low_s, names.SUM_MTBF_CI95_HIGH_S: r.mtbf_ci95_high_s,
           names.SUM_RECOVERY_S: r.recovery_s, names.SUM_FAILURE_COST_S: r.failure_cost_s, names.SUM_TOR: r.tor,
           names.SUM_SUCCESSFUL_INTERVAL_RATIO: r.successful_interval_ratio}
    if r.recovery_parts_s is not None:
        out.update({names.SUM_RECOVERY_DOWN_S: r.recovery_parts_s["down"],
                    names.SUM_RECOVERY_SETUP_S: r.recovery_parts_s["setup"],
                    names.SUM_RECOVERY_LOAD_S: r.recovery_parts_s["load"],
                    names.SUM_RECOVERY_REWARM_S: r.recovery_parts_s["rewarm"]})
    return {k: float(v) for k, v in out.items() if v is not None}


def summary_tags(r: Reliability) -> dict[str, str]:
    """The ``llmeff.reliability*`` tags of ``r``: the failures, the one line, why figures are absent."""
    tags = {names.RELIABILITY_FAILURES: failures_line(r), names.RELIABILITY: describe(r)}
    if r.why:
        tags[names.RELIABILITY_WHY] = "; ".join(f"{k}: {v}" for k, v in r.why.items() if v)
    return tags
