"""The comparison's first screen: one row per configuration with the figures that answer the question.

Which configuration gives the most tokens per second per device, at what MFU, for how many dollars
and kilograms of CO2e per billion tokens, with what goodput, reaching what quality, and how sure
each of those is. A pure calculator over :class:`~mlflow_llmeff.report.repeats.Configuration`
values: cells carry a display text and a sort value; footnotes say why a figure is absent (a CPU
has no datasheet peak and no default price) instead of leaving a silent gap.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from mlflow_llmeff import names
from mlflow_llmeff.report.calc import absent_why
from mlflow_llmeff.report.repeats import (METHOD_NOTE, Configuration, Estimate, best_index, floor_for,
                                          standing_order, versus_best)

__all__ = ["Cell", "Headline", "headline", "estimate_cell", "assumed_notes", "QUALITY_KEYS", "MFU_COLUMN", "MFU_COLUMN_OTHER",
           "MFU_NOTE", "mfu_denominator", "mixed_mfu_note"]

#: The MFU column's header: its denominator named. An FP8 run's MFU against the BF16 peak is "too good to
#: be true" (torchtitan #560), against the FP8 peak it reads lower than a BF16 run's for the same speed
#: (TransformerEngine #1151, on Databricks' FP8 figures): one denominator for every row, and said.
MFU_COLUMN = "MFU (BF16 peak)"
#: The header where no configuration has an MFU against a BF16 peak (CPU runs: against the measured
#: matmul peak, each cell marked): a trial read "MFU (BF16 peak)" above fp32 CPU cells that were not.
MFU_COLUMN_OTHER = "MFU"
#: The footnote of a column holding BF16-peak figures.
MFU_NOTE = ("MFU (BF16 peak): achieved model TFLOP/s per device / the device's dense BF16 datasheet peak "
            "(summary/mfu_bf16_peak), for every precision, so FP8, BF16 and FP32 runs share one denominator; "
            "summary/mfu, against the peak of the dtype the matmuls ran in (llmeff.peak.precision: fp8 for an "
            "FP8 run), is in the runs table")

#: Quality figures shown (the final eval value each run holds), in this order.
QUALITY_KEYS = ((names.EVAL_HELLASWAG_ACC_NORM, "HellaSwag"), (names.EVAL_MMLU_ACC, "MMLU"),
                (names.EVAL_VAL_LOSS, "val loss"))


@dataclass(frozen=True)
class Cell:
    """One cell: what is shown and what it sorts by (None sorts last)."""

    text: str
    sort: float | str | None = None
    title: str = ""
    link: str = ""


@dataclass
class Headline:
    """The headline table: column names, one row of cells per configuration, footnotes."""

    columns: list[str]
    rows: list[list[Cell]]
    configs: list[Configuration]
    footnotes: list[str] = field(default_factory=list)


def _g(v: float) -> str:
    if v == 0:
        return "0"
    a = abs(v)
    if a >= 1e5:
        return f"{v:,.0f}"
    if a >= 100:
        return f"{v:,.0f}"
    return f"{v:.3g}"


def estimate_cell(e: Estimate | None, *, pct: bool = False, fmt=None) -> Cell:
    """The figure with its interval; a single run's floor bounds marked (``6,761 [1,285, 12,237] floor``: its
    bounds, not ``+-81%``, which a per-token figure's ``/ (1 -+ f)`` is not); the method and any repeat left
    out in the cell's title. ``fmt`` formats a value (default: a percentage with ``pct``, else 3 figures)."""
    if e is None:
        return Cell("", None)
    fmt = fmt or ((lambda v: f"{v:.1%}") if pct else _g)
    left = f" ({len(e.left_out)} left out)" if e.left_out else ""
    if e.method == "floor":
        return Cell(f"{fmt(e.mean)} [{fmt(e.low)}, {fmt(e.high)}] floor{left}", e.mean, e.how())
    if not e.has_interval:
        return Cell(f"{fmt(e.mean)}{' (1 run)' if e.n == 1 else ''}{left}", e.mean, e.how())
    return Cell(f"{fmt(e.mean)} [{fmt(e.low)}, {fmt(e.high)}]{left}", e.mean, e.how())


def _mean(c: Configuration, key: str) -> float | None:
    return c.mean(key)  # over the repeats holding it, kept by the configuration


def _quality(c: Configuration) -> Cell:
    """The quality reached: each of :data:`QUALITY_KEYS` a configuration's repeats hold, as the other figures
    are (:func:`estimate_cell`): the mean over the repeats holding it with its 95% interval across them, ``(1
    run)`` for one (an eval score has no between-run floor), and how many repeats lacked it; the targets reached."""
    parts, sort, hows = [], None, []
    for key, label in QUALITY_KEYS:
        e = c.estimate(key)
        if e is not None:
            parts.append(f"{label} {estimate_cell(e, fmt=_g3).text}")
            hows.append(f"{label}: {e.how()}")
            sort = e.mean if sort is None else sort
    each = c.used_by_kind().counts()  # a run of each kind with how many (RunRecord.alike: the same tags but the name)
    targets = sorted(k for k in set().union(*(r.tags for r, _ in each)) if k.startswith(names.TTQ_TAG_PREFIX))
    if targets:
        reached = [k for k in targets if all(r.tags.get(k, "").startswith("reached") for r, _ in each if k in r.tags)]
        parts.append(f"{len(reached)}/{len(targets)} targets")
        for k in targets:  # a target some repeats reached: by how many (the time to it: docs/compare.md)
            given = sum(n for r, n in each if k in r.tags)
            got = sum(n for r, n in each if k in r.tags and r.tags[k].startswith("reached"))
            if 0 < got < given:
                parts.append(f"{k[len(names.TTQ_TAG_PREFIX):]} by {got} of {given} runs")
    title = ("HellaSwag acc_norm, MMLU acc, final eval/val_loss (means over the repeats holding them"
             + (": " + "; ".join(hows) if hows else "") + "); time-to-quality targets reached")
    return Cell(", ".join(parts), sort, title if parts else "")


def _g3(v: float) -> str:
    return f"{v:.3g}"


#: Degrees shown beside the strategy, in this order, where above 1.
_DEGREES = (("dp", names.PAR_DP), ("shard", names.PAR_DP_SHARD), ("tp", names.PAR_TP), ("pp", names.PAR_PP),
            ("cp", names.PAR_CP))


def layout_cell(c: Configuration) -> Cell:
    """The strategy and its degrees above 1, e.g. ``fsdp_tp dp2 shard2 tp2`` (dp: ranks that see
    different data; shard: data-parallel ranks the model state is sharded over; docs/parallelism.md)."""
    strategy = c.tag(names.PAR_STRATEGY) or ""
    parts = []
    for short_name, key in _DEGREES:
        v = c.tag(key)
        try:
            if v is not None and int(v) > 1:
                parts.append(f"{short_name}{int(v)}")
        except ValueError:
            continue
    text = " ".join([strategy] + parts).strip()
    title = ", ".join(f"{k.split('.')[-1]} {c.tag(k)}" for _, k in _DEGREES if c.tag(k) is not None)
    return Cell(text, text, title)


def _stability(c: Configuration) -> Cell:
    """``stable``, ``stable (2 repeats)``, ``unstable`` or ``1 of 2 unstable (kept)``; the title
    names each unstable repeat with its tokens/s and why (:meth:`Configuration.note`)."""
    n, s = len(c.runs), len(c.stable)
    if s == n:
        return Cell("stable" if n == 1 else f"stable ({n} repeats)", 1.0)
    text = "unstable" if n == 1 else f"{n - s} of {n} unstable (kept)"
    return Cell(text, s / n, c.note())


def headline(configs: list[Configuration], links: list[str] | None = None) -> Headline:
    """The headline table of ``configs`` (``links``: one URL per configuration's first used run).

    Columns: configuration, devices, layout (strategy and degrees), tokens/s per device [95% interval:
    Student's t across repeats, a single run +- its machine's between-run floor; the method is the
    first footnote, :data:`~mlflow_llmeff.report.repeats.METHOD_NOTE`], vs best (never a ranking
    within noise), MFU against the device's dense BF16 peak whatever the precision (``summary/mfu_bf16_peak``:
    one denominator for FP8 and BF16 runs, :data:`MFU_NOTE`; else against the measured matmul peak, marked;
    headed :data:`MFU_COLUMN`, or :data:`MFU_COLUMN_OTHER` where no configuration has a BF16-peak figure),
    USD and kg CO2e per 1e9 tokens, goodput, quality reached, stability.
    """
    bf16 = any(c.estimate(names.SUM_MFU_BF16_PEAK) is not None for c in configs)
    cols = ["configuration", "devices", "layout", "tokens/s per device [95%]", "vs best",
            MFU_COLUMN if bf16 else MFU_COLUMN_OTHER, "USD / 1e9 tokens", "kg CO2e / 1e9 tokens", "goodput",
            "quality reached", "stability"]
    standing = versus_best(configs, names.SUM_DEVICE_TOKENS_PER_SEC)
    best = best_index(configs, names.SUM_DEVICE_TOKENS_PER_SEC)
    best_title = f"best: {configs[best].label}" if best is not None else ""
    rows, notes = [], set()
    if any(len(c.runs) == 1 for c in configs):
        kinds = sorted({c.tag(names.ACCEL_SHORT) or "?" for c in configs if len(c.runs) == 1})
        unmeasured = [k for k in kinds if floor_for(k) is None]
        if unmeasured:
            notes.add(f"a single run of {', '.join(unmeasured)} has no interval: no between-run floor is "
                      "measured for that kind of machine (docs/stability.md); it is not ranked: repeat it")
        short = [(c.label, e.short_of) for c in configs if len(c.runs) == 1
                 and (e := c.estimate(names.SUM_DEVICE_TOKENS_PER_SEC)) is not None and e.short_of is not None]
        if short:
            notes.add("a single run shorter than the runs its machine's between-run floor was measured on has no "
                      "interval and is not ranked (repeat it, or run longer): "
                      + ", ".join(f"{label} ({got} steady steps, the floor's runs {least} or more)"
                                  for label, (got, least) in short))
    denominators: list[tuple[str, str]] = []  # (configuration, its MFU cell's denominator), shown rows only
    for i, c in enumerate(configs):
        mfu = c.estimate(names.SUM_MFU_BF16_PEAK)  # one denominator across precisions (docs/formulas.md)
        if (den := mfu_denominator(c)) is not None:
            denominators.append((c.label, den))
        if mfu is not None:
            mfu_cell = estimate_cell(mfu, pct=True)
            notes.add(MFU_NOTE)
        else:
            mp = c.estimate(names.SUM_MFU_MEASURED_PEAK)
            mfu_cell = estimate_cell(mp, pct=True)
            if mp is not None:
                mfu_cell = Cell(mfu_cell.text + " *", mfu_cell.sort, f"against the measured matmul peak; {mfu_cell.title}")
                notes.add("* MFU against the measured matmul peak of the device (no datasheet peak: "
                          "llmeff.peak.source says why)")
            else:
                steady = absent_why(c.runs[0], names.SUM_DEVICE_TOKENS_PER_SEC)
                left = next((w for r in c.runs if (w := absent_why(r, names.SUM_MFU_MEASURED_PEAK))), None)
                if steady and c.estimate(names.SUM_DEVICE_TOKENS_PER_SEC) is None:  # no rate: nothing to divide
                    notes.add(f"an empty tokens/s and MFU ({c.label}): {steady}")
                elif left:  # the run left its figure out (above its measured peak): the run's why
                    notes.add(f"an empty MFU ({c.label}): {names.SUM_MFU_MEASURED_PEAK} left out: {left}")
                elif c.estimate(names.SUM_MFU) is not None:  # against another dtype's peak only: not this column's
                    notes.add(f"an empty MFU ({c.label}): no BF16 peak is known for "
                              f"{c.tag(names.ACCEL_SHORT) or 'its device'}; its summary/mfu (against the "
                              f"{c.tag(names.PEAK_PRECISION) or c.tag(names.PRECISION) or '?'} peak, "
                              "llmeff.peak.precision) is in the runs table")
                else:
                    notes.add("an empty MFU: neither a datasheet peak nor a measured peak (see llmeff.peak.source)")
        usd = c.estimate(names.SUM_USD_PER_BTOK)
        if usd is None:  # why, as the run says: an undefined cost, or no price
            why = absent_why(c.runs[0], names.SUM_USD_PER_BTOK)
            notes.add(f"an empty USD cell ({c.label}): {why}" if why else
                      "an empty USD cell: no price per device-hour (there is no default price for "
                      f"{c.tag(names.ACCEL_SHORT) or 'this device'}; give device_hour_usd)")
        carbon = c.estimate(names.SUM_KG_CO2E_PER_BTOK)
        carbon_cell = estimate_cell(carbon)
        if carbon is None:
            est = c.estimate(names.SUM_ESTIMATE_KG_CO2E_PER_BTOK)
            carbon_cell = estimate_cell(est)
            if est is not None:
                carbon_cell = Cell(carbon_cell.text + " est.", carbon_cell.sort,
                                   f"codecarbon's CPU+RAM estimate; {carbon_cell.title}")
                notes.add("est.: kg CO2e from codecarbon's CPU+RAM estimate (no measured energy)")
        # goodput: each run's is a count of its own time; across repeats it varies, so a t interval (a
        # trial saw 0.06 alone over 3 seeds beside tokens/s and MFU with theirs); one run: '(1 run)'
        good = estimate_cell(c.estimate(names.SUM_GOODPUT), fmt=lambda v: f"{v:.2f}")
        quality = _quality(c)
        if not quality.text:
            notes.add("an empty quality reached: no HellaSwag or MMLU score, eval/val_loss or time-to-quality "
                      "target was logged (llmeff train: --eval-tasks, --targets; docs/evals.md)")
        stand = standing.get(i, "")
        rows.append([
            Cell(c.label, c.label, f"{len(c.runs)} run(s)", links[i] if links else ""),
            Cell(c.tag(names.ACCEL_COUNT) or "", float(c.devices) if c.devices else None),  # unknown sorts last
            layout_cell(c),
            estimate_cell(c.estimate(names.SUM_DEVICE_TOKENS_PER_SEC)),
            Cell(stand, float(standing_order(stand)), best_title),
            mfu_cell, estimate_cell(usd), carbon_cell,
            good,
            quality, _stability(c)])
    if len({d for _, d in denominators}) > 1:  # no one scale: say each row's, and rank none against another
        notes.discard(MFU_NOTE)
        notes = {n for n in notes if not n.startswith("* MFU against the measured")}
        notes.add(mixed_mfu_note(denominators))
        for row in rows:
            row[5] = Cell(row[5].text, None, row[5].title, row[5].link) if row[5].text else row[5]
    per_config = []  # every repeat that is unstable (kept) or left out of a figure, named with its value and why
    for c in configs:
        if c.note():
            per_config.append(f"{c.label}: {c.note()}")
        for key, what in ((names.SUM_DEVICE_TOKENS_PER_SEC, "tokens/s per device"), (names.SUM_MFU, "MFU"),
                          (names.SUM_USD_PER_BTOK, "USD / 1e9 tokens"), *QUALITY_KEYS):
            e = c.estimate(key)
            if e is not None and e.left_out:
                per_config.append(f"{c.label}: {what} from {e.n} of {len(c.runs)} repeats; left out: "
                                  + "; ".join(e.left_out))
    return Headline(cols, rows, configs, [METHOD_NOTE] + sorted(notes) + per_config + assumed_notes(configs))


def mfu_denominator(c: Configuration) -> str | None:
    """What configuration ``c``'s MFU cell is divided by: ``"BF16 datasheet peak (<device>)"`` where a repeat
    holds ``summary/mfu_bf16_peak``, else ``"<precision> measured peak <T> TFLOP/s"`` (``llmeff.peak.precision``,
    else ``llmeff.precision``; ``llmeff.peak.measured_tflops``, each repeat's value where they differ, in
    TFLOP/s) where one holds ``summary/mfu_measured_peak``; None where the cell is empty."""
    if c.estimate(names.SUM_MFU_BF16_PEAK) is not None:
        return f"BF16 datasheet peak ({c.tag(names.ACCEL_SHORT) or 'device'})"
    if c.estimate(names.SUM_MFU_MEASURED_PEAK) is None:
        return None
    prec = c.tag(names.PEAK_PRECISION) or c.tag(names.PRECISION) or "?"
    held = [r.tags[names.PEAK_MEASURED_TFLOPS] for r in c.runs
            if names.SUM_MFU_MEASURED_PEAK in r.metrics and names.PEAK_MEASURED_TFLOPS in r.tags]
    tflops = "/".join(dict.fromkeys(held)) or "?"
    return f"{prec} measured peak {tflops} TFLOP/s"


def mixed_mfu_note(denominators: list[tuple[str, str]]) -> str:
    """The one note of an MFU column whose rows are divided by different peaks: each row's denominator
    (:func:`mfu_denominator`), and that the column ranks nothing (its cells do not sort)."""
    return ("MFU: the rows do not share one denominator, so the column is not a ranking (its cells do not sort): "
            + "; ".join(f"{label}: {den}" for label, den in denominators))


_ENTRY = re.compile(r"; (?=[a-z_]+: )")  # llmeff.assumed: '<input>: <value> (<why>)' joined by '; '


def assumed_notes(configs: list[Configuration]) -> list[str]:
    """One line per assumption the runs record (``llmeff.assumed``: a list price, the grid country,
    a precision read off the parameters, ...), naming the configurations it holds for, so a figure
    resting on a guess is never shown as if the user had given its input."""
    holders: dict[str, list[str]] = {}
    for c in configs:
        for entry in sorted({e for r in c.used_by_kind().kinds() for e in _ENTRY.split(r.tags.get(names.ASSUMED, "")) if e}):
            holders.setdefault(entry, []).append(c.label)
    everyone = len(configs) > 1
    return [f"assumed ({names.ASSUMED}) for {'every configuration' if everyone and len(labels) == len(configs) else ', '.join(labels)}: "
            f"{entry}" for entry, labels in holders.items()]
