"""Repeats, intervals and noise: runs of one configuration as samples, comparisons that do not rank
noise, and scaling efficiency with its interval (``docs/stability.md``, "Comparisons" and
"Between-run floor").

A pure calculator over :class:`~mlflow_llmeff.report.calc.RunRecord` values (no MLflow, no drawing).
The run, not the step, is the unit of replication:

* A **configuration** is the set of finished runs whose :data:`CONFIG_TAGS` are all equal and that
  ran the same number of optimizer steps (``summary/steps``): they are repeats, samples of one
  configuration's figure. Run length is part of it because goodput (set-up is paid once a run),
  the quality reached and whether the between-run floor holds all change with it: a 50-step and a
  300-step run averaged into one row describe neither (a trial's val loss 3.06 of 2.378 and 3.750).
  Runs that stopped at their targets are the exception: their length is the seed's outcome, so
  their identity is what they ran to and their step cap (:func:`~mlflow_llmeff.report.calc.run_length`),
  and every seed, the one that never reached the target too, is a repeat (scored MLPerf-style:
  :mod:`mlflow_llmeff.report.mlperf`).
* Its **estimate** of a figure (:class:`Estimate`) is, with two or more repeats, the mean over
  **every** repeat holding the figure with a 95% Student-t interval across them (df = repeats - 1):
  an unstable repeat (``llmeff.stability``) is a sample like any other and stays in (a stall is a
  real cost on this machine), named in :meth:`Configuration.note` with its value and why; a repeat
  without the figure is named in :attr:`Estimate.left_out`. A single run's own interval
  (``summary/tokens_per_sec_ci95_*``, from its steps) says nothing about the next run and is never
  a configuration's interval: a configuration of one run carries the **between-run floor** of its
  kind of machine (:data:`BETWEEN_RUN_FLOOR`, measured from repeats), ``mean x (1 +- floor)`` for
  figures that follow its throughput, or no interval where none is measured.
* Two estimates whose intervals overlap are **within noise**: neither is ranked above the other;
  an estimate without an interval cannot be ranked either.
* **Scaling efficiency** (:mod:`mlflow_llmeff.report.scaling`) is computed from configuration estimates
  (interval arithmetic on the two intervals, Moore 1966: the lowest and highest ratio the two intervals
  allow), and a value above :data:`SUPERLINEAR` is flagged with what could explain it.

Formulas and sources: ``docs/stability.md``.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from itertools import compress, repeat
from operator import sub

from mlflow_llmeff import names
from mlflow_llmeff.report.calc import Kinds, RunRecord, absent_why, run_length, split_comparable, stopped_at_targets


__all__ = ["CONFIG_TAGS", "SUPERLINEAR", "Floor", "BETWEEN_RUN_FLOOR", "floor_for", "steady_steps", "Estimate", "Configuration",
           "configurations", "config_key", "config_keys", "t_quantile_975", "within_noise", "versus_best", "best_index",
           "noisy_pareto_front", "is_stable", "METHOD_NOTE", "ONLY_ONE", "ALONE"]

#: Condition tags that define a configuration (equal on every repeat). Measured conditions (what
#: else used the machine, stability) and provenance that does not change the work (git commit,
#: run name) are not among them.
CONFIG_TAGS = (names.ACCEL_NAME, names.ACCEL_SHORT, names.ACCEL_COUNT, names.NODES, names.PROCS_PER_NODE,
               names.PAR_STRATEGY, names.PAR_DP, names.PAR_DP_SHARD, names.PAR_DP_REPLICATE, names.PAR_TP, names.PAR_PP, names.PAR_CP, names.PRECISION,
               names.MODEL_NAME, names.MODEL_PARAMS, names.SEQ_LEN, names.MICRO_BATCH_SIZE, names.GRAD_ACCUM,
               names.GLOBAL_BATCH_TOKENS, names.ACT_CKPT, names.COMPILE, names.OPTIMIZER, names.ATTENTION, names.WEIGHTS,
               names.THREADS, names.CPU_AFFINITY, names.FLOPS_TRAINABLE, names.DATASET, names.FLOPS_FORMULA, names.PEAK_SOURCE, names.WARMUP_STEPS, names.V_TORCH, names.V_TRANSFORMERS, names.V_ACCELERATE,
               names.V_LLMEFF)

#: Scaling efficiency above this is flagged (docs/compare.md, "Scaling efficiency").
SUPERLINEAR = 1.05

# Two-sided 95% Student-t quantiles t_{0.975, df}, df = 1..30 (any statistics table, e.g. NIST/SEMATECH
# e-Handbook of Statistical Methods, 1.3.6.7.2); beyond 30 the normal 1.96 is within 2%.
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
         2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
         2.045, 2.042)

# Figures proportional to a run's throughput (a single run's floor is its relative floor) and inversely
# proportional ones (per-token costs of time-priced resources, and per-token carbon: energy is power x time).
_WITH_TPS = (names.SUM_TOKENS_PER_SEC, names.SUM_DEVICE_TOKENS_PER_SEC, names.SUM_DEVICE_TFLOPS, names.SUM_MFU,
             names.SUM_MFU_PALM, names.SUM_HFU, names.SUM_MFU_MEASURED_PEAK)
_AGAINST_TPS = (names.SUM_STEP_TIME_S, names.SUM_USD_PER_BTOK, names.SUM_KG_CO2E_PER_BTOK,
                names.SUM_ESTIMATE_KG_CO2E_PER_BTOK)


# Figures that are a fraction, at most 1: a share of a run's time (docs/time.md) and a utilization of a peak
# (MFU, HFU: a trial's compare showed '[0.0%, 128.9%]' beside goodput's clipped '[0.00, 1.00]') and an accuracy.
_SHARES = (names.SUM_GOODPUT, names.SUM_MFU, names.SUM_MFU_PALM, names.SUM_HFU, names.SUM_MFU_MEASURED_PEAK,
           names.SUM_MFU_BF16_PEAK, names.EVAL_HELLASWAG_ACC_NORM, names.EVAL_MMLU_ACC)


def _clip_high(key: str, mean: float, high: float) -> float:
    """``high`` of a fraction's interval clipped at 1 (:data:`_SHARES`), or at the mean where an older run's
    mean is above 1 (an error in its inputs, shown as logged: the interval still holds its mean)."""
    return min(max(1.0, mean), high) if key in _SHARES else high


@dataclass(frozen=True)
class Floor:
    """The between-run noise one run cannot see: the relative half width of the 95% interval that a
    single run's throughput carries for its configuration's mean, measured from repeats.

    Attributes:
        half_width: relative half width (0.81 = +-81% of the run's figure), in [0, 1).
        source: where it was measured (a section of ``docs/stability.md``).
        min_steady_steps: steady steps of the shortest runs it was measured on: a shorter run's
            spread between runs was not measured (fewer steps average less of the machine's load
            away), so it gets no interval from this floor and is not ranked.
    """

    half_width: float
    source: str
    min_steady_steps: int = 0


#: Measured between-run floors by kind of machine (``llmeff.accelerator.short``). ``cpu``: 12 runs in
#: 3 configurations repeated on the shared 2-core CPU machine (docs/stability.md, "Between-run
#: floor"): pooled between-run CV 0.356 (df 9), t(0.975, 9) x 0.356 = 0.806, rounded up; two sets of
#: shorter runs (57 and 47 steady steps: CV 0.36, 0.21) spread no wider (pooled with them: 0.69), so it holds from 47
#: steady steps, and a shorter run gets no interval. A kind not listed has no measured floor: its
#: single runs carry no interval and are never ranked.
BETWEEN_RUN_FLOOR = {
    "cpu": Floor(0.81, "docs/stability.md, 'Between-run floor': pooled CV 0.356 of 12 repeats of 3 "
                       "configurations on a shared 2-core CPU machine (df 9), x t(0.975, 9) = 2.262; "
                       "held by sets of runs down to 47 steady steps", min_steady_steps=47),
}

#: How the comparison's intervals are made, said once beside every table and figure that uses them.
METHOD_NOTE = ("95% intervals: Student's t across a configuration's repeats (mean +- t(0.975, n-1) s / sqrt(n)), "
               "every repeat included, unstable ones too; a configuration of one run: its figure +- the "
               "between-run floor measured for its kind of machine (never the run's own interval, which says "
               "nothing about the next run), no interval where none is measured; overlapping intervals are "
               "within noise and not ranked (docs/stability.md)")


def floor_for(kind: str | None) -> Floor | None:
    """The measured :class:`Floor` of a kind of machine (``llmeff.accelerator.short``), None when unmeasured."""
    return BETWEEN_RUN_FLOOR.get((kind or "").strip())


def t_quantile_975(df: int) -> float:
    """``t_{0.975}`` of Student's t with ``df`` degrees of freedom (1.96 beyond 30).

    Raises:
        ValueError: for ``df < 1``.
    """
    if df < 1:
        raise ValueError(f"df={df!r} is not accepted; give >= 1 degrees of freedom")
    return _T975[df - 1] if df <= len(_T975) else 1.96


def is_stable(r: RunRecord) -> bool:
    """True when the run's ``llmeff.stability`` tag says ``stable``."""
    return r.tags.get(names.STABILITY, "") == "stable"


def _num(v: float) -> str:
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.4g}"


@dataclass(frozen=True)
class Estimate:
    """A configuration's figure: its mean and 95% interval.

    Attributes:
        mean: the figure (mean over the repeats holding it).
        low, high: the 95% interval, None when there is none.
        n: repeats used.
        method: ``repeats`` (Student-t interval across n >= 2 runs), ``floor`` (one run: its figure
            +- the between-run floor of its kind of machine) or ``no interval``; other methods name
            themselves (e.g. ``process RSS +-5%``, report/plots.py).
        floor: the :class:`Floor` of a ``floor`` estimate.
        left_out: one ``"<run>: <why>"`` per repeat of the configuration left out of this figure.
        kind: the kind of machine (``llmeff.accelerator.short``) of a single-run estimate.
        inverse: a ``floor`` estimate of a figure that falls as throughput rises (``/ (1 -+ f)``),
            recorded where it is made (inferred from the bounds it was decided by float rounding).
        short_of: ``(steady steps, the floor's minimum)`` of a single run too short for its kind's
            floor (:attr:`Floor.min_steady_steps`): no interval.
        unit: what the runs are called in words: ``repeat``, or ``seed`` for runs each with its own
            seed (:attr:`Configuration.unit`).
    """

    mean: float
    low: float | None
    high: float | None
    n: int
    method: str
    floor: Floor | None = None
    left_out: tuple[str, ...] = ()
    kind: str | None = None
    inverse: bool = False
    short_of: tuple[int, int] | None = None
    unit: str = "repeat"

    @property
    def has_interval(self) -> bool:
        return self.low is not None and self.high is not None

    @property
    def half_width(self) -> float | None:
        """Half the interval's width as a fraction of the mean."""
        if not self.has_interval or not self.mean:
            return None
        return (self.high - self.low) / 2 / abs(self.mean)

    def how(self) -> str:
        """The method in words, e.g. ``mean of 2 repeats, 95% Student-t interval (df 1)``."""
        if self.method == "repeats":
            text = f"mean of {self.n} {self.unit}s, 95% Student-t interval across them (df {self.n - 1})"
        elif self.method == "floor":
            f = f"{self.floor.half_width:g}"
            text = (f"one run: its throughput +-{self.floor.half_width:.0%}, the between-run floor of "
                    f"{self.kind or 'this kind of machine'} ({self.floor.source}), so this figure "
                    f"{f'/ (1 -+ {f})' if self.inverse else f'x (1 +- {f})'}; not its own interval")
        elif self.method == "no interval" and self.short_of is not None:
            text = (f"one run of {self.short_of[0]} steady steps: the between-run floor of {self.kind} was "
                    f"measured on runs of {self.short_of[1]} or more, so no interval, not ranked (repeat it, "
                    "or run longer)")
        elif self.method == "no interval" and self.n == 1:
            text = (f"one run, no between-run floor measured for {self.kind or 'this kind of machine'}: "
                    "no interval, not ranked (repeat it)")
        else:
            text = self.method
        if self.left_out:
            text += "; left out: " + "; ".join(self.left_out)
        return text

    def text(self, fmt=_num) -> str:
        """``6,377 [1,498, 11,256] (2 repeats, t)`` / ``6,761 [1,285, 12,237] (1 run, between-run floor of cpu)``
        / ``6,761 (1 run, no interval)``. A floor's bounds are printed, not ``+-f``: a figure that falls as
        throughput rises (seconds or kg per token) spreads to ``/ (1 -+ f)``, not ``+-f``."""
        if self.method == "floor":
            return f"{fmt(self.mean)} [{fmt(self.low)}, {fmt(self.high)}] (1 run, between-run floor of {self.kind})"
        if not self.has_interval:
            return f"{fmt(self.mean)} ({'1 run, ' if self.n == 1 else ''}no interval)"
        how = f"{self.n} {self.unit}s, t" if self.method == "repeats" else self.method
        return f"{fmt(self.mean)} [{fmt(self.low)}, {fmt(self.high)}] ({how})"


def steady_steps(r: RunRecord) -> int | None:
    """The run's steady-state steps, ``summary/steps`` less ``llmeff.warmup_steps``; None when either is not logged."""
    try:
        return max(0, int(r.metrics[names.SUM_STEPS]) - int(r.tags[names.WARMUP_STEPS]))
    except (KeyError, ValueError, TypeError):
        return None


def _single_run_estimate(r: RunRecord, key: str, left_out: tuple[str, ...]) -> Estimate:
    """One run's figure with the between-run floor of its kind of machine, where the figure follows
    its throughput (proportionally or inversely), a floor is measured and the run is at least as long
    as the runs it was measured on (:attr:`Floor.min_steady_steps`); else no interval."""
    v = r.metrics[key]
    kind = r.tags.get(names.ACCEL_SHORT)
    fl = floor_for(kind)
    steady = steady_steps(r)
    if fl is not None and steady is not None and steady < fl.min_steady_steps and key in _WITH_TPS + _AGAINST_TPS:
        return Estimate(v, None, None, 1, "no interval", None, left_out, kind, short_of=(steady, fl.min_steady_steps))
    if fl is not None and key in _WITH_TPS:
        return Estimate(v, v * (1 - fl.half_width), _clip_high(key, v, v * (1 + fl.half_width)), 1, "floor", fl,
                        left_out, kind)
    if fl is not None and key in _AGAINST_TPS:  # throughput in x (1 +- f): the per-token figure in / (1 -+ f)
        return Estimate(v, v / (1 + fl.half_width), v / (1 - fl.half_width), 1, "floor", fl, left_out, kind,
                        inverse=True)
    return Estimate(v, None, None, 1, "no interval", None, left_out, kind)


def _plain_mean(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return sum(vals) / len(vals) if vals else None


def _left_out(r: RunRecord, key: str) -> str:
    """``"<run>: <why>"`` for a repeat without a finite ``key``: the why its ``llmeff.summary.absent`` gives."""
    why = absent_why(r, key)
    return f"{r.label}: no {key} ({why})" if why else f"{r.label}: no finite {key}"


@dataclass
class Configuration:
    """Finished runs with equal :data:`CONFIG_TAGS`: repeats of one configuration.

    Attributes:
        key: the values of :data:`CONFIG_TAGS`.
        runs: every finished repeat with a summary, in the order given.
        label: the :attr:`first` run's name and how many others, as repeats or seeds.

    The split into stable and unstable repeats and each figure's estimate are computed once for a
    given set of runs (recomputed when runs are added): a run's values changed in place after its
    figure was estimated are not seen.
    """

    key: tuple
    runs: list[RunRecord] = field(default_factory=list)
    #: what :meth:`_split` and :meth:`estimate` computed, for the runs as they were (their count):
    #: a report asks for them over a hundred times (headline, scaling, notes), each a pass over the runs
    _memo: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def _remembered(self, what, compute):
        n = len(self.runs)
        got = self._memo.get(what)
        if got is None or got[0] != n:
            got = self._memo[what] = (n, compute())
        return got[1]

    def kinds_of(self, kinds: Kinds) -> None:
        """Keep ``kinds`` (a :class:`~mlflow_llmeff.report.calc.Kinds` of :attr:`runs`, as they are) for the figures."""
        self._memo["kinds"] = (len(self.runs), kinds)

    def by_kind(self) -> Kinds:
        """:attr:`runs` with the kind of each (:class:`~mlflow_llmeff.report.calc.Kinds`), kept."""
        return self._remembered("kinds", lambda: Kinds(self.runs))

    def used_by_kind(self) -> Kinds:
        """:attr:`used` with the kind of each (:class:`~mlflow_llmeff.report.calc.Kinds`), kept."""
        return self._split_kinds()[1]

    def _split(self) -> tuple[list[RunRecord], list[RunRecord]]:
        return self._remembered("split", lambda: self._split_kinds()[0])

    def _split_kinds(self) -> tuple[tuple[list[RunRecord], list[RunRecord]], Kinds, Kinds]:
        """The stable and unstable repeats, a :class:`Kinds` of :attr:`used` (the two joined) and one of the
        runs :attr:`first` is chosen among."""
        def split():
            every = self.by_kind()
            stable, unstable = every.split(is_stable)  # a tag: once a kind of runs (RunRecord.alike)
            if not unstable.runs:
                return (list(self.runs), []), every, every
            return (stable.runs, unstable.runs), stable.join(unstable), stable if stable.runs else unstable

        return self._remembered("split kinds", split)

    def _used(self) -> list[RunRecord]:
        return self._remembered("used", lambda: self._split()[0] + self._split()[1])

    @property
    def stable(self) -> list[RunRecord]:
        return list(self._split()[0])

    @property
    def used(self) -> list[RunRecord]:
        """The repeats the figures use: every one (a repeat is a sample; an unstable one is named,
        not dropped), the stable ones first."""
        return list(self._used())

    @property
    def unstable(self) -> list[RunRecord]:
        """Repeats tagged unstable (in the figures, and named by :meth:`note`)."""
        return list(self._split()[1])

    @property
    def first(self) -> RunRecord:
        """The run the configuration is named after and linked to: its oldest stable run (else its oldest
        run), by MLflow start time; the first given where the starts are not known. Whatever order the
        runs were read in (a study listed its seeds by repeat and named the configuration '...-cpu';
        compare read them newest first and named the same runs '...-cpu-3')."""
        return self._remembered("first", lambda: _oldest(self._split_kinds()[2]))

    @property
    def label(self) -> str:
        """The :attr:`first` run's name, then ``(+N repeats)``, or ``(+N seeds)`` where every run has a
        ``seed`` param and no two share one (``llmeff study --seeds``: MLPerf-style runs, each its own
        seed, are not repeats of one seed)."""
        first = self.first.label
        if len(self.runs) == 1:
            return first
        return f"{first} (+{len(self.runs) - 1} {self.unit}{'s' if len(self.runs) > 2 else ''})"

    @property
    def unit(self) -> str:
        """``seed`` where every run has a ``seed`` param and no two share one, else ``repeat``: what the
        label, the intervals' words and the notes call the runs."""
        return self._remembered("unit", self._unit)

    def _unit(self) -> str:
        if len(self.runs) < 2 or len(self.by_kind().first) < len(self.runs):
            return "repeat"  # runs alike share their params: two of a kind share a seed, or have none
        s = [r.params.get("seed") for r in self.runs]
        return "seed" if None not in s and len(set(s)) == len(s) else "repeat"

    @property
    def devices(self) -> int | None:
        return self.runs[0].devices

    def tag(self, key: str) -> str | None:
        return self.runs[0].tags.get(key)

    def estimate(self, key: str) -> Estimate | None:
        """Mean and 95% interval of summary figure ``key`` over every repeat holding it (see the
        module docstring); None when no repeat holds it.

        Two or more repeats: ``mean +- t(0.975, n - 1) x s / sqrt(n)`` with ``s`` the sample standard
        deviation across the repeats (Student 1908; t from the standard table, NIST/SEMATECH
        e-Handbook 1.3.6.7.2), the low end clipped at 0 (no summary figure is negative), a fraction's high end
        at 1 (goodput, MFU, HFU: :func:`_clip_high`). One repeat:
        :func:`_single_run_estimate`.
        """
        return self._remembered(("estimate", key), lambda: self._estimate(key))

    def values(self, key: str) -> list[float | None]:
        """Each of :attr:`used`'s value of metric ``key`` (None where a repeat lacks it), in that order:
        one pass over the repeats a key (``dict.get`` mapped in C), kept for every later figure of it; none
        where no kind of its runs holds the key (:attr:`~mlflow_llmeff.report.calc.RunRecord.alike`: the same
        metric keys)."""
        return self._remembered(("values", key), lambda: self._values(key))

    def _values(self, key: str) -> list[float | None]:
        return self._column(key)[0]

    def _column(self, key: str) -> tuple[list[float | None], bool]:
        """:meth:`values` of ``key`` and whether every repeat holds it: runs alike hold the same metric keys
        (:attr:`~mlflow_llmeff.report.calc.RunRecord.alike`), so a kind of runs answers for all of its runs."""
        def read():
            held = [key in r.metrics for r in self.used_by_kind().kinds()]
            if not any(held):
                return [None] * len(self._used()), False
            return self.used_by_kind().column(key), all(held)

        return self._remembered(("column", key), read)

    def mean(self, key: str) -> float | None:
        """The plain mean of metric ``key`` over the :attr:`used` repeats holding it (NaN included, as
        logged); None when none holds it. Kept, like :meth:`estimate`."""
        return self._remembered(("mean", key), lambda: self._plain_mean(key))

    def _plain_mean(self, key: str) -> float | None:
        got, every = self._column(key)
        return sum(got) / len(got) if every and got else _plain_mean(got)

    def _estimate(self, key: str) -> Estimate | None:
        got, every = self._column(key)
        total = None
        if every and got:  # every repeat holds it (the usual case): a finite sum has no NaN or infinity in it
            total = sum(got)
            if not math.isfinite(total) and not all(map(math.isfinite, got)):
                total = None
        elif not got or got[0] is None and not any(map(operator.is_not, got, repeat(None))):  # no repeat holds it
            return None
        if total is not None or (got and None not in got and all(map(math.isfinite, got))):
            have, vals, left_out = self.used, got, ()
        else:
            used = self.used
            fin = [v is not None and math.isfinite(v) for v in got]
            have = [r for r, ok in zip(used, fin) if ok]
            if not have:
                return None
            left_out = tuple(_left_out(r, key) for r, ok in zip(used, fin) if not ok)
            vals = [v for v, ok in zip(got, fin) if ok]
        if len(have) == 1:
            return _single_run_estimate(have[0], key, left_out)
        n = len(vals)
        mean = (sum(vals) if total is None else total) / n
        # sum((v - mean) ** 2 for v in vals), the same operations in the same order, mapped in C
        sd = math.sqrt(sum(map(pow, map(sub, vals, repeat(mean)), repeat(2))) / (n - 1))
        half = t_quantile_975(n - 1) * sd / math.sqrt(n)
        # every summary figure is >= 0, and a share of time <= 1: a t interval of few repeats may reach
        # beyond, the figure cannot
        high = _clip_high(key, mean, mean + half)
        return Estimate(mean, max(0.0, mean - half), high, n, "repeats", None, left_out, unit=self.unit)

    def note(self) -> str:
        """What a reader must know about the repeats: the unstable ones, each with its tokens/s and
        why, kept in the figures (empty when every repeat is stable)."""
        bad = self.unstable
        if not bad:
            return ""

        def value(r: RunRecord) -> str:  # the table's figure: tokens/s per device
            tps = r.metrics.get(names.SUM_DEVICE_TOKENS_PER_SEC, r.metrics.get(names.SUM_TOKENS_PER_SEC))
            return f"{_num(tps)} tokens/s per device" if tps is not None else ""

        def one(r: RunRecord) -> str:
            v = value(r)
            return f"{r.label}{' ' + v if v else ''} ({r.tags.get(names.STABILITY, 'no stability tag (older run)')})"

        if len(self.runs) == 1:  # the row is the run: no second name, no second 'unstable'
            r, v = bad[0], value(bad[0])
            tag = r.tags.get(names.STABILITY, "no stability tag (older run)")
            why = tag.split(":", 1)[1].strip() if tag.startswith("unstable:") else tag
            return f"the run is unstable{' at ' + v if v else ''}: {why}"
        why = "; ".join(one(r) for r in bad)
        unit = self.unit
        if len(bad) == len(self.runs):
            return f"no stable {unit}, all {len(bad)} in the figures: {why}"
        return f"{len(bad)} unstable {unit}{'s' if len(bad) > 1 else ''} kept in the figures: {why}"


def _oldest(pool: Kinds) -> RunRecord:
    """The first run of ``pool`` with the earliest start (runs without one after every run with one)."""
    starts = pool.attribute("start_time_ms")
    if None not in starts:  # the first smallest start, found in C
        return pool.runs[starts.index(min(starts))]
    return min(pool.runs, key=lambda r: (r.start_time_ms is None, r.start_time_ms or 0))


def config_key(r: RunRecord) -> tuple:
    """A run's configuration: its :data:`CONFIG_TAGS` and its length (:func:`~mlflow_llmeff.report.calc.run_length`:
    the optimizer steps, or for a run stopped at its targets what it ran to)."""
    return _whole_key(_fixed_key(r), r)


def config_keys(runs: list[RunRecord]) -> list[tuple]:
    """:func:`config_key` of each of ``runs``, its tags and a length set by targets read once a kind of runs
    (:attr:`RunRecord.alike`)."""
    return [_whole_key(part, r) for r, part in zip(runs, Kinds(runs).per_run(_fixed_key))]


def _fixed_key(r: RunRecord) -> tuple[tuple, str | None]:
    """:func:`config_key`'s part from the run's tags and params: its tags, and its length where targets set it."""
    return tuple(map(r.tags.get, CONFIG_TAGS)), run_length(r) if stopped_at_targets(r) else None


def _whole_key(fixed: tuple[tuple, str | None], r: RunRecord) -> tuple:
    """:func:`config_key` from its :func:`_fixed_key` part: the run's optimizer steps where targets did not set its length."""
    values, length = fixed
    return (*values, run_length(r) if length is None else length)


def configurations(runs: list[RunRecord], *, compared: Kinds | None = None) -> list[Configuration]:
    """The configurations of the finished runs with a summary, in order of first appearance (a key per run:
    :func:`config_key`).

    ``compared``: the comparable runs of ``runs`` where known (:func:`~mlflow_llmeff.report.calc.split_comparable`).
    A key's tags and a length set by targets are read once for each kind of runs (:attr:`RunRecord.alike`),
    the rest once for each kind and value of ``summary/steps``, and the runs are sorted into configurations
    in passes of C: 100,000 runs of 5 kinds and one length are 5 keys."""
    compared = split_comparable(runs)[0] if compared is None else compared
    fixed = compared.answers(_fixed_key)  # per kind: its CONFIG_TAGS values, and its length where targets set it
    steps = compared.column(names.SUM_STEPS)
    one = len(set(steps)) == 1  # one length (the usual case): a kind is one configuration
    pairs = compared.of if one else list(zip(compared.of, steps))
    out: dict[tuple, Configuration] = {}
    where: dict = {}  # kind, or (kind, steps) -> its configuration, in the order first seen
    for pair in dict.fromkeys(pairs):
        kind, n = (pair, steps[0]) if one else pair
        values, length = fixed[kind]
        # _whole_key: where targets did not set the length, run_length's optimizer steps
        key = (*values, (int(n) if n is not None else None) if length is None else length)
        where[pair] = out.get(key) or out.setdefault(key, Configuration(key))
    configs = list(out.values())
    if len(configs) == 1:
        configs[0].runs.extend(compared.runs)
        configs[0].kinds_of(compared)
        return configs
    of = list(map(where.__getitem__, pairs))
    if len(configs) <= _FEW:  # each configuration's runs picked out in C
        for c in configs:
            part = compared.subset(list(map(operator.is_, of, repeat(c))))
            c.runs.extend(part.runs)
            c.kinds_of(part)
    else:
        for r, c in zip(compared.runs, of):
            c.runs.append(r)
    return configs


#: Up to this many configurations, :func:`configurations` picks each one's runs out in a pass of C.
_FEW = 16


def within_noise(a: Estimate | None, b: Estimate | None) -> bool:
    """True when the two figures cannot be told apart: their intervals overlap, or one has none."""
    if a is None or b is None or not a.has_interval or not b.has_interval:
        return True
    return a.low <= b.high and b.low <= a.high


def versus_best(configs: list[Configuration], key: str, *, higher_is_better: bool = True) -> dict[int, str]:
    """Per configuration index: ``best``, ``within noise of best``, ``not ranked (no interval)`` or ``0.62x best``.

    The best is the best mean (:func:`best_index`); a configuration is ranked below it only when their
    intervals do not overlap. Two intervals that overlap are ``within noise``; where either side has no
    interval (a single run shorter than its machine's floor, a kind of machine with none measured)
    nothing is known of the noise, and the label says so (``not ranked (no interval)``, or ``not
    ranked (best has no interval)``) rather than claim the two are within it. The best is then
    ``best (N within noise, M not ranked: no interval)``, naming only the parts there are; a configuration
    alone is ``no other configuration``, and the only one of several with the figure ``only one with this
    figure`` (nothing to be best against).
    """
    est = [c.estimate(key) for c in configs]
    best = best_index(configs, key, higher_is_better=higher_is_better)
    if best is None:
        return {}
    out, tied, unranked = {}, 0, 0
    for i, e in enumerate(est):
        if e is None or i == best:
            continue
        if not e.has_interval or not est[best].has_interval:
            out[i] = NOT_RANKED if not e.has_interval else NOT_RANKED_BEST
            unranked += 1
        elif within_noise(e, est[best]):
            out[i] = "within noise of best"
            tied += 1
        else:
            out[i] = f"{e.mean / est[best].mean:.3g}x best"
    if len(est) == 1:
        out[best] = ALONE
    elif sum(e is not None for e in est) == 1:
        out[best] = ONLY_ONE
    else:
        parts = ([f"{tied} within noise"] if tied else []) + ([f"{unranked} not ranked: no interval"] if unranked else [])
        out[best] = f"best ({', '.join(parts)})" if parts else "best"
    return out


#: :func:`versus_best` of a configuration without an interval, and of one beside a best without one.
NOT_RANKED = "not ranked (no interval)"
NOT_RANKED_BEST = "not ranked (best has no interval)"


def standing_order(label: str) -> int:
    """Where a :func:`versus_best` label sorts: 0 the best (or the only one), 1 unranked against it (within
    noise, or not ranked for want of an interval), 2 ranked below it (``0.62x best``) or no label."""
    if label.startswith("best") or label in (ONLY_ONE, ALONE):
        return 0
    if label.startswith("within noise") or label in (NOT_RANKED, NOT_RANKED_BEST):
        return 1
    return 2


#: :func:`versus_best` of the only configuration of several with the figure, and of a configuration alone.
ONLY_ONE = "only one with this figure"
ALONE = "no other configuration"


def best_index(configs: list[Configuration], key: str, *, higher_is_better: bool = True) -> int | None:
    """Index of the configuration with the best mean of ``key`` (None when none has it)."""
    est = [c.estimate(key) for c in configs]
    have = [i for i, e in enumerate(est) if e is not None]
    if not have:
        return None
    return (max if higher_is_better else min)(have, key=lambda i: est[i].mean)


def noisy_pareto_front(points: list[tuple[Estimate, Estimate]], *, maximize_x: bool, maximize_y: bool) -> list[int]:
    """Indices of the points no other point beats beyond noise, sorted by x mean.

    Point ``j`` dominates ``i`` when it is at least as good on both axes' means and better beyond
    noise (intervals apart, :func:`within_noise` false) on at least one. So a point that is worse
    only within noise stays on the front: it is never drawn as beaten.
    """
    sx, sy = (1 if maximize_x else -1), (1 if maximize_y else -1)

    def better(a: Estimate, b: Estimate, s: int) -> bool:  # a beats b beyond noise
        return s * a.mean > s * b.mean and not within_noise(a, b)

    front = []
    for i, (xi, yi) in enumerate(points):
        dominated = any(sx * xj.mean >= sx * xi.mean and sy * yj.mean >= sy * yi.mean
                        and (better(xj, xi, sx) or better(yj, yi, sy))
                        for j, (xj, yj) in enumerate(points) if j != i)
        if not dominated:
            front.append(i)
    return sorted(front, key=lambda i: points[i][0].mean)
