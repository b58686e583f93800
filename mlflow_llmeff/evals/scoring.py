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
  choices run again on top of its key/value cache ("branches"; identical tails run once).
* Documents of one *family* (e.g. one MMLU subject: the same description and few-shot examples)
  share their common token prefix: it runs once per family and its cache is reused by every
  document batch.
* Documents and branches are sorted by length (longest first) before batching, so padding is small.
* Documents whose choices differ only in their last token (MMLU) are one row each, and short rows
  are packed into one model row with a 4D block-diagonal causal mask.
* The LM head runs only on scored positions (``logits_to_keep``) where the model supports it; a
  ByT5 tokenizer is encoded directly as UTF-8 bytes + offset (checked on a probe string).

Positions are passed explicitly and padding is masked, so scores do not depend on batch size or
padding side beyond float rounding (fp32 log-probs, summed in float64: below 1e-5 nats). Documents whose input exceeds the
model's length fall back to the harness's per-choice left truncation, without sharing.
"""

from __future__ import annotations

import copy
import functools
import inspect
from dataclasses import dataclass, field
from typing import Any, Hashable, Sequence

import torch

__all__ = ["Encoded", "LoglikelihoodScorer", "encode_pair", "resolve_max_length"]

_DEFAULT_MAX_LENGTH = 2048  # the harness's default when neither config nor tokenizer says
_TOKENIZER_INFINITY = 1000000000000000019884624838656  # transformers' "no limit" model_max_length


def resolve_max_length(model: Any, tokenizer: Any = None) -> int:
    """Return the model's context length in tokens, looked up as lm-eval-harness 0.4.x does.

    Order: ``text_config`` or config ``n_positions``, ``max_position_embeddings``, ``n_ctx``; then
    the tokenizer's ``model_max_length`` unless it is transformers' "infinity"; then 2048.
    """
    config = getattr(model, "config", None)
    cfg = getattr(config, "text_config", None) or config
    for attr in ("n_positions", "max_position_embeddings", "n_ctx"):
        value = getattr(cfg, attr, None)
        if value is not None:
            return int(value)
    mml = getattr(tokenizer, "model_max_length", None)
    if mml is not None and mml != _TOKENIZER_INFINITY:
        return int(mml)
    return _DEFAULT_MAX_LENGTH


class _Encoder:
    """Token ids of a string: the tokenizer's *leading* special tokens (e.g. BOS) kept, trailing ones
    (e.g. ByT5's EOS) never added.

    With a BOS-adding tokenizer (Llama) this equals the harness 0.4.x default; with GPT-2 (adds
    nothing) both agree; with ByT5/T5 (appends EOS) it equals the harness run with
    ``add_bos_token=False`` (the harness's default would put an EOS between context and
    continuation).
    """

    def __init__(self, tokenizer: Any, add_bos: bool | None = None) -> None:
        self.tokenizer = tokenizer
        if add_bos is None:
            probe_with = list(tokenizer("a", add_special_tokens=True)["input_ids"])
            probe_without = list(tokenizer("a", add_special_tokens=False)["input_ids"])
            n = len(probe_without)
            self.prefix = next(
                (probe_with[:k] for k in range(len(probe_with) - n + 1) if probe_with[k : k + n] == probe_without),
                [],
            )
        elif add_bos:
            bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
            self.prefix = [bos]
        else:
            self.prefix = []
        # Harness: an empty context is replaced by this single token (BOS, else EOS).
        bos = tokenizer.bos_token_id
        self.prefix_token_id = bos if bos is not None else tokenizer.eos_token_id

        # the 4 choices of a document share their context string: remember recent encodings
        self._cached = functools.lru_cache(maxsize=64)(self._encode)
        self._byte_offset = self._probe_byte_tokenizer(tokenizer)
        self._specials = tuple(set(tokenizer.all_special_tokens) | set(tokenizer.get_added_vocab())) \
            if self._byte_offset is not None else ()

    @staticmethod
    def _probe_byte_tokenizer(tokenizer: Any) -> int | None:
        """Id of byte 0 for a ByT5-style tokenizer (id = UTF-8 byte + offset), else None.

        Its Python tokenizer costs ~2 us per character; the direct map gives the same ids, which is
        checked here on a probe string, and is used only for text holding no special-token string.
        """
        offset = getattr(tokenizer, "offset", None)
        if type(tokenizer).__name__ != "ByT5Tokenizer" or not isinstance(offset, int):
            return None
        probe = "Ab c\n\u00e9\u4e2d!"
        slow = list(tokenizer(probe, add_special_tokens=False)["input_ids"])
        return offset if slow == [b + offset for b in probe.encode("utf-8")] else None

    def _encode(self, text: str) -> tuple[int, ...]:
        if self._byte_offset is not None and not any(t in text for t in self._specials):
            off = self._byte_offset
            return tuple(self.prefix) + tuple(b + off for b in text.encode("utf-8"))
        return tuple(self.prefix) + tuple(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def __call__(self, text: str) -> list[int]:
        return list(self._cached(text))


@dataclass(frozen=True)
class Encoded:
    """One scored sequence: ``tokens`` (the full context + continuation, after truncation) and
    ``start``, the index in ``tokens`` of the first continuation token (>= 1)."""

    tokens: tuple[int, ...]
    start: int

    @property
    def input_ids(self) -> tuple[int, ...]:
        """What the model sees: all tokens but the last (the last is only a target)."""
        return self.tokens[:-1]


def encode_pair(encode: Any, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """Split ``context + continuation`` into (context ids, continuation ids) as the harness does.

    Args:
        encode: callable str -> list of token ids.
        context: conditioning text; "" is allowed (then the context is the prefix token, as in
            the harness, and must be given by the caller: this returns ``[]`` for it).
        continuation: scored text, non-empty.

    Returns:
        ``(context_ids, continuation_ids)``; ``continuation_ids`` is never empty: when the
        tokenizer merges the whole continuation into the context's last token, that token moves
        to the continuation (the harness would assert instead).

    Raises:
        ValueError: for an empty continuation.
    """
    if not continuation:
        raise ValueError("continuation '' is empty; a scored continuation needs at least one character")
    if context == "":
        return [], encode(continuation)
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces > 0:
        continuation = context[-n_spaces:] + continuation
        context = context[:-n_spaces]
    whole = encode(context + continuation)
    ctx = encode(context)
    n_ctx = len(ctx)
    if n_ctx >= len(whole):  # never leave the continuation empty
        n_ctx = len(whole) - 1
    return whole[:n_ctx], whole[n_ctx:]


def _lcp(seqs: Sequence[Sequence[int]]) -> int:
    """Length of the longest common prefix of token sequences."""
    first = seqs[0]
    n = min(len(s) for s in seqs)
    for i in range(n):
        t = first[i]
        if any(s[i] != t for s in seqs):
            return i
    return n


@dataclass
class _Doc:
    """Choices of one document, all untruncated, sharing ``shared`` (LCP of their inputs)."""

    idx: int  # position in the caller's list
    choices: list[Encoded]
    shared: int  # length of the common input prefix, >= 1
    family_len: int = 0  # tokens covered by the family prefix cache


class LoglikelihoodScorer:
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
    """

    def __init__(self, model: Any, tokenizer: Any, *, batch_size: int = 8, device: Any = None,
                 max_length: int | None = None, add_bos: bool | None = None, share_prefix: bool = True,
                 family_min_tokens: int = 16, padding_side: str = "right") -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size {batch_size} is not accepted; use an integer >= 1")
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
        pad = getattr(tokenizer, "pad_token_id", None)
        self.pad_id = pad if pad is not None else 0
        # transformers >= 5.2x names the KV cache argument ``cache``; older ones ``past_key_values``
        params = inspect.signature(model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        self._keep_logits = "logits_to_keep" in params  # LM head on scored positions only
        self.forward_passes = 0  # model calls made, for benchmarks
        self.forward_tokens = 0  # input positions run (padding included), for benchmarks
        self.progress = None  # an object with update(n): documents scored (a tqdm bar)

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
                    units.append(_Doc(d, [e], len(e.input_ids)))
                    slots.append([(d, i)])
        if self.progress is not None and hasattr(self.progress, "total"):
            self.progress.total = len(units)  # scoring units: documents, or choices where not shared
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

    # ------------------------------------------------------------------ internals
    def _forward(self, ids: torch.Tensor, mask: Any, pos: torch.Tensor, past: Any, use_cache: bool,
                 keep: torch.Tensor | None = None) -> tuple[torch.Tensor, Any]:
        """One model call; with ``keep`` (bool ``(B, T)``) returns only those positions' logits ``(N, V)``."""
        self.forward_passes += 1
        self.forward_tokens += int(ids.numel())
        kw = {self._cache_arg: past} if past is not None else {}
        if keep is not None and self._keep_logits:
            kw["logits_to_keep"] = keep  # the LM head runs on the kept positions only
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=use_cache, **kw)
        logits = out.logits
        if keep is not None and not self._keep_logits:
            logits = logits[keep]
        return logits, (out.get(self._cache_arg) if use_cache else None)

    def _select_cache(self, cache: Any, rows: list[int]) -> Any:
        """A new cache holding only batch ``rows`` of ``cache`` (the original stays intact)."""
        new = copy.copy(cache)
        new.layers = [copy.copy(layer) for layer in cache.layers]
        new.batch_select_indices(torch.tensor(rows, dtype=torch.long, device=self.device))
        return new

    def _score_family(self, docs: list[_Doc], use_family: bool) -> list[list[float]]:
        """Score documents that may share a family prefix; returns per doc its choice scores."""
        fam_cache, fam_len = None, 0
        if use_family and len(docs) > 1:
            fam_len = _lcp([u.choices[0].input_ids[: u.shared] for u in docs])
            fam_len = min([fam_len] + [u.shared - 1 for u in docs])  # every doc keeps >= 1 own token
            if fam_len >= self.family_min_tokens:
                prefix = docs[0].choices[0].input_ids[:fam_len]
                ids = torch.tensor([prefix], dtype=torch.long, device=self.device)
                _, fam_cache = self._forward(ids, torch.ones_like(ids), torch.arange(fam_len, device=self.device)[None],
                                             None, True, keep=torch.zeros_like(ids, dtype=torch.bool))
            else:
                fam_len = 0
        for u in docs:
            u.family_len = fam_len
        trees = [_Tree.build(u, fam_len) for u in docs]
        if any(max(t.seg, default=0) > 0 for t in trees):
            # choices differ in more than their last token (HellaSwag endings): run each document's
            # prefix once and the distinct tails as branches on its cache (a tree row with a 4D mask
            # would pay dense attention over all tails, measured slower on CPU)
            result: list[list[float]] = [[0.0] * len(u.choices) for u in docs]
            order = sorted(range(len(docs)), key=lambda j: -(docs[j].shared - docs[j].family_len))
            for s in range(0, len(order), self.batch_size):
                batch = order[s : s + self.batch_size]
                self._score_doc_batch([docs[j] for j in batch], fam_cache, fam_len, [result[j] for j in batch])
                self._advance(len(batch))
            return result
        # one input row per document (MMLU): pack several short documents into one row
        order = sorted(range(len(docs)), key=lambda j: -len(trees[j].row))  # longest first: little padding
        rows = self._pack([trees[j] for j in order]) if self.share_prefix else [[trees[j]] for j in order]
        for s in range(0, len(rows), self.batch_size):
            self._score_rows(rows[s : s + self.batch_size], fam_cache, fam_len)
            self._advance(sum(len(r) for r in rows[s : s + self.batch_size]))
        return [t.sums for t in trees]

    def _advance(self, documents: int) -> None:
        if self.progress is not None:
            self.progress.update(documents)

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
        lp = torch.log_softmax(logits.float(), dim=-1)
        picked = lp[index[rows, colt].to(dev), tgt].double()
        sums = torch.zeros(n_slots, dtype=torch.float64, device=dev).index_add_(0, slot, picked).tolist()
        k = 0
        for t in trees:
            t.sums = sums[k : k + len(t.doc.choices)]
            k += len(t.doc.choices)

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

    def _score_doc_batch(self, docs: list[_Doc], fam_cache: Any, fam_len: int, results: list[list[float]]) -> None:
        rows = [u.choices[0].input_ids[fam_len : u.shared] for u in docs]
        ids, mask, offs = self._pad(rows)
        pos = self._positions(mask, offs, [fam_len] * len(docs))
        # branches: the tails of the choices after the shared prefix (identical tails run once)
        branches: list[tuple[int, tuple[int, ...]]] = []  # (doc row, tail tokens)
        branch_of: dict[tuple[int, tuple[int, ...]], int] = {}
        for b, u in enumerate(docs):
            for e in u.choices:
                tail = e.input_ids[u.shared :]
                if tail and (b, tail) not in branch_of:
                    branch_of[(b, tail)] = len(branches)
                    branches.append((b, tail))
        past = None
        if fam_cache is not None:
            past = self._select_cache(fam_cache, [0] * len(docs))
            mask = torch.cat([torch.ones((len(docs), fam_len), dtype=torch.long), mask], dim=1)
        # positions scored at the shared level (p < shared predicts token p + 1): usually the first
        # continuation token or none; the LM head runs on these only
        keep = torch.zeros(ids.shape, dtype=torch.bool)
        wanted: list[tuple[int, int, torch.Tensor, list[int]]] = []  # (doc row, choice, columns, targets)
        for b, u in enumerate(docs):
            for i, e in enumerate(u.choices):
                lo, hi = e.start - 1, min(len(e.input_ids), u.shared)  # predicting positions in [lo, hi)
                if lo < hi:
                    cols = torch.arange(lo, hi) - fam_len + offs[b]
                    keep[b, cols] = True
                    wanted.append((b, i, cols, list(e.tokens[lo + 1 : hi + 1])))
        dev = self.device
        # right-padded rows without a family prefix: pads come after every real token, so the plain
        # causal mask is exact (and takes the causal attention kernel); branches still see ``mask``
        plain = fam_cache is None and self.padding_side == "right"
        logits, cache = self._forward(ids.to(dev), None if plain else mask.to(dev), pos.to(dev), past,
                                      bool(branches), keep=keep.to(dev))
        if wanted:
            index = torch.full(keep.shape, -1, dtype=torch.long)
            index[keep] = torch.arange(int(keep.sum()))
            lp = torch.log_softmax(logits.float(), dim=-1)
            for b, i, cols, targets in wanted:
                tgt = torch.tensor(targets, device=dev)
                results[b][i] += float(lp[index[b, cols].to(dev)].gather(-1, tgt[:, None]).double().sum())
        if not branches:
            return
        branch_scores = self._score_branches(docs, branches, cache, mask)
        for b, u in enumerate(docs):
            for i, e in enumerate(u.choices):
                tail = e.input_ids[u.shared :]
                if not tail:
                    continue
                lp_rows = branch_scores[branch_of[(b, tail)]]  # (len(tail), V) log-probs
                lo = max(e.start - 1, u.shared)
                rel = torch.arange(lo, len(e.input_ids)) - u.shared
                tgt = torch.tensor(e.tokens[lo + 1 :], device=lp_rows.device)
                results[b][i] += float(lp_rows[rel.to(lp_rows.device)].gather(-1, tgt[:, None]).double().sum())

    def _score_branches(self, docs: list[_Doc], branches: list[tuple[int, tuple[int, ...]]], cache: Any,
                        doc_mask: torch.Tensor) -> list[torch.Tensor]:
        """Run every branch on top of its document's cache; returns per branch (len, V) log-probs."""
        out: list[torch.Tensor] = [torch.empty(0)] * len(branches)
        order = sorted(range(len(branches)), key=lambda k: -len(branches[k][1]))
        dev = self.device
        for s in range(0, len(order), self.batch_size):
            chunk = order[s : s + self.batch_size]
            doc_rows = [branches[k][0] for k in chunk]
            ids, mask, offs = self._pad([branches[k][1] for k in chunk])
            pos = self._positions(mask, offs, [docs[r].shared for r in doc_rows])
            past = self._select_cache(cache, doc_rows)
            full_mask = torch.cat([doc_mask[doc_rows], mask], dim=1)
            # every real tail position is scored; the LM head skips the padding (kept rows come row-major)
            logits, _ = self._forward(ids.to(dev), full_mask.to(dev), pos.to(dev), past, True,
                                      keep=mask.bool().to(dev))
            lp = torch.log_softmax(logits.float(), dim=-1)  # (real tail positions, V)
            at = 0
            for k in chunk:
                n = len(branches[k][1])
                out[k] = lp[at : at + n]
                at += n
        return out


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
