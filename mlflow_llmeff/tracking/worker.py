"""The delivery worker of :class:`~mlflow_llmeff.tracking.logger.RunLogger`: its background thread, its
queue, the bounded waits for the tracking server, and the spill to the outbox file.

Every MLflow call of a run is a job in one queue (:class:`_Job`), delivered in order by one daemon
thread (``llmeff-delivery``), which backs off 1, 2, 4, 8, 10 s while the server does not answer.
The thread stays, blocked on the empty queue, for ``IDLE_S`` after its last job (or until a
successful close, :meth:`DeliveryWorker._retire`), so a logged step only appends to the queue: a
thread started at each logged step cost more than all the rest of the step's logging (issue 53).
A forked child starts its own thread (:func:`_after_fork_in_child`).
The process waits for that thread only where the logger says (:meth:`DeliveryWorker._wait`), for at
most the delivery wait ``wait_s`` without an answer (:mod:`mlflow_llmeff.tracking.delivery`);
what is not delivered then is written to ``<outbox_dir>/<run id>.jsonl``
(:meth:`DeliveryWorker._spill`, :mod:`mlflow_llmeff.tracking.outbox`). A batch MLflow rejects for
an entry is sent again in halves, down to single entries (:meth:`DeliveryWorker._recover`).

:class:`DeliveryWorker` is a base class of ``RunLogger``, not a logger of its own: its state
lives on the logger (:meth:`DeliveryWorker._start_delivery`), it logs into the logger's ``run_id``
through its ``client``, and it calls the logger's ``_note`` (a line for ``llmeff.logging.warnings``),
``_warn`` (warn once) and ``_write_problems`` (hand the warning tag over), and counts the logger's
metric ``_buffer`` as held.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections import deque

from mlflow_llmeff.tracking import delivery, outbox
from mlflow_llmeff.tracking.delivery import WAIT_ENV
from mlflow_llmeff.names import shorten

__all__ = ["DeliveryWorker", "metric_entities"]

# the records keep the name of the logger the worker belongs to: one logger name to configure
log = logging.getLogger("mlflow_llmeff.tracking.logger")

# MLflow error codes that blame an entry of the request; any other failure (store unreachable, run
# deleted, ...) is not retried entry by entry: it means the server is not taking anything now.
_ENTRY_ERRORS = frozenset({"INVALID_PARAMETER_VALUE", "BAD_REQUEST"})

IDLE_S = 10.0  # seconds the delivery thread waits on an empty queue before it exits (a new job starts another)

# every worker of this process, for the fork handler: a forked child has none of the parent's threads
_WORKERS: "weakref.WeakSet[DeliveryWorker]" = weakref.WeakSet()


class _Job:
    """One unit of delivery, in order: ``batch`` (Metric/Param/RunTag entities), ``create``,
    ``attach``, ``inputs``, ``eval`` (dicts as in the outbox records), ``report`` or ``end``."""

    __slots__ = ("seq", "kind", "data")

    def __init__(self, seq: int, kind: str, data) -> None:
        self.seq, self.kind, self.data = seq, kind, data

    def entries(self) -> int:
        """Metric points, params and tags this job carries (an eval: its metrics and its tag)."""
        if self.kind == "batch":
            return len(self.data)
        return len(self.data["metrics"]) + 1 if self.kind == "eval" else 0

    def records(self) -> list[dict]:
        if self.kind == "batch":
            return outbox.entity_records(metric_entities(self.data))
        if self.kind == "report":
            return [{"report": True}]
        return [{self.kind: list(self.data) if self.kind == "end" else self.data}]


class _Tracked:
    """The client, with every call timed: the logger knows how long the current request has waited."""

    def __init__(self, client, owner: "DeliveryWorker") -> None:
        self._client, self._owner = client, owner

    def __getattr__(self, name):
        attr = getattr(self._client, name)
        if not callable(attr):
            return attr

        def call(*args, **kwargs):
            self._owner._in_flight_since = time.monotonic()
            try:
                return attr(*args, **kwargs)
            finally:
                self._owner._in_flight_since = None

        return call


class DeliveryWorker:
    """The queue, the delivery thread, the bounded waits and the spill of a ``RunLogger`` (see the
    module docstring); ``RunLogger`` calls :meth:`_start_delivery` in its constructor.

    Attributes:
        quiet: True for a writer whose caller says on the terminal what was kept
            (:class:`~mlflow_llmeff.tracking.writer.RunWriter`): its lines go to the log at INFO only.
    """

    quiet = False

    def _start_delivery(self, client, run_id: str, *, outbox_dir: str | None, wait_s: float | None,
                        local_id: str | None, unanswered: str | None) -> None:
        """Set the delivery state: the timed client, the outbox folder, the wait (``wait_s``, default
        ``LLMEFF_DELIVERY_WAIT_S``), the local id, an empty queue, the server down when ``unanswered``.

        Raises:
            ValueError: when ``LLMEFF_DELIVERY_WAIT_S`` is not a number >= 0 (``wait_s`` None).
        """
        self._c = _Tracked(client, self)
        self.outbox_dir = outbox_dir or outbox.default_outbox_dir()
        self._wait_s = delivery.delivery_wait_s() if wait_s is None else float(wait_s)
        self._local_id = local_id or (run_id if outbox.is_local_id(run_id) else None)
        self.spilled_to: str | None = None  # the outbox file holding what the server has not taken
        self.eval_step: int | None = None  # the step an ``eval`` record was logged at, once delivered
        # The delivery queue: jobs in order; the first may be in flight. _done is the last delivered seq.
        self._cv = threading.Condition()
        self._queue: list[_Job] = []
        self._seq = self._done = 0
        self._courier: threading.Thread | None = None
        self._idle = False  # the delivery thread waits on the empty queue: a new job wakes it
        self._retiring = False  # closed with everything delivered: the thread exits once the queue is empty
        self._threads_started = 0  # delivery threads this worker started (a test counts them)
        self._in_flight_since: float | None = None  # monotonic start of the request in flight
        self._down_since: float | None = None  # unix time the server stopped answering (None: it answers)
        self._down_mono: float | None = None  # the same on the monotonic clock: the start of the unanswered request
        self._down_reason = ""
        self._outage: tuple[float, str] | None = None  # (unix start, reason) of an outage not yet in the warning tag
        self._closing = False  # the end is spilled: the delivery thread stops
        if unanswered:
            self._down_since, self._down_mono, self._down_reason = time.time(), time.monotonic(), unanswered
        _WORKERS.add(self)

    # ------------------------------------------------------------------ bounded reads
    def _read(self, fn, what: str):
        """``fn()`` now: within ``wait_s`` for a tracking server (the server is marked down when it
        does not answer, so later waits are skipped), directly for a local store."""
        if not delivery.is_server(_tracking_uri(self.client)):
            return fn()
        try:
            return delivery.bounded(fn, self._wait_s, what)
        except delivery.NoAnswer as e:
            self._went_down(e)
            raise

    # ------------------------------------------------------------------ the delivery thread
    def _enqueue(self, kind: str, data) -> None:
        if kind == "batch" and not data:
            return
        with self._cv:
            self._seq += 1
            self._queue.append(_Job(self._seq, kind, data))
            self._retiring = False
            closing = self._closing
            if closing:
                pass
            elif self._courier is not None and self._courier.is_alive():  # it exits under this lock, setting None
                if self._idle:
                    self._idle = False
                    self._cv.notify_all()
            else:
                try:
                    self._courier = threading.Thread(target=self._deliver_all, name="llmeff-delivery", daemon=True)
                    self._courier.start()
                    self._threads_started += 1
                except RuntimeError:  # the interpreter is shutting down: the outbox file keeps it
                    self._courier = None
        if closing:  # the end was spilled: what comes after it goes straight to the file
            self._spill()

    def _enqueue_record(self, rec: dict) -> None:
        if any(k in rec for k in ("m", "p", "t")):
            self._enqueue("batch", [outbox.entity(rec)])
        else:
            kind = next(iter(rec))
            self._enqueue(kind, None if kind == "report" else rec[kind])

    def _deliver_all(self) -> None:
        """Delivery thread: deliver jobs in order, backing off 1, 2, 4, 8, 10 s while the server does not answer."""
        delay = 1.0
        while True:
            with self._cv:
                if not self._await_job():
                    self._courier = None
                    self._idle = False
                    return
                job = self._queue[0]
            if self._deliver(job):
                with self._cv:
                    if self._queue and self._queue[0] is job:
                        self._queue.pop(0)
                    self._done = max(self._done, job.seq)
                    empty = not self._queue
                    self._cv.notify_all()
                self._answered(empty)
                delay = 1.0
                continue
            until = time.monotonic() + delay
            with self._cv:
                while not self._closing and (left := until - time.monotonic()) > 0:
                    self._cv.wait(left)  # a new job does not shorten the back-off; a close ends it
            delay = min(10.0, delay * 2)

    def _await_job(self) -> bool:
        """Under ``_cv``: wait while the queue is empty, at most ``IDLE_S`` and not after a close;
        True when a job is first in line."""
        if self._closing:
            return False
        if self._queue:
            return True
        until = time.monotonic() + IDLE_S
        while not self._queue and not self._closing and not self._retiring:
            left = until - time.monotonic()
            if left <= 0:
                return False
            self._idle = True
            self._cv.wait(left)
        self._idle = False
        return bool(self._queue) and not self._closing

    def _retire(self) -> None:
        """Everything is delivered and the run closed: the delivery thread exits now rather than after
        ``IDLE_S`` (a later job starts a new one)."""
        with self._cv:
            self._retiring = True
            self._cv.notify_all()

    def _deliver(self, job: _Job) -> bool:
        """One delivery attempt of ``job``; False when the server did not take it (it stays first in line)."""
        try:
            if job.kind == "batch":
                return self._deliver_batch(job)
            if job.kind == "create":
                if outbox.is_local_id(self.run_id):
                    self._created(outbox.create_run(self._c, job.data, self._local_id))
            elif outbox.is_local_id(self.run_id):
                raise RuntimeError(f"run {self.run_id} has no creation record")  # pragma: no cover - never queued so
            elif job.kind == "attach":
                outbox.attach_run(self._c, self.run_id, job.data)
            elif job.kind == "name":
                outbox.name_run(self._c, self.run_id, job.data)
            elif job.kind == "inputs":
                outbox.log_inputs(self._c, self.run_id, job.data)
            elif job.kind == "eval":
                self.eval_step = outbox.log_eval(self._c, self.run_id, job.data)
            elif job.kind == "table":
                outbox.log_table(self._c, self.run_id, job.data)
            elif job.kind == "file":
                outbox.log_file(self._c, self.run_id, job.data)
            elif job.kind == "text":
                outbox.log_text(self._c, self.run_id, job.data)
            elif job.kind == "files":
                outbox.log_files(self._c, self.run_id, job.data)
            elif job.kind == "report":
                outbox.log_report(self._c, self.run_id)
            elif job.kind == "end":
                self._c.set_terminated(self.run_id, job.data[0], end_time=int(job.data[1]))
            return True
        except Exception as e:  # noqa: BLE001
            if _blames_entry(e):  # refused for what it says, not for an outage: sending it again will not help
                self._note((f"{job.kind} rejected by MLflow ({_reason(e)})",))
                return True
            self._warn(e)
            self._went_down(e)
            return False

    def _deliver_batch(self, job: _Job) -> bool:
        job.data = metric_entities(job.data)  # the logger's points become Metric entities here, off the training thread
        try:
            self._log_batch(job.data)
            return True
        except Exception as e:  # noqa: BLE001
            error = e
        if not _blames_entry(error):
            self._warn(error)
            self._went_down(error)
            return False
        rest = self._recover(job.data, error)
        if rest:
            job.data = rest  # an outage in the middle: the rest waits
            return False
        self._write_problems()
        return True

    def _created(self, run_id: str) -> None:
        """The server created the local run: log into ``run_id`` from now on, and say so."""
        local = self._local_id
        self.run_id = run_id
        outbox.remember_run_id(self.outbox_dir, local, run_id)
        msg = f"mlflow_llmeff: the tracking server answered: local run {local} is MLflow run {run_id}"
        log.info(msg)  # printed, not also warned: a terminal would show it twice
        if not self.quiet:
            print(msg, flush=True)

    def _log_batch(self, entries: list):
        """One ``log_batch`` call carrying ``entries`` (Metric, Param and RunTag mixed)."""
        from mlflow.entities import Metric, Param

        return self._c.log_batch(
            self.run_id,
            metrics=[e for e in entries if isinstance(e, Metric)],
            params=[e for e in entries if isinstance(e, Param)],
            tags=[e for e in entries if not isinstance(e, (Metric, Param))],
            synchronous=True)

    def _recover(self, entries: list, error: Exception) -> list:
        """Deliver what can be delivered of a batch that MLflow rejected with ``error`` (blaming an entry).

        The batch is sent again in halves, down to single entries; an entry that fails alone is
        named in ``llmeff.logging.warnings``. Returns the entries not sent because the server
        stopped answering in the middle (empty when done).
        """
        if len(entries) == 1:
            self._note((f"{_describe(entries[0])} rejected by MLflow ({_reason(error)})",))
            return []
        queue = deque(_halves(entries))
        while queue:
            part = queue.popleft()
            if not part:
                continue
            try:
                self._log_batch(part)
            except Exception as e:  # noqa: BLE001
                if not _blames_entry(e):
                    self._warn(e)
                    self._went_down(e)
                    return [x for p in (part, *queue) for x in p]
                if len(part) == 1:
                    self._note((f"{_describe(part[0])} rejected by MLflow ({_reason(e)})",))
                else:
                    queue.extendleft(reversed(_halves(part)))
        return []

    def _went_down(self, error: Exception, since_mono: float | None = None) -> None:
        """The server did not answer (``since_mono``: since when, on the monotonic clock; default now)."""
        if self._down_since is None:
            ago = time.monotonic() - since_mono if since_mono is not None else 0.0
            self._down_since, self._down_mono = time.time() - ago, time.monotonic() - ago
            self._down_reason = _reason(error)
            if self._outage is None:
                self._outage = (self._down_since, self._down_reason)
            log.log(logging.INFO if self.quiet else logging.WARNING,
                    "mlflow_llmeff: the tracking server is not answering (%s); training goes on, points are "
                    "held and sent when it answers (outbox: %s)", self._down_reason, self.outbox_dir)

    def _answered(self, empty: bool) -> None:
        """A delivery succeeded: the server answers again; once the queue is empty after an outage, the
        outage goes into the warning tag."""
        self._down_since = self._down_mono = None
        if empty and self._outage is not None:
            start, reason = self._outage
            self._outage = None
            since = time.strftime("%H:%M:%S", time.gmtime(start))
            self._note((f"the tracking server did not answer from {since} UTC ({reason}) for "
                        f"{time.time() - start:.0f} s; every held point was delivered after",))
            self._write_problems()

    # ------------------------------------------------------------------ waiting and the outbox file
    def held_count(self) -> int:
        """Entries (metrics, params, tags) not yet confirmed by the tracking server."""
        with self._cv:
            return sum(j.entries() for j in self._queue) + len(self._buffer)

    def _wait(self, *, while_down: bool, spill_after: float | None = None) -> bool:
        """Wait until every job handed over is delivered; True when it is.

        Gives up when a request has waited ``wait_s`` for its answer (the server is then marked
        down since that request began), at once when the server is known down (unless
        ``while_down``: then ``wait_s`` after the server stopped answering or after this wait began,
        whichever is earlier, so one outage costs one wait). After ``spill_after`` seconds the outbox
        file is written (so a kill during the rest of the wait loses nothing).
        """
        start = time.monotonic()
        spilled = False
        while True:
            with self._cv:
                if self._done >= self._seq:
                    return True
                if self._courier is None:  # it could not start (interpreter shutdown) or stopped
                    return False
                self._cv.wait(0.05)
            now = time.monotonic()
            if spill_after is not None and not spilled and now - start >= spill_after:
                spilled = bool(self._spill())
            flight = self._in_flight_since
            if flight is not None and now - flight >= self._wait_s:
                self._went_down(delivery.NoAnswer(f"no answer to a request within {self._wait_s:g} s ({WAIT_ENV})"),
                                since_mono=flight)
            down = self._down_mono
            if down is not None and (not while_down or now - min(start, down) >= self._wait_s):
                return False
            if self._wait_s <= 0:
                return False

    def outbox_path(self, run_id: str | None = None) -> str:
        """The file this run's undelivered entries spill to: ``<outbox_dir>/<run_id>.jsonl``."""
        return os.path.join(self.outbox_dir, f"{run_id or self.run_id}.jsonl")

    def _spill(self) -> int:
        """Write every job not yet delivered to :meth:`outbox_path`, replacing it; remove the file when
        nothing is left. Returns the entries (metrics, params, tags) written."""
        with self._cv:
            jobs = list(self._queue)
            run_id = self.run_id
        records = [r for j in jobs for r in j.records()]
        path = self.outbox_path(run_id)
        if self._local_id and run_id != self._local_id and os.path.exists(self.outbox_path(self._local_id)):
            os.remove(self.outbox_path(self._local_id))  # spilled before the run had its id
        if not records:
            if os.path.exists(path):
                os.remove(path)
            self.spilled_to = None
            return 0
        outbox.write_outbox(path, run_id, records, local_id=self._local_id)
        self.spilled_to = path
        return sum(j.entries() for j in jobs)

    # ------------------------------------------------------------------ the end
    def _stop_and_say(self, status: str | None) -> None:
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        n = self._spill()
        if not self.spilled_to:
            return
        run = (f"local run {self.run_id} (not created on the server yet)" if outbox.is_local_id(self.run_id)
               else f"run {self.run_id}")
        if n:
            left = f"{n} entries of {run}; they and its end ({status}) are" if status else f"{n} entries of {run}; they are"
        else:
            left = f"the end ({status}) of {run}; it is" if status else f"all of {run}; the rest is"
        msg = (f"mlflow_llmeff: the tracking server did not take {left} in {self.spilled_to}: "
               f"run `llmeff sync {self.outbox_dir}` when it answers")
        log.info(msg)  # printed, not also warned: a terminal would show it twice
        if not self.quiet:
            print(msg, flush=True)

    def _say_local(self) -> None:
        why = self._down_reason or "the tracking server has not created this run yet"
        if not why.startswith("the tracking server"):
            why = f"the tracking server did not create the run ({why})"
        msg = (f"mlflow_llmeff: {why}; training goes on as local run {self.run_id}: its creation and every point "
               f"wait in {self.outbox_dir} and are sent when the server answers, or by `llmeff sync {self.outbox_dir}`")
        log.info(msg)  # printed, not also warned: a terminal would show it twice
        if not self.quiet:
            print(msg, flush=True)


def _after_fork_in_child() -> None:
    """In a forked child: no delivery thread runs (only the forking thread survives a fork), and the
    parent's lock may have been held by one; each worker gets a fresh lock and starts its own thread
    at its next job."""
    for w in list(_WORKERS):
        w._cv = threading.Condition()
        w._courier = None
        w._idle = False
        w._in_flight_since = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _tracking_uri(client) -> str | None:
    """The tracking URI ``client`` talks to (MLflow's current one when it does not say)."""
    import mlflow

    uri = getattr(getattr(client, "_tracking_client", None), "tracking_uri", None)
    return uri if isinstance(uri, str) else mlflow.get_tracking_uri()


def metric_entities(entries: list) -> list:
    """``entries`` with every point ``(key, value, timestamp ms, step)`` that
    :meth:`~mlflow_llmeff.tracking.logger.RunLogger.log_metrics` buffered made the ``mlflow.entities.Metric``
    of those four fields (on the delivery thread); entities (Metric, Param, RunTag) stay as they are."""
    from mlflow.entities import Metric

    return [Metric(*e) if type(e) is tuple else e for e in entries]


def _halves(entries: list) -> list[list]:
    mid = len(entries) // 2
    return [entries[:mid], entries[mid:]]


def _blames_entry(error: Exception) -> bool:
    """True when MLflow said the request itself is invalid (so one entry may be to blame)."""
    return getattr(error, "error_code", None) in _ENTRY_ERRORS


def _describe(entry) -> str:
    from mlflow.entities import Metric, Param

    if isinstance(entry, Metric):
        return f"metric {entry.key!r} at step {entry.step}"
    return f"{'param' if isinstance(entry, Param) else 'tag'} {entry.key!r}"


def _reason(error: Exception) -> str:
    """First line of ``error``'s message, at most 200 characters."""
    msg = str(getattr(error, "message", None) or error).strip().splitlines()
    text = f"{type(error).__name__}: {msg[0] if msg else ''}"
    return shorten(text, 200)
