"""Consumption totals: hand-computed energy, carbon, cost; they never roll back on a resume."""

import pytest

from mlflow_llmeff import names
from mlflow_llmeff.monitor.consumption import Consumption


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
    state = c.state_dict()
    assert (state.pop("energy_partial"), state.pop("energy_head_gap_s")) == (False, 0.0)
    assert state == pytest.approx({"energy_j": 7.2e6, "estimate_cpu_kwh": 1.1e-4, "estimate_ram_kwh": 2.2e-4})


def test_partial_measurement_omits_run_totals_and_per_token_energy_and_names_the_unmeasured():
    # 2 devices of the run, one measured (3.6 MJ = 1 kWh over 1000 s): coverage 0.5, nothing silently partial.
    c = Consumption(devices=2, device_hour_usd=3.6, intensity_g_per_kwh=400.0)
    c.set_devices(2, {"GPU-b": "GPU is lost"})
    c.start_interval(wall_s=0.0, tokens=0)
    c.update(joules=3.6e6, energy_devices=1, measured_domains=1, wall_s=1000.0)
    assert (c.coverage, c.complete, c.total_kwh) == (0.5, False, None)
    interval = c.interval(wall_s=1000.0, tokens=10_000)
    assert interval == {names.COST_TOTAL_USD: pytest.approx(2.0), names.ENERGY_DEVICE_AVG_POWER_W: 3600.0}
    s = c.summary(1000.0, tokens=10_000, device_tflops=36.0)
    assert s[names.SUM_ENERGY_COVERAGE] == 0.5 and s[names.SUM_TFLOPS_PER_W] == 0.01   # 36 / 3600 W measured
    for key in (names.SUM_ENERGY_KWH, names.SUM_J_PER_TOKEN, names.SUM_KWH_PER_BTOK, names.SUM_KG_CO2E,
                names.SUM_KG_CO2E_PER_BTOK, names.SUM_ESTIMATE_KG_CO2E):
        assert key not in s
    assert s[names.SUM_COST_USD] == pytest.approx(2.0)   # device-hours: complete without an energy price
    tag = c.tags(1000.0)[names.ENERGY_COVERAGE]
    assert tag.startswith("1/2 devices measured; not measured: GPU-b (GPU is lost); energy/total_kwh")
    assert "omitted, not scaled" in tag


def test_partial_measurement_drops_a_cost_that_would_price_partial_energy():
    c = Consumption(devices=2, device_hour_usd=3.6, usd_per_kwh=0.2)
    c.set_devices(2, {"GPU-b": "GPU is lost"})
    c.update(joules=3.6e6, energy_devices=1, measured_domains=1, wall_s=1000.0)
    assert c.cost_usd(1000.0) is None and "cost/* omitted" in c.tags(1000.0)[names.ENERGY_COVERAGE]


def test_a_device_two_ranks_own_is_named_in_the_coverage_tag():
    c = Consumption(devices=2)
    c.set_devices(1, shared={"GPU-a": [0, 1]})
    c.update(joules=100.0, energy_devices=1, measured_domains=1, wall_s=1.0)
    assert c.coverage == 1.0 and c.total_kwh == pytest.approx(100 / 3.6e6)
    assert c.tags(1.0)[names.ENERGY_COVERAGE] == "1/1 devices measured; GPU-a is owned by ranks 0, 1 and counted once (read by rank 0)"


def test_an_earlier_partial_attempt_keeps_the_run_partial():
    c = Consumption(devices=1)
    c.resume({"energy_j": 10.0, "energy_partial": True}, {})
    c.set_devices(1)
    c.update(joules=5.0, energy_devices=1, measured_domains=1, wall_s=2.0)
    assert c.coverage == 1.0 and not c.complete and c.total_kwh is None


# --------------------------------------------------------------------------- a counter slower than the interval
def _stepping_gpu(clock, watts: float, every_s: float):
    """A fake NVML GPU whose total-energy counter moves only every ``every_s`` seconds (some boards)."""
    import math
    from dataclasses import dataclass

    from mlflow_llmeff.testing import FakeGpu

    @dataclass
    class SteppingGpu(FakeGpu):
        every_s: float = 3.0

        def energy_mj(self) -> int:  # the counter's value at its last update
            return self.base_mj + round(self.watts * 1000 * math.floor(self.clock() / self.every_s) * self.every_s)

    return SteppingGpu("GPU-cccccccc-1111-2222-3333-444444444444", "00000000:18:00.0", watts, clock,
                       base_mj=7_000_000, every_s=every_s)


def test_a_counter_moving_every_third_interval_never_logs_0_w_and_keeps_its_total():
    from mlflow_llmeff.meters.energy import make_meter
    from mlflow_llmeff.testing import FakeClock, fake_nvml

    clock = FakeClock(0.0)
    gpu = _stepping_gpu(clock, 300.0, every_s=3.0)  # 900 J at t = 3, 6, 9 s; logging every 1 s
    meter = make_meter("nvml", device_indices=[0], nvml=fake_nvml([gpu]), env={"LOCAL_RANK": "0"}, clock=clock,
                       sampling_thread=False)
    meter.start()
    c = Consumption(devices=1)
    c.start_interval(wall_s=0.0, tokens=0)
    powers, per_token, why = {}, {}, {}
    for t in range(1, 11):  # intervals ending at 1..10 s, 100 tokens each
        clock.t = float(t)
        c.update(joules=meter.read().joules, energy_devices=1, wall_s=float(t))
        out = c.interval(wall_s=float(t), tokens=100 * t)
        if names.ENERGY_DEVICE_AVG_POWER_W in out:
            powers[t], per_token[t] = out[names.ENERGY_DEVICE_AVG_POWER_W], out[names.ENERGY_J_PER_TOKEN]
        else:
            why[t] = c.interval_why
    # by hand: each moving interval closes a 3 s span of 900 J and 300 tokens: 900 / 3 = 300 W, 900 / 300 = 3 J/token
    assert powers == {3: 300.0, 6: 300.0, 9: 300.0} and per_token == {3: 3.0, 6: 3.0, 9: 3.0}
    assert 0.0 not in powers.values()
    # the intervals the counter did not move are absent with why, the last one (10 s, no movement yet) too
    assert sorted(why) == [1, 2, 4, 5, 7, 8, 10]
    assert set(why[10]) == {names.ENERGY_DEVICE_AVG_POWER_W, names.ENERGY_J_PER_TOKEN}
    assert why[10][names.ENERGY_DEVICE_AVG_POWER_W].startswith("the energy counter did not move over the interval")
    # the total is the counter's, exactly: 300 W x 9 s at its last update
    assert c.total_j == 2700.0 == (gpu.energy_mj() - 7_000_000) / 1000


def test_a_counter_that_moves_every_interval_is_unchanged():
    c = Consumption(devices=1)
    c.start_interval(wall_s=0.0, tokens=0)
    c.update(joules=250.0, energy_devices=1)
    assert c.interval(wall_s=1.0, tokens=10)[names.ENERGY_DEVICE_AVG_POWER_W] == 250.0 and c.interval_why == {}
