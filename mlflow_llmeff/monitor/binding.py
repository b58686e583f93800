"""Run binding of a monitor (rank 0): opening or continuing the MLflow run, its logger, tags and params.

:func:`open_run` gives an :class:`~mlflow_llmeff.monitor.meter.EfficiencyMonitor` its run
(:func:`~mlflow_llmeff.tracking.runs.open_run`: the active run, ``MLFLOW_RUN_ID``, a run to
continue, else a new one named by :func:`~mlflow_llmeff.tracking.naming.study_name`) and its
:class:`~mlflow_llmeff.tracking.logger.RunLogger`, tags the run's conditions
(:func:`condition_tags`), and on a resumed attempt accounts what the crashed attempt did after its
checkpoint (:func:`account_crashed_tail`, from the server's last points or the heartbeat file,
:func:`write_heartbeat`); the run's name follows the first step's batch shape (:func:`tag_shape`,
:func:`varying_shape`). These functions work on the monitor's components
(:class:`~mlflow_llmeff.monitor.parts.Parts`, ``p``; the name and the caller's tags are its
:class:`~mlflow_llmeff.monitor.conditions.RunNaming`): they are the part of the monitor that talks to
MLflow about the run itself, kept out of the step's story.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from typing import Callable

from mlflow_llmeff import names
from mlflow_llmeff.monitor import assembly
from mlflow_llmeff.monitor import conditions as cond
from mlflow_llmeff.monitor.parts import Parts
from mlflow_llmeff.monitor.precision import fp8_layers
from mlflow_llmeff.tracking import runs
from mlflow_llmeff.tracking.logger import RunLogger
from mlflow_llmeff.tracking.naming import parts_from_tags, study_name

__all__ = ["open_run", "continue_job", "continue_consumption", "account_crashed_tail", "name_adopted_run",
           "rename_when_shaped", "close_run", "note_shape", "condition_tags", "model_name", "name_parts", "write_heartbeat",
           "read_heartbeat", "tag_shape", "fp8_after_first_step", "varying_shape", "HEARTBEAT_KEYS"]

log = logging.getLogger(__name__)

#: Strategy name prefixes whose data-parallel ranks shard model state (FSDP; every ZeRO stage shards at
#: least the optimizer state), as parallel/ gives their degrees and a user's loop names them.
_SHARDED_STRATEGIES = ("fsdp", "deepspeed", "zero")
#: Running totals the heartbeat file keeps (a resumed attempt continues its energy from them).
HEARTBEAT_KEYS = (names.ENERGY_TOTAL_KWH, names.ENERGY_ESTIMATE_CPU_KWH, names.ENERGY_ESTIMATE_RAM_KWH)


def open_run(p: Parts, run_id, run_name, experiment_name, extra_tags, params, resume_state) -> None:
    """Rank 0: open or continue the MLflow run, tag the conditions, account a crashed attempt's tail.

    Sets ``p.run`` and ``p.logger``, and tells ``p.naming`` the name's parts, the caller's tags and
    when the run was created (seconds from the attempt's start; None for a run an earlier attempt created).
    """
    from mlflow_llmeff.tracking import store

    client = store.client()
    parts = name_parts(p, extra_tags, params.get("eval_tasks"))
    name = run_name or study_name(parts)  # the fixed order; a suffix when the experiment has the name
    p.run = runs.open_run(client, run_id=run_id, run_name=name, experiment_name=experiment_name,
                          unique_name=run_name is None, outbox_dir=p.outbox_dir,
                          name_parts=parts if run_name is None else None)
    h = p.run
    named_here = h.owned and (not h.resumed or h.fresh_since_unix is not None
                              or any("create" in r for r in h.pending))
    # the name's parts, for the first step to complete (its batch shape); None: not a name we gave
    naming = p.naming
    naming.named(parts if run_name is None and named_here else None)
    naming.given_by_caller(extra_tags, params.get("eval_tasks"))
    # seconds from this attempt's start to the run's creation (None: a run created by an earlier attempt)
    naming.created(None if p.run.resumed and p.run.fresh_since_unix is None else p.clock() - p.attempt_start)
    if p.run.fresh_since_unix is not None and not resume_state:  # mlflow run: the run's wall time
        p.ledger.start_earlier(p.clock() - max(0.0, time.time() - p.run.fresh_since_unix))
        naming.created(0.0)  # the launcher created it; the wall time starts there too
    p.logger = RunLogger(p.run.run_id, client, resume=p.run.resumed, outbox_dir=p.outbox_dir,
                         first=p.run.pending, unanswered=p.run.unanswered, local_id=p.run.local_id)
    if resume_state:
        account_crashed_tail(p, resume_state)
    changed = p.logger.log_params(params) if params else {}
    tags = {**condition_tags(p), **extra_tags, names.RESUME_ATTEMPTS: str(p.job.attempts)}
    if resume_state:
        tags[names.RESUMED_FROM] = str(p.meter.step)
    if changed:
        tags[names.RESUME_CHANGED] = ", ".join(f"{k}: {a} -> {b} (not re-logged)" for k, (a, b) in changed.items())
    p.logger.set_tags(tags)


def _newest_totals(p: Parts) -> tuple[dict[str, float], float | None, dict | None]:
    """The run's newest logged running totals (server or heartbeat, whichever is newer), that point's
    Unix time, and the heartbeat."""
    last = {}
    for key in HEARTBEAT_KEYS:
        point = p.logger.last_point(key)
        if point is not None:
            last[key] = float(point[1])
    newest = p.logger.last_timestamp_s
    beat = read_heartbeat(p)
    if beat is not None and float(beat["unix"]) > (newest or 0.0):  # newer than what reached the server
        newest = float(beat["unix"])
        last.update({k: float(v) for k, v in beat.get("totals", {}).items()})
    return last, newest, beat


def continue_consumption(p: Parts) -> None:
    """An earlier attempt of the run wrote no checkpoint: energy and estimate continue from its newest totals."""
    last, _, _ = _newest_totals(p)
    p.consumption.resume({}, last)


def continue_job(p: Parts, down_s: float, earlier_s: dict[str, float], tail_end_unix: float | None,
                 earlier_device_s: dict[str, float]) -> None:
    """The job's earlier attempts that no checkpoint holds (arguments as
    :meth:`~mlflow_llmeff.monitor.meter.EfficiencyMonitor.continue_job` documents them): their seconds
    by category into the clock and the consumption, the resumed writer's lost tail moved to its last
    completed step, and, with no checkpoint resumed, energy continued from the run's newest totals."""
    job = p.job
    job.set_down(down_s)
    for category, seconds in earlier_s.items():
        p.ledger.add(category, seconds)
        p.consumption.add_earlier(seconds, device_s=earlier_device_s.get(category, seconds * p.world_size),
                                  init_s=seconds if category == "init" else 0.0,
                                  init_device_s=earlier_device_s.get(category) if category == "init" else 0.0)
    more = job.move_tail_end(tail_end_unix)
    if more is not None:
        p.ledger.add("lost_progress", more)
        p.consumption.add_earlier(more, job.tail_devices)
    elif earlier_s and job.tail_lost is None and p.is_main and p.run is not None:
        continue_consumption(p)


def account_crashed_tail(p: Parts, state: dict) -> None:
    """The crashed attempt ran on after its checkpoint until its last logged point: lost progress,
    and its energy and estimate continue from that point's totals."""
    last, newest, beat = _newest_totals(p)
    saved = state.get("saved_at_unix")
    # the server did not answer: the steps the crashed attempt logged (at least the checkpoint's) are
    # not logged again, so a replayed step never has two points
    p.logger.assume_logged_through(max(int(state.get("step", 0)), int(beat["step"]) if beat else 0))
    p.consumption.resume(state.get("consumption", {}), last)
    if newest is not None and saved is not None:
        lost = max(0.0, float(newest) - float(saved))
        p.ledger.add("lost_progress", lost)
        p.consumption.add_earlier(lost, p.job.tail_devices)  # the checkpoint's writer ran it on its devices
        p.job.lose_tail(lost, float(saved))  # continue_job may move its end to the last completed step


def name_parts(p: Parts, extra_tags: dict | None = None, eval_tasks: str | None = None,
               shape: dict | None = None) -> dict[str, str]:
    """The run name's parts (:func:`~mlflow_llmeff.tracking.naming.parts_from_tags`) of the monitored
    run: its condition tags, the model's name, the first step's batch shape tags (``shape``, once
    known) and the caller's tags (``extra_tags``: ``llmeff train`` gives its model, batch and sequence
    length; they win), with ``eval_tasks``. One function for every path (``llmeff train``,
    ``autolog()``, the HF Trainer with or without ``report_to``), so one configuration has one stem."""
    return parts_from_tags({**condition_tags(p), names.MODEL_NAME: model_name(p), **(shape or {}),
                            **(extra_tags or {})}, eval_tasks)


def name_adopted_run(p: Parts, experiment_id: str, set_tags: Callable[[dict[str, str]], None]) -> str:
    """Name the run the monitor logs into but did not create (the HF Trainer's own MLflow callback run,
    which MLflow named at random) as the meter names its own runs: :func:`name_parts`, unique in
    ``experiment_id``, set with ``set_tags`` (the monitor's); the first step then adds the batch
    shape's parts (:func:`rename_when_shaped`). Returns the name set ('' for a run with no part: it
    keeps its name).

    Raises:
        mlflow.exceptions.MlflowException: what MLflow raises.
    """
    from mlflow_llmeff.tracking import store

    parts = name_parts(p, p.naming.given, p.naming.eval_tasks)
    name = runs.unique_run_name(store.client(), experiment_id, "", exclude_run_id=p.logger.run_id, parts=parts)
    if name:
        set_tags({"mlflow.runName": name})
        p.naming.named(parts)
    return name


def rename_when_shaped(p: Parts, shape: dict[str, str]) -> None:
    """A run this meter named before its first step (``p.naming.parts``) is named again with the
    batch shape's parts (global batch, sequence length) once that step told them, so its name is
    the one ``llmeff train`` gives the same configuration, and again without them when the shape
    varies (:func:`varying_shape`); the uniqueness search runs on the logger's delivery thread
    (the step never waits)."""
    naming = p.naming
    before = naming.parts
    if before is None:
        return
    after = name_parts(p, naming.given, naming.eval_tasks, shape)
    naming.named(after)
    if study_name(after) != study_name(before):
        p.logger.rename(after)


def model_name(p: Parts) -> str:
    """The ``llmeff.model.name`` of the monitored model (:func:`~mlflow_llmeff.monitor.conditions.model_name`)."""
    return cond.model_name(p.model, p.account.config)


def condition_tags(p: Parts) -> dict[str, str]:
    """The run's condition tags: hardware, strategy, precision, model, FLOPs and peak provenance,
    the data-parallel degrees of a user's loop, and why communication is not measured here."""
    a = p.account
    tags = cond.condition_tags(
        accelerator=p.accelerator, world=p.world_size, strategy=p.strategy, precision=p.precision,
        model=p.model, config=a.config, flops_note=a.fpt_note, peak_tflops=a.peak_tflops,
        peak_source=a.peak_source, measured_peak_note=a.measured_peak_note,
        warmup_steps=p.warmup_steps, energy_source=p.energy.source, energy_why=p.energy.why,
        integration=p.integration, compiled=p.compiled,
        activation_checkpointing=p.activation_checkpointing, cost_tags=p.cost_tags,
        flops_method=a.flops_method, optimizer=p.optimizer,
        optimizer_origin=p.memory.origin if p.memory is not None else None)
    dp = p.world_size // (p.counting.copies * p.counting.slices)
    if p.counting.slices > 1:
        tags[names.PAR_CP] = str(p.counting.slices)
    if a.peak_tflops is not None:
        tags[names.PEAK_PRECISION] = a.peak_precision
    # a loop the meter does not run: llmeff train and transformers' Trainer say how they weigh their loss instead
    tags[names.LOSS_WEIGHTING] = ("unknown: the user's loop computes its own loss (a token-weighted one divides the "
                                  "summed loss by the step's loss-bearing tokens; docs/formulas.md)")
    if a.trainable_note:  # frozen weights or adapters: what the FLOPs per token count (docs/formulas.md)
        tags[names.FLOPS_TRAINABLE] = a.trainable_note
    tags[names.PRECISION_SOURCE] = p.precision_source
    if a.measured_peak_at:
        tags[names.PEAK_MEASURED_AT] = a.measured_peak_at
    tags.update(assembly.assumed_tag(p.assumptions()))  # end_tags completes it (PUE once the grid intensity is known)
    # a user's loop: its data-parallel ranks hold sharded state under FSDP and ZeRO-3 (llmeff train
    # passes its layout's own degrees as tags, which win)
    shard = dp if str(p.strategy or "").startswith(_SHARDED_STRATEGIES) else 1
    tags.update({names.PAR_DP: str(dp), names.PAR_DP_SHARD: str(shard), names.PAR_DP_REPLICATE: str(dp // shard)})
    # communication is measured by llmeff train (docs/parallelism.md), which sets these again
    why = "none: measured by llmeff train only (a collective probe at its start, sampled warm-up steps)"
    tags.update({names.COMM_PROBE: why, names.COMM_SAMPLED: why})
    return tags


def close_run(p: Parts, status: str, report: bool) -> None:
    """Rank 0: deliver the points, the report (``report``: ``efficiency_report.json`` and figures, built
    once every point before it is delivered) and, for a run the monitor owns, its end with ``status``,
    waiting at most the delivery wait without an answer (after a signal the outbox is written first);
    what is left waits in the outbox. The run is no longer MLflow's active run either way.

    Raises:
        Exception: what the logger raises (the run is released all the same).
    """
    try:
        if report:
            p.logger.queue_report()  # delivered by llmeff sync when the server does not answer
        p.logger.close(status if p.run.owned else None, urgent=status == "KILLED")
    finally:
        runs.release(p.run)  # its end is delivered or in the outbox


def note_shape(p: Parts) -> None:
    """Inside a step (the tags never wait): the first step tags its batch shape (:func:`tag_shape`); the
    first step whose batch shape differs from the first one's tags it ``dynamic`` (:func:`varying_shape`;
    the end of the run tags the final range)."""
    naming = p.naming
    if naming.shape_pending:
        tag_shape(p)
    if not naming.shape_varied and p.tally.varies:
        naming.shape_varies()
        tags = varying_shape(p, p.tally.shapes)
        if tags:
            p.logger.set_tags(tags, synchronous=False)


def _first_shape_tags(p: Parts) -> dict[str, str]:
    """The shape tags of the first step's first micro-batch (:func:`~mlflow_llmeff.monitor.conditions.shape_tags`)."""
    b, s, ga = p.tally.first_shape
    rule = p.counting
    # a context-parallel rank saw a slice: the sequence is cp slices long
    return cond.shape_tags(b, s * rule.slices, max(1, ga), p.world_size // (rule.copies * rule.slices))


def tag_shape(p: Parts) -> None:
    """Tag the batch shape of the first step (batch size, sequence length, accumulation, global batch),
    once, leaving out the tags the caller gave; inside the first step, so the tags do not wait."""
    p.naming.shape_tagged()
    late = fp8_after_first_step(p)
    if late and p.is_main:
        p.logger.set_tags(late, synchronous=False)
    if p.tally.first_shape is not None and p.is_main:
        shape = _first_shape_tags(p)
        given = p.naming.given_keys
        tags = {k: v for k, v in shape.items() if k not in given}
        if tags:
            p.logger.set_tags(tags, synchronous=False)  # inside the first step: no wait
        rename_when_shaped(p, shape)


def fp8_after_first_step(p: Parts) -> dict[str, str]:
    """After the first step, FP8 layers that could not tell before their first forward (TransformerEngine
    under ``fp8_autocast``: :mod:`mlflow_llmeff.monitor.precision`): the run's precision becomes ``fp8``,
    MFU's denominator the FP8 peak (the warm-up step logged no MFU yet), and the returned tags say so
    ({} when nothing changed). The measured matmul peak stays the one of set-up (``llmeff.peak.measured_at``
    names its dtype). On every rank; the caller tags on rank 0."""
    if p.precision == "fp8" or p.model is None:
        return {}
    found = fp8_layers(p.model)
    if found is None:
        return {}
    p.precision, p.precision_source = "fp8", found.source()
    p.assumed.pop("precision", None)
    a = p.account
    a.resolve_peak(p.accelerator, "fp8", p.user_peak_tflops)
    tags = {names.PRECISION: "fp8", names.PRECISION_SOURCE: p.precision_source,
            names.PEAK_TFLOPS: f"{a.peak_tflops:g}" if a.peak_tflops else "unknown", names.PEAK_SOURCE: a.peak_source}
    if a.peak_tflops is not None:
        tags[names.PEAK_PRECISION] = a.peak_precision
    given = p.naming.given_keys
    return {k: v for k, v in tags.items() if k not in given or k == names.PRECISION_SOURCE}


def varying_shape(p: Parts, shapes) -> dict[str, str]:
    """The tags of a batch shape that varied between micro-batches (dynamic padding, packing):
    ``llmeff.seq_len`` / ``micro_batch_size`` / ``global_batch_tokens`` = ``dynamic`` and the ranges
    seen (:func:`~mlflow_llmeff.monitor.conditions.varying_shape_tags`), leaving out the tags the
    caller gave. A run this meter named (:func:`rename_when_shaped`) is named again without the
    parts that are no condition of it (``gbt``, and ``s`` when the length varied): two runs of one
    dynamic-padding script get one stem whatever their first batch was. The rename waits on the
    logger's delivery thread; the caller sets the returned tags ({} on other ranks or when nothing
    varied).

    Args:
        shapes: the :class:`~mlflow_llmeff.monitor.counting.ShapeRange` counted so far (this rank's
            inside a step, every rank's at the end), or None.
    """
    if shapes is None or not shapes.varies or not p.is_main or p.tally.first_shape is None:
        return {}
    slices = p.counting.slices
    dynamic = cond.varying_shape_tags(dataclasses.replace(shapes, seq=(shapes.seq[0] * slices, shapes.seq[1] * slices)))
    given = p.naming.given_keys
    ranges = {names.SEQ_LEN: names.SEQ_LEN_RANGE, names.MICRO_BATCH_SIZE: names.MICRO_BATCH_SIZE_RANGE}
    # a range explains a 'dynamic' value: none beside a length or size the caller gave
    dropped = given | {ranges[k] for k in ranges if k in given}
    rename_when_shaped(p, {**_first_shape_tags(p), **dynamic})
    return {k: v for k, v in dynamic.items() if k not in dropped}


def write_heartbeat(path: str, run_id: str | None, step: int, m: dict[str, float], unix: float | None = None) -> None:
    """Rewrite the heartbeat file ``path`` with the step, the time (``unix``, Unix seconds the step was
    logged at; default now) and the running totals of ``m`` (temp file + rename: a reader never sees half
    of it; a full disk is logged, never raised)."""
    beat = {"run_id": run_id, "step": step, "unix": time.time() if unix is None else unix,
            "totals": {k: m[k] for k in HEARTBEAT_KEYS if k in m}}
    tmp = f"{path}.tmp"
    try:
        os.makedirs(os.path.dirname(tmp) or ".", exist_ok=True)
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(beat, f)
        os.replace(tmp, path)
    except OSError as e:  # a full disk must not stop training
        log.debug("heartbeat not written: %s", e)


def read_heartbeat(p: Parts) -> dict | None:
    """The monitor's heartbeat file when it belongs to its run (its id or local id), else None."""
    try:
        with open(p.heartbeat_path or "", encoding="utf-8") as f:
            beat = json.load(f)
    except (OSError, ValueError):
        return None
    return beat if beat.get("run_id") in (p.logger.run_id, p.run.local_id if p.run else None) else None
