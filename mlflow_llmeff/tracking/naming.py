"""Run names that differ at their start: the conditions that vary most between the runs of a study first.

The MLflow UI cuts run names at about 25 characters in the runs table and in chart legends, so a
name whose differences sit at its end reads like its neighbours. A name is made of short parts,
one per condition (``tiny``, ``ddp2``, ``gbt4k``, ``bf16``, ``s4k``, ``h100``, ``hs+mmlu``); the
parts whose value differs most among the experiment's runs (this one included) come first, ties
in the fixed order of :data:`PARTS`; with no other run the fixed order is the name. A repeat index
(``-2``, ``-3``) is added only when every part equals an existing run's (by
:func:`mlflow_llmeff.tracking.runs.unique_run_name`). A pure calculator: the caller reads the
other runs' conditions (their ``llmeff.*`` tags).

Example: the UI trial's five runs, made one after another in one experiment, are named
``tiny-single-fp32-gbt1k-s128-cpu``, ``ddp2-gbt2k-tiny-fp32-s128-cpu``,
``gbt4k-single-tiny-fp32-s128-cpu``, ``gbt1k-160m-single-fp32-s128-cpu`` and
``gbt1k-tiny-single-hs-fp32-s128-cpu`` (tests/test_naming.py).
"""

from __future__ import annotations

from typing import Mapping, Sequence

from mlflow_llmeff import names

__all__ = ["PARTS", "human_count", "parts_from_tags", "study_name"]

#: The parts of a name, in their fixed order: (part, what it shows).
PARTS = ("model", "layout", "evals", "precision", "batch", "seq", "accelerator")

_STRATEGY_SHORT = {"single": "single", "ddp": "ddp", "fsdp": "fsdp", "hsdp": "hsdp", "tp": "tp",
                   "fsdp_tp": "fsdptp", "deepspeed_zero1": "zero1", "deepspeed_zero2": "zero2",
                   "deepspeed_zero3": "zero3", "megatron": "megatron"}
_EVAL_SHORT = {"hellaswag": "hs", "mmlu": "mmlu", "val": "val"}


def human_count(n: int | str) -> str:
    """``1024`` -> ``1k``, ``1536`` -> ``1.5k``, ``4194304`` -> ``4M``, ``128`` -> ``128`` (binary multiples).

    Raises:
        ValueError: for a value that is not a non-negative integer.
    """
    try:
        v = int(n)
    except (TypeError, ValueError):
        raise ValueError(f"count {n!r} is not accepted; give a non-negative integer") from None
    if v < 0:
        raise ValueError(f"count {n!r} is not accepted; give a non-negative integer")
    for unit, size in (("M", 2 ** 20), ("k", 2 ** 10)):
        if v >= size and (v * 10) % size == 0:
            return f"{v / size:g}{unit}"
    return str(v)


def _model(name: str) -> str:
    base = name.rstrip("/").split("/")[-1]
    return base[len("llama-"):] if base.startswith("llama-") else base


def _layout(strategy: str, count: str) -> str:
    short = _STRATEGY_SHORT.get(strategy, strategy.replace("_", ""))
    if short == "single" or not count:
        return short
    return f"{short}x{count}" if short[-1].isdigit() else f"{short}{count}"


def parts_from_tags(tags: Mapping[str, str], eval_tasks: str | None = None) -> dict[str, str]:
    """The name parts of a run from its condition tags (``llmeff.*``); absent conditions give no part.

    Args:
        tags: the run's tags (or the conditions a new run will have, by the same keys).
        eval_tasks: comma-separated eval tasks of a run that evaluates benchmarks (default: the
            tasks named by its ``llmeff.eval.documents``-era tags are unknown, so none).
    """
    out = {}
    tags = {k: v for k, v in tags.items() if v not in (None, "", "auto")}  # "auto": not decided yet
    if tags.get(names.MODEL_NAME):
        out["model"] = _model(tags[names.MODEL_NAME])
    if tags.get(names.PAR_STRATEGY):
        out["layout"] = _layout(tags[names.PAR_STRATEGY], tags.get(names.ACCEL_COUNT, ""))
    tasks = [t.strip() for t in (eval_tasks or "").split(",") if t.strip() and t.strip() != "none"]
    if tasks:
        out["evals"] = "+".join(_EVAL_SHORT.get(t, t) for t in tasks)
    if tags.get(names.PRECISION):
        out["precision"] = tags[names.PRECISION]
    for part, key, prefix in (("batch", names.GLOBAL_BATCH_TOKENS, "gbt"), ("seq", names.SEQ_LEN, "s")):
        try:
            out[part] = prefix + human_count(tags[key])
        except (KeyError, ValueError):
            pass
    if tags.get(names.ACCEL_SHORT):
        out["accelerator"] = tags[names.ACCEL_SHORT].lower()
    return out


def study_name(this: Mapping[str, str], others: Sequence[Mapping[str, str]] = ()) -> str:
    """The name of a run with parts ``this`` among runs with parts ``others`` (:func:`parts_from_tags`).

    Parts are ordered by how many distinct values they take over ``others`` and this run (most
    first), ties in :data:`PARTS` order; a part this run lacks is left out.
    """
    everyone = [*others, this]

    def distinct(part: str) -> int:
        return len({o.get(part, "") for o in everyone})

    order = sorted((p for p in PARTS if this.get(p)), key=lambda p: (-distinct(p), PARTS.index(p)))
    return "-".join(this[p] for p in order)
