"""Loading MMLU and HellaSwag documents from their sources: the hub (default) or a local directory.

With no data directory given (no ``--data-dir`` / ``eval_data_dir``, no ``$LLMEFF_DATA_DIR``), the
documents come from the Hugging Face hub through ``datasets``, as lm-evaluation-harness 0.4 reads
them: ``cais/mmlu`` (config ``<subject>``, splits ``test`` scored and ``dev`` few-shot) and
``Rowan/hellaswag`` (split ``validation``); a warm ``datasets`` cache serves them offline. A data
directory in the original release formats is the alternative for machines without the hub::

    mmlu/dev/<subject>_dev.csv      5 few-shot examples per subject
    mmlu/test/<subject>_test.csv    the scored questions
    hellaswag/hellaswag_val.jsonl   the scored HellaSwag validation set

MMLU CSVs have no header and six columns ``question,A,B,C,D,answer`` (answer a letter A-D), as in
Hendrycks et al.'s release; HellaSwag lines are the original jsonl records (``ctx_a``, ``ctx_b``,
``activity_label``, ``endings`` (4), ``label``). Both sources give the same documents, in the
field layout of the hub copies (``cais/mmlu``: question, subject, choices, answer as an index;
``Rowan/hellaswag``: the jsonl fields, ``label`` an int), in file order.
"""

from __future__ import annotations

import csv
import functools
import json
import os
from pathlib import Path
from typing import Any

from mlflow_llmeff.names import shorten

__all__ = ["DATA_DIR_ENV", "HELLASWAG_HUB", "HUB", "LAYOUT", "MMLU_HUB", "MMLU_SUBJECTS", "load_hellaswag",
           "load_mmlu", "resolve_data_dir"]

DATA_DIR_ENV = "LLMEFF_DATA_DIR"
HUB = "hub"
MMLU_HUB = "cais/mmlu"  # lm-evaluation-harness tasks/mmlu/default: dataset_path, one config per subject
HELLASWAG_HUB = "Rowan/hellaswag"  # lm-evaluation-harness tasks/hellaswag: validation_split "validation"
LAYOUT = "expected layout: <data_dir>/mmlu/dev/<subject>_dev.csv, <data_dir>/mmlu/test/<subject>_test.csv, " \
         "<data_dir>/hellaswag/hellaswag_val.jsonl"

# The 57 MMLU subjects (file stems of the release, config names of cais/mmlu), alphabetical.
MMLU_SUBJECTS: tuple[str, ...] = (
    "abstract_algebra", "anatomy", "astronomy", "business_ethics", "clinical_knowledge", "college_biology",
    "college_chemistry", "college_computer_science", "college_mathematics", "college_medicine",
    "college_physics", "computer_security", "conceptual_physics", "econometrics", "electrical_engineering",
    "elementary_mathematics", "formal_logic", "global_facts", "high_school_biology", "high_school_chemistry",
    "high_school_computer_science", "high_school_european_history", "high_school_geography",
    "high_school_government_and_politics", "high_school_macroeconomics", "high_school_mathematics",
    "high_school_microeconomics", "high_school_physics", "high_school_psychology", "high_school_statistics",
    "high_school_us_history", "high_school_world_history", "human_aging", "human_sexuality",
    "international_law", "jurisprudence", "logical_fallacies", "machine_learning", "management", "marketing",
    "medical_genetics", "miscellaneous", "moral_disputes", "moral_scenarios", "nutrition", "philosophy",
    "prehistory", "professional_accounting", "professional_law", "professional_medicine",
    "professional_psychology", "public_relations", "security_studies", "sociology", "us_foreign_policy",
    "virology", "world_religions",
)
_LETTERS = "ABCD"


def resolve_data_dir(data_dir: str | os.PathLike | None = None) -> str:
    """Where documents come from: ``data_dir``, else env ``LLMEFF_DATA_DIR``, else :data:`HUB`.

    An empty string counts as not given. ``"hub"`` means the Hugging Face hub (or its cache).
    """
    if data_dir:
        return str(data_dir)
    return os.environ.get(DATA_DIR_ENV) or HUB


@functools.lru_cache(maxsize=None)
def _hub_rows(repo: str, config: str | None, split: str) -> tuple[dict, ...]:
    """Rows of a hub dataset split, loaded once per process (evaluations during training reuse them)."""
    import datasets  # lazy: heavy import

    try:
        ds = datasets.load_dataset(repo, config, split=split)
    except Exception as e:  # noqa: BLE001 - one line instead of the library's stack trace
        what = f"{repo}" + (f" (config {config!r}, split {split!r})" if config else f" (split {split!r})")
        raise ValueError(f"{what} could not be loaded from the Hugging Face hub or the datasets cache "
                         f"({type(e).__name__}: {shorten(str(e).splitlines()[0], 120) if str(e) else ''}); without network "
                         f"access give a local copy with --data-dir DIR (eval_data_dir) or ${DATA_DIR_ENV}; "
                         f"{LAYOUT}") from None
    return tuple(ds)


def _fail(path: Path | str, why: str) -> ValueError:
    return ValueError(f"{path}: {why}; {LAYOUT}")


def load_mmlu(data_dir: str | os.PathLike | None, subject: str, split: str) -> list[dict[str, Any]]:
    """Documents of one MMLU subject and split.

    Args:
        data_dir: a directory in the layout above, ``"hub"``, or None (see :func:`resolve_data_dir`).
        subject: one of :data:`MMLU_SUBJECTS`.
        split: ``"dev"`` (few-shot examples) or ``"test"`` (scored), or ``"val"``.

    Returns:
        ``[{"question": str, "subject": str, "choices": [4 str], "answer": int 0-3}, ...]``.

    Raises:
        ValueError: unknown subject or split; missing or malformed file (names it and the layout).
    """
    if subject not in MMLU_SUBJECTS:
        raise ValueError(f"MMLU subject {subject!r} is not known; accepted: {', '.join(MMLU_SUBJECTS)}")
    if split not in ("dev", "val", "test"):
        raise ValueError(f"MMLU split {split!r} is not accepted; use 'dev', 'val' or 'test'")
    root = resolve_data_dir(data_dir)
    if root == HUB:
        hub_split = {"dev": "dev", "val": "validation", "test": "test"}[split]
        return [{"question": r["question"], "subject": subject, "choices": list(r["choices"]),
                 "answer": int(r["answer"])} for r in _hub_rows(MMLU_HUB, subject, hub_split)]
    path = Path(root) / "mmlu" / split / f"{subject}_{split}.csv"
    if not path.is_file():
        raise _fail(path, "file not found")
    docs = []
    with open(path, newline="", encoding="utf-8") as f:
        for line_no, row in enumerate(csv.reader(f), start=1):
            if len(row) != 6 or row[5].strip() not in _LETTERS or not row[5].strip():
                raise _fail(path, f"row {line_no} is malformed (want 6 columns question,A,B,C,D,answer "
                                  f"with answer one of A-D, no header)")
            docs.append({"question": row[0], "subject": subject, "choices": row[1:5],
                         "answer": _LETTERS.index(row[5].strip())})
    if not docs:
        raise _fail(path, "file is empty")
    return docs


def load_hellaswag(data_dir: str | os.PathLike | None) -> list[dict[str, Any]]:
    """HellaSwag validation documents (the raw jsonl records, ``label`` as int).

    Args:
        data_dir: a directory in the layout above, ``"hub"``, or None (see :func:`resolve_data_dir`).

    Raises:
        ValueError: missing or malformed file (names it and the layout); the hub dataset cannot be
            loaded (names it and the ``--data-dir`` / ``LLMEFF_DATA_DIR`` alternative).
    """
    root = resolve_data_dir(data_dir)
    if root == HUB:
        return [dict(r, label=int(r["label"])) for r in _hub_rows(HELLASWAG_HUB, None, "validation")]
    path = Path(root) / "hellaswag" / "hellaswag_val.jsonl"
    if not path.is_file():
        raise _fail(path, "file not found")
    docs = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                ok = (all(isinstance(rec.get(k), str) for k in ("activity_label", "ctx_a", "ctx_b"))
                      and isinstance(rec.get("endings"), list) and len(rec["endings"]) == 4
                      and int(rec["label"]) in range(4))
            except (ValueError, TypeError, KeyError, AttributeError):
                ok = False
            if not ok:
                raise _fail(path, f"line {line_no} is malformed (want a json object with activity_label, "
                                  f"ctx_a, ctx_b, 4 endings and label 0-3)")
            docs.append(dict(rec, label=int(rec["label"])))
    if not docs:
        raise _fail(path, "file is empty")
    return docs
