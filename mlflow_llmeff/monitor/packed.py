"""Documents in packed batches, on the device and without a host read: where each document starts, and
``sum(l^2)`` with the number of documents (:class:`~mlflow_llmeff.monitor.counting.BatchCounter`)."""

from __future__ import annotations

__all__ = ["packed_starts", "segments_len_sq"]


def segments_len_sq(starts, real):
    """``(sum(l_i^2), documents)`` of rows cut into documents at ``starts`` (device tensors, no sync).

    A document of length ``l`` holds positions ``p = 0 .. l-1`` and ``sum_p (2p + 1) = l^2``, so
    ``sum(l_i^2)`` is the sum of ``2p + 1`` over real tokens, with ``p`` the distance to the last
    start at or before each token (a running max over the row): fixed shapes, no ``bincount`` and
    no host read.

    Args:
        starts: ``(B, T)`` bool, True where a document begins (the first real token of each row
            must be True).
        real: ``(B, T)`` bool, True on real (non-padding) tokens.
    """
    import torch

    t = starts.shape[1]
    ar = torch.arange(t, device=starts.device).expand_as(starts)
    last = torch.where(starts, ar, torch.zeros_like(ar)).cummax(dim=1).values
    odd = (2 * (ar - last) + 1) * real
    return odd.sum(dtype=torch.int64), (starts & real).sum(dtype=torch.int64)


def packed_starts(position_ids=None, seq_idx=None, shape=None):
    """``(B, T)`` bool document starts from ``seq_idx`` (a change of index) or ``position_ids``
    (anything but ``previous + 1``), or None when neither has the batch's 2-D shape."""
    import torch

    for marks, step in ((seq_idx, 0), (position_ids, 1)):
        if torch.is_tensor(marks) and not marks.is_floating_point():
            if marks.dim() == 1:
                marks = marks.unsqueeze(0)
            if tuple(marks.shape) != tuple(shape):
                continue
            starts = torch.ones(marks.shape, dtype=torch.bool, device=marks.device)
            starts[:, 1:] = marks[:, 1:] != marks[:, :-1] + step
            return starts
    return None
