"""What a new run is called: the default name of a configuration, a name unique in its experiment
(the experiment of a new run and its kind tag are written by the outbox's records, :mod:`mlflow_llmeff.tracking.outbox`).

Shared by the outbox (:mod:`mlflow_llmeff.tracking.outbox`, which creates and attaches runs when
the server answers), the run choice (:mod:`mlflow_llmeff.tracking.runs`) and the logger, so it
imports none of them: only the pure name calculator (:mod:`mlflow_llmeff.tracking.naming`)
and the paged search (:mod:`mlflow_llmeff.tracking.search`).
"""

from __future__ import annotations

from mlflow_llmeff.tracking import naming

__all__ = ["default_run_name", "unique_run_name"]

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


def unique_run_name(client, experiment_id: str, name: str, exclude_run_id: str | None = None,
                    parts: dict | None = None) -> str:
    """``name``, or ``name-2``, ``name-3``, ... when runs of the experiment already have it (never raises).

    Args:
        client: ``MlflowClient``.
        experiment_id: the experiment the run is in.
        name: the wanted name (used when ``parts`` is None).
        exclude_run_id: a run whose own name does not count (the launcher's run being renamed).
        parts: name parts (:func:`mlflow_llmeff.tracking.naming.parts_from_tags`): the name is then
            their fixed-order stem (:func:`mlflow_llmeff.tracking.naming.study_name`), the same for
            every repeat of the configuration in every experiment.
    """
    if parts:
        name = naming.study_name(parts) or name
    try:
        from mlflow_llmeff.tracking.search import all_runs

        quoted = name.replace("'", "")
        # every match, however many (one page is the newest 1,000: an older run's name would be given again)
        taken = {r.info.run_name for r in all_runs(client, [experiment_id], f"attributes.run_name LIKE '{quoted}%'")
                 if r.info.run_id != exclude_run_id}
    except Exception:  # noqa: BLE001 - a name is cosmetic: never fail a run for it
        return name
    if name not in taken:
        return name
    n = 2
    while f"{name}-{n}" in taken:
        n += 1
    return f"{name}-{n}"
