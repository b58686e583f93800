"""The machines' handshake before the launcher: every machine reaches machine 0 within a stated time,
every machine was given the same job, and each learns the network interface toward the others.

``llmeff train --num-machines N`` runs this on each machine before ``accelerate launch`` (whose
rendezvous, torch elastic's static one, would otherwise wait: a machine whose head never answers
retried for more than 120 s here, torch's store timeouts reach 15 and 30 minutes, and a machine
told ``--num-machines 3`` while the others were told 2 joins a process group of another size and
hangs at its first collective):

* machine 0 listens on ``main_process_port`` (the port its launcher binds next), each other
  machine connects to ``main_process_ip:main_process_port``, retrying until
  ``rendezvous_timeout_s``, and sends its rank, host name and settings (one JSON line): every
  resolved setting (:func:`shared_settings`) but the :data:`PER_MACHINE` ones;
* machine 0 also connects to ``main_process_ip:main_process_port`` itself and must meet its own
  listener there: a second machine given ``--machine-rank 0`` reaches the real head instead, and
  both learn it in seconds (each would otherwise wait the whole timeout for machines that went to
  the other);
* machine 0 compares them with its own as they come and answers every machine with one verdict
  line: ``ok``, or the first disagreement naming both values (``num_machines is 2 on machine 0
  (host-a) and 3 on machine 1 (host-b)``), a rank claimed twice, a checkpoint folder the machines do
  not share, or the machines that never came; a machine that comes after the verdict (a rank
  claimed twice, the first holder already met) is answered too, while machine 0 still listens;
* a machine still waiting after :data:`_GRACE_S` seconds (every machine that came already agreed)
  prints one line on stderr naming what it waits for, who came from which host and address, and
  when it gives up: ``llmeff: machine 0 waits for machine_rank 1 of 3 (came: 0 from host-a 10.0.0.1,
  2 from host-c 10.0.0.3); giving up in 295 s (rendezvous_timeout_s)``; machine 0 tells the machines
  that came (a ``llmeff_waiting`` line before the verdict, to those whose hello says ``hears_waiting``)
  so they name the same ranks, and a timeout names them on every machine;
* then machine 0 closes the port and every machine launches, with the interface its handshake
  crossed (:attr:`Met.interface`) handed to gloo and NCCL (``GLOO_SOCKET_IFNAME``,
  ``NCCL_SOCKET_IFNAME``; train/launch.py): without it gloo binds the address the host name
  resolves to, loopback on a host whose name does not resolve (containers, namespaces), and the
  job dies at its first collective.

Each failure is a :class:`RendezvousError`: one line naming the address, port and timeout. Plain
sockets, not torch's ``TCPStore``: the store prints a C++ stack trace on stderr for every failed
connection try, which buries the one line.
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import socket
import sys
import threading
import time
from typing import Callable

from mlflow_llmeff.names import shorten

__all__ = ["PER_MACHINE", "RendezvousError", "Met", "handshake", "serve", "join", "shared_settings",
           "disagreement", "interface_of", "FOLDER_FILE"]

#: Settings that may differ from machine to machine: where this machine is and what it holds locally
#: (its rank, how it reaches machine 0 and how long it waits, its own folders and caches, its worker
#: counts, its link's peak, its memory check). Every other setting of the resolved run, and what was
#: resolved (strategy, degrees, precision, device kind), must be the same on every machine: a
#: difference changes the job's shape or the order of its collectives (a hang), or its data, steps,
#: evals and targets (one run from two recipes).
PER_MACHINE = ("machine_rank", "main_process_ip", "rendezvous_timeout_s", "data_cache_dir", "tokenize_workers",
               "data_workers", "eval_data_dir", "link_peak_gbps", "checkpoint_dir", "save_model", "force")

#: The file each machine writes in its checkpoint folder before the handshake (``.<rank>`` appended):
#: machine 0 reads every other machine's, each other machine reads machine 0's, so a folder the
#: machines do not share (checkpoints, resume and preemption agree through it: train/preempt.py) is
#: named at the start, not when a preemption request never reaches the other machines.
FOLDER_FILE = "llmeff_rendezvous"

#: Seconds machine 0 waits, after its verdict, for the other machines to read it before it closes the port.
_ACK_S = 10.0
#: Seconds a machine waits quietly before it prints what it waits for (machines started together meet sooner).
_GRACE_S = 5.0
#: The longest real wait, in seconds, between two looks at the (possibly injected) clock.
_TICK_S = 0.2
#: Seconds a machine waits for a file another machine wrote to appear in the shared folder (NFS caches
#: a directory's attributes for up to 3 s by default, ``acdirmin``).
_FOLDER_S = 5.0


class RendezvousError(ValueError):
    """A machine did not meet the others (unreachable, absent, or given another job): one line."""


@dataclasses.dataclass(frozen=True)
class Met:
    """What a machine learnt at the handshake.

    Attributes:
        address: this machine's address on the connection it made or took (IPv4 or IPv6 text), or
            None (one machine, no handshake).
        interface: the network interface holding ``address`` (``eth0``; ``lo`` on loopback), or None
            when no interface holds it (an address translated on the way).
    """

    address: str | None = None
    interface: str | None = None


def shared_settings(run) -> dict:
    """The settings every machine must share: every field of the options but :data:`PER_MACHINE`, and,
    for a resolved run, what was resolved (``resolved.strategy``, ``resolved.degrees``,
    ``resolved.precision``, ``resolved.machine``), as JSON-ready values.

    Args:
        run: a :class:`~mlflow_llmeff.planning.spec.RunSpec` (``llmeff train``'s resolved run) or a
            :class:`~mlflow_llmeff.train.config.TrainConfig` (the options alone).
    """
    options = getattr(run, "options", run)
    out = {k: v for k, v in dataclasses.asdict(options).items() if k not in PER_MACHINE}
    # where a machine writes may differ, whether it writes may not: a checkpoint and the final model's
    # gather are collectives every rank takes part in
    out.update({f"{k} given": bool(getattr(options, k)) for k in ("checkpoint_dir", "save_model")})
    resolved = getattr(run, "resolved", None)
    if callable(resolved):
        out.update({f"resolved.{k}": v for k, v in resolved().items()})
    return json.loads(json.dumps(out))  # as the other machine reads it (tuples become lists)


def disagreement(mine: dict, theirs: dict, me: str, them: str) -> str | None:
    """One line naming every setting whose values differ (``None`` when they agree).

    Args:
        mine, theirs: :func:`shared_settings` of two machines.
        me, them: how the line names the machines, e.g. ``machine 0 (host-a)``.
    """
    keys = list(mine) + [k for k in theirs if k not in mine]
    differ = [k for k in keys if k not in PER_MACHINE and mine.get(k) != theirs.get(k)]
    given = [k for k in differ if not k.startswith("resolved.")]
    differ = given or differ  # what was resolved from settings that differ differs too: the settings are the news
    if not differ:
        return None
    parts = [f"{k} is {mine.get(k)!r} on {me} and {theirs.get(k)!r} on {them}" for k in differ]
    return "the machines were given different settings: " + "; ".join(parts) + ": give every machine the same"


def interface_of(address: str | None) -> str | None:
    """The name of the network interface that holds ``address`` on this machine (``eth0``), or None.

    Read from ``psutil.net_if_addrs()``; an IPv4 address seen through a dual-stack socket
    (``::ffff:10.0.0.1``) is looked up as IPv4."""
    if not address:
        return None
    address = _plain(address)
    try:
        import psutil

        for name, addrs in psutil.net_if_addrs().items():
            if any(a.address.split("%", 1)[0] == address for a in addrs):
                return name
    except Exception:  # noqa: BLE001 - a machine whose interfaces cannot be read: gloo's own choice stays
        return None
    return None


def _plain(address: str) -> str:
    return address[7:] if address.startswith("::ffff:") and "." in address else address


def _met(sock: socket.socket) -> Met:
    try:
        address = _plain(sock.getsockname()[0])
    except OSError:
        return Met()
    return Met(address, interface_of(address))


def _line(sock: socket.socket, deadline: float, clock) -> str | None:
    """One ``\\n``-ended line from ``sock`` before ``deadline`` (None: closed or timed out)."""
    data = b""
    while not data.endswith(b"\n"):
        left = deadline - clock()
        if left <= 0:
            return None
        sock.settimeout(left)
        try:
            chunk = sock.recv(4096)
        except OSError:
            return None
        if not chunk:
            return None
        data += chunk
    return data.decode("utf-8", "replace").strip()


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class _Lines:
    """The ``\\n``-ended lines of a socket, read in slices of real time without losing a partial line."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.closed, self._buf = sock, False, b""

    def next(self, wait_s: float) -> str | None:
        """The next line, waiting up to ``wait_s`` real seconds; None when none came (:attr:`closed`: never will)."""
        while b"\n" not in self._buf:
            if self.closed:
                return None
            self.sock.settimeout(max(wait_s, 0.001))
            try:
                chunk = self.sock.recv(4096)
            except (socket.timeout, TimeoutError):
                return None
            except OSError:
                chunk = b""
            if not chunk:
                self.closed = True
                return None
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return line.decode("utf-8", "replace").strip()


def _came(came: list) -> str:
    """``0 from host-a 10.0.0.1, 2 from host-c 10.0.0.3``; ``came``: ``[rank, host, address or None]`` per
    machine that came."""
    return ", ".join(f"{r} from {h}" + (f" {a}" if a else "") for r, h, a in sorted(came, key=lambda c: c[0]))


def _awaited(missing: list[int], num_machines: int, came: list) -> str:
    """``machine_rank 1 of 3 (came: 0 from host-a 10.0.0.1, 2 from host-c 10.0.0.3)``."""
    return f"machine_rank {', '.join(str(r) for r in missing)} of {num_machines} (came: {_came(came)})"


def _waits(rank: int, what: str, left_s: float) -> str:
    """The one line a waiting machine prints."""
    return f"llmeff: machine {rank} waits for {what}; giving up in {max(0.0, left_s):.0f} s (rendezvous_timeout_s)"


def _status(msg) -> tuple[list[int], int, list] | None:
    """``(missing, num_machines, came)`` from machine 0's ``llmeff_waiting`` message, or None (not one)."""
    try:
        w = msg["llmeff_waiting"]
        came = [[int(r), str(h), None if a is None else str(a)] for r, h, a in w["came"]]
        return [int(r) for r in w["missing"]], int(w["num_machines"]), came
    except (KeyError, TypeError, ValueError):
        return None


def _send(conn: socket.socket, msg: dict) -> None:
    try:
        conn.sendall((json.dumps(msg) + "\n").encode("utf-8"))
    except OSError:
        pass


# ------------------------------------------------------------------------------ the shared folder
def _write_folder_file(folder: str | None, rank: int, nonce: str) -> str | None:
    """Write this machine's file in the checkpoint folder (its nonce); returns the path (None: no folder)."""
    if not folder:
        return None
    path = os.path.join(folder, f"{FOLDER_FILE}.{rank}")
    try:
        os.makedirs(folder, exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write(nonce)
            f.flush()
            os.fsync(f.fileno())
    except OSError:
        return None
    return path


def _sees(folder: str | None, rank: int, nonce: str | None, clock, wait_s: float | None = None) -> bool:
    """True when ``folder`` holds machine ``rank``'s file with ``nonce`` (waiting up to ``wait_s``)."""
    if not folder or not nonce:
        return True
    until = clock() + (_FOLDER_S if wait_s is None else wait_s)
    while True:
        try:
            with open(os.path.join(folder, f"{FOLDER_FILE}.{rank}"), encoding="utf-8") as f:
                if f.read().strip() == nonce:
                    return True
        except OSError:
            pass
        if clock() >= until:
            return False
        time.sleep(0.2)


def _remove(path: str | None) -> None:
    if path:
        try:
            os.remove(path)
        except OSError:
            pass


def _not_shared(who: str, whose: str, folder: str) -> str:
    return (f"the checkpoint folder is not shared between the machines: {who} does not see {whose} file "
            f"{FOLDER_FILE}.<rank> in its {folder}; checkpoints, resume and preemption agree through that folder "
            "(train/preempt.py): give every machine the same shared folder (a network file system)")


# ------------------------------------------------------------------------------ machine 0
def serve(settings: dict, *, num_machines: int, port: int, timeout_s: float, host: str | None = None,
          head: tuple[str, int] | None = None, folder: str | None = None,
          clock: Callable[[], float] = time.monotonic, say: Callable[[str], None] | None = None) -> Met:
    """Machine 0's side: wait for machines ``1..num_machines-1`` and answer each with the verdict.

    Args:
        settings: :func:`shared_settings` of this machine.
        num_machines: machines of the job.
        port: the port to listen on.
        timeout_s: seconds to wait for every machine.
        host: how the lines name this machine (default: its host name).
        head: ``(main_process_ip, main_process_port)`` the other machines were told: this machine
            connects there too, and a listener other than its own (another machine given rank 0) ends
            the handshake on both with one line. None: not checked.
        folder: this machine's checkpoint folder (None or ``""``: none): the other machines must see
            its file there and it theirs.
        clock: seconds, monotonic (tests inject one).
        say: where the one waiting line goes (default: stderr), printed once after :data:`_GRACE_S`
            seconds without a verdict, naming the ranks still missing and who came from where.

    Returns:
        :class:`Met`: this machine's address and interface toward the other machines.

    Raises:
        RendezvousError: the port cannot be bound, a machine disagrees or claims a rank twice (rank 0
            too), the folder is not shared, or some machine did not come within ``timeout_s`` seconds.
    """
    host = host or socket.gethostname()
    me = f"machine 0 ({host})"
    try:
        dual = socket.has_dualstack_ipv6()
        server = socket.create_server(("", port), family=socket.AF_INET6 if dual else socket.AF_INET,
                                      dualstack_ipv6=dual)
    except OSError as e:
        raise RendezvousError(f"machine 0 cannot listen on port {port} for the other machines ({e.strerror or e}): "
                              "another job may hold it; give every machine another --main-process-port") from None
    nonce = secrets.token_hex(8)
    mine_file = _write_folder_file(folder, 0, nonce)
    started = clock()
    deadline = started + timeout_s
    probe = _Probe(head, settings, host, nonce, deadline, clock) if head else None
    clients: list[socket.socket] = []
    listeners: list[socket.socket] = []  # the clients that read llmeff_waiting lines before the verdict
    seen: dict[int, str] = {}
    where: dict[int, str | None] = {}  # each machine's address as machine 0 saw it
    met = Met()
    verdict = None
    said = False

    def status() -> tuple[list[int], list]:
        missing = [r for r in range(1, num_machines) if r not in seen]
        mine = met.address or (head[0] if head else None)
        return missing, [[0, host, mine]] + [[r, seen[r], where.get(r)] for r in seen]

    try:
        while verdict is None:
            now = clock()
            left = deadline - now
            if probe is not None and probe.verdict is not None:
                verdict = probe.verdict  # another machine 0 answered: it tells its machines too
                break
            if left <= 0:
                missing, came = status()
                verdict = (f"machine 0 at port {port} waited {timeout_s:g} s (rendezvous_timeout_s) for machine"
                           f"{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} of {num_machines}: none "
                           f"came{f' (came: {_came(came)})' if seen else ''}; "
                           "start `llmeff train --machine-rank R` with this --main-process-ip on each, within the timeout")
                break
            if not said and now - started >= _GRACE_S:  # every machine that came agreed: say what is missing
                missing, came = status()
                (say or _say)(_waits(0, _awaited(missing, num_machines, came), left))
                said = True
            server.settimeout(min(left, 0.2))
            try:
                conn, peer = server.accept()
            except (socket.timeout, TimeoutError):
                continue
            line = _line(conn, min(deadline, clock() + 30.0), clock)
            try:
                msg = json.loads(line or "")
                rank, them_host, theirs = int(msg["rank"]), str(msg["host"]), dict(msg["settings"])
            except (ValueError, KeyError, TypeError):
                conn.close()
                continue  # not one of ours (a port scan, a stale launcher): ignore it
            if rank == 0 and msg.get("nonce") == nonce:  # this machine's own probe: it is the head
                _send(conn, {"llmeff_self": True})
                conn.close()
                continue
            clients.append(conn)
            them = f"machine {rank} ({them_host})"
            if rank == 0:
                verdict = (f"machine_rank 0 was given to two machines, {host} and {them_host} (which reached "
                           f"{host} at main_process_ip): give each its own, 0 to the machine at main_process_ip")
            elif rank in seen:
                verdict = _twice(rank, seen[rank], them_host, seen, num_machines)
            elif not 0 < rank < num_machines:
                verdict = disagreement(settings, theirs, me, them) or (
                    f"{them} has machine_rank {rank}, outside 0..{num_machines - 1} of num_machines={num_machines}: "
                    f"give each machine its own rank in 0..{num_machines - 1}, 0 to the machine at main_process_ip")
            else:
                verdict = disagreement(settings, theirs, me, them)
                if verdict is None and folder and msg.get("folder") is not None:
                    if msg.get("head_nonce") != nonce:
                        verdict = _not_shared(them, "machine 0's", msg["folder"] or "folder")
                    elif not _sees(folder, rank, msg.get("folder_nonce"), clock):
                        verdict = _not_shared(me, f"{them}'s", folder)
                seen[rank] = them_host
                where[rank] = _plain(str(peer[0])) if peer else None
                if met.address is None:
                    met = _met(conn)
                if msg.get("hears_waiting") is True:
                    listeners.append(conn)
                if verdict is None and len(seen) == num_machines - 1:
                    verdict = "ok"
                elif verdict is None:  # tell every machine that came what the job still waits for
                    missing, came = status()
                    for each in listeners:
                        _send(each, {"llmeff_waiting": {"num_machines": num_machines, "missing": missing,
                                                        "came": came}})
        _answer(server, clients, verdict, seen, nonce, clock)
    finally:
        server.close()
        _remove(mine_file)
        if probe is not None:
            probe.stop()
    if verdict != "ok":
        raise RendezvousError(verdict)
    return met


def _twice(rank: int, first: str, second: str, seen: dict[int, str], num_machines: int) -> str:
    missing = [str(r) for r in range(1, num_machines) if r not in seen]
    none = f"; machine_rank {', '.join(missing)} to none" if missing else ""
    return f"machine_rank {rank} was given to two machines, {first} and {second}{none}: give each its own"


class _Probe:
    """Machine 0's connection to ``main_process_ip:main_process_port`` in a thread: its own listener
    answers ``llmeff_self``; another machine 0's answers a verdict (:attr:`verdict`)."""

    def __init__(self, head: tuple[str, int], settings: dict, host: str, nonce: str, deadline: float, clock) -> None:
        self.verdict: str | None = None
        self._done = threading.Event()
        self._msg = {"rank": 0, "host": host, "settings": settings, "nonce": nonce}
        self._head, self._deadline, self._clock = head, deadline, clock
        self._thread = threading.Thread(target=self._run, name="llmeff-rendezvous-probe", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._done.is_set() and self._clock() < self._deadline:
            try:
                sock = socket.create_connection(self._head, timeout=2.0)
            except OSError:
                self._done.wait(0.5)
                continue
            with sock:
                _send(sock, self._msg)
                answer = _line(sock, self._deadline, self._clock)
            try:
                msg = json.loads(answer or "")
            except ValueError:
                return  # something else listens there (the launcher after the handshake): not another machine 0
            if isinstance(msg, dict) and "llmeff_verdict" in msg and msg["llmeff_verdict"] != "ok":
                self.verdict = str(msg["llmeff_verdict"])
            return

    def stop(self) -> None:
        self._done.set()


def _answer(server: socket.socket, clients: list[socket.socket], verdict: str, seen: dict[int, str], nonce: str,
            clock) -> None:
    """Send ``verdict`` to every machine, then wait (up to :data:`_ACK_S`) for each to close its end;
    meanwhile a machine that comes late (a rank the job has already met) is answered with why."""
    for conn in clients:
        _send(conn, {"llmeff_verdict": verdict})
    until = clock() + _ACK_S
    open_ = list(clients)
    while open_ and clock() < until:
        for conn in list(open_):
            if _line(conn, min(until, clock() + 0.05), clock) is None and _closed(conn):
                conn.close()
                open_.remove(conn)
        server.settimeout(0.05)
        try:
            late, _ = server.accept()
        except OSError:
            continue
        line = _line(late, min(until, clock() + 5.0), clock)
        try:
            msg = json.loads(line or "")
            rank, them_host = int(msg["rank"]), str(msg["host"])
        except (ValueError, KeyError, TypeError):
            late.close()
            continue
        if rank == 0 and msg.get("nonce") == nonce:  # this machine's own probe, late
            _send(late, {"llmeff_self": True})
            late.close()
            continue
        if rank == 0 or rank in seen:
            why = (f"machine_rank {rank} was given to two machines, {seen.get(rank, 'machine 0')} and {them_host}: the "
                   f"job started without {them_host}; give each its own")
        else:
            why = f"machine {rank} ({them_host}) came after the machines had met ({verdict})"
        _send(late, {"llmeff_verdict": why})
        late.close()
    for conn in open_:
        conn.close()


def _closed(conn: socket.socket) -> bool:
    """True when the other end closed ``conn`` (a read returns nothing at once)."""
    try:
        conn.settimeout(0)
        return conn.recv(1, socket.MSG_PEEK) == b""
    except (BlockingIOError, socket.timeout):
        return False
    except OSError:
        return True


# ------------------------------------------------------------------------------ machines 1..
def join(settings: dict, *, rank: int, address: str, port: int, timeout_s: float, host: str | None = None,
         folder: str | None = None, clock: Callable[[], float] = time.monotonic,
         say: Callable[[str], None] | None = None) -> Met:
    """Machine ``rank``'s side (> 0): reach machine 0 at ``address:port``, retrying until ``timeout_s``,
    send this machine's settings and read the verdict.

    Args:
        folder: this machine's checkpoint folder (None or ``""``: none), see :func:`serve`.
        clock: seconds, monotonic (tests inject one).
        say: where a waiting line goes (default: stderr): after :data:`_GRACE_S` seconds without a verdict,
            once while machine 0 does not answer (``waits for machine 0 at 10.0.0.1:29500 (last try: ...)``),
            and once while machine 0 waits for other ranks (the ranks machine 0 named, who came from where).

    Returns:
        :class:`Met`: this machine's address and interface toward machine 0.

    Raises:
        RendezvousError: machine 0 did not answer within ``timeout_s`` seconds (naming the ranks it still
            waited for, when it said), or its verdict is not ``ok``.
    """
    say = say or _say
    started = clock()
    deadline = started + timeout_s
    where = f"{address}:{port}"
    last = "no answer"
    nonce = secrets.token_hex(8)
    mine_file = _write_folder_file(folder, rank, nonce)
    sock = None
    said = False
    try:
        while sock is None:
            now = clock()
            left = deadline - now
            if left <= 0:
                raise RendezvousError(
                    f"machine {rank} could not reach machine 0 at {where} within {timeout_s:g} s (rendezvous_timeout_s; "
                    f"last try: {last}): start machine 0 first, or check --main-process-ip / --main-process-port and "
                    "that the port is open between the machines")
            try:
                sock = socket.create_connection((address, port), timeout=min(left, 5.0))
            except OSError as e:
                last = e.strerror or ("no answer" if isinstance(e, TimeoutError) else type(e).__name__)
                now = clock()
                if not said and now - started >= _GRACE_S:  # machine 0 is the one missing, or not reachable
                    say(_waits(rank, f"machine 0 at {where} (last try: {last})", deadline - now))
                    said = True
                time.sleep(min(0.5, max(0.0, deadline - now)))
        with sock:
            met = _met(sock)
            msg = {"rank": rank, "host": host or socket.gethostname(), "settings": settings, "hears_waiting": True}
            if folder:  # machine 0 wrote its file before it listened: it is there now, if the folder is shared
                head_nonce = _head_nonce(folder)
                msg.update({"folder": folder, "folder_nonce": nonce, "head_nonce": head_nonce})
            try:
                sock.sendall((json.dumps(msg) + "\n").encode("utf-8"))
            except OSError as e:
                raise RendezvousError(f"machine {rank} lost machine 0 at {where} while sending its settings "
                                      f"({e.strerror or e})") from None
            answer, waited, closed = _read_verdict(sock, rank, started + _GRACE_S, deadline, clock, say)
    finally:
        _remove(mine_file)
    verdict = answer
    if answer is not None:
        try:
            verdict = str(json.loads(answer)["llmeff_verdict"])
        except (ValueError, KeyError, TypeError):  # another program listens there, not machine 0 of this job
            raise RendezvousError(
                f"machine {rank} reached {where}, but what answered is not machine 0 of an llmeff train job (it said "
                f"{shorten((answer.splitlines() or [''])[0], 80)!r}): check --main-process-ip and --main-process-port (machine 0's address, and a "
                "port nothing else uses)") from None
    if verdict is None and closed:
        raise RendezvousError(f"machine {rank} lost machine 0 at {where} before its verdict (it closed the connection"
                              f"{'; it waited for ' + waited if waited else ''}): machine 0's own error says why")
    if verdict is None:
        what = (f"machine 0 still waits for {waited}; start `llmeff train --machine-rank R` with this "
                "--main-process-ip on each, within the timeout" if waited else
                "machine 0 waits for the other machines; start them all")
        raise RendezvousError(f"machine {rank} reached machine 0 at {where} but had no verdict within {timeout_s:g} s "
                              f"(rendezvous_timeout_s): {what}")
    if verdict != "ok":
        raise RendezvousError(verdict)
    return met


def _read_verdict(sock: socket.socket, rank: int, quiet_until: float, deadline: float, clock,
                  say: Callable[[str], None]) -> tuple[str | None, str | None, bool]:
    """Machine ``rank``'s wait for machine 0's verdict on ``sock``: its ``llmeff_waiting`` lines on the way keep
    what machine 0 waits for, said once from ``quiet_until`` on.

    Returns:
        ``(answer, waited, closed)``: the first other line (the verdict; None: none before ``deadline``), what
        machine 0 last said it waited for (``machine_rank 1 of 3 (came: ...)``; None: it did not say), and
        whether machine 0 closed the connection without an answer.
    """
    lines = _Lines(sock)
    waited, said = None, False
    while True:
        now = clock()
        if waited is not None and not said and now >= quiet_until:
            say(_waits(rank, waited, deadline - now))
            said = True
        if now >= deadline:
            return None, waited, False
        line = lines.next(min(deadline - now, _TICK_S))
        if line is None:
            if lines.closed:
                return None, waited, True
            continue
        try:
            msg = json.loads(line)
        except ValueError:
            return line, waited, False
        known = _status(msg) if isinstance(msg, dict) and "llmeff_waiting" in msg else None
        if known is None:
            return line, waited, False
        waited = _awaited(*known)


def _head_nonce(folder: str, wait_s: float | None = None) -> str | None:
    """Machine 0's nonce in ``folder`` (waiting up to ``wait_s`` for it to appear), or None."""
    until = time.monotonic() + (_FOLDER_S if wait_s is None else wait_s)
    while True:
        try:
            with open(os.path.join(folder, f"{FOLDER_FILE}.0"), encoding="utf-8") as f:
                got = f.read().strip()
            if got:
                return got
        except OSError:
            pass
        if time.monotonic() >= until:
            return None
        time.sleep(0.2)


def handshake(run) -> Met:
    """This machine's side of the handshake for ``run`` (nothing with one machine).

    Args:
        run: the resolved run (:class:`~mlflow_llmeff.planning.spec.RunSpec`) or its options
            (:class:`~mlflow_llmeff.train.config.TrainConfig`).

    Returns:
        :class:`Met` (empty with one machine).

    Raises:
        RendezvousError: one line, see :func:`serve` and :func:`join`.
    """
    cfg = getattr(run, "options", run)
    if cfg.num_machines < 2:
        return Met()
    mine = shared_settings(run)
    if cfg.machine_rank == 0:
        return serve(mine, num_machines=cfg.num_machines, port=cfg.main_process_port,
                     timeout_s=cfg.rendezvous_timeout_s, head=(cfg.main_process_ip, cfg.main_process_port),
                     folder=cfg.checkpoint_dir or None)
    return join(mine, rank=cfg.machine_rank, address=cfg.main_process_ip, port=cfg.main_process_port,
                timeout_s=cfg.rendezvous_timeout_s, folder=cfg.checkpoint_dir or None)
