"""MLPerf-style result logs: written with mlperf-logging's MLLogger from a run's figures, on the run's own
timeline (run stop - run start = the time to the target), and passed by mlperf-logging's compliance checker
(the rules every MLPerf Training 6.0.0 benchmark shares); a log missing a required key fails it."""

from __future__ import annotations

import json

import pytest

from conftest import require
from mlflow_llmeff import names
from mlflow_llmeff.tracking import mllog

require("mlperf_logging", "pip install mlperf-logging (a dependency of mlflow_llmeff)")

#: A seed that reached its target at step 20: job start 1,000,000 ms, 12.5 s of set-up, 2.25 s to the target.
REACHED = mllog.RunFacts(seed=3, global_batch_size=8, seq_len=64, grad_accum=1, job_start_ms=1_000_000, init_s=12.5,
                         wall_s=15.0, evals=((10, 1_013_400, 4.78), (20, 1_014_740, 4.34), (20, 1_014_900, 4.34)),
                         target_s=2.25, steps=20, platform="1xAMD EPYC 7B13", precision="fp32",
                         params={"max_steps": 30, "opt_base_learning_rate": 0.001, "opt_name": "adamw",
                                 "train_samples": 6920, "eval_samples": 8}, reached_step=20)


def lines(path) -> list[dict]:
    return [json.loads(s.split(":::MLLOG ", 1)[1]) for s in open(path, encoding="utf-8") if ":::MLLOG" in s]


def test_a_reached_targets_log_passes_the_compliance_checker(tmp_path):
    path = mllog.write_log(REACHED, str(tmp_path / "result_3.txt"))
    got = lines(path)
    by_key = {g["key"]: g for g in got}
    # the run's timeline: init 12.5 s, run_stop - run_start = the 2.25 s to the target (the MLPerf result)
    assert (by_key["init_start"]["time_ms"], by_key["init_stop"]["time_ms"]) == (1_000_000, 1_012_500)
    assert by_key["run_start"]["time_ms"] == 1_012_500 and by_key["run_stop"]["time_ms"] == 1_014_750
    assert by_key["run_stop"]["metadata"]["status"] == "success"
    # step x 8 sequences; the eval that reached the target last (a final eval after it, at step 20 again, is not
    # the run's: its clock stopped), its time capped at run_stop
    assert [(g["value"], g["metadata"]["samples_count"], g["time_ms"]) for g in got if g["key"] == "eval_accuracy"] == [
        (4.78, 80, 1_013_400), (4.34, 160, 1_014_740)]
    assert (by_key["submission_benchmark"]["value"], by_key["submission_division"]["value"],
            by_key["submission_status"]["value"], by_key["cache_clear"]["value"]) == ("llama31_8b", "open", "research",
                                                                                     False)
    res = mllog.check_log(path)
    assert res.ok, res.output
    assert "INFO - SUCCESS" in res.output


def test_a_seed_that_never_reached_it_is_an_aborted_run_that_passes_too(tmp_path):
    import dataclasses

    aborted = dataclasses.replace(REACHED, target_s=None, steps=30, reached_step=None,
                                  evals=REACHED.evals[:2] + ((30, 1_014_950, 4.30),))
    path = mllog.write_log(aborted, str(tmp_path / "result_2.txt"))
    stop = [g for g in lines(path) if g["key"] == "run_stop"][0]
    # it stopped at its cap: job start + 15.0 s of wall, 30 steps x 8 sequences
    assert (stop["time_ms"], stop["metadata"]) == (1_015_000, {**stop["metadata"], "status": "aborted",
                                                                "samples_count": 240})
    assert mllog.check_log(path).ok


def test_a_log_without_its_run_stop_fails_the_checker(tmp_path):
    path = mllog.write_log(REACHED, str(tmp_path / "result_3.txt"))
    kept = [s for s in open(path, encoding="utf-8") if '"key": "run_stop"' not in s]
    broken = tmp_path / "broken.txt"
    broken.write_text("".join(kept), encoding="utf-8")
    res = mllog.check_log(str(broken))
    assert not res.ok and "Required EXACTLY_ONE occurrence of 'run_stop' but found 0" in res.output


def test_the_shared_rules_are_the_packages_without_the_benchmarks_own_file(tmp_path):
    import yaml

    path = mllog.generic_rules(where=str(tmp_path))
    text = open(path, encoding="utf-8").read()
    assert "enqueue_config" not in text
    keys = {r["KEY"]["NAME"] for r in yaml.safe_load(text) if "KEY" in r}
    assert {"submission_benchmark", "submission_division", "init_start", "run_stop", "eval_accuracy", "train_samples",
            "eval_samples", "cache_clear"} <= keys
    with pytest.raises(ValueError, match=r"^ruleset '0.0.1' is not accepted: mlperf-logging has no "):
        mllog.generic_rules("0.0.1", where=str(tmp_path))


def test_a_log_that_cannot_be_made_is_tagged_why_and_the_study_prints_no_fetch_command(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the relative store below resolves here
    class Client:  # a store whose run cannot be read: the log is not written, the tag says why
        tags = {}

        def get_run(self, run_id):
            raise RuntimeError(f"run {run_id} not found")

        def log_batch(self, run_id, metrics=(), params=(), tags=(), synchronous=True):  # the writer's one call
            self.tags.update({t.key: t.value for t in tags})

    client = Client()
    what, artifact = mllog.log_result(client, "r1", "val_loss", "val_loss_le_4.35")
    assert what == "not written: RuntimeError: run r1 not found" and artifact is None
    assert client.tags == {names.MLLOG: what}
    assert mllog.fetch_hint("sqlite:///study.db", "r1", artifact) == ""
    # the command names the study's store (without it, MLflow's default store has no such run), by its
    # absolute path (a trial's relative sqlite:///mlflow.db worked only from the study's folder) ...
    assert mllog.fetch_hint("sqlite:///study.db", "r1", "mllog/result_3.txt") == (
        f" (an artifact of the run, not a local file: MLFLOW_TRACKING_URI=sqlite:///{tmp_path}/study.db mlflow "
        "artifacts download --run-id r1 --artifact-path mllog/result_3.txt --dst-path .)")
    # ... but never its credential
    assert mllog.fetch_hint("postgresql://alice:s3cret@db:5432/mlflow", "r1", "mllog/result_3.txt") == (
        " (an artifact of the run, not a local file: MLFLOW_TRACKING_URI=<this store's URI: not printed, it holds a "
        "credential> mlflow artifacts download --run-id r1 --artifact-path mllog/result_3.txt --dst-path .)")
