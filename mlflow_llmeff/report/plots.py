"""The comparison's figures as PNG bytes (matplotlib, Agg backend: no display needed).

Each ``fig_*`` function returns PNG bytes, or a string saying why the figure is left out (no run
has the figures it needs). Pareto fronts come from :func:`mlflow_llmeff.report.calc.pareto_front`:
front points are labelled and joined, dominated runs are grey.
"""

from __future__ import annotations

import io
from typing import Callable

from .. import names
from .calc import RunRecord, carbon_per_btok, pareto_front

__all__ = ["draw_all", "png", "FIGURES"]

History = Callable[[str, str], list]


def _plt():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def png(fig) -> bytes:
    """The figure as PNG bytes (closed afterwards)."""
    plt = _plt()
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=90)
    plt.close(fig)
    return buf.getvalue()


def _summarised(runs: list[RunRecord]) -> list[RunRecord]:
    return [r for r in runs if r.comparable]


def fig_tokens_per_device(rep, history) -> bytes | str:
    """Bars: steady-state tokens/s per device of each run, coloured by group."""
    runs = [r for r in _summarised(rep.runs) if names.SUM_DEVICE_TOKENS_PER_SEC in r.metrics]
    if not runs:
        return "tokens_per_device.png: no run has summary/device_tokens_per_sec"
    plt = _plt()
    groups = sorted({rep.group_of(r) for r in runs})
    colours = {g: plt.cm.tab10(i % 10) for i, g in enumerate(groups)}
    runs = sorted(runs, key=lambda r: (rep.group_of(r), r.label))
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.bar(range(len(runs)), [r.metrics[names.SUM_DEVICE_TOKENS_PER_SEC] for r in runs],
           color=[colours[rep.group_of(r)] for r in runs])
    ax.set_xticks(range(len(runs)), [r.label for r in runs], rotation=30, ha="right", fontsize=7)
    ax.set_ylabel("tokens/s per device (steady state)")
    ax.set_title("Throughput per device by group")
    from matplotlib.patches import Patch

    ax.legend(handles=[Patch(color=c, label=g) for g, c in colours.items()], fontsize=7)
    return png(fig)


def _pareto(runs, xs, ys, *, xlabel, ylabel, title, maximize_x, maximize_y, sizes=None) -> bytes:
    plt = _plt()
    pts = list(zip(xs, ys))
    front = pareto_front(pts, maximize_x=maximize_x, maximize_y=maximize_y)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    s = sizes or [40] * len(pts)
    dominated = [i for i in range(len(pts)) if i not in front]
    if dominated:
        ax.scatter([xs[i] for i in dominated], [ys[i] for i in dominated], s=[s[i] for i in dominated],
                   color="0.75", label="dominated")
        for i in dominated:
            ax.annotate(runs[i].label, (xs[i], ys[i]), fontsize=6, color="0.55", xytext=(4, -10),
                        textcoords="offset points")
    ax.scatter([xs[i] for i in front], [ys[i] for i in front], s=[s[i] for i in front], color="tab:blue",
               label="Pareto front", zorder=3)
    ax.plot([xs[i] for i in front], [ys[i] for i in front], color="tab:blue", lw=1)
    for i in front:
        ax.annotate(runs[i].label, (xs[i], ys[i]), fontsize=7, xytext=(4, 4), textcoords="offset points")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=7)
    return png(fig)


def fig_pareto_cost(rep, history) -> bytes | str:
    """Pareto front: tokens/s per device (more is better) against USD per 1e9 tokens (less is better)."""
    runs = [r for r in _summarised(rep.runs)
            if names.SUM_DEVICE_TOKENS_PER_SEC in r.metrics and names.SUM_USD_PER_BTOK in r.metrics]
    if not runs:
        return "pareto_cost.png: no run has both summary/device_tokens_per_sec and summary/usd_per_billion_tokens"
    return _pareto(runs, [r.metrics[names.SUM_USD_PER_BTOK] for r in runs],
                   [r.metrics[names.SUM_DEVICE_TOKENS_PER_SEC] for r in runs],
                   xlabel="USD per billion tokens", ylabel="tokens/s per device",
                   title="Throughput against cost", maximize_x=False, maximize_y=True)


def fig_pareto_carbon(rep, history) -> bytes | str:
    """Pareto front: tokens/s per device against kg-CO2e per 1e9 tokens (measured, else codecarbon's estimate)."""
    runs, xs, est = [], [], False
    for r in _summarised(rep.runs):
        kg, is_est = carbon_per_btok(r)
        if kg is not None and names.SUM_DEVICE_TOKENS_PER_SEC in r.metrics:
            runs.append(r)
            xs.append(kg)
            est = est or is_est
    if not runs:
        return "pareto_carbon.png: no run has a kg-CO2e per billion tokens figure (measured or estimate)"
    label = "kg CO2e per billion tokens" + (" (some are codecarbon estimates)" if est else "")
    return _pareto(runs, xs, [r.metrics[names.SUM_DEVICE_TOKENS_PER_SEC] for r in runs], xlabel=label,
                   ylabel="tokens/s per device", title="Throughput against carbon", maximize_x=False,
                   maximize_y=True)


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


def fig_quality_cost(rep, history) -> bytes | str:
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
            return ("quality_cost.png: no run has a ttq/*_usd figure, nor eval/val_loss with summary/cost_usd "
                    "(give targets=, or a device_hour_usd price)")
        xs, ys = [r.metrics[names.SUM_COST_USD] for r in sel], [r.metrics[names.EVAL_VAL_LOSS] for r in sel]
        eval_key, xlabel, ylabel = names.EVAL_VAL_LOSS, "run cost (summary/cost_usd)", "final eval/val_loss"
    higher_better = "loss" not in eval_key and "perplexity" not in eval_key
    mem = [r.metrics.get(names.MEM_MAX_ALLOC) for r in sel]
    top = max((m for m in mem if m), default=0) or 1
    sizes = [30 + 300 * (m or 0) / top for m in mem]
    return _pareto(sel, xs, ys, xlabel=xlabel, ylabel=ylabel + " (marker area: memory per device)",
                   title="Quality against cost", maximize_x=False, maximize_y=higher_better, sizes=sizes)


def fig_loss(rep, history) -> bytes | str:
    """Training loss against tokens and against wall time (s since the run's first logged point)."""
    plt = _plt()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.8))
    drawn = 0
    for r in rep.runs:
        loss = history(r.run_id, names.TRAIN_LOSS)
        if not loss:
            continue
        tokens = dict((s, v) for s, _, v in history(r.run_id, names.TRAIN_TOKENS))
        t0 = loss[0][1]
        pts = [(tokens[s], v) for s, _, v in loss if s in tokens]
        if pts:
            a1.plot(*zip(*pts), marker=".", label=r.label)
        a2.plot([(ts - t0) / 1000 for _, ts, _ in loss], [v for _, _, v in loss], marker=".", label=r.label)
        drawn += 1
    if not drawn:
        plt.close(fig)
        return "loss.png: no run has a train/loss history"
    a1.set_xlabel("tokens")
    a2.set_xlabel("wall time since the first logged loss, s")
    for a in (a1, a2):
        a.set_ylabel("train/loss, nats/token")
    a1.legend(fontsize=6)
    fig.suptitle("Loss against tokens and wall time")
    return png(fig)


def fig_ttq(rep, history) -> bytes | str:
    """Bars: wall seconds to reach each target (``ttq/<target>_wall_s``), one bar per run and target."""
    bars = [(r.label, k[len("ttq/"):-len("_wall_s")], v) for r in _summarised(rep.runs)
            for k, v in sorted(r.metrics.items()) if k.startswith("ttq/") and k.endswith("_wall_s")]
    if not bars:
        return "ttq.png: no run reached a time-to-quality target (ttq/*_wall_s)"
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 0.6 + 0.35 * len(bars)))
    ax.barh(range(len(bars)), [b[2] for b in bars], color="tab:green")
    ax.set_yticks(range(len(bars)), [f"{b[0]}: {b[1]}" for b in bars], fontsize=7)
    ax.set_xlabel("wall seconds to the target")
    ax.set_title("Time to quality")
    return png(fig)


FIGURES = (("tokens_per_device.png", fig_tokens_per_device), ("pareto_cost.png", fig_pareto_cost),
           ("pareto_carbon.png", fig_pareto_carbon), ("quality_cost.png", fig_quality_cost),
           ("loss.png", fig_loss), ("ttq.png", fig_ttq))


def draw_all(rep, history: History) -> tuple[dict[str, bytes], list[str]]:
    """Every figure of :data:`FIGURES`: PNG bytes by name, and a note per figure left out."""
    figs, notes = {}, []
    for name, fn in FIGURES:
        out = fn(rep, history)
        if isinstance(out, bytes):
            figs[name] = out
        else:
            notes.append(out)
    return figs, notes
