"""Batched log-likelihood scoring of (context, continuation) pairs with any Hugging Face causal LM.

Definitions follow EleutherAI lm-evaluation-harness 0.4.x (``HFLM._encode_pair`` and
``HFLM._loglikelihood_tokens``):

* Trailing whitespace of the context moves to the front of the continuation; the context is
  encoded alone, the whole string ``context + continuation`` is encoded, and the continuation
  tokens are the whole encoding minus the first ``len(context tokens)`` tokens.
* The model input is ``(context + continuation)[-(max_length + 1):][:-1]`` (left truncation); the
  score is the sum of ``log_softmax`` over the continuation tokens.

Speed (what differs from the harness, never the numbers):

* Choices of one document share their common input prefix (the context, plus e.g. the space of
  ``" A"`` .. ``" D"`` for a byte tokenizer): it is run once, and only the differing tails of the
  choices run again on top of its key/value cache ("branches"; identical tails run once). The
  longest tail runs in the prefix's own row (the "lead"; the other branches mask its columns): a
  plain causal row needs no cache copy and no attention mask.
* Documents of one *family* (e.g. one MMLU subject: the same description and few-shot examples)
  share their common token prefix: it runs once per family and its cache is reused by every
  document batch.
* Documents and branches are sorted by length (longest first) before batching, so padding is small;
  branches of a window of ``branch_window * batch_size`` documents are sorted together (on
  HellaSwag's first 60 documents this cut the padded branch positions from 323 to 266 per
  document, 251 being real). Batches are cut where padding plus a per-pass cost is least
  (:func:`_batches`; never wider or taller than a plain cut's first batch), so an outlier runs
  alone instead of widening seven rows, and a branch batch's cache is cropped to the columns its
  rows attend to.
* The last decoder layer's feed-forward block (position-wise) runs on the scored positions only,
  where a probe shows the logits there unchanged (:meth:`LoglikelihoodScorer._last_mlp`): context
  positions need that layer's keys and values, which come before it, not its output.
* Documents whose choices differ only in their last token (MMLU) are one row each, and short rows
  are packed into one model row with a 4D block-diagonal causal mask.
* The LM head runs only on scored positions (``logits_to_keep``) where the model supports it. Where
  the model's logits are its LM head over its decoder's output (checked bit for bit on a probe),
  branch passes return hidden states and the LM head and log-softmax run later on >= 128 *
  ``batch_size`` gathered positions at once (:class:`_Picks`): short tails make small, slow
  matrix products otherwise. Only the picked log-probabilities are read (no per-row copies).
* A ByT5 tokenizer is encoded directly as UTF-8 bytes + offset (checked on a probe string).

Tried and dropped: all distinct tails of a document in one row on its prefix cache (a
block-diagonal 4D mask): fewer, larger passes, but 3% slower on CPU at both vocabularies (the
tails attend over each other's masked columns).

Positions are passed explicitly and padding is masked, so scores do not depend on batch size or
padding side beyond float rounding (fp32 log-probs, summed in float64: below 1e-5 nats). Documents whose input exceeds the
model's length fall back to the harness's per-choice left truncation, without sharing.

Modules: :mod:`mlflow_llmeff.evals.requests` (encoding requests as the harness does),
:mod:`mlflow_llmeff.evals.prefix_cache` (a document's prefix run once, its tails as branches on the
key/value cache; :func:`_batches`), :mod:`mlflow_llmeff.evals.lm_head` (the LM head on scored
positions only, late: :class:`_Picks`), this one (the scorer: model calls, the structure probes,
family prefixes, MMLU rows). Their names are re-exported here.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Hashable, Sequence

import torch

from mlflow_llmeff.evals.lm_head import _kept_positions_only, _Picks, _picked_sums
from mlflow_llmeff.evals.prefix_cache import _batches, _PrefixCache  # _batches: re-exported (tests)
from mlflow_llmeff.evals.requests import (
    Encoded,
    _Doc,
    _Encoder,
    _lcp,
    encode_pair,
    resolve_max_length,
)

__all__ = ["Encoded", "LoglikelihoodScorer", "encode_pair", "resolve_max_length"]


class LoglikelihoodScorer(_PrefixCache):
    """Scores multiple-choice documents with a causal LM.

    Args:
        model: a Hugging Face causal LM (``forward(input_ids, attention_mask, position_ids,
            past_key_values, use_cache)`` returning ``.logits`` of shape ``(B, T, V)``).
        tokenizer: any Hugging Face tokenizer.
        batch_size: rows per forward pass (documents, several short ones packed in one row, or branches).
        device: where to run; default the model's device.
        max_length: context length in tokens; default :func:`resolve_max_length`.
        add_bos: None keeps the tokenizer's leading special tokens (see :class:`_Encoder`), True
            forces BOS (else EOS) first, False adds none.
        share_prefix: False scores each choice as its own sequence, exactly the harness's plan
            (for cross-checks and benchmarks).
        family_min_tokens: smallest family prefix worth a separate cached forward pass.
        padding_side: "right" or "left"; results do not depend on it.
        branch_window: documents whose choice tails are sorted by length together, in units of
            ``batch_size`` (their prefix caches are held meanwhile: ``branch_window * batch_size``
            documents' keys and values); larger means less padding, more memory.
    """

    def __init__(self, model: Any, tokenizer: Any, *, batch_size: int = 8, device: Any = None,
                 max_length: int | None = None, add_bos: bool | None = None, share_prefix: bool = True,
                 family_min_tokens: int = 16, padding_side: str = "right", branch_window: int = 8) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size {batch_size} is not accepted; use an integer >= 1")
        if branch_window < 1:
            raise ValueError(f"branch_window {branch_window} is not accepted; use an integer >= 1")
        if padding_side not in ("left", "right"):
            raise ValueError(f"padding_side {padding_side!r} is not accepted; use 'left' or 'right'")
        self.model = model
        self.encode = _Encoder(tokenizer, add_bos)
        self.batch_size = batch_size
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        self.max_length = max_length or resolve_max_length(model, tokenizer)
        self.share_prefix = share_prefix
        self.family_min_tokens = family_min_tokens
        self.padding_side = padding_side
        self.branch_window = branch_window
        # a forward pass's fixed cost in input positions, for cutting batches (:func:`_batches`): on
        # this project's 2-core CPU the bench model (hidden 256, 4 layers) took 4.1 ms for a 1-token
        # pass and 89-95 us per position in 8 x 64-128 batches (bench/evals.py's model)
        self.pass_positions = 48
        pad = getattr(tokenizer, "pad_token_id", None)
        self.pad_id = pad if pad is not None else 0
        # transformers >= 5.2x names the KV cache argument ``cache``; older ones ``past_key_values``
        params = inspect.signature(model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        self._keep_logits = "logits_to_keep" in params  # LM head on scored positions only
        self._split: tuple[Any, Any, str] | None | bool = False  # (decoder, LM head, cache arg); None: unusable
        self._mlp: Any = False  # the last layer's feed-forward module (see _last_mlp); None: unusable
        self._probed: tuple[torch.Tensor, torch.Tensor] | None = None  # (ids, logits) of _probe
        self.forward_passes = 0  # model calls made, for benchmarks
        self.forward_tokens = 0  # input positions run (padding included), for benchmarks
        self.progress = None  # an object with update(n): documents scored (a tqdm bar)
        self._carry = 0.0  # documents scored but not yet shown (fractions of a document)
        self.between = None  # called between batches (no arguments): evaluate() re-decides its threads there

    # ------------------------------------------------------------------ encoding
    def encode_request(self, context: str, continuation: str) -> Encoded:
        """Encode one request and apply the harness's left truncation to ``max_length + 1`` tokens."""
        ctx, cont = encode_pair(self.encode, context, continuation)
        if not ctx:
            ctx = [self.encode.prefix_token_id]
        tokens = ctx + cont
        start = len(ctx)
        excess = len(tokens) - (self.max_length + 1)
        if excess > 0:
            if len(cont) > self.max_length:
                raise ValueError(f"continuation of {len(cont)} tokens exceeds max_length {self.max_length}")
            tokens = tokens[excess:]
            start -= excess
        return Encoded(tuple(tokens), start)

    # ------------------------------------------------------------------ public API
    def score(self, docs: Sequence[Sequence[tuple[str, str]]],
              families: Sequence[Hashable] | None = None) -> list[list[float]]:
        """Sum of continuation log-probabilities for every choice of every document.

        Args:
            docs: per document, its choices as ``(context, continuation)`` strings.
            families: optional key per document; documents with the same key (e.g. one MMLU
                subject) share the forward pass of their common token prefix.

        Returns:
            ``[doc][choice]`` log-likelihoods in nats (<= 0), in the order given.
        """
        encoded = [[self.encode_request(c, k) for c, k in doc] for doc in docs]
        return self.score_encoded(encoded, families)

    def score_encoded(self, encoded: Sequence[Sequence[Encoded]],
                      families: Sequence[Hashable] | None = None) -> list[list[float]]:
        """Like :meth:`score` for already encoded requests."""
        out: list[list[float]] = [[0.0] * len(d) for d in encoded]
        units: list[_Doc] = []  # (doc idx, choices) scored together
        slots: list[list[tuple[int, int]]] = []  # per unit: (doc, choice) of each of its choices
        for d, choices in enumerate(encoded):
            if not choices:
                continue
            truncated = any(len(e.tokens) > self.max_length for e in choices)
            if self.share_prefix and not truncated:
                shared = _lcp([e.input_ids for e in choices])
                units.append(_Doc(d, list(choices), max(shared, 1)))
                slots.append([(d, i) for i in range(len(choices))])
            else:  # one unit per choice: exactly the harness's plan
                for i, e in enumerate(choices):
                    units.append(_Doc(d, [e], len(e.input_ids), weight=1 / len(choices)))
                    slots.append([(d, i)])
        fam_of = [families[u.idx] if (families is not None and self.share_prefix) else None for u in units]
        groups: dict[Hashable, list[int]] = {}
        for j, f in enumerate(fam_of):  # documents without a family form one group, no family prefix
            groups.setdefault(("fam", f) if f is not None else ("none",), []).append(j)
        with torch.inference_mode():
            for key, members in groups.items():
                docs = [units[j] for j in members]
                scores = self._score_family(docs, use_family=key[0] == "fam")
                for j, sc in zip(members, scores):
                    for (d, i), s in zip(slots[j], sc):
                        out[d][i] = s
        return out

    def probe(self) -> None:
        """Run the structure checks now (:meth:`_head_split`, :meth:`_last_mlp`; once per scorer), e.g.
        before forking worker processes that would each run them again."""
        self._head_split()
        self._last_mlp()

    # ------------------------------------------------------------------ internals
    def _forward(self, ids: torch.Tensor, mask: Any, pos: torch.Tensor, past: Any, use_cache: bool,
                 keep: torch.Tensor | None = None, hidden: bool = False) -> tuple[torch.Tensor, Any]:
        """One model call; with ``keep`` (bool ``(B, T)``) returns only those positions' logits ``(N, V)``.

        With ``hidden`` and a model whose logits are its LM head over its decoder's last hidden
        state (see :meth:`_head_split`), returns those positions' final hidden states ``(N, H)``
        instead: the caller runs the LM head later, on many positions at once (:class:`_Picks`).
        """
        self.forward_passes += 1
        self.forward_tokens += int(ids.numel())
        mlp = self._last_mlp() if keep is not None else None
        if mlp is not None:
            with _kept_positions_only(mlp, keep):
                return self._call(ids, mask, pos, past, use_cache, keep, hidden)
        return self._call(ids, mask, pos, past, use_cache, keep, hidden)

    def _call(self, ids: torch.Tensor, mask: Any, pos: torch.Tensor, past: Any, use_cache: bool,
              keep: torch.Tensor | None, hidden: bool) -> tuple[torch.Tensor, Any]:
        """The model call of :meth:`_forward`."""
        split = self._head_split() if hidden and keep is not None else None
        if split is not None:
            decoder, _, cache_arg = split
            kw = {cache_arg: past} if past is not None else {}
            out = decoder(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=use_cache, **kw)
            return out.last_hidden_state[keep], (out.get(cache_arg) if use_cache else None)
        kw = {self._cache_arg: past} if past is not None else {}
        if keep is not None and self._keep_logits:
            kw["logits_to_keep"] = keep  # the LM head runs on the kept positions only
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=use_cache, **kw)
        logits = out.logits
        if keep is not None and not self._keep_logits:
            logits = logits[keep]
        return logits, (out.get(self._cache_arg) if use_cache else None)

    def _last_mlp(self) -> Any:
        """The last decoder layer's feed-forward module when running it on the kept positions only
        (:func:`_kept_positions_only`) leaves the model's logits at those positions unchanged on a
        probe (within 1e-6), else None. Checked once per scorer.

        Only the positions whose next-token scores are read need the last layer's feed-forward
        output; every other position needs that layer's keys and values only, which come before it.
        The feed-forward block is position-wise, so this changes nothing that is read. It is 3/4 of
        a Llama layer's matrix products (``3 * H * I`` of ``4 * H^2 + 3 * H * I`` with ``I = 4H``):
        on HellaSwag the context positions score nothing.
        """
        if self._mlp is not False:
            return self._mlp
        self._mlp = None
        if hasattr(self.model, "_orig_mod"):  # torch.compile'd: hooks set and removed each pass would recompile it
            return None
        try:
            decoder = self.model.get_decoder()
            layers = getattr(decoder, "layers", None)
            if layers is None:
                layers = getattr(decoder, "h", None)
            mlp = getattr(layers[-1], "mlp", None) if layers is not None and len(layers) else None
            if not isinstance(mlp, torch.nn.Module):
                return None
            ids, logits = self._probe()
            keep = torch.tensor([[False, True, False, False, True, False, False, True]], device=self.device)
            ref = logits[keep]
            with torch.inference_mode(), _kept_positions_only(mlp, keep):
                got = self.model(input_ids=ids, use_cache=False).logits[keep]
            if ref.shape == got.shape and torch.allclose(ref, got, rtol=0, atol=1e-6):
                self._mlp = mlp
        except Exception:  # noqa: BLE001 - any model this does not fit keeps the plain path
            self._mlp = None
        return self._mlp

    def _probe(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Eight token ids ``(1, 8)`` and the model's own logits on them ``(1, 8, V)``, run once: the
        input of the structure checks (:meth:`_head_split`, :meth:`_last_mlp`). Raises whatever the
        model raises (the checks catch it)."""
        if self._probed is None:
            head = self.model.get_output_embeddings()
            vocab = int(getattr(head, "out_features", 0) or getattr(self.model.config, "vocab_size", 9))
            ids = torch.arange(1, 9, dtype=torch.long, device=self.device)[None] % vocab
            with torch.inference_mode():
                self._probed = (ids, self.model(input_ids=ids, use_cache=False).logits)
        return self._probed

    def _head_split(self) -> tuple[Any, Any, str] | None:
        """``(decoder, LM head, cache argument)`` when ``model(x).logits`` equals
        ``lm_head(decoder(x).last_hidden_state)`` bit for bit on a probe, else None (e.g. logit
        soft-capping or scaling after the head). Checked once per scorer."""
        if self._split is not False:
            return self._split  # type: ignore[return-value]
        self._split = None
        try:
            decoder, head = self.model.get_decoder(), self.model.get_output_embeddings()
            if decoder is None or head is None or decoder is self.model:
                return None
            params = inspect.signature(decoder.forward).parameters
            cache_arg = "cache" if "cache" in params else "past_key_values"
            ids, ref = self._probe()
            with torch.inference_mode():
                got = head(decoder(input_ids=ids, use_cache=False).last_hidden_state)
            if ref.shape == got.shape and torch.equal(ref, got):
                self._split = (decoder, head, cache_arg)
        except Exception:  # noqa: BLE001 - any model without the split keeps the plain path
            self._split = None
        return self._split  # type: ignore[return-value]

    def _score_family(self, docs: list[_Doc], use_family: bool) -> list[list[float]]:
        """Score documents that may share a family prefix; returns per doc its choice scores."""
        fam_cache, fam_len = None, 0
        if use_family and len(docs) > 1:
            fam_len = _lcp([u.choices[0].input_ids[: u.shared] for u in docs])
            # every doc keeps >= 1 own token, and every position it scores (a family of identical contexts)
            fam_len = min([fam_len] + [u.shared - 1 for u in docs] + [e.start - 1 for u in docs for e in u.choices])
            if fam_len >= self.family_min_tokens:
                prefix = docs[0].choices[0].input_ids[:fam_len]
                ids = torch.tensor([prefix], dtype=torch.long, device=self.device)
                _, fam_cache = self._forward(ids, torch.ones_like(ids), torch.arange(fam_len, device=self.device)[None],
                                             None, True, keep=torch.zeros_like(ids, dtype=torch.bool))
            else:
                fam_len = 0
        for u in docs:
            u.family_len = fam_len
        if any(len(e.input_ids) > u.shared for u in docs for e in u.choices):
            # choices differ in more than their last token (HellaSwag endings): run each document's
            # prefix once and the distinct tails as branches on its cache (a tree row with a 4D mask
            # would pay dense attention over all tails, measured slower on CPU)
            return self._score_branching(docs, fam_cache, fam_len)
        trees = [_Tree.build(u, fam_len) for u in docs]
        # one input row per document (MMLU): pack several short documents into one row
        order = sorted(range(len(docs)), key=lambda j: -len(trees[j].row))  # longest first: little padding
        rows = self._pack([trees[j] for j in order]) if self.share_prefix else [[trees[j]] for j in order]
        for s in range(0, len(rows), self.batch_size):
            self._score_rows(rows[s : s + self.batch_size], fam_cache, fam_len)
            self._advance(sum(t.doc.weight for r in rows[s : s + self.batch_size] for t in r))
        return [t.sums for t in trees]

    def _advance(self, documents: float) -> None:
        """Move the progress bar by whole documents (a document scored choice by choice, as
        truncated ones are, counts 1/len(choices) a choice; the fraction waits for the rest); calls
        :attr:`between` first."""
        if self.between is not None:
            self.between()
        if self.progress is not None:
            self._carry += documents
            whole = int(self._carry + 1e-6)
            if whole:
                self.progress.update(whole)
                self._carry -= whole

    @staticmethod
    def _pack(trees: list[_Tree]) -> list[list[_Tree]]:
        """First-fit packing of trees (longest first) into rows no wider than the longest tree."""
        if not trees:
            return []
        cap = len(trees[0].row)
        rows: list[list[_Tree]] = []
        free: list[int] = []
        for t in trees:
            n = len(t.row)
            k = next((r for r in range(len(rows)) if free[r] >= n), None)
            if k is None:
                rows.append([t])
                free.append(cap - n)
            else:
                rows[k].append(t)
                free[k] -= n
        return rows

    def _score_rows(self, rows: list[list[_Tree]], fam_cache: Any, fam_len: int) -> None:
        """One forward for a batch of rows, each holding one or more trees (on the family cache);
        sets every tree's ``sums``."""
        n, width = len(rows), max(sum(len(t.row) for t in r) for r in rows)
        ids = torch.full((n, width), self.pad_id, dtype=torch.long)
        pos = torch.zeros((n, width), dtype=torch.long)
        seg = torch.full((n, width), -1, dtype=torch.long)  # part of a tree: 0 prefix, k tail k, -1 pad
        doc = torch.full((n, width), -1, dtype=torch.long)  # which tree of the row
        keep = torch.zeros((n, width), dtype=torch.bool)
        pairs: list[tuple[int, int, int, int]] = []  # (row, column, target token, choice slot in the batch)
        trees: list[_Tree] = []
        n_slots = 0
        for b, r in enumerate(rows):
            used = sum(len(t.row) for t in r)
            off = width - used if self.padding_side == "left" else 0
            for j, t in enumerate(r):
                m = len(t.row)
                ids[b, off : off + m] = torch.tensor(t.row, dtype=torch.long)
                pos[b, off : off + m] = torch.tensor(t.pos, dtype=torch.long)
                seg[b, off : off + m] = torch.tensor(t.seg, dtype=torch.long)
                doc[b, off : off + m] = j
                for col, target, choice in t.targets:
                    keep[b, off + col] = True
                    pairs.append((b, off + col, target, n_slots + choice))
                n_slots += len(t.doc.choices)
                trees.append(t)
                off += m
        simple = fam_len == 0 and self.padding_side == "right" and all(
            len(r) == 1 and max(r[0].seg, default=0) == 0 for r in rows)
        past = None
        if simple:  # plain causal rows padded on the right: pads are never attended, no mask needed
            mask = None
        else:  # causal within a tree, its prefix visible to its tails, tails blind to each other; family visible
            cols = torch.arange(width)
            segq, segk = seg[:, :, None], seg[:, None, :]
            allowed = ((cols[None, :, None] >= cols[None, None, :]) & (segk >= 0)
                       & (doc[:, :, None] == doc[:, None, :]) & ((segk == 0) | (segk == segq)))
            allowed |= torch.eye(width, dtype=torch.bool)[None] & (segq < 0)  # pad queries see themselves
            if fam_len:
                allowed = torch.cat([torch.ones((n, width, fam_len), dtype=torch.bool), allowed], dim=2)
                past = self._select_cache(fam_cache, [0] * n)
            dtype = next(self.model.parameters()).dtype
            dtype = dtype if dtype.is_floating_point else torch.float32
            mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, torch.finfo(dtype).min)[:, None]
            mask = mask.to(self.device)
        dev = self.device
        logits, _ = self._forward(ids.to(dev), mask, pos.to(dev), past, False, keep=keep.to(dev))
        # kept logits come in row-major order of ``keep``: map (row, column) -> index
        index = torch.full((n, width), -1, dtype=torch.long)
        index[keep] = torch.arange(int(keep.sum()))
        rows = torch.tensor([p[0] for p in pairs], dtype=torch.long)
        colt = torch.tensor([p[1] for p in pairs], dtype=torch.long)
        tgt = torch.tensor([p[2] for p in pairs], dtype=torch.long, device=dev)
        slot = torch.tensor([p[3] for p in pairs], dtype=torch.long, device=dev)
        sums = _picked_sums(logits, index[rows, colt].to(dev), tgt, slot, n_slots)
        k = 0
        for t in trees:
            t.sums = sums[k : k + len(t.doc.choices)]
            k += len(t.doc.choices)


@dataclass
class _Tree:
    """One document as a single model row: its shared prefix (after the family prefix), then each
    distinct choice tail. ``pos`` are absolute positions (a tail restarts right after the prefix),
    ``seg`` says which part a column is (0 prefix, k >= 1 tail k), ``targets`` lists
    ``(column, next token, choice)`` for every continuation token to score."""

    doc: _Doc
    row: list[int]
    pos: list[int]
    seg: list[int]
    targets: list[tuple[int, int, int]]
    sums: list[float] = field(default_factory=list)  # per choice, set when scored

    @classmethod
    def build(cls, u: _Doc, fam_len: int) -> "_Tree":
        first = u.choices[0].input_ids
        row = list(first[fam_len : u.shared])
        pos = list(range(fam_len, u.shared))
        seg = [0] * len(row)
        tail_at: dict[tuple[int, ...], int] = {}  # tail -> its first column
        targets: list[tuple[int, int, int]] = []
        for i, e in enumerate(u.choices):
            inp = e.input_ids
            tail = inp[u.shared :]
            if tail and tail not in tail_at:
                tail_at[tail] = len(row)
                row += tail
                pos += range(u.shared, u.shared + len(tail))
                seg += [len(tail_at)] * len(tail)
            for p in range(e.start - 1, len(inp)):  # input position p predicts token p + 1
                col = p - fam_len if p < u.shared else tail_at[tail] + p - u.shared
                targets.append((col, e.tokens[p + 1], i))
        return cls(u, row, pos, seg, targets)
