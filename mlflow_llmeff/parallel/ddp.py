"""``single`` (one process) and ``ddp`` (data parallelism: every rank a replica, gradients
all-reduced), through Accelerate's own ``prepare`` (``DistributedDataParallel``)."""

from __future__ import annotations

from mlflow_llmeff.calc.comm import CommEstimate, TrafficShape, bus_factor
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

    def bus_bytes(self, shape: TrafficShape, degrees: Degrees) -> CommEstimate:
        """One all-reduce of the fp32 gradients per step (``no_sync`` inside accumulation); DDP's small
        buffer broadcasts are left out."""
        return CommEstimate({"gradient all-reduce": bus_factor("all_reduce", degrees.dp) * 4 * float(shape.params)})

    def wraps(self, module) -> bool:
        return type(module).__name__ == "DistributedDataParallel"


STRATEGIES = (Single(), DDP())
