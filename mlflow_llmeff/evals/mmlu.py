"""MMLU prompts and scoring, as lm-evaluation-harness 0.4.x task ``mmlu`` (``mmlu/default``) defines them.

Prompt (harness ``_default_template_yaml`` and ``_generate_configs.py``)::

    The following are multiple choice questions (with answers) about <subject, _ as space>.\\n\\n
    <k few-shot blocks: question.strip()\\nA. ..\\nB. ..\\nC. ..\\nD. ..\\nAnswer: <letter>\\n\\n>
    <question.strip()>\\nA. <c0>\\nB. <c1>\\nC. <c2>\\nD. <c3>\\nAnswer:

scored with the continuations ``" A"`` .. ``" D"`` (target delimiter ``" "``). The k few-shot
examples are the first k rows of the subject's ``dev`` split (sampler ``first_n``, seed unused).
``acc`` = 1 when the argmax of the summed log-likelihoods is the answer.

Aggregate: the harness's ``mmlu`` group (and its stem/other/social_sciences/humanities subgroups)
declares ``aggregate_metric_list: acc, weight_by_size: True``, so ``mmlu/acc`` is the mean over
all questions (each subject weighted by its number of test questions), not the mean of the 57
subject accuracies.
"""

from __future__ import annotations

from typing import Any, Sequence

__all__ = ["CONTINUATIONS", "aggregate_acc", "context", "description", "doc_to_text", "fewshot_block", "requests"]

CONTINUATIONS = (" A", " B", " C", " D")


def description(subject: str) -> str:
    """The harness's task description, e.g. ``"...about high school biology.\\n\\n"``."""
    return f"The following are multiple choice questions (with answers) about {' '.join(subject.split('_'))}.\n\n"


def doc_to_text(doc: dict[str, Any]) -> str:
    """Question (stripped) and the four lettered choices (not stripped), ending in ``Answer:``."""
    c = doc["choices"]
    return f"{doc['question'].strip()}\nA. {c[0]}\nB. {c[1]}\nC. {c[2]}\nD. {c[3]}\nAnswer:"


def fewshot_block(doc: dict[str, Any]) -> str:
    """One solved example: text, target delimiter, answer letter, few-shot delimiter."""
    return doc_to_text(doc) + " " + "ABCD"[doc["answer"]] + "\n\n"


def context(doc: dict[str, Any], fewshot: Sequence[dict[str, Any]]) -> str:
    """Full context for ``doc`` with the given solved examples (the first k dev rows)."""
    return description(doc["subject"]) + "".join(fewshot_block(d) for d in fewshot) + doc_to_text(doc)


def requests(doc: dict[str, Any], fewshot: Sequence[dict[str, Any]]) -> list[tuple[str, str]]:
    """The four (context, continuation) pairs scored for ``doc``."""
    ctx = context(doc, fewshot)
    return [(ctx, c) for c in CONTINUATIONS]


def aggregate_acc(per_subject: dict[str, tuple[float, int]]) -> float:
    """Group accuracy weighted by size: sum(acc_s * n_s) / sum(n_s).

    Args:
        per_subject: subject -> (accuracy in [0, 1], number of scored questions).
    """
    total = sum(n for _, n in per_subject.values())
    if total == 0:
        raise ValueError("per_subject {} has no scored questions; need at least one subject with n > 0")
    return sum(a * n for a, n in per_subject.values()) / total
