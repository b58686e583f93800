"""Test hosts: Linux network namespaces joined by a bridge, each host's link shaped by ``tc tbf``.

A real two-machine job needs two network stacks and a link between them whose rate is known. Each
host here is a network namespace with its own loopback and one veth interface (``eth0``) whose other
end sits on a bridge in the root namespace; the bridge has the address ``.254`` of the hosts' /24, so
a host also reaches servers of the root namespace (an MLflow server, slurmctld). Every host's
``eth0`` sends through a token bucket filter (``tc qdisc ... tbf rate R``), and so does the bridge's
end of its veth (what the host receives), so each host has a full-duplex link of ``R`` per direction,
as a NIC of that line rate gives. netem is not available on these machines; tbf is.

The file system, users and processes stay shared: a host is its network and its host name, which is
what a multi-node launcher and its collectives see of a machine. A command on a host runs under ``ip
netns exec`` (which also mounts ``/etc/netns/<name>/hosts`` and an empty ``resolv.conf`` over
``/etc``: every host name of the set resolves, and nothing waits on a DNS server the namespace
cannot reach) and ``unshare --uts`` with the host's own name, so ``socket.gethostname()`` there is
the namespace's name. Processes started in a host are ordinary child processes, so CPU limits apply
to them as to any process.

Needs root (``ip netns``); :func:`unavailable` says why not where it cannot run. Names carry the
creating process's pid, so two test workers (``pytest -n 2``) build hosts side by side.

Command line (the SLURM script uses it):

    python tests/hosts.py up --name slurm --hosts 2 --rate-mbit 200     # prints one "nsname address" a line
    python tests/hosts.py down --name slurm
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field

#: Where a host set records what it made, so ``down`` (another process) can undo it.
STATE_DIR = "/run/llmeff-hosts"


def unavailable() -> str | None:
    """Why namespace hosts cannot be made here (None when they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "tc", "unshare"):
        if shutil.which(tool) is None:
            return f"'{tool}' (iproute2, util-linux) is not installed"
    probe = f"llprobe{os.getpid() % 100000}"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if r.returncode != 0:
        return f"ip netns add failed: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(list(cmd), capture_output=True, text=True)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {r.stderr.strip() or r.stdout.strip()}")
    return r


_SETS = iter("abcdefghijklmnopqrstuvwxyz" * 40)  # (a letter per host set this process makes)


def _free_subnet() -> int:
    """A third octet k with 10.77.k.0/24 unused on this machine."""
    used = _sh("ip", "-o", "-4", "addr", "show").stdout
    start = os.getpid() % 200 + 20
    for i in range(230):
        k = (start + i) % 230 + 20
        if f"10.77.{k}." not in used:
            return k
    raise RuntimeError("no free 10.77.k.0/24 subnet")


@dataclass
class Hosts:
    """``n`` namespace hosts on one bridge, each link shaped to ``rate_mbit`` Mbit/s per direction.

    Attributes:
        names: the namespaces, host 0 first (``ip netns exec NAME ...``).
        addresses: their IPv4 addresses, host 0 first.
        gateway: the bridge's address in the root namespace (servers the hosts reach).
        rate_mbit: each link's tbf rate in Mbit/s (10^6 bit/s), per direction; 0: not shaped.
        resolve_names: False: the hosts' names resolve nowhere (each host's ``/etc/hosts`` holds only
            ``localhost``), as in containers and pods whose host name is not in any name service.
    """

    n: int = 2
    rate_mbit: float = 200.0
    tag: str = ""
    resolve_names: bool = True
    names: list[str] = field(default_factory=list)
    addresses: list[str] = field(default_factory=list)
    gateway: str = ""
    bridge: str = ""
    _procs: list[subprocess.Popen] = field(default_factory=list)

    @property
    def rate_bytes_per_s(self) -> float:
        """The shaped line rate in bytes/s per direction (``rate_mbit x 10^6 / 8``)."""
        return self.rate_mbit * 1e6 / 8

    def up(self) -> "Hosts":
        """Make the bridge, the namespaces and their shaped veth links (undone by :meth:`down`).

        Raises:
            RuntimeError: a command of ``ip`` or ``tc`` failed (the set made so far is removed).
        """
        # a new tag for each set this process makes: the kernel frees a deleted namespace's links
        # asynchronously, so a set made right after another must not reuse its names
        tag = self.tag or f"{os.getpid() % 100000}{next(_SETS)}"
        k = _free_subnet()
        self.bridge, self.gateway = f"llbr{tag}", f"10.77.{k}.254"
        try:
            _sh("ip", "link", "add", self.bridge, "type", "bridge")
            _sh("ip", "addr", "add", f"{self.gateway}/24", "dev", self.bridge)
            _sh("ip", "link", "set", self.bridge, "up")
            for i in range(self.n):
                ns, outer = f"llh{tag}-{i}", f"llv{tag}-{i}"
                self.names.append(ns)
                self.addresses.append(f"10.77.{k}.{i + 1}")
                _sh("ip", "netns", "add", ns)
                _sh("ip", "link", "add", outer, "type", "veth", "peer", "name", "eth0", "netns", ns)
                _sh("ip", "link", "set", outer, "master", self.bridge)
                _sh("ip", "link", "set", outer, "up")
                _sh("ip", "-n", ns, "addr", "add", f"{self.addresses[i]}/24", "dev", "eth0")
                _sh("ip", "-n", ns, "link", "set", "eth0", "up")
                _sh("ip", "-n", ns, "link", "set", "lo", "up")
                _sh("ip", "-n", ns, "route", "add", "default", "via", self.gateway)
                if self.rate_mbit > 0:
                    self._shape(ns, "eth0")  # what the host sends
                    self._shape(None, outer)  # what it receives
            self._write_etc()
            self._save()
        except Exception:
            self.down()
            raise
        return self

    def _write_etc(self) -> None:
        """``/etc/netns/<name>/hosts`` (every host of the set by name) and an empty ``resolv.conf``."""
        lines = ["127.0.0.1 localhost"] + ([f"{a} {n}" for a, n in zip(self.addresses, self.names)]
                                           if self.resolve_names else [])
        for ns in self.names:
            d = os.path.join("/etc/netns", ns)
            os.makedirs(d, exist_ok=True)
            with open(os.path.join(d, "hosts"), "w") as f:
                f.write("\n".join(lines) + "\n")
            open(os.path.join(d, "resolv.conf"), "w").close()

    def _shape(self, ns: str | None, dev: str) -> None:
        # burst: at least rate / HZ (250) bytes, else tbf cannot reach its rate; 256 KiB covers 1 Gbit/s
        cmd = ["tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{self.rate_mbit:g}mbit",
               "burst", "256kb", "latency", "100ms"]
        _sh(*(["ip", "netns", "exec", ns] + cmd if ns else cmd))

    def command(self, i: int, argv: list[str]) -> list[str]:
        """``argv`` run on host ``i``: its network namespace and its host name (``self.names[i]``)."""
        ns = self.names[i]
        return ["ip", "netns", "exec", ns, "unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', ns, *argv]

    def popen(self, i: int, argv: list[str], **kw) -> subprocess.Popen:
        """Start ``argv`` on host ``i``; :meth:`down` ends it if it still runs."""
        p = subprocess.Popen(self.command(i, argv), **kw)
        self._procs.append(p)
        return p

    def run(self, i: int, argv: list[str], **kw) -> subprocess.CompletedProcess:
        """Run ``argv`` on host ``i`` to its end."""
        return subprocess.run(self.command(i, argv), **kw)

    def kill_host(self, i: int, sig: int = signal.SIGKILL) -> list[int]:
        """Send ``sig`` to every process in host ``i``'s namespace (a lost machine); returns their pids."""
        pids = [int(p) for p in _sh("ip", "netns", "pids", self.names[i], check=False).stdout.split()]
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        return pids

    def down(self) -> None:
        """End every process in the hosts, delete the namespaces and the bridge (never raises)."""
        for i in range(len(self.names)):
            self.kill_host(i)
        for p in self._procs:
            try:
                p.wait(timeout=10)
            except Exception:  # noqa: BLE001
                pass
        time.sleep(0.1)
        for i, ns in enumerate(self.names):
            # the outer end first: deleting a veth deletes its pair at once, where deleting the namespace
            # leaves the kernel to free its links later (or never, while a process still holds it)
            _sh("ip", "link", "del", self.names[i].replace("llh", "llv", 1), check=False)
            _sh("ip", "netns", "del", ns, check=False)
            shutil.rmtree(os.path.join("/etc/netns", ns), ignore_errors=True)
        if self.bridge:
            _sh("ip", "link", "del", self.bridge, check=False)
        if self.tag:
            try:
                os.remove(os.path.join(STATE_DIR, self.tag + ".json"))
            except OSError:
                pass

    def _save(self) -> None:
        if not self.tag:
            return
        os.makedirs(STATE_DIR, exist_ok=True)
        with open(os.path.join(STATE_DIR, self.tag + ".json"), "w") as f:
            json.dump({"n": self.n, "rate_mbit": self.rate_mbit, "names": self.names, "addresses": self.addresses,
                       "gateway": self.gateway, "bridge": self.bridge}, f)

    @classmethod
    def load(cls, tag: str) -> "Hosts":
        """The host set ``tag`` that :meth:`up` recorded (for ``down`` from another process)."""
        with open(os.path.join(STATE_DIR, tag + ".json")) as f:
            d = json.load(f)
        return cls(n=d["n"], rate_mbit=d["rate_mbit"], tag=tag, names=d["names"], addresses=d["addresses"],
                   gateway=d["gateway"], bridge=d["bridge"])

    def __enter__(self) -> "Hosts":
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="verb", required=True)
    u = sub.add_parser("up", help="make hosts; prints 'namespace address' a line")
    u.add_argument("--name", required=True, help="the set's tag (letters and digits, <= 6 characters)")
    u.add_argument("--hosts", type=int, default=2)
    u.add_argument("--rate-mbit", type=float, default=200.0, help="tbf rate per link and direction (0: unshaped)")
    d = sub.add_parser("down", help="remove a set made by up")
    d.add_argument("--name", required=True)
    a = p.parse_args(argv)
    if not a.name.isalnum() or len(a.name) > 6:
        raise SystemExit(f"--name {a.name!r}: use 1-6 letters and digits (interface names hold 15 characters)")
    if a.verb == "up":
        why = unavailable()
        if why:
            raise SystemExit(f"namespace hosts cannot be made here: {why}")
        h = Hosts(n=a.hosts, rate_mbit=a.rate_mbit, tag=a.name).up()
        for ns, addr in zip(h.names, h.addresses):
            print(ns, addr)
        print("gateway", h.gateway)
    else:
        try:
            Hosts.load(a.name).down()
        except FileNotFoundError:
            raise SystemExit(f"no host set {a.name!r} is recorded in {STATE_DIR}") from None


if __name__ == "__main__":
    main()
