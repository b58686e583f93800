"""Energy meters: measure the joules of the devices this process owns, once, and say how.

Backends, tried in this order by :func:`make_meter` with ``mode="auto"``:

1. ``nvml_counter``: NVML's total-energy counter (``nvmlDeviceGetTotalEnergyConsumption``,
   millijoules since the driver was loaded; Volta and newer). The energy of a window is the
   difference of two counter reads, so nothing between samples is missed.
2. ``nvml_power``: for a device whose counter is unsupported (pre-Volta), the board power
   (``nvmlDeviceGetPowerUsage``, milliwatts) sampled by a background thread and integrated with
   the trapezoidal rule. This is an integration of samples, not a counter, and is tagged so.
3. ``rapl``: Linux RAPL through ``/sys/class/powercap`` (CPU package and DRAM zones,
   ``energy_uj`` microjoules, wrapping at ``max_energy_range_uj``), where readable. Only for a
   process that uses no CUDA device (CPU energy is no stand-in for a GPU run), and only on local
   rank 0, because the zones are node-wide.
4. ``none``: nothing measurable; :attr:`EnergyMeter.why` says why. Never a made-up number.

Each rank measures only its own devices, found through ``CUDA_VISIBLE_DEVICES`` by UUID (or by
the UUID / PCI bus id torch reports), never by assuming CUDA index == NVML index when a UUID is
available. Readings carry per-device joules keyed by a globally unique device id (the NVML UUID,
or ``<host>:<rapl zone>``), so :func:`sum_over_ranks` on the main process adds each device
exactly once even if two ranks were misconfigured to measure the same one. Every meter also names
the devices it is responsible for, measured or not (:attr:`EnergyMeter.owned`,
:attr:`EnergyMeter.unmeasured`), so that a run knows how many of its devices were measured
(:func:`device_owners`, ``summary/energy_coverage``) and which physical device each rank reports
when several ranks share one GPU.

Units are converted at the boundary: NVML millijoules, NVML milliwatts and RAPL microjoules
become joules and watts as soon as they are read. ``pynvml`` comes from the ``nvidia-ml-py``
distribution (NVIDIA's official bindings, not the deprecated ``pynvml`` distribution) and is
imported lazily.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

__all__ = [
    "SOURCE_NVML_COUNTER",
    "SOURCE_NVML_POWER",
    "SOURCE_RAPL",
    "SOURCE_NONE",
    "SOURCE_FAKE",
    "MODES",
    "RAPL_ROOT",
    "J_PER_KWH",
    "EnergyReading",
    "EnergyMeter",
    "NullMeter",
    "NvmlMeter",
    "RaplMeter",
    "FakeEnergyMeter",
    "make_meter",
    "resolve_nvml_devices",
    "sum_over_ranks",
    "device_owners",
    "joules_to_kwh",
    "j_per_token",
    "average_power_w",
    "tflops_per_w",
    "kwh_per_billion_tokens",
]

SOURCE_NVML_COUNTER = "nvml_counter"
SOURCE_NVML_POWER = "nvml_power"
SOURCE_RAPL = "rapl"
SOURCE_NONE = "none"
SOURCE_FAKE = "fake"

MODES = ("auto", "nvml", "rapl", "none")
RAPL_ROOT = "/sys/class/powercap"
J_PER_KWH = 3.6e6  # 1 kWh = 1000 W x 3600 s

_log = logging.getLogger(__name__)
_warned: set[str] = set()


def _warn_once(msg: str) -> None:
    """Log ``msg`` as a warning the first time it is seen in this process."""
    if msg not in _warned:
        _warned.add(msg)
        _log.warning(msg)


class _Unavailable(Exception):
    """A backend cannot serve this process; the message is the reason (for ``energy.why``).

    ``owned``: the device ids it would have measured, when they are known (they stay the run's
    devices, unmeasured).
    """

    def __init__(self, msg: str, owned: Sequence[str] = ()):
        super().__init__(msg)
        self.owned = tuple(owned)


# --------------------------------------------------------------------------- readings


@dataclass(frozen=True)
class EnergyReading:
    """Energy measured since :meth:`EnergyMeter.start`.

    Attributes:
        joules: total energy of all measured devices, J (>= 0), cumulative since start.
        elapsed_s: wall time since start on the meter's clock, s.
        per_device_j: J per device, keyed by a globally unique device id (NVML UUID,
            ``<host>:<rapl zone>``, or the fake meter's names). ``joules`` is their sum.
    """

    joules: float
    elapsed_s: float
    per_device_j: dict[str, float] = field(default_factory=dict)

    @property
    def kwh(self) -> float:
        """Total energy in kWh."""
        return joules_to_kwh(self.joules)

    def as_dict(self) -> dict[str, Any]:
        """Plain dict for ``gather_object`` / ``all_gather_object`` between ranks."""
        return {"joules": self.joules, "elapsed_s": self.elapsed_s, "per_device_j": dict(self.per_device_j)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "EnergyReading":
        """Inverse of :meth:`as_dict`."""
        return cls(float(d["joules"]), float(d["elapsed_s"]), {str(k): float(v) for k, v in d["per_device_j"].items()})


def sum_over_ranks(readings: Iterable[EnergyReading]) -> EnergyReading:
    """Sum the readings gathered from every rank, counting each device once.

    Each rank measures only its own devices, so the node/job total is the sum over devices.
    Should two ranks report the same device id (two ranks measuring one GPU, or RAPL read on two
    ranks of one node), the device is counted once (the larger of the two readings, which cover
    nearly the same window) and a warning is logged: summing them would double count.

    Args:
        readings: one :class:`EnergyReading` per rank (order does not matter).

    Returns:
        The combined reading: joules = sum over distinct devices, elapsed_s = the longest window.
    """
    readings = list(readings)
    merged: dict[str, float] = {}
    for r in readings:
        for dev, j in r.per_device_j.items():
            if dev in merged:
                _warn_once(f"energy of device {dev} was reported by more than one rank; counted once")
                merged[dev] = max(merged[dev], j)
            else:
                merged[dev] = j
    elapsed = max((r.elapsed_s for r in readings), default=0.0)
    return EnergyReading(joules=sum(merged[k] for k in sorted(merged)), elapsed_s=elapsed, per_device_j=merged)


def device_owners(owned_by_rank: Sequence[Iterable[str]]) -> dict[str, int]:
    """The rank that reports each physical device: the lowest rank that owns it.

    Two ranks on one GPU (same NVML UUID) both read its counter; summing their joules would count
    the device twice. With one owner per device id, each rank sums only the devices it owns and a
    plain sum over ranks counts every device once.

    Args:
        owned_by_rank: per rank (index = rank), the device ids it is responsible for
            (:attr:`EnergyMeter.owned`).

    Returns:
        ``{device id: owner rank}``, in first-seen order; its length is the run's number of devices.
    """
    owners: dict[str, int] = {}
    for rank, owned in enumerate(owned_by_rank):
        for dev in owned:
            owners.setdefault(str(dev), rank)
    return owners


# --------------------------------------------------------------------------- pure calculators


def joules_to_kwh(joules: float) -> float:
    """Convert J to kWh (1 kWh = 3.6e6 J)."""
    return joules / J_PER_KWH


def j_per_token(joules: float, tokens: int) -> float:
    """Measured energy per non-padding token, J/token.

    Raises:
        ValueError: if ``tokens`` is not positive.
    """
    if tokens <= 0:
        raise ValueError(f"tokens={tokens!r} must be a positive count")
    return joules / tokens


def average_power_w(joules: float, elapsed_s: float, devices: int = 1) -> float:
    """Average power per device over a window, W = J / s / devices.

    Raises:
        ValueError: if ``elapsed_s`` or ``devices`` is not positive.
    """
    if not elapsed_s > 0:
        raise ValueError(f"elapsed_s={elapsed_s!r} must be > 0")
    if devices <= 0:
        raise ValueError(f"devices={devices!r} must be a positive count")
    return joules / elapsed_s / devices


def tflops_per_w(device_tflops_per_sec: float, device_avg_power_w: float) -> float:
    """Energy efficiency, (TFLOP/s) / W = TFLOP/J: achieved model TFLOP/s per device / average W per device.

    Raises:
        ValueError: if the power is not positive.
    """
    if not device_avg_power_w > 0:
        raise ValueError(f"device_avg_power_w={device_avg_power_w!r} must be > 0")
    return device_tflops_per_sec / device_avg_power_w


def kwh_per_billion_tokens(kwh: float, tokens: int) -> float:
    """Energy per 1e9 non-padding tokens, kWh.

    Raises:
        ValueError: if ``tokens`` is not positive.
    """
    if tokens <= 0:
        raise ValueError(f"tokens={tokens!r} must be a positive count")
    return kwh * 1e9 / tokens


class _Counter:
    """Accumulates a monotonically rising hardware counter across resets and wraparounds.

    Args:
        first: the counter value at start (raw units).
        wrap: the value at which the counter wraps to 0 (RAPL ``max_energy_range_uj``), or
            ``None`` for a counter that only goes back to 0 when it is reset (NVML after a driver
            reload or GPU reset).
    """

    def __init__(self, first: int, wrap: int | None = None):
        self.last = first
        self.wrap = wrap
        self.total = 0  # raw units accumulated since start
        self.resets = 0

    def update(self, value: int) -> int:
        if value >= self.last:
            delta = value - self.last
        elif self.wrap:  # wrapped past max: (wrap - last) up to the top, then value from 0
            delta = self.wrap - self.last + value
            self.resets += 1
        else:  # reset to 0: everything since the reset is `value`
            delta = value
            self.resets += 1
        self.total += delta
        self.last = value
        return self.total


class _PowerIntegrator:
    """Trapezoidal integral of sampled power: E += (P_prev + P_now) / 2 * dt, in J."""

    def __init__(self, t0: float, w0: float):
        self.t, self.w = t0, w0
        self.joules = 0.0

    def add(self, t: float, w: float) -> float:
        if t > self.t:
            self.joules += 0.5 * (self.w + w) * (t - self.t)
        self.t, self.w = t, w
        return self.joules


# --------------------------------------------------------------------------- meters


class EnergyMeter:
    """Interface of every meter: ``start()``, then ``read()`` any number of times, then ``close()``.

    Attributes:
        source: how energy is measured: ``nvml_counter``, ``nvml_power``, ``rapl``, ``none``,
            ``fake`` (value of the ``llmeff.energy.source`` tag).
        why: why energy is absent or measured by a fallback (``llmeff.energy.why``), else None.
        num_devices: devices whose energy this process measures (GPUs; RAPL: CPU packages).
        owned: ids of every energy domain this process is responsible for, measured or not (NVML
            UUIDs, ``<host>:rapl:<zone>``); the measured ones are the keys of
            :attr:`EnergyReading.per_device_j`.
    """

    source: str = SOURCE_NONE
    why: str | None = None
    num_devices: int = 0
    owned: tuple[str, ...] = ()

    @property
    def measures(self) -> bool:
        """True when :meth:`read` returns measured energy (False for the null meter)."""
        return self.source != SOURCE_NONE

    @property
    def unmeasured(self) -> dict[str, str]:
        """``{device id: why}`` for the owned devices this meter cannot read."""
        return dict(getattr(self, "_unmeasured", {}))

    @property
    def started(self) -> bool:
        """True once :meth:`start` ran (a caller may start a meter early, e.g. at process start)."""
        return getattr(self, "_t0", None) is not None

    def start(self) -> None:
        raise NotImplementedError

    def read(self) -> EnergyReading:
        """Energy since :meth:`start`, cumulative."""
        raise NotImplementedError

    def close(self) -> None:
        """Release the backend (stop sampling threads, shut NVML down). Idempotent."""

    def __enter__(self) -> "EnergyMeter":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class NullMeter(EnergyMeter):
    """No measurement: :meth:`read` reports 0 J over the elapsed time; ``why`` says why.

    Callers must check :attr:`measures` (False here) and log no energy metric.

    Args:
        why: why nothing is measured.
        owned: the devices that are therefore not measured (e.g. this process's GPU by UUID), if known.
        clock: seconds, monotonic.
    """

    def __init__(self, why: str, *, owned: Sequence[str] = (), clock: Callable[[], float] = time.monotonic):
        self.source = SOURCE_NONE
        self.why = why
        self.num_devices = 0
        self.owned = tuple(owned)
        self._unmeasured = {d: why for d in self.owned}
        self._clock = clock
        self._t0: float | None = None

    def start(self) -> None:
        self._t0 = self._clock()

    def read(self) -> EnergyReading:
        elapsed = 0.0 if self._t0 is None else self._clock() - self._t0
        return EnergyReading(0.0, elapsed, {})


class FakeEnergyMeter(EnergyMeter):
    """A meter for tests, shipped with the package: constant power per device on an injected clock.

    ``read()`` returns ``power_w[dev] * (clock() - t_start)`` J per device, exact and hardware-free.

    Args:
        power_w: watts per device id, or one wattage for a single device called ``"fake0"``.
        clock: the (fake) clock, seconds.
        source: the source it claims (default ``"fake"``; set e.g. ``"nvml_counter"`` to exercise
            a caller's tagging).
        why: the ``why`` it reports.
        unmeasured: ``{device id: why}`` of further devices it owns but cannot read (partial
            measurement).
    """

    def __init__(
        self,
        power_w: Mapping[str, float] | float = 100.0,
        *,
        clock: Callable[[], float],
        source: str = SOURCE_FAKE,
        why: str | None = None,
        unmeasured: Mapping[str, str] | None = None,
    ):
        self.power_w = dict(power_w) if isinstance(power_w, Mapping) else {"fake0": float(power_w)}
        self.source = source
        self.why = why
        self.num_devices = len(self.power_w)
        self._unmeasured = dict(unmeasured or {})
        self.owned = tuple(self.power_w) + tuple(d for d in self._unmeasured if d not in self.power_w)
        self._clock = clock
        self._t0: float | None = None

    def start(self) -> None:
        self._t0 = self._clock()

    def read(self) -> EnergyReading:
        if self._t0 is None:
            raise RuntimeError("FakeEnergyMeter.read() before start()")
        dt = self._clock() - self._t0
        per = {dev: w * dt for dev, w in self.power_w.items()}
        return EnergyReading(sum(per.values()), dt, per)


def _as_str(x: Any) -> str:
    return x.decode() if isinstance(x, (bytes, bytearray)) else str(x)


class NvmlMeter(EnergyMeter):
    """Energy of the given NVML devices: counter deltas, or integrated power where unsupported.

    Each device is probed once at construction. Its energy counter (mJ) is used when it
    answers; otherwise its power (mW) is sampled every ``sample_interval_s`` by a daemon thread
    (and at every :meth:`read`) and integrated. A device answering neither is left out, and
    ``why`` names it. A counter going backwards (driver reload, GPU reset) is treated as a reset
    to 0, so the energy after the reset is kept and nothing is subtracted.

    Args:
        nvml: the ``pynvml`` module (or a fake with the same functions).
        devices: ``(device id, NVML handle)`` for each device this process owns.
        clock: seconds, monotonic.
        sample_interval_s: power sampling period for devices without a counter, s.
        sampling_thread: start the sampling thread (tests drive :meth:`poll` by hand instead).
        owns_init: call ``nvmlShutdown`` on :meth:`close` (pairs the ``nvmlInit`` of the caller).

    Raises:
        _Unavailable: when no device answers either query.
    """

    def __init__(
        self,
        nvml: Any,
        devices: Sequence[tuple[str, Any]],
        *,
        clock: Callable[[], float] = time.monotonic,
        sample_interval_s: float = 0.1,
        sampling_thread: bool = True,
        owns_init: bool = False,
    ):
        self._nvml = nvml
        self._clock = clock
        self._interval = sample_interval_s
        self._use_thread = sampling_thread
        self._owns_init = owns_init
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._counter_devs: list[tuple[str, Any]] = []
        self._power_devs: list[tuple[str, Any]] = []
        self._counters: dict[str, _Counter] = {}
        self._integrators: dict[str, _PowerIntegrator] = {}
        self._last_j: dict[str, float] = {}
        self._t0: float | None = None
        self._closed = False
        self.owned = tuple(dev for dev, _ in devices)
        self._unmeasured: dict[str, str] = {}
        notes: list[str] = []
        for dev, h in devices:
            try:
                nvml.nvmlDeviceGetTotalEnergyConsumption(h)
                self._counter_devs.append((dev, h))
                continue
            except Exception as e:  # NVMLError_NotSupported on pre-Volta
                counter_err = e
            try:
                nvml.nvmlDeviceGetPowerUsage(h)
                self._power_devs.append((dev, h))
                notes.append(f"{dev}: energy counter unsupported ({_err(counter_err)}), power integrated every {sample_interval_s:g} s")
            except Exception as e:
                notes.append(f"{dev}: neither energy counter nor power readable ({_err(e)}); not measured")
                self._unmeasured[dev] = f"neither energy counter nor power readable ({_err(e)})"
        if not self._counter_devs and not self._power_devs:
            raise _Unavailable("; ".join(notes) or "no NVML device to measure", owned=self.owned)
        self.num_devices = len(self._counter_devs) + len(self._power_devs)
        # The weaker method names the whole reading: any integrated device makes it nvml_power.
        self.source = SOURCE_NVML_POWER if self._power_devs else SOURCE_NVML_COUNTER
        self.why = "; ".join(notes) or None
        self.device_methods = {d: SOURCE_NVML_COUNTER for d, _ in self._counter_devs}
        self.device_methods.update({d: SOURCE_NVML_POWER for d, _ in self._power_devs})

    def start(self) -> None:
        """Take the first counter reads and power samples. A device failing here is dropped (see ``why``)."""
        with self._lock:
            self._t0 = self._clock()
            for devs, first in ((self._counter_devs, self._start_counter), (self._power_devs, self._start_power)):
                for dev, h in list(devs):
                    try:
                        first(dev, h)
                        self._last_j[dev] = 0.0
                    except Exception as e:
                        devs.remove((dev, h))
                        self.device_methods.pop(dev, None)
                        self._unmeasured[dev] = f"first read failed ({_err(e)})"
                        note = f"{dev}: first read failed ({_err(e)}); not measured"
                        self.why = f"{self.why}; {note}" if self.why else note
                        _warn_once(f"energy: {note}")
            self.num_devices = len(self._counter_devs) + len(self._power_devs)
            if self.num_devices == 0:
                self.source = SOURCE_NONE
        if self._power_devs and self._use_thread:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="llmeff-nvml-power", daemon=True)
            self._thread.start()

    def _start_counter(self, dev: str, h: Any) -> None:
        self._counters[dev] = _Counter(int(self._nvml.nvmlDeviceGetTotalEnergyConsumption(h)))

    def _start_power(self, dev: str, h: Any) -> None:
        self._integrators[dev] = _PowerIntegrator(self._t0, self._nvml.nvmlDeviceGetPowerUsage(h) / 1000.0)

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self.poll()

    def poll(self) -> None:
        """Take one power sample of every device without an energy counter."""
        with self._lock:
            self._poll_locked(self._clock())

    def _poll_locked(self, now: float) -> None:
        for dev, h in self._power_devs:
            try:
                w = self._nvml.nvmlDeviceGetPowerUsage(h) / 1000.0  # mW -> W
            except Exception as e:
                _warn_once(f"NVML power read failed for {dev} ({_err(e)}); sample skipped")
                continue
            self._last_j[dev] = self._integrators[dev].add(now, w)

    def read(self) -> EnergyReading:
        if self._t0 is None:
            raise RuntimeError("NvmlMeter.read() before start()")
        with self._lock:
            now = self._clock()
            self._poll_locked(now)
            for dev, h in self._counter_devs:
                try:
                    mj = int(self._nvml.nvmlDeviceGetTotalEnergyConsumption(h))
                except Exception as e:
                    _warn_once(f"NVML energy counter read failed for {dev} ({_err(e)}); last value kept")
                    continue
                self._last_j[dev] = self._counters[dev].update(mj) / 1000.0  # mJ -> J
            per = dict(self._last_j)
            return EnergyReading(sum(per.values()), now - self._t0, per)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._owns_init:
            try:
                self._nvml.nvmlShutdown()
            except Exception:
                pass


def _err(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


class RaplMeter(EnergyMeter):
    """CPU package and DRAM energy from Linux RAPL (powercap sysfs), wraparound handled.

    Reads the top-level zones named ``package-N`` and their sub-zones named ``dram`` under
    ``root`` (``intel-rapl:N`` and ``intel-rapl:N:M``; AMD CPUs expose the same interface).
    ``core`` and ``uncore`` sub-zones are inside the package and skipped; ``psys`` (whole
    platform) overlaps the package and is skipped. Counters are ``energy_uj`` (µJ) and wrap at
    ``max_energy_range_uj``. The zones are node-wide: only one process per node may use this.

    Args:
        root: powercap directory (tests pass a fake tree).
        clock: seconds, monotonic.
        host: the device-id prefix (default: this host name), so ranks on different nodes differ.

    Raises:
        _Unavailable: no package zone, or ``energy_uj`` not readable (root-only on kernels
            patched for CVE-2020-8694).
    """

    _ZONE_RE = re.compile(r"^intel-rapl:(\d+)(?::(\d+))?$")

    def __init__(self, root: str = RAPL_ROOT, *, clock: Callable[[], float] = time.monotonic, host: str | None = None):
        self._clock = clock
        host = host or socket.gethostname()
        self._zones: list[tuple[str, str, int]] = []  # (device id, energy_uj path, wrap)
        try:
            names = sorted(os.listdir(root))
        except OSError as e:
            raise _Unavailable(f"RAPL: {root} not readable ({_err(e)})") from None
        packages = 0
        for d in names:
            m = self._ZONE_RE.match(d)
            if not m:
                continue
            path = os.path.join(root, d)
            try:
                with open(os.path.join(path, "name")) as f:
                    name = f.read().strip()
            except OSError:
                continue
            top = m.group(2) is None
            if (top and name.startswith("package")) or (not top and name == "dram"):
                try:
                    with open(os.path.join(path, "max_energy_range_uj")) as f:
                        wrap = int(f.read().strip())
                    with open(os.path.join(path, "energy_uj")) as f:
                        int(f.read().strip())
                except (OSError, ValueError) as e:
                    raise _Unavailable(f"RAPL: {path}/energy_uj not readable ({_err(e)})") from None
                label = name if top else f"dram-{m.group(1)}"
                self._zones.append((f"{host}:rapl:{label}", os.path.join(path, "energy_uj"), wrap))
                packages += top
        if packages == 0:
            raise _Unavailable(f"RAPL: no package zone under {root}")
        self.source = SOURCE_RAPL
        self.why = None
        self.num_devices = packages
        self.owned = tuple(dev for dev, _, _ in self._zones)
        self._counters: dict[str, _Counter] = {}
        self._last_j: dict[str, float] = {}
        self._t0: float | None = None

    @staticmethod
    def _read_uj(path: str) -> int:
        with open(path) as f:
            return int(f.read().strip())

    def start(self) -> None:
        self._t0 = self._clock()
        for dev, path, wrap in self._zones:
            self._counters[dev] = _Counter(self._read_uj(path), wrap=wrap)
            self._last_j[dev] = 0.0

    def read(self) -> EnergyReading:
        if self._t0 is None:
            raise RuntimeError("RaplMeter.read() before start()")
        now = self._clock()
        for dev, path, _ in self._zones:
            try:
                self._last_j[dev] = self._counters[dev].update(self._read_uj(path)) / 1e6  # uJ -> J
            except (OSError, ValueError) as e:
                _warn_once(f"RAPL read failed for {dev} ({_err(e)}); last value kept")
        per = dict(self._last_j)
        return EnergyReading(sum(per.values()), now - self._t0, per)


# --------------------------------------------------------------------------- device resolution


def _normalize_uuid(u: str) -> str:
    u = _as_str(u).strip()
    return u if u.startswith(("GPU-", "MIG-")) else f"GPU-{u}"


def resolve_nvml_devices(
    nvml: Any,
    cuda_indices: Sequence[int],
    *,
    visible_devices: str | None,
    torch_ids: Sequence[Mapping[str, Any]] | None = None,
) -> list[tuple[str, Any]]:
    """Map this process's CUDA device indices to NVML handles, keyed by NVML UUID.

    For CUDA (logical) index ``i``, in order of preference:

    1. ``torch_ids[i]["uuid"]`` (from ``torch.cuda.get_device_properties(i).uuid``), looked up
       with ``nvmlDeviceGetHandleByUUID``; else ``torch_ids[i]["pci_bus_id"]`` with
       ``nvmlDeviceGetHandleByPciBusId``;
    2. the ``i``-th entry of ``CUDA_VISIBLE_DEVICES``: a ``GPU-``/``MIG-`` UUID or unique UUID
       prefix (matched against every NVML device's UUID, as CUDA does), or an integer, taken as
       the NVML index (as torch does; exact when ``CUDA_DEVICE_ORDER=PCI_BUS_ID``);
    3. without ``CUDA_VISIBLE_DEVICES``: NVML index ``i``.

    Args:
        nvml: initialised ``pynvml`` module (or fake).
        cuda_indices: CUDA device indices this process uses, e.g. ``[local_rank]``.
        visible_devices: the value of ``CUDA_VISIBLE_DEVICES`` (None when unset).
        torch_ids: per CUDA index, ``{"uuid": ..., "pci_bus_id": ...}`` when torch can tell.

    Returns:
        ``(uuid, handle)`` per device, duplicates removed.

    Raises:
        _Unavailable: a device cannot be resolved (the message says which and why).
    """
    entries = None if visible_devices is None else [e.strip() for e in visible_devices.split(",") if e.strip()]
    all_uuids: list[str] | None = None

    def nvml_uuids() -> list[str]:
        nonlocal all_uuids
        if all_uuids is None:
            n = nvml.nvmlDeviceGetCount()
            all_uuids = [_as_str(nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetHandleByIndex(k))) for k in range(n)]
        return all_uuids

    out: list[tuple[str, Any]] = []
    for i in cuda_indices:
        handle = None
        ids = torch_ids[i] if torch_ids is not None and i < len(torch_ids) else None
        if ids and ids.get("uuid"):
            try:
                handle = nvml.nvmlDeviceGetHandleByUUID(_normalize_uuid(ids["uuid"]))
            except Exception:
                handle = None
        if handle is None and ids and ids.get("pci_bus_id"):
            try:
                handle = nvml.nvmlDeviceGetHandleByPciBusId(_as_str(ids["pci_bus_id"]))
            except Exception:
                handle = None
        if handle is None:
            if entries is not None:
                if i >= len(entries):
                    raise _Unavailable(f"CUDA device {i} is not in CUDA_VISIBLE_DEVICES={visible_devices!r}")
                e = entries[i]
                if e.isdigit():
                    handle = _by_index(nvml, int(e))
                else:
                    prefix = e if e.startswith(("GPU-", "MIG-")) else f"GPU-{e}"
                    hits = [k for k, u in enumerate(nvml_uuids()) if u.startswith(prefix)]
                    if len(hits) != 1:
                        what = "matches no NVML device" if not hits else "is ambiguous"
                        raise _Unavailable(f"CUDA_VISIBLE_DEVICES entry {e!r} {what}")
                    if e.startswith("MIG-"):
                        raise _Unavailable(f"{e} is a MIG instance: NVML energy is per whole GPU, not per instance")
                    handle = nvml.nvmlDeviceGetHandleByIndex(hits[0])
            else:
                handle = _by_index(nvml, i)
        uuid = _as_str(nvml.nvmlDeviceGetUUID(handle))
        if uuid not in [u for u, _ in out]:
            out.append((uuid, handle))
    return out


def _by_index(nvml: Any, k: int) -> Any:
    try:
        return nvml.nvmlDeviceGetHandleByIndex(k)
    except Exception as e:
        raise _Unavailable(f"NVML has no device {k} ({_err(e)})") from None


def _torch_cuda_ids(env: Mapping[str, str]) -> tuple[list[int] | None, list[dict[str, Any]] | None]:
    """This process's CUDA devices and their UUIDs / PCI bus ids, from torch if already imported.

    Returns ``(None, None)`` when torch is not imported or has no CUDA device. With a distributed
    launcher (``LOCAL_RANK`` set) the process owns its current device only; otherwise all visible.
    """
    torch = sys.modules.get("torch")
    if torch is None:
        return None, None
    try:
        if not torch.cuda.is_available():
            return None, None
        n = torch.cuda.device_count()
        ids = []
        for i in range(n):
            p = torch.cuda.get_device_properties(i)
            pci = None
            if getattr(p, "pci_bus_id", None) is not None:
                pci = f"{getattr(p, 'pci_domain_id', 0):08X}:{p.pci_bus_id:02X}:{getattr(p, 'pci_device_id', 0):02X}.0"
            ids.append({"uuid": str(getattr(p, "uuid", "") or ""), "pci_bus_id": pci})
        mine = [torch.cuda.current_device()] if "LOCAL_RANK" in env else list(range(n))
        return mine, ids
    except Exception:
        return None, None


def _import_nvml() -> Any:
    try:
        import pynvml  # provided by the nvidia-ml-py distribution
    except ImportError as e:
        raise _Unavailable(f"pynvml (nvidia-ml-py) not importable ({_err(e)})") from None
    return pynvml


def _make_nvml_meter(
    nvml: Any | None,
    device_indices: Sequence[int] | None,
    env: Mapping[str, str],
    torch_ids: Sequence[Mapping[str, Any]] | None,
    clock: Callable[[], float],
    sample_interval_s: float,
    sampling_thread: bool,
) -> NvmlMeter:
    if not device_indices:
        raise _Unavailable("no CUDA device in this process")
    nvml = nvml if nvml is not None else _import_nvml()
    try:
        nvml.nvmlInit()
    except Exception as e:
        raise _Unavailable(f"nvmlInit failed ({_err(e)})") from None
    try:
        devices = resolve_nvml_devices(nvml, device_indices, visible_devices=env.get("CUDA_VISIBLE_DEVICES"), torch_ids=torch_ids)
        return NvmlMeter(nvml, devices, clock=clock, sample_interval_s=sample_interval_s, sampling_thread=sampling_thread, owns_init=True)
    except BaseException:
        try:
            nvml.nvmlShutdown()
        except Exception:
            pass
        raise


def _make_rapl_meter(rapl_root: str, env: Mapping[str, str], clock: Callable[[], float]) -> RaplMeter:
    local_rank = env.get("LOCAL_RANK", "0") or "0"
    if local_rank != "0":
        raise _Unavailable(f"RAPL is node-wide and is read by local rank 0 only (this is local rank {local_rank})")
    return RaplMeter(rapl_root, clock=clock)


def make_meter(
    mode: str = "auto",
    *,
    device_indices: list[int] | None = None,
    nvml: Any | None = None,
    rapl_root: str = RAPL_ROOT,
    env: Mapping[str, str] | None = None,
    torch_ids: Sequence[Mapping[str, Any]] | None = None,
    clock: Callable[[], float] = time.monotonic,
    sample_interval_s: float = 0.1,
    sampling_thread: bool = True,
) -> EnergyMeter:
    """Build the best energy meter this process can use. Probes once; ``auto`` never raises.

    ``auto``: NVML (counter, else power integration, per device) for this process's CUDA
    devices; for a process without CUDA devices, RAPL if readable (local rank 0 only); else a
    :class:`NullMeter` whose ``why`` gives every reason. A fallback is logged once.

    Args:
        mode: ``auto``, ``nvml``, ``rapl`` or ``none`` (the ``measure_energy`` parameter).
        device_indices: CUDA device indices this process owns (e.g. ``[accelerator.device.index]``);
            default: torch's current device under a distributed launcher (``LOCAL_RANK`` set),
            else every visible device; none when torch is not imported or has no CUDA.
        nvml: a ``pynvml``-compatible module (tests pass a fake); default: import ``pynvml``.
        rapl_root: powercap directory (tests pass a fake sysfs tree).
        env: environment (default ``os.environ``): ``CUDA_VISIBLE_DEVICES``, ``LOCAL_RANK``.
        torch_ids: per CUDA index ``{"uuid", "pci_bus_id"}``; default: asked of torch.
        clock: seconds, monotonic (tests pass a fake clock).
        sample_interval_s: power-integration sampling period, s.
        sampling_thread: run the power sampling thread (tests call ``poll()`` instead).

    Raises:
        ValueError: for an unknown ``mode``, or when ``nvml`` / ``rapl`` is requested explicitly
            and cannot be served (the message says why).
    """
    if mode not in MODES:
        raise ValueError(f"measure_energy={mode!r} is not accepted; use one of {', '.join(MODES)}")
    env = os.environ if env is None else env
    if mode == "none":
        return NullMeter("measure_energy=none", clock=clock)
    if mode in ("nvml", "auto") and (device_indices is None or torch_ids is None):
        mine, tids = _torch_cuda_ids(env)
        device_indices = mine if device_indices is None else device_indices
        torch_ids = tids if torch_ids is None else torch_ids
    nvml_args = (nvml, device_indices, env, torch_ids, clock, sample_interval_s, sampling_thread)
    if mode == "nvml":
        try:
            return _make_nvml_meter(*nvml_args)
        except _Unavailable as e:
            raise ValueError(f"measure_energy='nvml' cannot be served: {e}") from None
    if mode == "rapl":
        try:
            return _make_rapl_meter(rapl_root, env, clock)
        except _Unavailable as e:
            raise ValueError(f"measure_energy='rapl' cannot be served: {e}") from None

    reasons: list[str] = []
    owned: tuple[str, ...] = ()
    if device_indices:
        owned = _cuda_ids(device_indices, torch_ids)
        try:
            meter: EnergyMeter = _make_nvml_meter(*nvml_args)
            if meter.why:
                _warn_once(f"energy: {meter.why}")
            return meter
        except _Unavailable as e:
            reasons.append(f"nvml: {e}")
            owned = e.owned or owned
        except Exception as e:  # a misbehaving driver must not stop training
            reasons.append(f"nvml: {_err(e)}")
        reasons.append("rapl: not used for a process on CUDA devices (CPU energy is not the GPUs' energy)")
    else:
        reasons.append("nvml: no CUDA device in this process")
        try:
            return _make_rapl_meter(rapl_root, env, clock)
        except _Unavailable as e:
            reasons.append(str(e))
        except Exception as e:
            reasons.append(f"RAPL: {_err(e)}")
    why = "; ".join(reasons)
    short = "NVML unavailable for this process's GPUs" if device_indices else "no CUDA device, no readable RAPL"
    if env.get("LOCAL_RANK", "0") == "0":  # once a machine, not once a process (the reason is the machine's)
        _warn_once(f"energy not measured here ({short}): only codecarbon's estimate is logged "
                   "(tag llmeff.energy.why and `llmeff energy-probe` say why)")
    return NullMeter(why, owned=owned, clock=clock)


def _cuda_ids(device_indices: Sequence[int], torch_ids: Sequence[Mapping[str, Any]] | None) -> tuple[str, ...]:
    """Ids of this process's CUDA devices when NVML cannot name them: torch's UUID, else ``<host>:cuda:<i>``."""
    out = []
    for i in device_indices:
        ids = torch_ids[i] if torch_ids is not None and i < len(torch_ids) else None
        out.append(_normalize_uuid(ids["uuid"]) if ids and ids.get("uuid") else f"{socket.gethostname()}:cuda:{i}")
    return tuple(dict.fromkeys(out))
