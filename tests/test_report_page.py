"""The efficiency page's request path, by counted work (queries issued, rows read, reports built, pages
rendered), never wall time: an unchanged store serves the page it served, a new point builds it again,
and the runs are read by the keys the reports show."""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

from mlflow_llmeff import names

from conftest import empty_store

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

    uri = empty_store(tmp_path / "m.db")
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


@pytest.fixture
def undrawn(monkeypatch):
    """The pages' figures left as being drawn: every page served here is the one a request gets before its
    figures are drawn (every figure's URL, no image size). These tests count reads and compare pages, which
    the drawing does not touch; it cost ~1 s of CPU a run set, in a thread outliving the test. The drawing
    itself: test_the_exit_waits_for_the_figures_being_drawn, the figure tests below, test_scale's cached page,
    test_server_modes. Yields the digests whose drawing was started, in order."""
    import threading

    from mlflow_llmeff.report import server as srv

    started = []

    def start_drawing(store, rep, digest):
        with srv._lock:
            if digest not in srv._figures and digest not in srv._drawing:
                srv._drawing[digest] = threading.Event()  # under way, as the real drawing is for ~1 s
                started.append(digest)

    monkeypatch.setattr(srv, "_start_drawing", start_drawing)
    yield started
    with srv._lock:
        for digest in started:
            srv._drawing.pop(digest, None)


def _counts():
    from mlflow_llmeff.report import server as srv
    from mlflow_llmeff.report import source

    return dict(source.READ.__dict__, **srv.RENDERED)


def _delta(before: dict, after: dict) -> dict:
    return {k: after[k] - before[k] for k in after}


def test_an_unchanged_store_serves_the_page_again_without_reading_a_run(page, undrawn):
    get, *_ = page
    c0 = _counts()
    first = get()
    c1 = _counts()
    # the first request: the store's change token, four queries (runs, metrics, tags, params), one report, one page
    assert _delta(c0, c1) == {"queries": 4, "rows": _delta(c0, c1)["rows"], "tokens": 1, "reports": 1, "pages": 1}
    assert _delta(c0, c1)["rows"] > 5
    second = get()
    assert _delta(c1, _counts()) == {"queries": 0, "rows": 0, "tokens": 1, "reports": 0, "pages": 0}
    assert second == first and len(undrawn) == 1  # its figures started once


def test_the_exit_waits_for_the_figures_being_drawn(page):
    """A page starts drawing its figures in a thread; at exit, :func:`finish_background` (an atexit hook)
    waits for it: a process whose drawing thread was still in matplotlib's C++ font code when the interpreter
    finalized aborted with status 134 (``pytest -n 0 tests/test_mlperf.py``: 28 passed, then the abort)."""
    import inspect
    import threading

    from mlflow_llmeff.report import server as srv

    get, *_ = page
    get()
    drawing = [t for t in threading.enumerate() if t.name.startswith("llmeff-figures-")]
    assert drawing and all(t in srv._background for t in drawing)  # this page's (and an earlier test's, if alive)
    assert srv.finish_background(60.0) == 0
    assert not any(t.is_alive() for t in drawing) and srv._figures  # drawn, not abandoned
    # and it runs at exit: registered where it is defined (atexit keeps no list a test could read, and
    # atexit.unregister says nothing of what it removed)
    assert "\n@atexit.register\ndef finish_background(" in inspect.getsource(srv)


def test_a_new_point_reads_the_runs_and_builds_the_page_again(page, undrawn):
    get, _, client, _, ids = page
    first = get()
    client.log_metric(ids[0], names.SUM_TOKENS_PER_SEC, 50_000.0, step=10**6)  # a figure the page shows (latest)
    c0 = _counts()
    again = get()
    d = _delta(c0, _counts())
    assert (d["queries"], d["tokens"], d["reports"], d["pages"]) == (4, 1, 1, 1)
    assert "50,000" in again and "50,000" not in first


def test_another_query_is_its_own_page(page, undrawn):
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


# ------------------------------------------------------------- the sqlite read, one row per run (issue 53)
def test_the_grouped_sqlite_read_gives_the_records_the_row_read_gives(page, monkeypatch):
    """The sqlite read joins each run's keys and values in SQL (one row per run); every record equals the
    row-per-value read's (tags, params, names, metrics to the last bit: doubles written with 21 digits)."""
    import math

    from mlflow_llmeff.report import source

    _, store, client, exp_id, ids = page
    odd = [0.1 + 0.2, 1 / 3, 5e-324, 2.2250738585072014e-308, 1.7976931348623157e308, 1e23, 8.228927346002939e-297]
    for i, v in enumerate(odd):
        client.log_metric(ids[0], f"summary/odd_{i}", v)
    client.log_metric(ids[1], "summary/not_a_number", float("nan"))
    client.set_tag(ids[2], "llmeff.note", "a\x1fvalue holding the separator")  # read again by rows
    client.set_tag(ids[3], "mlflow.runName", "a name\x1fholding the separator")  # its set read again by rows
    source.READ.reset()
    grouped = source.select_runs(store, exp_id).runs
    # four queries, and one by rows for the tags of the two runs the joined strings cannot carry
    assert source.READ.queries == 5
    source.READ.reset()
    monkeypatch.setattr(source, "_sqlite_grouped", source._by_rows)
    by_rows = source.select_runs(store, exp_id).runs
    assert [r.run_id for r in grouped] == [r.run_id for r in by_rows] and len(grouped) == 5
    for a, b in zip(grouped, by_rows):
        nan = [k for k, v in a.metrics.items() if math.isnan(v)]
        assert nan == [k for k, v in b.metrics.items() if math.isnan(v)]
        assert {k: v for k, v in a.metrics.items() if k not in nan} == {k: v for k, v in b.metrics.items() if k not in nan}
        assert (a.name, a.status, a.tags, a.params, a.start_time_ms) == (b.name, b.status, b.tags, b.params, b.start_time_ms)
    first = next(r for r in grouped if r.run_id == ids[0])
    assert [first.metrics[f"summary/odd_{i}"] for i in range(len(odd))] == odd
    assert next(r for r in grouped if r.run_id == ids[2]).tags["llmeff.note"] == "a\x1fvalue holding the separator"
    assert next(r for r in grouped if r.run_id == ids[3]).name == "a name\x1fholding the separator"
    assert next(r for r in grouped if r.run_id == ids[1]).metrics["summary/not_a_number"] != 0  # NaN, never a 0


def test_the_grouped_read_makes_a_row_per_run_and_a_row_per_set_of_tags(tmp_path):
    """20 runs, 4 repeats of each of 5 configurations: the runs' row each (with its name), a row of metrics
    each, and 5 rows of tags (one per distinct set, the repeats' ids joined): each set parsed and masked once,
    every record its own dict holding its own name."""
    import mlflow
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    from many_runs import log_many_runs
    from mlflow_llmeff.report import source

    uri = empty_store(tmp_path / "m.db")
    exp_id, ids = log_many_runs(mlflow.MlflowClient(uri), "twenty", 20, history=False)
    store = SqlAlchemyStore(uri, str(tmp_path / "artifacts"))
    source.READ.reset()
    runs = source.select_runs(store, exp_id).runs
    assert (source.READ.queries, source.READ.rows) == (4, 20 + 20 + 5 + 0)  # no param the reports read
    assert sorted(r.run_id for r in runs) == sorted(ids)
    assert all(r.tags["mlflow.runName"] == r.name and r.name.endswith(f"-r{ids.index(r.run_id)}") for r in runs)
    assert len({id(r.tags) for r in runs}) == 20
    sets = {i: {tuple(sorted((k, v) for k, v in r.tags.items() if k != "mlflow.runName"))
                for r in runs if ids.index(r.run_id) % 5 == i} for i in range(5)}
    assert all(len(s) == 1 for s in sets.values()) and len(set.union(*sets.values())) == 5  # 5 sets, repeats alike


def test_the_report_worked_out_once_per_kind_of_runs_is_the_report_worked_out_per_run(tmp_path):
    """Runs read alike (RunRecord.alike: the same metric keys, tags but the name, and params) have what depends
    on those worked out once for all of them; the report equals, figure for figure and page for page, the one
    built from the same records each taken alone (alike None, as an MlflowClient's search gives them). 40
    repeats of 5 configurations, some made to differ: a stall, an assumption, seeds, a FAILED run, another
    length, a run stopped at its targets, another dataset, a figure on one run only, a target some repeats
    reached."""
    import dataclasses

    import mlflow
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    from many_runs import log_many_runs
    from mlflow_llmeff.report import render, source

    uri = empty_store(tmp_path / "m.db")
    client = mlflow.MlflowClient(uri)
    exp_id, ids = log_many_runs(client, "kinds", 40, history=False)
    client.set_tag(ids[3], names.STABILITY, "unstable: a stall")
    client.set_tag(ids[8], names.ASSUMED, "price: 2.0 USD a device-hour (list)")
    for k, i in enumerate((0, 5, 10, 15)):
        client.log_param(ids[i], "seed", str(k))
    client.set_terminated(ids[6], "FAILED")
    client.log_metric(ids[11], names.SUM_STEPS, 99.0)
    client.log_metric(ids[12], names.SUM_MFU, 0.25)
    client.set_tag(ids[13], names.DATASET, "another")
    for i in (11, 16):  # one length by the metric, and one set by targets
        client.log_metric(ids[i], names.SUM_GOODPUT, 0.5)
    for k, v in (("stop_at_targets", "true"), ("targets", "val_loss=3.0"), ("max_steps", "60")):
        client.log_param(ids[16], k, v)
    i, ttq = next((i, k) for i in range(5) for k in client.get_run(ids[i]).data.tags
                  if k.startswith(names.TTQ_TAG_PREFIX))
    client.set_tag(ids[i + 5], ttq, "not reached")
    store = SqlAlchemyStore(uri, str(tmp_path / "artifacts"))
    sel = source.select_runs(store, exp_id)
    kinds = {r.alike for r in sel.runs}
    assert None not in kinds and 5 < len(kinds) < 40  # the configurations' repeats read alike, the changed apart
    alone = dataclasses.replace(sel, runs=[dataclasses.replace(r, alike=None) for r in sel.runs])
    a, b = (render.build_report(store, s, plots=False) for s in (sel, alone))
    assert [w.text() for w in a.warnings] == [w.text() for w in b.warnings] and a.warnings
    assert [(c.key, c.label, [r.run_id for r in c.used], [c.estimate(k) for k in a.columns], c.note())
            for c in a.configs] == [(c.key, c.label, [r.run_id for r in c.used], [c.estimate(k) for k in b.columns],
                                     c.note()) for c in b.configs]
    assert (a.columns, a.tag_columns, a.scaling) == (b.columns, b.tag_columns, b.scaling)
    assert [(t.target, t.runs, t.scores, t.missing) for t in a.targets] == \
        [(t.target, t.runs, t.scores, t.missing) for t in b.targets] and a.targets
    assert render.to_html(a) == render.to_html(b) and render.to_markdown(a) == render.to_markdown(b)
    assert render.to_csv(a) == render.to_csv(b)
    assert "1 unstable repeat kept in the figures" in render.to_html(a) and "assumed (llmeff.assumed)" in render.to_html(a)


def test_a_target_none_of_2000_runs_reached_names_five_of_them_and_counts_the_rest():
    from mlflow_llmeff.report import mlperf

    class Run:
        def __init__(self, i):
            self.label, self.end_s, self.steps, self.status = f"run-{i}", 10.0, 50, "FINISHED"

    class Score:
        not_reached = [Run(i) for i in range(2000)]

    got = mlperf._not_reached(Score())
    assert got[:5] == [f"run-{i} did not reach it (10 s, 50 steps)" for i in range(5)]
    assert got[5:] == ["and 1,995 more runs that did not reach it or failed (each run's row: the All runs table, "
                       "report.csv)"]


# ------------------------------------------------------------------------------ figures (issue 53)
def _five_figures(tmp_path):
    """Every figure of the five standard runs, laid out as the page draws it: ``{name: figure}``."""
    import mlflow

    from five_runs import log_five_runs
    from mlflow_llmeff.report import plots
    from mlflow_llmeff.report.render import build_report
    from mlflow_llmeff.report.source import metric_history, select_runs

    client = mlflow.MlflowClient(empty_store(tmp_path / 'f.db'))
    log_five_runs(client, "five")
    rep = build_report(client, select_runs(client, "five"), plots=False)
    out = {}
    for name, fn in plots.FIGURES:
        fig = fn(rep, lambda run_id, key: metric_history(client, run_id, key))
        if not isinstance(fig, str):
            plots.lay_out(fig)
            out[name] = fig
    return out


def test_the_time_to_target_label_lies_inside_the_image_written(tmp_path):
    # laid out at matplotlib's 100 dpi and written at 90, the label 'llama-tiny-cpu-…(+1 repeat):
    # val_loss_le_3.0' started at x = -0.8 px: its first letter cut. The layout is at the PNG's dpi now.
    import io

    import numpy as np
    from PIL import Image

    from mlflow_llmeff.report import plots

    figs = _five_figures(tmp_path)
    fig = figs["ttq.png"]
    r = fig.canvas.get_renderer()
    assert fig.dpi == plots.DPI
    labels = [t for t in fig.axes[0].get_yticklabels() if t.get_text()]
    assert [t.get_text() for t in labels] == ["llama-tiny-cpu-\u2026(+1 repeat): val_loss_le_3.0"]
    for t in labels + [fig.axes[0].xaxis.label, fig.axes[0].title]:
        bb = t.get_window_extent(r)
        assert bb.x0 >= 0 and bb.y0 >= 0 and bb.x1 <= fig.bbox.width and bb.y1 <= fig.bbox.height, (t.get_text(), bb)
    png = plots.png(fig)
    ink = np.asarray(Image.open(io.BytesIO(png)).convert("L")) < 200
    assert plots.png_size(png) == (630, 234) and not ink[:, :3].any()  # nothing drawn in the first 3 columns


def test_no_legend_box_covers_a_plotted_point(tmp_path):
    figs = _five_figures(tmp_path)
    checked = 0
    for name, fig in figs.items():
        r = fig.canvas.get_renderer()
        for ax in fig.axes:
            legends = [a.get_legend() for a in fig.axes if a.get_legend() is not None]
            points = []
            for coll in ax.collections:  # scatter points (errorbar lines are LineCollections without offsets)
                offsets = coll.get_offsets()
                if len(offsets) and hasattr(coll, "get_sizes") and len(coll.get_sizes()):
                    points += [tuple(p) for p in coll.get_offset_transform().transform(offsets)]
            for line in ax.lines:  # curves' points
                points += [tuple(p) for p in line.get_transform().transform(line.get_xydata())]
            boxes = [p.get_window_extent(r) for p in ax.patches]  # bars
            for legend in legends:
                lb = legend.get_window_extent(r)
                inside = [p for p in points if lb.x0 <= p[0] <= lb.x1 and lb.y0 <= p[1] <= lb.y1]
                assert not inside, (name, lb, inside[:3])
                assert not [b for b in boxes if b.overlaps(lb) and b.width > 0 and b.height > 0], name
                checked += len(points) + len(boxes)
    assert checked > 50


# ------------------------------------------------------------- the same page, counted work (issue 53)
_FIGURE_KEY = re.compile(r"/llmeff/figures/[0-9]+-[0-9a-f]+/")


@pytest.mark.parametrize("query", ["", "?all_runs=1", "?precision=fp32", "?group_by=model.name",
                                   "?filter=metrics.%60summary/goodput%60%20%3E%200.3"])
def test_the_page_read_by_sql_is_the_page_read_through_mlflows_search(page, undrawn, monkeypatch, query):
    """The page of the store's SQL read (its keys, side by side, the figures' key from the rows read) is
    the page of MLflow's own ``search_runs`` records (the path of a store that is not SQL), character for
    character but the figures' key."""
    from mlflow_llmeff.report import server as srv
    from mlflow_llmeff.report import source

    get, *_ = page
    by_sql = get(query)
    for cache in (srv._pages, srv._tokens, srv._figures):
        cache.clear()
    monkeypatch.setattr(source, "_sql_engine", lambda client: None)  # a store without tables: search_runs
    c0 = _counts()
    by_search = get(query)
    assert _delta(c0, _counts())["queries"] == 0  # no SQL read: MLflow's search
    assert _FIGURE_KEY.sub("/llmeff/figures/K/", by_sql) == _FIGURE_KEY.sub("/llmeff/figures/K/", by_search)
    assert "data-run-id=" in by_sql and _FIGURE_KEY.search(by_sql)


def test_the_first_request_issues_four_queries_however_many_runs(tmp_path, monkeypatch, undrawn):
    """The page's first request: four queries (runs, metrics, tags, params) for 5 runs and for 60, one report
    and one page; the rows read: a run's and its metrics' row per run, and one row per distinct set of tags
    (sqlite's grouped read: 60 repeats of 5 configurations make 5 rows of tags, not 60)."""
    import mlflow
    from flask import Flask
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    from many_runs import log_many_runs
    from mlflow_llmeff.report import server as srv
    from mlflow_llmeff.report import source

    uri = empty_store(tmp_path / "m.db")
    client = mlflow.MlflowClient(uri)
    small, _ = log_many_runs(client, "small", 5, history=False)
    large, _ = log_many_runs(client, "large", 60, history=False)
    store = SqlAlchemyStore(uri, str(tmp_path / "artifacts"))
    monkeypatch.setattr(srv, "_store", lambda: store)
    monkeypatch.setattr(source, "SETTLED_S", 0.0)
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    for cache in (srv._pages, srv._tokens, srv._figures):
        cache.clear()
    app = Flask("t")
    srv.register(app)
    web = app.test_client()
    got = {}
    for exp_id, n in ((small, 5), (large, 60)):
        c0 = _counts()
        assert web.get(f"/llmeff/experiments/{exp_id}").status_code == 200
        got[n] = _delta(c0, _counts())
    for n, d in got.items():
        assert (d["queries"], d["tokens"], d["reports"], d["pages"]) == (4, 1, 1, 1)
    # the runs (each with its name), a row per run of metrics, and a row per distinct set of tags: the five
    # standard configurations' (these runs hold no param the reports read)
    assert (got[5]["rows"], got[60]["rows"]) == (5 + 5 + 5, 60 + 60 + 5)


def test_the_tables_read_side_by_side_give_the_records_and_key_read_in_turn(page, monkeypatch):
    from mlflow_llmeff.report import source

    _, store, _, exp_id, _ = page
    side = source.select_runs(store, exp_id)
    monkeypatch.setattr(source, "_SIDE_BY_SIDE", False)
    in_turn = source.select_runs(store, exp_id)
    assert side.runs == in_turn.runs and side.content == in_turn.content and len(side.content) == 40
    assert source.select_runs(store, exp_id, "tags.`llmeff.precision` = 'fp32'").content != side.content


def test_inside_mlflow_server_the_store_is_made_before_the_first_page(tmp_path, monkeypatch):
    """With ``mlflow server``'s backend store URI in the environment, registering the pages makes the worker's
    tracking store in the background: the first page makes none (MLflow's store registry asked 0 times during
    it, 1 time in all); without the URI (a test's Flask app) no store is made as a side effect."""
    import mlflow
    from flask import Flask
    from mlflow.server import BACKEND_STORE_URI_ENV_VAR, handlers

    from many_runs import log_many_runs
    from mlflow_llmeff.report import server as srv
    from mlflow_llmeff.report import source

    uri = empty_store(tmp_path / "m.db")
    exp_id, _ = log_many_runs(mlflow.MlflowClient(uri), "warm", 5, history=False)
    made = []
    registry = handlers._tracking_store_registry
    real_get_store = registry.get_store
    monkeypatch.setattr(registry, "get_store", lambda *a, **k: made.append(a) or real_get_store(*a, **k))
    monkeypatch.setattr(handlers, "_tracking_store", None)
    monkeypatch.setattr(source, "SETTLED_S", 0.0)
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    for cache in (srv._pages, srv._tokens, srv._figures):
        cache.clear()
    monkeypatch.delenv(BACKEND_STORE_URI_ENV_VAR, raising=False)
    assert srv._warm_store() is None and made == [] and handlers._tracking_store is None
    monkeypatch.setenv(BACKEND_STORE_URI_ENV_VAR, uri)
    monkeypatch.setenv("_MLFLOW_SERVER_ARTIFACT_ROOT", str(tmp_path / "artifacts"))
    app = Flask("t")
    srv.register(app)
    srv.finish_background()
    assert len(made) == 1 and handlers._tracking_store is not None
    c0 = _counts()
    assert app.test_client().get(f"/llmeff/experiments/{exp_id}").status_code == 200
    assert len(made) == 1 and _delta(c0, _counts())["queries"] == 4
