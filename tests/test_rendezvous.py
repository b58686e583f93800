"""The machines' handshake before the launcher (train/rendezvous.py), on loopback: agreement, a different
node count named with both values, a rank given twice, an unreachable head and an absent machine within
the stated timeout."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from mlflow_llmeff.train.config import TrainConfig
from mlflow_llmeff.train.rendezvous import RendezvousError, disagreement, join, serve, shared_settings

from conftest import free_port

#: Generous bound on a handshake that must fail in about its timeout: it catches a hang (torch's own
#: rendezvous waits 15-30 minutes), not a speed.
HANG_S = 60.0


def settings(**kw) -> dict:
    return shared_settings(TrainConfig(**{"num_machines": 2, "main_process_ip": "127.0.0.1", **kw}))


def run_both(head: dict, other: dict, *, port: int, rank: int = 1, timeout_s: float = 20.0, machines: int = 2):
    """Machine 0 in a thread, machine ``rank`` here; returns (machine 0's error, this machine's error)."""
    errors: dict[str, BaseException | None] = {"head": None, "other": None}

    def head_side():
        try:
            serve(head, num_machines=machines, port=port, timeout_s=timeout_s, host="host-a")
        except RendezvousError as e:
            errors["head"] = e

    t = threading.Thread(target=head_side)
    t.start()
    try:
        join(other, rank=rank, address="127.0.0.1", port=port, timeout_s=timeout_s, host="host-b")
    except RendezvousError as e:
        errors["other"] = e
    t.join(HANG_S)
    assert not t.is_alive()
    return errors["head"], errors["other"]


def test_machines_with_the_same_settings_meet_and_free_the_port():
    port = free_port()
    assert run_both(settings(), settings(machine_rank=1, data_cache_dir="/local/cache"), port=port) == (None, None)
    with socket.create_server(("", port)):  # the launcher binds it next
        pass


def test_different_node_counts_fail_on_both_machines_naming_both_values():
    head, other = run_both(settings(), shared_settings(TrainConfig(num_machines=3, machine_rank=1,
                                                                    main_process_ip="127.0.0.1")), port=free_port())
    line = ("the machines were given different settings: num_machines is 2 on machine 0 (host-a) and 3 on machine 1 "
            "(host-b): give every machine the same")
    assert str(head) == line and str(other) == line and "\n" not in line


def test_a_rank_given_twice_is_named():
    port = free_port()
    err = {}

    def head_side():
        try:
            serve(settings(num_machines=3), num_machines=3, port=port, timeout_s=20, host="host-a")
        except RendezvousError as e:
            err["head"] = e

    t = threading.Thread(target=head_side)
    t.start()
    def first_side():  # host-b claims rank 1 first, then reads the verdict
        try:
            join(settings(num_machines=3), rank=1, address="127.0.0.1", port=port, timeout_s=20, host="host-b")
        except RendezvousError as e:
            err["first"] = e

    first = threading.Thread(target=first_side)
    first.start()
    with pytest.raises(RendezvousError) as e:
        join(settings(num_machines=3), rank=1, address="127.0.0.1", port=port, timeout_s=20, host="host-c")
    t.join(HANG_S), first.join(HANG_S)
    # whichever came first is named first
    assert str(e.value) in ("machine_rank 1 was given to two machines, host-b and host-c: give each its own",
                            "machine_rank 1 was given to two machines, host-c and host-b: give each its own")
    assert str(err["head"]) == str(err["first"]) == str(e.value)


def test_an_unreachable_head_fails_within_its_timeout_naming_address_and_port():
    port = free_port()  # nothing listens there
    started = time.monotonic()
    with pytest.raises(RendezvousError) as e:
        join(settings(), rank=1, address="127.0.0.1", port=port, timeout_s=1.5, host="host-b")
    assert time.monotonic() - started < HANG_S
    assert str(e.value).startswith(f"machine 1 could not reach machine 0 at 127.0.0.1:{port} within 1.5 s "
                                   "(rendezvous_timeout_s; last try: Connection refused)")


def test_machine_0_names_the_machines_that_never_came():
    port = free_port()
    with pytest.raises(RendezvousError, match=f"^machine 0 at port {port} waited 1 s \\(rendezvous_timeout_s\\) for "
                                              "machines 1, 2 of 3: none came"):
        serve(settings(num_machines=3), num_machines=3, port=port, timeout_s=1.0, host="host-a")


def test_a_difference_names_each_setting_with_both_values():
    a, b = settings(), settings(max_steps=40, seq_len=64)
    assert disagreement(a, b, "machine 0 (a)", "machine 1 (b)") == (
        "the machines were given different settings: seq_len is 128 on machine 0 (a) and 64 on machine 1 (b); "
        "max_steps is 50 on machine 0 (a) and 40 on machine 1 (b): give every machine the same")
    assert disagreement(a, dict(a), "x", "y") is None


def test_another_program_on_the_port_is_named_as_not_machine_0():
    # a trial's sandbox answered every outbound connection with an HTTP error, which the machine printed as its
    # error ('HTTP/1.1 400 Bad Request ...', naming neither machine 0 nor the address)
    port = free_port()
    server = socket.create_server(("127.0.0.1", port))

    def answer():
        conn, _ = server.accept()
        conn.recv(4096)
        conn.sendall(b"HTTP/1.1 400 Bad Request\r\nconnection: close\r\ncontent-length: 0\r\n\r\n")
        conn.close()

    t = threading.Thread(target=answer)
    t.start()
    try:
        with pytest.raises(RendezvousError) as e:
            join(settings(), rank=1, address="127.0.0.1", port=port, timeout_s=10.0, host="host-b")
    finally:
        t.join(timeout=HANG_S)
        server.close()
    assert str(e.value) == (
        f"machine 1 reached 127.0.0.1:{port}, but what answered is not machine 0 of an llmeff train job (it said "
        "'HTTP/1.1 400 Bad Request'): check --main-process-ip and --main-process-port (machine 0's address, and a "
        "port nothing else uses)")
