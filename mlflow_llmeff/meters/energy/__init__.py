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

Modules: :mod:`.base` (the interface, readings, :class:`NullMeter`, summing ranks), :mod:`.nvml`,
:mod:`.rapl`, :mod:`.select` (:func:`make_meter`), :mod:`.fake` (:class:`FakeEnergyMeter`). The
unit conversions and ratios (:func:`joules_to_kwh`, :func:`j_per_token`, ...) are pure arithmetic in
:mod:`mlflow_llmeff.calc.efficiency`, re-exported here.
"""

from __future__ import annotations

from mlflow_llmeff.calc.efficiency import (
    J_PER_KWH,
    average_power_w,
    j_per_token,
    joules_to_kwh,
    kwh_per_billion_tokens,
    tflops_per_w,
)
from mlflow_llmeff.meters.energy.base import (
    MODES,
    RAPL_ROOT,
    SOURCE_FAKE,
    SOURCE_NONE,
    SOURCE_NVML_COUNTER,
    SOURCE_NVML_POWER,
    SOURCE_RAPL,
    EnergyMeter,
    EnergyReading,
    NullMeter,
    _log,
    _Unavailable,
    _warn_once,
    _warned,
    device_owners,
    sum_over_ranks,
)
from mlflow_llmeff.meters.energy.fake import FakeEnergyMeter
from mlflow_llmeff.meters.energy.nvml import NvmlMeter, _torch_cuda_ids, resolve_nvml_devices
from mlflow_llmeff.meters.energy.rapl import RaplMeter
from mlflow_llmeff.meters.energy.select import make_meter


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
