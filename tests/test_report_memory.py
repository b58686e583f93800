"""The comparison's memory section: configurations told apart and labelled by their levers, each with the
peak, its share of capacity and the model state split in bytes per parameter (hand-made runs)."""

from __future__ import annotations

from mlflow_llmeff import names
from mlflow_llmeff.report.calc import RunRecord
from mlflow_llmeff.report.memory import lever_label, memory_table
from mlflow_llmeff.report.repeats import configurations

BASE = {names.ACCEL_SHORT: "cpu", names.ACCEL_NAME: "Test CPU", names.ACCEL_COUNT: "1", names.PRECISION: "fp32",
        names.PAR_STRATEGY: "single", names.MODEL_NAME: "llama-tiny", names.MODEL_PARAMS: str(2**20),
        names.SEQ_LEN: "128", names.MICRO_BATCH_SIZE: "8", names.GRAD_ACCUM: "1", names.GLOBAL_BATCH_TOKENS: "1024",
        names.ACT_CKPT: "false", names.COMPILE: "false", names.DATASET: "python-docs", names.FLOPS_FORMULA: "megatron",
        names.V_LLMEFF: "0.1.0", names.STABILITY: "stable", names.ATTENTION: "sdpa", names.WEIGHTS: "fp32",
        names.MEMORY_SOURCE: "cpu: peak RSS above the meter's start"}
GIB = 2**30
PARAMS = 2**20  # 1 MiB of parameters: 4 MiB of fp32 weights = 4 B/param


def run(run_id, optimizer, opt_bpp, *, peak_gib=0.05, tps=1000.0, **tags):
    w = 4 * PARAMS / GIB  # fp32 weights and gradients, GiB
    m = {names.SUM_TOKENS_PER_SEC: tps, names.SUM_DEVICE_TOKENS_PER_SEC: tps, names.SUM_MEM_PEAK_GIB: peak_gib,
         names.SUM_MEM_PEAK_FRACTION: 0.25, names.SUM_MEM_WEIGHTS_GIB: w, names.SUM_MEM_GRADIENTS_GIB: w,
         names.SUM_MEM_OPT_STATE_GIB: opt_bpp * PARAMS / GIB, names.SUM_OPT_STATE_BYTES_PER_PARAM: opt_bpp,
         names.SUM_MODEL_STATE_BYTES_PER_PARAM: 8 + opt_bpp, names.SUM_MEM_OTHER_GIB: peak_gib - (8 + opt_bpp) * PARAMS / GIB,
         names.SUM_MFU_MEASURED_PEAK: 0.125}
    return RunRecord(run_id, f"run-{run_id}", metrics=m, tags={**BASE, names.OPTIMIZER: optimizer, **tags})


TORCH = "AdamW (torch.optim); states float32; from llmeff train --optimizer adamw"
AO8 = "AdamW8bit (torchao.optim); states int8 codes + float32 scales; from llmeff train --optimizer adamw8bit"
BNB8 = "AdamW8bit (bitsandbytes.optim); states uint8 codes + float32 absmax; from llmeff train --optimizer bnb-adamw8bit"


def test_four_levers_are_four_configurations_each_labelled_by_its_lever():
    runs = [run("a", TORCH, 8.0), run("b", AO8, 2.03), run("c", BNB8, 2.03),
            run("d", TORCH, 8.0, **{names.ATTENTION: "eager"}), run("e", TORCH, 8.0)]  # e repeats a
    configs = configurations(runs)
    assert len(configs) == 4 and [len(c.runs) for c in configs] == [2, 1, 1, 1]
    assert [lever_label(c) for c in configs] == [
        "AdamW (torch.optim), sdpa, fp32 weights", "AdamW8bit (torchao.optim), sdpa, fp32 weights",
        "AdamW8bit (bitsandbytes.optim), sdpa, fp32 weights", "AdamW (torch.optim), eager, fp32 weights"]


def test_the_memory_section_splits_the_model_state_in_bytes_per_parameter():
    m = memory_table(configurations([run("a", TORCH, 8.0), run("b", AO8, 2.03, peak_gib=0.04)]))
    assert m.columns[:9] == ["configuration", "levers (optimizer, attention, weights)", "peak GiB / device",
                             "of capacity", "weights B/param", "gradients B/param", "optimizer state B/param",
                             "model state B/param", "rest of peak GiB"]
    torch_row, ao_row = ([c.text for c in row] for row in m.rows)
    # 4 MiB of fp32 weights over 2^20 parameters: 4 B/param, exactly; the optimizer's ratio as logged
    # one run each: no interval (memory has no between-run floor), said in the cell
    assert torch_row[2:9] == ["0.05 (1 run)", "25.0%", "4", "4", "8", "16", "0.0344 (1 run)"]  # 0.05 - 16 MiB
    assert ao_row[6:8] == ["2.03", "10", ] and ao_row[8] == f"{0.04 - 10.03 * PARAMS / GIB:.3g} (1 run)"
    assert torch_row[10] == "12.5% *" and any(n.startswith("* MFU against the measured") for n in m.footnotes)
    assert any("peak on CPU" in n for n in m.footnotes)


def test_the_peak_of_repeats_carries_its_95_percent_interval():
    # a fresh user's study: peaks of two levers 0.137 and 0.134 GiB, with nothing saying whether that differs
    m = memory_table(configurations([run("a", TORCH, 8.0, peak_gib=0.05), run("b", TORCH, 8.0, peak_gib=0.06)]))
    row, = ([c.text for c in r] for r in m.rows)
    # mean 0.055, s = 0.00707, t(0.975, 1) = 12.706: half width 12.706 x 0.00707 / sqrt(2) = 0.0635, low clipped at 0
    assert row[2] == "0.055 [0, 0.119]"
    assert row[8] == f"{0.055 - 16 * PARAMS / GIB:.3g} [0, {0.055 - 16 * PARAMS / GIB + 0.0635:.3g}]"


def test_runs_from_before_the_memory_keys_have_no_memory_section():
    old = RunRecord("x", "old", metrics={names.SUM_TOKENS_PER_SEC: 1.0, names.SUM_DEVICE_TOKENS_PER_SEC: 1.0},
                    tags=dict(BASE))
    assert memory_table(configurations([old])) is None
    c, = configurations([old])
    assert lever_label(c) == "?, sdpa, fp32 weights"


def test_activation_checkpointing_is_named_among_the_levers():
    c, = configurations([run("a", TORCH, 8.0, **{names.ACT_CKPT: "true", names.WEIGHTS: "bf16"})])
    assert lever_label(c) == "AdamW (torch.optim), sdpa, bf16 weights, ckpt"


def test_lora_is_named_among_the_levers():
    c, = configurations([run("a", TORCH, 8.0, **{names.FLOPS_TRAINABLE: "3,584 of 129,216 parameters trainable "
                                                 "(2.7737%); LoRA r=8 on q_proj,v_proj in 2 layers"})])
    assert lever_label(c) == "AdamW (torch.optim), sdpa, fp32 weights, LoRA r=8 on q_proj,v_proj"
