"""Benchmark scores logged to a run that exists already (``llmeff eval``): is the run there, and the
scores onto the active run (or ``$MLFLOW_RUN_ID``'s)."""

from __future__ import annotations

import os

__all__ = ["run_exists", "log_to_active_run"]


def run_exists(run_id: str) -> bool:
    """True when the tracking store has run ``run_id``; False when a tracking server did not answer within
    the delivery wait (``LLMEFF_DELIVERY_WAIT_S``): that is not a missing run, and what is logged waits
    in the outbox.

    Raises:
        LookupError: the store says there is no such run (the message is the store's error type).
    """
    import mlflow

    from mlflow_llmeff.tracking import delivery

    delivery.apply_request_settings()
    client = mlflow.MlflowClient()
    wait = delivery.delivery_wait_s() if delivery.is_server(mlflow.get_tracking_uri()) else None
    try:
        if wait is None:
            client.get_run(run_id)
        else:
            delivery.bounded(lambda: client.get_run(run_id), wait, "looking up the run")
        return True
    except delivery.NoAnswer:
        return False
    except Exception as e:  # noqa: BLE001 - one line instead of the store's stack trace
        if wait is not None and getattr(e, "error_code", None) not in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
            return False  # the server is away, not the run
        raise LookupError(type(e).__name__) from None


def log_to_active_run(metrics: dict[str, float], step: int | None = None, table: dict | None = None,
                      table_file: str = "") -> bool:
    """Log ``metrics`` at ``step`` (None: 0) and ``table`` (columns of equal length, as ``table_file``) to the
    active MLflow run, else to ``$MLFLOW_RUN_ID``'s run, through
    :class:`~mlflow_llmeff.tracking.writer.RunWriter` (waiting at most the delivery wait; what the server
    does not take waits in the outbox); False when there is neither run."""
    from mlflow_llmeff.tracking.store import active_run_id
    from mlflow_llmeff.tracking.writer import RunWriter

    run_id = active_run_id() or os.environ.get("MLFLOW_RUN_ID")
    if not run_id:
        return False
    writer = RunWriter.attach(run_id)
    writer.log_metrics(metrics, step=int(step or 0))
    if table is not None:
        writer.log_table(table, table_file)
    writer.end(None)
    return True
