"""One training run three ways (autolog, explicit monitor, llmeff train): the same keys, except the
documented ones a user's loop hides (HIDDEN_FROM_AUTOLOG / HIDDEN_FROM_MONITOR, docs/autolog.md)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import mlflow
import pytest

from mlflow_llmeff import names
from mlflow_llmeff.autologging import HIDDEN_FROM_AUTOLOG, HIDDEN_FROM_MONITOR

from conftest import REPO

SCRIPT = REPO / "tests" / "scripts" / "tiny_user_loop.py"


def keys_of(run) -> tuple[set[str], set[str], set[str]]:
    """(metric keys, llmeff.* tag keys, param keys) of a run."""
    tags = {k for k in run.data.tags if k.startswith("llmeff.")}
    return set(run.data.metrics), tags, set(run.data.params)


def without(keys: set[str], hidden: dict) -> set[str]:
    return {k for k in keys if not any(k == h or (h.endswith("/") and k.startswith(h)) for h in hidden)}


@pytest.mark.slow
def test_one_loop_three_ways_gives_the_same_keys(tracking_uri):
    from mlflow_llmeff.train.config import TrainConfig
    from mlflow_llmeff.train.loop import run_training

    env = dict(os.environ, MLFLOW_TRACKING_URI=tracking_uri, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    env.pop("MLFLOW_RUN_ID", None)
    for mode in ("autolog", "monitor"):
        r = subprocess.run([sys.executable, str(SCRIPT), "--mode", mode], env=env, capture_output=True, text=True,
                           timeout=300, cwd=REPO)
        assert r.returncode == 0, r.stderr[-3000:]
    run_training(TrainConfig(max_steps=6, seq_len=32, micro_batch_size=4, log_every_n_steps=3, warmup_steps=1,
                             eval_every=3))
    runs = mlflow.MlflowClient().search_runs(["0"], order_by=["attributes.start_time ASC"])
    by = {r.data.tags[names.AUTOLOG_INTEGRATION]: r for r in runs}
    assert set(by) == {"pytorch", "monitor", "train"}
    train_m, train_t, train_p = keys_of(by["train"])
    # the host CPU share is measured only over 100 CPU ticks or more, which a 6-step run reaches on some
    # paths and not others: present or absent-with-its-reason is checked per run below, not across paths
    measured_by_ticks = {names.SUM_HOST_OTHER_CPU, names.SUM_HOST_STEAL}
    # the rest of the memory peak: absent, and said why, where the process's peak reading predates the model state
    # (the in-process train path reads a pytest worker's peak; the subprocesses their own)
    measured_by_ticks.add(names.SUM_MEM_OTHER_GIB)
    train_m -= measured_by_ticks
    assert len(train_m) >= 35 and len(train_t) >= 50 and len(train_p) == len(TrainConfig.field_names())
    for way, hidden in (("monitor", HIDDEN_FROM_MONITOR), ("pytorch", HIDDEN_FROM_AUTOLOG)):
        m, t, p = keys_of(by[way])
        m -= measured_by_ticks
        assert m == without(train_m, hidden), (way, m ^ without(train_m, hidden))
        assert t == without(train_t, hidden), (way, t ^ without(train_t, hidden))
        assert p == set() and "params" in hidden
    # the figures the first release's autolog lacked are there on every path
    for key in (names.CARBON_ESTIMATE_KG, names.SUM_MFU_MEASURED_PEAK, names.SUM_GOODPUT, names.SUM_BADPUT["eval"],
                names.SUM_ESTIMATE_KG_CO2E):
        # MFU against the measured peak is left out where the run went faster than the peak measured on a
        # busy machine (monitor/account.py above_measured_peak), and says so
        assert all(key in r.data.metrics or (key == names.SUM_MFU_MEASURED_PEAK and f"{key}: the run's steady "
                                             in r.data.tags[names.SUMMARY_ABSENT]) for r in by.values()), key
    # how sure each figure is, from the same meter on every path (5 steady steps: too few for an interval)
    for r in by.values():
        assert names.SUM_STEP_TIME_P50_S in r.data.metrics
        assert r.data.tags[names.STABILITY].startswith("unstable: only 5 steady steps (fewer than 10: no interval)")
        assert (names.SUM_MEM_OTHER_GIB in r.data.metrics
                or f"{names.SUM_MEM_OTHER_GIB}: the peak (" in r.data.tags[names.SUMMARY_ABSENT]), r.data.tags
        # the host share: measured over 100 CPU ticks or more, else absent and said why (meters/contention.py)
        if names.SUM_HOST_OTHER_CPU in r.data.metrics:
            assert r.data.tags[names.CONTENTION].startswith(("quiet: ", "contended: "))
        else:
            assert r.data.tags[names.CONTENTION].startswith("unknown: host CPU share not measured: ")
            assert (f"{names.SUM_HOST_OTHER_CPU}, {names.SUM_HOST_STEAL}: "
                    in r.data.tags[names.SUMMARY_ABSENT]), r.data.tags[names.SUMMARY_ABSENT]
    assert by["pytorch"].data.metrics[names.SUM_BADPUT["eval"]] > 0  # its no_grad eval was timed as eval
    assert by["monitor"].data.metrics[names.TRAIN_TOKENS] == by["train"].data.metrics[names.TRAIN_TOKENS] == 6 * 4 * 32


def test_the_hidden_keys_are_listed_in_the_docs():
    doc = (REPO / "docs" / "autolog.md").read_text()
    for key in HIDDEN_FROM_AUTOLOG:
        assert re.search(rf"`{re.escape(key)}`", doc), key
