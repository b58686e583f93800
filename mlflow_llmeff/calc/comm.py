"""Communication arithmetic: bus bandwidth, link peaks, exposed time and bytes per step (pure).

No torch, no I/O: the probe and the step sampler (:mod:`mlflow_llmeff.meters.commprobe`) measure, this
module turns their timings and sizes into the figures of ``docs/parallelism.md``
("Communication"), and ``llmeff plan`` predicts the same bytes per step from the model shape.

Bus bandwidth follows nccl-tests (``doc/PERFORMANCE.md`` of github.com/NVIDIA/nccl-tests):
``algbw = size / time`` and ``busbw = algbw x factor`` with the factor of the collective over
``n`` ranks: all-reduce ``2(n-1)/n``, all-gather and reduce-scatter ``(n-1)/n`` (``size`` is the
whole output of an all-gather and the whole input of a reduce-scatter), all-to-all ``(n-1)/n``,
broadcast and reduce ``1``. ``busbw`` is what each rank's link carries per second with the ring
algorithm, so it compares across rank counts and against a link's datasheet rate. Bytes per step
use the same factors: the bus bytes a device sends per optimizer step, which each strategy of
:mod:`mlflow_llmeff.parallel` predicts (its ``bus_bytes``) with :func:`bus_factor`.

The peak a busbw is held against (:func:`internode_peak_gbps`, :func:`link_peak`). Inside one node
it is one device's link (NVLink, PCIe). Across nodes it is the node's aggregate network rate, ``k x R``
for ``k`` adapters of ``R`` GB/s, whatever the ``g`` devices per node, capped by one device's
intra-node link when ``g > 1``::

    peak = min(k x R, B_intra)        (B_intra only when g > 1)

Why: a ring over ``n`` ranks with each node's ``g`` ranks adjacent moves ``2(n-1)/n x S`` bytes
(all-reduce; ``(n-1)/n x S`` for all-gather and reduce-scatter) over every edge of the ring, and
each node has one inter-node edge per ring. NCCL runs one ring per channel and spreads the channels
over the node's adapters, so the node's inter-node edges together carry ``2(n-1)/n x S`` over
``k`` adapters: ``time >= 2(n-1)/n x S / (k R)``, and ``busbw = S / time x 2(n-1)/n <= k R``. The
``g`` ranks of a node share one set of inter-node edges; they do not each need ``1/g`` of the
adapters (each intra-node edge carries the same bytes over a device's own NVLink/PCIe link, hence
the cap). Rail-optimized nodes (one adapter per GPU, ``k = g``, each on its own rail) read the same
``k R``; each rail then carries ``1/k`` of it, so the utilization of the node is also each rail's.
Sources: nccl-tests ``doc/PERFORMANCE.md`` (busbw is held against the hardware's peak bandwidth);
NVIDIA's answers in NVIDIA/nccl#812 (a DGX-A100, 8 GPUs with 8 x 200 Gb/s InfiniBand cards,
measures 192 GB/s of all-reduce busbw: 0.96 of 8 x 25 = 200 GB/s; the earlier formula divided the
node's 200 GB/s by its 8 GPUs, 25 GB/s, and read 7.68) and NVIDIA/nccl#412 (one 200 Gb/s card
under 8 GPUs: about 24 GB/s inter-node; more cards give more, up to the node's NVLink bandwidth:
the cap); on two nodes NCCL's tree can exceed the network's rate (NVIDIA/nccl-tests#196,
NVIDIA/nccl#946; see :func:`utilization`).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["bus_factor", "algbw_gbps", "busbw_gbps", "LinkPeak", "LINKS", "link_peak", "nvlink_peak",
           "pcie_peak", "nic_peak", "internode_peak_gbps", "given_peak", "utilization", "union_length",
           "exposed_time", "probe_message_bytes", "TrafficShape", "CommEstimate"]

#: Collectives the factors know (torch.distributed / c10d names).
OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "reduce", "send", "recv")


def bus_factor(op: str, n: int) -> float:
    """The nccl-tests bus-bandwidth factor of collective ``op`` over ``n`` ranks (see the module docstring).

    Raises:
        ValueError: for an unknown ``op`` or ``n < 1``.
    """
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"ranks n={n!r} is not accepted; give an int >= 1")
    if op == "all_reduce":
        return 2.0 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    if op in ("broadcast", "reduce", "send", "recv"):
        return 1.0
    raise ValueError(f"collective {op!r} is not accepted; use one of: {', '.join(OPS)}")


def algbw_gbps(size_bytes: float, seconds: float) -> float:
    """Algorithm bandwidth in GB/s (1e9 bytes/s): ``size / time``.

    Raises:
        ValueError: when ``seconds <= 0`` or ``size_bytes < 0``.
    """
    if seconds <= 0 or size_bytes < 0:
        raise ValueError(f"size_bytes={size_bytes!r}, seconds={seconds!r}: need size >= 0 and time > 0")
    return size_bytes / seconds / 1e9


def busbw_gbps(op: str, size_bytes: float, seconds: float, n: int) -> float:
    """Bus bandwidth in GB/s: :func:`algbw_gbps` x :func:`bus_factor` (nccl-tests PERFORMANCE.md)."""
    return algbw_gbps(size_bytes, seconds) * bus_factor(op, n)


# --------------------------------------------------------------------------- link peaks
@dataclass(frozen=True)
class LinkPeak:
    """A link's rate per direction: the busbw peak of a rank whose collectives cross it.

    Attributes:
        link: e.g. ``NVLink 4``, ``PCIe 5.0 x16``, ``8 x InfiniBand NDR for 8 devices``, ``eth0``.
        gbps: GB/s (1e9 bytes/s) per direction: what a ring collective's busbw can reach (one
            device's link inside a node; the node's aggregate adapters across nodes).
        source: the datasheet, specification, interface reading or option it comes from.
    """

    link: str
    gbps: float
    source: str


#: NVLink: GB/s per link and direction, by NVLink version (NVML's nvmlDeviceGetNvLinkVersion).
NVLINK_PER_LINK_GBPS = {2: 25.0, 3: 25.0, 4: 25.0, 5: 50.0}
_NVLINK_SOURCE = {
    2: "NVIDIA Tesla V100 datasheet: NVLink 2.0, 6 links, 300 GB/s bidirectional (25 GB/s per link and direction)",
    3: "NVIDIA A100 datasheet: NVLink 3.0, 12 links, 600 GB/s bidirectional (25 GB/s per link and direction)",
    4: "NVIDIA H100/H200 datasheets: NVLink 4.0, 18 links, 900 GB/s bidirectional (25 GB/s per link and direction)",
    5: "NVIDIA Blackwell (B200/GB200) datasheet: NVLink 5.0, 18 links, 1.8 TB/s bidirectional (50 GB/s per link and direction)",
}
#: PCIe: GB/s per lane and direction by generation (transfer rate x encoding / 8).
PCIE_PER_LANE_GBPS = {3: 8 * 128 / 130 / 8, 4: 16 * 128 / 130 / 8, 5: 32 * 128 / 130 / 8, 6: 64 * 242 / 256 / 8}
_PCIE_SOURCE = {
    3: "PCI-SIG PCIe 3.0 base specification: 8 GT/s per lane, 128b/130b encoding",
    4: "PCI-SIG PCIe 4.0 base specification: 16 GT/s per lane, 128b/130b encoding",
    5: "PCI-SIG PCIe 5.0 base specification: 32 GT/s per lane, 128b/130b encoding",
    6: "PCI-SIG PCIe 6.0 base specification: 64 GT/s per lane, PAM4 with FLIT (242/256)",
}
#: Network adapters: line rate in Gb/s per port and the datasheet naming it.
NIC_RATES = {
    "InfiniBand EDR": (100, "NVIDIA ConnectX-5 datasheet: EDR InfiniBand 100 Gb/s per port"),
    "InfiniBand HDR": (200, "NVIDIA ConnectX-6 datasheet: HDR InfiniBand 200 Gb/s per port"),
    "InfiniBand NDR": (400, "NVIDIA ConnectX-7 datasheet: NDR InfiniBand 400 Gb/s per port"),
    "InfiniBand XDR": (800, "NVIDIA ConnectX-8 SuperNIC datasheet: XDR InfiniBand 800 Gb/s per port"),
    "RoCE 100GbE": (100, "IEEE 802.3 100GBASE line rate; NVIDIA ConnectX-5/6 datasheets (RoCE v2)"),
    "RoCE 200GbE": (200, "IEEE 802.3 200GBASE line rate; NVIDIA ConnectX-6 datasheet (RoCE v2)"),
    "RoCE 400GbE": (400, "IEEE 802.3 400GBASE line rate; NVIDIA ConnectX-7 / BlueField-3 datasheets (RoCE v2)"),
}


def nvlink_peak(version: int, links: int) -> LinkPeak:
    """NVLink peak of one GPU with ``links`` active links of ``version`` (per direction).

    Raises:
        ValueError: for a version not in :data:`NVLINK_PER_LINK_GBPS` or ``links < 1``.
    """
    if version not in NVLINK_PER_LINK_GBPS:
        raise ValueError(f"NVLink version {version!r} is not known; known: {sorted(NVLINK_PER_LINK_GBPS)}")
    if links < 1:
        raise ValueError(f"links={links} must be >= 1")
    return LinkPeak(f"NVLink {version} x{links}", NVLINK_PER_LINK_GBPS[version] * links, _NVLINK_SOURCE[version])


def pcie_peak(generation: int, width: int) -> LinkPeak:
    """PCIe peak of a ``width``-lane link of ``generation`` (per direction).

    Raises:
        ValueError: for a generation not in :data:`PCIE_PER_LANE_GBPS` or ``width < 1``.
    """
    if generation not in PCIE_PER_LANE_GBPS:
        raise ValueError(f"PCIe generation {generation!r} is not known; known: {sorted(PCIE_PER_LANE_GBPS)}")
    if width < 1:
        raise ValueError(f"width={width} must be >= 1")
    return LinkPeak(f"PCIe {generation}.0 x{width}", PCIE_PER_LANE_GBPS[generation] * width, _PCIE_SOURCE[generation])


def internode_peak_gbps(nic_gbps: float, nics: int, devices_per_node: int = 1,
                        intra_gbps: float | None = None) -> float:
    """Bus-bandwidth peak of a collective across nodes, GB/s per rank: ``min(nics x nic_gbps, intra_gbps)``.

    The node's aggregate adapter rate, not a share of it per device (the module docstring derives
    it; NVIDIA/nccl#812: 8 x 200 Gb/s for 8 GPUs is 200 GB/s), capped by one device's intra-node
    link (``intra_gbps``) when ``devices_per_node > 1`` (each intra-node edge of the ring carries the
    same bytes over that link).

    Args:
        nic_gbps: one adapter's line rate per direction, GB/s (1e9 bytes/s; 200 Gb/s = 25 GB/s).
        nics: adapters of one node the collectives use (>= 1).
        devices_per_node: ranks (devices) per node (>= 1).
        intra_gbps: one device's intra-node link per direction (NVLink, PCIe), GB/s, or None.

    Raises:
        ValueError: for a rate <= 0 or counts < 1.
    """
    if nic_gbps <= 0 or (intra_gbps is not None and intra_gbps <= 0):
        raise ValueError(f"nic_gbps={nic_gbps!r}, intra_gbps={intra_gbps!r}: rates must be > 0 GB/s")
    if nics < 1 or devices_per_node < 1:
        raise ValueError(f"nics={nics}, devices_per_node={devices_per_node}: both must be >= 1")
    peak = nics * nic_gbps
    if devices_per_node > 1 and intra_gbps is not None:
        peak = min(peak, intra_gbps)
    return peak


def nic_peak(kind: str, ports: int, devices_per_node: int = 1) -> LinkPeak:
    """Inter-node peak of a rank: the node's ``ports`` adapters of ``kind`` together (:func:`internode_peak_gbps`),
    shared by ``devices_per_node`` devices but not divided among them.

    Raises:
        ValueError: for a kind not in :data:`NIC_RATES`, or counts < 1.
    """
    if kind not in NIC_RATES:
        raise ValueError(f"network kind {kind!r} is not known; known: {', '.join(NIC_RATES)}")
    if ports < 1 or devices_per_node < 1:
        raise ValueError(f"ports={ports}, devices_per_node={devices_per_node}: both must be >= 1")
    gbit, source = NIC_RATES[kind]
    return LinkPeak(f"{ports} x {kind} for {devices_per_node} devices", internode_peak_gbps(gbit / 8, ports),
                    source)


def given_peak(gbps: float) -> LinkPeak:
    """The peak the user gave (``link_peak_gbps``), GB/s per rank and direction.

    Raises:
        ValueError: for ``gbps <= 0``.
    """
    if not gbps > 0:
        raise ValueError(f"link_peak_gbps={gbps!r} must be > 0 GB/s (1e9 bytes/s; 200 Mbit/s = 0.025)")
    return LinkPeak("link_peak_gbps", float(gbps), "given by the user (link_peak_gbps)")


def utilization(busbw: float, peak_gbps: float) -> tuple[float, str | None]:
    """``(busbw / peak, why it exceeds 1 or None)``: never clipped.

    A ratio above 1 means the peak is not this traffic's bound: it is wrong (a mistyped
    ``link_peak_gbps``, a shaper's burst allowance, a datasheet row for another link), or the bytes
    did not all cross that link: on two nodes NCCL's tree algorithm sends half the ring's bytes
    over the network and its busbw reaches up to twice the network's rate (NVIDIA/nccl-tests#196,
    NVIDIA/nccl#946: ``NCCL_ALGO=Ring`` measures the network); ranks of one node exchange through
    shared memory or loopback; NVLink SHARP or in-network reduction, or compression, moves fewer
    bytes than the ring's.

    Raises:
        ValueError: for ``peak_gbps <= 0`` or ``busbw < 0``.
    """
    if peak_gbps <= 0 or busbw < 0:
        raise ValueError(f"busbw={busbw!r}, peak_gbps={peak_gbps!r}: need busbw >= 0 and peak > 0")
    ratio = busbw / peak_gbps
    if ratio <= 1.0:
        return ratio, None
    return ratio, (f"busbw {busbw:.4g} GB/s is {ratio:.3g}x the peak {peak_gbps:.4g} GB/s: the peak is not this "
                   "traffic's bound (a wrong link_peak_gbps or datasheet row, a shaper's burst allowance), or not "
                   "every byte crossed that link (NCCL's tree on two nodes sends half the ring's bytes over the "
                   "network, up to 2x: NCCL_ALGO=Ring measures the network; shared memory or loopback between "
                   "ranks of one node; NVLink SHARP or in-network reduction; compression)")


def _table() -> tuple[LinkPeak, ...]:
    rows = [nvlink_peak(v, n) for v, n in ((2, 6), (3, 12), (4, 18), (5, 18))]
    rows += [pcie_peak(g, 16) for g in (3, 4, 5, 6)]
    rows += [nic_peak(k, 1, 1) for k in NIC_RATES]
    return tuple(rows)


#: The per-link peaks with their sources, as docs/parallelism.md lists them (one GPU's full NVLink
#: complement, x16 PCIe, one network port per device).
LINKS: tuple[LinkPeak, ...] = _table()


def link_peak(*, backend: str, nodes: int, nvlink: tuple[int, int] | None = None,
              pcie: tuple[int, int] | None = None, nic: tuple[str, int] | None = None,
              devices_per_node: int = 1, interface: tuple[LinkPeak | None, str] | None = None,
              given_gbps: float | None = None) -> tuple[LinkPeak | None, str]:
    """The link a run's collectives cross and its peak, or None with the reason.

    Args:
        backend: the process group's backend (``nccl``, ``gloo``, ...).
        nodes: machines taking part (> 1: the network is the bottleneck link).
        nvlink: ``(version, active links)`` of one GPU, when it has NVLink.
        pcie: ``(generation, width)`` of one GPU's PCIe link.
        nic: ``(kind, ports)`` of the machine's network adapters (a :data:`NIC_RATES` kind).
        devices_per_node: devices sharing the network adapters.
        interface: ``(peak of the interface that routes to the head, or None, why not)``: its
            shaped rate or line speed (:func:`mlflow_llmeff.meters.netpeak.interface_peak`), the
            network's rate where no InfiniBand/RoCE adapter serves the collectives.
        given_gbps: the user's ``link_peak_gbps`` (> 0 wins over everything read here).

    Returns:
        ``(LinkPeak, "")`` or ``(None, "unknown: <why>")``. Across nodes the peak is
        :func:`internode_peak_gbps`: the node's aggregate rate, capped by one GPU's NVLink/PCIe link
        when the node has several.
    """
    if given_gbps:
        return given_peak(given_gbps), ""
    if nodes > 1:
        intra = None
        if backend == "nccl" and devices_per_node > 1:
            intra = (nvlink_peak(*nvlink) if nvlink is not None and nvlink[1] > 0
                     else pcie_peak(*pcie) if pcie is not None else None)
        if backend == "nccl" and nic is not None:
            net = nic_peak(nic[0], nic[1], devices_per_node)
        elif interface is not None and interface[0] is not None:
            net = interface[0]
        else:
            nic_why = "no InfiniBand/RoCE adapter rate was readable (/sys/class/infiniband); " if backend == "nccl" else ""
            where = interface[1] if interface is not None else "the interface toward the head was not read"
            return None, (f"unknown: several machines ({backend}); {nic_why}{where}; give link_peak_gbps "
                          "(GB/s per direction, e.g. 200 Mbit/s = 0.025)")
        if intra is not None and intra.gbps < net.gbps:
            return LinkPeak(f"{intra.link} (below the network's {net.gbps:.4g} GB/s: {net.link})", intra.gbps,
                            intra.source), ""
        return net, ""
    if backend != "nccl":
        return None, (f"unknown: {backend} collectives go through shared memory / loopback TCP of one host; no link "
                      "datasheet applies (the peak table covers NVLink, PCIe and InfiniBand/RoCE under NCCL)")
    if nvlink is not None and nvlink[1] > 0:
        return nvlink_peak(*nvlink), ""
    if pcie is not None:
        return pcie_peak(*pcie), ""
    return None, "unknown: NVML reported neither NVLink nor a PCIe link for the GPU"


#: Seconds a probe's all-reduce lasts at least, at the link's peak (:func:`probe_message_bytes`).
PROBE_MIN_S = 0.5
#: The probe's largest message (bytes): 64 MiB, nccl-tests' customary top size for bus bandwidth.
PROBE_MAX_BYTES = 64 * 2**20


def probe_message_bytes(peak_gbps: float | None, *, nccl: bool) -> int:
    """Bytes of the probe's message: 64 MiB under NCCL, 4 MiB otherwise (gloo over loopback reaches its
    plateau there within a second), doubled until one all-reduce lasts :data:`PROBE_MIN_S` at
    ``peak_gbps`` (at most :data:`PROBE_MAX_BYTES`).

    A slow or shaped link lets a burst through faster than its rate (a tbf bucket, a switch's
    buffers: 256 KB at 200 Mbit/s is 6% of a 4 MiB all-reduce, which read 1.01 of the link); at
    0.5 s of traffic such a burst is under 2%. Measured between two hosts over 200 Mbit/s
    (tests/test_two_hosts.py): 16 MiB, 0.96-0.98 of the link.
    """
    size = (64 if nccl else 4) * 2**20
    if peak_gbps and peak_gbps > 0:
        while size < PROBE_MAX_BYTES and size < peak_gbps * 1e9 * PROBE_MIN_S:
            size *= 2
    return size


# --------------------------------------------------------------------------- exposed time
def _merged(intervals) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted((float(a), float(b)) for a, b in intervals if b > a):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def union_length(intervals) -> float:
    """Length of the union of ``[(start, end), ...]`` (overlaps counted once)."""
    return sum(b - a for a, b in _merged(intervals))


def exposed_time(comm, compute) -> float:
    """Time in the union of ``comm`` intervals not covered by any ``compute`` interval.

    The communication a step waits for: collectives overlapped by computation cost nothing
    (the measure of Holistic Trace Analysis' communication/computation overlap, inverted).
    """
    exposed = 0.0
    cover = _merged(compute)
    for a, b in _merged(comm):
        covered = sum(max(0.0, min(b, d) - max(a, c)) for c, d in cover if d > a and c < b)
        exposed += (b - a) - covered
    return exposed


# --------------------------------------------------------------------------- bytes per step
@dataclass(frozen=True)
class TrafficShape:
    """What a step's collectives carry depends on, besides the strategy and its degrees: the model and
    the step (each parallelism strategy's ``bus_bytes``, :mod:`mlflow_llmeff.parallel`, predicts from it).

    Attributes:
        params: model parameters.
        layer_params: parameters inside the decoder layers (the rest is the FSDP root).
        tp_params: parameters split by the tensor-parallel plan.
        grad_accum: micro-batches per step.
        tokens_per_micro_batch: ``micro_batch_size x seq_len`` on one rank.
        hidden, layers: the model's hidden size and decoder layers.
        precision: ``fp32``, ``bf16`` or ``fp16``.
        reshard_after_forward: FSDP2's setting.
        activation_checkpointing: full recomputation (TP's forward collectives run twice).
    """

    params: int
    layer_params: int
    tp_params: int
    grad_accum: int
    tokens_per_micro_batch: int
    hidden: int
    layers: int
    precision: str
    reshard_after_forward: bool = True
    activation_checkpointing: bool = False

    @property
    def half(self) -> bool:
        """16-bit training (bf16 or fp16)."""
        return self.precision in ("bf16", "fp16")


@dataclass(frozen=True)
class CommEstimate:
    """Predicted bus bytes per device per optimizer step, by part (a strategy's ``bus_bytes``)."""

    parts: dict[str, float]

    @property
    def total(self) -> float:
        return sum(self.parts.values())
