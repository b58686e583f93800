"""A hardware-free energy meter for tests: constant power per device on an injected clock.

Also re-exported by :mod:`mlflow_llmeff.testing`, the one module of fakes.
"""

from __future__ import annotations

from typing import Callable, Mapping

from mlflow_llmeff.meters.energy.base import SOURCE_FAKE, EnergyMeter, EnergyReading


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
