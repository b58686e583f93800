"""Key/value reuse of the scorer: a document's shared prefix runs once, its choice tails run as
branches on the prefix's cache (HellaSwag endings).

:class:`_PrefixCache` holds the methods of :class:`~mlflow_llmeff.evals.scoring.LoglikelihoodScorer`
that run prefixes and branches and select, crop and stack key/value caches; :func:`_batches` cuts
length-sorted rows into batches where padding plus a per-pass cost is least. The module docstring
of :mod:`mlflow_llmeff.evals.scoring` says why each step leaves the scores unchanged.
"""

from __future__ import annotations

import copy
from typing import Any, Sequence

import torch

from mlflow_llmeff.evals.lm_head import _Picks
from mlflow_llmeff.evals.requests import _Doc



class _PrefixCache:
    """The prefix-cache half of :class:`~mlflow_llmeff.evals.scoring.LoglikelihoodScorer` (a mixin).

    Uses the scorer's ``device``, ``pad_id``, ``padding_side``, ``batch_size``, ``branch_window``,
    ``pass_positions``, ``_forward`` and ``_advance``.
    """

    def _select_cache(self, cache: Any, rows: list[int]) -> Any:
        """A new cache holding only batch ``rows`` of ``cache`` (the original stays intact)."""
        new = copy.copy(cache)
        new.layers = [copy.copy(layer) for layer in cache.layers]
        new.batch_select_indices(torch.tensor(rows, dtype=torch.long, device=self.device))
        return new

    @staticmethod
    def _crop_masked(cache: Any, held: torch.Tensor) -> tuple[Any, torch.Tensor]:
        """Drop the cache columns right of the last one any row attends to (``held`` ``(B, T)``, 1 on
        real columns): rows of a window's stacked cache are padded to its widest document, and a batch
        of branches from shorter documents would attend over (masked) padding. Only caches whose layers
        are all plain ``DynamicLayer`` are cropped; others are returned as they are."""
        used = held.any(dim=0).nonzero()
        width = int(used[-1]) + 1 if used.numel() else 1
        extra = held.shape[1] - width
        if extra <= 0 or not all(type(layer).__name__ == "DynamicLayer" for layer in cache.layers):
            return cache, held
        for layer in cache.layers:
            layer.crop(-extra)
        return cache, held[:, :width]

    def _pad(self, rows: list[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """Pad rows to one length; returns (ids, mask, offset of each row's first real token)."""
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        offsets = []
        for b, r in enumerate(rows):
            off = width - len(r) if self.padding_side == "left" else 0
            if r:
                ids[b, off : off + len(r)] = torch.tensor(list(r), dtype=torch.long)
                mask[b, off : off + len(r)] = 1
            offsets.append(off)
        return ids, mask, offsets

    @staticmethod
    def _positions(mask: torch.Tensor, offsets: list[int], starts: list[int]) -> torch.Tensor:
        """Position ids: ``start + k`` for the k-th real token of each row; pads get a valid dummy."""
        width = mask.shape[1]
        pos = torch.zeros_like(mask)
        for b, (off, st) in enumerate(zip(offsets, starts)):
            pos[b] = st + torch.arange(width) - off
        return pos.clamp_(min=0)

    def _score_branching(self, docs: list[_Doc], fam_cache: Any, fam_len: int) -> list[list[float]]:
        """Score documents whose choices differ in more than their last token (HellaSwag endings).

        Each document's shared prefix runs once, with its longest tail in the same row (batches of
        at most ``batch_size`` documents, longest first, cut by :func:`_batches`); the other
        distinct tails then run as branches on its key/value cache. Branches of a
        *window* of ``branch_window * batch_size`` documents are sorted by length together before
        they are cut into batches, so a batch holds tails of similar length (little padding); the
        window's prefix caches are kept until its branches have run.
        """
        result: list[list[float]] = [[0.0] * len(u.choices) for u in docs]
        for u in docs:  # the longest tail runs in the prefix's row: plain causal, no cache copy
            tails = [e.input_ids[u.shared :] for e in u.choices]
            u.lead = max(tails, key=len)
        order = sorted(range(len(docs)), key=lambda j: -(docs[j].shared - docs[j].family_len + len(docs[j].lead)))
        window = self.batch_size * self.branch_window
        split = self._head_split()
        picks = _Picks(split[1] if split is not None else None, self.batch_size * 128)
        for w in range(0, len(order), window):
            part = order[w : w + window]
            wdocs = [docs[j] for j in part]
            # distinct tails after each document's shared prefix (identical tails run once), and per
            # branch its uses: (results row, choice, first scored tail position, targets)
            branches: list[tuple[int, tuple[int, ...]]] = []  # (row in the window, tail tokens)
            uses: list[list[tuple[list[float], int, int, tuple[int, ...]]]] = []
            branch_of: dict[tuple[int, tuple[int, ...]], int] = {}
            for k, u in enumerate(wdocs):
                for i, e in enumerate(u.choices):
                    tail = e.input_ids[u.shared :]
                    if not tail or tail == u.lead:
                        continue
                    if (k, tail) not in branch_of:
                        branch_of[(k, tail)] = len(branches)
                        branches.append((k, tail))
                        uses.append([])
                    lo = max(e.start - 1, u.shared)
                    uses[branch_of[(k, tail)]].append((result[part[k]], i, lo - u.shared, e.tokens[lo + 1 :]))
            caches, masks = [], []
            for s, e in _batches([u.shared - u.family_len + len(u.lead) for u in wdocs], self.batch_size,
                                 self.pass_positions):
                batch = list(range(s, e))
                cache, mask = self._score_prefixes([wdocs[k] for k in batch], fam_cache, fam_len,
                                                   [result[part[k]] for k in batch], bool(branches), picks)
                caches.append(cache)
                masks.append(mask)
            if branches:
                cache, mask = self._stack_caches(caches, masks)
                del caches
                self._score_branches(wdocs, branches, uses, cache, mask, picks)
            picks.flush()
            self._advance(sum(docs[j].weight for j in part))
        return result

    def _score_prefixes(self, docs: list[_Doc], fam_cache: Any, fam_len: int, results: list[list[float]],
                        use_cache: bool, picks: "_Picks") -> tuple[Any, torch.Tensor]:
        """Run the shared prefixes of a batch of documents (on the family cache), each followed by its
        lead tail, add the scores of the continuation tokens predicted inside them to ``results``;
        returns (cache, mask) where ``mask`` is ``(B, fam_len + width)``, 1 on the prefix columns
        (branches attend to these only, not to the lead tail)."""
        rows = [u.choices[0].input_ids[fam_len : u.shared] + u.lead for u in docs]
        ids, mask, offs = self._pad(rows)
        pos = self._positions(mask, offs, [fam_len] * len(docs))
        past = None
        if fam_cache is not None:
            past = self._select_cache(fam_cache, [0] * len(docs))
            mask = torch.cat([torch.ones((len(docs), fam_len), dtype=torch.long), mask], dim=1)
        # positions scored at the shared level (p < shared predicts token p + 1): usually the first
        # continuation token or none; the LM head runs on these only
        keep = torch.zeros(ids.shape, dtype=torch.bool)
        wanted: list[tuple[int, int, torch.Tensor, tuple[int, ...]]] = []  # (doc row, choice, columns, targets)
        for b, u in enumerate(docs):
            for i, e in enumerate(u.choices):
                lead = bool(u.lead) and e.input_ids[u.shared :] == u.lead  # this choice's row is this row
                lo, hi = e.start - 1, len(e.input_ids) if lead else min(len(e.input_ids), u.shared)
                if lo < hi:
                    cols = torch.arange(lo, hi) - fam_len + offs[b]
                    keep[b, cols] = True
                    wanted.append((b, i, cols, e.tokens[lo + 1 : hi + 1]))
        dev = self.device
        # right-padded rows without a family prefix: pads come after every real token, so the plain
        # causal mask is exact (and takes the causal attention kernel); branches still see ``mask``
        plain = fam_cache is None and self.padding_side == "right"
        states, cache = self._forward(ids.to(dev), None if plain else mask.to(dev), pos.to(dev), past,
                                      use_cache, keep=keep.to(dev), hidden=picks.head is not None)
        if wanted:
            index = torch.full(keep.shape, -1, dtype=torch.long)
            index[keep] = torch.arange(int(keep.sum()))
            picks.add(states, torch.cat([index[b, cols] for b, _, cols, _ in wanted]).tolist(),
                      [t for *_, targets in wanted for t in targets], [len(w[3]) for w in wanted],
                      [(results[b], i) for b, i, _, _ in wanted])
        if any(u.lead for u in docs):
            mask = mask.clone()
            for b, u in enumerate(docs):
                at = u.shared + offs[b]  # the lead tail's first column (after the family columns)
                mask[b, at : at + len(u.lead)] = 0
        return cache, mask

    @staticmethod
    def _stack_caches(caches: list[Any], masks: list[torch.Tensor]) -> tuple[Any, torch.Tensor]:
        """One cache (and mask) holding the rows of several prefix batches, in order; narrower
        batches are padded with masked zero columns on the right."""
        width = max(m.shape[1] for m in masks)
        mask = torch.cat([torch.nn.functional.pad(m, (0, width - m.shape[1])) for m in masks])
        if len(caches) == 1:
            return caches[0], mask
        new = copy.copy(caches[0])
        new.layers = [copy.copy(layer) for layer in caches[0].layers]
        for li, layer in enumerate(new.layers):
            for name in ("keys", "values"):
                parts = [getattr(c.layers[li], name) for c in caches]
                parts = [torch.nn.functional.pad(t, (0, 0, 0, width - t.shape[-2])) for t in parts]
                setattr(layer, name, torch.cat(parts))
        return new, mask

    def _score_branches(self, docs: list[_Doc], branches: list[tuple[int, tuple[int, ...]]],
                        uses: list[list[tuple[list[float], int, int, tuple[int, ...]]]], cache: Any,
                        doc_mask: torch.Tensor, picks: "_Picks") -> None:
        """Run every branch on top of its document's cache (longest first, ``batch_size`` a pass) and
        add each choice's tail log-likelihood (``uses``: per branch (results row, choice, first
        scored tail position, targets)) to its results."""
        order = sorted(range(len(branches)), key=lambda k: -len(branches[k][1]))
        dev = self.device
        for s, e in _batches([len(branches[k][1]) for k in order], self.batch_size, self.pass_positions):
            chunk = order[s:e]
            doc_rows = [branches[k][0] for k in chunk]
            ids, mask, offs = self._pad([branches[k][1] for k in chunk])
            pos = self._positions(mask, offs, [docs[r].shared for r in doc_rows])
            past = self._select_cache(cache, doc_rows)
            held = doc_mask[doc_rows]
            past, held = self._crop_masked(past, held)
            full_mask = torch.cat([held, mask], dim=1)
            # every real tail position is scored; the LM head skips the padding (kept rows come row-major)
            states, _ = self._forward(ids.to(dev), full_mask.to(dev), pos.to(dev), past, True,
                                      keep=mask.bool().to(dev), hidden=picks.head is not None)
            rows: list[int] = []
            tgt: list[int] = []
            counts: list[int] = []
            targets_of: list[tuple[list[float], int]] = []
            at = 0
            for k in chunk:
                for res, i, rel, targets in uses[k]:
                    rows += range(at + rel, at + rel + len(targets))
                    tgt += targets
                    counts.append(len(targets))
                    targets_of.append((res, i))
                at += len(branches[k][1])
            picks.add(states, rows, tgt, counts, targets_of)


def _batches(widths: Sequence[int], batch_size: int, pass_positions: int) -> list[tuple[int, int]]:
    """Cut rows sorted by width (longest first) into consecutive batches of at most ``batch_size``.

    Minimises ``sum over batches of (rows x widest row) + pass_positions``: the input positions run,
    padding included, plus a fixed cost per forward pass expressed in positions. A plain cut every
    ``batch_size`` rows pays for an outlier in every row of its batch (HellaSwag's first 60
    documents: one 224-token ending in a batch of 143-177-token ones); here it may run alone. No
    batch holds more rows, or is wider, than the plain cut's first batch, so peak memory does not
    grow. Returns ``[(start, end)]`` covering ``range(len(widths))`` in order.
    """
    n = len(widths)
    best = [0.0] + [float("inf")] * n  # best[i]: cost of batching the first i rows
    cut = [0] * (n + 1)
    for i in range(1, n + 1):
        for s in range(max(0, i - batch_size), i):  # the last batch is rows s..i-1, the widest is row s
            cost = best[s] + pass_positions + (i - s) * widths[s]
            if cost <= best[i]:  # ties: the shorter last batch, so equal widths give the plain cut
                best[i], cut[i] = cost, s
    out: list[tuple[int, int]] = []
    i = n
    while i > 0:
        out.append((cut[i], i))
        i = cut[i]
    return out[::-1]
