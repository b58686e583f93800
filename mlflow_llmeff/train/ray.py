"""``llmeff train`` as Ray Train's worker function: the entrypoint's training inside Ray's worker group.

Ray starts the processes and their torch process group itself (``TorchConfig``: gloo on CPU, NCCL on
GPUs), so this module does what ``llmeff train``'s launcher does for ``accelerate launch`` and nothing
more: every worker settles the settings on Ray's layout (:func:`settings_for_worker`: world, processes
per node, node rank from Ray's train context) and calls the same
:func:`~mlflow_llmeff.train.loop.run_training` every launched process calls. Accelerate finds Ray's
process group already made (Ray sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``); the meter
reads Ray's tags (:class:`~mlflow_llmeff.meters.schedulers.ray.RayTrain`: ``llmeff.scheduler.name=ray``,
the run's name, the world size). So the run is the one ``llmeff train`` gives: one MLflow run, rank 0
logging, every figure from the same meter.

Checkpoints and restarts:

* the checkpoint folder is ``checkpoint_dir`` when given (shared by every node, as for ``llmeff train``),
  else ``<Ray's run folder>/llmeff`` (``RunConfig(storage_path=..., name=...)``) when Ray stores on a
  local or mounted file system; on another storage (``s3://...``) without ``checkpoint_dir`` no checkpoint
  is written (say where with ``checkpoint_dir``);
* every checkpoint ``llmeff train`` writes is reported to Ray (``ray.train.report(checkpoint=...)``, every
  worker, rank 0 with the checkpoint): inside Ray's run folder without a copy (``NO_UPLOAD``), elsewhere
  copied into Ray's storage. ``Result.checkpoint`` is the last one;
* a worker group Ray restarts (``FailureConfig(max_failures=N)``) finds the same folder and resumes as
  ``llmeff train`` does: the latest checkpoint, its MLflow run, a new attempt with its down time. The job's
  record (``llmeff_job.json``) is written there as soon as the run exists, so a restart *before* the first
  checkpoint continues the same run too (from step 0). When Ray restores a checkpoint the folder lacks (a
  folder that is not shared with the node now holding rank 0), rank 0 copies it in first.

Use::

    from mlflow_llmeff.train.config import TrainConfig
    from mlflow_llmeff.train.ray import trainer
    from ray.train import ScalingConfig, RunConfig

    result = trainer(TrainConfig(model="llama-tiny", max_steps=100, checkpoint_every=50),
                     ScalingConfig(num_workers=2), RunConfig(name="tiny", storage_path="/shared/ray")).fit()

or pass :func:`train_loop_per_worker` to your own ``TorchTrainer`` with
``train_loop_config={"settings": dataclasses.asdict(cfg)}``.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import time
from typing import Any

from mlflow_llmeff.train import checkpoint as ckpt
from mlflow_llmeff.train.config import TrainConfig

__all__ = ["trainer", "train_loop_per_worker", "settings_for_worker", "RAY_FOLDER"]

#: The checkpoint folder's name inside Ray's run folder (``<storage_path>/<name>/llmeff``).
RAY_FOLDER = "llmeff"


def trainer(settings: TrainConfig, scaling_config: Any, run_config: Any = None, **kwargs: Any):
    """A ``ray.train.torch.TorchTrainer`` whose workers train ``settings`` as ``llmeff train`` would.

    Args:
        settings: the training settings (``num_processes``, ``num_machines``, ``machine_rank`` and
            ``main_process_ip`` are Ray's: left at their defaults, they are taken from Ray's layout).
        scaling_config: Ray's ``ScalingConfig`` (``num_workers``: the processes in all; ``use_gpu``).
        run_config: Ray's ``RunConfig``: its ``name`` and ``storage_path`` hold the checkpoints unless
            ``settings.checkpoint_dir`` is given; its ``FailureConfig`` restarts a failed worker group.
        **kwargs: more ``TorchTrainer`` arguments (``torch_config``, ...).

    Returns:
        The trainer; ``.fit()`` trains.

    Raises:
        ValueError: ``settings`` is not a :class:`~mlflow_llmeff.train.config.TrainConfig`.
    """
    from ray.train.torch import TorchTrainer

    if not isinstance(settings, TrainConfig):
        raise ValueError(f"settings={type(settings).__name__}; give a mlflow_llmeff.train.config.TrainConfig")
    return TorchTrainer(train_loop_per_worker, train_loop_config={"settings": dataclasses.asdict(settings)},
                        scaling_config=scaling_config, run_config=run_config, **kwargs)


def settings_for_worker(cfg: TrainConfig, *, world: int, local_world: int, node_rank: int, master_addr: str,
                        ray_folder: str | None) -> TrainConfig:
    """``cfg`` on Ray's layout: ``world`` processes as ``world / local_world`` nodes of ``local_world``
    (one node of ``world`` when Ray placed them unevenly: the product, which Accelerate checks, is the
    same), this worker's node rank, machine 0's address, and the checkpoint folder (``cfg.checkpoint_dir``,
    else ``<ray_folder>/llmeff`` when Ray's run folder is on a file system here, else none).

    Raises:
        ValueError: a layout option given that contradicts Ray's (one line naming both).
    """
    if world < 1 or local_world < 1:
        raise ValueError(f"Ray's world={world}, local world={local_world}; both must be at least 1")
    nodes = world // local_world if world % local_world == 0 else 1
    per_node = world // nodes
    for key, ray_value in (("num_processes", per_node), ("num_machines", nodes)):
        given = getattr(cfg, key)
        if given not in (1, ray_value):  # 1: the default, left to Ray
            raise ValueError(f"{key}={given} contradicts Ray's layout ({world} workers: num_processes={per_node}, "
                             f"num_machines={nodes}); leave it out")
    folder = cfg.checkpoint_dir or (os.path.join(ray_folder, RAY_FOLDER) if ray_folder else "")
    return dataclasses.replace(cfg, num_processes=per_node, num_machines=nodes,
                               machine_rank=node_rank if nodes > 1 else 0,
                               main_process_ip=master_addr if nodes > 1 else cfg.main_process_ip,
                               checkpoint_dir=folder)


def _ray_folder(context) -> str | None:
    """Ray's run folder (``storage_path/name``) when it is on a local or mounted file system, else None."""
    try:
        storage = context.get_storage()
        fs = storage.storage_filesystem
        if getattr(fs, "type_name", "") != "local":
            return None
        return str(storage.experiment_fs_path)
    except Exception:  # noqa: BLE001 - no folder known: checkpoint_dir must say where
        return None


def train_loop_per_worker(config: dict) -> None:
    """Ray Train's worker function: ``config["settings"]`` (a :class:`TrainConfig` as a dict) trained by
    :func:`~mlflow_llmeff.train.loop.run_training` in Ray's process group, each checkpoint reported to Ray.

    The attempt starts when Ray calls this function (Ray may run it in a process it started earlier), so
    Ray's start of the worker group before it is not in ``summary/wall_s``.

    Raises:
        ValueError: bad settings, or settings that contradict Ray's layout (one line).
    """
    started = time.perf_counter()
    import ray.train

    from mlflow_llmeff.train.launch import settle
    from mlflow_llmeff.train.loop import run_training

    ctx = ray.train.get_context()
    world, rank, folder = int(ctx.get_world_size()), int(ctx.get_world_rank()), _ray_folder(ctx)
    cfg = settings_for_worker(TrainConfig(**config["settings"]), world=world, local_world=int(ctx.get_local_world_size()),
                              node_rank=int(ctx.get_node_rank()), master_addr=os.environ.get("MASTER_ADDR", ""),
                              ray_folder=folder)
    spec = settle(cfg)
    for k, v in spec.strategy.launcher_env(cuda=spec.machine.cuda).items():
        os.environ.setdefault(k, v)  # what accelerate launch would have set (CPU: ACCELERATE_USE_CPU=1)
    if cfg.checkpoint_dir and rank == 0:
        _restore(ray.train.get_checkpoint(), cfg.checkpoint_dir)
    inside = bool(folder) and os.path.abspath(cfg.checkpoint_dir).startswith(os.path.abspath(folder) + os.sep)
    with ckpt.on_saved(lambda path, step: _report(path, step, rank, inside)):
        run_training(spec, started_at=started)


def _report(path: str, step: int, rank: int, inside: bool) -> None:
    """Every worker: report the checkpoint of ``step`` at ``path`` (rank 0's) to Ray; ``inside``: the path
    is in Ray's run folder already (reported without a copy)."""
    import ray.train

    checkpoint = ray.train.Checkpoint.from_directory(path) if rank == 0 else None
    kwargs = {}
    mode = getattr(ray.train, "CheckpointUploadMode", None)  # a Ray without it copies the folder
    if inside and mode is not None:
        kwargs["checkpoint_upload_mode"] = mode.NO_UPLOAD
    ray.train.report({"step": step}, checkpoint=checkpoint, **kwargs)


def _restore(checkpoint, checkpoint_dir: str) -> None:
    """Copy the checkpoint Ray restored into ``checkpoint_dir`` when the folder lacks it (a folder another
    node held); nothing when it already holds that step or a newer one."""
    if checkpoint is None:
        return
    with checkpoint.as_directory() as source:
        state_path = os.path.join(source, ckpt.STATE_FILE)
        if not os.path.isfile(state_path):
            return  # not a checkpoint of ours
        import json

        with open(state_path, encoding="utf-8") as f:
            step = int(json.load(f)["step"])
        have = ckpt.complete_checkpoints(checkpoint_dir)
        if have and have[-1][0] >= step:
            return
        target = ckpt.step_dir(checkpoint_dir, step)
        os.makedirs(checkpoint_dir, exist_ok=True)
        shutil.copytree(source, target + ckpt.PARTIAL, dirs_exist_ok=True)
        os.rename(target + ckpt.PARTIAL, target)
        print(f"llmeff: copied Ray's checkpoint of step {step} into {checkpoint_dir}")
