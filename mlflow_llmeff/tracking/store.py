"""The tracking store this process talks to: MLflow's client, its URI and the active run.

The layers above ``tracking/`` never import ``mlflow`` (tests/test_architecture.py): what they need of
the store's client they get here, and every write they make is a function of ``tracking/``.
"""

from __future__ import annotations

__all__ = ["client", "tracking_uri", "active_run_id"]


def client(uri: str | None = None):
    """An ``mlflow.MlflowClient`` for ``uri`` (default: MLflow's current tracking URI)."""
    import mlflow

    return mlflow.MlflowClient(uri) if uri else mlflow.MlflowClient()


def tracking_uri() -> str:
    """MLflow's current tracking URI (``MLFLOW_TRACKING_URI``, ``mlflow.set_tracking_uri``, else its default)."""
    import mlflow

    return mlflow.get_tracking_uri()


def active_run_id() -> str | None:
    """The id of the fluent API's active run in this thread, or None."""
    import mlflow

    run = mlflow.active_run()
    return run.info.run_id if run is not None else None
