"""Which blocks each rank trains on, step by step, so a resume continues the data order exactly.

The order is one global sequence of micro-batches of the whole data-parallel group, as Megatron-LM's
``MegatronPretrainingSampler`` draws them: every epoch is a fresh seeded permutation of all the
training blocks, global micro-step ``k`` takes the ``micro_batch_size x world`` blocks at slice
``k`` of it, and data-parallel rank ``r`` the ``r``-th ``micro_batch_size`` of those. The blocks a
step trains on therefore depend only on ``(seed, global batch, micro-step)``, not on how the
ranks split them: 2 data-parallel ranks of 4 sequences see the same 8 blocks as one process of
8, so runs of different strategies with the same global batch train on the same tokens in the
same order (and a tensor-parallel group, one data-parallel rank, reads one stream). Each rank
reads its blocks through a torch ``DataLoader`` (worker processes, pinned memory on CUDA,
prefetching). :func:`loss_shares` weighs each micro-batch of a step by its share of the step's
loss-bearing tokens (the loop's token-weighted loss).
"""

from __future__ import annotations

import itertools

from mlflow_llmeff.train.data import epoch_permutation


def micro_batches(n: int, micro_batch_size: int, seed: int, start: int, per_epoch: int | None = None,
                  world: int = 1, rank: int = 0):
    """Yield index lists (into the ``n`` training blocks) of this rank's micro-batches from micro-step ``start`` on.

    Every epoch is a fresh seeded permutation of all ``n`` blocks; global micro-step ``k`` takes
    slice ``k mod per_epoch`` of ``micro_batch_size x world`` blocks of it, and rank ``rank`` its
    ``rank``-th part, so the order depends only on ``(seed, k)`` and the global batch, and resuming
    at a step boundary continues it exactly.

    Args:
        n: training blocks.
        micro_batch_size: blocks per micro-batch per rank.
        seed: data-order seed.
        start: the global micro-step to start at (0 for a new run).
        per_epoch: global micro-batches per epoch (default ``n // (micro_batch_size x world)``).
        world, rank: data-parallel ranks and this one's index.

    Raises:
        ValueError: when there are fewer blocks than one global micro-batch.
    """
    width = micro_batch_size * world
    per_epoch = n // width if per_epoch is None else per_epoch
    if per_epoch < 1:
        raise ValueError(f"{n} training blocks are fewer than one global micro-batch "
                         f"(micro_batch_size={micro_batch_size} x {world} data-parallel ranks); use more text or "
                         "smaller batches")
    k, cached = start, (None, None)
    lo = rank * micro_batch_size
    while True:
        epoch, off = divmod(k, per_epoch)
        if cached[0] != epoch:
            cached = (epoch, epoch_permutation(n, epoch, seed))
        yield cached[1][off * width + lo: off * width + lo + micro_batch_size].tolist()
        k += 1


def document_batch(input_ids, eos_id: int) -> dict:
    """A packed block as padding-free documents: ``position_ids`` restart after each ``eos_id``.

    The ``packing=documents`` view of full blocks (documents joined with EOS): each document keeps
    its own positions and, with no attention mask, Hugging Face models attend within each
    document only (``masking_utils.find_packed_sequence_indices``; the same batch as transformers'
    ``DataCollatorWithFlattening``). The first token of every document carries no label, so no
    loss crosses a boundary. Token counting reads the documents from the positions
    (:class:`~mlflow_llmeff.monitor.counting.BatchCounter`).

    Args:
        input_ids: ``(B, T)`` int64 full blocks.
        eos_id: the end-of-document id (the last token of each document).

    Returns:
        ``{"input_ids", "position_ids", "labels"}``, each ``(B, T)``; ``labels`` is ``-100`` at
        each document's first token.
    """
    import torch

    b, t = input_ids.shape
    starts = torch.ones((b, t), dtype=torch.bool, device=input_ids.device)
    starts[:, 1:] = input_ids[:, :-1] == eos_id
    ar = torch.arange(t, device=input_ids.device).expand(b, t)
    pos = ar - torch.where(starts, ar, torch.zeros_like(ar)).cummax(dim=1).values
    return {"input_ids": input_ids, "position_ids": pos, "labels": input_ids.masked_fill(starts, -100)}


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

    With ``data.documents`` (``packing=documents``) a batch is :func:`document_batch` of its blocks.

    Args:
        data: the :class:`~mlflow_llmeff.train.data.PreparedData` (its ``train`` blocks, or stream).
        micro_batch_size: blocks per micro-batch.
        world, rank: data-parallel ranks and this one's data-parallel index (tensor-parallel
            peers share it and read the same batches).
        seed: data-order seed.
        start: global micro-step to start at (a resume passes ``step * grad_accum``).
        device: where batches go (copied with ``non_blocking`` from pinned memory on CUDA).
        num_workers: ``DataLoader`` worker processes (0: read in this process).
    """

    def __init__(self, data, micro_batch_size: int, world: int, rank: int, seed: int, start: int, device,
                 num_workers: int = 0) -> None:
        import torch

        from mlflow_llmeff.train.data import TokenBlocks

        self._device = device
        self._eos = data.eos_id if getattr(data, "documents", False) else None
        cuda = getattr(device, "type", str(device)) == "cuda"
        if getattr(data, "streaming", False):
            self._it = _stream_batches(data.train, TokenBlocks, data.seq_len, data.pad_id, micro_batch_size, start)
            return
        train = data.train
        sampler = micro_batches(len(train), micro_batch_size, seed, start, world=world, rank=rank)
        loader = torch.utils.data.DataLoader(
            train, batch_sampler=sampler, collate_fn=_as_is, num_workers=num_workers, pin_memory=cuda,
            prefetch_factor=4 if num_workers else None, persistent_workers=num_workers > 0)
        self._it = iter(loader)

    def __next__(self) -> dict:
        batch = next(self._it)
        if self._eos is not None:  # packing=documents: positions restart after each EOS, no mask
            batch = document_batch(batch["input_ids"], self._eos)
        return {k: v.to(self._device, non_blocking=True) for k, v in batch.items()}

    def __iter__(self):
        return self


def _loss_tokens(batch):
    """Loss-bearing tokens of a micro-batch as a 0-d tensor on its device (no sync): ``labels[:, 1:] != -100``
    (transformers shifts the labels by one), else each row's real tokens less one, else ``B x (T - 1)``."""
    import torch

    labels, mask = batch.get("labels"), batch.get("attention_mask")
    if labels is not None:
        return (labels[..., 1:] != -100).sum()
    if mask is not None:
        return (mask.sum(dim=-1) - 1).clamp(min=0).sum()
    ids = batch["input_ids"]
    return torch.tensor(ids.shape[0] * (ids.shape[-1] - 1), device=ids.device)


def _on_host(batch) -> bool:
    """True when every tensor of the micro-batch is a CPU tensor (reading a count from it syncs nothing)."""
    return all(getattr(v, "is_cpu", False) for v in batch.values())


def loss_token_counts(micro: list) -> list:
    """Each micro-batch's loss-bearing tokens (:func:`_loss_tokens`): host ints where every micro-batch is on
    the CPU (read at once, nothing to wait for), else 0-d tensors on their device (no sync). The loop counts
    them once a micro-batch and hands them both to :func:`loss_shares` and to the meter
    (``EfficiencyMonitor.count(batch, loss_tokens=...)``), which then does not compare the labels again."""
    if all(_on_host(b) for b in micro):
        return [int(_loss_tokens(b)) for b in micro]
    return [_loss_tokens(b) for b in micro]


def loss_shares(micro: list, world: int, dp: int, counts: list | None = None):
    """Each micro-batch's share of the optimizer step's loss-bearing tokens, counted over all its micro-batches
    and data-parallel ranks, so the step's loss is token-weighted: the summed loss over every loss-bearing
    token of the step divided by their count, never a mean of micro-batch means (docs/formulas.md, "Gradient
    accumulation: one token-weighted loss"; transformers' Trainer since 4.46 passes ``num_items_in_batch``
    for the same reason).

    Args:
        micro: the step's micro-batches on this rank (mappings with ``labels`` ``(B, T)``).
        world: processes of the job; dp: data-parallel ranks among them (tensor-parallel peers hold the
            same micro-batches and count them ``world / dp`` times, divided out here).
        counts: :func:`loss_token_counts` of ``micro`` when the caller has them (default: counted here).

    Returns:
        ``(shares, dp)``: one 0-d float64 tensor per micro-batch (a Python float where the micro-batches are
        on the CPU and ``dp`` is 1: the same value, without a dozen tiny tensor operations a step), ``n_i / N`` (``N``: the step's loss-bearing tokens
        over every micro-batch and data-parallel rank, at least 1), and ``dp``. A micro-batch's mean loss x
        ``n_i / N`` x ``dp`` summed over this rank's micro-batches is the step loss this rank reports: its
        mean over ranks is the token-weighted loss of the step. With more than one data-parallel rank ``N`` is
        one all-reduce of a scalar per step (8 bytes; no host sync).
    """
    import torch

    counts = loss_token_counts(micro) if counts is None else counts
    on_host = all(isinstance(c, int) for c in counts)  # CPU micro-batches: the counts were read, no device busy
    if dp == 1 and on_host:
        total_host = max(sum(counts), 1)
        return [x / total_host for x in counts], dp  # the float64 quotients the tensors would hold
    n = (torch.tensor(counts, dtype=torch.float64) if on_host
         else torch.stack([c.to(torch.float64) for c in counts]))  # (grad_accum,)
    total = n.sum()
    if dp > 1:  # (dp = 1: the ranks are tensor-parallel copies holding the same micro-batches)
        import torch.distributed as dist

        dist.all_reduce(total)  # every rank's micro-batches; tensor-parallel copies counted world/dp times
        total = total * dp / world
    total = total.clamp(min=1.0)
    return [x / total for x in n], dp
