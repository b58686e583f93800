"""Checkpoints: ``accelerate.save_state`` plus our counters, so a killed run resumes exactly.

Layout: ``<checkpoint_dir>/step_<NNNNNNNN>/`` holds the strategy's training state (Accelerate's
``save_state``: model, optimizer, RNG, registered scheduler; DeepSpeed's partitioned files; for the
device-mesh strategies also ``dcp/``, every rank's shards written by ``torch.distributed.checkpoint``)
and ``llmeff_state.json`` (step, MLflow run id, token and time counters).

Writes are atomic: everything goes into ``step_<NNNNNNNN>.partial/`` first, every file is
fsynced, the JSON is written last, and only then is the folder renamed to its final name (and the
parent folder fsynced). A kill at any point leaves either the previous checkpoints untouched plus
a ``.partial`` folder (never picked, removed at the next start) or the complete new checkpoint.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from contextlib import contextmanager

STATE_FILE = "llmeff_state.json"
#: Called on every rank with ``(path, step)`` once a checkpoint is complete (:func:`on_saved`).
_SAVED: list = []
_DIR_RE = re.compile(r"^step_(\d{8})$")
PARTIAL = ".partial"  # suffix of a checkpoint folder still being written


def step_dir(checkpoint_dir: str, step: int) -> str:
    """Directory of the checkpoint taken after optimizer step ``step``."""
    return os.path.join(checkpoint_dir, f"step_{step:08d}")


def heartbeat_path(checkpoint_dir: str) -> str | None:
    """The meter's heartbeat file in ``checkpoint_dir`` (None without one): time, step and totals
    of the newest logged step, read by a resumed attempt to account a SIGKILLed attempt's tail."""
    return os.path.join(checkpoint_dir, "heartbeat.json") if checkpoint_dir else None


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


def _fsync_tree(path: str) -> None:
    """fsync every file under ``path`` and the folders holding them (POSIX; a no-op where unsupported)."""
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                fd = os.open(os.path.join(root, name), os.O_RDONLY)
            except OSError:
                continue
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(root)


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # e.g. Windows cannot open a folder
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def clean_partial(checkpoint_dir: str) -> list[str]:
    """Remove half-written checkpoints (``step_*.partial`` folders) left by a killed save; returns them."""
    if not checkpoint_dir or not os.path.isdir(checkpoint_dir):
        return []
    removed = []
    for name in sorted(os.listdir(checkpoint_dir)):
        if name.endswith(PARTIAL) and _DIR_RE.match(name[:-len(PARTIAL)]):
            shutil.rmtree(os.path.join(checkpoint_dir, name), ignore_errors=True)
            removed.append(name)
    return removed


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


def find_resume(checkpoint_dir: str, resume: str, world: int, strategy: str | None = None) -> tuple[str, dict] | None:
    """The checkpoint a run resumes from (``resume=auto``), or None.

    Another number of processes than the writer's (an elastic restart on fewer machines) resumes
    where the writer's strategy allows it (:meth:`~mlflow_llmeff.parallel.base.Strategy.other_world_refused`:
    single, DDP and the device-mesh strategies do; DeepSpeed's partitioned state does not).

    Raises:
        ValueError: when the checkpoint was written by another number of processes with a strategy
            whose state cannot be read by this many, or by another parallelism strategy (its sharded
            state is that strategy's), or by a version of mlflow_llmeff whose counters this one
            cannot continue.
    """
    if not checkpoint_dir or resume != "auto":
        return None
    found = latest(checkpoint_dir)
    if not found:
        return None
    path, state = found
    written = state.get("params", {}).get("parallelism")
    if state.get("world_size") != world:
        why = _other_world_refused(written, state.get("world_size"))
        if why:
            raise ValueError(f"checkpoint {path} was written by {state.get('world_size')} processes, this run has "
                             f"{world}: {why}; resume with {state.get('world_size')} processes (num_processes x "
                             "num_machines) or resume=never")
    if strategy is not None and written not in (None, strategy) and not {written, strategy} <= {"auto", "single", "ddp"}:
        raise ValueError(f"checkpoint {path} was written with parallelism={written!r}, this run has {strategy!r}; "
                         f"resume with parallelism={written} or resume=never")
    if "monitor" not in state:
        raise ValueError(f"checkpoint {path} was written by an older mlflow_llmeff without meter state; "
                         "resume=never starts a new run")
    return path, state


def _other_world_refused(written: str | None, world: int | None) -> str | None:
    """Why the strategy that wrote a checkpoint (``parallelism`` as given, ``auto`` resolved with the
    writer's ``world``) keeps it from another number of processes; None when it does not."""
    from mlflow_llmeff import parallel

    if not isinstance(world, int) or world < 1:
        return "it does not record its number of processes"
    name = ("single" if world == 1 else "ddp") if written in (None, "auto") else written
    try:
        return parallel.get(name).other_world_refused()
    except ValueError:
        return f"its parallelism {written!r} is unknown here"


def resumed_position(state: dict, dp_world: int, grad_accum: int) -> int:
    """The global micro-step a resume continues the data order at (:mod:`mlflow_llmeff.train.batches`).

    The writer's data-parallel ranks took ``step x grad_accum`` global micro-batches of
    ``micro_batch_size x dp_world_then`` blocks; with another data-parallel world (an elastic restart on
    fewer machines) the same place in the order is that many blocks in, rounded up to the new global
    micro-batch, so no block is trained on twice before its epoch ends.
    """
    k = int(state["step"]) * grad_accum
    then = int(state.get("dp_world") or dp_world)
    return k if then == dp_world else -(-k * then // dp_world)


def save(accelerator, cfg, step: int, monitor, extra: dict, strategy=None, model=None, optimizer=None) -> None:
    """Write Accelerate's state, then the meter's state, atomically (a collective: every rank calls it).

    Everything is written into ``step_<N>.partial/``; the meter's state is taken after the weights
    are written, so its clock holds the write; the metrics up to this step reach the tracking
    server before ``llmeff_state.json`` is written, last; every file is fsynced and the folder is
    renamed to ``step_<N>`` only then. So a resume never picks a half-written checkpoint, and never
    one whose metrics are missing.

    The writes are the meter's ``checkpoint_save`` pauses (declared here: the caller declares none);
    the wait for the tracking server between them is an ``other`` pause, on every rank (they wait for
    rank 0 at a barrier): a checkpoint's time is its own, not the server's (0.3 s of saving read 5.2 s
    through a slow server when the flush was inside the checkpoint's pause).
    """
    final = step_dir(cfg.checkpoint_dir, step)
    path = final + PARTIAL
    with monitor.pause("checkpoint_save"):
        if accelerator.is_main_process and os.path.isdir(path):
            shutil.rmtree(path)  # left by an earlier attempt killed at this very step
        accelerator.wait_for_everyone()
        if strategy is None:
            accelerator.save_state(path)
        else:  # the strategy's sharded state (torch.distributed.checkpoint, DeepSpeed's own files, save_state)
            strategy.save(accelerator, model, optimizer, path)
        state = monitor.state_dict()
        accelerator.wait_for_everyone()  # every rank's shard is on disk
    if accelerator.is_main_process:
        from mlflow_llmeff.train.faults import maybe_fault

        maybe_fault("kill_in_save", step)
    with monitor.pause("other"):  # the tracking server's time: the metrics up to this step are delivered
        if accelerator.is_main_process:
            monitor.flush()
        accelerator.wait_for_everyone()
    with monitor.pause("checkpoint_save"):
        if accelerator.is_main_process:
            write_state(path, {"step": step, "run_id": monitor.run_id, "monitor": state,
                               "world_size": accelerator.num_processes, "params": cfg.to_params(), **extra})
            _fsync_tree(path)
            if os.path.isdir(final):  # a complete checkpoint of the same step (a replayed step): replace it
                shutil.rmtree(final)
            os.rename(path, final)
            _fsync_dir(cfg.checkpoint_dir)
            prune(cfg.checkpoint_dir, cfg.checkpoint_keep)
        accelerator.wait_for_everyone()
        for fn in list(_SAVED):  # e.g. Ray Train's report of it (train/ray.py): the checkpoint's time too
            fn(final, step)


@contextmanager
def on_saved(fn):
    """While inside, call ``fn(path, step)`` on every rank after each complete checkpoint :func:`save` writes
    (``llmeff train`` under Ray Train reports it to Ray: :mod:`mlflow_llmeff.train.ray`)."""
    _SAVED.append(fn)
    try:
        yield
    finally:
        _SAVED.remove(fn)
