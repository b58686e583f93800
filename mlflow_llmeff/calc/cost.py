"""USD of a training run from a device-hour price (plus an optional energy price); pure, no I/O.

    cost/total_usd = device_hour_usd x devices x wall_s / 3600  (+ kWh x usd_per_kwh if given)
    summary/usd_per_billion_tokens = cost/total_usd x 1e9 / tokens

A job whose attempts ran on different numbers of devices (an elastic restart after a lost machine:
2 processes, then 1) is billed by its device-hours, the sum over attempts of devices x attempt
hours (:func:`device_hours`); ``devices x wall_s`` is that sum for one device count.

The device-hour price is the user's ``device_hour_usd`` parameter or, failing that, the dated
default table below: on-demand list prices per GPU-hour, which change often and differ by a
factor of 2-5 between providers. The table exists so a run has a cost at all; pass
``device_hour_usd`` for a figure that means something for you. A rental price normally includes
the electricity; ``usd_per_kwh`` is for owned hardware (or a price that excludes power).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from mlflow_llmeff import names

__all__ = [
    "DevicePrice",
    "DEFAULT_DEVICE_HOUR_USD",
    "PRICE_TABLE_READ_ON",
    "device_hour_price",
    "total_cost_usd",
    "device_hours",
    "device_hours_cost_usd",
    "usd_per_billion_tokens",
    "cost_tags",
]


@dataclass(frozen=True)
class DevicePrice:
    """One row of the default price table.

    Attributes:
        usd: on-demand price, USD per device per hour.
        offer: the offer the price is for (provider, instance shape).
        source: URL of the provider's price page.
        listed_on: the date the provider page was captured showing this price.
        read_on: the date the capture was read for this table.
    """

    usd: float
    offer: str
    source: str
    listed_on: str
    read_on: str

    def describe(self) -> str:
        return f"default table: {self.offer}, {self.source} (listed {self.listed_on}, read {self.read_on})"


PRICE_TABLE_READ_ON = "2026-11-30"
_LAMBDA = "https://lambda.ai/instances"
_LAMBDA_ON = "2026-09-20"
_HYPERSTACK = "https://www.hyperstack.cloud/gpu-pricing"
_HYPERSTACK_ON = "2026-08-26"

# USD per device-hour, on-demand, keyed by the accelerator short names of hardware.PEAK_TABLE
# (llmeff.accelerator.short), so a generic "A100" or "H100" of unknown variant gets no price.
# One provider where it lists the GPU (Lambda, largest node shape, per GPU), so that rows compare;
# H200 from Hyperstack, which Lambda does not list. Captures of the provider pages dated
# listed_on, read on PRICE_TABLE_READ_ON. No CPU row: a CPU "device" has no standard price.
DEFAULT_DEVICE_HOUR_USD: dict[str, DevicePrice] = {
    "B200": DevicePrice(6.69, "Lambda on-demand 8x NVIDIA B200 SXM6, per GPU", _LAMBDA, _LAMBDA_ON, PRICE_TABLE_READ_ON),
    "H200": DevicePrice(3.99, "Hyperstack on-demand NVIDIA H200 SXM, per GPU", _HYPERSTACK, _HYPERSTACK_ON, PRICE_TABLE_READ_ON),
    "H100-SXM": DevicePrice(3.99, "Lambda on-demand 8x NVIDIA H100 SXM, per GPU", _LAMBDA, _LAMBDA_ON, PRICE_TABLE_READ_ON),
    "H100-PCIe": DevicePrice(3.29, "Lambda on-demand 1x NVIDIA H100 PCIe", _LAMBDA, _LAMBDA_ON, PRICE_TABLE_READ_ON),
    "GH200": DevicePrice(2.29, "Lambda on-demand 1x NVIDIA GH200", _LAMBDA, _LAMBDA_ON, PRICE_TABLE_READ_ON),
    "A100-80GB": DevicePrice(2.79, "Lambda on-demand 8x NVIDIA A100 SXM 80 GB, per GPU", _LAMBDA, _LAMBDA_ON, PRICE_TABLE_READ_ON),
    "A100-SXM4-40GB": DevicePrice(1.99, "Lambda on-demand 8x NVIDIA A100 SXM 40 GB, per GPU", _LAMBDA, _LAMBDA_ON, PRICE_TABLE_READ_ON),
    "A10": DevicePrice(1.29, "Lambda on-demand 1x NVIDIA A10", _LAMBDA, _LAMBDA_ON, PRICE_TABLE_READ_ON),
    "V100-SXM2": DevicePrice(0.79, "Lambda on-demand 8x NVIDIA Tesla V100 (SXM2 16 GB), per GPU", _LAMBDA, _LAMBDA_ON, PRICE_TABLE_READ_ON),
}


def _key(name: str) -> str:
    """Normalise a short name for look-up: case, spaces, '-' and '_' do not matter."""
    return re.sub(r"[\s_\-]+", "", name).upper()


_BY_KEY = {_key(k): v for k, v in DEFAULT_DEVICE_HOUR_USD.items()}


def _check_price(name: str, value: float) -> float:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
        raise ValueError(f"{name}={value!r} is not accepted; give a finite price >= 0 in USD")
    return float(value)


def device_hour_price(accelerator_short: str, user_price: float | None) -> tuple[float | None, str]:
    """The USD per device-hour to use, and where it comes from (``llmeff.cost.source``).

    The user's price wins. Otherwise the default table is looked up by exact short name (case,
    spaces, ``-`` and ``_`` ignored: ``"h100 pcie"`` finds ``"H100-PCIe"``), never by substring,
    so an unknown device gets no invented price.

    Args:
        accelerator_short: ``llmeff.accelerator.short``, e.g. ``"H100-SXM"``, ``"cpu"``.
        user_price: the ``device_hour_usd`` parameter, USD, or None.

    Returns:
        ``(price, source)``; ``(None, "unknown: ...")`` when there is no price.

    Raises:
        ValueError: for a negative or non-finite ``user_price``.
    """
    if user_price is not None:
        return _check_price("device_hour_usd", user_price), "user (device_hour_usd)"
    row = _BY_KEY.get(_key(accelerator_short or ""))
    if row is None:
        return None, f"unknown: no default price for {accelerator_short!r}; pass device_hour_usd"
    return row.usd, row.describe()


def total_cost_usd(
    *, device_hour_usd: float, devices: int, wall_s: float, kwh: float = 0.0, usd_per_kwh: float | None = None
) -> float:
    """Cost of a run, USD = device_hour_usd x devices x wall_s / 3600 (+ kwh x usd_per_kwh).

    Args:
        device_hour_usd: price per device per hour, USD.
        devices: devices taking part (world size).
        wall_s: wall time billed, s.
        kwh: measured energy, kWh (only used with ``usd_per_kwh``).
        usd_per_kwh: energy price, USD/kWh, or None to leave energy unpriced.

    Raises:
        ValueError: for a negative or non-finite input, or a non-positive device count.
    """
    _check_price("device_hour_usd", device_hour_usd)
    if devices <= 0:
        raise ValueError(f"devices={devices!r} must be a positive count")
    if not (math.isfinite(wall_s) and wall_s >= 0):
        raise ValueError(f"wall_s={wall_s!r} must be a finite number of seconds >= 0")
    usd = device_hour_usd * devices * wall_s / 3600.0
    if usd_per_kwh is not None:
        _check_price("usd_per_kwh", usd_per_kwh)
        if not (math.isfinite(kwh) and kwh >= 0):
            raise ValueError(f"kwh={kwh!r} must be a finite energy >= 0")
        usd += kwh * usd_per_kwh
    return usd


def device_hours(spans: "list[tuple[int, float]] | tuple[tuple[int, float], ...]") -> float:
    """Device-hours of a job whose attempts held different numbers of devices.

    ``device_hours = sum over spans of devices x seconds / 3600``: each attempt (or part of one)
    counted with the devices it held while it ran; the time no attempt ran (down time, a queue
    wait) holds no device and is not a span.

    Args:
        spans: ``(devices, seconds)`` per attempt, e.g. ``[(2, 1800.0), (1, 900.0)]`` -> 1.25.

    Raises:
        ValueError: for a device count below 1 or a negative or non-finite number of seconds.
    """
    total = 0.0
    for devices, seconds in spans:
        if not isinstance(devices, int) or isinstance(devices, bool) or devices < 1:
            raise ValueError(f"devices={devices!r} must be a positive count")
        if not (math.isfinite(seconds) and seconds >= 0):
            raise ValueError(f"seconds={seconds!r} must be a finite number of seconds >= 0")
        total += devices * seconds
    return total / 3600.0


def device_hours_cost_usd(*, device_hour_usd: float, device_hours: float, kwh: float = 0.0,
                          usd_per_kwh: float | None = None) -> float:
    """Cost of ``device_hours`` device-hours, USD = device_hour_usd x device_hours (+ kwh x usd_per_kwh):
    :func:`total_cost_usd` for a job whose device count changed between attempts (:func:`device_hours`).

    Raises:
        ValueError: for a negative or non-finite input.
    """
    _check_price("device_hour_usd", device_hour_usd)
    if not (math.isfinite(device_hours) and device_hours >= 0):
        raise ValueError(f"device_hours={device_hours!r} must be a finite number >= 0")
    usd = device_hour_usd * device_hours
    if usd_per_kwh is not None:
        _check_price("usd_per_kwh", usd_per_kwh)
        if not (math.isfinite(kwh) and kwh >= 0):
            raise ValueError(f"kwh={kwh!r} must be a finite energy >= 0")
        usd += kwh * usd_per_kwh
    return usd


def usd_per_billion_tokens(total_usd: float, tokens: int) -> float:
    """Cost per 1e9 non-padding tokens, USD = total_usd x 1e9 / tokens.

    Raises:
        ValueError: if ``tokens`` is not positive.
    """
    if tokens <= 0:
        raise ValueError(f"tokens={tokens!r} must be a positive count")
    return total_usd * 1e9 / tokens


def cost_tags(device_hour_usd: float | None, source: str, usd_per_kwh: float | None = None) -> dict[str, str]:
    """``llmeff.cost.*`` tags: the price assumed, its source and the energy price (or 'none')."""
    return {
        names.COST_DEVICE_HOUR_USD: "none" if device_hour_usd is None else f"{device_hour_usd:g}",
        names.COST_SOURCE: source,
        names.COST_USD_PER_KWH: "none" if usd_per_kwh is None else f"{usd_per_kwh:g}",
    }
