"""Reading the runs to compare out of MLflow: an ``MlflowClient`` (any tracking URI) or a server's live store.

Both expose the same positional calls (``get_experiment_by_name``, ``get_experiment``, ``search_runs``,
``get_metric_history``), so the efficiency page inside ``mlflow server`` and ``llmeff compare`` share
this code. Errors are ``ValueError`` with one line naming the bad value.
"""

from __future__ import annotations

from dataclasses import dataclass

from mlflow_llmeff import names
from mlflow_llmeff.tracking.redact import clean, environment_secrets
from mlflow_llmeff.tracking.runs import ui_run_url
from mlflow_llmeff.tracking.search import all_runs, apply_filter, filters_datasets, is_store_error, parse_filter
from mlflow_llmeff.report.calc import RunRecord

__all__ = ["Selection", "select_runs", "metric_history", "ui_run_url"]

@dataclass(frozen=True)
class Selection:
    """The compared runs of one experiment.

    Attributes:
        experiment_id, experiment_name: the experiment.
        filter_string: the MLflow search filter used ('' = every run).
        runs: every matching run, newest first (MLflow's pages followed to the end: no cap);
            comparison runs (``llmeff.compare.run_ids``) and study parents (``llmeff.study``: no
            training, no summary; their children are the runs) are left out.
        comparison_runs: how many comparison runs matched and were left out.
        study_runs: how many study parents matched and were left out.
        machine_runs: how many runs of a multi-machine job's other machines (``llmeff.machine.job_run``:
            made by ``mlflow run`` there, empty; the job's run is compared) matched and were left out.
    """

    experiment_id: str
    experiment_name: str
    filter_string: str
    runs: list[RunRecord]
    comparison_runs: int = 0
    study_runs: int = 0
    machine_runs: int = 0

    def scope(self) -> str:
        """Which runs these are: ``every active run of the experiment`` (or ``... matching the filter``),
        and the comparison runs and study parents left out."""
        scope = "matching the filter" if self.filter_string else "of the experiment"
        left = (f"; {self.comparison_runs:,} comparison run{'s' if self.comparison_runs != 1 else ''} "
                "(llmeff compare's own) left out" if self.comparison_runs else "")
        if self.study_runs:
            left += (f"; {self.study_runs:,} study parent run{'s' if self.study_runs != 1 else ''} (llmeff study's: "
                     "their children are compared) left out")
        if self.machine_runs:
            left += (f"; {self.machine_runs:,} run{'s' if self.machine_runs != 1 else ''} of a job's other machines "
                     "(mlflow run's there: empty, the job's run is compared) left out")
        return f"every active run {scope}{left}"

    def count_line(self) -> str:
        """``1,001 runs compared: every active run of the experiment``: what the first screen and the
        report say about how many runs they show (all of them: no cap)."""
        return f"{len(self.runs):,} run{'s' if len(self.runs) != 1 else ''} compared: {self.scope()}"


def _experiment(client, experiment: str):
    """The experiment named ``experiment`` (or with that id); ValueError when there is none."""
    exp = client.get_experiment_by_name(experiment)
    if exp is None and experiment.isdigit():
        try:
            exp = client.get_experiment(experiment)
        except Exception:  # noqa: BLE001 - an unknown id is reported below
            exp = None
    if exp is None:
        raise ValueError(f"experiment {experiment!r} not found; {_known_experiments(client)}")
    return exp


def _known_experiments(client, limit: int = 10) -> str:
    """``accepted: 'a', 'b' (+N more)``: the active experiments' names, newest first (one page of at most
    ``limit``), or what to give when none can be read."""
    try:
        page = client.search_experiments(max_results=limit + 1, order_by=["creation_time DESC"])
    except Exception:  # noqa: BLE001 - the list is a help, not the error
        page = []
    if not page:
        return "give an experiment name or id that exists in this tracking store"
    shown = ", ".join(repr(e.name) for e in page[:limit])
    more = " and more (mlflow experiments search lists them)" if len(page) > limit else ""
    return f"accepted: {shown}{more}"


def select_runs(client, experiment: str, filter_string: str = "") -> Selection:
    """Read every run of ``experiment`` that matches ``filter_string`` (MLflow search syntax),
    however many: MLflow's pages (1,000 runs each) are followed to the last one.

    Args:
        client: an ``mlflow.MlflowClient`` or a tracking store (``mlflow.server.handlers._get_tracking_store()``).
        experiment: experiment name (or numeric id).
        filter_string: MLflow search filter, e.g. ``tags."llmeff.precision" = 'bf16'``.

    A database-backed store (the server's own, ``SqlAlchemyStore``: sqlite, PostgreSQL, MySQL) is read
    with four plain SQL queries (:func:`_read_by_sql`: runs, latest metrics, tags, params) and the
    filter applied by MLflow's own Python evaluator; any other client (``MlflowClient``, a REST
    store) through ``search_runs``, page after page.

    Tags and params come back masked as our logger masks them (secret-looking names, values of
    secret environment variables, URI user-info), whoever logged them.

    Raises:
        ValueError: unknown experiment, a filter MLflow cannot parse, or no run to compare (each one line).
    """
    exp = _experiment(client, experiment)
    secrets = environment_secrets()
    try:
        found = _read_by_sql(client, exp.experiment_id, filter_string or "")
        if found is None:  # MLflow's search, active runs only
            found = all_runs(client, [exp.experiment_id], filter_string or "", order_by=["attributes.start_time DESC"])
    except Exception as e:
        if not is_store_error(e):
            raise
        first = str(e.message if hasattr(e, "message") else e).strip().splitlines()[0]
        raise ValueError(f"bad filter {filter_string!r}: {first}") from None
    memo: dict = {}  # condition tags repeat over the runs: each (key, value) is masked once
    runs = [_record(r, secrets, memo) for r in found]
    compared = [r for r in runs if names.COMPARE_RUN_IDS not in r.tags]
    left_out, runs = len(runs) - len(compared), compared
    trained = [r for r in runs if names.STUDY not in r.tags]  # a study's parent trains nothing
    parents, runs = len(runs) - len(trained), trained
    jobs = [r for r in runs if names.MACHINE_JOB_RUN not in r.tags]  # another machine's empty run of a job
    machines, runs = len(runs) - len(jobs), jobs
    if not runs:
        if filter_string:
            raise ValueError(f"no run of experiment {exp.name!r} matches the filter {filter_string!r}")
        raise ValueError(f"experiment {exp.name!r} has no runs to compare")
    return Selection(exp.experiment_id, exp.name, filter_string or "", runs, left_out, parents, machines)


def _sql_engine(client):
    """The SQLAlchemy engine (the read replica where one is set) of a database-backed tracking store
    (``mlflow.store.tracking.sqlalchemy_store.SqlAlchemyStore``), else None."""
    if not hasattr(client, "ManagedSessionMaker"):
        return None
    engine = getattr(client, "read_engine", None) or getattr(client, "engine", None)
    return engine if hasattr(engine, "connect") else None


def _read_by_sql(client, experiment_id: str, filter_string: str):
    """The active runs of ``experiment_id`` matching ``filter_string``, newest first, read straight
    from a database-backed store's tables, or None where this does not apply (another store, a
    filter on datasets, which these runs do not carry).

    MLflow's ``search_runs`` on such a store builds an ORM object for every tag, param and latest
    metric of every run: 5.9 s for 1,000 runs of 41 values each on this 2-core machine, most of a
    page's time. Here: four queries of plain rows (runs, ``latest_metrics``, ``tags``, ``params``:
    MLflow's schema since 1.x), each run a light object with MLflow's ``info``/``data`` attributes,
    filtered by ``mlflow.utils.search_utils.SearchUtils.filter`` (MLflow's own evaluator of its
    search syntax, the one its file store uses) and ordered as ``search_runs`` orders
    ``attributes.start_time DESC`` (then by run id).

    Raises:
        mlflow.exceptions.MlflowException: a filter MLflow cannot parse.
    """
    engine = _sql_engine(client)
    if engine is None or not str(experiment_id).isdigit():
        return None
    from types import SimpleNamespace

    if filters_datasets(parse_filter(filter_string)):
        return None
    # the id is all digits (checked above): a literal, so the driver's own cursor runs the queries
    # (SQLAlchemy's row objects cost 4 s of 5 for 10,000 runs)
    where = f"r.experiment_id = {int(experiment_id)} AND r.lifecycle_stage = 'active'"
    try:
        with engine.connect() as conn:
            cursor = conn.connection.cursor()
            try:
                cursor.execute("SELECT r.run_uuid, r.name, r.status, r.start_time, r.end_time, r.user_id, r.artifact_uri, "
                               f"r.lifecycle_stage FROM runs r WHERE {where} ORDER BY r.start_time DESC, r.run_uuid")
                rows = cursor.fetchall()
                values = {}
                for table in ("latest_metrics", "tags", "params"):
                    nan = ", v.is_nan" if table == "latest_metrics" else ""
                    got = values[table] = {}
                    cursor.execute(f"SELECT v.run_uuid, v.key, v.value{nan} FROM {table} v JOIN runs r ON "
                                   f"r.run_uuid = v.run_uuid WHERE {where}")
                    for row in cursor.fetchall():
                        one = got.get(row[0])
                        if one is None:
                            one = got[row[0]] = {}
                        one[row[1]] = row[2] if not nan else (float("nan") if row[3] else float(row[2]))
            finally:
                cursor.close()
    except Exception as e:  # noqa: BLE001 - a schema this read does not know: MLflow's own search instead
        import logging

        logging.getLogger(__name__).info("llmeff: the store's tables read as MLflow's search instead (%s)", e)
        return None
    runs = []
    for run_uuid, name, status, start, end, user, artifact_uri, stage in rows:
        info = SimpleNamespace(run_id=run_uuid, run_uuid=run_uuid, run_name=name, status=status, start_time=start,
                               end_time=end, user_id=user, artifact_uri=artifact_uri, lifecycle_stage=stage,
                               experiment_id=str(experiment_id))
        data = SimpleNamespace(metrics=values["latest_metrics"].get(run_uuid, {}), tags=values["tags"].get(run_uuid, {}),
                               params=values["params"].get(run_uuid, {}))
        runs.append(SimpleNamespace(info=info, data=data, inputs=SimpleNamespace(dataset_inputs=[])))
    return apply_filter(runs, filter_string)


def _record(run, secrets: list[str], memo: dict | None = None) -> RunRecord:
    """A run as the reports see it: tags and params through :func:`mlflow_llmeff.tracking.redact.clean`
    (runs logged by other tools never had our logger's masking, and reports are shared); ``memo``
    keeps each ``(key, value)``'s cleaned value for the other runs."""
    memo = {} if memo is None else memo

    def cleaned(k: str, v: str) -> str:
        got = memo.get((k, v))
        if got is None:
            got = memo[(k, v)] = clean(k, v, secrets)
        return got

    tags = {k: cleaned(k, v) for k, v in run.data.tags.items()}
    params = {k: cleaned(k, v) for k, v in run.data.params.items()}
    return RunRecord(run_id=run.info.run_id, name=tags.get("mlflow.runName") or run.info.run_name or "",
                     status=run.info.status, experiment_id=run.info.experiment_id,
                     metrics=dict(run.data.metrics), tags=tags, params=params,
                     start_time_ms=getattr(run.info, "start_time", None))


def metric_history(client, run_id: str, key: str) -> list[tuple[int, int, float]]:
    """``(step, timestamp_ms, value)`` points of one metric of one run, by step; [] when it has none."""
    try:
        points = client.get_metric_history(run_id, key)
    except Exception:  # noqa: BLE001 - a missing history is an empty plot line, not an error
        return []
    return sorted((int(m.step), int(m.timestamp), float(m.value)) for m in points)
