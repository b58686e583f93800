"""What clusters do to runs: kills at any point, diverged losses, OOM, data errors, secrets."""

from __future__ import annotations

import json
import contextlib
import dataclasses
import os
import subprocess
import sys

import mlflow
import pytest

from mlflow_llmeff import names
from mlflow_llmeff.tracking import redact
from mlflow_llmeff.train import checkpoint as ckpt
from mlflow_llmeff.train import faults
from mlflow_llmeff.train.config import TrainConfig
from mlflow_llmeff.train.loop import run_training

from conftest import empty_store
from test_train_e2e import env_for, history, only_run, parts_add_up


# ------------------------------------------------------------------ atomic checkpoints
class FakeAccelerator:
    is_main_process = True
    num_processes = 1

    def __init__(self, fail_after_files: int | None = None) -> None:
        self.fail_after_files = fail_after_files

    def save_state(self, path):
        os.makedirs(path, exist_ok=True)
        for i in range(3):
            if self.fail_after_files is not None and i == self.fail_after_files:
                raise KeyboardInterrupt("killed in the middle of the write")
            with open(os.path.join(path, f"shard{i}.bin"), "wb") as f:
                f.write(b"x" * 10)

    def wait_for_everyone(self):
        pass


class FakeMonitor:
    run_id = "r1"
    flushed = 0

    def state_dict(self):
        return {"steps": 1}

    def flush(self):
        self.flushed += 1

    def pause(self, category):
        return contextlib.nullcontext()


def test_checkpoint_appears_only_when_complete_and_half_writes_are_never_picked(tmp_path):
    cfg = TrainConfig(checkpoint_dir=str(tmp_path), checkpoint_keep=2)
    ckpt.save(FakeAccelerator(), cfg, 4, FakeMonitor(), {})
    assert sorted(os.listdir(tmp_path)) == ["step_00000004"]
    assert sorted(os.listdir(tmp_path / "step_00000004")) == ["llmeff_state.json", "shard0.bin", "shard1.bin",
                                                              "shard2.bin"]
    with pytest.raises(KeyboardInterrupt):  # a kill in the middle of the next write
        ckpt.save(FakeAccelerator(fail_after_files=2), cfg, 8, FakeMonitor(), {})
    assert sorted(os.listdir(tmp_path)) == ["step_00000004", "step_00000008.partial"]
    path, state = ckpt.latest(str(tmp_path))
    assert path.endswith("step_00000004") and state["step"] == 4
    assert ckpt.clean_partial(str(tmp_path)) == ["step_00000008.partial"]
    assert sorted(os.listdir(tmp_path)) == ["step_00000004"]
    # a replayed step's save replaces both a leftover partial and a complete folder of that step
    os.makedirs(tmp_path / "step_00000008.partial")
    ckpt.save(FakeAccelerator(), cfg, 8, FakeMonitor(), {"skipped_steps": 3})
    ckpt.save(FakeAccelerator(), cfg, 8, FakeMonitor(), {"skipped_steps": 5})
    assert sorted(os.listdir(tmp_path)) == ["step_00000004", "step_00000008"]
    assert json.loads((tmp_path / "step_00000008" / ckpt.STATE_FILE).read_text())["skipped_steps"] == 5


# ------------------------------------------------------------------ kill at any point, resume
KILL_ARGS = ["--max-steps", "12", "--log-every-n-steps", "2", "--seq-len", "32", "--micro-batch-size", "2",
             "--checkpoint-every", "4", "--eval-every", "4", "--val-blocks", "4", "--warmup-steps", "1",
             "--measure-energy", "none", "--seed", "3"]
TOKENS_PER_STEP = 2 * 32
KILL_CONFIG = TrainConfig(max_steps=12, log_every_n_steps=2, seq_len=32, micro_batch_size=2, checkpoint_every=4,
                          eval_every=4, val_blocks=4, warmup_steps=1, measure_energy="none", seed=3)  # KILL_ARGS


def test_the_in_process_reference_has_the_command_lines_settings():
    params = {f"--{k.replace('_', '-')}": v for k, v in KILL_CONFIG.to_params().items()}
    assert {k: params[k] for k in KILL_ARGS[::2]} == dict(zip(KILL_ARGS[::2], KILL_ARGS[1::2]))


def _final_weights(ckpt_dir):
    from safetensors.torch import load_file

    path, state = ckpt.latest(str(ckpt_dir))
    assert state["step"] == 12
    return load_file(os.path.join(path, "model.safetensors"))


def _train(tmp_path, uri, ckpt_dir, extra_env=None):
    return _all([(uri, ckpt_dir, extra_env)], tmp_path)[0]


def _all(jobs, tmp_path, meanwhile=None):
    """Run ``llmeff train`` for each ``(uri, checkpoint dir, extra env)`` at once (they are independent:
    separate stores and folders; single-threaded each, so the 2 cores run two at a time); ``meanwhile()``
    (if given) runs in this process while they do."""
    procs = [subprocess.Popen([sys.executable, "-m", "mlflow_llmeff", "train", *KILL_ARGS, "--checkpoint-dir", str(ck)],
                              cwd=tmp_path, env={**env_for(uri), **(extra or {})}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, start_new_session=True) for uri, ck, extra in jobs]
    if meanwhile is not None:
        meanwhile()
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=600)
        out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    return out


def _resume_here(uri, ck, monkeypatch, capsys) -> str:
    """The next attempt of the killed job in ``ck`` (store ``uri``): ``llmeff train``'s launch of KILL_ARGS in this
    process, with one thread as a launched process has (OMP_NUM_THREADS=1) and its start now, as a process
    started now has; returns what it printed. A process of its own added only its imports (the test's whole-tree
    CPU, interleaved: 58.0, 54.4 s with three resumed processes; 35.2, 35.5 s with the resumes here)."""
    import time

    import torch

    from mlflow_llmeff.train.launch import launch

    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    mlflow.set_tracking_uri(uri)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert launch(dataclasses.replace(KILL_CONFIG, checkpoint_dir=str(ck)), started_unix=time.time()) == 0
    finally:
        torch.set_num_threads(before)
    return capsys.readouterr().out


@pytest.mark.slow
def test_sigkill_in_a_step_in_a_save_and_in_an_eval_each_resume_to_an_uninterrupted_runs_weights(tmp_path, tracking_uri,
                                                                                             monkeypatch, capsys):
    import torch

    # point -> (the step it fires at, the last complete checkpoint before it)
    cases = {"kill_in_step": (7, 4), "kill_in_save": (8, 4), "kill_in_eval": (8, 4)}  # the eval runs before the save
    uris = {point: empty_store(tmp_path / (point + ".db")) for point in cases}
    # the uninterrupted run (the weights every resumed one must end with) is no test of the command line:
    # trained here, in this test's store, while the three killed launches run (one process fewer to start)
    def reference_run():  # one thread, as the launched processes have (OMP_NUM_THREADS=1): the same sums, bit for bit
        before = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            run_training(dataclasses.replace(KILL_CONFIG, checkpoint_dir=str(tmp_path / "ref")))
        finally:
            torch.set_num_threads(before)

    firsts = _all([(uris[p], tmp_path / p, {faults.ENV[p]: str(at)}) for p, (at, _) in cases.items()], tmp_path,
                  meanwhile=reference_run)
    assert only_run().info.status == "FINISHED"
    reference = _final_weights(tmp_path / "ref")
    for point, first in zip(cases, firsts):
        assert first.returncode == -9, (point, first.stderr[-2000:])
    assert (tmp_path / "kill_in_save" / "step_00000008.partial").is_dir()  # killed between Accelerate's files and the rename
    capsys.readouterr()
    # each job's next attempt, one after the other in this process (what the kills leave is the subject)
    seconds = [_resume_here(uris[p], tmp_path / p, monkeypatch, capsys) for p in cases]
    for (point, (at, resumed_from)), second in zip(cases.items(), seconds):
        uri, ck = uris[point], tmp_path / point
        assert "half-written" in second or point != "kill_in_save"
        mlflow.set_tracking_uri(uri)
        run = only_run()  # one run
        assert run.info.status == "FINISHED", point
        assert run.data.tags[names.RESUMED_FROM] == str(resumed_from), point
        tokens = history(run, names.TRAIN_TOKENS)
        assert [s for s, _ in tokens] == list(range(2, 13, 2)), point  # each logged step once
        assert [v for _, v in tokens] == [TOKENS_PER_STEP * s for s in range(2, 13, 2)], point  # continuous
        assert [s for s, _ in history(run, names.EVAL_VAL_LOSS)] == [4, 8, 12], point
        m = run.data.metrics
        assert parts_add_up(m) == pytest.approx(m[names.SUM_WALL_S], rel=0.01), point
        assert m[names.SUM_BADPUT["checkpoint_load"]] > 0, point
        assert m[names.SUM_BADPUT["lost_progress"]] > 0, point
        assert run.data.tags[names.HFU_METHOD].startswith("FlopCounterMode on step 1 "), point  # counted once
        weights = _final_weights(ck)
        assert weights.keys() == reference.keys()
        for k in reference:
            assert torch.equal(weights[k], reference[k]), (point, k)
        assert not [p for p in os.listdir(ck) if p.endswith(ckpt.PARTIAL)], point


# ------------------------------------------------------------------ bad numbers and crashes
def test_nan_loss_ends_failed_naming_the_step_with_points_and_checkpoint_kept(tracking_uri, tmp_path):
    cfg = TrainConfig(max_steps=20, log_every_n_steps=1, seq_len=32, micro_batch_size=2, learning_rate=1e8,
                      checkpoint_dir=str(tmp_path / "ck"), checkpoint_every=1, measure_energy="none")
    from mlflow_llmeff.train.loop import NonFiniteLoss

    with pytest.raises(NonFiniteLoss) as err:
        run_training(cfg)
    run = only_run()
    assert run.info.status == "FAILED" and run.info.end_time
    loss = history(run, names.TRAIN_LOSS)
    bad_step = loss[-1][0]
    assert loss[-1][1] != loss[-1][1]  # the NaN point itself is logged
    assert all(v == v for _, v in loss[:-1]) and [s for s, _ in loss] == list(range(1, bad_step + 1))
    assert run.data.tags[names.ERROR].startswith(f"train/loss is nan at step {bad_step} (nan_policy=fail)")
    assert str(err.value) == run.data.tags[names.ERROR]
    # the newest checkpoint is the step before: no checkpoint holds the diverged weights
    assert ckpt.latest(str(tmp_path / "ck"))[1]["step"] == bad_step - 1
    assert names.SUM_WALL_S in run.data.metrics  # the figures up to that point


def test_nan_policy_skip_step_skips_and_counts(tracking_uri):
    cfg = TrainConfig(max_steps=6, log_every_n_steps=2, seq_len=32, micro_batch_size=2, learning_rate=1e8,
                      nan_policy="skip_step", measure_energy="none")
    out = run_training(cfg)
    run = only_run()
    assert run.info.status == "FINISHED"
    skipped = history(run, names.TRAIN_SKIPPED_STEPS)
    assert skipped[-1][0] == 6 and skipped[-1][1] >= 1
    losses = history(run, names.TRAIN_LOSS)
    assert all(v == v for _, v in losses)  # skipped losses are not averaged in
    # a window of 2 steps logs a loss exactly when one of its steps was not skipped (here, measured: steps
    # 4, 5, 6 skipped, so losses at 2 and 4 and none at 6)
    def at(step):  # steps skipped up to `step` (the metric is cumulative)
        return max((v for s, v in skipped if s <= step), default=0.0)

    kept = [end for end in (2, 4, 6) if at(end) - at(end - 2) < 2]
    assert kept and [s for s, _ in losses] == kept, (losses, skipped)
    assert out["summary"][names.SUM_STEPS] == 6


def test_out_of_memory_ends_failed_with_advice_and_checkpoint_kept(tracking_uri, tmp_path, monkeypatch):
    import torch

    monkeypatch.setenv(faults.ENV["oom_at_step"], "3")
    cfg = TrainConfig(max_steps=6, log_every_n_steps=1, seq_len=32, micro_batch_size=2,
                      checkpoint_dir=str(tmp_path / "ck"), checkpoint_every=2, measure_energy="none")
    with pytest.raises(torch.OutOfMemoryError):
        run_training(cfg)
    run = only_run()
    assert run.info.status == "FAILED"
    assert run.data.tags[names.ERROR].startswith("out of memory at step 3 (CUDA out of memory. Tried to allocate")
    assert "micro_batch_size" in run.data.tags[names.ERROR]
    assert [s for s, _ in history(run, names.TRAIN_TOKENS)] == [1, 2]
    assert ckpt.latest(str(tmp_path / "ck"))[1]["step"] == 2


def test_data_error_ends_failed_naming_the_step(tracking_uri, tmp_path, monkeypatch):
    monkeypatch.setenv(faults.ENV["data_at_step"], "4")
    cfg = TrainConfig(max_steps=6, log_every_n_steps=1, seq_len=32, micro_batch_size=2,
                      checkpoint_dir=str(tmp_path / "ck"), checkpoint_every=3, measure_energy="none")
    from mlflow_llmeff.train.loop import DataError

    with pytest.raises(DataError):
        run_training(cfg)
    run = only_run()
    assert run.info.status == "FAILED"
    assert run.data.tags[names.ERROR] == ("data loading failed at step 4: OSError: [Errno 5] Input/output error: "
                                          "'shard-00007.jsonl' (LLMEFF_FAULT_DATA_AT_STEP=4: injected)")
    assert [s for s, _ in history(run, names.TRAIN_TOKENS)] == [1, 2, 3]
    assert ckpt.latest(str(tmp_path / "ck"))[1]["step"] == 3


def test_bad_nan_policy_is_one_line(tracking_uri):
    from mlflow_llmeff.train.config import validate

    with pytest.raises(ValueError, match="^nan_policy='ignore' is not accepted; use one of: fail, skip_step$"):
        validate(TrainConfig(nan_policy="ignore"))


# ------------------------------------------------------------------ secrets
def test_secret_names_and_values_are_never_recorded(tracking_uri, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_abcdefghijklmnop")
    monkeypatch.setenv("MY_SERVICE_PASSWORD", "correct-horse-battery")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")  # a name with "token" in a word, not a secret
    from mlflow_llmeff.tracking.logger import RunLogger

    client = mlflow.MlflowClient()
    exp = client.create_experiment("secrets")
    run_id = client.create_run(exp).info.run_id
    logger = RunLogger(run_id, client)
    logger.set_tags({"llmeff.user.api_key": "sk-live-123", "llmeff.user.note": "pulled with hf_abcdefghijklmnop",
                     "llmeff.user.tokenizer": "gpt2",
                     "llmeff.user.source": "https://alice:s3cr3t@data.example.com/c.jsonl?sig=XYZ&part=1"})
    logger.log_params({"dataset": "s3://AKIAKEY:wJalrXUtn@bucket/corpus", "password": "correct-horse-battery",
                       "learning_rate": "0.001"})
    logger.close()
    run = client.get_run(run_id)
    t, p = run.data.tags, run.data.params
    assert t["llmeff.user.api_key"] == "***"
    assert t["llmeff.user.note"] == "pulled with ***"
    assert t["llmeff.user.tokenizer"] == "gpt2"
    assert t["llmeff.user.source"] == "https://data.example.com/c.jsonl?sig=***&part=1"
    assert p == {"dataset": "s3://bucket/corpus", "password": "***", "learning_rate": "0.001"}
    blob = json.dumps({**t, **p})
    for secret in ("hf_abcdefghijklmnop", "correct-horse-battery", "s3cr3t", "wJalrXUtn", "sk-live-123"):
        assert secret not in blob


def test_redact_rules():
    assert [redact.secret_name(n) for n in ("HF_TOKEN", "AWS_SECRET_ACCESS_KEY", "apiKey", "GITHUB_PAT_TOKEN",
                                            "tokenizer", "global_batch_tokens", "sort_key", "llmeff.auth")] == \
        [True, True, True, True, False, False, False, True]
    assert redact.strip_uri_secrets("http://u:p@127.0.0.1:5000") == "http://127.0.0.1:5000"
    assert redact.strip_uri_secrets("no uri here") == "no uri here"
    assert redact.environment_secrets({"A_TOKEN": "short", "B_SECRET": "long-enough-1", "C": "long-enough-2"}) == \
        ["long-enough-1"]
    assert redact.clean_obj({"uri": "https://x:y@h/p", "api_key": "k", "n": [1, "https://z@h"]}, []) == \
        {"uri": "https://h/p", "api_key": "***", "n": [1, "https://h"]}


# ------------------------------------------------------------------ two nodes
@pytest.mark.slow
def test_two_nodes_on_loopback_give_one_run_with_tokens_from_both(mlflow_server, tmp_path):
    from conftest import free_port

    port = str(free_port())
    env = env_for(mlflow_server.uri)
    procs = []
    for rank in (0, 1):  # two "machines" of one process each, rendezvousing on 127.0.0.1
        node = tmp_path / f"node{rank}"
        node.mkdir()
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "mlflow_llmeff", "train", "--num-machines", "2", "--machine-rank", str(rank),
             "--main-process-ip", "127.0.0.1", "--main-process-port", port, "--max-steps", "6",
             "--log-every-n-steps", "3", "--seq-len", "32", "--micro-batch-size", "2", "--measure-energy", "none"],
            cwd=node, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True))
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[-2000:] for o in outs]
    run = only_run()
    assert run.info.status == "FINISHED", [o[-2000:] for o in outs]
    t = run.data.tags
    assert (t[names.NODES], t[names.PROCS_PER_NODE], t[names.ACCEL_COUNT], t[names.PAR_STRATEGY]) == ("2", "1", "2", "ddp")
    # 2 ranks x 2 sequences x 32 tokens = 128 tokens per step: both machines' tokens counted
    assert history(run, names.TRAIN_TOKENS) == [(3, 384.0), (6, 768.0)]


# ------------------------------------------------------------------ a tracking server that goes away
def test_outbox_spills_when_the_server_is_gone_and_llmeff_sync_delivers_it(tracking_uri, tmp_path):
    """A server that never comes back during the run: close() spills; llmeff sync sends and ends the run."""
    from click.testing import CliRunner
    from mlflow.exceptions import MlflowException

    from mlflow_llmeff.cli import main
    from mlflow_llmeff.tracking.logger import RunLogger

    class DownClient:
        def __init__(self, real):
            self.real, self.down = real, True

        def log_batch(self, *a, **kw):
            if self.down:
                raise MlflowException("API request to endpoint /api/2.0/mlflow/runs/log-batch failed: "
                                      "Connection refused", error_code="TEMPORARILY_UNAVAILABLE")
            return self.real.log_batch(*a, **kw)

        def set_terminated(self, *a, **kw):
            if self.down:
                raise MlflowException("Connection refused", error_code="TEMPORARILY_UNAVAILABLE")
            return self.real.set_terminated(*a, **kw)

    real = mlflow.MlflowClient()
    run_id = real.create_run("0").info.run_id
    client = DownClient(real)
    log = RunLogger(run_id, client, send_interval_s=0.0, outbox_dir=str(tmp_path / "outbox"), wait_s=0.5)
    for step in range(1, 4):
        log.log_metrics({"train/tokens": 64.0 * step, "train/loss": float("nan") if step == 3 else 2.0}, step)
    log.set_tags({"llmeff.user.note": "kept"})
    log.close("FINISHED")
    spilled = tmp_path / "outbox" / f"{run_id}.jsonl"
    assert spilled.exists()
    assert real.get_run(run_id).info.status == "RUNNING"  # not ended before everything is delivered
    assert real.get_run(run_id).data.metrics == {}
    r = CliRunner().invoke(main, ["sync", str(tmp_path / "outbox")])
    assert r.exit_code == 0, r.output
    assert r.output.strip() == f"run {run_id}: 7 entries sent, ended FINISHED"
    run = real.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.tags["llmeff.user.note"] == "kept"
    assert [(m.step, m.value) for m in real.get_metric_history(run_id, "train/tokens")] == [(1, 64.0), (2, 128.0),
                                                                                            (3, 192.0)]
    assert not spilled.exists()
    r = CliRunner().invoke(main, ["sync", str(tmp_path / "nowhere")])
    assert r.exit_code != 0 and "outbox folder" in r.output and "Traceback" not in r.output


def test_a_diverged_run_on_the_command_line_is_one_line_not_a_traceback(tracking_uri, tmp_path):
    r = subprocess.run([sys.executable, "-m", "mlflow_llmeff", "train", "--max-steps", "8", "--log-every-n-steps", "2",
                        "--seq-len", "32", "--micro-batch-size", "2", "--learning-rate", "1e8",
                        "--measure-energy", "none"], cwd=tmp_path, env=env_for(tracking_uri), capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 1
    assert "Traceback" not in r.stderr
    line = [x for x in r.stderr.splitlines() if x.startswith("Error: ")]
    assert len(line) == 1 and line[0].startswith("Error: train/loss is nan at step ")
    assert "--nan-policy skip_step" in line[0] and "checkpoint" not in line[0]  # no checkpoint_dir: none kept
    assert only_run().data.tags[names.ERROR] == line[0][len("Error: "):]
