"""HellaSwag prompts and scoring, as lm-evaluation-harness 0.4.x task ``hellaswag`` defines them.

Per document (harness ``tasks/hellaswag/utils.py``): ``query = preprocess(activity_label + ": " +
ctx_a + " " + ctx_b.capitalize())`` and ``choices = [preprocess(e) for e in endings]``, where
``preprocess`` strips, turns ``" [title]"`` into ``". "``, deletes every ``[...]`` (WikiHow
artifacts, non-greedy) and then replaces double spaces by one (once, left to right). Note
``str.capitalize`` lower-cases the rest of ``ctx_b``, as in the harness.

Each choice is scored as the continuation ``" " + choice`` of ``query``. ``acc``: argmax of the
summed log-likelihoods is the label; ``acc_norm``: argmax of log-likelihood / ``len(choice)``, the
length in *characters* of the preprocessed ending without the leading space (harness
``completion_len``; the harness's per-byte variant is ``acc_bytes``, not reported here).
"""

from __future__ import annotations

import re
from typing import Any, Sequence

__all__ = ["preprocess", "process_doc", "requests", "predictions"]

_BRACKETS = re.compile(r"\[.*?\]")


def preprocess(text: str) -> str:
    """The harness's HellaSwag text clean-up."""
    text = text.strip()
    text = text.replace(" [title]", ". ")
    text = _BRACKETS.sub("", text)
    return text.replace("  ", " ")


def process_doc(doc: dict[str, Any]) -> dict[str, Any]:
    """``{"query": str, "choices": [4 str], "gold": int}`` from a raw HellaSwag record."""
    ctx = doc["ctx_a"] + " " + doc["ctx_b"].capitalize()
    return {"query": preprocess(doc["activity_label"] + ": " + ctx),
            "choices": [preprocess(e) for e in doc["endings"]],
            "gold": int(doc["label"])}


def requests(pdoc: dict[str, Any]) -> list[tuple[str, str]]:
    """The four (context, continuation) pairs of a processed document."""
    return [(pdoc["query"], " " + c) for c in pdoc["choices"]]


def predictions(logliks: Sequence[float], choices: Sequence[str]) -> tuple[int, int]:
    """(pred by summed log-likelihood, pred by log-likelihood per character); ties -> first index."""
    pred = max(range(len(logliks)), key=lambda i: (logliks[i], -i))
    # numpy (the harness) gives -inf for ll / 0 with ll < 0; keep that for an empty ending
    normed = [ll / float(len(c)) if c else float("-inf") for ll, c in zip(logliks, choices)]
    pred_norm = max(range(len(normed)), key=lambda i: (normed[i], -i))
    return pred, pred_norm
