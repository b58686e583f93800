"""The run resolved once (planning/spec.py): ``auto`` over every machine's processes, read alike by the
fit check, the launcher, its processes and the set-up; one resolution and one validation per process
for a launch, a launched process and a dry run; one global batch formula on every path that tags it."""

from __future__ import annotations

import json
import sys
from contextlib import contextmanager

import mlflow
import pytest

from mlflow_llmeff import names
from mlflow_llmeff.parallel import Degrees
from mlflow_llmeff.planning import spec as specs
from mlflow_llmeff.planning.spec import Machine, RunSpec, resolve
from mlflow_llmeff.train import config
from mlflow_llmeff.train.config import TrainConfig, validate
from conftest import use_store

CPU = Machine(cuda=False, bf16=True)
#: llmeff train's quickest real run: 2 steps of llama-tiny on synthetic tokens.
TINY = dict(model="llama-tiny", dataset="synthetic", max_steps=2, seq_len=32, micro_batch_size=2, warmup_steps=1,
            log_every_n_steps=1, measure_energy="none", val_fraction=0.0, measure_comm=False)


@pytest.fixture
def tracking_uri(module_store, monkeypatch):
    """One sqlite store for the module's tests."""
    yield from use_store(module_store, monkeypatch)


@contextmanager
def counted():
    """Count the calls of the resolution (planning.spec.resolve) and of the validation
    (train.config.validate) in this thread, however they are bound (by their code objects)."""
    watched = {specs.resolve.__code__: "resolve", config.validate.__code__: "validate"}
    calls = {"resolve": 0, "validate": 0}

    def profile(frame, event, arg):
        if event == "call" and frame.f_code in watched:
            calls[watched[frame.f_code]] += 1

    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        yield calls
    finally:
        sys.setprofile(previous)


# ------------------------------------------------------------------ the resolution
def test_auto_is_single_for_one_process_and_ddp_over_two_machines_of_one_process():
    one = resolve(TrainConfig(), CPU)
    assert (one.strategy_name, one.degrees, one.world, one.precision) == ("single", Degrees(), 1, "fp32")
    two = resolve(TrainConfig(num_processes=1, num_machines=2, main_process_ip="10.0.0.1"), CPU)
    assert (two.strategy_name, two.degrees, two.world, two.nodes, two.processes_per_node) == (
        "ddp", Degrees(dp_replicate=2), 2, 2, 1)


@pytest.mark.parametrize("machine, precision", [(Machine(cuda=True, bf16=True), "bf16"),
                                                (Machine(cuda=True, bf16=False), "fp32"), (CPU, "fp32")])
def test_auto_precision_is_bf16_only_on_a_cuda_device_that_has_it(machine, precision):
    assert resolve(TrainConfig(), machine).precision == precision
    assert resolve(TrainConfig(precision="fp16"), machine).precision == "fp16"  # given: taken as it is


def test_data_workers_and_learning_rate_warm_up_are_resolved_with_the_run():
    gpu = Machine(cuda=True, bf16=True)
    assert (resolve(TrainConfig(), gpu).data_workers, resolve(TrainConfig(), CPU).data_workers) == (2, 0)
    assert resolve(TrainConfig(data_workers=3), CPU).data_workers == 3
    # 5% of max_steps, rounded (half to even: 2.5 -> 2), at least 1
    assert [resolve(TrainConfig(max_steps=n), CPU).lr_warmup_steps for n in (50, 70, 10)] == [2, 4, 1]
    assert resolve(TrainConfig(lr_warmup_steps=7), CPU).lr_warmup_steps == 7


def test_a_launched_process_reads_what_was_resolved_and_a_spec_keeps_its_resolution():
    spec = resolve(TrainConfig(parallelism="fsdp_tp", num_processes=4, tp_size=2), CPU)
    back = RunSpec.read(TrainConfig(parallelism="fsdp_tp", num_processes=4, tp_size=2),
                        json.loads(json.dumps(spec.resolved())))
    assert (back.strategy, back.degrees, back.precision, back.machine) == (
        spec.strategy, Degrees(dp_shard=2, tp=2), "fp32", CPU)
    with pytest.raises(ValueError, match=r"^the resolved degrees dp 2 x tp 2 = 4 do not fit num_processes=2 x "
                                         r"num_machines=1$"):
        RunSpec.read(TrainConfig(num_processes=2), spec.resolved())
    assert spec.with_options(run_name="mine").options.run_name == "mine"
    with pytest.raises(ValueError, match=r"^num_processes changes what was resolved; only run_name, checkpoint_dir"):
        spec.with_options(num_processes=8)


# ------------------------------------------------------------------ (a) two machines of one process each
def test_auto_over_two_machines_is_ddp_in_the_fit_check_the_launch_and_the_set_up(tracking_uri, monkeypatch):
    """The issue's defect: fit_here and the dry run resolved auto over num_processes (single) while
    training used processes x machines (ddp); the dry run of such a run even failed."""
    from mlflow_llmeff.train import launch as launch_mod
    from mlflow_llmeff.train import setup

    cfg = TrainConfig(num_processes=1, num_machines=2, main_process_ip="10.0.0.1", **TINY)
    spec = validate(cfg, CPU)
    assert (spec.strategy_name, spec.degrees) == ("ddp", Degrees(dp_replicate=2))
    assert launch_mod.fit_here(spec).strategy == "ddp"  # the fit check's estimate is ddp's
    cmd, _ = launch_mod.accelerate_command(spec)  # every machine starts its processes with its resolution
    assert cmd[cmd.index("--num_processes") + 1] == "2" and cmd[cmd.index("--num_machines") + 1] == "2"
    assert "--multi_gpu" in cmd
    worker = RunSpec.read(TrainConfig(**json.loads(cmd[cmd.index("--config-json") + 1])),
                          json.loads(cmd[cmd.index("--resolved-json") + 1]))
    assert (worker.strategy_name, worker.degrees, worker.world) == ("ddp", Degrees(dp_replicate=2), 2)

    class Accelerator:  # what Accelerate makes on rank 0 of the 2 (no process group here)
        num_processes, process_index, is_main_process = 2, 0, True

        def __init__(self, **kwargs):
            self.kwargs = kwargs

    class Applied(Exception):
        pass

    def layout(accelerator, degrees):  # where the set-up applies the strategy to this rank
        raise Applied(worker.strategy.name, degrees, accelerator.kwargs)

    import accelerate

    monkeypatch.setattr(accelerate, "Accelerator", Accelerator)
    monkeypatch.setattr(worker.strategy, "layout", layout)
    with pytest.raises(Applied) as applied:
        setup.build(worker)
    assert applied.value.args[:2] == ("ddp", Degrees(dp_replicate=2))
    assert applied.value.args[2]["cpu"] is True and applied.value.args[2]["mixed_precision"] == "no"

    run_id = mlflow.MlflowClient().create_run("0").info.run_id  # the dry run: it failed before
    monkeypatch.setenv("MLFLOW_RUN_ID", run_id)
    assert launch_mod.dry_run(cfg, accelerator_short="cpu", as_json=True) == 0
    tags = mlflow.MlflowClient().get_run(run_id).data.tags
    assert (tags[names.PAR_STRATEGY], tags[names.ACCEL_COUNT]) == ("ddp", "2")


def test_the_set_up_refuses_a_launch_of_another_world_than_resolved(monkeypatch):
    from mlflow_llmeff.train import setup

    class Accelerator:
        num_processes, process_index, is_main_process = 1, 0, True

        def __init__(self, **kwargs):
            pass

    import accelerate

    monkeypatch.setattr(accelerate, "Accelerator", Accelerator)
    spec = resolve(TrainConfig(num_processes=2), CPU)
    with pytest.raises(ValueError, match=r"^1 processes were started for a run resolved for 2 \(num_processes=2 x "
                                         r"num_machines=1\)"):
        setup.build(spec)


# ------------------------------------------------------------------ (b) once per process
def test_llmeff_train_resolves_and_validates_once_in_its_process(tracking_uri):
    from click.testing import CliRunner

    from mlflow_llmeff.cli import main

    args = [a for k, v in TINY.items() for a in (f"--{k.replace('_', '-')}", str(v).lower() if isinstance(v, bool)
                                                 else str(v))]
    with counted() as calls:
        res = CliRunner().invoke(main, ["train", *args])
    assert res.exit_code == 0, res.output[-3000:]
    assert calls == {"resolve": 1, "validate": 1}  # was: validate twice, auto strategy resolved 9 times


def test_a_launched_process_resolves_and_validates_nothing(tracking_uri, monkeypatch):
    """The launcher resolves once; the process it starts (here run in this one) reads --resolved-json."""
    from mlflow_llmeff.train import launch as launch_mod
    from mlflow_llmeff.train import loop

    seen = {}

    class Process:  # the child process, run in this one with its own count
        pid = -1  # no process group of its own to signal

        def __init__(self, cmd, *, env, stderr, text, bufsize, start_new_session):
            seen["launcher"] = dict(calls)
            monkeypatch.setattr(loop.lifecycle, "exit_now", lambda code: None)
            with counted() as child:
                loop.main(cmd[3:])
            seen["child"], self.stderr = child, iter(())

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def wait(self, timeout=None):
            return 0

    monkeypatch.setattr(launch_mod.subprocess, "Popen", Process)
    with counted() as calls:
        assert launch_mod.launch(TrainConfig(**TINY), own_process=True) == 0
    assert seen == {"launcher": {"resolve": 1, "validate": 1}, "child": {"resolve": 0, "validate": 0}}


def test_a_dry_run_resolves_and_validates_once(tracking_uri, capsys):
    from mlflow_llmeff.train import launch as launch_mod

    with counted() as calls:
        assert launch_mod.launch(TrainConfig(dry_run=True, **TINY)) == 0
    assert calls == {"resolve": 1, "validate": 1}  # was: validate once, strategy resolved 4 times, precision 3
    with counted() as calls:
        assert launch_mod.dry_run(TrainConfig(**TINY), accelerator_short="H100") == 0
    assert calls == {"resolve": 1, "validate": 1}
    assert "fits an 80 GiB H100-SXM" in capsys.readouterr().out


# ------------------------------------------------------------------ (c) one global batch formula
def test_the_global_batch_is_seq_len_x_micro_batch_x_accumulation_x_dp_on_every_path(tracking_uri, monkeypatch,
                                                                                      capsys):
    """2-D parallelism over 4 processes, tensor parallel over 2: dp = 2, not the world (4) nor 1."""
    from mlflow_llmeff.train.failures import known_conditions
    from mlflow_llmeff.monitor.conditions import shape_tags
    from mlflow_llmeff.train import launch as launch_mod
    from mlflow_llmeff.train.loop import run_tags

    settings = dict(TINY, grad_accum=3, parallelism="fsdp_tp", num_processes=4, tp_size=2)
    want = str(32 * 2 * 3 * 2)  # 384 positions; the world would give 768
    spec = validate(TrainConfig(**settings), CPU)
    assert (spec.degrees.dp, spec.world, spec.global_batch_tokens) == (2, 4, 384)
    assert run_tags(spec, "synthetic")[names.GLOBAL_BATCH_TOKENS] == want  # llmeff train's run
    assert spec.tags()[names.GLOBAL_BATCH_TOKENS] == want
    params = {k: v for k, v in settings.items()}
    assert known_conditions(params, spec)[names.GLOBAL_BATCH_TOKENS] == want  # a run failed after resolving
    assert known_conditions(params)[names.GLOBAL_BATCH_TOKENS] == want  # ... and before
    assert shape_tags(2, 32, 3, 2)[names.GLOBAL_BATCH_TOKENS] == want  # a monitored loop's first step
    run_id = mlflow.MlflowClient().create_run("0").info.run_id
    monkeypatch.setenv("MLFLOW_RUN_ID", run_id)
    assert launch_mod.launch(TrainConfig(dry_run=True, **settings)) == 0  # a dry run's plan run
    run = mlflow.MlflowClient().get_run(run_id)
    assert run.data.tags[names.GLOBAL_BATCH_TOKENS] == want and run.data.metrics["plan/tokens_per_step"] == 384
    assert "tokens_per_step" in capsys.readouterr().out
