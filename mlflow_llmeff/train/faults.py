"""Fault injection for tests: the entrypoint fails on purpose at a named point of a named step.

Each point is switched on by an environment variable holding the optimizer step (1-based) at
which it fires; unset or 0 means never. The tests use them to prove that every way a run can end
leaves a correct record and a resumable checkpoint:

================================  ===========================================================
``LLMEFF_FAULT_KILL_AT_STEP``     SIGKILL right after the step (metrics flushed first)
``LLMEFF_FAULT_KILL_IN_STEP``     SIGKILL inside the step: after the first backward, before
                                  the optimizer step
``LLMEFF_FAULT_KILL_IN_SAVE``     SIGKILL inside the checkpoint save of that step: Accelerate's
                                  files written, ``llmeff_state.json`` not yet, not renamed
``LLMEFF_FAULT_KILL_IN_EVAL``     SIGKILL inside the evaluation after that step
``LLMEFF_FAULT_RAISE_AT_STEP``    RuntimeError after the step (a failure inside training)
``LLMEFF_FAULT_SIGTERM_AT_STEP``  SIGTERM to itself after the step (a scheduler's kill)
``LLMEFF_FAULT_OOM_AT_STEP``      ``torch.OutOfMemoryError`` from a forward hook in that step
``LLMEFF_FAULT_DATA_AT_STEP``     OSError while fetching that step's first micro-batch
``LLMEFF_FAULT_HOLD_AT_STEP``     after the step (metrics flushed first), write
                                  ``$LLMEFF_FAULT_HOLD_FILE.reached`` and wait (at most 300 s)
                                  until ``$LLMEFF_FAULT_HOLD_FILE`` exists: the test changes the
                                  world meanwhile (e.g. the tracking server stops answering)
================================  ===========================================================

The after-step kill and hold fire on the main process, or on the global rank in
``LLMEFF_FAULT_RANK`` when it is set (``1``: a 2-process run loses rank 1).
"""

from __future__ import annotations

import os
import signal
import time

ENV = {
    "kill_at_step": "LLMEFF_FAULT_KILL_AT_STEP",
    "kill_in_step": "LLMEFF_FAULT_KILL_IN_STEP",
    "kill_in_save": "LLMEFF_FAULT_KILL_IN_SAVE",
    "kill_in_eval": "LLMEFF_FAULT_KILL_IN_EVAL",
    "raise_at_step": "LLMEFF_FAULT_RAISE_AT_STEP",
    "sigterm_at_step": "LLMEFF_FAULT_SIGTERM_AT_STEP",
    "oom_at_step": "LLMEFF_FAULT_OOM_AT_STEP",
    "data_at_step": "LLMEFF_FAULT_DATA_AT_STEP",
    "hold_at_step": "LLMEFF_FAULT_HOLD_AT_STEP",
}
HOLD_FILE_ENV = "LLMEFF_FAULT_HOLD_FILE"
RANK_ENV = "LLMEFF_FAULT_RANK"


def on_this_rank(is_main: bool) -> bool:
    """True where the after-step kill and hold fire: the global rank ``$LLMEFF_FAULT_RANK`` (this
    process's ``$RANK``, 0 without one) when set, else the main process (``is_main``)."""
    want = os.environ.get(RANK_ENV, "").strip()
    if not want.isdigit():
        return is_main
    return int(want) == int(os.environ.get("RANK", "0") or 0)


def fault_step(point: str) -> int:
    """The step at which ``point`` fires (0: never)."""
    v = os.environ.get(ENV[point], "0") or "0"
    return int(v) if v.strip().isdigit() else 0


def fires(point: str, step: int) -> bool:
    """True when ``point`` is set to fire at ``step``."""
    at = fault_step(point)
    return bool(at) and at == step


def maybe_fault(point: str, step: int) -> None:
    """Fire ``point`` if it is set for ``step``: SIGKILL, an exception, SIGTERM, or a hold.

    Raises:
        RuntimeError, torch.OutOfMemoryError or OSError: as the table above says.
    """
    if not fires(point, step):
        return
    if point.startswith("kill"):
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(5)  # never reached
    if point == "raise_at_step":
        raise RuntimeError(f"{ENV[point]}={step}: injected failure")
    if point == "sigterm_at_step":
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler raises SystemExit at the next bytecode
    if point == "oom_at_step":
        import torch

        raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate 2.00 GiB ({ENV[point]}={step}: injected)")
    if point == "hold_at_step":
        path = os.environ[HOLD_FILE_ENV]
        with open(path + ".reached", "w", encoding="utf-8") as f:
            f.write(str(step))
        deadline = time.monotonic() + 300
        while not os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.05)
        return
    if point == "data_at_step":
        raise OSError(f"[Errno 5] Input/output error: 'shard-00007.jsonl' ({ENV[point]}={step}: injected)")


def oom_hook(model, step_of):
    """Register a forward pre-hook on ``model`` that raises the injected OOM at its step.

    ``step_of`` is a callable giving the optimizer step being computed. Returns the hook handle, or
    None when the fault is not set.
    """
    if not fault_step("oom_at_step"):
        return None

    def hook(_module, _args):
        maybe_fault("oom_at_step", step_of())

    return model.register_forward_pre_hook(hook)
