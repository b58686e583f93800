"""The end-of-run summary of a monitor: ``summary/*`` figures, stability, consumption totals, end tags.

:func:`figures` builds every ``summary/*`` figure of the run over all its attempts: tokens, steps,
wall time and its goodput breakdown (:func:`~mlflow_llmeff.calc.goodput.breakdown`), steady-state
throughput, TFLOP/s, MFU and HFU (:class:`~mlflow_llmeff.monitor.account.FlopsAccount`), memory per
parameter, and the consumption totals (energy, carbon, cost). :func:`stability_figures` adds the
dispersion and interval of the steady steps, contention and stragglers (docs/stability.md);
:func:`end_tags` the tags that say where each figure comes from, and :func:`batch_shapes` the padded
shapes of every rank's micro-batches (a shape that varied is tagged ``dynamic`` at the end). These
functions work on the monitor's components (:class:`~mlflow_llmeff.monitor.parts.Parts`, ``p``; what the
end collects is its :class:`~mlflow_llmeff.monitor.notes.Ending`, the undefined figures its
``summary_absent``); with ``collective`` they reduce over ranks (call on every rank).
"""

from __future__ import annotations

import math
import os

from mlflow_llmeff import names
from mlflow_llmeff.calc import stability as st
from mlflow_llmeff.calc.goodput import breakdown, goodput
from mlflow_llmeff.calc.reliability import with_down
from mlflow_llmeff.meters import collectives
from mlflow_llmeff.meters.probes import model_state_bytes
from mlflow_llmeff.monitor import binding, points
from mlflow_llmeff.monitor.assembly import assumed_tag
from mlflow_llmeff.monitor.conditions import unwrap_model
from mlflow_llmeff.monitor.counting import ShapeRange
from mlflow_llmeff.monitor.parts import Parts
from mlflow_llmeff.names import shorten

__all__ = ["conclude", "figures", "stability_figures", "batch_shapes", "headline", "end_tags"]


def conclude(p: Parts, collective: bool) -> dict[str, float]:
    """Account the last steps, close the clock and log ``summary/*`` with the end tags (rank 0); returns
    the summary. With ``collective`` the tail after the last window edge is summed over ranks; without
    it (rank 0 alone) that tail is left out and ``llmeff.autolog.note`` says so."""
    note = None
    step = p.step_count
    if p.window.steps:
        if collective:
            points.edge(p)
        else:
            note = (f"steps {p.meter.step + 1}..{step} after the last window edge are not in the totals: "
                    "the run ended on rank 0 only (call finish on every rank, accelerator.end_training() "
                    "or torch.distributed.destroy_process_group())")
            step = p.meter.step
    seconds = p.ledger.close()  # the wall time ends here; cost and the summary use it
    job_tags = _job_figures(p)
    p.carbon.stop()
    if step > 0 and p.last.step != step:  # counters and totals at the last step, once
        points.log_interval(p, step, collective)
    else:  # each key is logged once per step: the end-of-run totals are the summary's
        points.refresh_consumption(p, collective)
    p.summary_absent.clear()  # summary/* key -> why it is undefined for this run (llmeff.summary.absent)
    out = figures(p, seconds, collective)
    out.update(stability_figures(p, collective))
    shapes = batch_shapes(p, collective)
    if p.is_main:
        # a batch shape that varied: 'dynamic', the ranges over the whole run, the name without gbt/s
        tags = {**end_tags(p, note), **binding.varying_shape(p, shapes), **job_tags}
        refilled = p.tally.refilled
        if refilled:
            tags[names.COUNTING_REFILLED] = (f"{refilled} CPU micro-batches kept for their window's edge had their "
                                             "tensors written in place before it: counted as they then were")
        if (p.ending.status == "FINISHED" and names.SUM_TOKENS_PER_SEC in out
                and "mlflow.note.content" not in p.naming.given_keys):  # a failure keeps its why
            tags["mlflow.note.content"] = headline(p, out)
            if p.job.note:  # what happened across the job's attempts
                tags["mlflow.note.content"] += f"\n\n{p.job.note}"
        p.logger.set_tags(tags)
        p.logger.log_metrics(out, max(step, 0))
        points.warn_mfu(p, out.get(names.SUM_MFU), "summary")
        # against the measured matmul peak too: above 1 says the peak was read low (a busy machine, a stale
        # cache entry, shapes faster than those timed: llmeff peak --refresh), as trials found at 227% and 148%
        # with no word; the figure itself is left out (llmeff.summary.absent says why)
        points.warn_mfu(p, p.account.above_measured_peak(out), "summary/mfu_measured_peak (llmeff peak --refresh "
                                                               "measures the peak again)", "left out")
    return out


def batch_shapes(p: Parts, collective: bool) -> ShapeRange | None:
    """The padded lengths and micro-batch sizes of the run's micro-batches (:attr:`StepTally.shapes
    <mlflow_llmeff.monitor.counting.StepTally.shapes>`), over every rank with ``collective`` (one
    ``max`` all-reduce of the negated minima and the maxima); None when no batch had a shape."""
    mine = p.tally.shapes
    if not collective or p.world_size == 1:
        return mine
    none = -(2 ** 62)  # a rank without a shaped batch: below every negated minimum, and a maximum of 0
    v = collectives.all_reduce([-mine.seq[0], mine.seq[1], -mine.batch[0], mine.batch[1]] if mine else
                               [none, 0, none, 0], "max", dtype="int64")
    lo_t, hi_t, lo_b, hi_b = (int(x) for x in v)
    return ShapeRange(seq=(-lo_t, hi_t), batch=(-lo_b, hi_b)) if hi_t > 0 else None


#: ``llmeff.reliability.why`` of a run without a job ledger: ``llmeff train`` without a checkpoint folder,
#: and every monitor in a user's own loop (it sees one process, not the job's restarts).
NO_JOB_TRAIN = ("no checkpoint_dir: no job ledger, so no summary/attempts, failures, down time or MTBF (a "
                "restart could not resume this run; give --checkpoint-dir)")
NO_JOB_LOOP = ("a monitored loop sees one process, not its job's restarts: no summary/attempts, failures, down "
               "time or MTBF (llmeff train with --checkpoint-dir counts them)")


def _job_figures(p: Parts) -> dict[str, str]:
    """The job's reliability figures at the clock's end (EfficiencyMonitor.set_job_figures): its
    metrics join the summary, its line the description; returns its tags."""
    if not p.is_main:
        return {}
    if not p.job.has_figures:  # absent, and why (never a made-up 'attempts 1')
        return {names.RELIABILITY_WHY: NO_JOB_TRAIN if p.integration == "train" else NO_JOB_LOOP}
    import time

    try:
        metrics, tags = p.job.figures(time.time())  # its description line: p.job.note
    except Exception as e:  # noqa: BLE001 - reliability figures never stop the run's end
        return {names.RELIABILITY_WHY: f"not computed: {type(e).__name__}: {shorten(str(e), 300)}"}
    p.ending.add_figures(metrics)
    return dict(tags)


def figures(p: Parts, seconds: dict[str, float], collective: bool) -> dict[str, float]:
    """Every ``summary/*`` figure of the run (all attempts); ``seconds``: the ledger's closed seconds by category."""
    # a compilation booked inside a step names the warm-up excess compile too (never both words)
    compiled = p.compiled or (p.compiles is not None and p.compiles.seen)
    parts = breakdown(seconds, p.ledger.warmup_steps, p.ledger.steady_steps, compiled=compiled)
    if p.job.down_s:  # the job's down time between attempts: part of its wall time (docs/time.md)
        parts = with_down(parts, p.job.down_s)
    tokens = p.meter.total.tokens
    out: dict[str, float] = {names.SUM_TOKENS: float(tokens), names.SUM_STEPS: float(p.meter.step),
                             names.SUM_WALL_S: parts["wall"], names.SUM_GOODPUT: goodput(parts)}
    if out[names.SUM_GOODPUT] is None:
        _absent(p, names.SUM_GOODPUT, "no wall time (a share of no time is undefined)")
    unknown_excess = None  # the warm-up excess is measured against the steady step time
    if p.ledger.steady_steps == 0 and p.ledger.warmup_steps > 0:
        unknown_excess = "compile" if compiled else "warmup"
        why = (f"no steady-state step (all {p.ledger.warmup_steps} steps were warm-up): the warm-up excess "
               "over steady speed, and so the productive time, is unknown")
        out[names.SUM_GOODPUT] = None
        _absent(p, names.SUM_GOODPUT, why)
        _absent(p, names.SUM_BADPUT[unknown_excess], why)
    for c in names.BADPUT_CATEGORIES:
        if c in parts and c != unknown_excess:
            out[names.SUM_BADPUT[c]] = parts[c]
    if compiled and p.compiles is not None:  # recompilations after the warm-up: compile time, not steps
        out[names.SUM_RECOMPILES] = float(p.compiles.recompiles)
    rates = p.meter.summary()
    tflops = None
    if rates is None or tokens == 0:  # no steady rate: a rate over no time, or of no counted token
        why = ("no token counted (pass batch= or tokens= to step())" if rates is not None else
               f"no steady-state step time (all {p.meter.step} steps were warm-up, or took no time)")
        for key in (names.SUM_TOKENS_PER_SEC, names.SUM_DEVICE_TOKENS_PER_SEC, names.SUM_STEP_TIME_S):
            _absent(p, key, why)
    if rates is not None and tokens == 0:
        points.note_nothing_counted(p)
        rates = None
    if rates is not None:
        out.update({names.SUM_TOKENS_PER_SEC: rates.tokens_per_sec,
                    names.SUM_DEVICE_TOKENS_PER_SEC: rates.device_tokens_per_sec,
                    names.SUM_STEP_TIME_S: rates.step_time_s})
        flops_figures, tflops = p.account.summary_figures(rates)
        out.update(flops_figures)
        for key, why in p.account.absent_figures(flops_figures, rates).items():
            _absent(p, key, why)
    out.update(_memory_figures(p, collective))
    # cost and energy over the attempts' time: no device is held or read while no attempt runs
    out.update(p.consumption.summary(parts["wall"] - parts.get("down", 0.0), tokens, tflops))
    for key, why in p.consumption.absent().items():
        _absent(p, key, why)
    out.update(p.ending.figures)
    return {k: v for k, v in out.items() if v is not None and math.isfinite(v)}


def stability_figures(p: Parts, collective: bool) -> dict[str, float]:
    """Dispersion and interval of the steady steps, contention and stragglers (docs/stability.md);
    their tags wait in ``p.ending.stability`` for :func:`end_tags`."""
    s = p.steps.analyse()
    p.ending.start_stability({names.STABILITY: st.verdict(s), names.STABILITY_METHOD: st.THRESHOLDS_TEXT})
    out: dict[str, float] = {}
    if s is None:  # no steady step that took time: no spread, percentile or interval of one
        for key in (names.SUM_STEP_TIME_P50_S, names.SUM_STEP_TIME_P90_S, names.SUM_STEP_TIME_CV, names.SUM_STALL_S,
                    names.SUM_STALLS, names.SUM_TPS_CI95_LOW, names.SUM_TPS_CI95_HIGH):
            _absent(p, key, "no steady-state step time")
    else:
        out.update({names.SUM_STEP_TIME_P50_S: s.p50_step_s, names.SUM_STEP_TIME_P90_S: s.p90_step_s})
        if s.cv is not None:
            out[names.SUM_STEP_TIME_CV] = s.cv
        else:
            _absent(p, names.SUM_STEP_TIME_CV, f"{s.steps} steady step (a spread needs at least 2)")
        if s.steps >= 3:
            out.update({names.SUM_STALL_S: s.stall_s, names.SUM_STALLS: float(s.stalls)})
        else:  # a step over 5x the median of 1 or 2 steps cannot exist: a count of 0 would say nothing
            for key in (names.SUM_STALL_S, names.SUM_STALLS):
                _absent(p, key, f"{s.steps} steady step{'' if s.steps == 1 else 's'} (a stall is a step over "
                                  f"{st.STALL_FACTOR:g}x the median: none can be among fewer than 3)")
        if s.ci95 is None:  # refused: llmeff.stability says the same in its words
            why = (f"{s.steps} steady step{'' if s.steps == 1 else 's'} (an interval needs at least {st.MIN_STEPS})"
                   if s.steps < st.MIN_STEPS
                   else f"too few independent steps ({s.n_eff:.1f} of {s.steps}; at least "
                        f"{st.MIN_EFFECTIVE_STEPS:g} needed)" if s.n_eff is not None else "no steady tokens")
            for key in (names.SUM_TPS_CI95_LOW, names.SUM_TPS_CI95_HIGH):
                _absent(p, key, why)
        else:
            # centred on the mean the summary reports (the same steps; they differ by float32
            # storage in checkpoints and device-event rounding only); without that mean, no interval
            tps = _steady_tps(p)
            if tps and s.tokens_per_sec:
                scale = tps / s.tokens_per_sec
                out[names.SUM_TPS_CI95_LOW], out[names.SUM_TPS_CI95_HIGH] = s.ci95[0] * scale, s.ci95[1] * scale
            else:
                for key in (names.SUM_TPS_CI95_LOW, names.SUM_TPS_CI95_HIGH):
                    _absent(p, key, "no steady-state tokens/s to centre the interval on")
    contention, tags = p.contention.finish(collective)
    out.update(contention)
    why = getattr(p.contention, "absent_why", None)
    if why:
        for key in (names.SUM_HOST_OTHER_CPU, names.SUM_HOST_STEAL):
            if key not in contention:
                _absent(p, key, why)
    p.ending.add_stability(tags)
    if not collective and p.world_size > 1:
        for key in (names.SUM_STRAGGLER_RATIO, *names.SUM_PHASE_STRAGGLER.values()):
            _absent(p, key, "the run ended on rank 0 only: the other ranks' phase times could not be gathered "
                              "(llmeff.autolog.note)")
    if collective and p.world_size > 1:
        out.update(straggler_figures(p))
    return out


def _rank_times(p: Parts) -> dict:
    """This rank's host, mean seconds per steady step of each phase it timed, and mean step time."""
    import socket

    totals = p.phase_totals
    timer = p.phases
    timed = [phase for phase, ok in timer.timed.items() if ok] if timer is not None else []
    phases, step_s = totals.per_step(timed)
    out = {"host": socket.gethostname(), "address": os.environ.get("LLMEFF_HOST_ADDRESS") or None,
           "steps": totals.steps, "phases": phases, "step_s": step_s}
    if p.ledger is not None:  # this rank's data wait and step seconds, all attempts (llmeff.data_wait.ranks)
        seconds = p.ledger.seconds
        out.update(data_wait_s=seconds["warmup_data_wait"] + seconds["steady_data_wait"], train_s=p.ledger.train_s())
    return out


def told_apart(got: list[dict]) -> list[dict]:
    """Each rank's ``host``, with its machine's address appended (``node (10.0.0.2)``) where machines of
    other addresses share its host name (containers and pods often do), so ``llmeff.hosts`` and the
    straggler do not merge them. The address is the one the machines' handshake crossed
    (``$LLMEFF_HOST_ADDRESS``, train/launch.py)."""
    addresses: dict[str, set] = {}
    for g in got:
        addresses.setdefault(g["host"], set()).add(g.get("address"))
    return [{**g, "host": f"{g['host']} ({g.get('address') or 'address unknown'})"} if len(addresses[g["host"]]) > 1
            else g for g in got]


def data_wait_text(got: list[dict]) -> str | None:
    """``llmeff.data_wait.ranks``: each rank's data wait as a share of its step seconds (fraction in [0, 1])
    and in seconds, and the rank that waited most when the shares differ (``rank 1 waited most: 0.31 of
    its step time; rank 0 0.05 (1 s), rank 1 0.31 (6.2 s)``); None when a rank has no step seconds.
    ``got``: every rank's :func:`_rank_times` (``data_wait_s``, ``train_s``)."""
    shares = [(r, g["data_wait_s"] / g["train_s"], g["data_wait_s"]) for r, g in enumerate(got)
              if g.get("train_s") and "data_wait_s" in g]
    if not shares or len(shares) < len(got):  # a rank without its seconds: no comparison
        return None
    each = ", ".join(f"rank {r} {share:.2g} ({wait:.3g} s)" for r, share, wait in shares)
    r, share, _ = max(shares, key=lambda x: x[1])
    if share == min(x[1] for x in shares):
        return f"every rank alike: {each}"
    return f"rank {r} waited most: {share:.2g} of its step time; {each}"


def _ms(x: float) -> str:
    return f"{x * 1e3:.4g}"


def straggler_figures(p: Parts) -> dict[str, float]:
    """``summary/straggler_ratio`` and the phase ratios; the tags ``llmeff.straggler.rank`` (rank, host,
    phase) and ``llmeff.hosts`` (each host's ranks and times) wait in ``p.ending.stability``. A
    collective (every rank's times are gathered)."""
    from mlflow_llmeff.calc.stragglers import RankTimes, stragglers

    got = told_apart(collectives.all_gather_object(_rank_times(p)))
    waits = data_wait_text(got)  # summary/badput_data_wait_s is rank 0's: each rank's share beside it
    if waits:
        p.ending.add_stability({names.DATA_WAIT_RANKS: waits})
    idle = [str(r) for r, g in enumerate(got) if not g["steps"]]
    keys = (names.SUM_STRAGGLER_RATIO, *names.SUM_PHASE_STRAGGLER.values())
    if idle:  # a ratio over a rank with no timed step is undefined, never 1.0
        for key in keys:
            _absent(p, key, f"no timed steady step on rank{'s' if len(idle) > 1 else ''} {', '.join(idle)}")
        return {}
    found = stragglers([RankTimes(g["host"], g["phases"], g["step_s"]) for g in got])
    if found is None:
        for key in keys:
            _absent(p, key, "no phase timed on every rank, or the median rank's compute time is 0")
        return {}
    out = {names.SUM_STRAGGLER_RATIO: found.ratio}
    for phase, key in names.SUM_PHASE_STRAGGLER.items():
        if phase in found.phase_ratios:
            out[key] = found.phase_ratios[phase]
        else:
            untimed = [str(r) for r, g in enumerate(got) if phase not in g["phases"]]
            _absent(p, key, f"{phase} not timed on rank{'s' if len(untimed) > 1 else ''} {', '.join(untimed)} (its "
                              "optimizer has no step hooks)" if untimed else f"the median rank's {phase} time is 0")
    r = found.rank
    mine = got[r]["phases"]
    of = f" {found.phase_ratio:.3g}x the median rank" if found.phase_ratio is not None else ""
    waits = [w for w in found.wait_s if w is not None]
    wait = (f"; collective wait and other: rank {r} {_ms(found.wait_s[r])} ms/step, the median rank "
            f"{_ms(st.percentile(waits, 50))}" if found.wait_s[r] is not None and waits else "")
    p.ending.add_stability({names.STRAGGLER_RANK: (
        f"rank {r} on host {found.host}: {found.phase}{of} ({_ms(mine[found.phase])} vs "
        f"{_ms(found.medians[found.phase])} ms/step); compute ({' + '.join(found.phases)}) {found.ratio:.3g}x "
        f"({_ms(found.compute_s[r])} vs {_ms(found.medians['compute'])} ms/step){wait}")})
    p.ending.add_stability({names.HOSTS: hosts_text(got, found)})
    return out


def hosts_text(got: list[dict], found) -> str:
    """``llmeff.hosts``: each host with its ranks, their mean compute time per step and its phases, and
    their collective wait (``host-a: rank 0, compute 12.3 ms/step (forward 4.1, backward 7.9,
    optimizer 0.3), wait 20.1 ms/step; ...``), hosts in the order of their first rank."""
    by_host: dict[str, list[int]] = {}
    for r, g in enumerate(got):
        by_host.setdefault(g["host"], []).append(r)
    parts = []
    for host, ranks in by_host.items():
        mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
        phases = ", ".join(f"{p} {_ms(mean([got[r]['phases'][p] for r in ranks]))}" for p in found.phases)
        waits = [found.wait_s[r] for r in ranks if found.wait_s[r] is not None]
        wait = f", wait {_ms(mean(waits))} ms/step" if waits else ""
        who = f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
        parts.append(f"{host}: {who}, compute {_ms(mean([found.compute_s[r] for r in ranks]))} ms/step ({phases}){wait}")
    return "; ".join(parts)


def _absent(p: Parts, key: str, why: str) -> None:
    """Record that ``key`` is undefined for this run (not logged) and why, for ``llmeff.summary.absent``."""
    p.summary_absent.add(key, why)


def headline(p: Parts, out: dict[str, float]) -> str:
    """The run's description: its steady throughput with its interval and stability, and where its
    figures are (the runs table shows an interval metric's last window, not the run's figure)."""
    tps, low, high = (out.get(k) for k in (names.SUM_TOKENS_PER_SEC, names.SUM_TPS_CI95_LOW, names.SUM_TPS_CI95_HIGH))
    interval = f" (95% interval {low:,.0f} to {high:,.0f})" if low is not None and high is not None else ""
    return (f"{tps:,.0f} tokens/s steady state{interval}, {p.ending.stability.get(names.STABILITY) or 'stability unknown'}. "
            "The run's figures are the summary/* metrics; throughput/* are per-window rates (the runs table "
            "shows their last window).")


def _steady_tps(p: Parts) -> float | None:
    rates = p.meter.summary()
    return rates.tokens_per_sec if rates is not None and rates.counts.tokens > 0 else None


def _memory_figures(p: Parts, collective: bool) -> dict[str, float]:
    """``summary/bytes_per_param`` (CUDA allocator peak per parameter), ``summary/model_state_bytes_per_param``
    and, with the monitor's memory component (:class:`~mlflow_llmeff.monitor.memwatch.MemoryWatch`),
    where the bytes go (:func:`memory_split_figures`)."""
    inner = unwrap_model(p.model) if p.model is not None else None
    if inner is None:
        return {}
    alloc, _, _ = points.memory(p, collective, fresh=True)
    out: dict[str, float] = {}
    if p.device is not None and p.device.type == "cuda":  # allocator statistics, never process RSS
        nparams = sum(int(getattr(w, "ds_numel", 0)) or w.numel() for w in inner.parameters())  # ZeRO-3: whole
        out[names.SUM_BYTES_PER_PARAM] = alloc * 2**30 / max(1, nparams)
    if p.optimizer is not None:
        state_bytes, model_params = model_state_bytes(inner, p.optimizer)
        # bytes over no parameter are undefined, never 0 (-1: this rank has no figure; max over ranks)
        bpp = state_bytes / model_params if model_params > 0 else -1.0
        if collective:
            bpp = collectives.all_reduce([bpp], "max")[0]
        if bpp >= 0:
            out[names.SUM_MODEL_STATE_BYTES_PER_PARAM] = bpp
        else:
            _absent(p, names.SUM_MODEL_STATE_BYTES_PER_PARAM, "the model has no parameters")
    watch = getattr(p, "memory", None)  # a Parts built by hand (tests) has none
    if watch is not None:
        out.update(memory_split_figures(p, watch, inner, collective))
    return out


#: Memory figures per device, reduced with ``max`` over ranks (absent on a rank: :data:`_NONE`).
_MAX_KEYS = (names.SUM_MEM_WEIGHTS_GIB, names.SUM_MEM_GRADIENTS_GIB, names.SUM_MEM_OPT_STATE_GIB,
             names.SUM_OPT_STATE_BYTES_PER_PARAM, names.SUM_MEM_PEAK_GIB, names.SUM_MEM_OTHER_GIB,
             names.SUM_MEM_PEAK_FRACTION, names.SUM_MEM_NVML_PROCESS_GIB)
#: Counts summed over devices.
_SUM_KEYS = (names.SUM_MEM_ALLOC_RETRIES, names.SUM_MEM_OOMS)
_NONE = -1e300


def memory_split_figures(p: Parts, watch, inner, collective: bool) -> dict[str, float]:
    """Weights, gradients, optimizer state (GiB, and the state per parameter), the peak and its rest,
    the peak's share of the capacity, on CUDA the allocator's retries and OOMs and NVML's process memory
    (docs/metrics.md "Memory"): per device, ``max`` over ranks (the counts summed) with ``collective``
    (one all-reduce of each kind, on every rank). Their tags wait in ``watch.end_tags``; a figure no
    rank could read is left out, the rest of a peak below the model state is absent and says why."""
    watch.learn_device(p.device)  # a model-less monitor learns it late
    try:
        mine, tags = watch.figures(inner, p.optimizer)
    except Exception as e:  # noqa: BLE001 - memory figures never stop the run's end
        mine, tags = {}, {names.MEMORY_CAPACITY: f"unknown: {type(e).__name__}: {shorten(str(e), 200)}"}
    tops = [mine.get(k, _NONE) for k in _MAX_KEYS]
    sums = [mine.get(k, 0.0) for k in _SUM_KEYS]
    if collective and p.world_size > 1:
        tops = collectives.all_reduce(tops, "max")
        sums = collectives.all_reduce(sums, "sum")
    out = {k: float(v) for k, v in zip(_MAX_KEYS, tops) if v > _NONE / 2}
    out.update({k: float(v) for k, v in zip(_SUM_KEYS, sums) if k in mine})
    other = out.get(names.SUM_MEM_OTHER_GIB)
    if other is not None and other < 0:
        del out[names.SUM_MEM_OTHER_GIB]
        _absent(p, names.SUM_MEM_OTHER_GIB, f"the peak ({out.get(names.SUM_MEM_PEAK_GIB, 0):.3g} GiB) is below the "
                                            f"model state by {-other:.3g} GiB: it was read before the state existed")
    tags.update(watch.final_optimizer_tags(p.optimizer))
    if p.ending.status == "FAILED":  # the exception being handled, else the one the interpreter printed
        import sys

        ending = sys.exc_info()[1] or getattr(sys, "last_value", None)
        tags.update(watch.on_failure(ending, p.logger if p.is_main else None))
    watch.keep_end_tags(tags)
    return out


def end_tags(p: Parts, note: str | None) -> dict[str, str]:
    """The tags logged with the summary: HFU method, energy and carbon sources, consumption provenance,
    stability, targets not reached, ``note`` (``llmeff.autolog.note``), the undefined summary figures
    (``llmeff.summary.absent``) and wall time vs MLflow's Duration."""
    tags = {names.HFU_METHOD: p.account.hfu_note, **p.carbon.tags(
        energy_source=p.energy.source if p.consumption.measured else None),
        **p.consumption.tags(p.ledger.wall_s()), **p.ending.stability}
    if p.job.down_s:  # time between attempts: no process read a counter, no device is priced
        down = f"{p.job.down_s:.3f} s of summary/badput_down_s (no attempt ran)"
        tags[names.ENERGY_SPAN] = (
            f"{tags[names.ENERGY_SPAN]}; the times above are the attempts' time: summary/wall_s also holds the "
            f"job's {down}, neither measured nor priced in cost/*" if names.ENERGY_SPAN in tags else
            f"cost/* covers the attempts' device time: the job's {down} are not priced")
    if p.consumption.devices_changed:  # an elastic restart on another number of devices
        counts = sorted(set(p.consumption.prior_devices) | {p.consumption.devices}, reverse=True)
        tags[names.RESUME_DEVICES] = (
            f"{', '.join(map(str, counts))} devices across the attempts (this one {p.consumption.devices}): "
            "summary/device_hours, cost/* and the per-device figures (throughput/device/*, summary/device_*, MFU) "
            "count each attempt's seconds at the devices it held")
    if p.account.counter_gap:
        tags[names.FLOPS_COUNTER_GAP] = p.account.counter_gap
    if p.peak.source is not None:
        tags[names.MEMORY_SOURCE] = p.peak.source
    memory_tags = dict(getattr(getattr(p, "memory", None), "end_tags", None) or {})
    peak_source = memory_tags.pop(names.MEMORY_SOURCE, None)
    if peak_source is not None:  # the CPU peak of summary/memory/peak_gib beside the interval keys' RSS
        tags[names.MEMORY_SOURCE] = (f"{tags[names.MEMORY_SOURCE]}; summary/memory/peak_gib: {peak_source}"
                                     if names.MEMORY_SOURCE in tags else f"summary/memory/peak_gib: {peak_source}")
    tags.update(memory_tags)
    if not p.consumption.measured and p.consumption.estimate is not None:
        tags[names.ENERGY_SOURCE] = "codecarbon_estimate"
        tags[names.ENERGY_WHY] = (f"no measured energy ({p.energy.why}); only codecarbon's CPU/RAM estimate is "
                                  "logged, under energy/estimate/* and carbon/estimate_kg_co2e")
    for t in p.targets:
        if t.key not in p.reached:
            tags[t.not_reached_tag] = "not_reached"
    if note:
        tags[names.AUTOLOG_NOTE] = note
    if p.summary_absent:
        tags[names.SUMMARY_ABSENT] = p.summary_absent.text()
    tags.update(assumed_tag(p.assumptions()))
    tags[names.WALL_VS_DURATION] = wall_vs_duration(p.naming.created_after_s)
    return tags


def wall_vs_duration(created_after_s: float | None) -> str:
    """Why MLflow's Duration and ``summary/wall_s`` differ (both are shown on the run's page);
    ``created_after_s``: seconds from the attempt's start to the run's creation (None: an earlier attempt's run)."""
    before = created_after_s
    head = ("summary/wall_s runs from each attempt's start (process start for llmeff train: imports and "
            "set-up included; all attempts of a resumed run added) to the last summary figure")
    if before is None:
        return head + "; this attempt continued a run MLflow created earlier, whose Duration counts from then"
    before = max(0.0, before)
    return (head + f"; MLflow created the run {before:.1f} s after this attempt started, and its Duration runs "
            "from then to the run's end, after the end-of-run report was logged")
