"""The network interface a machine reaches the job's head through, and its rate: a shaper's, else its line speed.

Across machines without an InfiniBand/RoCE adapter (gloo, or NCCL over sockets) the collectives
cross the interface that routes to the head's address (``MASTER_ADDR``), and its rate is the busbw
peak (:func:`mlflow_llmeff.calc.comm.internode_peak_gbps` with one adapter):

1. the root egress qdisc's rate, as ``tc qdisc show dev IF`` prints it: ``tbf``'s ``rate``, or the
   largest ``ceil`` of ``htb``'s root classes (``tc class show dev IF``): a shaped link sends no
   faster whatever the hardware could;
2. else ``/sys/class/net/IF/speed`` (Mb/s), for an interface with hardware behind it. A virtual
   interface (veth, bridge, tun, loopback: ``/sys/class/net/IF`` resolves under
   ``/devices/virtual/``) reports a nominal figure (veth says 10000 Mb/s whatever carries it): it is
   not taken, and the reason says so. A bond's speed is its members' sum and is taken.

Rates are bits per second on the wire, per direction; GB/s = 1e9 bytes/s (200 Mbit/s = 0.025 GB/s).
Needs ``ip`` and ``tc`` (iproute2); without them the reason says so. Never raises.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import socket
import subprocess
from typing import Callable

from mlflow_llmeff.calc.comm import LinkPeak

__all__ = ["route_interface", "shaped_rate", "line_speed", "interface_peak", "parse_rate"]

Runner = Callable[[list[str]], str]

_RATE = re.compile(r"^(\d+(?:\.\d+)?)([KMGT]?)(i?)(bit|bps)$")


def _run(argv: list[str]) -> str:
    """stdout of ``argv`` ('' when it fails or is missing)."""
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return ""
    return r.stdout if r.returncode == 0 else ""


def parse_rate(text: str) -> float | None:
    """Bits per second of a tc rate (``200Mbit``, ``1Gbit``, ``25Mbps``, ``100Kibit``), else None.

    tc's units: ``bit`` (bits/s) and ``bps`` (bytes/s), with SI prefixes (``K`` = 1e3 ...) or IEC
    ones (``Ki`` = 1024 ...), tc(8) "PARAMETERS".
    """
    m = _RATE.match(text.strip())
    if not m:
        return None
    value, prefix, iec, unit = m.groups()
    base = 1024.0 if iec else 1000.0
    scale = base ** " KMGT".index(prefix or " ")
    return float(value) * scale * (8.0 if unit == "bps" else 1.0)


def route_interface(address: str, run: Runner = _run) -> tuple[str | None, str]:
    """``(interface, "")`` that traffic to ``address`` leaves through, or ``(None, why)``.

    The head's own machine holds ``address`` on an interface (its route is ``lo``): that interface.
    Elsewhere ``ip route get``'s device.
    """
    try:
        ip = socket.getaddrinfo(address, None)[0][4][0]
    except (OSError, IndexError):
        return None, f"the head's address {address!r} does not resolve"
    try:
        for link in json.loads(run(["ip", "-j", "addr", "show"]) or "[]"):
            for a in link.get("addr_info", []):
                if a.get("local") == ip and link.get("ifname"):
                    if ipaddress.ip_address(ip).is_loopback:
                        return None, f"the head's address {ip} is this machine's loopback"
                    return link["ifname"], ""
        routes = json.loads(run(["ip", "-j", "route", "get", ip]) or "[]")
    except ValueError:
        return None, "ip -j printed no JSON (iproute2 too old?)"
    if not routes or not routes[0].get("dev"):
        return None, f"no route to the head's address {ip} ('ip route get {ip}' said nothing; is iproute2 installed?)"
    return routes[0]["dev"], ""


def shaped_rate(dev: str, run: Runner = _run) -> tuple[float, str] | None:
    """``(bits/s, "tbf rate 200Mbit")`` of ``dev``'s root egress shaper, or None without one.

    ``tbf``: the root qdisc's ``rate``. ``htb``: the largest ``ceil`` (else ``rate``) of its root classes.
    """
    text = run(["tc", "qdisc", "show", "dev", dev])
    root = next((line for line in text.splitlines() if " root " in f" {line} "), "")
    words = root.split()
    if len(words) < 2:
        return None
    kind = words[1]
    if kind == "tbf" and "rate" in words:
        bits = parse_rate(words[words.index("rate") + 1])
        return (bits, f"tbf rate {words[words.index('rate') + 1]}") if bits else None
    if kind == "htb":
        best: tuple[float, str] | None = None
        for line in run(["tc", "class", "show", "dev", dev]).splitlines():
            w = line.split()
            if "root" not in w:
                continue
            for key in ("ceil", "rate"):
                if key in w and (bits := parse_rate(w[w.index(key) + 1])):
                    if best is None or bits > best[0]:
                        best = (bits, f"htb root class {key} {w[w.index(key) + 1]}")
                    break
        return best
    return None


def line_speed(dev: str, sys_root: str = "/sys/class/net") -> tuple[float | None, str]:
    """``(bits/s, "")`` of ``dev``'s line speed from sysfs, or ``(None, why it is not taken)``."""
    base = os.path.join(sys_root, dev)
    try:
        speed = int(open(os.path.join(base, "speed")).read().strip())
    except (OSError, ValueError):
        speed = -1
    virtual = "/devices/virtual/" in os.path.realpath(base) and not os.path.isdir(os.path.join(base, "bonding"))
    if virtual:
        said = f"reports {speed} Mb/s, a nominal figure" if speed > 0 else "reports no speed"
        return None, (f"{dev} is a virtual interface (veth, bridge, tun or loopback) that {said}, not a line rate, "
                      "and has no tc rate shaper")
    if speed <= 0:
        return None, f"{dev} reports no line speed ({base}/speed unreadable or -1) and has no tc rate shaper"
    return speed * 1e6, ""


def interface_peak(address: str, *, run: Runner = _run, sys_root: str = "/sys/class/net") -> tuple[LinkPeak | None, str]:
    """The peak of the interface toward ``address`` (the head), per direction, or ``(None, why)``.

    Returns:
        ``(LinkPeak, "")``: gbps is bits/s / 8 / 1e9 of the shaper's rate (below the line speed
        where that is known and lower), else of the line speed; ``source`` says which reading.
    """
    try:
        dev, why = route_interface(address, run)
        if dev is None:
            return None, why
        shaped = shaped_rate(dev, run)
        line, line_why = line_speed(dev, sys_root)
        toward = f"the interface that routes to the head {address}"
        if shaped is not None and (line is None or shaped[0] <= line):
            bits, what = shaped
            return LinkPeak(f"{dev} ({what})", bits / 8 / 1e9, f"tc qdisc show dev {dev}: root {what}, on {toward}"), ""
        if line is not None:
            return LinkPeak(f"{dev} ({line / 1e6:g} Mb/s)", line / 8 / 1e9,
                            f"{sys_root}/{dev}/speed: {line / 1e6:g} Mb/s line rate of {toward}"), ""
        return None, line_why
    except Exception as e:  # noqa: BLE001 - a reading never stops training
        return None, f"the interface toward {address} was not read ({type(e).__name__}: {e})"
