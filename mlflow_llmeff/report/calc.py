"""Pure calculators for comparing runs: the table's columns, comparability, scaling efficiency, Pareto fronts.

Nothing here reads MLflow or draws: inputs are :class:`RunRecord` values (what a run holds), outputs
are plain data that :mod:`mlflow_llmeff.report.render` turns into Markdown, CSV, HTML and PNGs.
Formulas and their sources are in ``docs/compare.md``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .. import names

__all__ = ["RunRecord", "Incomparability", "ScalingRow", "round_sig", "unit_of", "header", "metric_columns",
           "differing_tags", "comparability_warnings", "scaling_efficiency", "pareto_front", "carbon_per_btok",
           "CONDITION_TAGS", "COMPARABILITY"]


@dataclass(frozen=True)
class RunRecord:
    """What one MLflow run holds, as the comparison needs it.

    Attributes:
        run_id: MLflow run id.
        name: run name (``mlflow.runName``).
        status: MLflow status (FINISHED, FAILED, KILLED, RUNNING, ...).
        experiment_id: the run's experiment.
        metrics: latest value of every metric, by key.
        tags: every tag, by key (``llmeff.*`` conditions among them).
        params: every param, by name.
    """

    run_id: str
    name: str
    status: str = "FINISHED"
    experiment_id: str = "0"
    metrics: dict[str, float] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)
    params: dict[str, str] = field(default_factory=dict)

    @property
    def has_summary(self) -> bool:
        """True when the run logged its end-of-run ``summary/*`` figures."""
        return any(k.startswith("summary/") for k in self.metrics)

    @property
    def comparable(self) -> bool:
        """True for a run that finished with its summary: only these enter scaling, fronts and plots
        (a FAILED run, e.g. a diverged loss, is a marked row, never a baseline)."""
        return self.has_summary and self.status == "FINISHED"

    @property
    def devices(self) -> int | None:
        """Devices taking part (``llmeff.accelerator.count``), None when absent or not an integer."""
        v = self.tags.get(names.ACCEL_COUNT, "")
        return int(v) if v.isdigit() and int(v) > 0 else None

    @property
    def label(self) -> str:
        """Run name, else the first 8 characters of its id."""
        return self.name or self.run_id[:8]


#: Condition tags shown in the table when they differ between the compared runs (order of columns).
CONDITION_TAGS = (names.ACCEL_SHORT, names.ACCEL_COUNT, names.NODES, names.PAR_STRATEGY, names.PRECISION,
                  names.MODEL_NAME, names.SEQ_LEN, names.MICRO_BATCH_SIZE, names.GRAD_ACCUM,
                  names.GLOBAL_BATCH_TOKENS, names.ACT_CKPT, names.COMPILE, names.ENERGY_SOURCE, names.DATASET,
                  names.FLOPS_FORMULA, names.PEAK_SOURCE, names.EVAL_BATCH_SIZE, names.EVAL_NUM_FEWSHOT,
                  names.EVAL_DOCUMENTS, names.V_LLMEFF)

#: What makes figures of two runs not comparable: (what, tag key, param fallback for older runs).
COMPARABILITY = (("FLOPs convention", names.FLOPS_FORMULA, None),
                 ("peak source", names.PEAK_SOURCE, None),
                 ("eval batch size", names.EVAL_BATCH_SIZE, None),
                 ("few-shot count", names.EVAL_NUM_FEWSHOT, "eval_num_fewshot"),
                 ("eval documents", names.EVAL_DOCUMENTS, None),
                 ("dataset", names.DATASET, None),
                 ("llmeff version", names.V_LLMEFF, None))

_UNITS = {d.key: d.unit for d in names.METRICS}
_TTQ_UNITS = {"wall_s": "s", "train_s": "s", "tokens": "tokens", "device_hours": "device-h", "kwh": "kWh",
              "usd": "USD", "kg_co2e": "kg CO2e"}
_ORDER = {d.key: i for i, d in enumerate(names.METRICS)}


def round_sig(x: float | None, digits: int = 4) -> float | None:
    """``x`` rounded to ``digits`` significant digits (None, NaN and inf pass through unchanged).

    Args:
        x: any float.
        digits: significant digits, >= 1.

    Raises:
        ValueError: for ``digits < 1``.
    """
    if digits < 1:
        raise ValueError(f"digits={digits!r} is not accepted; give an int >= 1")
    if x is None or not math.isfinite(x) or x == 0:
        return x
    return round(x, digits - 1 - int(math.floor(math.log10(abs(x)))))


def unit_of(key: str) -> str:
    """The unit of a metric key from ``names.py`` (``ttq/<stem>_<suffix>`` from its suffix); ``-`` when unknown."""
    if key in _UNITS:
        return _UNITS[key]
    if key.startswith("ttq/"):
        for suffix, unit in _TTQ_UNITS.items():
            if key.endswith("_" + suffix):
                return unit
    return "-"


def header(key: str) -> str:
    """A column header with its unit, e.g. ``summary/tokens_per_sec [tokens/s]``."""
    unit = unit_of(key)
    return key if unit in ("-", "") else f"{key} [{unit}]"


# quality columns: the last value MLflow holds of each (the run's final evaluation); per-subject MMLU keys stay out
EVAL_COLUMNS = (names.EVAL_VAL_LOSS, names.EVAL_VAL_PPL, names.EVAL_MMLU_ACC, names.EVAL_HELLASWAG_ACC,
                names.EVAL_HELLASWAG_ACC_NORM)


def metric_columns(runs: list[RunRecord]) -> list[str]:
    """Every ``summary/*`` key any run holds in ``names.py`` order, then the standard eval keys
    (:data:`EVAL_COLUMNS`, their last logged value) any run holds, then ``ttq/*`` keys sorted.
    A run that did not evaluate shows an empty cell under an eval column."""
    keys = {k for r in runs for k in r.metrics}
    summary = sorted((k for k in keys if k.startswith("summary/")), key=lambda k: (_ORDER.get(k, 10**6), k))
    return summary + [k for k in EVAL_COLUMNS if k in keys] + sorted(k for k in keys if k.startswith("ttq/"))


def _condition(r: RunRecord, tag: str, param: str | None) -> str | None:
    v = r.tags.get(tag)
    if v is None and param is not None:
        v = r.params.get(param)
    return v


def differing_tags(runs: list[RunRecord], keys: tuple[str, ...] = CONDITION_TAGS) -> list[str]:
    """The condition tags among ``keys`` whose value (absent counts as a value) is not the same on every run.

    Only runs with ``summary/*`` figures count (a crashed or non-training run lacking the tags would
    make every condition look different); with none, every run counts.
    """
    compared = [r for r in runs if r.comparable] or runs
    return [k for k in keys if len({r.tags.get(k) for r in compared}) > 1]


@dataclass(frozen=True)
class Incomparability:
    """A reason the compared figures are not comparable.

    Attributes:
        what: the condition, e.g. ``eval batch size``.
        key: its tag key.
        values: each distinct value (``unknown`` when a run lacks it) with the run labels holding it.
    """

    what: str
    key: str
    values: dict[str, list[str]]

    def text(self) -> str:
        """One line, e.g. ``not comparable: eval batch size (llmeff.eval.batch_size) differs: 8 (a, b); 16 (c)``."""
        parts = "; ".join(f"{v} ({', '.join(runs)})" for v, runs in self.values.items())
        return f"not comparable: {self.what} ({self.key}) differs: {parts}"


def comparability_warnings(runs: list[RunRecord]) -> list[Incomparability]:
    """One warning per condition of :data:`COMPARABILITY` whose value differs between runs.

    A run that lacks the condition counts as ``unknown``; a condition no run records gives no warning.
    Only runs with ``summary/*`` figures take part (a crashed run is marked in its row instead).
    """
    out = []
    compared = [r for r in runs if r.comparable] or runs
    for what, key, param in COMPARABILITY:
        values: dict[str, list[str]] = {}
        for r in compared:
            values.setdefault(_condition(r, key, param) or "unknown", []).append(r.label)
        if len(values) > 1:
            out.append(Incomparability(what, key, values))
    return out


@dataclass(frozen=True)
class ScalingRow:
    """Scaling efficiency of one run against its group's baseline run.

    Attributes:
        group: what the runs of the group share, e.g. ``llama-tiny cpu fp32 seq 128``.
        run_id, name: the run.
        baseline_id, baseline_name: the baseline run (N0 devices).
        devices, baseline_devices: N and N0.
        tokens_per_sec, baseline_tokens_per_sec: ``summary/tokens_per_sec`` of each (global, tokens/s).
        efficiency: ``tokens_per_sec(N) / (tokens_per_sec(N0) * N / N0)``, a fraction (1 = linear).
        kind: ``strong`` (same global batch tokens), ``weak`` (same batch tokens per device) or
            ``batch differs`` (neither: the ratio mixes scaling with a batch-size effect).
    """

    group: str
    run_id: str
    name: str
    baseline_id: str
    baseline_name: str
    devices: int
    baseline_devices: int
    tokens_per_sec: float
    baseline_tokens_per_sec: float
    efficiency: float
    kind: str


# Conditions two runs must share to be compared as the same job at different device counts.
_SAME_JOB = (names.ACCEL_SHORT, names.PRECISION, names.MODEL_NAME, names.SEQ_LEN, names.ACT_CKPT, names.COMPILE,
             names.DATASET, names.FLOPS_FORMULA)


def _batch_per_device(r: RunRecord) -> str | None:
    try:
        return str(int(r.tags[names.SEQ_LEN]) * int(r.tags[names.MICRO_BATCH_SIZE]) * int(r.tags[names.GRAD_ACCUM]))
    except (KeyError, ValueError):
        return None


def scaling_efficiency(runs: list[RunRecord], baseline: str | None = None) -> list[ScalingRow]:
    """Scaling efficiency of runs that differ only in device count.

    Runs are grouped by :data:`_SAME_JOB` conditions and parallelism strategy (``single`` joins any
    data-parallel group). In each group with at least two device counts, the baseline is ``baseline``
    when it is in the group, else the run with the fewest devices (the earliest-listed among equals),
    and every other run gets::

        efficiency = tokens_per_sec(N) / (tokens_per_sec(N0) * N / N0)

    With the same global batch (strong scaling) this is the speed-up over the ideal N/N0; with the same
    batch per device (weak scaling) it equals per-device throughput over the baseline's per-device
    throughput (Gustafson's scaled speed-up divided by N/N0). See ``docs/compare.md``.

    Args:
        runs: the compared runs; those without ``summary/tokens_per_sec`` or a device count are left out.
        baseline: run id of the baseline for its group.

    Returns:
        One :class:`ScalingRow` per non-baseline run of a group, ordered by group then device count.

    Raises:
        ValueError: when ``baseline`` is not one of ``runs`` or has no ``summary/tokens_per_sec``.
    """
    usable = [r for r in runs if r.comparable and r.devices and (r.metrics.get(names.SUM_TOKENS_PER_SEC) or 0) > 0]
    if baseline is not None and baseline not in {r.run_id for r in usable}:
        known = {r.run_id for r in runs}
        why = "has no summary/tokens_per_sec or device count" if baseline in known else "is not among the compared runs"
        raise ValueError(f"--baseline {baseline!r} {why}")
    groups: dict[tuple, list[RunRecord]] = {}
    for r in usable:
        groups.setdefault(tuple(r.tags.get(k) for k in _SAME_JOB), []).append(r)
    out: list[ScalingRow] = []
    for key, members in groups.items():
        strategies = {r.tags.get(names.PAR_STRATEGY) for r in members} - {"single"}
        for strategy in sorted(strategies, key=str) or ["single"]:
            sub = [r for r in members if r.tags.get(names.PAR_STRATEGY) in ("single", strategy)]
            out += _scale_group(sub, baseline, _group_label(key, strategy))
    return out


def _group_label(key: tuple, strategy: str | None) -> str:
    model, short, precision, seq = key[2], key[0], key[1], key[3]
    return f"{model} {short} {precision} seq {seq} {strategy}"


def _scale_group(members: list[RunRecord], baseline: str | None, label: str) -> list[ScalingRow]:
    if len({r.devices for r in members}) < 2:
        return []
    base = next((r for r in members if r.run_id == baseline), None) or min(members, key=lambda r: r.devices)
    n0, t0 = base.devices, base.metrics[names.SUM_TOKENS_PER_SEC]
    rows = []
    for r in sorted(members, key=lambda r: r.devices):
        if r.run_id == base.run_id or r.devices == base.devices:  # same device count: no scaling to measure
            continue
        n, t = r.devices, r.metrics[names.SUM_TOKENS_PER_SEC]
        if r.tags.get(names.GLOBAL_BATCH_TOKENS) and r.tags.get(names.GLOBAL_BATCH_TOKENS) == base.tags.get(
                names.GLOBAL_BATCH_TOKENS):
            kind = "strong"
        elif _batch_per_device(r) is not None and _batch_per_device(r) == _batch_per_device(base):
            kind = "weak"
        else:
            kind = "batch differs"
        rows.append(ScalingRow(label, r.run_id, r.label, base.run_id, base.label, n, n0, t, t0,
                               t / (t0 * n / n0), kind))
    return rows


def pareto_front(points: list[tuple[float, float]], *, maximize_x: bool, maximize_y: bool) -> list[int]:
    """Indices of the non-dominated points, sorted by x.

    A point is dominated when another is at least as good on both axes and better on one
    ("better" is larger where ``maximize_*``, else smaller). Equal points are all kept.

    Args:
        points: ``(x, y)`` pairs; pairs with a NaN or infinite coordinate are never on the front.
        maximize_x, maximize_y: direction of each axis.
    """
    sx, sy = (1 if maximize_x else -1), (1 if maximize_y else -1)
    ok = [i for i, (x, y) in enumerate(points) if math.isfinite(x) and math.isfinite(y)]
    front = []
    for i in ok:
        xi, yi = points[i][0] * sx, points[i][1] * sy
        dominated = any(points[j][0] * sx >= xi and points[j][1] * sy >= yi
                        and (points[j][0] * sx > xi or points[j][1] * sy > yi) for j in ok if j != i)
        if not dominated:
            front.append(i)
    return sorted(front, key=lambda i: points[i][0])


def carbon_per_btok(r: RunRecord) -> tuple[float | None, bool]:
    """kg-CO2e per 1e9 tokens of a run and whether it is an estimate (codecarbon's CPU+RAM estimate).

    The measured figure (``summary/kg_co2e_per_billion_tokens``) wins; otherwise the estimate's.
    """
    v = r.metrics.get(names.SUM_KG_CO2E_PER_BTOK)
    if v is not None:
        return v, False
    v = r.metrics.get(names.SUM_ESTIMATE_KG_CO2E_PER_BTOK)
    return v, v is not None
