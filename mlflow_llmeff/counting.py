"""Token counting on the device: the counts of ``../shared/METRICS.md`` from a batch's tensors.

Counts accumulate in one small int64 tensor on the batch's device, so counting never forces a
host-device synchronization; :meth:`BatchCounter.take` reads (and, across ranks, sums) them at a
window edge.
"""

from __future__ import annotations

from .throughput import Counts

# Positions in the accumulator tensor.
_TOKENS, _PADDED, _LOSS, _SAMPLES, _SUM_LEN_SQ = range(5)


class BatchCounter:
    """Accumulates non-padding, padded and loss-bearing tokens, samples and ``sum(l^2)``.

    Args:
        device: torch device of the accumulator (the batches' device).
    """

    def __init__(self, device="cpu") -> None:
        import torch

        self._acc = torch.zeros(5, dtype=torch.int64, device=device)

    def add(self, input_ids=None, attention_mask=None, labels=None) -> None:
        """Count one micro-batch.

        Args:
            input_ids: ``(B, T)`` token ids (used when there is no attention mask).
            attention_mask: ``(B, T)``, 1 on real tokens, 0 on padding; when absent every position
                is a real token.
            labels: ``(B, T)`` with ``-100`` where no loss is taken; loss-bearing tokens are
                ``labels[:, 1:] != -100`` (causal shift). Absent: non-padding tokens minus one per
                sequence.
        """
        import torch

        ref = attention_mask if attention_mask is not None else input_ids
        if ref is None:
            raise ValueError("BatchCounter.add needs input_ids or attention_mask")
        if ref.dim() == 1:
            ref = ref.unsqueeze(0)
        mask = attention_mask if attention_mask is not None else torch.ones_like(ref)
        if mask.dim() == 1:
            mask = mask.unsqueeze(0)
        lens = mask.sum(dim=1).to(torch.int64)
        acc = self._acc
        acc[_TOKENS] += lens.sum()
        acc[_PADDED] += mask.numel()
        if labels is not None:
            lab = labels if labels.dim() == 2 else labels.unsqueeze(0)
            acc[_LOSS] += (lab[:, 1:] != -100).sum()
        else:
            acc[_LOSS] += (lens - 1).clamp(min=0).sum()
        acc[_SAMPLES] += mask.shape[0]
        acc[_SUM_LEN_SQ] += (lens * lens).sum()

    def take(self, steps: int, reduce=None) -> Counts:
        """Return the counts since the last take (summed over ranks by ``reduce``) and reset.

        Args:
            steps: optimizer steps the counts cover.
            reduce: callable summing a tensor over data-parallel ranks (e.g.
                ``lambda t: accelerator.reduce(t, "sum")``); None for one process.
        """
        t = reduce(self._acc) if reduce is not None else self._acc
        v = t.tolist()
        self._acc.zero_()
        return Counts(steps=steps, tokens=v[_TOKENS], padded_tokens=v[_PADDED], loss_tokens=v[_LOSS],
                      samples=v[_SAMPLES], sum_len_sq=v[_SUM_LEN_SQ])

    def peek_tokens(self) -> tuple[int, int]:
        """(tokens, sum of squared lengths) counted locally since the last take (synchronizes)."""
        return int(self._acc[_TOKENS]), int(self._acc[_SUM_LEN_SQ])
