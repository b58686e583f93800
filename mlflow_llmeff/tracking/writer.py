"""The one door to MLflow: :class:`RunWriter`, through which every run's creation, tag, param, metric, artifact and end passes.

Every write to MLflow is made by the background worker (:mod:`mlflow_llmeff.tracking.worker`: its
thread; :mod:`mlflow_llmeff.tracking.outbox`: the records it delivers, which ``llmeff sync`` delivers
too), handed over by a writer: the training run's :class:`~mlflow_llmeff.tracking.logger.RunLogger`,
or a :class:`RunWriter` (a ``RunLogger`` made for one short job) for every other run: a study's parent
and children, a dry run's plan, a comparison, an MLPerf-style result log, an eval's scores, the runs of
a job's other machines. So every write has MLflow's key checks (:mod:`~mlflow_llmeff.tracking.keys`),
secret masking (:mod:`~mlflow_llmeff.tracking.redact`), batching, and a bounded wait
(:mod:`~mlflow_llmeff.tracking.delivery`, ``LLMEFF_DELIVERY_WAIT_S``): what the server has not taken
by then waits in the outbox, and ``llmeff sync`` sends it. ``tests/test_architecture.py`` allows
MLflow client writes only in this module, the worker and the outbox's records.

The few writes that are not a run's entries are here too: the fluent run of a local store (MLflow's
``start_run``, so a user's ``mlflow.log_*`` calls land in the meter's run) and its release.
"""

from __future__ import annotations

import logging
import threading
import time

from mlflow_llmeff.tracking import delivery, outbox
from mlflow_llmeff.tracking.logger import RunLogger

__all__ = ["RunWriter", "context_tags", "start_fluent_run", "end_fluent_run"]

log = logging.getLogger(__name__)


def context_tags(tags: dict | None = None) -> dict:
    """``tags`` with the context tags ``mlflow.start_run`` would add (source, user, git commit), as a
    run ``llmeff train`` creates has them; no ``llmeff.*`` condition of a context provider (a study's
    parent has no conditions; a child's own training tags its conditions). Never raises."""
    try:
        from mlflow.tracking import context

        resolved = {k: str(v) for k, v in context.registry.resolve_tags({}).items() if not k.startswith("llmeff.")}
    except Exception:  # noqa: BLE001 - context tags are cosmetic
        resolved = {}
    return {**resolved, **(tags or {})}


class RunWriter(RunLogger):
    """The writer of one run that is not a training run's (see the module docstring): a
    :class:`~mlflow_llmeff.tracking.logger.RunLogger` that says nothing on the terminal (its caller
    says what was kept, in one line), made by :meth:`create` or :meth:`attach`.

    Attributes:
        experiment_id: the run's experiment where known (a run :meth:`create` made on the server), else None.
    """

    quiet = True
    experiment_id: str | None = None

    @classmethod
    def create(cls, run_name: str, *, experiment_id: str | None = None, experiment_name: str | None = None,
               tags: dict | None = None, params: dict | None = None, unique: bool = False, client=None,
               outbox_dir: str | None = None, wait_s: float | None = None) -> "RunWriter":
        """A new run named ``run_name`` (``unique``: ``-2``, ``-3``, ... where the experiment has it) with
        ``tags`` and the context tags (:func:`context_tags`), then ``params``.

        The creation waits at most ``wait_s`` (default ``LLMEFF_DELIVERY_WAIT_S``) for a tracking
        server; without an answer the run has a local id (``local-...``, :attr:`answered` False) and its
        creation waits in the outbox with everything written to it.

        Args:
            experiment_id: the experiment; else ``experiment_name`` (created when missing); else MLflow's current one.

        Raises:
            mlflow.exceptions.MlflowException: a refusal (:data:`~mlflow_llmeff.tracking.delivery.REFUSALS`), or
                any error of a local store.
        """
        from mlflow import MlflowClient

        client = client or MlflowClient()
        checked, problems = _checked_tags(context_tags(tags))
        spec = {"experiment_id": experiment_id, "experiment_name": None if experiment_id else experiment_name,
                "run_name": run_name, "unique": unique, "start_ms": int(time.time() * 1000), "tags": checked}
        local_id = outbox.new_local_id()
        gave_up = threading.Event()  # set when the wait ran out: the worker's creation then wins
        try:
            run = delivery.call(lambda: outbox.create_now(client, spec, local_id, gave_up), "creating the run",
                                uri=client.tracking_uri, wait_s=wait_s)
        except delivery.Unreachable as e:
            gave_up.set()
            writer = cls(local_id, client, outbox_dir=outbox_dir, wait_s=wait_s, first=[{"create": spec}],
                         unanswered=str(e), local_id=local_id)
        else:
            writer = cls(run.info.run_id, client, outbox_dir=outbox_dir, wait_s=wait_s)
            writer.experiment_id = run.info.experiment_id
        writer.note_problems(problems)
        if params:
            writer.log_params(params)
        return writer

    @classmethod
    def attach(cls, run_id: str, *, client=None, outbox_dir: str | None = None,
               wait_s: float | None = None) -> "RunWriter":
        """The writer of the existing run ``run_id`` (nothing is read or written until it is used)."""
        return cls(run_id, client, outbox_dir=outbox_dir, wait_s=wait_s)

    def note_problems(self, problems: tuple[str, ...]) -> None:
        """Name ``problems`` (a key mapped, a value shortened) in ``llmeff.logging.warnings``."""
        self._note(tuple(problems))
        self._write_problems()

    @property
    def answered(self) -> bool:
        """False once the tracking server did not answer (or has not created the run): what is written
        waits in the outbox."""
        return self._down_since is None and not outbox.is_local_id(self.run_id)

    @property
    def unanswered_reason(self) -> str:
        """Why the server is known not to answer (one line naming it and the bound), else ``""``."""
        return self._down_reason if self._down_since is not None else ""

    def write_text(self, text: str, artifact_file: str) -> None:
        """Log ``text`` as the artifact ``artifact_file`` (a path in the run), delivered in order."""
        self._enqueue("text", {"text": str(text), "artifact_file": artifact_file})

    def log_folder(self, local_dir: str, artifact_path: str | None = None) -> None:
        """Log the files of the local folder ``local_dir`` as artifacts under ``artifact_path`` (None: the
        run's root), delivered in order; the folder must stay until :meth:`end`."""
        import os

        self._enqueue("files", {"path": os.path.abspath(local_dir), "artifact_path": artifact_path})

    def end(self, status: str | None = "FINISHED") -> bool:
        """Deliver everything and (``status``) end the run now; True when the server took it all.

        Waits at most the delivery wait for an answer, and not at all once the server is known not to
        answer: then everything (the end too) is written to :meth:`outbox_path` at once.
        """
        if self._down_since is None:
            return self.close(status)
        self._send()
        if status:
            self._enqueue("end", (status, int(time.time() * 1000)))
        self._stop_and_say(status)
        return False

    def _warn(self, e: Exception) -> None:
        log.debug("mlflow_llmeff: a write was not taken", exc_info=e)


def _checked_tags(tags: dict) -> tuple[dict, tuple[str, ...]]:
    """``tags`` as MLflow takes them and with secrets masked (as :meth:`RunLogger.set_tags` writes them), and
    the problems found (for ``llmeff.logging.warnings``)."""
    from mlflow_llmeff.tracking import keys, redact

    secrets = redact.environment_secrets()
    out, problems = {}, []
    for k, v in tags.items():
        c = keys.check_tag(k, redact.clean(str(k), str(v), secrets))
        problems += c.problems
        if c.key is not None:
            out[c.key] = c.value
    return out, tuple(problems)


def start_fluent_run(client, experiment_name: str | None, run_name_of):
    """Start MLflow's active run (``mlflow.start_run``) in ``experiment_name`` (created when missing; None:
    MLflow's current experiment), named ``run_name_of(experiment id)``, for a local store (called
    directly: a local store does not hang); the ``mlflow.entities.Run``."""
    import mlflow

    if experiment_name:
        exp = client.get_experiment_by_name(experiment_name)
        exp_id = exp.experiment_id if exp else client.create_experiment(experiment_name)
    else:
        from mlflow.tracking.fluent import _get_experiment_id

        exp_id = _get_experiment_id()
    run = mlflow.start_run(experiment_id=exp_id, run_name=run_name_of(exp_id))
    outbox.ensure_experiment_kind(client, run.info.experiment_id)
    return run


def end_fluent_run(run_id: str) -> None:
    """End MLflow's active run when it is ``run_id`` (``mlflow.end_run``)."""
    import mlflow

    active = mlflow.active_run()
    if active is not None and active.info.run_id == run_id:
        mlflow.end_run()
