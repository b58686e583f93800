"""A dry run's plan on the launcher's run (``mlflow run -P dry_run=true``): tags, name and ``plan/*`` metrics."""

from __future__ import annotations

from mlflow_llmeff import names
from mlflow_llmeff.tracking.naming import parts_from_tags, study_name

__all__ = ["assumed_text", "log_plan"]


def assumed_text(assumed: dict[str, str]) -> str:
    """``llmeff.assumed``'s value: ``<input>: <value> (<why>)`` joined by ``; ``."""
    return "; ".join(f"{k}: {v}" for k, v in assumed.items())


def log_plan(run_id: str, tags: dict[str, str], plan: dict, fit_line: str, *, eval_tasks: str = "", client=None) -> None:
    """Write ``plan`` onto run ``run_id``: ``llmeff.dry_run=true``, the condition ``tags``, the name
    ``plan-<stem>`` (the stem ``llmeff train`` gives the configuration, :mod:`mlflow_llmeff.tracking.naming`),
    ``llmeff.assumed`` when the plan took something for the user (an alias, auto precision there, a list
    price), ``llmeff.plan.fit`` (``fit_line``) and every number of the plan as ``plan/<field>``.

    Args:
        run_id: the launcher's run.
        tags: the plan's condition tags (model, accelerator, count, strategy, precision, sequence
            length, global batch).
        plan: :func:`mlflow_llmeff.planning.plan.make_plan`'s dict with predictions and ``assumed``.
        fit_line: the fit verdict's line.
        eval_tasks: the run's eval tasks (a part of the name).
        client: an ``MlflowClient`` (default: one for the current tracking URI).

    Written through :class:`~mlflow_llmeff.tracking.writer.RunWriter` (key checks, masking, one batch),
    waiting at most the delivery wait (``LLMEFF_DELIVERY_WAIT_S``); what the server does not take then
    waits in the outbox. Never raises.
    """
    from mlflow_llmeff.tracking.writer import RunWriter

    tags = dict(tags)
    name = "plan-" + study_name(parts_from_tags(tags, eval_tasks))
    if plan.get("assumed"):
        tags[names.ASSUMED] = assumed_text(plan["assumed"])
    writer = RunWriter.attach(run_id, client=client)
    writer.set_tags({names.DRY_RUN: "true", "mlflow.runName": name, **tags, names.PLAN_FIT: fit_line}, synchronous=False)
    writer.log_metrics({f"plan/{k}": float(v) for k, v in plan.items() if isinstance(v, (int, float))}, step=0)
    writer.end(None)
