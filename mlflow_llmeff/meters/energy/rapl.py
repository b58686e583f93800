"""RAPL backend: CPU package and DRAM energy from Linux powercap sysfs (``rapl``).

Microjoules become joules as soon as they are read; counters wrap at ``max_energy_range_uj``.
"""

from __future__ import annotations

import os
import re
import socket
import time
from typing import Callable

from mlflow_llmeff.meters.energy.base import (
    RAPL_ROOT,
    SOURCE_RAPL,
    EnergyMeter,
    EnergyReading,
    _Counter,
    _err,
    _Unavailable,
    _warn_once,
)


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
