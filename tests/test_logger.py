import math
import os
import sys
import threading

import mlflow
import pytest
from mlflow.entities import Metric
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE

from mlflow_llmeff import names
from mlflow_llmeff.evals.targets import parse_targets
from mlflow_llmeff.tracking import keys, worker
from mlflow_llmeff.tracking.logger import NullLogger, RunLogger, default_run_name
from mlflow_llmeff.testing import FakeClock


def steps(client, run_id, key):
    return sorted(m.step for m in client.get_metric_history(run_id, key))


def test_metrics_are_buffered_then_sent_in_one_batch(tracking_uri):
    client = RecordingClient()
    run_id = new_run(client)
    clock = FakeClock()
    log = RunLogger(run_id, client, send_interval_s=5.0, clock=clock)
    log.log_metrics({"train/loss": 1.0}, 1)
    log.log_metrics({"train/loss": 0.9, "train/learning_rate": 1e-3}, 2)
    assert len(log._buffer) == 3 and log.flush(send=False) and client.calls == []  # nothing sent within the interval
    clock.t = 5.0
    log.log_metrics({"train/loss": 0.8}, 3)
    assert log._buffer == [] and log.flush(send=False)
    assert client.calls == [(4, 0, 0, True)]  # one batch
    log.log_metrics({"train/loss": 0.7}, 4)
    log.close()
    assert steps(client, run_id, "train/loss") == [1, 2, 3, 4]
    assert steps(client, run_id, "train/learning_rate") == [2]
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
    assert default_run_name("llama-tiny", "cpu", 1, "single", "fp32", seq_len=128,
                            global_batch_tokens=4096) == "llama-tiny-cpu-1x-single-fp32-s128-gbt4096"


def test_runs_of_one_experiment_get_distinct_names(tracking_uri):
    import mlflow

    from mlflow_llmeff.tracking.runs import open_run

    client = mlflow.MlflowClient()
    got = []
    for _ in range(3):  # e.g. a default run, then an eval run of the same configuration, twice
        handle = open_run(client, run_id=None, run_name="llama-tiny-cpu-1x-single-fp32-s128-gbt1024",
                          unique_name=True)
        got.append(client.get_run(handle.run_id).info.run_name)
        mlflow.end_run()
    assert got == ["llama-tiny-cpu-1x-single-fp32-s128-gbt1024", "llama-tiny-cpu-1x-single-fp32-s128-gbt1024-2",
                   "llama-tiny-cpu-1x-single-fp32-s128-gbt1024-3"]


def test_mlflow_projects_empty_string_param_is_not_a_change(tracking_uri):
    client = mlflow.MlflowClient()
    run_id = client.create_run("0").info.run_id
    client.log_param(run_id, "checkpoint_dir", "''")  # how `mlflow run` logs an empty default
    assert RunLogger(run_id, client).log_params({"checkpoint_dir": ""}) == {}


# --------------------------------------------------------------------------- nothing lost to one bad entry
class RecordingClient:
    """A real MlflowClient that records each log_batch call and rejects batches holding a poisoned key.

    A rejected synchronous call raises what an MLflow store raises for a bad entry
    (INVALID_PARAMETER_VALUE); a rejected asynchronous call returns an operation whose ``wait``
    raises the generic wrapper MLflow's ``RunOperations.wait`` raises.
    """

    def __init__(self, poison=(), reject_multi=False):
        self._client = mlflow.MlflowClient()
        self.poison = set(poison)
        self.reject_multi = reject_multi
        self.calls = []  # (number of metrics, params, tags, synchronous)

    def __getattr__(self, name):
        return getattr(self._client, name)

    def log_batch(self, run_id, metrics=(), params=(), tags=(), synchronous=True):
        entries = [*metrics, *params, *tags]
        self.calls.append((len(metrics), len(params), len(tags), synchronous))
        bad = [e.key for e in entries if e.key in self.poison]
        if bad and (self.reject_multi and len(entries) > 1 or len(entries) == 1):
            error = MlflowException(f"Invalid value {bad[0]!r} for parameter 'key'", error_code=INVALID_PARAMETER_VALUE)
        elif bad:
            error = MlflowException(f"batch rejected because of {bad[0]!r}", error_code=INVALID_PARAMETER_VALUE)
        else:
            return self._client.log_batch(run_id, metrics=metrics, params=params, tags=tags, synchronous=synchronous)
        if synchronous:
            raise error
        return FailedOperation(error)


class FailedOperation:
    def __init__(self, error):
        self.error = error

    def wait(self):
        raise MlflowException(f"The following failures occurred while performing one or more async logging operations: [{self.error!r}]")


def new_run(client=None):
    return (client or mlflow.MlflowClient()).create_run("0").info.run_id


def warnings_tag(run_id):
    return mlflow.MlflowClient().get_run(run_id).data.tags.get(names.LOGGING_WARNINGS)


def test_case_a_plus_signed_target_keys_land_with_the_summary(tracking_uri):
    target = parse_targets("val_loss<=+9.5")[0]
    assert (target.threshold, target.key) == (9.5, "val_loss_le_9.5")
    run_id = new_run()
    log = RunLogger(run_id)
    ttq = {key: float(i) for i, key in enumerate(target.metric_keys().values())}
    summary = {names.SUM_MFU: 0.41, names.SUM_TOKENS: 1_000_000.0, names.SUM_WALL_S: 123.5, names.SUM_GOODPUT: 0.9}
    log.log_metrics({**ttq, **summary}, 40)
    log.close()
    logged = mlflow.MlflowClient().get_run(run_id).data.metrics
    assert logged == {**ttq, **summary}
    assert ttq["ttq/val_loss_le_9.5_wall_s"] == 0.0 and warnings_tag(run_id) is None


def test_a_metric_key_mlflow_refuses_is_renamed_and_the_rest_logged(tracking_uri):
    run_id = new_run()
    log = RunLogger(run_id)
    log.log_metrics({"ttq/val_loss_le_+9.5_wall_s": 12.0, "mfu(%)": 41.0, names.SUM_MFU: 0.41}, 7)
    log.close()
    assert mlflow.MlflowClient().get_run(run_id).data.metrics == {
        "ttq/val_loss_le_plus_9.5_wall_s": 12.0, "mfu_pct": 41.0, names.SUM_MFU: 0.41}
    assert warnings_tag(run_id) == ("metric 'ttq/val_loss_le_+9.5_wall_s' renamed to 'ttq/val_loss_le_plus_9.5_wall_s'; "
                                    "metric 'mfu(%)' renamed to 'mfu_pct'")


def test_case_b_a_bad_user_tag_key_does_not_cost_the_condition_tags(tracking_uri):
    run_id = new_run()
    tags = {d.key: f"value {i}" for i, d in enumerate(names.TAGS[:60])}
    RunLogger(run_id).set_tags({**tags, "team@lab": "nlp", "cost(%)": "12"})
    logged = mlflow.MlflowClient().get_run(run_id).data.tags
    assert all(logged[k] == v for k, v in tags.items()) and len(tags) == 60
    assert (logged["team_at_lab"], logged["cost_pct"]) == ("nlp", "12")
    assert logged[names.LOGGING_WARNINGS] == "tag 'team@lab' renamed to 'team_at_lab'; tag 'cost(%)' renamed to 'cost_pct'"


def test_a_metric_with_a_string_value_is_dropped_and_named(tracking_uri):
    run_id = new_run()
    log = RunLogger(run_id)
    log.log_metrics({"train/loss": 2.5, "eval/note": "diverged", "train/tokens": 4096}, 3)
    log.close()
    assert mlflow.MlflowClient().get_run(run_id).data.metrics == {"train/loss": 2.5, "train/tokens": 4096.0}
    assert warnings_tag(run_id) == "metric 'eval/note' dropped: value of type str is not a real number"


def test_nan_and_inf_losses_are_logged(tracking_uri):
    client = mlflow.MlflowClient()
    run_id = new_run()
    log = RunLogger(run_id, client)
    for step, loss in enumerate([2.0, math.nan, math.inf, -math.inf], start=1):
        log.log_metrics({"train/loss": loss}, step)
    log.close()
    values = [m.value for m in sorted(client.get_metric_history(run_id, "train/loss"), key=lambda m: m.step)]
    # SQL stores keep NaN and write +/-inf as the largest double (SqlAlchemyStore.sanitize_metric_value)
    assert values[0] == 2.0 and math.isnan(values[1])
    assert values[2:] == [sys.float_info.max, -sys.float_info.max]
    assert warnings_tag(run_id) is None


def test_a_rejected_sync_batch_is_retried_entry_by_entry(tracking_uri):
    client = RecordingClient(poison={"llmeff.poisoned"}, reject_multi=True)
    run_id = new_run(client)
    tags = {f"user.tag{i}": str(i) for i in range(7)} | {"llmeff.poisoned": "x"}
    RunLogger(run_id, client).set_tags(tags)
    logged = mlflow.MlflowClient().get_run(run_id).data.tags
    assert {k: logged.get(k) for k in tags} == {**{f"user.tag{i}": str(i) for i in range(7)}, "llmeff.poisoned": None}
    assert logged[names.LOGGING_WARNINGS] == ("tag 'llmeff.poisoned' rejected by MLflow (MlflowException: "
                                              "Invalid value 'llmeff.poisoned' for parameter 'key')")


def test_a_rejected_metric_batch_is_sent_again_in_halves(tracking_uri):
    client = RecordingClient(poison={"train/poisoned"})
    run_id = new_run(client)
    log = RunLogger(run_id, client, send_interval_s=0.0)
    log.log_metrics({"train/loss": 1.5, "train/poisoned": 1.0, "train/tokens": 512}, 1)
    log.close()
    assert mlflow.MlflowClient().get_run(run_id).data.metrics == {"train/loss": 1.5, "train/tokens": 512.0}
    assert "metric 'train/poisoned' at step 1 rejected by MLflow" in warnings_tag(run_id)
    assert client.calls[:3] == [(3, 0, 0, True), (1, 0, 0, True), (2, 0, 0, True)]  # the batch, then its halves


def test_the_real_store_rejecting_a_key_loses_only_that_key(tracking_uri, monkeypatch):
    # "bad@key" passes local validation here, so only the sqlite store sees it and rejects it
    accepted = keys.key_accepted
    monkeypatch.setattr(keys, "key_accepted", lambda k: k == "bad@key" or accepted(k))
    keys._checked_key.cache_clear()
    client = mlflow.MlflowClient()
    run_id = new_run(client)
    log = RunLogger(run_id, client)
    log.log_metrics({f"m{i}": float(i) for i in range(9)} | {"bad@key": 1.0}, 2)
    log.close()
    keys._checked_key.cache_clear()
    assert client.get_run(run_id).data.metrics == {f"m{i}": float(i) for i in range(9)}
    assert warnings_tag(run_id).startswith("metric 'bad@key' at step 2 rejected by MLflow (MlflowException: Invalid value")


def test_a_tag_value_over_8000_characters_is_shortened(tracking_uri):
    run_id = new_run()
    RunLogger(run_id).set_tags({"notes": "n" * 9000, "short": "s"})
    logged = mlflow.MlflowClient().get_run(run_id).data.tags
    assert (logged["notes"], logged["short"]) == ("n" * 8000, "s")
    assert logged[names.LOGGING_WARNINGS] == "tag 'notes' value shortened from 9000 to 8000 characters"


def test_params_over_100_in_one_call_all_land_in_batches_of_100(tracking_uri):
    client = RecordingClient()
    run_id = new_run(client)
    params = {f"p{i:03d}": str(i) for i in range(250)}
    assert RunLogger(run_id, client).log_params(params) == {}
    assert mlflow.MlflowClient().get_run(run_id).data.params == params
    assert [c[1] for c in client.calls] == [100, 100, 50]


def test_tags_over_100_in_one_call_are_sent_in_batches_of_100(tracking_uri):
    client = RecordingClient()
    run_id = new_run(client)
    tags = {f"t{i:03d}": str(i) for i in range(201)}
    RunLogger(run_id, client).set_tags(tags)
    assert [c[2] for c in client.calls] == [100, 100, 1]
    logged = mlflow.MlflowClient().get_run(run_id).data.tags
    assert {k: logged[k] for k in tags} == tags


def test_every_call_is_made_by_the_delivery_thread(tracking_uri):
    client = RecordingClient()
    run_id = new_run(client)
    threads = []
    real = client.log_batch

    def log_batch(*a, **kw):
        threads.append(threading.current_thread())
        return real(*a, **kw)

    client.log_batch = log_batch
    log = RunLogger(run_id, client, send_interval_s=0.0)
    log.set_tags({"user.note": "x"})
    log.log_metrics({"train/loss": 1.0}, 1)
    log.close()
    assert len(threads) == 2 and all(t.name == "llmeff-delivery" for t in threads)  # the tag, then the metric
    assert steps(client, run_id, "train/loss") == [1]


class CountingClient:
    """A client whose log_batch only counts the metric points it is given (no store: usable in a forked child)."""

    def __init__(self):
        self.points = 0

    def log_batch(self, run_id, metrics=(), params=(), tags=(), synchronous=True):
        self.points += len(metrics)


def delivery_starts(monkeypatch):
    """The delivery threads started from now on (a list the patched Thread.start fills)."""
    started = []
    real = threading.Thread.start

    def start(self):
        if self.name == "llmeff-delivery":
            started.append(self)
        return real(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    return started


def test_logged_steps_start_one_delivery_thread_not_one_each(tracking_uri, monkeypatch):
    # issue 53: the thread exited whenever its queue was empty, so each logged step started a new one on the
    # training thread; it now waits on the empty queue (IDLE_S) and a step only appends a job
    monkeypatch.setattr(worker, "IDLE_S", 3600.0)
    started = delivery_starts(monkeypatch)
    client = RecordingClient()
    run_id = new_run(client)
    log = RunLogger(run_id, client, send_interval_s=0.0)
    for step in range(1, 21):
        log.log_metrics({"train/loss": 1.0 / step}, step)
        assert log.flush(send=False)  # delivered: the queue is empty again before the next step
    assert len(started) == 1 and started[0].is_alive()  # idle, not gone
    assert log.close()
    started[0].join(30)  # a hang guard only: a successful close wakes it to exit at once
    assert not started[0].is_alive() and len(started) == 1
    assert steps(client, run_id, "train/loss") == list(range(1, 21))
    assert client.calls == [(1, 0, 0, True)] * 20  # one batch per logged step (the end is set_terminated)


def test_an_idle_delivery_thread_exits_and_the_next_job_starts_another(monkeypatch):
    monkeypatch.setattr(worker, "IDLE_S", 0.05)
    started = delivery_starts(monkeypatch)
    client = CountingClient()
    log = RunLogger("r" * 32, client, send_interval_s=0.0)
    log.log_metrics({"train/loss": 1.0}, 1)
    assert log.flush(send=False)
    started[0].join(30)  # exits IDLE_S after its last job (30 s: a hang guard only)
    assert not started[0].is_alive() and log._courier is None
    log.log_metrics({"train/loss": 0.5}, 2)
    assert log.flush(send=False)
    assert len(started) == 2 and client.points == 2


@pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork is POSIX only")
def test_a_forked_child_delivers_with_its_own_thread(monkeypatch):
    # the parent's idle thread is not in the child (only the forking thread survives a fork)
    monkeypatch.setattr(worker, "IDLE_S", 3600.0)
    client = CountingClient()
    log = RunLogger("r" * 32, client, send_interval_s=0.0)
    log.log_metrics({"train/loss": 1.0}, 1)
    assert log.flush(send=False) and log._courier.is_alive()
    pid = os.fork()
    if pid == 0:  # the child: exit code 0 only when its own thread delivered its point
        code = 1
        try:
            log.log_metrics({"train/loss": 0.5}, 2)
            code = 0 if log.flush(send=False) and client.points == 2 else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert client.points == 1 and log.close(status=None)


def test_last_point_after_resume_is_the_newest_point_per_key(tracking_uri):
    client = mlflow.MlflowClient()
    run_id = new_run(client)
    client.log_batch(run_id, metrics=[Metric("energy/total_kwh", 0.5, 1_000, 1), Metric("energy/total_kwh", 1.25, 2_000, 4),
                                      Metric("energy/total_kwh", 0.75, 3_000, 2), Metric("cost/total_usd", 3.0, 2_500, 4)])
    log = RunLogger(run_id, client, resume=True)
    assert log.last_point("energy/total_kwh") == (4, 1.25, 2_000)
    assert log.last_point("cost/total_usd") == (4, 3.0, 2_500)
    assert log.last_point("train/loss") is None
    # the newest of the keys' latest points: MLflow keeps each key's latest by step, so a point of an earlier step
    # logged later (step 2 at 3.0 s here, a replay; the product logs in step order) is not read
    assert (log.last_logged_step("energy/total_kwh"), log.last_timestamp_s) == (4, 2.5)


def test_resume_reads_one_runs_get_and_no_metric_history(tracking_uri):
    # issue 52: resuming read every key's whole history, 13 s at 5,000 points on each of 20 keys
    client = mlflow.MlflowClient()
    run_id = new_run(client)
    keys = [f"k/{i}" for i in range(20)]
    client.log_batch(run_id, metrics=[Metric(k, float(s), 1_000 * s, s) for k in keys for s in range(1, 51)])
    calls = []

    class Counting:
        def __getattr__(self, name):
            calls.append(name)
            return getattr(client, name)

    log = RunLogger(run_id, Counting(), resume=True)
    assert "get_metric_history" not in calls and calls.count("get_run") == 1
    assert all(log.last_point(k) == (50, 50.0, 50_000) for k in keys) and log.last_timestamp_s == 50.0


def test_a_renamed_key_is_deduplicated_on_resume_under_its_mlflow_key(tracking_uri):
    client = mlflow.MlflowClient()
    run_id = new_run(client)
    first = RunLogger(run_id, client)
    first.log_metrics({"mfu(%)": 40.0}, 1)
    first.log_metrics({"mfu(%)": 41.0}, 2)
    first.flush()
    again = RunLogger(run_id, client, resume=True)
    assert again.last_point("mfu_pct")[:2] == (2, 41.0)
    again.log_metrics({"mfu(%)": 99.0}, 2)  # replayed step
    again.log_metrics({"mfu(%)": 42.0}, 3)
    again.close()
    assert [(m.step, m.value) for m in sorted(client.get_metric_history(run_id, "mfu_pct"), key=lambda m: m.step)] == [
        (1, 40.0), (2, 41.0), (3, 42.0)]


def test_the_warnings_tag_stays_under_8000_characters_and_says_what_was_left_out(tracking_uri):
    run_id = new_run()
    log = RunLogger(run_id)
    log.log_metrics({f"note{i:03d}": "text" for i in range(300)}, 1)
    log.close()
    text = warnings_tag(run_id)
    shown = text.split("; ")
    assert len(text) <= 8000 and text == log.warnings_text()
    assert shown[0] == "metric 'note000' dropped: value of type str is not a real number"
    assert shown[-1] == f"{300 - (len(shown) - 1)} more not listed (see the training log)"


def test_null_logger_has_the_same_methods_as_no_ops():
    null = NullLogger()
    null.set_synchronous(True)
    null.flush()
    assert (null.last_point("train/loss"), null.last_logged_step("train/loss"), null.last_timestamp_s) == (None, -1, None)


@pytest.mark.parametrize("status", ["FINISHED", "FAILED"])
def test_close_sets_the_status_after_flushing(tracking_uri, status):
    client = mlflow.MlflowClient()
    run_id = new_run(client)
    log = RunLogger(run_id, client)
    log.log_metrics({"train/loss": 1.0}, 1)
    log.close(status)
    assert (client.get_run(run_id).info.status, steps(client, run_id, "train/loss")) == (status, [1])


@pytest.mark.parametrize("logged, given, same", [
    ("'my run'", "my run", True),  # MLflow Projects logs -P run_name='my run' shell-quoted
    ("''", "", True), ('""', "", True),
    ("'val_loss<=1.9,hellaswag/acc_norm>=0.30'", "val_loss<=1.9,hellaswag/acc_norm>=0.30", True),
    ("llama-tiny", "llama-tiny", True),
    ("'my run'", "my other run", False), ("it's", "it's", True), ("a b", "a", False),
])
def test_params_compare_through_mlflow_projects_shell_quoting(logged, given, same):
    from mlflow_llmeff.tracking.logger import _same_param

    assert (_same_param(logged) == _same_param(given)) is same


def test_a_local_file_is_delivered_as_an_artifact_in_order_and_from_the_outbox(tracking_uri, tmp_path):
    from mlflow_llmeff.tracking import outbox

    client = mlflow.MlflowClient()
    run_id = new_run(client)
    snap = tmp_path / "oom_snapshot.pickle"
    snap.write_bytes(b"\x80\x04snapshot")
    log = RunLogger(run_id, client)
    log.log_file(str(snap), "memory")
    log.close()
    got = client.download_artifacts(run_id, "memory/oom_snapshot.pickle", str(tmp_path / "got"))
    assert open(got, "rb").read() == b"\x80\x04snapshot"
    # spilled while the server did not answer: the outbox record delivers it later (llmeff sync)
    other = new_run(client)
    box = tmp_path / "box"
    outbox.write_outbox(str(box / f"{other}.jsonl"), other, [{"file": {"path": str(snap), "artifact_path": "memory"}}])
    outbox.deliver_outbox(str(box), client)
    assert [f.path for f in client.list_artifacts(other, "memory")] == ["memory/oom_snapshot.pickle"]


def test_points_become_the_metric_entities_of_the_training_thread_on_the_delivery_thread(tracking_uri, monkeypatch):
    # issue 53: log_metrics buffers (key, value, timestamp ms, step); the delivery thread builds the Metric entities the
    # training thread built before: the same key, value, timestamp and step on the server, none built by the caller
    import types

    import mlflow.entities

    from mlflow_llmeff.tracking import logger as logger_module

    built = []

    class Seen(Metric):
        def __init__(self, *args, **kwargs):
            built.append(threading.current_thread().name)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(mlflow.entities, "Metric", Seen)
    monkeypatch.setattr(logger_module, "time", types.SimpleNamespace(time=lambda: 1_700_000_000.5))
    client = mlflow.MlflowClient()
    run_id = new_run(client)
    log = RunLogger(run_id, client, send_interval_s=0.0, clock=FakeClock())
    log.log_metrics({"train/loss": 2.5, "train/tokens": 4096}, 5)  # keys checked (the slow path), an int value
    log.log_metrics({"train/loss": 2.25, "train/tokens": 8192}, 10)  # keys checked before (the fast path)
    assert log._buffer == [] and log.flush(send=False)
    assert built == ["llmeff-delivery"] * 4
    history = {k: [(m.step, m.value, m.timestamp) for m in client.get_metric_history(run_id, k)]
               for k in ("train/loss", "train/tokens")}
    assert history == {"train/loss": [(5, 2.5, 1_700_000_000_500), (10, 2.25, 1_700_000_000_500)],
                       "train/tokens": [(5, 4096.0, 1_700_000_000_500), (10, 8192.0, 1_700_000_000_500)]}
    # a point spilled before the delivery thread took it is the outbox record of its Metric entity
    assert worker._Job(1, "batch", [("train/loss", 2.5, 17, 5)]).records() == [{"m": ["train/loss", 2.5, 17, 5]}]
    log.close()
