"""The interface toward the head and its rate (meters/netpeak.py), on canned ``ip`` / ``tc`` output and a fake sysfs."""

from __future__ import annotations

import json
import os

import pytest

from mlflow_llmeff.meters import netpeak

ADDR = json.dumps([{"ifname": "lo", "addr_info": [{"local": "127.0.0.1"}]},
                   {"ifname": "eth0", "addr_info": [{"local": "10.77.3.1"}]}])


def fake_run(outputs: dict[str, str]):
    """A runner answering each command line (joined by spaces) from ``outputs`` ('' otherwise)."""
    seen = []

    def run(argv):
        seen.append(" ".join(argv))
        return outputs.get(" ".join(argv), "")

    run.seen = seen
    return run


def sysfs(tmp_path, dev: str, speed: str, virtual: bool, bond: bool = False) -> str:
    """``<tmp>/class/net/<dev>`` linked to a devices folder (``devices/virtual/net/<dev>`` when virtual)."""
    real = tmp_path / "devices" / ("virtual" if virtual else "pci0000:00/0000:00:03.0") / "net" / dev
    real.mkdir(parents=True)
    (real / "speed").write_text(speed + "\n")
    if bond:
        (real / "bonding").mkdir()
    net = tmp_path / "class" / "net"
    net.mkdir(parents=True, exist_ok=True)
    os.symlink(real, net / dev)
    return str(net)


@pytest.mark.parametrize("text, bits", [("200Mbit", 200e6), ("1Gbit", 1e9), ("25Mbps", 200e6),
                                        ("100Kibit", 102_400.0), ("800bit", 800.0), ("fast", None)])
def test_tc_rates_in_bits_per_second(text, bits):
    assert netpeak.parse_rate(text) == bits


def test_the_heads_own_machine_uses_the_interface_holding_its_address(tmp_path):
    run = fake_run({"ip -j addr show": ADDR})
    assert netpeak.route_interface("10.77.3.1", run) == ("eth0", "")
    # another machine: the route's device
    run = fake_run({"ip -j addr show": ADDR, "ip -j route get 10.77.3.2": json.dumps([{"dev": "eth1"}])})
    assert netpeak.route_interface("10.77.3.2", run) == ("eth1", "")


def test_a_tbf_shaped_link_of_200_mbit_is_0_025_gb_per_s(tmp_path):
    run = fake_run({"ip -j addr show": ADDR,
                    "tc qdisc show dev eth0": "qdisc tbf 801b: root refcnt 3 rate 200Mbit burst 256Kb lat 100ms\n"})
    net = sysfs(tmp_path, "eth0", "10000", virtual=True)  # a veth: its 10000 Mb/s is not taken
    peak, why = netpeak.interface_peak("10.77.3.1", run=run, sys_root=net)
    assert why == "" and peak.gbps == 0.025 and peak.link == "eth0 (tbf rate 200Mbit)"
    assert peak.source == "tc qdisc show dev eth0: root tbf rate 200Mbit, on the interface that routes to the head 10.77.3.1"


def test_htb_takes_its_largest_root_ceiling():
    run = fake_run({"tc qdisc show dev eth0": "qdisc htb 1: root refcnt 3 r2q 10 default 0x10\n",
                    "tc class show dev eth0": "class htb 1:10 root prio 0 rate 100Mbit ceil 400Mbit burst 1600b\n"
                                              "class htb 1:20 parent 1:10 prio 0 rate 50Mbit ceil 900Mbit\n"})
    assert netpeak.shaped_rate("eth0", run) == (400e6, "htb root class ceil 400Mbit")


def test_a_physical_line_speed_is_taken_a_veths_nominal_speed_is_not(tmp_path):
    run = fake_run({"ip -j addr show": ADDR, "ip -j route get 10.1.1.1": json.dumps([{"dev": "eth0"}])})
    net = sysfs(tmp_path, "eth0", "25000", virtual=False)  # 25 Gb/s Ethernet: 3.125 GB/s
    peak, why = netpeak.interface_peak("10.1.1.1", run=run, sys_root=net)
    assert peak.gbps == 3.125 and peak.source.startswith(f"{net}/eth0/speed: 25000 Mb/s line rate")
    net2 = sysfs(tmp_path / "v", "eth0", "10000", virtual=True)
    peak, why = netpeak.interface_peak("10.1.1.1", run=run, sys_root=net2)
    assert peak is None and why == ("eth0 is a virtual interface (veth, bridge, tun or loopback) that reports "
                                    "10000 Mb/s, a nominal figure, not a line rate, and has no tc rate shaper")
    net3 = sysfs(tmp_path / "b", "eth0", "50000", virtual=True, bond=True)  # a bond: its members' sum
    assert netpeak.interface_peak("10.1.1.1", run=run, sys_root=net3)[0].gbps == 6.25


def test_without_iproute2_the_reason_says_so():
    peak, why = netpeak.interface_peak("10.1.1.1", run=fake_run({}))
    assert peak is None and "no route to the head's address 10.1.1.1" in why
