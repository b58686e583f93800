"""The machines' layout of ``llmeff train`` from the scheduler it runs under (SLURM's ``srun``, a
PyTorchJob): options not given take the scheduler's values, given ones must agree
(:func:`mlflow_llmeff.meters.scheduler.layout`)."""

from __future__ import annotations

import dataclasses
import sys

from mlflow_llmeff.meters import scheduler
from mlflow_llmeff.train.config import TrainConfig


def from_scheduler(cfg: TrainConfig, placement: scheduler.Placement | None = None, *, say: bool = True) -> TrainConfig:
    """``cfg`` with ``num_machines``, ``machine_rank``, ``main_process_ip`` (and a PyTorchJob's port and
    processes per node) from the scheduler where they were not given; unchanged outside one.

    Args:
        cfg: the settings as given.
        placement: the scheduler's (default: :func:`mlflow_llmeff.meters.scheduler.read` of this
            process's environment).
        say: print the layout taken on stderr (one line).

    Raises:
        ValueError: a given option contradicts the scheduler (one line; see ``scheduler.layout``).
    """
    p = scheduler.read() if placement is None else placement
    if p is None or p.num_machines is None:
        return cfg
    defaults = TrainConfig()
    got = scheduler.layout(p, num_machines=cfg.num_machines, machine_rank=cfg.machine_rank,
                           main_process_ip=cfg.main_process_ip,
                           defaults=(defaults.num_machines, defaults.machine_rank, defaults.main_process_ip))
    if "main_process_port" in got and cfg.main_process_port != defaults.main_process_port:
        got.pop("main_process_port")  # given: the user's port wins (the service may forward it)
    if p.processes_per_node and cfg.num_processes == defaults.num_processes:
        got["num_processes"] = p.processes_per_node
    changed = {k: v for k, v in got.items() if getattr(cfg, k) != v}
    if changed and say:
        where = f"SLURM job {p.job_id}" if p.scheduler == "slurm" else p.scheduler
        print(f"llmeff: {where} on {p.num_machines} node{'s' if p.num_machines != 1 else ''}: "
              + ", ".join(f"{k}={v}" for k, v in changed.items()), file=sys.stderr)
    return dataclasses.replace(cfg, **changed) if changed else cfg
