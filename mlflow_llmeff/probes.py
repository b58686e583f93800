"""Probes of the running process: software versions, git commit, parameter counts, memory.

Shared by the training entrypoint and :class:`~mlflow_llmeff.monitor.EfficiencyMonitor`; torch is
imported inside the functions.
"""

from __future__ import annotations

import os

from . import names


def software_versions() -> dict[str, str]:
    """``llmeff.version.*`` tags: mlflow_llmeff, Python, torch, transformers, accelerate, mlflow."""
    import platform

    from . import __version__

    out = {names.V_LLMEFF: __version__, names.V_PYTHON: platform.python_version()}
    for tag, mod in ((names.V_TORCH, "torch"), (names.V_TRANSFORMERS, "transformers"),
                     (names.V_ACCELERATE, "accelerate"), (names.V_MLFLOW, "mlflow")):
        try:
            out[tag] = __import__(mod).__version__
        except Exception:  # noqa: BLE001
            out[tag] = "unknown"
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
    """(bytes of weights + gradients + optimizer state, parameters) held by this device."""
    import torch

    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t

    nbytes, nparams = 0, 0
    for p in model.parameters():
        lp = local(p)
        nparams += lp.numel()
        nbytes += lp.numel() * lp.element_size()
        if p.requires_grad:  # gradients live through every step (freed only between steps)
            g = local(p.grad) if p.grad is not None else lp
            nbytes += g.numel() * g.element_size()
    opt = getattr(optimizer, "optimizer", optimizer)
    for st in opt.state.values():
        for v in st.values():
            if torch.is_tensor(v) and v.dim() > 0:
                lv = local(v)
                nbytes += lv.numel() * lv.element_size()
    return nbytes, nparams


def peak_memory_gib(device) -> tuple[float, float, str]:
    """(max allocated, max reserved) GiB of this process's device, and the source."""
    import torch

    if device.type == "cuda":
        return (torch.cuda.max_memory_allocated(device) / 2**30, torch.cuda.max_memory_reserved(device) / 2**30,
                "torch.cuda.max_memory_allocated / max_memory_reserved")
    import resource

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB
    return rss, rss, "cpu: peak process RSS (getrusage ru_maxrss) for both allocated and reserved; no allocator statistics on CPU"


def process_start_perf_counter() -> float:
    """``time.perf_counter()`` value of this process's start (psutil, else ``/proc``; else now).

    The wall time of ``llmeff train`` starts here: imports and set-up are ``init``.
    """
    import time

    now_perf, now_unix = time.perf_counter(), time.time()
    try:
        import psutil

        created = psutil.Process().create_time()
    except Exception:  # noqa: BLE001 - no psutil or no /proc: the attempt starts now
        return now_perf
    return now_perf - max(0.0, now_unix - created)
