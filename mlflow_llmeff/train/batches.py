"""Which blocks each rank trains on, step by step, so a resume continues the data order exactly.

Each rank reads only its shard of the training blocks (contiguous, disjoint, split as
``datasets.distributed.split_dataset_by_node`` splits a map-style dataset) through a torch ``DataLoader`` (worker processes,
pinned memory on CUDA, prefetching); the order inside a shard is a fresh seeded permutation per
epoch, so it depends only on ``(seed, world, rank, micro-step)``.
"""

from __future__ import annotations

import itertools

from .data import epoch_permutation


def micro_batches(n: int, micro_batch_size: int, seed: int, start: int, per_epoch: int | None = None):
    """Yield index lists (into this rank's shard of ``n`` blocks) of micro-batches from micro-step ``start`` on.

    Every epoch is a fresh seeded permutation of the shard; micro-step ``k`` takes slice
    ``k mod per_epoch`` of it, so the order depends only on ``(seed, k)`` and resuming at a step
    boundary continues it exactly.

    Args:
        n: blocks in this rank's shard.
        micro_batch_size: blocks per micro-batch.
        seed: data-order seed.
        start: the global micro-step to start at (0 for a new run).
        per_epoch: micro-batches per epoch, the same on every rank (default ``n // micro_batch_size``;
            pass the smallest shard's so ranks with one block more stay in step).

    Raises:
        ValueError: when there are fewer blocks than one micro-batch.
    """
    per_epoch = n // micro_batch_size if per_epoch is None else per_epoch
    if per_epoch < 1:
        raise ValueError(f"{n} training blocks on this rank are fewer than one micro-batch "
                         f"(micro_batch_size={micro_batch_size}); use more text or smaller batches")
    k, cached = start, (None, None)
    while True:
        epoch, off = divmod(k, per_epoch)
        if cached[0] != epoch:
            cached = (epoch, epoch_permutation(n, epoch, seed))
        yield cached[1][off * micro_batch_size: (off + 1) * micro_batch_size].tolist()
        k += 1


def _as_is(batch):
    """The ``DataLoader`` collate function: ``TokenBlocks.__getitems__`` already returns the batch."""
    return batch


def _stream_batches(stream, blocks_cls, seq_len: int, pad_id: int, micro_batch_size: int, start: int):
    """Micro-batches from a packed ``IterableDataset``, epoch after epoch; skips ``start`` micro-batches."""
    import datasets

    def rows():
        for epoch in itertools.count():
            stream.set_epoch(epoch)
            yield from (r["input_ids"] for r in stream)

    it = itertools.islice(rows(), start * micro_batch_size, None)  # a resume re-reads the stream up to its place
    while True:
        chunk = list(itertools.islice(it, micro_batch_size))
        if len(chunk) < micro_batch_size:
            raise ValueError("the streamed dataset yields fewer blocks than one micro-batch")
        yield blocks_cls(datasets.Dataset.from_dict({"input_ids": chunk}), seq_len, pad_id)[:]


class BatchStream:
    """This rank's micro-batches as dicts of ``(B, T)`` tensors on ``device``, from micro-step ``start``.

    Args:
        data: the :class:`~mlflow_llmeff.train.data.PreparedData` (its ``train`` blocks, or stream).
        micro_batch_size: blocks per micro-batch.
        world, rank: data-parallel processes and this one's index.
        seed: data-order seed.
        start: global micro-step to start at (a resume passes ``step * grad_accum``).
        device: where batches go (copied with ``non_blocking`` from pinned memory on CUDA).
        num_workers: ``DataLoader`` worker processes (0: read in this process).
    """

    def __init__(self, data, micro_batch_size: int, world: int, rank: int, seed: int, start: int, device,
                 num_workers: int = 0) -> None:
        import torch

        from .data import TokenBlocks

        self._device = device
        cuda = getattr(device, "type", str(device)) == "cuda"
        if getattr(data, "streaming", False):
            self._it = _stream_batches(data.train, TokenBlocks, data.seq_len, data.pad_id, micro_batch_size, start)
            return
        train = data.train
        shard = train.shard(world, rank)
        per_epoch = (len(train) // world) // micro_batch_size  # the smallest shard's, the same on every rank
        if per_epoch < 1:
            raise ValueError(f"{len(train)} training blocks are fewer than one global micro-batch "
                             f"(micro_batch_size={micro_batch_size} x {world} processes); use more text or "
                             f"smaller batches")
        sampler = micro_batches(len(shard), micro_batch_size, seed, start, per_epoch)
        loader = torch.utils.data.DataLoader(
            shard, batch_sampler=sampler, collate_fn=_as_is, num_workers=num_workers, pin_memory=cuda,
            prefetch_factor=4 if num_workers else None, persistent_workers=num_workers > 0)
        self._it = iter(loader)

    def __next__(self) -> dict:
        batch = next(self._it)
        return {k: v.to(self._device, non_blocking=True) for k, v in batch.items()}

    def __iter__(self):
        return self
