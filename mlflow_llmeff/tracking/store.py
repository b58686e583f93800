"""The tracking store this process talks to: MLflow's client, its URI, the active run, a run's name.

The layers above ``tracking/`` never import ``mlflow`` (tests/test_architecture.py): what they need of
the store's client they get here, and every write they make is a function of ``tracking/``.
"""

from __future__ import annotations

__all__ = ["client", "reader", "tracking_uri", "active_run_id", "run_identity", "autolog_setting"]


def client(uri: str | None = None):
    """An ``mlflow.MlflowClient`` for ``uri`` (default: MLflow's current tracking URI)."""
    import mlflow

    return mlflow.MlflowClient(uri) if uri else mlflow.MlflowClient()


def reader(uri: str | None = None):
    """A client for reads only, each bounded by the delivery wait for a tracking server
    (:func:`mlflow_llmeff.tracking.delivery.bounded_reads`: after one unanswered read the rest raise
    :class:`~mlflow_llmeff.tracking.delivery.Unreachable` at once); a local store's client as it is."""
    from mlflow_llmeff.tracking.delivery import bounded_reads

    return bounded_reads(client(uri))


def tracking_uri() -> str:
    """MLflow's current tracking URI (``MLFLOW_TRACKING_URI``, ``mlflow.set_tracking_uri``, else its default)."""
    import mlflow

    return mlflow.get_tracking_uri()


def active_run_id() -> str | None:
    """The id of the fluent API's active run in this thread, or None."""
    import mlflow

    run = mlflow.active_run()
    return run.info.run_id if run is not None else None


def run_identity(run_id: str, wait_s: float) -> tuple[str | None, str | None]:
    """``(run name, experiment id)`` of ``run_id`` read from the tracking store, waiting at most ``wait_s``
    seconds for a server (:func:`mlflow_llmeff.tracking.delivery.bounded`).

    Raises:
        mlflow_llmeff.tracking.delivery.NoAnswer: no answer within ``wait_s``.
        mlflow.exceptions.MlflowException: what the store raises.
    """
    from mlflow_llmeff.tracking import delivery

    info = delivery.bounded(lambda: client().get_run(run_id).info, wait_s, "reading the run's name")
    return info.run_name, info.experiment_id


def autolog_setting(integration: str, key: str, default=None):
    """The ``key`` setting the user gave an MLflow autologging integration (``autolog(silent=True)``:
    ``silent``), as MLflow keeps it; ``default`` when it was not given."""
    from mlflow.utils.autologging_utils import get_autologging_config

    return get_autologging_config(integration, key, default)
