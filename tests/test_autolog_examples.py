"""The example scripts, run as users run them (a subprocess each), with only the autolog line added.

Each must give exactly one run with the standard metrics and condition tags, and ``train/tokens``
equal to the non-padding tokens the script fed (hand-computed in each script's docstring).
"""

from __future__ import annotations

import os
import subprocess
import sys

import mlflow
import pytest

from mlflow_llmeff import names

from conftest import REPO, empty_store

EXAMPLES = REPO / "examples"
OUR_PREFIXES = ("train/", "throughput/", "summary/", "memory/", "energy/", "cost/", "carbon/", "eval/")


def run_script(args: list[str], uri: str, timeout: int = 240) -> str:
    """Run an example; returns its stderr."""
    env = dict(os.environ, MLFLOW_TRACKING_URI=uri, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    env.pop("MLFLOW_RUN_ID", None)
    r = subprocess.run(args, env=env, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "llmeff: run " not in r.stdout  # the user's stdout is their program's
    return r.stderr


def only_run(uri: str):
    mlflow.set_tracking_uri(uri)
    runs = mlflow.MlflowClient().search_runs([e.experiment_id for e in mlflow.search_experiments()])
    assert len(runs) == 1, [r.info.run_name for r in runs]
    return runs[0]


def assert_standard(run, tokens: int, count: str, strategy: str, integration: str) -> None:
    m, t = run.data.metrics, run.data.tags
    assert run.info.status == "FINISHED"
    assert m[names.TRAIN_TOKENS] == tokens and m[names.SUM_TOKENS] == tokens
    for key in (names.TPUT_TOKENS, names.TPUT_DEVICE_TOKENS, names.TPUT_DEVICE_TFLOPS, names.TRAIN_STEP_TIME_S,
                names.SUM_TOKENS_PER_SEC, names.SUM_DEVICE_TFLOPS, names.SUM_STEP_TIME_S, names.SUM_WALL_S):
        assert key in m, key
    assert (t[names.ACCEL_SHORT], t[names.ACCEL_COUNT], t[names.PAR_STRATEGY]) == ("cpu", count, strategy)
    assert t[names.AUTOLOG_INTEGRATION] == integration
    assert t[names.PEAK_SOURCE].startswith("unknown") and names.SUM_MFU not in m  # CPU: no datasheet peak
    for key in (names.V_TORCH, names.V_MLFLOW, names.PRECISION, names.MODEL_PARAMS, names.WARMUP_STEPS):
        assert key in t, key


def assert_closing_line(stderr: str, run) -> None:
    """One closing line (main rank only) naming the run and its steady tokens/s as logged."""
    lines = [line for line in stderr.splitlines() if line.startswith("llmeff: run ")]
    tps = run.data.metrics[names.SUM_TOKENS_PER_SEC]
    steps, tokens = int(run.data.metrics[names.SUM_STEPS]), int(run.data.metrics[names.SUM_TOKENS])
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"llmeff: run {run.info.run_name} ({run.info.run_id}): {steps} steps, "
                               f"{tokens:,} tokens, {tps:,.0f} tokens/s steady state "), lines[0]


def assert_no_duplicate_points(run) -> list[str]:
    client = mlflow.MlflowClient()
    ours = [k for k in run.data.metrics if k.startswith(OUR_PREFIXES)]
    for key in ours:
        steps = [p.step for p in client.get_metric_history(run.info.run_id, key)]
        assert len(steps) == len(set(steps)), (key, steps)
    return ours


def test_plain_pytorch_example(tmp_path):
    uri = empty_store(tmp_path / "mlflow.db")
    err = run_script([sys.executable, str(EXAMPLES / "plain_pytorch.py")], uri)
    run = only_run(uri)
    assert_standard(run, 394, "1", "single", "pytorch")  # 2 epochs x 197 bytes
    assert_closing_line(err, run)
    assert run.data.metrics[names.TRAIN_PADDED_TOKENS] == 436  # 2 x (50 + 64 + 54 + 50)
    assert run.data.metrics[names.TRAIN_LOSS_TOKENS] == 378  # 394 - 16 sequences
    # each batch padded to its longer sentence, 25, 32, 27, 25 bytes: no fixed length, no gbt/s parts
    assert (run.data.tags[names.SEQ_LEN], run.data.tags[names.SEQ_LEN_RANGE]) == ("dynamic", "25-32")
    assert run.info.run_name == "llama-fp32-cpu"
    assert_no_duplicate_points(run)


@pytest.mark.slow
def test_accelerate_example_one_process(tmp_path):
    uri = empty_store(tmp_path / "mlflow.db")
    err = run_script([sys.executable, str(EXAMPLES / "accelerate_loop.py")], uri)
    run = only_run(uri)
    assert_standard(run, 1536, "1", "single", "accelerate")  # 6 steps x 2 x 4 x 32
    assert_closing_line(err, run)
    assert run.data.tags[names.GRAD_ACCUM] == "2" and run.data.metrics[names.SUM_STEPS] == 6


@pytest.mark.slow
def test_accelerate_example_ddp_two_cpu_processes_one_run_tokens_summed(tmp_path):
    uri = empty_store(tmp_path / "mlflow.db")
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           str(EXAMPLES / "accelerate_loop.py")]
    os.environ.setdefault("ACCELERATE_USE_CPU", "1")
    try:
        err = run_script(cmd, uri, timeout=300)
    finally:
        os.environ.pop("ACCELERATE_USE_CPU", None)
    run = only_run(uri)
    assert_standard(run, 3072, "2", "ddp", "accelerate")  # 2 processes x 1536
    assert_closing_line(err, run)
    assert run.data.metrics[names.SUM_STEPS] == 6  # optimizer steps, not steps x ranks
    assert_no_duplicate_points(run)


@pytest.fixture(scope="module")
def hf_trainer(tmp_path_factory):
    """``examples/hf_trainer.py`` run twice as a user repeats it, into one store: ``--report-to mlflow`` (the
    Trainer's own MLflow callback starts the run), then ``--report-to none`` (autolog starts it). Each
    launch's stderr, the ids of the runs it added to the store, and the store's URI. The three tests below
    read these two launches (they each ran the same script before: 4 launches of it, now 2)."""
    folder = tmp_path_factory.mktemp("hf_trainer")
    uri = empty_store(folder / "mlflow.db")
    client, seen, out = mlflow.MlflowClient(uri), set(), {}
    for report_to in ("mlflow", "none"):
        err = run_script([sys.executable, str(EXAMPLES / "hf_trainer.py"), "--report-to", report_to], uri)
        ids = {r.info.run_id for r in client.search_runs([e.experiment_id for e in client.search_experiments()])}
        out[report_to] = (err, sorted(ids - seen))
        seen |= ids
    return uri, out


def hf_trainer_run(hf_trainer, report_to: str):
    """The one run the launch ``--report-to report_to`` of :func:`hf_trainer` added (and its stderr)."""
    uri, out = hf_trainer
    err, new = out[report_to]
    assert len(new) == 1, new  # the launch made exactly one run
    mlflow.set_tracking_uri(uri)
    return mlflow.MlflowClient().get_run(new[0]), err


@pytest.mark.slow
def test_hf_trainer_with_its_own_mlflow_callback_one_run_no_duplicate_points(hf_trainer):
    run, err = hf_trainer_run(hf_trainer, "mlflow")
    assert_standard(run, 394, "1", "single", "trainer")  # 8 steps = 2 epochs x 197 bytes
    assert_closing_line(err, run)
    ours = assert_no_duplicate_points(run)
    assert "loss" in run.data.metrics  # the Trainer's own callback logged into the same run
    trainer_keys = set(run.data.metrics) - set(ours)
    assert not trainer_keys & set(ours)
    client = mlflow.MlflowClient()
    assert [p.step for p in client.get_metric_history(run.info.run_id, names.TRAIN_LOSS)] == [2, 4, 6, 8]


@pytest.mark.slow
def test_hf_trainer_without_mlflow_reporting_gets_its_own_run(hf_trainer):
    run, err = hf_trainer_run(hf_trainer, "none")
    assert_standard(run, 394, "1", "single", "trainer")
    assert_closing_line(err, run)
    assert "loss" not in run.data.metrics


@pytest.mark.slow
def test_the_trainers_own_run_and_autologs_run_share_the_configurations_name(hf_trainer):
    """The HF Trainer's run is named from its configuration, with or without the Trainer's own MLflow callback.

    The trial (issue 31): ``examples/hf_trainer.py --report-to mlflow`` gave a random MLflow name
    (``overjoyed-slug-911``: the Trainer's callback starts the run with ``run_name=None``), while the
    same script without the callback gave ``llama-fp32-cpu``, without the batch parts a run of
    ``llmeff train`` has (they are known at the end of the first step, and the run is named again
    then). Both paths must give the one stem of the configuration, with a suffix for the repeat.
    (It was tests/test_trainer_name.py, which launched the script twice more.)
    """
    uri, _ = hf_trainer
    runs = mlflow.MlflowClient(uri).search_runs(["0"], order_by=["attributes.start_time ASC"])
    # the collator pads each batch to its longest row (23 to 32 bytes): the sequence length and the global
    # batch are no condition, so no gbt/s parts (they were the first step's, 'gbt46-s23', whichever
    # sentences the shuffle put first, until a trial split repeats of one script into configurations)
    assert [r.info.run_name for r in runs] == ["llama-fp32-cpu", "llama-fp32-cpu-2"]
    assert {r.data.tags[names.SEQ_LEN] for r in runs} == {"dynamic"}
    assert "loss" in runs[0].data.metrics  # the first is the Trainer's own run (its callback logged into it)
