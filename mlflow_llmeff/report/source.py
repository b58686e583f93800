"""Reading the runs to compare out of MLflow: an ``MlflowClient`` (any tracking URI) or a server's live store.

Both expose the same positional calls (``get_experiment_by_name``, ``get_experiment``, ``search_runs``,
``get_metric_history``), so the efficiency page inside ``mlflow server`` and ``llmeff compare`` share
this code. Errors are ``ValueError`` with one line naming the bad value.
"""

from __future__ import annotations

import hashlib
import threading
from array import array
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from itertools import chain

from mlflow_llmeff import names
from mlflow_llmeff.tracking.delivery import Unreachable, bounded_reads
from mlflow_llmeff.tracking.redact import clean, environment_secrets
from mlflow_llmeff.tracking.runs import ui_run_url
from mlflow_llmeff.tracking.search import all_runs, apply_filter, filters_datasets, is_store_error, parse_filter
from mlflow_llmeff.report.calc import RunRecord

__all__ = ["Selection", "select_runs", "metric_history", "ui_run_url", "change_token", "READ", "REPORT_TAGS",
           "REPORT_METRIC_PREFIXES", "REPORT_PARAMS"]

#: What a database-backed store's read (:func:`_read_by_sql`) takes of each run: the tags the reports read
#: (every ``llmeff.*`` condition and provenance tag, and the run's name), the latest metrics under these
#: prefixes (summary figures, time to quality, final evals, the network's ``comm/*``, memory, training), and
#: these params (a run's seed, its targets and step cap, an eval's few-shot count: report/calc.py and
#: report/repeats.py). Keys a search filter names are read besides. tests/test_scale.py checks that every
#: key the report modules read is among them.
REPORT_TAGS = ("llmeff.%", "mlflow.runName")
REPORT_METRIC_PREFIXES = ("summary/", "ttq/", "eval/", "comm/", "memory/", "train/")
REPORT_PARAMS = ("seed", "targets", "stop_at_targets", "max_steps", "eval_num_fewshot")


class _Reads:
    """Counted work of the store reads (the page's tests assert it, never wall time): SQL queries issued,
    rows read, and :func:`change_token` look-ups."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.queries, self.rows, self.tokens = 0, 0, 0

    def count(self, rows: int) -> None:
        """One query that returned ``rows`` rows (from any thread)."""
        with _COUNT_LOCK:
            self.queries, self.rows = self.queries + 1, self.rows + rows


_COUNT_LOCK = threading.Lock()
#: The module's counters (:class:`_Reads`).
READ = _Reads()
#: Read a database's three value tables side by side (threads, a connection each); False: in turn.
_SIDE_BY_SIDE = True

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
    #: a digest of everything the read returned (a database-backed store's rows, the filter), from which
    #: ``runs`` follow; None where the runs came through ``search_runs`` (then digest the records)
    content: str | None = None

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
    except Unreachable:
        raise
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

    An ``MlflowClient`` of a tracking server is read through
    :class:`~mlflow_llmeff.tracking.delivery.BoundedReads`: each read waits at most the delivery wait
    (``LLMEFF_DELIVERY_WAIT_S``), and after one unanswered read the rest are not tried.

    Raises:
        ValueError: unknown experiment, a filter MLflow cannot parse, or no run to compare (each one line).
        mlflow_llmeff.tracking.delivery.Unreachable: the tracking server did not answer within the wait
            (one line naming it and the bound).
    """
    client = bounded_reads(client)
    exp = _experiment(client, experiment)
    secrets = environment_secrets()
    content, found = hashlib.sha1(), None
    try:
        runs = _read_by_sql(client, exp.experiment_id, filter_string or "", secrets, content)
        if runs is None:  # MLflow's search, active runs only
            found = all_runs(client, [exp.experiment_id], filter_string or "", order_by=["attributes.start_time DESC"])
    except Exception as e:
        if not is_store_error(e) or isinstance(e, Unreachable):
            raise
        first = str(e.message if hasattr(e, "message") else e).strip().splitlines()[0]
        raise ValueError(f"bad filter {filter_string!r}: {first}") from None
    if runs is None:
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
    digest = None if found is not None else content.hexdigest()
    return Selection(exp.experiment_id, exp.name, filter_string or "", runs, left_out, parents, machines, digest)


def _sql_engine(client):
    """The SQLAlchemy engine (the read replica where one is set) of a database-backed tracking store
    (``mlflow.store.tracking.sqlalchemy_store.SqlAlchemyStore``), else None."""
    if not hasattr(client, "ManagedSessionMaker"):
        return None
    engine = getattr(client, "read_engine", None) or getattr(client, "engine", None)
    return engine if hasattr(engine, "connect") else None


def _filter_keys(clauses: list[dict]) -> dict[str, set[str]]:
    """The tag, metric and param keys a parsed search filter names (read besides the report's own)."""
    out: dict[str, set[str]] = {"tags": set(), "latest_metrics": set(), "params": set()}
    kinds = {"tag": "tags", "metric": "latest_metrics", "parameter": "params"}
    for c in clauses:
        table = kinds.get(c.get("type", ""))
        if table:
            out[table].add(c["key"])
    return out


def _key_condition(table: str, extra: set[str]) -> tuple[str, list[str]]:
    """The SQL condition on ``v.key`` for the keys of ``table`` the reports read, and its parameters."""
    if table == "tags":
        likes, exact = [t for t in REPORT_TAGS if t.endswith("%")], [t for t in REPORT_TAGS if not t.endswith("%")]
    elif table == "latest_metrics":
        likes, exact = [p + "%" for p in REPORT_METRIC_PREFIXES], []
    else:
        likes, exact = [], list(REPORT_PARAMS)
    exact = sorted(set(exact) | extra)
    parts = ["v.key LIKE ?"] * len(likes) + ([f"v.key IN ({', '.join('?' * len(exact))})"] if exact else [])
    return "(" + " OR ".join(parts) + ")", likes + exact


def _read_by_sql(client, experiment_id: str, filter_string: str, secrets: list[str] | None = None,
                 content=None):
    """The active runs of ``experiment_id`` matching ``filter_string`` as :class:`RunRecord`, newest first,
    read straight from a database-backed store's tables, or None where this does not apply (another store,
    a filter on datasets, which these runs do not carry).

    MLflow's ``search_runs`` on such a store builds an ORM object for every tag, param and latest
    metric of every run: 5.9 s for 1,000 runs of 41 values each on this 2-core machine, most of a
    page's time. Here: four queries (runs, ``latest_metrics``, ``tags``, ``params``: MLflow's schema
    since 1.x), each reading only the keys the reports show (:data:`REPORT_TAGS`,
    :data:`REPORT_METRIC_PREFIXES`, :data:`REPORT_PARAMS`, and those the filter names). The runs are
    the outer loop of every join (``runs CROSS JOIN <table>``: sqlite otherwise walked the key index
    and looked each value's run up, 5x the CPU at 10,000 runs). On sqlite the metrics query returns one
    row per run, its keys and values joined by the database, and the tags and params queries one row per
    distinct set with its runs' ids and names (:func:`_sqlite_grouped`: repeats' equal tags parsed and
    masked once, metrics split in C); other databases a row per value (:func:`_by_rows`).
    A filter is applied by ``mlflow.utils.search_utils.SearchUtils.filter`` (MLflow's own evaluator of
    its search syntax, the one its file store uses) on light objects with MLflow's ``info``/``data``
    attributes; the order is ``search_runs``' ``attributes.start_time DESC`` (then by run id). Every
    query and row is counted in :data:`READ`.

    ``secrets``: values to mask (default: the environment's, :func:`~mlflow_llmeff.tracking.redact.environment_secrets`).
    ``content``: a ``hashlib`` object given every row the queries return and the filter (:func:`_seen`):
    the records are a function of them, so its digest names the run set without a pass over the records.

    Raises:
        mlflow.exceptions.MlflowException: a filter MLflow cannot parse.
    """
    engine = _sql_engine(client)
    if engine is None or not str(experiment_id).isdigit():
        return None
    clauses = parse_filter(filter_string)
    if filters_datasets(clauses):
        return None
    extra = _filter_keys(clauses)
    secrets = environment_secrets() if secrets is None else secrets
    # the id is all digits (checked above): a literal, so the driver's own cursor runs the queries
    # (SQLAlchemy's row objects cost 4 s of 5 for 10,000 runs)
    where = f"r.experiment_id = {int(experiment_id)} AND r.lifecycle_stage = 'active'"
    memo: dict = {}  # condition tags repeat over the runs: each (key, value) is masked once

    def cleaned(k: str, v: str) -> str:
        got = memo.get((k, v))
        if got is None:
            got = memo[(k, v)] = clean(k, v, secrets)
        return got

    tables = ("latest_metrics", "tags", "params")
    # each table's digest apart (the threads finish in any order), given to ``content`` in table order
    seen = {t: (None if content is None else hashlib.sha1()) for t in tables}
    # each table's runs by the distinct set they were read in (sqlite's grouped read): RunRecord.alike
    sets: dict[str, dict] = {t: {} for t in tables}

    def values_of(table: str) -> dict[str, dict]:
        keys, args = _key_condition(table, extra[table])
        if style != "qmark":  # psycopg2, pymysql: %s placeholders
            keys = keys.replace("?", "%s")
        with engine.connect() as conn:
            cursor = conn.connection.cursor()
            try:
                return read(cursor, table, where, keys, args, cleaned, content=seen[table], sets=sets[table])
            finally:
                cursor.close()

    try:
        style = getattr(engine.dialect, "paramstyle", "qmark")  # sqlite3: ?, psycopg2 and pymysql: %s
        grouped = engine.url.get_backend_name() == "sqlite"
        read = _sqlite_grouped if grouped else _by_rows
        # the three tables side by side, each on its own connection of the store's pool: the drivers
        # (sqlite3, psycopg2) let go of the GIL while the database works, which is most of a read (at
        # 10,000 runs: tags 0.22 s, metrics 0.13 s of the database's CPU). One snapshot per query, as a
        # single connection gives (sqlite3 opens no transaction for a SELECT; PostgreSQL's READ COMMITTED
        # takes one per statement). An in-memory sqlite database is one connection's own: read in turn.
        side = _SIDE_BY_SIDE and not (grouped and (not engine.url.database or "memory" in engine.url.database))
        pool = ThreadPoolExecutor(len(tables), thread_name_prefix="llmeff-read") if side else None
        try:
            pending = {t: pool.submit(values_of, t) for t in tables} if pool else {}
            with engine.connect() as conn:
                cursor = conn.connection.cursor()
                try:
                    cursor.execute("SELECT r.run_uuid, r.name, r.status, r.start_time, r.end_time, r.user_id, "
                                   f"r.artifact_uri, r.lifecycle_stage FROM runs r WHERE {where} "
                                   "ORDER BY r.start_time DESC, r.run_uuid")
                    rows = cursor.fetchall()
                finally:
                    cursor.close()
            READ.count(len(rows))
            values = {t: pending[t].result() if pool else values_of(t) for t in tables}
        finally:
            if pool is not None:
                pool.shutdown(wait=True)
    except Exception as e:  # noqa: BLE001 - a schema this read does not know: MLflow's own search instead
        import logging

        logging.getLogger(__name__).info("llmeff: the store's tables read as MLflow's search instead (%s)", e)
        return None
    _seen(content, "runs", rows)
    for t in tables:
        if content is not None:
            content.update(seen[t].digest())
    _seen(content, "filter", [(filter_string,)])
    exp_id = str(experiment_id)
    metrics, tags, params = values["latest_metrics"], values["tags"], values["params"]
    none: dict = {}
    ms, ts, ps = (sets[t] for t in tables)
    if not all(None in x for x in (ms, ts, ps)):  # a table read by rows: no run is known alike another
        ms = ts = ps = {u: None for u, *_ in rows}
    # dict(...): runs of equal tags or params share the parsed dict; each record gets its own. alike: the
    # numbers of its metric keys' list, its tag set and its param set (-1: none of the keys read; a run
    # read by rows: None, alike no other)
    records = [RunRecord(u, tags.get(u, none).get(_RUN_NAME) or name or "", status, exp_id, metrics.get(u) or {},
                         dict(tags.get(u, none)), dict(params.get(u, none)), start,
                         None if None in (a := (ms.get(u, -1), ts.get(u, -1), ps.get(u, -1))) else a)
               for u, name, status, start, _end, _user, _uri, _stage in rows]
    if not filter_string:
        return records
    from types import SimpleNamespace

    light = []
    for rec, (u, name, status, start, end, user, artifact_uri, stage) in zip(records, rows):
        info = SimpleNamespace(run_id=u, run_uuid=u, run_name=name, status=status, start_time=start, end_time=end,
                               user_id=user, artifact_uri=artifact_uri, lifecycle_stage=stage, experiment_id=exp_id)
        data = SimpleNamespace(metrics=rec.metrics, tags=rec.tags, params=rec.params)
        light.append(SimpleNamespace(info=info, data=data, inputs=SimpleNamespace(dataset_inputs=[]), record=rec))
    return [x.record for x in apply_filter(light, filter_string)]


_RUN_NAME = "mlflow.runName"


def _seen(content, what: str, rows: list) -> None:
    """Give ``content`` (a ``hashlib`` object, or None) the rows one query returned: every value's text
    (``str``: exact for strings, integers and floats) joined, and each one's length, so no two row sets
    give the same bytes (C's loops: 0.02 s for 10,000 runs' 8.7 MB of tags; JSON took 0.06 s, digesting
    the records 0.16-0.2 s)."""
    if content is not None:
        cells = list(map(str, chain.from_iterable(rows)))
        content.update(f"{what}:{len(rows)}:".encode())
        content.update(array("q", map(len, cells)).tobytes())
        content.update("\x1e".join(cells).encode("utf-8", "surrogatepass"))


def _by_rows(cursor, table: str, where: str, keys: str, args: list, cleaned, ids=(), content=None,
             sets: dict | None = None) -> dict[str, dict]:
    """``{run id: {key: value}}`` of ``table`` for the selected runs, a row per value (PostgreSQL, MySQL):
    metrics as floats (NaN where MLflow's ``is_nan`` is set), tags and params through ``cleaned``;
    ``ids``: only these runs (sqlite's placeholders); ``content``: see :func:`_seen`. ``sets`` is left as
    it is (no run read by rows is known alike another: :attr:`~mlflow_llmeff.report.calc.RunRecord.alike`)."""
    nan = ", v.is_nan" if table == "latest_metrics" else ""
    if ids:
        where += f" AND r.run_uuid IN ({', '.join('?' * len(ids))})"
    cursor.execute(f"SELECT v.run_uuid, v.key, v.value{nan} FROM runs r CROSS JOIN {table} v WHERE "
                   f"r.run_uuid = v.run_uuid AND {where} AND {keys}", list(ids) + list(args))
    found = cursor.fetchall()
    READ.count(len(found))
    _seen(content, table, found)
    got: dict[str, dict] = {}
    for row in found:
        one = got.get(row[0])
        if one is None:
            one = got[row[0]] = {}
        if nan:
            one[row[1]] = float("nan") if row[3] else float(row[2])
        else:
            one[row[1]] = cleaned(row[1], row[2])
    return got


#: What joins a run's keys and its values in :func:`_sqlite_grouped`: the ASCII unit separator (no MLflow
#: key holds it; a run with a value that does is read by rows).
_SEP = "\x1f"


def _sqlite_grouped(cursor, table: str, where: str, keys: str, args: list, cleaned, content=None,
                    sets: dict | None = None) -> dict[str, dict]:
    """``{run id: {key: value}}`` of ``table`` for the selected runs of a sqlite store, grouped by sqlite's
    ``group_concat`` (with :data:`_SEP`), so Python makes a row per run or fewer where a row per value made
    380,000 (10,000 runs of 38 values).

    * ``latest_metrics``: one row per run, its keys and its values joined; values written by
      ``printf('%!.20e')`` (21 significant digits: every double reads back exactly,
      tests/test_report_page.py; sqlite's own text of a REAL keeps 15), ``nan`` where MLflow's ``is_nan``
      is set. Each distinct list of keys is split once.
    * ``tags``, ``params``: one row per distinct set of keys and values but the run's name, with the ids
      of its runs and their names joined in the same order (repeats of a configuration share every tag
      but their name): 5 rows for 100,000 repeats of 5 configurations, where a row per run had Python
      make 100,000 pairs of 0.4-0.5 KB strings (90 MB) and digest them. Each set is parsed and masked once;
      the caller copies it per run.

    The runs are a list the values' index is searched with in run order (``IN (SELECT ...)``: no sort
    for the per-run grouping; 2.0 s of CPU for 100,000 runs' tags where the join took 2.8-3.1 s). A run
    whose values do not split into as many as its keys (a value holding the separator, a NULL value) is
    read by rows (:func:`_by_rows`), and so is every run of a set whose names do not split into one a run.

    ``sets``: a dict given each run's number of its set (of keys and values; for metrics, of keys), None for
    a run read by rows, and ``sets[None] = True`` when the grouping held (left out when every run of the
    table was read by rows): :attr:`~mlflow_llmeff.report.calc.RunRecord.alike`."""
    sets = {} if sets is None else sets
    inside = f"v.run_uuid IN (SELECT r.run_uuid FROM runs r WHERE {where}) AND {keys}"
    if table == "latest_metrics":
        value = "CASE WHEN v.is_nan THEN 'nan' ELSE printf('%!.20e', v.value) END"
        cursor.execute(f"SELECT v.run_uuid, count(*), group_concat(v.key, char(31)), group_concat({value}, char(31)) "
                       f"FROM {table} v WHERE {inside} GROUP BY v.run_uuid", args)
    else:
        # per run: its other keys (n), their non-NULL values (k: group_concat leaves a NULL out, told apart
        # from a value holding the separator), keys and values joined, whether it has a name and the name
        other, name = f"v.key != '{_RUN_NAME}'", f"v.key = '{_RUN_NAME}'"
        cursor.execute(f"SELECT n, k, has, ks, vs, count(*), group_concat(u, char(31)), count(nm), "
                       f"group_concat(nm, char(31)) FROM (SELECT v.run_uuid AS u, sum({other}) AS n, "
                       f"count(CASE WHEN {other} THEN v.value END) AS k, sum({name}) AS has, "
                       f"group_concat(CASE WHEN {other} THEN v.key END, char(31)) AS ks, "
                       f"group_concat(CASE WHEN {other} THEN v.value END, char(31)) AS vs, "
                       f"max(CASE WHEN {name} THEN v.value END) AS nm FROM {table} v WHERE {inside} "
                       "GROUP BY v.run_uuid) GROUP BY n, k, has, ks, vs", args)
    found = cursor.fetchall()
    READ.count(len(found))
    _seen(content, table, found)
    got: dict[str, dict] = {}
    again = []
    if table == "latest_metrics":
        split: dict[str, tuple[list[str], int]] = {}  # each distinct list of keys split once, and numbered
        for u, n, ks, vs in found:
            k_list = split.get(ks)
            if k_list is None:
                k_list = split[ks] = (ks.split(_SEP), len(split))
            k_list, sets[u] = k_list
            v_list = vs.split(_SEP)
            if len(v_list) != n or len(k_list) != n:
                again.append(u)
                continue
            got[u] = dict(zip(k_list, map(float, v_list)))
    else:
        for n, k, has, ks, vs, count, ids, named, nms in found:
            run_ids = ids.split(_SEP)
            if len(run_ids) != count:  # a run id holding the separator (not one MLflow makes): all by rows
                sets.clear()
                return _by_rows(cursor, table, where, keys, args, cleaned, content=content)
            k_list, v_list = (ks or "").split(_SEP), (vs or "").split(_SEP)
            run_names = nms.split(_SEP) if has and named == count else ()
            if (n and (k != n or len(k_list) != n or len(v_list) != n)) or (has and len(run_names) != count):
                again += run_ids
                continue
            one = {key: cleaned(key, v) for key, v in zip(k_list, v_list)} if n else {}
            sets.update(dict.fromkeys(run_ids, len(sets)))
            if has:
                for u, nm in zip(run_ids, run_names):
                    got[u] = {**one, _RUN_NAME: cleaned(_RUN_NAME, nm)}
            else:
                got.update(dict.fromkeys(run_ids, one))
    sets.update(dict.fromkeys(again))
    sets[None] = True
    for i in range(0, len(again), 500):  # the few runs the joined strings cannot carry, by rows
        got.update(_by_rows(cursor, table, where, keys, args, cleaned, ids=again[i:i + 500], content=content))
    return got


def change_token(client) -> str | None:
    """A value that changes whenever the store behind ``client`` commits a change, read without reading
    any run; None where no such value is known (then every page reads its runs).

    * sqlite: the database file's (and its write-ahead log's) modification time and size. A file's
      time moves in steps of the kernel's clock tick, so a token whose file changed less than
      :data:`SETTLED_S` before it was read is None (a write in the same tick would leave it equal):
      only a store quiet for that long is served from a cache.
    * PostgreSQL: the write-ahead log's position (``pg_current_wal_lsn()``; a replica's
      ``pg_last_wal_replay_lsn()``), which every committed write moves, in any process.
    * other stores (MySQL, an ``MlflowClient``): None.

    Each look-up is counted in :data:`READ` (``tokens``).
    """
    engine = _sql_engine(client)
    if engine is None:
        return None
    READ.tokens += 1
    url = engine.url
    try:
        if url.get_backend_name() == "sqlite":
            import os
            import time

            path = url.database
            if not path or path == ":memory:":
                return None
            stats = [os.stat(p) for p in (path, path + "-wal") if os.path.exists(p)]
            newest = max(st.st_mtime for st in stats)
            if time.time() - newest < SETTLED_S:
                return None
            return "sqlite:" + ",".join(f"{st.st_mtime_ns}:{st.st_size}" for st in stats)
        if url.get_backend_name() == "postgresql":
            import sqlalchemy as sa

            with engine.connect() as conn:
                lsn = conn.execute(sa.text("SELECT CASE WHEN pg_is_in_recovery() THEN pg_last_wal_replay_lsn()::text "
                                           "ELSE pg_current_wal_lsn()::text END")).scalar()
            READ.queries += 1
            return f"postgresql:{lsn}"
    except Exception:  # noqa: BLE001 - no token: the page reads its runs, as without one
        return None
    return None


#: Seconds a sqlite file must have been unchanged before :func:`change_token` vouches for it.
SETTLED_S = 1.0


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
    """``(step, timestamp_ms, value)`` points of one metric of one run, by step; [] when it has none, or
    when a tracking server does not answer within the delivery wait (:func:`~mlflow_llmeff.tracking.delivery.bounded_reads`)."""
    try:
        points = bounded_reads(client).get_metric_history(run_id, key)
    except Exception:  # noqa: BLE001 - a missing history is an empty plot line, not an error
        return []
    return sorted((int(m.step), int(m.timestamp), float(m.value)) for m in points)
