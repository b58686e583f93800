"""The memory section of a comparison: per configuration, its levers and where every byte of a device goes.

A pure calculator over :class:`~mlflow_llmeff.report.repeats.Configuration` values, beside the headline
(:mod:`mlflow_llmeff.report.headline`): the levers that move memory (``llmeff.optimizer``,
``llmeff.attention``, ``llmeff.weights``, activation checkpointing) label each configuration, and its
figures are the run summary's memory keys (``docs/memory.md``): the peak per device, its share of what
the device or process may use, the model state split into weights, gradients and optimizer state in
bytes per parameter, the rest of the peak, with tokens/s per device and MFU beside them so a lever's
cost in speed reads on the same line as what it saves.

A section of its own rather than more headline columns: the headline must fit the first 1600-px
screen of the page (tests/test_repeats.py), and the memory columns are wanted only where runs
measured them.
"""

from __future__ import annotations

import re

from mlflow_llmeff import names
from mlflow_llmeff.report.headline import Cell, Headline, estimate_cell, mfu_denominator, mixed_mfu_note
from mlflow_llmeff.report.repeats import Configuration

__all__ = ["memory_table", "lever_label", "MEMORY_KEYS"]

#: The summary keys that make a configuration appear in the memory section.
MEMORY_KEYS = (names.SUM_MEM_PEAK_GIB, names.SUM_OPT_STATE_BYTES_PER_PARAM, names.SUM_MEM_OPT_STATE_GIB)

_GIB = 2**30


def lever_label(c: Configuration) -> str:
    """The levers of ``c`` in a few words: the optimizer's class and package (the part of
    ``llmeff.optimizer`` before its first ';'), the attention kernel, the weights, and ``ckpt`` under
    activation checkpointing; '?' for a lever the runs did not record (runs from before the tags)."""
    opt = (c.tag(names.OPTIMIZER) or "?").split(";")[0].strip()
    attn = (c.tag(names.ATTENTION) or "?").split(":")[0].strip()
    parts = [opt, attn, f"{c.tag(names.WEIGHTS) or '?'} weights"]
    if (c.tag(names.ACT_CKPT) or "").lower() == "true":
        parts.append("ckpt")
    lora = re.search(r"LoRA r=[0-9/]+ on [A-Za-z0-9_,]+", c.tag(names.FLOPS_TRAINABLE) or "")
    if lora:
        parts.append(lora.group(0))
    return ", ".join(parts)


def _mean(c: Configuration, key: str) -> float | None:
    e = c.estimate(key)
    return e.mean if e is not None else None


def _per_param(c: Configuration, key: str) -> float | None:
    """A GiB figure of one device as bytes per parameter of the model (``llmeff.model.params``)."""
    gib, params = _mean(c, key), c.tag(names.MODEL_PARAMS) or ""
    if gib is None or not params.isdigit() or int(params) == 0:
        return None
    return gib * _GIB / int(params)


def _three(v: float) -> str:
    return format(v, ".3g")


def _num(v: float | None, fmt: str) -> Cell:
    return Cell("" if v is None else format(v, fmt), v)


def memory_table(configs: list[Configuration]) -> Headline | None:
    """The memory section: one row per configuration that holds a memory figure, in ``configs``' order.

    Columns: configuration, levers (:func:`lever_label`), peak GiB per device
    (``summary/memory/peak_gib``, with its 95% interval across repeats as the headline's figures have it:
    Student's t over two or more, ``(1 run)`` for one, whose memory has no between-run floor), share of capacity (``summary/memory/peak_fraction``), weights,
    gradients and optimizer state in bytes per parameter (``summary/memory/*_gib`` x 2^30 /
    ``llmeff.model.params``: one device's bytes, so a sharded run reads its share), their sum
    (``summary/model_state_bytes_per_param``), the rest of the peak in GiB (activations, workspace, the
    optimizer step's temporaries: ``summary/memory/other_gib``, with its interval the same way), tokens/s per device and MFU (against
    the dense BF16 datasheet peak where known, else the measured matmul peak, marked ``*``).

    Returns:
        None when no configuration holds any of :data:`MEMORY_KEYS` (runs from before these keys).
    """
    rows, shown, notes, denominators = [], [], set(), []
    for c in configs:
        if not any(c.estimate(k) is not None for k in MEMORY_KEYS):
            continue
        peak = _mean(c, names.SUM_MEM_PEAK_GIB)
        frac = _mean(c, names.SUM_MEM_PEAK_FRACTION)
        mfu = _mean(c, names.SUM_MFU_BF16_PEAK)
        mfu_text = "" if mfu is None else f"{mfu:.1%}"
        if mfu is None and (mp := _mean(c, names.SUM_MFU_MEASURED_PEAK)) is not None:
            mfu, mfu_text = mp, f"{mp:.1%} *"
            notes.add("* MFU against the measured matmul peak of the device (no datasheet peak)")
        if (den := mfu_denominator(c)) is not None:
            denominators.append((c.label, den))
        if peak is not None and (c.tag(names.MEMORY_SOURCE) or "").startswith("cpu"):
            notes.add("peak on CPU: the process's peak RSS above its RSS when the meter started, plus the tensors "
                      "held then (llmeff.memory.source); share of capacity: peak RSS / the cgroup's limit, else the "
                      "host's memory (llmeff.memory.capacity)")
        rows.append([Cell(c.label, c.label), Cell(lever_label(c), lever_label(c)),
                     estimate_cell(c.estimate(names.SUM_MEM_PEAK_GIB), fmt=_three),
                     Cell("" if frac is None else f"{frac:.1%}", frac),
                     _num(_per_param(c, names.SUM_MEM_WEIGHTS_GIB), ".3g"),
                     _num(_per_param(c, names.SUM_MEM_GRADIENTS_GIB), ".3g"),
                     _num(_mean(c, names.SUM_OPT_STATE_BYTES_PER_PARAM), ".3g"),
                     _num(_mean(c, names.SUM_MODEL_STATE_BYTES_PER_PARAM), ".3g"),
                     estimate_cell(c.estimate(names.SUM_MEM_OTHER_GIB), fmt=_three),
                     _num(_mean(c, names.SUM_DEVICE_TOKENS_PER_SEC), ",.0f"),
                     Cell(mfu_text, mfu)])
        shown.append(c)
    if not rows:
        return None
    if len({d for _, d in denominators}) > 1:  # no one scale: each row's denominator, and no sorting across them
        notes = {n for n in notes if not n.startswith("* MFU against the measured")}
        notes.add(mixed_mfu_note(denominators))
        for row in rows:
            row[-1] = Cell(row[-1].text, None)
    cols = ["configuration", "levers (optimizer, attention, weights)", "peak GiB / device", "of capacity",
            "weights B/param", "gradients B/param", "optimizer state B/param", "model state B/param",
            "rest of peak GiB", "tokens/s per device", "MFU"]
    foot = ["B/param: one device's bytes as stored (a tensor subclass by its inner tensors, a table shared by an "
            "optimizer's tensors once) / the model's parameters; the rest of the peak is activations, workspace, "
            "the optimizer step's temporaries and the loss path (docs/memory.md)"]
    return Headline(cols, rows, shown, foot + sorted(notes))
