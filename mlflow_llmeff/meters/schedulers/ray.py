"""Ray Train: a worker of ``ray.train.torch.TorchTrainer`` (Ray >= 2.43's Train, ``ray.train.get_context()``).

Ray starts the processes and their torch process group itself (``TorchConfig``: gloo or NCCL), so it
gives no launch layout for ``llmeff train`` to fill: the processes are already running. What it
gives is read from the worker's train context: the run's name (``RunConfig(name=...)``, the same
across the worker group's restarts under ``FailureConfig``) as ``llmeff.scheduler.job_id``, the
world size, this worker's node rank and local world size.

Detected only inside a Ray Train worker: ``ray.train`` is already imported by the worker (a process
that never imported Ray is never asked to import it) and ``ray.train.get_context()`` answers.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Mapping

from mlflow_llmeff import names
from mlflow_llmeff.meters.schedulers.base import Placement, Runner, Scheduler

__all__ = ["RayTrain", "train_context"]


def train_context() -> Any | None:
    """Ray Train's context of this worker (``ray.train.get_context()``), or None outside one (``ray.train``
    not imported, or no train run in this process)."""
    if "ray.train" not in sys.modules:
        return None
    try:
        ctx = sys.modules["ray.train"].get_context()
        ctx.get_world_size()  # outside a worker Ray raises here (V2) or answers 1 without a run (V1)
        return ctx
    except Exception:  # noqa: BLE001 - not a Ray Train worker
        return None


class RayTrain(Scheduler):
    """A Ray Train worker: the layout is Ray's (no launch layout), the tags its context's."""

    name = "ray"

    def __init__(self, context: Callable[[], Any | None] = train_context) -> None:
        self.context = context

    def detect(self, env: Mapping[str, str]) -> bool:
        return self.context() is not None

    def read(self, env: Mapping[str, str], run: Runner | None = None) -> Placement:
        """Ray's run name, world size, node rank and processes per node; never a launch layout."""
        ctx = self.context()
        world = int(ctx.get_world_size())
        local = int(ctx.get_local_world_size())
        extra = ((names.SCHEDULER_WORLD_SIZE, str(world)),)
        return Placement(scheduler=self.name, job_id=str(ctx.get_experiment_name() or "") or None,
                         world_size=world, processes_per_node=local,
                         nodes=1 if world == local else None,  # more: Ray may place unevenly
                         why_no_layout="Ray Train starts the processes and their process group itself",
                         machine_rank=int(ctx.get_node_rank()), extra_tags=extra)
