"""Tests for mlflow_llmeff.meters.cgroup: the container's memory limit from a fake /proc + /sys tree."""

from __future__ import annotations

import pytest

from mlflow_llmeff.meters.cgroup import CpuQuota, MemoryLimit, cpu_quota, format_bytes, memory_limit

GIB, TIB = 2**30, 2**40
HOST = 1536 * GIB  # a 1.5 TiB host


def tree(tmp_path, cgroup: str, files: dict[str, str]):
    """A fake root: ``proc/self/cgroup`` holding ``cgroup`` and each ``sys/fs/cgroup/<path>`` file."""
    (tmp_path / "proc" / "self").mkdir(parents=True)
    (tmp_path / "proc" / "self" / "cgroup").write_text(cgroup)
    for rel, text in files.items():
        f = tmp_path / "sys" / "fs" / "cgroup" / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text + "\n")
    return tmp_path


def test_cgroup_v2_memory_max_of_the_processs_cgroup(tmp_path):
    root = tree(tmp_path, "0::/kubepods/pod1/ctr\n", {"kubepods/pod1/ctr/memory.max": str(100 * GIB),
                                                       "kubepods/pod1/memory.max": "max"})
    got = memory_limit(root, HOST)
    assert got == MemoryLimit(100 * GIB, "cgroup v2 memory.max",
                              str(root / "sys/fs/cgroup/kubepods/pod1/ctr/memory.max"))


def test_a_parents_smaller_limit_bounds_the_child(tmp_path):
    root = tree(tmp_path, "0::/kubepods/pod1/ctr\n", {"kubepods/pod1/ctr/memory.max": "max",
                                                       "kubepods/pod1/memory.max": str(50 * GIB)})
    assert memory_limit(root, HOST).bytes == 50 * GIB


def test_a_namespaced_view_reads_the_mounts_root(tmp_path):
    # inside a container /proc/self/cgroup may say "0::/" (or a path not under the mount)
    root = tree(tmp_path, "0::/\n", {"memory.max": str(100 * GIB)})
    assert memory_limit(root, HOST).bytes == 100 * GIB
    other = tree(tmp_path / "b", "0::/kubepods/x\n", {"memory.max": str(64 * GIB)})
    assert memory_limit(other, HOST).bytes == 64 * GIB


def test_cgroup_v1_memory_limit_in_bytes(tmp_path):
    root = tree(tmp_path, "12:cpu,cpuacct:/docker/abc\n5:memory:/docker/abc\n",
                {"memory/docker/abc/memory.limit_in_bytes": str(100 * GIB)})
    got = memory_limit(root, HOST)
    assert (got.bytes, got.source) == (100 * GIB, "cgroup v1 memory.limit_in_bytes")


@pytest.mark.parametrize("cgroup, files", [
    ("0::/ctr\n", {"ctr/memory.max": "max", "memory.max": "max"}),                      # v2: no limit
    ("5:memory:/docker/abc\n", {"memory/docker/abc/memory.limit_in_bytes": "9223372036854771712"}),  # v1 unlimited
    ("0::/ctr\n", {"ctr/memory.max": str(2 * TIB)}),                                     # above the host's memory
    ("0::/ctr\n", {"ctr/memory.max": str(HOST)}),                                        # equal to it
    ("0::/ctr\n", {}),                                                                   # no file to read
    ("garbage\n", {}),
])
def test_no_limit_below_the_host_is_none(tmp_path, cgroup, files):
    assert memory_limit(tree(tmp_path, cgroup, files), HOST) is None


def test_no_proc_file_is_none(tmp_path):
    assert memory_limit(tmp_path, HOST) is None


def test_v1_unlimited_is_none_even_when_the_hosts_memory_is_unknown(tmp_path, monkeypatch):
    import mlflow_llmeff.meters.cgroup as cg

    monkeypatch.setattr(cg, "host_memory_bytes", lambda: None)
    root = tree(tmp_path, "5:memory:/a\n", {"memory/a/memory.limit_in_bytes": "9223372036854771712"})
    assert memory_limit(root) is None


@pytest.mark.parametrize("n, text", [(100 * GIB, "100 GiB"), (HOST, "1.5 TiB"), (512 * 2**20, "512 MiB"), (10, "10 B")])
def test_format_bytes(n, text):
    assert format_bytes(n) == text


def test_a_hybrid_hosts_unified_v2_mount_is_read_too(tmp_path):
    # cgroup v2 mounted at /sys/fs/cgroup/unified beside v1 controllers (systemd's hybrid layout)
    root = tree(tmp_path, "0::/job\n", {"unified/job/memory.max": str(12 * GIB)})
    got = memory_limit(root, HOST)
    assert (got.bytes, got.source) == (12 * GIB, "cgroup v2 memory.max")


# ---- the CPU quota (cpu_quota): what the eval's thread count is bounded by


@pytest.mark.parametrize("text, cpus", [("150000 100000", 1.5), ("200000 100000", 2.0), ("50000 100000", 0.5),
                                        ("100000", 1.0)])  # no period: the kernel's default 100000 us
def test_cgroup_v2_cpu_max_is_quota_over_period(tmp_path, text, cpus):
    root = tree(tmp_path, "0::/kubepods/pod1/ctr\n", {"kubepods/pod1/ctr/cpu.max": text,
                                                       "kubepods/pod1/cpu.max": "max 100000"})
    assert cpu_quota(root) == CpuQuota(cpus, "cgroup v2 cpu.max", str(root / "sys/fs/cgroup/kubepods/pod1/ctr/cpu.max"))


def test_a_parents_smaller_cpu_quota_bounds_the_child(tmp_path):
    root = tree(tmp_path, "0::/job/ctr\n", {"job/ctr/cpu.max": "max 100000", "job/cpu.max": "300000 100000"})
    assert cpu_quota(root).cpus == 3.0


@pytest.mark.parametrize("controllers", ["cpu,cpuacct", "cpu"])
def test_cgroup_v1_cfs_quota_over_period(tmp_path, controllers):
    root = tree(tmp_path, f"4:memory:/d\n2:{controllers}:/docker/abc\n",
                {f"{controllers}/docker/abc/cpu.cfs_quota_us": "250000",
                 f"{controllers}/docker/abc/cpu.cfs_period_us": "100000"})
    got = cpu_quota(root)
    assert (got.cpus, got.source) == (2.5, "cgroup v1 cpu.cfs_quota_us")


@pytest.mark.parametrize("cgroup, files", [
    ("0::/ctr\n", {"ctr/cpu.max": "max 100000", "cpu.max": "max 100000"}),          # v2: no quota
    ("1:cpu:/\n", {"cpu/cpu.cfs_quota_us": "-1", "cpu/cpu.cfs_period_us": "100000"}),  # v1: no quota (this machine)
    ("0::/ctr\n", {"ctr/cpu.max": "garbage"}),
    ("0::/ctr\n", {}),
])
def test_no_cpu_quota_is_none(tmp_path, cgroup, files):
    assert cpu_quota(tree(tmp_path, cgroup, files)) is None


def test_no_proc_file_is_no_cpu_quota(tmp_path):
    assert cpu_quota(tmp_path) is None
