"""The tracking store this process talks to: MLflow's client, its URI, the active run, a run's name.

The layers above ``tracking/`` never import ``mlflow`` (tests/test_architecture.py): what they need of
the store's client they get here, and every write they make is a function of ``tracking/``.
"""

from __future__ import annotations

import os

__all__ = ["client", "reader", "tracking_uri", "active_run_id", "run_identity", "autolog_setting", "project_store",
           "StoreNotFound", "launcher_folder"]


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


class StoreNotFound(RuntimeError):
    """No store that a relative tracking URI can name holds the project's run (the message is one line)."""


def project_store(uri: str | None = None, run_id: str | None = None, experiment_id: str | None = None,
                  folders: list[str] | None = None) -> str:
    """The tracking URI, with a relative local store made absolute, of the store that holds this process's
    MLflow project run.

    ``mlflow run`` creates the run in the store its own folder resolves (``sqlite:///mlflow.db``: the
    ``mlflow.db`` where the user typed the command), then starts the entry point in the project's folder with
    ``MLFLOW_TRACKING_URI`` as given and ``MLFLOW_RUN_ID``: there the same relative path names a new, empty
    store (``Run with id=... not found``, a trial of ``projects/scaling-sweep``). MLflow passes no variable
    naming the folder, so the folders of this process's launchers (the parent first, then its parents: a
    shell between them keeps the project's folder), then this process's own, are tried in that order, and
    the first whose store already holds the run is the answer. A store is only looked at, never created
    (sqlite opened read-only; a file store's ``<root>/<experiment id>/<run id>`` folder).

    Args:
        uri: the tracking URI (default: ``MLFLOW_TRACKING_URI``, else MLflow's own, which is absolute).
        run_id: the project's run (default: ``MLFLOW_RUN_ID``); None: not under ``mlflow run``, and a
            relative store is this process's folder's, as MLflow reads it.
        experiment_id: its experiment (default: ``MLFLOW_EXPERIMENT_ID``), for a file store's layout.
        folders: the folders to try, in order (default: the launchers' folders, then this process's).

    Returns:
        ``uri`` unchanged when it is not a relative local path (a server, ``sqlite:////abs``, ``databricks``);
        else the absolute form (:func:`~mlflow_llmeff.tracking.redact.absolute_store`) against the folder found.

    Raises:
        StoreNotFound: under ``mlflow run``, no folder's store holds the run; the line names the URI and the
            stores looked at.
    """
    from mlflow_llmeff.tracking.redact import absolute_store

    uri = uri or os.environ.get("MLFLOW_TRACKING_URI") or tracking_uri()
    run_id = run_id if run_id is not None else os.environ.get("MLFLOW_RUN_ID")
    if absolute_store(uri, cwd="/") == uri:  # not a relative local path: the same store from every folder
        return uri
    if not run_id:
        return absolute_store(uri)
    experiment_id = experiment_id if experiment_id is not None else os.environ.get("MLFLOW_EXPERIMENT_ID")
    tried = []
    for folder in _launcher_folders() if folders is None else folders:
        store = absolute_store(uri, cwd=folder)
        if store not in tried:
            tried.append(store)
            if _holds_run(store, run_id, experiment_id):
                return store
    raise StoreNotFound(f"MLFLOW_TRACKING_URI={uri} is a relative path and no store it names from the folders "
                        f"that started this run holds run {run_id} (looked in: {', '.join(tried)}); give the "
                        "store's absolute path, e.g. sqlite:////abs/path/mlflow.db")


def _launcher_folders(depth: int = 4) -> list[str]:
    """The working folders of this process's parent and up to ``depth - 1`` of its ancestors (nearest first),
    then this process's own; a process whose folder cannot be read (gone, another user's) is skipped."""
    import psutil

    folders = []
    proc = psutil.Process()
    for _ in range(depth):
        try:
            proc = proc.parent()
            if proc is None:
                break
            folders.append(proc.cwd())
        except (psutil.Error, OSError):
            break
    return folders + [os.getcwd()]


#: process names of shells, which ``mlflow run``'s ``bash -c`` may leave between it and the entry point
_SHELLS = frozenset({"sh", "bash", "dash", "zsh", "ksh", "fish", "cmd.exe", "powershell.exe", "pwsh"})


def launcher_folder() -> str:
    """The working folder of the process that started this one, a shell between them skipped: under ``mlflow
    run`` the folder the user ran it from (MLflow starts an entry point in the project's folder and passes
    no variable naming the user's); this process's own folder when not under ``mlflow run`` (no
    ``MLFLOW_RUN_ID``: a script started by hand is in the user's folder) or when no parent can be read."""
    import psutil

    if not os.environ.get("MLFLOW_RUN_ID"):
        return os.getcwd()
    try:
        proc = psutil.Process().parent()
        while proc is not None and proc.name() in _SHELLS and proc.cwd() == os.getcwd():
            proc = proc.parent()
        if proc is not None:
            return proc.cwd()
    except (psutil.Error, OSError):
        pass
    return os.getcwd()


def _holds_run(store: str, run_id: str, experiment_id: str | None) -> bool:
    """Whether the local ``store`` (an absolute ``sqlite:////...`` URI or a file store's folder) exists and
    holds ``run_id``; looked at only: sqlite opened read-only, nothing created."""
    import sqlite3
    import urllib.parse

    if store.startswith("sqlite:///"):
        path = store[len("sqlite:///"):].partition("?")[0]
        if not os.path.isfile(path):
            return False
        try:
            con = sqlite3.connect(f"file:{urllib.parse.quote(path)}?mode=ro", uri=True)
            try:
                return con.execute("SELECT 1 FROM runs WHERE run_uuid = ?", (run_id,)).fetchone() is not None
            finally:
                con.close()
        except sqlite3.Error:
            return False
    root = store[len("file://"):] if store.startswith("file://") else store
    if experiment_id:
        return os.path.isdir(os.path.join(root, experiment_id, run_id))
    return os.path.isdir(root) and any(os.path.isdir(os.path.join(root, e, run_id)) for e in os.listdir(root))
