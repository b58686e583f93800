"""Ray Train under ``autolog()``: one MLflow run per Ray Train run, continued across worker restarts.

Inside ``train_loop_per_worker`` Ray has already made the torch process group (``TorchConfig``), so
the workers report as torchrun's do: rank 0 opens the run, the other ranks' counts are summed into it
at window edges, and Ray's ``destroy_process_group`` at the worker group's shutdown ends it
(autolog's patch). What Ray adds, and this module handles:

* **the resume point is Ray's checkpoint.** ``ray.train.report(..., checkpoint=...)`` is patched: when
  any worker reports a checkpoint, every worker takes the meter's state (a collective, as Ray's report
  is called on every worker) and rank 0 writes it, with its run id, into its checkpoint folder as
  :data:`STATE_FILE` before Ray uploads it. Report rank 0's checkpoint (Ray's own advice for data
  parallelism): another rank's checkpoint carries no meter state.
* **a restart continues the run.** When ``FailureConfig(max_failures=N)`` restarts the worker group, the
  new workers' first counted forward finds ``ray.train.get_checkpoint()`` holding :data:`STATE_FILE`:
  the meter resumes that run and state (counters, clock, energy, attempts + 1), and rank 0 books the
  gap as down time (``summary/badput_down_s``): from the killed attempt's last sign of life (the
  heartbeat rank 0 rewrites at every logged point in the run's storage folder, when that folder is on
  a local or shared file system; else the checkpoint's save time) to ``autolog()`` in the new worker
  (the attempt's start: its set-up until the first step is ``init``, as for ``llmeff train``). The
  steps the killed attempt ran after its checkpoint are lost progress, as for ``llmeff train``.
* without a checkpoint a restart starts a new run (nothing tells it the run to continue).
* **one worker ends its run too.** Ray makes a process group of one but destroys it only for two or
  more workers, and then kills the worker's process (no exit hook runs): the run would stay RUNNING.
  With one worker the run ends when ``train_loop_per_worker`` returns (:func:`finish_when_returned`),
  before Ray's controller can see it return (it kills the process right after).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
from typing import Any, Callable

__all__ = ["STATE_FILE", "HEARTBEAT_FILE", "in_worker", "resume_kwargs", "down_s", "patch_report",
           "finish_when_returned"]

log = logging.getLogger("mlflow_llmeff.autologging")

#: The meter's state in a Ray checkpoint folder: ``{"run_id", "state"}`` (``EfficiencyMonitor.state_dict``).
STATE_FILE = "llmeff_monitor.json"
#: Rank 0's heartbeat in the Ray run's storage folder (``RunConfig(storage_path=..., name=...)``).
HEARTBEAT_FILE = "llmeff_heartbeat.json"


def in_worker() -> bool:
    """True inside a Ray Train worker (:func:`~mlflow_llmeff.meters.schedulers.ray.train_context`)."""
    from mlflow_llmeff.meters.schedulers.ray import train_context

    return train_context() is not None


def _heartbeat_path() -> str | None:
    """The heartbeat's path in the run's storage folder when Ray stores on a local (or mounted) file
    system, else None. Reads Ray's ``StorageContext`` (a DeveloperAPI: ``experiment_fs_path``)."""
    try:
        storage = sys.modules["ray.train"].get_context().get_storage()
        fs = getattr(storage, "storage_filesystem", None)
        if fs is None or getattr(fs, "type_name", "") != "local":
            return None
        path = os.path.join(str(storage.experiment_fs_path), HEARTBEAT_FILE)
        return path if os.path.isdir(os.path.dirname(path)) else None
    except Exception:  # noqa: BLE001 - no heartbeat: the checkpoint's time bounds the down time
        return None


def _saved_state() -> dict | None:
    """``{"run_id", "state"}`` of the checkpoint Ray restored for this attempt, or None."""
    ckpt = sys.modules["ray.train"].get_checkpoint()
    if ckpt is None:
        return None
    with ckpt.as_directory() as folder:
        path = os.path.join(folder, STATE_FILE)
        if not os.path.exists(path):
            return None
        with open(path, encoding="utf-8") as f:
            return json.load(f)


def resume_kwargs(started_at: float) -> dict[str, Any]:
    """The monitor's keyword arguments in a Ray Train worker: the attempt's start ``started_at``
    (``time.perf_counter()`` when ``autolog()`` was called in the worker: Ray may reuse a process it
    started earlier, so the process's own start is not the attempt's), the heartbeat path, and
    ``run_id`` and ``resume_state`` when Ray restored a checkpoint with :data:`STATE_FILE`. ``{}``
    outside Ray."""
    if not in_worker():
        return {}
    out: dict[str, Any] = {"heartbeat_path": _heartbeat_path(), "started_at": started_at}
    saved = _saved_state()
    if saved:
        out.update(run_id=saved["run_id"], resume_state=saved["state"])
    return out


def down_s(resume_state: dict, heartbeat_path: str | None, run_id: str, start_unix: float) -> float:
    """Seconds between the killed attempt's last sign of life and this attempt's start ``start_unix``
    (unix s: ``autolog()`` in the restarted worker), at least 0.

    The last sign of life is the heartbeat's time when it belongs to ``run_id``, else the resumed
    checkpoint's save time (then the killed attempt's steps after the checkpoint are down time too).
    """
    last = float(resume_state.get("saved_at_unix") or 0.0)
    try:
        with open(heartbeat_path or "", encoding="utf-8") as f:
            beat = json.load(f)
        if beat.get("run_id") == run_id:
            last = max(last, float(beat["unix"]))
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return max(0.0, float(start_unix) - last) if last else 0.0


def _report_with_state(active_monitor: Callable[[], Any], original, *args, **kwargs):
    """``ray.train.report``: the meter's state into rank 0's checkpoint folder before Ray uploads it."""
    from mlflow_llmeff.meters import collectives

    mon = active_monitor()
    checkpoint = kwargs.get("checkpoint", args[1] if len(args) > 1 else None)
    if mon is not None and not mon.finished:
        try:
            anyone = collectives.all_reduce([1.0 if checkpoint is not None else 0.0], op="max")[0] > 0
            if anyone:
                with mon.pause("checkpoint_save"):
                    state = mon.state_dict()  # a collective: every worker is in this report
                    if mon.is_main and checkpoint is not None:
                        with open(os.path.join(checkpoint.path, STATE_FILE), "w", encoding="utf-8") as f:
                            json.dump({"run_id": mon.run_id, "state": state}, f)
        except Exception as e:  # noqa: BLE001 - a meter's state is never worth a failed report
            log.warning("mlflow_llmeff: the meter's state was not saved with Ray's checkpoint: %s: %s",
                        type(e).__name__, e)
    return original(*args, **kwargs)


def patch_report(integration: str, active_monitor: Callable[[], Any]) -> None:
    """Patch ``ray.train.report`` (``safe_patch``: ``autolog(disable=True)`` reverts it) to save the state
    of ``active_monitor()`` (the meter of the training in progress, or None) with rank 0's checkpoint."""
    from mlflow.utils.autologging_utils import safe_patch

    def patched(original, *args, **kwargs):
        return _report_with_state(active_monitor, original, *args, **kwargs)

    safe_patch(integration, sys.modules["ray.train"], "report", patched)


def _thread_runner():
    """Ray Train V2's runner of this worker's ``train_loop_per_worker`` thread (``ray.train.v2._internal``: an
    internal module, read fail-soft), or None outside it or in another Ray."""
    try:
        from ray.train.v2._internal.execution.context import get_train_context

        return get_train_context().execution_context.training_thread_runner
    except Exception:  # noqa: BLE001 - another Ray, or no Ray Train worker
        return None


def _worker_function_failed() -> bool:
    """True when this worker's ``train_loop_per_worker`` raised: Ray Train V2 keeps the error in the worker's
    thread runner (False when unknown: the status is FINISHED)."""
    try:
        return _thread_runner().get_error() is not None
    except Exception:  # noqa: BLE001 - another Ray: the status is FINISHED
        return False


def _end_inside_ray_thread(runner, end: Callable[[], None]) -> bool:
    """Have Ray V2's ``runner`` (its ``ThreadRunner``, running ``train_loop_per_worker``) call ``end()`` after
    the function returns and before the thread running it ends; True when it will, False when ``runner`` is
    not such a runner (or its function is no longer running).

    The runner's thread joins its monitor thread (``_monitor_thread``, which records the function's error)
    as its last act, and Ray's controller sees the function done only when that thread has ended (its
    poll, every 2 s by default), then kills the worker's process at once (no exit hook). A thread of ours
    put in the monitor's place waits for Ray's monitor, then calls ``end()``: the run is ended before the
    controller can see the function return, however long ending it takes."""
    monitor = getattr(runner, "_monitor_thread", None)
    if not isinstance(monitor, threading.Thread) or not runner.is_running():
        return False

    def then_end() -> None:
        monitor.join()  # the function returned or raised, and Ray's runner holds its error
        end()

    ours = threading.Thread(target=then_end, name="mlflow_llmeff-ray-end", daemon=True)
    runner._monitor_thread = ours  # read by the runner's thread when the function has returned
    ours.start()
    return True


def finish_when_returned(finish: Callable[[str], None], world_size: int) -> bool:
    """A Ray Train run of one worker (``world_size`` 1): call ``finish(status)`` when ``train_loop_per_worker``
    (run by this thread: Ray runs the function in a thread of its own) returns, ``FAILED`` when it raised,
    else ``FINISHED``. Returns whether it will (not for 2 or more workers, where Ray's
    ``destroy_process_group`` ends the run, nor in a process's main thread).

    Ray's controller kills the worker's process as soon as its poll sees the function's thread end (every
    2 s by default), so under Ray V2 the run is ended inside that thread, after the function returns
    (:func:`_end_inside_ray_thread`); elsewhere (another Ray, a plain thread) when the thread ends.
    """
    thread = threading.current_thread()
    if world_size != 1 or thread is threading.main_thread():
        return False

    def end() -> None:
        try:
            finish("FAILED" if _worker_function_failed() else "FINISHED")
        except Exception as e:  # noqa: BLE001 - ending a run never raises into Ray
            log.warning("mlflow_llmeff: the run of this Ray Train worker was not ended: %s: %s", type(e).__name__, e)

    if _end_inside_ray_thread(_thread_runner(), end):
        return True

    def wait() -> None:
        thread.join()
        end()

    threading.Thread(target=wait, name="mlflow_llmeff-ray-end", daemon=True).start()
    return True
