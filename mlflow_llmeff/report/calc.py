"""Pure calculators for comparing runs: the table's columns, comparability, Pareto fronts (repeats,
intervals and scaling efficiency: :mod:`mlflow_llmeff.report.repeats`).

Nothing here reads MLflow or draws: inputs are :class:`RunRecord` values (what a run holds), outputs
are plain data that :mod:`mlflow_llmeff.report.render` turns into Markdown, CSV, HTML and PNGs.
Formulas and their sources are in ``docs/compare.md``.
"""

from __future__ import annotations

import math
import operator
import re
from dataclasses import dataclass, field
from functools import partial
from itertools import compress

from mlflow_llmeff import names
from mlflow_llmeff.calc import reliability as _rel
from mlflow_llmeff.report.kinds import Kinds, column, kind_counts, kinds, per_kind, per_run  # noqa: F401 (the API)

__all__ = ["RunRecord", "Incomparability", "round_sig", "unit_of", "header", "metric_columns",
           "differing_tags", "comparability_warnings", "pareto_front", "carbon_per_btok", "absent_why",
           "CONDITION_TAGS", "COMPARABILITY", "Fleet", "Failure", "CauseRow", "fleet_reliability",
           "parse_failures", "failures_by_cause", "run_length", "stopped_at_targets", "kinds", "kind_counts", "per_kind",
           "Kinds", "per_run", "split_comparable", "column"]


_IS_SUMMARY = operator.methodcaller("startswith", "summary/")


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
        start_time_ms: the run's start, ms since the epoch (MLflow's ``start_time``); None when not read.
        alike: a value shared by the runs read with the same metric keys, the same tags (the name aside)
            and the same params (report/source.py's grouped read numbers each distinct set): the report
            works out what depends only on those once for all such runs (repeats of one configuration:
            100,000 runs of 5 configurations are 5 kinds). None: not known, the run is taken alone.
            Not compared (two records of one run are equal whatever they were read with).
    """

    run_id: str
    name: str
    status: str = "FINISHED"
    experiment_id: str = "0"
    metrics: dict[str, float] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)
    params: dict[str, str] = field(default_factory=dict)
    start_time_ms: int | None = None
    alike: object = field(default=None, compare=False, repr=False)

    @property
    def has_summary(self) -> bool:
        """True when the run logged its end-of-run ``summary/*`` figures."""
        return any(map(_IS_SUMMARY, self.metrics))

    @property
    def comparable(self) -> bool:
        """True for a run that finished with its summary: only these enter scaling, fronts and plots
        (a FAILED run, e.g. a diverged loss, is a marked row, never a baseline). Worked out once per record
        (a report asks six times a run; kept beside the fields, which eq and repr do not read)."""
        got = self.__dict__.get("_comparable")
        if got is None:
            got = self.__dict__["_comparable"] = self.has_summary and self.status == "FINISHED"
        return got

    @property
    def devices(self) -> int | None:
        """Devices taking part (``llmeff.accelerator.count``), None when absent or not an integer."""
        v = self.tags.get(names.ACCEL_COUNT, "")
        return int(v) if v.isdigit() and int(v) > 0 else None

    @property
    def label(self) -> str:
        """Run name, else the first 8 characters of its id."""
        return self.name or self.run_id[:8]


_HAS_SUMMARY = operator.attrgetter("has_summary")


def split_comparable(runs: list[RunRecord] | Kinds) -> tuple[Kinds, Kinds]:
    """``(the runs of ``runs`` that are comparable, the others)`` (:class:`Kinds`, each in the order given):
    :attr:`RunRecord.comparable` as it answers (a summary, read once per kind of runs, and FINISHED), in
    passes of C."""
    every = runs if isinstance(runs, Kinds) else Kinds(runs)
    summary = every.per_run(_HAS_SUMMARY)
    statuses = every.attribute("status")
    if all(summary) and statuses.count("FINISHED") == len(statuses):
        return every, Kinds([], [])
    return every.split_by(list(map(operator.and_, summary, map("FINISHED".__eq__, statuses))))


#: Condition tags shown in the table when they differ between the compared runs (order of columns).
CONDITION_TAGS = (names.ACCEL_SHORT, names.ACCEL_COUNT, names.NODES, names.PAR_STRATEGY, names.PRECISION,
                  names.MODEL_NAME, names.SEQ_LEN, names.MICRO_BATCH_SIZE, names.GRAD_ACCUM,
                  names.GLOBAL_BATCH_TOKENS, names.ACT_CKPT, names.COMPILE, names.OPTIMIZER, names.ATTENTION, names.WEIGHTS,
                  names.THREADS, names.CPU_AFFINITY, names.ENERGY_SOURCE, names.DATASET,
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
                 # goodput = productive / wall: set-up and the final save are paid once per run, so a
                 # 50-step run's goodput (a trial: 0.12) is not a 300-step run's (0.51) at equal speed;
                 # the steps every path counts (summary/steps), not max_steps, which only some log
                 ("run length (optimizer steps)", names.SUM_STEPS, None, (names.SUM_GOODPUT,), None),
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


def metric_columns(runs: list[RunRecord], *, each: list[RunRecord] | None = None) -> list[str]:
    """Every ``summary/*`` key any run holds in ``names.py`` order, then the standard eval keys
    (:data:`EVAL_COLUMNS`, their last logged value) any run holds, then ``ttq/*`` keys sorted.
    A run that did not evaluate shows an empty cell under an eval column. ``each``: a run of each kind of
    ``runs`` where known (:func:`kinds`: runs alike hold the same keys, :attr:`RunRecord.alike`)."""
    keys = set().union(*(r.metrics for r in (kinds(runs) if each is None else each)))
    summary = sorted((k for k in keys if k.startswith("summary/")), key=lambda k: (_ORDER.get(k, 10**6), k))
    return summary + [k for k in EVAL_COLUMNS if k in keys] + sorted(k for k in keys if k.startswith("ttq/"))


def stopped_at_targets(r: RunRecord) -> bool:
    """True for a run ``llmeff train`` (or ``llmeff study --target``) ran to its targets: params
    ``stop_at_targets=true`` and non-empty ``targets``; its length is set by when a target was reached."""
    return r.params.get("stop_at_targets", "").lower() == "true" and bool(r.params.get("targets", "").strip())


def run_length(r: RunRecord) -> int | str | None:
    """The run's length as part of its configuration's identity.

    A run that stopped at its targets (:func:`stopped_at_targets`) has a length its seed decides, so
    its identity is what it ran to: ``"to <targets>, at most <max_steps> steps"`` (seeds to one target
    with one step cap are repeats of one configuration, MLPerf-style, the one that never reached it
    included). Any other run: its optimizer steps, ``summary/steps`` (None when not logged): a
    50-step and a 300-step run are not repeats (goodput, quality and the between-run floor change
    with length).
    """
    if stopped_at_targets(r):
        return f"to {r.params['targets'].strip()}, at most {r.params.get('max_steps', '?')} steps"
    steps = r.metrics.get(names.SUM_STEPS)
    return int(steps) if steps is not None else None


def _condition(r: RunRecord, tag: str, param: str | None) -> str | None:
    """The condition's value: its tag, else its param, else (a count such as ``summary/steps``) its metric;
    a run's length is :func:`run_length`."""
    v = _fixed_condition(r, tag, param)
    return _metric_condition(r, tag) if v is _BY_METRIC else v


#: :func:`_fixed_condition`'s answer where the run's metric decides.
_BY_METRIC = object()


def _fixed_condition(r: RunRecord, tag: str, param: str | None):
    """:func:`_condition` from the run's tags and params alone (the same for runs alike,
    :attr:`RunRecord.alike`), or :data:`_BY_METRIC` where its metric ``tag`` decides."""
    if tag == names.SUM_STEPS and stopped_at_targets(r):
        return str(run_length(r))
    v = r.tags.get(tag)
    if v is None and param is not None:
        v = r.params.get(param)
    return _BY_METRIC if v is None else v


def _metric_condition(r: RunRecord, tag: str) -> str | None:
    return _metric_text(r.metrics.get(tag))


def _metric_text(m) -> str | None:
    """A metric's value as a condition's value: ``50`` for 50.0 (``:g``); None for no number."""
    return f"{m:g}" if isinstance(m, (int, float)) else None


def differing_tags(runs: list[RunRecord], keys: tuple[str, ...] = CONDITION_TAGS, *,
                   compared: Kinds | None = None) -> list[str]:
    """The condition tags among ``keys`` whose value (absent counts as a value) is not the same on every run.

    Only runs with ``summary/*`` figures count (a crashed or non-training run lacking the tags would
    make every condition look different); with none, every run counts. ``compared``: the comparable runs
    of ``runs`` where known (:func:`split_comparable`).
    """
    compared = split_comparable(runs)[0] if compared is None else compared
    each = compared.kinds() if compared.runs else kinds(runs)
    rows = {tuple(map(r.tags.get, keys)) for r in each}  # repeats share their values: a few distinct rows
    return [k for i, k in enumerate(keys) if len({row[i] for row in rows}) > 1]


#: Runs an :class:`Incomparability` line names per value (then how many more).
RUNS_NAMED = 5


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
        """One line, e.g. ``not comparable: eval batch size (llmeff.eval.batch_size) differs: 8 (a, b); 16 (c)``;
        each value names its first :data:`RUNS_NAMED` runs, then how many more (the line stays one line
        at 10,000 runs)."""

        def named(runs: list[str]) -> str:
            more = len(runs) - RUNS_NAMED
            return ", ".join(runs[:RUNS_NAMED]) + (f" and {more:,} more" if more > 0 else "")

        parts = "; ".join(f"{v} ({named(runs)})" for v, runs in self.values.items())
        return f"not comparable: {self.what} ({self.key}) differs: {parts}"


def comparability_warnings(runs: list[RunRecord], *, compared: Kinds | None = None) -> list[Incomparability]:
    """One warning per condition of :data:`COMPARABILITY` whose value differs between the runs
    whose compared figures it changes (those holding one of its metrics), said once for all rows.

    A run that lacks the condition counts as ``unknown``; a condition no run records gives no warning.
    Only runs with ``summary/*`` figures take part (a crashed run is marked in its row instead), so
    runs that never scored a benchmark are not "unknown" eval documents beside one that did.
    ``compared``: the comparable runs of ``runs`` where known (:func:`split_comparable`).
    """
    out = []
    compared = split_comparable(runs)[0] if compared is None else compared
    if not compared.runs:  # no run with a summary: every run takes part
        compared = Kinds(runs)
    each = compared.kinds()  # a run of each kind (RunRecord.alike): metric keys, tags and params as theirs
    for what, key, param, affects, norm in COMPARABILITY:
        metrics = None if affects is None else frozenset(affects)
        sub = each if metrics is None else [r for r in each if not metrics.isdisjoint(r.metrics)]
        if (key != names.SUM_STEPS and _one_value(sub, key, norm)) or _one_fixed(sub, key, param, norm):
            continue  # the same on every run: no warning, no run to name (100,000 runs x 8 conditions)
        taking = compared
        if metrics is not None:  # whether a run holds one of the metrics: once a kind (its metric keys)
            taking = compared.split_by(compared.per_run(partial(_holds_any, metrics)))[0]
        # each run's answer from its tags and params, once a kind (RunRecord.alike); where its metric decides,
        # the metric's text
        answers = taking.per_run(partial(_fixed_condition, tag=key, param=param))
        if _distinct(taking, answers, key, norm) > 1:
            values = _naming(taking.runs, answers, key, norm)
            if len(values) > 1:
                out.append(Incomparability(what, key, values))
    return out


def _holds_any(metrics: frozenset, r: RunRecord) -> bool:
    return not metrics.isdisjoint(r.metrics)


def _distinct(runs: Kinds, answers: list, key: str, norm) -> int:
    """How many values :func:`_naming` would name (each run's ``answers``: :func:`_fixed_condition`),
    counted over the distinct answers and metric values in C: no list of labels made where the runs agree
    (the run length, ``summary/steps``, of 100,000 runs)."""
    distinct = set(answers)
    if _BY_METRIC in distinct:
        distinct.discard(_BY_METRIC)
        values = runs.column(key) if not distinct else column([r for r, a in zip(runs.runs, answers) if a is _BY_METRIC], key)
        distinct.update(_metric_text(m) for m in set(values))
    return len({(norm(v) if v is not None and norm is not None else v) or "unknown" for v in distinct})


def _naming(runs: list[RunRecord], answers: list, key: str, norm) -> dict[str, list[str]]:
    """Each value of the condition (``unknown`` where a run has none) with the labels of the runs holding it,
    in the runs' order (each run's ``answers``: :func:`_fixed_condition`)."""
    values: dict[str, list[str]] = {}
    normed: dict = {}  # each distinct value normalised once
    shown: dict = {}  # each metric value's text once
    for r, v in zip(runs, answers):
        if v is _BY_METRIC:
            m = r.metrics.get(key)
            v = shown.get(m)
            if v is None and m is not None:
                v = shown[m] = _metric_text(m)
        if v is not None and norm is not None:
            got = normed.get(v)
            v = normed[v] = norm(v) if got is None else got
        labels = values.get(v or "unknown")
        if labels is None:
            labels = values[v or "unknown"] = []
        labels.append(r.name or r.run_id[:8])  # r.label
    return values


def _one_fixed(runs: list[RunRecord], key: str, param: str | None, norm) -> bool:
    """True when every run of ``runs`` has one value of the condition from its tags and params
    (:func:`_fixed_condition`, after ``norm``): then :func:`comparability_warnings` has nothing to say of
    it. A run whose metric decides answers False (the full pass over the runs decides)."""
    seen = set()
    for r in runs:
        v = _fixed_condition(r, key, param)
        if v is _BY_METRIC:
            return False
        seen.add(v if norm is None else norm(v))
        if len(seen) > 1:
            return False
    return True


def _one_value(runs: list[RunRecord], key: str, norm) -> bool:
    """True when every run of ``runs`` holds tag ``key`` with one value (after ``norm``): then
    :func:`comparability_warnings` has nothing to say of it. A run without the tag answers False (its
    param or metric may stand in: the full pass decides)."""
    try:
        seen = set(map(operator.itemgetter(key), map(operator.attrgetter("tags"), runs)))
    except KeyError:
        return False
    return len({norm(v) for v in seen} if norm is not None else seen) <= 1


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


_ABSENT_ENTRY = re.compile(r"; (?=summary/)")


def absent_why(r: RunRecord, key: str) -> str | None:
    """Why run ``r`` holds no ``key``, as its ``llmeff.summary.absent`` tag says (entries
    ``<key>[, <key>...]: <why>`` joined by ``; ``); None when the tag does not name the key (an older
    run, or a figure that was never measured rather than undefined)."""
    for entry in _ABSENT_ENTRY.split(r.tags.get(names.SUMMARY_ABSENT, "")):
        keys, sep, why = entry.partition(": ")
        if sep and key in (k.strip() for k in keys.split(",")):
            return why
    return None


def carbon_per_btok(r: RunRecord) -> tuple[float | None, bool]:
    """kg-CO2e per 1e9 tokens of a run and whether it is an estimate (codecarbon's CPU+RAM estimate).

    The measured figure (``summary/kg_co2e_per_billion_tokens``) wins; otherwise the estimate's.
    """
    v = r.metrics.get(names.SUM_KG_CO2E_PER_BTOK)
    if v is not None:
        return v, False
    v = r.metrics.get(names.SUM_ESTIMATE_KG_CO2E_PER_BTOK)
    return v, v is not None


# ------------------------------------------------------------------------------------ reliability
_REL_KEYS = (names.SUM_FAILURES, names.SUM_WALL_S, names.SUM_BADPUT_DOWN_S)


@dataclass(frozen=True)
class Fleet:
    """Reliability of several jobs together (a configuration, an experiment).

    Attributes:
        runs: runs holding the reliability figures (``summary/failures``, ``summary/wall_s``,
            ``summary/badput_down_s``); runs without them (older runs) take no part.
        attempts: sum of ``summary/attempts`` (None when a run lacks it).
        failures: sum of ``summary/failures``.
        operating_s: sum over the runs of ``summary/wall_s - summary/badput_down_s``, seconds.
        mtbf_s: ``operating_s / failures``; None with no failure.
        low_s, high_s: the 95% Poisson (chi-square) interval of
            :func:`mlflow_llmeff.calc.reliability.fleet_mtbf`; ``high_s`` None with no failure.
        left_out: labels of the runs without reliability figures.
    """

    runs: int
    attempts: int | None
    failures: int
    operating_s: float
    mtbf_s: float | None
    low_s: float | None
    high_s: float | None
    left_out: tuple[str, ...] = ()


def has_reliability(r: RunRecord) -> bool:
    """True when the run logged the figures a fleet MTBF needs (runs before issue 29 did not)."""
    return all(k in r.metrics and math.isfinite(r.metrics[k]) for k in _REL_KEYS)


def _has_reliability_keys(r: RunRecord) -> bool:
    return all(k in r.metrics for k in _REL_KEYS)


def fleet_reliability(runs: list[RunRecord]) -> Fleet | None:
    """Failures and operating time summed over ``runs``, with the fleet MTBF and its interval.

    Operating time per run = ``summary/wall_s - summary/badput_down_s`` (wall minus the time no
    attempt ran); MTBF = summed operating time / summed failures, 95% interval
    ``[2T / chi2(0.975, 2r + 2), 2T / chi2(0.025, 2r)]`` (time-truncated Poisson; NIST/SEMATECH
    e-Handbook ch. 8; :func:`mlflow_llmeff.calc.reliability.fleet_mtbf`).

    Returns:
        None when no run holds the figures (nothing to show: never a 0).
    """
    # a kind of runs without one of the keys has no run with the figures (RunRecord.alike: its metric keys)
    keyed = Kinds(runs).per_run(_has_reliability_keys)
    if not any(keyed):
        return None
    holds = [k and has_reliability(r) for r, k in zip(runs, keyed)]
    have = list(compress(runs, holds))
    if not have:
        return None
    ops = [(r.metrics[names.SUM_WALL_S] - r.metrics[names.SUM_BADPUT_DOWN_S], int(r.metrics[names.SUM_FAILURES]))
           for r in have]
    mtbf, low, high = _rel.fleet_mtbf(ops)
    att = [r.metrics.get(names.SUM_ATTEMPTS) for r in have]
    attempts = int(sum(att)) if all(a is not None for a in att) else None
    return Fleet(len(have), attempts, sum(f for _, f in ops), sum(o for o, _ in ops), mtbf, low, high,
                 tuple(r.label for r, h in zip(runs, holds) if not h))


@dataclass(frozen=True)
class Failure:
    """One entry of a run's ``llmeff.reliability.failures`` tag.

    Attributes:
        run: the run's label.
        attempt: the failed attempt (1-based).
        cause: one of :data:`mlflow_llmeff.calc.reliability.CAUSES`.
        detail: what the cause was (``SIGKILL``, ``exit 1``, ...), "" when none.
        step: the last step the attempt completed.
        at_s: seconds into the job.
        lost_steps: steps redone.
        down_s, recovery_s: seconds; None when no attempt followed yet.
        lost_s: seconds of work redone when the tag holds them (``lost N s``), else None.
    """

    run: str
    attempt: int
    cause: str
    detail: str
    step: int
    at_s: float
    lost_steps: int
    down_s: float | None = None
    recovery_s: float | None = None
    lost_s: float | None = None


_FAILURE = re.compile(r"attempt (\d+): (\w+)(?: \((.*)\))? at step (\d+), ([\d.]+) s into the job, "
                      r"checkpoint \w+, (\d+) steps redone(?:, down ([\d.]+) s, recovery ([\d.]+) s)?"
                      r"(?:, lost ([\d.]+) s)?")


def parse_failures(r: RunRecord) -> list[Failure] | None:
    """The failures listed in the run's ``llmeff.reliability.failures`` tag (format of
    :func:`mlflow_llmeff.calc.reliability.failures_line`: ``; ``-separated entries).

    Returns:
        ``[]`` for ``none in N attempts``, None when the run has no such tag (an older run).

    Raises:
        ValueError: an entry that is not in that format (names the run and the entry).
    """
    tag = r.tags.get(names.RELIABILITY_FAILURES)
    if tag is None:
        return None
    if tag.startswith("none in "):
        return []
    out = []
    for entry in tag.split("; "):
        m = _FAILURE.fullmatch(entry.strip())
        if not m:
            raise ValueError(f"run {r.label}: {names.RELIABILITY_FAILURES} entry {entry!r} is not "
                             "'attempt N: cause (detail) at step S, T s into the job, ...'")
        a, cause, detail, step, at, lost_steps, down, rec, lost = m.groups()
        f = lambda v: None if v is None else float(v)  # noqa: E731
        out.append(Failure(r.label, int(a), cause, detail or "", int(step), float(at), int(lost_steps),
                           f(down), f(rec), f(lost)))
    return out


@dataclass(frozen=True)
class CauseRow:
    """Failures of one cause across runs (the Llama 3 paper's table of interruptions, Table 5).

    Attributes:
        cause: the cause.
        count: failures of it.
        share: count / all failures (0-1).
        details: each detail seen with its count, e.g. ``{"SIGKILL": 3}``.
        lost_steps: steps redone, summed.
        down_s, recovery_s: seconds summed over the failures whose down / recovery time is known
            (a next attempt followed); None when none is known (never a sum of unknowns as 0).
        cost_s: failure cost (recovery + lost progress) summed, seconds; None when some of its
            failures' lost progress cannot be told apart (a run failing of several causes whose
            tag does not give each failure's lost seconds) or their recovery is unknown.
        down_known, recovery_known: failures whose down / recovery time is known (of ``count``).
    """

    cause: str
    count: int
    share: float
    details: dict[str, int]
    lost_steps: int
    down_s: float | None
    recovery_s: float | None
    cost_s: float | None
    down_known: int = 0
    recovery_known: int = 0


def failures_by_cause(runs: list[RunRecord]) -> list[CauseRow]:
    """Every failure of ``runs`` grouped by cause, most frequent first (ties: by name).

    A failure's cost is its recovery plus its lost progress. The tag gives the recovery; the lost
    seconds come from the tag's ``lost N s`` when present, else from the run: its
    ``summary/failure_cost_s`` minus the recoveries of its failures is the run's lost progress,
    which goes whole to the cause when all of the run's failures have that cause (otherwise the
    cause's cost is None). A failure no attempt followed yet has no down or recovery time: it is
    not summed as 0, the row counts the failures whose times are known (``down_known``,
    ``recovery_known``).

    Returns:
        ``[]`` when no run failed (or none holds the tag).

    Raises:
        ValueError: from :func:`parse_failures`.
    """
    rows: dict[str, dict] = {}
    for r in runs:
        fs = parse_failures(r)
        if not fs:
            continue
        causes = {x.cause for x in fs}
        run_cost = r.metrics.get(names.SUM_FAILURE_COST_S)
        every_known = all(x.lost_s is not None and x.recovery_s is not None for x in fs)
        for x in fs:
            d = rows.setdefault(x.cause, {"count": 0, "details": {}, "lost_steps": 0, "down": [], "rec": [],
                                          "cost": 0.0})
            d["count"] += 1
            key = x.detail or x.cause
            d["details"][key] = d["details"].get(key, 0) + 1
            d["lost_steps"] += x.lost_steps
            for part, v in (("down", x.down_s), ("rec", x.recovery_s)):
                if v is not None:  # unknown (no next attempt yet): counted as unknown, never as 0 s
                    d[part].append(v)
            if every_known:
                d["cost"] = None if d["cost"] is None else d["cost"] + x.recovery_s + x.lost_s
        if not every_known:
            d = rows[next(iter(causes))]
            if len(causes) == 1 and run_cost is not None and math.isfinite(run_cost) and d["cost"] is not None:
                d["cost"] += run_cost
            else:
                for c in causes:
                    rows[c]["cost"] = None
    total = sum(d["count"] for d in rows.values())
    out = [CauseRow(c, d["count"], d["count"] / total, d["details"], d["lost_steps"],
                    sum(d["down"]) if d["down"] else None, sum(d["rec"]) if d["rec"] else None, d["cost"],
                    len(d["down"]), len(d["rec"])) for c, d in rows.items()]
    return sorted(out, key=lambda x: (-x.count, x.cause))
