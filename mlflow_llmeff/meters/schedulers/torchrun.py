"""torchrun's variables: a Kubeflow PyTorchJob's pods, or ``torchrun`` (``PET_*``) outside Kubernetes.

Kubeflow's PyTorchJob (training-operator v1, ``pkg/controller.v1/pytorch/envvar.go``) sets on every
pod ``PET_NNODES`` (the replicas), ``PET_NODE_RANK`` (master 0, worker i: i + 1), ``PET_NPROC_PER_NODE``,
``MASTER_ADDR`` and ``MASTER_PORT`` (the master's service), ``WORLD_SIZE`` (replicas x processes) and
``RANK`` (the node rank): machines = ``PET_NNODES``, rank = ``PET_NODE_RANK`` (else ``GROUP_RANK``,
torchrun's node rank), machine 0 = ``PET_MASTER_ADDR`` or ``MASTER_ADDR``. Inside a worker that a
launcher started (``LOCAL_RANK`` set) the launcher's own ``RANK`` / ``WORLD_SIZE`` are never read as
a layout.

``PET_NPROC_PER_NODE`` is torchrun's ``--nproc-per-node``: an integer, or ``auto`` / ``cpu`` / ``gpu``,
resolved as torchrun resolves them (:func:`nproc_per_node`).
"""

from __future__ import annotations

from typing import Callable, Mapping

from mlflow_llmeff.meters.schedulers.base import Placement, Runner, Scheduler, env_int

__all__ = ["TorchElastic", "nproc_per_node", "read_pet"]

#: ``PET_NPROC_PER_NODE``'s words torchrun accepts besides an integer.
NPROC_WORDS = ("auto", "cpu", "gpu")


def _accelerators() -> int:
    """Devices of torch's current accelerator this process sees (CUDA, XPU, ...; 0 without one)."""
    import torch

    return torch.accelerator.device_count() if torch.accelerator.is_available() else 0


def _cpus() -> int:
    """CPUs this process may run on (torch's ``torch._utils.cpu_count``: the affinity mask, else all)."""
    import os

    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def nproc_per_node(value: str, accelerators: Callable[[], int] = _accelerators,
                   cpus: Callable[[], int] = _cpus) -> int:
    """Processes per node that torchrun starts for ``--nproc-per-node=value`` (``PET_NPROC_PER_NODE``).

    As ``torch.distributed.run.determine_local_world_size`` (torch 2.13): an integer is itself;
    ``auto`` is the accelerator's device count when one is available, else the CPU count; ``cpu`` the
    CPU count; ``gpu`` the CUDA device count (an error without one).

    Args:
        value: the variable's text.
        accelerators: devices of the available accelerator, 0 without one (default: torch's).
        cpus: CPUs this process may use (default: its affinity mask).

    Raises:
        ValueError: a value torchrun refuses, or ``gpu`` with no device.
    """
    text = value.strip()
    if text.isdigit() and int(text) > 0:
        return int(text)
    if text == "auto":
        return accelerators() or cpus()
    if text == "cpu":
        return cpus()
    if text == "gpu":
        n = accelerators()
        if not n:
            raise ValueError("PET_NPROC_PER_NODE='gpu' but this machine has no accelerator device; "
                             "give a number or auto")
        return n
    raise ValueError(f"PET_NPROC_PER_NODE={value!r} is not accepted; use a positive integer or one of: "
                     f"{', '.join(NPROC_WORDS)}")


def read_pet(env: Mapping[str, str], name: str, *, job_id: str | None = None,
             accelerators: Callable[[], int] = _accelerators, cpus: Callable[[], int] = _cpus) -> Placement:
    """The layout of torchrun's ``PET_*`` variables, tagged as scheduler ``name``.

    Raises:
        ValueError: ``PET_NPROC_PER_NODE`` as :func:`nproc_per_node` refuses it.
    """
    nnodes = (env.get("PET_NNODES") or "").strip()
    if not nnodes.isdigit():  # an elastic range such as "1:4": the rendezvous decides the machines
        return Placement(scheduler=name, job_id=job_id,
                         why_no_layout=f"PET_NNODES={nnodes!r} is an elastic range: "
                                       "llmeff train needs a fixed number of machines")
    nproc = (env.get("PET_NPROC_PER_NODE") or "").strip()
    return Placement(scheduler=name, num_machines=int(nnodes), nodes=int(nnodes), job_id=job_id,
                     machine_rank=env_int(env, "PET_NODE_RANK", "GROUP_RANK") or 0,
                     main_process_host=(env.get("PET_MASTER_ADDR") or env.get("MASTER_ADDR") or None),
                     main_process_port=env_int(env, "PET_MASTER_PORT", "MASTER_PORT"),
                     processes_per_node=nproc_per_node(nproc, accelerators, cpus) if nproc else None,
                     sources=("PET_NNODES", "PET_NODE_RANK",
                              "PET_MASTER_ADDR" if env.get("PET_MASTER_ADDR") else "MASTER_ADDR"))


class TorchElastic(Scheduler):
    """A PyTorchJob's pod (``kubernetes``) or torchrun's agent (``torchrun``): ``PET_NNODES`` set."""

    name = "torchrun"

    def __init__(self, accelerators: Callable[[], int] = _accelerators, cpus: Callable[[], int] = _cpus) -> None:
        self.accelerators, self.cpus = accelerators, cpus

    def detect(self, env: Mapping[str, str]) -> bool:
        return bool((env.get("PET_NNODES") or "").strip())

    def read(self, env: Mapping[str, str], run: Runner | None = None) -> Placement:
        """See the module docstring.

        Raises:
            ValueError: ``PET_NPROC_PER_NODE`` torchrun would refuse.
        """
        name = "kubernetes" if env.get("KUBERNETES_SERVICE_HOST") else self.name
        return read_pet(env, name, accelerators=self.accelerators, cpus=self.cpus)
