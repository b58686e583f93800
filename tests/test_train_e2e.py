"""End-to-end training runs on CPU with a real MLflow store (tiny model, real text)."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import mlflow
import pytest

from mlflow_llmeff import names
from mlflow_llmeff.train.config import TrainConfig
from mlflow_llmeff.train.loop import KILL_AT_STEP_ENV, run_training

from conftest import REPO, START_TICK_S, process_start_unix_of
from eval_fixtures import eval_fixture_dir

INTERVAL_KEYS = [names.TRAIN_LOSS, names.TRAIN_LR, names.TRAIN_TOKENS, names.TRAIN_PADDED_TOKENS,
                 names.TRAIN_LOSS_TOKENS, names.TRAIN_STEP_TIME_S, names.TPUT_TOKENS, names.TPUT_SAMPLES,
                 names.TPUT_DEVICE_TOKENS, names.TPUT_DEVICE_TFLOPS, names.MEM_MAX_ALLOC, names.MEM_MAX_RESERVED,
                 names.EVAL_VAL_LOSS, names.EVAL_VAL_PPL]
SUMMARY_KEYS = [names.SUM_TOKENS_PER_SEC, names.SUM_DEVICE_TOKENS_PER_SEC, names.SUM_DEVICE_TFLOPS,
                names.SUM_STEP_TIME_S, names.SUM_MODEL_STATE_BYTES_PER_PARAM,
                names.SUM_GOODPUT, names.SUM_WALL_S, names.SUM_TOKENS, names.SUM_STEPS,
                # compile: only when compiling or building ops; down: with summary/attempts (a job with
                # a checkpoint folder keeps its attempts ledger; docs/time.md)
                *(names.SUM_BADPUT[c] for c in names.BADPUT_CATEGORIES if c not in ("compile", "down"))]
CONDITION_TAGS = [names.ACCEL_NAME, names.ACCEL_SHORT, names.ACCEL_COUNT, names.ACCEL_GENERATION, names.NODES,
                  names.PAR_STRATEGY, names.PAR_DP, names.PRECISION, names.MODEL_NAME, names.MODEL_PARAMS,
                  names.MODEL_NON_EMB_PARAMS, names.MODEL_LAYERS, names.MODEL_HIDDEN, names.SEQ_LEN,
                  names.MICRO_BATCH_SIZE, names.GRAD_ACCUM, names.GLOBAL_BATCH_TOKENS, names.ACT_CKPT,
                  names.WARMUP_STEPS, names.V_TORCH, names.V_TRANSFORMERS, names.V_ACCELERATE, names.V_MLFLOW,
                  names.V_LLMEFF, names.FLOPS_FORMULA, names.PEAK_SOURCE, names.DATASET_KIND, names.MEMORY_SOURCE]


def only_run():
    runs = mlflow.MlflowClient().search_runs([e.experiment_id for e in mlflow.search_experiments()])
    assert len(runs) == 1, [r.info.run_name for r in runs]
    return runs[0]


def history(run, key):
    return sorted((m.step, m.value) for m in mlflow.MlflowClient().get_metric_history(run.info.run_id, key))


def env_for(tracking_uri):
    env = dict(os.environ, MLFLOW_TRACKING_URI=tracking_uri, OMP_NUM_THREADS="1")
    env.pop("MLFLOW_RUN_ID", None)
    return env


@pytest.mark.slow
def test_readme_command_gives_one_finished_run_with_every_key(tracking_uri, tmp_path):
    # The README's first command, as a user runs it (defaults: llama-tiny on built-in real text).
    r = subprocess.run([sys.executable, "-m", "mlflow", "run", str(REPO), "--env-manager", "local",
                        "-P", "model=llama-tiny"], cwd=tmp_path, env=env_for(tracking_uri),
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    run = only_run()
    assert run.info.status == "FINISHED"
    for key in INTERVAL_KEYS + SUMMARY_KEYS:
        assert key in run.data.metrics, key
        assert math.isfinite(run.data.metrics[key]), key
    for tag in CONDITION_TAGS:
        assert run.data.tags.get(tag), tag
    assert run.data.tags[names.ACCEL_SHORT] == "cpu"
    assert names.SUM_BYTES_PER_PARAM not in run.data.metrics  # CPU: no allocator statistics, never from RSS
    assert run.data.tags[names.PAR_STRATEGY] == "single"
    assert run.info.run_name == "tiny-fp32-gbt1k-s128-cpu"  # 128 x 8 x 1 x 1 = 1k tokens a step
    # 50 steps x 8 sequences x 128 packed tokens, no padding
    assert run.data.metrics[names.TRAIN_TOKENS] == 50 * 8 * 128 == run.data.metrics[names.SUM_TOKENS]
    assert [s for s, _ in history(run, names.TRAIN_LOSS)] == list(range(5, 51, 5))
    exp = mlflow.MlflowClient().get_experiment(run.info.experiment_id)
    assert exp.tags[names.EXPERIMENT_KIND_TAG] == names.EXPERIMENT_KIND_VALUE


@pytest.mark.slow
def test_loss_falls_on_shared_shakespeare(tracking_uri, shared_data):
    corpus = str(shared_data / "corpus" / "tinyshakespeare.txt")
    run_training(TrainConfig(dataset=corpus, max_steps=40, log_every_n_steps=5, learning_rate=3e-3))
    loss = history(only_run(), names.TRAIN_LOSS)
    assert loss[-1][1] < loss[0][1] - 1.0, loss  # bytes: ~5.5 nats at init, well under 4.5 after 40 steps


def test_padding_and_grad_accum_token_counts_hand_computed(tracking_uri, tmp_path):
    # 40 documents "abcd": 4 bytes + EOS = 5 real tokens, padded to seq_len 8.
    p = tmp_path / "docs.txt"
    p.write_text("\n\n".join(["abcd"] * 40))
    out = run_training(TrainConfig(dataset=str(p), packing=False, seq_len=8, micro_batch_size=2, grad_accum=2,
                                   max_steps=6, log_every_n_steps=3, warmup_steps=1, val_fraction=0.1))
    run = only_run()
    # per step: 2 micro-batches x 2 sequences = 4 sequences -> 20 real, 32 padded, 4 x 4 = 16 loss tokens
    assert history(run, names.TRAIN_TOKENS) == [(3, 60.0), (6, 120.0)]
    assert history(run, names.TRAIN_PADDED_TOKENS) == [(3, 96.0), (6, 192.0)]
    assert history(run, names.TRAIN_LOSS_TOKENS) == [(3, 48.0), (6, 96.0)]
    s = out["summary"]
    # steady state = steps 2..6 (warm-up step 1 excluded): 100 tokens over their measured time
    assert s[names.SUM_TOKENS_PER_SEC] == pytest.approx(100 / (5 * s[names.SUM_STEP_TIME_S]))
    assert s[names.SUM_TOKENS] == 120
    # fp32 AdamW: 4 (weights) + 4 (gradients) + 8 (two moments) bytes per parameter
    assert s[names.SUM_MODEL_STATE_BYTES_PER_PARAM] == 16.0


def last_sign_of_life(ck, attempt: int, step: int) -> float:
    """Unix time of the last sign of life of ``attempt``, killed after ``step``, read from the job's files
    in ``ck`` before a next attempt changes them: the newest of its start, its ledger records
    (``llmeff_attempts.jsonl``) and its heartbeat (``llmeff_progress``, asserted to be at ``step``)."""
    import json

    from mlflow_llmeff.train import job as jobs

    beat = jobs.read_heartbeat(str(ck / jobs.PROGRESS_FILE))
    assert beat is not None and (beat["attempt"], beat["step"]) == (attempt, step), beat
    events = [json.loads(line) for line in (ck / jobs.LEDGER_FILE).read_text().splitlines() if line.strip()]
    mine = [e for e in events if e.get("attempt") == attempt]
    assert not [e for e in mine if e.get("event") == "end"]  # a SIGKILL leaves none
    return max([beat["unix"]] + [float(e[k]) for e in mine for k in ("start_unix", "unix") if k in e])


@pytest.mark.slow
def test_killed_run_resumes_into_the_same_run(tracking_uri, tmp_path):
    # 16 steps, checkpoints every 5, killed 2 steps after checkpoint 10 (it was 40 steps killed at 22: the same
    # path, 24 steps and 4 checkpoint saves more of CPU)
    args = [sys.executable, "-m", "mlflow_llmeff", "train", "--max-steps", "16", "--log-every-n-steps", "1",
            "--seq-len", "32", "--micro-batch-size", "4", "--checkpoint-dir", str(tmp_path / "ck"),
            "--checkpoint-every", "5"]
    import time

    env = env_for(tracking_uri)
    t0 = time.time()
    first = subprocess.run(args, cwd=tmp_path, env={**env, KILL_AT_STEP_ENV: "12"}, capture_output=True, timeout=600)
    t1 = time.time()
    assert first.returncode == -9  # SIGKILL after step 12; last checkpoint at step 10
    last_alive = last_sign_of_life(tmp_path / "ck", attempt=1, step=12)
    assert last_alive <= t1
    time.sleep(3.0)  # down: no attempt runs
    t2 = time.time()
    proc = subprocess.Popen(args, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    second_start = process_start_unix_of(proc.pid)  # read off /proc while it runs
    stdout, stderr = proc.communicate(timeout=600)
    t3 = time.time()
    assert proc.returncode == 0, stderr[-3000:]
    assert t2 - START_TICK_S <= second_start <= t3
    run = only_run()
    assert run.info.status == "FINISHED"
    m = run.data.metrics
    assert (m[names.SUM_ATTEMPTS], m[names.SUM_FAILURES]) == (2.0, 1.0)
    # down time (docs/time.md): the killed attempt's last sign of life (its heartbeat after step 12,
    # read from its checkpoint folder before the second attempt started) to the second attempt's
    # process start (read off /proc here): those two, to the tick
    assert m[names.SUM_BADPUT_DOWN_S] == pytest.approx(second_start - last_alive, abs=START_TICK_S)
    gap = t2 - t1
    # the job's wall time covers the first attempt, the gap and the second attempt's run
    assert (t1 - t0) + gap < m[names.SUM_WALL_S] <= t3 - t0
    assert run.data.tags[names.RESUMED_FROM] == "10" and run.data.tags[names.RESUME_ATTEMPTS] == "2"
    tokens = history(run, names.TRAIN_TOKENS)
    assert [s for s, _ in tokens] == list(range(1, 17))           # each step once
    assert [v for _, v in tokens] == [128.0 * s for s in range(1, 17)]  # counters continuous
    assert [s for s, _ in history(run, names.TRAIN_LOSS)] == list(range(1, 17))
    # the crashed attempt ran 2 steps past its step-10 checkpoint: lost progress, counted once
    assert 0 < m["summary/badput_lost_progress_s"] < m[names.SUM_WALL_S]
    assert parts_add_up(m) == pytest.approx(m[names.SUM_WALL_S], rel=1e-9)
    # consumption never rolls back: codecarbon's estimate continues from the crashed attempt's step 12
    ram = history(run, names.ENERGY_ESTIMATE_RAM_KWH)
    assert all(b >= a for (_, a), (_, b) in zip(ram, ram[1:])), ram
    assert ram[-1][1] > dict(ram)[12] > 0


def test_cpu_run_logs_cost_identity_and_never_reports_an_estimate_as_measured(tracking_uri):
    out = run_training(TrainConfig(max_steps=6, log_every_n_steps=3, seq_len=32, micro_batch_size=2,
                                   device_hour_usd=2.5))
    run = only_run()
    m, tags = run.data.metrics, run.data.tags
    # cost = price x devices x wall hours, per 1e9 tokens, with the run's own wall_s and tokens
    assert m[names.SUM_USD_PER_BTOK] == pytest.approx(2.5 * 1 * m[names.SUM_WALL_S] / 3600 / m[names.SUM_TOKENS] * 1e9)
    assert tags[names.COST_SOURCE] == "user (device_hour_usd)" and tags[names.COST_DEVICE_HOUR_USD] == "2.5"
    assert [s for s, _ in history(run, names.COST_TOTAL_USD)] == [3, 6]  # once per logged step
    if tags[names.ENERGY_SOURCE] in ("rapl",):  # a machine with readable RAPL measures the CPU package
        assert m[names.ENERGY_TOTAL_KWH] > 0
    else:  # no counter here: the estimate (codecarbon is a dependency) is kept apart and tagged, nothing
        # is reported as measured
        assert tags[names.ENERGY_SOURCE] == "codecarbon_estimate"
        assert names.ENERGY_TOTAL_KWH not in m and names.CARBON_TOTAL_KG not in m
        assert names.SUM_J_PER_TOKEN not in m
        assert m[names.CARBON_ESTIMATE_KG] > 0 and "estimate" in tags[names.ENERGY_WHY]
    assert float(tags[names.CARBON_INTENSITY]) > 0
    assert out["summary"][names.SUM_TOKENS] == 6 * 2 * 32
    # no checkpoint folder: no job to count attempts over, said why (never a made-up attempts = 1)
    assert names.SUM_ATTEMPTS not in m and tags[names.RELIABILITY_WHY].startswith("no checkpoint_dir: no job ledger")


@pytest.mark.slow
def test_time_to_quality_logged_at_first_step_reaching_target(tracking_uri, shared_data):
    corpus = str(shared_data / "corpus" / "tinyshakespeare.txt")
    run_training(TrainConfig(dataset=corpus, max_steps=30, learning_rate=3e-3, eval_every=10, eval_tasks="hellaswag",
                             eval_limit=8, eval_data_dir=str(shared_data),
                             targets="val_loss<=3.5,hellaswag/acc_norm>=0.99"))
    run = only_run()
    val = history(run, names.EVAL_VAL_LOSS)
    first = next(s for s, v in val if v <= 3.5)  # bytes: ~3.9 at step 10, ~3.3 at step 20
    stem = "val_loss_le_3.5"
    wall = history(run, f"ttq/{stem}_wall_s")
    assert [s for s, _ in wall] == [first]
    m = run.data.metrics
    assert m[f"ttq/{stem}_tokens"] == first * 8 * 128
    assert 0 < m[f"ttq/{stem}_train_s"] < m[f"ttq/{stem}_wall_s"]  # eval time is in wall, not in train
    assert m[f"ttq/{stem}_device_hours"] == pytest.approx(m[f"ttq/{stem}_wall_s"] / 3600)
    assert run.data.tags[f"llmeff.ttq.{stem}"] == f"reached_at_step_{first}"
    assert run.data.tags["llmeff.ttq.hellaswag_acc_norm_ge_0.99"] == "not_reached"
    assert not any(k.startswith("ttq/hellaswag") for k in m)
    assert [s for s, _ in history(run, names.EVAL_HELLASWAG_ACC_NORM)] == [10, 20, 30]
    # which documents: llmeff eval --limit 8 --subset-seed 0 scores the same ones
    assert run.data.tags[names.EVAL_DOCUMENTS] == "8 drawn with seed 0"


def test_mfu_above_one_is_reported_not_clipped(tracking_uri):
    # A 10 MFLOP/s "peak" on this CPU is an input error: MFU comes out far above 1 (a 1 GFLOP/s one
    # gave 0.97 on a loaded 2-core machine: the step itself ran below 1 GFLOP/s).
    out = run_training(TrainConfig(max_steps=8, log_every_n_steps=4, seq_len=32, micro_batch_size=2,
                                   peak_tflops=1e-5))
    run = only_run()
    mfu = history(run, names.TPUT_DEVICE_MFU)
    assert mfu and all(v > 1.0 for _, v in mfu)
    assert out["summary"][names.SUM_MFU] > 1.0
    assert "> 1 is impossible" in run.data.tags[names.MFU_WARNING]
    assert run.data.tags[names.PEAK_SOURCE].startswith("user")
    # HFU counts the same step's executed FLOPs: at least the model FLOPs
    assert out["summary"][names.SUM_HFU] >= out["summary"][names.SUM_MFU] * 0.99


def test_failure_inside_training_ends_the_run_failed(tracking_uri, monkeypatch):
    from mlflow_llmeff.train.loop import RAISE_AT_STEP_ENV

    monkeypatch.setenv(RAISE_AT_STEP_ENV, "3")
    with pytest.raises(RuntimeError, match="injected failure"):
        run_training(TrainConfig(max_steps=6, log_every_n_steps=1, seq_len=32, micro_batch_size=2))
    run = only_run()
    assert run.info.status == "FAILED"
    assert [s for s, _ in history(run, names.TRAIN_TOKENS)] == [1, 2, 3]  # what was measured is kept
    assert run.data.tags[names.ERROR] == "RuntimeError: LLMEFF_FAULT_RAISE_AT_STEP=3: injected failure"
    assert run.data.tags["mlflow.note.content"] == "Failed: " + run.data.tags[names.ERROR]


def test_missing_eval_data_is_rejected_before_any_run_starts(tracking_uri, tmp_path):
    with pytest.raises(ValueError, match=r"hellaswag_val.jsonl: file not found in the data directory"):
        run_training(TrainConfig(eval_tasks="hellaswag", eval_data_dir=str(tmp_path)))
    assert mlflow.MlflowClient().search_runs(["0"]) == []


@pytest.mark.slow
def test_compile_really_compiles_and_its_time_is_compile_badput(tracking_uri):
    out = run_training(TrainConfig(max_steps=6, log_every_n_steps=3, seq_len=32, micro_batch_size=2, compile=True,
                                   peak_tflops=1.0))
    s = out["summary"]
    # Inductor compilation takes seconds on CPU; an uncompiled warm-up of this model takes well under one.
    assert s[names.SUM_BADPUT["compile"]] > 2.0 and names.SUM_BADPUT["warmup"] not in s
    run = only_run()
    assert run.data.tags[names.HFU_METHOD].startswith("analytic: compile=true")
    # no recomputation; the causal sdpa kernel computes the score triangle s(s+1)/2, not palm's square:
    # 677,760 hardware FLOPs per token at s = 32 against megatron's 676,992 (tests/test_lora.py's hand count)
    assert s[names.SUM_HFU] == pytest.approx(s[names.SUM_MFU] * 677_760 / 676_992)


def parts_add_up(m: dict) -> float:
    """productive + every badput category, to compare with summary/wall_s."""
    return m[names.SUM_GOODPUT] * m[names.SUM_WALL_S] + sum(m.get(k, 0.0) for k in names.SUM_BADPUT.values())


@pytest.mark.slow
def test_evals_during_training_stay_out_of_tokens_per_sec(tracking_uri, monkeypatch):
    # The case: llama-tiny, seq_len=64, micro_batch_size=4, 12 steps logged every 4; B evaluates
    # every 4 steps. Before: B 79 tokens/s against A's 1,312, and B's parts summed to 82.4 s of a 57.8 s wall.
    # Each evaluation is made 0.5 s longer (a sleep: the injected cost is known, the machine's noise is
    # not in it). The ledger is in one state at a time and its parts add up to the wall exactly, so
    # eval badput holding at least the injected 0.5 s per eval says none of it went into a step: the
    # steps' seconds, the denominator of tokens/s, are what is left. (On a fake clock, exactly:
    # tests/test_monitor.py.)
    import time as time_

    from mlflow_llmeff.train import evaluate as ev

    inner, extra_s = ev.evaluate, 0.5

    def slow_evaluate(cfg, t):
        time_.sleep(extra_s)
        return inner(cfg, t)

    monkeypatch.setattr(ev, "evaluate", slow_evaluate)
    common = dict(seq_len=64, micro_batch_size=4, max_steps=12, log_every_n_steps=4)
    a = run_training(TrainConfig(**common))["summary"]
    b = run_training(TrainConfig(**common, eval_every=4, targets="val_loss<=+9.5"))["summary"]
    assert a[names.SUM_BADPUT["eval"]] >= extra_s and b[names.SUM_BADPUT["eval"]] >= 3 * extra_s  # 1 and 3 evals
    for s in (a, b):
        # 256 tokens a step (packed), 9 steady steps (12 - 3 warm-up): tokens/s is over step seconds only
        steady_s = 9 * 256 / s[names.SUM_TOKENS_PER_SEC]
        assert steady_s == pytest.approx(9 * s[names.SUM_STEP_TIME_S], rel=1e-9)
        assert steady_s <= s[names.SUM_WALL_S] - s[names.SUM_BADPUT["eval"]] - s[names.SUM_BADPUT["init"]]
    assert b[names.SUM_BADPUT["eval"]] > a[names.SUM_BADPUT["eval"]] > 0  # A evaluates once, at the end
    for s in (a, b):
        assert parts_add_up(s) == pytest.approx(s[names.SUM_WALL_S], rel=1e-9)
    runs = mlflow.MlflowClient().search_runs(["0"], order_by=["attributes.start_time DESC"])
    m = runs[0].data.metrics  # run B: the +9.5 target, reached at its first eval, lost no key
    assert [s for s, _ in history(runs[0], "ttq/val_loss_le_9.5_wall_s")] == [4]
    assert all(k in m for k in b)
    assert [s for s, _ in history(runs[0], names.EVAL_VAL_LOSS)] == [4, 8, 12]


@pytest.mark.slow
def test_sigterm_ends_the_run_killed_with_its_points(tracking_uri, tmp_path):
    from mlflow_llmeff.train.loop import SIGTERM_AT_STEP_ENV

    args = [sys.executable, "-m", "mlflow_llmeff", "train", "--max-steps", "20", "--log-every-n-steps", "4",
            "--seq-len", "32", "--micro-batch-size", "2"]
    r = subprocess.run(args, cwd=tmp_path, env={**env_for(tracking_uri), SIGTERM_AT_STEP_ENV: "6"},
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 143, r.stderr[-2000:]
    run = only_run()
    assert run.info.status == "KILLED" and run.info.end_time is not None
    assert run.data.tags[names.ERROR] == "stopped by SIGTERM"
    assert history(run, names.TRAIN_TOKENS) == [(4, 256.0), (6, 384.0)]  # the tail after step 4 flushed
    assert run.data.metrics[names.SUM_STEPS] == 6.0


def test_saved_model_is_the_trained_weights_and_llmeff_eval_scores_it(tracking_uri, tmp_path):
    import torch
    from click.testing import CliRunner
    from transformers import AutoModelForCausalLM

    from mlflow_llmeff.cli import main

    out_dir = tmp_path / "model"
    out = run_training(TrainConfig(max_steps=3, log_every_n_steps=3, seq_len=32, micro_batch_size=2,
                                   save_model=str(out_dir), checkpoint_dir=str(tmp_path / "ckpt")))
    assert out["summary"][names.SUM_STEPS] == 3
    saved = AutoModelForCausalLM.from_pretrained(out_dir)
    # the same weights as the run's last checkpoint (Accelerate's state of step 3)
    from safetensors.torch import load_file

    (step_dir,) = (tmp_path / "ckpt").glob("step_*")  # checkpoint_every=0: the end only
    ckpt = load_file(str(step_dir / "model.safetensors"))
    seen = {name: torch.equal(p, ckpt[name]) for name, p in saved.state_dict().items() if name in ckpt}
    assert len(seen) >= 10 and all(seen.values())
    res = CliRunner().invoke(main, ["eval", "--model", str(out_dir), "--tasks", "hellaswag", "--limit", "3",
                                    "--data-dir", eval_fixture_dir()])
    assert res.exit_code == 0, res.output
    assert "3 documents" in res.output


@pytest.mark.slow
def test_a_fresh_mlflow_run_with_quoted_string_params_has_no_changed_params(tracking_uri, tmp_path):
    # MLflow Projects logs -P string values shell-quoted ('my run'); the entrypoint gets them unquoted
    r = subprocess.run([sys.executable, "-m", "mlflow", "run", str(REPO), "--env-manager", "local",
                        "-P", "run_name=my run", "-P", "targets=val_loss<=99", "-P", "max_steps=6",
                        "-P", "log_every_n_steps=3", "-P", "eval_every=3", "-P", "val_blocks=2"],
                       cwd=tmp_path, env=env_for(tracking_uri), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    run = only_run()
    assert run.data.params["run_name"] == "'my run'" and run.info.run_name == "my run"
    assert names.RESUME_CHANGED not in run.data.tags, run.data.tags.get(names.RESUME_CHANGED)
    assert run.data.tags[names.TTQ_TAG_PREFIX + "val_loss_le_99"].startswith("reached_at_step_")
