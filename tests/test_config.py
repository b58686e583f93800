"""Bad input: one line naming the value and the accepted ones, before any heavy work."""

import subprocess
import sys

import pytest

from mlflow_llmeff.planning.spec import Machine, resolve
from mlflow_llmeff.train.config import TrainConfig, validate


def check(**kw):
    validate(TrainConfig(**kw), cuda_available=kw.pop("_cuda", False), bf16_supported=True)


@pytest.mark.parametrize("kw, match", [
    (dict(model="llama-99b"), r"unknown model 'llama-99b'; accepted: a preset \(llama-tiny, "),
    (dict(dataset="/no/such/file.txt"), r"dataset '/no/such/file.txt' does not exist; accepted: 'python-docs'"),
    (dict(seq_len=1024), r"seq_len=1024 exceeds the 512 positions of model 'llama-tiny'; use seq_len <= 512"),
    (dict(max_steps=0), r"max_steps=0 must be a positive integer"),
    (dict(micro_batch_size=-2), r"micro_batch_size=-2 must be a positive integer"),
    (dict(grad_accum=0), r"grad_accum=0 must be a positive integer"),
    (dict(precision="fp64"), r"precision='fp64' is not accepted; use one of: auto, fp32, bf16, fp16"),
    (dict(parallelism="zero"), r"parallelism='zero' is not accepted; use one of: auto, single, ddp, fsdp"),
    (dict(precision="fp16"), r"precision='fp16' needs a CUDA device .*accepted on CPU: fp32, bf16"),
    (dict(parallelism="cp", num_processes=2), r"parallelism='cp' cannot run on CPU: torch 2.13's context_parallel "
                                              r"has no sharding rule for the CPU attention kernel"),
    (dict(parallelism="tp", num_processes=4), r"tensor parallelism over 4 ranks needs num_key_value_heads divisible "
                                              r"by 4; the model has 2"),
    (dict(parallelism="tp", num_processes=4, tp_size=2), r"parallelism='tp' uses every process .*use fsdp_tp"),
    (dict(parallelism="fsdp_tp", num_processes=4), r"parallelism='fsdp_tp' needs tp_size > 1 dividing the 4 processes"),
    (dict(parallelism="hsdp", num_processes=4), r"parallelism='hsdp' with dp_shard=4 of 4 processes replicates nothing"),
    (dict(parallelism="hsdp", num_processes=4, dp_shard=3), r"parallelism='hsdp': dp_shard=3 must divide the 4 processes"),
    (dict(parallelism="fsdp", num_processes=2, precision="bf16", tp_size=-1), r"tp_size=-1 must be >= 0"),
    (dict(resume="yes"), r"resume='yes' is not accepted; use one of: auto, never"),
    (dict(measure_energy="ipmi"), r"measure_energy='ipmi' is not accepted; use one of: auto, nvml, rapl, none"),
    (dict(device_hour_usd=-1.0), r"device_hour_usd=-1.0 must be >= 0 USD"),
    # a wrong rank for the job's machines: machine_rank 2 of 2 machines
    (dict(num_machines=2, machine_rank=2, main_process_ip="10.0.0.1"),
     r"^machine_rank=2 with num_machines=2; machine_rank must be in 0\.\.1$"),
    (dict(num_machines=2, machine_rank=1), r"^num_machines=2 needs main_process_ip \(the address of machine 0\)$"),
    (dict(num_machines=2, main_process_ip="10.0.0.1", rendezvous_timeout_s=0.0),
     r"^rendezvous_timeout_s=0.0 must be > 0 seconds$"),
    (dict(link_peak_gbps=-0.025), r"^link_peak_gbps=-0.025 must be >= 0 GB/s \(0: read the link's rate\)$"),
])
def test_bad_settings_raise_one_line(kw, match):
    with pytest.raises(ValueError, match=match) as e:
        check(**kw)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("kw", [
    dict(parallelism="fsdp", num_processes=2), dict(parallelism="fsdp", num_processes=1),
    dict(parallelism="hsdp", num_processes=4, dp_shard=2), dict(parallelism="tp", num_processes=2),
    dict(parallelism="fsdp_tp", num_processes=4, tp_size=2), dict(parallelism="ddp", num_processes=2),
])
def test_sharded_and_tensor_parallel_strategies_validate_on_cpu(kw):
    check(**kw)  # FSDP2, HSDP, TP and 2-D run on CPU over gloo (tests/test_strategies.py trains each)


def test_bf16_unsupported_device_is_rejected():
    with pytest.raises(ValueError, match=r"precision='bf16' is not supported by this device; accepted here: fp32, fp16"):
        validate(TrainConfig(precision="bf16"), cuda_available=True, bf16_supported=False)


def test_defaults_validate_and_resolve():
    spec = validate(TrainConfig(), cuda_available=False, bf16_supported=True)
    assert (spec.precision, spec.strategy_name, spec.world) == ("fp32", "single", 1)
    assert resolve(TrainConfig(), Machine(cuda=True, bf16=True)).precision == "bf16"
    assert resolve(TrainConfig(), Machine(cuda=True, bf16=False)).precision == "fp32"
    assert resolve(TrainConfig(num_processes=8), Machine(cuda=False, bf16=True)).strategy_name == "ddp"


def test_cli_prints_one_line_error_without_traceback():
    r = subprocess.run([sys.executable, "-m", "mlflow_llmeff", "train", "--model", "llama-99b"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    err = [line for line in r.stderr.splitlines() if line.startswith("Error:")]
    assert err == [err[0]] and "unknown model 'llama-99b'" in err[0]


def test_mlproject_file_is_generated_from_train_config():
    import pathlib

    from mlflow_llmeff.train.config import render_mlproject

    assert (pathlib.Path(__file__).parents[1] / "MLproject").read_text() == render_mlproject()


def test_mlproject_parameters_match_train_config():
    import pathlib

    import yaml

    spec = yaml.safe_load((pathlib.Path(__file__).parents[1] / "MLproject").read_text())
    main = spec["entry_points"]["main"]
    assert list(main["parameters"]) == TrainConfig.field_names()
    for name in TrainConfig.field_names():
        assert "{" + name + "}" in main["command"]


def test_per_subject_mmlu_metrics_when_asked_or_when_the_tasks_name_subjects():
    from mlflow_llmeff.train.config import TrainConfig
    from mlflow_llmeff.train.loop import _subject_metrics

    assert _subject_metrics(TrainConfig(eval_tasks="mmlu,hellaswag")) is False  # 57 subjects: the table only
    assert _subject_metrics(TrainConfig(eval_tasks="mmlu", eval_subject_metrics=True)) is True
    assert _subject_metrics(TrainConfig(eval_tasks="mmlu_anatomy, hellaswag")) is True  # named: a few charts
    assert TrainConfig(eval_subject_metrics=True).to_params()["eval_subject_metrics"] == "true"
