"""Compare and the efficiency page against a PostgreSQL-backed ``mlflow server`` (MLflow's production set-up).

The module starts its own PostgreSQL cluster from the machine's binaries (Debian's
``/usr/lib/postgresql/<version>/bin``: ``initdb`` with trust authentication on a private socket
folder and a free loopback port; as root, as the ``postgres`` user), creates a database, and runs
``mlflow server --app-name llmeff --backend-store-uri postgresql+psycopg://... --workers 2`` over
it. The five standard runs (tests/five_runs.py) are logged to it over HTTP and to a sqlite store;
``llmeff compare`` and the page must give the same figures from both; so must a 2-process training job
logged to it, SIGKILLed and resumed, against its copy in sqlite; an outbox synced into it lands once.
Nothing else is needed from
CI: the cluster and the server stop with the module.
"""

from __future__ import annotations

import csv
import glob
import io
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from conftest import HEALTHY_SERVER_ENV, empty_store, stop_process_group
from click.testing import CliRunner

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pg_bin() -> str | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    if found:
        return os.path.dirname(found[-1])
    initdb = shutil.which("initdb")
    return os.path.dirname(initdb) if initdb else None


def _as_postgres(cmd: list[str]) -> list[str]:
    """``cmd`` as the ``postgres`` user when we are root (PostgreSQL refuses to run as root)."""
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        import shlex

        return ["su", "postgres", "-c", " ".join(shlex.quote(c) for c in cmd)]
    return cmd


@pytest.fixture(scope="module")
def postgres():
    """A private PostgreSQL cluster with a database ``mlflow``; yields its SQLAlchemy URI."""
    pg = _pg_bin()
    try:
        import psycopg  # noqa: F401 - MLflow's postgresql+psycopg driver
    except ImportError:
        psycopg = None
    if pg is None or psycopg is None:
        why = "PostgreSQL binaries (initdb)" if pg is None else "psycopg (pip install 'psycopg[binary]': the dev extras)"
        if os.environ.get("CI"):
            pytest.fail(f"{why} not found: CI must have them")
        pytest.skip(f"{why} not installed")
    import pathlib
    import tempfile

    # outside pytest's folder: the postgres user cannot enter root's private temporary folders
    root = pathlib.Path(tempfile.mkdtemp(prefix="llmeff_pg_"))
    data = root / "data"
    if os.geteuid() == 0:
        shutil.chown(root, "postgres")
    port = _free_port()

    def run(cmd: list[str], timeout: float = 120) -> None:
        r = subprocess.run(_as_postgres(cmd), capture_output=True, text=True, timeout=timeout)
        assert r.returncode == 0, f"{cmd[0]}: {(r.stdout + r.stderr)[-2000:]}"

    run([f"{pg}/initdb", "-D", str(data), "-A", "trust", "-U", "postgres", "--no-sync"])
    try:
        run([f"{pg}/pg_ctl", "-D", str(data), "-l", str(root / "log"), "-w", "-o",
             f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c fsync=off", "start"])
        run([f"{pg}/createdb", "-h", str(root), "-p", str(port), "-U", "postgres", "mlflow"], 60)
        yield f"postgresql+psycopg://postgres@127.0.0.1:{port}/mlflow"
    finally:
        subprocess.run(_as_postgres([f"{pg}/pg_ctl", "-D", str(data), "-m", "fast", "-w", "stop"]),
                       capture_output=True, timeout=120)
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def server(postgres, tmp_path_factory):
    """``mlflow server --app-name llmeff --workers 2`` over the PostgreSQL store; yields its URL."""
    root = tmp_path_factory.mktemp("pgserver")
    port = _free_port()
    log = open(root / "server.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--app-name", "llmeff", "--backend-store-uri",
                             postgres, "--default-artifact-root", str(root / "artifacts"), "--host", "127.0.0.1",
                             "--port", str(port), "--workers", "2"], cwd=root, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 240
    try:
        while True:
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.time() > deadline:
                pytest.fail(f"mlflow server did not start: {(root / 'server.log').read_text()[-3000:]}")
            time.sleep(1)
        yield url
    finally:
        stop_process_group(proc, wait_s=30)
        log.close()


@pytest.fixture(scope="module")
def both(server, tmp_path_factory):
    """The five standard runs in the PostgreSQL server and in a sqlite store: ``(server URL, experiment
    id there, sqlite URI, experiment id there)``."""
    import mlflow

    from five_runs import log_five_runs

    exp_pg, _ = log_five_runs(mlflow.MlflowClient(server), "five")
    sqlite = empty_store(tmp_path_factory.mktemp("pgsqlite") / "mlflow.db")
    exp_sq, _ = log_five_runs(mlflow.MlflowClient(sqlite), "five")
    return server, exp_pg, sqlite, exp_sq


def _compare(uri: str, out, monkeypatch, experiment: str = "five") -> tuple[str, list[dict]]:
    from mlflow_llmeff.cli import main

    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    r = CliRunner().invoke(main, ["compare", "--experiment", experiment, "--out", str(out)], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    rows = list(csv.DictReader(io.StringIO((out / "report.csv").read_text())))
    return r.output, [{k: v for k, v in row.items() if k not in ("run_id", "url")} for row in rows]


def test_compare_over_the_postgres_server_gives_the_sqlite_figures(both, tmp_path, monkeypatch):
    server, _, sqlite, _ = both
    out_pg, rows_pg = _compare(server, tmp_path / "pg", monkeypatch)
    out_sq, rows_sq = _compare(sqlite, tmp_path / "sq", monkeypatch)
    assert len(rows_pg) == 5 and rows_pg == rows_sq
    table = lambda out: [ln for ln in out.splitlines() if not ln.startswith("report: ")]  # noqa: E731
    assert table(out_pg) == table(out_sq)  # the headline table and scaling lines, to the character
    assert "47,500 [9,025, 85,975] floor" in out_pg  # a single run carries the between-run floor (docs/stability.md)


def _headline(page: str) -> str:
    table = page[page.index("<table id='headline'"):page.index("</table>", page.index("<table id='headline'"))]
    return re.sub(r"href='[^']*'", "href=''", table)  # run links carry each store's ids


def _pages(server: str, exp_pg: str, sqlite: str, exp_sq: str, tmp_path, monkeypatch) -> tuple[str, str]:
    """An experiment's page from the PostgreSQL server, and its sqlite copy's from the pages app in this process."""
    import tempfile

    import mlflow
    from flask import Flask

    from mlflow_llmeff.report import server as srv

    with urllib.request.urlopen(f"{server}/llmeff/experiments/{exp_pg}", timeout=120) as r:
        page_pg = r.read().decode()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(srv, "_store", lambda: mlflow.MlflowClient(sqlite))
    app = Flask("t")
    srv.register(app)
    return page_pg, app.test_client().get(f"/llmeff/experiments/{exp_sq}").get_data(as_text=True)


def test_the_page_of_the_postgres_server_shows_the_sqlite_figures(both, tmp_path, monkeypatch):
    page_pg, page_sq = _pages(*both, tmp_path, monkeypatch)
    assert "5 runs compared: every active run of the experiment" in page_pg
    assert _headline(page_pg) == _headline(page_sq)
    assert page_pg.count("<tr class='run'") == 5


@pytest.mark.parametrize("filter_string", ["", "tags.`llmeff.accelerator.count` = '2'",
                                           "metrics.`summary/tokens_per_sec` > 42000",
                                           "attributes.run_name LIKE 'llama-tiny-%-gbt1024%'"])
def test_the_sql_read_of_a_postgres_store_selects_what_search_runs_selects(postgres, both, tmp_path, filter_string):
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    from mlflow_llmeff.report.source import _read_by_sql, select_runs

    store = SqlAlchemyStore(postgres, str(tmp_path / "artifacts"))
    _, exp_pg, _, _ = both
    assert _read_by_sql(store, exp_pg, filter_string) is not None
    by_sql = select_runs(store, exp_pg, filter_string).runs

    from types import SimpleNamespace

    # the same store seen through search_runs only (no engine: MLflow's own search, page after page)
    searched = SimpleNamespace(get_experiment_by_name=store.get_experiment_by_name, get_experiment=store.get_experiment,
                               search_runs=store.search_runs)
    by_search = select_runs(searched, exp_pg, filter_string).runs
    from test_scale import _shown  # the search's records cut to the keys the SQL read takes (source.REPORT_*)

    assert by_sql == [_shown(r, filter_string) for r in by_search] and by_sql


# ------------------------------------------------------------------ a job trained against the server
@pytest.fixture(scope="module")
def trained(server, tmp_path_factory):
    """A 2-process ``llmeff train`` job logging to the PostgreSQL-backed server, rank 0 SIGKILLed after
    step 4 (checkpoint at 3), then the same command again, which resumes it: ``(outputs, the run)``."""
    import mlflow

    from mlflow_llmeff.train import faults

    tmp = tmp_path_factory.mktemp("pgtrain")
    cmd = [sys.executable, "-m", "mlflow_llmeff", "train", "--num-processes", "2", "--max-steps", "6",
           "--log-every-n-steps", "1", "--warmup-steps", "1", "--seq-len", "32", "--micro-batch-size", "2",
           "--measure-energy", "none", "--checkpoint-dir", str(tmp / "ck"), "--checkpoint-every", "3",
           "--experiment-name", "pgtrain"]
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_RUN_ID"}
    env.update(MLFLOW_TRACKING_URI=server, OMP_NUM_THREADS="1", **HEALTHY_SERVER_ENV)
    first = subprocess.run(cmd, cwd=tmp, env={**env, faults.ENV["kill_at_step"]: "4"}, capture_output=True,
                           text=True, timeout=600)
    second = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=600)
    client = mlflow.MlflowClient(server)
    runs = client.search_runs([client.get_experiment_by_name("pgtrain").experiment_id])
    return first, second, runs


def test_a_two_process_job_killed_and_resumed_on_the_postgres_server_is_one_run(server, trained, tmp_path, monkeypatch):
    """The job is one FINISHED run (2 attempts, 1 failure), every step's tokens once; copied into a
    sqlite store, it gives the same report row and the same page headline as on the server."""
    import mlflow
    from mlflow.entities import Metric, Param, RunTag

    from mlflow_llmeff import names

    first, second, runs = trained
    assert first.returncode != 0, first.stderr[-2000:]  # the kill
    assert second.returncode == 0, second.stderr[-3000:]
    assert len(runs) == 1, [r.info.run_name for r in runs]
    run = runs[0]
    m, t = run.data.metrics, run.data.tags
    assert run.info.status == "FINISHED" and t[names.ACCEL_COUNT] == "2" and t[names.PAR_STRATEGY] == "ddp"
    assert (m[names.SUM_ATTEMPTS], m[names.SUM_FAILURES]) == (2.0, 1.0)
    # 2 ranks x 2 sequences x 32 tokens = 128 tokens a step; steps 4-6 again after the resume from 3, once each
    history = sorted((p.step, p.value) for p in mlflow.MlflowClient(server).get_metric_history(
        run.info.run_id, names.TRAIN_TOKENS))
    assert history == [(s, 128.0 * s) for s in range(1, 7)]

    # the same run in a sqlite store: its latest values, tags and params
    sqlite = empty_store(tmp_path / "copy.db")
    sq = mlflow.MlflowClient(sqlite)
    exp = sq.create_experiment("pgtrain")
    copy = sq.create_run(exp, start_time=run.info.start_time, run_name=run.info.run_name).info.run_id
    tags = [RunTag(k, v) for k, v in t.items() if not k.startswith("mlflow.") or k == "mlflow.runName"]
    points = [Metric(k, v, run.info.start_time, 0) for k, v in m.items()]
    for i in range(0, max(len(points), len(tags)), 200):
        sq.log_batch(copy, metrics=points[i:i + 200], tags=tags[i:i + 200],
                     params=[Param(k, v) for k, v in run.data.params.items()] if i == 0 else [])
    sq.set_terminated(copy, "FINISHED", end_time=run.info.end_time)

    _, rows_pg = _compare(server, tmp_path / "pg", monkeypatch, "pgtrain")
    _, rows_sq = _compare(sqlite, tmp_path / "sq", monkeypatch, "pgtrain")
    assert len(rows_pg) == 1 and rows_pg == rows_sq

    pg_exp = mlflow.MlflowClient(server).get_experiment_by_name("pgtrain").experiment_id
    page_pg, page_sq = _pages(server, pg_exp, sqlite, exp, tmp_path, monkeypatch)
    assert re.search(r"\b1 runs? compared", page_pg), page_pg[:2000]
    assert _headline(page_pg) == _headline(page_sq)


def test_an_outbox_syncs_into_the_postgres_server_once(server, tmp_path, monkeypatch):
    """A run that never reached the server (its creation and points spilled to the outbox while it was
    down) is created by ``llmeff sync`` on the PostgreSQL-backed server with its original start time,
    every point once; the same outbox synced again (the id file gone) finds that run, makes no second."""
    import mlflow
    from mlflow.exceptions import MlflowException

    from mlflow_llmeff import names
    from mlflow_llmeff.cli import main
    from mlflow_llmeff.tracking.logger import RunLogger

    class Down:
        def __getattr__(self, name):
            def call(*a, **kw):
                raise MlflowException("Connection refused", error_code="TEMPORARILY_UNAVAILABLE")

            return call

    monkeypatch.setenv("MLFLOW_TRACKING_URI", server)
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    local = "local-" + "b" * 32
    spec = {"experiment_name": "pg-outbox", "experiment_id": None, "run_name": "tiny-late", "unique": False,
            "start_ms": 1_700_000_000_000, "tags": {"mlflow.user": "me"}}
    log = RunLogger(local, Down(), first=[{"create": spec}], send_interval_s=0.0, outbox_dir=str(tmp_path), wait_s=0.2)
    for step in (1, 2):
        log.log_metrics({names.TRAIN_TOKENS: 64.0 * step}, step)
    assert log.close("FINISHED") is False  # nothing delivered: all of it in the outbox
    spilled = (tmp_path / f"{local}.jsonl").read_text()

    def sync() -> None:
        r = CliRunner().invoke(main, ["sync", str(tmp_path)])
        assert r.exit_code == 0, r.output

    sync()
    client = mlflow.MlflowClient(server)
    exp = client.get_experiment_by_name("pg-outbox").experiment_id
    [run] = client.search_runs([exp])
    assert (run.info.run_name, run.info.start_time, run.info.status) == ("tiny-late", 1_700_000_000_000, "FINISHED")
    assert run.data.tags[names.OUTBOX_LOCAL_ID] == local
    (tmp_path / f"{local}.jsonl").write_text(spilled)  # delivered again (a copy of the outbox)
    (tmp_path / f"{local}.run_id").unlink(missing_ok=True)
    sync()
    [again] = client.search_runs([exp])
    assert again.info.run_id == run.info.run_id
    assert sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, names.TRAIN_TOKENS)) == \
        [(1, 64.0), (2, 128.0)]
