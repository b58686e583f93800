"""The conditions and name of a run that failed before it trained (``llmeff train`` under ``mlflow run``):
what is known of it from its options, resolved at most once (:mod:`mlflow_llmeff.planning.spec`)."""

from __future__ import annotations

__all__ = ["known_conditions", "failed_run_name", "failure_conditions"]


def known_conditions(params: dict, spec=None) -> dict[str, str]:
    """The condition tags known before anything is built (for a run that fails early).

    ``spec``: the run as resolved (:class:`~mlflow_llmeff.planning.spec.RunSpec`), when it got that
    far: its strategy, precision and global batch are read from it. Without one (the settings were
    refused before they could be resolved) they are resolved here from ``params``, the only
    resolution in this process, or stay unknown when they cannot be."""
    from mlflow_llmeff import names
    from mlflow_llmeff.meters.probes import software_versions

    tags = dict(software_versions())
    try:
        from mlflow_llmeff.meters.hardware import detect_accelerator

        tags.update(detect_accelerator(count=int(params.get("num_processes") or 1)).tags())
    except Exception:  # noqa: BLE001
        pass
    for key, name in ((names.MODEL_NAME, "model"), (names.PRECISION, "precision"),
                      (names.PAR_STRATEGY, "parallelism"), (names.SEQ_LEN, "seq_len"),
                      (names.MICRO_BATCH_SIZE, "micro_batch_size"), (names.GRAD_ACCUM, "grad_accum")):
        if params.get(name) not in (None, ""):
            tags[key] = str(params[name])
    try:  # what the run would have been tagged: strategy and precision resolved, the global batch
        if spec is None:
            import dataclasses

            from mlflow_llmeff.planning.spec import resolve
            from mlflow_llmeff.train.config import TrainConfig, probe_machine

            known = {f.name for f in dataclasses.fields(TrainConfig)}
            spec = resolve(TrainConfig(**{k: v for k, v in params.items() if k in known and v is not None}),
                           probe_machine())
        tags.update(spec.tags())
    except Exception:  # noqa: BLE001 - a configuration that does not resolve: those conditions stay unknown
        pass
    return tags


def failed_run_name(params: dict, spec=None) -> str:
    """The name of a run that failed before training: the user's ``run_name``, else the standard
    name's parts from the conditions known (fixed order: nothing more is read from the server)."""
    return failure_conditions(params, spec)[1]


def failure_conditions(params: dict, spec=None) -> tuple[dict[str, str], str]:
    """``(tags, name)`` of a run that failed before training: :func:`known_conditions` (resolved once at
    most) and the name made of them (:func:`failed_run_name`)."""
    from mlflow_llmeff.tracking.naming import parts_from_tags, study_name

    tags = known_conditions(params, spec)
    if params.get("run_name"):
        return tags, str(params["run_name"])
    return tags, study_name(parts_from_tags(tags, params.get("eval_tasks"))) or "failed-run"
