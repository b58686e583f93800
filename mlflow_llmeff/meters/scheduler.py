"""Where a job runs under a scheduler: its layout (machines, this machine's rank, machine 0's address)
and its ``llmeff.scheduler.*`` tags.

A reader of the environment, no MLflow: :func:`read` asks each engine of
:mod:`mlflow_llmeff.meters.schedulers` (one class per engine, ``detect`` and ``read``: SLURM,
Ray Train, Kubeflow Trainer v2, a PyTorchJob or torchrun) and returns the first one's
:class:`Placement` (or None outside every one), :func:`layout` checks given options against it
(one-line errors) and fills the ones not given, :func:`tags` names it for the run. What each engine
gives is in its module's docstring.
"""

from __future__ import annotations

import os
import sys
from typing import Mapping

from mlflow_llmeff import names
from mlflow_llmeff.meters import schedulers
from mlflow_llmeff.meters.schedulers.base import Placement, Runner
from mlflow_llmeff.meters.schedulers.slurm import expand_hostlist, hostnames, queue_wait_s

__all__ = ["Placement", "read", "layout", "tags", "expand_hostlist", "hostnames", "queue_wait_s", "cached"]


def read(env: Mapping[str, str] | None = None, run: Runner | None = None) -> Placement | None:
    """The placement of the first engine of :data:`~mlflow_llmeff.meters.schedulers.ENGINES` that detects
    this process (Ray Train, SLURM, Kubeflow Trainer v2, a PyTorchJob or torchrun), or None.

    Args:
        env: the environment (default ``os.environ``).
        run: runs ``scontrol`` (default ``subprocess.run``; tests pass a fake); its failure leaves the
            figure it gives absent.

    Raises:
        ValueError: a variable the engine's launcher would refuse (``PET_NPROC_PER_NODE=many``).
    """
    env = os.environ if env is None else env
    engine = schedulers.detect(env)
    return engine.read(env, run) if engine is not None else None


_CACHE: dict[tuple, Placement | None] = {}


def cached() -> Placement | None:
    """:func:`read` of this process's environment, once per environment (the monitor's tags); None on
    any error (a tag is never worth a failed run)."""
    key = tuple(sorted((k, v) for k, v in os.environ.items()
                       if k.startswith(("SLURM_", "PET_", "MASTER_", "JOB_COMPLETION_INDEX"))))
    key += (("ray.train", "ray.train" in sys.modules),)  # a Ray worker imported it before its loop
    if key not in _CACHE:
        try:
            _CACHE[key] = read()
        except Exception:  # noqa: BLE001 - a reader of the environment never stops a run
            _CACHE[key] = None
    return _CACHE[key]


def layout(p: Placement | None, *, num_machines: int, machine_rank: int, main_process_ip: str,
           main_process_port: int | None = None, defaults: tuple[int, int, str] = (1, 0, "")) -> dict:
    """The machines' layout with the scheduler's values where none was given.

    A value equal to its default (``defaults``: ``num_machines`` 1, ``machine_rank`` 0,
    ``main_process_ip`` '') counts as not given and takes the scheduler's; a given one must agree.

    Returns:
        ``{"num_machines", "machine_rank", "main_process_ip"}`` (and ``"main_process_port"`` when the
        scheduler gives one and none was given), or the given values when ``p`` has no layout.

    Raises:
        ValueError: one line naming the given option, the scheduler's value and where it comes from:
            a different number of machines or machine rank, machine 0 named as another node of the
            job, or a SLURM step with more tasks than nodes.
    """
    given = {"num_machines": num_machines, "machine_rank": machine_rank, "main_process_ip": main_process_ip}
    if p is None or p.num_machines is None:
        return given
    src = p.sources
    if p.tasks is not None and p.tasks != p.num_machines:
        raise ValueError(f"the SLURM step runs {p.tasks} tasks on {p.num_machines} nodes; llmeff train starts each "
                         "machine's processes itself (num_processes): run one task per node "
                         "(srun --ntasks-per-node=1)")
    if num_machines != defaults[0] and num_machines != p.num_machines:
        raise ValueError(f"num_machines={num_machines} contradicts {p.scheduler}'s {p.num_machines} "
                         f"({src[0]}); leave num_machines out (it defaults to {p.num_machines}) or run on "
                         f"{num_machines} nodes")
    if machine_rank != defaults[1] and machine_rank != p.machine_rank:
        raise ValueError(f"machine_rank={machine_rank} contradicts {p.scheduler}'s {p.machine_rank} ({src[1]}) "
                         "on this node; leave machine_rank out")
    if main_process_ip and p.main_process_host and main_process_ip != p.main_process_host \
            and main_process_ip in p.first_hosts:
        raise ValueError(f"main_process_ip={main_process_ip!r} names node {p.first_hosts.index(main_process_ip)} of "
                         f"the job, but machine 0 is {p.main_process_host!r} (the first host of {src[2]}); leave "
                         "main_process_ip out or give an address of that node")
    out = {"num_machines": p.num_machines, "machine_rank": p.machine_rank,
           "main_process_ip": main_process_ip or p.main_process_host or ""}
    if p.main_process_port is not None:
        out["main_process_port"] = p.main_process_port
    return out


def tags(p: Placement | None) -> dict[str, str]:
    """``llmeff.scheduler.*`` of ``p`` (``{}`` outside a scheduler); a figure the scheduler did not
    give is left out."""
    if p is None:
        return {}
    out = {names.SCHEDULER_NAME: p.scheduler}
    for key, value in ((names.SCHEDULER_JOB_ID, p.job_id), (names.SCHEDULER_NODES, p.nodes),
                       (names.SCHEDULER_NODE_LIST, p.node_list), (names.SCHEDULER_RESTART_COUNT, p.restart_count),
                       (names.SCHEDULER_PARTITION, p.partition)):
        if value is not None:
            out[key] = str(value)
    if p.queue_wait_s is not None:
        out[names.SCHEDULER_QUEUE_WAIT_S] = f"{p.queue_wait_s:.0f}"
    out.update(dict(p.extra_tags))
    return out
