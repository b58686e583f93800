"""Token counting on the device: the counts of ``../shared/METRICS.md`` from a batch's tensors.

Counts accumulate in one small int64 tensor on the batch's device, so counting never forces a
host-device synchronization; :meth:`BatchCounter.take` reads (and, across ranks, sums) them at a
window edge.
"""

from __future__ import annotations

from .throughput import Counts

# Positions in the on-device accumulator; padded positions and samples are shapes, kept as ints.
_TOKENS, _LOSS, _SUM_LEN_SQ = range(3)


class BatchCounter:
    """Accumulates non-padding, padded and loss-bearing tokens, samples and ``sum(l^2)``.

    Args:
        device: torch device of the accumulator (the batches' device).
    """

    def __init__(self, device="cpu") -> None:
        import torch

        self._acc = torch.zeros(3, dtype=torch.int64, device=device)
        self._padded = 0
        self._samples = 0

    def add(self, input_ids=None, attention_mask=None, labels=None) -> None:
        """Count one micro-batch (a few fused tensor ops on its device, no synchronization).

        Args:
            input_ids: ``(B, T)`` token ids (used when there is no attention mask).
            attention_mask: ``(B, T)``, 1 on real tokens, 0 on padding; when absent every position
                is a real token.
            labels: ``(B, T)`` with ``-100`` where no loss is taken; loss-bearing tokens are
                ``labels[:, 1:] != -100`` (causal shift). Absent: non-padding tokens minus one per
                sequence.

        Raises:
            ValueError: when neither ``input_ids`` nor ``attention_mask`` is given.
        """
        import torch

        ref = attention_mask if attention_mask is not None else input_ids
        if ref is None:
            raise ValueError("BatchCounter.add needs input_ids or attention_mask")
        if ref.dim() == 1:
            ref = ref.unsqueeze(0)
        b, t = ref.shape
        if attention_mask is not None:
            lens = ref.sum(dim=1, dtype=torch.int64)
            tokens = lens.sum()
            sum_sq = (lens * lens).sum()
        else:  # every position is real: all three counts are shapes
            lens = None
            tokens = torch.tensor(b * t, device=self._acc.device)
            sum_sq = torch.tensor(b * t * t, device=self._acc.device)
        if labels is not None:
            lab = labels if labels.dim() == 2 else labels.unsqueeze(0)
            loss = (lab[:, 1:] != -100).sum()
        else:
            loss = (lens - 1).clamp(min=0).sum() if lens is not None else torch.tensor(b * (t - 1), device=self._acc.device)
        self._acc += torch.stack((tokens, loss, sum_sq))
        self._padded += b * t
        self._samples += b

    def take(self, steps: int, reduce=None) -> Counts:
        """Return the counts since the last take (summed over ranks by ``reduce``) and reset.

        Args:
            steps: optimizer steps the counts cover.
            reduce: callable summing a tensor over data-parallel ranks (e.g.
                ``lambda t: accelerator.reduce(t, "sum")``); None for one process.
        """
        import torch

        local = torch.cat((self._acc, torch.tensor([self._padded, self._samples], dtype=torch.int64,
                                                   device=self._acc.device)))
        v = (reduce(local) if reduce is not None else local).tolist()
        self._acc.zero_()
        self._padded = self._samples = 0
        return Counts(steps=steps, tokens=v[_TOKENS], padded_tokens=v[3], loss_tokens=v[_LOSS],
                      samples=v[4], sum_len_sq=v[_SUM_LEN_SQ])

    def peek_tokens(self) -> tuple[int, int]:
        """(tokens, sum of squared lengths) counted locally since the last take (synchronizes)."""
        return int(self._acc[_TOKENS]), int(self._acc[_SUM_LEN_SQ])
