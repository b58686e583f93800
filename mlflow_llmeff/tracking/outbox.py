"""The outbox: what the tracking server has not taken yet, one JSON-lines file per run, and its delivery.

A run's file is ``<outbox dir>/<run id>.jsonl``: its first line names the run (``{"run_id": ...}``,
with ``"local_id"`` for a run the server did not create in time), then one record a line, in the
order the run made them:

* ``{"create": {...}}``: create the run (experiment id or name, run name, start time in ms, tags);
  the run's id until then is a local one, ``local-<32 hex>``;
* ``{"attach": {...}}``: mark an existing run RUNNING again (a resumed run; the launcher's run of
  ``mlflow run``, named when it has no metrics yet);
* ``{"name": {"name_parts": {...}}}``: name the run its configuration's stem, unique in its experiment
  (a run the meter named before its first step told the batch shape; :func:`name_run`);
* ``{"m": [key, value, timestamp ms, step]}``, ``{"p": [key, value]}``, ``{"t": [key, value]}``:
  metric points, params, tags;
* ``{"inputs": [...]}``: the run's dataset inputs (MLflow ``Dataset`` fields and the context);
* ``{"eval": {...}}``: ``llmeff eval --run-id`` results, logged at the run's last ``train/tokens`` step;
* ``{"table": {"data": {...}, "artifact_file": ...}}``: a table artifact (``MlflowClient.log_table``),
  e.g. the per-subject MMLU scores of an eval;
* ``{"file": {"path": ..., "artifact_path": ...}}``: a local file as an artifact (``MlflowClient.log_artifact``),
  e.g. the memory snapshot of an out-of-memory failure;
* ``{"text": {"text": ..., "artifact_file": ...}}``: a text artifact (``MlflowClient.log_text``), e.g.
  the ids a comparison run compared;
* ``{"files": {"path": ..., "artifact_path": ...}}``: a local folder's files as artifacts
  (``MlflowClient.log_artifacts``), e.g. a comparison's report;
* ``{"report": true}``: the end-of-run efficiency report (``efficiency_report.json``, the summary
  table, the figures), built from the run as the server holds it once everything before it is
  delivered (:func:`mlflow_llmeff.tracking.run_report.log_run_report`);
* ``{"end": [status, end time ms]}``: end the run.

Delivering a record twice is harmless: a metric point is the same (key, value, timestamp, step),
which MLflow's SQL stores keep once; tags, params, inputs and the report are set to the same
values; a run created for a local id carries the tag ``llmeff.outbox.local_run_id``, and creating
looks for it first, so a run is never created twice. Once a local id has a run, the folder keeps
the mapping in ``<local id>.run_id`` (a resumed attempt continues that run).
"""

from __future__ import annotations

import json
import logging
import os
import uuid
from typing import NamedTuple

from mlflow_llmeff import names
from mlflow_llmeff.tracking.experiments import unique_run_name
from mlflow_llmeff.tracking.search import all_runs

__all__ = ["LOCAL_PREFIX", "entity", "new_local_id", "is_local_id", "default_outbox_dir", "known_run_id", "remember_run_id",
           "entity_records", "write_outbox", "read_outbox", "create_run", "keep_only", "runs_of_local_id", "attach_run", "log_inputs", "log_eval", "log_table",
           "log_report", "deliver_outbox_file", "deliver_outbox", "Delivered"]

log = logging.getLogger(__name__)

LOCAL_PREFIX = "local-"


def new_local_id() -> str:
    """A run id for a run the tracking server has not created yet: ``local-<32 hex digits>``."""
    return LOCAL_PREFIX + uuid.uuid4().hex


def is_local_id(run_id: str | None) -> bool:
    return bool(run_id) and str(run_id).startswith(LOCAL_PREFIX)


def default_outbox_dir() -> str:
    """Where undelivered entries spill without a checkpoint folder: ``$LLMEFF_OUTBOX_DIR`` or
    ``~/.cache/mlflow_llmeff/outbox``."""
    return os.environ.get("LLMEFF_OUTBOX_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "mlflow_llmeff",
                                                               "outbox")


def _id_file(folder: str, local_id: str) -> str:
    return os.path.join(folder, f"{local_id}.run_id")


def known_run_id(folder: str | None, local_id: str) -> str | None:
    """The MLflow run id a local id was given (by the training process or ``llmeff sync``), else None."""
    try:
        with open(_id_file(folder or default_outbox_dir(), local_id), encoding="utf-8") as f:
            return f.read().strip() or None
    except OSError:
        return None


def remember_run_id(folder: str | None, local_id: str, run_id: str) -> None:
    """Record that ``local_id`` is MLflow run ``run_id`` (never raises)."""
    folder = folder or default_outbox_dir()
    try:
        os.makedirs(folder, exist_ok=True)
        tmp = _id_file(folder, local_id) + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(run_id + "\n")
        os.replace(tmp, _id_file(folder, local_id))
    except OSError:
        log.debug("could not record the run id of %s", local_id, exc_info=True)


# ------------------------------------------------------------------------------------ the file
def entity_records(entries: list) -> list[dict]:
    """``m``/``p``/``t`` records of MLflow ``Metric``, ``Param`` and ``RunTag`` entities."""
    from mlflow.entities import Metric, Param

    out = []
    for e in entries:
        if isinstance(e, Metric):
            out.append({"m": [e.key, e.value, e.timestamp, e.step]})
        else:
            out.append({"p" if isinstance(e, Param) else "t": [e.key, e.value]})
    return out


def entity(rec: dict):
    """The MLflow entity (``Metric``, ``Param`` or ``RunTag``) of one outbox record."""
    from mlflow.entities import Metric, Param, RunTag

    if "m" in rec:
        k, v, ts, step = rec["m"]
        return Metric(k, float(v), int(ts), int(step))
    return Param(*rec["p"]) if "p" in rec else RunTag(*rec["t"])


def write_outbox(path: str, run_id: str, records: list[dict], local_id: str | None = None) -> None:
    """Write an outbox file atomically (temporary file, fsync, rename): the header, then ``records``."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = path + ".tmp"
    head = {"run_id": run_id, **({"local_id": local_id} if local_id and local_id != run_id else {})}
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(json.dumps(head) + "\n")
        for rec in records:
            f.write(json.dumps(rec) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_outbox(path: str) -> tuple[dict, list[dict]]:
    """``(header, records)`` of an outbox file.

    Raises:
        ValueError: for a file that is not an outbox file (its first line names no run).
    """
    with open(path, encoding="utf-8") as f:
        lines = [json.loads(line) for line in f if line.strip()]
    if not lines or "run_id" not in lines[0]:
        raise ValueError(f"{path} is not an mlflow_llmeff outbox file (no run id on its first line)")
    return lines[0], lines[1:]


# ------------------------------------------------------------------------------------ the records
def experiment_id(client, spec: dict) -> str:
    """The experiment of a ``create`` record: ``experiment_id``, else ``experiment_name`` (created when
    missing), else MLflow's current experiment."""
    if spec.get("experiment_id"):
        return str(spec["experiment_id"])
    if spec.get("experiment_name"):
        exp = client.get_experiment_by_name(spec["experiment_name"])
        return exp.experiment_id if exp else client.create_experiment(spec["experiment_name"])
    from mlflow.tracking.fluent import _get_experiment_id

    return _get_experiment_id()


def ensure_experiment_kind(client, experiment_id: str) -> None:
    """Tag an experiment for MLflow 3's training-runs page unless it already has a kind (never raises)."""
    try:
        exp = client.get_experiment(experiment_id)
        if names.EXPERIMENT_KIND_TAG not in (exp.tags or {}):
            client.set_experiment_tag(experiment_id, names.EXPERIMENT_KIND_TAG, names.EXPERIMENT_KIND_VALUE)
    except Exception:  # noqa: BLE001 - cosmetic; never fatal
        log.debug("could not tag experiment %s", experiment_id, exc_info=True)


def create_now(client, spec: dict, local_id: str, gave_up=None):
    """Create a new run from a ``create`` spec now (the experiment made if named and missing), tagged with
    ``local_id`` (``llmeff.outbox.local_run_id``); the Run. Called within a bounded wait
    (:func:`mlflow_llmeff.tracking.delivery.bounded`); without an answer the ``create`` record is delivered
    later (:func:`create_run`), so the run is created once.

    One run per local id: copies that MLflow's retried request created are deleted (:func:`keep_only`).
    A creation that lands after the caller stopped waiting (``gave_up``, a ``threading.Event``, set)
    yields to the worker's: it deletes itself when that one exists.
    """
    exp_id = experiment_id(client, spec)
    name = (unique_run_name(client, exp_id, spec["run_name"], parts=spec.get("name_parts")) if spec.get("unique")
            else spec.get("run_name"))
    tags = {**(spec.get("tags") or {}), names.OUTBOX_LOCAL_ID: local_id}
    tags.pop("mlflow.runName", None)  # the name is run_name (MLflow refuses the two when they differ)
    run = client.create_run(exp_id, start_time=spec.get("start_ms"), tags=tags, run_name=name)
    if gave_up is not None and gave_up.is_set():  # nobody holds this id: the worker's run (if any) wins
        if [r for r in runs_of_local_id(client, exp_id, local_id) if r != run.info.run_id]:
            client.delete_run(run.info.run_id)
            return run
    else:
        keep_only(client, exp_id, local_id, run.info.run_id)
    ensure_experiment_kind(client, exp_id)
    return run


def create_run(client, spec: dict, local_id: str) -> str:
    """Create the run of a ``create`` record (or find the one already created for ``local_id``); its id.

    ``spec``: ``experiment_id`` or ``experiment_name`` (neither: MLflow's current experiment),
    ``run_name``, ``unique`` (add ``-2``, ``-3``, ... to a name the experiment has; with
    ``name_parts`` the name is their fixed-order stem), ``start_ms`` (the run's
    original start time), ``tags``.
    """
    exp_id = experiment_id(client, spec)
    found = client.search_runs([exp_id], f"tags.`{names.OUTBOX_LOCAL_ID}` = '{local_id}'", max_results=1)
    if found:
        return found[0].info.run_id
    name = spec.get("run_name") or None
    if name and spec.get("unique"):
        name = unique_run_name(client, exp_id, name, parts=spec.get("name_parts"))
    tags = {**(spec.get("tags") or {}), names.OUTBOX_LOCAL_ID: local_id}
    tags.pop("mlflow.runName", None)  # the name is run_name (MLflow refuses the two when they differ)
    run = client.create_run(exp_id, start_time=spec.get("start_ms"), tags=tags, run_name=name)
    keep_only(client, exp_id, local_id, run.info.run_id)
    ensure_experiment_kind(client, exp_id)
    return run.info.run_id


def runs_of_local_id(client, exp_id: str, local_id: str) -> list[str]:
    """Ids of the active runs of ``exp_id`` tagged ``llmeff.outbox.local_run_id = local_id``: every
    one, page after page (until issue 31 the first 100: copies past them were never deleted)."""
    return [r.info.run_id for r in all_runs(client, [exp_id], f"tags.`{names.OUTBOX_LOCAL_ID}` = '{local_id}'")]


def keep_only(client, exp_id: str, local_id: str, run_id: str) -> list[str]:
    """Delete (MLflow's soft delete) every other active run created for ``local_id``; the ids deleted.

    MLflow's HTTP client retries every method, ``CreateRun`` included, on a read timeout or a
    5xx answer (``mlflow/utils/request_utils.py``: ``allowed_methods=None``): a server that
    created the run but answered late gets the request again and creates a second run with the
    same tags. The creation's local id tells the copies apart from any other run, and the one
    whose id the caller holds is kept.
    """
    extra = [r for r in runs_of_local_id(client, exp_id, local_id) if r != run_id]
    for other in extra:
        client.delete_run(other)
    return extra


def name_run(client, run_id: str, spec: dict) -> str:
    """Name run ``run_id`` (a ``name`` record) the fixed-order stem of ``spec["name_parts"]``
    (:func:`mlflow_llmeff.tracking.naming.study_name`), ``-2``, ``-3`` where another run of its
    experiment has it; returns the name set.

    The meter names a run when it creates it, before the first step; the batch shape (the global
    batch and sequence length parts) is known at the end of that step, so a run whose stem then
    grows is named again, and its name is the one ``llmeff train`` gives the same configuration.

    Raises:
        mlflow.exceptions.MlflowException: what MLflow raises (the run is not there).
    """
    run = client.get_run(run_id)
    name = unique_run_name(client, run.info.experiment_id, run.info.run_name or "", exclude_run_id=run_id,
                           parts=spec.get("name_parts"))
    if name and name != run.info.run_name:
        client.set_tag(run_id, "mlflow.runName", name)
    return name


def attach_run(client, run_id: str, spec: dict) -> None:
    """Mark an existing run RUNNING (an ``attach`` record): ``continued_from`` (a launcher's run that a
    resume redirected: tagged ``llmeff.resume.continued_in_run``); ``run_name`` (named so if it has
    no metrics yet, ``unique`` as in :func:`create_run`)."""
    client.update_run(run_id, status="RUNNING")
    if spec.get("continued_from"):
        client.set_tag(spec["continued_from"], names.RESUME_CONTINUED_IN, run_id)
    if spec.get("run_name"):
        run = client.get_run(run_id)
        if not run.data.metrics:
            name = spec["run_name"]
            if spec.get("unique"):
                name = unique_run_name(client, run.info.experiment_id, name, exclude_run_id=run_id,
                                       parts=spec.get("name_parts"))
            client.set_tag(run_id, "mlflow.runName", name)
        ensure_experiment_kind(client, run.info.experiment_id)


def dataset_records(datasets: list, context: str) -> list[dict]:
    """JSON-safe form of ``mlflow.data`` datasets for an ``inputs`` record."""
    out = []
    for d in datasets:
        e = d._to_mlflow_entity()
        out.append({"name": e.name, "digest": e.digest, "source_type": e.source_type, "source": e.source,
                    "schema": e.schema, "profile": e.profile, "context": context})
    return out


def log_inputs(client, run_id: str, datasets: list[dict]) -> None:
    """Log the datasets of an ``inputs`` record as the run's inputs (what ``mlflow.log_input`` does)."""
    from mlflow.entities import Dataset, DatasetInput, InputTag
    from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT

    client.log_inputs(run_id, datasets=[
        DatasetInput(Dataset(d["name"], d["digest"], d["source_type"], d["source"], d.get("schema"), d.get("profile")),
                     tags=[InputTag(MLFLOW_DATASET_CONTEXT, d["context"])] if d.get("context") else [])
        for d in datasets])


def log_eval(client, run_id: str, spec: dict) -> int:
    """Log an ``eval`` record (``metrics``, ``timestamp`` ms, ``note``) at the run's last ``train/tokens``
    step (0 without one), with the tag ``llmeff.eval.last``; returns the step."""
    from mlflow.entities import Metric, RunTag

    step = max((m.step for m in client.get_metric_history(run_id, names.TRAIN_TOKENS)), default=0)
    ts = int(spec["timestamp"])
    client.log_batch(run_id, metrics=[Metric(k, float(v), ts, step) for k, v in spec["metrics"].items()],
                     tags=[RunTag(names.EVAL_LAST, f"{spec['note']}; logged at step {step}")])
    return step


def log_table(client, run_id: str, spec: dict) -> None:
    """Log a ``table`` record (``data``: column -> values; ``artifact_file``) as the run's table artifact."""
    client.log_table(run_id, data=spec["data"], artifact_file=spec["artifact_file"])


def log_file(client, run_id: str, spec: dict) -> None:
    """Log a ``file`` record (``path``: a local file; ``artifact_path``: the folder in the run) as an artifact."""
    client.log_artifact(run_id, spec["path"], artifact_path=spec.get("artifact_path"))


def log_text(client, run_id: str, spec: dict) -> None:
    """Log a ``text`` record (``text``; ``artifact_file``: its path in the run) as a text artifact."""
    client.log_text(run_id, spec["text"], spec["artifact_file"])


def log_files(client, run_id: str, spec: dict) -> None:
    """Log a ``files`` record (``path``: a local folder; ``artifact_path``: the folder in the run) as artifacts."""
    client.log_artifacts(run_id, spec["path"], artifact_path=spec.get("artifact_path"))


def log_report(client, run_id: str) -> None:
    """The efficiency report of a run whose points are delivered (:func:`mlflow_llmeff.tracking.run_report.report_artifacts`:
    ``efficiency_report.json``, the summary table, the figures); a failure becomes ``llmeff.report.warning``."""
    from mlflow_llmeff.names import shorten
    from mlflow_llmeff.tracking.run_report import report_artifacts

    try:
        report, table, figures = report_artifacts(client, run_id)
        client.log_dict(run_id, report, "efficiency_report.json")
        if table:
            client.log_table(run_id, data=table, artifact_file="efficiency_summary.json")
        for path, fig in figures.items():
            client.log_figure(run_id, fig, path)
        problem = None
    except Exception as e:  # noqa: BLE001 - a report must never stop or fail the run
        first = shorten(str(e).splitlines()[0], 300) if str(e) else ""
        problem = f"efficiency report not (fully) logged: {type(e).__name__}: {first}"
    if problem:
        log.warning("mlflow_llmeff: %s", problem)
        client.set_tag(run_id, names.REPORT_WARNING, problem)


# ------------------------------------------------------------------------------------ delivery (llmeff sync)
class Delivered(NamedTuple):
    """What :func:`deliver_outbox_file` did: the MLflow run, entries sent, the status set (or None),
    and the local id the run had (or None)."""

    run_id: str
    entries: int
    status: str | None
    local_id: str | None


def deliver_outbox_file(path: str, client, *, terminate: bool = True) -> Delivered:
    """Deliver an outbox file's records in order (creating the run first if it has a local id) and,
    with ``terminate``, build the report and end the run with its recorded status and end time;
    then delete the file.

    Raises:
        ValueError: for a file that is not an outbox file.
        mlflow.exceptions.MlflowException: when the server refuses or does not answer (the file stays).
    """
    from mlflow.entities import Metric, Param, RunTag
    from mlflow.utils.validation import MAX_METRICS_PER_BATCH, MAX_PARAMS_TAGS_PER_BATCH

    header, records = read_outbox(path)
    folder = os.path.dirname(path)
    run_id = header["run_id"]
    local_id = header.get("local_id") or (run_id if is_local_id(run_id) else None)
    if is_local_id(run_id):
        run_id = known_run_id(folder, run_id) or run_id
    sent, status, batch = 0, None, []

    def send_batch() -> None:
        metrics = [e for e in batch if isinstance(e, Metric)]
        others = [e for e in batch if not isinstance(e, Metric)]
        for i in range(0, len(metrics), MAX_METRICS_PER_BATCH):
            client.log_batch(run_id, metrics=metrics[i:i + MAX_METRICS_PER_BATCH])
        for i in range(0, len(others), MAX_PARAMS_TAGS_PER_BATCH):
            part = others[i:i + MAX_PARAMS_TAGS_PER_BATCH]
            client.log_batch(run_id, params=[e for e in part if isinstance(e, Param)],
                             tags=[e for e in part if isinstance(e, RunTag)])
        batch.clear()

    for rec in records:
        if any(k in rec for k in ("m", "p", "t")):
            batch.append(entity(rec))
            sent += 1
            continue
        send_batch()
        if "create" in rec:
            if is_local_id(run_id):
                run_id = create_run(client, rec["create"], local_id)
                remember_run_id(folder, local_id, run_id)
        elif is_local_id(run_id):
            raise ValueError(f"{path}: run {run_id} has no creation record and no known MLflow run id")
        elif "attach" in rec:
            attach_run(client, run_id, rec["attach"])
        elif "name" in rec:
            name_run(client, run_id, rec["name"])
        elif "inputs" in rec:
            log_inputs(client, run_id, rec["inputs"])
        elif "eval" in rec:
            log_eval(client, run_id, rec["eval"])
            sent += len(rec["eval"]["metrics"]) + 1
        elif "table" in rec:
            log_table(client, run_id, rec["table"])
        elif "file" in rec and os.path.exists(rec["file"]["path"]):  # a file removed since is not sent
            log_file(client, run_id, rec["file"])
        elif "text" in rec:
            log_text(client, run_id, rec["text"])
        elif "files" in rec and os.path.isdir(rec["files"]["path"]):  # a folder removed since is not sent
            log_files(client, run_id, rec["files"])
        elif "report" in rec and terminate:
            log_report(client, run_id)
        elif "end" in rec and terminate:
            status = str(rec["end"][0])
            client.set_terminated(run_id, status, end_time=int(rec["end"][1]))
    if is_local_id(run_id):
        raise ValueError(f"{path}: run {run_id} has no creation record and no known MLflow run id")
    send_batch()
    os.remove(path)
    return Delivered(run_id, sent, status, local_id)


def deliver_outbox(folder: str, client=None) -> list[Delivered]:
    """Deliver every outbox file (``*.jsonl``) in ``folder``, oldest name first.

    Raises:
        ValueError: when ``folder`` is not a directory.
    """
    from mlflow import MlflowClient

    if not os.path.isdir(folder):
        raise ValueError(f"outbox folder {folder!r} does not exist (llmeff train spills to <checkpoint_dir>/outbox, "
                         f"autolog and monitors to {default_outbox_dir()})")
    client = client or MlflowClient()
    return [deliver_outbox_file(os.path.join(folder, name), client)
            for name in sorted(os.listdir(folder)) if name.endswith(".jsonl")]
