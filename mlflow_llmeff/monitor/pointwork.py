"""The logged points' figures, built off the training thread (one process).

At a logged step the monitor reads what belongs to the step on the training thread (counts, losses,
energy, memory, clocks: :func:`~mlflow_llmeff.monitor.points.read_interval`) and hands the rest, building
the ~20 figures of the point from those readings and handing them to the logger
(:func:`~mlflow_llmeff.monitor.points.publish_interval`), to a :class:`PointWorker`: one daemon thread,
``llmeff-points``, that runs the jobs in the order they came. That work was ~40% of the meter's own time
on the training thread (``bench/overhead.py``, issue 53). The figures are the same: the second half reads
no clock and no state the next steps change, and the points keep the time stamp of their step.

Whatever reads what a job writes (the consumption totals, the last point, the logger's buffer before a
checkpoint, the summary) first waits for every job handed over (:meth:`PointWorker.drain`): the monitor
drains at every window edge, before a checkpoint's state, an eval, a flush, :attr:`latest_metrics
<mlflow_llmeff.monitor.meter.EfficiencyMonitor.latest_metrics>` and the end of the run, so points reach
the logger in step order and the summary sees them all. A job's error is kept and returned by the next
drain (the monitor then stops, as after any failure of its own). Not used with several ranks: their
readings are collectives, made on the training thread in the same order on every rank, and the rest is
made there too.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Callable

__all__ = ["PointWorker"]


class PointWorker:
    """Runs handed-over jobs in order on one daemon thread, started at the first job.

    Args:
        name: the thread's name.
    """

    def __init__(self, name: str = "llmeff-points") -> None:
        self._name = name
        self._jobs: deque[Callable[[], None]] = deque()
        self._cv = threading.Condition()
        self.pending = 0  # jobs handed over and not yet done (read without the lock: drain's fast path)
        self._thread: threading.Thread | None = None
        self._closed = False
        self.error: BaseException | None = None  # the first job's exception, until a drain returns it

    def submit(self, job: Callable[[], None]) -> None:
        """Run ``job()`` on the worker thread after every job handed over before it (a closed worker runs
        it here, at once)."""
        with self._cv:
            if not self._closed:
                self._jobs.append(job)
                self.pending += 1
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                    self._thread.start()
                else:
                    self._cv.notify_all()
                return
        job()

    def drain(self) -> BaseException | None:
        """Wait until every job handed over is done; returns (and forgets) the first job's exception since
        the last drain, None when all went well. Called on the thread that submits."""
        if self.pending:
            with self._cv:
                while self.pending:
                    self._cv.wait()
        error, self.error = self.error, None
        return error

    def close(self, timeout_s: float | None = None) -> BaseException | None:
        """Drain, then end the thread (a later :meth:`submit` runs its job at once); returns :meth:`drain`'s
        exception. ``timeout_s``: the most seconds to wait for the thread to end after the drain."""
        error = self.drain()
        with self._cv:
            self._closed = True
            self._cv.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s)
        return error

    def _run(self) -> None:
        cv, jobs = self._cv, self._jobs
        while True:
            with cv:
                while not jobs and not self._closed:
                    cv.wait()
                if not jobs:
                    return
                job = jobs.popleft()
            try:
                job()
            except BaseException as e:  # noqa: BLE001 - returned by the next drain, never lost
                if self.error is None:
                    self.error = e
            with cv:
                self.pending -= 1
                if not self.pending:
                    cv.notify_all()
