"""LoRA through ``llmeff train --lora-rank 8 --lora-targets q_proj,v_proj`` (issue 51): the run counts the FLOPs of
what trains, by the hand count of tests/test_lora.py (llama-tiny, r=8 on q and v: 438,016 + 768 s per token;
trained in full 652,416 + 768 s), and only the adapters get optimizer state."""

from __future__ import annotations

import mlflow
import pytest

from mlflow_llmeff import names
from mlflow_llmeff.train.config import TrainConfig, validate

from conftest import require_peft

pytestmark = pytest.mark.slow

LORA = lambda s: 438_016 + 768 * s  # noqa: E731 - tests/test_lora.py's module docstring derives it
FULL = lambda s: 652_416 + 768 * s  # noqa: E731
TRAINABLE, PARAMS = 3_584, 129_216  # adapters' weights: q 512 + 512, v 512 + 256, in 2 layers; llama-tiny's own


@pytest.fixture(scope="module")
def lora_run(module_store):
    require_peft()
    from mlflow_llmeff.train.loop import run_training

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLFLOW_TRACKING_URI", module_store)
        mp.delenv("MLFLOW_RUN_ID", raising=False)
        mlflow.set_tracking_uri(module_store)
        try:
            out = run_training(TrainConfig(lora_rank=8, lora_targets="q_proj,v_proj", max_steps=6, log_every_n_steps=3,
                                           seq_len=32, micro_batch_size=2, measure_energy="none", peak_tflops=1.0))
            run = mlflow.MlflowClient().get_run(out["run_id"])
        finally:
            mlflow.set_tracking_uri(None)
    return run


def test_a_lora_run_counts_the_hand_flops_per_token(lora_run):
    m = lora_run.data.metrics
    assert lora_run.info.status == "FINISHED"
    assert (lora_run.data.params["lora_rank"], lora_run.data.params["lora_targets"]) == ("8", "q_proj,v_proj")
    # FLOPs per token read back: achieved TFLOP/s per device over tokens/s per device (the same window)
    assert m[names.SUM_DEVICE_TFLOPS] * 1e12 / m[names.SUM_DEVICE_TOKENS_PER_SEC] == pytest.approx(LORA(32), rel=1e-9)
    # MFU at the run's tokens/s: the same speed trained in full would read FULL / LORA = 1.4635 x higher
    assert m[names.SUM_MFU] == pytest.approx(m[names.SUM_DEVICE_TOKENS_PER_SEC] * LORA(32) / 1e12, rel=1e-9)
    assert FULL(32) / LORA(32) == pytest.approx(1.4635, abs=1e-4)
    assert "LoRA r=8 on q_proj,v_proj in 2 layers" in lora_run.data.tags[names.FLOPS_METHOD]
    assert lora_run.info.run_name.startswith("tiny-lora8-fp32-")  # the lever, named


def test_only_the_adapters_hold_optimizer_state(lora_run):
    m = lora_run.data.metrics
    # fp32 AdamW moments of the 3,584 adapter weights (8 B each) over the model's 129,216 parameters, plus the
    # optimizer's 0-d step counters (4 B for each of the 8 adapter matrices)
    assert m[names.SUM_OPT_STATE_BYTES_PER_PARAM] == pytest.approx((8 * TRAINABLE + 4 * 8) / PARAMS, rel=1e-9)


@pytest.mark.parametrize("kw, line", [
    ({"lora_rank": -1}, "lora_rank=-1 must be >= 0 (0 = train every weight)"),
    ({"lora_rank": 8, "lora_targets": " , "}, "lora_targets=' , ' names no module; give e.g. q_proj,v_proj"),
    ({"lora_rank": 8, "parallelism": "fsdp", "num_processes": 2},
     "lora_rank=8 with parallelism='fsdp': LoRA adapters train here with parallelism auto, single or ddp"),
])
def test_bad_lora_settings_are_one_line(kw, line):
    with pytest.raises(ValueError) as e:
        validate(TrainConfig(measure_energy="none", **kw))
    assert str(e.value) == line


def test_the_plan_and_the_fit_check_count_only_the_adapters_gradients_and_state():
    # a trial: llmeff plan --lora-rank 8 gave the full model's gradients and AdamW state, so the fit check refused
    # a LoRA run of llama3-8b in bf16 that fits a 24 GiB machine
    from mlflow_llmeff.planning.plan import make_plan

    require_peft()  # validate checks that peft is there before it reads the targets
    plan = make_plan(TrainConfig(lora_rank=8, lora_targets="q_proj,v_proj", seq_len=128, measure_energy="none"),
                     accelerator_short="cpu", precision="fp32", strategy="single")
    # fp32 weights: the base's 125,632 and the adapters' 3,584; gradients of the adapters only; AdamW's two fp32
    # moments of the adapters and a 4-byte step counter for each of their 8 matrices
    assert round(plan["memory_weights_gib"] * 2**30) == 4 * (125_632 + TRAINABLE)
    assert round(plan["memory_gradients_gib"] * 2**30) == 4 * TRAINABLE
    assert round(plan["memory_optimizer_gib"] * 2**30) == 8 * TRAINABLE + 4 * 8
    assert plan["flops_per_token_megatron"] == LORA(128)
    assert plan["trainable"].startswith("LoRA r=8 on q_proj,v_proj: 3,584 adapter weights trained")
    with pytest.raises(ValueError, match=r"^LoRA targets foo_proj match no matrix of this model; accepted: down_proj"):
        validate(TrainConfig(lora_rank=8, lora_targets="foo_proj", measure_energy="none"))
