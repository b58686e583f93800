"""Scaling efficiency: configurations that differ only in device count, compared with an interval
(``docs/compare.md``, "Scaling efficiency"; ``docs/stability.md``).

A pure calculator over :class:`~mlflow_llmeff.report.repeats.Configuration` values: each side's global
tokens/s is its configuration's estimate (:meth:`~mlflow_llmeff.report.repeats.Configuration.estimate`),
and the ratio's interval is interval arithmetic on the two (Moore 1966). A value above
:data:`~mlflow_llmeff.report.repeats.SUPERLINEAR` is flagged with what could explain it.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

from mlflow_llmeff import names
from mlflow_llmeff.report.calc import RunRecord, per_kind
from mlflow_llmeff.report.repeats import SUPERLINEAR, Configuration, Estimate, configurations

__all__ = ["ScalingRow", "SAME_JOB", "scaling_efficiency", "accepted_ids"]

_DEVICES = operator.attrgetter("devices")
_RUN_ID = operator.attrgetter("run_id")
_ABOVE_0 = (0.0).__lt__  # a figure above 0 (False for NaN)


@dataclass(frozen=True)
class ScalingRow:
    """Scaling efficiency of one configuration against its group's baseline configuration.

    Attributes:
        group: what the configurations share, e.g. ``llama-tiny cpu fp32 seq 128 ddp``.
        name, baseline_name: the configurations' labels.
        run_ids, baseline_run_ids: the repeats used on each side.
        devices, baseline_devices: N and N0.
        tokens_per_sec, baseline_tokens_per_sec: the global throughput estimates.
        efficiency: ``T(N) / (T(N0) * N / N0)``, 1 = linear.
        low, high: its interval (both None without intervals on both sides; ``high`` None alone when
            the baseline's interval reaches 0: no upper bound).
        kind: ``strong`` (same global batch tokens), ``weak`` (same batch per device), ``batch varies``
            (a side's batch shape varied within its runs, ``llmeff.global_batch_tokens=dynamic``: neither
            can be told) or ``batch differs``.
        flags: why a value above :data:`SUPERLINEAR` may not be real (empty otherwise).
        refused: why no efficiency is computed (the two sides ran different threads per process:
            ``llmeff.threads``); ``efficiency`` is then NaN. Empty otherwise.
    """

    group: str
    name: str
    baseline_name: str
    run_ids: tuple[str, ...]
    baseline_run_ids: tuple[str, ...]
    devices: int
    baseline_devices: int
    tokens_per_sec: Estimate
    baseline_tokens_per_sec: Estimate
    efficiency: float
    low: float | None
    high: float | None
    kind: str
    flags: tuple[str, ...] = ()
    refused: str = ""

    @property
    def run_id(self) -> str:
        return self.run_ids[0]

    @property
    def baseline_id(self) -> str:
        return self.baseline_run_ids[0]


#: Conditions configurations must share to be the same job at different device counts.
SAME_JOB = (names.ACCEL_SHORT, names.PRECISION, names.MODEL_NAME, names.SEQ_LEN, names.ACT_CKPT, names.COMPILE,
            names.OPTIMIZER, names.ATTENTION, names.WEIGHTS, names.DATASET, names.FLOPS_FORMULA)


def _batch_per_device(c: Configuration) -> str | None:
    try:
        return str(int(c.tag(names.SEQ_LEN)) * int(c.tag(names.MICRO_BATCH_SIZE)) * int(c.tag(names.GRAD_ACCUM)))
    except (TypeError, ValueError):
        return None


def scaling_efficiency(runs: list[RunRecord], baseline: str | None = None,
                       configs: list[Configuration] | None = None) -> list[ScalingRow]:
    """Scaling efficiency of configurations that differ only in device count, with its interval.

    Configurations (:func:`configurations`) are grouped by :data:`SAME_JOB` and parallelism
    strategy (``single`` joins any data-parallel group). The baseline of a group is the
    configuration holding run ``baseline`` when given, else the one with the fewest devices (among
    equals: one with a stable repeat, then the first listed). For every other device count::

        efficiency = T(N) / (T(N0) * N / N0),   interval [T_low(N) / T_high(N0), T_high(N) / T_low(N0)] * N0 / N

    where ``T`` is the configuration's global tokens/s estimate. Strong scaling (same global
    batch): speed-up over the ideal N/N0; weak (same batch per device): per-device throughput over
    the baseline's. See ``docs/compare.md`` and ``docs/stability.md``.

    Args:
        runs: the compared runs; those without ``summary/tokens_per_sec`` or a device count are left out.
        baseline: run id whose configuration is the baseline of its group.
        configs: :func:`configurations` of ``runs`` where known (regrouped, no key computed again; the same result:
            a configuration's runs share their device count, a tag of its key, and its tokens/s are the values
            its estimate reads, so no pass over the runs is made for them).

    Returns:
        One :class:`ScalingRow` per non-baseline configuration of a group, by group then device count.

    Raises:
        ValueError: when ``baseline`` is not one of ``runs`` or has no ``summary/tokens_per_sec``.
    """
    if configs is None:
        devices: dict = {}  # each kind of runs' device count read once (RunRecord.alike)
        usable = [r for r in runs if r.comparable and per_kind(r, devices, _DEVICES)
                  and (r.metrics.get(names.SUM_TOKENS_PER_SEC) or 0) > 0]
        found = baseline is None or baseline in map(_RUN_ID, usable)
        parts = configurations(usable)
    else:
        parts = _usable_configurations(runs, configs)
        found = baseline is None or any(baseline in map(_RUN_ID, c.runs) for c in parts)
    if not found:
        known = {r.run_id for r in runs}
        why = "has no summary/tokens_per_sec or device count" if baseline in known else "is not among the compared runs"
        accepted = [r.run_id for c in parts for r in c.runs]
        raise ValueError(f"--baseline {baseline!r} {why}; {accepted_ids(accepted)}")
    groups: dict[tuple, list[Configuration]] = {}
    for c in parts:
        groups.setdefault(tuple(c.tag(k) for k in SAME_JOB), []).append(c)
    out: list[ScalingRow] = []
    for key, members in groups.items():
        strategies = {c.tag(names.PAR_STRATEGY) for c in members} - {"single"}
        for strategy in sorted(strategies, key=str) or ["single"]:
            sub = [c for c in members if c.tag(names.PAR_STRATEGY) in ("single", strategy)]
            out += _scale_group(sub, baseline, f"{key[2]} {key[0]} {key[1]} seq {key[3]} {strategy}")
    return out


#: Run ids a baseline error names before "and N more".
SHOWN_IDS = 10


def accepted_ids(ids: list[str]) -> str:
    """``"accepted: 'a', 'b' and 3 more"``: the run ids a baseline may name (the compared runs with tokens/s and a
    device count), at most :data:`SHOWN_IDS` of them shown, sorted; ``"no compared run has ..."`` where none."""
    if not ids:
        return "no compared run has summary/tokens_per_sec and a device count"
    ids = sorted(set(ids))
    more = f" and {len(ids) - SHOWN_IDS} more" if len(ids) > SHOWN_IDS else ""
    return "accepted: " + ", ".join(map(repr, ids[:SHOWN_IDS])) + more


def _usable_configurations(runs: list[RunRecord], configs: list[Configuration]) -> list[Configuration]:
    """The part of each of ``configs`` (:func:`configurations` of ``runs``) whose runs have a device count and
    ``summary/tokens_per_sec`` above 0, in order of each part's first run among ``runs``.

    A configuration's runs share their device count (``llmeff.accelerator.count`` is in its key); where every
    run's tokens/s is above 0 (its :meth:`~Configuration.values`, which its estimate reads again) the part is
    the configuration itself, with the figures it already worked out."""
    out, cut = [], False
    for c in configs:
        if not c.runs or not c.runs[0].devices:
            continue
        tps = c.values(names.SUM_TOKENS_PER_SEC)
        if None not in tps and all(map(_ABOVE_0, tps)):
            out.append(c)
            continue
        sub = [r for r in c.runs if (r.metrics.get(names.SUM_TOKENS_PER_SEC) or 0) > 0]
        if sub:
            out.append(Configuration(c.key, sub))
            cut = True
    if not cut:  # each part starts where its configuration does: already in order of first run
        return out
    at = dict(zip(map(id, runs), range(len(runs))))
    return sorted(out, key=lambda c: at[id(c.runs[0])])


def _pick_baseline(members: list[Configuration], baseline: str | None) -> Configuration:
    chosen = None if baseline is None else next((c for c in members if baseline in map(_RUN_ID, c.runs)), None)
    if chosen is not None:
        return chosen
    fewest = min(c.devices for c in members)
    at = [c for c in members if c.devices == fewest]
    return next((c for c in at if c.stable), at[0])


def _scale_group(members: list[Configuration], baseline: str | None, label: str) -> list[ScalingRow]:
    if len({c.devices for c in members}) < 2:
        return []
    base = _pick_baseline(members, baseline)
    t0 = base.estimate(names.SUM_TOKENS_PER_SEC)
    n0 = base.devices
    rows = []
    for c in sorted(members, key=lambda c: c.devices):
        if c is base or c.devices == n0:  # same device count: no scaling to measure
            continue
        t, n = c.estimate(names.SUM_TOKENS_PER_SEC), c.devices
        threads, threads0 = c.tag(names.THREADS), base.tag(names.THREADS)
        if threads and threads0 and threads != threads0:  # the ratio would measure threads, not scaling
            rows.append(ScalingRow(label, c.label, base.label, tuple(map(_RUN_ID, c.used)),
                                   tuple(map(_RUN_ID, base.used)), n, n0, t, t0, float("nan"), None, None,
                                   _kind(c, base), (), refused=(
                                       f"{threads} threads a process against {threads0} (llmeff.threads): a "
                                       "process's speed moves with its threads, so the ratio would not be scaling; "
                                       "run both with the same OMP_NUM_THREADS")))
            continue
        eff = t.mean / (t0.mean * n / n0)
        low = high = None
        if t.has_interval and t0.has_interval and t0.high > 0:
            low = t.low / t0.high * n0 / n
            # a baseline interval reaching 0 (few, scattered repeats) bounds the ratio below only
            high = t.high / t0.low * n0 / n if t0.low > 0 else None
        kind = _kind(c, base)
        rows.append(ScalingRow(label, c.label, base.label, tuple(map(_RUN_ID, c.used)),
                               tuple(map(_RUN_ID, base.used)), n, n0, t, t0, eff, low, high, kind,
                               tuple(_superlinear_flags(c, base, eff, low, kind))))
    return rows


def _kind(c: Configuration, base: Configuration) -> str:
    gbt, gbt0 = c.tag(names.GLOBAL_BATCH_TOKENS), base.tag(names.GLOBAL_BATCH_TOKENS)
    if names.SHAPE_DYNAMIC in (gbt, gbt0):  # two 'dynamic' batches are not the same batch
        return "batch varies"
    if gbt and gbt == gbt0:
        return "strong"
    if _batch_per_device(c) is not None and _batch_per_device(c) == _batch_per_device(base):
        return "weak"
    return "batch differs"


def _superlinear_flags(c: Configuration, base: Configuration, eff: float, low: float | None, kind: str) -> list[str]:
    """What could explain an efficiency above :data:`SUPERLINEAR` (empty when it is not above)."""
    if eff <= SUPERLINEAR:
        return []
    flags = []
    if low is None:
        flags.append("no interval on one side: cannot tell it from noise")
    elif low <= 1.0:
        flags.append(f"its interval reaches {low:.3g}: within noise of linear scaling")
    if not base.stable:
        flags.append(f"baseline {base.label} has no stable repeat ({base.used[0].tags.get(names.STABILITY, 'no stability tag')})")
    o0, o = base.mean(names.SUM_HOST_OTHER_CPU), c.mean(names.SUM_HOST_OTHER_CPU)
    if o0 is not None and o is not None and o0 > o + 0.05:
        flags.append(f"the baseline shared its host more (other processes {o0:.0%} vs {o:.0%} of host CPU)")
    if c.tag(names.DATASET) != base.tag(names.DATASET):
        flags.append("different data")
    if kind == "strong":
        flags.append(f"strong scaling: each device holds 1/{c.devices // max(1, base.devices)} of the baseline's batch "
                     "(a smaller working set fits caches better)")
    if kind == "batch differs":
        flags.append("the batch differs: the ratio mixes scaling with a batch-size effect")
    if kind == "batch varies":
        flags.append("the batch shape varied within runs (dynamic padding or packing, llmeff.seq_len.range): "
                     "strong or weak scaling cannot be told, and the ratio may mix in a batch-size effect")
    return flags
