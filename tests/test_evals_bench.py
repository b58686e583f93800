"""bench/evals.py --hogs: each side's slowdown from its own quiet rounds, the check that ours is no
larger than lm-eval's, and hog processes that end when the rounds do."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

BENCH = pathlib.Path(__file__).resolve().parents[1] / "bench" / "evals.py"


@pytest.fixture(scope="module")
def ev():
    spec = importlib.util.spec_from_file_location("bench_evals_hogs", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_slowdown_is_the_median_of_loaded_over_the_median_of_quiet_rounds(ev):
    assert ev.slowdowns([10.0, 12.0, 11.0], [22.0, 40.0, 33.0]) == 3.0
    with pytest.raises(ValueError, match="at least one round"):
        ev.slowdowns([], [1.0])


def test_a_slowdown_above_lm_evals_is_named(ev):
    rows = [("hellaswag", 32000, 1.6, 2.7), ("hellaswag", 259, 3.1, 2.9), ("mmlu", None, 2.0, 2.0)]
    assert ev.slower_than_theirs(rows) == ["hellaswag vocab 259: ours 3.10x > lm-eval 2.90x"]


def test_hogs_run_inside_the_block_and_are_ended_after(ev):
    with ev.Hogs(2) as hogs:
        procs = list(hogs.procs)
        assert len(procs) == 2 and all(p.poll() is None for p in procs)
    assert all(p.returncode is not None for p in procs) and hogs.procs == []
