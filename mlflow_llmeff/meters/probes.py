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

    :func:`~mlflow_llmeff.meters.memory.state_split` counts the bytes as stored: a ``DTensor`` parameter
    (FSDP2, tensor parallelism) by its local shard, a tensor subclass (torchao's low-bit optimizer
    states) by its inner tensors, a storage shared by several tensors (tied weights, bitsandbytes'
    quantization maps) once; a DeepSpeed ZeRO-3 parameter by its partition, DeepSpeed's fp32 master
    partitions as optimizer state and its gradient partitions as gradients. Gradients count at their
    size during the step even where they are freed between steps. The 0-d step counters of the
    optimizer's states are left out (bytes per tensor, not per parameter; ``StateBytes.counters``). The
    parameters are the whole model's (global shapes), so the ratio shows the sharding: 16 bytes per
    parameter for fp32 AdamW replicated, 16 / n fully sharded over n ranks.
    """
    from mlflow_llmeff.meters.memory import state_split

    split = state_split(model, optimizer)
    return split.per_param_total, split.params


def tensor_bytes(x) -> int:
    """Bytes of a tensor, or of the tensors in a (nested) list or tuple; 0 for anything else."""
    import torch

    if torch.is_tensor(x):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(tensor_bytes(y) for y in x)
    return 0


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


def torch_source_constants(relpath: str) -> dict | None:
    """The top-level constants of the installed torch's source file ``relpath`` (e.g. ``version.py``,
    ``optim/__init__.py``), read without importing torch: ``name -> value`` for each ``name = <constant>``
    or ``name: T = <constant>``, and a list of constants (``__all__ = [...]``) as a tuple of them; None when
    torch or the file cannot be found or parsed. Read once a process per file (the installed torch does
    not change under a running process)."""
    if relpath not in _TORCH_SOURCE:
        _TORCH_SOURCE[relpath] = _read_torch_source(relpath)
    return _TORCH_SOURCE[relpath]


_TORCH_SOURCE: dict[str, dict | None] = {}


def _read_torch_source(relpath: str) -> dict | None:
    import ast
    import importlib.util

    try:
        spec = importlib.util.find_spec("torch")
        folders = list(spec.submodule_search_locations or []) if spec else []
        with open(os.path.join(folders[0], *relpath.split("/")), encoding="utf-8") as f:
            body = ast.parse(f.read()).body
    except Exception:  # noqa: BLE001 - no torch, no such file, or not Python we can parse
        return None
    facts = {}
    for node in body:
        target = node.target if isinstance(node, ast.AnnAssign) else (
            node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else None)
        if not isinstance(target, ast.Name):
            continue
        if isinstance(node.value, ast.Constant):
            facts[target.id] = node.value.value
        elif isinstance(node.value, (ast.List, ast.Tuple)) and all(isinstance(e, ast.Constant) for e in node.value.elts):
            facts[target.id] = tuple(e.value for e in node.value.elts)
    return facts


def torch_built_without_gpu() -> bool:
    """True when the installed torch is a build without CUDA and ROCm (its ``torch/version.py`` sets
    ``cuda`` and ``hip`` to None, e.g. ``2.13.0+cpu``), read from that generated file without importing
    torch (:func:`torch_source_constants`); False when torch is imported already (its answer, which a test
    may fake, is asked instead) or the file says otherwise or cannot be read. Such a build's
    ``torch.cuda.is_available()`` is False (``torch.cuda._is_compiled()`` is)."""
    import sys

    if "torch" in sys.modules:
        return False
    facts = torch_source_constants("version.py") or {}
    return "cuda" in facts and "hip" in facts and facts["cuda"] is None and facts["hip"] is None
