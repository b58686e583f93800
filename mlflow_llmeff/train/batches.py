"""Which blocks each rank trains on, step by step, so a resume continues the data order exactly."""

from __future__ import annotations

from .data import epoch_order


def micro_batches(n: int, micro_batch_size: int, world: int, rank: int, seed: int, start: int):
    """Yield index lists of this rank's micro-batches from global micro-step ``start`` on.

    Every epoch is a fresh seeded permutation; micro-step ``k`` of rank ``r`` takes the
    ``(k * world + r)``-th slice of ``micro_batch_size`` samples, so data order depends only on
    ``(seed, k)`` and resuming at a step boundary continues it exactly.

    Raises:
        ValueError: when there are fewer blocks than one global micro-batch.
    """
    per_epoch = n // (micro_batch_size * world)
    if per_epoch < 1:
        raise ValueError(f"{n} training blocks are fewer than one global micro-batch "
                         f"(micro_batch_size={micro_batch_size} x {world} processes); use more text or smaller batches")
    k, cached = start, (None, None)
    while True:
        epoch, off = divmod(k, per_epoch)
        if cached[0] != epoch:
            cached = (epoch, epoch_order(n, epoch, seed))
        base = (off * world + rank) * micro_batch_size
        yield cached[1][base: base + micro_batch_size]
        k += 1


class BatchStream:
    """This rank's micro-batches as dicts of ``(B, T)`` tensors on ``device``, from micro-step ``start``."""

    def __init__(self, blocks, micro_batch_size: int, world: int, rank: int, seed: int, start: int, device) -> None:
        self._tensors = blocks[:]
        self._indices = micro_batches(len(blocks), micro_batch_size, world, rank, seed, start)
        self._device = device

    def __next__(self) -> dict:
        idx = next(self._indices)
        return {k: v[idx].to(self._device, non_blocking=True) for k, v in self._tensors.items()}

    def __iter__(self):
        return self
