"""A study's runs in MLflow (``llmeff study``, :mod:`mlflow_llmeff.train.study`): the parent run with its
parameters, each child created for its training, and how they end."""

from __future__ import annotations

from mlflow_llmeff import names
from mlflow_llmeff.names import shorten
from mlflow_llmeff.tracking.experiments import unique_run_name

__all__ = ["context_tags", "create_parent", "create_child", "end_parent", "end_open_child"]


def context_tags(tags: dict) -> dict:
    """``tags`` with the context tags ``mlflow.start_run`` would add (source, user, git commit), as a
    run ``llmeff train`` creates has them; no ``llmeff.*`` condition of a context provider (a study's
    parent has no conditions; a child's own training tags its conditions). Never raises."""
    try:
        from mlflow.tracking import context

        resolved = {k: str(v) for k, v in context.registry.resolve_tags({}).items() if not k.startswith("llmeff.")}
    except Exception:  # noqa: BLE001 - context tags are cosmetic
        resolved = {}
    return {**resolved, **tags}


def create_parent(client, experiment_id: str, stem: str, tags: dict, params: dict[str, str]) -> str:
    """Create the study's parent run, named ``stem`` made unique in the experiment, with ``tags`` (and the
    context tags) and ``params``; returns its id.

    Raises:
        mlflow.exceptions.MlflowException: what the store raises.
    """
    parent = client.create_run(experiment_id, run_name=unique_run_name(client, experiment_id, stem),
                               tags=context_tags(tags)).info.run_id
    for k, v in params.items():
        client.log_param(parent, k, v)
    return parent


def create_child(client, experiment_id: str, name: str, tags: dict) -> str:
    """Create one child run named ``name`` (until its training names it) with its study ``tags``; returns its id."""
    return client.create_run(experiment_id, run_name=name, tags=context_tags(tags)).info.run_id


def end_parent(client, run_id: str, status: str, error: str | None = None, note: str | None = None) -> None:
    """End the parent with ``status``, ``error`` as ``llmeff.error`` and the description (``Failed: <error>``,
    else ``note``) where given."""
    if error:
        client.set_tag(run_id, names.ERROR, shorten(error, 2000))
    description = f"Failed: {shorten(error, 2000)}" if error and status == "FAILED" else note
    if description:
        client.set_tag(run_id, "mlflow.note.content", description)
    client.set_terminated(run_id, status)


def end_open_child(client, run_id: str, status: str, why: str) -> None:
    """End a child its training left open (it failed before its meter started) with ``why`` on it (as
    :func:`~mlflow_llmeff.tracking.runs.record_failure` writes it). Never raises: the failure is
    already on the terminal and in the parent."""
    from mlflow_llmeff.tracking.runs import record_failure

    try:
        if client.get_run(run_id).info.status == "RUNNING":
            record_failure(why, run_id=run_id)
            client.set_terminated(run_id, status)
    except Exception:  # noqa: BLE001
        pass
