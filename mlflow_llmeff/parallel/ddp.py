"""``single`` (one process) and ``ddp`` (data parallelism: every rank a replica, gradients
all-reduced), through Accelerate's own ``prepare`` (``DistributedDataParallel``)."""

from __future__ import annotations

from mlflow_llmeff.parallel.base import Strategy
from mlflow_llmeff.parallel.degrees import Degrees


class Single(Strategy):
    name = "single"
    summary = "one process, one device"
    needs_launcher = False

    def degrees(self, world: int, *, tp_size: int = 0, dp_shard: int = 0, processes_per_node: int = 0) -> Degrees:
        if world != 1:
            raise ValueError(f"parallelism='single' with {world} processes; use ddp, fsdp, tp or deepspeed_zero*")
        return Degrees()


class DDP(Strategy):
    name = "ddp"
    summary = "data parallel: every rank holds the whole model, gradients all-reduced (DistributedDataParallel)"
    needs_launcher = False  # one process trains alone in the calling process


STRATEGIES = (Single(), DDP())
