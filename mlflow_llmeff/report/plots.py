"""The comparison's figures as PNG bytes (matplotlib, Agg backend: no display needed).

Each ``fig_*`` function returns a matplotlib figure, or a string saying why the figure is left out
(no run has the figures it needs); :func:`draw_all` lays each out (:func:`lay_out`: no text
outside the image) and turns it into PNG bytes. Throughput figures are per configuration (repeats
averaged, 95% intervals drawn: Student's t across repeats, a single run +- the between-run floor of
its kind of machine, :mod:`mlflow_llmeff.report.repeats`); Pareto fronts come from
:func:`mlflow_llmeff.report.repeats.noisy_pareto_front`, so a point beaten only within noise (a
single run within the floor of another) stays on the front; points beaten beyond noise are grey.
"""

from __future__ import annotations

import io
from typing import Callable

from mlflow_llmeff import names
from mlflow_llmeff.report.calc import RunRecord
from mlflow_llmeff.report.repeats import Estimate, noisy_pareto_front, standing_order, versus_best

__all__ = ["draw_all", "png", "png_size", "pyplot", "FIGURES", "DPI", "legend_outside"]

History = Callable[[str, str], list]

#: The interval method in a figure's title (the table's first footnote says it in full).
INTERVALS = "95%: t across repeats; one run: +- its machine's between-run floor"


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend (no display; imported only when a figure is drawn)."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


#: Pixels per inch of every figure's PNG. The layout is computed at this resolution (:func:`lay_out`):
#: laid out at matplotlib's default 100 and saved at 90, the time-to-target chart's label lost its first
#: pixels (tick labels do not shrink in step with the figure).
DPI = 90


def legend_outside(ax, **kwargs):
    """The axes' legend to the right of its plot area, never over a point, bar or line (``loc="best"``
    inside the axes hid a point); :func:`lay_out`'s tight layout makes room for it."""
    return ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0, **kwargs)


def lay_out(fig) -> None:
    """Tight layout at :data:`DPI` (the resolution the PNG is written at), then every annotation that
    would stick out of the figure turned to the other side of its point (labels near the right edge
    point left), so no text is clipped."""
    fig.set_dpi(DPI)
    fig.tight_layout()
    fig.canvas.draw()
    r = fig.canvas.get_renderer()
    width = fig.bbox.width
    for ax in fig.axes:
        for t in ax.texts:
            if not hasattr(t, "xyann"):
                continue
            bb = t.get_window_extent(r)
            dx, dy = t.xyann
            if bb.x1 > width:
                t.set_horizontalalignment("right")
                t.xyann = (-abs(dx), dy)
            elif bb.x0 < 0:
                t.set_horizontalalignment("left")
                t.xyann = (abs(dx), dy)


def clipped_texts(fig) -> list[str]:
    """The drawn texts of a laid-out figure whose box is not inside the image (empty when none is).

    Tick labels count only for ticks inside the view (matplotlib keeps label objects for ticks
    outside it that it never draws).
    """
    from matplotlib.text import Text

    fig.canvas.draw()
    r = fig.canvas.get_renderer()
    w, h = fig.bbox.width, fig.bbox.height
    texts: list[Text] = [t for t in fig.texts]
    for ax in fig.axes:
        texts += [ax.title, ax._left_title, ax._right_title, ax.xaxis.label, ax.yaxis.label, *ax.texts]
        legend = ax.get_legend()
        if legend is not None:
            texts += legend.get_texts()
        for axis in (ax.xaxis, ax.yaxis):
            for tick in axis._update_ticks():  # the ticks inside the view: the ones drawn
                texts += [tick.label1, tick.label2]
    if fig._suptitle is not None:
        texts.append(fig._suptitle)
    out = []
    for t in texts:
        if not t.get_visible() or not t.get_text().strip():
            continue
        bb = t.get_window_extent(r)
        if bb.x0 < -1 or bb.y0 < -1 or bb.x1 > w + 1 or bb.y1 > h + 1:
            out.append(t.get_text())
    return out


def png_size(data: bytes) -> tuple[int, int] | None:
    """``(width, height)`` in pixels of PNG ``data`` (its IHDR header), None for bytes that are not a PNG."""
    if len(data) < 24 or data[:8] != b"\x89PNG\r\n\x1a\n":
        return None
    import struct

    return struct.unpack(">II", data[16:24])


def png(fig) -> bytes:
    """The figure laid out (:func:`lay_out`) as PNG bytes (closed afterwards)."""
    plt = pyplot()
    buf = io.BytesIO()
    lay_out(fig)
    fig.savefig(buf, format="png", dpi=DPI)
    plt.close(fig)
    return buf.getvalue()


def short(label: str, n: int = 40) -> str:
    """``label`` in at most ``n`` characters for a figure (the table keeps full names): whole when it
    fits, else its first parts and its last two (``-`` ``_`` ``/`` or space end a part) joined by ``…``,
    so the cut falls between parts and a repeat's suffix stays:
    ``tiny-single-fp32-gbt512-s128-cpu-2`` in 32 is ``tiny-single-fp32-gbt512-…cpu-2`` (before:
    ``tiny-single-fp32-gbt512-s128-cp…``, the repeats of one configuration alike). A label without
    parts short enough is cut at ``n - 1`` characters and marked."""
    import re

    if len(label) <= n:
        return label
    parts = re.split(r"(?<=[-_/ ])", label)
    tail = "".join(parts[-2:]) if len(parts) > 2 else ""
    head, room = "", n - 1 - len(tail)
    for p in parts[:-2]:
        if len(head) + len(p) > room:
            break
        head += p
    if not tail or not head:
        return label[: n - 1] + "\u2026"
    return f"{head}\u2026{tail}"


def _summarised(runs: list[RunRecord]) -> list[RunRecord]:
    return [r for r in runs if r.comparable]


def fig_tokens_per_device(rep, history):
    """Bars: tokens/s per device of each configuration (mean over its repeats) with its 95% interval,
    coloured by group; a bar within noise of the best is hatched (no ranking among those)."""
    configs = [c for c in rep.configs if c.estimate(names.SUM_DEVICE_TOKENS_PER_SEC) is not None]
    if not configs:
        return "tokens_per_device.png: no run has summary/device_tokens_per_sec"
    plt = pyplot()
    groups = sorted({rep.group_of(c.runs[0]) for c in configs})
    colours = {g: plt.cm.tab10(i % 10) for i, g in enumerate(groups)}
    configs = sorted(configs, key=lambda c: (rep.group_of(c.runs[0]), c.label))
    est = [c.estimate(names.SUM_DEVICE_TOKENS_PER_SEC) for c in configs]
    standing = versus_best(configs, names.SUM_DEVICE_TOKENS_PER_SEC)
    fig, ax = plt.subplots(figsize=(8, 4))
    err = [[e.mean - e.low if e.has_interval else 0 for e in est], [e.high - e.mean if e.has_interval else 0 for e in est]]
    bars = ax.bar(range(len(configs)), [e.mean for e in est], color=[colours[rep.group_of(c.runs[0])] for c in configs],
                  yerr=err, capsize=4, ecolor="0.2")
    for i, b in enumerate(bars):
        if standing_order(standing.get(i, "")) == 1 or not est[i].has_interval:
            b.set_hatch("//")
    ax.set_xticks(range(len(configs)), [short(c.label, 32) for c in configs], rotation=30, ha="right", fontsize=7)
    ax.set_ylabel("tokens/s per device (steady state)")
    ax.set_title(f"Throughput per device ({INTERVALS})\nhatched: within noise of the best, or no interval", fontsize=9)
    from matplotlib.patches import Patch

    legend_outside(ax, handles=[Patch(color=c, label=g) for g, c in colours.items()], fontsize=7)
    return fig


#: Marker areas (points^2) of :func:`marker_sizes`: the smallest memory figure and the largest.
MARKER_AREA_MIN, MARKER_AREA_MAX = 30.0, 330.0


def marker_sizes(memory_gib: list) -> tuple[list[float], list[bool]]:
    """Marker areas in proportion to each run's peak memory per device, and which runs have none.

    Args:
        memory_gib: per run, peak memory per device in GiB, or None where the run has no memory figure.

    Returns:
        ``(areas, hollow)``: areas in points^2, :data:`MARKER_AREA_MIN` + (:data:`MARKER_AREA_MAX` -
        :data:`MARKER_AREA_MIN`) x memory / the largest memory; a run without a figure gets the middle
        area and ``hollow`` True (drawn as an outline: an unknown memory is not the smallest one).
    """
    known = [m for m in memory_gib if m is not None]
    top = max(known, default=0.0) or 1.0
    mid = (MARKER_AREA_MIN + MARKER_AREA_MAX) / 2
    areas = [mid if m is None else MARKER_AREA_MIN + (MARKER_AREA_MAX - MARKER_AREA_MIN) * m / top for m in memory_gib]
    return areas, [m is None for m in memory_gib]


def _pareto(configs, xs, ys, *, xlabel, ylabel, title, maximize_x, maximize_y, sizes=None, hollow=None):
    """Configurations as points with their 95% intervals; the front is :func:`noisy_pareto_front`
    (never beaten within noise), so a point worse only within noise is drawn on it: a single run is
    beaten only beyond the between-run floor, and never where its kind of machine has none measured.
    ``sizes``: marker areas; ``hollow``: points drawn as outlines (their size figure is unknown)."""
    plt = pyplot()
    front = noisy_pareto_front(list(zip(xs, ys)), maximize_x=maximize_x, maximize_y=maximize_y)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    s = sizes or [40] * len(xs)
    hollow = hollow or [False] * len(xs)

    def err(es):
        return [[e.mean - e.low if e.has_interval else 0 for e in es], [e.high - e.mean if e.has_interval else 0 for e in es]]

    dominated = [i for i in range(len(xs)) if i not in front]
    for idx, colour, label in ((dominated, "0.7", "dominated beyond noise"), (front, "tab:blue", "front (within noise)")):
        if not idx:
            continue
        ax.errorbar([xs[i].mean for i in idx], [ys[i].mean for i in idx], xerr=err([xs[i] for i in idx]),
                    yerr=err([ys[i] for i in idx]), fmt="none", ecolor=colour, lw=1, zorder=2)
        ax.scatter([xs[i].mean for i in idx], [ys[i].mean for i in idx], s=[s[i] for i in idx],
                   facecolors=["none" if hollow[i] else colour for i in idx], edgecolors=colour,
                   label=label, zorder=3)
        lo, hi = min(x.mean for x in xs), max(x.mean for x in xs)
        for i in idx:
            right = hi > lo and xs[i].mean > (lo + hi) / 2  # labels of the right half end at their point
            ax.annotate(short(configs[i].label, 32), (xs[i].mean, ys[i].mean), fontsize=7 if colour != "0.7" else 6,
                        color="black" if colour != "0.7" else "0.5", xytext=(-4 if right else 4, 4),
                        textcoords="offset points", ha="right" if right else "left")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(f"{title}\n({INTERVALS})", fontsize=9)
    legend_outside(ax, fontsize=7)
    return fig


def _pairs(rep, x_of) -> tuple[list, list, list]:
    """Configurations with a tokens/s-per-device estimate and an x estimate from ``x_of(config)``."""
    out = []
    for c in rep.configs:
        y = c.estimate(names.SUM_DEVICE_TOKENS_PER_SEC)
        x = x_of(c)
        if x is not None and y is not None:
            out.append((c, x, y))
    return [p[0] for p in out], [p[1] for p in out], [p[2] for p in out]


def fig_pareto_cost(rep, history):
    """Pareto front: tokens/s per device (more is better) against USD per 1e9 tokens (less is better)."""
    configs, xs, ys = _pairs(rep, lambda c: c.estimate(names.SUM_USD_PER_BTOK))
    if not configs:
        return "pareto_cost.png: no run has both summary/device_tokens_per_sec and summary/usd_per_billion_tokens"
    return _pareto(configs, xs, ys, xlabel="USD per billion tokens", ylabel="tokens/s per device",
                   title="Throughput against cost", maximize_x=False, maximize_y=True)


def fig_pareto_carbon(rep, history):
    """Pareto front: tokens/s per device against kg-CO2e per 1e9 tokens (measured, else codecarbon's estimate)."""
    est = []

    def carbon(c):
        for key in (names.SUM_KG_CO2E_PER_BTOK, names.SUM_ESTIMATE_KG_CO2E_PER_BTOK):
            e = c.estimate(key)
            if e is not None:
                est.append(key == names.SUM_ESTIMATE_KG_CO2E_PER_BTOK)
                return e
        return None

    configs, xs, ys = _pairs(rep, carbon)
    if not configs:
        return "pareto_carbon.png: no run has a kg-CO2e per billion tokens figure (measured or estimate)"
    label = "kg CO2e per billion tokens" + (" (some are codecarbon estimates)" if any(est) else "")
    return _pareto(configs, xs, ys, xlabel=label, ylabel="tokens/s per device", title="Throughput against carbon",
                   maximize_x=False, maximize_y=True)


#: One run's peak process RSS (CPU: no allocator statistics) is taken as +-5%: the interpreter's and
#: libraries' pages move it by a few percent between launches, and a 4 MiB difference between two
#: 640 MiB workers (a trial: ddp vs fsdp of a 3.2M-parameter model) is not a ranking.
RSS_BAND = 0.05


def _memory(c) -> Estimate | None:
    """Peak memory per device of a configuration (``memory/device/max_allocated_gib``, the max over
    its devices): the t interval across repeats; one run's allocator peak as a point (read, not
    sampled: any difference counts); one run's process RSS (CPU) within :data:`RSS_BAND`."""
    e = c.estimate(names.MEM_MAX_ALLOC)
    if e is None or e.has_interval:
        return e
    if "RSS" in (c.tag(names.MEMORY_SOURCE) or ""):
        return Estimate(e.mean, e.mean * (1 - RSS_BAND), e.mean * (1 + RSS_BAND), e.n, "process RSS +-5%")
    return Estimate(e.mean, e.mean, e.mean, e.n, "measured peak")


def fig_pareto_memory(rep, history):
    """Pareto front: tokens/s per device (more is better) against peak memory per device (less is
    better): what a sharded strategy buys in memory and costs in throughput (docs/parallelism.md)."""
    configs, xs, ys = _pairs(rep, _memory)
    if not configs:
        return "pareto_memory.png: no run has both summary/device_tokens_per_sec and memory/device/max_allocated_gib"
    cpu = any(c.tag(names.MEMORY_SOURCE) and "RSS" in c.tag(names.MEMORY_SOURCE) for c in configs)
    label = "peak memory per device, GiB" + (" (CPU: process RSS)" if cpu else "")
    return _pareto(configs, xs, ys, xlabel=label, ylabel="tokens/s per device", title="Throughput against memory",
                   maximize_x=False, maximize_y=True)


def _quality_pairs(r: RunRecord) -> list[tuple[str, str, float, float]]:
    """``(eval key, ttq key, quality, usd)`` for each reached target of the run with a cost figure."""
    out = []
    for k, usd in r.metrics.items():
        if not (k.startswith("ttq/") and k.endswith("_usd")):
            continue
        stem = k[len("ttq/"):-len("_usd")]
        for ek, ev in r.metrics.items():
            base = ek[len("eval/"):].replace("/", "_") if ek.startswith("eval/") else None
            if base and (stem.startswith(base + "_ge_") or stem.startswith(base + "_le_")):
                out.append((ek, k, ev, usd))
    return out


def fig_quality_cost(rep, history):
    """Quality against the cost to reach it: the eval metric of a target against ``ttq/<target>_usd``
    (else final ``eval/val_loss`` against ``summary/cost_usd``); marker area by peak memory per device."""
    runs = _summarised(rep.runs)
    pairs = [(r, p) for r in runs for p in _quality_pairs(r)]
    if pairs:
        eval_key = pairs[0][1][0]
        pairs = [(r, p) for r, p in pairs if p[0] == eval_key]
        sel, xs, ys = [r for r, _ in pairs], [p[3] for _, p in pairs], [p[2] for _, p in pairs]
        xlabel, ylabel = f"USD to reach the target ({pairs[0][1][1]})", eval_key
    else:
        sel = [r for r in runs if names.EVAL_VAL_LOSS in r.metrics and names.SUM_COST_USD in r.metrics]
        if not sel:
            targets = any(k.startswith(names.TTQ_TAG_PREFIX) for r in runs for k in r.tags)
            why = ("the runs have targets but no price: their ttq/*_usd and cost figures need device_hour_usd"
                   if targets else "give targets= and a device_hour_usd price")
            return f"quality_cost.png: no run has a ttq/*_usd figure, nor eval/val_loss with summary/cost_usd ({why})"
        xs, ys = [r.metrics[names.SUM_COST_USD] for r in sel], [r.metrics[names.EVAL_VAL_LOSS] for r in sel]
        eval_key, xlabel, ylabel = names.EVAL_VAL_LOSS, "run cost (summary/cost_usd)", "final eval/val_loss"
    higher_better = "loss" not in eval_key and "perplexity" not in eval_key
    sizes, hollow = marker_sizes([r.metrics.get(names.MEM_MAX_ALLOC) for r in sel])
    xs, ys = ([Estimate(v, None, None, 1, "no interval") for v in vals] for vals in (xs, ys))
    area = "marker area: memory per device" + ("; hollow: no memory figure" if any(hollow) else "")
    return _pareto(sel, xs, ys, xlabel=xlabel, ylabel=f"{ylabel} ({area})", title="Quality against cost",
                   maximize_x=False, maximize_y=higher_better, sizes=sizes, hollow=hollow)


def _one_run_each(rep) -> list:
    """One run per configuration (the one it is named after,
    :attr:`~mlflow_llmeff.report.repeats.Configuration.first`), so curves stay readable with many repeats;
    runs that did not finish with a summary are drawn too (a crashed run's loss is worth seeing)."""
    picked = [c.first for c in rep.configs]
    seen = {r.run_id for c in rep.configs for r in c.runs}
    return picked + [r for r in rep.runs if r.run_id not in seen]


def fig_loss(rep, history):
    """Training loss against tokens and against wall time (s since the run's first logged point), one
    curve per configuration (the run it is named after, ``Configuration.first``) and per run without a
    summary."""
    plt = pyplot()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.8))
    drawn = 0
    for r in _one_run_each(rep):
        loss = history(r.run_id, names.TRAIN_LOSS)
        if not loss:
            continue
        tokens = dict((s, v) for s, _, v in history(r.run_id, names.TRAIN_TOKENS))
        t0 = loss[0][1]
        pts = [(tokens[s], v) for s, _, v in loss if s in tokens]
        if pts:
            a1.plot(*zip(*pts), marker=".", label=short(r.label))
        a2.plot([(ts - t0) / 1000 for _, ts, _ in loss], [v for _, _, v in loss], marker=".", label=short(r.label))
        drawn += 1
    if not drawn:
        plt.close(fig)
        return "loss.png: no run has a train/loss history"
    from matplotlib.ticker import EngFormatter, MaxNLocator

    a1.set_xlabel("tokens")
    a1.xaxis.set_major_formatter(EngFormatter(sep=""))  # 40k, 1.2M: tick labels that do not run together
    a2.set_xlabel("wall time since the first logged loss, s")
    for a in (a1, a2):
        a.set_ylabel("train/loss, nats/token")
        a.xaxis.set_major_locator(MaxNLocator(5))
    legend_outside(a2, handles=a1.get_legend_handles_labels()[0], labels=a1.get_legend_handles_labels()[1], fontsize=6)
    fig.suptitle("Loss against tokens and wall time")
    return fig


def fig_ttq(rep, history):
    """Bars: wall seconds to reach each target, one bar per configuration and target: the MLPerf
    olympic mean of its runs with the range of the runs averaged (:mod:`mlflow_llmeff.report.mlperf`:
    fastest and slowest dropped, a run that did not reach the target counted as the slowest; one or two
    runs that all reached it: their mean), never a mean over only the runs that reached it. A
    configuration without a result is named in the note."""
    bars, left = [], []
    for ts in getattr(rep, "targets", []):
        shown = ts.figure("wall_s")  # one or two runs that all reached it: their mean, said in the table
        if shown is not None:
            bars.append((ts.config.label, ts.target, *shown[:3]))
        else:
            left.append(f"{short(ts.config.label, 40)} to {ts.target}: {ts.wall.why}")
    if not bars:
        why = "; ".join(left) if left else "no run was given a time-to-quality target (targets=)"
        return f"ttq.png: no configuration has an MLPerf-scored time to a target ({why})"
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, max(2.6, 0.9 + 0.35 * len(bars))))
    y = range(len(bars))
    ax.barh(y, [b[2] for b in bars], color="tab:green",
            xerr=[[b[2] - b[3] for b in bars], [b[4] - b[2] for b in bars]], capsize=3)
    ax.set_yticks(y, [f"{short(b[0], 28)}: {short(b[1], 24)}" for b in bars], fontsize=7)
    ax.set_xlabel("wall s to the target: olympic mean (bar: runs averaged)", fontsize=8)
    ax.set_title("Time to target, MLPerf-scored" + (f" ({len(left)} without a result)" if left else ""), fontsize=9)
    return fig


FIGURES = (("tokens_per_device.png", fig_tokens_per_device), ("pareto_cost.png", fig_pareto_cost),
           ("pareto_carbon.png", fig_pareto_carbon), ("pareto_memory.png", fig_pareto_memory),
           ("quality_cost.png", fig_quality_cost),
           ("loss.png", fig_loss), ("ttq.png", fig_ttq))


def draw_all(rep, history: History) -> tuple[dict[str, bytes], list[str]]:
    """Every figure of :data:`FIGURES`: PNG bytes by name, and a note per figure left out."""
    figs, notes = {}, []
    for name, fn in FIGURES:
        out = fn(rep, history)
        if isinstance(out, str):
            notes.append(out)
        else:
            figs[name] = png(out)
    return figs, notes
