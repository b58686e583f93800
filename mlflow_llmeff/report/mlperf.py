"""Time, energy and cost to a quality target per configuration, scored as MLPerf Training scores a benchmark.

A pure calculator over :class:`~mlflow_llmeff.report.repeats.Configuration` values (no MLflow, no
drawing). For each configuration and each target its runs carry (``llmeff.ttq.<target>``), every run
is one sample: the time to the target ``ttq/<target>_wall_s`` (from the end of set-up, eval time
included: ``docs/time.md``), the energy ``ttq/<target>_kwh`` and the cost ``ttq/<target>_usd``. A run
that did not reach the target (``llmeff.ttq.<target>=not_reached``), or that failed before its end, is
a non-converged run. The time is scored by :func:`mlflow_llmeff.calc.mlperf.olympic`: the fastest
and the slowest run dropped, one non-converged run counting as the slowest, two or more leaving no
result (MLPerf Training Rules, Dec 9, 2025, "Benchmark Results"; ``docs/compare.md``, "Time to target,
MLPerf-style"). Energy and cost are the mean over exactly the runs the time score kept
(:func:`mlflow_llmeff.calc.mlperf.olympic_on_kept`), as MLCommons' result summarizer scores power. The mean over only the runs that reached a target (what the
time-to-quality figure showed before) made a configuration that sometimes fails look faster.
"""

from __future__ import annotations

import html
import math
from dataclasses import dataclass
from functools import partial
from itertools import compress

from mlflow_llmeff import names
from mlflow_llmeff.calc.mlperf import RULES, Olympic, olympic, olympic_on_kept
from mlflow_llmeff.report.calc import Kinds, RunRecord
from mlflow_llmeff.report.repeats import Configuration, config_keys


__all__ = ["RunToTarget", "TargetScore", "target_scores", "config_scores", "targets_of", "RULE_NOTE", "COLUMNS", "rows", "text_lines",
           "markdown", "html_section"]

#: Said once under every table of these scores.
RULE_NOTE = (f"Scored as MLPerf Training scores a benchmark ({RULES}); a run that did not reach the target, or "
             "failed, counts as infinitely slow. The time runs from training start, the run's set-up excluded, "
             "as MLPerf's run_start does. Energy and cost are the mean over the runs the time score keeps (the "
             "same fastest and slowest dropped), as MLCommons' result summarizer scores power. MLPerf "
             "asks for 10 runs (Small LLM pretraining, Llama 3.1 8B) or 3 (LLM pretraining, Llama 3.1 405B): "
             "MLPerf-style results, not an MLPerf submission (docs/compare.md)")

_FIGURES = (("wall_s", "s"), ("kwh", "kWh"), ("usd", "USD"))


@dataclass(frozen=True)
class RunToTarget:
    """One run of a configuration against one target.

    Attributes:
        label: the run's name.
        values: ``{"wall_s" | "kwh" | "usd": value}`` to the target, each present when the run reached
            it and logged the figure.
        reached: the run reached the target.
        end_s: a run that did not reach it: its wall time after set-up when it stopped (at its step
            cap, or when it failed), seconds; None when unknown or reached.
        steps: the optimizer steps it ran (``summary/steps``), None when not logged.
        status: the run's MLflow status (a FAILED or KILLED run counts as not converged).
    """

    label: str
    values: dict
    reached: bool
    end_s: float | None = None
    steps: int | None = None
    status: str = "FINISHED"


@dataclass(frozen=True)
class TargetScore:
    """A configuration's olympic scores to one target.

    Attributes:
        config: the configuration.
        target: the target's key stem, e.g. ``val_loss_le_3.0``.
        runs: each run, in the configuration's order, failed runs last.
        scores: ``{"wall_s" | "kwh" | "usd": Olympic}``, energy and cost over the runs the time score kept;
            a figure some run that reached the target did not log (energy unmeasured, no price) has no score
            and is in :attr:`missing` instead.
        missing: ``{figure: "<why>"}`` for the figures without a score for want of values.
    """

    config: Configuration
    target: str
    runs: tuple[RunToTarget, ...]
    scores: dict
    missing: dict

    @property
    def wall(self) -> Olympic:
        return self.scores["wall_s"]

    @property
    def not_reached(self) -> list[RunToTarget]:
        return [r for r in self.runs if not r.reached]

    def figure(self, key: str = "wall_s") -> tuple[float, float, float, str] | None:
        """``(value, low, high, how)`` to show for figure ``key``: the olympic score with the range of the runs
        averaged; for one or two runs that all reached the target (too few to drop the fastest and the
        slowest) their plain mean and range, said so; None otherwise (no result: :attr:`Olympic.why`)."""
        o = self.scores.get(key)
        if o is None:
            return None
        if o.valid:
            return o.score, o.low, o.high, f"olympic mean of the middle {len(o.kept)} of {o.n} runs"
        if o.n < 2 * o.drop + 1 and o.not_converged == 0 and o.converged:
            n = len(o.converged)
            return (sum(o.converged) / n, o.converged[0], o.converged[-1],
                    f"mean of {n} run{'s' if n > 1 else ''}: too few to drop the fastest and the slowest")
        return None


def targets_of(c: Configuration) -> list[str]:
    """The target stems any run of ``c`` was given (its ``llmeff.ttq.<stem>`` tags, or a ``ttq/<stem>_wall_s``
    an older run logged without the tag), sorted."""
    each = c.by_kind().kinds()  # runs alike hold the same tag and metric keys (RunRecord.alike)
    tagged = {k[len(names.TTQ_TAG_PREFIX):] for k in set().union(*(r.tags for r in each))
              if k.startswith(names.TTQ_TAG_PREFIX)}
    timed = {k[len("ttq/"):-len("_wall_s")] for k in set().union(*(r.metrics for r in each))
             if k.startswith("ttq/") and k.endswith("_wall_s")}
    return sorted(tagged | timed)


def _given(r: RunRecord, stem: str) -> bool:
    """The run was given the target (its tag says reached or not, or it logged the time to it)."""
    return names.TTQ_TAG_PREFIX + stem in r.tags or f"ttq/{stem}_wall_s" in r.metrics


def _end_s(r: RunRecord) -> float | None:
    wall, init = r.metrics.get(names.SUM_WALL_S), r.metrics.get(names.SUM_BADPUT["init"])
    if wall is None or not math.isfinite(wall):
        return None
    return max(0.0, wall - (init or 0.0))


def _keys(stem: str) -> list[tuple[str, str]]:
    """``(figure, its metric key)`` of each of :data:`_FIGURES` to target ``stem``."""
    return [(s, f"ttq/{stem}_{s}") for s, _ in _FIGURES]


def _one(r: RunRecord, stem: str, keys: list[tuple[str, str]] | None = None) -> RunToTarget:
    m = r.metrics
    values = {s: m[k] for s, k in keys or _keys(stem) if k in m and math.isfinite(m[k])}
    reached = "wall_s" in values
    steps = r.metrics.get(names.SUM_STEPS)
    return RunToTarget(r.label, values, reached, None if reached else _end_s(r),
                       int(steps) if steps is not None else None, r.status)


def target_scores(configs: list[Configuration], others: list[RunRecord] = ()) -> list[TargetScore]:
    """Every configuration's olympic scores to every target its runs carry, in the order of ``configs``.

    Args:
        configs: the configurations (:func:`~mlflow_llmeff.report.repeats.configurations`).
        others: runs left out of the configurations (FAILED, KILLED, without a summary): one with the
            configuration's key (:func:`~mlflow_llmeff.report.repeats.config_key`: its conditions and,
            for a run stopped at its targets, what it ran to) is one of its runs that did not converge,
            unless it logged the target's time before it failed.
    """
    failed: dict[tuple, list[RunRecord]] = {}
    stopped = [r for r in others if r.status in ("FAILED", "KILLED")]
    for r, key in zip(stopped, config_keys(stopped)):
        failed.setdefault(key, []).append(r)
    return [ts for c in configs for ts in config_scores(c, failed.get(c.key, []))]


class _Runs:
    """What a :class:`RunToTarget` of each of ``runs`` holds whatever the target, read once for every target:
    label, steps, status, and its wall time after set-up (:func:`_end_s`, where it did not reach a target)."""

    def __init__(self, kinds: Kinds):
        runs = self.runs = kinds.runs
        self.kinds = kinds
        names_ = kinds.attribute("name")
        self.labels = names_ if all(names_) else [r.label for r in runs]
        self.steps = kinds.column(names.SUM_STEPS)  # as logged: made whole where a RunToTarget holds it
        self.status = kinds.attribute("status")
        self._ends: list | None = None

    def ends(self) -> list[float | None]:
        """:func:`_end_s` of each run (worked out once, when a run first did not reach a target)."""
        if self._ends is None:
            self._ends = list(map(_end_of, self.kinds.column(names.SUM_WALL_S),
                                  self.kinds.column(names.SUM_BADPUT["init"])))
        return self._ends

    def to(self, stem: str, keys: list[tuple[str, str]], given: list[bool] | None = None) -> list[RunToTarget]:
        """A :class:`RunToTarget` of each run to target ``stem`` (only those ``given`` it where given): the figures
        a kind of runs holds found once (:attr:`~mlflow_llmeff.report.calc.RunRecord.alike`: its metric keys)."""
        held = self.kinds.per_run(partial(_held, keys=keys))
        at = range(len(self.runs)) if given is None else list(compress(range(len(self.runs)), given))
        ends = self.ends() if [] in held else None  # a kind holds no figure of it: its runs did not reach it
        runs, labels, steps, status = self.runs, self.labels, self.steps, self.status
        out = []
        for i in at:
            k = held[i]
            if k:
                m = runs[i].metrics
                values = {s: m[key] for s, key in k if math.isfinite(m[key])}
                reached = "wall_s" in values
            else:
                values, reached = {}, False
            n = steps[i]
            out.append(RunToTarget(labels[i], values, reached, None if reached else (ends or self.ends())[i],
                                   None if n is None else int(n), status[i]))
        return out


def _held(r: RunRecord, keys: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The ``(figure, key)`` of ``keys`` whose metric run ``r`` holds."""
    return [(s, k) for s, k in keys if k in r.metrics]


def _end_of(wall: float | None, init: float | None) -> float | None:
    """:func:`_end_s` from the run's ``summary/wall_s`` and set-up time."""
    if wall is None or not math.isfinite(wall):
        return None
    return max(0.0, wall - (init or 0.0))


def config_scores(c: Configuration, failed: list[RunRecord] = ()) -> list[TargetScore]:
    """One configuration's olympic scores to each target its runs carry (:func:`targets_of`), ``failed``
    being runs of it that did not finish (each a non-converged run unless it logged the target's time)."""
    out = []
    stems = targets_of(c)
    if not stems:
        return out
    mine, stopped = _Runs(c.by_kind()), _Runs(Kinds(list(failed)))
    for stem in stems:
        keys = _keys(stem)
        given = c.by_kind().per_run(partial(_given, stem=stem))  # whether it was given: once a kind of runs
        runs = mine.to(stem, keys, given) + stopped.to(stem, keys)
        times = [r.values.get("wall_s") for r in runs]
        scores, missing = {"wall_s": olympic(times)}, {}
        for s in ("kwh", "usd"):  # on the runs the time score keeps (MLCommons' result summarizer)
            lacking = [r.label for r in runs if r.reached and s not in r.values]
            if lacking:
                why = "energy was not measured" if s == "kwh" else "no price (device_hour_usd)"
                missing[s] = f"{why} on {', '.join(lacking)}"
                continue
            scores[s] = olympic_on_kept(times, [r.values.get(s) if r.reached else None for r in runs])
        out.append(TargetScore(c, stem, tuple(runs), scores, missing))
    return out


def _g(v: float) -> str:
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"


def _cell(ts: TargetScore, key: str, unit: str) -> str:
    o, shown = ts.scores.get(key), ts.figure(key)
    if o is None:
        return f"none: {ts.missing[key]}" if key in ts.missing else ""
    if shown is not None:
        value, low, high, how = shown
        interval = f" [{_g(low)}, {_g(high)}]" if high > low else ""  # (the middle one of 3: no range)
        return f"{_g(value)} {unit}{interval}" + ("" if o.valid else f" ({how})")
    if o.not_converged > o.drop:
        return f"invalid: {o.not_converged} of {o.n} not reached"
    return f"none: {o.n} run{'s' if o.n != 1 else ''}, 3 needed"


def _method(ts: TargetScore, sep: str = " (dropped: ", end: str = ")") -> str:
    """How the time was scored: ``the middle run of 3 (dropped: 380 s fastest, 455 s slowest)``, or why
    it is not valid; ``sep``/``end`` frame the dropped runs (the terminal line, already in brackets,
    uses ``"; dropped: "`` and ``""``)."""
    o = ts.wall
    if not o.valid:
        return o.why
    dropped = [f"{_g(v)} s fastest" for v in o.dropped_low] + [f"{_g(v)} s slowest" for v in o.dropped_high]
    dropped += ["the one not reached as the slowest"] if o.not_converged else []
    middle = f"mean of the middle {len(o.kept)} of {o.n} runs" if len(o.kept) > 1 else f"the middle run of {o.n}"
    return (f"{middle}{sep}{', '.join(dropped)}{end}"
            + ("; [lowest, highest] of those" if o.high > o.low else ""))  # as _cell shows a range


#: Runs that did not reach a target named one by one in the scoring's "how" (the first ones; then how many
#: more): a configuration of 2,000 seeds listed every one, 350 KiB of the page at 10,000 runs (issue 53).
NOT_REACHED_NAMED = 5


def _not_reached(ts: TargetScore) -> list[str]:
    """``<run> did not reach it (<s> s, <n> steps)`` / ``<run> failed (...)`` for each run that did not, the
    first :data:`NOT_REACHED_NAMED` of them, then ``and <n> more runs that did not reach it or failed (each
    run's row: the All runs table, report.csv)``."""
    out = []
    missed = ts.not_reached
    for r in missed[:NOT_REACHED_NAMED]:
        at = f" ({_g(r.end_s)} s" + (f", {r.steps} steps)" if r.steps is not None else ")") if r.end_s is not None else ""
        what = "failed" if r.status in ("FAILED", "KILLED") else "did not reach it"
        out.append(f"{r.label} {what}{at}")
    if len(missed) > NOT_REACHED_NAMED:
        more = len(missed) - NOT_REACHED_NAMED
        out.append(f"and {more:,} more run{'s' if more != 1 else ''} that did not reach it or failed (each run's "
                   "row: the All runs table, report.csv)")
    return out


def _how(ts: TargetScore) -> str:
    return "; ".join([_method(ts), *_not_reached(ts)])


#: The columns of :func:`rows`.
COLUMNS = ("configuration", "target", "reached", "time to target from training start [range of the runs kept]",
           "energy to target", "cost to target", "how")


def rows(scores: list[TargetScore]) -> list[list[str]]:
    """One row of :data:`COLUMNS` per configuration and target."""
    out = []
    for ts in scores:
        reached = sum(r.reached for r in ts.runs)
        out.append([ts.config.label, ts.target, f"{reached} of {len(ts.runs)}",
                    _cell(ts, "wall_s", "s"), _cell(ts, "kwh", "kWh"), _cell(ts, "usd", "USD"), _how(ts)])
    return out


def text_lines(scores: list[TargetScore]) -> list[str]:
    """The scores as lines for a terminal: one per configuration and target, then the rule.

    ``<configuration>: to <target>: <k> of <n> runs reached it; time from training start <s> s (<how it
    was scored>); energy <kWh>; cost <USD>; <run> did not reach it (...)``: the scoring beside the time
    it explains (a trial found it after energy and cost, in brackets within brackets), and "from training
    start" because the time excludes set-up, as MLPerf's does (the run's wall beside it includes it).
    """
    if not scores:
        return []
    out = []
    for ts, row in zip(scores, rows(scores)):
        name, target, reached, wall, kwh, usd, _ = row
        # where the score is invalid its cell says why ('invalid: 2 of 3 not reached'), the rule below it
        method = _method(ts, "; dropped: ", "") if ts.wall.valid else ""
        line = (f"{name}: to {target}: {reached} runs reached it; time from training start {wall or '-'}"
                + (f" ({method})" if method else "") + f"; energy {kwh or '-'}; cost {usd or '-'}")
        out.append("; ".join([line, *_not_reached(ts)]))
    return out + [RULE_NOTE]


def markdown(scores: list[TargetScore]) -> list[str]:
    """The Markdown section ``## Time to target (MLPerf scoring)``; [] without targets."""
    if not scores:
        return []
    esc = lambda s: s.replace("|", "\\|")  # noqa: E731
    out = ["## Time to target (MLPerf scoring)", "", RULE_NOTE + ".", "", "| " + " | ".join(COLUMNS) + " |",
           "|" + " --- |" * len(COLUMNS)]
    out += ["| " + " | ".join(esc(c) for c in row) + " |" for row in rows(scores)]
    return out + [""]


def html_section(scores: list[TargetScore]) -> str:
    """The HTML section (table ``#ttq``) for the efficiency page and report.html; "" without targets."""
    if not scores:
        return ""
    e = html.escape
    out = ["<h2>Time to target (MLPerf scoring)</h2>",
           "<table id='ttq'><thead><tr>" + "".join(f"<th class='t'>{e(c)}</th>" for c in COLUMNS) + "</tr></thead><tbody>"]
    out += ["<tr>" + "".join(f"<td class='{'t' if i in (0, 1, 6) else ''}'>{e(c)}</td>" for i, c in enumerate(row))
            + "</tr>" for row in rows(scores)]
    out += ["</tbody></table>", f"<p class='note'>{e(RULE_NOTE)}.</p>"]
    return "\n".join(out)
