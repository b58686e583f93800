"""Rank-0 MLflow logger: batched, delivered by a background thread, resume-aware, never fatal to training.

Only the main process constructs an active logger (others get :class:`NullLogger`). Nothing the
training thread calls waits on a request: metrics are buffered in memory and handed, at most every
``send_interval_s`` seconds, to the logger's delivery thread, which makes every MLflow call of the
run in order (the run's creation when the server did not answer at the start, params, tags,
metric batches, dataset inputs, the efficiency report, the end of the run). The process waits for
that thread only at stated points, and at each for at most the delivery wait ``wait_s``
(``LLMEFF_DELIVERY_WAIT_S``, default 30 s) without an answer (:mod:`mlflow_llmeff.tracking.delivery`):
a synchronous :meth:`RunLogger.set_tags` or :meth:`RunLogger.log_params`, :meth:`RunLogger.flush`
(before every checkpoint, so a checkpoint never outruns its metrics) and :meth:`RunLogger.close`
(the end). Whatever the server has not taken by then is written to the outbox file
(:mod:`mlflow_llmeff.tracking.outbox`), which the thread keeps sending from, and which
``llmeff sync`` delivers later (the thread, its queue, the waits and the spill are
:mod:`mlflow_llmeff.tracking.worker`). On resume the logger learns the last point of each key and
drops points at or before its step, so a replayed step is never logged twice.

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

import logging
import os
import threading
import time
import warnings

from mlflow_llmeff import names
from mlflow_llmeff.tracking import delivery, keys, outbox, redact
from mlflow_llmeff.tracking.delivery import WAIT_ENV  # noqa: F401 - re-exported
from mlflow_llmeff.tracking.experiments import default_run_name  # noqa: F401 - re-exported
from mlflow_llmeff.tracking.outbox import ensure_experiment_kind  # noqa: F401 - re-exported
from mlflow_llmeff.tracking.outbox import default_outbox_dir, deliver_outbox, deliver_outbox_file, write_outbox  # noqa: F401 - re-exported
from mlflow_llmeff.tracking.worker import DeliveryWorker

log = logging.getLogger(__name__)

_MAX_PROBLEMS = 1000  # problems remembered for the warning tag; later new ones are only counted
_SPILL_AFTER_S = 1.0  # at the end, the outbox file is written once delivery has taken this long


class NullLogger:
    """What non-main ranks hold: every call is a no-op."""

    run_id: str | None = None
    last_timestamp_s: float | None = None
    spilled_to: str | None = None

    def log_metrics(self, metrics: dict[str, float], step: int, *, timestamp_ms: int | None = None) -> None:  # noqa: D102
        pass

    def set_tags(self, tags: dict[str, str], *, synchronous: bool = True) -> None:  # noqa: D102
        pass

    def log_table(self, data: dict[str, list], artifact_file: str) -> None:  # noqa: D102
        pass

    def log_file(self, path: str, artifact_path: str | None = None) -> None:  # noqa: D102
        pass

    def log_params(self, params: dict[str, str]) -> dict[str, tuple[str, str]]:  # noqa: D102
        return {}

    def log_inputs(self, datasets: list, context: str = "training") -> None:  # noqa: D102
        pass

    def set_synchronous(self, synchronous: bool = True) -> None:  # noqa: D102
        pass

    def last_logged_step(self, key: str) -> int:  # noqa: D102
        return -1

    def last_point(self, key: str) -> tuple[int, float, int] | None:  # noqa: D102
        return None

    def assume_logged_through(self, step: int) -> None:  # noqa: D102
        pass

    def queue_report(self) -> None:  # noqa: D102
        pass

    def rename(self, name_parts: dict[str, str]) -> None:  # noqa: D102
        pass

    def flush(self) -> bool:  # noqa: D102
        return True

    def close(self, status: str | None = "FINISHED", *, report: bool = False,  # noqa: D102
              urgent: bool = False) -> bool:
        return True


class RunLogger(DeliveryWorker, NullLogger):
    """Logs to one MLflow run from the main process.

    Args:
        run_id: the MLflow run to log into, or a local id (``local-...``) for a run the server has
            not created yet (then ``first`` holds its ``create`` record).
        client: an ``mlflow.MlflowClient``; a new one (current tracking URI) when None.
        resume: True when continuing a run; then points at or before each key's last logged step
            (on the server, or in this run's outbox file) are dropped, and :meth:`last_point` gives
            each key's newest point.
        send_interval_s: the least time between two hand-overs of the metric buffer, in seconds.
        clock: monotonic clock in seconds (injected by tests).
        outbox_dir: where undelivered entries spill (default :func:`~mlflow_llmeff.tracking.outbox.default_outbox_dir`).
        wait_s: the delivery wait, seconds (default ``LLMEFF_DELIVERY_WAIT_S``, 30).
        first: outbox records to deliver before anything else (``create``, ``attach``; from
            :func:`mlflow_llmeff.tracking.runs.open_run`).
        unanswered: why the server is already known not to answer (it did not at the start), or None.
        local_id: the local id the run had before the server created it (a resumed run), else None.
    """

    def __init__(self, run_id: str, client=None, *, resume: bool = False, send_interval_s: float = 5.0,
                 clock=time.monotonic, outbox_dir: str | None = None, wait_s: float | None = None,
                 first: list[dict] | tuple = (), unanswered: str | None = None, local_id: str | None = None) -> None:
        from mlflow import MlflowClient

        delivery.apply_request_settings()
        self.run_id = run_id
        self.client = client or MlflowClient()
        self._warned = False
        self._resumed = resume
        self._last_step: dict[str, int] = {}
        self._last_point: dict[str, tuple[int, float, int]] = {}
        self._floor = -1  # with the run's history unknown: steps at or below this were logged before
        # points (key, value, timestamp ms, step) not yet handed to the delivery thread, which makes them
        # mlflow.entities.Metric (worker.metric_entities): no entity is built on the training thread
        self._buffer: list = []
        self._buffer_lock = threading.RLock()  # the buffer is filled on two threads (monitor/pointwork.py)
        self._ok_keys: set[str] = set()  # metric keys already checked and accepted unchanged
        self._problems: dict[str, None] = {}  # ordered set of problem lines for the warning tag
        self._problems_unlisted = 0  # new problems beyond _MAX_PROBLEMS
        self._problems_dirty = False  # the warning tag is behind _problems
        self._clock = clock
        self._send_interval_s = send_interval_s
        self._last_send = clock()
        self.last_timestamp_s: float | None = None  # newest metric point before this attempt (unix s)
        self._start_delivery(self.client, run_id, outbox_dir=outbox_dir, wait_s=wait_s, local_id=local_id,
                             unanswered=unanswered)
        self.history_known = not resume
        adopted = self._adopt_own_outbox() if resume or outbox.is_local_id(run_id) else []
        create = [r for r in adopted if "create" in r][:1] or [r for r in first if "create" in r][:1]
        for rec in create + [r for r in first if "create" not in r] + [r for r in adopted if "create" not in r]:
            self._enqueue_record(rec)
        if resume and not outbox.is_local_id(run_id):
            self._learn_history()
        if outbox.is_local_id(run_id):
            self._say_local()

    # ------------------------------------------------------------------ resume
    def _learn_history(self) -> None:
        """Remember each key's newest point (largest step, then latest timestamp) before this attempt.

        One ``runs/get``: MLflow keeps every key's latest point (largest step, then latest timestamp,
        then largest value: the stores' ``latest_metrics``) with the run, so no metric history is read
        (issue 52: 5,000 points on each of 20 keys took 13 s of ``get_metric_history``, and a slow server
        was marked down). Waits at most ``wait_s`` for a tracking server (none when it is known not to
        answer); without an answer the history stays unknown (:meth:`assume_logged_through` then drops
        replayed steps).
        """
        if self._down_since is not None:
            return
        try:  # RunData keeps the Metric entities (step, timestamp) of runs/get only here
            latest = self._read(lambda: list(self.client.get_run(self.run_id).data._metric_objs), "the run's metrics")
        except Exception as e:  # noqa: BLE001
            self._warn(e)
            return
        self.history_known = True
        for m in latest:
            self._remember(m.key, m.step, m.value, m.timestamp)

    def _remember(self, key: str, step: int, value: float, timestamp: int) -> None:
        old = self._last_point.get(key)
        if old is None or (step, timestamp) > (old[0], old[2]):
            self._last_point[key] = (step, value, timestamp)
        self._last_step[key] = max(self._last_step.get(key, -1), step)
        self.last_timestamp_s = max(self.last_timestamp_s or 0.0, timestamp / 1000)

    def _adopt_own_outbox(self) -> list[dict]:
        """What an earlier attempt of this run left in the outbox, as records to deliver first (its
        ``end`` and ``report`` dropped: this attempt makes its own); its points count as logged."""
        out = []
        for rid in dict.fromkeys([self.run_id, self._local_id]):
            path = os.path.join(self.outbox_dir, f"{rid}.jsonl") if rid else None
            if not path or not os.path.exists(path):
                continue
            try:
                header, records = outbox.read_outbox(path)
            except Exception as e:  # noqa: BLE001 - kept for llmeff sync
                self._warn(e)
                continue
            for rec in records:
                if "end" in rec or "report" in rec:
                    continue
                if "m" in rec:
                    k, v, ts, step = rec["m"]
                    self._remember(k, int(step), float(v), int(ts))
                out.append(rec)
            log.info("mlflow_llmeff: %d records an earlier attempt left in %s are sent first", len(out), path)
        return out

    def assume_logged_through(self, step: int) -> None:
        """With the run's history unknown (the server did not answer at the start): treat steps up to
        ``step`` (e.g. the crashed attempt's last logged step) as logged, so replayed steps are dropped."""
        if not self.history_known:
            self._floor = max(self._floor, int(step))

    def _warn(self, e: Exception) -> None:
        if self._closing:  # a request abandoned at the end failed late: the end's line said it all
            log.debug("logging failure after the end was spilled", exc_info=e)
            return
        if not self._warned:
            self._warned = True
            warnings.warn(f"mlflow_llmeff: MLflow logging failed ({type(e).__name__}: {e}); training continues", stacklevel=3)
        log.debug("logging failure", exc_info=e)

    def set_synchronous(self, synchronous: bool = True) -> None:
        """Kept for callers of earlier versions: every call is made by the delivery thread now."""

    def last_logged_step(self, key: str) -> int:
        """Last step ``key`` was logged at before this attempt (-1 when never)."""
        return max(self._last_step.get(key, -1), self._floor)

    def last_point(self, key: str) -> tuple[int, float, int] | None:
        """Newest point of ``key`` before this attempt (resume only), else None.

        Returns:
            ``(step, value, timestamp in ms since the epoch)`` of the point with the largest step
            (latest timestamp among equal steps), e.g. to continue a cumulative total.
        """
        return self._last_point.get(key)

    # ------------------------------------------------------------------ metrics
    def log_metrics(self, metrics: dict[str, float], step: int, *, timestamp_ms: int | None = None) -> None:
        """Queue metrics at ``step``; hand the buffer over when ``send_interval_s`` has passed.

        Keys MLflow refuses are mapped (:func:`~mlflow_llmeff.tracking.keys.safe_key`), values that
        are not real numbers are dropped, both noted in ``llmeff.logging.warnings``. NaN and +/-inf
        are logged (a diverged loss must show). After a resume, a point at or before the step its
        (mapped) key was last logged at is dropped. ``timestamp_ms``: the points' time, ms since the
        epoch (default: now); the monitor passes the time its step was read at when the point is
        built off the training thread (:mod:`mlflow_llmeff.monitor.pointwork`).

        Each point is buffered as a tuple ``(key, value, timestamp ms, step)``; the delivery thread makes it
        the ``mlflow.entities.Metric`` it sends (:func:`~mlflow_llmeff.tracking.worker.metric_entities`), so a
        logged step builds no entity (~16 a point) on the training thread (issue 53). Safe to call from
        two threads (the buffer is handed over under a lock).
        """
        ts = int(time.time() * 1000) if timestamp_ms is None else timestamp_ms
        with self._buffer_lock:
            ok, last, floor, buf = self._ok_keys, self._last_step, self._floor, self._buffer
            try:
                for k, v in metrics.items():
                    if k in ok and type(v) in (float, int) and type(step) is int:  # fast path: a key checked before
                        if step > last.get(k, -1) and step > floor:
                            buf.append((k, float(v), ts, step))
                        continue
                    checked = keys.check_metric(k, v, step)
                    self._note(checked.problems)
                    if checked.key is not None and not checked.problems and checked.key == k:
                        ok.add(k)
                    if checked.key is not None and int(step) > max(last.get(checked.key, -1), floor):
                        buf.append((checked.key, checked.value, ts, int(step)))
            except Exception as e:  # noqa: BLE001 - e.g. metrics not a mapping: never fatal
                self._warn(e)
            if self._clock() - self._last_send >= self._send_interval_s:
                self._send()

    def _send(self) -> None:
        """Hand the buffered metrics (batches of at most ``MAX_METRICS_PER_BATCH``) and new problems over."""
        from mlflow.utils.validation import MAX_METRICS_PER_BATCH

        with self._buffer_lock:  # (a point being buffered on another thread lands in this buffer or the next)
            self._last_send = self._clock()
            buf, self._buffer = self._buffer, []
            for i in range(0, len(buf), MAX_METRICS_PER_BATCH):
                self._enqueue("batch", buf[i:i + MAX_METRICS_PER_BATCH])
        self._write_problems()

    # ------------------------------------------------------------------ tags, params, inputs
    def set_tags(self, tags: dict[str, str], *, synchronous: bool = True) -> None:
        """Set tags (values converted with ``str``), in batches of at most 100.

        ``synchronous=True`` waits (at most ``wait_s`` without an answer, not at all while the server
        is known not to answer) until they are delivered, else spills them to the outbox file;
        ``synchronous=False`` only hands them over (for tags set from inside a training step).

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
        self._enqueue_chunked(list(entries.values()))
        self._write_problems()
        if synchronous:
            self.flush(send=False)

    def log_params(self, params: dict[str, str]) -> dict[str, tuple[str, str]]:
        """Log params not yet on the run; never re-log one with a new value.

        Keys and values are checked like tags (value limit ``MAX_PARAM_VAL_LENGTH``, 6000 characters)
        and sent in batches of at most 100, waited for as a synchronous :meth:`set_tags`. The params
        already logged are read first (at most ``wait_s``); when the server does not answer, all are
        sent, and one logged before with another value is rejected by MLflow and named in
        ``llmeff.logging.warnings``.

        Returns:
            ``{name: (logged value, new value)}`` for params that already had another value (they
            keep the logged value; the caller records them in a tag). ``name`` is as given.
        """
        from mlflow.entities import Param

        existing: dict[str, str] = {}
        if self._down_since is None and not outbox.is_local_id(self.run_id):
            try:
                existing = self._read(lambda: self.client.get_run(self.run_id).data.params, "the run's params")
            except Exception as e:  # noqa: BLE001
                self._warn(e)
        try:
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
        self._enqueue_chunked(list(entries.values()))
        self._write_problems()
        self.flush(send=False)
        return changed

    def log_inputs(self, datasets: list, context: str = "training") -> None:
        """Log ``mlflow.data`` datasets as the run's inputs (``mlflow.log_input``), delivered in order."""
        try:
            self._enqueue("inputs", outbox.dataset_records(datasets, context))
        except Exception as e:  # noqa: BLE001 - a missing Dataset column must not stop training
            self._warn(e)

    def queue_report(self) -> None:
        """Build and log the run's efficiency report once everything handed over before is delivered
        (:func:`mlflow_llmeff.tracking.outbox.log_report`; by ``llmeff sync`` when it waits in the outbox)."""
        self._send()  # the buffered points (the summary) first: the report reads them from the server
        self._enqueue("report", None)

    def rename(self, name_parts: dict[str, str]) -> None:
        """Name the run the fixed-order stem of ``name_parts``, unique in its experiment, delivered in
        order like every call (:func:`mlflow_llmeff.tracking.outbox.name_run`; never waits: the
        uniqueness search runs on the delivery thread)."""
        self._enqueue("name", {"name_parts": dict(name_parts)})

    def log_table(self, data: dict[str, list], artifact_file: str) -> None:
        """Log ``data`` (column -> values, equal lengths) as an MLflow table artifact (``log_table``:
        the artifact viewer shows it as a table), delivered in order like every call."""
        try:
            self._enqueue("table", {"data": {k: list(v) for k, v in data.items()}, "artifact_file": artifact_file})
        except Exception as e:  # noqa: BLE001 - a table must not stop training
            self._warn(e)

    def log_file(self, path: str, artifact_path: str | None = None) -> None:
        """Log the local file ``path`` as an artifact of the run under ``artifact_path`` (a folder; None:
        the root), delivered in order like every call (e.g. the memory snapshot of an out-of-memory
        failure, :mod:`mlflow_llmeff.monitor.memwatch`). The file must stay until the run is closed."""
        try:
            self._enqueue("file", {"path": str(path), "artifact_path": artifact_path})
        except Exception as e:  # noqa: BLE001 - an artifact must not stop training
            self._warn(e)

    def log_eval(self, metrics: dict[str, float], note: str) -> None:
        """Log evaluation ``metrics`` at the run's last ``train/tokens`` step, found when delivered
        (``llmeff eval --run-id``); :attr:`eval_step` is that step once delivered."""
        self._enqueue("eval", {"metrics": {k: float(v) for k, v in metrics.items()},
                               "timestamp": int(time.time() * 1000), "note": note})

    def _note_collision(self, kind: str, given, key: str, entries: dict) -> None:
        if key in entries:
            self._note((f"{kind} {given!r} and another {kind} both map to {key!r}; the last one given is kept",))

    def _enqueue_chunked(self, entries: list) -> None:
        """Hand tags or params over, ``MAX_PARAMS_TAGS_PER_BATCH`` (100) per call."""
        from mlflow.utils.validation import MAX_PARAMS_TAGS_PER_BATCH

        for i in range(0, len(entries), MAX_PARAMS_TAGS_PER_BATCH):
            self._enqueue("batch", entries[i:i + MAX_PARAMS_TAGS_PER_BATCH])

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
        """Hand ``llmeff.logging.warnings`` over when a problem was found since it was last set."""
        if not self._problems_dirty:
            return
        from mlflow.entities import RunTag

        self._problems_dirty = False
        self._enqueue("batch", [RunTag(names.LOGGING_WARNINGS, self.warnings_text())])

    # ------------------------------------------------------------------ flush and close
    def flush(self, *, send: bool = True) -> bool:
        """Hand the buffer over and wait until the tracking server has every entry, or spill them.

        Waits at most ``wait_s`` (``LLMEFF_DELIVERY_WAIT_S``, default 30 s) for an unanswered
        request, and not at all once the server is known not to answer: then every entry not yet
        confirmed is written to :meth:`outbox_path` (the training loop calls this before every
        checkpoint, so a checkpoint never outruns its metrics: they are on the server or in the
        outbox file beside it). Returns True when everything is delivered.
        """
        if send:
            self._send()
        ok = self._wait(while_down=False)
        self._spill()
        return ok

    def close(self, status: str | None = "FINISHED", *, report: bool = False, urgent: bool = False) -> bool:
        """Deliver everything, then (``report``) the run's efficiency report, then (``status``) the end
        of the run with this end time; wait at most ``wait_s`` without an answer (also while the
        server is known not to answer: it may come back).

        When the server does not take everything, nothing is lost: what is left (the end included)
        is in :meth:`outbox_path`, a line says how to send it (``llmeff sync <outbox dir>``), and
        False is returned. A ``KeyboardInterrupt`` or ``SystemExit`` (SIGINT, SIGTERM) during the
        wait stops it: the file is written, the line printed, and the exception goes on. ``urgent``
        (a signal is ending the process) writes the file before waiting at all.
        """
        self._send()
        if report:
            self.queue_report()
        if status:
            self._enqueue("end", (status, int(time.time() * 1000)))
        if self._closing:  # already spilled at an earlier close: the server is not answering
            self._spill()
            return False
        try:
            ok = self._wait(while_down=True, spill_after=0.0 if urgent else _SPILL_AFTER_S)
        except BaseException:
            self._stop_and_say(status)
            raise
        if ok:
            self._spill()  # removes a file an earlier spill left
            self._retire()  # the delivery thread exits now, not after its idle wait
            return True
        self._stop_and_say(status)
        return False


def _same_param(value: str) -> str:
    """Normal form for comparing param values: MLflow Projects logs a ``-P`` string value shell-quoted
    (``shlex.quote``: ``'my run'``, ``''``, ``'val_loss<=1.9'``), the entrypoint gets it unquoted, so
    a value that is exactly one shell-quoted word compares as that word."""
    import shlex

    if value in ('""',):
        return ""
    try:
        words = shlex.split(value)
    except ValueError:  # an unbalanced quote: not shell quoting
        return value
    return words[0] if len(words) == 1 and shlex.quote(words[0]) == value else value


