"""Direct encoding for ByT5-style byte tokenizers: token id = UTF-8 byte + offset.

transformers' ``ByT5Tokenizer`` is pure Python (~2 us per character): tokenizing a 2 GB corpus with
it takes over half an hour on two cores. Its ids are, by definition, each UTF-8 byte plus a fixed
offset (3 for ``extra_ids=0``: pad, EOS, UNK come first), except where the text spells one of its
special tokens (``"</s>"``...), which it turns into that token's id. This module checks a tokenizer
against that rule on a probe string and, where it holds, encodes without it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["byte_offset", "special_strings"]

_PROBE = "Ab c\n\u00e9\u4e2d!\x00\U0001f600"


def byte_offset(tokenizer: Any) -> int | None:
    """Id of byte 0 when ``tokenizer`` is a ``ByT5Tokenizer`` whose ids are UTF-8 bytes + that
    offset (checked on a probe string with 1- to 4-byte characters), else None."""
    offset = getattr(tokenizer, "offset", None)
    if type(tokenizer).__name__ != "ByT5Tokenizer" or not isinstance(offset, int):
        return None
    slow = list(tokenizer(_PROBE, add_special_tokens=False)["input_ids"])
    return offset if slow == [b + offset for b in _PROBE.encode("utf-8")] else None


def special_strings(tokenizer: Any) -> tuple[str, ...]:
    """Strings the tokenizer turns into a single special or added token; text holding any of them
    must go through the tokenizer itself."""
    return tuple(sorted(set(tokenizer.all_special_tokens) | set(tokenizer.get_added_vocab())))
