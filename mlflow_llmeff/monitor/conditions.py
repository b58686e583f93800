"""The measurement conditions of a run as ``llmeff.*`` tags, and what is read off the model.

One place for every path (``llmeff train``, ``EfficiencyMonitor``, autolog): the accelerator, its
count and nodes, parallelism, precision, model shape, FLOPs convention, peaks and their sources,
warm-up, energy and cost sources, software versions, the code's commit and the scheduler's job
(``llmeff.scheduler.*``, :mod:`mlflow_llmeff.meters.scheduler`).
"""

from __future__ import annotations

import os
import sys

from mlflow_llmeff import names
from mlflow_llmeff.meters.memory import attention_tag, optimizer_tag, weights_tag

__all__ = ["unwrap_model", "infer_precision", "infer_strategy", "is_compiled", "uses_activation_checkpointing",
           "recompute_plan", "model_name", "condition_tags", "shape_tags", "varying_shape_tags", "FLOPS_FORMULA_NOTE",
           "WARMUP_NOTE", "RunNaming"]

FLOPS_FORMULA_NOTE = ("megatron: L*h^2*(12+12g/n+18f/h+6s/h)+6hV per token, causal attention counted once "
                      "(Megatron-LM num_floating_point_operations); palm beside it")
WARMUP_NOTE = ("first warmup_steps optimizer steps of every attempt (torch.compile, allocator and kernel warm-up, "
               "the FlopCounterMode step) excluded from throughput/* and steady-state summary/*; their excess over "
               "steady-state step time is summary/badput_warmup_s (badput_compile_s when compiling)")


def unwrap_model(model):
    """The user's module inside DDP / FSDP / Accelerate / ``torch.compile`` wrappers."""
    seen = 0
    while model is not None and seen < 8:
        inner = getattr(model, "_orig_mod", None) or getattr(model, "module", None)
        if inner is None or inner is model:
            break
        model, seen = inner, seen + 1
    return model


def is_compiled(model) -> bool:
    """True when ``torch.compile`` wraps the model at any depth of its wrappers."""
    m, depth = model, 0
    while m is not None and depth < 8:
        if getattr(m, "_orig_mod", None) is not None:
            return True
        m, depth = getattr(m, "module", None), depth + 1
    return False


def uses_activation_checkpointing(model) -> bool:
    """True for a Hugging Face model with activation (gradient) checkpointing on."""
    try:
        inner = unwrap_model(model)
        for attr in ("is_activation_checkpointing", "is_gradient_checkpointing"):  # transformers >= 5 renamed it
            if hasattr(type(inner), attr) or attr in getattr(inner, "__dict__", {}):
                return bool(getattr(inner, attr))
        return False
    except Exception:  # noqa: BLE001
        return False


def recompute_plan(model):
    """What the model's activation checkpointing re-executes, read off its layers; None when it has none.

    Hugging Face models checkpoint each decoder layer (``GradientCheckpointingLayer`` with
    ``gradient_checkpointing`` set; ``every_n_layers`` marks only some) through
    ``_gradient_checkpointing_func``, a ``functools.partial`` of ``torch.utils.checkpoint.checkpoint``
    whose keywords say reentrant or not (transformers 5 defaults to non-reentrant) and ``early_stop``
    (PyTorch's default: True). A model with checkpointing on but no such layers (a wrapper the
    plugin cannot see into) gets the transformers default: every layer, early stop.

    Returns:
        A :class:`~mlflow_llmeff.calc.flops.Recompute`, or None without activation checkpointing.
    """
    from mlflow_llmeff.calc.flops import Recompute

    if model is None or not uses_activation_checkpointing(model):
        return None
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer

        layers = [m for m in unwrap_model(model).modules() if isinstance(m, GradientCheckpointingLayer)]
    except Exception:  # noqa: BLE001 - transformers < 4.52 or not a transformers model
        layers = []
    marked = [i for i, m in enumerate(layers) if getattr(m, "gradient_checkpointing", False)]
    if not marked:
        return Recompute()
    kw = dict(getattr(getattr(layers[marked[0]], "_gradient_checkpointing_func", None), "keywords", None) or {})
    early = not kw.get("use_reentrant", False) and bool(kw.get("early_stop", True))
    return Recompute(layers=None if len(marked) == len(layers) else tuple(marked), early_stop=early)


def infer_precision(model) -> str:
    """``fp32`` / ``bf16`` / ``fp16`` from the dtype of the model's first floating parameter."""
    try:
        import torch

        for p in model.parameters():
            if p.is_floating_point():
                return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(p.dtype, "fp32")
    except Exception:  # noqa: BLE001
        pass
    return "fp32"


def infer_strategy(model, world: int) -> str:
    """``single``, ``ddp``, ``fsdp`` or ``deepspeed_zero<n>`` from the model's wrappers, Accelerate's
    environment and the world size: each strategy recognises itself (:func:`mlflow_llmeff.parallel.detect`)."""
    from mlflow_llmeff.parallel import detect

    return detect(model, world)


def model_name(model, config) -> str:
    """The config's ``name_or_path``, else its ``model_type``, else the module's class name."""
    for attr in ("name_or_path", "_name_or_path"):
        v = getattr(config, attr, None)
        if isinstance(v, str) and v:
            return v
    mt = getattr(config, "model_type", None)
    if isinstance(mt, str) and mt:
        return mt
    inner = unwrap_model(model)
    return type(inner).__name__.lower() if inner is not None else "model"


#: The commits :func:`script_git_commit` read, by directory: one ``git rev-parse`` a directory a process.
_COMMITS: dict[str, str] = {}


def script_git_commit() -> str:
    """Git commit of the directory holding the running script (``sys.argv[0]``), where known.

    Read once a directory a process (a ``git`` subprocess, 10-20 ms on a 2-core host): the commit of the
    code this process runs is the one it found first, and a meter's tags ask at set-up and again at the
    first step's renaming (``bench/overhead.py`` timed that second call inside the first step)."""
    from mlflow_llmeff.meters.probes import git_commit

    here = os.path.dirname(os.path.abspath(sys.argv[0])) if sys.argv and sys.argv[0] else os.getcwd()
    commit = _COMMITS.get(here)
    if commit is None:
        commit = _COMMITS[here] = git_commit(here)
    return commit


def nodes(world: int) -> int:
    """Machines taking part: ``LLMEFF_NUM_MACHINES`` (llmeff train), ``NUM_MACHINES`` / ``GROUP_WORLD_SIZE``
    when a launcher says, else world / local world."""
    for var in ("LLMEFF_NUM_MACHINES", "NUM_MACHINES", "GROUP_WORLD_SIZE"):
        v = os.environ.get(var, "")
        if v.isdigit() and int(v) > 0:
            return int(v)
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    local_n = int(local) if local.isdigit() and int(local) > 0 else world
    return max(1, world // local_n)


def model_tags(model, config) -> dict[str, str]:
    """``llmeff.model.*`` tags: name, parameters (total, non-embedding), layers, hidden size."""
    from mlflow_llmeff.meters.probes import param_counts

    tags = {names.MODEL_NAME: model_name(model, config)}
    inner = unwrap_model(model)
    if inner is not None:
        try:
            total, non_emb = param_counts(inner)
            tags[names.MODEL_PARAMS], tags[names.MODEL_NON_EMB_PARAMS] = str(total), str(non_emb)
        except Exception:  # noqa: BLE001 - not a Hugging Face model: total only
            tags[names.MODEL_PARAMS] = str(sum(p.numel() for p in inner.parameters()))
    if config is not None:
        tags[names.MODEL_LAYERS] = str(getattr(config, "num_hidden_layers", getattr(config, "n_layer", "unknown")))
        tags[names.MODEL_HIDDEN] = str(getattr(config, "hidden_size", getattr(config, "n_embd", "unknown")))
    return tags


def thread_tags() -> dict[str, str]:
    """``llmeff.threads`` and ``llmeff.cpu.affinity`` of this process (measurement conditions: a CPU run's
    speed per process moves with its threads; a DDP run on one host divides the cores among its processes)."""
    import torch

    out = {names.THREADS: f"intra-op {torch.get_num_threads()}, inter-op {torch.get_num_interop_threads()}"}
    try:
        out[names.CPU_AFFINITY] = f"{len(os.sched_getaffinity(0))} of {os.cpu_count()}"
    except (AttributeError, OSError):  # no sched_getaffinity (macOS)
        out[names.CPU_AFFINITY] = f"unknown of {os.cpu_count()}"
    return out


def condition_tags(*, accelerator, world: int, strategy: str, precision: str, model, config, flops_note: str,
                   peak_tflops: float | None, peak_source: str, measured_peak_note: str, warmup_steps: int,
                   energy_source: str, energy_why: str | None, integration: str, compiled: bool,
                   activation_checkpointing: bool, cost_tags: dict[str, str],
                   flops_method: str | None = None, optimizer=None,
                   optimizer_origin: str | None = None) -> dict[str, str]:
    """Every condition tag a meter knows at its start (see ``docs/metrics.md`` for each key).

    ``llmeff.attention`` and ``llmeff.weights`` are read off ``model``; ``llmeff.optimizer`` off
    ``optimizer`` where given (its states do not exist yet: ``states not yet allocated``, until the
    monitor's first logged point after they do, :class:`~mlflow_llmeff.monitor.memwatch.MemoryWatch`)."""
    from mlflow_llmeff.meters.probes import software_versions

    tags = {**accelerator.tags(), **software_versions()}
    tags.update({
        names.NODES: str(nodes(world)), names.PROCS_PER_NODE: str(max(1, world // nodes(world))),
        names.PAR_STRATEGY: strategy, names.PAR_DP: str(world),
        names.PAR_TP: "1", names.PAR_PP: "1", names.PAR_CP: "1", names.PRECISION: precision,
        names.FLOPS_FORMULA: flops_note,
        names.PEAK_TFLOPS: f"{peak_tflops:g}" if peak_tflops else "unknown", names.PEAK_SOURCE: peak_source,
        names.PEAK_MEASURED_TFLOPS: measured_peak_note,
        names.WARMUP_STEPS: str(warmup_steps), names.WARMUP_NOTE: WARMUP_NOTE,
        names.GIT_COMMIT: script_git_commit(),
        names.ENERGY_SOURCE: energy_source, names.ENERGY_WHY: energy_why or "measured",
        names.AUTOLOG_INTEGRATION: integration,
        names.COMPILE: str(bool(compiled)).lower(), names.ACT_CKPT: str(bool(activation_checkpointing)).lower(),
    })
    if flops_method is not None:
        tags[names.FLOPS_METHOD] = flops_method
    tags.update(model_tags(model, config))
    tags.update(thread_tags())
    if model is not None:  # the levers read off the built model (llmeff.optimizer needs states: later)
        try:
            tags.update({names.ATTENTION: attention_tag(unwrap_model(model)), names.WEIGHTS: weights_tag(model)})
        except Exception:  # noqa: BLE001 - a tag never stops the run
            pass
    if optimizer is not None:
        try:
            tags[names.OPTIMIZER] = optimizer_tag(optimizer, optimizer_origin)
        except Exception:  # noqa: BLE001
            pass
    tags.update(cost_tags)
    from mlflow_llmeff.meters import scheduler

    tags.update(scheduler.tags(scheduler.cached()))  # SLURM's or a PyTorchJob's job, node list, requeues, queue wait
    return tags


def shape_tags(micro_batch_size: int, seq_len: int, grad_accum: int, world: int) -> dict[str, str]:
    """``llmeff.seq_len``, ``micro_batch_size``, ``grad_accum`` and ``global_batch_tokens``
    (:func:`mlflow_llmeff.calc.throughput.global_batch_tokens`; ``world``: the data-parallel ranks)."""
    from mlflow_llmeff.calc.throughput import global_batch_tokens

    return {names.SEQ_LEN: str(seq_len), names.MICRO_BATCH_SIZE: str(micro_batch_size),
            names.GRAD_ACCUM: str(grad_accum),
            names.GLOBAL_BATCH_TOKENS: str(global_batch_tokens(seq_len, micro_batch_size, grad_accum, world))}


def varying_shape_tags(shapes) -> dict[str, str]:
    """The shape tags of a run whose padded length or micro-batch size varied between micro-batches:
    the varying ones and the global batch are ``dynamic`` (no condition of the run, and no part of
    its name) and the range seen is beside them.

    Args:
        shapes: a :class:`~mlflow_llmeff.monitor.counting.ShapeRange`; ``seq`` in positions (a
            context-parallel run: the full sequence), ``batch`` in rows per micro-batch.

    Returns:
        ``{}`` when neither varied.
    """
    tags: dict[str, str] = {}
    for varies, (lo, hi), key, range_key in (
            (shapes.seq_varies, shapes.seq, names.SEQ_LEN, names.SEQ_LEN_RANGE),
            (shapes.batch_varies, shapes.batch, names.MICRO_BATCH_SIZE, names.MICRO_BATCH_SIZE_RANGE)):
        if varies:
            tags.update({key: names.SHAPE_DYNAMIC, range_key: f"{lo}-{hi}"})
    if tags:
        tags[names.GLOBAL_BATCH_TOKENS] = names.SHAPE_DYNAMIC
    return tags


class RunNaming:
    """The run's name as the meter gave it, the tags its caller gave, and the batch-shape tags the
    name follows (:mod:`~mlflow_llmeff.monitor.binding`: the first step's shape completes the name).

    Attributes (read them; the methods change them):
        parts: the name's parts when the meter named the run (None: a name it did not give).
        given: the caller's tags the name was made from (they win over the meter's).
        given_keys: their keys.
        eval_tasks: the ``eval_tasks`` param the name was made with (None: none).
        created_after_s: seconds from the attempt's start to the run's creation (None: an earlier
            attempt's run).
        shape_pending: the first step's batch shape is still to be tagged.
        shape_varied: a micro-batch's shape differed from the first one's (tagged ``dynamic``).
    """

    __slots__ = ("parts", "given", "given_keys", "eval_tasks", "created_after_s", "shape_pending", "shape_varied")

    def __init__(self) -> None:
        self.parts: dict[str, str] | None = None
        self.given: dict[str, str] = {}
        self.given_keys: frozenset[str] = frozenset()
        self.eval_tasks: str | None = None
        self.created_after_s: float | None = None
        self.shape_pending, self.shape_varied = True, False

    def given_by_caller(self, tags: dict[str, str], eval_tasks: str | None) -> None:
        """The caller gave ``tags`` (a copy is kept) and the ``eval_tasks`` param."""
        self.given, self.given_keys, self.eval_tasks = dict(tags), frozenset(tags), eval_tasks

    def named(self, parts: dict[str, str] | None) -> None:
        """The meter named the run from ``parts`` (None: the name is not the meter's)."""
        self.parts = parts

    def created(self, after_s: float | None) -> None:
        """The run was created ``after_s`` seconds after the attempt started (None: by an earlier attempt)."""
        self.created_after_s = after_s

    def shape_tagged(self) -> None:
        """The first step's batch shape is tagged."""
        self.shape_pending = False

    def shape_varies(self) -> None:
        """A micro-batch's shape differed from the first one's (tagged once)."""
        self.shape_varied = True

