"""The strategy registry, the degrees of each strategy, and counting over data-parallel ranks (no processes)."""

from __future__ import annotations

import sys

import pytest

from mlflow_llmeff import names, parallel
from mlflow_llmeff.parallel import Degrees


def test_every_strategy_is_found_by_name_without_importing_torch():
    import subprocess

    code = ("import sys; import mlflow_llmeff.parallel as p; print(','.join(p.NAMES)); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120).stdout.split()
    assert out == ["single,ddp,fsdp,hsdp,tp,fsdp_tp,cp,deepspeed_zero1,deepspeed_zero2,deepspeed_zero3", "False"]
    with pytest.raises(ValueError, match=r"parallelism='zero' is not accepted; use one of: auto, single, ddp, fsdp"):
        parallel.get("zero")


@pytest.mark.parametrize("strategy, world, kw, expected", [
    ("single", 1, {}, Degrees()),
    ("ddp", 8, {}, Degrees(dp_replicate=8)),
    ("fsdp", 8, {}, Degrees(dp_shard=8)),
    ("hsdp", 16, dict(processes_per_node=8), Degrees(dp_replicate=2, dp_shard=8)),  # a machine shards, machines replicate
    ("hsdp", 4, dict(dp_shard=2), Degrees(dp_replicate=2, dp_shard=2)),
    ("tp", 2, {}, Degrees(tp=2)),
    ("fsdp_tp", 8, dict(tp_size=2), Degrees(dp_shard=4, tp=2)),
    ("deepspeed_zero3", 4, {}, Degrees(dp_shard=4)),
])
def test_degrees_of_each_strategy(strategy, world, kw, expected):
    d = parallel.get(strategy).degrees(world, **kw)
    assert d == expected and d.world == world


@pytest.mark.parametrize("strategy, world, kw, match", [
    ("single", 2, {}, r"parallelism='single' with 2 processes"),
    ("fsdp", 4, dict(dp_shard=2), r"parallelism='fsdp' shards over all 4 processes \(dp_shard=2 given\); use hsdp"),
    ("hsdp", 4, dict(dp_shard=1), r"parallelism='hsdp' with dp_shard=1 shards nothing; use ddp"),
    ("tp", 4, dict(tp_size=2), r"parallelism='tp' uses every process \(tp_size=2, 4 processes\); use fsdp_tp"),
    ("fsdp_tp", 4, dict(tp_size=3), r"parallelism='fsdp_tp' needs tp_size > 1 dividing the 4 processes"),
    ("fsdp_tp", 2, dict(tp_size=2), r"parallelism='fsdp_tp' needs tp_size > 1 dividing the 2 processes and smaller"),
])
def test_degrees_that_do_not_fit_are_one_line(strategy, world, kw, match):
    with pytest.raises(ValueError, match=match):
        parallel.get(strategy).degrees(world, **kw)


def test_degree_tags_multiply_to_the_world_size():
    d = Degrees(dp_replicate=2, dp_shard=2, tp=2)
    tags = d.tags()
    assert tags == {names.PAR_DP: "4", names.PAR_DP_SHARD: "2", names.PAR_DP_REPLICATE: "2", names.PAR_TP: "2",
                    names.PAR_PP: "1", names.PAR_CP: "1"}
    assert int(tags[names.PAR_DP]) * int(tags[names.PAR_TP]) * int(tags[names.PAR_PP]) * int(tags[names.PAR_CP]) == 8
    assert d.model_parallel == 2 and d.describe() == "dp 4 (replicate 2 x shard 2) x tp 2 = 8"
    with pytest.raises(ValueError, match=r"parallelism degree tp=0 is not accepted"):
        Degrees(tp=0)


def test_a_model_without_a_tensor_parallel_plan_is_refused_for_tp():
    from mlflow_llmeff.parallel.tp import check_shape
    from mlflow_llmeff.models.presets import load_config

    with pytest.raises(ValueError, match=r"model type 'gpt2' has no tensor-parallel plan"):
        check_shape(load_config("gpt2-124m"), 2)
    check_shape(load_config("llama-7b"), 8)  # 32 heads, 32 kv heads, 11008 = 8 x 1376


def _wrapped(*classes):
    """A model inside wrappers of the given class names, outermost first (``torch.compile``'s
    ``_orig_mod`` for ``OptimizedModule``, ``.module`` for the rest)."""
    inner = type("LlamaForCausalLM", (), {})()
    for name in reversed(classes):
        outer = type(name, (), {})()
        setattr(outer, "_orig_mod" if name == "OptimizedModule" else "module", inner)
        inner = outer
    return inner


@pytest.mark.parametrize("model, world, environ, expected", [
    (_wrapped("DistributedDataParallel"), 2, {}, "ddp"),
    (_wrapped("OptimizedModule", "DistributedDataParallel"), 2, {}, "ddp"),       # compiled, then DDP inside
    (_wrapped("FullyShardedDataParallel"), 2, {}, "fsdp"),                         # FSDP1
    (_wrapped("FSDPLlamaForCausalLM"), 2, {}, "fsdp"),                             # FSDP2's fully_shard class
    (_wrapped(), 2, {"ACCELERATE_USE_FSDP": "true"}, "fsdp"),
    (_wrapped(), 2, {"ACCELERATE_USE_DEEPSPEED": "1"}, "deepspeed_zero2"),        # Accelerate's default stage
    (_wrapped(), 4, {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3"}, "deepspeed_zero3"),
    (_wrapped(), 2, {"ACCELERATE_USE_FSDP": "false"}, "ddp"),
    (_wrapped(), 1, {}, "single"),
    (None, 1, {"ACCELERATE_USE_DEEPSPEED": "1", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "1"}, "deepspeed_zero1"),
])
def test_each_strategy_recognises_itself_in_a_users_loop(model, world, environ, expected):
    assert parallel.detect(model, world, environ) == expected


def test_launch_commands_per_strategy_on_cpu():
    from mlflow_llmeff.planning.spec import Machine, resolve
    from mlflow_llmeff.train.config import TrainConfig
    from mlflow_llmeff.train.launch import accelerate_command

    cpu, gpu = Machine(cuda=False, bf16=True), Machine(cuda=True, bf16=True)
    cmd, env = accelerate_command(resolve(TrainConfig(parallelism="fsdp", num_processes=2), cpu))
    assert "--multi_gpu" in cmd and env["ACCELERATE_USE_CPU"] == "1"
    cmd, env = accelerate_command(resolve(TrainConfig(parallelism="deepspeed_zero2", num_processes=2), cpu))
    assert cmd[cmd.index("--zero_stage") + 1] == "2" and "--use_deepspeed" in cmd and env["DS_ACCELERATOR"] == "cpu"
    cmd, _ = accelerate_command(resolve(TrainConfig(parallelism="fsdp", num_processes=1), gpu))
    assert cmd[1:6] == ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1"]  # a group of one


def test_tokens_count_once_per_data_parallel_rank(monkeypatch, tracking_uri):
    """Two tensor-parallel ranks counted the same 2 x 8 batch: the sum over ranks is halved."""
    import torch

    from mlflow_llmeff.meters import collectives
    from mlflow_llmeff.monitor.meter import EfficiencyMonitor

    monkeypatch.setattr(collectives, "world_and_rank", lambda: (2, 0))
    monkeypatch.setattr(collectives, "reduce_tensor", lambda t: t * 2)  # the other rank counted the same
    monkeypatch.setattr(collectives, "all_reduce", lambda v, op="sum", **kw: list(v))
    with pytest.raises(ValueError, match=r"data_parallel_size=3 is not accepted; give an int >= 1 dividing"):
        EfficiencyMonitor(data_parallel_size=3, measure_energy="none", measure_peak=False)
    mon = EfficiencyMonitor(data_parallel_size=1, measure_energy="none", measure_peak=False, warmup_steps=0,
                            log_every_n_steps=1)
    ids = torch.ones(2, 8, dtype=torch.long)
    mon.step(batch={"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    assert mon.latest_metrics[names.TRAIN_TOKENS] == 16  # not 32
    summary = mon.finish()
    assert summary[names.SUM_TOKENS] == 16
