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
the same tag. A logging failure warns once and training goes on (accelerate's tracker does the
same).
"""

from __future__ import annotations

import logging
import time
import warnings
from collections import deque

from .. import names
from . import keys

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
                 clock=time.monotonic) -> None:
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
        if resume:
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
            for k, v in tags.items():
                checked = keys.check_tag(k, v)
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
            for k, v in params.items():
                checked = keys.check_param(k, v)
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
        """Send ``entries`` in one call; remember an async operation with its entries for :meth:`flush`."""
        if not entries:
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
            except Exception as e:  # noqa: BLE001
                self._recover(entries, e, resend_whole=True)
        self._pending = still

    def _recover(self, entries: list, error: Exception, *, resend_whole: bool) -> None:
        """Deliver what can be delivered of a batch that failed with ``error``.

        The batch is sent again synchronously in halves, down to single entries; an entry that
        fails alone is named in ``llmeff.logging.warnings``. ``resend_whole`` first resends the
        whole batch (an async failure reaches us wrapped, without MLflow's error code). A failure
        that does not blame an entry stops the retry: the rest is named as not logged.
        """
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
        self._warn(error)
        self._outage = True  # the store is failing: leave the warning tag for the next send
        shown = list(dict.fromkeys(_describe(e) for e in entries))
        more = f" and {len(shown) - 5} more" if len(shown) > 5 else ""
        self._note((f"{len(entries)} entries not logged ({', '.join(shown[:5])}{more}): {_reason(error)}",))

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
        if self._outage:  # do not add a second failing call (each one may wait out HTTP retries)
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
        """Send the buffer and wait until every queued batch reached the tracking server.

        A batch whose async operation failed is retried synchronously (see :meth:`_recover`).
        """
        self._send()
        pending, self._pending = self._pending, []
        for op, entries in pending:
            try:
                op.wait()
            except Exception as e:  # noqa: BLE001
                self._recover(entries, e, resend_whole=True)
        self._write_problems()

    def close(self, status: str = "FINISHED") -> None:
        """Flush and mark the run terminated with ``status``."""
        self.flush()
        try:
            self.client.set_terminated(self.run_id, status)
        except Exception as e:  # noqa: BLE001
            self._warn(e)


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
