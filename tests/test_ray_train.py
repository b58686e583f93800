"""Ray Train for real (CPU, gloo): ``mlflow_llmeff.autolog()`` inside ``train_loop_per_worker`` gives one
MLflow run per Ray Train run (2 workers, and 1 worker, where Ray never destroys the process group), and a
worker killed mid-run under ``FailureConfig(max_failures=1)`` continues that run as a second attempt from
Ray's checkpoint (autologging/ray.py); ``llmeff train`` as the worker function (train/ray.py) gives the
entrypoint's run from Ray, and a restart before its first checkpoint continues that run. One local Ray
(``ray.init(num_cpus=2)``) for the module: starting it costs about 15 s here; each fit without the two
helper actors of Ray Train that no test here uses (:func:`without_unused_helpers`)."""

from __future__ import annotations

import os

import mlflow
import pytest

from mlflow_llmeff import names

from conftest import REPO, require
from ray_workers import killed_once, train_loop

pytestmark = pytest.mark.slow

require("ray", "pip install 'mlflow-llmeff[ray]'", load=False)  # imported by the tests and the cluster
TOKENS_PER_STEP = 2 * 8 + 2 * 9  # rank 0: 2 rows of 8 tokens, rank 1: 2 rows of 9


#: What of Ray this module needs none of, off unless the environment says otherwise: the preemption
#: watcher actor Ray Train starts with every worker group (7 here: 5 fits and 2 restarts; each a Python
#: process importing Ray, about 1.5-2 s of CPU), the idle workers raylet prestarts at ``ray.init`` (one per
#: CPU, never used: Ray Train's actors carry a runtime environment of their own), Ray Train's metrics
#: export, and the log monitor's listing of the session's log folder every 0.1 s (it lists it every 0.5 s
#: once a node has that many log files, here 0; ``log_to_driver=False``: none of its lines reach us).
#: Ray's health-check poll stays at its default (2 s), as a user's.
RAY_QUIET = {"RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0", "RAY_prestart_worker_first_driver": "0",
             "RAY_TRAIN_METRICS_ENABLED": "0", "RAY_LOG_MONITOR_MANY_FILES_THRESHOLD": "0"}


@pytest.fixture(scope="module")
def cluster(module_store, tmp_path_factory):
    """A local Ray of 2 CPUs whose workers log to the module's store and import tests/ray_workers.py."""
    import ray

    saved = {k: os.environ.get(k) for k in ("MLFLOW_TRACKING_URI", "PYTHONPATH", "OMP_NUM_THREADS", *RAY_QUIET)}
    os.environ.update(MLFLOW_TRACKING_URI=module_store, OMP_NUM_THREADS="1",
                      PYTHONPATH=os.pathsep.join([str(REPO / "tests"), saved["PYTHONPATH"] or ""]).rstrip(os.pathsep))
    for k, v in RAY_QUIET.items():
        os.environ.setdefault(k, v)
    mlflow.set_tracking_uri(module_store)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield tmp_path_factory.mktemp("ray")
    finally:
        ray.shutdown()
        mlflow.set_tracking_uri(None)
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


def without_unused_helpers(trainer):
    """``trainer`` without the two default callbacks of Ray Train whose actors no test here uses: the
    ``DatasetsCallback`` (a ``DatasetManager`` actor at each attempt, for ``datasets=``, which no test passes)
    and the ``PlacementGroupCleanerCallback`` (a detached actor at each fit that removes the placement group
    if the controller dies ungracefully, which no test makes it do). Each is a Python process importing Ray
    Train, about 2 s of CPU. Ray 2.60 has no public switch for them: this wraps the trainer's private
    ``_create_default_callbacks``, and fails (AttributeError, or the assertion naming what Ray gave) when Ray
    no longer has it or no longer makes exactly one of each."""
    from ray.train.v2._internal.callbacks.datasets import DatasetsCallback
    from ray.train.v2._internal.callbacks.placement_group_callback import PlacementGroupCleanerCallback

    defaults = trainer._create_default_callbacks

    def create():
        callbacks = defaults()
        unused = [c for c in callbacks if isinstance(c, (DatasetsCallback, PlacementGroupCleanerCallback))]
        assert sorted(type(c).__name__ for c in unused) == ["DatasetsCallback", "PlacementGroupCleanerCallback"], \
            f"Ray Train's default callbacks changed: {[type(c).__name__ for c in callbacks]}"
        return [c for c in callbacks if c not in unused]

    trainer._create_default_callbacks = create
    return trainer


def test_leaving_out_the_unused_helpers_fails_when_rays_default_callbacks_change():
    from types import SimpleNamespace

    from ray.train.v2._internal.callbacks.datasets import DatasetsCallback
    from ray.train.v2._internal.callbacks.placement_group_callback import PlacementGroupCleanerCallback

    datasets, cleaner = object.__new__(DatasetsCallback), object.__new__(PlacementGroupCleanerCallback)
    kept = object()
    trainer = without_unused_helpers(SimpleNamespace(_create_default_callbacks=lambda: [kept, cleaner, datasets]))
    assert trainer._create_default_callbacks() == [kept]
    with pytest.raises(AssertionError, match=r"Ray Train's default callbacks changed: \['object'\]"):
        without_unused_helpers(SimpleNamespace(_create_default_callbacks=lambda: [kept]))._create_default_callbacks()
    with pytest.raises(AttributeError, match="_create_default_callbacks"):
        without_unused_helpers(SimpleNamespace())


def fit(storage, name: str, steps: int, kill: bool, max_failures: int = 0, workers: int = 2):
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    without_unused_helpers(TorchTrainer(
        train_loop, train_loop_config={"steps": steps, "kill": kill}, scaling_config=ScalingConfig(num_workers=workers),
        run_config=RunConfig(name=name, storage_path=str(storage),
                             failure_config=FailureConfig(max_failures=max_failures)))).fit()
    return runs_named(name)


def runs_named(name: str):
    """The MLflow runs of the Ray Train run ``name`` (``llmeff.scheduler.job_id``: Ray's run name)."""
    return mlflow.search_runs(search_all_experiments=True, output_format="list",
                              filter_string=f"tags.`{names.SCHEDULER_JOB_ID}` = '{name}'")


def test_two_ray_workers_with_autolog_give_one_finished_run_with_both_workers_tokens_once(cluster):
    before = len(mlflow.search_runs(search_all_experiments=True, output_format="list"))
    runs = fit(cluster, "two-workers", steps=4, kill=False)
    assert len(runs) == 1 and len(mlflow.search_runs(search_all_experiments=True, output_format="list")) == before + 1
    run = runs[0]
    assert run.info.status == "FINISHED"
    assert run.data.metrics[names.TRAIN_TOKENS] == run.data.metrics[names.SUM_TOKENS] == 4 * TOKENS_PER_STEP == 136
    assert {k: run.data.tags.get(k) for k in (names.SCHEDULER_NAME, names.SCHEDULER_WORLD_SIZE, names.RESUME_ATTEMPTS)} \
        == {names.SCHEDULER_NAME: "ray", names.SCHEDULER_WORLD_SIZE: "2", names.RESUME_ATTEMPTS: "1"}


def test_a_worker_killed_mid_run_continues_the_same_run_as_a_second_attempt_with_its_down_time(cluster):
    runs = fit(cluster, "killed", steps=6, kill=True, max_failures=1)
    assert len(runs) == 1
    run = runs[0]
    m = run.data.metrics
    assert run.info.status == "FINISHED" and run.data.tags[names.RESUME_ATTEMPTS] == "2"
    # steps 1-2 of the first attempt (its checkpoint) and steps 3-6 of the second: each counted once
    assert m[names.SUM_STEPS] == 6 and m[names.SUM_TOKENS] == m[names.TRAIN_TOKENS] == 6 * TOKENS_PER_STEP == 204
    assert m["summary/badput_down_s"] > 0  # from the killed attempt's last heartbeat to autolog() in the new workers
    assert m["summary/badput_lost_progress_s"] > 0  # its step 3, after the checkpoint, is redone
    history = mlflow.MlflowClient().get_metric_history(run.info.run_id, names.TRAIN_TOKENS)
    assert max(p.value for p in history if p.step == 6) == 204


def test_one_ray_worker_with_autolog_ends_its_run_when_the_worker_function_returns(cluster):
    # one worker: Ray never calls destroy_process_group, and kills the worker's process (no atexit)
    runs = fit(cluster, "one-worker", steps=3, kill=False, workers=1)
    assert len(runs) == 1
    run = runs[0]
    assert run.info.status == "FINISHED" and run.info.end_time is not None
    assert run.data.metrics[names.SUM_TOKENS] == run.data.metrics[names.TRAIN_TOKENS] == 3 * 2 * 8 == 48
    assert run.data.tags[names.SCHEDULER_WORLD_SIZE] == "1"


# ---------------------------------------------------------------- llmeff train as Ray Train's worker function
def tiny(**kw):
    """llama-tiny on synthetic blocks: 2 sequences of 32 tokens a step on each worker."""
    from mlflow_llmeff.train.config import TrainConfig

    return TrainConfig(model="llama-tiny", dataset="synthetic", seq_len=32, micro_batch_size=2, log_every_n_steps=1,
                       warmup_steps=1, measure_energy="none", **kw)


def test_llmeff_train_as_the_worker_function_of_two_ray_workers_gives_the_entrypoints_run(cluster):
    from ray.train import RunConfig, ScalingConfig

    from mlflow_llmeff.train.ray import trainer

    result = without_unused_helpers(trainer(tiny(max_steps=4, checkpoint_every=2), ScalingConfig(num_workers=2),
                                            RunConfig(name="llmeff-train", storage_path=str(cluster)))).fit()
    runs = runs_named("llmeff-train")
    assert len(runs) == 1
    run = runs[0]
    m, tags = run.data.metrics, run.data.tags
    assert run.info.status == "FINISHED"
    assert m[names.TRAIN_TOKENS] == m[names.SUM_TOKENS] == 4 * 2 * 2 * 32 == 512  # steps x workers x rows x tokens
    assert m[names.SUM_STEPS] == 4
    assert {k: tags.get(k) for k in (names.SCHEDULER_NAME, names.SCHEDULER_WORLD_SIZE, names.PAR_STRATEGY)} \
        == {names.SCHEDULER_NAME: "ray", names.SCHEDULER_WORLD_SIZE: "2", names.PAR_STRATEGY: "ddp"}
    assert run.data.params["num_processes"] == "2"
    # llmeff train's checkpoints are Ray's: the last one reported, in Ray's run folder, not copied
    assert result.checkpoint.path == str(cluster / "llmeff-train" / "llmeff" / "step_00000004")


def test_a_restart_before_the_first_checkpoint_continues_the_same_run(cluster):
    import dataclasses

    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    without_unused_helpers(TorchTrainer(
        killed_once, train_loop_config={"settings": dataclasses.asdict(tiny(max_steps=3)),
                                        "marker": str(cluster / "killed-once"), "kill_at": 2},
        scaling_config=ScalingConfig(num_workers=1),
        run_config=RunConfig(name="restart-early", storage_path=str(cluster),
                             failure_config=FailureConfig(max_failures=1)))).fit()
    runs = runs_named("restart-early")
    assert len(runs) == 1
    run = runs[0]
    assert run.info.status == "FINISHED"
    assert run.data.metrics[names.SUM_ATTEMPTS] == 2 and run.data.tags[names.RESUME_ATTEMPTS] == "2"
    assert run.data.metrics[names.SUM_STEPS] == 3


def test_one_workers_run_ends_when_the_thread_running_its_function_ends_and_two_workers_are_left_to_ray():
    import threading

    from mlflow_llmeff.autologging.ray import finish_when_returned

    ended, started, go = [], [], threading.Event()

    def worker_function():  # Ray runs train_loop_per_worker in a thread of its own
        started.append(finish_when_returned(ended.append, world_size=1))
        go.wait(5)
        assert ended == []  # not before it returns

    t = threading.Thread(target=worker_function)
    t.start()
    go.set()
    t.join()
    for _ in range(500):
        if ended:
            break
        threading.Event().wait(0.01)
    assert started == [True] and ended == ["FINISHED"]  # outside Ray V2's runner no error is known
    assert finish_when_returned(ended.append, world_size=2) is False  # Ray's destroy_process_group ends it
    assert finish_when_returned(ended.append, world_size=1) is False  # a main thread is no Ray worker's


@pytest.mark.parametrize("raises, status", [(False, "FINISHED"), (True, "FAILED")])
def test_under_rays_thread_runner_one_workers_run_is_ended_before_ray_can_see_its_function_return(monkeypatch, raises,
                                                                                                  status):
    # Ray's controller kills a worker's process as soon as its poll sees the function's thread end: the run
    # must be ended by then, however long ending it takes (here 0.3 s)
    import threading

    from ray.train.v2._internal.execution.worker_group.thread_runner import ThreadRunner

    from mlflow_llmeff.autologging import ray as ray_train

    runner, ended, armed = ThreadRunner(), [], []
    monkeypatch.setattr(ray_train, "_thread_runner", lambda: runner)

    def slow_finish(s):
        threading.Event().wait(0.3)
        ended.append(s)

    def train_loop_per_worker():
        armed.append(ray_train.finish_when_returned(slow_finish, world_size=1))
        if raises:
            raise RuntimeError("the worker function failed")

    runner.run(train_loop_per_worker)
    while runner.is_running():  # what Ray's controller polls before it kills the process
        threading.Event().wait(0.005)
    assert armed == [True] and ended == [status]
    assert (runner.get_error() is not None) is raises


# ---------------------------------------------------------------- train/ray.py's layout and restore, by hand
@pytest.mark.parametrize("world, local, node, expected", [
    (2, 2, 0, (2, 1, 0, "")),  # one node: no machine address needed
    (4, 2, 1, (2, 2, 1, "10.0.0.1")),  # two nodes of two: node rank 1, machine 0's address from Ray
    (3, 2, 1, (3, 1, 0, "")),  # placed unevenly: one node of 3 (the product Accelerate checks)
])
def test_a_worker_takes_rays_layout(world, local, node, expected):
    from mlflow_llmeff.train.config import TrainConfig
    from mlflow_llmeff.train.ray import settings_for_worker

    cfg = settings_for_worker(TrainConfig(), world=world, local_world=local, node_rank=node, master_addr="10.0.0.1",
                              ray_folder="/ray/run")
    assert (cfg.num_processes, cfg.num_machines, cfg.machine_rank, cfg.main_process_ip) == expected


def test_the_checkpoint_folder_is_the_given_one_else_in_rays_run_folder_else_none():
    from mlflow_llmeff.train.config import TrainConfig
    from mlflow_llmeff.train.ray import settings_for_worker

    def folder(given, ray_folder):
        return settings_for_worker(TrainConfig(checkpoint_dir=given), world=1, local_world=1, node_rank=0,
                                   master_addr="", ray_folder=ray_folder).checkpoint_dir

    assert folder("", "/ray/run") == os.path.join("/ray/run", "llmeff")
    assert folder("/shared/ck", "/ray/run") == "/shared/ck"
    assert folder("", None) == ""  # Ray stores elsewhere (s3://): no checkpoint unless checkpoint_dir says where


def test_a_layout_given_against_rays_is_refused_in_one_line():
    from mlflow_llmeff.train.config import TrainConfig
    from mlflow_llmeff.train.ray import settings_for_worker

    with pytest.raises(ValueError, match=r"num_processes=4 contradicts Ray's layout \(2 workers: num_processes=2"):
        settings_for_worker(TrainConfig(num_processes=4), world=2, local_world=2, node_rank=0, master_addr="",
                            ray_folder=None)


def test_rays_restored_checkpoint_is_copied_in_only_when_the_folder_lacks_it(tmp_path):
    import json

    from mlflow_llmeff.train import checkpoint as ckpt
    from ray.train import Checkpoint

    from mlflow_llmeff.train.ray import _restore

    source = tmp_path / "ray" / "checkpoint_000001"
    source.mkdir(parents=True)
    (source / ckpt.STATE_FILE).write_text(json.dumps({"step": 4}))
    (source / "model.safetensors").write_text("weights")
    folder = tmp_path / "ck"
    _restore(Checkpoint.from_directory(str(source)), str(folder))
    assert ckpt.complete_checkpoints(str(folder)) == [(4, ckpt.step_dir(str(folder), 4))]
    assert (folder / "step_00000004" / "model.safetensors").read_text() == "weights"
    (source / ckpt.STATE_FILE).write_text(json.dumps({"step": 2}))  # older than the folder's newest: kept out
    _restore(Checkpoint.from_directory(str(source)), str(folder))
    assert [s for s, _ in ckpt.complete_checkpoints(str(folder))] == [4]
