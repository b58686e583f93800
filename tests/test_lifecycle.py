"""Every ending gets its status, after the buffered points are flushed: scripts run as users run them."""

from __future__ import annotations

import os
import subprocess
import sys

import mlflow
import pytest

from mlflow_llmeff.monitor import lifecycle
from mlflow_llmeff import names

from conftest import HEALTHY_SERVER_ENV, REPO

SCRIPT = REPO / "tests" / "scripts" / "ending_loop.py"


@pytest.mark.parametrize("exc, status", [
    (None, "FINISHED"), (SystemExit(0), "FINISHED"), (SystemExit(), "FINISHED"), (SystemExit(2), "FAILED"),
    (SystemExit("usage: ..."), "FAILED"), (ValueError("x"), "FAILED"), (KeyboardInterrupt(), "KILLED")])
def test_status_for_each_ending(exc, status):
    assert lifecycle.status_for(exc) == status


def run(meter: str, end: str, uri: str) -> subprocess.CompletedProcess:
    # the store stays up: the product's wait, not the suite's 3 s (at load 11, one sqlite write took longer,
    # the run's end went to the outbox and the test read RUNNING for monitor-exit1)
    env = dict(os.environ, MLFLOW_TRACKING_URI=uri, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), **HEALTHY_SERVER_ENV)
    env.pop("MLFLOW_RUN_ID", None)
    return subprocess.run([sys.executable, str(SCRIPT), "--meter", meter, "--end", end], env=env,
                          capture_output=True, text=True, timeout=240, cwd=REPO)


@pytest.mark.slow
@pytest.mark.parametrize("meter, end, status, code", [
    ("autolog", "normal", "FINISHED", 0), ("autolog", "exit0", "FINISHED", 0), ("autolog", "exit1", "FAILED", 1),
    ("autolog", "raise", "FAILED", 1), ("autolog", "sigterm", "KILLED", 143), ("autolog", "sigint", "KILLED", 1),
    ("monitor", "sigterm", "KILLED", 143), ("monitor", "exit1", "FAILED", 1)])
def test_a_script_that_ends_any_way_leaves_a_run_with_its_status_end_time_and_points(tracking_uri, meter, end,
                                                                                   status, code):
    # The cases: a plain autolog loop killed by SIGTERM after step 6 left a RUNNING run with no
    # end time and no metrics; one that called sys.exit(1) ended FINISHED.
    r = run(meter, end, tracking_uri)
    assert r.returncode in (code, -2 if end == "sigint" else code), r.stderr[-2000:]
    client = mlflow.MlflowClient()
    runs = client.search_runs([e.experiment_id for e in mlflow.search_experiments()])
    assert len(runs) == 1
    got = runs[0]
    assert got.info.status == status and got.info.end_time is not None
    tokens = [(m.step, m.value) for m in client.get_metric_history(got.info.run_id, names.TRAIN_TOKENS)]
    assert tokens == [(4, 32.0), (6, 48.0)]  # the step-6 tail was flushed before the run ended
    assert got.data.metrics[names.SUM_STEPS] == 6.0 and names.SUM_WALL_S in got.data.metrics
