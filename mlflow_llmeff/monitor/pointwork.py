"""The logged points' figures, built off the training thread (one process).

At a logged step the monitor reads what belongs to the step on the training thread (counts, losses,
the energy counters, codecarbon's estimate, memory, clocks, the time stamp:
:func:`~mlflow_llmeff.monitor.points.read_interval`) and hands the rest to a :class:`PointWorker`, one
daemon thread, ``llmeff-points``, that runs the jobs in the order they came: summing the readings into
the consumption totals, reading the host's contention (an interval from one reading to the next), and
building the ~20 figures of the point and handing them to the logger
(:func:`~mlflow_llmeff.monitor.points.publish_interval`). The figures are the same: the second half reads
no clock of the meter's and no state the next steps change, and the points keep the time stamp of
their step (``tests/test_monitor_pointwork.py``).

Whatever reads what a job writes (the consumption totals, the last point, the logger's buffer before a
checkpoint, the summary) first drains the worker (:meth:`PointWorker.drain`): the monitor drains at every
window edge, before a checkpoint's state, an eval, a flush, :attr:`latest_metrics
<mlflow_llmeff.monitor.meter.EfficiencyMonitor.latest_metrics>` and the end of the run, so points reach
the logger in step order and the summary sees them all. A drain runs the jobs the thread has not
started yet itself (steps faster than the thread wakes), so it never waits for more than the job in
progress. A job's error is kept and returned by the next drain (the monitor then stops, as after any
failure of its own). Not used with several ranks: their readings are collectives, made on the training
thread in the same order on every rank, and the rest is made there too.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Callable

__all__ = ["PointWorker", "POLL_S", "MAX_POLL_S", "IDLE_S"]

#: Seconds between the worker thread's looks for jobs at the least: its first look after a job, and while
#: jobs come faster than twice in this.
POLL_S = 0.01
#: Seconds between its looks at the most. Between the two it looks twice per interval between the jobs it
#: found (half the last such interval): a look costs the process a wake-up whether or not a job is there,
#: and at every 10 ms the thread took 0.5% of a core (jobs every 5 steps of ~7 ms, measured on the loaded
#: 2-core machine) to save the training thread ~30 us a logged step.
MAX_POLL_S = 0.5
#: Seconds without a job after which the thread sleeps until a job wakes it.
IDLE_S = 2.0


class PointWorker:
    """Runs handed-over jobs in order on one daemon thread, started at the first job.

    Handing a job over is an append: no system call. The thread looks for jobs twice per interval between
    the jobs it finds (from :data:`POLL_S` to :data:`MAX_POLL_S`) while they come, and sleeps until woken
    after :data:`IDLE_S` without one (then the next job wakes it). Waking
    it at every job cost the training thread ~25-50 us a logged step, more on a loaded host where the woken
    thread takes the core (``bench/overhead.py``). :meth:`drain` takes the lock the thread runs each job
    under: it waits for the job in progress, then runs the jobs the thread has not reached yet itself, in
    order, so a job never runs twice or beside another.

    Args:
        name: the thread's name.
    """

    def __init__(self, name: str = "llmeff-points") -> None:
        self._name = name
        self._jobs: deque[Callable[[], None]] = deque()
        self._wake = threading.Lock()  # released: there may be jobs (the thread waits to acquire it)
        self._wake.acquire()
        self._run = threading.Lock()  # held while a job runs, on either thread
        self.submitted = self.done = 0  # jobs handed over, jobs done (each written by one thread; read by both)
        self._thread: threading.Thread | None = None
        self._closed = False
        self._asleep = False  # the thread waits to be woken (no job for IDLE_S)
        self.error: BaseException | None = None  # the first job's exception, until a drain returns it

    @property
    def pending(self) -> int:
        """Jobs handed over and not yet done."""
        return self.submitted - self.done

    def submit(self, job: Callable[[], None]) -> None:
        """Run ``job()`` on the worker thread after every job handed over before it (a closed worker runs
        it here, at once)."""
        if self._closed:
            job()
            return
        self._jobs.append(job)
        self.submitted += 1
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
            self._thread.start()
        elif self._asleep:
            self._wake_up()

    def _wake_up(self) -> None:
        try:
            self._wake.release()
        except RuntimeError:  # already released: the thread has not taken the last wake-up yet
            pass

    def drain(self) -> BaseException | None:
        """Make every job handed over done: wait for the one in progress, run those not yet started here;
        returns (and forgets) the first job's exception since the last drain, None when all went well.
        Called on the thread that submits."""
        if self.submitted != self.done:
            with self._run:
                jobs = self._jobs
                while jobs:
                    self._do(jobs.popleft())
        error, self.error = self.error, None
        return error

    def close(self, timeout_s: float | None = None) -> BaseException | None:
        """Drain, then end the thread (a later :meth:`submit` runs its job at once); returns :meth:`drain`'s
        exception. ``timeout_s``: the most seconds to wait for the thread to end after the drain."""
        error = self.drain()
        self._closed = True
        thread = self._thread
        if thread is not None:
            self._wake_up()
            if thread is not threading.current_thread():
                thread.join(timeout_s)
        return error

    def _do(self, job: Callable[[], None]) -> None:
        """Run one job (under ``_run``), keeping its exception for the next drain."""
        try:
            job()
        except BaseException as e:  # noqa: BLE001 - returned by the next drain, never lost
            if self.error is None:
                self.error = e
        finally:
            self.done += 1

    def _loop(self) -> None:
        jobs, run, wake = self._jobs, self._run, self._wake
        idle, poll, found = 0.0, POLL_S, None  # found: when the thread last found jobs (monotonic s)
        while not self._closed:
            if idle >= IDLE_S:  # (a job handed over as this is set waits for the next one, or a drain)
                self._asleep = True
                wake.acquire()
                self._asleep, idle, poll, found = False, 0.0, POLL_S, None
            else:
                wake.acquire(timeout=poll)
            ran = False
            while True:
                with run:
                    if not jobs:
                        break
                    self._do(jobs.popleft())
                    ran = True
            if ran:
                now = time.monotonic()
                if found is not None:
                    poll = min(max(POLL_S, (now - found) / 2), MAX_POLL_S)
                idle, found = 0.0, now
            else:
                idle += poll
