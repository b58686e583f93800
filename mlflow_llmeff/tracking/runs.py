"""Which MLflow run a meter logs into, and how it ends: open, resume, end with a status.

Order of choice (:func:`open_run`): an explicit ``run_id`` (a resumed checkpoint's run); the
active run; ``MLFLOW_RUN_ID`` (set by ``mlflow run`` for the child process; named as below while
it has no metrics yet); otherwise a new run
in ``experiment_name`` (or MLflow's current experiment), named as ``docs/training.md`` ("Logging") says.
A run the meter opened or resumed is the meter's to end; an active run the user started stays
open for the user.

With a tracking server (an ``http(s)`` URI), nothing here waits longer than the delivery wait
(``LLMEFF_DELIVERY_WAIT_S``, :mod:`mlflow_llmeff.tracking.delivery`): the calls that resume or
re-open a known run are handed to the logger's delivery thread (``attach`` records), and a new
run's creation is waited for at most that long; without an answer the run gets a local id and its
creation waits in the outbox with everything else (:mod:`mlflow_llmeff.tracking.outbox`). A local
store (sqlite, a folder) is called directly.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field

from mlflow_llmeff import names
from mlflow_llmeff.tracking import outbox, writer
from mlflow_llmeff.tracking.delivery import REFUSALS as _REFUSALS
from mlflow_llmeff.tracking.experiments import unique_run_name
from mlflow_llmeff.names import shorten

__all__ = ["RunHandle", "open_run", "release", "unique_run_name", "ui_run_url", "run_url_line",
           "mark_machine_runs"]

# _REFUSALS: MLflow error codes that say the request is wrong, not that the server is away: raised,
# never turned into a local run.


@dataclass
class RunHandle:
    """The run a meter logs into.

    Attributes:
        run_id: MLflow run id, or a local id (``local-...``) while the server has not created it.
        owned: True when the meter ends the run (it created or resumed it).
        fluent: True when the run is MLflow's active run started by the meter (``mlflow.start_run``).
        resumed: True when an existing run was continued.
        fresh_since_unix: for a launcher's run with nothing logged yet (``mlflow run``), its start
            time (unix seconds): the run's wall time starts there. None otherwise.
        pending: outbox records the logger delivers before anything else (``create``, ``attach``).
        unanswered: why the tracking server is known not to answer (it did not at the start), or None.
        local_id: the local id the run had before the server created it, else None.
    """

    run_id: str
    owned: bool
    fluent: bool
    resumed: bool
    fresh_since_unix: float | None = None
    pending: list = field(default_factory=list)
    unanswered: str | None = None
    local_id: str | None = None


def open_run(client, *, run_id: str | None, run_name: str, experiment_name: str | None = None,
             unique_name: bool = False, outbox_dir: str | None = None, name_parts: dict | None = None) -> RunHandle:
    """Open (or continue) the run to log into; see the module docstring for the order of choice.

    Under ``mlflow run`` a resumed checkpoint's run can differ from the launcher's
    ``MLFLOW_RUN_ID``: the launcher's run then gets ``llmeff.resume.continued_in_run``. With
    ``unique_name`` a new (or fresh launcher's) run gets :func:`unique_run_name` of ``run_name``, or
    with ``name_parts`` (the conditions' short forms) of their fixed-order stem.
    A local id (a checkpoint of a run the server had not created) is looked up in ``outbox_dir``
    (where the training process or ``llmeff sync`` recorded its MLflow id) and on the server.

    Raises:
        mlflow.exceptions.MlflowException: when a local store fails, or a server refuses the
            request itself (e.g. permission denied); a server that does not answer never raises.
    """
    import mlflow

    from mlflow_llmeff.tracking import delivery

    delivery.apply_request_settings()
    env_run = os.environ.get("MLFLOW_RUN_ID") or None
    wait = delivery.delivery_wait_s() if delivery.is_server(_uri(client)) else None
    if run_id is not None:
        local_id = run_id if outbox.is_local_id(run_id) else None
        if local_id:
            run_id, unanswered = outbox.known_run_id(outbox_dir, local_id), None
            if run_id is None:
                run_id, unanswered = _find_local(client, local_id, wait)
            if run_id is None:  # still not on the server: its outbox file holds the creation
                return RunHandle(local_id, owned=True, fluent=False, resumed=True, local_id=local_id,
                                 unanswered=unanswered,
                                 pending=[{"create": _create_spec(run_name, experiment_name, unique_name, name_parts)}])
        continued = env_run if env_run and env_run != run_id else None
        return RunHandle(run_id, owned=True, fluent=False, resumed=True, local_id=local_id,
                         pending=[{"attach": {"continued_from": continued}}])
    active = mlflow.active_run()
    if active is not None:
        return RunHandle(active.info.run_id, owned=False, fluent=False, resumed=False)
    if env_run:
        try:
            return _call(lambda: _claim_env_run(client, env_run, run_name, unique_name, name_parts), wait,
                         "re-opening the launcher's run")
        except _Unanswered as e:
            return RunHandle(env_run, owned=True, fluent=False, resumed=True, unanswered=str(e),
                             pending=[{"attach": {"run_name": run_name, "unique": unique_name,
                                                  "name_parts": name_parts}}])
    if wait is None:  # a local store: MLflow's own start_run
        return _start_run(client, run_name, experiment_name, unique_name, name_parts)
    spec = _create_spec(run_name, experiment_name, unique_name, name_parts)
    # the id is given first and the run created with it as a tag: a create the server carries out
    # after the wait ran out is found by the outbox's replay, not created twice
    local_id = outbox.new_local_id()
    gave_up = threading.Event()  # set when the wait ran out: the outbox's worker then owns the creation
    try:
        run = _call(lambda: _create(client, spec, local_id, gave_up), wait, "creating the run", gave_up)
    except _Unanswered as e:
        return RunHandle(local_id, owned=True, fluent=False, resumed=False, pending=[{"create": spec}],
                         unanswered=str(e), local_id=local_id)
    return RunHandle(run.info.run_id, owned=True, fluent=_activate(run), resumed=False)


class _Unanswered(Exception):
    """The tracking server did not answer (in time, or at all)."""


def _call(fn, wait: float | None, what: str, gave_up: threading.Event | None = None):
    """``fn()`` directly (``wait`` None: a local store) or within ``wait`` seconds; a server that does not
    answer, or fails without refusing the request itself, raises :class:`_Unanswered` (and sets
    ``gave_up`` when the wait ran out while ``fn`` goes on)."""
    from mlflow_llmeff.tracking import delivery

    if wait is None:
        return fn()
    try:
        return delivery.bounded(fn, wait, what)
    except delivery.NoAnswer as e:
        if gave_up is not None:
            gave_up.set()
        raise _Unanswered(str(e)) from None
    except Exception as e:  # noqa: BLE001
        if getattr(e, "error_code", None) in _REFUSALS:
            raise
        first = shorten((str(e).strip().splitlines() or [""])[0], 200)
        raise _Unanswered(f"{type(e).__name__}: {first}") from None


def _uri(client) -> str:
    import mlflow

    uri = getattr(getattr(client, "_tracking_client", None), "tracking_uri", None)
    return uri if isinstance(uri, str) else mlflow.get_tracking_uri()


def _claim_env_run(client, env_run: str, run_name: str, unique_name: bool, name_parts: dict | None = None) -> RunHandle:
    """Mark the launcher's run RUNNING and, while it has no metrics, name it (an ``attach`` record delivered
    now: :func:`mlflow_llmeff.tracking.outbox.attach_run`)."""
    before = client.get_run(env_run)
    outbox.attach_run(client, env_run, {"run_name": run_name, "unique": unique_name, "name_parts": name_parts})
    fresh = not before.data.metrics
    start = before.info.start_time
    return RunHandle(env_run, owned=True, fluent=False, resumed=True,
                     fresh_since_unix=start / 1000 if fresh and start else None)


def _create_spec(run_name: str, experiment_name: str | None, unique_name: bool, name_parts: dict | None = None) -> dict:
    """A ``create`` record: the experiment as this process names it, the name, the start time now, and
    the context tags ``mlflow.start_run`` would set (source, user, git, our condition tags)."""
    from mlflow.tracking import context
    from mlflow.tracking import fluent

    try:
        tags = {k: str(v) for k, v in context.registry.resolve_tags({}).items()}
    except Exception:  # noqa: BLE001 - context tags are cosmetic
        tags = {}
    exp_id = os.environ.get("MLFLOW_EXPERIMENT_ID") or getattr(fluent, "_active_experiment_id", None)
    return {"experiment_name": experiment_name or (None if exp_id else os.environ.get("MLFLOW_EXPERIMENT_NAME")),
            "experiment_id": None if experiment_name else exp_id, "run_name": run_name, "unique": unique_name,
            "name_parts": name_parts, "start_ms": int(time.time() * 1000), "tags": tags}


def _create(client, spec: dict, local_id: str, gave_up: threading.Event | None = None):
    """:func:`mlflow_llmeff.tracking.outbox.create_now`: the run of a ``create`` spec, created now."""
    return outbox.create_now(client, spec, local_id, gave_up)


def _start_run(client, run_name: str, experiment_name: str | None, unique_name: bool,
               name_parts: dict | None = None) -> RunHandle:
    def name(exp_id: str) -> str:
        return unique_run_name(client, exp_id, run_name, parts=name_parts) if unique_name else run_name

    run = writer.start_fluent_run(client, experiment_name, name)
    return RunHandle(run.info.run_id, owned=True, fluent=True, resumed=False)


def _find_local(client, local_id: str, wait: float | None) -> tuple[str | None, str | None]:
    """``(the MLflow run created for local_id or None, why the server did not answer or None)``; the run
    carries the tag ``llmeff.outbox.local_run_id``."""
    def find():
        from mlflow_llmeff.tracking.search import all_experiment_ids

        exp_ids = all_experiment_ids(client)  # every experiment (one page is 1,000 of them)
        found = client.search_runs(exp_ids, f"tags.`{names.OUTBOX_LOCAL_ID}` = '{local_id}'", max_results=1)
        return found[0].info.run_id if found else None

    try:
        return _call(find, wait, "finding the run of a local id"), None
    except _Unanswered as e:  # the outbox file creates it when the server answers
        return None, str(e)


def _activate(run) -> bool:
    """Make ``run`` MLflow's active run of this thread without another request (what ``mlflow.start_run``
    ends with), so the user's ``mlflow.log_*`` calls land in it; False when MLflow has no such stack."""
    try:
        from mlflow.tracking import fluent

        fluent._active_run_stack.get().append(fluent.ActiveRun(run))
        return True
    except Exception:  # noqa: BLE001 - then it is simply not the active run
        return False


def release(handle: RunHandle) -> None:
    """Stop ``handle``'s run being MLflow's active run, without a request (its end is the logger's:
    delivered, or waiting in the outbox), so MLflow's exit hook never ends it again."""
    if not handle.fluent:
        return
    try:
        from mlflow.tracking import fluent

        stack = fluent._active_run_stack.get()
        for i in range(len(stack) - 1, -1, -1):
            if stack[i].info.run_id == handle.run_id:
                del stack[i]
                fluent._last_active_run_id.set(handle.run_id)
                break
        monitor = getattr(fluent, "run_id_to_system_metrics_monitor", {}).pop(handle.run_id, None)
        if monitor is not None:
            monitor.finish()
    except Exception:  # noqa: BLE001 - MLflow internals moved: end it the documented way
        writer.end_fluent_run(handle.run_id)


def error_line(exc: BaseException) -> str:
    """One line for a run's ``llmeff.error``: the message of a ValueError, else ``Type: message``."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    own = isinstance(exc, ValueError) or getattr(exc, "one_line", False)  # messages written to be the line
    line = text if own else f"{type(exc).__name__}: {text}".rstrip(": ")
    return shorten(line, 2000)


def record_failure(message: str, tags: dict[str, str] | None = None, run_id: str | None = None,
                   run_name: str | None = None) -> bool:
    """Write why a run failed onto it: ``llmeff.error``, the run's description, ``tags``, and (when
    given) its name, so a run that failed before training is named like the others: the configuration's
    stem made unique in the experiment (``...-cpu-3``; :func:`unique_run_name`), so that it never takes
    the name of a finished repeat (a trial's failed run was named like the run that finished beside it,
    and a comparison naming runs by name could no longer tell them apart). The name is read within
    5 s at most (``delivery.bounded``); unanswered, the stem is kept.

    For the launcher's run under ``mlflow run`` (``MLFLOW_RUN_ID``) when ``run_id`` is None. Never
    raises; returns True when something was written.
    """
    run_id = run_id or os.environ.get("MLFLOW_RUN_ID")
    if not run_id:
        return False
    try:
        from mlflow import MlflowClient

        from mlflow_llmeff.tracking import delivery
        from mlflow_llmeff.tracking.logger import RunLogger

        client = MlflowClient()
        if run_name:
            try:
                run_name = delivery.bounded(
                    lambda: unique_run_name(client, client.get_run(run_id).info.experiment_id, run_name,
                                            exclude_run_id=run_id),
                    min(5.0, delivery.delivery_wait_s()), "reading the names taken")
            except Exception:  # noqa: BLE001 - a name is cosmetic: the stem it is
                pass
        logger = RunLogger(run_id, client)
        named = {"mlflow.runName": run_name} if run_name else {}
        logger.set_tags({**(tags or {}), **named, names.ERROR: message, "mlflow.note.content": f"Failed: {message}"})
        logger.close(None)  # delivered, or in the outbox with how to send it
        return True
    except Exception:  # noqa: BLE001 - reporting a failure must not hide it
        return False


def mark_machine_runs(job_run_id: str, machine_runs: dict[int, tuple[str, str]], num_machines: int,
                        client=None) -> str | None:
    """Mark the runs ``mlflow run`` made on the job's other machines (MLflow issue #3787: one run per
    machine, all but machine 0's empty) as parts of the job's run. Each gets the tag
    ``llmeff.machine.job_run`` (the job's run), ``mlflow.parentRunId`` (the UI nests it under the job's
    run, collapsed), a description saying where the figures are, and the end status FINISHED; ``mlflow
    run`` on that machine then ends it again with that machine's exit status, and ``llmeff compare``
    leaves it out. It is not deleted: MLflow 3.17's ``mlflow run`` ends its run even when it was ended
    (``_maybe_set_run_terminated`` compares the status string to integers), and ending a deleted run
    raises, which would fail that machine's ``mlflow run`` after the job succeeded. Called by the job's
    rank 0 (the only writer), before the first step.

    Args:
        job_run_id: the run rank 0 logs into.
        machine_runs: ``{machine_rank: (its MLFLOW_RUN_ID, its host)}`` of machines 1.. that have one
            (one that is the job's own run is left alone).
        num_machines: machines in the job.
        client: an ``MlflowClient`` (default: a new one).

    Returns:
        The ``llmeff.machine_runs`` tag for the job's run (``machine 1 (host): run ID``; a failure says
        so), or None when there was none. Never raises.
    """
    todo = {r: v for r, v in sorted(machine_runs.items()) if v[0] and v[0] != job_run_id}
    if not todo:
        return None
    said = []
    for rank, (run_id, host) in todo.items():
        note = (f"Machine {rank} of {num_machines} ({host}) of the job whose run is {job_run_id}: rank 0 logs every "
                "figure there. This machine's launcher (mlflow run on each machine) made this run; it logs nothing.")
        try:
            w = writer.RunWriter.attach(run_id, client=client)
            w.set_tags({names.MACHINE_JOB_RUN: job_run_id, "mlflow.parentRunId": job_run_id,
                        "mlflow.note.content": note}, synchronous=False)
            if w.end("FINISHED"):
                said.append(f"machine {rank} ({host}): run {run_id}")
            else:
                said.append(f"machine {rank} ({host}): run {run_id} not marked yet ({w.unanswered_reason or 'no answer'}; "
                            f"waits in {w.spilled_to})")
        except Exception as e:  # noqa: BLE001 - a run left unmarked is named, never the end of training
            said.append(f"machine {rank} ({host}): run {run_id} not marked ({type(e).__name__}: {shorten(str(e), 200)})")
    return "; ".join(said)


#: The query that makes MLflow 3's UI open a page as model training, not GenAI (checked on 3.17.2: a
#: fresh browser otherwise shows a run under "Evaluations").
TRAINING_VIEW = "workflowType=machine_learning"


def ui_run_url(base: str, experiment_id: str, run_id: str) -> str:
    """The MLflow 3 UI address of a run opened as a training run
    (``#/experiments/<id>/runs/<run id>?workflowType=machine_learning``).

    ``base`` is the server's address (``http://host:port``) or ``""`` for a link relative to the server.
    """
    return f"{base.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}?{TRAINING_VIEW}"


def ui_experiment_url(base: str, experiment_id: str) -> str:
    """The MLflow 3 UI address of an experiment's runs opened as model training."""
    return f"{base.rstrip('/')}/#/experiments/{experiment_id}/runs?{TRAINING_VIEW}"


def run_url_line(tracking_uri: str, experiment_id: str, run_id: str) -> str:
    """One line telling where to open the run: its training-runs URL on a server, else the
    ``mlflow ui`` command for a local store and the URL it will serve. A credential in the URI is never
    printed (a server's address loses its user-info; a store's URI is
    :func:`~mlflow_llmeff.tracking.redact.store_arg`)."""
    from mlflow_llmeff.tracking.redact import store_arg, strip_uri_secrets

    if tracking_uri.startswith(("http://", "https://")):
        return f"view run at {ui_run_url(strip_uri_secrets(tracking_uri), experiment_id, run_id)}"
    return (f"view run: mlflow ui --backend-store-uri {store_arg(tracking_uri)} then open "
            f"{ui_run_url('http://127.0.0.1:5000', experiment_id, run_id)}")
