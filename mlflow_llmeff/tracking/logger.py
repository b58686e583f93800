"""Rank-0 MLflow logger: batched, asynchronous, resume-aware, and never fatal to training.

Only the main process constructs an active logger (others get :class:`NullLogger`). Metrics are
buffered in memory and sent at most every ``send_interval_s`` seconds as one
``MlflowClient.log_batch(..., synchronous=False)`` call, MLflow's own async queue, so neither a
slow tracking server nor the store's per-call cost (several ms of Python under the GIL for a
sqlite store) lands on a training step; :meth:`RunLogger.flush` sends and waits (the training
loop calls it before every checkpoint, so a checkpoint never outruns its metrics) and
:meth:`RunLogger.close` flushes. On resume the logger learns the last point of each key and drops
points at or before its step, so a replayed step is never logged twice.

Nothing is lost to one bad entry. Every metric, tag and param is checked against MLflow's own rules
first (:mod:`mlflow_llmeff.tracking.keys`): a key MLflow refuses is mapped to one it accepts, an
over-long value is shortened, a metric value that is not a number is dropped, and the tag
``llmeff.logging.warnings`` says which. A batch the store still rejects is sent again in halves,
down to single entries, so only the entries that fail on their own are lost, and they are named in
the same tag. Secrets never land: values of secret-looking names, environment secrets and URI
user-info are masked first (:mod:`mlflow_llmeff.tracking.redact`). A logging failure warns once
and training goes on (accelerate's tracker does the same).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import warnings
from collections import deque

from .. import names
from . import keys, redact

log = logging.getLogger(__name__)

# MLflow error codes that blame an entry of the request; any other failure (store unreachable, run
# deleted, ...) is not retried entry by entry: MLflow's HTTP client already retried the request with
# backoff, and splitting it would only multiply that wait.
_ENTRY_ERRORS = frozenset({"INVALID_PARAMETER_VALUE", "BAD_REQUEST"})
_MAX_PROBLEMS = 1000  # problems remembered for the warning tag; later new ones are only counted


class NullLogger:
    """What non-main ranks hold: every call is a no-op."""

    run_id: str | None = None
    last_timestamp_s: float | None = None

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:  # noqa: D102
        pass

    def set_tags(self, tags: dict[str, str], *, synchronous: bool = True) -> None:  # noqa: D102
        pass

    def log_params(self, params: dict[str, str]) -> dict[str, tuple[str, str]]:  # noqa: D102
        return {}

    def set_synchronous(self, synchronous: bool = True) -> None:  # noqa: D102
        pass

    def last_logged_step(self, key: str) -> int:  # noqa: D102
        return -1

    def last_point(self, key: str) -> tuple[int, float, int] | None:  # noqa: D102
        return None

    def flush(self) -> None:  # noqa: D102
        pass

    def close(self, status: str = "FINISHED") -> None:  # noqa: D102
        pass

    def settle(self, status: str) -> bool:  # noqa: D102
        return True


class RunLogger(NullLogger):
    """Logs to one MLflow run from the main process.

    Args:
        run_id: the MLflow run to log into (it must exist).
        client: an ``mlflow.MlflowClient``; a new one (current tracking URI) when None.
        resume: True when continuing a run; then points at or before each key's last logged step
            are dropped, and :meth:`last_point` gives each key's newest point.
        send_interval_s: the least time between two sends of the metric buffer, in seconds.
        clock: monotonic clock in seconds (injected by tests).
    """

    def __init__(self, run_id: str, client=None, *, resume: bool = False, send_interval_s: float = 5.0,
                 clock=time.monotonic, outbox_dir: str | None = None, wait_s: float | None = None) -> None:
        from mlflow import MlflowClient

        self.run_id = run_id
        self.client = client or MlflowClient()
        self._warned = False
        self._synchronous = False
        self._last_step: dict[str, int] = {}
        self._last_point: dict[str, tuple[int, float, int]] = {}
        self._pending: list[tuple[object, list]] = []  # (RunOperations, the entries it carries)
        self._buffer: list = []  # mlflow.entities.Metric not yet sent
        self._ok_keys: set[str] = set()  # metric keys already checked and accepted unchanged
        self._problems: dict[str, None] = {}  # ordered set of problem lines for the warning tag
        self._problems_unlisted = 0  # new problems beyond _MAX_PROBLEMS
        self._problems_dirty = False  # the warning tag is behind _problems
        self._outage = False  # a failure that blamed no entry happened since the tag was last due
        self._clock = clock
        self._send_interval_s = send_interval_s
        self._last_send = clock()
        self.last_timestamp_s: float | None = None  # newest metric point before this attempt (unix s)
        # The outbox: entries the server has not confirmed, sent again by a background thread.
        self.outbox_dir = outbox_dir or default_outbox_dir()
        self._wait_s = float(os.environ.get(WAIT_ENV, "30")) if wait_s is None else float(wait_s)
        self._held: list[tuple[object, list]] = []  # (async operation still in flight or None, entries)
        self._lock = threading.Lock()
        self._down_since: float | None = None  # unix time the server stopped answering (None: up)
        self._prober: threading.Thread | None = None
        self._closing = False
        if resume:
            self._deliver_own_outbox()
            self._learn_history()

    def _learn_history(self) -> None:
        """Remember each key's newest point (largest step, then latest timestamp) before this attempt."""
        try:
            run_metrics = self.client.get_run(self.run_id).data.metrics
        except Exception as e:  # noqa: BLE001
            self._warn(e)
            return
        for key in run_metrics:
            try:
                hist = self.client.get_metric_history(self.run_id, key)
            except Exception as e:  # noqa: BLE001
                self._warn(e)
                continue
            if not hist:
                self._last_step[key] = -1
                continue
            newest = max(hist, key=lambda m: (m.step, m.timestamp))
            self._last_step[key] = newest.step
            self._last_point[key] = (newest.step, newest.value, newest.timestamp)
            latest_s = max(m.timestamp for m in hist) / 1000
            self.last_timestamp_s = max(self.last_timestamp_s or 0.0, latest_s)

    def _warn(self, e: Exception) -> None:
        if not self._warned:
            self._warned = True
            warnings.warn(f"mlflow_llmeff: MLflow logging failed ({type(e).__name__}: {e}); training continues", stacklevel=3)
        log.debug("logging failure", exc_info=e)

    def set_synchronous(self, synchronous: bool = True) -> None:
        """From now on send every batch with ``synchronous=True`` (or go back to async with False).

        Needed when finishing at interpreter exit: MLflow ends open runs in an ``atexit`` handler,
        when its asynchronous logging thread pool may already be shut down.
        """
        self._synchronous = synchronous

    def last_logged_step(self, key: str) -> int:
        """Last step ``key`` was logged at before this attempt (-1 when never)."""
        return self._last_step.get(key, -1)

    def last_point(self, key: str) -> tuple[int, float, int] | None:
        """Newest point of ``key`` before this attempt (resume only), else None.

        Returns:
            ``(step, value, timestamp in ms since the epoch)`` of the point with the largest step
            (latest timestamp among equal steps), e.g. to continue a cumulative total.
        """
        return self._last_point.get(key)

    # ------------------------------------------------------------------ metrics
    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Queue metrics at ``step``; send the buffer when ``send_interval_s`` has passed.

        Keys MLflow refuses are mapped (:func:`~mlflow_llmeff.tracking.keys.safe_key`), values that
        are not real numbers are dropped, both noted in ``llmeff.logging.warnings``. NaN and +/-inf
        are logged (a diverged loss must show). After a resume, a point at or before the step its
        (mapped) key was last logged at is dropped.
        """
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        ok = self._ok_keys
        try:
            for k, v in metrics.items():
                if k in ok and type(v) in (float, int) and type(step) is int:  # fast path: a key checked before
                    if step > self._last_step.get(k, -1):
                        self._buffer.append(Metric(k, float(v), ts, step))
                    continue
                checked = keys.check_metric(k, v, step)
                self._note(checked.problems)
                if checked.key is not None and not checked.problems and checked.key == k:
                    ok.add(k)
                if checked.key is not None and int(step) > self._last_step.get(checked.key, -1):
                    self._buffer.append(Metric(checked.key, checked.value, ts, int(step)))
        except Exception as e:  # noqa: BLE001 - e.g. metrics not a mapping: never fatal
            self._warn(e)
        if self._clock() - self._last_send >= self._send_interval_s:
            self._send()

    def _send(self) -> None:
        """Send the buffered metrics (batches of at most ``MAX_METRICS_PER_BATCH``) and new problems."""
        from mlflow.utils.validation import MAX_METRICS_PER_BATCH

        self._last_send = self._clock()
        self._reap()
        buf, self._buffer = self._buffer, []
        for i in range(0, len(buf), MAX_METRICS_PER_BATCH):
            self._submit(buf[i:i + MAX_METRICS_PER_BATCH], synchronous=self._synchronous)
        self._write_problems()

    # ------------------------------------------------------------------ tags and params
    def set_tags(self, tags: dict[str, str], *, synchronous: bool = True) -> None:
        """Set tags (values converted with ``str``), in batches of at most 100.

        ``synchronous=False`` queues them with MLflow's asynchronous logging (for tags set from
        inside a training step); :meth:`flush` waits for them.

        A key MLflow refuses is mapped, a value over ``MAX_TAG_VAL_LENGTH`` (8000 characters) is
        shortened, both noted in ``llmeff.logging.warnings``; every other tag lands unchanged.
        """
        from mlflow.entities import RunTag

        try:
            entries = {}
            secrets = redact.environment_secrets()
            for k, v in tags.items():
                checked = keys.check_tag(k, redact.clean(str(k), str(v), secrets))
                self._note(checked.problems)
                if checked.key is not None:
                    self._note_collision("tag", k, checked.key, entries)
                    entries[checked.key] = RunTag(checked.key, checked.value)
        except Exception as e:  # noqa: BLE001
            self._warn(e)
            return
        self._submit_chunked(list(entries.values()), synchronous=synchronous or self._synchronous)
        self._write_problems()

    def log_params(self, params: dict[str, str]) -> dict[str, tuple[str, str]]:
        """Log params not yet on the run; never re-log one with a new value.

        Keys and values are checked like tags (value limit ``MAX_PARAM_VAL_LENGTH``, 6000 characters)
        and sent in batches of at most 100.

        Returns:
            ``{name: (logged value, new value)}`` for params that already had another value (they
            keep the logged value; the caller records them in a tag). ``name`` is as given.
        """
        from mlflow.entities import Param

        try:
            existing = self.client.get_run(self.run_id).data.params
            changed, entries = {}, {}
            secrets = redact.environment_secrets()
            for k, v in params.items():
                checked = keys.check_param(k, redact.clean(str(k), str(v), secrets))
                self._note(checked.problems)
                if checked.key is None:
                    continue
                if checked.key in existing:
                    if _same_param(existing[checked.key]) != _same_param(checked.value):
                        changed[k] = (existing[checked.key], checked.value)
                    continue
                self._note_collision("param", k, checked.key, entries)
                entries[checked.key] = Param(checked.key, checked.value)
        except Exception as e:  # noqa: BLE001
            self._warn(e)
            return {}
        self._submit_chunked(list(entries.values()))
        self._write_problems()
        return changed

    def _note_collision(self, kind: str, given, key: str, entries: dict) -> None:
        if key in entries:
            self._note((f"{kind} {given!r} and another {kind} both map to {key!r}; the last one given is kept",))

    def _submit_chunked(self, entries: list, synchronous: bool = True) -> None:
        """Send tags or params, ``MAX_PARAMS_TAGS_PER_BATCH`` (100) per call."""
        from mlflow.utils.validation import MAX_PARAMS_TAGS_PER_BATCH

        for i in range(0, len(entries), MAX_PARAMS_TAGS_PER_BATCH):
            self._submit(entries[i:i + MAX_PARAMS_TAGS_PER_BATCH], synchronous=synchronous)

    # ------------------------------------------------------------------ sending and recovery
    def _log_batch(self, entries: list, synchronous: bool):
        """One ``log_batch`` call carrying ``entries`` (Metric, Param and RunTag mixed)."""
        from mlflow.entities import Metric, Param

        return self.client.log_batch(
            self.run_id,
            metrics=[e for e in entries if isinstance(e, Metric)],
            params=[e for e in entries if isinstance(e, Param)],
            tags=[e for e in entries if not isinstance(e, (Metric, Param))],
            synchronous=synchronous)

    def _submit(self, entries: list, *, synchronous: bool) -> None:
        """Send ``entries`` in one call; remember an async operation with its entries for :meth:`flush`.

        While the tracking server is down, entries go straight to the outbox (no call, no wait).
        """
        if not entries:
            return
        if self._down_since is not None:
            self._hold(None, entries)
            return
        try:
            op = self._log_batch(entries, synchronous)
        except Exception as e:  # noqa: BLE001
            # an async call that fails at once (its thread pool is shut down) is retried whole first
            self._recover(entries, e, resend_whole=not synchronous)
            return
        if not synchronous and op is not None:
            self._pending.append((op, entries))

    def _reap(self) -> None:
        """Forget async operations that have finished (retrying failed ones), so memory stays bounded.

        Looks at ``RunOperations._operation_futures`` (MLflow 3 internals); without it, operations
        are kept until :meth:`flush`.
        """
        still = []
        for op, entries in self._pending:
            futures = getattr(op, "_operation_futures", None)
            if futures is None or not all(f.done() for f in futures):
                still.append((op, entries))
                continue
            try:
                op.wait()  # finished: returns or raises at once
            except Exception:  # noqa: BLE001 - resent whole (then in halves) by the outbox thread
                self._hold(None, entries)
        self._pending = still

    def _recover(self, entries: list, error: Exception, *, resend_whole: bool) -> None:
        """Deliver what can be delivered of a batch that failed with ``error``.

        The batch is sent again synchronously in halves, down to single entries; an entry that
        fails alone is named in ``llmeff.logging.warnings``. ``resend_whole`` first resends the
        whole batch (an async failure reaches us wrapped, without MLflow's error code). A failure
        that does not blame an entry stops the retry: the rest goes to the outbox.
        """
        if self._down_since is not None and not _blames_entry(error):
            self._hold(None, entries)
            return
        if resend_whole:
            queue = deque([entries])
        elif _blames_entry(error):
            queue = deque(_halves(entries)) if len(entries) > 1 else deque()
            if len(entries) == 1:
                self._note((f"{_describe(entries[0])} rejected by MLflow ({_reason(error)})",))
        else:
            self._lost(entries, error)
            return
        while queue:
            part = queue.popleft()
            try:
                self._log_batch(part, synchronous=True)
            except Exception as e:  # noqa: BLE001
                if not _blames_entry(e):
                    self._lost([x for p in (part, *queue) for x in p], e)
                    return
                if len(part) == 1:
                    self._note((f"{_describe(part[0])} rejected by MLflow ({_reason(e)})",))
                else:
                    queue.extendleft(reversed(_halves(part)))

    def _lost(self, entries: list, error: Exception) -> None:
        """The store failed without blaming an entry: the server is down; hold ``entries`` in the outbox."""
        self._warn(error)
        self._outage = True  # the store is failing: leave the warning tag for the next send
        self._went_down(error)
        self._hold(None, entries)

    # ------------------------------------------------------------------ the outbox
    def _went_down(self, error: Exception) -> None:
        if self._down_since is None:
            self._down_since = time.time()
            self._down_reason = _reason(error)
            log.warning("mlflow_llmeff: the tracking server is not answering (%s); training goes on, points are "
                        "held and sent when it answers (outbox: %s)", self._down_reason, self.outbox_dir)

    def _hold(self, op, entries: list) -> None:
        """Keep ``entries`` (and the async ``op`` that may still deliver them) for the outbox thread."""
        with self._lock:
            self._held.append((op, entries))
            if self._prober is None or not self._prober.is_alive():
                self._prober = threading.Thread(target=self._probe, name="llmeff-outbox", daemon=True)
                self._prober.start()

    def _probe(self) -> None:
        """Outbox thread: deliver held entries in order, backing off 1, 2, 4, 8, 10 s while the server is down."""
        delay = 1.0
        while True:
            with self._lock:
                if not self._held:
                    self._prober = None
                    self._back_up()
                    return
                op, entries = self._held[0]
            if self._deliver(op, entries):
                with self._lock:
                    self._held.pop(0)
                delay = 1.0
                continue
            if self._closing:
                return  # close() spills what is left
            time.sleep(delay)
            delay = min(10.0, delay * 2)

    def _deliver(self, op, entries: list) -> bool:
        """One delivery attempt: wait for ``op`` if it is still in flight, else send ``entries`` synchronously.

        Returns False when the server did not answer (the entries stay held).
        """
        if op is not None:
            try:
                op.wait()
                return True
            except Exception:  # noqa: BLE001 - failed in flight: send ourselves
                pass
        try:
            self._log_batch(entries, synchronous=True)
            return True
        except Exception as e:  # noqa: BLE001
            if _blames_entry(e):
                self._recover(entries, e, resend_whole=False)  # halves; a later outage re-holds the rest
                return True
            self._warn(e)
            self._went_down(e)
            return False

    def _back_up(self) -> None:
        """Called with the lock held when the outbox is empty again."""
        if self._down_since is not None:
            since = time.strftime("%H:%M:%S", time.gmtime(self._down_since))
            self._note((f"the tracking server did not answer from {since} UTC ({self._down_reason}) for "
                        f"{time.time() - self._down_since:.0f} s; every held point was delivered after",))
            self._down_since = None

    def outbox_path(self) -> str:
        """The file this run's undelivered entries spill to: ``<outbox_dir>/<run_id>.jsonl``."""
        return os.path.join(self.outbox_dir, f"{self.run_id}.jsonl")

    def _spill(self, end: tuple[str, int] | None = None) -> int:
        """Write every held entry (and ``end`` = (status, end time ms)) to :meth:`outbox_path`, replacing
        it; remove the file when nothing is held. Returns the entries written."""
        with self._lock:
            entries = [e for _, batch in self._held for e in batch]
        path = self.outbox_path()
        if not entries and end is None:
            if os.path.exists(path):
                os.remove(path)
            return 0
        write_outbox(path, self.run_id, entries, end)
        return len(entries)

    def _deliver_own_outbox(self) -> None:
        """On resume: send what an earlier attempt of this run left in the outbox (not its end record)."""
        path = self.outbox_path()
        if os.path.exists(path):
            try:
                n, _ = deliver_outbox_file(path, self.client, terminate=False)
                log.info("mlflow_llmeff: delivered %d entries an earlier attempt left in %s", n, path)
            except Exception as e:  # noqa: BLE001 - kept for llmeff sync
                self._warn(e)

    def held_count(self) -> int:
        """Entries waiting in the outbox (not yet confirmed by the tracking server)."""
        with self._lock:
            return sum(len(b) for _, b in self._held)

    def _wait_for_outbox(self, deadline: float, *, while_down: bool = False) -> None:
        """Wait until the outbox is empty or ``deadline``; stop early when the server is down unless ``while_down``."""
        while self.held_count() and (while_down or self._down_since is None) and time.monotonic() < deadline:
            time.sleep(0.05)

    # ------------------------------------------------------------------ the warning tag
    def _note(self, problems: tuple[str, ...]) -> None:
        """Record problem lines (once each) for ``llmeff.logging.warnings``."""
        for p in problems:
            if p in self._problems:
                continue
            log.warning("mlflow_llmeff: %s", p)
            if len(self._problems) < _MAX_PROBLEMS:
                self._problems[p] = None
            else:
                self._problems_unlisted += 1
            self._problems_dirty = True

    def warnings_text(self) -> str:
        """The value of ``llmeff.logging.warnings``: problems joined by ``'; '``, at most 8000 characters."""
        from mlflow.utils.validation import MAX_TAG_VAL_LENGTH

        lines = list(self._problems)
        ends = [0]  # ends[n]: length of the first n lines joined by "; "
        for i, line in enumerate(lines):
            ends.append(ends[-1] + len(line) + (2 if i else 0))
        for n in range(len(lines), -1, -1):  # the most lines that fit beside the "more" note
            left_out = len(lines) - n + self._problems_unlisted
            note = [f"{left_out} more not listed (see the training log)"] if left_out else []
            if ends[n] + sum(len(x) + 2 for x in note) <= MAX_TAG_VAL_LENGTH:
                return "; ".join(lines[:n] + note)
        return ""  # pragma: no cover - the note alone always fits

    def _write_problems(self) -> None:
        """Set ``llmeff.logging.warnings`` when a problem was found since it was last set."""
        if self._outage or self._down_since is not None:  # no second failing call (each may wait out HTTP retries)
            self._outage = False
            return
        if not self._problems_dirty:
            return
        from mlflow.entities import RunTag

        self._problems_dirty = False
        try:
            self._log_batch([RunTag(names.LOGGING_WARNINGS, self.warnings_text())], synchronous=True)
        except Exception as e:  # noqa: BLE001
            self._warn(e)
            self._problems_dirty = self._outage = True  # try again at the send after next

    # ------------------------------------------------------------------ flush and close
    def flush(self) -> None:
        """Send the buffer and wait until the tracking server has every entry, or spill them to the outbox.

        Waits at most ``wait_s`` (``LLMEFF_DELIVERY_WAIT_S``, default 30 s), and not at all once the
        server is known to be down: then every entry not yet confirmed is written to
        :meth:`outbox_path` (the training loop calls this before every checkpoint, so a checkpoint
        never outruns its metrics: they are on the server or in the outbox file beside it).
        """
        self._send()
        deadline = time.monotonic() + self._wait_s
        pending, self._pending = self._pending, []
        for op, entries in pending:
            if not self._wait_op(op, deadline):
                self._hold(op, entries)  # still in flight: the outbox thread waits for it
                continue
            try:
                op.wait()
            except Exception:  # noqa: BLE001 - resent whole, then in halves, by the outbox thread
                self._hold(None, entries)
        self._wait_for_outbox(deadline)
        self._spill()
        self._write_problems()

    def _wait_op(self, op, deadline: float) -> bool:
        """Wait for an async operation until ``deadline`` (or until the server is known down); True when done."""
        futures = getattr(op, "_operation_futures", None)
        if futures is None:
            return True  # no way to wait with a timeout: op.wait() blocks
        for f in futures:
            while not f.done():
                if self._down_since is not None or time.monotonic() >= deadline:
                    return False
                time.sleep(0.02)
        return True

    def close(self, status: str = "FINISHED") -> None:
        """Flush and mark the run terminated with ``status`` once every entry is delivered.

        When the server does not take everything within ``wait_s``, nothing is lost: the entries and
        the status with this end time are written to :meth:`outbox_path`, and
        ``llmeff sync <outbox dir>`` (or resuming the run) delivers them and ends the run.
        """
        self.flush()
        if not self.settle(status):
            return
        end_ms = int(time.time() * 1000)
        try:
            self.client.set_terminated(self.run_id, status, end_time=end_ms)
        except Exception as e:  # noqa: BLE001
            self.ending_failed(status, end_ms, e)

    def settle(self, status: str) -> bool:
        """Before ending the run with ``status``: wait up to ``wait_s`` for the outbox to empty (the server
        may come back). True when everything is delivered (end the run now); otherwise the entries and
        the ending are written to :meth:`outbox_path`, a line says how to send them, and False."""
        self._wait_for_outbox(time.monotonic() + self._wait_s, while_down=True)
        if not self.held_count():
            self._spill()  # an earlier spill is delivered now: remove its file
            self._write_problems()  # e.g. the outage note made when the server came back
            return True
        self._closing = True
        n = self._spill(end=(status, int(time.time() * 1000)))
        msg = (f"mlflow_llmeff: the tracking server did not take {n} entries of run {self.run_id}; they and its "
               f"end ({status}) are in {self.outbox_path()}: run `llmeff sync {self.outbox_dir}` when it answers")
        log.warning(msg)
        print(msg, flush=True)
        return False

    def ending_failed(self, status: str, end_ms: int, error: Exception) -> None:
        """Ending the run failed (the server went away at the last moment): keep the ending in the outbox."""
        self._warn(error)
        write_outbox(self.outbox_path(), self.run_id, [], (status, end_ms))


def default_outbox_dir() -> str:
    """Where undelivered entries spill without a checkpoint folder: ``$LLMEFF_OUTBOX_DIR`` or
    ``~/.cache/mlflow_llmeff/outbox``."""
    return os.environ.get("LLMEFF_OUTBOX_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "mlflow_llmeff",
                                                               "outbox")


WAIT_ENV = "LLMEFF_DELIVERY_WAIT_S"


def write_outbox(path: str, run_id: str, entries: list, end: tuple[str, int] | None = None) -> None:
    """Write an outbox file atomically: one JSON object per line (``m``: metric key, value, timestamp
    ms, step; ``p``/``t``: param/tag key, value; ``end``: status, end time ms), the run id first."""
    from mlflow.entities import Metric, Param

    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(json.dumps({"run_id": run_id}) + "\n")
        for e in entries:
            if isinstance(e, Metric):
                rec = {"m": [e.key, e.value, e.timestamp, e.step]}
            else:
                rec = {"p" if isinstance(e, Param) else "t": [e.key, e.value]}
            f.write(json.dumps(rec) + "\n")
        if end is not None:
            f.write(json.dumps({"end": list(end)}) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def deliver_outbox_file(path: str, client, *, terminate: bool = True) -> tuple[int, str | None]:
    """Send an outbox file's entries to its run and, with ``terminate``, end the run with the recorded
    status and end time; then delete the file.

    Sending again what the server already has is harmless: a metric point is the same
    (key, value, timestamp, step), which MLflow's SQL stores keep once, and tags and params are set to
    the same values.

    Returns:
        ``(entries sent, status set or None)``.

    Raises:
        ValueError: for a file that is not an outbox file (its first line names no run).
        mlflow.exceptions.MlflowException: when the server refuses or does not answer (the file stays).
    """
    from mlflow.entities import Metric, Param, RunTag
    from mlflow.utils.validation import MAX_METRICS_PER_BATCH, MAX_PARAMS_TAGS_PER_BATCH

    with open(path, encoding="utf-8") as f:
        lines = [json.loads(line) for line in f if line.strip()]
    if not lines or "run_id" not in lines[0]:
        raise ValueError(f"{path} is not an mlflow_llmeff outbox file (no run id on its first line)")
    run_id, metrics, others, end = lines[0]["run_id"], [], [], None
    for rec in lines[1:]:
        if "m" in rec:
            k, v, ts, step = rec["m"]
            metrics.append(Metric(k, float(v), int(ts), int(step)))
        elif "p" in rec:
            others.append(Param(*rec["p"]))
        elif "t" in rec:
            others.append(RunTag(*rec["t"]))
        elif "end" in rec:
            end = rec["end"]
    for i in range(0, len(metrics), MAX_METRICS_PER_BATCH):
        client.log_batch(run_id, metrics=metrics[i:i + MAX_METRICS_PER_BATCH])
    for i in range(0, len(others), MAX_PARAMS_TAGS_PER_BATCH):
        part = others[i:i + MAX_PARAMS_TAGS_PER_BATCH]
        client.log_batch(run_id, params=[e for e in part if isinstance(e, Param)],
                         tags=[e for e in part if isinstance(e, RunTag)])
    status = None
    if terminate and end is not None:
        status = str(end[0])
        client.set_terminated(run_id, status, end_time=int(end[1]))
    os.remove(path)
    return len(metrics) + len(others), status


def deliver_outbox(folder: str, client=None) -> list[tuple[str, int, str | None]]:
    """Deliver every outbox file (``*.jsonl``) in ``folder``: ``[(run id, entries sent, status set)]``.

    Raises:
        ValueError: when ``folder`` is not a directory.
    """
    from mlflow import MlflowClient

    if not os.path.isdir(folder):
        raise ValueError(f"outbox folder {folder!r} does not exist (llmeff train spills to <checkpoint_dir>/outbox, "
                         f"autolog and monitors to {default_outbox_dir()})")
    client = client or MlflowClient()
    out = []
    for name in sorted(os.listdir(folder)):
        if name.endswith(".jsonl"):
            n, status = deliver_outbox_file(os.path.join(folder, name), client)
            out.append((name[:-len(".jsonl")], n, status))
    return out


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
    return text if len(text) <= 200 else text[:197] + "..."


def _same_param(value: str) -> str:
    """Normal form for comparing param values: MLflow Projects logs an empty string as ``''``."""
    return "" if value in ("''", '""') else value


def default_run_name(model: str, accel_short: str, count: int, strategy: str, precision: str, *,
                     seq_len: int | str | None = None, global_batch_tokens: int | str | None = None) -> str:
    """``<model>-<accelerator short>-<count>x-<strategy>-<precision>[-s<seq_len>][-gbt<global batch tokens>]``,
    e.g. ``llama-7b-h100-8x-fsdp-bf16-s4096-gbt4194304``.

    The model part is the last path component for local directories and hub ids. Sequence length and
    global batch tokens, where known, tell apart runs that differ only in batch shape;
    :func:`mlflow_llmeff.tracking.runs.unique_run_name` adds a counter when names are still equal.
    """
    base = model.rstrip("/").split("/")[-1]
    name = f"{base}-{accel_short.lower()}-{count}x-{strategy}-{precision}"
    if seq_len not in (None, ""):
        name += f"-s{seq_len}"
    if global_batch_tokens not in (None, ""):
        name += f"-gbt{global_batch_tokens}"
    return name


def ensure_experiment_kind(client, experiment_id: str) -> None:
    """Tag an experiment for MLflow 3's training-runs page unless it already has a kind."""
    try:
        exp = client.get_experiment(experiment_id)
        if names.EXPERIMENT_KIND_TAG not in (exp.tags or {}):
            client.set_experiment_tag(experiment_id, names.EXPERIMENT_KIND_TAG, names.EXPERIMENT_KIND_VALUE)
    except Exception:  # noqa: BLE001 - cosmetic; never fatal
        log.debug("could not tag experiment %s", experiment_id, exc_info=True)
