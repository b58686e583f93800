"""The fakes that tests and users need, in one module shipped with the package, so that a test of a
training script runs every measured path without a GPU, an NVML driver, RAPL or codecarbon.

* :class:`FakeClock`: an injected clock set by hand (``clock()``, ``clock.t``, ``clock.advance(dt)``);
  every meter takes a ``clock=`` argument, so figures over a window are exact and never depend on
  wall time.
* :func:`fake_nvml`: a fake ``pynvml`` module; its device handles are :class:`FakeGpu` objects
  whose readings follow a fake clock and attributes a test sets (energy counter, power, clocks,
  throttle reasons, temperature, power limit, the processes on the device, :class:`FakeProcess`).
  Units are NVML's own (millijoules, milliwatts, MHz, degrees C), so the code under test converts
  them exactly as it does for real NVML. Failing calls raise :class:`FakeNvmlError` (a stand-in for
  ``pynvml.NVMLError``, which the product catches as any exception).
* :class:`FakeEnergyMeter` (from :mod:`mlflow_llmeff.meters.energy`): constant watts per device on
  an injected clock, passed as ``EfficiencyMonitor(energy_meter=...)``.
* :class:`FakeCarbonTracker` (from :mod:`mlflow_llmeff.meters.carbon`): codecarbon's place with a
  fixed grid intensity, passed as ``EfficiencyMonitor(carbon_tracker=...)``.

Example::

    from mlflow_llmeff.testing import FakeClock, FakeEnergyMeter

    clock = FakeClock()
    meter = FakeEnergyMeter(300.0, clock=clock)  # 300 W on one device
    meter.start(); clock.advance(2.0)
    assert meter.read().joules == 600.0
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field
from typing import Callable

from mlflow_llmeff.meters.carbon import FakeCarbonTracker
from mlflow_llmeff.meters.energy import FakeEnergyMeter

__all__ = ["FakeClock", "FakeNvmlError", "FakeGpu", "FakeProcess", "fake_nvml", "THROTTLE_BITS",
           "FakeEnergyMeter", "FakeCarbonTracker"]


class FakeClock:
    """A monotonic clock a test sets by hand: ``clock()`` returns :attr:`t`, in seconds.

    Pass it wherever a meter takes ``clock=`` (a callable returning seconds). Time moves only when
    the test moves it: ``clock.t = 12.5`` or ``clock.advance(0.5)``.

    Args:
        t: the time it starts at, s (default 0.0).
    """

    def __init__(self, t: float = 0.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    @property
    def now(self) -> float:
        """The current time, s (the same as calling the clock)."""
        return self.t

    def advance(self, dt: float) -> float:
        """Move the clock ``dt`` seconds on and return the new time.

        Raises:
            ValueError: for a negative ``dt`` (a monotonic clock never goes back; set ``t`` to do so).
        """
        if dt < 0:
            raise ValueError(f"dt={dt!r} is negative; a monotonic clock does not go back (set .t instead)")
        self.t += dt
        return self.t

#: NVML clocks-event (throttle) reason bits (``nvml.h``, ``nvmlClocksEventReason*`` /
#: ``nvmlClocksThrottleReason*``), the ones the product names.
THROTTLE_BITS = {
    "gpu_idle": 0x1,
    "applications_clocks_setting": 0x2,
    "sw_power_cap": 0x4,
    "hw_slowdown": 0x8,
    "sync_boost": 0x10,
    "sw_thermal_slowdown": 0x20,
    "hw_thermal_slowdown": 0x40,
    "hw_power_brake_slowdown": 0x80,
    "display_clock_setting": 0x100,
}


class FakeNvmlError(Exception):
    """What a failing fake NVML call raises (e.g. ``Not Supported``, ``Not Found``)."""


@dataclass
class FakeProcess:
    """A process on a fake device, as ``nvmlDeviceGetComputeRunningProcesses`` reports it.

    Attributes:
        pid: process id.
        usedGpuMemory: bytes of device memory it holds (NVML's own attribute name).
    """

    pid: int
    usedGpuMemory: int | None = 0  # noqa: N815 - NVML's attribute name; None: NVML_VALUE_NOT_AVAILABLE


@dataclass
class FakeGpu:
    """A GPU whose energy counter (mJ) rises at ``watts`` on the fake clock.

    Attributes:
        uuid, pci: NVML UUID and PCI bus id.
        watts: board power (W); the counter rises at this rate.
        clock: the fake clock (seconds).
        base_mj: counter value at clock 0.
        counter: False for a pre-Volta GPU without the total-energy counter.
        reset_at: at that time the counter goes back to 0 (driver reload) and rises again.
        readable: False for a device whose every reading fails (e.g. lost from the bus).
        name: product name.
        sm_clock_mhz, max_sm_clock_mhz: current and maximum SM clock.
        throttle_reasons: bit mask of :data:`THROTTLE_BITS`; None: NVML answers "Not Supported".
        temperature_c: GPU temperature.
        power_limit_w: enforced power limit.
        processes: compute processes on the device; None: NVML answers "Not Supported".
        mig_mode: 1 on a physical GPU whose MIG mode is enabled (``nvmlDeviceGetMigMode``), else 0.
        parent: set on a MIG instance (a device of its own UUID ``MIG-...``): its physical GPU, whose
            energy counter it reports (NVML's counter belongs to the whole GPU).
    """

    uuid: str
    pci: str
    watts: float
    clock: Callable[[], float]
    base_mj: int = 0
    counter: bool = True
    reset_at: float | None = None
    readable: bool = True
    name: str = "NVIDIA H100 80GB HBM3"
    sm_clock_mhz: int = 1980
    max_sm_clock_mhz: int = 1980
    throttle_reasons: int | None = 0
    temperature_c: int = 45
    power_limit_w: float = 700.0
    processes: list[FakeProcess] | None = field(default_factory=list)
    mig_mode: int = 0
    parent: "FakeGpu | None" = None

    def _check(self) -> None:
        if not self.readable:
            raise FakeNvmlError("GPU is lost")

    def energy_mj(self) -> int:
        self._check()
        if not self.counter:
            raise FakeNvmlError("Not Supported")
        if self.parent is not None:  # a MIG instance: the whole GPU's counter
            return self.parent.energy_mj()
        t = self.clock()
        if self.reset_at is not None and t >= self.reset_at:
            return round(self.watts * 1000 * (t - self.reset_at))
        return self.base_mj + round(self.watts * 1000 * t)

    def power_mw(self) -> int:
        self._check()
        return round(self.watts * 1000)

    def supported(self, value):
        """``value``, or NVML's "Not Supported" error for a reading the device does not give (None)."""
        self._check()
        if value is None:
            raise FakeNvmlError("Not Supported")
        return value


def fake_nvml(gpus: list[FakeGpu], instances: list[FakeGpu] = ()) -> types.SimpleNamespace:
    """A stand-in for the ``pynvml`` module over ``gpus``: same function names, handles are the FakeGpu objects.

    ``instances`` are MIG instances (:attr:`FakeGpu.parent` set): found by their ``MIG-`` UUID, as
    NVML finds them, but not counted or indexed (NVML's index and PCI bus id are the physical GPU's).

    ``calls`` counts ``nvmlInit`` / ``nvmlShutdown``. ``NVML_CLOCK_SM`` and
    ``NVML_TEMPERATURE_GPU`` are the real constants' values.
    """
    calls = {"init": 0, "shutdown": 0}

    def find(attr, value):
        for g in list(gpus) + (list(instances) if attr == "uuid" else []):
            if getattr(g, attr) == value:
                return g
        raise FakeNvmlError("Not Found")

    def by_index(i):
        if not 0 <= i < len(gpus):
            raise FakeNvmlError("Invalid Argument")
        return gpus[i]

    def checked(fn):
        def call(g, *args):
            g._check()
            return fn(g, *args)
        return call

    return types.SimpleNamespace(
        calls=calls,
        NVMLError=FakeNvmlError,
        NVML_CLOCK_SM=1,
        NVML_TEMPERATURE_GPU=0,
        nvmlInit=lambda: calls.__setitem__("init", calls["init"] + 1),
        nvmlShutdown=lambda: calls.__setitem__("shutdown", calls["shutdown"] + 1),
        nvmlDeviceGetCount=lambda: len(gpus),
        nvmlDeviceGetHandleByIndex=by_index,
        nvmlDeviceGetHandleByUUID=lambda u: find("uuid", u),
        nvmlDeviceGetHandleByPciBusId=lambda b: find("pci", b),
        nvmlDeviceGetUUID=lambda g: g.uuid,
        nvmlDeviceGetName=checked(lambda g: g.name),
        nvmlDeviceGetTotalEnergyConsumption=lambda g: g.energy_mj(),
        nvmlDeviceGetPowerUsage=lambda g: g.power_mw(),  # mW
        nvmlDeviceGetClockInfo=checked(lambda g, kind: g.sm_clock_mhz),
        nvmlDeviceGetMaxClockInfo=checked(lambda g, kind: g.max_sm_clock_mhz),
        nvmlDeviceGetCurrentClocksEventReasons=lambda g: g.supported(g.throttle_reasons),
        nvmlDeviceGetCurrentClocksThrottleReasons=lambda g: g.supported(g.throttle_reasons),
        nvmlDeviceGetTemperature=checked(lambda g, sensor: g.temperature_c),
        nvmlDeviceGetEnforcedPowerLimit=checked(lambda g: round(g.power_limit_w * 1000)),  # mW
        nvmlDeviceGetComputeRunningProcesses=lambda g: list(g.supported(g.processes)),
        nvmlDeviceGetMigMode=checked(lambda g: (g.mig_mode, g.mig_mode)),  # (current, pending)
        nvmlDeviceIsMigDeviceHandle=lambda g: int(g.parent is not None),
        nvmlDeviceGetDeviceHandleFromMigDeviceHandle=lambda g: g.parent if g.parent is not None else g,
    )
