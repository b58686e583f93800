"""ZeRO model state: the probe on fake DeepSpeed engines, the plan against DeepSpeed's own estimators (no processes)."""

from __future__ import annotations

import pytest
import torch

from mlflow_llmeff.meters.probes import model_state_bytes as measured_state
from mlflow_llmeff.planning.plan import model_state_bytes as planned_state

P = 1000  # parameters of the fake model: one 20 x 40 matrix (800) and one 200-element vector


def _model(dtype):
    m = torch.nn.Module()
    m.w = torch.nn.Parameter(torch.zeros(20, 40, dtype=dtype))
    m.v = torch.nn.Parameter(torch.zeros(200, dtype=dtype))
    return m


class _Wrapped:  # Accelerate's AcceleratedOptimizer around the engine's optimizer
    def __init__(self, zero):
        self.optimizer = zero


def _adam(master):
    inner = torch.optim.AdamW(master)
    for t in master:  # the two fp32 moments on each master partition
        inner.state[t] = {"step": torch.tensor(1.0), "exp_avg": torch.zeros_like(t), "exp_avg_sq": torch.zeros_like(t)}
    return inner


def _zero12(stage, dtype, n):
    """A DeepSpeedZeroOptimizer over ``n`` ranks as DeepSpeed 0.19 lays it out on one rank."""
    zero = type("DeepSpeedZeroOptimizer", (), {})()
    zero.partition_gradients = stage == 2
    zero.single_partition_of_fp32_groups = [torch.zeros(P // n, dtype=torch.float32)]
    zero.optimizer = _adam(zero.single_partition_of_fp32_groups)
    return zero


def _zero3(dtype, n, persist_v):
    """A DeepSpeedZeroOptimizer_Stage3: each parameter released (empty data) with its ds_tensor partition;
    the 200-element vector persistent (``ds_persist``) when ``persist_v``."""
    model = _model(dtype)
    for p in model.parameters():
        p.ds_numel, p.ds_persist = p.numel(), (persist_v and p.dim() == 1)
        p.ds_tensor = torch.zeros(p.numel() // n, dtype=dtype)
        p.data = torch.empty(0, dtype=dtype)  # released (empty_partition_cache partitions persistent ones too)
    zero = type("DeepSpeedZeroOptimizer_Stage3", (), {})()
    zero.fp32_partitioned_groups_flat = [torch.zeros(P // n, dtype=torch.float32)]
    zero.grad_partitions_flat_buffer = torch.zeros(P // n, dtype=dtype)
    zero.optimizer = _adam(zero.fp32_partitioned_groups_flat)
    return model, zero


# (stage, precision, n) -> bytes per parameter by hand
@pytest.mark.parametrize("stage, precision, n, per_param", [
    (1, "fp32", 2, 4 + 4 + 12 / 2),           # fp32 working copy and whole gradients, master + moments / 2
    (1, "bf16", 2, 2 + 2 + 4 / 2 + 12 / 2),   # + the fp32 copy of the gradient partition the step makes
    (2, "fp32", 2, 4 + 4 / 2 + 12 / 2),
    (2, "bf16", 2, 2 + (2 + 4) / 2 + 12 / 2),  # DeepSpeed's estimator: 2 + 18 / n = 11
    (2, "bf16", 4, 2 + (2 + 4) / 4 + 12 / 4),
])
def test_probe_counts_the_fp32_gradient_partition_of_16_bit_zero_1_and_2(stage, precision, n, per_param):
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    nbytes, nparams = measured_state(_model(dtype), _Wrapped(_zero12(stage, dtype, n)))
    assert nparams == P and nbytes / P == per_param
    assert sum(planned_state(P, f"deepspeed_zero{stage}", n, precision=precision)) / P == per_param


@pytest.mark.parametrize("precision, n, persist_v, per_param", [
    # no persistent tensor: partitions (b + b + 12) / n, and at the step the fp32 gradient copy 4 / n
    ("bf16", 2, False, (2 + 2 + 12) / 2 + 4 / 2),      # 10: DeepSpeed's 18 / n plus its 16-bit partition 2 / n
    ("fp32", 2, False, (4 + 4 + 12) / 2 + 4 / 2),      # 12: flatten copies the fp32 partition too
    # the 200-element vector whole on every rank in forward and backward: 4 B x 200 / 1000 = 0.8 < 4 / 2
    ("fp32", 2, True, (4 + 4 + 12) / 2 + 4 / 2),
    # over 8 ranks the step's copy is 4 / 8 = 0.5 B/param, below the whole vector's 0.8: forward decides
    ("fp32", 8, True, (4 + 4 + 12) / 8 + 4 * 200 / 1000),
    ("bf16", 8, True, (2 + 2 + 12) / 8 + 4 / 8),  # the whole vector 2 x 200 / 1000 = 0.4 < 0.5: the step
])
def test_probe_takes_the_larger_of_zero3_forward_and_step(precision, n, persist_v, per_param):
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    model, zero = _zero3(dtype, n, persist_v)
    nbytes, nparams = measured_state(model, _Wrapped(zero))
    assert nparams == P and nbytes / P == pytest.approx(per_param)
    planned = planned_state(P, "deepspeed_zero3", n, precision=precision, persistent_params=200 if persist_v else 0)
    assert sum(planned) / P == pytest.approx(per_param)


def test_zero3_on_one_rank_holds_no_second_copy_of_persistent_tensors():
    # one rank: the partition is the whole tensor, DeepSpeed gathers into its storage
    model, zero = _zero3(torch.float32, 1, True)
    assert measured_state(model, _Wrapped(zero))[0] / P == 4 + 4 + 12 + 4  # the step's fp32 copy
    assert sum(planned_state(P, "deepspeed_zero3", 1, precision="fp32", persistent_params=200)) / P == 24


# DeepSpeed's estimators against the plan: P = 1,000,000 parameters, the largest module 100,000 (ZeRO-3's
# gathered layer, 4 B each), no offload. Hand-computed cell, ZeRO-2 bf16 over 4 ranks:
# estimate_zero2_model_states_mem_needs: 2P + 18P / 4 = 2,000,000 + 4,500,000 = 6,500,000 B per device;
# the plan: weights 2P, gradients 2P / 4 + 4P / 4 (16-bit partition + its fp32 copy), optimizer 12P / 4
# = 2,000,000 + 1,500,000 + 3,000,000 = 6,500,000 B: equal.
EST_P, EST_LARGEST = 1_000_000, 100_000


@pytest.mark.parametrize("n", [1, 2, 4])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_plan_against_deepspeeds_estimators(stage, precision, n, monkeypatch):
    from conftest import require

    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    require("deepspeed", "pip install 'mlflow-llmeff[deepspeed]' after torch")
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    plan = sum(planned_state(EST_P, f"deepspeed_zero{stage}", n, precision=precision))
    _, z2 = estimate_zero2_model_states_mem_needs(EST_P, num_gpus_per_node=n, cpu_offload=False)
    _, z3, _ = estimate_zero3_model_states_mem_needs(EST_P, EST_LARGEST, num_gpus_per_node=n, cpu_offload=False,
                                                     cpu_offload_params=False)
    assert z2 == 2 * EST_P + 18 * EST_P // n and z3 == 4 * EST_LARGEST + 18 * EST_P // n  # their formulas
    # DeepSpeed sizes 16-bit mixed precision only; in fp32 the working copy and gradients are 4 B, and
    # ZeRO-1/2 keep no second gradient copy (.to(fp32) returns the fp32 partition)
    if stage == 2:
        assert plan == (z2 if precision == "bf16" else 4 * EST_P + 16 * EST_P / n)
    elif stage == 1:  # no estimator: ZeRO-2's with whole 16-bit gradients
        assert plan == (z2 + 2 * EST_P - 2 * EST_P / n if precision == "bf16" else 8 * EST_P + 12 * EST_P / n)
    else:  # the plan: a 16-bit partition of the weights (2 / n) where DeepSpeed adds the gathered largest layer
        b = 2 if precision == "bf16" else 4
        assert plan == (z3 - 4 * EST_LARGEST + 2 * EST_P / n if precision == "bf16"
                        else (b + b + 12 + 4) * EST_P / n)


def _zero3_engine(model, n):
    """A DeepSpeedZeroOptimizer_Stage3 over ``model``'s parameters on one of ``n`` ranks: each parameter
    released with its partition, those of at most DeepSpeed's 100,000 elements ``ds_persist``."""
    from mlflow_llmeff.planning.plan import ZERO3_PERSISTENCE_THRESHOLD

    total = 0
    for p in model.parameters():
        p.ds_numel, p.ds_persist = p.numel(), p.numel() <= ZERO3_PERSISTENCE_THRESHOLD
        p.ds_tensor = torch.zeros(p.numel() // n, dtype=p.dtype)
        total += p.numel()
        p.data = torch.empty(0, dtype=p.dtype)
    zero = type("DeepSpeedZeroOptimizer_Stage3", (), {})()
    zero.fp32_partitioned_groups_flat = [torch.zeros(total // n, dtype=torch.float32)]
    zero.grad_partitions_flat_buffer = torch.zeros(total // n, dtype=torch.float32)
    zero.optimizer = _adam(zero.fp32_partitioned_groups_flat)
    return zero


@pytest.mark.parametrize("n, per_param", [
    # 2 ranks: the step's 20 / 2 + 4 / 2 = 12 B/param beats forward's 20 / 2 + 4 x 921,344 / 3,084,032 = 11.195
    # (11.19: what bench/parallel.py measured on 2026-12-01, when the probe read the forward state only)
    (2, 12.0),
    # 8 ranks: the step holds 24 / 8 = 3; forward keeps the persistent tensors whole: 20 / 8 + 1.19499 = 3.69499
    (8, 20 / 8 + 4 * 921_344 / 3_084_032),
])
def test_the_bench_models_zero3_state_by_hand_in_the_plan_and_the_probe(n, per_param):
    # bench/parallel.py's 4-layer Llama (hidden 256, 8/4 heads, MLP 704, vocab 259, untied): every tensor of
    # at most 100,000 elements stays whole under ZeRO-3: per layer q, o 256 x 256 = 65,536, k, v 256 x 128 =
    # 32,768, two norms 256; embedding and LM head 259 x 256 = 66,304 each; final norm 256: 921,344 of the
    # 3,084,032 parameters. The MLP matrices (256 x 704 = 180,224) are partitioned.
    from transformers import LlamaConfig, LlamaForCausalLM

    from mlflow_llmeff.planning.plan import persistent_param_count

    cfg = LlamaConfig(num_hidden_layers=4, hidden_size=256, num_attention_heads=8, num_key_value_heads=4,
                      intermediate_size=704, vocab_size=259, max_position_embeddings=512)
    assert persistent_param_count(cfg) == 921_344
    planned = planned_state(3_084_032, "deepspeed_zero3", n, precision="fp32", persistent_params=921_344)
    assert sum(planned) / 3_084_032 == pytest.approx(per_param, rel=1e-12)
    model = LlamaForCausalLM(cfg)
    nbytes, nparams = measured_state(model, _Wrapped(_zero3_engine(model, n)))
    assert nparams == 3_084_032 and nbytes / nparams == pytest.approx(per_param, rel=1e-12)
