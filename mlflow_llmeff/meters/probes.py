"""Probes of the running process: software versions, git commit, parameter counts, memory.

Shared by the training entrypoint and :class:`~mlflow_llmeff.monitor.meter.EfficiencyMonitor`; torch is
imported inside the functions.
"""

from __future__ import annotations

import os

from mlflow_llmeff import names


#: ``llmeff.version.*`` tag -> (module, the distributions that install it).
_VERSIONED = ((names.V_TORCH, "torch", ("torch",)), (names.V_TRANSFORMERS, "transformers", ("transformers",)),
              (names.V_ACCELERATE, "accelerate", ("accelerate",)), (names.V_MLFLOW, "mlflow", ("mlflow", "mlflow-skinny")))


def software_versions() -> dict[str, str]:
    """``llmeff.version.*`` tags: mlflow_llmeff, Python, torch, transformers, accelerate, mlflow.

    A module's ``__version__`` when it is imported already, else its installed distribution's version
    (``importlib.metadata``: nothing is imported to read it; a reader of the process never imports
    mlflow), else ``unknown``."""
    import importlib.metadata
    import platform
    import sys

    from mlflow_llmeff import __version__

    out = {names.V_LLMEFF: __version__, names.V_PYTHON: platform.python_version()}
    for tag, module, dists in _VERSIONED:
        loaded = getattr(sys.modules.get(module), "__version__", None)
        out[tag] = str(loaded) if loaded else "unknown"
        for dist in dists if not loaded else ():
            try:
                out[tag] = importlib.metadata.version(dist)
                break
            except importlib.metadata.PackageNotFoundError:
                continue
    return out


def git_commit(directory: str) -> str:
    """Git commit of the checkout holding ``directory``, or ``unknown: <why>``."""
    import subprocess

    here = directory
    try:
        r = subprocess.run(["git", "-C", here, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5)
        return r.stdout.strip() if r.returncode == 0 and r.stdout.strip() else "unknown: not a git checkout"
    except Exception:  # noqa: BLE001
        return "unknown: git not available"


def param_counts(model) -> tuple[int, int]:
    """(total, non-embedding) parameters of the built model; tied weights counted once."""
    total = sum(p.numel() for p in model.parameters())
    emb = model.get_input_embeddings().weight.numel()
    wpe = getattr(getattr(model, "transformer", None), "wpe", None)  # GPT-2 learned positions
    if wpe is not None:
        emb += wpe.weight.numel()
    return total, total - emb


def model_state_bytes(model, optimizer) -> tuple[int, int]:
    """(bytes of weights + gradients + optimizer state held by this device, the model's parameters).

    The bytes are this device's own: a ``DTensor`` parameter (FSDP2, tensor parallelism) counts its
    local shard, a DeepSpeed ZeRO-3 parameter its partition, DeepSpeed's fp32 master partitions
    count as optimizer state and its gradient partitions as gradients. Gradients count at their
    size during the step even where they are freed between steps. The parameters are the whole
    model's (global shapes), so the ratio shows the sharding: 16 bytes per parameter for fp32 AdamW
    replicated, 16 / n fully sharded over n ranks.
    """
    import torch

    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t

    inner_opt = getattr(optimizer, "optimizer", optimizer)
    if hasattr(inner_opt, "optimizer") and _is_deepspeed_zero(inner_opt):
        return _deepspeed_state_bytes(model, inner_opt)
    nbytes, nparams = 0, 0
    for p in model.parameters():
        lp = local(p)
        nparams += p.numel()
        nbytes += tensor_bytes(lp)
        if p.requires_grad:  # gradients live through every step (freed only between steps)
            g = local(p.grad) if p.grad is not None else lp
            nbytes += tensor_bytes(g)
    for st in inner_opt.state.values():
        for v in st.values():
            if torch.is_tensor(v) and v.dim() > 0:
                nbytes += tensor_bytes(local(v))
    return nbytes, nparams


def _is_deepspeed_zero(opt) -> bool:
    return type(opt).__name__ in ("DeepSpeedZeroOptimizer", "DeepSpeedZeroOptimizer_Stage3")


def tensor_bytes(x) -> int:
    """Bytes of a tensor, or of the tensors in a (nested) list or tuple; 0 for anything else."""
    import torch

    if torch.is_tensor(x):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(tensor_bytes(y) for y in x)
    return 0


def _deepspeed_state_bytes(model, zero) -> tuple[int, int]:
    """:func:`model_state_bytes` of a DeepSpeed ZeRO run (DeepSpeed 0.19's optimizer attributes), the
    most held at one moment of a step (``planning/plan.py`` ``model_state_bytes`` predicts the same).

    Weights: the module's parameters (ZeRO-3: each one's ``ds_tensor`` partition). Optimizer: the
    torch optimizer's state on the flat partitions plus the fp32 master partitions
    (``single_partition_of_fp32_groups``, ZeRO-3 ``fp32_partitioned_groups_flat``). Gradients:
    ZeRO-1 keeps whole gradients (reduced at the step), ZeRO-2 and 3 a partition of the master
    partition's size in the weights' dtype; in 16-bit runs the step adds the fp32 copy of that
    partition (``stage_1_and_2.py`` ``single_grad_partition = flat_grad_partition.to(fp32)``).
    ZeRO-3 holds two states in turn (``stage3.py`` ``step``): in forward and backward the parameters
    of at most ``stage3_param_persistence_threshold`` elements (``ds_persist``) are whole on every rank
    besides their partitions (counted whole even where ``empty_partition_cache`` released them since),
    with any other parameter still gathered; at the step those are partitioned and the step holds an
    fp32 copy of the gradient partition (``_prepare_fp32_grad_for_sub_group``: ``flatten`` copies, in
    fp32 too). The larger of the two is returned.
    """
    import torch

    params = list(model.parameters())
    stage3 = type(zero).__name__.endswith("Stage3")
    nparams = sum(int(getattr(p, "ds_numel", 0)) or p.numel() for p in params)
    master = zero.fp32_partitioned_groups_flat if stage3 else zero.single_partition_of_fp32_groups
    master_bytes, master_numel = tensor_bytes(master), sum(t.numel() for t in master)
    moments = sum(tensor_bytes(v) for st in zero.optimizer.state.values() for v in st.values()
                  if torch.is_tensor(v) and v.dim() > 0)
    elem = params[0].element_size() if params else 4
    master_elem = master[0].element_size() if len(master) else 4
    if not stage3:
        stage = int(getattr(zero, "partition_gradients", False)) + 1
        grads = sum(p.numel() for p in params) * elem if stage == 1 else master_numel * elem
        step_copy = master_numel * master_elem if elem != master_elem else 0  # fp32 runs step on the partition
        return sum(tensor_bytes(p.data) for p in params) + grads + step_copy + master_bytes + moments, nparams
    partitions = sum(tensor_bytes(p.ds_tensor) if hasattr(p, "ds_tensor") else tensor_bytes(p.data) for p in params)
    whole = 0
    for p in params:
        if not hasattr(p, "ds_tensor"):
            continue
        if getattr(p, "ds_persist", False):
            # on one rank the partition is the whole tensor (DeepSpeed gathers into its storage)
            whole += p.ds_numel * elem if p.ds_tensor.numel() < p.ds_numel else 0
        else:
            whole += tensor_bytes(p.data)  # still gathered when read (normally released: empty)
    buffer = getattr(zero, "grad_partitions_flat_buffer", None)
    grads = tensor_bytes(buffer) if torch.is_tensor(buffer) else master_numel * elem
    forward = partitions + whole + grads + master_bytes + moments
    step = partitions + grads + master_numel * master_elem + master_bytes + moments
    return max(forward, step), nparams


def peak_memory_gib(device) -> tuple[float, float, str]:
    """(max allocated, max reserved) GiB of this process's device, and the source."""
    import torch

    if device.type == "cuda":
        return (torch.cuda.max_memory_allocated(device) / 2**30, torch.cuda.max_memory_reserved(device) / 2**30,
                "torch.cuda.max_memory_allocated / max_memory_reserved")
    import resource

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB
    return rss, rss, "cpu: peak process RSS (getrusage ru_maxrss) for both allocated and reserved; no allocator statistics on CPU"


def process_age_s() -> float | None:
    """Seconds since this process started, or None where ``/proc`` cannot tell.

    Read as ``CLOCK_BOOTTIME`` now less the process's ``starttime`` (``/proc/self/stat`` field 22,
    clock ticks since boot; proc(5)): both on the kernel's boot clock, so the age is exact to one
    tick (10 ms at ``SC_CLK_TCK`` = 100; truncated, never later than the true start) and no step of
    the wall clock enters it. psutil's ``create_time()`` adds that age to ``/proc/stat``'s ``btime``,
    whole seconds, so its start can be up to 1 s early in Unix time: a restart's down time read
    against it came out 0.5 s short of the gap a test measured (CI, 3.0 s gap, 2.51 s reported).
    """
    import time

    try:
        with open("/proc/self/stat") as f:
            stat = f.read()
        ticks = int(stat.rsplit(")", 1)[1].split()[19])  # field 22; the name in (...) may hold spaces
        return max(0.0, time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError, AttributeError):  # no /proc, or no CLOCK_BOOTTIME
        return None


def process_start_unix() -> float:
    """Unix time (s) this process started: now less :func:`process_age_s`; psutil's ``create_time()``
    where ``/proc`` cannot tell (whole-second ``btime``, up to 1 s early); else now."""
    import time

    age = process_age_s()
    if age is not None:
        return time.time() - age
    try:
        import psutil

        return float(psutil.Process().create_time())
    except Exception:  # noqa: BLE001 - no psutil either: the attempt starts now
        return time.time()


def process_start_perf_counter() -> float:
    """``time.perf_counter()`` value of this process's start (:func:`process_start_unix`).

    The wall time of ``llmeff train`` starts here: imports and set-up are ``init``.
    """
    import time

    now_perf, now_unix = time.perf_counter(), time.time()
    return now_perf - max(0.0, now_unix - process_start_unix())
