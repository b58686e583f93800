"""The efficiency page's request path, by counted work (queries issued, rows read, reports built, pages
rendered), never wall time: an unchanged store serves the page it served, a new point builds it again,
and the runs are read by the keys the reports show."""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

from mlflow_llmeff import names

REPORT = pathlib.Path(__file__).resolve().parents[1] / "mlflow_llmeff" / "report"


@pytest.fixture
def page(tmp_path, monkeypatch):
    """``(get, store, client, experiment id, run ids)``: the five standard runs in a sqlite store, served by
    the page's routes on a Flask test app over MLflow's own SqlAlchemyStore (the server's store)."""
    import mlflow
    from flask import Flask
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    from five_runs import log_five_runs
    from mlflow_llmeff.report import server as srv
    from mlflow_llmeff.report import source

    uri = f"sqlite:///{tmp_path / 'm.db'}"
    client = mlflow.MlflowClient(uri)
    exp_id, ids = log_five_runs(client, "five")
    store = SqlAlchemyStore(uri, str(tmp_path / "artifacts"))
    monkeypatch.setattr(srv, "_store", lambda: store)
    monkeypatch.setattr(source, "SETTLED_S", 0.0)  # the store is not written while a request reads it
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the figures' disk cache: this test's own
    for cache in (srv._pages, srv._tokens, srv._figures):
        cache.clear()
    app = Flask("t")
    srv.register(app)
    web = app.test_client()

    def get(query: str = "") -> str:
        r = web.get(f"/llmeff/experiments/{exp_id}{query}")
        assert r.status_code == 200
        return r.get_data(as_text=True)

    return get, store, client, exp_id, ids


def _counts():
    from mlflow_llmeff.report import server as srv
    from mlflow_llmeff.report import source

    return dict(source.READ.__dict__, **srv.RENDERED)


def _delta(before: dict, after: dict) -> dict:
    return {k: after[k] - before[k] for k in after}


def test_an_unchanged_store_serves_the_page_again_without_reading_a_run(page):
    get, *_ = page
    c0 = _counts()
    first = get()
    c1 = _counts()
    # the first request: the store's change token, four queries (runs, metrics, tags, params), one report, one page
    assert _delta(c0, c1) == {"queries": 4, "rows": _delta(c0, c1)["rows"], "tokens": 1, "reports": 1, "pages": 1}
    assert _delta(c0, c1)["rows"] > 5
    second = get()
    assert _delta(c1, _counts()) == {"queries": 0, "rows": 0, "tokens": 1, "reports": 0, "pages": 0}
    assert second == first


def test_a_new_point_reads_the_runs_and_builds_the_page_again(page):
    get, _, client, _, ids = page
    first = get()
    client.log_metric(ids[0], names.SUM_TOKENS_PER_SEC, 50_000.0, step=10**6)  # a figure the page shows (latest)
    c0 = _counts()
    again = get()
    d = _delta(c0, _counts())
    assert (d["queries"], d["tokens"], d["reports"], d["pages"]) == (4, 1, 1, 1)
    assert "50,000" in again and "50,000" not in first


def test_another_query_is_its_own_page(page):
    get, *_ = page
    get()
    c0 = _counts()
    get("?precision=fp32")
    d = _delta(c0, _counts())
    # a filter is on: its runs, then every run for the filter form's values (4 + 4 queries)
    assert (d["queries"], d["reports"], d["pages"]) == (8, 1, 1)


def test_a_store_written_within_the_settling_time_gives_no_token(page, monkeypatch):
    from mlflow_llmeff.report import source

    _, store, client, _, ids = page
    monkeypatch.setattr(source, "SETTLED_S", 3600.0)  # every write is recent
    assert source.change_token(store) is None
    monkeypatch.setattr(source, "SETTLED_S", 0.0)
    before = source.change_token(store)
    client.log_metric(ids[0], names.TRAIN_LOSS, 1.0, step=99)
    assert before.startswith("sqlite:") and source.change_token(store) != before


def test_the_runs_are_read_by_the_keys_the_reports_show(page):
    from mlflow_llmeff.report import source

    _, store, client, exp_id, ids = page
    client.set_tag(ids[0], "team.note", "x" * 5000)  # a long tag no report shows
    client.log_metric(ids[0], "system/cpu_utilization_percentage", 12.0)
    client.log_param(ids[0], "lr", "0.001")
    run = next(r for r in source.select_runs(store, exp_id).runs if r.run_id == ids[0])
    assert "team.note" not in run.tags and "system/cpu_utilization_percentage" not in run.metrics
    assert "lr" not in run.params and names.SUM_TOKENS_PER_SEC in run.metrics and names.PRECISION in run.tags
    # a filter on such keys reads them (MLflow's evaluator sees what it filters on)
    got = source.select_runs(store, exp_id, "params.lr = '0.001' and tags.`team.note` != ''").runs
    assert [r.run_id for r in got] == [ids[0]] and got[0].params["lr"] == "0.001"


def _read_literals(node_kind: str) -> set[str]:
    """The string keys the report modules read from a run's ``params`` (``r.params.get("x")``, ``r.params["x"]``)."""
    out = set()
    for path in REPORT.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
                target, arg = node.func.value, (node.args[0] if node.args else None)
            elif isinstance(node, ast.Subscript):
                target, arg = node.value, node.slice
            else:
                continue
            if isinstance(target, ast.Attribute) and target.attr == node_kind and isinstance(arg, ast.Constant) \
                    and isinstance(arg.value, str):
                out.add(arg.value)
    return out


def test_every_param_and_metric_the_reports_read_is_among_the_keys_read():
    from mlflow_llmeff.report.calc import COMPARABILITY
    from mlflow_llmeff.report.source import REPORT_METRIC_PREFIXES, REPORT_PARAMS

    params = _read_literals("params") | {p for _, _, p, _, _ in COMPARABILITY if p}
    assert params and params <= set(REPORT_PARAMS)
    # every metric key of names.py a report module names
    used = set()
    for path in REPORT.glob("*.py"):
        used |= set(re.findall(r"names\.([A-Z][A-Z0-9_]+)", path.read_text()))
    keys = [getattr(names, u) for u in used if isinstance(getattr(names, u, None), str)]
    metric_keys = {k for k in keys if "/" in k and not k.startswith("llmeff.")}
    assert metric_keys and all(k.startswith(REPORT_METRIC_PREFIXES) for k in metric_keys), \
        sorted(k for k in metric_keys if not k.startswith(REPORT_METRIC_PREFIXES))
