"""Every match of an MLflow search, page after page: no search of the product stops at one page.

MLflow's ``search_runs`` and ``search_experiments`` return one page (1,000 results unless asked)
and a page token for the next; a caller that reads only the first page sees the newest 1,000 runs
of an experiment and silently misses the rest (issue 31: the 1,001st run of an experiment, a run
name already taken). The functions here follow the tokens to the end. They take an
``MlflowClient`` or a tracking store (``mlflow.server.handlers._get_tracking_store()``): both have
the same positional ``search_runs(experiment_ids, filter_string, run_view_type, max_results,
order_by, page_token)`` and keyword ``search_experiments``.

The only searches that ask for one result are existence look-ups of a unique tag (is there a run
created for this ``llmeff.outbox.local_run_id``?, ``tracking/outbox.py`` and ``tracking/runs.py``):
any match answers them, and the copies a retried ``CreateRun`` made are all found by
:func:`mlflow_llmeff.tracking.outbox.runs_of_local_id` through :func:`all_runs`.
"""

from __future__ import annotations

from typing import Iterable

__all__ = ["PAGE_SIZE", "all_runs", "all_experiments", "all_experiment_ids", "is_store_error", "parse_filter",
           "filters_datasets", "apply_filter"]

#: Results asked for per request: MLflow's default page (a server on any MLflow release accepts it).
PAGE_SIZE = 1000


def all_runs(client, experiment_ids: Iterable[str], filter_string: str = "", *, order_by: list[str] | None = None,
             view_type: int | None = None, page_size: int = PAGE_SIZE) -> list:
    """Every run of ``experiment_ids`` matching ``filter_string`` (MLflow search syntax), in
    ``order_by`` order, read ``page_size`` at a time until MLflow gives no page token.

    Args:
        client: ``MlflowClient`` or tracking store.
        experiment_ids: the experiments searched.
        filter_string: MLflow search filter ('' = every run).
        order_by: e.g. ``["attributes.start_time DESC"]`` (default: MLflow's, newest first).
        view_type: ``mlflow.entities.ViewType`` value (default ``ACTIVE_ONLY``).
        page_size: runs per request (1 to 50,000, MLflow's bound).

    Returns:
        The ``mlflow.entities.Run`` objects (a list, however many).

    Raises:
        mlflow.exceptions.MlflowException: what MLflow raises (a filter it cannot parse, a store that fails).
    """
    from mlflow.entities import ViewType

    view = ViewType.ACTIVE_ONLY if view_type is None else view_type
    ids = list(experiment_ids)
    out, token = [], None
    while True:
        page = client.search_runs(ids, filter_string or "", view, page_size, order_by, token)
        out += list(page)
        token = getattr(page, "token", None)
        if not token or not page:
            return out


def all_experiments(client, *, view_type: int | None = None, page_size: int = PAGE_SIZE) -> list:
    """Every experiment (``ACTIVE_ONLY`` by default) as ``mlflow.entities.Experiment``, page after page.

    Raises:
        mlflow.exceptions.MlflowException: what MLflow raises.
    """
    from mlflow.entities import ViewType

    view = ViewType.ACTIVE_ONLY if view_type is None else view_type
    out, token = [], None
    while True:
        page = client.search_experiments(view_type=view, max_results=page_size, page_token=token)
        out += list(page)
        token = getattr(page, "token", None)
        if not token or not page:
            return out


def all_experiment_ids(client, *, view_type: int | None = None) -> list[str]:
    """The ids of :func:`all_experiments`.

    Raises:
        mlflow.exceptions.MlflowException: what MLflow raises.
    """
    return [e.experiment_id for e in all_experiments(client, view_type=view_type)]


def is_store_error(e: BaseException) -> bool:
    """True for an error MLflow raised (``mlflow.exceptions.MlflowException``: a filter it cannot parse, a
    store that refused), as opposed to a bug or a lost connection."""
    from mlflow.exceptions import MlflowException

    return isinstance(e, MlflowException)


def parse_filter(filter_string: str) -> list[dict]:
    """The clauses of an MLflow search filter (``SearchUtils.parse_search_filter``; [] for '').

    Raises:
        mlflow.exceptions.MlflowException: a filter MLflow cannot parse.
    """
    from mlflow.utils.search_utils import SearchUtils

    return SearchUtils.parse_search_filter(filter_string) if filter_string else []


def filters_datasets(clauses: list[dict]) -> bool:
    """True when a clause of :func:`parse_filter` is on the runs' datasets (``datasets.name`` ...)."""
    from mlflow.utils.search_utils import SearchUtils

    return any(SearchUtils.is_dataset(c.get("type"), c.get("comparator", "").upper()) for c in clauses)


def apply_filter(runs: list, filter_string: str) -> list:
    """The ``runs`` (objects with MLflow's ``info``/``data``/``inputs``) matching ``filter_string``, by
    MLflow's own evaluator of its search syntax (``SearchUtils.filter``, the one its file store uses).

    Raises:
        mlflow.exceptions.MlflowException: a filter MLflow cannot parse.
    """
    from mlflow.utils.search_utils import SearchUtils

    return SearchUtils.filter(runs, filter_string) if filter_string else runs
