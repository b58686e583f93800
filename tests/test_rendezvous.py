"""The machines' handshake before the launcher (train/rendezvous.py), on loopback: agreement, a different
node count named with both values, a rank given twice or outside the job, an unreachable head and an absent
machine within the stated timeout, and what a waiting machine says after its grace (injected clocks)."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from mlflow_llmeff.train.config import TrainConfig
from mlflow_llmeff.train import rendezvous
from mlflow_llmeff.train.rendezvous import (PER_MACHINE, Met, RendezvousError, disagreement, interface_of, join, serve,
                                            shared_settings)

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
    # (and the rank nobody was given: 3 machines, 2 claim rank 1)
    assert str(e.value) in ("machine_rank 1 was given to two machines, host-b and host-c; machine_rank 2 to none: "
                            "give each its own",
                            "machine_rank 1 was given to two machines, host-c and host-b; machine_rank 2 to none: "
                            "give each its own")
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
        "the machines were given different settings: max_steps is 50 on machine 0 (a) and 40 on machine 1 (b); "
        "seq_len is 128 on machine 0 (a) and 64 on machine 1 (b): give every machine the same")
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


# ------------------------------------------------------------------------------ every setting, rank 0 twice
@pytest.mark.parametrize("field, theirs", [("targets", "val_loss<=2.0"), ("resume", "never"),
                                           ("reshard_after_forward", False), ("val_blocks", 0),
                                           ("learning_rate", 0.5), ("eval_limit", 7)])
def test_settings_outside_the_old_list_that_could_hang_a_job_are_named(field, theirs):
    # these 4 (and 33 more) passed unchecked when 25 of 62 settings were compared
    mine = settings()
    line = disagreement(mine, settings(**{field: theirs}), "machine 0 (a)", "machine 1 (b)")
    assert line == (f"the machines were given different settings: {field} is {mine[field]!r} on machine 0 (a) and "
                    f"{theirs!r} on machine 1 (b): give every machine the same")


def test_every_setting_but_the_per_machine_ones_is_compared():
    fields = set(TrainConfig.field_names())
    compared = set(settings())
    assert compared == (fields - set(PER_MACHINE)) | {"checkpoint_dir given", "save_model given"}
    assert set(PER_MACHINE) <= fields
    local = dict(machine_rank=1, main_process_ip="10.0.0.1", rendezvous_timeout_s=5.0, data_cache_dir="/x",
                 tokenize_workers=3, data_workers=2, eval_data_dir="/e", link_peak_gbps=1.0, checkpoint_dir="/mnt/c",
                 save_model="/m", force=True)
    assert set(local) == set(PER_MACHINE)
    assert disagreement(settings(checkpoint_dir="/c", save_model="/n"), settings(**local), "a", "b") is None
    # where a machine checkpoints may differ, whether it does may not (a checkpoint is a collective)
    assert disagreement(settings(), settings(checkpoint_dir="/c"), "a", "b") == (
        "the machines were given different settings: checkpoint_dir given is False on a and True on b: "
        "give every machine the same")


def test_what_was_resolved_is_compared_too():
    from mlflow_llmeff.planning.spec import Machine
    from mlflow_llmeff.train.config import validate

    cfg = TrainConfig(num_machines=2, main_process_ip="127.0.0.1")
    cpu, gpu = (validate(cfg, Machine(cuda=c, bf16=c), engine=False) for c in (False, True))
    mine, theirs = shared_settings(cpu), shared_settings(gpu)
    assert mine["resolved.precision"] == "fp32" and theirs["resolved.precision"] == "bf16"
    line = disagreement(mine, theirs, "a", "b")
    assert "resolved.precision is 'fp32' on a and 'bf16' on b" in line and "resolved.machine is " in line
    # another node count changes the degrees too: the setting is named, not what was resolved from it
    three = shared_settings(validate(TrainConfig(num_machines=3, main_process_ip="127.0.0.1"), Machine(cuda=False,
                                                                                                       bf16=False),
                                     engine=False))
    assert disagreement(mine, three, "a", "b") == ("the machines were given different settings: num_machines is 2 on "
                                                   "a and 3 on b: give every machine the same")


def _in_thread(side, errors: dict, key: str, **kw) -> threading.Thread:
    """``side(**kw)`` (:func:`serve` or :func:`join`) in a started thread, its result or RendezvousError in ``errors[key]``."""
    def run():
        try:
            errors[key] = side(**kw)
        except RendezvousError as e:
            errors[key] = e

    t = threading.Thread(target=run)
    t.start()
    return t


def _serve_in_thread(errors: dict, key: str, **kw) -> threading.Thread:
    return _in_thread(serve, errors, key, **kw)


def test_rank_0_on_two_machines_is_one_line_on_both_in_seconds_not_the_timeout():
    # two machines told --machine-rank 0 and the same --main-process-ip: each listened and waited the whole
    # rendezvous timeout (300 s) for a machine 1 and then said "none came"
    head_port, other_port = free_port(), free_port()
    got: dict = {}
    started = time.monotonic()
    head = _serve_in_thread(got, "head", settings=settings(), num_machines=2, port=head_port, timeout_s=300.0,
                            host="host-a", head=("127.0.0.1", head_port))
    other = _serve_in_thread(got, "other", settings=settings(), num_machines=2, port=other_port, timeout_s=300.0,
                             host="host-b", head=("127.0.0.1", head_port))
    head.join(HANG_S), other.join(HANG_S)
    took = time.monotonic() - started
    assert not head.is_alive() and not other.is_alive()
    line = ("machine_rank 0 was given to two machines, host-a and host-b (which reached host-a at main_process_ip): "
            "give each its own, 0 to the machine at main_process_ip")
    assert [type(got[k]) for k in ("head", "other")] == [RendezvousError, RendezvousError]
    assert str(got["head"]) == str(got["other"]) == line  # not the 300 s timeout's "none came"
    print(f"\nrank 0 twice: both machines failed after {took:.2f} s (timeout 300 s)")


def test_machine_0_meets_its_own_listener_and_learns_the_interface_toward_the_others():
    port = free_port()
    got: dict = {}
    t = _serve_in_thread(got, "head", settings=settings(), num_machines=2, port=port, timeout_s=20.0, host="host-a",
                         head=("127.0.0.1", port))
    met = join(settings(machine_rank=1), rank=1, address="127.0.0.1", port=port, timeout_s=20.0, host="host-b")
    t.join(HANG_S)
    assert got["head"] == Met("127.0.0.1", "lo") and met == Met("127.0.0.1", "lo")
    assert interface_of("::ffff:127.0.0.1") == "lo" and interface_of("192.0.2.77") is None


def test_a_rank_that_comes_after_the_job_met_is_told_in_one_line():
    port = free_port()
    got: dict = {}
    t = _serve_in_thread(got, "head", settings=settings(), num_machines=2, port=port, timeout_s=20.0, host="host-a")
    join(settings(machine_rank=1), rank=1, address="127.0.0.1", port=port, timeout_s=20.0, host="host-b")
    with pytest.raises(RendezvousError) as e:  # the third machine, also told rank 1, while machine 0 still listens
        join(settings(machine_rank=1), rank=1, address="127.0.0.1", port=port, timeout_s=20.0, host="host-c")
    t.join(HANG_S)
    assert got["head"] == Met("127.0.0.1", "lo")
    assert str(e.value) == ("machine_rank 1 was given to two machines, host-b and host-c: the job started without "
                            "host-c; give each its own")


def test_a_checkpoint_folder_the_machines_do_not_share_is_named_on_both(tmp_path, monkeypatch):
    monkeypatch.setattr(rendezvous, "_FOLDER_S", 0.3)
    mine, theirs = tmp_path / "head", tmp_path / "other"  # two folders: as two machines' local disks
    port = free_port()
    got: dict = {}
    t = _serve_in_thread(got, "head", settings=settings(checkpoint_dir=str(mine)), num_machines=2, port=port,
                         timeout_s=20.0, host="host-a", folder=str(mine))
    with pytest.raises(RendezvousError) as e:
        join(settings(machine_rank=1, checkpoint_dir=str(theirs)), rank=1, address="127.0.0.1", port=port,
             timeout_s=20.0, host="host-b", folder=str(theirs))
    t.join(HANG_S)
    line = ("the checkpoint folder is not shared between the machines: machine 1 (host-b) does not see machine 0's "
            f"file llmeff_rendezvous.<rank> in its {theirs}; checkpoints, resume and preemption agree through that "
            "folder (train/preempt.py): give every machine the same shared folder (a network file system)")
    assert str(e.value) == str(got["head"]) == line
    assert list(mine.iterdir()) == [] and list(theirs.iterdir()) == []  # the probe files are removed


def test_a_shared_checkpoint_folder_passes(tmp_path):
    port = free_port()
    got: dict = {}
    t = _serve_in_thread(got, "head", settings=settings(checkpoint_dir=str(tmp_path)), num_machines=2, port=port,
                         timeout_s=20.0, host="host-a", folder=str(tmp_path))
    met = join(settings(machine_rank=1, checkpoint_dir=str(tmp_path)), rank=1, address="127.0.0.1", port=port,
               timeout_s=20.0, host="host-b", folder=str(tmp_path))
    t.join(HANG_S)
    assert met == got["head"] == Met("127.0.0.1", "lo")


# ------------------------------------------------------------------------------ a rank that never comes, said in seconds
class Clock:
    """An injected monotonic clock: each of ``first`` once, then :attr:`now`, which the test moves."""

    def __init__(self, now: float, *first: float) -> None:
        self.now, self._first, self._lock = now, list(first), threading.Lock()

    def __call__(self) -> float:
        with self._lock:
            return self._first.pop(0) if self._first else self.now


class Said:
    """The lines a machine prints while it waits (its ``say``), with an event per line."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.event = threading.Event()

    def __call__(self, line: str) -> None:
        self.lines.append(line)
        self.event.set()


def _join_in_thread(errors: dict, key: str, **kw) -> threading.Thread:
    return _in_thread(join, errors, key, **kw)


def _listening(port: int) -> bool:
    """Whether a socket listens on ``port`` (any address, IPv4 or IPv6: /proc/net/tcp and tcp6, state 0A) within
    ``HANG_S`` seconds, read without connecting to it (machine 0 would take a connection for a machine)."""
    import time

    deadline = time.monotonic() + HANG_S
    while time.monotonic() < deadline:
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            try:
                with open(table) as f:
                    rows = [line.split() for line in list(f)[1:]]
            except OSError:
                continue
            if any(r[1].rsplit(":", 1)[1] == f"{port:04X}" and r[3] == "0A" for r in rows):
                return True
        time.sleep(0.01)
    return False


def _ranks_0_and_2_of_3(port: int, got: dict, head_clock: Clock, join_clock: Clock, head_said: Said,
                        joined_said: Said) -> tuple[threading.Thread, threading.Thread]:
    """Machine 0 (host-a) and machine 2 (host-c) of 3, each waiting up to 300 s on its own clock; machine 1 never
    starts."""
    head = _serve_in_thread(got, "head", settings=settings(num_machines=3), num_machines=3, port=port,
                            timeout_s=300.0, host="host-a", clock=head_clock, say=head_said)
    if not _listening(port):  # else machine 2, past its grace, names machine 0 missing (a CI run's race)
        head_clock.now = 300.0  # machine 0's deadline: its thread ends
        head.join(HANG_S)
        raise AssertionError(f"machine 0 does not listen on port {port} after {HANG_S} s")
    joined = _join_in_thread(got, "joined", settings=settings(num_machines=3, machine_rank=2), rank=2,
                             address="127.0.0.1", port=port, timeout_s=300.0, host="host-c", clock=join_clock,
                             say=joined_said)
    return head, joined


CAME_0_AND_2 = "(came: 0 from host-a 127.0.0.1, 2 from host-c 127.0.0.1)"


def test_a_missing_rank_is_named_on_every_waiting_machine_after_the_grace_then_at_the_timeout():
    # 3 machines, machine 1 never starts: each waited the whole rendezvous timeout (300 s) silently, machine 2 then
    # saying only "machine 0 waits for the other machines"
    port = free_port()
    got: dict = {}
    head_clock = Clock(0.0)  # machine 0 stays inside its 5 s grace until the test moves it
    join_clock = Clock(10.0, 0.0)  # machine 2 starts at 0 and is past its grace when machine 0 answers
    head_said, joined_said = Said(), Said()
    head, joined = _ranks_0_and_2_of_3(port, got, head_clock, join_clock, head_said, joined_said)
    assert joined_said.event.wait(HANG_S)  # told by machine 0 over the handshake's socket
    assert joined_said.lines == [f"llmeff: machine 2 waits for machine_rank 1 of 3 {CAME_0_AND_2}; giving up in 290 s "
                                 "(rendezvous_timeout_s)"]
    assert head_said.lines == []  # 0 s on machine 0's clock: still inside its grace
    head_clock.now = 6.0
    assert head_said.event.wait(HANG_S)
    assert head_said.lines == [f"llmeff: machine 0 waits for machine_rank 1 of 3 {CAME_0_AND_2}; giving up in 294 s "
                               "(rendezvous_timeout_s)"]
    assert "head" not in got and "joined" not in got  # both still wait, before the deadline
    head_clock.now = 300.0  # machine 0's deadline: its verdict reaches machine 2
    head.join(HANG_S), joined.join(HANG_S)
    assert not head.is_alive() and not joined.is_alive()
    line = (f"machine 0 at port {port} waited 300 s (rendezvous_timeout_s) for machine 1 of 3: none came {CAME_0_AND_2}; "
            "start `llmeff train --machine-rank R` with this --main-process-ip on each, within the timeout")
    assert [type(got[k]) for k in ("head", "joined")] == [RendezvousError, RendezvousError]
    assert str(got["head"]) == str(got["joined"]) == line
    assert len(head_said.lines) == len(joined_said.lines) == 1  # one line each, however long the wait


def test_a_joined_machine_that_gives_up_first_names_the_rank_machine_0_waits_for():
    port = free_port()
    got: dict = {}
    head_clock, join_clock = Clock(0.0), Clock(10.0, 0.0)
    head_said, joined_said = Said(), Said()
    head, joined = _ranks_0_and_2_of_3(port, got, head_clock, join_clock, head_said, joined_said)
    assert joined_said.event.wait(HANG_S)
    join_clock.now = 300.0  # machine 2's own deadline, machine 0 still waiting
    joined.join(HANG_S)
    assert not joined.is_alive()
    assert str(got["joined"]) == (
        f"machine 2 reached machine 0 at 127.0.0.1:{port} but had no verdict within 300 s (rendezvous_timeout_s): "
        f"machine 0 still waits for machine_rank 1 of 3 {CAME_0_AND_2}; start `llmeff train --machine-rank R` with "
        "this --main-process-ip on each, within the timeout")
    head_clock.now = 300.0
    head.join(HANG_S)
    assert not head.is_alive() and "for machine 1 of 3: none came" in str(got["head"])


def test_a_missing_machine_0_is_named_by_the_joined_machine_after_the_grace():
    port = free_port()  # nothing listens there
    got: dict = {}
    join_clock, joined_said = Clock(10.0, 0.0), Said()
    joined = _join_in_thread(got, "joined", settings=settings(machine_rank=1), rank=1, address="127.0.0.1", port=port,
                             timeout_s=300.0, host="host-b", clock=join_clock, say=joined_said)
    assert joined_said.event.wait(HANG_S)
    assert joined_said.lines == [f"llmeff: machine 1 waits for machine 0 at 127.0.0.1:{port} (last try: Connection "
                                 "refused); giving up in 290 s (rendezvous_timeout_s)"]
    join_clock.now = 300.0
    joined.join(HANG_S)
    assert not joined.is_alive() and len(joined_said.lines) == 1
    assert str(got["joined"]).startswith(f"machine 1 could not reach machine 0 at 127.0.0.1:{port} within 300 s")


def test_a_rank_outside_the_job_is_refused_at_once_on_both_machines_naming_the_range():
    # the clocks never move: the refusal comes from the hello itself, not from any timeout
    port = free_port()
    got: dict = {}
    head_said, joined_said = Said(), Said()
    head = _serve_in_thread(got, "head", settings=settings(), num_machines=2, port=port, timeout_s=300.0,
                            host="host-a", clock=Clock(0.0), say=head_said)
    with pytest.raises(RendezvousError) as e:
        join(settings(), rank=5, address="127.0.0.1", port=port, timeout_s=300.0, host="host-b", clock=Clock(0.0),
             say=joined_said)
    head.join(HANG_S)
    assert not head.is_alive()
    line = ("machine 5 (host-b) has machine_rank 5, outside 0..1 of num_machines=2: give each machine its own rank in "
            "0..1, 0 to the machine at main_process_ip")
    assert str(e.value) == str(got["head"]) == line
    assert head_said.lines == joined_said.lines == []


def test_a_node_count_other_than_machine_0s_is_refused_at_once_while_it_waits_for_others():
    # machine 0 expects 3 and waits for machine 2; machine 1 told 2 machines is refused at its hello
    port = free_port()
    got: dict = {}
    head = _serve_in_thread(got, "head", settings=settings(num_machines=3), num_machines=3, port=port, timeout_s=300.0,
                            host="host-a", clock=Clock(0.0), say=Said())
    with pytest.raises(RendezvousError) as e:
        join(settings(machine_rank=1), rank=1, address="127.0.0.1", port=port, timeout_s=300.0, host="host-b",
             clock=Clock(0.0), say=Said())
    head.join(HANG_S)
    assert not head.is_alive()
    line = ("the machines were given different settings: num_machines is 3 on machine 0 (host-a) and 2 on machine 1 "
            "(host-b): give every machine the same")
    assert str(e.value) == str(got["head"]) == line
