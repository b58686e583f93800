"""Pure calculators for comparing runs: the table's columns, comparability, Pareto fronts (repeats,
intervals and scaling efficiency: :mod:`mlflow_llmeff.report.repeats`).

Nothing here reads MLflow or draws: inputs are :class:`RunRecord` values (what a run holds), outputs
are plain data that :mod:`mlflow_llmeff.report.render` turns into Markdown, CSV, HTML and PNGs.
Formulas and their sources are in ``docs/compare.md``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from mlflow_llmeff import names

__all__ = ["RunRecord", "Incomparability", "round_sig", "unit_of", "header", "metric_columns",
           "differing_tags", "comparability_warnings", "pareto_front", "carbon_per_btok",
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

_BENCH = (names.EVAL_MMLU_ACC, names.EVAL_HELLASWAG_ACC, names.EVAL_HELLASWAG_ACC_NORM)
def _method(v: str) -> str:
    return v.split(":", 1)[0]


#: What makes figures of two runs not comparable: (what, tag key, param fallback for older runs, the
#: metrics whose comparison it changes: only runs holding one of them take part; None = every run,
#: and how a value is compared: None = as it is).
#: The eval batch size is no such condition: it changes how fast an eval runs, not its score (lm-eval
#: definitions), and is a column of the full table.
COMPARABILITY = (("FLOPs convention", names.FLOPS_FORMULA, None, (names.SUM_DEVICE_TFLOPS, names.SUM_MFU), None),
                 # formula vs a meta-device count: the method, not the model type it names
                 ("FLOPs method", names.FLOPS_METHOD, None, (names.SUM_DEVICE_TFLOPS, names.SUM_MFU), _method),
                 ("peak source", names.PEAK_SOURCE, None, (names.SUM_MFU, names.SUM_HFU), None),
                 ("few-shot count", names.EVAL_NUM_FEWSHOT, "eval_num_fewshot", (names.EVAL_MMLU_ACC,), None),
                 ("eval documents", names.EVAL_DOCUMENTS, None, _BENCH, None),
                 ("dataset", names.DATASET, None, None, None),
                 ("llmeff version", names.V_LLMEFF, None, None, None))

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
    """One warning per condition of :data:`COMPARABILITY` whose value differs between the runs
    whose compared figures it changes (those holding one of its metrics), said once for all rows.

    A run that lacks the condition counts as ``unknown``; a condition no run records gives no warning.
    Only runs with ``summary/*`` figures take part (a crashed run is marked in its row instead), so
    runs that never scored a benchmark are not "unknown" eval documents beside one that did.
    """
    out = []
    compared = [r for r in runs if r.comparable] or runs
    for what, key, param, affects, norm in COMPARABILITY:
        values: dict[str, list[str]] = {}
        for r in compared:
            if affects is not None and not any(k in r.metrics for k in affects):
                continue
            v = _condition(r, key, param)
            if v is not None and norm is not None:
                v = norm(v)
            values.setdefault(v or "unknown", []).append(r.label)
        if len(values) > 1:
            out.append(Incomparability(what, key, values))
    return out


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
