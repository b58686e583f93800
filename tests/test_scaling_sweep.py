"""projects/scaling-sweep/sweep.py in this process: a store it cannot open, or a run no store holds, is one
line naming the URI. The launched sweep (its store, threads per process, the report's place) is tested
in tests/test_compare_server.py, whose one sweep is run as documented from a folder with a relative store."""

from __future__ import annotations

import runpy
import sys

import pytest

from conftest import REPO

SWEEP = REPO / "projects" / "scaling-sweep"


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
