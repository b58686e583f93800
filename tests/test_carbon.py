"""Carbon: codecarbon for real, offline, on CPU: no network, no file, no stop from a stale lock."""

from __future__ import annotations

import os
import signal
import socket
import sys

import pytest

from mlflow_llmeff import names
from mlflow_llmeff.meters.carbon import CarbonTracker, grid_intensity_g_per_kwh

# codecarbon 3.3's global_energy_mix.json: USA carbon_intensity 369.473 g/kWh (2023 data),
# FRA 56.039; cloud/impact.csv: gcp us-central1 430 g/kWh (Google region data).
USA_G_PER_KWH = 369.473


@pytest.fixture
def no_network(monkeypatch):
    """Fail the test on any attempt to open a connection or resolve a name."""
    attempts: list[object] = []

    def refuse(*args, **kwargs):
        attempts.append(args)
        raise AssertionError(f"network access attempted: {args!r}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    return attempts


@pytest.fixture
def tmp_cwd(tmp_path, monkeypatch):
    d = tmp_path / "cwd"
    d.mkdir()
    monkeypatch.chdir(d)
    return d


@pytest.fixture
def planted_lock(tmp_path, monkeypatch):
    """A lock file left by a crashed codecarbon run, where codecarbon 3.3 looks for it.

    codecarbon 3.3 keeps its lock at ``os.path.join(tempfile.gettempdir(), ".codecarbon.lock")``
    (module constant ``codecarbon.lock.LOCKFILE``, i.e. /tmp/.codecarbon.lock). The test points
    that constant at its own tmp dir so it does not disturb other codecarbon users on the machine.
    """
    import codecarbon.lock

    lock = tmp_path / ".codecarbon.lock"
    lock.write_text("")
    monkeypatch.setattr(codecarbon.lock, "LOCKFILE", str(lock))
    return lock


def test_codecarbon_runs_for_real_offline_with_no_network_and_no_file(tmp_cwd, no_network, planted_lock):
    handlers = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    ct = CarbonTracker(country_iso_code="USA", env={})
    ct.start()
    assert ct.why is None, ct.why
    assert ct._tracker is not None  # started despite the stale lock
    sum(i * i for i in range(200_000))  # a little CPU work
    ct.stop()
    assert no_network == []
    assert os.listdir(tmp_cwd) == []  # no emissions.csv, no lock, nothing
    assert planted_lock.exists()  # not ours to remove
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == handlers
    assert ct.intensity_g_per_kwh == pytest.approx(USA_G_PER_KWH, rel=1e-12)
    assert ct.source.startswith("codecarbon 3.") and "offline, country=USA" in ct.source
    est = ct.estimate
    assert est is not None and est.cpu_kwh >= 0 and est.ram_kwh > 0 and est.duration_s > 0
    m = ct.metrics(measured_kwh=None)
    assert names.CARBON_TOTAL_KG not in m  # an estimate is never reported as the measurement
    assert m[names.ENERGY_ESTIMATE_RAM_KWH] == est.ram_kwh
    assert m[names.CARBON_ESTIMATE_KG] == pytest.approx(est.kwh * USA_G_PER_KWH / 1000, rel=1e-12)
    tags = ct.tags(energy_source="none")
    assert tags[names.CARBON_ESTIMATE_METHOD].startswith("codecarbon estimate, tracking_mode=machine: CPU by ")
    assert tags[names.CARBON_INTENSITY] == "369.473"


def test_planted_lock_is_where_codecarbon_looks(tmp_cwd, planted_lock, monkeypatch):
    """Sanity check of the fixture: codecarbon with its lock enabled refuses to run."""
    from codecarbon import OfflineEmissionsTracker

    monkeypatch.setattr(signal, "signal", lambda *a: None)  # codecarbon's Lock() would install handlers
    t = OfflineEmissionsTracker(country_iso_code="USA", output_methods=[], allow_multiple_runs=False, log_level="critical")
    assert t._another_instance_already_running


def test_kg_co2e_is_our_measured_kwh_times_codecarbons_intensity():
    ct = CarbonTracker(country_iso_code="USA", env={"LOCAL_RANK": "1"})  # rank 1: intensity only
    ct.start()
    assert ct._tracker is None and "local rank 0 only" in ct.why
    assert ct.kg_co2e(1.0) == pytest.approx(0.369473, rel=1e-12)
    assert ct.kg_co2e(2.5) == pytest.approx(2.5 * 0.369473, rel=1e-12)
    m = ct.metrics(measured_kwh=2.5, tokens=500_000_000)
    assert m[names.CARBON_TOTAL_KG] == pytest.approx(0.9236825, rel=1e-12)
    assert m[names.SUM_KG_CO2E_PER_BTOK] == pytest.approx(1.847365, rel=1e-12)
    assert "measured, nvml_counter" in ct.tags(energy_source="nvml_counter")[names.CARBON_ENERGY_BASIS]


def test_intensity_agrees_with_codecarbons_own_emissions_for_the_same_energy():
    from codecarbon.core.emissions import Emissions
    from codecarbon.core.units import Energy
    from codecarbon.external.geography import GeoMetadata
    from codecarbon.input import DataSource

    g, src = grid_intensity_g_per_kwh(country_iso_code="FRA")
    kg = Emissions(DataSource()).get_private_infra_emissions(Energy.from_energy(kWh=3.0), GeoMetadata(country_iso_code="FRA"))
    assert 3.0 * g / 1000 == pytest.approx(kg, rel=1e-12)
    assert "country=FRA" in src


@pytest.mark.parametrize(
    "provider, region, expected_g, in_source",
    [
        ("gcp", "us-central1", 430.0, "cloud=gcp/us-central1 (cloud/impact.csv"),
        ("gcp", "mars-north1", USA_G_PER_KWH, "not in cloud/impact.csv, so country=USA"),
    ],
)
def test_cloud_region_intensity(provider, region, expected_g, in_source):
    g, src = grid_intensity_g_per_kwh(country_iso_code="USA", cloud_provider=provider, cloud_region=region)
    assert g == pytest.approx(expected_g, rel=1e-12)
    assert in_source in src


def test_unknown_country_uses_world_average_and_says_so():
    g, src = grid_intensity_g_per_kwh(country_iso_code="XXX")
    assert g > 0 and "world average (country 'XXX' not in" in src


def test_missing_codecarbon_disables_carbon_with_a_reason(monkeypatch):
    for mod in [m for m in sys.modules if m == "codecarbon" or m.startswith("codecarbon.")]:
        monkeypatch.delitem(sys.modules, mod)
    monkeypatch.setitem(sys.modules, "codecarbon", None)  # import codecarbon -> ImportError
    ct = CarbonTracker(env={})
    ct.start()
    ct.stop()
    assert ct.intensity_g_per_kwh is None and ct.kg_co2e(1.0) is None
    assert ct.source.startswith("none: codecarbon is not installed")
    assert ct.metrics(measured_kwh=1.0) == {}
    assert ct.tags() == {names.CARBON_SOURCE: ct.source, names.CARBON_ESTIMATE_METHOD: f"none: {ct.why}"}


def test_tracker_that_fails_to_start_leaves_intensity_and_says_why(tmp_cwd, monkeypatch):
    from codecarbon.emissions_tracker import BaseEmissionsTracker

    def boom(self):
        raise RuntimeError("no hardware")

    # codecarbon's start() swallows this; CarbonTracker must notice it never started
    monkeypatch.setattr(BaseEmissionsTracker, "_ensure_hardware_ready", boom)
    ct = CarbonTracker(env={})
    ct.start()
    ct.stop()
    assert ct._tracker is None and ct.estimate is None
    assert "tracker failed to start" in ct.why
    assert ct.kg_co2e(1.0) == pytest.approx(0.369473, rel=1e-12)
    assert os.listdir(tmp_cwd) == []


def test_disabled_tracker_reports_none():
    ct = CarbonTracker(enabled=False)
    ct.start()
    assert ct.source == "none: carbon tracking disabled (measure_energy=none)"
    assert ct.kg_co2e(1.0) is None


# --------------------------------------------------------------------------- RAM power from the container's limit
GIB = 2**30


def _cgroup_tree(root, cgroup: str, files: dict):
    (root / "proc" / "self").mkdir(parents=True)
    (root / "proc" / "self" / "cgroup").write_text(cgroup)
    for rel, text in files.items():
        f = root / "sys" / "fs" / "cgroup" / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text)
    return root


@pytest.mark.parametrize("cgroup, files, source", [
    ("0::/ctr\n", {"ctr/memory.max": str(100 * GIB)}, "cgroup v2 memory.max"),
    ("5:memory:/ctr\n", {"memory/ctr/memory.limit_in_bytes": str(100 * GIB)}, "cgroup v1 memory.limit_in_bytes"),
])
def test_ram_power_is_sized_by_the_containers_limit_not_the_host(tmp_path, cgroup, files, source):
    from mlflow_llmeff.meters.carbon import ram_power_basis

    root = _cgroup_tree(tmp_path, cgroup, files)
    watts, basis = ram_power_basis("machine", {}, cgroup_root=str(root), host_bytes=1536 * GIB)
    # codecarbon's model at 100 GB: 8 DIMMs on x86, 4 at 5 W + 4 at 0.9 x 5 W = 38 W
    assert watts == 38.0
    assert basis == f"RAM power 38 W from the container's memory limit 100 GiB ({source}), not the host's 1.5 TiB"


def test_without_a_limit_codecarbon_keeps_the_hosts_memory(tmp_path):
    from mlflow_llmeff.meters.carbon import ram_power_basis

    root = _cgroup_tree(tmp_path, "0::/ctr\n", {"ctr/memory.max": "max"})
    assert ram_power_basis("machine", {}, cgroup_root=str(root), host_bytes=1536 * GIB) == (
        None, "RAM power from the host's memory 1.5 TiB (no container memory limit below it)")
    assert ram_power_basis("process", {}, cgroup_root=str(root))[0] is None
    assert ram_power_basis("machine", {"SLURM_JOB_ID": "7"}, cgroup_root=str(root)) == (
        None, "RAM power from the SLURM job's memory (codecarbon reads it under SLURM_JOB_ID)")


def test_the_tracker_is_given_the_containers_ram_power_and_the_tag_says_so(tmp_cwd, no_network, tmp_path):
    root = _cgroup_tree(tmp_path / "fake", "0::/\n", {"memory.max": str(100 * GIB)})
    ct = CarbonTracker(country_iso_code="USA", env={}, cgroup_root=str(root), host_memory_bytes=1536 * GIB)
    ct.start()
    assert ct.why is None, ct.why
    ram = next(hw for hw in ct._tracker._hardware if type(hw).__name__ == "RAM")
    assert ram._force_ram_power == 38.0
    ct.stop()
    assert ct.tags()[names.CARBON_ESTIMATE_METHOD].endswith(
        "; RAM power 38 W from the container's memory limit 100 GiB (cgroup v2 memory.max), not the host's 1.5 TiB")


def test_the_cpu_model_is_read_from_proc_cpuinfo_not_from_a_cpuinfo_subprocess(tmp_cwd, no_network, planted_lock,
                                                                               monkeypatch):
    # codecarbon's detect_cpu_model asks py-cpuinfo, which runs itself as `python cpuinfo.py --json`: a process
    # (1.2-1.4 s, 0.9 s of CPU here) at every monitored run's start
    import subprocess

    import cpuinfo
    from codecarbon.core.util import detect_cpu_model

    from mlflow_llmeff.meters.carbon import cpu_model_from_proc

    started = []
    real_popen = subprocess.Popen

    def popen(args, *a, **kw):
        started.append(args)
        return real_popen(args, *a, **kw)

    monkeypatch.setattr(subprocess, "Popen", popen)
    asked = cpuinfo.get_cpu_info
    detect_cpu_model.cache_clear()  # as in a fresh process
    ct = CarbonTracker(country_iso_code="USA", env={})
    ct.start()
    ct.stop()
    assert ct.why is None, ct.why
    assert [a for a in started if "cpuinfo" in str(a)] == []
    assert cpuinfo.get_cpu_info is asked  # put back
    model = cpu_model_from_proc()
    if model is not None:  # x86 Linux (CI): codecarbon took /proc/cpuinfo's model name
        assert detect_cpu_model() == model
    detect_cpu_model.cache_clear()


def test_the_model_name_is_the_first_model_name_line(tmp_path):
    from mlflow_llmeff.meters.carbon import cpu_model_from_proc

    f = tmp_path / "cpuinfo"
    f.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 7B13\n\nprocessor\t: 1\n"
                 "model name\t: AMD EPYC 7B13\n")
    assert cpu_model_from_proc(str(f)) == "AMD EPYC 7B13"
    f.write_text("processor\t: 0\nBogoMIPS\t: 50.00\nCPU implementer\t: 0x41\n")  # ARM: no model name
    assert cpu_model_from_proc(str(f)) is None
    assert cpu_model_from_proc(str(tmp_path / "none")) is None


def test_a_window_edge_reads_codecarbons_own_sample_and_samples_itself_only_when_it_is_stale(
        tmp_cwd, no_network, planted_lock, monkeypatch):
    """codecarbon's own timer samples every SAMPLE_S (1 s, under ESTIMATE_AGE_S), so the running estimate at
    a window edge is two totals read on the caller's thread; only a sample older than ESTIMATE_AGE_S (its
    timer fell behind) is refreshed there. The sample's age is set by the test, not waited for."""
    import threading
    import time

    from mlflow_llmeff.meters import carbon

    assert carbon.SAMPLE_S < carbon.ESTIMATE_AGE_S
    ct = CarbonTracker(country_iso_code="USA", env={})
    ct.start()
    tracker = ct._tracker
    try:
        assert tracker._measure_power_secs == carbon.SAMPLE_S and tracker._scheduler.interval == carbon.SAMPLE_S
        tracker._scheduler.stop()  # the test moves the sample's age itself
        callers: list[bool] = []
        measure = tracker._do_measurements

        def spy():
            callers.append(threading.current_thread() is threading.main_thread())
            measure()

        monkeypatch.setattr(tracker, "_do_measurements", spy)
        tracker._last_measured_time = time.perf_counter() - (carbon.ESTIMATE_AGE_S - 0.5)  # a fresh sample
        before = float(tracker._total_cpu_energy.kWh), float(tracker._total_ram_energy.kWh)
        assert ct.running_estimate() == before and callers == []  # read, not measured
        tracker._last_measured_time = time.perf_counter() - (carbon.ESTIMATE_AGE_S + 0.5)  # the timer fell behind
        after = ct.running_estimate()
        assert callers == [True]  # measured once, here
        assert after[1] > before[1]  # RAM power x the 2.5 s since the last sample
        assert ct.running_estimate() == after and callers == [True]  # fresh again: read
    finally:
        ct.stop()
