"""Token counting on the device: the counts of ``docs/formulas.md`` ("Counting rules") from a batch.

Counts accumulate in one small int64 tensor on the batch's device, so counting never forces a
host-device synchronization; :meth:`BatchCounter.take` reads (and, across ranks, sums) them at a
window edge.
"""

from __future__ import annotations

from dataclasses import dataclass

from mlflow_llmeff.calc.throughput import Counts
from mlflow_llmeff.monitor.packed import packed_starts, segments_len_sq

# Positions in the on-device accumulator; padded positions are shapes, kept as an int.
_TOKENS, _LOSS, _SUM_LEN_SQ, _SAMPLES = range(4)

#: The layout of the int64 counts tensor a ``reduce`` callable of :meth:`BatchCounter.take` and
#: :meth:`StepTally.take` receives (and returns): one value per field, in this order. The last four
#: count the micro-batches whose field was not given (:class:`~mlflow_llmeff.calc.throughput.Counts`).
REDUCE_LAYOUT = ("tokens", "loss_tokens", "sum_len_sq", "padded_tokens", "samples",
                 "padded_unknown", "loss_unknown", "samples_unknown", "lengths_unknown")

#: Why each field of :class:`~mlflow_llmeff.calc.throughput.Counts` can be unknown: counts passed as
#: numbers (``EfficiencyMonitor.count(tokens=...)``) without it, or a flat ``(N,)`` batch, which has no
#: rows (:class:`BatchCounter`). A ``(B, T)`` batch gives all of them.
UNKNOWN_WHY = {
    "padded": "padded positions unknown (a micro-batch counted as tokens= without padded_tokens=)",
    "loss": ("loss-bearing tokens unknown (a micro-batch counted as tokens= without loss_tokens= or samples=, "
             "or a flat (N,) batch without labels)"),
    "samples": ("sequences unknown (a micro-batch counted as tokens= without samples=, or a flat (N,) batch "
                "without position_ids, cu_seqlens or seq_idx)"),
    "lengths": ("sequence lengths unknown (a micro-batch counted as tokens= without samples= or sum_len_sq=, or "
                "a flat (N,) batch without position_ids, cu_seqlens or seq_idx): attention FLOPs grow with the "
                "sequence length, and all of a micro-batch's tokens taken as one sequence would grow with the "
                "micro-batch size"),
}


def counts_from(steps: int, v) -> Counts:
    """:class:`~mlflow_llmeff.calc.throughput.Counts` of ``steps`` steps from values in :data:`REDUCE_LAYOUT` order."""
    if all(type(x) is int for x in v):  # the host's and tolist()'s: passed as they are, in Counts' field order
        tokens, loss, sum_sq, padded, samples, *unknown = v
        return Counts(steps, tokens, padded, loss, samples, sum_sq, *unknown)
    return Counts(steps=steps, **{name: int(x) for name, x in zip(REDUCE_LAYOUT, v)})


#: Keys of a batch mapping (or a forward's keyword arguments) that :class:`StepTally` reads: the
#: ids, the padding mask, the labels and the three ways collators mark packed documents.
BATCH_KEYS = ("input_ids", "attention_mask", "labels", "position_ids", "cu_seq_lens_q", "cu_seqlens", "seq_idx")
#: the keys of a packed batch (:meth:`BatchCounter.add`), tested in one call against a mapping's keys
_PACKED_KEYS = frozenset(BATCH_KEYS[3:])


_TENSOR = []  # torch.Tensor, once torch is imported (this module does not import torch at its own import)


def _tensor_type():
    """``torch.Tensor`` (imported on first use)."""
    if not _TENSOR:
        import torch

        _TENSOR.append(torch.Tensor)
    return _TENSOR[0]


def _host_readable(device) -> bool:
    """True where a tensor's value is read without waiting on an accelerator (the CPU)."""
    return device.type == "cpu"


class _Shape:
    """A kept batch's ``(B, T)`` and device (the CPU) where :meth:`BatchCounter._add_rows` reads its ``ref``."""

    def __init__(self, shape) -> None:
        import torch

        self.shape, self.device = shape, torch.device("cpu")


def _version(x) -> int | None:
    """``x._version`` (torch's count of in-place writes to a tensor), None for None."""
    return None if x is None else x._version


def _dtype(x):
    """``x.dtype``, None for None."""
    return None if x is None else x.dtype


def _array(x):
    """A CPU tensor's values as a NumPy array, in place where torch allows it (no copy, no autograd)."""
    try:
        return x.detach().numpy()
    except (TypeError, RuntimeError):  # a dtype NumPy has no twin for (bfloat16): through int64
        return x.detach().to("cpu").long().numpy()


class BatchCounter:
    """Accumulates non-padding, padded and loss-bearing tokens, sequences and ``sum(l^2)``.

    A sequence is a row of the batch, or, in a packed batch, each document of a row (``docs/formulas.md``,
    "Variable-length and packed batches"): documents are read from ``cu_seqlens`` (cumulative
    lengths, flash-attention style), ``seq_idx`` (document index per token) or ``position_ids``
    that restart at each document (transformers' ``DataCollatorWithFlattening``). A flat ``(N,)``
    tensor without one of those three has no rows, so its sequences and their lengths are unknown
    (counted as such, :data:`UNKNOWN_WHY`), never taken as one sequence of all ``N`` tokens.

    Args:
        device: torch device of the accumulator (the batches' device).
    """

    def __init__(self, device="cpu") -> None:
        import torch

        self._acc = torch.zeros(4, dtype=torch.int64, device=device)
        # the same four counts where they are read on the host (a CPU batch's, or a dense batch's shapes):
        # a CPU tensor is read without a device synchronization, and ints cost no tensor op
        self._host = [0, 0, 0, 0]
        self._acc_used = False  # True once a count went to the device accumulator (an accelerator's batch)
        # CPU batches read at the window edge (:meth:`_defer`): (mask, labels, their autograd versions)
        self._deferred: list[tuple] = []
        self._seen: tuple | None = None  # the first batch's tensors: ids and versions (the probation)
        self.defer = None  # None: undecided; True: CPU batches are read at the edge; False: at once
        self.refilled = 0  # deferred micro-batches whose tensors were refilled in place before the edge
        self._padded = 0
        self._unknown = {"loss_unknown": 0, "samples_unknown": 0, "lengths_unknown": 0}  # flat micro-batches

    def add(self, input_ids=None, attention_mask=None, labels=None, position_ids=None, cu_seqlens=None,
            seq_idx=None, loss_tokens=None) -> None:
        """Count one micro-batch (a few fused tensor ops on its device, no synchronization).

        Args:
            input_ids: ``(B, T)`` token ids (used when there is no attention mask).
            attention_mask: ``(B, T)``, 1 on real tokens, 0 on padding; when absent every position
                is a real token (or, with ``cu_seqlens``, the first ``cu_seqlens[-1]`` positions).
            labels: ``(B, T)`` with ``-100`` where no loss is taken; loss-bearing tokens are
                ``labels[:, 1:] != -100`` (causal shift). Absent: non-padding tokens minus one per
                sequence.
            position_ids: ``(B, T)`` positions; where one is not the previous plus one a new
                document starts (a packed row). Other shapes (e.g. multimodal 3-D positions) are
                ignored.
            cu_seqlens: ``(D + 1,)`` cumulative document lengths over the flattened batch
                (``cu_seq_lens_q`` of ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``);
                document lengths are its differences. Takes precedence over the other two.
            seq_idx: ``(B, T)`` document index of every token; a change starts a document.
            loss_tokens: this micro-batch's loss-bearing tokens as its caller already counted them (an
                int, or a 0-d integer-valued tensor on the batch's device, added unsynchronized): the
                labels are then not read (``llmeff train`` counts them once, for its loss weights).

        Raises:
            ValueError: when neither ``input_ids`` nor ``attention_mask`` is given.
        """
        import torch

        ref = attention_mask if attention_mask is not None else input_ids
        if ref is None:
            raise ValueError("BatchCounter.add needs input_ids or attention_mask")
        if loss_tokens is not None:  # counted by the caller: the labels are not read again
            labels = None
            if ref.is_cpu or not torch.is_tensor(loss_tokens):
                loss_tokens = int(loss_tokens)
        if ref.dim() == 2 and cu_seqlens is None and position_ids is None and seq_idx is None:
            if ref.is_cpu and self._defer(ref, attention_mask, labels, loss_tokens):  # (is_cpu: no device object)
                return
            self._add_rows(ref, attention_mask, labels, loss=loss_tokens)  # the common dense batch: rows are sequences
            return
        flat = ref.dim() == 1  # a flat stream: no rows, so no sequence unless documents are marked
        if flat:
            ref = ref.unsqueeze(0)
        b, t = ref.shape
        dev = self._acc.device
        cu = cu_seqlens if torch.is_tensor(cu_seqlens) and cu_seqlens.dim() == 1 and cu_seqlens.numel() > 1 else None
        starts = None if cu is not None else packed_starts(position_ids, seq_idx, (b, t))
        real = ref.bool() if attention_mask is not None else None
        docs = None
        if cu is not None:
            lens = (cu[1:] - cu[:-1]).to(device=dev, dtype=torch.int64)
            sum_sq = (lens * lens).sum()
            docs = (lens > 0).sum()
            tokens = ref.sum(dtype=torch.int64) if real is not None else (cu[-1] - cu[0]).to(device=dev, dtype=torch.int64)
        elif starts is not None:
            if real is None:
                real = torch.ones((b, t), dtype=torch.bool, device=starts.device)
            else:  # a real token after padding starts a sequence whatever its position says
                starts[:, 1:] |= real[:, 1:] & ~real[:, :-1]
            sum_sq, docs = segments_len_sq(starts, real)
            tokens = real.sum(dtype=torch.int64)
        elif flat:  # sequences and their lengths unknown: neither is guessed
            tokens = ref.sum(dtype=torch.int64) if real is not None else torch.tensor(t, device=dev)
            sum_sq = torch.zeros((), dtype=torch.int64, device=dev)
            self._unknown["samples_unknown"] += 1
            self._unknown["lengths_unknown"] += 1
        elif attention_mask is not None:
            lens = ref.sum(dim=1, dtype=torch.int64)
            tokens = lens.sum()
            sum_sq = (lens * lens).sum()
        else:  # every position is real: all counts are shapes
            tokens = torch.tensor(b * t, device=dev)
            sum_sq = torch.tensor(b * t * t, device=dev)
        if loss_tokens is not None:
            loss = loss_tokens if torch.is_tensor(loss_tokens) else torch.tensor(loss_tokens, device=dev)
        elif labels is not None:
            lab = labels if labels.dim() == 2 else labels.unsqueeze(0)
            loss = (lab[:, 1:] != -100).sum()
        elif docs is not None:
            loss = tokens - docs
        elif flat:  # one token per sequence carries no loss: how many sequences is unknown
            loss = torch.zeros((), dtype=torch.int64, device=dev)
            self._unknown["loss_unknown"] += 1
        elif attention_mask is not None:
            loss = (lens - 1).clamp(min=0).sum()
        else:
            loss = torch.tensor(b * (t - 1), device=dev)
        samples = (docs if docs is not None else torch.zeros((), dtype=torch.int64, device=dev) if flat
                   else torch.tensor(b, device=dev))
        self._acc += torch.stack([x.to(device=dev, dtype=torch.int64).reshape(())
                                  for x in (tokens, loss, sum_sq, samples)])
        self._acc_used = True
        self._padded += b * t

    def _defer(self, ref, attention_mask, labels, loss_tokens: int | None = None) -> bool:
        """Keep a CPU batch to be read at the window edge (:meth:`take`); False: read it now.

        Right after a training step the first code to run finds the host's caches cold: on a 2-core
        machine a 21 ms llama-tiny step made the three NumPy reductions of a count cost ~120 us there,
        against ~20 us in a tight loop. Read at the edge, the micro-batches of a window are counted in
        one pass (``bench/overhead.py``: docs/time.md, "The meter's own time"). A batch is read where
        its tensors are when the edge comes, so a loop that refills one tensor in place would be
        miscounted: the second micro-batch decides (a loop passing the first batch's very tensors
        again, written in place since (``Tensor._version``, torch's count of in-place writes), is read
        at once, for good), and a kept batch whose tensors were written after it came is counted as
        they are then, in :attr:`refilled`, and the counter reads at once from then on. ``loss_tokens``
        (the caller's count, its labels ``None``) is added at once."""
        m = attention_mask if attention_mask is not None else labels
        if m is None:
            return False  # the counts are the shape's: nothing to read
        if self.defer is None:
            seen = (id(attention_mask), id(labels), _version(attention_mask), _version(labels))
            if self._seen is None:
                self._seen = seen
                return False  # the first batch: read now, and remembered
            # the first batch's very tensors written since: a loop refilling its tensors in place
            self.defer = not (seen[:2] == self._seen[:2] and seen[2:] != self._seen[2:]) and not any(
                x is not None and x.requires_grad for x in (attention_mask, labels))  # (a float mask under autograd)
        if not self.defer:
            return False
        self.keep(ref.shape, attention_mask, labels, loss_tokens)
        return True

    def keep(self, shape, attention_mask, labels, loss_tokens: int | None) -> None:
        """Keep a dense ``(B, T)`` CPU batch for the edge, once :attr:`defer` is True (the checks of
        :meth:`_defer`, or :meth:`StepTally.add_batch`'s short path, made): its rows and positions are
        counted now, its mask (or None) and labels (or None) read at the edge, with their versions now;
        ``loss_tokens``: the caller's count (an int, added now; its labels None) or None."""
        b, t = shape
        h = self._host
        h[_SAMPLES] += b
        given = loss_tokens is not None
        if given:
            h[_LOSS] += loss_tokens
        self._padded += b * t
        self._deferred.append((shape, attention_mask, labels, _version(attention_mask), _version(labels), given))

    def _settle(self) -> None:
        """Count the batches :meth:`_defer` kept (at the window edge)."""
        kept, self._deferred = self._deferred, []
        first = kept[0]
        shape, mask_dtype, labels_dtype, given = first[0], _dtype(first[1]), _dtype(first[2]), first[5]
        same = True
        for k_shape, mask, labels, v_mask, v_labels, k_given in kept:  # (one loop, no generator: right after a step)
            if _version(mask) != v_mask or _version(labels) != v_labels:  # refilled in place since
                self.refilled += 1
                self.defer = False
            if same and not (k_shape == shape and k_given == given and _dtype(mask) == mask_dtype
                             and _dtype(labels) == labels_dtype):
                same = False
        if not same or len(kept) == 1:
            for shape, mask, labels, _, _, given_k in kept:  # (a given loss count was added when it came)
                self._add_rows(_Shape(shape), mask, labels, counted=True, loss=0 if given_k else None)
            return
        # One pass over the window's micro-batches of one shape, stacked to (k, B, T), in torch: right after
        # a training step torch's code is warm and NumPy's is not (bench/overhead.py, 5 batches of 8 x 128:
        # ~100 us against ~150-165 us for the same sums through NumPy). Masks and labels are integer
        # tensors (no autograd: no detach needed).
        import torch

        h = self._host
        b, t = first[0]
        if first[1] is not None:
            # (k B,) row lengths, summed on the host: one torch reduction and one read (~20% under the two
            # reductions and two reads it replaces, right after a step)
            lens = torch.cat([k[1] for k in kept]).sum(dim=1, dtype=torch.int64)
            rows = lens.tolist()
            h[_TOKENS] += sum(rows)
            h[_SUM_LEN_SQ] += sum([n * n for n in rows])
            rows = lens
        else:
            rows = None
            h[_TOKENS] += len(kept) * b * t
            h[_SUM_LEN_SQ] += len(kept) * b * t * t
        if given:  # the caller's loss counts, added when they came
            pass
        elif first[2] is not None:
            labs = torch.stack([k[2] if k[2].dim() == 2 else k[2][None] for k in kept])  # (k, B, T)
            h[_LOSS] += labs[:, :, 1:].ne(-100).sum().item()
        elif rows is not None:
            h[_LOSS] += (rows - 1).clamp(min=0).sum().item()
        else:
            h[_LOSS] += len(kept) * b * (t - 1)

    def _add_rows(self, ref, attention_mask, labels, counted: bool = False, loss=None) -> None:
        """Count a ``(B, T)`` batch whose rows are its sequences (no packed documents), in as few ops as
        the counts need: each row's length from the mask (or ``T``), ``sum(l)``, ``sum(l^2)`` and the
        loss-bearing ``labels[:, 1:] != -100`` (or ``l - 1`` a row). On CPU the tensors are read in place
        through NumPy (no device to wait for, and a NumPy reduction of a small array costs a few
        microseconds where a torch op costs several times that); on an accelerator the sums stay on it,
        added to the accumulator unsynchronized. The same counts as the general path of :meth:`add`
        (``tests/test_counting.py`` holds both). ``loss``: the loss-bearing tokens as the caller counted them
        (an int, or a 0-d tensor on the batch's device), read from neither labels nor mask."""
        import torch

        b, t = ref.shape
        h = self._host
        if not counted:  # (kept batches counted their rows and positions when they came)
            h[_SAMPLES] += b
            self._padded += b * t
        on_host = _host_readable(ref.device)
        if loss is not None:  # counted by the caller
            if torch.is_tensor(loss):
                self._acc[_LOSS] += loss.reshape(()).to(torch.int64)
                self._acc_used = True
            else:
                h[_LOSS] += loss
            if attention_mask is None:
                h[_TOKENS] += b * t
                h[_SUM_LEN_SQ] += b * t * t
            elif on_host:
                rows = _array(attention_mask).sum(axis=1, dtype="int64")
                h[_TOKENS] += int(rows.sum())
                h[_SUM_LEN_SQ] += int((rows * rows).sum())
            else:
                lens = attention_mask.sum(dim=1, dtype=torch.int64)
                self._acc[0:3:2] += torch.stack((lens, lens * lens)).sum(dim=1)  # tokens, sum(l^2)
                self._acc_used = True
            return
        lab = labels if labels is None or labels.dim() == 2 else labels.unsqueeze(0)
        if attention_mask is None:  # every position is real: the counts are the shape's
            h[_TOKENS] += b * t
            h[_SUM_LEN_SQ] += b * t * t
            if lab is None:
                h[_LOSS] += b * (t - 1)
            elif on_host:
                h[_LOSS] += int((_array(lab)[:, 1:] != -100).sum())
            else:
                self._acc[_LOSS] += (lab[:, 1:] != -100).sum()
            return
        if on_host:
            rows = _array(attention_mask).sum(axis=1, dtype="int64")  # (B,) real tokens a row
            h[_TOKENS] += int(rows.sum())
            h[_SUM_LEN_SQ] += int((rows * rows).sum())
            h[_LOSS] += (int((_array(lab)[:, 1:] != -100).sum()) if lab is not None
                         else int((rows - 1).clip(min=0).sum()))
            return
        lens = attention_mask.sum(dim=1, dtype=torch.int64)  # (B,) real tokens a row
        loss = (lab[:, 1:] != -100).sum(dim=1) if lab is not None else (lens - 1).clamp(min=0)
        self._acc[:3] += torch.stack((lens, loss.to(torch.int64), lens * lens)).sum(dim=1)  # accumulator order
        self._acc_used = True

    def take(self, steps: int, reduce=None) -> Counts:
        """Return the counts since the last take (summed over ranks by ``reduce``) and reset.

        Args:
            steps: optimizer steps the counts cover.
            reduce: callable summing a tensor over data-parallel ranks (e.g.
                ``lambda t: accelerator.reduce(t, "sum")``); None for one process.
        """
        import torch

        if self._deferred:
            self._settle()
        # REDUCE_LAYOUT: tokens, loss tokens, sum of squared lengths, padded, samples, then the unknowns
        unknown = [self._unknown.get(name, 0) for name in REDUCE_LAYOUT[5:]]
        h = self._host
        acc = self._acc.tolist() if self._acc_used else [0, 0, 0, 0]  # an accelerator's: one read at the edge
        v = [acc[0] + h[_TOKENS], acc[1] + h[_LOSS], acc[2] + h[_SUM_LEN_SQ], self._padded, acc[3] + h[_SAMPLES],
             *unknown]
        if reduce is not None:
            v = reduce(torch.tensor(v, dtype=torch.int64, device=self._acc.device)).tolist()
        if self._acc_used:
            self._acc.zero_()
            self._acc_used = False
        self._host = [0, 0, 0, 0]
        self._padded = 0
        self._unknown = dict.fromkeys(self._unknown, 0)
        return counts_from(steps, v)

    def peek_tokens(self) -> tuple[int, int | None]:
        """(tokens, sum of squared lengths) counted locally since the last take (synchronizes); the sum
        is None when some micro-batch's lengths are unknown."""
        if self._deferred:
            self._settle()
        sq = None if self._unknown["lengths_unknown"] else int(self._acc[_SUM_LEN_SQ]) + self._host[_SUM_LEN_SQ]
        return int(self._acc[_TOKENS]) + self._host[_TOKENS], sq


@dataclass(frozen=True)
class ShapeRange:
    """The padded shapes of a run's micro-batches: what a collator padding each batch to its longest
    row (dynamic padding) or packing documents into one row of varying length makes vary.

    Attributes:
        seq: ``(shortest, longest)`` padded length ``T`` of a micro-batch, positions (``>= 1``).
        batch: ``(smallest, largest)`` micro-batch size ``B``, rows (``>= 1``); a smaller last
            micro-batch of the run is left out (a data loader's partial last batch, ``drop_last=False``).
    """

    seq: tuple[int, int]
    batch: tuple[int, int]

    @property
    def seq_varies(self) -> bool:
        """True when the padded length was not the same in every micro-batch."""
        return self.seq[0] != self.seq[1]

    @property
    def batch_varies(self) -> bool:
        """True when the micro-batch size was not the same in every micro-batch (but a smaller last one)."""
        return self.batch[0] != self.batch[1]

    @property
    def varies(self) -> bool:
        """True when either varied: the sequence length and the global batch are then no condition of the run."""
        return self.seq_varies or self.batch_varies


class StepTally:
    """What a meter counts between two window edges: tokens of every micro-batch and their losses.

    Batches are counted on their device with :class:`BatchCounter` (no synchronization); counts
    passed as numbers are kept on the host and ride in the same collective at the edge. Losses
    (0-d tensors) are summed on the device too.

    Attributes:
        first_shape: ``(micro batch, seq len, micro-batches in the first step)`` as first seen.
        micro: micro-batches counted in the step in progress.

    Every counted batch's padded shape ``(B, T)`` is also kept as a range (:attr:`shapes`), read
    off the tensor's shape (host ints, no synchronization).
    """

    _FIELDS = REDUCE_LAYOUT

    def __init__(self) -> None:
        self.counter: BatchCounter | None = None
        self._tensor = None  # torch.Tensor once a batch was counted (read by add_batch's short path)
        self.device = None
        self.host = [0] * len(self._FIELDS)
        self.loss_acc = None  # device tensor: sum of tensor losses
        self.loss_acc_n = 0  # how many tensor losses it holds
        self.loss_host = [0.0, 0]  # sum and count of float losses
        self.micro = 0
        self.first_shape: tuple[int, int, int] | None = None
        # [shortest T, longest T, smallest B, largest B] of the micro-batches before the latest one, and
        # the latest (B, T): a smaller latest B may be the data loader's partial last batch (ShapeRange)
        self._earlier: list[int] | None = None
        self._latest: tuple[int, int] | None = None
        self._latest_inside = False  # the latest shape lies inside the earlier range (folding it is a no-op)
        self._varied = False  # shapes.varies, kept as each shape is noted (read on every step)

    # ------------------------------------------------------------------------------ counting
    def add_batch(self, batch, loss_tokens=None) -> None:
        """Count a mapping with ``input_ids`` / ``attention_mask`` / ``labels`` ``(B, T)`` (and, in a
        packed batch, ``position_ids``, ``seq_idx`` or ``cu_seq_lens_q`` / ``cu_seqlens``: see
        :meth:`BatchCounter.add`), or a ``(B, T)`` id tensor; ``loss_tokens``: its loss-bearing tokens
        as the caller counted them (the labels are then not read)."""
        counter = self.counter
        if counter is not None and counter.defer and type(batch) is dict and _PACKED_KEYS.isdisjoint(batch):
            # The loop's usual micro-batch once the counter keeps CPU batches for the edge: a dict with a dense
            # (B, T) CPU mask, and the loss tokens counted by the caller (``llmeff train``; the labels are then
            # not read) or labels. The same entry as the general path below (packed keys, other masks and
            # labels go that way), with a fraction of its checks: this runs right after a step, where every
            # operation finds the host's caches cold (bench/overhead.py, issue 53).
            mask, tensor = batch.get("attention_mask"), self._tensor
            if type(mask) is tensor:
                shape = mask.shape
                labels = None if loss_tokens is not None else batch.get("labels")
                if len(shape) == 2 and mask.is_cpu and (labels is None or type(labels) is tensor):
                    counter.keep(shape, mask, labels, None if loss_tokens is None else
                                 loss_tokens if type(loss_tokens) is int else int(loss_tokens))
                    if not (self._latest_inside and self._latest == shape):
                        self._note_shape(*shape)
                    return
        import torch

        is_tensor = torch.is_tensor
        if is_tensor(batch):
            ids, mask, labels, pos, cu, seq_idx = batch, None, None, None, None, None
        else:
            get = batch.get if hasattr(batch, "get") else (lambda k: getattr(batch, k, None))
            ids, mask, labels = get("input_ids"), get("attention_mask"), get("labels")
            keys = getattr(batch, "keys", None)
            if keys is not None and _PACKED_KEYS.isdisjoint(keys()):  # a mapping without packing keys (the
                pos = seq_idx = cu = None  # common batch: one C-level test instead of four lookups)
            else:
                pos, seq_idx = get("position_ids"), get("seq_idx")
                cu = get("cu_seq_lens_q")
                if cu is None:
                    cu = get("cu_seqlens")
            # what is not a tensor is not read (a list of labels, a None); the common batch has none of these
            if labels is not None and not is_tensor(labels):
                labels = None
            if pos is not None and not is_tensor(pos):
                pos = None
            if cu is not None and not is_tensor(cu):
                cu = None
            if seq_idx is not None and not is_tensor(seq_idx):
                seq_idx = None
        if mask is not None and (not is_tensor(mask) or mask.dim() > 2):
            mask = None  # 4-D custom masks: count input_ids positions instead
        ref = mask if mask is not None else ids
        if ref is None or not is_tensor(ref):
            return
        if self.counter is None:
            self.counter, self.device, self._tensor = BatchCounter(ref.device), ref.device, torch.Tensor
        self.counter.add(ids, mask, labels, pos, cu, seq_idx, loss_tokens)
        shape = ref.shape
        if len(shape) == 2:
            b, t = shape
        else:
            b, t = 1, shape[-1]
        if self.first_shape is None:
            self.first_shape = (b, t, 0)
        self._note_shape(b, t)

    def _note_shape(self, b: int, t: int) -> None:
        """Keep micro-batch ``(B, T)`` as the latest shape; the one before joins the earlier range."""
        if self._latest_inside and self._latest == (b, t):  # the same shape again, already in the range:
            return  # folding it changes nothing (the common loop of one shape)
        if self._latest is not None:
            self._earlier = self._fold(self._earlier, *self._latest)
        self._latest = (b, t)
        e = self._earlier
        self._latest_inside = e is not None and e[0] <= t <= e[1] and e[2] <= b <= e[3]
        if not self._varied and self._earlier is not None:
            lo_t, hi_t, lo_b, hi_b = self._with_latest(self._earlier, b, t)
            self._varied = lo_t != hi_t or lo_b != hi_b

    @staticmethod
    def _with_latest(earlier: list[int] | None, b: int, t: int) -> tuple[int, int, int, int]:
        """``(shortest T, longest T, smallest B, largest B)`` of the earlier range with the latest
        micro-batch ``(b, t)``: its length counts in full, its size only when not smaller (a smaller
        one may be the data loader's partial last batch; :attr:`shapes` and :attr:`varies` both
        read this one rule)."""
        lo_t, hi_t, lo_b, hi_b = earlier or (t, t, b, b)
        return min(lo_t, t), max(hi_t, t), lo_b, max(hi_b, b)

    @staticmethod
    def _fold(rng: list[int] | None, b: int, t: int) -> list[int]:
        if rng is None:
            return [t, t, b, b]
        return [min(rng[0], t), max(rng[1], t), min(rng[2], b), max(rng[3], b)]

    @property
    def refilled(self) -> int:
        """CPU micro-batches whose tensors were written in place between their count and the window's
        edge (:meth:`BatchCounter._defer`); 0 without batches."""
        return self.counter.refilled if self.counter is not None else 0

    @property
    def varies(self) -> bool:
        """``shapes.varies`` without building :attr:`shapes` (a bool kept as shapes are counted;
        read on every step)."""
        return self._varied

    @property
    def shapes(self) -> ShapeRange | None:
        """The padded lengths and micro-batch sizes counted so far (None before a batch with a shape).

        The latest micro-batch counts in full for its length; its size only when it is not smaller
        than the earlier ones: a smaller one may be the data loader's partial last batch, and it is
        folded in (the size then varies) only when another batch follows it.
        """
        if self._latest is None:
            return None
        lo_t, hi_t, lo_b, hi_b = self._with_latest(self._earlier, *self._latest)
        return ShapeRange(seq=(lo_t, hi_t), batch=(lo_b, hi_b))

    def shape_state(self) -> list[int] | None:
        """The shapes counted so far for a checkpoint, ``[shortest T, longest T, smallest B, largest B]``:
        a resumed run continues after the latest batch, so it is no last batch and joins the range."""
        if self._latest is None:
            return None
        return self._fold(self._earlier, *self._latest)

    def load_shape_state(self, state: list[int] | None) -> None:
        """Continue the shapes of :meth:`shape_state` (None: none were counted)."""
        if state:
            lo_t, hi_t, lo_b, hi_b = (int(v) for v in state)
            self._earlier = [lo_t, hi_t, lo_b, hi_b]
            self._latest = (hi_b, hi_t)  # a shape inside the range: folding it in changes nothing
            self._latest_inside = True
            self._varied = lo_t != hi_t or lo_b != hi_b

    def add_numbers(self, tokens, padded_tokens=None, loss_tokens=None, samples=None, sum_len_sq=None) -> None:
        """Count a micro-batch given as numbers (defaults as in :meth:`EfficiencyMonitor.count`).

        What is not given and cannot be derived is counted as unknown (:data:`UNKNOWN_WHY`), never as a
        guess: padded positions without ``padded_tokens``; loss-bearing tokens without ``loss_tokens``
        or ``samples`` (with ``samples``: ``tokens - samples``, the causal shift); sequences without
        ``samples``; sequence lengths without ``sum_len_sq`` or ``samples`` (with ``samples`` alone:
        equal lengths, ``sum(l^2) = tokens^2 / samples``).
        """
        h = dict(zip(self._FIELDS, self.host))
        t = int(tokens)
        s = int(samples) if samples is not None else None
        h["tokens"] += t
        if padded_tokens is not None:
            h["padded_tokens"] += int(padded_tokens)
        else:
            h["padded_unknown"] += 1
        if loss_tokens is not None or s is not None:
            h["loss_tokens"] += int(loss_tokens) if loss_tokens is not None else t - s
        else:
            h["loss_unknown"] += 1
        if s is not None:
            h["samples"] += s
        else:
            h["samples_unknown"] += 1
        if sum_len_sq is not None or s:
            h["sum_len_sq"] += int(sum_len_sq) if sum_len_sq is not None else t * t // s
        else:
            h["lengths_unknown"] += 1
        self.host = [h[f] for f in self._FIELDS]

    def add_loss(self, loss) -> None:
        """Add one micro-batch's mean loss (a 0-d tensor on an accelerator is summed on its device,
        unsynchronized; a CPU tensor's value is read at once, as a float's)."""
        if not hasattr(loss, "detach"):  # a number
            self.loss_host[0] += float(loss)
        elif loss.is_cpu:  # (.item(): half the cost of float() on a tensor right after a step)
            self.loss_host[0] += loss.item()
        else:
            import torch

            if self.loss_acc is None:
                self.loss_acc = torch.zeros((), dtype=torch.float64, device=loss.device)
            self.loss_acc += loss.detach().reshape(())
            self.loss_acc_n += 1
            return
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

        host = list(self.host)  # in REDUCE_LAYOUT order
        self.host = [0] * len(self._FIELDS)
        if self.counter is not None and reduce is None and not any(host):  # batches only, one process
            return self.counter.take(steps)
        if self.counter is not None:
            def with_host(t):
                t = t + torch.tensor(host, dtype=torch.int64, device=t.device)
                return reduce(t) if reduce is not None else t

            return self.counter.take(steps, reduce=with_host)
        t = torch.tensor(host, dtype=torch.int64)
        return counts_from(steps, (reduce(t) if reduce is not None else t).tolist())

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

    def peek_tokens(self) -> tuple[int, int | None]:
        """(tokens, sum of squared lengths) counted on this rank since the last take (synchronizes); the
        sum is None when some micro-batch's lengths are unknown."""
        h = dict(zip(self._FIELDS, self.host))
        t, sq = (self.counter.peek_tokens() if self.counter is not None else (0, 0))
        return t + h["tokens"], None if h["lengths_unknown"] or sq is None else sq + h["sum_len_sq"]
