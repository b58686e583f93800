"""``llmeff compare``: read the runs, build the report, write it, optionally log it as one comparison run."""

from __future__ import annotations

import os

from mlflow_llmeff import names
from mlflow_llmeff.report.render import DEFAULT_GROUP_BY, Report, build_report, write_report
from mlflow_llmeff.report.source import Selection, select_runs

__all__ = ["compare", "default_ui_base", "log_report"]


def default_ui_base(tracking_uri: str) -> str:
    """The MLflow UI address for run links: the tracking URI when it is a server, else ``mlflow ui``'s default."""
    if tracking_uri.startswith(("http://", "https://")):
        return tracking_uri.rstrip("/")
    return "http://127.0.0.1:5000"


def compare(experiment: str, *, filter_string: str = "", group_by: str = DEFAULT_GROUP_BY,
            baseline: str | None = None, out_dir: str = "llmeff-compare", log_to_mlflow: bool = False,
            tracking_uri: str | None = None, ui_base: str | None = None) -> tuple[Report, list[str], str | None]:
    """Compare the runs of ``experiment`` and write the report into ``out_dir``.

    Args:
        experiment: experiment name (or id).
        filter_string: MLflow search filter ('' = every run).
        group_by: comma-separated ``llmeff.*`` tag names the plots group by.
        baseline: scaling baseline run id.
        out_dir: folder for report.md/csv/html and the PNGs (created).
        log_to_mlflow: also log the folder as artifacts of a new comparison run in the experiment.
        tracking_uri: default: MLflow's current tracking URI.
        ui_base: MLflow UI address for run links; default :func:`default_ui_base`.

    Returns:
        ``(report, written paths, comparison run id or None)``.

    Raises:
        ValueError: unknown/empty experiment, bad filter, ``group_by`` or ``baseline`` (one line each).
    """
    import mlflow

    uri = tracking_uri or mlflow.get_tracking_uri()
    client = mlflow.MlflowClient(uri)
    selection = select_runs(client, experiment, filter_string)
    launcher = os.environ.get("MLFLOW_RUN_ID")  # under `mlflow run -e compare`: the launcher's own run
    if launcher and any(r.run_id == launcher for r in selection.runs):
        selection = Selection(selection.experiment_id, selection.experiment_name, selection.filter_string,
                              [r for r in selection.runs if r.run_id != launcher])
        if not selection.runs:
            raise ValueError(f"experiment {selection.experiment_name!r} has no runs to compare")
    rep = build_report(client, selection, group_by=group_by, baseline=baseline,
                       ui_base=default_ui_base(uri) if ui_base is None else ui_base)
    paths = write_report(rep, out_dir)
    run_id = log_report(client, rep, out_dir) if log_to_mlflow else None
    return rep, paths, run_id


def log_report(client, rep: Report, out_dir: str) -> str:
    """Log ``out_dir`` as the artifacts of one comparison run tagged with the compared run ids
    (``llmeff.compare.run_ids``); returns its run id.

    The run is a new FINISHED run of the compared experiment, or under ``mlflow run -e compare`` the
    launcher's run (``MLFLOW_RUN_ID``, which the launcher ends).
    """
    sel = rep.selection
    tags = {names.COMPARE_RUN_IDS: ",".join(r.run_id for r in sel.runs)[:8000],
            names.COMPARE_EXPERIMENT: sel.experiment_name, names.COMPARE_FILTER: sel.filter_string,
            "mlflow.runName": f"compare-{len(sel.runs)}-runs",
            "mlflow.note.content": "llmeff compare report: open report.html in Artifacts"}
    launcher = os.environ.get("MLFLOW_RUN_ID")
    run_id = launcher or client.create_run(sel.experiment_id).info.run_id
    for k, v in tags.items():
        client.set_tag(run_id, k, v)
    client.log_artifacts(run_id, os.path.abspath(out_dir))
    if not launcher:
        client.set_terminated(run_id, "FINISHED")
    return run_id
