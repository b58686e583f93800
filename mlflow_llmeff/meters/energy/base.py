"""The energy meter interface, its readings, and what every backend shares.

:class:`EnergyMeter` (``start()``, ``read()``, ``close()``), :class:`EnergyReading` (joules per
device id), :class:`NullMeter` (nothing measurable, and why), summing readings over ranks
(:func:`sum_over_ranks`, :func:`device_owners`), and the counter / power-integration helpers the
NVML and RAPL backends use. The package docstring (:mod:`mlflow_llmeff.meters.energy`) says how
a backend is chosen.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

from mlflow_llmeff.calc.efficiency import joules_to_kwh

SOURCE_NVML_COUNTER = "nvml_counter"
SOURCE_NVML_POWER = "nvml_power"
SOURCE_RAPL = "rapl"
SOURCE_NONE = "none"
SOURCE_FAKE = "fake"

MODES = ("auto", "nvml", "rapl", "none")
RAPL_ROOT = "/sys/class/powercap"

# the package's logger name, as before the package was split (one logger for every backend)
_log = logging.getLogger("mlflow_llmeff.meters.energy")
_warned: set[str] = set()


def _warn_once(msg: str) -> None:
    """Log ``msg`` as a warning, ``llmeff: <msg>`` like every line the package prints, the first time it is
    seen in this process."""
    if msg not in _warned:
        _warned.add(msg)
        _log.warning(f"llmeff: {msg}")


class _Unavailable(Exception):
    """A backend cannot serve this process; the message is the reason (for ``energy.why``).

    ``owned``: the device ids it would have measured, when they are known (they stay the run's
    devices, unmeasured).
    """

    def __init__(self, msg: str, owned: Sequence[str] = ()):
        super().__init__(msg)
        self.owned = tuple(owned)

def _as_str(x: Any) -> str:
    return x.decode() if isinstance(x, (bytes, bytearray)) else str(x)

def _err(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__

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
