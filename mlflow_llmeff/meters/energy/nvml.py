"""NVML backends: the total-energy counter (``nvml_counter``), else integrated board power
(``nvml_power``), and finding this process's devices in NVML by UUID.

NVML's counter belongs to the whole physical GPU. A MIG instance (or a GPU in MIG mode) and a GPU
that another process uses during the run are therefore not measured as the run's
(:func:`whole_gpu_reason`, :func:`other_processes`; ``docs/energy_carbon_cost.md``, "Partial
measurement"): they are named in :attr:`EnergyMeter.unmeasured` with the reason, and
``summary/energy_coverage`` counts them as unmeasured. No share is guessed (NVML gives no
per-process or per-instance energy).

NVML millijoules and milliwatts become joules and watts as soon as they are read. ``pynvml``
comes from the ``nvidia-ml-py`` distribution and is imported lazily (:func:`_import_nvml`).
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any, Callable, Iterable, Mapping, Sequence

from mlflow_llmeff.meters.energy.base import (
    SOURCE_NONE,
    SOURCE_NVML_COUNTER,
    SOURCE_NVML_POWER,
    EnergyMeter,
    EnergyReading,
    _as_str,
    _Counter,
    _err,
    _PowerIntegrator,
    _Unavailable,
    _warn_once,
)


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
        own_pids: the pids that are this run's (default :func:`run_pids`); a device listing any
            other compute process at :meth:`start` or a :meth:`read` is dropped from then on.

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
        own_pids: Callable[[], Iterable[int]] | None = None,
    ):
        self._nvml = nvml
        self._own_pids = own_pids or run_pids
        self._pids: list[int] | None = None
        self._handles = dict(devices)
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
            whole = whole_gpu_reason(nvml, dev, h)
            if whole is not None:
                notes.append(f"{dev}: {whole}; not measured")
                self._unmeasured[dev] = whole
                continue
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
            self._drop_shared_locked()
        if self._power_devs and self._use_thread:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="llmeff-nvml-power", daemon=True)
            self._thread.start()

    def _drop_shared_locked(self) -> None:
        """Leave out, from now on, every measured device on which another process runs."""
        def pids(fresh: bool) -> list[int] | None:
            if fresh or self._pids is None:  # the process tree is read once, and again only to confirm
                try:
                    self._pids = list(self._own_pids())
                except Exception as e:  # noqa: BLE001 - our own pids unreadable: nothing can be told apart
                    _warn_once(f"energy: this run's processes unreadable ({_err(e)}); other processes on its "
                               "GPUs not checked")
                    return None
            return self._pids

        for devs in (self._counter_devs, self._power_devs):
            for dev, h in list(devs):
                ours = pids(False)
                if ours is None:
                    return
                others = other_processes(self._nvml, h, ours)
                if others:  # a new rank or worker of ours may have started since: read our tree again
                    ours = pids(True)
                    others = other_processes(self._nvml, h, ours) if ours is not None else None
                if not others:
                    continue
                devs.remove((dev, h))
                self.device_methods.pop(dev, None)
                self._last_j.pop(dev, None)
                shown = ", ".join(str(p) for p in others[:4]) + (" ..." if len(others) > 4 else "")
                why = (f"another process used it during the run (pid {shown}): NVML's energy counter covers "
                       "the whole GPU, so its energy is not this run's alone")
                self._unmeasured[dev] = why
                note = f"{dev}: {why}; not measured"
                self.why = f"{self.why}; {note}" if self.why else note
                _warn_once(f"energy: {note}")
        self.num_devices = len(self._counter_devs) + len(self._power_devs)
        if self.num_devices == 0:
            self.source = SOURCE_NONE

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
            self._drop_shared_locked()
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

# --------------------------------------------------------------------------- devices not ours alone
def whole_gpu_reason(nvml: Any, dev: str, handle: Any) -> str | None:
    """Why NVML's energy counter of ``handle`` is not this run's alone, or None.

    On a MIG instance (a ``MIG-`` UUID or handle) and on a GPU whose MIG mode is enabled (this
    process then runs on one of its instances), ``nvmlDeviceGetTotalEnergyConsumption`` counts the
    whole physical GPU, every instance's work included (NVML API reference, "MIG": device-level
    queries of a MIG-enabled GPU cover the GPU); charging it to the run would count other
    instances' energy as ours. NVML reports no per-instance energy, so such a device is not
    measured.
    """
    try:
        if dev.startswith("MIG-") or int(nvml.nvmlDeviceIsMigDeviceHandle(handle) or 0):
            return "a MIG instance: NVML's energy counter covers the whole physical GPU, not the instance"
    except Exception:  # noqa: BLE001 - no MIG query (older driver or bindings): not a MIG handle
        pass
    try:
        current = nvml.nvmlDeviceGetMigMode(handle)
        current = current[0] if isinstance(current, (tuple, list)) else current
        if int(current or 0) == 1:
            return ("MIG mode is enabled on this GPU (the run uses one of its instances): NVML's energy "
                    "counter covers the whole physical GPU, every instance included")
    except Exception:  # noqa: BLE001 - Not Supported (no MIG on this GPU)
        pass
    return None


def other_processes(nvml: Any, handle: Any, own_pids: Iterable[int]) -> list[int] | None:
    """Compute processes on ``handle`` that are not ``own_pids`` (sorted), or None when NVML cannot tell.

    None also when NVML lists processes but none of ours although we use the device: its pids are
    then from another PID namespace (a container) and cannot be told apart.
    """
    try:
        procs = nvml.nvmlDeviceGetComputeRunningProcesses(handle)
    except Exception:  # noqa: BLE001
        return None
    pids = {int(p.pid) for p in procs}
    ours = set(own_pids)
    if pids and not ours & pids:
        return None
    return sorted(pids - ours)


def run_pids() -> list[int]:
    """This run's pids as one process sees them: its own tree and, under a launcher
    (``LOCAL_RANK`` set: torchrun, accelerate launch), the launcher's tree (the other ranks)."""
    import os

    from mlflow_llmeff.meters.contention import own_tree_pids

    pids = set(own_tree_pids())
    if "LOCAL_RANK" in os.environ:
        try:
            pids |= set(own_tree_pids(os.getppid()))
        except Exception:  # noqa: BLE001 - the launcher gone: our own tree only
            pass
    return sorted(pids)


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
