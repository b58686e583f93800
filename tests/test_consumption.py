"""Consumption totals: hand-computed energy, carbon, cost; they never roll back on a resume."""

import pytest

from mlflow_llmeff import names
from mlflow_llmeff.consumption import Consumption


def test_measured_energy_carbon_and_cost_hand_computed():
    c = Consumption(devices=8, device_hour_usd=2.5, usd_per_kwh=0.1, intensity_g_per_kwh=400.0)
    c.update(joules=7.2e6, energy_devices=8)  # 2 kWh
    t = c.totals(wall_s=1800.0)
    assert t[names.ENERGY_TOTAL_KWH] == 2.0
    assert t[names.CARBON_TOTAL_KG] == 0.8  # 2 kWh x 400 g/kWh
    assert t[names.COST_TOTAL_USD] == 2.5 * 8 * 0.5 + 2.0 * 0.1  # 10.2 USD
    s = c.summary(1800.0, tokens=4_000_000, device_tflops=100.0)
    assert s[names.SUM_J_PER_TOKEN] == 1.8
    assert s[names.SUM_KWH_PER_BTOK] == 500.0
    assert s[names.SUM_USD_PER_BTOK] == pytest.approx(2550.0)
    assert s[names.SUM_TFLOPS_PER_W] == 100.0 / 500.0  # 7.2e6 J / 1800 s / 8 devices = 500 W each
    assert s[names.SUM_KG_CO2E_PER_BTOK] == pytest.approx(200.0)
    assert names.SUM_ESTIMATE_KG_CO2E not in s  # measured energy wins


def test_interval_power_and_energy_per_token_since_the_last_point():
    c = Consumption(devices=2)
    c.start_interval(wall_s=0.0, tokens=0)
    c.update(joules=4000.0, energy_devices=2)
    first = c.interval(wall_s=10.0, tokens=1000)
    assert first[names.ENERGY_DEVICE_AVG_POWER_W] == 200.0 and first[names.ENERGY_J_PER_TOKEN] == 4.0
    c.update(joules=10000.0, energy_devices=2)
    second = c.interval(wall_s=20.0, tokens=4000)
    assert second[names.ENERGY_DEVICE_AVG_POWER_W] == 300.0 and second[names.ENERGY_J_PER_TOKEN] == 2.0
    assert names.COST_TOTAL_USD not in second  # no price, no cost


def test_only_an_estimate_gives_estimate_figures_never_measured_ones():
    c = Consumption(devices=1, intensity_g_per_kwh=500.0)
    c.update(joules=0.0, energy_devices=0, estimate=(1e-4, 3e-4))
    t = c.totals(60.0)
    assert names.ENERGY_TOTAL_KWH not in t and names.CARBON_TOTAL_KG not in t
    assert t[names.ENERGY_ESTIMATE_CPU_KWH] == 1e-4 and t[names.ENERGY_ESTIMATE_RAM_KWH] == 3e-4
    assert t[names.CARBON_ESTIMATE_KG] == pytest.approx(2e-4)
    s = c.summary(60.0, tokens=1000, device_tflops=None)
    assert s[names.SUM_ESTIMATE_KG_CO2E] == pytest.approx(2e-4)
    assert s[names.SUM_ESTIMATE_KG_CO2E_PER_BTOK] == pytest.approx(2e2)
    assert names.SUM_ENERGY_KWH not in s


def test_resume_continues_from_the_later_of_checkpoint_and_last_logged_point():
    c = Consumption(devices=1, intensity_g_per_kwh=500.0)
    checkpoint = {"energy_j": 3.6e6, "estimate_cpu_kwh": 1e-4, "estimate_ram_kwh": 2e-4}
    # the crashed attempt logged more after its checkpoint (energy) but not the estimate
    c.resume(checkpoint, {names.ENERGY_TOTAL_KWH: 1.5, names.ENERGY_ESTIMATE_RAM_KWH: 1e-4})
    c.update(joules=1.8e6, energy_devices=1, estimate=(1e-5, 2e-5))
    assert c.total_kwh == 2.0  # 1.5 kWh up to the crash + 0.5 kWh now
    assert c.estimate == pytest.approx((1.1e-4, 2.2e-4))  # the checkpoint's estimate was the later one
    assert c.state_dict() == pytest.approx({"energy_j": 7.2e6, "estimate_cpu_kwh": 1.1e-4, "estimate_ram_kwh": 2.2e-4})
