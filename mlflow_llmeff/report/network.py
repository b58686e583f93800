"""The network section of a comparison: per configuration, how its collectives used the link between devices.

A pure calculator over :class:`~mlflow_llmeff.report.repeats.Configuration` values, beside the memory
section (:mod:`mlflow_llmeff.report.memory`), reading the keys a multi-process run already logs
(``docs/metrics.md``; ``docs/parallelism.md``):

* nodes: ``llmeff.nodes`` (machines taking part) and the devices of the run (``llmeff.accelerator.count``);
* all-reduce bus bandwidth: ``comm/allreduce_busbw_gbps`` (nccl-tests' busbw = algbw x 2(n-1)/n, GB/s
  = 1e9 bytes/s), measured by the communication probe at the start of the run;
* the link's peak and where it comes from: ``llmeff.comm.peak_gbps`` and ``llmeff.comm.peak.source``
  (NVLink/PCIe generation, the InfiniBand/RoCE adapter's datasheet, the interface toward the head
  with its tc shaper's rate or sysfs line speed, or the user's ``link_peak_gbps``);
* utilisation of the link: ``comm/busbw_utilization`` = busbw / peak, never clipped (above 1,
  ``llmeff.comm.peak.exceeded`` says why);
* exposed communication: ``summary/comm_exposed_fraction``, the share of a profiled step spent in
  collectives not overlapped with compute;
* the straggler: ``summary/straggler_ratio`` (slowest rank's compute time per steady step / the
  median rank's) and ``llmeff.straggler.rank`` (which rank, on which host, and the phase most
  above the median rank's).

A configuration appears when any of :data:`NETWORK_KEYS` is logged by one of its repeats or it spans
more than one node; single-process runs, which log none of these, give no section. Figures are the
repeats' means (:meth:`Configuration.estimate`); tags are the first repeat's (repeats share their
conditions). An absent figure is an empty cell, with the reason the run gives where it gave one
(``llmeff.comm.peak.source`` for an unknown peak).
"""

from __future__ import annotations

from mlflow_llmeff import names
from mlflow_llmeff.report.headline import Cell, Headline
from mlflow_llmeff.report.repeats import Configuration

__all__ = ["network_table", "NETWORK_KEYS", "NETWORK_COLUMNS", "straggler_text"]

#: The metric keys that make a configuration appear in the network section.
NETWORK_KEYS = (names.COMM_ALLREDUCE_BUSBW, names.COMM_BUSBW_UTIL, names.SUM_COMM_EXPOSED, names.SUM_STRAGGLER_RATIO)

#: The section's columns, in order.
NETWORK_COLUMNS = ["configuration", "nodes", "devices", "all-reduce busbw GB/s", "link peak GB/s",
                   "busbw / link", "link (source of its peak)", "exposed comm", "straggler ratio",
                   "straggler (host, phase)"]


def _mean(c: Configuration, key: str) -> float | None:
    e = c.estimate(key)
    return e.mean if e is not None else None


def _num(v: float | None, fmt: str) -> Cell:
    return Cell("" if v is None else format(v, fmt), v)


def _pct(v: float | None) -> Cell:
    return Cell("" if v is None else f"{v:.1%}", v)


def _int_tag(c: Configuration, key: str) -> Cell:
    v = c.tag(key) or ""
    return Cell(v, int(v)) if v.isdigit() else Cell(v, None)


def straggler_text(tag: str | None) -> str:
    """The straggler's rank, host and phase from ``llmeff.straggler.rank``: the part before its first ';'
    (``rank 1 on host node-1: backward 2.3x the median rank (41.2 vs 17.9 ms/step)``); the compute and
    wait figures after it stay in the cell's title. '' without the tag."""
    return (tag or "").split(";")[0].strip()


def _multi_node(c: Configuration) -> bool:
    nodes = c.tag(names.NODES) or ""
    return nodes.isdigit() and int(nodes) > 1


def network_table(configs: list[Configuration]) -> Headline | None:
    """The network section: one row per configuration that measured its collectives, in ``configs``' order.

    Columns (:data:`NETWORK_COLUMNS`): configuration, nodes, devices, all-reduce busbw (GB/s, 3
    significant figures), the link's peak (GB/s, as tagged), busbw over that peak (a percentage, 1
    decimal), the link and the source of its peak, the exposed communication share (a percentage),
    the straggler ratio (3 significant figures) and the straggler's rank, host and phase
    (:func:`straggler_text`; the whole tag in the cell's title).

    Returns:
        None when no configuration holds any of :data:`NETWORK_KEYS` and none spans two nodes.
    """
    rows, shown, notes = [], [], set()
    for c in configs:
        if not (any(c.estimate(k) is not None for k in NETWORK_KEYS) or _multi_node(c)):
            continue
        peak_tag, source = c.tag(names.COMM_PEAK_GBPS) or "", c.tag(names.COMM_PEAK_SOURCE) or ""
        try:
            peak = float(peak_tag)
        except ValueError:
            peak = None
        util = _mean(c, names.COMM_BUSBW_UTIL)
        if util is not None and util > 1:
            notes.add("busbw / link above 100%: logged as measured, never clipped; llmeff.comm.peak.exceeded of "
                      "the run says why (a wrong peak or a shaper's burst, traffic that did not cross the link)")
        strag = c.tag(names.STRAGGLER_RANK) or ""
        rows.append([Cell(c.label, c.label), _int_tag(c, names.NODES), _int_tag(c, names.ACCEL_COUNT),
                     _num(_mean(c, names.COMM_ALLREDUCE_BUSBW), ".3g"),
                     Cell(f"{peak:.3g}" if peak is not None else peak_tag, peak),
                     _pct(util), Cell(source, source),
                     _pct(_mean(c, names.SUM_COMM_EXPOSED)),
                     _num(_mean(c, names.SUM_STRAGGLER_RATIO), ".3g"),
                     Cell(straggler_text(strag), straggler_text(strag), title=strag)])
        shown.append(c)
    if not rows:
        return None
    foot = ["busbw: nccl-tests' bus bandwidth of an all-reduce (algbw x 2(n-1)/n, 1e9 bytes/s) measured at the "
            "start of the run (comm/allreduce_busbw_gbps); busbw / link: against the peak of the link the "
            "collectives cross (comm/busbw_utilization; across machines the node's network rate); exposed comm: "
            "share of a profiled step in collectives not overlapped with compute (summary/comm_exposed_fraction); "
            "straggler ratio: slowest rank's compute time per steady step / the median rank's "
            "(summary/straggler_ratio; docs/parallelism.md)"]
    return Headline(list(NETWORK_COLUMNS), rows, shown, foot + sorted(notes))
