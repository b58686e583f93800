"""The efficiency page inside ``mlflow server --app-name llmeff``: the usual MLflow UI plus ``/llmeff/``.

Registered in the ``mlflow.app`` entry-point group (pyproject.toml), the contract MLflow's own
``basic-auth`` app follows: a factory that takes MLflow's Flask app, adds routes, and returns it (or,
under uvicorn, MLflow's FastAPI wrapper of it). Pages:

* ``/llmeff/``: every active experiment, linking to its efficiency page;
* ``/llmeff/experiments/<id>``: the ``llmeff compare`` report of that experiment (table, warnings,
  scaling efficiency, Pareto fronts and the other plots), read live from the server's tracking store
  on each request, with filters by condition tags (``?accelerator.short=cpu&precision=fp32``), a free
  MLflow filter (``?filter=...``), ``?group_by=`` and ``?baseline=``.

Bad input (unknown experiment, a filter MLflow cannot parse, no runs) is a one-line page with
status 400/404, never a stack trace.
"""

from __future__ import annotations

import html

from .. import names

__all__ = ["create_app", "register", "FILTER_TAGS"]

#: Condition tags offered as filters on the page (query parameter = the name without ``llmeff.``).
FILTER_TAGS = (names.ACCEL_SHORT, names.ACCEL_COUNT, names.PAR_STRATEGY, names.PRECISION, names.MODEL_NAME)
PREFIX = "/llmeff"


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
    from mlflow.entities import ViewType

    exps = _store().search_experiments(view_type=ViewType.ACTIVE_ONLY, max_results=1000)
    items = "".join(f"<li><a href='{PREFIX}/experiments/{html.escape(e.experiment_id)}'>{html.escape(e.name)}</a>"
                    f" &middot; <a href='/#/experiments/{html.escape(e.experiment_id)}/runs'>runs in MLflow</a></li>"
                    for e in exps)
    return _page("llmeff: experiments", f"<h1>Efficiency pages</h1><ul id='experiments'>{items}</ul>")


def filter_string(args) -> str:
    """The MLflow search filter of the page's query: each condition-tag filter ANDed with ``filter``.

    Args:
        args: the request's query parameters (a mapping).
    """
    parts = []
    for key in FILTER_TAGS:
        value = args.get(key[len("llmeff."):], "")
        if value:
            parts.append(f"tags.`{key}` = '{value.replace(chr(39), '')}'")
    if args.get("filter"):
        parts.append(f"({args['filter']})" if parts else args["filter"])
    return " and ".join(parts)


def _filter_form(exp_id: str, args, runs) -> str:
    e = html.escape
    fields = []
    for key in FILTER_TAGS:
        short = key[len("llmeff."):]
        values = sorted({r.tags.get(key) for r in runs if r.tags.get(key)})
        opts = "".join(f"<option{' selected' if args.get(short) == v else ''}>{e(v)}</option>" for v in values)
        fields.append(f"<label>{e(short)} <select name='{e(short)}'><option value=''>any</option>{opts}"
                      "</select></label>")
    return (f"<form class='filters' method='get' action='{PREFIX}/experiments/{e(exp_id)}'>" + " ".join(fields)
            + f"<br><label>MLflow filter <input name='filter' value='{e(args.get('filter', ''))}'></label>"
            f"<input type='hidden' name='group_by' value='{e(args.get('group_by', ''))}'>"
            "<button type='submit'>apply</button></form>"
            f"<p><a href='/#/experiments/{e(exp_id)}/runs'>this experiment's runs in MLflow</a> &middot; "
            f"<a href='{PREFIX}/'>all efficiency pages</a></p>")


def experiment_page(experiment_id: str):
    """``/llmeff/experiments/<id>``: the comparison report of one experiment, live from the store."""
    from flask import request

    from .render import DEFAULT_GROUP_BY, build_report, to_html
    from .source import select_runs

    store = _store()
    args = request.args
    try:
        exp = store.get_experiment(experiment_id)
    except Exception:  # noqa: BLE001 - MLflow raises for an unknown id
        exp = None
    if exp is None:
        return _page("llmeff: not found", f"<p class='error'>experiment id {html.escape(experiment_id)!r} not "
                                          "found</p>", 404)
    try:
        every = select_runs(store, exp.experiment_id, "").runs
        sel = select_runs(store, exp.experiment_id, filter_string(args))
        rep = build_report(store, sel, group_by=args.get("group_by") or DEFAULT_GROUP_BY,
                           baseline=args.get("baseline") or None, ui_base="")
    except ValueError as e:
        return _page("llmeff: error", f"<p class='error'>{html.escape(str(e))}</p>"
                                      f"<p><a href='{PREFIX}/experiments/{html.escape(experiment_id)}'>reset</a></p>",
                     400)
    from flask import Response

    return Response(to_html(rep, extra_head=_filter_form(exp.experiment_id, args, every)), mimetype="text/html")


def register(app) -> None:
    """Add the efficiency routes to MLflow's Flask ``app`` (once)."""
    if f"{PREFIX}/" in {r.rule for r in app.url_map.iter_rules()}:
        return
    app.add_url_rule(f"{PREFIX}/", "llmeff_experiments", experiments_page, methods=["GET"])
    app.add_url_rule(f"{PREFIX}/experiments/<experiment_id>", "llmeff_experiment", experiment_page, methods=["GET"])


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
