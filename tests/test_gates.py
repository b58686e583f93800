"""The suite's own gates: a missing dependency skips locally and fails under CI (tests/conftest.py)."""

from __future__ import annotations

import pytest

from conftest import require, under_ci

MISSING = "llmeff_no_such_module_for_the_gate_test"


@pytest.mark.parametrize("value, expected", [("true", True), ("1", True), ("yes", True), ("", False), ("0", False),
                                             ("false", False), ("No", False)])
def test_ci_is_read_from_the_environment(monkeypatch, value, expected):
    monkeypatch.setenv("CI", value)
    assert under_ci() is expected


def test_a_missing_dependency_fails_under_ci(monkeypatch):
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match=f"{MISSING} is not installed .*: CI must install it"):
        require(MISSING, "pip install it")


def test_a_missing_dependency_skips_outside_ci(monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match=f"{MISSING} is not installed .*; pip install it"):
        require(MISSING, "pip install it")


def test_a_present_dependency_is_returned_under_ci(monkeypatch):
    import json

    monkeypatch.setenv("CI", "true")
    assert require("json") is json


def test_a_dependency_only_found_is_not_imported_and_a_missing_one_still_fails_or_skips(monkeypatch):
    import sys

    monkeypatch.delitem(sys.modules, "tomllib", raising=False)  # a stdlib module this test never imports
    monkeypatch.setenv("CI", "true")
    assert require("tomllib", load=False) is None and "tomllib" not in sys.modules
    with pytest.raises(pytest.fail.Exception, match=f"{MISSING} is not installed .*: CI must install it"):
        require(MISSING, load=False)
    monkeypatch.delenv("CI")
    with pytest.raises(pytest.skip.Exception, match=f"{MISSING} is not installed .*; pip install it"):
        require(MISSING, "pip install it", load=False)


@pytest.mark.slow
def test_a_bench_that_misses_its_target_exits_1_and_says_so(tmp_path):
    # the cheapest bench (one round of 2 steps per contender, ~15 s of CPU): no time inside our calls (0%)
    # cannot be met, and a ratio of 100 cannot be resolved (the noise floor is about 1)
    import os
    import pathlib
    import subprocess
    import sys

    repo = pathlib.Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, str(repo / "bench" / "overhead.py"), "--steps", "2", "--rounds", "1",
                        "--target", "100", "--inside-target", "0"], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}"})
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-2000:]
    assert "target NOT met: time inside our calls <= 0%: train_path " in r.stderr
    assert "; time inside our calls <= 0%: monitor " in r.stderr
    assert "median ratio bare_again/bare" in r.stdout and "(noise floor)" in r.stdout
    assert "(target >= 100: not resolvable in this run: the noise floor " in r.stdout


def test_every_serial_test_is_in_a_file_collected_last():
    """A serial test early in the session waits for whatever the other worker is in, minutes when it
    is test_strategies.py's launches (conftest's gate): serial tests live only in ``_LAST`` files."""
    import ast
    import pathlib

    from conftest import _LAST

    found = {}
    for path in sorted(pathlib.Path(__file__).parent.glob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and any(
                    ast.unparse(d).endswith("mark.serial") for d in node.decorator_list):
                found.setdefault(path.name, []).append(node.name)
    assert set(found) == set(_LAST), found  # each _LAST file holds serial tests, and no other file does
    assert len(found["test_timed_alone.py"]) == 1 and len(found["test_contention.py"]) == 3


def test_files_run_longest_first_and_the_serial_ones_last():
    """The two workers end together only if xdist hands out files longest first (conftest's measured
    table) and keeps that order: ``--no-loadscope-reorder`` (its default orders files by test count)."""
    import pathlib
    import tomllib

    from conftest import _FILE_SECONDS, _LAST, _UNMEASURED_S, schedule_key

    tests = pathlib.Path(__file__).parent
    assert set(_FILE_SECONDS) <= {p.name for p in tests.glob("test_*.py")}  # no stale name in the table
    assert len(_FILE_SECONDS) >= 50 and not set(_FILE_SECONDS) & set(_LAST)
    order = sorted([*_FILE_SECONDS, *_LAST, "test_not_measured_yet.py"], key=schedule_key)
    assert order[-len(_LAST):] == list(_LAST)
    seconds = [_FILE_SECONDS.get(name, _UNMEASURED_S) for name in order[:-len(_LAST)]]
    assert seconds == sorted(seconds, reverse=True)
    addopts = tomllib.loads((tests.parent / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["addopts"]
    assert "--dist loadfile" in addopts and "--no-loadscope-reorder" in addopts
