"""Predictions from earlier runs use only runs measured under the plan's speed conditions (planning/predict.py)."""

from __future__ import annotations

import statistics

import mlflow
import pytest

from mlflow_llmeff import names
from mlflow_llmeff.planning.plan import make_plan
from mlflow_llmeff.planning.predict import add_predictions, optimizer_of, trainable_of
from mlflow_llmeff.train.config import TrainConfig

#: The speed-condition tags an ``llmeff train`` run of llama-tiny logs by default (fp32 on a CPU).
DEFAULTS = {names.PRECISION: "fp32",
            names.OPTIMIZER: "AdamW (torch.optim); states fp32; from llmeff train --optimizer adamw",
            names.WEIGHTS: "fp32",
            names.FLOPS_TRAINABLE: "all 125,632 parameters trainable: 6 FLOPs per weight per token (Kaplan et al. "
                                   "2020; docs/formulas.md)",
            names.ATTENTION: "sdpa", names.COMPILE: "false", names.ACT_CKPT: "false",
            names.THREADS: "intra-op 2, inter-op 2"}


def llmeff_train_tags(**changed: str) -> dict[str, str]:
    """A finished llmeff train run's condition tags on a one-process CPU, llama-tiny at seq 128 x 8, ``changed``
    (tag key -> value) replacing the defaults."""
    return {names.ACCEL_SHORT: "cpu", names.MODEL_NAME: "llama-tiny", names.PAR_STRATEGY: "single",
            names.ACCEL_COUNT: "1", names.SEQ_LEN: "128", names.MICRO_BATCH_SIZE: "8", **DEFAULTS, **changed}


def _log(client, exp: str, tflops: float, tags: dict[str, str]) -> None:
    rid = client.create_run(exp, tags=tags).info.run_id
    client.log_metric(rid, names.SUM_DEVICE_TFLOPS, tflops)
    client.set_terminated(rid, "FINISHED")


def _predict(client, cfg: TrainConfig, precision: str) -> dict:
    plan = make_plan(cfg, accelerator_short="cpu", precision=precision, strategy="single")
    return add_predictions(plan, cfg, client=client, accelerator_short="cpu", strategy="single")


def _tps(plan: dict, tflops: float) -> float:
    """tokens/s of one device at ``tflops`` model TFLOP/s (the prediction's own arithmetic, by hand)."""
    return tflops * 1e12 / plan["flops_per_token_megatron"]


def test_fp32_and_bf16_plans_are_predicted_from_their_own_precisions_runs(tracking_uri):
    # the trial: both precisions printed 'median of 6 runs ...' and 7,766 tok/s, the median over 2 bf16 runs
    # (~2k tok/s) and 4 fp32 runs (4k-45k tok/s)
    client = mlflow.MlflowClient()
    exp = client.create_experiment("trial")
    fp32, bf16 = (0.004, 0.009, 0.02, 0.1), (0.0011, 0.0013)
    for tf in fp32:
        _log(client, exp, tf, llmeff_train_tags())
    for tf in bf16:
        _log(client, exp, tf, llmeff_train_tags(**{names.PRECISION: "bf16"}))
    cfg = TrainConfig(model="llama-tiny")
    got = _predict(client, cfg, "fp32")
    assert got["predicted_tokens_per_sec"] == pytest.approx(_tps(got, statistics.median(fp32)), rel=1e-12)
    assert got["prediction_basis"] == (
        "median of 4 runs of llama-tiny's shape with single on 1 device, seq_len 128, micro batch 8; all with "
        "precision fp32, optimizer adamw, fp32 weights, every weight trained, sdpa attention, not compiled, "
        "no activation checkpointing; threads intra-op 2, inter-op 2")
    got = _predict(client, cfg, "bf16")
    assert got["predicted_tokens_per_sec"] == pytest.approx(_tps(got, statistics.median(bf16)), rel=1e-12)
    assert got["prediction_basis"].startswith("median of 2 runs of llama-tiny's shape with single on 1 device, "
                                              "seq_len 128, micro batch 8; all with precision bf16, ")


@pytest.mark.parametrize("cfg_changes, tags", [
    (dict(optimizer="adamw8bit"),
     {names.OPTIMIZER: "AdamW8bit (torchao.optim); states uint8 codes + fp32 scales + fp32 tables; from llmeff "
                       "train --optimizer adamw8bit"}),
    (dict(optimizer="bnb-adamw8bit"),  # another loop's optimizer, known by its class
     {names.OPTIMIZER: "AdamW8bit (bitsandbytes.optim); states uint8 codes + fp32 absmax; from the user's loop"}),
    (dict(weights="bf16"), {names.WEIGHTS: "bf16", names.PRECISION: "bf16"}),
    (dict(lora_rank=8), {names.FLOPS_TRAINABLE: "1,024 of 126,656 parameters trainable (0.8085%); LoRA r=8 on "
                                                "q_proj,v_proj in 2 layers; embedding frozen, LM head frozen"}),
    (dict(compile=True), {names.COMPILE: "true"}),
    (dict(activation_checkpointing=True), {names.ACT_CKPT: "true"}),
    (dict(attn_implementation="eager"), {names.ATTENTION: "eager"}),
])
def test_each_lever_is_predicted_from_the_runs_that_used_it_only(tracking_uri, cfg_changes, tags):
    client = mlflow.MlflowClient()
    exp = client.create_experiment("levers")
    for tf in (0.01, 0.02, 0.03):  # the defaults: median 0.02
        _log(client, exp, tf, llmeff_train_tags())
    for tf in (0.5, 0.7):  # the lever: median 0.6
        _log(client, exp, tf, llmeff_train_tags(**tags))
    precision = tags.get(names.PRECISION, "fp32")
    lever = _predict(client, TrainConfig(model="llama-tiny", **cfg_changes), precision)
    assert lever["predicted_tokens_per_sec"] == pytest.approx(_tps(lever, 0.6), rel=1e-12)
    assert lever["prediction_basis"].startswith("median of 2 runs")
    plain = _predict(client, TrainConfig(model="llama-tiny"), "fp32")
    assert plain["predicted_tokens_per_sec"] == pytest.approx(_tps(plain, 0.02), rel=1e-12)
    assert plain["prediction_basis"].startswith("median of 3 runs")


def test_no_run_under_the_plans_conditions_gives_no_prediction_and_says_how_they_differ(tracking_uri):
    client = mlflow.MlflowClient()
    exp = client.create_experiment("none")
    for tf in (0.01, 0.02, 0.03, 0.04):
        _log(client, exp, tf, llmeff_train_tags())
    untagged = {k: v for k, v in llmeff_train_tags().items() if k not in (names.OPTIMIZER, names.WEIGHTS)}
    _log(client, exp, 0.05, untagged)  # a run that does not say its optimizer or weights matches no plan's
    got = _predict(client, TrainConfig(model="llama-tiny"), "bf16")
    assert "predicted_tokens_per_sec" not in got and "predicted_wall_s" not in got
    assert got["prediction_basis"] == (
        "no prediction: no earlier run of llama-tiny's shape on cpu was measured with precision bf16, optimizer "
        "adamw, fp32 weights, every weight trained, sdpa attention, not compiled, no activation checkpointing (of "
        "the 5 there: precision fp32 in 5; optimizer, weights not recorded in 1)")
    fp32 = _predict(client, TrainConfig(model="llama-tiny"), "fp32")  # the untagged run is left out
    assert fp32["predicted_tokens_per_sec"] == pytest.approx(_tps(fp32, 0.025), rel=1e-12)


def test_the_basis_names_mixed_threads(tracking_uri):
    client = mlflow.MlflowClient()
    exp = client.create_experiment("threads")
    for tf, threads in ((0.01, "intra-op 1, inter-op 1"), (0.02, "intra-op 2, inter-op 2"),
                        (0.03, "intra-op 2, inter-op 2")):
        _log(client, exp, tf, llmeff_train_tags(**{names.THREADS: threads}))
    got = _predict(client, TrainConfig(model="llama-tiny"), "fp32")
    assert got["predicted_tokens_per_sec"] == pytest.approx(_tps(got, 0.02), rel=1e-12)
    assert got["prediction_basis"].endswith("; threads mixed: intra-op 2, inter-op 2 (2 runs), intra-op 1, "
                                            "inter-op 1 (1 run)")


@pytest.mark.parametrize("tag, name", [
    ("AdamW (torch.optim); states fp32; from llmeff train --optimizer adamw", "adamw"),
    ("AdamWBf16 (mlflow_llmeff.train); states bf16; from llmeff train --optimizer adamw-bf16", "adamw-bf16"),
    ("AdamW (torch.optim); states fp32; from transformers Trainer optim=adamw_torch", "adamw"),
    ("AdamW (torch.optim) in DeepSpeedZeroOptimizer; states fp32; from the user's loop", "adamw"),
    ("AdamW8bit (torchao.optim); states not yet allocated; from the user's loop", "adamw8bit"),
    ("Lion (lion_pytorch.lion_pytorch); states fp32; from the user's loop", "lion"),
    ("unknown: AttributeError", None), (None, None),
])
def test_a_runs_optimizer_tag_is_read_as_the_option_it_ran(tag, name):
    assert optimizer_of(tag) == name


@pytest.mark.parametrize("tag, trained", [
    ("all 125,632 parameters trainable: 6 FLOPs per weight per token (Kaplan et al. 2020)", "every weight"),
    ("1,024 of 126,656 parameters trainable (0.8085%); LoRA r=8 on q_proj,v_proj in 2 layers; embedding frozen",
     "LoRA r=8 on q_proj,v_proj"),
    ("100 of 200 parameters trainable (50.0000%); 1 of 2 decoder layers frozen; embedding frozen", "partly frozen"),
    ("every weight counted trainable: RuntimeError: x", None), (None, None),
])
def test_a_runs_trainable_tag_is_read_as_what_it_trained(tag, trained):
    assert trainable_of(tag) == trained
