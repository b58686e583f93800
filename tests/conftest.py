"""Shared fixtures: a private MLflow store per test, quiet single-threaded torch, the shared data."""

from __future__ import annotations

import os
import pathlib
import tempfile

import pytest

# assertions of the helper modules the tests share (tests/strategies.py) say what differed, as a test's do
pytest.register_assert_rewrite("strategies")

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


def require(module: str, how: str = "", load: bool = True):
    """Import and return ``module``; when it is missing, skip locally but fail under CI
    (:func:`under_ci`), where a missing dependency is a broken set-up, not a reason to pass.

    Usable at module level (``lm_eval = require("lm_eval")``: a collection error under CI) and
    inside a test. ``load=False`` only finds it (``importlib.util.find_spec``) and returns None: a
    module-level check that leaves the import to the tests that use it, so that collecting the file,
    which every worker does, costs nothing (peft: ~1.5-3 s of CPU with bitsandbytes, lm_eval ~1 s).

    Raises:
        pytest.fail.Exception: under CI when ``module`` cannot be imported (found).
        pytest.skip.Exception: elsewhere when it cannot be imported (found).
    """
    import importlib
    import importlib.util

    try:
        if not load:
            if importlib.util.find_spec(module) is None:
                raise ImportError(f"No module named {module!r}")
            return None
        return importlib.import_module(module)
    except ImportError as e:
        why = f"{module} is not installed ({e})" + (f"; {how}" if how else "")
        if under_ci():
            pytest.fail(f"{why}: CI must install it", pytrace=False)
        pytest.skip(why, allow_module_level=True)


def require_peft(load: bool = True):
    """peft for the LoRA tests, from its own folder (``$LLMEFF_PEFT_DIR``, else ``.venv/peft``: .ci/run installs it
    there, not in the venv, where transformers would import it and bitsandbytes in every process) put on
    ``sys.path``, or from the environment; :func:`require`'s rules (and its ``load``) when it is in neither."""
    import os
    import sys

    folder = os.environ.get("LLMEFF_PEFT_DIR", str(REPO / ".venv" / "peft"))
    if os.path.isdir(folder) and folder not in sys.path:
        sys.path.append(folder)  # after the venv: its torch, transformers and accelerate stay first
    return require("peft", "pip install 'mlflow-llmeff[lora]' (CI: --target .venv/peft)", load=load)


def use_store(uri: str, monkeypatch):
    """Point MLflow at ``uri`` for one test (also exported for subprocesses); a generator for fixtures."""
    import mlflow

    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    mlflow.set_tracking_uri(uri)
    yield uri
    mlflow.set_tracking_uri(None)


_EMPTY_STORE: pathlib.Path | None = None


def empty_store(path, artifacts=None) -> str:
    """A new, empty MLflow sqlite store at ``path`` (a ``.db`` file): a copy of one this process made once,
    whose tables MLflow created; returns its URI.

    Creating an MLflow database runs its schema migrations: 1.5-2 s of a quiet 2-core machine, 6-11 s of a
    loaded one, where the copy takes 0.35-0.5 s to its first run (measured); the suite makes hundreds. The
    copy holds what a fresh store holds (the ``Default`` experiment, the schema version), so a test sees
    no difference but the time. The ``Default`` experiment's artifacts go where a fresh store's would if
    it were made beside ``path`` (``<its folder>/mlruns/0``, as a process started there makes it), or in
    ``artifacts/0`` (what ``mlflow server --default-artifact-root artifacts`` gives it)."""
    import shutil
    import sqlite3

    global _EMPTY_STORE
    if _EMPTY_STORE is None:
        import mlflow

        folder = pathlib.Path(tempfile.mkdtemp(prefix="llmeff_empty_store_", dir=_TMP_ROOT))
        import atexit

        atexit.register(shutil.rmtree, str(folder), True)
        made = folder / "mlflow.db"
        mlflow.MlflowClient(f"sqlite:///{made}").search_experiments()  # creates the tables
        _EMPTY_STORE = made
    path = pathlib.Path(path)
    shutil.copyfile(_EMPTY_STORE, path)
    where = pathlib.Path(artifacts) if artifacts is not None else path.parent / "mlruns"
    with sqlite3.connect(path) as db:
        db.execute("UPDATE experiments SET artifact_location = ? WHERE experiment_id = 0", (str(where / "0"),))
    return f"sqlite:///{path}"


@pytest.fixture
def tracking_uri(tmp_path, monkeypatch):
    """A fresh sqlite MLflow store for one test (:func:`empty_store`); also exported for subprocesses."""
    yield from use_store(empty_store(tmp_path / "mlflow.db"), monkeypatch)


@pytest.fixture(scope="module")
def module_store(tmp_path_factory):
    """One sqlite store for a module's tests (:func:`empty_store`); a module overrides ``tracking_uri``
    with ``use_store(module_store, ...)``."""
    return empty_store(tmp_path_factory.mktemp("mlflow") / "mlflow.db")


@pytest.fixture
def shared_data():
    """Path of ../shared/data (LLMEFF_DATA_DIR overrides); skips when absent."""
    if not DATA_DIR.is_dir():
        if under_ci():  # CI lays ../shared beside the clone: missing data is a failure there
            pytest.fail(f"shared data not found at {DATA_DIR} (set LLMEFF_DATA_DIR)")
        pytest.skip(f"shared data not found at {DATA_DIR} (set LLMEFF_DATA_DIR)")
    return DATA_DIR


def _restore_tracking_uri():
    """MLflow's explicit tracking URI now (None when unset or MLflow not imported) and a function that puts it back."""
    import sys

    utils = sys.modules.get("mlflow.tracking._tracking_service.utils")
    before = getattr(utils, "_tracking_uri", None) if utils is not None else None

    def restore():
        now = sys.modules.get("mlflow.tracking._tracking_service.utils")
        if now is not None and getattr(now, "_tracking_uri", None) != before:
            import mlflow

            mlflow.set_tracking_uri(before)
    return restore


@pytest.fixture(autouse=True)
def _no_tracking_uri_leaks():
    """A tracking URI a test set with ``mlflow.set_tracking_uri`` outlives it in its worker, and outranks
    ``MLFLOW_TRACKING_URI`` for every later test there (a compare of 1,001 runs read another test's store
    and found no experiment): each test ends with MLflow's explicit URI as it found it."""
    restore = _restore_tracking_uri()
    yield
    restore()


@pytest.fixture(scope="module", autouse=True)
def _no_module_tracking_uri_leaks():
    """The same for a module-scoped fixture: it is set up before any function fixture, so the guard above
    takes its URI for the baseline and keeps it; this guard, set up first in its module and torn down last,
    ends each module with the URI it found (at CI 2-core, test_memory_study's store outlived its module and
    test_mlperf's compare on the same worker found experiment 'levers' instead of 'seeds')."""
    restore = _restore_tracking_uri()
    yield
    restore()


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

        if not (self.root / "mlflow.db").exists():  # the server's first start: its tables made once (empty_store)
            empty_store(self.root / "mlflow.db", artifacts=self.root / "artifacts")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{self.root / 'mlflow.db'}",
             "--default-artifact-root", str(self.root / "artifacts"), "--host", "127.0.0.1",
             "--port", str(self.port), "--workers", "1"],
            stdout=open(self.root / "server.log", "ab"), stderr=subprocess.STDOUT,
            # no job runner: MLflow's GenAI job execution (on by default) starts a runner and 9 huey consumers,
            # 10 processes instead of 2, 13-20 s of CPU a start instead of 6-7 (measured); the product uses no job
            env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
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


#: Seconds each test file takes (the sum of its tests' setup, call and teardown; ``--durations=0``, or
#: ``--junitxml`` summed by file), measured with the whole suite on two workers. xdist's ``--dist loadfile``
#: hands a worker one file at a time in collection order (with ``--no-loadscope-reorder``: by default it
#: orders files by their number of tests, which put test_strategies.py's minutes at the end), so
#: :func:`pytest_collection_modifyitems` puts the longest first and the two workers end together (the
#: longest-processing-time rule). A file not listed (a new one) counts :data:`_UNMEASURED_S`.
#: Measured at 9ea8431 by the fresh-clone CI (2 workers, 844 s of pytest, 1,606 s of worker time): the 30
#: longest files as its 'seconds by file' line gave them (:func:`pytest_terminal_summary`), the serial files
#: (:data:`_LAST`, run last whatever they take) left out; the others are under its shortest listed (14 s):
#: earlier measures, capped there.
_FILE_SECONDS: dict[str, float] = {
    "test_ray_train.py": 164, "test_delivery.py": 94, "test_strategies.py": 93, "test_reliability.py": 89,
    "test_train_e2e.py": 85, "test_compare_server.py": 75, "test_study.py": 66, "test_strategies_zero.py": 64,
    "test_lifecycle.py": 62, "test_server_modes.py": 60, "test_autolog_examples.py": 52, "test_survive.py": 51,
    "test_postgres.py": 44, "test_plan_memory.py": 43, "test_two_hosts.py": 42, "test_memory_study.py": 39,
    "test_slurm.py": 37, "test_two_hosts_lines.py": 25, "test_world_change.py": 24, "test_three_ways.py": 23,
    "test_node_loss.py": 23, "test_compare.py": 22, "test_preempt.py": 20, "test_monitor.py": 20,
    "test_writer.py": 18, "test_autolog.py": 18, "test_fit.py": 16, "test_scale.py": 15, "test_plan.py": 14,
    "test_report_page.py": 14, "test_architecture.py": 14, "test_intervals.py": 14, "test_logger.py": 14,
    "test_memory.py": 14, "test_stability.py": 14, "test_config.py": 14, "test_flopcount.py": 14, "test_lora.py": 14,
    "test_setups.py": 11.2, "test_mlperf.py": 10.2, "test_evals_tasks.py": 7.7, "test_naming.py": 6.7,
    "test_data.py": 4.9, "test_comm.py": 4.5, "test_undefined.py": 4.3, "test_counting.py": 3.6,
    "test_parallel.py": 3.5, "test_scheduler.py": 3.5, "test_levers.py": 3.4, "test_rendezvous.py": 2.3,
    "test_evals_scoring.py": 1.7, "test_repeats.py": 0.9, "test_zero_state.py": 0.9,
    "test_report_reliability.py": 0.7, "test_flops.py": 0.6, "test_energy.py": 0.3, "test_cli.py": 0.1,
    "test_hardware.py": 0.1, "test_keys.py": 0.1,
}

#: Seconds of each test file in this session (setup, call and teardown of its tests, as the workers
#: reported them), printed at the end (:func:`pytest_terminal_summary`) so that every CI log gives the
#: numbers :data:`_FILE_SECONDS` is kept from.
_SEEN_SECONDS: dict[str, float] = {}


def pytest_runtest_logreport(report):
    name = report.nodeid.split("::", 1)[0].rsplit("/", 1)[-1]
    _SEEN_SECONDS[name] = _SEEN_SECONDS.get(name, 0.0) + float(getattr(report, "duration", 0.0) or 0.0)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """The 30 longest files of the session and the sum over all, in seconds of worker time."""
    if getattr(config, "workerinput", None) is not None or not _SEEN_SECONDS:
        return
    ranked = sorted(_SEEN_SECONDS.items(), key=lambda kv: -kv[1])
    terminalreporter.write_sep("=", f"seconds by file (worker time, {sum(_SEEN_SECONDS.values()):.0f} s in all)")
    terminalreporter.write_line("  ".join(f"{name} {s:.0f}" for name, s in ranked[:30]))


#: Where a file not in :data:`_FILE_SECONDS` goes: among the long files, so that a new slow file does not
#: start last and hold the session's end; a short one costs nothing there.
_UNMEASURED_S = 30.0


#: The files of ``serial`` tests, run last. A serial test waits for the test the other worker is in
#: (the gate above): early in the session that can be test_strategies.py's module fixture, minutes of
#: launches during which both workers would wait; at the end it is a short test.
_LAST = ("test_contention.py", "test_timed_alone.py")


def schedule_key(name: str) -> tuple[int, float]:
    """Where file ``name`` runs: the ``serial`` files (:data:`_LAST`) last, in that order; every other
    file longest first (:data:`_FILE_SECONDS`)."""
    if name in _LAST:
        return 1, _LAST.index(name)
    return 0, -_FILE_SECONDS.get(name, _UNMEASURED_S)


def pytest_collection_modifyitems(session, config, items):
    items.sort(key=lambda item: schedule_key(item.path.name))  # stable: order within a file kept


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
