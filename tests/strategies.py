"""What tests/test_strategies.py and tests/test_strategies_zero.py share: every parallelism strategy that
runs on CPU, over gloo, against one single-process run.

Each strategy trains llama-tiny for 6 steps with the same global batch (8 sequences of 32 tokens)
and seed as the single-process reference, in fp32, and is launched once (the command ``llmeff
train`` runs), all its assertions sharing that run: one FINISHED MLflow run, the degree tags,
tokens counted once per data-parallel rank, the first 5 training losses equal to the reference's
(relative 1e-5: only the order of floating-point sums differs), the validation loss and benchmark
scores of the end-of-run eval equal too, the model state per device as the sharding says, and the
measured communication. FSDP is the run killed between checkpoints and resumed. Data order is one
global batch split over the data-parallel ranks (train/batches.py), which is what makes the losses
comparable across layouts.

The strategies are split over two test files so that pytest-xdist's two workers launch them side by
side (``--dist loadfile`` gives a file to one worker); the single-process reference is trained once
per session (:func:`reference`) and read by both.
"""

from __future__ import annotations

import os
import subprocess
import sys

import mlflow
import pytest

from mlflow_llmeff import names
from mlflow_llmeff.planning.plan import make_plan, model_state_bytes, parameter_split
from mlflow_llmeff.models.presets import load_config
from mlflow_llmeff.train.config import TrainConfig
from mlflow_llmeff.train import faults
from mlflow_llmeff.train.loop import KILL_AT_STEP_ENV

from conftest import require
from eval_fixtures import eval_fixture_dir

P = 125_632  # llama-tiny parameters
REL = 1e-5   # relative tolerance of losses and scores (fp32, different reduction orders)
# Model state per device, measured / the plan's prediction (``llmeff plan``), one tolerance for every
# strategy (bench/parallel.py uses the same): the plan divides the state exactly, the engines hold a
# little more. FSDP2 pads uneven dim-0 shards (rank 0 holds the odd row of the 259-row embedding and
# LM head: +0.1% at 2 ranks), HSDP and 2-D the same in their shard groups, DeepSpeed aligns its flat
# partitions; DDP and TP hold exactly the prediction. ZeRO-3's tensors of at most
# stage3_param_persistence_threshold (DeepSpeed's default 1e5) elements, whole on every rank, are in
# the plan (planning/plan.py persistent_param_count): every llama-tiny tensor is one.
STATE_REL = 0.01
SEQ, GLOBAL_SEQS, STEPS = 32, 8, 6
BASE = dict(model="llama-tiny", dataset="synthetic", seq_len=SEQ, max_steps=STEPS, log_every_n_steps=1,
            warmup_steps=3, measure_energy="none", val_blocks=8, eval_tasks="mmlu_anatomy,hellaswag",
            eval_limit=1, precision="fp32", seed=0)  # one document a task: a TP forward is 14 gloo all-reduces
EVAL_KEYS = ("eval/val_loss", "eval/mmlu_anatomy/acc", "eval/hellaswag/acc", "eval/hellaswag/acc_norm")

# strategy -> (settings, expected (dp, dp_shard, dp_replicate, tp))
CASES = {
    "ddp": (dict(num_processes=2, micro_batch_size=4), (2, 1, 2, 1)),
    "hsdp": (dict(num_processes=4, dp_shard=2, micro_batch_size=2), (4, 2, 2, 1)),
    "tp": (dict(num_processes=2, micro_batch_size=8), (1, 1, 1, 2)),
    "fsdp_tp": (dict(num_processes=4, tp_size=2, micro_batch_size=4), (2, 2, 1, 2)),
    "deepspeed_zero1": (dict(num_processes=2, micro_batch_size=4), (2, 2, 1, 1)),
    "deepspeed_zero2": (dict(num_processes=2, micro_batch_size=4), (2, 2, 1, 1)),
    "deepspeed_zero3": (dict(num_processes=2, micro_batch_size=4), (2, 2, 1, 1)),
}


def _has_deepspeed() -> bool:
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        return False
    return True


def make_template_db(tmp_path_factory):
    """An empty MLflow sqlite store, copied for every launch (creating the tables costs seconds)."""
    path = tmp_path_factory.mktemp("template") / "mlflow.db"
    mlflow.MlflowClient(f"sqlite:///{path}").search_experiments()
    return path


def store(template_db, folder, name: str) -> str:
    import shutil

    path = folder / f"{name}.db"
    shutil.copy(template_db, path)
    return f"sqlite:///{path}"


def config(strategy: str, **kw) -> TrainConfig:
    from conftest import free_port

    return TrainConfig(**{**BASE, "eval_data_dir": eval_fixture_dir(), "parallelism": strategy,
                          "experiment_name": f"strategy-{strategy}", "main_process_port": free_port(), **kw})


def the_run(uri: str, experiment: str):
    client = mlflow.MlflowClient(uri)
    exp = client.get_experiment_by_name(experiment)
    runs = client.search_runs([exp.experiment_id])
    assert len(runs) == 1, [r.info.run_name for r in runs]  # one MLflow run, however many processes
    return runs[0]


def history(run, key, uri):
    return sorted((m.step, m.value) for m in mlflow.MlflowClient(uri).get_metric_history(run.info.run_id, key))


def command(cfg: TrainConfig, cli: bool) -> tuple[list[str], dict]:
    """``llmeff train`` itself (``cli``), or the ``accelerate launch`` of the loop it makes."""
    from mlflow_llmeff.planning.spec import Machine, resolve
    from mlflow_llmeff.train.launch import accelerate_command

    if cli:
        args = [a for k, v in cfg.to_params().items() for a in (f"--{k.replace('_', '-')}", v)]
        return [sys.executable, "-m", "mlflow_llmeff", "train", *args], dict(os.environ)
    return accelerate_command(resolve(cfg, Machine(cuda=False, bf16=True)))


class Launches:
    """Every strategy's launch, two at a time (the processes are single-threaded; the 2 cores would
    otherwise idle while one launch imports and the other waits), each into its own store."""

    def __init__(self, template_db, folder):
        self.template_db, self.folder = template_db, folder
        self.jobs: list[tuple[str, TrainConfig, dict, bool]] = []
        self.done: dict[str, tuple[subprocess.CompletedProcess, str, TrainConfig]] = {}
        self.uris: dict[str, str] = {}
        self.started: dict[str, float] = {}
        self.seconds: dict[str, float] = {}  # wall seconds of each launch (printed with -s)

    def add(self, name: str, cfg: TrainConfig, env: dict | None = None, cli: bool = False, uri: str | None = None):
        self.uris[name] = uri or store(self.template_db, self.folder, name)
        self.jobs.append((name, cfg, env or {}, cli))

    def run(self, then=None, slots: int = int(os.environ.get("LLMEFF_TEST_LAUNCH_SLOTS", "2"))) -> None:
        import time

        running: list = []
        while self.jobs or running:
            while self.jobs and len(running) < slots:
                name, cfg, env_extra, cli = self.jobs.pop(0)
                cmd, env = command(cfg, cli)
                env = {**env, "OMP_NUM_THREADS": "1", "MLFLOW_TRACKING_URI": self.uris[name], **env_extra}
                env.pop("MLFLOW_RUN_ID", None)
                self.started[name] = time.perf_counter()
                running.append((name, cfg, subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                                            stderr=subprocess.PIPE, text=True)))
            for item in list(running):
                name, cfg, p = item
                if p.poll() is None:
                    continue
                out, err = p.communicate()
                self.done[name] = (subprocess.CompletedProcess(p.args, p.returncode, out, err), self.uris[name], cfg)
                self.seconds[name] = time.perf_counter() - self.started[name]
                running.remove(item)
                if then:
                    then(name, self)
            time.sleep(0.2)



def _train_reference(template_db, folder) -> dict:
    """The single-process run of :data:`BASE` in this process: its training losses and end-of-run scores."""
    from mlflow_llmeff.train.loop import run_training

    ref_uri = store(template_db, folder, "single")
    mlflow.set_tracking_uri(ref_uri)
    os.environ["MLFLOW_TRACKING_URI"] = ref_uri
    try:
        run_training(config("single", num_processes=1, micro_batch_size=GLOBAL_SEQS))
    finally:
        mlflow.set_tracking_uri(None)
        os.environ.pop("MLFLOW_TRACKING_URI", None)
    run = the_run(ref_uri, "strategy-single")
    assert run.data.tags[names.PAR_STRATEGY] == "single"
    return {"loss": [v for _, v in history(run, names.TRAIN_LOSS, ref_uri)],
            "eval": {k: run.data.metrics[k] for k in EVAL_KEYS}}


def reference(template_db, folder, tmp_path_factory) -> dict:
    """The single-process reference, trained once per session: under pytest-xdist the first worker to
    ask trains it (the other waits on a lock in the workers' shared base folder) and writes it as JSON
    (floats round-trip exactly), which the other reads; without workers it is trained here. It is
    deterministic (seed 0, fp32, one thread), so one training serves every file."""
    import fcntl
    import json

    if "PYTEST_XDIST_WORKER" not in os.environ:
        return _train_reference(template_db, folder)
    shared = tmp_path_factory.getbasetemp().parent  # popen-gwN's parent: this session's, both workers'
    path = shared / "strategy-reference.json"
    with open(shared / "strategy-reference.lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if not path.exists():
                path.write_text(json.dumps(_train_reference(template_db, folder)))
            return json.loads(path.read_text())
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def launch(request, template_db, tmp_path_factory, module: str):
    """Launch the strategies the session selected from test module ``module`` (all of its cases by
    default; the FSDP kill and resume when its test is selected), two at a time, and get the
    single-process reference (:func:`reference`) meanwhile: ``(reference, {name: (completed process,
    store URI, config)}, folder)``."""
    folder = tmp_path_factory.mktemp("strategies")
    mine = [item for item in request.session.items if item.module.__name__ == module]
    wanted = {item.callspec.params["strategy"] for item in mine if hasattr(item, "callspec")}
    resume = any(item.name.startswith("test_fsdp_killed") for item in mine)
    jobs = Launches(template_db, folder)
    if resume:
        ck = folder / "fsdp-ck"
        # rank 1 SIGKILLed after step 4, through llmeff train (its launcher records which rank was lost)
        jobs.add("fsdp-killed", config("fsdp", num_processes=2, micro_batch_size=4, checkpoint_dir=str(ck),
                                       checkpoint_every=3), {KILL_AT_STEP_ENV: "4", faults.RANK_ENV: "1"}, cli=True)
    for strategy in CASES:
        if strategy in wanted and (not strategy.startswith("deepspeed") or _has_deepspeed()):
            jobs.add(strategy, config(strategy, **CASES[strategy][0]))

    def resume_after_kill(name, jobs):
        if name == "fsdp-killed":  # the same run again, as a user reruns it (llmeff train), into the same store
            jobs.add("fsdp", jobs.done[name][2], cli=True, uri=jobs.uris[name])
            jobs.jobs.insert(0, jobs.jobs.pop())

    import threading

    worker = threading.Thread(target=jobs.run, kwargs={"then": resume_after_kill})
    worker.start()
    try:
        ref = reference(template_db, folder, tmp_path_factory)
    finally:
        worker.join()
    print("launch seconds:", {k: round(v) for k, v in jobs.seconds.items()})
    return ref, jobs.done, folder


def check_run(run, uri, strategy: str, degrees: tuple[int, int, int, int], world: int, reference: dict) -> None:
    """The assertions every strategy's run shares."""
    tags, m = run.data.tags, run.data.metrics
    assert run.info.status == "FINISHED"
    assert tags[names.PAR_STRATEGY] == strategy and tags[names.ACCEL_COUNT] == str(world)
    dp, dp_shard, dp_replicate, tp = degrees
    assert (tags[names.PAR_DP], tags[names.PAR_DP_SHARD], tags[names.PAR_DP_REPLICATE], tags[names.PAR_TP],
            tags[names.PAR_PP], tags[names.PAR_CP]) == (str(dp), str(dp_shard), str(dp_replicate), str(tp), "1", "1")
    assert dp * tp == world  # dp x tp x pp x cp = world size
    # tokens once per data-parallel rank: 8 sequences x 32 tokens per step, whatever the layout
    assert history(run, names.TRAIN_TOKENS, uri) == [(s, float(s * GLOBAL_SEQS * SEQ)) for s in range(1, STEPS + 1)]
    assert tags[names.GLOBAL_BATCH_TOKENS] == str(GLOBAL_SEQS * SEQ)
    losses = [v for _, v in history(run, names.TRAIN_LOSS, uri)]
    assert losses[:5] == pytest.approx(reference["loss"][:5], rel=REL)
    for k in EVAL_KEYS:  # the same scores: validation loss, MMLU, HellaSwag
        assert m[k] == pytest.approx(reference["eval"][k], rel=REL), k
    # communication: measured at start (gloo: no link peak, said why) and on sampled warm-up steps
    for key in (names.COMM_ALLREDUCE_BUSBW, names.COMM_ALLGATHER_BUSBW, names.COMM_REDUCESCATTER_BUSBW):
        assert m[key] > 0, key
    assert names.COMM_BUSBW_UTIL not in m and tags[names.COMM_PEAK_GBPS] == "unknown"
    assert tags[names.COMM_PEAK_SOURCE].startswith("unknown: gloo")
    assert 0 <= m[names.SUM_COMM_EXPOSED] <= 1
    assert "bytes counted on step" in tags[names.COMM_SAMPLED]


def expected_state_bytes_per_param(strategy: str, world: int, **kw) -> float:
    split = parameter_split(load_config("llama-tiny"))
    persistent = P if strategy == "deepspeed_zero3" else 0  # every llama-tiny tensor is under 1e5 elements
    return sum(model_state_bytes(P, strategy, world, tp_params=split["tensor_parallel"], precision="fp32",
                                 persistent_params=persistent, **kw)) / P


def assert_state_as_planned(run, cfg: TrainConfig, strategy: str) -> None:
    """Measured ``summary/model_state_bytes_per_param`` = the plan's weights + gradients + optimizer
    bytes per device / its parameters, within :data:`STATE_REL`."""
    plan = make_plan(cfg, accelerator_short="cpu", precision="fp32", strategy=strategy)
    predicted = (plan["memory_weights_gib"] + plan["memory_gradients_gib"] + plan["memory_optimizer_gib"]) \
        * 2**30 / plan["params_total"]
    measured = run.data.metrics[names.SUM_MODEL_STATE_BYTES_PER_PARAM]
    assert measured / predicted == pytest.approx(1.0, abs=STATE_REL), (strategy, measured, predicted)


def run_config(launched, name) -> TrainConfig:
    return launched[1][name][2]


def finished(launched, name):
    reference, done, _ = launched
    r, uri, cfg = done[name]
    assert r.returncode == 0, r.stderr[-4000:]
    return reference, the_run(uri, cfg.experiment_name), uri


def check_strategy(strategy: str, launched) -> None:
    """Every assertion of one strategy's launch against the reference."""
    if strategy.startswith("deepspeed"):  # skips locally, fails under CI (.ci/run installs it)
        require("deepspeed", "pip install 'mlflow-llmeff[deepspeed]' after torch")
    settings, degrees = CASES[strategy]
    reference, run, uri = finished(launched, strategy)
    check_run(run, uri, strategy, degrees, settings["num_processes"], reference)
    m = run.data.metrics
    bpp, bytes_per_step = m[names.SUM_MODEL_STATE_BYTES_PER_PARAM], m[names.SUM_COMM_BYTES]
    assert_state_as_planned(run, run_config(launched, strategy), strategy)  # every strategy: measured = plan
    if strategy == "ddp":
        assert bpp == 16.0  # fp32 AdamW replicated: 4 + 4 + 8
        assert bytes_per_step == pytest.approx(4 * P, rel=1e-3)  # one fp32 all-reduce (2(n-1)/n = 1) + buffers
    elif strategy == "tp":
        assert bpp == pytest.approx(expected_state_bytes_per_param("tp", 1, tp=2))  # 16 x 79,552 / 125,632
        assert bytes_per_step == 7 * 2 * 8 * SEQ * 64 * 4  # 7 all-reduces a layer of (8 x 32 x 64) fp32
    elif strategy in ("hsdp", "fsdp_tp"):
        kw = dict(dp_shard=2, tp=degrees[3])
        assert bpp == pytest.approx(expected_state_bytes_per_param(strategy, degrees[0], **kw), rel=0.01)  # + padding
    if strategy in ("hsdp", "fsdp_tp") or strategy.startswith("deepspeed"):  # counted = the plan's prediction
        plan = make_plan(run_config(launched, strategy), accelerator_short="cpu", precision="fp32", strategy=strategy)
        assert bytes_per_step == pytest.approx(plan["comm_bytes_per_step"], rel=0.01)  # FSDP2 pads uneven shards
    if strategy.startswith("deepspeed"):  # in fp32: a 4-byte working copy and 12 B of fp32 master weights and moments, / 2
        # ZeRO-3: every llama-tiny tensor (at most 16,576 elements) is under DeepSpeed's default
        # stage3_param_persistence_threshold (1e5), so forward and backward hold it whole, 4 B/param, on
        # top of the partitions; the step's fp32 gradient copy (4 / 2) is smaller: 2 + 4 + 2 + 6
        want = {"deepspeed_zero1": 4 + 4 + 6.0, "deepspeed_zero2": 4 + 2 + 6.0, "deepspeed_zero3": 2 + 4 + 2 + 6.0}
        assert want[strategy] == expected_state_bytes_per_param(strategy, 2)  # the plan's estimate
        assert bpp == pytest.approx(want[strategy], rel=2e-3)  # measured: within the partitions' padding
        # DeepSpeed's shared-memory all-reduce (inference only) was neither built nor loaded: ZeRO.build_ops
        # marks it not compatible (DeepSpeed prints "... deepspeed_shm_comm_op built successfully" on a load)
        out = launched[1][strategy][0]
        assert "deepspeed_shm_comm" not in out.stdout + out.stderr


def check_fsdp_killed_and_resumed(launched) -> None:
    """FSDP killed between checkpoints resumes into the same run, which trains as the reference."""
    first = launched[1]["fsdp-killed"][0]
    assert first.returncode != 0  # rank 1 SIGKILLed after step 4; last checkpoint at step 3
    reference, run, uri = finished(launched, "fsdp")
    ck = launched[2] / "fsdp-ck"
    assert sorted(os.listdir(ck / "step_00000006" / "dcp")) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert run.data.tags[names.RESUMED_FROM] == "3" and run.data.tags[names.RESUME_ATTEMPTS] == "2"
    # the failure is the lost rank and its signal, as torch elastic saw it (not rank 0's SIGTERM or gloo error)
    assert run.data.tags[names.RELIABILITY_FAILURES].startswith(
        "attempt 1: lost_rank (lost rank 1 (SIGKILL)) at step 4,"), run.data.tags[names.RELIABILITY_FAILURES]
    assert [s for s, _ in history(run, names.TRAIN_LOSS, uri)] == list(range(1, STEPS + 1))  # each step once
    # steps 1-3 of the first attempt, 4-5 of the resumed one: the sharded model, optimizer, schedule
    # and data order all continue exactly
    check_run(run, uri, "fsdp", (2, 2, 1, 1), 2, reference)
    # FSDP2 over 2 ranks: every dim-0 shard holds half the rows, rank 0 one more of the 259-row
    # embedding and LM head (16 B each for 64 columns): (125,632 + 2 x 64) / 2 parameters x 16 B
    assert run.data.metrics[names.SUM_MODEL_STATE_BYTES_PER_PARAM] == pytest.approx(16 * (P + 128) / 2 / P)
    assert_state_as_planned(run, run_config(launched, "fsdp"), "fsdp")  # the plan's 8 B/param, + 0.1% padding
    # counted on the resumed attempt's second step: forward gather, backward re-gather of the layers, fp32
    # reduce-scatter, (n-1)/n each: the plan's prediction within the padding of the 259-row shards
    plan = make_plan(run_config(launched, "fsdp"), accelerator_short="cpu", precision="fp32", strategy="fsdp")
    assert run.data.metrics[names.SUM_COMM_BYTES] == pytest.approx(plan["comm_bytes_per_step"], rel=0.01)
