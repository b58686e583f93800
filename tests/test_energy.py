"""Energy meters: NVML counters and power integration (fake pynvml), RAPL (fake sysfs), summing ranks."""

from __future__ import annotations

import types

import pytest

from mlflow_llmeff.meters import energy
from mlflow_llmeff.testing import FakeClock, FakeGpu, FakeNvmlError, fake_nvml  # noqa: F401
from mlflow_llmeff.meters.energy import (
    EnergyReading,
    FakeEnergyMeter,
    device_owners,
    make_meter,
    sum_over_ranks,
)


UUID_A = "GPU-aaaaaaaa-1111-2222-3333-444444444444"
UUID_B = "GPU-bbbbbbbb-1111-2222-3333-444444444444"


def two_gpus(clock, **b_kwargs):
    a = FakeGpu(UUID_A, "00000000:18:00.0", 300.0, clock, base_mj=5_000_000)
    b = FakeGpu(UUID_B, "00000000:3B:00.0", 400.0, clock, base_mj=9_000_000, **b_kwargs)
    return a, b


def rank_meter(nvml, clock, visible, env_extra=None):
    env = {"CUDA_VISIBLE_DEVICES": visible, "LOCAL_RANK": "0", **(env_extra or {})}
    return make_meter("nvml", device_indices=[0], nvml=nvml, env=env, clock=clock, sampling_thread=False)


def test_two_ranks_each_measure_own_device_and_total_is_the_sum_not_twice():
    clock = FakeClock(10.0)
    a, b = two_gpus(clock)
    nvml = fake_nvml([a, b])
    # each rank sees one GPU, named by UUID in the order opposite to NVML's
    m0 = rank_meter(nvml, clock, visible=UUID_B)
    m1 = rank_meter(nvml, clock, visible=UUID_A)
    m0.start(), m1.start()
    clock.t = 110.0  # 100 s later: B 400 W -> 40,000 J, A 300 W -> 30,000 J
    r0, r1 = m0.read(), m1.read()
    assert m0.source == m1.source == "nvml_counter" and m0.why is None
    assert r0.per_device_j == {UUID_B: 40_000.0}
    assert r1.per_device_j == {UUID_A: 30_000.0}
    total = sum_over_ranks([EnergyReading.from_dict(r0.as_dict()), r1])
    assert total.joules == 70_000.0  # not 140,000
    assert total.elapsed_s == 100.0
    tokens = 1_000_000
    assert energy.j_per_token(total.joules, tokens) == 0.07
    assert energy.average_power_w(total.joules, total.elapsed_s, devices=2) == 350.0
    assert energy.joules_to_kwh(72_000.0) == 0.02


def test_same_device_reported_by_two_ranks_is_counted_once():
    r = EnergyReading(30_000.0, 100.0, {UUID_A: 30_000.0})
    total = sum_over_ranks([r, r])
    assert total.joules == 30_000.0
    assert total.per_device_j == {UUID_A: 30_000.0}


def test_each_device_has_one_owner_rank_however_many_ranks_own_it():
    # ranks 0 and 1 share GPU A (two processes on one device), rank 2 has B: A is read by rank 0 only
    owners = device_owners([[UUID_A], [UUID_A], [UUID_B]])
    assert owners == {UUID_A: 0, UUID_B: 2}


def test_an_unreadable_device_stays_owned_and_says_why():
    clock = FakeClock(0.0)
    a, b = two_gpus(clock, readable=False)
    m = make_meter("nvml", device_indices=[0, 1], nvml=fake_nvml([a, b]), env={}, clock=clock, sampling_thread=False)
    m.start()
    clock.t = 10.0
    assert m.read().per_device_j == {UUID_A: 3_000.0} and m.num_devices == 1
    assert m.owned == (UUID_A, UUID_B)
    assert m.unmeasured == {UUID_B: "neither energy counter nor power readable (FakeNvmlError: GPU is lost)"}


def test_a_gpu_process_without_nvml_owns_its_gpu_unmeasured(tmp_path):
    broken = types.SimpleNamespace(nvmlInit=lambda: (_ for _ in ()).throw(FakeNvmlError("Driver Not Loaded")))
    m = make_meter("auto", device_indices=[0], nvml=broken, env={}, torch_ids=[{"uuid": UUID_A[4:]}],
                   rapl_root=str(tmp_path))
    assert m.source == "none" and m.owned == (UUID_A,) and "nvmlInit failed" in m.unmeasured[UUID_A]


def test_counter_reset_keeps_energy_before_and_after():
    clock = FakeClock(10.0)
    a, b = two_gpus(clock, reset_at=50.0)  # B: driver reload at t=50 s, counter restarts at 0
    m = rank_meter(fake_nvml([a, b]), clock, visible="1")
    m.start()
    clock.t = 40.0
    assert m.read().joules == 12_000.0  # 400 W x 30 s
    clock.t = 110.0  # after the reset: counter reads 400 W x 60 s = 24,000 J since t=50
    r = m.read()
    assert r.joules == 12_000.0 + 24_000.0  # 10 s between the last read and the reset are lost
    assert r.per_device_j == {UUID_B: 36_000.0}


def test_device_without_counter_falls_back_to_power_integration_250w_for_an_hour_is_quarter_kwh():
    clock = FakeClock(0.0)
    old = FakeGpu("GPU-cccccccc-0000-0000-0000-000000000000", "00000000:01:00.0", 250.0, clock, counter=False)
    m = make_meter("auto", device_indices=[0], nvml=fake_nvml([old]), env={}, clock=clock, sampling_thread=False)
    m.start()
    clock.t = 1800.0
    m.poll()
    clock.t = 3600.0
    r = m.read()
    assert m.source == "nvml_power"
    assert "energy counter unsupported" in m.why and "power integrated" in m.why
    assert r.joules == 900_000.0
    assert r.kwh == 0.25
    assert energy.average_power_w(r.joules, r.elapsed_s) == 250.0


def test_mixed_devices_use_counter_and_power_and_tag_the_weaker_method():
    clock = FakeClock(0.0)
    a, b = two_gpus(clock, counter=False)
    m = make_meter("nvml", device_indices=[0, 1], nvml=fake_nvml([a, b]), env={}, clock=clock, sampling_thread=False)
    m.start()
    clock.t = 10.0
    r = m.read()
    assert m.source == "nvml_power" and UUID_B in m.why
    assert m.device_methods == {UUID_A: "nvml_counter", UUID_B: "nvml_power"}
    assert r.per_device_j == {UUID_A: 3_000.0, UUID_B: 4_000.0}
    assert m.num_devices == 2


def test_power_sampling_thread_integrates_on_its_own():
    import time

    gpu = FakeGpu("GPU-dddddddd-0000-0000-0000-000000000000", "x", 100.0, time.monotonic, counter=False)
    m = make_meter("nvml", device_indices=[0], nvml=fake_nvml([gpu]), env={}, sample_interval_s=0.01)
    m.start()
    deadline = time.monotonic() + 5
    while m._integrators[gpu.uuid].t == m._t0 and time.monotonic() < deadline:
        time.sleep(0.01)
    m.close()
    assert m._thread is not None and not m._thread.is_alive()
    assert m._integrators[gpu.uuid].t > m._t0  # the thread took at least one sample


def test_visible_devices_integer_and_pci_from_torch_resolve_the_right_gpu():
    clock = FakeClock(0.0)
    a, b = two_gpus(clock)
    nvml = fake_nvml([a, b])
    devs = energy.resolve_nvml_devices(nvml, [0], visible_devices="1")
    assert [u for u, _ in devs] == [UUID_B]
    # torch-reported ids win over the index: UUID without the GPU- prefix, or the PCI bus id
    devs = energy.resolve_nvml_devices(nvml, [0], visible_devices="1", torch_ids=[{"uuid": UUID_A[4:]}])
    assert [u for u, _ in devs] == [UUID_A]
    devs = energy.resolve_nvml_devices(nvml, [0], visible_devices=None, torch_ids=[{"uuid": "", "pci_bus_id": b.pci}])
    assert [u for u, _ in devs] == [UUID_B]
    # a UUID prefix, as CUDA accepts
    devs = energy.resolve_nvml_devices(nvml, [0], visible_devices="GPU-bbbb")
    assert [u for u, _ in devs] == [UUID_B]


def test_explicit_nvml_without_devices_raises_and_auto_degrades_with_why(tmp_path):
    with pytest.raises(ValueError, match="measure_energy='nvml' cannot be served: no CUDA device"):
        make_meter("nvml", device_indices=[], env={})
    m = make_meter("auto", device_indices=None, env={}, rapl_root=str(tmp_path / "missing"))
    assert m.source == "none" and not m.measures
    assert "no CUDA device" in m.why and "RAPL" in m.why
    m.start()
    assert m.read().joules == 0.0


def test_auto_on_cuda_without_nvml_does_not_fall_back_to_cpu_energy(tmp_path):
    broken = types.SimpleNamespace(nvmlInit=lambda: (_ for _ in ()).throw(FakeNvmlError("Driver Not Loaded")))
    _rapl_tree(tmp_path, {"intel-rapl:0": ("package-0", 1_000, 10**9)})
    m = make_meter("auto", device_indices=[0], nvml=broken, env={}, rapl_root=str(tmp_path))
    assert m.source == "none"
    assert "nvmlInit failed" in m.why and "not used for a process on CUDA devices" in m.why


def test_unknown_mode_is_rejected_with_accepted_values():
    with pytest.raises(ValueError, match="measure_energy='gpu' is not accepted; use one of auto, nvml, rapl, none"):
        make_meter("gpu")


def test_none_mode_measures_nothing_and_says_so():
    m = make_meter("none")
    assert (m.source, m.why, m.num_devices, m.measures) == ("none", "measure_energy=none", 0, False)


# --------------------------------------------------------------------------- RAPL


def _rapl_tree(root, zones):
    """zones: dir name -> (name, energy_uj, max_energy_range_uj)."""
    for d, (name, uj, wrap) in zones.items():
        p = root / d
        p.mkdir(parents=True, exist_ok=True)
        (p / "name").write_text(name + "\n")
        (p / "energy_uj").write_text(f"{uj}\n")
        (p / "max_energy_range_uj").write_text(f"{wrap}\n")


def _set_uj(root, d, uj):
    (root / d / "energy_uj").write_text(f"{uj}\n")


def test_rapl_sums_package_and_dram_skips_core_and_psys_and_handles_wraparound(tmp_path):
    wrap = 262_143_328_850  # a real max_energy_range_uj
    _rapl_tree(tmp_path, {
        "intel-rapl": ("ignored control dir", 0, 0),
        "intel-rapl:0": ("package-0", wrap - 1_000_000, wrap),  # 1 J below the wrap
        "intel-rapl:0:0": ("core", 5, wrap),
        "intel-rapl:0:1": ("dram", 2_000_000, wrap),
        "intel-rapl:1": ("psys", 7, wrap),
    })
    clock = FakeClock(0.0)
    m = make_meter("rapl", rapl_root=str(tmp_path), env={}, clock=clock)
    assert m.source == "rapl" and m.num_devices == 1
    m.start()
    clock.t = 10.0
    _set_uj(tmp_path, "intel-rapl:0", 4_000_000)  # wrapped: 1 J to the top + 4 J = 5 J
    _set_uj(tmp_path, "intel-rapl:0:0", 999_999_999)  # core: inside the package, ignored
    _set_uj(tmp_path, "intel-rapl:0:1", 5_000_000)  # dram: +3 J
    _set_uj(tmp_path, "intel-rapl:1", 999_999_999)  # psys: ignored
    r = m.read()
    assert sorted(k.split(":rapl:")[1] for k in r.per_device_j) == ["dram-0", "package-0"]
    assert r.joules == 8.0
    assert r.elapsed_s == 10.0


def test_rapl_is_read_by_local_rank_zero_only(tmp_path):
    _rapl_tree(tmp_path, {"intel-rapl:0": ("package-0", 1_000, 10**9)})
    with pytest.raises(ValueError, match="local rank 0 only"):
        make_meter("rapl", rapl_root=str(tmp_path), env={"LOCAL_RANK": "1"})
    m = make_meter("auto", rapl_root=str(tmp_path), env={"LOCAL_RANK": "1"})
    assert m.source == "none" and "local rank 0 only" in m.why


def test_unreadable_rapl_counter_is_reported_not_guessed(tmp_path):
    _rapl_tree(tmp_path, {"intel-rapl:0": ("package-0", 1_000, 10**9)})
    (tmp_path / "intel-rapl:0" / "energy_uj").unlink()  # as if root-only (CVE-2020-8694)
    m = make_meter("auto", rapl_root=str(tmp_path), env={})
    assert m.source == "none" and "energy_uj not readable" in m.why


# --------------------------------------------------------------------------- fake meter, calculators


def test_fake_meter_is_exact_on_a_fake_clock():
    clock = FakeClock(5.0)
    m = FakeEnergyMeter({"g0": 200.0, "g1": 100.0}, clock=clock)
    m.start()
    clock.t = 15.0
    r = m.read()
    assert (r.joules, r.elapsed_s, r.per_device_j) == (3_000.0, 10.0, {"g0": 2_000.0, "g1": 1_000.0})
    assert m.source == "fake" and m.num_devices == 2


def test_efficiency_calculators():
    assert energy.tflops_per_w(400.0, 500.0) == 0.8
    assert energy.kwh_per_billion_tokens(2.5, 500_000_000) == 5.0
    with pytest.raises(ValueError, match="tokens=0 must be a positive count"):
        energy.j_per_token(1.0, 0)
    with pytest.raises(ValueError, match="elapsed_s=0.0 must be > 0"):
        energy.average_power_w(1.0, 0.0)


def test_device_failing_at_start_is_dropped_with_why_not_raised():
    clock = FakeClock(0.0)
    a, b = two_gpus(clock)
    nvml = fake_nvml([a, b])
    m = make_meter("nvml", device_indices=[0, 1], nvml=nvml, env={}, clock=clock, sampling_thread=False)
    b.counter = False  # B's counter answered the probe, then fails (GPU fell off the bus)
    b.watts = 400.0
    m.start()
    clock.t = 10.0
    r = m.read()
    assert r.per_device_j == {UUID_A: 3_000.0}
    assert m.num_devices == 1 and f"{UUID_B}: first read failed" in m.why
    m.close()
    assert nvml.calls == {"init": 1, "shutdown": 1}


def test_energy_probe_command_says_how_energy_would_be_measured():
    from click.testing import CliRunner

    from mlflow_llmeff.cli import main

    res = CliRunner().invoke(main, ["energy-probe", "--measure-energy", "none"])
    assert res.exit_code == 0
    assert "energy.source: none (0 device(s))" in res.output
    assert "energy.why: measure_energy=none" in res.output
    assert "carbon.intensity_g_per_kwh: 369.473" in res.output  # codecarbon's USA figure, offline


def test_energy_not_measured_note_is_said_once_a_machine_not_once_a_process(tmp_path, monkeypatch, caplog):
    import logging

    from mlflow_llmeff.meters import energy
    from mlflow_llmeff.meters.energy import base

    monkeypatch.setattr(base, "_warned", set())  # _warn_once reads the set of energy/base.py
    missing = str(tmp_path / "missing")
    with caplog.at_level(logging.WARNING, logger=energy._log.name):
        make_meter("auto", device_indices=None, env={"LOCAL_RANK": "1"}, rapl_root=missing)
        assert [r.getMessage() for r in caplog.records] == []  # rank 1 of the machine: silent
        m = make_meter("auto", device_indices=None, env={"LOCAL_RANK": "0"}, rapl_root=missing)
    assert [r.getMessage()[:59] for r in caplog.records] == ["llmeff: energy not measured here (no CUDA device, no readab"]
    assert "no CUDA device" in m.why  # every process still tags why
