"""Kubeflow Trainer v2: a ``TrainJob`` (``trainer.kubeflow.org/v1alpha1``) run by a ``ClusterTrainingRuntime``.

The Trainer's Torch plugin (kubeflow/trainer ``pkg/runtime/framework/plugins/torch/torch.go``) sets on
the trainer container of every node the variables torchrun reads: ``PET_NNODES`` (``numNodes``),
``PET_NPROC_PER_NODE`` (``numProcPerNode``, by default ``auto``; with CPU-only resources the CPU
limit), ``PET_NODE_RANK`` (the pod's Job completion index), ``PET_MASTER_ADDR``
(``<trainjob>-node-0-0.<trainjob>``, node 0's pod in the JobSet's headless service) and
``PET_MASTER_PORT`` (29400); unlike the legacy PyTorchJob, no ``MASTER_ADDR`` / ``WORLD_SIZE`` / ``RANK``.

Told apart from a PyTorchJob's pod: the Trainer runs each node as a pod of an Indexed Job of a
JobSet, and Kubernetes gives every pod of an Indexed Job ``JOB_COMPLETION_INDEX`` (the PyTorchJob's
operator creates bare pods, which have none). ``llmeff.scheduler.job_id`` is the TrainJob's name,
read from ``PET_MASTER_ADDR``'s service part.
"""

from __future__ import annotations

from typing import Callable, Mapping

from mlflow_llmeff.meters.schedulers.base import Placement, Runner, Scheduler
from mlflow_llmeff.meters.schedulers.torchrun import _accelerators, _cpus, read_pet

__all__ = ["KubeflowTrainer"]


class KubeflowTrainer(Scheduler):
    """A node of a Kubeflow Trainer v2 ``TrainJob``: ``PET_NNODES`` and ``JOB_COMPLETION_INDEX`` set."""

    name = "kubeflow-trainer"

    def __init__(self, accelerators: Callable[[], int] = _accelerators, cpus: Callable[[], int] = _cpus) -> None:
        self.accelerators, self.cpus = accelerators, cpus

    def detect(self, env: Mapping[str, str]) -> bool:
        return bool((env.get("PET_NNODES") or "").strip()) and bool((env.get("JOB_COMPLETION_INDEX") or "").strip())

    def read(self, env: Mapping[str, str], run: Runner | None = None) -> Placement:
        """The TrainJob's layout (``PET_*``; ``auto`` processes per node resolved as torchrun does).

        Raises:
            ValueError: ``PET_NPROC_PER_NODE`` torchrun would refuse.
        """
        master = (env.get("PET_MASTER_ADDR") or "").strip()
        _, dot, service = master.partition(".")
        job = service.split(".")[0] if dot and service else None
        return read_pet(env, self.name, job_id=job, accelerators=self.accelerators, cpus=self.cpus)
