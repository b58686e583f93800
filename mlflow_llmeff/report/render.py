"""The comparison report: the table (Markdown, CSV, one self-contained HTML page) and its plots (PNG).

:func:`build_report` reads what the plots need (metric histories) and runs the pure calculators of
:mod:`mlflow_llmeff.report.calc`; :func:`write_report` writes the files. Plots use matplotlib's Agg
backend; the HTML inlines every PNG as base64, so the page opens anywhere (a browser, MLflow's
artifact viewer) without its folder.
"""

from __future__ import annotations

import base64
import csv
import html
import io
import operator
import os
from dataclasses import dataclass, field
from itertools import chain, compress

from mlflow_llmeff import names
from mlflow_llmeff.report.calc import (CONDITION_TAGS, Fleet, Incomparability, Kinds, RunRecord, comparability_warnings,
                   differing_tags, failures_by_cause, fleet_reliability, header, metric_columns, round_sig, split_comparable)
from mlflow_llmeff.report.mlperf import html_section, markdown as targets_markdown, target_scores
from mlflow_llmeff.report.repeats import Configuration, configurations
from mlflow_llmeff.report.scaling import ScalingRow, scaling_efficiency
from mlflow_llmeff.report.source import Selection, metric_history, ui_run_url

__all__ = ["Report", "parse_group_by", "build_report", "write_report", "to_markdown", "to_csv", "to_html",
           "scaling_lines", "headline_text", "best_first", "DEFAULT_GROUP_BY", "Reliability", "reliability",
           "reliability_text", "ordered_runs", "figures_html", "RUNS_SHOWN"]

DEFAULT_GROUP_BY = "accelerator.name,parallelism.strategy,precision"
#: Rows of the efficiency page's "All runs" table (``to_html(max_runs=...)``); the page says how many of
#: how many it shows and links to the rest (report.csv and report.md list every run).
RUNS_SHOWN = 200
_TAG_KEYS = {d.key for d in names.TAGS}
_RUN_ID = operator.attrgetter("run_id")


@dataclass
class Report:
    """A built comparison.

    Attributes:
        selection: the experiment, filter and runs.
        group_by: tag keys the runs are grouped by (full ``llmeff.*`` keys).
        columns: ``summary/*`` and ``ttq/*`` metric keys shown.
        tag_columns: condition tags whose values differ between the runs.
        warnings: reasons the runs are not comparable.
        scaling: scaling efficiency rows (from configuration estimates, with intervals).
        configs: the configurations: runs with equal condition tags are repeats of one.
        figures: PNG bytes by file name (``tokens_per_device.png``, ...), in display order.
        notes: one line per figure left out, saying why.
        ui_base: base address of the MLflow UI for run links (``""`` = relative to the server).
        targets: each configuration's MLPerf-style scores to each target its runs carry
            (:func:`mlflow_llmeff.report.mlperf.target_scores`).
        others: the runs not comparable (marked rows), where :func:`build_report` worked them out (None: not known),
            so the runs table counts those it does not show without a pass over every run.
    """

    selection: Selection
    group_by: list[str]
    columns: list[str]
    tag_columns: list[str]
    warnings: list[Incomparability]
    scaling: list[ScalingRow]
    configs: list[Configuration] = field(default_factory=list)
    figures: dict[str, bytes] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    ui_base: str = ""
    targets: list = field(default_factory=list)
    others: list[RunRecord] | None = field(default=None, repr=False, compare=False)

    @property
    def runs(self) -> list[RunRecord]:
        return self.selection.runs

    def group_of(self, r: RunRecord) -> str:
        """The run's group label: its values of ``group_by`` joined by ``/``."""
        return " / ".join(r.tags.get(k, "?") for k in self.group_by)

    def row_note(self, r: RunRecord) -> str:
        """Why a row needs care: no summary figures (status and ``llmeff.error``), else an unstable
        run's ``llmeff.stability`` (empty when none)."""
        if r.comparable:  # conditions that differ are warned once above the table, not on every row
            stability = r.tags.get(names.STABILITY)
            return stability if stability and stability != "stable" else ""
        why = r.tags.get(names.ERROR)
        if r.has_summary:
            return f"{r.status}: left out of scaling, fronts and plots" + (f" ({why})" if why else "")
        return f"{r.status}: no summary/* metrics" + (f" ({why})" if why else "")

    def missing_summary(self, r: RunRecord) -> bool:
        """True for a marked row: no summary, or a run that did not finish."""
        return not r.comparable

    def url(self, r: RunRecord) -> str:
        return ui_run_url(self.ui_base, r.experiment_id, r.run_id)


def parse_group_by(text: str) -> list[str]:
    """``accelerator.name,precision`` -> ``["llmeff.accelerator.name", "llmeff.precision"]``.

    Raises:
        ValueError: for a name that is not an ``llmeff.*`` tag of ``names.py`` (the message lists them).
    """
    keys = []
    for part in (p.strip() for p in (text or "").split(",")):
        if not part:
            continue
        key = part if part.startswith("llmeff.") else "llmeff." + part
        if key not in _TAG_KEYS:
            known = ", ".join(sorted(k[len("llmeff."):] for k in _TAG_KEYS))
            raise ValueError(f"--group-by {part!r} is not an llmeff tag; use some of: {known}")
        keys.append(key)
    return keys


def build_report(client, selection: Selection, *, group_by: str = DEFAULT_GROUP_BY, baseline: str | None = None,
                 ui_base: str = "", plots: bool = True) -> Report:
    """Compare the runs of ``selection``: columns, warnings, scaling efficiency and (``plots``) figures.

    Args:
        client: ``MlflowClient`` or tracking store, for the metric histories of the loss plots.
        selection: from :func:`mlflow_llmeff.report.source.select_runs`.
        group_by: comma-separated ``llmeff.*`` tag names (with or without the prefix).
        baseline: run id of the scaling baseline (default: fewest devices in each group).
        ui_base: MLflow UI address for run links (``""``: relative, as inside the server).
        plots: draw the figures (needs matplotlib).

    Raises:
        ValueError: bad ``group_by`` or ``baseline`` (one line naming it).
    """
    keys = parse_group_by(group_by)
    runs = selection.runs
    every = Kinds(runs)  # the runs read once with their kinds (RunRecord.alike): every part below takes them
    compared, others = split_comparable(every)
    tag_cols = [k for k in differing_tags(runs, compared=compared) if k not in keys]
    configs = configurations(runs, compared=compared)  # each run's key once: scaling regroups these
    rep = Report(selection, keys, metric_columns(runs, each=every.kinds()), tag_cols,
                 comparability_warnings(runs, compared=compared), scaling_efficiency(runs, baseline, configs),
                 best_first(configs), ui_base=ui_base, others=others.runs)
    rep.targets = target_scores(rep.configs, others.runs)
    if plots:
        from mlflow_llmeff.report import plots as pl

        rep.figures, rep.notes = pl.draw_all(rep, lambda run_id, key: metric_history(client, run_id, key))
    return rep


def best_first(configs: list[Configuration]) -> list[Configuration]:
    """``configs`` by their mean tokens/s per device (``summary/device_tokens_per_sec``), highest
    first, so every report (Markdown, HTML, the page, the terminal) lists the best configuration
    first; equal means and configurations without the figure keep their order, the latter last."""
    est = [(c, c.estimate(names.SUM_DEVICE_TOKENS_PER_SEC)) for c in configs]
    ranked = sorted((x for x in est if x[1] is not None), key=lambda x: -x[1].mean)
    return [c for c, _ in ranked] + [c for c, e in est if e is None]


# ---------------------------------------------------------------------------------------------- text
def _fmt(v) -> str:
    """A figure of the "All runs" table: from 1,000 up, whole with thousands separators (``38,115``, as in
    the configurations' table; 4 significant figures showed ``38110`` beside it, which reads as exact);
    below, 4 significant figures (``0.4123``, ``27.62``); from 1e15, ``1.235e+15``."""
    if v is None:
        return ""
    v = float(v)
    if 1e3 <= abs(v) < 1e15:
        return f"{v:,.0f}"
    return _fmt_csv(v)


def _fmt_csv(v) -> str:
    """A figure of report.csv: 4 significant figures, no separators (a spreadsheet reads it as a number)."""
    if v is None:
        return ""
    r = round_sig(float(v), 4)
    return f"{r:g}" if abs(r) < 1e15 else f"{r:.4g}"


def ordered_runs(rep: Report) -> list[RunRecord]:
    """Every run of ``rep`` in the order the runs tables list them: the best configuration's repeats
    first (configurations as :func:`best_first` ranks them, each one's stable repeats first), then
    the runs in no configuration (unfinished, no summary) in the selection's order (newest first)."""
    out = list(chain.from_iterable(c.used for c in rep.configs))
    rest = rep.runs if rep.others is None else rep.others  # build_report: a run not among others is configured
    seen = set(map(_RUN_ID, out)) if rest else ()  # the rest picked out in C
    return out + list(compress(rest, map(operator.not_, map(seen.__contains__, map(_RUN_ID, rest))))) if rest else out


def table_rows(rep: Report, runs: list[RunRecord] | None = None, fmt=None) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the table (strings; one row per run of ``runs``, default
    :func:`ordered_runs`; numbers as ``fmt`` writes them, default :func:`_fmt`: whole with thousands
    separators from 1,000, else 4 significant digits)."""
    fmt = fmt or _fmt
    head = ["run", "status", "group"] + rep.tag_columns + [header(k) for k in rep.columns] + ["note"]
    rows = []
    for r in (ordered_runs(rep) if runs is None else runs):
        rows.append([r.label, r.status, rep.group_of(r)] + [r.tags.get(k, "") for k in rep.tag_columns]
                    + [fmt(r.metrics.get(k)) for k in rep.columns] + [rep.row_note(r)])
    return head, rows


def scaling_lines(rep: Report) -> list[str]:
    """One line per scaling row: efficiency to 3 significant digits with its 95% interval, the baseline
    configuration, both tokens/s as the tables print them (:func:`_fmt`), a flag for a value above 1.05."""
    out = []
    for s in rep.scaling:
        if s.refused:
            out.append(f"{s.group}: {s.name} ({s.devices} devices) vs baseline {s.baseline_name} "
                       f"({s.baseline_devices}): no scaling efficiency: {s.refused}")
            continue
        if s.low is None:
            interval = " (no interval)"
        else:
            interval = f" [{s.low:.3g}, {s.high:.3g}]" if s.high is not None else f" [{s.low:.3g}, no upper bound]"
        line = (f"{s.group}: {s.name} ({s.devices} devices) vs baseline {s.baseline_name} "
                f"({s.baseline_devices}): {s.kind} scaling efficiency {s.efficiency:.3g}{interval} "
                f"({_fmt(s.tokens_per_sec.mean)} vs {_fmt(s.baseline_tokens_per_sec.mean)} tokens/s)")
        if s.flags:
            line += " FLAGGED above 1.05: " + "; ".join(s.flags)
        out.append(line)
    return out


@dataclass
class Reliability:
    """The report's reliability section: one line for the experiment, then (when a run failed) a
    table per configuration and a table of failures by cause; empty when no run holds the figures.

    Attributes:
        lines: the experiment's line(s) (``[]``: no run holds reliability figures).
        config_head, config_rows: per configuration (only configurations whose runs hold the figures).
        cause_head, cause_rows: failures by cause, most frequent first (``[]`` when no run failed).
    """

    lines: list[str] = field(default_factory=list)
    config_head: list[str] = field(default_factory=list)
    config_rows: list[list[str]] = field(default_factory=list)
    cause_head: list[str] = field(default_factory=list)
    cause_rows: list[list[str]] = field(default_factory=list)


def _s(v: float | None) -> str:
    if v is None:
        return ""
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"


def _known_sum(total: float | None, known: int, count: int) -> str:
    """A sum over the failures whose figure is known: ``43``, ``43 (1 of 2 known)`` or ``unknown``."""
    if total is None:
        return "unknown"
    return _s(total) + ("" if known == count else f" ({known} of {count} known)")


def _mtbf_text(f: Fleet) -> str:
    if f.mtbf_s is None:
        return f"no failure (> {_s(f.low_s)} s, 95% lower bound)" if f.low_s is not None else "no failure"
    return f"{_s(f.mtbf_s)} s [{_s(f.low_s)}, {_s(f.high_s)}]"


def reliability(rep: Report) -> Reliability:
    """The reliability section of ``rep`` (see :class:`Reliability`): fleet MTBF from summed
    operating time and failures (:func:`mlflow_llmeff.report.calc.fleet_reliability`) for the
    experiment (every run holding the figures, unfinished ones included) and per configuration
    (its finished repeats), and failures by cause (:func:`mlflow_llmeff.report.calc.failures_by_cause`)."""
    out = Reliability()
    fleet = fleet_reliability(rep.runs)
    if fleet is None:
        return out
    att = f"{fleet.attempts} attempt{'s' if fleet.attempts != 1 else ''}" if fleet.attempts is not None else "attempts unknown"
    runs = f"{fleet.runs} run{'s' if fleet.runs != 1 else ''}"
    old = f" ({len(fleet.left_out)} older run{'s' if len(fleet.left_out) != 1 else ''} without reliability figures left out)" \
        if fleet.left_out else ""
    if not fleet.failures:
        out.lines.append(f"No run failed: {att} in {runs}, {_s(fleet.operating_s)} s of operation; fleet MTBF "
                         f"> {_s(fleet.low_s)} s (95% lower bound, 2T/chi2(0.975, 2)){old}.")
        return out
    out.lines.append(f"Experiment: {fleet.failures} failure{'s' if fleet.failures != 1 else ''}, {att} in {runs}, "
                     f"{_s(fleet.operating_s)} s of operation; fleet MTBF {_mtbf_text(fleet)} (95% Poisson "
                     f"interval: 2T/chi2(0.975, 2r+2), 2T/chi2(0.025, 2r)){old}.")
    out.config_head = ["configuration", "runs", "attempts", "failures", "operating s", "fleet MTBF [95%]"]
    for c in rep.configs:
        f = fleet_reliability(c.runs)
        if f is None:
            continue
        out.config_rows.append([c.label, str(f.runs), "" if f.attempts is None else str(f.attempts), str(f.failures),
                                _s(f.operating_s), _mtbf_text(f)])
    out.cause_head = ["cause", "failures", "share", "as seen", "steps redone", "down s", "recovery s",
                      "failure cost s"]
    for row in failures_by_cause(rep.runs):
        seen = ", ".join(f"{k} x{n}" for k, n in sorted(row.details.items(), key=lambda kv: (-kv[1], kv[0])))
        out.cause_rows.append([row.cause, str(row.count), f"{row.share:.1%}", seen, str(row.lost_steps),
                               _known_sum(row.down_s, row.down_known, row.count),
                               _known_sum(row.recovery_s, row.recovery_known, row.count),
                               "unknown" if row.cost_s is None else _s(row.cost_s)])
    return out


def reliability_text(rep: Report) -> str:
    """The reliability section as plain text for a terminal ("" when no run holds the figures)."""
    rel = reliability(rep)
    lines = list(rel.lines)
    for head, rows in ((rel.config_head, rel.config_rows), (rel.cause_head, rel.cause_rows)):
        if not rows:
            continue
        table = [head] + rows
        widths = [max(len(r[i]) for r in table) for i in range(len(head))]
        text = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in table]
        text.insert(1, "  ".join("-" * w for w in widths))
        lines += text
    return "\n".join(lines)


def _reliability_md(rep: Report) -> list[str]:
    rel = reliability(rep)
    if not rel.lines:
        return []
    out = ["## Reliability", ""] + rel.lines + [""]
    for title, head, rows in (("Per configuration", rel.config_head, rel.config_rows),
                              ("Failures by cause", rel.cause_head, rel.cause_rows)):
        if rows:
            out += [f"{title}:", "", "| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
            out += ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in rows] + [""]
    return out


def _reliability_html(rep: Report) -> str:
    e = html.escape
    rel = reliability(rep)
    if not rel.lines:
        return ""
    out = ["<h2>Reliability</h2>"] + [f"<p class='note' id='reliability-line'>{e(s)}</p>" for s in rel.lines]
    for ident, head, rows in (("reliability", rel.config_head, rel.config_rows),
                              ("failures-by-cause", rel.cause_head, rel.cause_rows)):
        if not rows:
            continue
        out.append(f"<table id='{ident}'><thead><tr>" + "".join(f"<th class='t'>{e(h)}</th>" for h in head)
                   + "</tr></thead><tbody>")
        out += ["<tr>" + "".join(f"<td class='{'t' if i in (0, 3) else ''}'>{e(c)}</td>" for i, c in enumerate(row))
                + "</tr>" for row in rows]
        out.append("</tbody></table>")
    return "\n".join(out)


def _md_cell(s: str) -> str:
    return s.replace("|", "\\|").replace("\n", " ")


def _md_lead(s: str) -> str:
    """``s`` with a leading list or emphasis marker (``*``, ``+``, ``-``) backslash-escaped, so a Markdown
    list item starting with it keeps the character (CommonMark 0.31, "Backslash escapes")."""
    return "\\" + s if s[:1] in ("*", "+", "-") else s


def _md_code(s: str) -> str:
    """``s`` as a Markdown code span: backticks inside take a longer fence, padded with a space (CommonMark
    0.31, "Code spans": the fence is a run of backticks no run inside equals; one space each side is
    stripped). A filter's ``tags.`llmeff.study.parent```, fenced with one backtick, broke the line."""
    import re

    longest = max((len(m) for m in re.findall(r"`+", s)), default=0)
    if not longest:
        return f"`{s}`"
    fence = "`" * (longest + 1)
    return f"{fence} {s} {fence}"


def to_markdown(rep: Report) -> str:
    """The report as Markdown: warnings, the table (run names link to the MLflow UI), scaling, figures."""
    sel = rep.selection
    lines = [f"# Efficiency comparison: {sel.experiment_name}", "", sel.count_line(), ""]
    if sel.filter_string:
        lines += [f"Filter: {_md_code(sel.filter_string)}", ""]
    h = _headline(rep)
    if h.rows:
        lines += ["## Configurations (repeats as samples; within noise = intervals overlap, not ranked)", "",
                  f"Runs with equal condition tags are repeats of one configuration. {h.footnotes[0]}.", "",
                  "| " + " | ".join(h.columns) + " |", "|" + " --- |" * len(h.columns)]
        lines += ["| " + " | ".join(_md_cell(c.text) for c in row) + " |" for row in h.rows]
        # a note that starts with the cells' marker ('* MFU against ...') keeps it: escaped, not a nested bullet
        lines += [""] + [f"- {_md_lead(n)}" for n in h.footnotes[1:]] + ([""] if h.footnotes[1:] else [])
        lines += targets_markdown(rep.targets)
        lines += _memory_md(rep)
        lines += _network_md(rep)
        lines += ["## All runs", ""]
    lines += [f"> **WARNING** {w.text()}" for w in rep.warnings] + ([""] if rep.warnings else [])
    runs = ordered_runs(rep)
    head, rows = table_rows(rep, runs)
    lines += ["| " + " | ".join(_md_cell(h) for h in head) + " |", "|" + " --- |" * len(head)]
    for r, row in zip(runs, rows):
        cells = [f"[{_md_cell(row[0])}]({rep.url(r)})"] + [_md_cell(c) for c in row[1:]]
        if rep.missing_summary(r):
            cells[0] = f"**{cells[0]} (no summary)**"
        lines.append("| " + " | ".join(cells) + " |")
    lines += [""] + _reliability_md(rep) + ["## Scaling efficiency", ""]  # the section ends in a blank line
    lines += [f"- {s}" for s in scaling_lines(rep)] or ["No runs that differ only in device count."]
    lines += ["", "## Figures", ""]
    lines += [f"![{n}]({n})" for n in rep.figures] + [f"- {n}" for n in rep.notes]
    return "\n".join(lines) + "\n"


def to_csv(rep: Report) -> str:
    """The table as CSV (plus the run id and UI link of each run)."""
    runs = ordered_runs(rep)
    head, rows = table_rows(rep, runs, fmt=_fmt_csv)
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(head + ["run_id", "url"])
    for r, row in zip(runs, rows):
        w.writerow(row + [r.run_id, rep.url(r)])
    return buf.getvalue()


_CSS = """body{font-family:system-ui,sans-serif;margin:12px 20px;color:#222;max-width:1560px}
h1{font-size:20px;margin:4px 0 6px}h2{font-size:16px;margin:14px 0 6px}
table{border-collapse:collapse;font-size:13px}th,td{border:1px solid #ccc;padding:3px 6px;text-align:right}
th{background:#f3f3f3;font-size:12px;white-space:normal}
td.t,th.t{text-align:left}
table.sortable th{cursor:pointer}table.sortable th:after{content:" \\2195";color:#999;font-size:10px}
#headline td{white-space:nowrap}#headline td.q{white-space:normal;max-width:16em;text-align:left;font-size:12px}
#headline td:first-child{max-width:24em;overflow:hidden;text-overflow:ellipsis}
#headline tr.unstable td.s{background:#fff3cd}
.scroll{overflow-x:auto;max-width:100%}
#runs th{max-width:9em;min-width:4.5em}#runs td:first-child{white-space:nowrap}
#runs td:first-child,#runs td:nth-child(2),#runs td:nth-child(3){text-align:left}
tr.nosummary td{background:#fde2e2;color:#700}tr.notcomparable td:last-child{background:#fff3cd;font-weight:600}
.warn{background:#fff3cd;border:2px solid #d39e00;padding:4px 10px;margin:6px 0;font-weight:600;font-size:13px}
.figs{display:flex;flex-wrap:wrap;gap:8px;align-items:flex-start}.figs img{max-width:100%;height:auto;border:1px solid #ddd}
.note{color:#555;font-size:12px;margin:4px 0}form.filters{margin:4px 0;font-size:13px}form.filters input{width:30em}
#chooser{font-size:12px;margin:6px 0}#chooser label{margin-right:10px;white-space:nowrap}
details summary{cursor:pointer;font-weight:600;margin:10px 0 4px}"""

_JS = """document.querySelectorAll('table.sortable th').forEach(function(th,i){th.addEventListener('click',function(){
var tb=th.closest('table').tBodies[0],rows=Array.from(tb.rows),dir=th.dataset.dir==='asc'?'desc':'asc';th.dataset.dir=dir;
rows.sort(function(a,b){var x=a.cells[i].dataset.v,y=b.cells[i].dataset.v;if(x===undefined||x==='')return 1;
if(y===undefined||y==='')return -1;var nx=parseFloat(x),ny=parseFloat(y),c=(isNaN(nx)||isNaN(ny))?x.localeCompare(y):nx-ny;
return dir==='asc'?c:-c});rows.forEach(function(r){tb.appendChild(r)})})});
document.querySelectorAll('#chooser input').forEach(function(cb){cb.addEventListener('change',function(){
var i=+cb.dataset.col;document.querySelectorAll('#runs tr').forEach(function(tr){var c=tr.children[i];
if(c)c.style.display=cb.checked?'':'none'})})});"""


def _headline(rep: Report):
    from mlflow_llmeff.report.headline import headline

    links = [rep.url(c.first) for c in rep.configs]  # the run each label names
    return headline(rep.configs, links)


def headline_text(rep: Report) -> str:
    """The headline table as plain text for a terminal: one line per configuration (best first),
    columns padded to their widest cell, then the footnotes; one line when nothing compares."""
    h = _headline(rep)
    if not h.rows:
        return "No finished run with summary figures to compare."
    return "\n".join(_padded(h) + [f"- {n}" for n in h.footnotes] + _memory_text(rep) + _network_text(rep))


def _padded(h) -> list[str]:
    """A table's header, a rule and its rows as text lines, each column padded to its widest cell."""
    table = [list(h.columns)] + [[c.text for c in row] for row in h.rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(h.columns))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return lines


def _memory(rep: Report):
    from mlflow_llmeff.report.memory import memory_table

    return memory_table(rep.configs)


def _memory_text(rep: Report) -> list[str]:
    """The memory section for the terminal (:func:`mlflow_llmeff.report.memory.memory_table`), [] without one."""
    m = _memory(rep)
    if m is None:
        return []
    return ["", "Memory per device (levers and where the bytes go):"] + _padded(m) + [f"- {n}" for n in m.footnotes]


def _memory_md(rep: Report) -> list[str]:
    m = _memory(rep)
    if m is None:
        return []
    out = ["## Memory per device", "", "| " + " | ".join(m.columns) + " |", "|" + " --- |" * len(m.columns)]
    out += ["| " + " | ".join(_md_cell(c.text) for c in row) + " |" for row in m.rows]
    return out + [""] + [f"- {_md_lead(n)}" for n in m.footnotes] + [""]


def _memory_html(rep: Report) -> str:
    return _section_html("Memory per device", "memory", _memory(rep), text_columns=(0, 1))


def _network(rep: Report):
    from mlflow_llmeff.report.network import network_table

    return network_table(rep.configs)


def _network_text(rep: Report) -> list[str]:
    """The network section for the terminal (:func:`mlflow_llmeff.report.network.network_table`), [] without one."""
    n = _network(rep)
    if n is None:
        return []
    return ["", "Network (collectives, the link they cross, the straggler):"] + _padded(n) + [f"- {x}" for x in n.footnotes]


def _network_md(rep: Report) -> list[str]:
    n = _network(rep)
    if n is None:
        return []
    out = ["## Network", "", "| " + " | ".join(n.columns) + " |", "|" + " --- |" * len(n.columns)]
    out += ["| " + " | ".join(_md_cell(c.text) for c in row) + " |" for row in n.rows]
    return out + [""] + [f"- {_md_lead(x)}" for x in n.footnotes] + [""]


def _network_html(rep: Report) -> str:
    return _section_html("Network", "network", _network(rep), text_columns=(0, 6, 9))


def _section_html(title: str, ident: str, table, text_columns: tuple[int, ...]) -> str:
    """A section table of the page (memory, network): sortable, a cell's title kept, its footnotes below."""
    e = html.escape
    if table is None:
        return ""
    out = [f"<h2>{e(title)}</h2><table id='{ident}' class='sortable'><thead><tr>"
           + "".join(f"<th class='{'t' if i in text_columns else ''}'>{e(c)}</th>" for i, c in enumerate(table.columns))
           + "</tr></thead><tbody>"]
    for row in table.rows:
        cells = []
        for i, c in enumerate(row):
            klass = " class='t'" if i in text_columns else ""
            title_attr = f" title='{e(c.title)}'" if c.title else ""
            cells.append(f"<td{klass} data-v='{'' if c.sort is None else e(str(c.sort))}'{title_attr}>{e(c.text)}</td>")
        out.append("<tr>" + "".join(cells) + "</tr>")
    out.append("</tbody></table>")
    return "\n".join(out + [f"<p class='note'>{e(n)}</p>" for n in table.footnotes])


def _headline_html(rep: Report) -> str:
    e = html.escape
    h = _headline(rep)
    if not h.rows:
        return "<p class='note'>No finished run with summary figures to compare.</p>"
    # text-sorted columns ('t'), the wrapping quality column ('q'), the stability column ('s'), a figure whose
    # interval goes under its value ('w': goodput, so the table still fits the first 1600-px screen)
    klasses = [{"configuration": "t", "layout": "t", "vs best": "t", "quality reached": "q t",
                "stability": "s t", "goodput": "w"}.get(c, "") for c in h.columns]
    out = ["<table id='headline' class='sortable'><thead><tr>"
           + "".join(f"<th class='{'t' if 't' in k.split() else ''}'>{e(c)}</th>" for k, c in zip(klasses, h.columns))
           + "</tr></thead><tbody>"]
    for c, row in zip(h.configs, h.rows):
        cls = " class='unstable'" if c.unstable else ""
        cells = []
        for i, cell in enumerate(row):
            v = "" if cell.sort is None else e(str(cell.sort))
            text = (f"<a href='{e(cell.link)}' target='_top'>{e(cell.text)}</a>" if cell.link else e(cell.text))
            klass = klasses[i]
            if "w" in klass.split():  # '0.60 [0.35, 0.85]' / '0.88 (1 run)': the interval on a line of its own
                text = text.replace(" [", "<br>[", 1).replace(" (", "<br>(", 1)
            title = f" title='{e(cell.title)}'" if cell.title else ""
            cells.append(f"<td class='{klass}' data-v='{v}'{title}>{text}</td>")
        out.append(f"<tr{cls}>" + "".join(cells) + "</tr>")
    out.append("</tbody></table>")
    notes = ["Runs with equal condition tags are repeats of one configuration (the run, not the step, is the "
             "unit of replication). Click a header to sort."] + h.footnotes
    out += [f"<p class='note'>{e(n)}</p>" for n in notes]
    return "\n".join(out)


def _runs_table_html(rep: Report, max_runs: int | None = None, rest_html: str = "") -> str:
    e = html.escape
    every = ordered_runs(rep)
    runs = every if max_runs is None else every[:max_runs]
    head, rows = table_rows(rep, runs)

    def breakable(h: str) -> str:  # headers wrap after '/' and '_' rather than inside words
        return e(h).replace("/", "/<wbr>").replace("_", "_<wbr>").replace(".", ".<wbr>")

    chooser = "".join(f"<label><input type='checkbox' checked data-col='{i}'>{e(h.split(' [')[0])}</label>"
                      for i, h in enumerate(head) if i > 0)
    shown = (f"{len(rows):,} runs" if len(runs) == len(every) else
             f"{len(rows):,} of {len(every):,} runs shown")
    out = [f"<details id='all-runs'><summary>All runs: {shown} x {len(head)} columns (summary figures, "
           "conditions that differ, final evals, time to quality)</summary>"]
    if len(runs) < len(every):  # never a silent cap: how many are left out and where every run is
        hidden = (sum(1 for r in every[len(runs):] if rep.missing_summary(r)) if rep.others is None
                  else len(rep.others) - sum(1 for r in runs if rep.missing_summary(r)))  # the others not shown
        marked = (f"; {hidden:,} of the runs not shown {'is' if hidden == 1 else 'are'} unfinished or without "
                  "summary figures" if hidden else "")
        out.append(f"<p class='warn' id='runs-shown'>{len(rows):,} of {len(every):,} runs shown (the best "
                   f"configuration's repeats first, in report.csv's order){marked}. Every run: "
                   + (rest_html or "report.csv and report.md of <code>llmeff compare</code>") + ".</p>")
    out += [f"<div id='chooser'>Columns: {chooser}</div><div class='scroll'>",
           "<table id='runs'><thead><tr>" + "".join(f"<th>{breakable(h)}</th>" for h in head) + "</tr></thead><tbody>"]
    for r, row in zip(runs, rows):
        cls = " class='nosummary'" if rep.missing_summary(r) else (" class='run notcomparable'" if rep.row_note(r)
                                                                   else " class='run'")
        cells = [f"<a href='{e(rep.url(r))}' target='_top'>{e(row[0])}</a>"] + [e(c) for c in row[1:]]
        out.append(f"<tr{cls} data-run-id='{e(r.run_id)}'>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    out.append("</tbody></table></div></details>")
    return "\n".join(out)


def figures_html(sources: dict[str, str], notes: list[str], sizes: dict[str, tuple[int, int]] | None = None) -> str:
    """The page's figures section: an image per figure (``sources``: name -> its URL or data URI),
    then one line per figure left out (``notes``).

    Each image is shown at its own size, pixel for pixel (a PNG stretched to half the page was blurred):
    ``sizes`` (name -> its PNG's ``(width, height)``, :func:`mlflow_llmeff.report.plots.png_size`) go into
    its ``width``/``height`` attributes, so the page is laid out at the final size before the image
    arrives; an image whose size is not known yet (being drawn) takes its own size when it comes. The
    style only narrows an image on a screen narrower than it (``max-width:100%``)."""
    e = html.escape
    sizes = sizes or {}

    def dims(name: str) -> str:
        got = sizes.get(name)
        return f" width='{got[0]}' height='{got[1]}'" if got else ""

    out = ["<h2>Figures</h2><div class='figs'>"]
    out += [f"<img alt='{e(name)}' title='{e(name)}' src='{e(src)}'{dims(name)}>" for name, src in sources.items()]
    out.append("</div>" + "".join(f"<p class='note'>{e(n)}</p>" for n in notes))
    return "\n".join(out)


def to_html(rep: Report, *, extra_head: str = "", figure_urls: dict[str, str] | None = None,
            max_runs: int | None = None, rest_html: str = "", figures_block: str | None = None) -> str:
    """The report as one HTML page that leads with the answer: the headline table of configurations
    (sortable), the warnings that change it, then every run (one click away, with a column chooser),
    scaling efficiency and the figures.

    Args:
        rep: the report.
        extra_head: HTML placed under the title (the server page's filter form).
        figure_urls: figure name -> URL to load it from (the server page); default: every figure
            inlined as a base64 PNG, so the file opens anywhere without its folder.
        max_runs: rows of the "All runs" table (default: every run); fewer runs shown than there are
            is said on the table ("200 of 10,000 runs shown") with ``rest_html`` (HTML: where every
            run is; default: report.csv and report.md).
        figures_block: HTML put where the figures go instead of :func:`figures_html` (the server page
            fills it on each request).
    """
    e = html.escape
    sel = rep.selection
    out = ["<!doctype html><html><head><meta charset='utf-8'>",
           f"<title>llmeff: {e(sel.experiment_name)}</title><style>{_CSS}</style></head><body>",
           f"<h1>Efficiency comparison: {e(sel.experiment_name)}</h1>", extra_head,
           f"<p class='note' id='run-count'>{e(sel.count_line())}</p>"]
    if sel.filter_string:
        out.append(f"<p class='note'>Filter: <code>{e(sel.filter_string)}</code></p>")
    out.append(_headline_html(rep))
    out.append(html_section(rep.targets))
    out.append(_memory_html(rep))
    out.append(_network_html(rep))
    out += [f"<div class='warn'>WARNING: {e(w.text())}</div>" for w in rep.warnings]
    out.append(_runs_table_html(rep, max_runs, rest_html))
    rel_html = _reliability_html(rep)
    if rel_html:
        out.append(rel_html)
    out.append("<h2>Scaling efficiency</h2>")
    lines = scaling_lines(rep)
    out.append("<ul id='scaling'>" + "".join(f"<li>{e(s)}</li>" for s in lines) + "</ul>" if lines
               else "<p class='note'>No configurations that differ only in device count.</p>")
    if figures_block is None:
        sources = (dict(figure_urls) if figure_urls is not None else
                   {name: "data:image/png;base64," + base64.b64encode(png).decode() for name, png in rep.figures.items()})
        from mlflow_llmeff.report.plots import png_size

        sizes = {name: png_size(png) for name, png in rep.figures.items() if png_size(png)}
        figures_block = figures_html(sources, rep.notes, sizes)
    out.append(figures_block)
    out.append("<p class='note'>Formulas and what is comparable: docs/compare.md and docs/stability.md of "
               f"mlflow_llmeff. Conditions shown when they differ: {e(', '.join(CONDITION_TAGS))}.</p>")
    out.append(f"<script>{_JS}</script></body></html>")
    return "\n".join(out)


def write_report(rep: Report, out_dir: str) -> list[str]:
    """Write ``report.md``, ``report.csv``, ``report.html`` and every figure's PNG into ``out_dir``.

    Returns:
        The written paths.
    """
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for name, text in (("report.md", to_markdown(rep)), ("report.csv", to_csv(rep)), ("report.html", to_html(rep))):
        p = os.path.join(out_dir, name)
        with open(p, "w", encoding="utf-8", newline="") as f:
            f.write(text)
        paths.append(p)
    for name, png in rep.figures.items():
        p = os.path.join(out_dir, name)
        with open(p, "wb") as f:
            f.write(png)
        paths.append(p)
    return paths
