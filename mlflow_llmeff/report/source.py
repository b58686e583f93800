"""Reading the runs to compare out of MLflow: an ``MlflowClient`` (any tracking URI) or a server's live store.

Both expose the same positional calls (``get_experiment_by_name``, ``get_experiment``, ``search_runs``,
``get_metric_history``), so the efficiency page inside ``mlflow server`` and ``llmeff compare`` share
this code. Errors are ``ValueError`` with one line naming the bad value.
"""

from __future__ import annotations

from dataclasses import dataclass

from mlflow_llmeff import names
from mlflow_llmeff.tracking.redact import clean, environment_secrets
from mlflow_llmeff.tracking.runs import ui_run_url
from mlflow_llmeff.tracking.search import all_runs
from mlflow_llmeff.report.calc import RunRecord

__all__ = ["Selection", "select_runs", "metric_history", "ui_run_url"]

@dataclass(frozen=True)
class Selection:
    """The compared runs of one experiment.

    Attributes:
        experiment_id, experiment_name: the experiment.
        filter_string: the MLflow search filter used ('' = every run).
        runs: every matching run, newest first (MLflow's pages followed to the end: no cap);
            comparison runs (``llmeff.compare.run_ids``) are left out.
        comparison_runs: how many comparison runs matched and were left out.
    """

    experiment_id: str
    experiment_name: str
    filter_string: str
    runs: list[RunRecord]
    comparison_runs: int = 0

    def scope(self) -> str:
        """Which runs these are: ``every active run of the experiment`` (or ``... matching the filter``),
        and the comparison runs left out."""
        scope = "matching the filter" if self.filter_string else "of the experiment"
        left = (f"; {self.comparison_runs:,} comparison run{'s' if self.comparison_runs != 1 else ''} "
                "(llmeff compare's own) left out" if self.comparison_runs else "")
        return f"every active run {scope}{left}"

    def count_line(self) -> str:
        """``1,001 runs compared: every active run of the experiment``: what the first screen and the
        report say about how many runs they show (all of them: no cap)."""
        return f"{len(self.runs):,} run{'s' if len(self.runs) != 1 else ''} compared: {self.scope()}"


def _experiment(client, experiment: str):
    """The experiment named ``experiment`` (or with that id); ValueError when there is none."""
    exp = client.get_experiment_by_name(experiment)
    if exp is None and experiment.isdigit():
        try:
            exp = client.get_experiment(experiment)
        except Exception:  # noqa: BLE001 - an unknown id is reported below
            exp = None
    if exp is None:
        raise ValueError(f"experiment {experiment!r} not found (give an experiment name or id that exists in "
                         f"this tracking store)")
    return exp


def select_runs(client, experiment: str, filter_string: str = "") -> Selection:
    """Read every run of ``experiment`` that matches ``filter_string`` (MLflow search syntax),
    however many: MLflow's pages (1,000 runs each) are followed to the last one.

    Args:
        client: an ``mlflow.MlflowClient`` or a tracking store (``mlflow.server.handlers._get_tracking_store()``).
        experiment: experiment name (or numeric id).
        filter_string: MLflow search filter, e.g. ``tags."llmeff.precision" = 'bf16'``.

    Tags and params come back masked as our logger masks them (secret-looking names, values of
    secret environment variables, URI user-info), whoever logged them.

    Raises:
        ValueError: unknown experiment, a filter MLflow cannot parse, or no run to compare (each one line).
    """
    from mlflow.entities import ViewType
    from mlflow.exceptions import MlflowException

    exp = _experiment(client, experiment)
    secrets = environment_secrets()
    try:
        found = all_runs(client, [exp.experiment_id], filter_string or "", order_by=["attributes.start_time DESC"],
                         view_type=ViewType.ACTIVE_ONLY)
    except MlflowException as e:
        first = str(e.message if hasattr(e, "message") else e).strip().splitlines()[0]
        raise ValueError(f"bad filter {filter_string!r}: {first}") from None
    runs = [_record(r, secrets) for r in found]
    compared = [r for r in runs if names.COMPARE_RUN_IDS not in r.tags]
    left_out, runs = len(runs) - len(compared), compared
    if not runs:
        if filter_string:
            raise ValueError(f"no run of experiment {exp.name!r} matches the filter {filter_string!r}")
        raise ValueError(f"experiment {exp.name!r} has no runs to compare")
    return Selection(exp.experiment_id, exp.name, filter_string or "", runs, left_out)


def _record(run, secrets: list[str]) -> RunRecord:
    """A run as the reports see it: tags and params through :func:`mlflow_llmeff.tracking.redact.clean`
    (runs logged by other tools never had our logger's masking, and reports are shared)."""
    tags = {k: clean(k, v, secrets) for k, v in run.data.tags.items()}
    params = {k: clean(k, v, secrets) for k, v in run.data.params.items()}
    return RunRecord(run_id=run.info.run_id, name=tags.get("mlflow.runName") or run.info.run_name or "",
                     status=run.info.status, experiment_id=run.info.experiment_id,
                     metrics=dict(run.data.metrics), tags=tags, params=params)


def metric_history(client, run_id: str, key: str) -> list[tuple[int, int, float]]:
    """``(step, timestamp_ms, value)`` points of one metric of one run, by step; [] when it has none."""
    try:
        points = client.get_metric_history(run_id, key)
    except Exception:  # noqa: BLE001 - a missing history is an empty plot line, not an error
        return []
    return sorted((int(m.step), int(m.timestamp), float(m.value)) for m in points)
