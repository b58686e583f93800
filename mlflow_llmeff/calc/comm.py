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
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["bus_factor", "algbw_gbps", "busbw_gbps", "LinkPeak", "LINKS", "link_peak", "nvlink_peak",
           "pcie_peak", "nic_peak", "union_length", "exposed_time", "TrafficShape", "CommEstimate"]

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
    """A link's datasheet rate per device and direction.

    Attributes:
        link: e.g. ``NVLink 4``, ``PCIe 5.0 x16``, ``InfiniBand NDR``.
        gbps: GB/s (1e9 bytes/s) per device and direction: what a ring collective's busbw can reach.
        source: the datasheet or specification.
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


def nic_peak(kind: str, ports: int, devices_per_node: int) -> LinkPeak:
    """Inter-node peak per device: ``ports`` adapters of ``kind`` shared by ``devices_per_node`` devices.

    Raises:
        ValueError: for a kind not in :data:`NIC_RATES`, or counts < 1.
    """
    if kind not in NIC_RATES:
        raise ValueError(f"network kind {kind!r} is not known; known: {', '.join(NIC_RATES)}")
    if ports < 1 or devices_per_node < 1:
        raise ValueError(f"ports={ports}, devices_per_node={devices_per_node}: both must be >= 1")
    gbit, source = NIC_RATES[kind]
    return LinkPeak(f"{ports} x {kind} for {devices_per_node} devices", gbit / 8 * ports / devices_per_node, source)


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
              devices_per_node: int = 1) -> tuple[LinkPeak | None, str]:
    """The link a run's collectives cross and its peak, or None with the reason.

    Args:
        backend: the process group's backend (``nccl``, ``gloo``, ...).
        nodes: machines taking part (> 1: the network is the bottleneck link).
        nvlink: ``(version, active links)`` of one GPU, when it has NVLink.
        pcie: ``(generation, width)`` of one GPU's PCIe link.
        nic: ``(kind, ports)`` of the machine's network adapters (a :data:`NIC_RATES` kind).
        devices_per_node: devices sharing the network adapters.

    Returns:
        ``(LinkPeak, "")`` or ``(None, "unknown: <why>")``.
    """
    if backend != "nccl":
        where = "TCP between machines" if nodes > 1 else "shared memory / loopback TCP of one host"
        return None, (f"unknown: {backend} collectives go through {where}; no link datasheet applies "
                      "(the peak table covers NVLink, PCIe and InfiniBand/RoCE under NCCL)")
    if nodes > 1:
        if nic is None:
            return None, "unknown: several machines, and no InfiniBand/RoCE adapter rate was readable (/sys/class/infiniband)"
        return nic_peak(nic[0], nic[1], devices_per_node), ""
    if nvlink is not None and nvlink[1] > 0:
        return nvlink_peak(*nvlink), ""
    if pcie is not None:
        return pcie_peak(*pcie), ""
    return None, "unknown: NVML reported neither NVLink nor a PCIe link for the GPU"


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
