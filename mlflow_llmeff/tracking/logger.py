"""Rank-0 MLflow logger: batched, asynchronous, resume-aware, and never fatal to training.

Only the main process constructs an active logger (others get :class:`NullLogger`). Metrics are
buffered in memory and sent at most every ``send_interval_s`` seconds as one
``MlflowClient.log_batch(..., synchronous=False)`` call, MLflow's own async queue, so neither a
slow tracking server nor the store's per-call cost (several ms of Python under the GIL for a
sqlite store) lands on a training step; :meth:`RunLogger.flush` sends and waits (the training
loop calls it before every checkpoint, so a checkpoint never outruns its metrics) and
:meth:`RunLogger.close` flushes. On resume the
logger learns the last step each key was logged at and drops points at or before it, so a replayed
step is never logged twice. A logging failure warns once and training goes on (accelerate's
tracker does the same).
"""

from __future__ import annotations

import logging
import math
import time
import warnings

from .. import names

log = logging.getLogger(__name__)


class NullLogger:
    """What non-main ranks hold: every call is a no-op."""

    run_id: str | None = None

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:  # noqa: D102
        pass

    def set_tags(self, tags: dict[str, str]) -> None:  # noqa: D102
        pass

    def log_params(self, params: dict[str, str]) -> dict[str, tuple[str, str]]:  # noqa: D102
        return {}

    def close(self, status: str = "FINISHED") -> None:  # noqa: D102
        pass


class RunLogger(NullLogger):
    """Logs to one MLflow run from the main process.

    Args:
        run_id: the MLflow run to log into (it must exist).
        client: an ``mlflow.MlflowClient``; a new one (current tracking URI) when None.
        resume: True when continuing a run; then points at or before each key's last logged step
            are dropped.
    """

    def __init__(self, run_id: str, client=None, *, resume: bool = False, send_interval_s: float = 5.0,
                 clock=time.monotonic) -> None:
        from mlflow import MlflowClient

        self.run_id = run_id
        self.client = client or MlflowClient()
        self._warned = False
        self._last_step: dict[str, int] = {}
        self._pending = []
        self._buffer = []
        self._clock = clock
        self._send_interval_s = send_interval_s
        self._last_send = clock()
        self.last_timestamp_s: float | None = None  # newest metric point before this attempt (unix s)
        if resume:
            run = self.client.get_run(run_id)
            for key in run.data.metrics:
                try:
                    hist = self.client.get_metric_history(run_id, key)
                    self._last_step[key] = max(m.step for m in hist) if hist else -1
                    if hist:
                        newest = max(m.timestamp for m in hist) / 1000
                        self.last_timestamp_s = max(self.last_timestamp_s or 0.0, newest)
                except Exception as e:  # noqa: BLE001
                    self._warn(e)

    def _warn(self, e: Exception) -> None:
        if not self._warned:
            self._warned = True
            warnings.warn(f"mlflow_llmeff: MLflow logging failed ({type(e).__name__}: {e}); training continues", stacklevel=3)
        log.debug("logging failure", exc_info=e)

    def last_logged_step(self, key: str) -> int:
        """Last step ``key`` was logged at before this attempt (-1 when never)."""
        return self._last_step.get(key, -1)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Queue finite metrics at ``step``; non-finite values are dropped (never logged as NaN)."""
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        batch = [Metric(k, float(v), ts, step) for k, v in metrics.items()
                 if v is not None and math.isfinite(float(v)) and step > self._last_step.get(k, -1)]
        self._buffer += batch
        if self._clock() - self._last_send >= self._send_interval_s:
            self._send()

    def _send(self) -> None:
        """Queue the buffered metrics with MLflow's async logger (batches of at most 1000)."""
        self._last_send = self._clock()
        buf, self._buffer = self._buffer, []
        for i in range(0, len(buf), 1000):
            try:
                self._pending.append(self.client.log_batch(self.run_id, metrics=buf[i:i + 1000], synchronous=False))
            except Exception as e:  # noqa: BLE001
                self._warn(e)

    def set_tags(self, tags: dict[str, str]) -> None:
        """Set string tags (values converted with ``str``)."""
        from mlflow.entities import RunTag

        try:
            self.client.log_batch(self.run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])
        except Exception as e:  # noqa: BLE001
            self._warn(e)

    def log_params(self, params: dict[str, str]) -> dict[str, tuple[str, str]]:
        """Log params not yet on the run; never re-log one with a new value.

        Returns:
            ``{name: (logged value, new value)}`` for params that already had another value (they
            keep the logged value; the caller records them in a tag).
        """
        from mlflow.entities import Param

        try:
            existing = self.client.get_run(self.run_id).data.params
            changed = {k: (existing[k], v) for k, v in params.items()
                       if k in existing and _same_param(existing[k]) != _same_param(v)}
            new = [Param(k, v) for k, v in params.items() if k not in existing]
            if new:
                self.client.log_batch(self.run_id, params=new)
            return changed
        except Exception as e:  # noqa: BLE001
            self._warn(e)
            return {}

    def flush(self) -> None:
        """Send the buffer and wait until every queued metric batch reached the tracking server."""
        self._send()
        for op in self._pending:
            try:
                if op is not None:
                    op.wait()
            except Exception as e:  # noqa: BLE001
                self._warn(e)
        self._pending.clear()

    def close(self, status: str = "FINISHED") -> None:
        """Flush and mark the run terminated with ``status``."""
        self.flush()
        try:
            self.client.set_terminated(self.run_id, status)
        except Exception as e:  # noqa: BLE001
            self._warn(e)


def _same_param(value: str) -> str:
    """Normal form for comparing param values: MLflow Projects logs an empty string as ``''``."""
    return "" if value in ("''", '""') else value


def default_run_name(model: str, accel_short: str, count: int, strategy: str, precision: str) -> str:
    """``<model>-<accelerator short><count>x-<strategy>-<precision>``, e.g. ``llama-7b-h100-8x-fsdp-bf16``.

    The model part is the last path component for local directories and hub ids.
    """
    base = model.rstrip("/").split("/")[-1]
    return f"{base}-{accel_short.lower()}-{count}x-{strategy}-{precision}"


def ensure_experiment_kind(client, experiment_id: str) -> None:
    """Tag an experiment for MLflow 3's training-runs page unless it already has a kind."""
    try:
        exp = client.get_experiment(experiment_id)
        if names.EXPERIMENT_KIND_TAG not in (exp.tags or {}):
            client.set_experiment_tag(experiment_id, names.EXPERIMENT_KIND_TAG, names.EXPERIMENT_KIND_VALUE)
    except Exception:  # noqa: BLE001 - cosmetic; never fatal
        log.debug("could not tag experiment %s", experiment_id, exc_info=True)
