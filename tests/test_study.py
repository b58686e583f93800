"""llmeff study: the round-robin order and the parent/child wiring (an injected runner), bad input as one
line, comparisons that leave the study's parent out and take its children as repeats (hand-computed
t-interval), each child in a process of its own (the command, the attempt's start it is handed, its one-line
error), and one real study of 2 configurations x 2 repeats of the tiniest runs."""

from __future__ import annotations

import re

import math

import mlflow
import pytest
from click.testing import CliRunner

from mlflow_llmeff import names
from mlflow_llmeff.cli import main
from mlflow_llmeff.train.config import TrainConfig
from mlflow_llmeff.train.study import PARENT_TAG, Outcome, StudyConfig, check, run_study, schedule, summary_lines
from conftest import START_TICK_S, use_store

#: How long after the end of ``summary/wall_s`` its point may be stamped: the clock stops, the summary is
#: built, then its points are made (20-37 ms measured: tests/test_timed_alone.py; 0.35 s seen with a whole
#: suite running beside it). The fault it guards against, a clock started at the child's imports instead of
#: the start handed over, is several seconds (a child's set-up, summary/badput_init_s, 6.45 s measured:
#: docs/stability.md), so 1 s still catches it.
STAMP_LAG_S = 1.0

TINY = "--model llama-tiny --dataset synthetic --max-steps 4 --seq-len 32 --warmup-steps 1 --log-every-n-steps 2 " \
       "--measure-energy none --val-fraction 0"


@pytest.fixture
def tracking_uri(module_store, monkeypatch):
    """One sqlite store for the module (a new MLflow database costs about a second); each test has
    its own experiment."""
    yield from use_store(module_store, monkeypatch)


class FakeRunner:
    """Records the order it is called in and the tags it is given; returns fake run ids."""

    def __init__(self, fail=()):
        self.calls, self.fail = [], set(fail)

    def __call__(self, child, tags):
        self.calls.append((child.config, child.repeat, dict(tags), child.cfg))
        n = len(self.calls)
        if (child.config, child.repeat) in self.fail:
            return Outcome(f"fake-{n}", 1, "diverged at step 3")
        return Outcome(f"fake-{n}")


def configs(*options):
    return [StudyConfig(o, TrainConfig(**kw)) for o, kw in options]


def test_children_run_round_robin_as_children_of_one_parent(tracking_uri, tmp_path):
    fake = FakeRunner()
    res = run_study(configs(("A", {"seq_len": 32, "checkpoint_dir": str(tmp_path / "a")}), ("B", {"seq_len": 64})),
                    3, experiment="study-fake", runner=fake, echo=lambda line: None)
    # A1 B1 A2 B2 A3 B3: every configuration's repeat i before any repeat i+1
    assert [(c, r) for c, r, _, _ in fake.calls] == [(1, 1), (2, 1), (1, 2), (2, 2), (1, 3), (2, 3)]
    assert [t for _, _, t, _ in fake.calls][:2] == [
        {PARENT_TAG: res.parent_run_id, names.STUDY_CONFIG: "1", names.STUDY_REPEAT: "1"},
        {PARENT_TAG: res.parent_run_id, names.STUDY_CONFIG: "2", names.STUDY_REPEAT: "1"}]
    assert [o.run_id for _, o in res.children] == [f"fake-{i}" for i in range(1, 7)]
    # each repeat has its own checkpoint folder: a repeat never resumes another's finished run
    assert [cfg.checkpoint_dir for c, _, _, cfg in fake.calls if c == 1] == [
        str(tmp_path / "a" / f"repeat-{i}") for i in (1, 2, 3)]
    assert {cfg.experiment_name for *_, cfg in fake.calls} == {"study-fake"}
    parent = mlflow.MlflowClient().get_run(res.parent_run_id)
    assert parent.data.tags[names.STUDY] == "2 configurations x 3 repeats, round-robin"
    assert parent.data.params == {"repeats": "3", "config_1": "A", "config_2": "B"}
    assert (parent.info.status, parent.info.run_name) == ("FINISHED", "study-2x3")
    assert mlflow.get_experiment(parent.info.experiment_id).name == "study-fake"


def test_cpu_configurations_of_different_process_counts_run_with_the_same_threads(tracking_uri, monkeypatch):
    # a trial's study of 1 and 2 processes on CPU: Accelerate gave each DDP process 1 thread, the single run kept 2,
    # and compare refused the scaling (llmeff.threads differ)
    import os

    from mlflow_llmeff.evals import threads as threads_mod

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv("MKL_NUM_THREADS", "7")
    monkeypatch.setattr(threads_mod, "usable_cpus", lambda *a, **k: (4, "affinity 4 of 4"))
    seen, lines = [], []
    fake = FakeRunner()

    def runner(child, tags):
        seen.append((child.cfg.num_processes, os.environ.get("OMP_NUM_THREADS"), os.environ.get("MKL_NUM_THREADS")))
        return fake(child, tags)

    run_study(configs(("1", {"num_processes": 1}), ("2", {"num_processes": 2})), 1, experiment="study-threads",
              runner=runner, echo=lines.append)
    assert seen == [(1, "2", "2"), (2, "2", "2")]  # 4 usable CPUs over the largest count, 2 processes
    assert ("llmeff study: 2 intra-op thread(s) in every process of every run (affinity 4 of 4 over 2 processes), "
            "so runs of different process counts compare (llmeff.threads)") in lines
    assert "OMP_NUM_THREADS" not in os.environ and os.environ["MKL_NUM_THREADS"] == "7"  # the study's own, back
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # the user's count wins
    seen.clear()
    run_study(configs(("1", {"num_processes": 1}), ("2", {"num_processes": 2})), 1, experiment="study-threads",
              runner=runner, echo=lines.append)
    assert seen == [(1, "3", "3"), (2, "3", "3")]
    seen.clear()  # one process count: nothing pinned
    run_study(configs(("a", {"seq_len": 32}), ("b", {"seq_len": 64})), 1, experiment="study-threads", runner=runner,
              echo=lines.append)
    assert seen == [(1, "3", "7"), (1, "3", "7")]
    monkeypatch.setenv("OMP_NUM_THREADS", "two")
    with pytest.raises(ValueError, match=r"^OMP_NUM_THREADS='two' is not accepted; give a thread count >= 1$"):
        run_study(configs(("1", {"num_processes": 1}), ("2", {"num_processes": 2})), 1, experiment="study-threads",
                  runner=runner, echo=lines.append)


def test_a_server_lost_mid_study_names_where_the_parents_end_waits_in_the_one_line(tracking_uri, monkeypatch):
    # the fresh-user trial: the server stopped answering after the first child; the Error: line named the second
    # child's run alone, while the parent's end (KILLED) waited in the outbox too
    from mlflow_llmeff.tracking import delivery
    from mlflow_llmeff.train import study

    class LostAfterOne(FakeRunner):
        def __call__(self, child, tags):
            if self.calls:
                raise delivery.Unreachable("the tracking server X did not answer creating the run; configuration 1 "
                                           "repeat 2 was not trained: its run waits in /o/local-2.jsonl")
            return super().__call__(child, tags)

    ends = []

    def end_spilled(parent, status, **kw):  # the server did not take the parent's end: it waits in the outbox
        ends.append((status, kw))
        parent.spilled_to = "/o/parent.jsonl"
        return False

    monkeypatch.setattr(study, "_end_run", end_spilled)
    with pytest.raises(delivery.Unreachable) as e:
        run_study(configs(("A", {})), 2, experiment="study-lost", runner=LostAfterOne(), echo=lambda line: None)
    [(status, kw)] = ends
    assert (status, kw) == ("KILLED", {"error": "stopped after 1 of 2 runs"})
    line = str(e.value)
    assert line.startswith("the tracking server X did not answer creating the run; configuration 1 repeat 2 was not "
                           "trained: its run waits in /o/local-2.jsonl; the study stopped after 1 of 2 runs and its "
                           "parent run ") and "\n" not in line
    assert re.search(r"parent run [0-9a-f]{32} \(KILLED\) waits in /o/parent\.jsonl \(llmeff sync .+ when it answers\)$",
                     line), line


def test_a_failed_child_is_named_on_the_parent_and_the_study_goes_on(tracking_uri):
    fake = FakeRunner(fail={(1, 1)})
    res = run_study(configs(("A", {}), ("B", {"seq_len": 64})), 2, experiment="study-fail", runner=fake,
                    echo=lambda line: None)
    assert len(fake.calls) == 4 and [c for c, _ in res.failed] == [res.children[0][0]]
    parent = mlflow.MlflowClient().get_run(res.parent_run_id)
    assert parent.info.status == "FAILED"
    assert parent.data.tags[names.ERROR] == ("1 of 4 runs failed: configuration 1 repeat 1 (run fake-1): "
                                             "diverged at step 3")


def test_the_runner_hands_each_child_run_to_the_training_and_records_a_failure(tracking_uri, monkeypatch):
    import os

    from mlflow_llmeff.train.study import TrainRunner

    client = mlflow.MlflowClient()
    exp = client.create_experiment("study-runner")
    seen = []

    def launch(run, *, started_unix):  # the training: names the run it was handed, as the meter does
        cfg = run.options  # the run check() resolved, read: nothing is resolved again
        run_id = os.environ["MLFLOW_RUN_ID"]
        seen.append((cfg.run_name, run_id, started_unix))
        if cfg.seq_len == 64:
            raise ValueError("seq_len=64 is refused here")
        client.set_tag(run_id, "mlflow.runName", cfg.run_name)
        client.set_terminated(run_id, "FINISHED")
        return 0

    monkeypatch.setenv("MLFLOW_RUN_ID", "outer-run")
    res = run_study(configs(("A", {"run_name": "mine"}), ("B", {"seq_len": 64})), 2, experiment="study-runner",
                    runner=TrainRunner(client, exp, launch=launch), echo=lambda line: None)
    assert os.environ["MLFLOW_RUN_ID"] == "outer-run"  # restored after each child
    # the user's name: the same stem on every repeat, a suffix on the later ones
    assert [n for n, _, _ in seen] == ["mine", "", "mine-2", ""]
    assert [r for _, r, _ in seen] == [o.run_id for _, o in res.children]
    for (child, outcome), (_, _, started) in zip(res.children, seen):
        run = client.get_run(outcome.run_id)
        assert run.data.tags[PARENT_TAG] == res.parent_run_id
        assert run.data.tags[names.STUDY_REPEAT] == str(child.repeat) and names.STUDY not in run.data.tags
        assert started <= run.info.start_time / 1000 + 1e-3  # the child's clock starts before its run
        if child.config == 2:  # refused before its meter started: FAILED with why, the study went on
            assert (run.info.status, run.data.tags[names.ERROR]) == ("FAILED", "seq_len=64 is refused here")
            assert run.info.run_name == f"study-config2-repeat{child.repeat}"
    assert client.get_run(res.parent_run_id).info.status == "FAILED"


class FakePopen:
    """Stands for the child process: records its command and environment, prints ``lines`` on stderr."""

    seen: list = []

    def __init__(self, lines, code):
        self.lines, self.code = lines, code

    pid = -1  # no process group to signal

    def __call__(self, cmd, *, env, stderr, text, bufsize, start_new_session):
        assert start_new_session  # the child heads a group of its own: a stop signal reaches all of it
        FakePopen.seen.append((cmd, env))
        self.stderr = iter(self.lines)
        return self

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def wait(self, timeout=None):
        return self.code


def test_a_one_device_child_trains_in_a_process_of_its_own(tracking_uri, monkeypatch, capsys):
    import dataclasses
    import json
    import sys

    from mlflow_llmeff.train import launch as launch_mod
    from mlflow_llmeff.train.job import START_ENV
    from mlflow_llmeff.train.study import TrainRunner

    cfg = TrainConfig(model="llama-tiny", dataset="synthetic", max_steps=4, seq_len=32, measure_energy="none")
    FakePopen.seen = []
    monkeypatch.setattr(launch_mod.subprocess, "Popen", FakePopen(["step 1\n"], 0))
    runner = TrainRunner(mlflow.MlflowClient(), "0")  # the study's default launch
    assert runner.launch(cfg, started_unix=1700000000.25) == 0
    (cmd, env), = FakePopen.seen
    # the per-process entry accelerate launch runs, handed the whole config and the child's own start
    assert cmd[:4] == [sys.executable, "-m", "mlflow_llmeff.train.loop", "--config-json"]
    assert json.loads(cmd[4]) == dataclasses.asdict(cfg) and env[START_ENV] == "1700000000.25"
    assert capsys.readouterr().err == "step 1\n"  # its stderr passes through
    # the child's last 'error: <line>' is the child's error, as one line (no traceback, no exit code alone)
    monkeypatch.setattr(launch_mod.subprocess, "Popen", FakePopen(["step 1\n", "error: diverged at step 3\n"], 1))
    with pytest.raises(launch_mod.ChildError, match=r"^diverged at step 3$") as e:
        runner.launch(cfg, started_unix=1.0)
    assert e.value.code == 1
    monkeypatch.setattr(launch_mod.subprocess, "Popen", FakePopen(["Killed\n"], -9))
    assert runner.launch(cfg, started_unix=1.0) == -9  # no line of its own: the study names the exit code


def test_schedule_and_check_refuse_bad_input_naming_the_value(tmp_path):
    with pytest.raises(ValueError, match=r"^repeats=0 is not accepted; give a positive integer \(>= 1\)$"):
        schedule([TrainConfig()], 0)
    with pytest.raises(ValueError, match="checkpoint-dir .* is also configuration 1's"):
        check(configs(("A", {"checkpoint_dir": str(tmp_path)}), ("B", {"checkpoint_dir": str(tmp_path), "seq_len": 64})))
    with pytest.raises(ValueError, match="--experiment 'x' and --experiment-name 'y' in a --config differ"):
        check(configs(("A", {"experiment_name": "y"})), "x")
    with pytest.raises(ValueError, match=r"^configuration 2 \('B'\): precision='fp64' is not accepted"):
        check(configs(("A", {}), ("B", {"precision": "fp64"})))


@pytest.mark.parametrize("args, line", [
    (["--repeats", "0", "--config", "--max-steps 4"], "Error: Invalid value for '--repeats': 0 is not in the range x>=1."),
    (["--repeats", "2", "--config", "--max-stepz 4"],  # click's own words follow (and its suggestions)
     "Error: Invalid value for '--config': '--max-stepz 4': No such option"),
    (["--repeats", "2", "--config", "--max-steps four"],
     ("Error: Invalid value for '--config': '--max-steps four': Invalid value for '--max-steps': "
      "'four' is not a valid integer.")),
    (["--repeats", "2", "--seeds", "2", "--config", "--max-steps 4"], "Error: give --repeats N (the same seed) or "
                                                                      "--seeds N (seed + i - 1 for run i)"),
    (["--repeats", "2"], "Error: give --repeats N (the same seed) or --seeds N (seed + i - 1 for run i), and with "
                         "--repeats a --config per configuration"),
    (["--seeds", "2", "--target", "bleu=0.3", "--config", "--eval-every 5"],
     "Error: target metric 'bleu' is unknown, so 'metric=value' cannot say whether to reach it from above or below"),
    (["--seeds", "2", "--target", "val_loss=abc", "--config", "--eval-every 5"],  # as written, forms named
     "Error: target 'val_loss=abc' has non-numeric value 'abc'; write metric=value (<= for a loss or perplexity, "
     ">= for an accuracy), metric>=value or metric<=value"),
    (["--seeds", "2", "--target", "val_loss=3"],  # llmeff train's defaults evaluate only at the end
     "Error: configuration 1 (''): --eval-every 0 evaluates only at the end, so no run stops at val_loss<=3"),
])
def test_cli_bad_input_is_one_line_naming_the_value(args, line, tracking_uri):
    before = len(mlflow.search_runs(search_all_experiments=True))
    res = CliRunner().invoke(main, ["study", *args])
    last = res.output.strip().splitlines()[-1]
    assert res.exit_code == 2 and last.startswith(line) and res.output.count("Error") == 1
    assert "--max-stepz" not in args[-1] or "--max-stepz" in last[len(line):]
    assert len(mlflow.search_runs(search_all_experiments=True)) == before  # nothing was created


def _child(client, exp, parent, config, repeat, tps, mbs):
    tags = {PARENT_TAG: parent, names.STUDY_CONFIG: str(config), names.STUDY_REPEAT: str(repeat),
            names.ACCEL_SHORT: "cpu", names.ACCEL_COUNT: "1", names.MODEL_NAME: "llama-tiny",
            names.MICRO_BATCH_SIZE: str(mbs), names.PAR_STRATEGY: "single", names.STABILITY: "stable"}
    run = client.create_run(exp, run_name=f"tiny-mbs{mbs}" + (f"-{repeat}" if repeat > 1 else ""), tags=tags)
    client.log_metric(run.info.run_id, names.SUM_TOKENS_PER_SEC, tps)
    client.set_terminated(run.info.run_id, "FINISHED")


def test_comparisons_leave_the_study_parent_out_and_take_its_children_as_repeats(tracking_uri):
    from mlflow_llmeff.report.repeats import configurations
    from mlflow_llmeff.report.source import select_runs
    from mlflow_llmeff.train.study import StudyResult

    client = mlflow.MlflowClient()
    exp = client.create_experiment("study-groups")
    parent = client.create_run(exp, run_name="study-2x2", tags={names.STUDY: "2 configurations x 2 repeats, "
                                                                              "round-robin"}).info.run_id
    client.set_terminated(parent, "FINISHED")
    for config, repeat, tps, mbs in ((1, 1, 1000.0, 1), (2, 1, 3000.0, 2), (1, 2, 1200.0, 1), (2, 2, 3100.0, 2)):
        _child(client, exp, parent, config, repeat, tps, mbs)
    sel = select_runs(client, "study-groups")
    assert len(sel.runs) == 4 and parent not in {r.run_id for r in sel.runs} and sel.study_runs == 1
    assert sel.scope().endswith("; 1 study parent run (llmeff study's: their children are compared) left out")
    a, b = configurations(sel.runs)
    e = next(c for c in (a, b) if c.tag(names.MICRO_BATCH_SIZE) == "1").estimate(names.SUM_TOKENS_PER_SEC)
    # 1,000 and 1,200: mean 1,100, s = 200 / sqrt(2) = 141.42, half = t(0.975, 1) 12.706 x 141.42 / sqrt(2) = 1,270.6
    assert (e.mean, e.n, e.method) == (1100.0, 2, "repeats")
    assert (e.low, e.high) == (0.0, pytest.approx(1100 + 12.706 * 100.0))
    lines = summary_lines(client, StudyResult(parent, exp))
    # 3,000 and 3,100: mean 3,050, half = 12.706 x 50 = 635.3
    assert lines[1] == ("configuration 2 (tiny-mbs2 (+1 repeat)): 3,050 [2,415, 3,685] (2 repeats, t) tokens/s: "
                        "mean of 2 repeats, 95% Student-t interval across them (df 1)")
    # as bash reads it when pasted: the filter whole, its backticks not run
    assert lines[-1] == ("compare: llmeff compare --experiment study-groups --filter "
                         f"\"tags.\\`{PARENT_TAG}\\` = '{parent}'\"")  # readable: no '"'"' (a trial)
    words = ["llmeff", "compare", "--experiment", "study-groups", "--filter", f"tags.`{PARENT_TAG}` = '{parent}'"]
    import subprocess

    pasted = lines[-1][len("compare: llmeff compare "):]  # bash itself: no backtick runs, the words as above
    echo = subprocess.run(["bash", "-c", "printf '%s\\n' " + pasted], capture_output=True, text=True, check=True)
    assert echo.stdout.splitlines() == words[2:] and echo.stderr == ""


def test_a_real_study_of_two_configurations_twice(tracking_uri, monkeypatch):
    from mlflow_llmeff.train import launch as launch_mod

    handed = []  # the start the study hands each child's launch, unix s, in the order run
    real_launch = launch_mod.launch

    def launch(cfg, *, started_unix=None, own_process=False):
        handed.append(started_unix)
        return real_launch(cfg, started_unix=started_unix, own_process=own_process)

    monkeypatch.setattr(launch_mod, "launch", launch)  # TrainRunner takes it from the module when built
    res = CliRunner().invoke(main, ["study", "--repeats", "2", "--experiment", "study-real",
                                    "--config", TINY + " --micro-batch-size 1", "--config", TINY + " --micro-batch-size 2"])
    assert res.exit_code == 0, res.output
    client = mlflow.MlflowClient()
    exp = client.get_experiment_by_name("study-real").experiment_id
    runs = client.search_runs([exp], order_by=["attributes.start_time ASC"])
    parent = next(r for r in runs if names.STUDY in r.data.tags)
    kids = [r for r in runs if r.info.run_id != parent.info.run_id]
    assert [(r.data.tags[names.STUDY_CONFIG], r.data.tags[names.STUDY_REPEAT]) for r in kids] == [
        ("1", "1"), ("2", "1"), ("1", "2"), ("2", "2")]
    assert {r.data.tags[PARENT_TAG] for r in kids} == {parent.info.run_id}
    assert [r.info.status for r in runs] == ["FINISHED"] * 5 and not parent.data.metrics
    # one stem per configuration, the repeat with a unique suffix (tracking/naming.py)
    assert [r.info.run_name for r in kids] == ["tiny-fp32-gbt32-s32-cpu", "tiny-fp32-gbt64-s32-cpu",
                                               "tiny-fp32-gbt32-s32-cpu-2", "tiny-fp32-gbt64-s32-cpu-2"]
    # each start handed over comes after the parent's start, or the previous child's end (MLflow's
    # times, in ms rounded down), and before its own run is created
    assert len(handed) == 4 and parent.info.start_time / 1000 <= handed[0]
    for before, r, started in zip([None, *kids], kids, handed):
        assert before is None or before.info.end_time / 1000 <= started
        assert started <= r.info.start_time / 1000 + 1e-3
        # its summary/wall_s runs from that start (the child process gets it in $LLMEFF_ATTEMPT_START_UNIX;
        # its run, made about 1 ms later, is the launcher's run it starts at too) to the summary, whose
        # point is stamped just after: to a tick below, STAMP_LAG_S above (21-27 ms measured, alone)
        [point] = client.get_metric_history(r.info.run_id, names.SUM_WALL_S)
        stamped_s = point.timestamp / 1000 - started
        assert stamped_s - STAMP_LAG_S <= r.data.metrics[names.SUM_WALL_S] <= stamped_s + START_TICK_S
    for r in kids:  # each child's clock starts at its own run, not at this process's start or the run before
        assert r.data.metrics[names.SUM_WALL_S] <= (r.info.end_time - r.info.start_time) / 1000 + 0.5
        assert r.data.metrics[names.SUM_STEPS] == 4
    assert f"llmeff study: parent run {parent.info.run_id}, 2 configurations x 2 repeats, round-robin" in res.output
    assert "configuration 1 (tiny-fp32-gbt32-s32-cpu (+1 repeat)): " in res.output
    assert "mean of 2 repeats, 95% Student-t interval across them (df 1)" in res.output
    tps = [r.data.metrics[names.SUM_TOKENS_PER_SEC] for r in kids if r.data.tags[names.STUDY_CONFIG] == "1"]
    mean = sum(tps) / 2
    half = 12.706 * abs(tps[0] - tps[1]) / 2  # t(0.975, 1) x s / sqrt(2), s = |a - b| / sqrt(2)
    from mlflow_llmeff.report.repeats import configurations
    from mlflow_llmeff.report.source import select_runs

    sel = select_runs(client, "study-real")
    assert sel.study_runs == 1 and len(sel.runs) == 4
    one = next(c for c in configurations(sel.runs) if c.tag(names.MICRO_BATCH_SIZE) == "1")
    e = one.estimate(names.SUM_TOKENS_PER_SEC)
    assert (e.mean, e.n) == (pytest.approx(mean), 2) and e.high == pytest.approx(mean + half)
    assert math.isfinite(e.low) and e.low == pytest.approx(max(0.0, mean - half))


def test_a_study_to_a_target_needs_evals_during_training_and_one_target():
    from mlflow_llmeff.train.config import TrainConfig
    from mlflow_llmeff.train.study import StudyConfig, to_target

    with pytest.raises(ValueError, match=r"^configuration 1 \(''\): --eval-every 0 evaluates only at the end, so "
                                         r"no run stops at val_loss<=3.0; give --eval-every N"):
        to_target([StudyConfig("", TrainConfig())], "val_loss=3.0")
    with pytest.raises(ValueError, match=r"--targets 'val_loss<=2.0' and the study's --target 'val_loss<=3.0' differ"):
        to_target([StudyConfig("x", TrainConfig(eval_every=5, targets="val_loss<=2.0"))], "val_loss<=3.0")
    [c], [t] = to_target([StudyConfig("x", TrainConfig(eval_every=5))], "hellaswag/acc_norm=0.3")
    assert (c.cfg.targets, c.cfg.stop_at_targets, t.key) == ("hellaswag/acc_norm>=0.3", True, "hellaswag_acc_norm_ge_0.3")


def test_seeds_give_each_repeat_its_own_seed():
    from mlflow_llmeff.train.config import TrainConfig
    from mlflow_llmeff.train.study import schedule

    kids = schedule([TrainConfig(seed=7), TrainConfig(seed=0, seq_len=64)], 3, seeds=True)
    assert [(k.config, k.repeat, k.cfg.seed) for k in kids] == [(1, 1, 7), (2, 1, 0), (1, 2, 8), (2, 2, 1),
                                                                (1, 3, 9), (2, 3, 2)]
    assert {k.cfg.seed for k in schedule([TrainConfig(seed=7)], 3)} == {7}  # --repeats: the machine's noise alone


def test_a_real_study_of_three_seeds_to_a_target_is_scored_as_mlperf_does_with_checked_logs(tracking_uri, tmp_path):
    # seeds 0, 1, 2 of llama-tiny to val_loss<=4.35 within 30 steps (python-docs text, evals every 5 steps):
    # each stops at the eval that reaches it or at its cap; each gets an MLPerf-style log that the compliance
    # checker passes; the study scores the three as MLPerf does
    from mlflow_llmeff.calc.mlperf import olympic
    from mlflow_llmeff.report.repeats import configurations
    from mlflow_llmeff.report.source import select_runs
    from mlflow_llmeff.tracking.mllog import check_log

    config = ("--model llama-tiny --max-steps 30 --seq-len 64 --eval-every 5 --val-blocks 8 --warmup-steps 1 "
              "--log-every-n-steps 5 --measure-energy none")
    res = CliRunner().invoke(main, ["study", "--seeds", "3", "--target", "val_loss=4.35", "--experiment", "seeds-real",
                                    "--config", config])
    assert res.exit_code == 0, res.output
    client = mlflow.MlflowClient()
    exp = client.get_experiment_by_name("seeds-real").experiment_id
    runs = client.search_runs([exp], order_by=["attributes.start_time ASC"])
    parent = next(r for r in runs if names.STUDY in r.data.tags)
    kids = [r for r in runs if r.info.run_id != parent.info.run_id]
    assert parent.data.tags[names.STUDY_TARGET] == "val_loss<=4.35"
    assert parent.data.params == {"seeds": "3", "target": "val_loss<=4.35", "config_1": config}
    assert [r.data.params["seed"] for r in kids] == ["0", "1", "2"]
    times = []
    for r in kids:
        losses = [(m.step, m.value) for m in client.get_metric_history(r.info.run_id, names.EVAL_VAL_LOSS)]
        first = next((step for step, v in sorted(losses) if v <= 4.35), None)
        wall = r.data.metrics.get("ttq/val_loss_le_4.35_wall_s")
        # it stopped at the eval that reached the target, else ran to its cap
        assert (wall is not None) == (first is not None)
        assert r.data.metrics[names.SUM_STEPS] == (first if first is not None else 30)
        times.append(wall)
        seed = r.data.params["seed"]
        status = "success" if wall is not None else "aborted"
        assert r.data.tags[names.MLLOG].startswith(f"mllog/result_{seed}.txt: MLPerf-style result log")
        assert r.data.tags[names.MLLOG].endswith(f"run_stop {status}")
        # the study's line says it is an artifact, and how to fetch it (a new user looked for ./mllog)
        # naming the study's store (a trial's download without it looked in ./mlruns: 'Run ... not found')
        assert (f"llmeff study: run {r.info.run_id}: {r.data.tags[names.MLLOG]} (an artifact of the run, not a local "
                f"file: MLFLOW_TRACKING_URI={tracking_uri} mlflow artifacts download --run-id {r.info.run_id} "
                f"--artifact-path mllog/result_{seed}.txt --dst-path .)") in res.output
        local = client.download_artifacts(r.info.run_id, f"mllog/result_{seed}.txt", str(tmp_path))
        check = check_log(local)
        assert check.ok, check.output
        text = open(local, encoding="utf-8").read()
        assert f'"key": "seed", "value": {seed}' in text and f'"status": "{status}"' in text
    # one configuration of the three seeds, whatever steps each ran
    c, = configurations(select_runs(client, "seeds-real").runs)
    assert len(c.runs) == 3
    # named the same in the study's summary and in compare (they read the runs in other orders), as seeds
    assert c.label == f"{c.first.name} (+2 seeds)"
    assert c.first.start_time_ms == min(r.start_time_ms for r in (c.stable or c.runs))  # the oldest
    assert f"configuration 1 ({c.label}): " in res.output
    o = olympic(times)
    print(f"seeds to val_loss<=4.35: {times}; olympic {o.score} ({o.why})")
    line = next(s for s in res.output.splitlines() if ": to val_loss_le_4.35: " in s)
    reached = sum(t is not None for t in times)
    assert f": to val_loss_le_4.35: {reached} of 3 runs reached it; time from training start " in line
    if o.valid:  # the middle run's time (three runs: the fastest and the slowest dropped)
        assert o.score == sorted(t if t is not None else math.inf for t in times)[1]
        # one value kept: the value alone, no [low, high] range of one value, the scoring beside it
        shown = f"{o.score:.3g}" if o.score < 100 else f"{o.score:,.0f}"
        assert f"time from training start {shown} s (the middle run of 3; dropped: " in line
        assert "[lowest, highest]" not in line
    else:
        assert f"time from training start invalid: {3 - reached} of 3 not reached" in line


def test_a_child_the_server_does_not_create_stops_the_study_in_one_line_and_waits_in_the_outbox(tmp_path, monkeypatch):
    """Issue 52: a child run whose creation the tracking server does not answer (a closed port) is not trained;
    the runner says so in one line naming the server, the bound and the outbox file that keeps the child
    (created, with its study tags, then KILLED)."""
    import os
    import socket

    from mlflow_llmeff.tracking import delivery, outbox
    from mlflow_llmeff.train.study import TrainRunner

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    uri = f"http://127.0.0.1:{s.getsockname()[1]}"
    s.close()  # nothing listens there
    monkeypatch.setenv("LLMEFF_DELIVERY_WAIT_S", "2")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("LLMEFF_OUTBOX_DIR", str(tmp_path))
    trained = []
    runner = TrainRunner(mlflow.MlflowClient(uri), "7", launch=lambda run, *, started_unix: trained.append(run))
    [child] = schedule([TrainConfig()], 1)
    tags = {PARENT_TAG: "p1", names.STUDY_CONFIG: "1", names.STUDY_REPEAT: "1"}
    with pytest.raises(delivery.Unreachable) as e:
        runner(child, tags)
    assert trained == []
    line = str(e.value)
    assert line.startswith(f"the tracking server {uri} did not answer creating the run (connection refused; each call "
                           "waits at most 2 s, LLMEFF_DELIVERY_WAIT_S); configuration 1 repeat 1 was not trained: "
                           f"its run waits in {tmp_path}/local-") and "\n" not in line
    [kept] = [f for f in os.listdir(tmp_path) if f.endswith(".jsonl")]
    _, records = outbox.read_outbox(str(tmp_path / kept))
    create = records[0]["create"]
    assert (create["experiment_id"], create["run_name"]) == ("7", "study-config1-repeat1")
    assert {k: create["tags"][k] for k in tags} == tags and records[-1]["end"][0] == "KILLED"
    # and it says why (the fresh-user trial's synced child was KILLED with no llmeff.error)
    [error] = [r["t"][1] for r in records if "t" in r and r["t"][0] == names.ERROR]
    assert error == (f"not trained: the tracking server {uri} did not answer creating the run (connection refused; "
                     "each call waits at most 2 s, LLMEFF_DELIVERY_WAIT_S)")
