"""What else used the machine while a run trained: host CPU taken by other processes, steal, and on
CUDA devices other processes, clock-throttle reasons, SM clock against its maximum, temperature and
the power limit (``docs/stability.md``, "What else used the machine").

Readers take their sources as arguments (``/proc/stat`` text, a ``pynvml`` module such as
:func:`mlflow_llmeff.testing.fake_nvml`), so every path runs in tests without the hardware; the
arithmetic is in pure functions. Collectives over ranks are the monitor's job: this module only
samples one process's view and turns numbers into figures and tag text.

Host CPU, from the aggregate ``cpu`` line of ``/proc/stat`` (clock ticks since boot, proc(5)):
``busy = user + nice + system + irq + softirq`` (guest time is inside user), ``total = busy +
idle + iowait + steal``. Over a window, the other processes' share of the host's CPU time is
``(busy delta - our processes' CPU seconds x ticks/s) / total delta``, where our processes are
the training processes of this host and their live descendants (DataLoader workers), read with
psutil; steal (time the hypervisor ran someone else) is ``steal delta / total delta``.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

__all__ = ["HostCpu", "parse_proc_stat", "read_host_cpu", "own_tree_cpu_s", "own_tree_pids", "own_tree", "host_fractions",
           "process_cpu_snapshot", "top_others", "DeviceSample", "read_device", "GpuConditions", "throttle_names",
           "host_text", "gpu_text", "throttle_text", "larger_memory", "gpu_contended", "CONTENDED_CPU_FRACTION", "CONTENDED_STEAL_FRACTION", "THROTTLE_REASONS",
           "BENIGN_THROTTLE"]

#: A window is ``contended`` when other processes used more than this share of the host's CPU time.
CONTENDED_CPU_FRACTION = 0.05
#: ... or steal exceeded this share.
CONTENDED_STEAL_FRACTION = 0.02
#: A host share is read from ``/proc/stat`` ticks (100 a second per CPU): over fewer than this many
#: ticks in the steady window its resolution is coarser than 1% (a trial: 1 tick of steal in 30 read
#: "steal 3.3%" and made a 7-step run "contended"), so no share is given and the tag says why.
MIN_WINDOW_TICKS = 100

#: NVML clocks-event (throttle) reason bits, ``nvml.h`` (``nvmlClocksEventReason*``, formerly
#: ``nvmlClocksThrottleReason*``).
THROTTLE_REASONS = {
    0x1: "gpu_idle",
    0x2: "applications_clocks_setting",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}
#: Reasons that are not a slowdown of a busy device (idle between samples, a clock setting).
BENIGN_THROTTLE = 0x1 | 0x2 | 0x100


# ------------------------------------------------------------------------------------------- host CPU
@dataclass(frozen=True)
class HostCpu:
    """The host's aggregate CPU time since boot, in clock ticks (``/proc/stat`` ``cpu`` line).

    Attributes:
        total: every tick of every CPU (busy + idle + iowait + steal).
        busy: user + nice + system + irq + softirq.
        steal: ticks the hypervisor gave to another guest.
    """

    total: int
    busy: int
    steal: int


def parse_proc_stat(text: str) -> HostCpu:
    """The :class:`HostCpu` of ``/proc/stat`` text.

    Raises:
        ValueError: when the text has no aggregate ``cpu`` line of at least 4 numbers.
    """
    for line in text.splitlines():
        parts = line.split()
        if parts and parts[0] == "cpu":
            v = [int(x) for x in parts[1:]] + [0] * 8
            user, nice, system, idle, iowait, irq, softirq, steal = v[:8]
            busy = user + nice + system + irq + softirq
            return HostCpu(total=busy + idle + iowait + steal, busy=busy, steal=steal)
    raise ValueError("no aggregate 'cpu' line in /proc/stat text")


def read_host_cpu(path: str = "/proc/stat") -> HostCpu | None:
    """The host's CPU ticks now, or None where ``/proc/stat`` cannot be read (not Linux).

    Only the file's first 4 KiB are read (one ``read``, no text wrapper): the aggregate ``cpu`` line
    comes first (proc(5)), and the per-interrupt counters after it run to kilobytes on a large host."""
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            head = os.read(fd, 4096)
        finally:
            os.close(fd)
        return parse_proc_stat(head.decode("ascii", "replace"))
    except (OSError, ValueError):
        return None


def _descendants(pid: int) -> list[int] | None:
    """Pids of ``pid``'s descendants from each thread's ``/proc/<pid>/task/<tid>/children`` (Linux >= 3.5,
    proc(5)): a few small reads per process of the tree, where ``psutil``'s ``children`` reads every process's
    ``/proc/<pid>/stat`` on the host (milliseconds on a busy one). None where the files cannot be read."""
    out, todo = [], [pid]
    try:
        while todo:
            p = todo.pop()
            for tid in os.listdir(f"/proc/{p}/task"):
                try:
                    with open(f"/proc/{p}/task/{tid}/children", "rb") as f:
                        kids = [int(k) for k in f.read().split()]
                except FileNotFoundError:  # a thread that just ended
                    continue
                out += kids
                todo += kids
    except (OSError, ValueError):
        return None
    return out


def _tree(pid: int | None = None):
    import psutil

    p = psutil.Process(pid)
    found = _descendants(p.pid)
    if found is not None:
        kids = []
        for k in dict.fromkeys(found):
            try:
                kids.append(psutil.Process(k))
            except psutil.Error:  # exited since
                pass
        return [p, *kids]
    try:
        kids = p.children(recursive=True)
    except psutil.Error:
        kids = []
    return [p, *kids]


def own_tree(pid: int | None = None) -> list:
    """``psutil.Process`` objects of process ``pid`` (default: this one) and its live descendants
    (read from the tree's own ``/proc/<pid>/task/*/children`` files; without them, from every process's
    ``/proc/<pid>/stat``: milliseconds on a busy host)."""
    return _tree(pid)


def own_tree_cpu_s(pid: int | None = None, procs: list | None = None) -> float:
    """User + system CPU seconds of process ``pid`` (default: this one) and its live descendants,
    or of the processes ``procs`` (an earlier :func:`own_tree`; one ``/proc`` read each)."""
    import psutil

    total, me = 0.0, os.getpid()
    for p in (_tree(pid) if procs is None else procs):
        try:
            if p.pid == me:  # this process: the kernel's own counters without a /proc read (os.times)
                t = os.times()
                total += t.user + t.system
                continue
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:  # a worker that just exited
            pass
    return total


def own_tree_pids(pid: int | None = None) -> list[int]:
    """Pids of process ``pid`` (default: this one) and its live descendants."""
    return [p.pid for p in _tree(pid)]


def host_fractions(before: HostCpu, after: HostCpu, own_cpu_s: float,
                   ticks_per_s: float | None = None) -> tuple[float, float] | None:
    """``(other processes' share, steal share)`` of the host's CPU time between two readings.

    Args:
        before, after: host readings at the window's edges.
        own_cpu_s: CPU seconds our processes on this host used in the window.
        ticks_per_s: clock ticks per second (default ``os.sysconf("SC_CLK_TCK")``, 100 on Linux).

    Returns:
        Two fractions in [0, 1], or None for a window without ticks.
    """
    hz = float(ticks_per_s or os.sysconf("SC_CLK_TCK"))
    total = after.total - before.total
    if total <= 0:
        return None
    other = (after.busy - before.busy) - own_cpu_s * hz
    return min(1.0, max(0.0, other / total)), min(1.0, max(0.0, (after.steal - before.steal) / total))


def process_cpu_snapshot(exclude: Iterable[int] = ()) -> dict[int, tuple[str, float]]:
    """``{pid: (name, user + system CPU seconds)}`` of every readable process on the host but ``exclude``."""
    import psutil

    skip = set(exclude)
    out = {}
    for p in psutil.process_iter(["name", "cpu_times"]):
        try:
            if p.pid in skip or p.info["cpu_times"] is None:
                continue
            t = p.info["cpu_times"]
            out[p.pid] = (p.info["name"] or "?", t.user + t.system)
        except psutil.Error:
            continue
    return out


def top_others(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]], window_s: float,
               cpus: int, n: int = 3, exclude: Iterable[int] = ()) -> list[tuple[str, int, float]]:
    """The ``n`` other processes that used the most of the host's CPU in a window.

    A process absent from ``before`` started inside the window: all its CPU time counts.

    Args:
        before, after: :func:`process_cpu_snapshot` at the window's edges.
        window_s: the window's wall seconds; cpus: the host's CPUs.
        exclude: pids that are ours (found after ``before`` was taken).

    Returns:
        ``(name, pid, share of the host's CPU time)``, largest first, shares > 0.5% only.
    """
    if window_s <= 0 or cpus <= 0:
        return []
    skip = set(exclude)
    used = []
    for pid, (name, cpu) in after.items():
        if pid in skip:
            continue
        share = (cpu - before.get(pid, (name, 0.0))[1]) / (window_s * cpus)
        if share > 0.005:
            used.append((name, pid, share))
    return sorted(used, key=lambda u: -u[2])[:n]


def host_text(other: float, steal: float, top: Sequence[tuple[str, int, float]] = (), host: str | None = None) -> str:
    """One host's part of the ``llmeff.contention`` tag, e.g.
    ``other processes 48% of host CPU (python3 1234: 45%), steal 0.0%``."""
    who = f" ({', '.join(f'{name} {pid}: {share:.0%}' for name, pid, share in top)})" if top else ""
    where = f"{host}: " if host else ""
    return f"{where}other processes {other:.1%} of host CPU{who}, steal {steal:.1%}"


# ------------------------------------------------------------------------------------------ CUDA devices
@dataclass(frozen=True)
class DeviceSample:
    """One NVML reading of one device (NVML units converted: W, MHz, degrees C).

    Attributes:
        uuid: NVML UUID.
        sm_clock_mhz, max_sm_clock_mhz: current and maximum SM clock (None when unreadable).
        throttle: clocks-event reason bits; None when NVML cannot read them (never 0, which says "no
            reason set").
        temperature_c: GPU temperature.
        power_limit_w: enforced power limit.
        other_pids: compute processes on the device that are not ours, with their device memory
            bytes (None where NVML does not give it); None when NVML cannot list them.
        pids_visible: False when NVML lists processes but none of ours although we use the device
            (a container's PID namespace: NVML reports host pids, so none can be told apart).
    """

    uuid: str
    sm_clock_mhz: float | None
    max_sm_clock_mhz: float | None
    throttle: int | None
    temperature_c: float | None
    power_limit_w: float | None
    other_pids: dict[int, int | None] | None
    pids_visible: bool = True


def _try(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except Exception:  # noqa: BLE001 - NVMLError (Not Supported, ...) leaves the field unknown
        return None


def _memory(proc: Any) -> int | None:
    """A process's device memory in bytes, None where NVML does not give it (``usedGpuMemory`` None:
    NVML_VALUE_NOT_AVAILABLE), never 0 bytes for unknown."""
    mem = getattr(proc, "usedGpuMemory", None)
    return int(mem) if mem is not None else None


def larger_memory(a: int | None, b: int | None) -> int | None:
    """The larger of two device-memory readings (bytes), a known one over an unknown (None) one."""
    return b if a is None else a if b is None else max(a, b)


def read_device(nvml: Any, uuid: str, handle: Any, own_pids: Iterable[int]) -> DeviceSample:
    """Read :class:`DeviceSample` of one device through ``nvml`` (real ``pynvml`` or the fake)."""
    sm_kind = getattr(nvml, "NVML_CLOCK_SM", 1)
    reasons_fn = (getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
                  or getattr(nvml, "nvmlDeviceGetCurrentClocksThrottleReasons", None))
    procs = _try(lambda: nvml.nvmlDeviceGetComputeRunningProcesses(handle))
    ours = set(own_pids)
    others, visible = None, True
    if procs is not None:
        pids = {int(p.pid): _memory(p) for p in procs}
        others = {pid: mem for pid, mem in pids.items() if pid not in ours}
        visible = not pids or bool(ours & set(pids))
        if not visible:  # none of ours among them: pids from another namespace, not comparable
            others = None
    limit = _try(lambda: nvml.nvmlDeviceGetEnforcedPowerLimit(handle))
    return DeviceSample(
        uuid=uuid,
        sm_clock_mhz=_try(lambda: float(nvml.nvmlDeviceGetClockInfo(handle, sm_kind))),
        max_sm_clock_mhz=_try(lambda: float(nvml.nvmlDeviceGetMaxClockInfo(handle, sm_kind))),
        throttle=_reasons(reasons_fn, handle),
        temperature_c=_try(lambda: float(nvml.nvmlDeviceGetTemperature(handle, getattr(nvml, "NVML_TEMPERATURE_GPU", 0)))),
        power_limit_w=limit / 1000.0 if limit is not None else None,  # mW -> W at the boundary
        other_pids=others, pids_visible=visible)


def _reasons(reasons_fn: Callable[[Any], Any] | None, handle: Any) -> int | None:
    """The clocks-event reason bits of a device, or None where NVML has no such call or it fails."""
    bits = _try(lambda: reasons_fn(handle)) if reasons_fn else None
    return int(bits) if bits is not None else None


def throttle_names(bits: int, *, include_benign: bool = False) -> list[str]:
    """The names of the set reason bits (slowdowns only unless ``include_benign``)."""
    mask = bits if include_benign else bits & ~BENIGN_THROTTLE
    return [name for bit, name in THROTTLE_REASONS.items() if mask & bit]


def _empty() -> dict:
    """An aggregate of no samples: the keys :func:`_fold` fills. ``throttle_read`` / ``throttle_unread``:
    the devices (UUIDs) whose clocks-event reasons were read / could not be read in some sample;
    ``procs_unread``: the devices whose compute processes NVML could not list."""
    return {"samples": 0, "min_clock_frac": None, "min_clock_mhz": None, "max_temp_c": None,
            "min_power_limit_w": None, "throttle": 0, "others": {}, "pids_visible": True,
            "throttle_read": set(), "throttle_unread": set(), "procs_unread": set()}


@dataclass
class GpuConditions:
    """Samples of this process's CUDA devices over the run, kept as window aggregates.

    Call :meth:`sample` at window edges (and, with ``period_s``, a daemon thread samples between
    them, so a throttle episode between two edges is seen). :meth:`take_interval` returns and resets
    the interval aggregate; :meth:`window` is the aggregate since :meth:`begin` (keys of :func:`_empty`).

    Args:
        nvml: an initialised ``pynvml`` module (or fake).
        devices: ``(uuid, handle)`` of this process's devices.
        own_pids: pids of the run's processes (all ranks of this host).
        period_s: seconds between background samples; None: no thread.
    """

    nvml: Any
    devices: list[tuple[str, Any]]
    own_pids: set[int] = field(default_factory=set)
    period_s: float | None = None
    _interval: dict = field(default_factory=dict)
    _window: dict | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def begin(self) -> None:
        """Start the steady window (and the background sampler)."""
        with self._lock:
            self._window, self._interval = _empty(), _empty()
        if self.period_s and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="llmeff-gpu-conditions", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                self.sample()
            except Exception:  # noqa: BLE001 - a sampler never stops training
                return

    def sample(self) -> list[DeviceSample]:
        """Read every device once and fold the readings into the interval and the window."""
        got = [read_device(self.nvml, u, h, self.own_pids) for u, h in self.devices]
        with self._lock:
            for agg in (self._interval, self._window):
                if agg is None:
                    continue
                for s in got:
                    _fold(agg, s)
        return got

    def take_interval(self) -> dict:
        """The aggregate since the last call, then reset."""
        with self._lock:
            out, self._interval = self._interval or _empty(), _empty()
        return out

    def window(self) -> dict | None:
        """The aggregate since :meth:`begin` (None before)."""
        with self._lock:
            w = self._window
            return None if w is None else dict(w, others=dict(w["others"]), **{
                k: set(w[k]) for k in ("throttle_read", "throttle_unread", "procs_unread")})

    def close(self) -> None:
        self._stop.set()


def _fold(agg: dict, s: DeviceSample) -> None:
    """Fold one device reading into an aggregate: minima of clocks and limits, maxima of temperature,
    the union of throttle bits and of other processes (largest memory seen)."""
    agg["samples"] += 1
    if s.sm_clock_mhz is not None:
        agg["min_clock_mhz"] = s.sm_clock_mhz if agg["min_clock_mhz"] is None else min(agg["min_clock_mhz"], s.sm_clock_mhz)
        if s.max_sm_clock_mhz:
            f = s.sm_clock_mhz / s.max_sm_clock_mhz
            agg["min_clock_frac"] = f if agg["min_clock_frac"] is None else min(agg["min_clock_frac"], f)
    if s.temperature_c is not None:
        agg["max_temp_c"] = s.temperature_c if agg["max_temp_c"] is None else max(agg["max_temp_c"], s.temperature_c)
    if s.power_limit_w is not None:
        agg["min_power_limit_w"] = (s.power_limit_w if agg["min_power_limit_w"] is None
                                    else min(agg["min_power_limit_w"], s.power_limit_w))
    if s.throttle is None:  # unread, not "no reason": a slowdown there is unknown
        agg["throttle_unread"].add(s.uuid)
    else:
        agg["throttle"] |= s.throttle
        agg["throttle_read"].add(s.uuid)
    if s.other_pids:
        for pid, mem in s.other_pids.items():
            agg["others"][pid] = larger_memory(mem, agg["others"].get(pid))
    elif s.other_pids is None and s.pids_visible:
        agg["procs_unread"].add(s.uuid)
    agg["pids_visible"] = agg["pids_visible"] and s.pids_visible


def gpu_text(window: dict) -> str:
    """The devices' part of the ``llmeff.contention`` tag from a :meth:`GpuConditions.window` aggregate, e.g.
    ``GPU: 1 other process (pid 999, 2.0 GiB); throttle: sw_thermal_slowdown; SM clock >= 1410/1980 MHz (71%); <= 83 C; power limit 700 W``."""
    parts = []
    others = window.get("others") or {}
    if others:
        listed = ", ".join(f"pid {pid}, {mem / 2**30:.1f} GiB" if mem is not None else f"pid {pid}, memory unknown"
                           for pid, mem in sorted(others.items())[:3])
        parts.append(f"{len(others)} other process{'es' if len(others) > 1 else ''} ({listed})")
    elif not window.get("pids_visible", True):
        parts.append("other processes unknown (NVML pids are from another PID namespace)")
    elif window.get("procs_unread"):
        parts.append(f"other processes unknown (NVML could not list them on {_devices(window['procs_unread'])})")
    else:
        parts.append("no other process")
    parts.append(throttle_text(window))
    if window.get("min_clock_mhz") is not None:
        frac = window.get("min_clock_frac")
        parts.append(f"SM clock >= {window['min_clock_mhz']:.0f} MHz" + (f" ({frac:.0%} of max)" if frac else ""))
    if window.get("max_temp_c") is not None:
        parts.append(f"<= {window['max_temp_c']:.0f} C")
    if window.get("min_power_limit_w") is not None:
        parts.append(f"power limit {window['min_power_limit_w']:.0f} W")
    return "GPU: " + "; ".join(parts)


def _devices(uuids) -> str:
    return ", ".join(sorted(uuids))


def throttle_text(window: dict) -> str:
    """The slowdown reasons of an aggregate, saying which devices' reasons NVML could not read:
    ``throttle: sw_thermal_slowdown``, ``throttle: none``, ``throttle: unknown (NVML could not read the
    clocks-event reasons of GPU-b)`` or, mixed, ``throttle: none on GPU-a; unknown on GPU-b (...)``."""
    slow = throttle_names(window.get("throttle", 0))
    read, unread = set(window.get("throttle_read", ())), set(window.get("throttle_unread", ()))
    seen = ", ".join(slow) if slow else "none"
    why = f"NVML could not read the clocks-event reasons of {_devices(unread)}"
    if not unread:
        return f"throttle: {seen}"
    if not read:
        return f"throttle: unknown ({why})"
    return f"throttle: {seen} on {_devices(read)}; unknown on the others ({why})"


def gpu_contended(window: dict) -> bool:
    """True when another process used our devices or a slowdown reason was set during the window."""
    return bool(window.get("others")) or bool(window.get("throttle", 0) & ~BENIGN_THROTTLE)


