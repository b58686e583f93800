"""Choosing the energy backend of this process from ``measure_energy``: :func:`make_meter`.

``auto`` tries NVML (counter, else power integration), then RAPL for a process without CUDA
devices (local rank 0 only), else a :class:`~mlflow_llmeff.meters.energy.base.NullMeter` whose
``why`` gives every reason; see the package docstring.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any, Callable, Mapping, Sequence

from mlflow_llmeff.meters.energy.base import RAPL_ROOT, MODES, EnergyMeter, NullMeter, _err, _Unavailable, _warn_once
from mlflow_llmeff.meters.energy.nvml import (
    NvmlMeter,
    _import_nvml,
    _normalize_uuid,
    _torch_cuda_ids,
    resolve_nvml_devices,
)
from mlflow_llmeff.meters.energy.rapl import RaplMeter


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
