"""The run's closing report on the terminal, the same on every path (:func:`report_lines`): the closing
line (what it trained, how fast: steady tokens/s with its interval, MFU, and which run holds it), its
stability verdict (``llmeff: stable`` or ``llmeff: unstable: <why>``), what was assumed for the user,
and where to open the run.

``llmeff train`` prints them on its stdout (loop.py, with the job's reliability line after a restart);
a monitor in anyone else's loop (``autolog()``, an explicit
:class:`~mlflow_llmeff.monitor.meter.EfficiencyMonitor`) prints them once, on the main rank, on stderr,
when it finishes (:func:`print_closing_line`): a user's stdout is their own program's.
``autolog(silent=True)`` silences them. Printing never raises into training.
"""

from __future__ import annotations

import sys

from mlflow_llmeff import names

__all__ = ["closing_line", "report_lines", "run_identity", "print_closing_line", "AUTOLOG_INTEGRATIONS"]

#: ``llmeff.autolog.integration`` values of a monitor that ``mlflow_llmeff.autolog()`` created
AUTOLOG_INTEGRATIONS = ("trainer", "accelerate", "pytorch")
#: the name ``autolog()`` is registered under with MLflow (``autologging/hooks.py``, ``INTEGRATION``)
_AUTOLOG_NAME = "mlflow_llmeff"


#: the closing line's words for a badput category (names.BADPUT_CATEGORIES; docs/time.md)
_LOSS_WORDS = {"init": "set-up before the first step", "warmup": "warm-up", "compile": "compilation",
               "data_wait": "waiting for data", "eval": "evals", "checkpoint_save": "checkpoint saves",
               "checkpoint_load": "checkpoint loads", "lost_progress": "work redone after a failure",
               "other": "time outside steps", "down": "down time between attempts"}
#: the largest badput is named beside goodput when it is at least this share of the wall time
_LOSS_SHARE = 0.10


def closing_line(summary: dict[str, float], *, run_id: str | None, run_name: str | None = None,
                 absent: dict[str, str] | None = None) -> str:
    """``llmeff: run <name> (<id>): <steps> steps, <tokens> tokens, <tokens/s> tokens/s steady state [95%
    interval <low>-<high>], MFU <x>% [95% interval <low>-<high>%], wall <s> s, goodput <fraction> (counted, not
    sampled: no interval; largest loss: <what>, <s> s)``.

    A figure the summary does not hold says why (``absent``: ``llmeff.summary.absent``'s ``{key: why}``):
    no steady tokens/s, or no interval around it. MFU is against the datasheet peak, else against the
    measured matmul peak (said so), else left out; its interval is the tokens/s one scaled to it, or
    the same reason for none. Goodput is a count of this run's own time, so it has no interval and
    says so (a trial asked why MFU and goodput stood without one beside tokens/s). The largest
    ``summary/badput_*_s`` is named beside goodput when it is at least 10% of the wall time (a trial
    read "goodput 0.25" of a 50-step run as three quarters of training wasted: 9.9 s of its 13.9 s
    were set-up).

    Args:
        summary: the run's ``summary/*`` metrics (:meth:`EfficiencyMonitor.finish`).
        run_id: the MLflow run id (or ``local-...``).
        run_name: the run's name, when known.
        absent: why a ``summary/*`` figure is undefined, by key.
    """
    absent = absent or {}
    who = f"{run_name} ({run_id})" if run_name else f"{run_id}"
    parts = [f"{int(summary.get(names.SUM_STEPS, 0))} steps", f"{int(summary.get(names.SUM_TOKENS, 0)):,} tokens"]
    tps = summary.get(names.SUM_TOKENS_PER_SEC)
    # the steady tokens/s interval, or why it has none: read once, for tokens/s and for MFU scaled from it
    low, high = summary.get(names.SUM_TPS_CI95_LOW), summary.get(names.SUM_TPS_CI95_HIGH)
    has_interval = low is not None and high is not None
    why_none = absent.get(names.SUM_TPS_CI95_LOW)
    no_interval = f" [no 95% interval: {why_none}]" if why_none else ""
    if tps is None:
        why = absent.get(names.SUM_TOKENS_PER_SEC)
        parts.append("no steady-state tokens/s" + (f" ({why})" if why else ""))
    else:
        interval = f" [95% interval {low:,.0f}-{high:,.0f}]" if has_interval else no_interval
        parts.append(f"{tps:,.0f} tokens/s steady state{interval}")
    mfu, of = summary.get(names.SUM_MFU), ""
    if mfu is None and summary.get(names.SUM_MFU_MEASURED_PEAK) is not None:
        mfu, of = summary[names.SUM_MFU_MEASURED_PEAK], " of the measured matmul peak"
    if mfu is not None:
        scale = (low / tps, high / tps) if has_interval and tps else None
        value, interval = _mfu_with_interval(mfu, scale, no_interval)
        parts.append(f"MFU {value}{of}{interval}")
    parts.append(f"wall {summary.get(names.SUM_WALL_S, 0.0):.1f} s")
    goodput = summary.get(names.SUM_GOODPUT)
    if goodput is not None:
        wall = summary.get(names.SUM_WALL_S) or 0.0
        losses = [(summary.get(names.SUM_BADPUT[c]) or 0.0, c) for c in names.BADPUT_CATEGORIES]
        lost, what = max(losses)
        worst = f"; largest loss: {_LOSS_WORDS[what]}, {lost:.1f} s" if wall > 0 and lost >= _LOSS_SHARE * wall else ""
        # this run's own time, counted: nothing sampled, so nothing to put an interval around
        parts.append(f"goodput {goodput:.2f} (counted, not sampled: no interval{worst})")
    else:  # why, as llmeff.summary.absent says it (no wall time, or no steady step to measure warm-up against)
        why = absent.get(names.SUM_GOODPUT)
        parts.append("goodput undefined" + (f" ({why})" if why else ""))
    return f"llmeff: run {who}: " + ", ".join(parts)


def _mfu_with_interval(mfu: float, scale: tuple[float, float] | None, no_interval: str) -> tuple[str, str]:
    """``("41.2%", " [95% interval 40.5-42.0%]")``: MFU and the steady tokens/s interval scaled to it
    (``scale``: its low and high over tokens/s; MFU is tokens/s x one FLOPs-per-token of the steady
    window / (devices x peak), monitor/account.py, so the interval scales exactly); without ``scale``,
    tokens/s's ``no_interval`` words (``" [no 95% interval: <why>]"`` or ``""``)."""
    import math

    pct = 100 * mfu
    decimals = max(0, 2 - math.floor(math.log10(abs(pct)))) if pct else 1  # three significant figures
    if scale is None:
        return f"{pct:.{decimals}f}%", no_interval
    lo, hi = pct * scale[0], pct * scale[1]
    return f"{pct:.{decimals}f}%", f" [95% interval {lo:.{decimals}f}-{hi:.{decimals}f}%]"


def run_identity(run_id: str | None) -> tuple[str | None, str | None]:
    """``(run name, experiment id)`` of ``run_id`` read from the tracking server, waiting at most 5 s
    (or the delivery wait, when shorter); ``(None, None)`` when it cannot be read."""
    if not run_id or run_id.startswith("local-"):
        return None, None
    try:
        from mlflow_llmeff.tracking import delivery, store

        return store.run_identity(run_id, min(5.0, delivery.delivery_wait_s()))
    except Exception:  # noqa: BLE001 - a name on the terminal is cosmetic
        return None, None


#: The share of the host's CPU other processes took in the steady window above which an unstable run's
#: closing report says the machine was contended (a quarter: one of 4 cores, half of a 2-core machine's one).
CONTENDED_SHARE = 0.25


def contention_line(summary: dict[str, float], stability: str | None, intra_op_threads: int) -> str | None:
    """``contended: ...`` for an unstable run whose host others took at least :data:`CONTENDED_SHARE` of
    (``summary/host_other_cpu_fraction``), naming this process's intra-op threads (``llmeff.threads``), which
    wait on each other when a core is taken; None otherwise. A fresh user's run at load 11: 415 tokens/s with
    2 threads, 7,347 with one, and the report blamed only the step times' spread."""
    share = summary.get(names.SUM_HOST_OTHER_CPU)
    if not (stability or "").startswith("unstable") or share is None or not share >= CONTENDED_SHARE:
        return None
    threads = (f"; its {intra_op_threads} intra-op threads (llmeff.threads) wait on each other whenever a core is "
               "taken: OMP_NUM_THREADS=1 avoids that on a shared machine (a configuration of its own: compare runs "
               "with the same threads)") if intra_op_threads > 1 else ""
    return (f"contended: other processes took {share:.0%} of the host's CPU in the steady window "
            f"(summary/host_other_cpu_fraction), so the steps waited for CPU; rerun on a quiet machine{threads}")


def report_lines(mon, summary: dict[str, float], reliability: str | None = None) -> list[str]:
    """The closing report of a finished monitor, each line ``llmeff: ...``: :func:`closing_line`, the
    stability verdict (``llmeff.stability``), each target reached or not and its best value
    (:meth:`~mlflow_llmeff.monitor.notes.Reached.line`), what was assumed (``llmeff.assumed``), ``reliability``
    (the job's line, given only after a restart) and where to open the run (when the server holds it).

    The run's name and experiment are read from the tracking server once, bounded
    (:func:`run_identity`); a run waiting in the outbox has neither (its line said how to send it).
    """
    from mlflow_llmeff.monitor.assembly import assumed_line

    name, exp_id = (None, None) if mon.spilled_to else run_identity(mon.run_id)
    lines = [closing_line(summary, run_id=mon.run_id, run_name=name, absent=mon.summary_absent)]
    if mon.stability:
        lines.append(f"llmeff: {mon.stability}")
        import torch

        contended = contention_line(summary, mon.stability, torch.get_num_threads())
        if contended:
            lines.append(f"llmeff: {contended}")
    targets = getattr(mon, "targets_line", None)  # each target's fate (set by finish), not only in llmeff.ttq.* tags
    if targets:
        lines.append(f"llmeff: {targets}")
    told = assumed_line(mon.assumptions())  # not only in a tag: the figures rest on it
    if told:
        lines.append(f"llmeff: {told}")
    if reliability:
        lines.append(f"llmeff: {reliability}")
    if exp_id is not None:
        from mlflow_llmeff.tracking import store
        from mlflow_llmeff.tracking.runs import run_url_line

        lines.append(f"llmeff: {run_url_line(store.tracking_uri(), exp_id, mon.run_id)}")
    return lines


def print_closing_line(mon) -> None:
    """Print :func:`report_lines` of a finished monitor on stderr: main rank only, not for ``llmeff train``
    (it prints its own report), not under ``autolog(silent=True)``. Never raises."""
    try:
        if not (mon.is_main and mon.summary and mon.run_id) or mon.integration == "train":
            return
        if mon.integration in AUTOLOG_INTEGRATIONS and _autolog_silent():
            return
        print("\n".join(report_lines(mon, mon.summary)), file=sys.stderr, flush=True)
    except Exception:  # noqa: BLE001 - a closing report never stops training
        pass


def _autolog_silent() -> bool:
    """``autolog(silent=True)`` was given (MLflow keeps an integration's settings)."""
    from mlflow_llmeff.tracking.store import autolog_setting

    return bool(autolog_setting(_AUTOLOG_NAME, "silent", False))
