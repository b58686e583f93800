"""The efficiency page inside ``mlflow server --app-name llmeff``: the usual MLflow UI plus ``/llmeff/``.

Registered in the ``mlflow.app`` entry-point group (pyproject.toml), the contract MLflow's own
``basic-auth`` app follows: a factory that takes MLflow's Flask app, adds routes, and returns it (or,
under uvicorn, MLflow's FastAPI wrapper of it). Pages:

* ``/llmeff/``: every active experiment, linking to its efficiency page;
* ``/llmeff/experiments/<id>``: the ``llmeff compare`` report of that experiment (table, warnings,
  scaling efficiency, Pareto fronts and the other plots), read live from the server's tracking store
  on each request, with filters by condition tags (``?accelerator.short=cpu&precision=fp32``), a free
  MLflow filter (``?filter=...``), ``?group_by=`` and ``?baseline=``.

Behind ``mlflow server --static-prefix P`` the pages, their links and image URLs are under ``P/llmeff``
and the MLflow UI links under ``P/``. With authentication (``--app-name llmeff-auth``,
:mod:`mlflow_llmeff.report.auth`) the same pages check MLflow basic-auth's permissions: an app whose
config holds ``LLMEFF_READABLE`` (experiment ids -> those the request's user may read) lists only the
readable experiments and answers 403 for another experiment's page or figures; a figure's key names
its experiment (:func:`figures_key`).

Bad input (unknown experiment, a filter MLflow cannot parse, no runs) is a one-line page with
status 400/404, never a stack trace.

The runs are read from the server's store in one pass of plain SQL over its tables (runs, latest
metrics, tags, params: :func:`mlflow_llmeff.report.source.select_runs`; MLflow's ``search_runs``
builds an ORM object per value, 5.9 s for 1,000 runs), every run of the selection, however many;
metric histories are read only for what the figures draw. A page whose run set (its digest, below)
and query were served before is served again from memory without being built (``PAGE_CACHE_SIZE``
pages; its figures section filled on each request from the figures as they are then). Before its runs,
a request reads the store's last change (:func:`mlflow_llmeff.report.source.change_token`: a sqlite
file's time and size, PostgreSQL's WAL position): while it is unchanged, a query served before is
served again without one run read, one report built or one page rendered (``RENDERED`` and
``source.READ`` count them; tests/test_report_page.py). bench/page.py measures it at 10,000 runs: the
second request 0.05 s, where reading the runs again took 1.04 s (issue 53). The "All runs" table shows the first
:data:`~mlflow_llmeff.report.render.RUNS_SHOWN` runs and says how many of how many, with where every
run is (``?all_runs=1``, MLflow's run list filtered the same way, report.csv/report.md).

Figures are drawn once per run set, in the background: they are cached by a digest of the compared
runs (ids, status, latest metric values, tags) and the page's grouping and baseline, and served
from ``/llmeff/figures/<digest>/<name>``. A page whose run set has no figures yet is served at once
and starts the drawing; each figure request waits for it (a figure left out is an image saying
why). So the page never waits for matplotlib, and a page whose runs did not change draws nothing
(bench/page.py measures both). matplotlib is imported in the background when the app starts.
``mlflow server`` runs several uvicorn workers, each with its own memory: drawn figures are also kept
on disk (the temporary folder, ``llmeff-figures-<uid>/<digest>.pkl``) for the other workers, and an
image URL carries the experiment and the page's query, so a worker that finds neither draws it.
"""

from __future__ import annotations

import atexit
import hashlib
import html
import json
import threading
from collections import OrderedDict

from mlflow_llmeff import names
from mlflow_llmeff.tracking.runs import ui_experiment_url

__all__ = ["create_app", "register", "FILTER_TAGS"]

#: Condition tags offered as filters on the page (query parameter = the name without ``llmeff.``).
FILTER_TAGS = (names.ACCEL_SHORT, names.ACCEL_COUNT, names.PAR_STRATEGY, names.PRECISION, names.MODEL_NAME)
PREFIX = "/llmeff"
#: Run sets whose figures are kept (least recently used dropped first).
FIGURE_CACHE_SIZE = 32
_figures: "OrderedDict[str, tuple[dict[str, bytes], list[str]]]" = OrderedDict()
_lock = threading.Lock()


def run_set_digest(runs, group_by: str, baseline: str) -> str:
    """A digest of what the figures are drawn from: every run's id, status, name, latest metrics and tags,
    and the page's grouping and baseline (a new point or a finished run changes it). Each distinct set of
    tags (but the name) is written once and its runs point to it: 10,000 repeats of 5 configurations
    write 5 sets, not 10,000."""
    h = hashlib.sha1()
    h.update(json.dumps([group_by, baseline]).encode())
    tag_sets: dict[tuple, int] = {}  # repeats share their tags but their name: each set written once
    rows = []
    for r in sorted(runs, key=lambda r: r.run_id):  # repr: exact for str and float, a third of json's time
        others = dict(r.tags)
        name = others.pop("mlflow.runName", None)
        tags = tuple(others.items())
        i = tag_sets.get(tags)
        if i is None:
            i = tag_sets[tags] = len(tag_sets)
        rows.append((r.run_id, r.status, r.name, name, sorted(r.metrics.items()), i))
    h.update(repr(rows).encode())
    h.update(repr([sorted(t) for t in tag_sets]).encode())
    return h.hexdigest()[:20]


def figures_key(experiment_id: str, runs, group_by: str, baseline: str, content: str | None = None) -> str:
    """``<experiment id>-<digest>``: the key of a run set's figures. The experiment it names is the
    one whose read permission a figure request needs (report/auth.py), and a key is only ever drawn from
    that experiment's runs (:func:`_draw_again` checks the digest).

    ``content``: the digest of what a database-backed store's read returned
    (:attr:`mlflow_llmeff.report.source.Selection.content`), from which ``runs`` follow: digested with the
    grouping and baseline instead of a pass over the runs (:func:`run_set_digest`, 0.16-0.2 s of CPU at
    10,000 runs)."""
    if content is None:
        return f"{experiment_id}-{run_set_digest(runs, group_by, baseline)}"
    digest = hashlib.sha1(json.dumps(["read", content, group_by, baseline]).encode()).hexdigest()[:20]
    return f"{experiment_id}-{digest}"


def _experiment_of(key: str) -> str:
    """The experiment id a figures key names (``""`` for a key without one)."""
    return key.rpartition("-")[0]


_drawing: dict[str, threading.Event] = {}
#: Seconds a figure request waits for its run set's drawing.
FIGURE_WAIT_S = 120.0


def _disk(digest: str) -> str:
    """Where a run set's drawn figures are kept for every worker of the server (``mlflow server``
    starts several uvicorn workers, each with its own memory: a page served by one and an image
    requested from another must not miss)."""
    import os
    import tempfile

    uid = os.getuid() if hasattr(os, "getuid") else "user"
    return os.path.join(tempfile.gettempdir(), f"llmeff-figures-{uid}", f"{digest}.pkl")


def _cached(digest: str) -> tuple[dict[str, bytes], list[str]] | None:
    import pickle

    with _lock:
        hit = _figures.get(digest)
        if hit is not None:
            _figures.move_to_end(digest)
            return hit
    try:
        with open(_disk(digest), "rb") as f:
            hit = pickle.load(f)  # written by this server's own workers (_store_drawn)
    except (OSError, pickle.PickleError, EOFError, ValueError):
        return None
    with _lock:
        _figures[digest] = hit
        while len(_figures) > FIGURE_CACHE_SIZE:
            _figures.popitem(last=False)
    return hit


def _store_drawn(digest: str, drawn) -> None:
    """Keep ``drawn`` on disk for the other workers (atomically: a reader never sees half a file)."""
    import os
    import pickle

    path = _disk(digest)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.partial"
        with open(tmp, "wb") as f:
            pickle.dump(drawn, f)
        os.replace(tmp, path)
    except OSError:  # no shared cache: each worker draws its own
        pass


#: Seconds the interpreter's exit waits for figures being drawn (:func:`finish_background`).
EXIT_WAIT_S = 30.0
_background: list[threading.Thread] = []


def _in_background(target, name: str) -> None:
    """Run ``target`` in a daemon thread that :func:`finish_background` waits for at exit."""
    t = threading.Thread(target=target, name=name, daemon=True)
    with _lock:
        _background[:] = [b for b in _background if b.is_alive()] + [t]
    t.start()


@atexit.register
def finish_background(timeout_s: float = EXIT_WAIT_S) -> int:
    """Wait up to ``timeout_s`` seconds in all for the figure threads still drawing; return how many are left.

    matplotlib's font code is C++: a daemon thread still drawing when the interpreter finalizes is unwound
    inside it and the process aborts ("terminate called without an active exception", exit status 134:
    a page test's process, or a Flask server stopped with Ctrl-C, while a figure was drawn). Registered
    with :mod:`atexit`, which runs before finalization; a thread still alive after ``timeout_s`` is left.
    """
    import time

    end = time.monotonic() + timeout_s
    with _lock:
        threads = list(_background)
    for t in threads:
        t.join(max(0.0, end - time.monotonic()))
    return sum(t.is_alive() for t in threads)


def _start_drawing(store, rep, digest: str) -> None:
    """Draw the figures of ``rep`` into the cache in a background thread (once per digest)."""
    with _lock:
        if digest in _figures or digest in _drawing:
            return
        done = _drawing[digest] = threading.Event()

    def work() -> None:
        from mlflow_llmeff.report import plots as pl
        from mlflow_llmeff.report.source import metric_history

        try:
            drawn = pl.draw_all(rep, lambda run_id, key: metric_history(store, run_id, key))
        except Exception as e:  # noqa: BLE001 - a figure that cannot be drawn says so, the page stays
            drawn = ({}, [f"figures not drawn: {type(e).__name__}: {e}"])
        _store_drawn(digest, drawn)
        with _lock:
            _figures[digest] = drawn
            while len(_figures) > FIGURE_CACHE_SIZE:
                _figures.popitem(last=False)
            _drawing.pop(digest, None)
        done.set()

    _in_background(work, f"llmeff-figures-{digest}")


def _note_png(text: str) -> bytes:
    """A small image carrying ``text``: a figure left out says why where it would have been."""
    import textwrap

    from mlflow_llmeff.report import plots as pl

    plt = pl.pyplot()
    fig = plt.figure(figsize=(7, 1.0))
    fig.text(0.01, 0.5, "\n".join(textwrap.wrap(text, 110)), fontsize=8, va="center", color="0.35")
    return pl.png(fig)


def figure(digest: str, name: str):
    """``/llmeff/figures/<digest>/<name>?experiment=<id>&<the page's query>``: one figure of a run set.

    Waits for its drawing; a worker that has neither drawn it nor finds it on disk (another worker
    served the page) draws it from the experiment and query the URL carries. 404 only for a URL
    without them whose figures are gone."""
    from flask import Response, request

    exp_id = _experiment_of(digest)
    if not exp_id:  # not a key this server makes (figures_key): nobody's figures
        return _page("llmeff: not found", "<p class='error'>no such figure</p>", 404)
    if not _readable([exp_id]):
        return _forbidden(exp_id)
    with _lock:
        pending = _drawing.get(digest)
    if pending is None and _cached(digest) is None and request.args.get("experiment") == exp_id:
        pending = _draw_again(digest, request.args)
    if pending is not None:
        pending.wait(FIGURE_WAIT_S)
    hit = _cached(digest)
    if hit is None:
        return _page("llmeff: not found", "<p class='error'>figure not cached any more: reload the page</p>", 404)
    png = hit[0].get(name)
    if png is None:
        why = next((n for n in hit[1] if n.startswith(name)), f"{name}: not drawn")
        png = _note_png(why)
    return Response(png, mimetype="image/png", headers={"Cache-Control": "private, max-age=3600"})


def base() -> str:
    """Where the pages are served: ``/llmeff``, behind ``mlflow server --static-prefix P`` at ``P/llmeff``
    (MLflow's own routes carry the prefix the same way: ``mlflow.server.handlers._add_static_prefix``)."""
    from mlflow.server.handlers import _add_static_prefix

    return _add_static_prefix(PREFIX)


def _ui_root() -> str:
    """The MLflow UI's root under the server's static prefix (``""`` without one)."""
    import os

    from mlflow.server.handlers import STATIC_PREFIX_ENV_VAR

    return os.environ.get(STATIC_PREFIX_ENV_VAR, "").rstrip("/")


def _readable(experiment_ids: list[str]) -> list[str]:
    """The experiment ids of ``experiment_ids`` the request's user may read: all of them unless the app
    was built with a permission check (``LLMEFF_READABLE`` in its config; report/auth.py)."""
    from flask import current_app

    check = current_app.config.get("LLMEFF_READABLE")
    return list(experiment_ids) if check is None else list(check(list(experiment_ids)))


def _forbidden(experiment_id: str):
    return _page("llmeff: permission denied", f"<p class='error'>permission denied: you may not read experiment "
                                              f"{html.escape(experiment_id)!r}</p>", 403)


def _store():
    from mlflow.server.handlers import _get_tracking_store

    return _get_tracking_store()


def _page(title: str, body: str, status: int = 200):
    from flask import Response

    text = (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title></head>"
            f"<body style='font-family:system-ui,sans-serif;margin:1.5em'>{body}</body></html>")
    return Response(text, status=status, mimetype="text/html")


def experiments_page():
    """``/llmeff/``: the active experiments, each linking to its efficiency page."""
    from mlflow_llmeff.tracking.search import all_experiments

    exps = all_experiments(_store())  # every active experiment, page after page
    allowed = set(_readable([e.experiment_id for e in exps]))  # with authentication: those the user may read
    items = "".join(f"<li><a href='{base()}/experiments/{html.escape(e.experiment_id)}'>{html.escape(e.name)}</a>"
                    f" &middot; <a href='{html.escape(ui_experiment_url(_ui_root(), e.experiment_id))}'>runs in MLflow"
                    "</a></li>" for e in exps if e.experiment_id in allowed)
    return _page("llmeff: experiments", f"<h1>Efficiency pages</h1><ul id='experiments'>{items}</ul>")


def filter_string(args) -> str:
    """The MLflow search filter of the page's query: each condition-tag filter ANDed with ``filter``.

    Joined with ``and`` alone: MLflow's filter grammar has AND and no parentheses, so ``(filter)``
    made every drop-down plus filter a 400 (a trial); since there is no OR, the plain join is exact.

    Args:
        args: the request's query parameters (a mapping).
    """
    parts = []
    for key in FILTER_TAGS:
        value = args.get(key[len("llmeff."):], "")
        if value:
            parts.append(f"tags.`{key}` = '{value.replace(chr(39), '')}'")
    if args.get("filter"):
        parts.append(args["filter"])
    return " and ".join(parts)


def _filter_rows(runs) -> set[tuple]:
    """The distinct values of :data:`FILTER_TAGS` over ``runs``: a run of each kind's (runs alike share their
    tags but the name, :attr:`~mlflow_llmeff.report.calc.RunRecord.alike`: 5 rows read for 100,000 repeats)."""
    from mlflow_llmeff.report.kinds import kinds

    return {tuple(map(r.tags.get, FILTER_TAGS)) for r in kinds(runs)}


def _filter_form(exp_id: str, args, rows: set[tuple]) -> str:
    """The filter form: a drop-down per :data:`FILTER_TAGS` key of the values in ``rows`` (:func:`_filter_rows`)."""
    e = html.escape
    fields = []
    for i, key in enumerate(FILTER_TAGS):
        short = key[len("llmeff."):]
        values = sorted({row[i] for row in rows if row[i]})
        opts = "".join(f"<option{' selected' if args.get(short) == v else ''}>{e(v)}</option>" for v in values)
        fields.append(f"<label>{e(short)} <select name='{e(short)}'><option value=''>any</option>{opts}"
                      "</select></label>")
    return (f"<form class='filters' method='get' action='{base()}/experiments/{e(exp_id)}'>" + " ".join(fields)
            + f"<br><label>MLflow filter <input name='filter' value='{e(args.get('filter', ''))}'></label>"
            f"<input type='hidden' name='group_by' value='{e(args.get('group_by', ''))}'>"
            "<button type='submit'>apply</button></form>"
            f"<p><a href='{e(ui_experiment_url(_ui_root(), exp_id))}'>this experiment's runs in MLflow</a> &middot; "
            f"<a href='{base()}/'>all efficiency pages</a></p>")


def _page_report(store, experiment_id: str, args, sel=None):
    """``(selection, report, group_by, baseline)`` of the page of ``experiment_id`` with query ``args``
    (``sel``: its runs, already read).

    Raises:
        ValueError: a filter MLflow cannot parse or that matches no run (from ``select_runs``), a bad
            ``group_by`` or ``baseline``.
    """
    from mlflow_llmeff.report.render import DEFAULT_GROUP_BY, build_report
    from mlflow_llmeff.report.source import select_runs

    sel = sel or select_runs(store, experiment_id, filter_string(args))
    group_by, baseline = args.get("group_by") or DEFAULT_GROUP_BY, args.get("baseline") or None
    rep = build_report(store, sel, group_by=group_by, baseline=baseline, ui_base=_ui_root(), plots=False)
    return sel, rep, group_by, baseline


#: Pages served again without building them: by run set (digest), query and filter-form values.
PAGE_CACHE_SIZE = 16
_pages: "OrderedDict[str, tuple[str, str]]" = OrderedDict()
#: The page of a query while the store is unchanged: (store change token, experiment, query) -> (digest, page key).
_tokens: "OrderedDict[str, tuple[str, str]]" = OrderedDict()
#: Counted work of the pages (tests assert it, never wall time): reports built and pages rendered to HTML.
RENDERED = {"reports": 0, "pages": 0}


def _token_key(token: str, experiment_id: str, args) -> str:
    return hashlib.sha1(json.dumps([token, experiment_id, sorted(args.items(multi=True))]).encode()).hexdigest()


def _page_key(digest: str, args, rows: set[tuple]) -> str:
    """What a page shows beyond its run set's digest: its query and the filter form's values ``rows``
    (:func:`_filter_rows` of every run of the experiment, read apart when a filter is on)."""
    form = sorted({(k, row[i]) for row in rows for i, k in enumerate(FILTER_TAGS) if row[i]})
    return hashlib.sha1(json.dumps([digest, sorted(args.items(multi=True)), form]).encode()).hexdigest()


def _draw_again(digest: str, args):
    """Start drawing the run set of the page ``args`` describe (``experiment`` and its query) under
    ``digest``; the event to wait on, or None when the experiment cannot be read or its runs are not
    the run set ``digest`` names any more (never figures of one run set under another's key)."""
    store = _store()
    try:
        sel, rep, group_by, baseline = _page_report(store, args["experiment"], args)
    except Exception:  # noqa: BLE001 - then the 404 page says to reload
        return None
    if figures_key(args["experiment"], sel.runs, group_by, baseline or "", sel.content) != digest:
        return None
    _start_drawing(store, rep, digest)
    with _lock:
        return _drawing.get(digest)


#: Where a cached page's figures section goes: filled on every request from its run set's figures as
#: they are then (being drawn: every figure's URL; drawn: the drawn ones and why any was left out).
_FIGURES_MARK = "<!--llmeff:figures-->"


def _rest_html(exp_id: str, args, filter_text: str) -> str:
    """Where every run of a page whose runs table is cut to ``RUNS_SHOWN`` is: this page with
    ``all_runs=1``, MLflow's run list filtered the same way, report.csv/report.md."""
    from urllib.parse import quote, urlencode

    e = html.escape
    query = urlencode([(k, v) for k, v in args.items(multi=True) if k != "all_runs"] + [("all_runs", "1")])
    mlflow_list = ui_experiment_url(_ui_root(), exp_id) + (f"&searchFilter={quote(filter_text)}" if filter_text else "")
    return (f"<a id='all-runs-link' href='{base()}/experiments/{e(exp_id)}?{e(query)}'>this page with every run</a> "
            f"(<code>?all_runs=1</code>, about 0.5 KiB a run), <a href='{e(mlflow_list)}' target='_top'>MLflow's run "
            "list</a> (filtered the same way), or report.csv and report.md of <code>llmeff compare</code>")


def experiment_page(experiment_id: str):
    """``/llmeff/experiments/<id>``: the comparison report of one experiment, live from the store.

    The "All runs" table shows the first :data:`mlflow_llmeff.report.render.RUNS_SHOWN` runs (the best
    configuration's first) and says how many of how many, with links to the rest; ``?all_runs=1``
    shows every run."""
    from flask import request

    from mlflow_llmeff.report.render import RUNS_SHOWN, to_html
    from mlflow_llmeff.report.source import change_token, select_runs

    store = _store()
    args = request.args
    try:
        exp = store.get_experiment(experiment_id)
    except Exception:  # noqa: BLE001 - MLflow raises for an unknown id
        exp = None
    if exp is None:
        return _page("llmeff: not found", f"<p class='error'>experiment id {html.escape(experiment_id)!r} not "
                                          "found</p>", 404)
    if not _readable([exp.experiment_id]):
        return _forbidden(exp.experiment_id)
    from mlflow_llmeff.report.render import DEFAULT_GROUP_BY

    all_runs = args.get("all_runs", "")
    if all_runs not in ("", "0", "1"):
        return _page("llmeff: error", f"<p class='error'>all_runs={html.escape(all_runs)!r} is not accepted; give "
                                      "all_runs=1 (every run in the table) or leave it out (the first "
                                      f"{RUNS_SHOWN})</p>", 400)
    rep = None
    # the store's last change, read before its runs: while it is unchanged, the page of this query is the
    # page served before, without one run read (source.change_token; None: read every time)
    token = change_token(store)
    tkey = _token_key(token, exp.experiment_id, args) if token else None
    with _lock:
        known = _tokens.get(tkey) if tkey else None
    if known is not None:
        digest, key = known
        with _lock:
            parts = _pages.get(key)
            if parts is not None:
                _pages.move_to_end(key)
            drawing = digest in _drawing
        hit = _cached(digest)
        if parts is not None and (hit is not None or drawing):
            return _serve(exp.experiment_id, args, digest, parts, hit)
    try:
        sel = select_runs(store, exp.experiment_id, filter_string(args))
        # the filter form offers the values of every run: a second search only when a filter is on
        every = sel.runs if not sel.filter_string else select_runs(store, exp.experiment_id, "").runs
        group_by, baseline = args.get("group_by") or DEFAULT_GROUP_BY, args.get("baseline") or None
        digest = figures_key(exp.experiment_id, sel.runs, group_by, baseline or "", sel.content)
        form_rows = _filter_rows(every)  # one pass over the runs for the page's key and its form
        key = _page_key(digest, args, form_rows)
        with _lock:
            parts = _pages.get(key)
            if parts is not None:
                _pages.move_to_end(key)
        hit = _cached(digest)
        with _lock:
            drawing = digest in _drawing
        if parts is None or (hit is None and not drawing):  # a figure set dropped: its report draws it again
            sel, rep, group_by, baseline = _page_report(store, exp.experiment_id, args, sel)
            RENDERED["reports"] += 1
    except ValueError as e:
        return _page("llmeff: error", f"<p class='error'>{html.escape(str(e))}</p>"
                                      f"<p><a href='{base()}/experiments/{html.escape(experiment_id)}'>reset</a></p>",
                     400)
    if parts is None:  # the page without its figures, kept for every request of the same runs and query
        text = to_html(rep, extra_head=_filter_form(exp.experiment_id, args, form_rows), figures_block=_FIGURES_MARK,
                       max_runs=None if all_runs == "1" else RUNS_SHOWN,
                       rest_html=_rest_html(exp.experiment_id, args, sel.filter_string))
        RENDERED["pages"] += 1
        head, _, tail = text.partition(_FIGURES_MARK)
        parts = (head, tail)
        with _lock:
            _pages[key] = parts
            while len(_pages) > PAGE_CACHE_SIZE:
                _pages.popitem(last=False)
    if hit is None and rep is not None:  # drawn in the background; the page does not wait (each image does)
        # started once the page is rendered: a drawing thread beside the rendering took its turns with
        # the GIL from the page's own work
        _start_drawing(store, rep, digest)
    if tkey:
        with _lock:
            _tokens[tkey] = (digest, key)
            while len(_tokens) > PAGE_CACHE_SIZE:
                _tokens.popitem(last=False)
    return _serve(exp.experiment_id, args, digest, parts, hit)


def _serve(exp_id: str, args, digest: str, parts: tuple[str, str], hit):
    """The page: its cached parts around the figures section of run set ``digest`` as it is now (being
    drawn: every figure's URL; drawn: the drawn ones and why any was left out)."""
    from urllib.parse import urlencode

    from flask import Response

    from mlflow_llmeff.report.plots import FIGURES, png_size
    from mlflow_llmeff.report.render import figures_html

    shown, notes = ([name for name, _ in FIGURES], []) if hit is None else (list(hit[0]), list(hit[1]))
    query = urlencode([("experiment", exp_id)] + [(k, v) for k, v in args.items(multi=True) if k != "experiment"])
    urls = {name: f"{base()}/figures/{digest}/{name}?{query}" for name in shown}
    # drawn: each image's width and height from its PNG, so the page is laid out at the final size
    sizes = {} if hit is None else {name: png_size(png) for name, png in hit[0].items() if png_size(png)}
    return Response(parts[0] + figures_html(urls, notes, sizes) + parts[1], mimetype="text/html")


def register(app) -> None:
    """Add the efficiency routes to MLflow's Flask ``app`` (once)."""
    root = base()  # behind --static-prefix P: P/llmeff/...
    if f"{root}/" in {r.rule for r in app.url_map.iter_rules()}:
        return
    app.add_url_rule(f"{root}/", "llmeff_experiments", experiments_page, methods=["GET"])
    app.add_url_rule(f"{root}/experiments/<experiment_id>", "llmeff_experiment", experiment_page, methods=["GET"])
    app.add_url_rule(f"{root}/figures/<digest>/<name>", "llmeff_figure", figure, methods=["GET"])
    _in_background(_warm_matplotlib, "llmeff-warm-matplotlib")


def _warm_store():
    """Inside ``mlflow server`` (its backend store URI in the environment), the worker's tracking store,
    made now rather than by the first request that needs it; None elsewhere (a test's Flask app: no store
    made as a side effect).

    ``mlflow server`` makes the store in its parent process (``initialize_backend_stores``: the tables
    exist) and each worker makes its own again on first use: for a sqlite store about 0.05 s of CPU and
    0.1 s of wall time here (SQLAlchemy's engine, alembic's schema check, seven modules imported), paid
    by the first efficiency page. Two threads asking at once each make one and the last is kept (MLflow's
    own check-then-set), so a request in the first tenth of a second after start at worst makes its own."""
    import os

    from mlflow.server import BACKEND_STORE_URI_ENV_VAR

    if not os.environ.get(BACKEND_STORE_URI_ENV_VAR):
        return None
    return _store()


def _warm_matplotlib() -> None:
    """Make the tracking store (:func:`_warm_store`), import the report's modules and matplotlib (and build its
    font cache on a fresh machine) before the first page needs them (the first request paid the report
    modules' imports: at 10,000 runs, load 1-2, bench/page.py's first request 1.49 s before, 1.25-1.33 s
    after)."""
    try:
        _warm_store()
    except Exception:  # noqa: BLE001 - the first request makes it, as MLflow would
        pass
    try:
        from mlflow_llmeff.report import headline, memory, mlperf, network, render, source  # noqa: F401
    except Exception:  # noqa: BLE001 - a page imports them itself
        pass
    try:
        from mlflow_llmeff.report import plots as pl

        plt = pl.pyplot()
        fig, _ = plt.subplots()
        pl.png(fig)
    except Exception:  # noqa: BLE001 - a page draws without it, only slower
        pass


def create_app(app=None):
    """The ``mlflow.app`` factory: MLflow's server app with the efficiency pages added.

    Args:
        app: MLflow's Flask app (default: ``mlflow.server.app``).

    Returns:
        The Flask app, or under uvicorn (``mlflow server``'s default) MLflow's FastAPI app wrapping it.
    """
    from mlflow.server import app as mlflow_app

    app = app or mlflow_app
    register(app)
    from mlflow.environment_variables import _MLFLOW_SGI_NAME

    if _MLFLOW_SGI_NAME.get() == "uvicorn":
        from mlflow.server.fastapi_app import create_fastapi_app

        return create_fastapi_app(app)
    return app
