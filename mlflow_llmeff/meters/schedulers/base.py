"""What every scheduler reader shares: the :class:`Placement` it reads and the :class:`Scheduler` interface.

One class per engine (SLURM, a PyTorchJob or torchrun, Kubeflow Trainer v2, Ray Train), each with
``detect()`` (does this process run under it?) and ``read()`` (the layout it gives), as Lightning's
``ClusterEnvironment`` (``lightning/fabric/plugins/environments``) has one class per cluster. A new engine
is one module with one such class, listed in :data:`mlflow_llmeff.meters.schedulers.ENGINES`.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from typing import Callable, Mapping

__all__ = ["Placement", "Scheduler", "Runner", "env_int"]

Runner = Callable[..., subprocess.CompletedProcess]

#: Where a PyTorchJob's or a TrainJob's layout comes from, named in the one-line refusals of ``layout``.
PET_SOURCES = ("PET_NNODES", "PET_NODE_RANK", "MASTER_ADDR")


@dataclass(frozen=True)
class Placement:
    """Where this process runs under a scheduler.

    Attributes:
        scheduler: ``slurm``; ``kubernetes`` (a PyTorchJob) or ``torchrun`` (the same variables outside
            Kubernetes); ``kubeflow-trainer`` (a TrainJob of Kubeflow Trainer v2); ``ray`` (a Ray Train worker).
        num_machines: machines of the launch (None: the environment gives no launch layout, e.g. a
            SLURM batch script outside ``srun``: ``why_no_layout`` says so).
        machine_rank: this machine's rank in ``0..num_machines-1``.
        main_process_host: machine 0's host name or address (the rendezvous).
        main_process_port: the rendezvous port the scheduler gives (None: not given).
        processes_per_node: processes per machine the scheduler gives (PyTorchJob's nprocPerNode), or None.
        job_id: the scheduler's job id (None: none known).
        nodes: machines of the job (``SLURM_JOB_NUM_NODES``; the launch's for a PyTorchJob).
        node_list: the job's nodes as the scheduler writes them (``llh1-[0-1]``), or None.
        restart_count: how often the scheduler restarted the job (``SLURM_RESTART_COUNT``; 0: never).
        partition: the SLURM partition, or None.
        queue_wait_s: seconds this start waited in the queue (``StartTime - SubmitTime``), or None.
        why_no_layout: why there is no launch layout (None when there is one).
        tasks: tasks of the SLURM step (to refuse more than one per node), or None.
        first_hosts: the step's hosts in SLURM's order (machine 0 first), to name a contradiction.
        sources: the variables the number of machines, this machine's rank and machine 0 come from
            (named in :func:`~mlflow_llmeff.meters.scheduler.layout`'s refusals).
        world_size: processes of the job, when the scheduler starts them itself (Ray Train), else None.
        extra_tags: ``(tag, value)`` pairs the engine adds to ``llmeff.scheduler.*`` (Ray's run name).
    """

    scheduler: str
    num_machines: int | None = None
    machine_rank: int | None = None
    main_process_host: str | None = None
    main_process_port: int | None = None
    processes_per_node: int | None = None
    job_id: str | None = None
    nodes: int | None = None
    node_list: str | None = None
    restart_count: int | None = None
    partition: str | None = None
    queue_wait_s: float | None = None
    why_no_layout: str | None = None
    tasks: int | None = None
    first_hosts: tuple[str, ...] = ()
    sources: tuple[str, str, str] = PET_SOURCES
    world_size: int | None = None
    extra_tags: tuple[tuple[str, str], ...] = ()


class Scheduler:
    """One engine that starts training processes: ``detect`` says whether this process runs under it,
    ``read`` what layout it gives. Subclasses set :attr:`name` (``llmeff.scheduler.name``) and never
    raise from ``detect``; ``read`` raises only what its docstring names."""

    name: str = ""

    def detect(self, env: Mapping[str, str]) -> bool:
        """True when ``env`` (and, for engines that start workers in-process, this process) is this engine's."""
        raise NotImplementedError

    def read(self, env: Mapping[str, str], run: Runner | None = None) -> Placement:
        """The :class:`Placement` this engine gives (call after :meth:`detect` said True).

        Args:
            env: the environment.
            run: runs the engine's command-line tools (``scontrol``); tests pass a fake.
        """
        raise NotImplementedError


def env_int(env: Mapping[str, str], *keys: str) -> int | None:
    """The first of ``keys`` in ``env`` that holds a non-negative integer, else None."""
    for k in keys:
        v = (env.get(k) or "").strip()
        if v.isdigit():
            return int(v)
    return None
