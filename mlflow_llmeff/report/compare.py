"""``llmeff compare``: read the runs, build the report, write it, optionally log it as one comparison run."""

from __future__ import annotations

import dataclasses
import os

from mlflow_llmeff import names
from mlflow_llmeff.report.render import DEFAULT_GROUP_BY, Report, build_report, write_report
from mlflow_llmeff.report.source import select_runs
from mlflow_llmeff.tracking.keys import tag_value_limit

__all__ = ["RUN_IDS_ARTIFACT", "compare", "compared_ids_tag", "default_ui_base", "log_report"]

#: The comparison run's artifact with every compared run id, one a line (the tag may hold only some).
RUN_IDS_ARTIFACT = "run_ids.txt"


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
    from mlflow_llmeff.tracking import store

    uri = tracking_uri or store.tracking_uri()
    client = store.client(uri)
    selection = select_runs(client, experiment, filter_string)
    launcher = os.environ.get("MLFLOW_RUN_ID")  # under `mlflow run -e compare`: the launcher's own run
    if launcher and any(r.run_id == launcher for r in selection.runs):
        selection = dataclasses.replace(selection, runs=[r for r in selection.runs if r.run_id != launcher])
        if not selection.runs:
            raise ValueError(f"experiment {selection.experiment_name!r} has no runs to compare")
    rep = build_report(client, selection, group_by=group_by, baseline=baseline,
                       ui_base=default_ui_base(uri) if ui_base is None else ui_base)
    paths = write_report(rep, out_dir)
    run_id = log_report(client, rep, out_dir) if log_to_mlflow else None
    return rep, paths, run_id


def compared_ids_tag(run_ids: list[str], limit: int | None = None) -> str:
    """The value of ``llmeff.compare.run_ids``: the ids comma-separated, whole ids only.

    When they all fit in ``limit`` characters (default: MLflow's tag value limit,
    ``mlflow.utils.validation.MAX_TAG_VAL_LENGTH``, 8,000 characters) the value is the plain list;
    otherwise it says how many of how many it holds and where the rest is, then the ids that fit:
    ``"240 of 1001 run ids (all in artifact run_ids.txt): id1,id2,..."``. Never an id cut in two
    (until issue 31 the list was cut at 8,000 characters, mid-id, without a word).

    Raises:
        ValueError: for a ``limit`` too small for the note and one id.
    """
    limit = tag_value_limit() if limit is None else limit
    whole = ",".join(run_ids)
    if len(whole) <= limit:
        return whole
    n, used, best = len(run_ids), -1, 0
    for k, rid in enumerate(run_ids, 1):  # the first k ids joined take ``used`` characters
        used += len(rid) + 1
        if len(_note(k, n)) + used > limit:
            break
        best = k
    if not best:
        raise ValueError(f"tag value limit {limit} is not accepted; it holds no run id with its note "
                         f"(give at least {len(_note(1, n)) + len(run_ids[0])} characters)")
    return _note(best, n) + ",".join(run_ids[:best])


def _note(k: int, n: int) -> str:
    return f"{k} of {n} run ids (all in artifact {RUN_IDS_ARTIFACT}): "


def log_report(client, rep: Report, out_dir: str) -> str:
    """Log ``out_dir`` as the artifacts of one comparison run tagged with the compared run ids
    (``llmeff.compare.run_ids``, :func:`compared_ids_tag`); returns its run id.

    Every compared id is also the artifact :data:`RUN_IDS_ARTIFACT` (one a line): MLflow's tag value
    value (8,000 characters) holds about 240 ids, and the tag then says how many of how many it holds.
    The run is a new FINISHED run of the compared experiment, or under ``mlflow run -e compare`` the
    launcher's run (``MLFLOW_RUN_ID``, which the launcher ends), written through the one door
    (:class:`~mlflow_llmeff.tracking.writer.RunWriter`), waiting at most the delivery wait.

    Raises:
        mlflow_llmeff.tracking.delivery.Unreachable: the server did not take it all (it waits in the
            outbox; the message says where).
    """
    from mlflow_llmeff.tracking.delivery import Unreachable
    from mlflow_llmeff.tracking.writer import RunWriter

    sel = rep.selection
    ids = [r.run_id for r in sel.runs]
    tags = {names.COMPARE_RUN_IDS: compared_ids_tag(ids),
            names.COMPARE_EXPERIMENT: sel.experiment_name, names.COMPARE_FILTER: sel.filter_string,
            "mlflow.runName": f"compare-{len(sel.runs)}-runs",
            "mlflow.note.content": "llmeff compare report: open report.html in Artifacts"}
    launcher = os.environ.get("MLFLOW_RUN_ID")
    writer = (RunWriter.attach(launcher, client=client) if launcher else
              RunWriter.create(tags["mlflow.runName"], experiment_id=sel.experiment_id, client=client))
    writer.set_tags(tags, synchronous=False)
    writer.write_text("".join(f"{i}\n" for i in ids), RUN_IDS_ARTIFACT)
    writer.log_folder(out_dir)
    if not writer.end(None if launcher else "FINISHED"):
        raise Unreachable(f"{writer.unanswered_reason or 'the tracking server did not take the comparison run'}; "
                          f"the comparison run waits in {writer.spilled_to} (llmeff sync {writer.outbox_dir})")
    return writer.run_id
