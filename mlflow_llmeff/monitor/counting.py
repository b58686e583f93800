"""Token counting on the device: the counts of ``../shared/METRICS.md`` from a batch's tensors.

Counts accumulate in one small int64 tensor on the batch's device, so counting never forces a
host-device synchronization; :meth:`BatchCounter.take` reads (and, across ranks, sums) them at a
window edge.
"""

from __future__ import annotations

from mlflow_llmeff.calc.throughput import Counts

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


class StepTally:
    """What a meter counts between two window edges: tokens of every micro-batch and their losses.

    Batches are counted on their device with :class:`BatchCounter` (no synchronization); counts
    passed as numbers are kept on the host and ride in the same collective at the edge. Losses
    (0-d tensors) are summed on the device too.

    Attributes:
        first_shape: ``(micro batch, seq len, micro-batches in the first step)`` as first seen.
        micro: micro-batches counted in the step in progress.
    """

    _FIELDS = ("tokens", "padded_tokens", "loss_tokens", "samples", "sum_len_sq")

    def __init__(self) -> None:
        self.counter: BatchCounter | None = None
        self.device = None
        self.host = [0] * len(self._FIELDS)
        self.loss_acc = None  # device tensor: sum of tensor losses
        self.loss_acc_n = 0  # how many tensor losses it holds
        self.loss_host = [0.0, 0]  # sum and count of float losses
        self.micro = 0
        self.first_shape: tuple[int, int, int] | None = None

    # ------------------------------------------------------------------------------ counting
    def add_batch(self, batch) -> None:
        """Count a mapping with ``input_ids`` / ``attention_mask`` / ``labels`` ``(B, T)``, or a ``(B, T)`` id tensor."""
        import torch

        if torch.is_tensor(batch):
            ids, mask, labels = batch, None, None
        else:
            get = batch.get if hasattr(batch, "get") else (lambda k: getattr(batch, k, None))
            ids, mask, labels = get("input_ids"), get("attention_mask"), get("labels")
        if mask is not None and (not torch.is_tensor(mask) or mask.dim() > 2):
            mask = None  # 4-D custom masks: count input_ids positions instead
        ref = mask if mask is not None else ids
        if ref is None or not torch.is_tensor(ref):
            return
        if self.counter is None:
            self.counter, self.device = BatchCounter(ref.device), ref.device
        self.counter.add(ids, mask, labels if torch.is_tensor(labels) else None)
        if self.first_shape is None:
            shape = ref.shape if ref.dim() == 2 else (1, ref.shape[-1])
            self.first_shape = (int(shape[0]), int(shape[1]), 0)

    def add_numbers(self, tokens, padded_tokens=None, loss_tokens=None, samples=None, sum_len_sq=None) -> None:
        """Count a micro-batch given as numbers (defaults as in :meth:`EfficiencyMonitor.count`)."""
        t = int(tokens)
        s = int(samples) if samples is not None else 0
        self.host[0] += t
        self.host[1] += int(padded_tokens) if padded_tokens is not None else t
        self.host[2] += int(loss_tokens) if loss_tokens is not None else (t - s if s else t)
        self.host[3] += s
        self.host[4] += int(sum_len_sq) if sum_len_sq is not None else (t * t // s if s else t * t)

    def add_loss(self, loss) -> None:
        """Add one micro-batch's mean loss (a 0-d tensor is summed on its device, unsynchronized)."""
        if hasattr(loss, "detach"):
            import torch

            if self.loss_acc is None:
                self.loss_acc = torch.zeros((), dtype=torch.float64, device=loss.device)
            self.loss_acc += loss.detach().reshape(())
            self.loss_acc_n += 1
        else:
            self.loss_host[0] += float(loss)
            self.loss_host[1] += 1

    def end_step(self) -> None:
        """Close a step: the first step's micro-batch count completes :attr:`first_shape`."""
        if self.first_shape is not None and self.first_shape[2] == 0:
            b, s, _ = self.first_shape
            self.first_shape = (b, s, max(1, self.micro))
        self.micro = 0

    # ------------------------------------------------------------------------------ edges
    def take(self, steps: int, reduce=None) -> Counts:
        """Counts since the last take, summed over ranks by ``reduce`` (a tensor -> tensor sum), and reset."""
        import torch

        host = list(self.host)
        self.host = [0] * len(self._FIELDS)
        if self.counter is not None:
            # BatchCounter's layout: tokens, loss tokens, sum of squared lengths, padded, samples
            in_layout = [host[0], host[2], host[4], host[1], host[3]]

            def with_host(t):
                t = t + torch.tensor(in_layout, dtype=torch.int64, device=t.device)
                return reduce(t) if reduce is not None else t

            return self.counter.take(steps, reduce=with_host)
        t = torch.tensor(host, dtype=torch.int64)
        v = (reduce(t) if reduce is not None else t).tolist()
        return Counts(steps, *[int(x) for x in v])

    def peek_loss(self) -> tuple[float, int]:
        """This rank's (sum, count) of losses since the last take, without resetting (synchronizes)."""
        s, n = self.loss_host
        if self.loss_acc is not None and self.loss_acc_n:
            s, n = s + float(self.loss_acc), n + self.loss_acc_n
        return s, n

    def take_loss(self) -> tuple[float, int]:
        """This rank's (sum, count) of losses since the last take (synchronizes), and reset."""
        s, n = self.loss_host
        if self.loss_acc is not None and self.loss_acc_n:
            s, n = s + float(self.loss_acc), n + self.loss_acc_n
            self.loss_acc.zero_()
            self.loss_acc_n = 0
        self.loss_host = [0.0, 0]
        return s, n

    def peek_tokens(self) -> tuple[int, int]:
        """(tokens, sum of squared lengths) counted on this rank since the last take (synchronizes)."""
        t, sq = (self.counter.peek_tokens() if self.counter is not None else (0, 0))
        return t + self.host[0], sq + self.host[4]
