"""Shared fixtures: a private MLflow store per test, quiet single-threaded torch, the shared data."""

from __future__ import annotations

import os
import pathlib
import tempfile

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
DATA_DIR = pathlib.Path(os.environ.get("LLMEFF_DATA_DIR", REPO.parent / "shared" / "data"))

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("CODECARBON_LOG_LEVEL", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
# The tests' files (tmp_path, the stores they create, checkpoints, outboxes, token caches) live in RAM
# where the machine has a tmpfs: every MLflow sqlite commit fsyncs, and on this kind of shared disk that
# doubled the time of writing runs (100 runs: 2.8 s in /tmp, 1.5 s in /dev/shm). LLMEFF_TEST_TMP=disk,
# or an explicit --basetemp, keeps them on disk.
_SHM = "/dev/shm"
_RAM_TMP = (os.environ.get("LLMEFF_TEST_TMP", "") != "disk" and os.path.isdir(_SHM) and os.access(_SHM, os.W_OK))
_TMP_ROOT = _SHM if _RAM_TMP else None


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    """The controller (or a run without workers) puts the base temporary folder in :data:`_SHM`;
    xdist's workers get folders inside it (``popen-gwN``)."""
    if not _RAM_TMP or getattr(config, "workerinput", None) is not None or config.option.basetemp:
        return
    config.option.basetemp = tempfile.mkdtemp(prefix="llmeff-pytest-", dir=_SHM)
    config._llmeff_ram_basetemp = config.option.basetemp


def pytest_unconfigure(config):
    """Give the RAM back: the base folder made in :func:`pytest_configure` goes at the end of the run."""
    path = getattr(config, "_llmeff_ram_basetemp", None)
    if path:
        import shutil

        shutil.rmtree(path, ignore_errors=True)


# a logger closing against a failing store waits this long for it before spilling to its outbox (30 s by
# default); tests that stop a real server set their own
os.environ.setdefault("LLMEFF_DELIVERY_WAIT_S", "3")
# ... and tests whose server stays up wait as long as the product does: on a loaded 2-core CI machine one
# request to a healthy loopback server took over 3 s, the run's end went to the outbox, and a test of
# two machines read RUNNING where the run had finished (CI of stop 48)
HEALTHY_SERVER_ENV = {"LLMEFF_DELIVERY_WAIT_S": "30"}


def _fresh_folder(var: str, prefix: str) -> None:
    """``$var`` = a new folder (in RAM where :data:`_RAM_TMP`), removed when the process that made it
    ends; xdist's workers inherit the controller's and make none."""
    if not os.environ.get(var):
        import atexit
        import shutil

        os.environ[var] = tempfile.mkdtemp(prefix=prefix, dir=_TMP_ROOT)
        atexit.register(shutil.rmtree, os.environ[var], True)


# what a logger spills without a checkpoint folder goes to a fresh folder, not the user's ~/.cache
_fresh_folder("LLMEFF_OUTBOX_DIR", "llmeff_test_outbox_")
# Token caches of the tests' runs go to a fresh folder, not the user's ~/.cache.
_fresh_folder("LLMEFF_CACHE_DIR", "llmeff_test_tokens_")
# The product has no default data folder beside the repository: tests point it at the shared data.
if DATA_DIR.is_dir():
    os.environ.setdefault("LLMEFF_DATA_DIR", str(DATA_DIR))


def under_ci() -> bool:
    """True under CI: the ``CI`` environment variable set to anything but empty, 0, false or no
    (CI services set ``CI=true``)."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def require(module: str, how: str = ""):
    """Import and return ``module``; when it is missing, skip locally but fail under CI
    (:func:`under_ci`), where a missing dependency is a broken set-up, not a reason to pass.

    Usable at module level (``lm_eval = require("lm_eval")``: a collection error under CI) and
    inside a test.

    Raises:
        pytest.fail.Exception: under CI when ``module`` cannot be imported.
        pytest.skip.Exception: elsewhere when it cannot be imported.
    """
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as e:
        why = f"{module} is not installed ({e})" + (f"; {how}" if how else "")
        if under_ci():
            pytest.fail(f"{why}: CI must install it", pytrace=False)
        pytest.skip(why, allow_module_level=True)


def require_peft():
    """peft for the LoRA tests, from its own folder (``$LLMEFF_PEFT_DIR``, else ``.venv/peft``: .ci/run installs it
    there, not in the venv, where transformers would import it and bitsandbytes in every process) put on
    ``sys.path``, or from the environment; :func:`require`'s rules when it is in neither."""
    import os
    import sys

    folder = os.environ.get("LLMEFF_PEFT_DIR", str(REPO / ".venv" / "peft"))
    if os.path.isdir(folder) and folder not in sys.path:
        sys.path.append(folder)  # after the venv: its torch, transformers and accelerate stay first
    return require("peft", "pip install 'mlflow-llmeff[lora]' (CI: --target .venv/peft)")


def use_store(uri: str, monkeypatch):
    """Point MLflow at ``uri`` for one test (also exported for subprocesses); a generator for fixtures."""
    import mlflow

    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    mlflow.set_tracking_uri(uri)
    yield uri
    mlflow.set_tracking_uri(None)


@pytest.fixture
def tracking_uri(tmp_path, monkeypatch):
    """A fresh sqlite MLflow store for one test; also exported for subprocesses."""
    yield from use_store(f"sqlite:///{tmp_path / 'mlflow.db'}", monkeypatch)


@pytest.fixture(scope="module")
def module_store(tmp_path_factory):
    """One sqlite store for a module's tests (creating an MLflow database costs seconds); a module
    overrides ``tracking_uri`` with ``use_store(module_store, ...)``."""
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"


@pytest.fixture
def shared_data():
    """Path of ../shared/data (LLMEFF_DATA_DIR overrides); skips when absent."""
    if not DATA_DIR.is_dir():
        if under_ci():  # CI lays ../shared beside the clone: missing data is a failure there
            pytest.fail(f"shared data not found at {DATA_DIR} (set LLMEFF_DATA_DIR)")
        pytest.skip(f"shared data not found at {DATA_DIR} (set LLMEFF_DATA_DIR)")
    return DATA_DIR


@pytest.fixture(autouse=True)
def _no_tracking_uri_leaks():
    """A tracking URI a test set with ``mlflow.set_tracking_uri`` outlives it in its worker, and outranks
    ``MLFLOW_TRACKING_URI`` for every later test there (a compare of 1,001 runs read another test's store
    and found no experiment): each test ends with MLflow's explicit URI as it found it."""
    import sys

    utils = sys.modules.get("mlflow.tracking._tracking_service.utils")
    before = getattr(utils, "_tracking_uri", None) if utils is not None else None
    yield
    utils = sys.modules.get("mlflow.tracking._tracking_service.utils")
    if utils is not None and getattr(utils, "_tracking_uri", None) != before:
        import mlflow

        mlflow.set_tracking_uri(before)


@pytest.fixture(autouse=True)
def _no_active_run_leaks():
    """A test that leaves an MLflow run active would send the next test's metrics to it: fail it."""
    yield
    import sys

    if "mlflow" in sys.modules:
        import mlflow

        run = mlflow.active_run()
        if run is not None:
            try:
                mlflow.end_run()
            except Exception:  # noqa: BLE001 - its store may be gone with the test's tmp_path
                pass
            pytest.fail(f"the test left MLflow run {run.info.run_id} active")


def process_start_unix_of(pid: int) -> float:
    """Unix time (s) process ``pid`` started, read here off the OS: ``/proc/<pid>/stat`` field 22
    (clock ticks since boot, proc(5)) on the boot clock, moved to the wall clock now. The product reads
    its own start the same way (``probes.process_start_unix``: ``/proc/self/stat``), so both see the same
    tick; they differ only by how far the wall clock moved against the boot clock between the two reads
    (NTP slewing: at most 0.5 ms a second). Read it while the process runs (right after ``Popen``)."""
    import time

    with open(f"/proc/{pid}/stat") as f:
        ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # the name in (...) may hold spaces
    return time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK"))


#: Allowance for two readings of one process start (:func:`process_start_unix_of` against the
#: product's): a 10 ms clock tick (SC_CLK_TCK = 100) and 1 ms, a bound on the clocks' drift between them.
START_TICK_S = 0.011


def free_port() -> int:
    """A TCP port free on the loopback address now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LoopbackServer:
    """A real ``mlflow server`` on 127.0.0.1 with a sqlite backend, which a test can stop and start."""

    def __init__(self, root: pathlib.Path) -> None:
        self.root, self.port = root, free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.proc = None

    def start(self, timeout_s: float = 120.0) -> None:
        import subprocess
        import sys
        import time
        import urllib.request

        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{self.root / 'mlflow.db'}",
             "--default-artifact-root", str(self.root / "artifacts"), "--host", "127.0.0.1",
             "--port", str(self.port), "--workers", "1"],
            stdout=open(self.root / "server.log", "ab"), stderr=subprocess.STDOUT,
            start_new_session=True)  # its own process group: stop() ends its workers too, never the tests
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.3)
            if self.proc.poll() is not None:
                raise RuntimeError(f"mlflow server exited: {(self.root / 'server.log').read_text()[-2000:]}")
        raise RuntimeError("mlflow server did not answer /health in time")

    def stop(self) -> None:
        import os
        import signal

        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except Exception:  # noqa: BLE001
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.proc = None


@pytest.fixture
def mlflow_server(tmp_path, monkeypatch):
    """A started :class:`LoopbackServer`, the tracking URI of this test and its subprocesses."""
    import mlflow

    root = tmp_path / "server"
    root.mkdir()
    server = LoopbackServer(root)
    server.start()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", server.uri)
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    for k, v in HEALTHY_SERVER_ENV.items():  # a test that stops the server sets its own wait
        monkeypatch.setenv(k, v)
    mlflow.set_tracking_uri(server.uri)
    yield server
    mlflow.set_tracking_uri(None)
    server.stop()


# ----------------------------------------------------------------------------- two workers, one gate
# The suite runs on two pytest-xdist workers (pyproject addopts, --dist loadfile: a file's tests and
# its module fixtures stay on one worker). Tests marked ``serial`` measure what else uses the
# machine (contention, launches of several processes) and run alone: every test holds a shared
# lock on one file while it runs, a serial test an exclusive one. A turnstile lock in front gives a
# waiting serial test precedence over the next shared holder (else the other worker could starve it).
_GATE = pathlib.Path(tempfile.gettempdir()) / f"llmeff-tests-{os.environ.get('PYTEST_XDIST_TESTRUNUID', 'solo')}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Hold the gate over a test's whole protocol: the module fixtures its setup starts and the
    teardown it triggers run under the same lock as the test."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        yield
        return
    import fcntl

    serial = item.get_closest_marker("serial") is not None
    with open(f"{_GATE}.turn", "a+") as turn, open(f"{_GATE}.gate", "a+") as gate:
        fcntl.flock(turn, fcntl.LOCK_EX)
        try:
            fcntl.flock(gate, fcntl.LOCK_EX if serial else fcntl.LOCK_SH)
        finally:
            fcntl.flock(turn, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(gate, fcntl.LOCK_UN)


#: The files that take longest (measured: tests/conftest.py's two workers give each file to one), run
#: first so that neither worker starts one of them when the other is about to finish.
_LONGEST_FIRST = ("test_strategies.py", "test_survive.py", "test_compare_server.py", "test_train_e2e.py",
                  "test_delivery.py", "test_lifecycle.py", "test_autolog_examples.py", "test_postgres.py", "test_logger.py",
                  "test_fit.py")


#: The files of ``serial`` tests, run last. A serial test waits for the test the other worker is in
#: (the gate above): early in the session that can be test_strategies.py's module fixture, minutes of
#: launches during which both workers would wait; at the end it is a short test.
_LAST = ("test_contention.py", "test_timed_alone.py", "test_two_hosts.py")


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(_LONGEST_FIRST)}
    rank.update({name: 1000 + i for i, name in enumerate(_LAST)})
    items.sort(key=lambda item: rank.get(item.path.name, len(_LONGEST_FIRST)))  # stable: order within a file kept


def stop_process_group(proc, wait_s: float = 20) -> None:
    """Stop a server started with ``start_new_session=True`` and the workers it started (its process
    group): SIGTERM, then SIGKILL after ``wait_s`` seconds; a group already gone is fine."""
    import os
    import signal
    import subprocess

    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(wait_s)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
