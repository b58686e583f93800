"""The monitor in the setups that change the counting (METRICS.md): context parallelism, FP8, a counter gap."""

from __future__ import annotations

import os
import pathlib

from contextlib import nullcontext

import mlflow
import pytest
import torch

from mlflow_llmeff import names
from mlflow_llmeff.meters import collectives
from mlflow_llmeff.meters import hardware as hw
from mlflow_llmeff.models.build import load_config
from mlflow_llmeff.monitor.meter import EfficiencyMonitor
from mlflow_llmeff.testing import FakeClock

from conftest import require, use_store


@pytest.fixture
def tracking_uri(module_store, monkeypatch):
    yield from use_store(module_store, monkeypatch)


def history(run_id: str, key: str) -> list[tuple[int, float]]:
    return [(m.step, m.value) for m in mlflow.MlflowClient().get_metric_history(run_id, key)]


# ------------------------------------------------------------------------------ context parallelism
def test_context_parallel_ranks_count_their_slices_once(monkeypatch, tracking_uri):
    # 4 ranks: cp 2 x tp 2, one data-parallel rank. Its batch: 2 sequences of 8 tokens; each cp rank
    # holds and counts the 2 x 4 slice, its tp peer the same slice again.
    monkeypatch.setattr(collectives, "world_and_rank", lambda: (4, 0))
    monkeypatch.setattr(collectives, "reduce_tensor", lambda t: t * 4)  # every rank counted the same shape
    monkeypatch.setattr(collectives, "all_reduce", lambda v, op="sum", **kw: list(v))
    monkeypatch.setattr(collectives, "all_gather_object", lambda o: [o])
    clock = FakeClock()
    mon = EfficiencyMonitor(data_parallel_size=1, context_parallel_size=2, model_config=load_config("llama-tiny"),
                            peak_tflops=1.0, measure_energy="none", measure_peak=False, warmup_steps=0,
                            log_every_n_steps=1, clock=clock)
    ids = torch.ones(2, 4, dtype=torch.long)
    clock.t += 1.0
    mon.step(batch={"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    m = mon.latest_metrics
    assert m[names.TRAIN_TOKENS] == 16  # 2 x 8: the old rule (cp ranks as copies) gave 8
    assert m[names.TRAIN_PADDED_TOKENS] == 16 and m[names.TPUT_SAMPLES] == 2.0
    # attention at the full length 8: llama-tiny 2*64^2*(12 + 6 + 49.5 + 6*8/64) + 6*64*259 = 658,560
    assert m[names.TPUT_DEVICE_TFLOPS] * 1e12 / m[names.TPUT_DEVICE_TOKENS] == pytest.approx(658_560, rel=1e-9)
    mon.finish()
    tags = mlflow.MlflowClient().get_run(mon.run_id).data.tags
    assert tags[names.PAR_CP] == "2" and tags[names.PAR_DP] == "1"
    assert tags[names.SEQ_LEN] == "8" and tags[names.GLOBAL_BATCH_TOKENS] == "16"  # the full sequence, not the slice


def test_a_context_parallel_size_that_does_not_fit_is_refused(monkeypatch, tracking_uri):
    monkeypatch.setattr(collectives, "world_and_rank", lambda: (4, 0))
    with pytest.raises(ValueError, match=r"data_parallel_size=4 is not accepted; give an int >= 1 dividing the "
                                         r"world size 4 with context_parallel_size=2"):
        EfficiencyMonitor(data_parallel_size=4, context_parallel_size=2, measure_energy="none", measure_peak=False)
    with pytest.raises(ValueError, match=r"context_parallel_size=3 is not accepted"):
        EfficiencyMonitor(context_parallel_size=3, measure_energy="none", measure_peak=False)


# ------------------------------------------------------------------------------ FP8: the denominator named
H100 = hw.AcceleratorInfo("NVIDIA H100 80GB HBM3", "H100-SXM", 1, 79.6, "Hopper", None, "12.8", "cuda")


@pytest.mark.parametrize("precision, peak, mfu_of_2", [("fp8", 1978.9, 2 / 1978.9), ("bf16", 989.4, 2 / 989.4)])
def test_an_fp8_run_names_its_denominator_and_logs_the_bf16_figure_beside_it(monkeypatch, tracking_uri, precision,
                                                                             peak, mfu_of_2):
    monkeypatch.setattr(hw, "detect_accelerator", lambda **kw: H100)
    cfg = load_config("llama-tiny")
    clock = FakeClock()
    mon = EfficiencyMonitor(log_every_n_steps=2, warmup_steps=0, model_config=cfg, precision=precision, clock=clock,
                            measure_energy="none", measure_peak=False, device_hour_usd=0.0)
    # 2 TFLOP/s per device: tokens/s = 2e12 / 676,992 FLOPs/token (llama-tiny at s = 32)
    per_step = 2e12 * 0.5 / 676_992
    for _ in range(2):
        clock.t += 0.5
        mon.step(tokens=per_step, samples=per_step / 32, sum_len_sq=per_step * 32)
    s = mon.finish()
    assert s[names.SUM_DEVICE_TFLOPS] == pytest.approx(2.0, rel=1e-5)  # whole tokens: 1e-5
    assert s[names.SUM_MFU] == pytest.approx(mfu_of_2, rel=1e-5)       # 2 / 1978.9 = 0.0010107 in fp8
    assert s[names.SUM_MFU_BF16_PEAK] == pytest.approx(2 / 989.4, rel=1e-5)  # 0.0020214 on either
    tags = mlflow.MlflowClient().get_run(mon.run_id).data.tags
    assert tags[names.PEAK_PRECISION] == precision and tags[names.PEAK_TFLOPS] == f"{peak:g}"


GB300 = hw.AcceleratorInfo("NVIDIA GB300", "GB300", 1, 279.0, "Blackwell", None, "13.0", "cuda")


def test_an_fp4_run_divides_by_the_fp4_peak_and_logs_the_bf16_figure_beside_it(monkeypatch, tracking_uri):
    # GB300's dense NVFP4 15,000 TFLOP/s and BF16 2,500 (meters/hardware.py, its datasheet row)
    monkeypatch.setattr(hw, "detect_accelerator", lambda **kw: GB300)
    clock = FakeClock()
    mon = EfficiencyMonitor(log_every_n_steps=2, warmup_steps=0, model_config=load_config("llama-tiny"),
                            precision="fp4", clock=clock, measure_energy="none", measure_peak=False,
                            device_hour_usd=0.0)
    per_step = 30e12 * 0.5 / 676_992  # 30 TFLOP/s per device
    for _ in range(2):
        clock.t += 0.5
        mon.step(tokens=per_step, samples=per_step / 32, sum_len_sq=per_step * 32)
    s = mon.finish()
    assert s[names.SUM_MFU] == pytest.approx(30 / 15000, rel=1e-5)           # 0.002 against the FP4 peak
    assert s[names.SUM_MFU_BF16_PEAK] == pytest.approx(30 / 2500, rel=1e-5)  # 0.012 on the one scale
    tags = mlflow.MlflowClient().get_run(mon.run_id).data.tags
    assert (tags[names.PRECISION], tags[names.PEAK_PRECISION], tags[names.PEAK_TFLOPS]) == ("fp4", "fp4", "15000")


def test_without_a_peak_no_precision_tag_and_no_bf16_figure(tracking_uri):
    clock = FakeClock()
    mon = EfficiencyMonitor(log_every_n_steps=1, warmup_steps=0, model_config=load_config("llama-tiny"), clock=clock,
                            measure_energy="none", measure_peak=False)
    clock.t += 1.0
    mon.step(tokens=64, samples=2)
    s = mon.finish()
    assert names.SUM_MFU not in s and names.SUM_MFU_BF16_PEAK not in s  # CPU: no datasheet peak
    tags = mlflow.MlflowClient().get_run(mon.run_id).data.tags
    assert names.PEAK_PRECISION not in tags
    # MFU, its palm twin and HFU are absent and say why (a trial found HFU gone with no word of why), and so is
    # the measured-peak MFU of a monitor told not to measure one
    no_peak = ("no dense datasheet peak for this device and precision (llmeff.peak.source: unknown: CPUs have no "
               "datasheet peak in the table; see summary/mfu_measured_peak (llmeff peak) or pass peak_tflops)")
    assert (f"summary/mfu, summary/mfu_palm, summary/hfu: {no_peak}; "
            "summary/mfu_measured_peak: no measured matmul peak (not measured (measure_peak=False))") in \
        tags[names.SUMMARY_ABSENT]
    assert names.SUM_HFU not in s and names.SUM_DEVICE_TFLOPS in s


# ------------------------------------------------------------------------------ FP8 read off the modules that run
#: torchao's float8 training layer as the detection sees it: the class name and module path of
#: torchao.float8.float8_linear.Float8Linear (torchao's kernels need CUDA; this stand-in runs nn.Linear's forward)
Float8Linear = type("Float8Linear", (torch.nn.Linear,), {"__module__": "torchao.float8.float8_linear"})
#: TransformerEngine's te.Linear as the detection sees it: fp8 is set by its first forward under fp8_autocast
TeLinear = type("Linear", (torch.nn.Linear,), {"__module__": "transformer_engine.pytorch.module.linear", "fp8": False})


def _tiny_with(layer_class, keep_head: bool = True):
    """llama-tiny with its linear layers turned into ``layer_class`` (the LM head kept, as torchtitan's float8
    filter keeps it); returns the model and how many layers were converted."""
    from mlflow_llmeff.models.build import build_model

    torch.manual_seed(0)
    model = build_model("llama-tiny")
    n = 0
    for name, m in model.named_modules():
        if type(m) is torch.nn.Linear and not (keep_head and name == "lm_head"):
            m.__class__, n = layer_class, n + 1
    return model, n


def test_a_model_converted_to_torchao_float8_is_tagged_fp8_against_the_fp8_peak(monkeypatch, tracking_uri):
    # the trial: torchao's Float8Linear layers under a launcher's bf16 were tagged bf16, and MFU divided by
    # the BF16 peak read twice what the FP8 peak gives
    monkeypatch.setattr(hw, "detect_accelerator", lambda **kw: H100)
    model, n = _tiny_with(Float8Linear)
    assert n == 14  # 2 layers x (q, k, v, o, gate, up, down)
    clock = FakeClock()
    mon = EfficiencyMonitor(log_every_n_steps=2, warmup_steps=0, model=model, precision="bf16", clock=clock,
                            measure_energy="none", measure_peak=False, device_hour_usd=0.0)
    assert mon.precision == "fp8"
    per_step = 2e12 * 0.5 / 676_992  # 2 TFLOP/s per device at s = 32 (the test above)
    for _ in range(2):
        clock.t += 0.5
        mon.step(tokens=per_step, samples=per_step / 32, sum_len_sq=per_step * 32)
    s = mon.finish()
    assert s[names.SUM_MFU] == pytest.approx(2 / 1978.9, rel=1e-5)  # the FP8 dense peak of an H100 SXM
    assert s[names.SUM_MFU_BF16_PEAK] == pytest.approx(2 / 989.4, rel=1e-5)
    tags = mlflow.MlflowClient().get_run(mon.run_id).data.tags
    assert (tags[names.PRECISION], tags[names.PEAK_PRECISION], tags[names.PEAK_TFLOPS]) == ("fp8", "fp8", "1978.9")
    assert tags[names.PRECISION_SOURCE] == ("modules: 14 of 15 Linear layers are "
                                            "torchao.float8.float8_linear.Float8Linear")
    assert "-fp8-" in mlflow.MlflowClient().get_run(mon.run_id).info.run_name


def test_torchaos_own_float8_conversion_is_read_as_fp8(monkeypatch, tracking_uri):
    # torchao's real convert_to_float8_training (pure Python on CPU; its kernels are not run here): the
    # class path the detection reads is torchao's own; without a filter it converts the LM head too
    # torchao lives outside the venv (.ci/run: .venv/torchao): installed, transformers imports it at every
    # model build (1.4 s a process)
    folder = os.environ.get("LLMEFF_TORCHAO_DIR", str(pathlib.Path(__file__).resolve().parents[1] / ".venv" / "torchao"))
    if os.path.isdir(folder):
        monkeypatch.syspath_prepend(folder)
    torchao_float8 = require("torchao.float8", "pip install --no-deps --target .venv/torchao torchao")
    monkeypatch.setattr(hw, "detect_accelerator", lambda **kw: H100)
    model, _ = _tiny_with(torch.nn.Linear)
    torchao_float8.convert_to_float8_training(model)
    mon = EfficiencyMonitor(model=model, precision="bf16", measure_energy="none", measure_peak=False,
                            device_hour_usd=0.0)
    mon.finish()
    tags = mlflow.MlflowClient().get_run(mon.run_id).data.tags
    assert (tags[names.PRECISION], tags[names.PEAK_PRECISION]) == ("fp8", "fp8")
    assert tags[names.PRECISION_SOURCE] == ("modules: 15 of 15 Linear layers are "
                                            "torchao.float8.float8_linear.Float8Linear")


def test_a_plain_model_keeps_the_given_precision_and_says_where_it_came_from(monkeypatch, tracking_uri):
    monkeypatch.setattr(hw, "detect_accelerator", lambda **kw: H100)
    model, _ = _tiny_with(torch.nn.Linear)
    mon = EfficiencyMonitor(model=model, precision="bf16", measure_energy="none", measure_peak=False,
                            device_hour_usd=0.0)
    mon.finish()
    tags = mlflow.MlflowClient().get_run(mon.run_id).data.tags
    assert (tags[names.PRECISION], tags[names.PRECISION_SOURCE], tags[names.PEAK_TFLOPS]) == ("bf16", "option", "989.4")


def test_transformer_engine_layers_under_fp8_autocast_switch_the_run_to_fp8_after_the_first_step(monkeypatch,
                                                                                                tracking_uri):
    # te.Linear cannot tell before its first forward: init_fp8_metadata sets fp8 under fp8_autocast
    monkeypatch.setattr(hw, "detect_accelerator", lambda **kw: H100)
    model, n = _tiny_with(TeLinear)
    clock = FakeClock()
    mon = EfficiencyMonitor(log_every_n_steps=2, warmup_steps=1, model=model, precision="bf16", clock=clock,
                            measure_energy="none", measure_peak=False, device_hour_usd=0.0)
    assert mon.precision == "bf16"  # no forward yet: nothing says FP8
    for m in model.modules():  # the first forward under te.fp8_autocast
        if isinstance(m, TeLinear):
            m.fp8 = True
    per_step = 2e12 * 0.5 / 676_992
    for _ in range(3):
        clock.t += 0.5
        mon.step(tokens=per_step, samples=per_step / 32, sum_len_sq=per_step * 32)
    s = mon.finish()
    assert mon.precision == "fp8" and s[names.SUM_MFU] == pytest.approx(2 / 1978.9, rel=1e-5)
    tags = mlflow.MlflowClient().get_run(mon.run_id).data.tags
    assert (tags[names.PRECISION], tags[names.PEAK_PRECISION], tags[names.PEAK_TFLOPS]) == ("fp8", "fp8", "1978.9")
    assert tags[names.PRECISION_SOURCE] == (f"modules: {n} of 15 Linear layers are "
                                            "transformer_engine.pytorch.module.linear.Linear")


# ------------------------------------------------------------------------------ a counter that cannot see
def test_a_tiny_qwen3_moe_under_checkpointing_keeps_hfu_above_mfu_and_tags_the_gap(tracking_uri):
    # transformers 5's fused expert kernel (torch._grouped_mm on CPU) is invisible to FlopCounterMode:
    # the counted step falls short of the formula, which is a gap in the count, not lower hardware FLOPs
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    cfg = Qwen3MoeConfig(vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                         num_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
                         attn_implementation="eager")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    model.activation_checkpointing_enable()
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    clock = FakeClock()
    mon = EfficiencyMonitor(log_every_n_steps=2, warmup_steps=0, model=model, peak_tflops=1.0, clock=clock,
                            measure_energy="none", measure_peak=False)
    for i in range(2):
        with mon.counting_hardware_flops() if i == 0 else nullcontext():
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
            mon.count({"input_ids": ids})
        clock.t += 0.5
        mon.step()
    s = mon.finish()
    assert s[names.SUM_HFU] > s[names.SUM_MFU]  # the analytic ratio (recompute included), never the short count
    tags = mlflow.MlflowClient().get_run(mon.run_id).data.tags
    gap = tags[names.FLOPS_COUNTER_GAP]
    assert gap.startswith("step 1: FlopCounterMode counted ") and gap.endswith(
        "of the formula's hardware FLOPs on a real step; modules it could not see: model.layers.0.mlp.experts, "
        "model.layers.1.mlp.experts; HFU uses the analytic ratio (the count is a measurement gap, not lower "
        "hardware FLOPs)")
    assert tags[names.HFU_METHOD].startswith("analytic: the FlopCounterMode step counted less than the formula")


def test_a_resumed_attempt_keeps_the_gap_and_an_older_checkpoint_still_loads():
    from mlflow_llmeff.monitor.account import FlopsAccount

    a = FlopsAccount()
    a.load([None, "analytic: ...", "step 1: FlopCounterMode counted 40.0% ..."])  # a gap counted before
    assert a.hfu_ratio is None and a.hfu_counted and a.counter_gap.startswith("step 1: FlopCounterMode counted 40.0%")
    assert a.state() == [None, "analytic: ...", "step 1: FlopCounterMode counted 40.0% ..."]
    b = FlopsAccount()
    b.load([1.25, "FlopCounterMode on step 1 of the attempt"])  # the two-item form of earlier checkpoints
    assert (b.hfu_ratio, b.counter_gap, b.hfu_counted) == (1.25, None, True)


@pytest.mark.parametrize("sizes, world, expected", [
    (dict(dp_replicate_size=1, dp_shard_size=2, cp_size=2, tp_size=1), 4,
     {"data_parallel_size": 2, "context_parallel_size": 2}),
    (dict(dp_replicate_size=1, dp_shard_size=2, cp_size=1, tp_size=2), 4,
     {"data_parallel_size": 2, "context_parallel_size": 1}),  # fsdp x tp: tp peers are copies
    (dict(dp_replicate_size=1, dp_shard_size=2, cp_size=1, tp_size=1), 8, {}),  # does not fit: not guessed
])
def test_autolog_reads_accelerates_parallelism_config(monkeypatch, sizes, world, expected):
    from types import SimpleNamespace

    from accelerate import ParallelismConfig

    from mlflow_llmeff.autologging.hooks import _accelerate_degrees

    monkeypatch.setenv("WORLD_SIZE", str(world))
    acc = SimpleNamespace(parallelism_config=ParallelismConfig(**sizes), num_processes=world)
    assert _accelerate_degrees(acc) == expected
    assert _accelerate_degrees(SimpleNamespace(parallelism_config=None)) == {}
