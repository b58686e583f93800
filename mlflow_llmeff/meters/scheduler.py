"""Where a job runs under a scheduler: SLURM's or a PyTorchJob's environment read as the machines'
layout (machines, this machine's rank, machine 0's address) and as ``llmeff.scheduler.*`` tags.

A reader of the environment, no MLflow: :func:`read` returns a :class:`Placement` (or None outside a
scheduler), :func:`layout` checks given options against it (one-line errors) and fills the ones not
given, :func:`tags` names it for the run.

SLURM (``srun`` runs one ``llmeff train`` per node, which starts that node's processes itself):

* inside a job step (``SLURM_STEP_NUM_NODES`` set; ``srun``): machines = ``SLURM_STEP_NUM_NODES``,
  this machine's rank = ``SLURM_NODEID``, machine 0 = the first host of ``SLURM_STEP_NODELIST``
  expanded by ``scontrol show hostnames`` (the batch host comes first); a step with more tasks than
  nodes is refused (``srun --ntasks-per-node=1``);
* in the batch script itself (no step): the job is tagged, the layout is this one machine (the
  other nodes run nothing until an ``srun``);
* tags: ``SLURM_JOB_ID``, ``SLURM_JOB_NUM_NODES`` / ``SLURM_NNODES``, ``SLURM_JOB_NODELIST``,
  ``SLURM_RESTART_COUNT`` (0 until a requeue), ``SLURM_JOB_PARTITION``, and the queue wait of this
  start, ``StartTime - SubmitTime`` of ``scontrol show job`` (a requeue resets SubmitTime, so after
  one it is the wait of the requeued start).

Kubeflow's PyTorchJob (training-operator v1, ``pkg/controller.v1/pytorch/envvar.go``) sets on every
pod ``PET_NNODES`` (the replicas), ``PET_NODE_RANK`` (master 0, worker i: i + 1), ``PET_NPROC_PER_NODE``,
``MASTER_ADDR`` and ``MASTER_PORT`` (the master's service), ``WORLD_SIZE`` (replicas x processes) and
``RANK`` (the node rank): machines = ``PET_NNODES``, rank = ``PET_NODE_RANK`` (else ``GROUP_RANK``,
torchrun's node rank), machine 0 = ``PET_MASTER_ADDR`` or ``MASTER_ADDR``. Inside a worker that a
launcher started (``LOCAL_RANK`` set) the launcher's own ``RANK`` / ``WORLD_SIZE`` are never read as
a layout.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from dataclasses import dataclass
from typing import Callable, Mapping

from mlflow_llmeff import names

__all__ = ["Placement", "read", "layout", "tags", "expand_hostlist", "hostnames", "queue_wait_s", "cached"]

Runner = Callable[..., subprocess.CompletedProcess]


@dataclass(frozen=True)
class Placement:
    """Where this process runs under a scheduler.

    Attributes:
        scheduler: ``slurm`` or ``kubernetes`` (a PyTorchJob), or ``torchrun`` (the same variables
            outside Kubernetes).
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


def _int(env: Mapping[str, str], *keys: str) -> int | None:
    for k in keys:
        v = (env.get(k) or "").strip()
        if v.isdigit():
            return int(v)
    return None


def expand_hostlist(text: str) -> list[str]:
    """SLURM's compressed host list, e.g. ``"gpu-[01-03,07],login"`` -> ``gpu-01 gpu-02 gpu-03 gpu-07 login``
    (zero padding kept; one bracket group per host name: what ``scontrol show hostnames`` prints for it).

    Raises:
        ValueError: for a malformed list (an open bracket, a range running backwards).
    """
    out: list[str] = []
    for part in re.findall(r"[^,\[]+(?:\[[^\]]*\])?[^,]*", text.strip()):
        m = re.fullmatch(r"([^\[\]]*)\[([^\]]*)\]([^\[\]]*)", part)
        if m is None:
            if "[" in part or "]" in part:
                raise ValueError(f"host list {text!r} is malformed at {part!r}")
            out.append(part)
            continue
        head, body, tail = m.groups()
        for item in body.split(","):
            lo, _, hi = item.partition("-")
            if not lo.isdigit() or (hi and not hi.isdigit()):
                raise ValueError(f"host list {text!r}: {item!r} is not a number or range")
            if hi and int(hi) < int(lo):
                raise ValueError(f"host list {text!r}: the range {item!r} runs backwards")
            for n in range(int(lo), int(hi or lo) + 1):
                out.append(f"{head}{n:0{len(lo)}d}{tail}")
    return out


def hostnames(node_list: str, run: Runner | None = None) -> list[str]:
    """The hosts of a SLURM node list, in SLURM's order: ``scontrol show hostnames LIST``, else (no
    scontrol here, or it failed) :func:`expand_hostlist`. ``run``: runs scontrol (default ``subprocess.run``)."""
    run = run or subprocess.run
    try:
        r = run(["scontrol", "show", "hostnames", node_list], capture_output=True, text=True, timeout=10)
        hosts = r.stdout.split() if r.returncode == 0 else []
        if hosts:
            return hosts
    except (OSError, subprocess.SubprocessError):
        pass
    return expand_hostlist(node_list)


def _slurm_time(text: str) -> float | None:
    try:
        return time.mktime(time.strptime(text, "%Y-%m-%dT%H:%M:%S"))
    except (TypeError, ValueError):
        return None


def queue_wait_s(job_id: str, run: Runner | None = None) -> float | None:
    """Seconds this start of ``job_id`` waited: ``StartTime - SubmitTime`` of ``scontrol show job``
    (whole seconds; a requeue sets SubmitTime anew); None when scontrol cannot say."""
    run = run or subprocess.run
    try:
        r = run(["scontrol", "show", "job", "-o", str(job_id)], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    fields = dict(re.findall(r"(\w+)=(\S*)", r.stdout if r.returncode == 0 else ""))
    submit, start = _slurm_time(fields.get("SubmitTime", "")), _slurm_time(fields.get("StartTime", ""))
    return max(0.0, start - submit) if submit is not None and start is not None else None


def _slurm(env: Mapping[str, str], run: Runner | None) -> Placement:
    job = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
    node_list = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    common = dict(scheduler="slurm", job_id=job, nodes=_int(env, "SLURM_JOB_NUM_NODES", "SLURM_NNODES"),
                  node_list=node_list, restart_count=_int(env, "SLURM_RESTART_COUNT") or 0,
                  partition=env.get("SLURM_JOB_PARTITION") or None,
                  queue_wait_s=queue_wait_s(job, run) if job else None)
    step_nodes = _int(env, "SLURM_STEP_NUM_NODES")
    if step_nodes is None:
        return Placement(**common, why_no_layout="a SLURM batch script outside srun: this machine alone "
                                                "(srun llmeff train runs it on every node of the job)")
    step_list = env.get("SLURM_STEP_NODELIST") or node_list or ""
    hosts = hostnames(step_list, run) if step_list else []
    return Placement(**common, num_machines=step_nodes, machine_rank=_int(env, "SLURM_NODEID") or 0,
                     main_process_host=hosts[0] if hosts else None,
                     tasks=_int(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"), first_hosts=tuple(hosts))


def _elastic(env: Mapping[str, str]) -> Placement | None:
    nnodes = (env.get("PET_NNODES") or "").strip()
    if not nnodes:
        return None
    name = "kubernetes" if env.get("KUBERNETES_SERVICE_HOST") else "torchrun"
    if not nnodes.isdigit():  # an elastic range such as "1:4": the rendezvous decides the machines
        return Placement(scheduler=name, why_no_layout=f"PET_NNODES={nnodes!r} is an elastic range: "
                                                       "llmeff train needs a fixed number of machines")
    port = _int(env, "PET_MASTER_PORT", "MASTER_PORT")
    return Placement(scheduler=name, num_machines=int(nnodes), nodes=int(nnodes),
                     machine_rank=_int(env, "PET_NODE_RANK", "GROUP_RANK") or 0,
                     main_process_host=(env.get("PET_MASTER_ADDR") or env.get("MASTER_ADDR") or None),
                     main_process_port=port, processes_per_node=_int(env, "PET_NPROC_PER_NODE"))


def read(env: Mapping[str, str] | None = None, run: Runner | None = None) -> Placement | None:
    """The scheduler this process runs under (SLURM first, then a PyTorchJob's ``PET_*``), or None.

    Args:
        env: the environment (default ``os.environ``).
        run: runs ``scontrol`` (default ``subprocess.run``; tests pass a fake); its failure leaves the
            figure it gives absent.
    """
    env = os.environ if env is None else env
    if env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID"):
        return _slurm(env, run)
    return _elastic(env)


_CACHE: dict[tuple, Placement | None] = {}


def cached() -> Placement | None:
    """:func:`read` of this process's environment, once per environment (the monitor's tags); None on
    any error (a tag is never worth a failed run)."""
    key = tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith(("SLURM_", "PET_", "MASTER_"))))
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
    src = ("SLURM_STEP_NUM_NODES", "SLURM_NODEID", "SLURM_STEP_NODELIST") if p.scheduler == "slurm" else \
        ("PET_NNODES", "PET_NODE_RANK", "MASTER_ADDR")
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
    return out
