"""Measured communication: a collective probe at start, and sampled steps during training.

* :func:`measure` times all-reduce, all-gather and reduce-scatter over the run's process group at
  one large message and turns the times into nccl-tests bus bandwidth (:mod:`mlflow_llmeff.calc.comm`);
  the result is cached per machine, world size, backend and device like the matmul peak
  (:func:`mlflow_llmeff.meters.hardware.measure_matmul_peak`), in ``<cache dir>/comm.json``.
* :func:`detect_link` names the link those collectives cross and its peak (NVML's NVLink and
  PCIe figures, the InfiniBand/RoCE adapters in ``/sys/class/infiniband``, across machines
  without them the interface toward the head: :mod:`mlflow_llmeff.meters.netpeak`), or the
  user's ``link_peak_gbps``.
* :class:`StepSampler` looks at a few warm-up steps of each attempt (never a steady-state one, so
  the steady-state figures carry no sampling overhead): the second is counted by
  :class:`CommCounter` (every collective's size and ranks, through a ``TorchDispatchMode``), the
  third and fourth are profiled with ``torch.profiler`` for the collective time not overlapped
  with compute. The first is left alone: ``FlopCounterMode`` counts it, and some engines run
  other collectives in it (DeepSpeed ZeRO-3 traces the module order there, gathering more).

Every function that takes part in a collective must be called on every rank in the same order.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from mlflow_llmeff.meters import collectives
from mlflow_llmeff.calc import comm
from mlflow_llmeff import names
from mlflow_llmeff.meters.probes import tensor_bytes

__all__ = ["ProbeResult", "measure", "detect_link", "probe_figures", "CommCounter", "StepSampler", "kineto_notes_dropped"]

_OPS = ("all_reduce", "all_gather", "reduce_scatter")


#: A note Kineto (torch.profiler's library) writes to the process's stderr as a profile starts and stops:
#: ``USDT:2026-12-07 17:36:15 8199:8199 SyncActivityProfilerHandler.cpp:52] profiler_start``; a trial found four
#: in every 2-process CPU run's output. Its own ``KINETO_LOG_LEVEL`` cannot drop them without its errors.
_KINETO_NOTE = re.compile(rb"^(?:USDT|STAGE):\S+ \S+ \d+:\d+ \S+\.cpp:\d+\] ")


@contextlib.contextmanager
def kineto_notes_dropped():
    """Inside, file descriptor 2 (stderr, where Kineto's C++ writes) goes to a temporary file; after, every
    line of it is written to the real stderr but Kineto's start and stop notes (:data:`_KINETO_NOTE`). Meant
    for the milliseconds of a profiler's start or stop: another thread's output then comes a moment late,
    never lost."""
    import sys
    import tempfile

    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            kept = [line for line in tmp.read().splitlines(keepends=True) if not _KINETO_NOTE.match(line)]
            if kept:
                os.write(2, b"".join(kept))


@dataclass(frozen=True)
class ProbeResult:
    """Bus bandwidth of the three collectives (GB/s) and how they were measured."""

    busbw_gbps: dict[str, float]
    ranks: int
    backend: str
    size_bytes: int
    iterations: int
    cached: bool

    def describe(self) -> str:
        how = "cached" if self.cached else "measured"
        return (f"{how}: {self.backend}, {self.ranks} ranks, {self.size_bytes / 2**20:g} MiB messages, best of "
                f"{self.iterations} timed iterations after 2 warm-up, slowest rank's time; busbw by nccl-tests factors")


def _cache_key(backend: str, world: int, nodes: int, device_name: str, size: int) -> str:
    import socket

    import torch

    return f"{backend}|world={world}|nodes={nodes}|{device_name}|{socket.gethostname()}|{size}B|torch {torch.__version__}"


def _time_op(op: str, size_bytes: int, device, iterations: int) -> float:
    """Best seconds of ``op`` at ``size_bytes`` (nccl-tests size convention), slowest rank per iteration."""
    import torch
    import torch.distributed as dist

    n = dist.get_world_size()
    count = size_bytes // 4 // n * n  # fp32 elements, divisible by the ranks
    big = torch.ones(count, dtype=torch.float32, device=device)
    small = torch.ones(count // n, dtype=torch.float32, device=device)

    # torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor (*_single); either is one c10d op
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

    def run():
        if op == "all_reduce":
            dist.all_reduce(big)
        elif op == "all_gather":
            gather(big, small)
        else:
            scatter(small, big)

    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    best = float("inf")
    for i in range(2 + iterations):
        dist.barrier()
        sync()
        t0 = time.perf_counter()
        run()
        sync()
        dt = collectives.all_reduce([time.perf_counter() - t0], op="max")[0]
        if i >= 2:
            best = min(best, dt)
    return best


def measure(device, *, nodes: int = 1, device_name: str = "", cache_dir: str | Path | None = None,
            refresh: bool = False, size_bytes: int | None = None, iterations: int | None = None) -> ProbeResult | None:
    """Bus bandwidth of all-reduce, all-gather and reduce-scatter over the world group (a collective).

    Args:
        device: this rank's torch device (CUDA tensors under NCCL, else CPU).
        nodes: machines taking part (part of the cache key).
        device_name: accelerator name (part of the cache key).
        cache_dir: folder of ``comm.json``; default :func:`mlflow_llmeff.meters.hardware.default_cache_dir`.
        refresh: measure even when rank 0 has a cached value.
        size_bytes: message size (nccl-tests size); default 64 MiB under NCCL, 4 MiB otherwise
            (gloo over loopback reaches its plateau there within a second).
        iterations: timed iterations (the best counts); default 5 under NCCL, 3 otherwise.

    Returns:
        The result, or None without a process group of more than one rank.
    """
    dist = collectives.process_group()
    if dist is None or dist.get_world_size() < 2:
        return None
    from mlflow_llmeff.meters.hardware import default_cache_dir

    backend = str(dist.get_backend())
    nccl = backend == "nccl"
    size = int(size_bytes or (64 if nccl else 4) * 2**20)
    iters = int(iterations or (5 if nccl else 3))
    world = dist.get_world_size()
    key = _cache_key(backend, world, nodes, device_name, size)
    file = Path(cache_dir or default_cache_dir()) / "comm.json"
    cache: dict = {}
    hit = [0.0, 0.0, 0.0, 0.0]
    if dist.get_rank() == 0 and not refresh and file.is_file():
        try:
            cache = json.loads(file.read_text())
            entry = cache.get(key)
            if isinstance(entry, dict) and all(op in entry for op in _OPS):
                hit = [1.0] + [float(entry[op]) for op in _OPS]
        except (OSError, ValueError):
            cache = {}
    hit = collectives.all_reduce(hit)  # rank 0's cache decides for every rank (a probe is a collective)
    if hit[0]:
        return ProbeResult(dict(zip(_OPS, hit[1:])), world, backend, size, iters, True)
    seconds = {op: _time_op(op, size, device, iters) for op in _OPS}
    busbw = {op: comm.busbw_gbps(op, size, s, world) for op, s in seconds.items()}
    if dist.get_rank() == 0:
        try:
            if file.is_file() and not cache:
                cache = json.loads(file.read_text())
            cache[key] = {**busbw, "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
            file.parent.mkdir(parents=True, exist_ok=True)
            tmp = file.with_suffix(".json.tmp")
            tmp.write_text(json.dumps(cache, indent=1, sort_keys=True))
            tmp.replace(file)
        except (OSError, ValueError):
            pass  # an unwritable cache only costs a re-measurement next time
    return ProbeResult(busbw, world, backend, size, iters, False)


# --------------------------------------------------------------------------- the link and its peak
def _nvml_links(index: int) -> tuple[tuple[int, int] | None, tuple[int, int] | None]:
    """``(nvlink (version, active links) or None, pcie (generation, width) or None)`` from NVML."""
    try:
        import pynvml
    except ImportError:
        return None, None
    nvlink = pcie = None
    try:
        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(index)
        active, version = 0, 0
        for link in range(18):  # NVML_NVLINK_MAX_LINKS
            try:
                if pynvml.nvmlDeviceGetNvLinkState(h, link) == pynvml.NVML_FEATURE_ENABLED:
                    active += 1
                    version = max(version, int(pynvml.nvmlDeviceGetNvLinkVersion(h, link)))
            except pynvml.NVMLError:
                break
        if active:
            nvlink = (version, active)
        try:
            pcie = (int(pynvml.nvmlDeviceGetMaxPcieLinkGeneration(h)), int(pynvml.nvmlDeviceGetMaxPcieLinkWidth(h)))
        except pynvml.NVMLError:
            pcie = None
    except Exception:  # noqa: BLE001 - no NVML: no link figures
        return None, None
    return nvlink, pcie


def _nics(root: str = "/sys/class/infiniband") -> tuple[str, int] | None:
    """``(kind, active ports)`` of the fastest kind of RDMA adapter ports, from sysfs, or None."""
    found: dict[str, int] = {}
    try:
        devices = os.listdir(root)
    except OSError:
        return None
    for dev in devices:
        ports = os.path.join(root, dev, "ports")
        for port in (os.listdir(ports) if os.path.isdir(ports) else []):
            base = os.path.join(ports, port)
            try:
                state = open(os.path.join(base, "state")).read()
                rate = float(open(os.path.join(base, "rate")).read().split()[0])  # "400 Gb/sec (4X NDR)"
                layer = open(os.path.join(base, "link_layer")).read().strip()
            except (OSError, ValueError, IndexError):
                continue
            if "ACTIVE" not in state:
                continue
            if layer == "InfiniBand":
                kind = {100: "InfiniBand EDR", 200: "InfiniBand HDR", 400: "InfiniBand NDR", 800: "InfiniBand XDR"}.get(int(rate))
            else:
                kind = {100: "RoCE 100GbE", 200: "RoCE 200GbE", 400: "RoCE 400GbE"}.get(int(rate))
            if kind:
                found[kind] = found.get(kind, 0) + 1
    if not found:
        return None
    best = max(found, key=lambda k: comm.NIC_RATES[k][0])
    return best, found[best]


def detect_link(device, *, backend: str, nodes: int, devices_per_node: int, head: str | None = None,
                given_gbps: float | None = None) -> tuple[comm.LinkPeak | None, str]:
    """The link this run's collectives cross and its peak (:func:`mlflow_llmeff.calc.comm.link_peak`).

    Args:
        device: this rank's torch device (NVML's NVLink/PCIe figures for a CUDA device under NCCL).
        backend: the process group's backend.
        nodes: machines taking part.
        devices_per_node: ranks on each machine.
        head: the head's address (``MASTER_ADDR``): across machines the interface that routes to it
            and its rate (:func:`mlflow_llmeff.meters.netpeak.interface_peak`) where no
            InfiniBand/RoCE adapter serves NCCL.
        given_gbps: the user's ``link_peak_gbps`` (> 0: taken as it is, nothing read).
    """
    if given_gbps:
        return comm.link_peak(backend=backend, nodes=nodes, given_gbps=given_gbps)
    nvlink = pcie = nic = interface = None
    if backend == "nccl" and getattr(device, "type", None) == "cuda":
        nvlink, pcie = _nvml_links(device.index or 0)
        if nodes > 1:
            nic = _nics()
    if nodes > 1 and nic is None:
        from mlflow_llmeff.meters.netpeak import interface_peak

        interface = interface_peak(head) if head else (None, "the head's address (MASTER_ADDR) is not set")
    return comm.link_peak(backend=backend, nodes=nodes, nvlink=nvlink, pcie=pcie, nic=nic,
                          devices_per_node=devices_per_node, interface=interface)


def probe_figures(result: ProbeResult | None, peak: comm.LinkPeak | None, why: str,
                  reason_none: str = "") -> tuple[dict[str, float], dict[str, str]]:
    """The ``comm/*`` metrics and ``llmeff.comm.*`` tags of a probe.

    ``comm/busbw_utilization`` is the all-reduce's busbw over the peak, never clipped: above 1 it is
    logged as measured and ``llmeff.comm.peak.exceeded`` says why that can be
    (:func:`mlflow_llmeff.calc.comm.utilization`).
    """
    tags = {names.COMM_PEAK_GBPS: f"{peak.gbps:g}" if peak else "unknown",
            names.COMM_PEAK_SOURCE: f"{peak.link}: {peak.source}" if peak else why}
    if result is None:
        tags[names.COMM_PROBE] = reason_none or "none: no process group of more than one rank"
        return {}, tags
    m = {names.COMM_ALLREDUCE_BUSBW: result.busbw_gbps["all_reduce"],
         names.COMM_ALLGATHER_BUSBW: result.busbw_gbps["all_gather"],
         names.COMM_REDUCESCATTER_BUSBW: result.busbw_gbps["reduce_scatter"]}
    if peak:
        m[names.COMM_BUSBW_UTIL], exceeded = comm.utilization(result.busbw_gbps["all_reduce"], peak.gbps)
        if exceeded:
            tags[names.COMM_PEAK_EXCEEDED] = f"all-reduce {exceeded}"
    tags[names.COMM_PROBE] = result.describe()
    return m, tags


# --------------------------------------------------------------------------- bytes of a step
def _group_size(pg_or_name) -> int:
    """Ranks of a c10d op's group: a group name (functional collectives) or the ``ScriptObject`` the
    dispatcher passes for a ``ProcessGroup`` (``ProcessGroup.unbox`` turns it back into one)."""
    import torch.distributed as dist

    if isinstance(pg_or_name, str):
        from torch.distributed.distributed_c10d import _resolve_process_group

        return _resolve_process_group(pg_or_name).size()
    if isinstance(pg_or_name, dist.ProcessGroup):
        return pg_or_name.size()
    return dist.ProcessGroup.unbox(pg_or_name).size()


def _collective(name: str, args) -> tuple[str, int, int] | None:
    """``(op, size in bytes by the nccl-tests convention, ranks)`` of a c10d op call, else None."""
    ns, _, op = name.partition("::")
    op = op.split(".")[0]
    if ns == "c10d":
        table = {  # op -> (kind, index of the sized tensor(s), index of the process group)
            "allreduce_": ("all_reduce", 0, 1), "allreduce_coalesced_": ("all_reduce", 0, 1),
            "_allgather_base_": ("all_gather", 0, 2), "allgather_": ("all_gather", 0, 2),
            "allgather_into_tensor_coalesced_": ("all_gather", 0, 2),
            "_reduce_scatter_base_": ("reduce_scatter", 1, 2), "reduce_scatter_": ("reduce_scatter", 1, 2),
            "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1, 2),
            "broadcast_": ("broadcast", 0, 1), "reduce_": ("reduce", 0, 1),
            "alltoall_base_": ("all_to_all", 1, 2), "alltoall_": ("all_to_all", 1, 2),
        }
        if op not in table:
            return None
        kind, ti, gi = table[op]
        return kind, tensor_bytes(args[ti]), _group_size(args[gi])
    if ns == "_c10d_functional":
        if op in ("all_reduce", "all_reduce_"):
            return "all_reduce", tensor_bytes(args[0]), _group_size(args[2])
        if op == "all_reduce_coalesced":
            return "all_reduce", tensor_bytes(args[0]), _group_size(args[2])
        if op == "all_gather_into_tensor":
            return "all_gather", tensor_bytes(args[0]) * int(args[1]), int(args[1])
        if op == "reduce_scatter_tensor":
            return "reduce_scatter", tensor_bytes(args[0]), int(args[2])
        if op == "all_to_all_single":
            return "all_to_all", tensor_bytes(args[0]), _group_size(args[3])
        if op == "broadcast":
            return "broadcast", tensor_bytes(args[0]), _group_size(args[2])
    return None


class CommCounter:
    """Records every collective run inside it: ``(op, size bytes, ranks)``, and their bus bytes.

    A ``TorchDispatchMode`` (the mechanism of torch's own ``CommDebugMode``) sees the c10d ops of
    DDP's reducer, FSDP2, DTensor redistributions and DeepSpeed's ``torch.distributed`` calls on
    this thread and the autograd threads it starts.
    """

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, int]] = []

    @contextlib.contextmanager
    def counting(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        calls = self.calls

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func.namespace in ("c10d", "_c10d_functional"):
                    try:
                        got = _collective(f"{func.namespace}::{func._opname}", args)
                        if got is not None and got[2] > 1:
                            calls.append(got)
                    except Exception:  # noqa: BLE001 - counting never breaks the collective
                        pass
                return func(*args, **(kwargs or {}))

        with _Mode():
            yield self

    @property
    def bus_bytes(self) -> float:
        """Sum of ``size x bus factor`` over the recorded collectives."""
        return sum(size * comm.bus_factor(op, n) for op, size, n in self.calls)


# --------------------------------------------------------------------------- exposed time of a step
def _kineto_intervals(prof, cuda: bool) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
    """(collective intervals, compute intervals) in µs from a finished profiler.

    CUDA: NCCL kernels against every other kernel (device time). CPU: gloo's ``gloo:*`` work,
    which runs on gloo's own threads, against the ``aten::`` operators of every other thread (the
    training thread and the autograd engine's).
    """
    comm_iv, compute_iv, gloo_threads = [], [], set()
    events = list(prof.profiler.kineto_results.events())
    for e in events:
        if not cuda and e.name().startswith("gloo:"):
            gloo_threads.add(e.start_thread_id())
    for e in events:
        name = e.name()
        start = e.start_ns() / 1e3
        end = start + e.duration_ns() / 1e3
        on_device = "cuda" in str(e.device_type()).lower()
        if cuda:
            if not on_device or name.startswith(("Memcpy", "Memset")):
                continue
            (comm_iv if "nccl" in name.lower() else compute_iv).append((start, end))
        elif name.startswith("gloo:"):
            comm_iv.append((start, end))
        elif name.startswith("aten::") and e.start_thread_id() not in gloo_threads:
            compute_iv.append((start, end))
    return comm_iv, compute_iv


@dataclass
class StepSampler:
    """Looks at warm-up steps of one attempt (see the module docstring) and gives the summary figures.

    Args:
        world: processes of the run (nothing is sampled for one).
        warmup_steps: warm-up steps of each attempt; step ``start_step + 2`` is counted (with
            ``warmup_steps >= 2``), steps ``start_step + 3`` and ``+ 4`` are profiled (as far as
            they are warm-up steps).
        start_step: optimizer steps done before this attempt.
        device: the training device (synchronized around profiled steps).
        enabled: ``measure_comm``.
        compiled: ``torch.compile`` is on (a dispatch mode would stop it: bytes are not counted).
    """

    world: int
    warmup_steps: int
    start_step: int
    device: object
    enabled: bool = True
    compiled: bool = False
    _counter: CommCounter = field(default_factory=CommCounter)
    _exposed_us: float = 0.0
    _wall_us: float = 0.0
    _profiled: list[int] = field(default_factory=list)
    _counted: int | None = None

    @property
    def active(self) -> bool:
        return self.enabled and self.world > 1 and self.warmup_steps >= 2

    def _last(self) -> int:
        return self.start_step + min(self.warmup_steps, 4)

    @contextlib.contextmanager
    def around(self, step: int):
        """Wrap one optimizer step (its micro-batches and optimizer step)."""
        k = step - self.start_step  # the attempt's k-th step
        if not self.active or k < 2 or step > self._last() or (k == 2 and self.compiled):
            yield
            return
        if k == 2:
            with self._counter.counting():
                yield
            self._counted = step
            return
        with self._profiling(step):
            yield

    @contextlib.contextmanager
    def _profiling(self, step: int):
        from torch.profiler import ProfilerActivity, profile

        cuda = getattr(self.device, "type", None) == "cuda"
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        collectives.synchronize(self.device)
        t0 = time.perf_counter()
        prof = profile(activities=acts)
        with kineto_notes_dropped():
            prof.start()
        try:
            yield
            collectives.synchronize(self.device)
        finally:
            with kineto_notes_dropped():
                prof.stop()
        wall = (time.perf_counter() - t0) * 1e6
        comm_iv, compute_iv = _kineto_intervals(prof, cuda)
        self._exposed_us += comm.exposed_time(comm_iv, compute_iv)
        self._wall_us += wall
        self._profiled.append(step)

    def due(self, step: int) -> bool:
        """True at the step after which :meth:`figures` must be called (on every rank)."""
        return self.active and step == self._last()

    def figures(self) -> tuple[dict[str, float], dict[str, str]]:
        """``summary/comm_*`` figures (means over ranks) and the ``llmeff.comm.sampled`` tag (a collective)."""
        local = [self._exposed_us, self._wall_us, self._counter.bus_bytes, 1.0 if self._counted else 0.0]
        g = collectives.all_reduce(local)
        out: dict[str, float] = {}
        notes = []
        if self._wall_us > 0 and g[1] > 0:
            out[names.SUM_COMM_EXPOSED] = g[0] / g[1]
            notes.append(f"exposed communication profiled on step(s) {', '.join(map(str, self._profiled))} "
                         "(torch.profiler, warm-up, under the profiler)")
        else:
            notes.append("exposed communication not profiled: needs warmup_steps >= 3 (warm-up step 1 counts "
                         "FLOPs, step 2 bytes)")
        if g[3] == self.world:
            out[names.SUM_COMM_BYTES] = g[2] / self.world
            notes.append(f"bytes counted on step {self._counted} (every collective's size and ranks)")
        else:
            notes.append("bytes per step not counted: " + ("torch.compile is on (a dispatch mode would stop it)"
                                                           if self.compiled else "no counted step"))
        return out, {names.COMM_SAMPLED: "; ".join(notes)}

    @staticmethod
    def inactive_tag(world: int, enabled: bool, warmup_steps: int) -> dict[str, str]:
        """The ``llmeff.comm.sampled`` tag of a run whose steps are not sampled."""
        why = ("measure_comm=false" if not enabled else "one process: no collectives" if world < 2
               else f"warmup_steps={warmup_steps}: only warm-up steps after the first are sampled (give >= 2)")
        return {names.COMM_SAMPLED: f"none: {why}"}
