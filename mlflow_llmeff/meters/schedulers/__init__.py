"""The engines that start training processes, one class each (:class:`~.base.Scheduler`: ``detect`` and
``read``), in the order :func:`detect` asks them. A new engine is one module here and one entry in
:data:`ENGINES`; :mod:`mlflow_llmeff.meters.scheduler` turns the placement into a layout and tags.
"""

from __future__ import annotations

from typing import Mapping

from mlflow_llmeff.meters.schedulers.base import Placement, Runner, Scheduler
from mlflow_llmeff.meters.schedulers.kubeflow import KubeflowTrainer
from mlflow_llmeff.meters.schedulers.ray import RayTrain
from mlflow_llmeff.meters.schedulers.slurm import Slurm
from mlflow_llmeff.meters.schedulers.torchrun import TorchElastic

__all__ = ["Placement", "Scheduler", "ENGINES", "detect", "Slurm", "RayTrain", "KubeflowTrainer", "TorchElastic"]

#: Asked in this order, the first that detects wins: Ray Train (a worker of a run: Ray made its
#: processes and process group, even inside a SLURM job that started Ray), SLURM, Kubeflow Trainer v2
#: (``PET_*`` in an Indexed Job's pod) before a PyTorchJob or torchrun (``PET_*`` alone).
ENGINES: tuple[Scheduler, ...] = (RayTrain(), Slurm(), KubeflowTrainer(), TorchElastic())


def detect(env: Mapping[str, str], engines: tuple[Scheduler, ...] = ENGINES) -> Scheduler | None:
    """The first of ``engines`` whose ``detect(env)`` is True, or None outside every one."""
    for engine in engines:
        if engine.detect(env):
            return engine
    return None
