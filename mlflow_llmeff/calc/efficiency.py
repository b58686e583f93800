"""Energy units and efficiency ratios: J to kWh, J per token, average power, TFLOP/s per W.

Pure arithmetic (standard library only); the energy meters that measure the joules are in
:mod:`mlflow_llmeff.meters.energy`. Formulas: ``docs/energy_carbon_cost.md`` (energy and efficiency rows).
"""

from __future__ import annotations

__all__ = ["J_PER_KWH", "joules_to_kwh", "j_per_token", "average_power_w", "tflops_per_w", "kwh_per_billion_tokens"]

J_PER_KWH = 3.6e6  # 1 kWh = 1000 W x 3600 s


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
