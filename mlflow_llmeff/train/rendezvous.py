"""The machines' handshake before the launcher: every machine reaches machine 0 within a stated time,
and every machine was given the same job.

``llmeff train --num-machines N`` runs this on each machine before ``accelerate launch`` (whose
rendezvous, torch elastic's static one, would otherwise wait: a machine whose head never answers
retried for more than 120 s here, torch's store timeouts reach 15 and 30 minutes, and a machine
told ``--num-machines 3`` while the others were told 2 joins a process group of another size and
hangs at its first collective):

* machine 0 listens on ``main_process_port`` (the port its launcher binds next), each other
  machine connects to ``main_process_ip:main_process_port``, retrying until
  ``rendezvous_timeout_s``, and sends its rank, host name and :data:`SHARED` settings (one JSON line);
* machine 0 compares them with its own as they come and answers every machine with one verdict
  line: ``ok``, or the first disagreement naming both values (``num_machines is 2 on machine 0
  (host-a) and 3 on machine 1 (host-b)``), a rank claimed twice, or the machines that never came;
* then machine 0 closes the port and every machine launches.

Each failure is a :class:`RendezvousError`: one line naming the address, port and timeout. Plain
sockets, not torch's ``TCPStore``: the store prints a C++ stack trace on stderr for every failed
connection try, which buries the one line.
"""

from __future__ import annotations

import json
import socket
import time
from typing import Callable

from mlflow_llmeff.names import shorten

__all__ = ["SHARED", "RendezvousError", "handshake", "serve", "join", "shared_settings", "disagreement"]

#: Settings every machine must share: a difference changes the job's shape or the order of its
#: collectives (a hang), or its data and steps. Paths and workers local to a machine may differ.
SHARED = ("num_machines", "num_processes", "main_process_port", "parallelism", "tp_size", "dp_shard", "model",
          "dataset", "packing", "seq_len", "micro_batch_size", "grad_accum", "max_steps", "precision", "seed",
          "activation_checkpointing", "compile", "warmup_steps", "log_every_n_steps", "eval_every", "eval_tasks",
          "checkpoint_every", "measure_comm", "nan_policy", "stop_at_targets")

#: Seconds machine 0 waits, after its verdict, for the other machines to read it before it closes the port.
_ACK_S = 10.0


class RendezvousError(ValueError):
    """A machine did not meet the others (unreachable, absent, or given another job): one line."""


def shared_settings(cfg) -> dict:
    """The :data:`SHARED` fields of ``cfg`` (a :class:`~mlflow_llmeff.train.config.TrainConfig`)."""
    return {k: getattr(cfg, k) for k in SHARED}


def disagreement(mine: dict, theirs: dict, me: str, them: str) -> str | None:
    """One line naming every setting whose values differ (``None`` when they agree).

    Args:
        mine, theirs: :func:`shared_settings` of two machines.
        me, them: how the line names the machines, e.g. ``machine 0 (host-a)``.
    """
    differ = [k for k in SHARED if mine.get(k) != theirs.get(k)]
    if not differ:
        return None
    parts = [f"{k} is {mine.get(k)!r} on {me} and {theirs.get(k)!r} on {them}" for k in differ]
    return "the machines were given different settings: " + "; ".join(parts) + ": give every machine the same"


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


def serve(settings: dict, *, num_machines: int, port: int, timeout_s: float, host: str | None = None,
          clock: Callable[[], float] = time.monotonic) -> None:
    """Machine 0's side: wait for machines ``1..num_machines-1`` and answer each with the verdict.

    Raises:
        RendezvousError: the port cannot be bound, a machine disagrees or claims a rank twice, or
            some machine did not come within ``timeout_s`` seconds.
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
    deadline = clock() + timeout_s
    clients: list[socket.socket] = []
    seen: dict[int, str] = {}
    verdict = None
    try:
        while verdict is None:
            left = deadline - clock()
            if left <= 0:
                missing = [str(r) for r in range(1, num_machines) if r not in seen]
                verdict = (f"machine 0 at port {port} waited {timeout_s:g} s (rendezvous_timeout_s) for machine"
                           f"{'s' if len(missing) > 1 else ''} {', '.join(missing)} of {num_machines}: none came; "
                           "start `llmeff train --machine-rank R` with this --main-process-ip on each, within the timeout")
                break
            server.settimeout(min(left, 1.0))
            try:
                conn, _ = server.accept()
            except (socket.timeout, TimeoutError):
                continue
            clients.append(conn)
            line = _line(conn, min(deadline, clock() + 30.0), clock)
            try:
                msg = json.loads(line or "")
                rank, them_host, theirs = int(msg["rank"]), str(msg["host"]), dict(msg["settings"])
            except (ValueError, KeyError, TypeError):
                continue  # not one of ours (a port scan, a stale launcher): ignore it
            them = f"machine {rank} ({them_host})"
            if rank in seen:
                verdict = f"machine_rank {rank} was given to two machines, {seen[rank]} and {them_host}: give each its own"
            elif not 0 < rank < num_machines:
                verdict = disagreement(settings, theirs, me, them) or (
                    f"{them} has machine_rank {rank}, outside 1..{num_machines - 1} of num_machines={num_machines}")
            else:
                verdict = disagreement(settings, theirs, me, them)
                seen[rank] = them_host
                if verdict is None and len(seen) == num_machines - 1:
                    verdict = "ok"
        _answer(clients, verdict, clock)
    finally:
        server.close()
    if verdict != "ok":
        raise RendezvousError(verdict)


def _answer(clients: list[socket.socket], verdict: str, clock) -> None:
    """Send ``verdict`` to every machine, then wait (up to :data:`_ACK_S`) for each to close its end."""
    for conn in clients:
        try:
            conn.sendall((json.dumps({"llmeff_verdict": verdict}) + "\n").encode("utf-8"))
        except OSError:
            pass
    until = clock() + _ACK_S
    for conn in clients:
        _line(conn, until, clock)  # returns when the machine closed (it read the verdict)
        conn.close()


def join(settings: dict, *, rank: int, address: str, port: int, timeout_s: float, host: str | None = None,
         clock: Callable[[], float] = time.monotonic) -> None:
    """Machine ``rank``'s side (> 0): reach machine 0 at ``address:port``, retrying until ``timeout_s``,
    send this machine's settings and read the verdict.

    Raises:
        RendezvousError: machine 0 did not answer within ``timeout_s`` seconds, or its verdict is not ``ok``.
    """
    deadline = clock() + timeout_s
    where = f"{address}:{port}"
    last = "no answer"
    sock = None
    while sock is None:
        left = deadline - clock()
        if left <= 0:
            raise RendezvousError(
                f"machine {rank} could not reach machine 0 at {where} within {timeout_s:g} s (rendezvous_timeout_s; "
                f"last try: {last}): start machine 0 first, or check --main-process-ip / --main-process-port and "
                "that the port is open between the machines")
        try:
            sock = socket.create_connection((address, port), timeout=min(left, 5.0))
        except OSError as e:
            last = e.strerror or ("no answer" if isinstance(e, TimeoutError) else type(e).__name__)
            time.sleep(min(0.5, max(0.0, deadline - clock())))
    with sock:
        msg = {"rank": rank, "host": host or socket.gethostname(), "settings": settings}
        try:
            sock.sendall((json.dumps(msg) + "\n").encode("utf-8"))
        except OSError as e:
            raise RendezvousError(f"machine {rank} lost machine 0 at {where} while sending its settings "
                                  f"({e.strerror or e})") from None
        answer = _line(sock, deadline, clock)
    verdict = answer
    if answer is not None:
        try:
            verdict = str(json.loads(answer)["llmeff_verdict"])
        except (ValueError, KeyError, TypeError):  # another program listens there, not machine 0 of this job
            raise RendezvousError(
                f"machine {rank} reached {where}, but what answered is not machine 0 of an llmeff train job (it said "
                f"{shorten((answer.splitlines() or [''])[0], 80)!r}): check --main-process-ip and --main-process-port (machine 0's address, and a "
                "port nothing else uses)") from None
    if verdict is None:
        raise RendezvousError(f"machine {rank} reached machine 0 at {where} but had no verdict within {timeout_s:g} s "
                              "(rendezvous_timeout_s): machine 0 waits for the other machines; start them all")
    if verdict != "ok":
        raise RendezvousError(verdict)


def handshake(cfg) -> None:
    """This machine's side of the handshake for ``cfg`` (nothing with one machine).

    Raises:
        RendezvousError: one line, see :func:`serve` and :func:`join`.
    """
    if cfg.num_machines < 2:
        return
    mine = shared_settings(cfg)
    if cfg.machine_rank == 0:
        serve(mine, num_machines=cfg.num_machines, port=cfg.main_process_port, timeout_s=cfg.rendezvous_timeout_s)
    else:
        join(mine, rank=cfg.machine_rank, address=cfg.main_process_ip, port=cfg.main_process_port,
             timeout_s=cfg.rendezvous_timeout_s)
