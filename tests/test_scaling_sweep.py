"""projects/scaling-sweep: one sweep (1 and 2 CPU processes, a few steps) launched the way README and
docs/compare.md say, ``mlflow run projects/scaling-sweep --env-manager local``, from a folder of the test's
with the relative store ``sqlite:///mlflow.db`` and no ``OMP_NUM_THREADS``; its tests read that one sweep.
The store resolved from the project's folder, the threads per process and the report's place were a
fresh-user trial's three faults."""

from __future__ import annotations

import os
import re
import runpy
import subprocess
import sys

import pytest

from conftest import REPO

SWEEP = REPO / "projects" / "scaling-sweep"


def _files_under(folder) -> set[str]:
    return {os.path.join(d, f) for d, _, files in os.walk(folder) for f in files if "__pycache__" not in d}


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """``(completed process, folder, client of its store, parent run, children, files under projects/ before)``."""
    import mlflow

    here = tmp_path_factory.mktemp("user")
    before = _files_under(REPO / "projects")
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_RUN_ID", "OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    env.update(MLFLOW_TRACKING_URI="sqlite:///mlflow.db", CODECARBON_LOG_LEVEL="error")
    r = subprocess.run([sys.executable, "-m", "mlflow", "run", str(SWEEP), "--env-manager", "local",
                        "-P", "process_counts=1,2", "-P", "max_steps=6", "-P", "warmup_steps=1",
                        "-P", "log_every_n_steps=2", "-P", "seq_len=64", "-P", "val_blocks=2"],
                       cwd=here, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    client = mlflow.MlflowClient(f"sqlite:///{here}/mlflow.db")
    parents = client.search_runs(["0"], "tags.`mlflow.runName` LIKE 'scaling-sweep-%'")
    assert len(parents) == 1, [p.info.run_name for p in parents]
    children = client.search_runs(["0"], f"tags.mlflow.parentRunId = '{parents[0].info.run_id}'")
    return r, here, client, parents[0], children, before


@pytest.mark.slow
def test_relative_sqlite_store_is_the_one_in_the_folder_it_was_run_from(sweep):
    r, here, client, parent, children, _ = sweep
    assert "Traceback" not in r.stderr
    assert parent.info.status == "FINISHED"
    assert sorted(int(c.data.tags["llmeff.accelerator.count"]) for c in children) == [1, 2]
    assert all(c.info.status == "FINISHED" for c in children)


@pytest.mark.slow
def test_every_process_ran_the_same_threads_and_the_efficiency_is_computed(sweep):
    from mlflow_llmeff.evals.threads import usable_cpus

    r, here, client, parent, children, _ = sweep
    threads = {int(c.data.tags["llmeff.accelerator.count"]): c.data.tags["llmeff.threads"] for c in children}
    expected = max(1, usable_cpus()[0] // 2)  # no OMP_NUM_THREADS: the usable CPUs over the largest count
    assert threads[1] == threads[2]
    assert threads[1].startswith(f"intra-op {expected}, inter-op ")
    assert f"scaling-sweep: {expected} intra-op thread(s) in every process of every child" in r.stdout
    by_n = {int(c.data.tags["llmeff.accelerator.count"]): c.data.metrics["summary/tokens_per_sec"] for c in children}
    m = re.search(r"\(2 devices\) vs baseline .* \(1\): weak scaling efficiency ([0-9.e+-]+) ", r.stdout)
    assert m, r.stdout[-3000:]
    assert float(m.group(1)) == float(f"{by_n[2] / (by_n[1] * 2):.3g}")
    # logged: the parent's report holds the same figure
    report = client.download_artifacts(parent.info.run_id, "scaling-report/report.md", str(here / "dl"))
    text = open(report).read()
    assert "## Scaling efficiency" in text and m.group(1) in text.split("## Scaling efficiency")[1]


@pytest.mark.slow
def test_report_is_written_where_it_was_run_from_and_nothing_under_projects(sweep):
    r, here, client, parent, children, before = sweep
    assert {"report.md", "report.csv", "report.html"} <= {p.name for p in (here / "scaling-report").iterdir()}
    assert f"scaling-sweep: report in {here / 'scaling-report'}" in r.stdout
    assert _files_under(REPO / "projects") == before


def test_run_missing_from_its_store_is_one_line_naming_the_store(tmp_path, monkeypatch):
    from conftest import _restore_tracking_uri, empty_store

    uri = empty_store(tmp_path / "mlflow.db")
    restore = _restore_tracking_uri()
    for var, value in (("MLFLOW_TRACKING_URI", uri), ("MLFLOW_RUN_ID", "f" * 32), ("OMP_NUM_THREADS", "1"),
                       ("MKL_NUM_THREADS", "1")):
        monkeypatch.setenv(var, value)
    monkeypatch.setattr(sys, "argv", ["sweep.py", "--process-counts", "1"])
    try:
        with pytest.raises(SystemExit) as e:
            runpy.run_path(str(SWEEP / "sweep.py"), run_name="__main__")
    finally:
        restore()
    assert str(e.value) == f"scaling-sweep: cannot open run {'f' * 32} in tracking store {uri}: Run with id={'f' * 32} not found"


def test_relative_store_without_the_run_is_one_line_naming_the_uri(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///mlflow.db")
    monkeypatch.setenv("MLFLOW_RUN_ID", "f" * 32)
    monkeypatch.setattr(sys, "argv", ["sweep.py", "--process-counts", "1"])
    with pytest.raises(SystemExit) as e:
        runpy.run_path(str(SWEEP / "sweep.py"), run_name="__main__")
    assert str(e.value).startswith("scaling-sweep: MLFLOW_TRACKING_URI=sqlite:///mlflow.db is a relative path and no "
                                   f"store it names from the folders that started this run holds run {'f' * 32}")
    assert not (tmp_path / "mlflow.db").exists()
