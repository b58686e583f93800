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
import os
from dataclasses import dataclass, field

from .. import names
from .calc import (CONDITION_TAGS, Incomparability, RunRecord, comparability_warnings, differing_tags, header,
                   metric_columns, round_sig)
from .repeats import Configuration, ScalingRow, configurations, scaling_efficiency, versus_best
from .source import Selection, metric_history, ui_run_url

__all__ = ["Report", "parse_group_by", "build_report", "write_report", "to_markdown", "to_csv", "to_html",
           "scaling_lines", "configuration_rows", "DEFAULT_GROUP_BY"]

DEFAULT_GROUP_BY = "accelerator.name,parallelism.strategy,precision"
_TAG_KEYS = {d.key for d in names.TAGS}


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

    @property
    def runs(self) -> list[RunRecord]:
        return self.selection.runs

    def group_of(self, r: RunRecord) -> str:
        """The run's group label: its values of ``group_by`` joined by ``/``."""
        return " / ".join(r.tags.get(k, "?") for k in self.group_by)

    def row_note(self, r: RunRecord) -> str:
        """Why a row needs care: no summary figures (status and ``llmeff.error``), else the
        conditions that make it not comparable with the other rows (empty when none)."""
        if r.comparable:
            diffs = [f"{w.what} = {v}" for w in self.warnings for v, labels in w.values.items() if r.label in labels]
            notes = ["not comparable: " + "; ".join(diffs)] if diffs else []
            stability = r.tags.get(names.STABILITY)
            if stability and stability != "stable":
                notes.append(stability)
            return "; ".join(notes)
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
    tag_cols = [k for k in differing_tags(runs) if k not in keys]
    rep = Report(selection, keys, metric_columns(runs), tag_cols, comparability_warnings(runs),
                 scaling_efficiency(runs, baseline), configurations(runs), ui_base=ui_base)
    if plots:
        from . import plots as pl

        rep.figures, rep.notes = pl.draw_all(rep, lambda run_id, key: metric_history(client, run_id, key))
    return rep


# ---------------------------------------------------------------------------------------------- text
def _fmt(v) -> str:
    if v is None:
        return ""
    r = round_sig(float(v), 4)
    return f"{r:g}" if abs(r) < 1e15 else f"{r:.4g}"


def table_rows(rep: Report) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the table (strings; one row per run, numbers to 4 significant digits)."""
    head = ["run", "status", "group"] + rep.tag_columns + [header(k) for k in rep.columns] + ["note"]
    rows = []
    for r in rep.runs:
        rows.append([r.label, r.status, rep.group_of(r)] + [r.tags.get(k, "") for k in rep.tag_columns]
                    + [_fmt(r.metrics.get(k)) for k in rep.columns] + [rep.row_note(r)])
    return head, rows


def scaling_lines(rep: Report) -> list[str]:
    """One line per scaling row: efficiency to 3 significant digits with its 95% interval, the
    baseline configuration, and a flag naming what could explain a value above 1.05."""
    out = []
    for s in rep.scaling:
        interval = f" [{s.low:.3g}, {s.high:.3g}]" if s.low is not None else " (no interval)"
        line = (f"{s.group}: {s.name} ({s.devices} devices) vs baseline {s.baseline_name} "
                f"({s.baseline_devices}): {s.kind} scaling efficiency {s.efficiency:.3g}{interval} "
                f"({s.tokens_per_sec.mean:.4g} vs {s.baseline_tokens_per_sec.mean:.4g} tokens/s)")
        if s.flags:
            line += " FLAGGED above 1.05: " + "; ".join(s.flags)
        out.append(line)
    return out


def configuration_rows(rep: Report) -> tuple[list[str], list[list[str]]]:
    """One row per configuration: repeats, tokens/s per device with its 95% interval, how it stands
    against the best (never ranked within noise), and what to know about its repeats."""
    head = ["configuration", "group", "repeats (stable)", "tokens/s per device [95% interval]", "vs best", "note"]
    standing = versus_best(rep.configs, names.SUM_DEVICE_TOKENS_PER_SEC)
    rows = []
    for i, c in enumerate(rep.configs):
        est = c.estimate(names.SUM_DEVICE_TOKENS_PER_SEC)
        rows.append([c.label, rep.group_of(c.runs[0]), f"{len(c.runs)} ({len(c.stable)})",
                     est.text(_fmt) if est else "", standing.get(i, ""), c.note()])
    return head, rows


def _md_cell(s: str) -> str:
    return s.replace("|", "\\|").replace("\n", " ")


def to_markdown(rep: Report) -> str:
    """The report as Markdown: warnings, the table (run names link to the MLflow UI), scaling, figures."""
    sel = rep.selection
    lines = [f"# Efficiency comparison: {sel.experiment_name}", ""]
    if sel.filter_string:
        lines += [f"Filter: `{sel.filter_string}`", ""]
    lines += [f"> **WARNING** {w.text()}" for w in rep.warnings] + ([""] if rep.warnings else [])
    head, rows = table_rows(rep)
    lines += ["| " + " | ".join(_md_cell(h) for h in head) + " |", "|" + " --- |" * len(head)]
    for r, row in zip(rep.runs, rows):
        cells = [f"[{_md_cell(row[0])}]({rep.url(r)})"] + [_md_cell(c) for c in row[1:]]
        if rep.missing_summary(r):
            cells[0] = f"**{cells[0]} (no summary)**"
        lines.append("| " + " | ".join(cells) + " |")
    chead, crows = configuration_rows(rep)
    lines += ["", "## Configurations (repeats as samples; within noise = intervals overlap, not ranked)", "",
              "| " + " | ".join(chead) + " |", "|" + " --- |" * len(chead)]
    lines += ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in crows]
    lines += ["", "## Scaling efficiency", ""]
    lines += [f"- {s}" for s in scaling_lines(rep)] or ["No runs that differ only in device count."]
    lines += ["", "## Figures", ""]
    lines += [f"![{n}]({n})" for n in rep.figures] + [f"- {n}" for n in rep.notes]
    return "\n".join(lines) + "\n"


def to_csv(rep: Report) -> str:
    """The table as CSV (plus the run id and UI link of each run)."""
    head, rows = table_rows(rep)
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(head + ["run_id", "url"])
    for r, row in zip(rep.runs, rows):
        w.writerow(row + [r.run_id, rep.url(r)])
    return buf.getvalue()


_CSS = """body{font-family:system-ui,sans-serif;margin:1.5em;color:#222}
table{border-collapse:collapse;font-size:13px}th,td{border:1px solid #ccc;padding:3px 6px;text-align:right}
th{background:#f3f3f3;position:sticky;top:0;max-width:9em;min-width:4.5em;white-space:normal;font-size:12px}td:first-child{white-space:nowrap}td:first-child,td:nth-child(2),td:nth-child(3){text-align:left}
tr.nosummary td{background:#fde2e2;color:#700}
tr.notcomparable td:last-child{background:#fff3cd;font-weight:600}.warn{background:#fff3cd;border:2px solid #d39e00;
padding:6px 10px;margin:6px 0;font-weight:600}.figs img{max-width:46%;margin:6px;border:1px solid #ddd}
.note{color:#555}form.filters{margin:8px 0}form.filters input{width:38em}"""


def to_html(rep: Report, *, extra_head: str = "") -> str:
    """The report as one self-contained HTML page (CSS inline, every figure a base64 PNG).

    Args:
        rep: the report.
        extra_head: HTML placed above the warnings (the server page's filter form).
    """
    e = html.escape
    sel = rep.selection
    out = ["<!doctype html><html><head><meta charset='utf-8'>",
           f"<title>llmeff: {e(sel.experiment_name)}</title><style>{_CSS}</style></head><body>",
           f"<h1>Efficiency comparison: {e(sel.experiment_name)}</h1>", extra_head]
    if sel.filter_string:
        out.append(f"<p>Filter: <code>{e(sel.filter_string)}</code></p>")
    out += [f"<div class='warn'>WARNING: {e(w.text())}</div>" for w in rep.warnings]
    head, rows = table_rows(rep)
    def breakable(h: str) -> str:  # headers wrap after '/' and '_' rather than inside words
        return e(h).replace("/", "/<wbr>").replace("_", "_<wbr>").replace(".", ".<wbr>")

    out.append("<table id='runs'><thead><tr>" + "".join(f"<th>{breakable(h)}</th>" for h in head)
               + "</tr></thead><tbody>")
    for r, row in zip(rep.runs, rows):
        cls = " class='nosummary'" if rep.missing_summary(r) else (" class='run notcomparable'" if rep.row_note(r)
                                                                   else " class='run'")
        cells = [f"<a href='{e(rep.url(r))}' target='_top'>{e(row[0])}</a>"] + [e(c) for c in row[1:]]
        out.append(f"<tr{cls} data-run-id='{e(r.run_id)}'>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    out.append("</tbody></table>")
    chead, crows = configuration_rows(rep)
    out.append("<h2>Configurations</h2><p class='note'>Runs with equal condition tags are repeats of one configuration: "
               "mean and 95% interval across repeats (one run: its own interval). Within noise = the intervals "
               "overlap: not ranked.</p><table id='configs'><thead><tr>"
               + "".join(f"<th>{e(h)}</th>" for h in chead) + "</tr></thead><tbody>")
    out += ["<tr>" + "".join(f"<td>{e(c)}</td>" for c in row) + "</tr>" for row in crows]
    out.append("</tbody></table>")
    out.append("<h2>Scaling efficiency</h2>")
    lines = scaling_lines(rep)
    out.append("<ul id='scaling'>" + "".join(f"<li>{e(s)}</li>" for s in lines) + "</ul>" if lines
               else "<p>No runs that differ only in device count.</p>")
    out.append("<h2>Figures</h2><div class='figs'>")
    for name, png in rep.figures.items():
        out.append(f"<img alt='{e(name)}' title='{e(name)}' src='data:image/png;base64,"
                   f"{base64.b64encode(png).decode()}'>")
    out.append("</div>" + "".join(f"<p class='note'>{e(n)}</p>" for n in rep.notes))
    out.append("<p class='note'>Formulas and what is comparable: docs/compare.md of mlflow_llmeff. "
               f"Conditions shown when they differ: {e(', '.join(CONDITION_TAGS))}.</p></body></html>")
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
