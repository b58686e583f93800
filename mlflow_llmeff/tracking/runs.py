"""Which MLflow run a meter logs into, and how it ends: open, resume, end with a status.

Order of choice (:func:`open_run`): an explicit ``run_id`` (a resumed checkpoint's run); the
active run; ``MLFLOW_RUN_ID`` (set by ``mlflow run`` for the child process; named as below while
it has no metrics yet); otherwise a new run
in ``experiment_name`` (or MLflow's current experiment), named as ``../shared/METRICS.md`` says.
A run the meter opened or resumed is the meter's to end; an active run the user started stays
open for the user.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from .. import names

__all__ = ["RunHandle", "open_run", "end_run", "unique_run_name", "ui_run_url", "run_url_line"]


@dataclass
class RunHandle:
    """The run a meter logs into.

    Attributes:
        run_id: MLflow run id.
        owned: True when the meter ends the run (it created or resumed it).
        fluent: True when the run is MLflow's active run started by the meter (``mlflow.start_run``).
        resumed: True when an existing run was continued.
        fresh_since_unix: for a launcher's run with nothing logged yet (``mlflow run``), its start
            time (unix seconds): the run's wall time starts there. None otherwise.
    """

    run_id: str
    owned: bool
    fluent: bool
    resumed: bool
    fresh_since_unix: float | None = None


def unique_run_name(client, experiment_id: str, name: str, exclude_run_id: str | None = None) -> str:
    """``name``, or ``name-2``, ``name-3``, ... when runs of the experiment already have it (never raises).

    Args:
        client: ``MlflowClient``.
        experiment_id: the experiment the run is in.
        name: the wanted name.
        exclude_run_id: a run whose own name does not count (the launcher's run being renamed).
    """
    try:
        quoted = name.replace("'", "")
        taken = {r.info.run_name for r in client.search_runs(
            [experiment_id], f"attributes.run_name LIKE '{quoted}%'", max_results=1000)
            if r.info.run_id != exclude_run_id}
    except Exception:  # noqa: BLE001 - a name is cosmetic: never fail a run for it
        return name
    if name not in taken:
        return name
    n = 2
    while f"{name}-{n}" in taken:
        n += 1
    return f"{name}-{n}"


def open_run(client, *, run_id: str | None, run_name: str, experiment_name: str | None = None,
             unique_name: bool = False) -> RunHandle:
    """Open (or continue) the run to log into; see the module docstring for the order of choice.

    Under ``mlflow run`` a resumed checkpoint's run can differ from the launcher's
    ``MLFLOW_RUN_ID``: the launcher's run then gets ``llmeff.resume.continued_in_run``. With
    ``unique_name`` a new (or fresh launcher's) run gets :func:`unique_run_name` of ``run_name``.
    """
    import mlflow

    from .logger import ensure_experiment_kind

    env_run = os.environ.get("MLFLOW_RUN_ID") or None
    if run_id is not None:
        client.update_run(run_id, status="RUNNING")
        if env_run and env_run != run_id:
            client.set_tag(env_run, names.RESUME_CONTINUED_IN, run_id)
        return RunHandle(run_id, owned=True, fluent=False, resumed=True)
    active = mlflow.active_run()
    if active is not None:
        return RunHandle(active.info.run_id, owned=False, fluent=False, resumed=False)
    if env_run:
        client.update_run(env_run, status="RUNNING")
        run = client.get_run(env_run)
        fresh = not run.data.metrics
        if fresh:  # the launcher's fresh run: give it the standard name
            if unique_name:
                run_name = unique_run_name(client, run.info.experiment_id, run_name, exclude_run_id=env_run)
            client.set_tag(env_run, "mlflow.runName", run_name)
        ensure_experiment_kind(client, run.info.experiment_id)
        return RunHandle(env_run, owned=True, fluent=False, resumed=True,
                         fresh_since_unix=run.info.start_time / 1000 if fresh and run.info.start_time else None)
    if experiment_name:
        exp = client.get_experiment_by_name(experiment_name)
        exp_id = exp.experiment_id if exp else client.create_experiment(experiment_name)
    else:
        from mlflow.tracking.fluent import _get_experiment_id

        exp_id = _get_experiment_id()
    if unique_name:
        run_name = unique_run_name(client, exp_id, run_name)
    run = mlflow.start_run(experiment_id=exp_id, run_name=run_name)
    ensure_experiment_kind(client, run.info.experiment_id)
    return RunHandle(run.info.run_id, owned=True, fluent=True, resumed=False)


def end_run(client, handle: RunHandle, status: str) -> None:
    """End a run the meter owns with ``status`` (and an end time); leaves a user's active run open."""
    if not handle.owned:
        return
    import mlflow

    active = mlflow.active_run()
    if handle.fluent and active is not None and active.info.run_id == handle.run_id:
        mlflow.end_run(status)
    else:
        client.set_terminated(handle.run_id, status)


def error_line(exc: BaseException) -> str:
    """One line for a run's ``llmeff.error``: the message of a ValueError, else ``Type: message``."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    own = isinstance(exc, ValueError) or getattr(exc, "one_line", False)  # messages written to be the line
    line = text if own else f"{type(exc).__name__}: {text}".rstrip(": ")
    return line[:2000]


def record_failure(message: str, tags: dict[str, str] | None = None, run_id: str | None = None) -> bool:
    """Write why a run failed onto it: ``llmeff.error``, the run's description, and ``tags``.

    For the launcher's run under ``mlflow run`` (``MLFLOW_RUN_ID``) when ``run_id`` is None. Never
    raises; returns True when something was written.
    """
    run_id = run_id or os.environ.get("MLFLOW_RUN_ID")
    if not run_id:
        return False
    try:
        from mlflow import MlflowClient

        from .logger import RunLogger

        logger = RunLogger(run_id, MlflowClient())
        logger.set_tags({**(tags or {}), names.ERROR: message, "mlflow.note.content": f"Failed: {message}"})
        return True
    except Exception:  # noqa: BLE001 - reporting a failure must not hide it
        return False


def ui_run_url(base: str, experiment_id: str, run_id: str) -> str:
    """The MLflow 3 UI address of a run in the training-runs view (``#/experiments/<id>/runs/<run id>``).

    A bare ``#/experiments/<id>`` opens the GenAI overview in a fresh browser; this address does not.
    ``base`` is the server's address (``http://host:port``) or ``""`` for a link relative to the server.
    """
    return f"{base.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}"


def run_url_line(tracking_uri: str, experiment_id: str, run_id: str) -> str:
    """One line telling where to open the run: its training-runs URL on a server, else the
    ``mlflow ui`` command for a local store and the URL it will serve."""
    if tracking_uri.startswith(("http://", "https://")):
        return f"view run at {ui_run_url(tracking_uri, experiment_id, run_id)}"
    return (f"view run: mlflow ui --backend-store-uri {tracking_uri} then open "
            f"{ui_run_url('http://127.0.0.1:5000', experiment_id, run_id)}")
