"""A monitor's window edges: counts over ranks, step times, and the points it logs with their readings.

At every logged step the :class:`~mlflow_llmeff.monitor.meter.EfficiencyMonitor` reads energy and
codecarbon's estimate on every rank and sums them (each physical device once), takes the peak
memory and the learning rate, and hands ``train/*``, ``throughput/*``, ``memory/*``, the running
consumption totals and the contention figures to the logger (:func:`log_interval`); rank 0 then
rewrites the heartbeat file. At every window edge :func:`edge` folds the steps counted since the last
one into the throughput meter. These functions work on the monitor's components
(:class:`~mlflow_llmeff.monitor.parts.Parts`, ``p``) through their methods; they are collectives where they say so, called
on every rank in the same order.
"""

from __future__ import annotations

import logging
import math
import time
import warnings
from functools import partial

from mlflow_llmeff import names
from mlflow_llmeff.calc import flops as fl
from mlflow_llmeff.evals.api import SUBJECT_TABLE, split_subjects
from mlflow_llmeff.meters import collectives
from mlflow_llmeff.meters import energy as en
from mlflow_llmeff.meters.probes import peak_memory_gib
from mlflow_llmeff.monitor.binding import write_heartbeat
from mlflow_llmeff.monitor.counting import UNKNOWN_WHY
from mlflow_llmeff.monitor.notes import absent_text  # noqa: F401 - re-exported (llmeff.*.absent's text)
from mlflow_llmeff.monitor.parts import Parts

__all__ = ["edge", "reduce_counts", "absent_text", "unknown_counts", "note_unknown", "time_steps", "log_interval",
           "read_interval", "publish_interval", "check_loss", "log_eval", "log_ttq", "refresh_consumption",
           "memory", "note_nothing_counted", "warn_mfu"]

#: Seconds a CPU process's peak-RSS reading is logged again before it is read anew (:func:`memory`).
CPU_MEMORY_REFRESH_S = 1.0

log = logging.getLogger("mlflow_llmeff.monitor.meter")  # the monitor's own logger, as before the split


def edge(p: Parts, collective: bool = True) -> None:
    """Account the pending steps: counts summed over ranks (with ``collective`` on several ranks: a
    collective), with their step seconds, into the throughput meter and the step times."""
    window = p.window
    reduce = partial(reduce_counts, p) if (collective and p.world_size > 1) else None
    if p.compiles is not None:  # torch.compile called after the monitor started: listen from here on
        p.compiles.install()
    counts = p.tally.take(window.steps, reduce=reduce)
    p.meter.add(counts, window.seconds)
    time_steps(p, counts, window.seconds)
    window.close()


def reduce_counts(p: Parts, t):
    """Counts summed over every rank, then made the global batch's by the run's counting rule
    (:func:`~mlflow_llmeff.parallel.degrees.token_counting`): divided by the ranks that counted the
    same tokens (tensor/pipeline copies), and, where context-parallel ranks counted slices of the
    same sequences, samples divided and ``sum(l^2)`` multiplied by their number (attention at the
    full length). A collective (``t``: the tally's counts tensor in
    :data:`~mlflow_llmeff.monitor.counting.REDUCE_LAYOUT`; the monitor passes it to
    :meth:`~mlflow_llmeff.monitor.counting.StepTally.take`)."""
    import torch

    t = collectives.reduce_tensor(t)
    rule = p.counting
    r, k = rule.copies, rule.slices
    if r > 1 or k > 1:
        counts = t[:5]  # REDUCE_LAYOUT: tokens, loss tokens, sum(l^2), padded, samples; then the unknowns,
        if r > 1 and bool((counts % r).any()) and p.notices.first("replica counts"):  # kept as sums
            warnings.warn(f"mlflow_llmeff: token counts summed over ranks are not a multiple of the {r} ranks of "
                          "a model-parallel group: its ranks counted different batches", stacklevel=3)
        mul = torch.tensor([1, 1, k, 1, 1], dtype=t.dtype, device=t.device)
        div = torch.tensor([r, r, r, r, r * k], dtype=t.dtype, device=t.device)
        t = torch.cat((counts * mul // div, t[5:]))
    return t


def time_steps(p: Parts, counts, window_s: float) -> None:
    """Keep the per-step seconds (device events on CUDA) and phase times of a steady window just added."""
    device_s = p.devclock.take(window_s) if p.devclock is not None else None
    phase_s = p.phases.take() if p.phases is not None else None
    host_s = p.window.take_steady()
    # a window with a compilation booked: the device events hold its gap, the host's step times do not
    touched = p.compiles is not None and p.compiles.take_touched()
    if counts.steps == 0 or p.meter.is_warmup(p.meter.step):
        return
    secs = device_s if device_s is not None and len(device_s) == len(host_s) and not touched else host_s
    p.steps.add_window(secs, counts.tokens)
    if phase_s is not None:
        p.phase_totals.add(phase_s, counts.steps, secs)


def unknown_counts(p: Parts, total, window) -> dict[str, str]:
    """Interval keys that rest on a count the run was not given (:data:`~mlflow_llmeff.monitor.counting.UNKNOWN_WHY`):
    the cumulative padded and loss-bearing tokens (``total``), samples/s and the FLOPs figures of the
    steady ``window`` (its :class:`~mlflow_llmeff.calc.throughput.Counts`, or None); key -> why."""
    why: dict[str, str] = {}
    if total.padded_unknown:
        why[names.TRAIN_PADDED_TOKENS] = UNKNOWN_WHY["padded"]
    if total.loss_unknown:
        why[names.TRAIN_LOSS_TOKENS] = UNKNOWN_WHY["loss"]
    if window is not None and window.samples_unknown:
        why[names.TPUT_SAMPLES] = UNKNOWN_WHY["samples"]
    if window is not None and window.lengths_unknown and p.account.shape is not None:
        flops = (names.TPUT_DEVICE_TFLOPS,) + ((names.TPUT_DEVICE_MFU, names.TPUT_DEVICE_HFU)
                                               if p.account.peak_tflops is not None else ())
        why.update(dict.fromkeys(flops, UNKNOWN_WHY["lengths"]))
    return why


def note_unknown(p: Parts, why: dict[str, str]) -> None:
    """Tag ``llmeff.interval.absent`` (rank 0) with every interval key left out so far for an unknown count."""
    absent = p.interval_absent
    if absent.note(why):
        p.logger.set_tags({names.INTERVAL_ABSENT: absent.text()}, synchronous=False)


def log_interval(p: Parts, step: int, collective: bool = True, later=None) -> None:
    """The interval metrics at a logged step (a collective: losses, energy and memory over ranks).

    Two halves: :func:`read_interval` takes every reading that belongs to the step (counts, losses,
    energy, memory, clocks, the learning rate, the host's contention, the time stamp) on the calling
    thread; :func:`publish_interval` builds the figures from them and hands them to the logger. With
    ``later`` (a callable taking a function: :meth:`~mlflow_llmeff.monitor.pointwork.PointWorker.submit`, one
    process) the second half runs there, off the training thread; the figures are the same."""
    reading = read_interval(p, step, collective, one_process=later is not None)
    if later is None:
        publish_interval(p, step, reading)
    else:
        later(partial(publish_interval, p, step, reading))


def read_interval(p: Parts, step: int, collective: bool = True, one_process: bool = False) -> tuple:
    """The readings of a logged step (:func:`log_interval`'s first half, on the training thread: the
    collectives, the clocks and every state the next steps change), in the order they were always read.
    ``one_process`` (the second half runs off the training thread): the energy, codecarbon's estimate and
    the wall time are read here and summed into the totals there (:func:`read_consumption`), and the host's
    contention is read there (its interval runs from one reading to the next wherever they are made)."""
    total = p.meter.total
    snap = object.__new__(type(total))  # the totals as of this step (the next edge adds to them in place)
    snap.__dict__.update(total.__dict__)
    if one_process:
        cons = read_consumption(p)
        loss_sum, loss_n = p.tally.take_loss()
    else:
        cons = None
        loss_sum, loss_n = refresh_consumption(p, collective, p.tally.take_loss())
    alloc, reserved, _ = memory(p, collective)
    loss = None
    if loss_n:
        loss = loss_sum / loss_n
        if not math.isfinite(loss):
            p.last.note_nonfinite(step, loss)
    lr = learning_rate(p)
    rates = p.meter.interval()
    if rates is not None and total.tokens == 0:
        note_nothing_counted(p)
        rates = None  # no token was counted: a rate of 0 tokens/s would be a number nobody measured
    wall_s = p.ledger.wall_s()
    system = None if one_process else (p.contention.interval(collective), getattr(p.contention, "interval_why", {}))
    tags = p.memory.optimizer_tags(p.optimizer) if p.is_main and getattr(p, "memory", None) is not None else None
    return snap, cons, loss, alloc, reserved, lr, rates, wall_s, system, tags, time.time()


def publish_interval(p: Parts, step: int, reading: tuple) -> None:
    """Build the interval metrics of ``step`` from its :func:`read_interval` readings and hand them to the
    logger (rank 0), with the heartbeat; no collective, no clock read, no state of the steps to come
    (:func:`log_interval`'s second half, on the training thread or off it)."""
    total, cons, loss, alloc, reserved, lr, rates, wall_s, system, tags, unix = reading
    if cons is not None:
        add_consumption(p, cons)
    m: dict[str, float] = {names.TRAIN_TOKENS: total.tokens, names.TRAIN_PADDED_TOKENS: total.padded_tokens,
                           names.TRAIN_LOSS_TOKENS: total.loss_tokens,
                           names.MEM_MAX_ALLOC: alloc, names.MEM_MAX_RESERVED: reserved}
    if loss is not None:
        m[names.TRAIN_LOSS] = loss
    if lr is not None:
        m[names.TRAIN_LR] = lr
    if rates is not None:
        m.update(p.account.interval_metrics(rates))
        warn_mfu(p, m.get(names.TPUT_DEVICE_MFU), step)
    unknown = unknown_counts(p, total, rates.counts if rates is not None else None)
    for key in unknown:  # a count not given is left out, never its default
        m.pop(key, None)
    note_unknown(p, unknown)
    m.update(p.consumption.interval(wall_s, total.tokens))
    note_unknown(p, p.consumption.interval_why)  # a counter that did not move: no power, and why
    if system is None:  # one process: read here
        system = p.contention.interval(False), getattr(p.contention, "interval_why", {})
    m.update(system[0])
    note_unknown(p, system[1])
    p.last.logged(step, m)
    p.logger.log_metrics(m, step, timestamp_ms=int(unix * 1000))
    if tags:  # llmeff.optimizer once its states exist
        p.logger.set_tags(tags, synchronous=False)
    if p.heartbeat_path and p.is_main:
        write_heartbeat(p.heartbeat_path, p.logger.run_id, step, m, unix=unix)


def check_loss(p: Parts, collective: bool = True) -> None:
    """Note a non-finite loss (``p.last``) at the current step when the mean of the losses counted since the last
    logged step is not finite (on any rank, with ``collective``: a collective). Synchronizes the device."""
    s, n = p.tally.peek_loss()
    bad = 1.0 if (n and not math.isfinite(s)) else 0.0
    if collective and p.world_size > 1:
        bad = collectives.all_reduce([bad], op="max")[0]
    if bad:
        p.last.note_nonfinite(p.step_count, s / n if n else float("nan"))


def log_eval(p: Parts, values: dict[str, float], step: int) -> None:
    """Rank 0: ``eval/*`` at ``step`` (an ``eval/`` prefix dropped, ``val_perplexity`` = exp(``val_loss``)
    added, MMLU subjects as one table); then ``ttq/*`` for the targets the values reach (:func:`log_ttq`)."""
    clean = {(k[len("eval/"):] if k.startswith("eval/") else k): float(v) for k, v in values.items()}
    if "val_loss" in clean and "val_perplexity" not in clean:  # one definition on every path
        clean["val_perplexity"] = math.exp(min(clean["val_loss"], 700.0))
    if p.is_main:
        shown, table = split_subjects(clean)
        if table is not None:  # one table per eval; per-subject metrics only when asked
            p.logger.log_table(table, SUBJECT_TABLE.format(step=step))
        p.logger.log_metrics({f"eval/{k}": v for k, v in (clean if p.subject_metrics else shown).items()},
                                step)
    for t in p.targets:
        if t.metric in clean:
            p.reached.saw(t, clean[t.metric])
    newly = [t for t in p.targets if t.key not in p.reached and t.reached(clean.get(t.metric))]
    if newly:
        log_ttq(p, newly, step)


def log_ttq(p: Parts, newly, step: int) -> None:
    """``ttq/<target>_*`` at the first step the targets ``newly`` are reached (``docs/time.md``, "Time to quality");
    a collective (pending steps are accounted, consumption read over ranks)."""
    if p.window.steps:
        edge(p)
    refresh_consumption(p)
    seconds = p.ledger.snapshot()
    whole = p.ledger.wall_s()
    wall = whole - seconds["init"]
    held = p.consumption.device_s(whole, init_s=seconds["init"])  # each attempt at its devices, set-up left out
    kwh = p.consumption.total_kwh
    usd = p.consumption.cost_usd(wall, device_s=held)
    figures = {"wall_s": wall, "train_s": p.ledger.train_s(), "tokens": float(p.meter.total.tokens),
               "device_hours": held / 3600.0, "kwh": kwh, "usd": usd,
               "kg_co2e": p.consumption.kg_co2e(kwh)}
    for t in newly:
        p.reached.reach(t.key, step)
        keys = t.metric_keys()
        p.logger.log_metrics({keys[k]: v for k, v in figures.items() if v is not None}, step)
        p.logger.set_tags({t.not_reached_tag: f"reached_at_step_{step}"})


def refresh_consumption(p: Parts, collective: bool = True, loss: tuple[float, int] = (0.0, 0)) -> tuple[float, int]:
    """Read energy and codecarbon's estimate on every rank and sum them, with ``loss`` (sum, n) riding along.

    Each physical device is summed once: a rank adds only the devices it owns
    (:func:`~mlflow_llmeff.meters.energy.device_owners`: the lowest rank listing a device id reads it),
    so two ranks on one GPU count it once. Without a collective on several ranks (rank 0 alone at
    exit) the other ranks' readings cannot be had: the totals stay those of the last collective
    reading, and ``llmeff.energy.span`` says where the energy ends.
    """
    loss_sum, loss_n = loss
    many = p.world_size > 1
    if many and not collective:
        return loss_sum, int(loss_n)
    local = [loss_sum, float(loss_n), *_consumption_local(p, *_consumption_readings(p, many))]
    g = collectives.all_reduce(local) if many else local
    _consumption_sums(p, many, g, p.ledger.wall_s())
    return g[0], int(g[1])


def read_consumption(p: Parts) -> tuple:
    """One process: the energy reading, codecarbon's running estimate and the wall time of
    :func:`refresh_consumption`, read now (in its order); :func:`add_consumption` makes them the totals."""
    return (*_consumption_readings(p, False), p.ledger.wall_s())


def _consumption_readings(p: Parts, many: bool) -> tuple:
    """This rank's devices of the energy reading, the reading (None without a meter) and codecarbon's
    running estimate, read in that order (:func:`refresh_consumption`, :func:`read_consumption`)."""
    mine = _energy_share(p, many)
    reading = p.energy.read() if p.energy.measures else None
    return mine, reading, p.carbon.running_estimate()


def add_consumption(p: Parts, readings: tuple) -> None:
    """The totals of :func:`read_consumption`'s readings, as :func:`refresh_consumption` sets them."""
    mine, reading, est, wall_s = readings
    _consumption_sums(p, False, [0.0, 0.0, *_consumption_local(p, mine, reading, est)], wall_s)


def _consumption_local(p: Parts, mine: set[str], reading, est) -> list[float]:
    """This rank's ``[joules, devices, cpu kWh, ram kWh, estimated, domains, unmeasured]`` to sum over ranks."""
    joules, devices, domains = 0.0, 0, 0
    if reading is not None:
        ours = [d for d in reading.per_device_j if d in mine]
        joules = sum(reading.per_device_j[d] for d in ours)
        domains = len(ours)
        devices = p.energy.num_devices if len(ours) == len(reading.per_device_j) else len(ours)
    return [joules, float(devices), est[0] if est else 0.0, est[1] if est else 0.0, 1.0 if est else 0.0,
            float(domains), float(len(p.energy.unmeasured))]


def _consumption_sums(p: Parts, many: bool, g: list[float], wall_s: float) -> None:
    """Set the consumption totals from the sums ``g`` (:func:`refresh_consumption`'s layout) read at ``wall_s``."""
    if p.energy_share.check(g[8]):  # a device left the measurement (another process on it): every rank
        _energy_share(p, many)        # sees the same sum, so all gather the devices and reasons again
    p.consumption.update(joules=g[2], energy_devices=int(g[3]), estimate=(g[4], g[5]) if g[6] else None,
                         measured_domains=int(g[7]), wall_s=wall_s)


def _energy_share(p: Parts, many: bool) -> set[str]:
    """The device ids this rank reports (once per run: one collective gathering every rank's devices)."""
    if p.energy_share.ids is not None:
        return p.energy_share.ids
    owned = list(p.energy.owned)
    if not owned and p.energy.measures:  # a meter that names no devices: the ones it reads are its own
        owned = list(p.energy.read().per_device_j)
    mine = {"owned": owned, "unmeasured": p.energy.unmeasured}
    ranks = collectives.all_gather_object(mine) if many else [mine]
    owners = en.device_owners([r["owned"] for r in ranks])
    unmeasured = {d: why for r in ranks for d, why in r["unmeasured"].items() if d in owners}
    shared = {d: [i for i, r in enumerate(ranks) if d in r["owned"]] for d in owners}
    p.consumption.set_devices(len(owners), unmeasured, {d: rs for d, rs in shared.items() if len(rs) > 1})
    ids = {d for d, rank in owners.items() if rank == p.rank}
    p.energy_share.gathered(ids, float(sum(len(r["unmeasured"]) for r in ranks)))
    return ids


def memory(p: Parts, collective: bool = True, fresh: bool = False) -> tuple[float, float, str]:
    """Peak allocated and reserved memory in GiB (max over ranks with ``collective``) and their source.

    On CUDA the allocator's peaks are read every time (no system call). A CPU process's peak RSS
    (``getrusage``, a system call: ~50 us right after a step on a 2-core host, ``bench/overhead.py``)
    is read at most every :data:`CPU_MEMORY_REFRESH_S` and at the summary (``fresh``); in between the
    last reading is logged: the peak as of at most that long before the step (a peak only grows, so
    it is never above the step's). The collective is made every time, so ranks stay in step.
    """
    import torch

    dev = p.device if p.device is not None else torch.device("cpu")
    peak = p.peak
    now = p.clock() if p.clock is not None else time.monotonic()
    cuda = dev.type == "cuda"
    held = None if cuda or fresh else peak.reuse(now, CPU_MEMORY_REFRESH_S)
    if held is None:
        alloc, reserved, source = peak_memory_gib(dev)
        peak.read(now, alloc, reserved, source, hold=not cuda)
    else:
        alloc, reserved, source = held
    if collective and p.world_size > 1:
        alloc, reserved = collectives.all_reduce([alloc, reserved], op="max")
    return alloc, reserved, source


def learning_rate(p: Parts) -> float | None:
    """The learning rate given to ``step()``, else the optimizer's first group's, else None."""
    lr = p.window.lr
    if lr is not None:
        return lr
    try:
        lr = p.optimizer.param_groups[0]["lr"] if p.optimizer is not None else None
        return float(lr) if lr is not None else None
    except Exception:  # noqa: BLE001
        return None


def note_nothing_counted(p: Parts) -> None:
    """Warn once (and tag) that steps ran with no token counted: no rate is logged."""
    if not p.notices.first("nothing counted"):
        return
    msg = ("EfficiencyMonitor.step() ran with no token counted (pass batch= or tokens= to step() or count()): "
           "no throughput, MFU or per-token figure is logged")
    warnings.warn(f"mlflow_llmeff: {msg}", stacklevel=4)  # the user's step() or finish()
    p.logger.set_tags({names.AUTOLOG_NOTE: msg}, synchronous=False)


def warn_mfu(p: Parts, mfu: float | None, where: str | int, fate: str = "logged unclipped") -> None:
    """Warn once (and tag ``llmeff.mfu_warning``) about an implausible MFU; it is reported, never clipped
    (``fate``: what became of it, :func:`~mlflow_llmeff.calc.flops.mfu_warning`).
    ``where``: the figure's name, or the logged step it was computed at (``step <n>``)."""
    warn = fl.mfu_warning(mfu, fate)
    if warn and p.notices.first("mfu"):  # reported, never clipped
        if isinstance(where, int):
            where = f"step {where}"
        log.warning(f"llmeff: {where}: {warn}")
        p.logger.set_tags({names.MFU_WARNING: f"{where}: {warn}"}, synchronous=False)
