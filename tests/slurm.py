"""A SLURM cluster for tests: slurmctld beside namespace hosts (tests/hosts.py), one slurmd in each.

Debian's ``slurm-wlm`` (22.05) and ``munge``; ``.ci/run`` installs them where missing. The cluster is
made of:

* one ``munged`` with its own key and socket in the cluster's folder (``AuthInfo=socket=...``), serving
  every daemon and client of the cluster (the hosts share the file system);
* ``slurmctld`` in the root network namespace, reached by the hosts at the bridge's address, under a
  host name of its own (``unshare --uts``: a controller runs only where its host name is
  ``SlurmctldHost``'s);
* one ``slurmd -N <host>`` per namespace host, entered with ``nsenter --net`` and a private mount
  namespace that binds the host's ``/etc/netns/<host>/hosts`` over ``/etc/hosts`` (the jobs' host names
  resolve) but keeps ``/sys`` (``ip netns exec`` remounts it, and slurmd 22.05 will not start without
  ``/sys/fs/cgroup``: its cgroup plugin initialises even with ``proctrack/linuxproc``);
* a generated ``slurm.conf``: ``NodeName=<host> NodeAddr=<address> CPUs=2``, ``SelectType=select/linear``
  (whole nodes), ``ProctrackType=proctrack/linuxproc`` and ``TaskPlugin=task/none`` (no cgroups in
  the test container), ``JobRequeue=1``, ``ReturnToService=2``, state and spool in the folder, ports
  of the host set's subnet (two clusters side by side do not collide).

Clients (``sbatch``, ``srun``, ``scontrol``) find the cluster through ``SLURM_CONF`` (:attr:`Cluster.env`);
``sbatch`` exports the submitter's environment to the job, so jobs see it too. A requeued job waits
120 s before it is eligible again (slurmctld's fixed begin time after a requeue);
:meth:`Cluster.release` ends that wait at once (``scontrol update StartTime=now``).

Command line (CI scripts)::

    python tests/slurm.py up --name ci      # prints SLURM_CONF=<path> and the nodes
    python tests/slurm.py down --name ci
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hosts import Hosts  # noqa: E402
from hosts import unavailable as hosts_unavailable  # noqa: E402

STATE_DIR = "/run/llmeff-slurm"
DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol")
TERMINAL = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE")


def unavailable() -> str | None:
    """Why a cluster cannot be made here (None when it can): namespace hosts and the SLURM and munge daemons."""
    why = hosts_unavailable()
    if why:
        return why
    missing = [d for d in DAEMONS if shutil.which(d) is None and not os.path.exists(f"/usr/sbin/{d}")]
    if missing:
        return f"{', '.join(missing)} not installed (apt-get install slurm-wlm munge)"
    if shutil.which("nsenter") is None:
        return "nsenter (util-linux) is not installed"
    return None


def _which(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


@dataclass
class Cluster:
    """A SLURM cluster on ``n`` namespace hosts (see the module docstring); a context manager.

    Attributes:
        hosts: the namespace hosts, one slurmd each (node names are the hosts' names).
        folder: state, spool, logs, the munge key and socket, ``slurm.conf``.
        partition: the one partition, every node in it.
    """

    n: int = 2
    rate_mbit: float = 0.0
    tag: str = ""
    cpus: int = 2
    hosts: Hosts | None = None
    folder: str = ""
    partition: str = "debug"
    _procs: list[subprocess.Popen] = field(default_factory=list)

    @property
    def conf(self) -> str:
        """Path of the cluster's ``slurm.conf`` (``SLURM_CONF``)."""
        return os.path.join(self.folder, "slurm.conf")

    @property
    def env(self) -> dict[str, str]:
        """This process's environment with ``SLURM_CONF`` pointing at the cluster."""
        return {**os.environ, "SLURM_CONF": self.conf}

    @property
    def nodes(self) -> list[str]:
        return list(self.hosts.names) if self.hosts else []

    # ------------------------------------------------------------------ up and down
    def up(self, timeout_s: float = 60.0) -> "Cluster":
        """Make the hosts, write the configuration, start munged, slurmctld and the slurmds, and wait
        until every node is idle.

        Raises:
            RuntimeError: a daemon did not start or the nodes did not come up within ``timeout_s``
                (the logs' last lines are in the message; everything made so far is removed).
        """
        self.hosts = Hosts(n=self.n, rate_mbit=self.rate_mbit, tag=self.tag).up()
        try:
            self.folder = tempfile.mkdtemp(prefix=f"llmeff-slurm-{self.tag or os.getpid()}-")
            os.chmod(self.folder, 0o700)  # munged refuses a socket folder others may write
            for sub in ("state", "spool", *(os.path.join("spool", h) for h in self.nodes)):
                os.makedirs(os.path.join(self.folder, sub), exist_ok=True)
            key = os.path.join(self.folder, "munge.key")
            with open(key, "wb") as f:
                f.write(os.urandom(1024))
            os.chmod(key, 0o400)
            with open(self.conf, "w") as f:
                f.write(self.render_conf())
            self._start_munge(key)
            ctl = self._ctl_name()
            self._spawn("slurmctld", ["unshare", "--uts", "sh", "-c", f'hostname {ctl} && exec "$0" "$@"',
                                      _which("slurmctld"), "-D", "-f", self.conf])
            for node in self.nodes:
                binds = (f"mount --bind /etc/netns/{node}/hosts /etc/hosts && "
                         f"mount --bind /etc/netns/{node}/resolv.conf /etc/resolv.conf && hostname {node}")
                self._spawn(f"slurmd.{node}", ["nsenter", f"--net=/run/netns/{node}", "unshare", "--mount", "--uts",
                                               "sh", "-c", f'{binds} && exec "$0" "$@"', _which("slurmd"), "-D",
                                               "-N", node, "-f", self.conf])
            self._wait_idle(timeout_s)
            self._save()
        except Exception:
            self.down()
            raise
        return self

    def _ctl_name(self) -> str:
        return f"llctl{self.tag or os.getpid() % 100000}"

    def _ports(self) -> tuple[int, int]:
        k = int(self.hosts.gateway.split(".")[2])  # the host set's subnet: unique among live sets
        return 17000 + 2 * k, 17001 + 2 * k

    def render_conf(self) -> str:
        """``slurm.conf`` for the hosts (see the module docstring)."""
        d, (ctld_port, slurmd_port) = self.folder, self._ports()
        lines = [f"ClusterName=llmeff{self.tag or 'test'}".lower(),
                 f"SlurmctldHost={self._ctl_name()}({self.hosts.gateway})",
                 f"SlurmctldPort={ctld_port}", f"SlurmdPort={slurmd_port}",
                 "SlurmUser=root", "SlurmdUser=root", "AuthType=auth/munge", "CredType=cred/munge",
                 f"AuthInfo=socket={d}/munge.sock", f"StateSaveLocation={d}/state", f"SlurmdSpoolDir={d}/spool/%n",
                 f"SlurmctldPidFile={d}/slurmctld.pid", f"SlurmdPidFile={d}/slurmd.%n.pid",
                 f"SlurmctldLogFile={d}/slurmctld.log", f"SlurmdLogFile={d}/slurmd.%n.log",
                 "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "JobAcctGatherType=jobacct_gather/none",
                 "AccountingStorageType=accounting_storage/none", "SelectType=select/linear",
                 "SchedulerType=sched/builtin", "MpiDefault=none", "SwitchType=switch/none", "ReturnToService=2",
                 "JobRequeue=1", "KillWait=10", "MinJobAge=600", "MailProg=/bin/true", "SlurmdTimeout=60"]
        lines += [f"NodeName={h} NodeAddr={a} CPUs={self.cpus} State=UNKNOWN"
                  for h, a in zip(self.hosts.names, self.hosts.addresses)]
        lines.append(f"PartitionName={self.partition} Nodes=ALL Default=YES MaxTime=INFINITE State=UP")
        return "\n".join(lines) + "\n"

    def _start_munge(self, key: str) -> None:
        d = self.folder
        r = subprocess.run([_which("munged"), "--force", f"--socket={d}/munge.sock", f"--key-file={key}",
                            f"--pid-file={d}/munged.pid", f"--log-file={d}/munged.log", f"--seed-file={d}/munged.seed"],
                           capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"munged did not start: {r.stderr.strip()}")

    def _spawn(self, name: str, argv: list[str]) -> None:
        out = open(os.path.join(self.folder, f"{name}.out"), "w")
        self._procs.append(subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                            env=self.env))

    def _wait_idle(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        states = ""
        while time.monotonic() < deadline:
            dead = [p for p in self._procs if p.poll() is not None]
            if dead:
                break
            r = self.run(["sinfo", "-h", "-N", "-o", "%N %t"])
            states = r.stdout.strip()
            got = dict(line.split() for line in states.splitlines() if len(line.split()) == 2)
            if len(got) == self.n and all(s == "idle" for s in got.values()):
                return
            time.sleep(0.3)
        raise RuntimeError(f"the SLURM nodes did not come up ({states or 'no answer'}):\n{self.logs()}")

    def logs(self, lines: int = 6) -> str:
        """The last lines of every daemon's log, for an error message."""
        out = []
        for name in sorted(os.listdir(self.folder)) if self.folder and os.path.isdir(self.folder) else []:
            if name.endswith((".log", ".out")):
                with open(os.path.join(self.folder, name), errors="replace") as f:
                    tail = f.read().splitlines()[-lines:]
                out.append(f"== {name}\n" + "\n".join(tail))
        return "\n".join(out)

    def down(self) -> None:
        """Stop the daemons and every job process, remove the hosts and the folder (never raises)."""
        for p in self._procs:
            _stop(p.pid)
        for name in ("slurmctld.pid", "munged.pid", *(f"slurmd.{h}.pid" for h in self.nodes)):
            try:
                with open(os.path.join(self.folder, name)) as f:
                    _stop(int(f.read().strip()))
            except (OSError, ValueError):
                pass
        for p in self._procs:
            try:
                p.wait(timeout=10)
            except Exception:  # noqa: BLE001
                pass
        if self.hosts is not None:
            self.hosts.down()
        if self.folder:
            shutil.rmtree(self.folder, ignore_errors=True)
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
            json.dump({"n": self.n, "folder": self.folder, "pids": [p.pid for p in self._procs]}, f)

    def __enter__(self) -> "Cluster":
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()

    # ------------------------------------------------------------------ using it
    def run(self, argv: list[str], **kw) -> subprocess.CompletedProcess:
        """Run a SLURM client command (``sbatch``, ``scontrol``, ...) against the cluster, in the root namespace."""
        kw.setdefault("capture_output", True)
        kw.setdefault("text", True)
        return subprocess.run(argv, env={**self.env, **kw.pop("env", {})}, **kw)

    def sbatch(self, script: str, *args: str, env: dict[str, str] | None = None) -> int:
        """Submit ``script`` (its text) with ``sbatch --parsable ARGS``; returns the job id.

        Raises:
            RuntimeError: sbatch refused it (its message).
        """
        path = os.path.join(self.folder, f"job-{time.time_ns()}.sh")
        with open(path, "w") as f:
            f.write(script)
        r = self.run(["sbatch", "--parsable", *args, path], env=env or {})
        if r.returncode != 0:
            raise RuntimeError(f"sbatch refused the job: {r.stderr.strip()}")
        return int(r.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """``scontrol show job``'s fields of ``job_id`` (``JobState``, ``Restarts``, ``SubmitTime``, ...)."""
        text = self.run(["scontrol", "show", "job", "-o", str(job_id)]).stdout
        return dict(m.groups() for m in re.finditer(r"(\w+)=(\S*)", text))

    def wait(self, job_id: int, states: tuple[str, ...], timeout_s: float = 300.0, poll_s: float = 0.2) -> dict[str, str]:
        """Wait until the job's state is one of ``states``; returns its fields.

        Raises:
            TimeoutError: not within ``timeout_s``, or the job ended in another state (its last state and
                the logs in the message).
        """
        deadline = time.monotonic() + timeout_s
        fields: dict[str, str] = {}
        while time.monotonic() < deadline:
            fields = self.job(job_id)
            if fields.get("JobState") in states:
                return fields
            if fields.get("JobState") in TERMINAL:  # it will not change any more
                break
            time.sleep(poll_s)
        raise TimeoutError(f"job {job_id} not {'/'.join(states)} within {timeout_s:.0f} s: "
                           f"{fields.get('JobState')} ({fields.get('Reason')})\n{self.logs()}")

    def release(self, job_id: int) -> None:
        """Make a requeued (pending) job eligible now instead of 120 s after its requeue."""
        self.run(["scontrol", "update", f"jobid={job_id}", "StartTime=now"], check=True)


def _stop(pid: int) -> None:
    for sig in (signal.SIGTERM,):
        try:
            os.killpg(pid, sig)
        except (ProcessLookupError, PermissionError):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="verb", required=True)
    u = sub.add_parser("up", help="make a cluster; prints SLURM_CONF=<path> and its nodes")
    u.add_argument("--name", required=True, help="the set's tag (letters and digits, <= 6 characters)")
    u.add_argument("--hosts", type=int, default=2)
    u.add_argument("--rate-mbit", type=float, default=0.0)
    d = sub.add_parser("down", help="stop a cluster made by up")
    d.add_argument("--name", required=True)
    a = p.parse_args(argv)
    if not a.name.isalnum() or len(a.name) > 6:
        raise SystemExit(f"--name {a.name!r}: use 1-6 letters and digits")
    if a.verb == "up":
        why = unavailable()
        if why:
            raise SystemExit(f"a SLURM cluster cannot be made here: {why}")
        c = Cluster(n=a.hosts, rate_mbit=a.rate_mbit, tag=a.name).up()
        c._procs = []  # the daemons outlive this command; down finds them by their pid files
        print(f"SLURM_CONF={c.conf}")
        for h, addr in zip(c.hosts.names, c.hosts.addresses):
            print(h, addr)
    else:
        try:
            with open(os.path.join(STATE_DIR, a.name + ".json")) as f:
                rec = json.load(f)
        except FileNotFoundError:
            raise SystemExit(f"no cluster {a.name!r} is recorded in {STATE_DIR}") from None
        hosts = Hosts.load(a.name)
        Cluster(n=rec["n"], tag=a.name, hosts=hosts, folder=rec["folder"]).down()


if __name__ == "__main__":
    main()
