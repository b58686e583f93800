"""The memory limit of this process's container, read from its cgroup (v2 ``memory.max``, else v1).

A job in a 100 GiB container on a 1.5 TiB host may use 100 GiB: RAM power estimated from the host's
total charges it for memory it cannot touch. The limit is read the way the kernel documents it:
``/proc/self/cgroup`` names the process's cgroup (``0::<path>`` on cgroup v2; ``<id>:memory:<path>``
on v1, "Control Group v2", docs.kernel.org/admin-guide/cgroup-v2.html, and ``cgroups(7)``), whose
``memory.max`` (v2; ``max`` = no limit) or ``memory.limit_in_bytes`` (v1; an unlimited cgroup shows a
huge number) under ``/sys/fs/cgroup`` holds the limit in bytes. A cgroup is also bounded by its
ancestors, so every level from the process's cgroup up to the root is read and the smallest limit
kept. A limit at or above the host's memory is no limit. Inside a container the cgroup namespace
often shows the path as ``/`` with the container's own cgroup mounted at ``/sys/fs/cgroup``; a path
that is not found under the mount is read at the mount's root instead.

On a hybrid host the v2 hierarchy may be mounted at ``/sys/fs/cgroup/unified``: both mounts are read.
The one reader of the limit: codecarbon's RAM power (:mod:`mlflow_llmeff.meters.carbon`) and a run's
``summary/memory/peak_fraction`` (:func:`mlflow_llmeff.meters.memory.memory_capacity`) use it.

The container's CPU quota is read the same way (:func:`cpu_quota`): v2 ``cpu.max`` (``<quota> <period>``
in microseconds, ``max`` = no quota), else v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` (``-1`` = no
quota) under the ``cpu`` controller's mount (``cpu`` or ``cpu,cpuacct``), every level up to the root, the
smallest quota in CPUs kept (kernel docs: "Control Group v2", CPU interface files; "CFS Bandwidth
Control", docs.kernel.org/scheduler/sched-bwc.html). The eval's thread count
(:mod:`mlflow_llmeff.evals.threads`) uses it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CpuQuota", "MemoryLimit", "cpu_quota", "memory_limit", "host_memory_bytes", "format_bytes"]


@dataclass(frozen=True)
class MemoryLimit:
    """A container memory limit.

    Attributes:
        bytes: the limit, bytes (> 0, below the host's memory).
        source: where it was read: ``cgroup v2 memory.max`` or ``cgroup v1 memory.limit_in_bytes``.
        path: the file that held it (under the root given to :func:`memory_limit`).
    """

    bytes: int
    source: str
    path: str


def host_memory_bytes() -> int | None:
    """The host's physical memory, bytes (``sysconf(SC_PAGE_SIZE) * sysconf(SC_PHYS_PAGES)``), None where
    the platform does not say (not Linux)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None


#: cgroup v1 shows an unlimited cgroup as PAGE_COUNTER_MAX pages, 9223372036854771712 bytes on 4 KiB
#: pages; anything from 2**62 up is taken as no limit even where the host's memory is unknown.
_UNLIMITED_V1 = 2**62


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _membership(base: Path, controller: str) -> tuple[str | None, tuple[str, str] | None] | None:
    """This process's cgroup paths from ``proc/self/cgroup`` under ``base``: (the v2 unified path or None,
    (the v1 path, its controllers field) of the hierarchy holding ``controller`` or None); None where the
    file cannot be read."""
    text = _read(base / "proc" / "self" / "cgroup")
    if text is None:
        return None
    v2_path, v1 = None, None
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hid, controllers, path = parts
        if hid == "0" and controllers == "":
            v2_path = path
        elif controller in controllers.split(","):
            v1 = (path, controllers)
    return v2_path, v1


def _levels(mount: Path, cg_path: str) -> list[Path]:
    """The cgroup directories from the process's own up to the mount's root (the mount's root alone
    when the path is not under the mount: a namespaced view)."""
    rel = [p for p in cg_path.strip().split("/") if p]
    own = mount.joinpath(*rel) if rel else mount
    if not own.is_dir():
        return [mount]
    return [mount.joinpath(*rel[:i]) for i in range(len(rel), -1, -1)]


def _smallest(levels: list[Path], filename: str) -> tuple[int, Path] | None:
    best = None
    for d in levels:
        text = _read(d / filename)
        if text is None or text == "max":
            continue
        try:
            value = int(text)
        except ValueError:
            continue
        if 0 < value < _UNLIMITED_V1 and (best is None or value < best[0]):
            best = (value, d / filename)
    return best


def memory_limit(root: str | Path = "/", host_bytes: int | None = None) -> MemoryLimit | None:
    """This process's container memory limit (module docstring), or None when there is none.

    Args:
        root: the file-system root holding ``proc/self/cgroup`` and ``sys/fs/cgroup`` (``/``; tests
            pass a fake tree).
        host_bytes: the host's memory, bytes; a limit at or above it is no limit. None: read with
            :func:`host_memory_bytes` (then only ``max`` and v1's unlimited value count as no limit).

    Returns:
        A :class:`MemoryLimit` (cgroup v2 first, then v1), or None: no cgroup file readable, ``max``,
        or a limit >= ``host_bytes``. Never raises on an unreadable or odd file.
    """
    base = Path(root)
    member = _membership(base, "memory")
    if member is None:
        return None
    host = host_bytes if host_bytes is not None else host_memory_bytes()
    v2_path, v1 = member
    v1_path = v1[0] if v1 is not None else None
    found = []
    if v2_path is not None:  # the unified hierarchy at the mount, or beside v1 on a hybrid host
        got = min((g for mount in (base / "sys" / "fs" / "cgroup", base / "sys" / "fs" / "cgroup" / "unified")
                   if (g := _smallest(_levels(mount, v2_path), "memory.max"))), default=None, key=lambda g: g[0])
        if got:
            found.append((got, "cgroup v2 memory.max"))
    if v1_path is not None and not found:
        got = _smallest(_levels(base / "sys" / "fs" / "cgroup" / "memory", v1_path), "memory.limit_in_bytes")
        if got:
            found.append((got, "cgroup v1 memory.limit_in_bytes"))
    if not found:
        return None
    (value, path), source = found[0]
    if host is not None and value >= host:
        return None
    return MemoryLimit(value, source, str(path))


@dataclass(frozen=True)
class CpuQuota:
    """A container CPU quota (CFS bandwidth control).

    Attributes:
        cpus: quota / period, CPUs' worth of time per period (> 0; e.g. 1.5 for ``150000 100000``).
        source: ``cgroup v2 cpu.max`` or ``cgroup v1 cpu.cfs_quota_us``.
        path: the file that held it (under the root given to :func:`cpu_quota`).
    """

    cpus: float
    source: str
    path: str


def _v2_cpu(d: Path) -> float | None:
    text = _read(d / "cpu.max")
    if not text:
        return None
    parts = text.split()
    try:
        quota, period = parts[0], (int(parts[1]) if len(parts) > 1 else 100_000)
        return None if quota == "max" or period <= 0 or int(quota) <= 0 else int(quota) / period
    except ValueError:
        return None


def _v1_cpu(d: Path) -> float | None:
    quota, period = _read(d / "cpu.cfs_quota_us"), _read(d / "cpu.cfs_period_us")
    try:
        q, p = int(quota or ""), int(period or "")
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None  # -1: no quota


def cpu_quota(root: str | Path = "/") -> CpuQuota | None:
    """This process's container CPU quota (module docstring), or None when there is none.

    Args:
        root: the file-system root holding ``proc/self/cgroup`` and ``sys/fs/cgroup`` (``/``; tests
            pass a fake tree).

    Returns:
        A :class:`CpuQuota` (cgroup v2 first, then v1; the smallest over the cgroup and its
        ancestors), or None: no cgroup file readable, ``max`` / ``-1`` everywhere. Never raises on an
        unreadable or odd file.
    """
    base = Path(root)
    member = _membership(base, "cpu")
    if member is None:
        return None
    v2_path, v1_path = member
    mount = base / "sys" / "fs" / "cgroup"
    candidates: list[tuple[float, Path, str]] = []
    if v2_path is not None:
        for m in (mount, mount / "unified"):
            for d in _levels(m, v2_path):
                got = _v2_cpu(d)
                if got is not None:
                    candidates.append((got, d / "cpu.max", "cgroup v2 cpu.max"))
    if v1_path is not None and not candidates:
        path, controllers = v1_path
        for name in dict.fromkeys([controllers, "cpu", "cpu,cpuacct", "cpuacct,cpu"]):
            m = mount / name
            if not m.is_dir():
                continue
            for d in _levels(m, path):
                got = _v1_cpu(d)
                if got is not None:
                    candidates.append((got, d / "cpu.cfs_quota_us", "cgroup v1 cpu.cfs_quota_us"))
            break
    if not candidates:
        return None
    cpus, path, source = min(candidates, key=lambda c: c[0])
    return CpuQuota(cpus, source, str(path))


def format_bytes(n: float) -> str:
    """``100 GiB``, ``1.5 TiB``: bytes in binary units, 3 significant figures."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"
