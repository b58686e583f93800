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
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
from dataclasses import dataclass, field
from typing import Any, Hashable, Sequence

import torch

from mlflow_llmeff.models.bytetok import byte_offset, special_strings

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
        # a ByT5 tokenizer's Python code costs ~2 us per character; the direct map gives the same ids
        self._byte_offset = byte_offset(tokenizer)
        self._specials = special_strings(tokenizer) if self._byte_offset is not None else ()

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
    lead: tuple[int, ...] = ()  # the choice tail run in the prefix's own row (branching documents)
    weight: float = 1.0  # the document's share in this unit (progress counts documents)


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
        truncated ones are, counts 1/len(choices) a choice; the fraction waits for the rest)."""
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


@contextlib.contextmanager
def _kept_positions_only(mlp: torch.nn.Module, keep: torch.Tensor):
    """Within the block, ``mlp`` (a position-wise module ``(B, T, H) -> (B, T, H)``) runs on the
    ``keep`` positions (bool ``(B, T)``) only; its output elsewhere is zero (never read). Forward
    hooks, removed on exit: the module itself is not changed."""
    def pre(module: Any, args: tuple) -> tuple:
        return (args[0][keep][None],) + tuple(args[1:])

    def post(module: Any, args: tuple, out: Any) -> torch.Tensor:
        if not isinstance(out, torch.Tensor):
            raise TypeError("the feed-forward module returned no tensor")
        full = torch.zeros(keep.shape + out.shape[-1:], dtype=out.dtype, device=out.device)
        full[keep] = out[0]
        return full

    handles = [mlp.register_forward_pre_hook(pre), mlp.register_forward_hook(post)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


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


class _Picks:
    """Log-likelihood terms waiting for their LM head: hidden states of scored positions are
    gathered from many small forward passes (short HellaSwag tails) and the LM head and
    log-softmax run on ``block_rows`` of them at once. On this project's 2-core CPU a 32k-vocabulary
    head ran at 79 GFLOP/s on 264 rows and 110 GFLOP/s on 2,048 (``bench/evals.py``). Without a
    head split (see ``LoglikelihoodScorer._head_split``) the states given are logits and are scored
    at once.

    Args:
        head: the LM head (``(N, H) -> (N, V)``), or None when ``add`` receives logits.
        block_rows: rows per LM-head call (memory: ``block_rows * V`` float32 twice).
    """

    def __init__(self, head: Any, block_rows: int) -> None:
        self.head, self.block_rows = head, block_rows
        self.states: list[torch.Tensor] = []
        self.rows: list[int] = []
        self.targets: list[int] = []
        self.counts: list[int] = []
        self.owners: list[tuple[list[float], int]] = []
        self.n = 0

    def add(self, states: torch.Tensor, rows: list[int], targets: list[int], counts: list[int],
            owners: list[tuple[list[float], int]]) -> None:
        """``states`` ``(N, H or V)``; ``rows``/``targets`` aligned (row of ``states``, token id);
        ``counts[k]`` consecutive entries are summed into ``owners[k] = (results row, choice)``."""
        self.states.append(states)
        self.rows += [self.n + r for r in rows]
        self.targets += targets
        self.counts += counts
        self.owners += owners
        self.n += states.shape[0]
        if self.head is None or self.n >= self.block_rows:
            self.flush()

    def flush(self) -> None:
        """Run the LM head on what is waiting and add every sum to its owner."""
        if not self.owners:
            self.states, self.n = [], 0
            return
        states = self.states[0] if len(self.states) == 1 else torch.cat(self.states)
        logits = states if self.head is None else self.head(states)
        dev = logits.device
        slot = torch.repeat_interleave(torch.arange(len(self.counts)), torch.tensor(self.counts))
        sums = _picked_sums(logits, torch.tensor(self.rows, device=dev), torch.tensor(self.targets, device=dev),
                            slot.to(dev), len(self.counts))
        for (res, i), v in zip(self.owners, sums):
            res[i] += v
        self.states, self.rows, self.targets, self.counts, self.owners, self.n = [], [], [], [], [], 0


def _picked_sums(logits: torch.Tensor, rows: torch.Tensor, targets: torch.Tensor, slot: torch.Tensor,
                 n_slots: int) -> list[float]:
    """Per slot, the float64 sum of ``log_softmax(logits)[rows, targets]`` over its entries.

    ``logits`` is ``(N, V)``; ``rows``, ``targets`` and ``slot`` are aligned 1D index tensors.
    Log-softmax in float32 as the harness computes it, then only the picked entries are read (a
    fused log-softmax measured faster on CPU than ``logit - logsumexp``, which makes three passes).
    """
    picked = torch.log_softmax(logits.float(), dim=-1)[rows, targets].double()
    return torch.zeros(n_slots, dtype=torch.float64, device=logits.device).index_add_(0, slot, picked).tolist()


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
