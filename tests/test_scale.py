"""An experiment past one page of MLflow's search (1,001 runs): no search of the product stops at a page.

MLflow returns 1,000 runs a request and a page token for the rest. The trial (issue 31): with 1,001
runs, compare and the efficiency page read the newest 500 and said nothing of the other 501, and the
next auto name was one already taken (the name search saw the newest 1,000 matches only).

The 1,001 runs are made once for the module in a sqlite store: the first 15 logged through MlflowClient
(tests/many_runs.py: three calls a run, summaries only; about 30 ms a run here, 29-57 s for all 1,001 on this
shared 2-core machine), the other 986 copies of them row by row in SQL (many_runs.copy_runs), each the run
many_runs.py would have logged as run ``i`` (run i's figures repeat every 15 runs) but for its id. The tests that
use them are slow. Named so the name search's first page misses one: run 0 (the oldest) is ``STEM``, runs
1..1000 are ``STEM-2`` .. ``STEM-1001``.
"""

from __future__ import annotations

import csv
import html
import io
import time

import pytest
from click.testing import CliRunner

from mlflow_llmeff import names

from conftest import empty_store

STEM = "tiny-fp32-gbt1k-s128-cpu"
N = 1001
#: Runs logged through MlflowClient before the rest are copied: many_runs.py's figures of run i repeat with
#: period 15 (five configurations x three tokens/s offsets).
LOGGED = 15


def _name(i: int) -> str:
    return STEM if i == 0 else f"{STEM}-{i + 1}"


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    """``(client, experiment id, run ids oldest first, seconds the logging took)`` of 1,001 runs."""
    import mlflow

    from many_runs import copy_runs, log_many_runs

    uri = empty_store(tmp_path_factory.mktemp("scale") / "mlflow.db")
    client = mlflow.MlflowClient(uri)
    t = time.perf_counter()
    exp_id, ids = log_many_runs(client, "scale", LOGGED, run_name=_name, history=False)
    ids += copy_runs(uri, ids, range(LOGGED, N), lambda i, _logged_name: _name(i))
    made_s = time.perf_counter() - t
    # a copy is the run many_runs.py logs as its index, but for its id: run 1000 against run 1000 % 15
    copy, logged = client.get_run(ids[N - 1]), client.get_run(ids[(N - 1) % LOGGED])
    shift = 1000 * (N - 1 - (N - 1) % LOGGED)
    assert (copy.info.run_name, copy.data.tags["mlflow.runName"]) == (_name(N - 1), _name(N - 1))
    assert (copy.info.start_time, copy.info.end_time) == (logged.info.start_time + shift, logged.info.end_time + shift)
    assert (copy.info.status, copy.data.metrics, copy.data.params) == (logged.info.status, logged.data.metrics,
                                                                       logged.data.params)
    assert {k: v for k, v in copy.data.tags.items() if k != "mlflow.runName"} == \
        {k: v for k, v in logged.data.tags.items() if k != "mlflow.runName"}
    assert [(m.timestamp - shift, m.step) for m in client.get_metric_history(copy.info.run_id, names.SUM_TOKENS_PER_SEC)] \
        == [(m.timestamp, m.step) for m in client.get_metric_history(logged.info.run_id, names.SUM_TOKENS_PER_SEC)]
    return client, exp_id, ids, made_s, uri


# ------------------------------------------------------------------------- paging, with a fake client
class _PagedClient:
    """A client whose searches return ``page`` results a call with a page token, like MLflow's."""

    def __init__(self, runs, experiments=("0",), page=2):
        self.runs, self.experiments, self.page, self.calls = list(runs), list(experiments), page, []

    @staticmethod
    def _slice(items, size, token):
        from mlflow.store.entities.paged_list import PagedList

        start = int(token or 0)
        end = start + min(size, 1000)
        return PagedList(items[start:end], str(end) if end < len(items) else None)

    def search_runs(self, experiment_ids, filter_string="", run_view_type=1, max_results=1000, order_by=None,
                    page_token=None):
        self.calls.append(("runs", page_token))
        return self._slice(self.runs, min(max_results, self.page), page_token)

    def search_experiments(self, view_type=1, max_results=1000, filter_string=None, order_by=None, page_token=None):
        from types import SimpleNamespace

        self.calls.append(("experiments", page_token))
        return self._slice([SimpleNamespace(experiment_id=e) for e in self.experiments],
                           min(max_results, self.page), page_token)


def _run(name: str, metrics=None, tags=None):
    from types import SimpleNamespace

    return SimpleNamespace(info=SimpleNamespace(run_id=f"id-{name}", run_name=name),
                           data=SimpleNamespace(metrics=metrics or {}, tags=tags or {}, params={}))


def test_all_runs_follows_page_tokens_to_the_end():
    from mlflow_llmeff.tracking.search import all_runs

    client = _PagedClient([_run(str(i)) for i in range(5)], page=2)
    assert [r.info.run_name for r in all_runs(client, ["0"])] == ["0", "1", "2", "3", "4"]
    assert client.calls == [("runs", None), ("runs", "2"), ("runs", "4")]


def test_all_experiment_ids_follows_page_tokens_to_the_end():
    from mlflow_llmeff.tracking.search import all_experiment_ids

    client = _PagedClient([], experiments=["0", "1", "2"], page=2)
    assert all_experiment_ids(client) == ["0", "1", "2"]


def test_next_name_counts_matches_past_the_first_page():
    from mlflow_llmeff.tracking.runs import unique_run_name

    # newest first: 'x-2', 'x-3' on the first page, 'x' itself only on the second
    client = _PagedClient([_run("x-2"), _run("x-3"), _run("x")], page=2)
    assert unique_run_name(client, "0", "x") == "x-4"


def test_every_copy_of_a_retried_creation_is_found_past_the_first_page():
    from mlflow_llmeff.tracking.outbox import keep_only

    class Deleting(_PagedClient):
        def delete_run(self, run_id):
            self.runs = [r for r in self.runs if r.info.run_id != run_id]

    copies = Deleting([_run(str(i)) for i in range(150)], page=100)  # the old search read the first 100
    assert len(keep_only(copies, "0", "local-x", "id-0")) == 149
    assert [r.info.run_id for r in copies.runs] == ["id-0"]


def test_predictions_read_earlier_runs_past_the_first_page():
    from mlflow_llmeff.planning.predict import history_tflops

    runs = [_run(str(i), {names.SUM_DEVICE_TFLOPS: tf}, {names.MODEL_NAME: "m"}) for i, tf in enumerate((1.0, 2.0, 9.0))]
    client = _PagedClient(runs, experiments=["0", "1", "2"], page=2)
    tflops, n, _ = history_tflops(client, "cpu", "m")
    assert (tflops, n) == (2.0, 3)  # the median of all three; the first page alone gives 1.5 of two


# ------------------------------------------------------------------------------- 1,001 runs, sqlite
@pytest.mark.slow
def test_the_name_search_first_page_misses_the_oldest_match(big):
    # what the fault needed: MLflow's one page of matches leaves the oldest run's name out
    client, exp_id, _, _, _ = big
    first_page = {r.info.run_name for r in client.search_runs([exp_id], f"attributes.run_name LIKE '{STEM}%'",
                                                              max_results=1000)}
    assert len(first_page) == 1000 and STEM not in first_page


@pytest.mark.slow
def test_the_next_auto_name_is_not_taken_with_1001_matches(big):
    from mlflow_llmeff.tracking.runs import unique_run_name

    client, exp_id, _, _, _ = big
    assert unique_run_name(client, exp_id, STEM) == f"{STEM}-1002"


@pytest.mark.slow
def test_select_runs_reads_all_1001_runs_newest_first(big):
    from mlflow_llmeff.report.source import select_runs

    client, exp_id, ids, _, _ = big
    sel = select_runs(client, "scale")
    assert [r.run_id for r in sel.runs] == ids[::-1]
    assert sel.count_line() == "1,001 runs compared: every active run of the experiment"


@pytest.mark.slow
def test_compare_reports_all_1001_runs(big, tmp_path, monkeypatch):
    from mlflow_llmeff.cli import main

    _, _, ids, _, uri = big
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    r = CliRunner().invoke(main, ["compare", "--experiment", "scale", "--out", str(tmp_path / "o")],
                           catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert "1001 runs of 'scale' compared" in r.output
    rows = list(csv.DictReader(io.StringIO((tmp_path / "o" / "report.csv").read_text())))
    assert sorted(row["run_id"] for row in rows) == sorted(ids)
    md = (tmp_path / "o" / "report.md").read_text()
    assert "1,001 runs compared: every active run of the experiment" in md
    assert sum(ln.startswith("| [") for ln in md[md.index("## All runs"):].splitlines()) == 1001


@pytest.mark.slow
def test_the_page_first_screen_says_it_shows_all_1001_runs(big, tmp_path, monkeypatch):
    import tempfile

    from flask import Flask

    from mlflow_llmeff.report import server as srv

    client, exp_id, _, _, _ = big
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(srv, "_store", lambda: client)
    app = Flask("t")
    srv.register(app)
    page = app.test_client().get(f"/llmeff/experiments/{exp_id}").get_data(as_text=True)
    count = page.index("<p class='note' id='run-count'>1,001 runs compared: every active run of the experiment</p>")
    assert count < page.index("<table id='headline'")  # above the answer: on the first screen
    # the runs table shows the first 200 and says so, with where every run is; report.csv keeps all
    # 1,001 (test_compare_reports_all_1001_runs)
    assert "All runs: 200 of 1,001 runs shown x " in page and page.count("data-run-id=") == 200
    assert "<p class='warn' id='runs-shown'>200 of 1,001 runs shown (the best configuration's" in page
    link = page.split("<a id='all-runs-link' href='")[1].split("'")[0].replace("&amp;", "&")
    assert link == f"/llmeff/experiments/{exp_id}?all_runs=1"
    every = app.test_client().get(link).get_data(as_text=True)
    assert "All runs: 1,001 runs x " in every and every.count("data-run-id=") == 1001 and "runs-shown" not in every
    bad = app.test_client().get(f"/llmeff/experiments/{exp_id}?all_runs=yes")
    assert bad.status_code == 400 and "all_runs='yes' is not accepted; give all_runs=1" in bad.get_data(as_text=True)


# ------------------------------------------------------- the server's store read by SQL, cached pages
@pytest.fixture
def five_store(tmp_path):
    """``(SqlAlchemyStore, MlflowClient, experiment id)`` of the five standard runs in one sqlite file."""
    import mlflow
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    from five_runs import log_five_runs

    uri = empty_store(tmp_path / "m.db")
    client = mlflow.MlflowClient(uri)
    exp_id, _ = log_five_runs(client, "five")
    return SqlAlchemyStore(uri, str(tmp_path / "artifacts")), client, exp_id


@pytest.mark.parametrize("filter_string", [
    "", "tags.`llmeff.accelerator.count` = '2'", "metrics.`summary/tokens_per_sec` > 42000",
    "attributes.run_name LIKE 'llama-tiny-%-gbt1024%'", "attributes.status = 'FINISHED'",
    "params.model = 'llama-160m'", "tags.`llmeff.eval.documents` IS NOT NULL"])
def test_the_store_read_by_sql_selects_what_search_runs_selects(five_store, filter_string):
    from mlflow_llmeff.report.source import _read_by_sql, select_runs

    store, client, exp_id = five_store
    assert _read_by_sql(store, exp_id, filter_string) is not None  # the SQL read, not the fallback
    by_sql, by_search = select_runs(store, exp_id, filter_string), select_runs(client, exp_id, filter_string)
    # ids, names, status, metrics, tags, params; in the same order: of the keys the reports show (and those the
    # filter names), which are all the SQL read takes (source.REPORT_*)
    assert by_sql.runs == [_shown(r, filter_string) for r in by_search.runs]
    assert len(by_sql.runs) >= 1 and all(r.tags and r.metrics for r in by_sql.runs)


def _shown(r, filter_string: str):
    """``r`` with only the keys the SQL read takes: ``llmeff.*`` tags and the name, the report's metric
    prefixes, its params, and the keys ``filter_string`` names."""
    import dataclasses

    from mlflow_llmeff.report import source
    from mlflow_llmeff.tracking.search import parse_filter

    extra = source._filter_keys(parse_filter(filter_string))
    return dataclasses.replace(
        r, tags={k: v for k, v in r.tags.items() if k.startswith("llmeff.") or k == "mlflow.runName" or k in extra["tags"]},
        metrics={k: v for k, v in r.metrics.items() if k.startswith(source.REPORT_METRIC_PREFIXES)
                 or k in extra["latest_metrics"]},
        params={k: v for k, v in r.params.items() if k in source.REPORT_PARAMS or k in extra["params"]})


def test_the_store_read_by_sql_refuses_a_bad_filter_in_one_line(five_store):
    from mlflow_llmeff.report.source import select_runs

    store, _, exp_id = five_store
    with pytest.raises(ValueError, match=r"^bad filter 'metrics.x >>> 1': "):
        select_runs(store, exp_id, "metrics.x >>> 1")


def test_an_unchanged_page_is_served_again_and_a_new_point_rebuilds_it(five_store, tmp_path, monkeypatch):
    import tempfile

    from flask import Flask

    from mlflow_llmeff.report import render
    from mlflow_llmeff.report import server as srv

    store, client, exp_id = five_store
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(srv, "_store", lambda: store)
    builds = []
    real = render.build_report
    monkeypatch.setattr(render, "build_report", lambda *a, **k: builds.append(1) or real(*a, **k))
    app = Flask("t")
    srv.register(app)
    web = app.test_client()
    url = f"/llmeff/experiments/{exp_id}"
    first = web.get(url).get_data(as_text=True)
    digest = first.split("/llmeff/figures/")[1].split("/")[0]
    srv._drawing.get(digest, srv.threading.Event()).wait(120)  # the figures drawn
    second = web.get(url).get_data(as_text=True)
    third = web.get(url).get_data(as_text=True)
    # built once: the second request (figures drawn by then) is the first page with its figures filled in
    assert len(builds) == 1 and third == second
    drawn, notes = srv._cached(digest)
    assert second.count(f"/llmeff/figures/{digest}/") == len(drawn) > 0 and all(html.escape(n) in second for n in notes)
    assert first.split("<h2>Figures</h2>")[0] == second.split("<h2>Figures</h2>")[0]
    run_id = client.search_runs([exp_id], max_results=1)[0].info.run_id
    client.log_metric(run_id, names.SUM_TOKENS_PER_SEC, 99_000.0, step=60)
    fourth = web.get(url).get_data(as_text=True)
    assert len(builds) == 2 and "99,000" in fourth  # the new point in the All runs table


def test_a_store_whose_tables_the_sql_read_does_not_know_falls_back_to_mlflows_search():
    from mlflow_llmeff.report.source import _read_by_sql

    class Engine:
        def connect(self):
            raise RuntimeError("no such table: latest_metrics")

    class Store:  # a database-backed store (ManagedSessionMaker) whose schema is not MLflow's 1.x-3.x one
        ManagedSessionMaker = object()
        engine = Engine()

    assert _read_by_sql(Store(), "1", "") is None
