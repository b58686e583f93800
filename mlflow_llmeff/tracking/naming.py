"""Run names that are a function of the configuration alone: short parts in one fixed order.

A name is made of short parts, one per condition (``tiny``, ``ao8bit``, ``ddp2``, ``hs+mmlu``, ``bf16``,
``gbt4k``, ``s4k``, ``h100``), always in the order of :data:`PARTS` (model, memory levers that differ
from the default, layout, evals, precision, global batch, sequence length, accelerator); a condition the run
lacks gives no part, and neither does a default: torch AdamW, sdpa, fp32 weights (no lever part) and a single
process (no layout part: ``tiny-fp32-gbt1k-s128-cpu``, where two DDP processes give
``tiny-ddp2-fp32-gbt2k-s128-cpu``). A batch shape that varied between micro-batches
(``llmeff.seq_len=dynamic``, dynamic padding or packing) gives no batch or length part: ``llama-fp32-cpu``.
So the same configuration has the same name stem in every experiment and for every repeat, and a
name can be read (and searched: ``attributes.run_name LIKE 'tiny-ddp2-%'``) without knowing which
other runs existed when it was made. A repeat index (``-2``, ``-3``) is added only when a run of the
experiment already has the name (by :func:`mlflow_llmeff.tracking.experiments.unique_run_name`). A pure
calculator.

What differs comes within the first 20 characters, which the MLflow runs table shows of a name: the
parts are short and defaults give none, so a short model's layout, precision and batch (the axes a study
varies) end by the 20th character. Until issue 53 a single process was named ``single``, and
``tiny-single-fp32-gbt512-s128-cpu`` and ``tiny-single-fp32-gbt4k-s128-cpu`` differed only after the
20th character (``tiny-single-fp32-gbt``), one name in the table for two batches.

Example: the UI trial's five runs are ``tiny-fp32-gbt1k-s128-cpu``, ``tiny-ddp2-fp32-gbt2k-s128-cpu``,
``tiny-fp32-gbt4k-s128-cpu``, ``160m-fp32-gbt1k-s128-cpu`` and ``tiny-hs-fp32-gbt1k-s128-cpu``
(tests/test_naming.py). Until issue 31 the parts that varied most among the experiment's runs came
first, so repeats of one configuration were named ``tiny-ddp2-fp32-...`` in one experiment and
``ddp2-gbt2k-tiny-...`` in another: a name that depends on the other runs is no name of a configuration.
"""

from __future__ import annotations

import re
from typing import Mapping

from mlflow_llmeff import names

__all__ = ["PARTS", "human_count", "parts_from_tags", "study_name"]

#: The parts of a name, in their fixed order: (part, what it shows).
PARTS = ("model", "levers", "layout", "evals", "precision", "batch", "seq", "accelerator")

#: Optimizers' short names by (package family, class): the part of a name ``llmeff.optimizer`` gives;
#: torch's AdamW, the default, gives none. Another class is named by its class, lowercased.
_OPTIMIZER_SHORT = {("torch", "adamw"): "", ("torchao", "adamw8bit"): "ao8bit", ("torchao", "adamw4bit"): "ao4bit",
                    ("torchao", "adamwfp8"): "aofp8", ("bitsandbytes", "adamw8bit"): "bnb8bit",
                    ("bitsandbytes", "pagedadamw8bit"): "bnbpaged8bit", ("mlflow_llmeff", "adamwbf16"): "adamwbf16"}
_ATTENTION_SHORT = {"sdpa": "", "eager": "eager", "flash_attention_2": "fa2", "flash_attention_3": "fa3",
                    "flex_attention": "flex"}

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
    """``ddp2``, ``zero3x8``, ``fsdp``; '' for a single process (the default layout gives no part)."""
    short = _STRATEGY_SHORT.get(strategy, strategy.replace("_", ""))
    if short == "single":
        return ""
    if not count:
        return short
    return f"{short}x{count}" if short[-1].isdigit() else f"{short}{count}"


def _levers(tags: Mapping[str, str]) -> str:
    """The memory levers that differ from the default (torch AdamW, sdpa, fp32 weights, no activation
    checkpointing, every weight trained), joined by '-': ``ao8bit``, ``eager``, ``wbf16``, ``ckpt``, ``lora8``
    (LoRA rank 8, read from ``llmeff.flops.trainable``); '' for the default."""
    out = []
    opt = tags.get(names.OPTIMIZER, "")
    if opt:  # 'AdamW8bit (torchao.optim); states ...': the class and its package's top module
        cls, _, rest = opt.split(";")[0].partition(" (")
        family = rest.split(".")[0].rstrip(")").strip()
        out.append(_OPTIMIZER_SHORT.get((family, cls.strip().lower()), cls.strip().lower()))
    attn = tags.get(names.ATTENTION, "")
    if attn and not attn.startswith("unknown"):
        out.append(_ATTENTION_SHORT.get(attn, attn.replace("_", "")))
    if tags.get(names.WEIGHTS, "fp32") not in ("fp32", ""):
        out.append("w" + tags[names.WEIGHTS])
    if tags.get(names.ACT_CKPT, "").lower() == "true":
        out.append("ckpt")
    lora = re.search(r"LoRA r=([0-9/]+)", tags.get(names.FLOPS_TRAINABLE, ""))
    if lora:  # adapters on a frozen base: 'lora8'
        out.append("lora" + lora.group(1).replace("/", "+"))
    return "-".join(p for p in out if p)


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
    levers = _levers(tags)
    if levers:
        out["levers"] = levers
    layout = _layout(tags[names.PAR_STRATEGY], tags.get(names.ACCEL_COUNT, "")) if tags.get(names.PAR_STRATEGY) else ""
    if layout:
        out["layout"] = layout
    tasks = [t.strip() for t in (eval_tasks or "").split(",") if t.strip() and t.strip() != "none"]
    if tasks:
        out["evals"] = "+".join(_EVAL_SHORT.get(t, t) for t in tasks)
    if tags.get(names.PRECISION):
        out["precision"] = tags[names.PRECISION]
    # a value that is no count ('dynamic': the shape varied between micro-batches) gives no part
    for part, key, prefix in (("batch", names.GLOBAL_BATCH_TOKENS, "gbt"), ("seq", names.SEQ_LEN, "s")):
        try:
            out[part] = prefix + human_count(tags[key])
        except (KeyError, ValueError):
            pass
    if tags.get(names.ACCEL_SHORT):
        out["accelerator"] = tags[names.ACCEL_SHORT].lower()
    return out


def study_name(this: Mapping[str, str]) -> str:
    """The name stem of a run with parts ``this`` (:func:`parts_from_tags`): its parts joined by ``-``
    in :data:`PARTS` order (a function of the configuration alone); '' for a run with no part."""
    return "-".join(this[p] for p in PARTS if this.get(p))
