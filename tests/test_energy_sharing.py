"""GPUs whose NVML energy counter is not the run's alone: MIG instances and GPUs other processes use
(METRICS.md, "Setups that change the counting"). Fake NVML, fake clock."""

from __future__ import annotations

import os

import mlflow
import pytest

from mlflow_llmeff import names
from mlflow_llmeff.meters.energy import make_meter
from mlflow_llmeff.monitor.meter import EfficiencyMonitor
from mlflow_llmeff.testing import FakeClock, FakeGpu, FakeProcess, fake_nvml

from conftest import use_store

PCI = "0000:18:00.0"


@pytest.fixture
def tracking_uri(module_store, monkeypatch):
    yield from use_store(module_store, monkeypatch)


def mig_gpu(clock):
    """A 300 W H100 in MIG mode and one of its instances (the run's device)."""
    gpu = FakeGpu("GPU-aaaa", PCI, 300.0, clock, mig_mode=1)
    return gpu, FakeGpu("MIG-aaaa-1", PCI, 0.0, clock, parent=gpu)


def test_a_mig_instance_found_by_its_uuid_is_not_measured():
    clock = FakeClock()
    gpu, inst = mig_gpu(clock)
    m = make_meter("auto", device_indices=[0], nvml=fake_nvml([gpu], [inst]), env={},
                   torch_ids=[{"uuid": "MIG-aaaa-1"}], clock=clock, sampling_thread=False)
    assert not m.measures
    assert list(m.unmeasured) == ["MIG-aaaa-1"]
    assert ("MIG-aaaa-1: a MIG instance: NVML's energy counter covers the whole physical GPU, not the instance; "
            "not measured") in m.unmeasured["MIG-aaaa-1"]


def test_a_gpu_in_mig_mode_reached_through_its_pci_id_is_not_measured():
    # torch's uuid of a MIG instance without its prefix is no NVML uuid: resolution falls back to the
    # PCI bus id, i.e. the physical GPU, whose counter holds every instance's energy
    clock = FakeClock()
    gpu, inst = mig_gpu(clock)
    m = make_meter("auto", device_indices=[0], nvml=fake_nvml([gpu], [inst]), env={},
                   torch_ids=[{"uuid": "aaaa-1", "pci_bus_id": PCI}], clock=clock, sampling_thread=False)
    assert not m.measures
    assert "GPU-aaaa: MIG mode is enabled on this GPU (the run uses one of its instances)" in m.unmeasured["GPU-aaaa"]


def test_a_mig_run_is_not_charged_its_parents_energy(tracking_uri):
    clock = FakeClock()
    gpu, inst = mig_gpu(clock)
    meter = make_meter("auto", device_indices=[0], nvml=fake_nvml([gpu], [inst]), env={},
                       torch_ids=[{"uuid": "MIG-aaaa-1"}], clock=clock, sampling_thread=False)
    mon = EfficiencyMonitor(log_every_n_steps=2, warmup_steps=0, clock=clock, energy_meter=meter,
                            measure_energy="none", measure_peak=False, device_hour_usd=3.6)
    for _ in range(4):
        clock.t += 1.0
        mon.step(tokens=100, samples=1)
    s = mon.finish()
    run = mlflow.MlflowClient().get_run(mon.run_id)
    # the whole GPU drew 300 W x 4 s = 1200 J: none of it is charged to the instance's run
    for key in (names.SUM_ENERGY_KWH, names.SUM_J_PER_TOKEN, names.ENERGY_TOTAL_KWH):
        assert key not in run.data.metrics
    assert s[names.SUM_ENERGY_COVERAGE] == 0.0 and run.data.tags[names.ENERGY_SOURCE] == "none"
    assert run.data.tags[names.ENERGY_COVERAGE].startswith(
        "0/1 devices measured; not measured: MIG-aaaa-1 (nvml: MIG-aaaa-1: a MIG instance: NVML's energy counter "
        "covers the whole physical GPU, not the instance; not measured")


def test_a_gpu_another_process_uses_during_the_run_leaves_the_coverage(tracking_uri):
    clock = FakeClock()
    me = FakeProcess(os.getpid(), 1 << 30)
    a = FakeGpu("GPU-a", "0000:18:00.0", 300.0, clock, processes=[me])
    b = FakeGpu("GPU-b", "0000:3b:00.0", 400.0, clock, processes=[FakeProcess(os.getpid(), 1 << 30)])
    meter = make_meter("nvml", device_indices=[0, 1], nvml=fake_nvml([a, b]), env={}, clock=clock,
                       sampling_thread=False)
    mon = EfficiencyMonitor(log_every_n_steps=2, warmup_steps=0, clock=clock, energy_meter=meter,
                            measure_energy="none", measure_peak=False, device_hour_usd=3.6)
    for i in range(4):
        clock.t += 1.0
        if i == 2:  # another job starts on GPU b during step 3
            b.processes.append(FakeProcess(4_000_001, 2 << 30))
        mon.step(tokens=100, samples=1)
    s = mon.finish()
    assert s[names.SUM_ENERGY_COVERAGE] == 0.5
    run = mlflow.MlflowClient().get_run(mon.run_id)
    assert names.SUM_ENERGY_KWH not in run.data.metrics  # GPU a alone would be half the run's energy
    assert run.data.tags[names.ENERGY_COVERAGE].startswith(
        "1/2 devices measured; not measured: GPU-b (another process used it during the run (pid 4000001): "
        "NVML's energy counter covers the whole GPU, so its energy is not this run's alone)")


def test_our_own_processes_on_the_gpu_are_no_other_process():
    clock = FakeClock()
    a = FakeGpu("GPU-a", "0000:18:00.0", 300.0, clock, processes=[FakeProcess(os.getpid())])
    m = make_meter("nvml", device_indices=[0], nvml=fake_nvml([a]), env={}, clock=clock, sampling_thread=False)
    m.start()
    clock.t += 2.0
    assert m.read().joules == 600.0 and m.unmeasured == {}
    # pids from another namespace (none of ours listed): nothing can be told apart, nothing is dropped
    a.processes = [FakeProcess(77), FakeProcess(78)]
    clock.t += 1.0
    assert m.read().joules == 900.0 and m.unmeasured == {}
