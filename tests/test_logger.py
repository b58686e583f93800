import math

import mlflow

from mlflow_llmeff.tracking.logger import RunLogger, default_run_name


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def steps(client, run_id, key):
    return sorted(m.step for m in client.get_metric_history(run_id, key))


def test_metrics_are_buffered_then_sent_in_one_batch(tracking_uri):
    client = mlflow.MlflowClient()
    run_id = client.create_run("0").info.run_id
    clock = FakeClock()
    log = RunLogger(run_id, client, send_interval_s=5.0, clock=clock)
    log.log_metrics({"train/loss": 1.0}, 1)
    log.log_metrics({"train/loss": 0.9, "bad": math.nan}, 2)
    assert log._pending == [] and len(log._buffer) == 2  # nothing sent within the interval; NaN dropped
    clock.t = 5.0
    log.log_metrics({"train/loss": 0.8}, 3)
    assert log._buffer == [] and len(log._pending) == 1
    log.log_metrics({"train/loss": 0.7}, 4)
    log.close()
    assert steps(client, run_id, "train/loss") == [1, 2, 3, 4]
    assert "bad" not in client.get_run(run_id).data.metrics
    assert client.get_run(run_id).info.status == "FINISHED"


def test_resume_drops_points_already_logged_per_key(tracking_uri):
    client = mlflow.MlflowClient()
    run_id = client.create_run("0").info.run_id
    first = RunLogger(run_id, client)
    for s in (1, 2, 3):
        first.log_metrics({"a": s, "b": s}, s)
    first.log_metrics({"a": 4}, 4)
    first.flush()
    again = RunLogger(run_id, client, resume=True)
    for s in (3, 4, 5):  # replayed steps after a resume from step 2
        again.log_metrics({"a": 10 + s, "b": 10 + s}, s)
    again.close()
    assert steps(client, run_id, "a") == [1, 2, 3, 4, 5]
    assert steps(client, run_id, "b") == [1, 2, 3, 4, 5]
    assert [m.value for m in sorted(client.get_metric_history(run_id, "a"), key=lambda m: m.step)][3] == 4


def test_params_are_never_relogged_with_new_values(tracking_uri):
    client = mlflow.MlflowClient()
    run_id = client.create_run("0").info.run_id
    log = RunLogger(run_id, client)
    assert log.log_params({"max_steps": "40", "seed": "0"}) == {}
    changed = log.log_params({"max_steps": "80", "seed": "0", "new": "x"})
    assert changed == {"max_steps": ("40", "80")}
    assert client.get_run(run_id).data.params == {"max_steps": "40", "seed": "0", "new": "x"}


def test_logging_failure_warns_once_and_does_not_raise(tracking_uri, recwarn):
    client = mlflow.MlflowClient()
    log = RunLogger("0" * 32, client, send_interval_s=0.0)  # a run that does not exist
    log.set_tags({"x": "y"})
    log.log_metrics({"a": 1.0}, 1)
    log.close()
    assert len([w for w in recwarn if "MLflow logging failed" in str(w.message)]) == 1


def test_default_run_name():
    assert default_run_name("llama-7b", "H100-SXM", 8, "fsdp", "bf16") == "llama-7b-h100-sxm-8x-fsdp-bf16"
    assert default_run_name("/models/my-llama/", "cpu", 2, "ddp", "fp32") == "my-llama-cpu-2x-ddp-fp32"


def test_mlflow_projects_empty_string_param_is_not_a_change(tracking_uri):
    client = mlflow.MlflowClient()
    run_id = client.create_run("0").info.run_id
    client.log_param(run_id, "checkpoint_dir", "''")  # how `mlflow run` logs an empty default
    assert RunLogger(run_id, client).log_params({"checkpoint_dir": ""}) == {}
