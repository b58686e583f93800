"""Where a new run goes and what it is called: the experiment (and its kind tag), the run's name.

Shared by the outbox (:mod:`mlflow_llmeff.tracking.outbox`, which creates and attaches runs when
the server answers), the run choice (:mod:`mlflow_llmeff.tracking.runs`) and the logger, so it
imports none of them: only ``names`` and the pure name calculator
(:mod:`mlflow_llmeff.tracking.naming`).
"""

from __future__ import annotations

import logging

from mlflow_llmeff import names
from mlflow_llmeff.tracking import naming

__all__ = ["NAMING_RUNS", "default_run_name", "ensure_experiment_kind", "experiment_id", "study_run_name",
           "unique_run_name"]

log = logging.getLogger(__name__)

#: Most runs of the experiment read to order a new run's name parts (newest first).
NAMING_RUNS = 200


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
    """Tag an experiment for MLflow 3's training-runs page unless it already has a kind."""
    try:
        exp = client.get_experiment(experiment_id)
        if names.EXPERIMENT_KIND_TAG not in (exp.tags or {}):
            client.set_experiment_tag(experiment_id, names.EXPERIMENT_KIND_TAG, names.EXPERIMENT_KIND_VALUE)
    except Exception:  # noqa: BLE001 - cosmetic; never fatal
        log.debug("could not tag experiment %s", experiment_id, exc_info=True)


def default_run_name(model: str, accel_short: str, count: int, strategy: str, precision: str, *,
                     seq_len: int | str | None = None, global_batch_tokens: int | str | None = None) -> str:
    """``<model>-<accelerator short>-<count>x-<strategy>-<precision>[-s<seq_len>][-gbt<global batch tokens>]``,
    e.g. ``llama-7b-h100-8x-fsdp-bf16-s4096-gbt4194304``.

    The model part is the last path component for local directories and hub ids. Sequence length and
    global batch tokens, where known, tell apart runs that differ only in batch shape;
    :func:`unique_run_name` adds a counter when names are still equal.
    """
    base = model.rstrip("/").split("/")[-1]
    name = f"{base}-{accel_short.lower()}-{count}x-{strategy}-{precision}"
    if seq_len not in (None, ""):
        name += f"-s{seq_len}"
    if global_batch_tokens not in (None, ""):
        name += f"-gbt{global_batch_tokens}"
    return name


def study_run_name(client, experiment_id: str, parts: dict, exclude_run_id: str | None = None) -> str:
    """The name of a new run with name parts ``parts`` (:func:`mlflow_llmeff.tracking.naming.parts_from_tags`)
    among the experiment's runs: the parts that vary most among them first (:func:`naming.study_name`).
    Without the other runs (a store that fails) the parts keep their fixed order. Never raises."""
    try:
        others = [naming.parts_from_tags(r.data.tags, r.data.params.get("eval_tasks"))
                  for r in client.search_runs([experiment_id], "", max_results=NAMING_RUNS,
                                              order_by=["attributes.start_time DESC"])
                  if r.info.run_id != exclude_run_id and names.COMPARE_RUN_IDS not in r.data.tags]
    except Exception:  # noqa: BLE001 - a name is cosmetic: never fail a run for it
        others = []
    return naming.study_name(parts, [o for o in others if o])


def unique_run_name(client, experiment_id: str, name: str, exclude_run_id: str | None = None,
                    parts: dict | None = None) -> str:
    """``name``, or ``name-2``, ``name-3``, ... when runs of the experiment already have it (never raises).

    Args:
        client: ``MlflowClient``.
        experiment_id: the experiment the run is in.
        name: the wanted name (used when ``parts`` is None).
        exclude_run_id: a run whose own name does not count (the launcher's run being renamed).
        parts: name parts: the name is then :func:`study_run_name` among the experiment's runs.
    """
    if parts:
        name = study_run_name(client, experiment_id, parts, exclude_run_id)
    try:
        quoted = name.replace("'", "")
        taken = {r.info.run_name for r in client.search_runs(
            [experiment_id], f"attributes.run_name LIKE '{quoted}%'", max_results=1000)
            if r.info.run_id != exclude_run_id}
    except Exception:  # noqa: BLE001 - a name is cosmetic: never fail a run for it
        return name
    if name not in taken:
        return name
    n = 2
    while f"{name}-{n}" in taken:
        n += 1
    return f"{name}-{n}"
