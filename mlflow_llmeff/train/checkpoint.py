"""Checkpoints: ``accelerate.save_state`` plus our counters, so a killed run resumes exactly.

Layout: ``<checkpoint_dir>/step_<NNNNNNNN>/`` holds Accelerate's state (model, optimizer, RNG,
registered scheduler) and ``llmeff_state.json`` (step, MLflow run id, token and time counters).
The JSON is written last and atomically, so a directory without it is an interrupted save and
is ignored.
"""

from __future__ import annotations

import json
import os
import re
import shutil

STATE_FILE = "llmeff_state.json"
_DIR_RE = re.compile(r"^step_(\d{8})$")


def step_dir(checkpoint_dir: str, step: int) -> str:
    """Directory of the checkpoint taken after optimizer step ``step``."""
    return os.path.join(checkpoint_dir, f"step_{step:08d}")


def complete_checkpoints(checkpoint_dir: str) -> list[tuple[int, str]]:
    """``[(step, path)]`` of complete checkpoints, oldest first (empty when the dir is absent)."""
    if not checkpoint_dir or not os.path.isdir(checkpoint_dir):
        return []
    out = []
    for name in os.listdir(checkpoint_dir):
        m = _DIR_RE.match(name)
        path = os.path.join(checkpoint_dir, name)
        if m and os.path.isfile(os.path.join(path, STATE_FILE)):
            out.append((int(m.group(1)), path))
    return sorted(out)


def latest(checkpoint_dir: str) -> tuple[str, dict] | None:
    """The newest complete checkpoint as ``(path, state)``, or None."""
    ckpts = complete_checkpoints(checkpoint_dir)
    if not ckpts:
        return None
    path = ckpts[-1][1]
    with open(os.path.join(path, STATE_FILE), encoding="utf-8") as f:
        return path, json.load(f)


def write_state(path: str, state: dict) -> None:
    """Write ``llmeff_state.json`` atomically (temp file, then rename)."""
    tmp = os.path.join(path, STATE_FILE + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(state, f, indent=1, sort_keys=True)
    os.replace(tmp, os.path.join(path, STATE_FILE))


def prune(checkpoint_dir: str, keep: int) -> None:
    """Delete all but the newest ``keep`` complete checkpoints, and stale incomplete ones."""
    ckpts = complete_checkpoints(checkpoint_dir)
    for _, path in ckpts[:-keep] if keep > 0 else ckpts:
        shutil.rmtree(path, ignore_errors=True)
    newest = ckpts[-1][0] if ckpts else -1
    for name in os.listdir(checkpoint_dir):
        m = _DIR_RE.match(name)
        path = os.path.join(checkpoint_dir, name)
        if m and int(m.group(1)) < newest and not os.path.isfile(os.path.join(path, STATE_FILE)):
            shutil.rmtree(path, ignore_errors=True)


def find_resume(checkpoint_dir: str, resume: str, world: int) -> tuple[str, dict] | None:
    """The checkpoint a run resumes from (``resume=auto``), or None.

    Raises:
        ValueError: when the checkpoint was written by another number of processes, or by a
            version of mlflow_llmeff whose counters this one cannot continue.
    """
    if not checkpoint_dir or resume != "auto":
        return None
    found = latest(checkpoint_dir)
    if not found:
        return None
    path, state = found
    if state.get("world_size") != world:
        raise ValueError(f"checkpoint {path} was written by {state.get('world_size')} processes, this run has "
                         f"{world}; resume with num_processes={state.get('world_size')} or resume=never")
    if "monitor" not in state:
        raise ValueError(f"checkpoint {path} was written by an older mlflow_llmeff without meter state; "
                         "resume=never starts a new run")
    return path, state


def save(accelerator, cfg, step: int, monitor, extra: dict) -> None:
    """Write Accelerate's state, then the meter's state (a collective: every rank calls it).

    The meter's state is taken after the weights are written, so its clock holds the write; the
    metrics up to this step reach the tracking server before ``llmeff_state.json`` is written, last
    (a directory without it is an interrupted save), so a resume from here never lacks them.
    """
    path = step_dir(cfg.checkpoint_dir, step)
    accelerator.save_state(path)
    state = monitor.state_dict()
    if accelerator.is_main_process:
        monitor.flush()
        write_state(path, {"step": step, "run_id": monitor.run_id, "monitor": state,
                           "world_size": accelerator.num_processes, "params": cfg.to_params(), **extra})
        prune(cfg.checkpoint_dir, cfg.checkpoint_keep)
    accelerator.wait_for_everyone()
