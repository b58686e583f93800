"""The few collectives the meter needs: device synchronization and sums / maxima over ranks.

Everything goes through ``torch.distributed`` when a process group is initialized (Accelerate,
torchrun and ``init_process_group`` all make one), so the meter works under any launcher. Every
rank must make the same calls in the same order; a caller that is on one rank only passes
``collective=False`` to the meter instead.
"""

from __future__ import annotations

__all__ = ["process_group", "world_and_rank", "synchronize", "all_reduce", "reduce_tensor", "all_gather_object"]


def process_group():
    """``torch.distributed`` when a process group is initialized, else None (never raises)."""
    try:
        import torch.distributed as dist

        return dist if dist.is_available() and dist.is_initialized() else None
    except Exception:  # noqa: BLE001
        return None


def world_and_rank() -> tuple[int, int]:
    """``(world size, global rank)``; ``(1, 0)`` without a process group."""
    dist = process_group()
    return (dist.get_world_size(), dist.get_rank()) if dist else (1, 0)


def synchronize(device) -> None:
    """Wait for the device's queued work (CUDA); a no-op on CPU, where work is synchronous."""
    if device is not None and getattr(device, "type", None) == "cuda":
        import torch

        torch.cuda.synchronize(device)


def _reduce_device():
    """Device for collectives: the current CUDA device under NCCL, else the CPU (gloo)."""
    import torch

    dist = process_group()
    if dist is not None and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce(values: list[float], op: str = "sum", *, dtype: str = "float64") -> list[float]:
    """Sum (``op="sum"``) or maximum (``"max"``) of ``values`` element-wise over all ranks.

    Args:
        values: this rank's numbers (same length on every rank).
        op: ``sum`` or ``max``.
        dtype: ``float64`` or ``int64`` (exact integer counts).

    Returns:
        The reduced values (this rank's values unchanged without a process group).
    """
    dist = process_group()
    if dist is None or dist.get_world_size() == 1:
        return list(values)
    import torch

    t = torch.tensor(values, dtype=getattr(torch, dtype), device=_reduce_device())
    dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return t.tolist()


def reduce_tensor(t):
    """Sum an integer tensor over ranks in place on the collective device; returns the result."""
    dist = process_group()
    if dist is None or dist.get_world_size() == 1:
        return t
    t = t.to(_reduce_device())
    dist.all_reduce(t)
    return t


def all_gather_object(obj) -> list:
    """Every rank's ``obj`` (picklable), in rank order; ``[obj]`` without a process group.

    ``torch.distributed.all_gather_object`` (pickled through the collective device). For small,
    rare exchanges (the devices each rank owns, once per run), not for per-step data.
    """
    dist = process_group()
    if dist is None or dist.get_world_size() == 1:
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out
