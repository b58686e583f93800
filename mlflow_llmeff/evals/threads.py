"""How many CPU threads the eval's scoring runs with: the CPUs this process may use, fewer while others use them.

Why (measured on this project's 2-core machine, HellaSwag, the bench model of ``bench/evals.py``):
torch's intra-op default is the machine's cores, and each operator is an OpenMP parallel region whose
threads meet at a barrier. When other processes hold the CPUs, one preempted thread stalls the region
until the scheduler runs it again (milliseconds); our scorer runs many short operators (prefix and
branch passes, the late LM head), so it paid this stall more often per document than lm-eval's few,
long padded passes. At a load average of 28: 150 s on 2 threads against 23 s on 1 for 40 documents
(lm-eval: 172 s against 64 s).

The choice:

1. **Usable CPUs** (:func:`usable_cpus`): the affinity set (``os.sched_getaffinity``), bounded by the
   container's CPU quota (:func:`mlflow_llmeff.meters.cgroup.cpu_quota`) rounded **down**, at least 1:
   ``cpu.max "150000 100000"`` (1.5 CPUs) gives 1 thread, ``"250000 100000"`` 2. Rounding down follows
   uber-go/automaxprocs ("round down rather than up ... rather than guaranteeing constant throttling at
   saturation", its CHANGELOG); Go 1.25's runtime rounds up (minimum 2) and proposal golang/go#76835
   asks it to round down for that reason. An OpenMP barrier waits for its slowest thread, so a thread
   the quota cannot pay for costs more here than in Go. ``OMP_NUM_THREADS`` (when set) caps it.
2. **Others' load** (:class:`CpuShare`): the CPU time the usable CPUs spent busy (``/proc/stat``, per
   CPU of the affinity set) minus this process's own (``time.process_time``), per second of the
   window: CPUs others hold. Threads = usable CPUs minus that, rounded half up, at least 1
   (:func:`choose_threads`). Re-decided at most every ``every_s`` (0.5 s) between batches, so a job
   that starts or stops beside the eval is followed.

Thread counts change float summation order only inside a matrix product (rounding, ~1e-7 relative);
``bench/evals.py`` checks every round that the predictions equal lm-eval's.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field
from typing import Callable

__all__ = ["CpuShare", "ThreadChooser", "WorkerCount", "affinity_tag", "choose_threads", "choose_workers",
           "default_workers", "usable_cpus"]


def _affinity() -> set[int] | None:
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no sched_getaffinity (macOS)
        return None


def affinity_tag() -> str:
    """``'<CPUs this process may run on> of <the host's>'`` (names.CPU_AFFINITY, as training tags it)."""
    got = _affinity()
    return f"{len(got) if got is not None else 'unknown'} of {os.cpu_count()}"


def usable_cpus(affinity: set[int] | None = None, quota: float | None = None, *,
                read_quota: bool = True) -> tuple[int, str]:
    """CPUs this process may use: ``(count >= 1, how it was found)``.

    Args:
        affinity: the CPU ids this process may run on; None reads ``os.sched_getaffinity(0)`` (else
            ``os.cpu_count()``).
        quota: the container's CPU quota in CPUs (quota / period, e.g. 1.5); None reads it with
            :func:`mlflow_llmeff.meters.cgroup.cpu_quota` unless ``read_quota`` is False.
        read_quota: False: no quota when ``quota`` is None (tests).

    Returns:
        ``min(len(affinity), max(1, floor(quota)))`` and e.g. ``"affinity 2 of 2, cgroup quota 1.5 CPUs
        (rounded down)"``.

    Raises:
        ValueError: ``quota`` <= 0 or an empty ``affinity``.
    """
    if affinity is None:
        affinity = _affinity()
    if affinity is not None and not affinity:
        raise ValueError("affinity set() is empty; use the CPU ids this process may run on")
    n = len(affinity) if affinity is not None else (os.cpu_count() or 1)
    where = f"affinity {n} of {os.cpu_count()}" if affinity is not None else f"{n} CPUs (os.cpu_count)"
    source = ""
    if quota is None and read_quota:
        from mlflow_llmeff.meters.cgroup import cpu_quota

        got = cpu_quota()
        if got is not None:
            quota, source = got.cpus, f" ({got.source})"
    if quota is not None:
        if quota <= 0:
            raise ValueError(f"quota {quota} is not accepted; use a CPU count > 0 (quota / period)")
        whole = max(1, math.floor(quota + 1e-9))
        where += f", cgroup quota {quota:g} CPUs{source} rounded down to {whole}"
        n = min(n, whole)
    else:
        where += ", no cgroup CPU quota"
    return n, where


def choose_threads(usable: int, others: float | None, cap: int | None = None) -> int:
    """Intra-op threads: ``usable`` less the CPUs others hold (``others``, rounded half up), in [1, usable].

    Args:
        usable: CPUs this process may use (:func:`usable_cpus`), >= 1.
        others: CPUs' worth of time other processes used on them over the last window (0 ..
            ``usable``); None: unknown, all ``usable``.
        cap: an upper bound (``OMP_NUM_THREADS``), None for none.

    Raises:
        ValueError: ``usable`` < 1.
    """
    if usable < 1:
        raise ValueError(f"usable {usable} is not accepted; use a CPU count >= 1")
    n = usable if others is None else math.floor(usable - max(0.0, others) + 0.5)
    n = max(1, min(usable, n))
    return max(1, min(n, cap)) if cap is not None else n


def choose_workers(usable: int, cap: int | None, threads: int | None, forkable: bool, distributed: bool) -> int:
    """Worker processes of one thread each for scoring (:mod:`mlflow_llmeff.evals.workers`).

    ``usable`` (capped by ``cap``, ``OMP_NUM_THREADS``: torchrun sets 1 for each of its processes),
    unless a thread count was asked (``threads``), the platform cannot fork, or a
    ``torch.distributed`` group is up (a worker would call a sharded model's collectives alone): then 1.
    Not less for others' load: a process of one thread has no OpenMP barrier to stall, and a worker
    that other jobs slow takes fewer chunks.

    Raises:
        ValueError: ``usable`` < 1.
    """
    if usable < 1:
        raise ValueError(f"usable {usable} is not accepted; use a CPU count >= 1")
    if threads is not None or not forkable or distributed:
        return 1
    return max(1, min(usable, cap)) if cap is not None else usable


def _omp_cap() -> int | None:
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    return int(env) if env.isdigit() and int(env) >= 1 else None


def default_workers(threads: int | None = None) -> int:
    """:func:`choose_workers` for this process: its usable CPUs (:func:`usable_cpus`),
    ``OMP_NUM_THREADS``, fork and ``torch.distributed`` as found."""
    from mlflow_llmeff.evals.workers import can_fork

    distributed = False
    try:
        import torch.distributed as dist

        distributed = dist.is_available() and dist.is_initialized()
    except ImportError:  # torch without distributed
        pass
    return choose_workers(usable_cpus()[0], _omp_cap(), threads, can_fork(), distributed)


def _read_stat(cpus: set[int] | None) -> float | None:
    """Busy seconds of ``cpus`` (all with None) since boot, from ``/proc/stat``; None where unreadable."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            lines = f.read().splitlines()
        tick = os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, AttributeError):
        return None
    busy, seen = 0, False
    for line in lines:
        if not line.startswith("cpu") or line.startswith("cpu "):
            continue
        name, *fields = line.split()
        if cpus is not None and int(name[3:]) not in cpus:
            continue
        v = [int(x) for x in fields[:8]]  # user nice system idle iowait irq softirq steal
        busy += v[0] + v[1] + v[2] + v[5] + v[6] + v[7]
        seen = True
    return busy / tick if seen else None


@dataclass
class CpuShare:
    """CPUs' worth of time other processes used on this process's CPUs between two samples.

    ``busy`` gives the busy seconds of the usable CPUs (``/proc/stat``), ``own`` this process's CPU
    seconds (all its threads), ``clock`` wall seconds; tests inject all three.
    """

    busy: Callable[[], float | None]
    own: Callable[[], float] = time.process_time
    clock: Callable[[], float] = time.monotonic
    _last: tuple[float, float, float] | None = field(default=None, init=False)

    @classmethod
    def of(cls, cpus: set[int] | None) -> "CpuShare":
        """A share read from ``/proc/stat`` for the CPUs ``cpus`` (None: all)."""
        return cls(lambda: _read_stat(cpus))

    def mark(self) -> bool:
        """Start a window now; False where the CPUs' busy time cannot be read."""
        busy = self.busy()
        self._last = None if busy is None else (busy, self.own(), self.clock())
        return self._last is not None

    def elapsed(self) -> float:
        """Wall seconds since :meth:`mark` (0 without one)."""
        return self.clock() - self._last[2] if self._last is not None else 0.0

    def others(self) -> float | None:
        """CPUs others held since :meth:`mark` (>= 0), and a new window starts; None without a window."""
        if self._last is None:
            return None
        busy, own, now = self.busy(), self.own(), self.clock()
        if busy is None or now <= self._last[2]:
            return None
        b0, o0, t0 = self._last
        self._last = (busy, own, now)
        return max(0.0, ((busy - b0) - (own - o0)) / (now - t0))


@dataclass
class ThreadChooser:
    """Sets torch's intra-op threads for one evaluation and follows others' load (module docstring).

    Call :meth:`start` before scoring, :meth:`tick` between batches, :meth:`stop` after (restores the
    thread count found). ``set_threads`` / ``get_threads`` default to torch's.

    Attributes:
        usable: CPUs this process may use (:func:`usable_cpus`).
        where: how ``usable`` was found (``'2 usable: affinity 2 of 2, ...'``).
        cap: ``OMP_NUM_THREADS`` when set, else None.
        every_s: the shortest window between two decisions, s.
        seconds_at: wall seconds scored at each thread count (what the eval reports).
    """

    usable: int
    where: str
    share: CpuShare | None
    cap: int | None = None
    every_s: float = 0.5
    set_threads: Callable[[int], None] | None = None
    get_threads: Callable[[], int] | None = None
    seconds_at: dict[int, float] = field(default_factory=dict)
    current: int = 0
    _found: int = 0
    _since: float = 0.0

    @classmethod
    def for_this_process(cls) -> "ThreadChooser":
        """Usable CPUs from affinity and the cgroup quota, others' load from ``/proc/stat``."""
        affinity = _affinity()
        usable, where = usable_cpus(affinity)
        cap = _omp_cap()
        if cap is not None:
            where += f", OMP_NUM_THREADS={cap}"
        return cls(usable, f"{usable} usable: {where}", CpuShare.of(affinity), cap)

    def _set(self, n: int) -> None:
        if self.set_threads is None:
            import torch

            torch.set_num_threads(n)
        else:
            self.set_threads(n)

    def begin(self) -> None:
        """Start the first load window (call as early as possible: data loading fills it)."""
        if self.share is not None:
            self.share.mark()

    def start(self) -> int:
        """Choose and set the first thread count (from the window since :meth:`begin` if >= 50 ms,
        else all usable CPUs); returns it."""
        if self.get_threads is None:
            import torch

            self._found = torch.get_num_threads()
        else:
            self._found = self.get_threads()
        others = None
        if self.share is not None:
            others = self.share.others() if self.share.elapsed() >= 0.05 else None
            if others is None:
                self.share.mark()
        self.current = choose_threads(self.usable, others, self.cap)
        self._set(self.current)
        self._since = self._now()
        return self.current

    def _now(self) -> float:
        return self.share.clock() if self.share is not None else time.monotonic()

    def tick(self) -> int:
        """Between batches: after ``every_s``, re-decide from the window since the last decision."""
        if self.share is None or self.current == 0 or self.share.elapsed() < self.every_s:
            return self.current
        now = self._now()
        self.seconds_at[self.current] = self.seconds_at.get(self.current, 0.0) + now - self._since
        self._since = now
        n = choose_threads(self.usable, self.share.others(), self.cap)
        if n != self.current:
            self.current = n
            self._set(n)
        return n

    def stop(self) -> None:
        """Book the last interval and restore the thread count found at :meth:`start`."""
        if self.current:
            now = self._now()
            self.seconds_at[self.current] = self.seconds_at.get(self.current, 0.0) + now - self._since
            self._set(self._found)
            self.current = 0

    def describe(self) -> str:
        """``'intra-op 1-2: 1 for 12.3 s, 2 for 4.0 s (2 usable: affinity 2 of 2, no cgroup CPU quota)'``."""
        used = sorted(n for n, s in self.seconds_at.items() if s > 0) or [self.current or self.usable]
        span = f"{used[0]}" if len(used) == 1 else f"{used[0]}-{used[-1]}"
        parts = ", ".join(f"{n} for {self.seconds_at[n]:.1f} s" for n in used if n in self.seconds_at)
        return f"intra-op {span}" + (f": {parts}" if len(used) > 1 else "") + f" ({self.where})"


@dataclass
class WorkerCount:
    """How many worker processes score now: ``usable`` first, one more while one more pays.

    Why (measured on this project's 2-core machine, HellaSwag 1,000 documents, vocabulary 32000, the
    bench model of ``bench/evals.py``): 2 and 4 workers of one thread took the same CPU time (130.6 s
    each); what differs under load is how much CPU the workers *receive*. Linux's scheduler shares a
    CPU between runnable threads of one group (one session under autogroup, one cgroup) in equal
    parts, so beside two busy loops in the group 2 workers receive half the group's CPU time and 4
    two thirds; where the competitors are other groups (other sessions under autogroup), the group's
    share is fixed and more workers receive nothing more. Which one holds is not known in advance,
    so it is measured on the real work: the CPU seconds all workers ran per wall second of a window
    (``received``, from
    :func:`mlflow_llmeff.evals.workers.processes_cpu_seconds`).

    The decision, once per window (:meth:`decide`):

    * The workers receive their CPUs (``received >= busy * min(current, usable)``): no probe; more
      than ``usable`` workers go back to ``usable`` (the extra ones have nothing to take).
    * Else a probe: one worker more (at most ``cap``), kept when the next window's ``received`` is at
      least ``1 + gain`` times the one before, otherwise taken back and no probe for ``hold``
      windows. Above ``usable``, every other probe is one worker less, kept unless ``received``
      falls by ``gain`` (load changes while the eval runs). Per-thread sharing beside two loops
      gives 3 workers 1.2x what 2 receive and 4 1.11x what 3 do; a group share gives 1.0x.

    Measured (bench model, vocabulary 32000, two hogs in the bench's session, this loaded 2-core
    machine): 1,000 documents interleaved with the code before (2 workers throughout), 3 rounds, load
    2.2-7.0: median seconds quiet / hogs 113.4 / 350.9 before (3.09x), 96.0 / 118.8 after (1.24x),
    predictions identical; ``bench/evals.py --limit 400 --hogs 2 --rounds 1`` at load 0.3-1.7: ours
    1.67x (26.0 -> 43.4 s), lm-eval 3.04x (80.7 -> 245.1 s).

    A worker's documents and their scores do not depend on the count (the chunks are planned before,
    :func:`mlflow_llmeff.evals.workers.plan_chunks`). ``cap`` bounds the memory (each worker holds
    its own activations; the weights are shared copy-on-write) and the share taken from others.

    Attributes:
        usable: CPUs this process may use (:func:`usable_cpus`), the first count.
        cap: the most workers (>= ``usable``).
        gain: the rise in ``received`` that keeps one more worker (0.08: 8%).
        busy: ``received / current`` at or above which the workers count as receiving their CPUs.
        hold: windows without a probe after a probe that did not pay.
        current: workers scoring now.
        decisions: ``(received, workers before, workers after)`` per window (tests, ``describe``).
    """

    usable: int
    cap: int
    gain: float = 0.08
    busy: float = 0.9
    hold: int = 4
    current: int = 0
    decisions: list[tuple[float, int, int]] = field(default_factory=list)
    _probe: str = ""  # "up" / "down" while a probe window runs
    _ref: float = 0.0
    _wait: int = 0
    _down_next: bool = False

    def __post_init__(self) -> None:
        if self.usable < 1 or self.cap < self.usable:
            raise ValueError(f"usable {self.usable} / cap {self.cap} is not accepted; use 1 <= usable <= cap")
        self.current = self.current or self.usable

    def decide(self, received: float) -> int:
        """The worker count for the next window, given the CPUs' worth the workers received in this one."""
        before = self.current
        if self._probe == "up":
            if received < self._ref * (1 + self.gain):
                self.current -= 1
                self._wait, self._down_next = self.hold, self.current > self.usable
            elif self.current >= self.cap:  # kept, at the cap: no probe down at once
                self._wait = self.hold
            self._probe = ""
        elif self._probe == "down":
            if received <= self._ref * (1 - self.gain):
                self.current += 1
            self._probe, self._wait, self._down_next = "", self.hold, False
        elif received >= self.busy * min(self.current, self.usable):  # the CPUs are ours: no more needed
            self.current = min(self.current, self.usable)
        elif self._wait > 0:
            self._wait -= 1
        elif self._down_next and self.current > self.usable or self.current >= self.cap > self.usable:
            self._probe, self._ref, self.current = "down", received, self.current - 1
        elif self.current < self.cap:
            self._probe, self._ref, self.current = "up", received, self.current + 1
        self.decisions.append((received, before, self.current))
        return self.current

    def describe(self) -> str:
        """``'2-4 workers (probed: 3 kept at 1.31 CPUs received, ...)'``: the counts used, the windows."""
        counts = [self.usable] + [after for _, _, after in self.decisions]
        span = f"{min(counts)}" if min(counts) == max(counts) else f"{min(counts)}-{max(counts)}"
        changes = [f"{b}->{a} at {r:.2f} CPUs received" for r, b, a in self.decisions if a != b]
        return (f"{span} workers over {len(self.decisions)} windows"
                + (f" ({', '.join(changes[:6])}{', ...' if len(changes) > 6 else ''})" if changes else "")
                + f"; cap {self.cap}")
