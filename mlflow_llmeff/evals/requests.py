"""Building the requests the scorer runs: token ids of (context, continuation) pairs as
lm-evaluation-harness 0.4.x encodes them, and the documents they form.

:func:`encode_pair` splits ``context + continuation`` as ``HFLM._encode_pair`` does;
:class:`_Encoder` keeps a tokenizer's leading special tokens (BOS) and never adds trailing ones;
:class:`Encoded` is one scored sequence; :class:`_Doc` the choices of one document and their
shared input prefix; :func:`resolve_max_length` the model's context length as the harness looks it
up. No torch here: the model runs in :mod:`mlflow_llmeff.evals.scoring`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Sequence

from mlflow_llmeff.models.bytetok import byte_offset, special_strings

__all__ = ["Encoded", "encode_pair", "resolve_max_length"]

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
