"""Several machines, the launcher's side (train/launch.py) and the hosts' names (monitor/summary.py): the
interface the handshake crossed handed to gloo and NCCL unless the user set one, the line machines 1.. print
at their end, and machines sharing a host name told apart by address."""

from __future__ import annotations

import socket

from mlflow_llmeff.monitor.summary import told_apart
from mlflow_llmeff.train.config import TrainConfig
from mlflow_llmeff.train.launch import interface_env, machine_end_line
from mlflow_llmeff.train.rendezvous import Met


def test_the_handshakes_interface_goes_to_gloo_and_nccl():
    assert interface_env(Met("10.0.0.2", "eth0"), {}) == {"GLOO_SOCKET_IFNAME": "eth0", "NCCL_SOCKET_IFNAME": "eth0"}


def test_an_interface_the_user_named_is_kept():
    assert interface_env(Met("10.0.0.2", "eth0"), {"NCCL_SOCKET_IFNAME": "ib0"}) == {"GLOO_SOCKET_IFNAME": "eth0"}


def test_an_address_no_interface_holds_sets_nothing():
    assert interface_env(Met("203.0.113.9", None), {}) == {}


def test_machine_1_says_how_its_part_ended_and_the_jobs_run():
    cfg = TrainConfig(num_machines=2, machine_rank=1, main_process_ip="10.0.0.1")
    host = socket.gethostname()
    assert machine_end_line(cfg, 0, "ab" * 16) == (
        f"machine 1 of 2 ({host}): its part of the job finished (exit 0); the job's run is {'ab' * 16} "
        "(logged by machine 0 at 10.0.0.1)")
    assert machine_end_line(cfg, 75, None) == (
        f"machine 1 of 2 ({host}): its part of the job was preempted (checkpointed; rerun the same command to "
        "resume) (exit 75); the job's run was not reported to this machine (machine 0 at 10.0.0.1 logs it)")
    assert "its part of the job failed (exit 1)" in machine_end_line(cfg, 1, None)


def test_machines_sharing_a_host_name_are_told_apart_by_address():
    got = [{"host": "node", "address": "10.0.0.1"}, {"host": "node", "address": "10.0.0.1"},
           {"host": "node", "address": "10.0.0.2"}, {"host": "other", "address": "10.0.0.3"}]
    assert [g["host"] for g in told_apart(got)] == ["node (10.0.0.1)", "node (10.0.0.1)", "node (10.0.0.2)", "other"]
    # one machine's ranks (one address) keep the bare name
    assert [g["host"] for g in told_apart(got[:2])] == ["node", "node"]
