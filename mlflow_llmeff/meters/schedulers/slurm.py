"""SLURM: ``srun`` runs one ``llmeff train`` per node, which starts that node's processes itself.

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
"""

from __future__ import annotations

import re
import subprocess
import time
from typing import Mapping

from mlflow_llmeff.meters.schedulers.base import Placement, Runner, Scheduler, env_int

__all__ = ["Slurm", "expand_hostlist", "hostnames", "queue_wait_s"]

SOURCES = ("SLURM_STEP_NUM_NODES", "SLURM_NODEID", "SLURM_STEP_NODELIST")


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


class Slurm(Scheduler):
    """A SLURM job (``SLURM_JOB_ID``), in its batch script or inside an ``srun`` step."""

    name = "slurm"

    def detect(self, env: Mapping[str, str]) -> bool:
        return bool(env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID"))

    def read(self, env: Mapping[str, str], run: Runner | None = None) -> Placement:
        """The job's tags, and the step's layout inside ``srun`` (see the module docstring); scontrol's
        failure leaves the figure it gives absent."""
        job = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
        node_list = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        common = dict(scheduler=self.name, job_id=job, nodes=env_int(env, "SLURM_JOB_NUM_NODES", "SLURM_NNODES"),
                      node_list=node_list, restart_count=env_int(env, "SLURM_RESTART_COUNT") or 0,
                      partition=env.get("SLURM_JOB_PARTITION") or None,
                      queue_wait_s=queue_wait_s(job, run) if job else None, sources=SOURCES)
        step_nodes = env_int(env, "SLURM_STEP_NUM_NODES")
        if step_nodes is None:
            return Placement(**common, why_no_layout="a SLURM batch script outside srun: this machine alone "
                                                    "(srun llmeff train runs it on every node of the job)")
        step_list = env.get("SLURM_STEP_NODELIST") or node_list or ""
        hosts = hostnames(step_list, run) if step_list else []
        return Placement(**common, num_machines=step_nodes, machine_rank=env_int(env, "SLURM_NODEID") or 0,
                         main_process_host=hosts[0] if hosts else None,
                         tasks=env_int(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"), first_hosts=tuple(hosts))
