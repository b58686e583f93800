"""tracking/store.py: the store an MLflow project run's relative tracking URI names (project_store), the
folder ``mlflow run`` was started from (launcher_folder)."""

from __future__ import annotations

import os

import pytest

from conftest import empty_store
from mlflow_llmeff.tracking.store import StoreNotFound, launcher_folder, project_store


def _store_with_run(folder) -> str:
    """An sqlite store ``folder/mlflow.db`` holding one run; returns the run's id."""
    import mlflow

    client = mlflow.MlflowClient(empty_store(folder / "mlflow.db"))
    return client.create_run("0").info.run_id


def test_relative_sqlite_store_is_the_folder_whose_store_holds_the_run(tmp_path):
    user, project = tmp_path / "user", tmp_path / "project"
    user.mkdir(), project.mkdir()
    empty_store(project / "mlflow.db")  # the store a first, failed try left in the project's folder
    run_id = _store_with_run(user)
    got = project_store("sqlite:///mlflow.db", run_id, "0", folders=[str(project), str(user)])
    assert got == f"sqlite:///{user}/mlflow.db"


def test_relative_file_store_is_resolved_by_its_run_folder(tmp_path):
    (tmp_path / "b" / "mlruns" / "3" / "abc").mkdir(parents=True)
    (tmp_path / "a").mkdir()
    got = project_store("mlruns", "abc", "3", folders=[str(tmp_path / "a"), str(tmp_path / "b")])
    assert got == str(tmp_path / "b" / "mlruns")


def test_no_store_holding_the_run_is_one_line_naming_the_uri_and_the_stores_looked_at(tmp_path):
    with pytest.raises(StoreNotFound) as e:
        project_store("sqlite:///m.db", "missing", "0", folders=[str(tmp_path), "/srv/a"])
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith("MLFLOW_TRACKING_URI=sqlite:///m.db is a relative path")
    assert f"looked in: sqlite:///{tmp_path}/m.db, sqlite:////srv/a/m.db" in msg
    assert not (tmp_path / "m.db").exists()  # looked at, never created


@pytest.mark.parametrize("uri", ["sqlite:////srv/m.db", "http://127.0.0.1:5000", "databricks", "sqlite:///:memory:"])
def test_a_uri_that_names_the_same_store_from_every_folder_is_kept(uri):
    assert project_store(uri, "any", "0", folders=[]) == uri


def test_without_a_project_run_a_relative_store_is_this_folders(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert project_store("sqlite:///m.db", "", folders=[]) == f"sqlite:///{tmp_path}/m.db"


def test_launcher_folder_is_the_parent_process_folder_under_mlflow_run(tmp_path, monkeypatch):
    import subprocess
    import sys

    code = "from mlflow_llmeff.tracking.store import launcher_folder; print(launcher_folder())"
    # a child in another folder, as mlflow run starts an entry point in the project's folder
    env = {**os.environ, "MLFLOW_RUN_ID": "r"}
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, check=True)
    assert r.stdout.strip() == os.getcwd()
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    monkeypatch.chdir(tmp_path)
    assert launcher_folder() == str(tmp_path)
