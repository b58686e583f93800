"""Tests for mlflow_llmeff.meters.flopcount: formula or meta-device count for any causal LM, and the cross-check."""

from __future__ import annotations

import functools
import json

import pytest
from click.testing import CliRunner
from transformers import CONFIG_MAPPING

from mlflow_llmeff.calc import flops as fl
from mlflow_llmeff.meters.flopcount import count_on_meta, resolve

# Tiny configs (2 layers, h 64) of every family the formula reads, built from the real transformers
# config classes: odd head widths, GQA, MoE with shared experts and dense layers, MLA, windows.
_BASE = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
             vocab_size=128, pad_token_id=0)
_MOE = dict(num_experts_per_tok=2, moe_intermediate_size=40)
FAMILIES = {
    "llama": dict(attention_bias=True, mlp_bias=True),
    "mistral": dict(sliding_window=8),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "qwen2": dict(use_sliding_window=True, sliding_window=8, max_window_layers=1),
    "qwen3": dict(head_dim=24, tie_word_embeddings=True),
    "qwen3_moe": dict(num_experts=4, head_dim=24, mlp_only_layers=[0], **_MOE),
    "qwen2_moe": dict(num_experts=4, shared_expert_intermediate_size=48, **_MOE),
    "gemma": dict(head_dim=24),
    "gemma2": dict(head_dim=24, sliding_window=8),
    "gemma3_text": dict(head_dim=24, sliding_window=8, sliding_window_pattern=2),
    "phi3": dict(),
    "olmo2": dict(),
    "olmoe": dict(num_experts=4, num_experts_per_tok=2),
    "granite": dict(),
    "granitemoe": dict(num_local_experts=4, num_experts_per_tok=2),
    "gpt_neox": dict(),
    "gpt2": dict(n_layer=2, n_embd=64, n_head=4, vocab_size=128),
    "deepseek_v3": dict(num_key_value_heads=4, n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=1,
                        q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12,
                        n_group=1, topk_group=1, **_MOE),
}
# What checkpointing re-executes differs by family (a norm or the router weights after the last
# matmul keep its output, so early stop must rerun it): checked on one of each kind.
RECOMPUTE_FAMILIES = ("llama", "gemma2", "mixtral", "deepseek_v3", "gpt2", "qwen2_moe")


def config_of(model_type: str):
    return CONFIG_MAPPING[model_type](**{**_BASE, **FAMILIES[model_type]})


@functools.cache
def counted_family(model_type: str) -> fl.CountedFlops:
    """One meta-device count per family for the whole module (each is a few forward/backward passes)."""
    return count_on_meta(config_of(model_type),
                         recompute=fl.Recompute() if model_type in RECOMPUTE_FAMILIES else None)


def bloom():
    # BLOOM is not in the formula: ALiBi, fused QKV, a plain 4h MLP, tied head.
    return CONFIG_MAPPING["bloom"](n_layer=2, hidden_size=64, n_head=4, vocab_size=128)


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_formula_agrees_with_the_meta_device_count_within_1_percent(model_type):
    config = config_of(model_type)
    assert model_type in fl.FORMULA_TYPES
    counted = counted_family(model_type)
    recompute = counted.recompute
    # the recompute check below runs for exactly the families counted with checkpointing: none drops out unseen
    assert (recompute is not None) == (model_type in RECOMPUTE_FAMILIES)
    for s in (16, 64):  # 64 is past the windows of 8: both sides apply the config's windows
        for conv in fl.CONVENTIONS:
            assert fl.flops_per_token(config, s, conv) == pytest.approx(fl.flops_per_token(counted, s, conv), rel=0.01)
        if recompute is not None:  # what HF checkpointing re-executes (early stop included), counted
            assert fl.recompute_flops_per_token(config, s, recompute) == pytest.approx(
                fl.recompute_flops_per_token(counted, s, recompute), rel=0.01)
    assert fl.param_counts(config)["total"] == counted.params_total   # sum(p.numel()) of the meta model


def test_formula_and_count_agree_exactly_today():
    # The 1% above leaves room for a transformers release adding a small matmul; today nothing differs.
    for model_type in ("deepseek_v3", "qwen3", "gemma2"):
        config, counted = config_of(model_type), counted_family(model_type)
        assert fl.flops_per_token(config, 64) == pytest.approx(fl.flops_per_token(counted, 64), rel=1e-12)


def test_an_architecture_the_formula_does_not_know_is_counted_on_the_meta_device():
    source = resolve(bloom())
    assert source.method == "meta_count" and source.note.startswith("meta_count: model_type 'bloom'")
    L, h, V, s = 2, 64, 128, 64
    layer = 3 * h * h + h * h + 2 * h * 4 * h          # fused QKV, dense, 4h MLP: 49,152
    weights = 6 * (L * layer + h * V)                  # tied head still counted: 638,976
    per_key = L * 12 * h                               # 1,536 per attended key (ALiBi's baddbmm counted)
    assert fl.flops_per_token(source.flops, s) == pytest.approx(weights + per_key * s / 2, rel=1e-12)   # 688,128
    assert fl.flops_per_token(source.flops, s, "palm") == pytest.approx(weights + per_key * s, rel=1e-12)
    # per layer 12h^2 weights + 13h biases and LayerNorms; the tied embedding; its LayerNorm and the final one
    assert fl.param_counts(source.flops)["total"] == L * (12 * h * h + 13 * h) + V * h + 2 * 2 * h == 108_416


def test_a_formula_family_resolves_to_the_formula():
    source = resolve(config_of("qwen3"))
    assert source.method == "formula" and isinstance(source.flops, fl.ModelShape)
    assert source.note.startswith("formula: qwen3")


@pytest.mark.parametrize("model_type, kwargs, why", [
    # transformers 5's Llama-4 runs every expert on every token: the count would be hardware FLOPs
    ("llama4_text", dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, intermediate_size=48, intermediate_size_mlp=96, vocab_size=128,
                         num_local_experts=4, num_experts_per_tok=1, attention_chunk_size=16, pad_token_id=0),
     "do not change with num_experts_per_tok"),
    ("t5", dict(d_model=64, num_layers=2, num_heads=4, d_ff=96, vocab_size=128), "cannot build it"),
])
def test_a_model_neither_path_can_count_gets_no_figure_and_says_why(model_type, kwargs, why):
    source = resolve(CONFIG_MAPPING[model_type](**kwargs))
    assert source.flops is None and source.method == "none"
    assert source.note.startswith(f"none: the formula does not know model_type {model_type!r}") and why in source.note


# --------------------------------------------------------------------------- llmeff flops
def test_cli_flops_of_a_local_directory_says_the_meta_count_was_used(tmp_path):
    from mlflow_llmeff.cli import main

    bloom().save_pretrained(tmp_path)
    result = CliRunner().invoke(main, ["flops", "--model", str(tmp_path), "--seq-len", "64", "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert out["method"] == "meta_count" and out["flops_per_token_megatron"] == pytest.approx(688_128, rel=1e-12)


def test_cli_flops_text_names_the_formula_for_a_known_family(tmp_path):
    from mlflow_llmeff.cli import main

    config_of("qwen3").save_pretrained(tmp_path)
    result = CliRunner().invoke(main, ["flops", "--model", str(tmp_path), "--seq-len", "64"])
    assert result.exit_code == 0, result.output
    assert "method: formula: qwen3 config fields" in result.output


def test_cli_flops_of_an_unreachable_hub_id_fails_in_one_line(monkeypatch):
    from mlflow_llmeff.cli import main

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    result = CliRunner().invoke(main, ["flops", "--model", "no-such-org/no-such-model", "--seq-len", "64"])
    assert result.exit_code == 1
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: model 'no-such-org/no-such-model' is not a preset")


def test_cli_flops_of_a_model_nobody_can_count_fails_in_one_line(tmp_path):
    from mlflow_llmeff.cli import main

    CONFIG_MAPPING["t5"](d_model=64, num_layers=2, num_heads=4, d_ff=96, vocab_size=128).save_pretrained(tmp_path)
    result = CliRunner().invoke(main, ["flops", "--model", str(tmp_path), "--seq-len", "64"])
    assert result.exit_code == 1
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "no FLOPs per token (none: the formula does not know model_type 't5'" in lines[0]


# ------------------------------------------------------------------------------------ what the kernel executes
@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_each_layers_matrices_add_up_to_its_weights(model_type):
    shape = fl.model_shape(config_of(model_type))
    assert [sum(m.weights for m in shape.layer_matrices(i)) for i in range(shape.layers)] == \
        [shape.layer_weights(i) for i in range(shape.layers)]


def test_a_causal_kernel_computes_the_triangle_with_its_diagonal():
    from mlflow_llmeff.meters.flopcount import causal_pairs, sdpa_backward_flops, sdpa_flops

    # 4 tokens: 1 + 2 + 3 + 4 = 10 pairs (2.5 keys a query); a window of 2: 1 + 2 + 2 + 2 = 7; chunks of
    # 2: (1 + 2) * 2 = 6; the dense square: 16
    assert fl.executed_attended_keys(4, causal=True) == 2.5 and fl.executed_attended_keys(4, causal=False) == 4.0
    assert fl.executed_attended_keys(4, 2, causal=True) == 7 / 4
    assert fl.executed_attended_keys(4, causal=True, chunk=2) == 6 / 4
    assert fl.executed_attended_keys([4, 2], causal=True) == pytest.approx((10 + 3) / 6, rel=1e-15)  # per sequence
    assert (causal_pairs(4, 4), causal_pairs(2, 4), causal_pairs(4, 2)) == (10, 3, 3 + 2 * 2)
    q = (1, 2, 4, 8)  # b, heads, s, d: 2 * 1 * 2 * 10 pairs * (8 + 8) = 640 forward
    assert sdpa_flops(q, q, q, True) == 640 and sdpa_flops(q, q, q) == 1024
    assert sdpa_backward_flops(q, q, q, q, True) == 2 * 2 * 10 * (3 * 8 + 2 * 8) == 1600


def test_the_step_counter_sees_cpu_sdpa_calls_and_whether_they_were_causal():
    import torch

    from mlflow_llmeff.meters.flopcount import step_counter

    q = torch.randn(1, 2, 16, 8, requires_grad=True)
    counter = step_counter()
    with counter:
        torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()
        torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(16, 16).tril().bool())
    assert counter.llmeff_attention == [("flash_attention_for_cpu", True), ("flash_attention_for_cpu", False)]
    assert counter.get_total_flops() == 0  # still invisible: the monitor adds CPU SDPA analytically


@pytest.mark.parametrize("attn, ratio, kernel", [
    # llama-tiny at s = 32: megatron 652,416 + 768 * 32 = 676,992 per token; a causal kernel computes
    # 16.5 keys a query (16 + the diagonal's 0.5): + 2 layers * 6 * 128 * 0.5 = 768; dense: 32 keys, 701,568
    ("sdpa", (676_992 + 768) / 676_992, "sdpa: causal kernel assumed"),
    ("flash_attention_2", (676_992 + 768) / 676_992, "flash_attention_2: causal kernel"),
    ("eager", 701_568 / 676_992, "eager: the full square"),
    (None, 701_568 / 676_992, "unset: kernel unknown, the full square assumed"),
])
def test_the_analytic_hfu_ratio_follows_the_configs_attention_kernel(attn, ratio, kernel):
    from mlflow_llmeff.models.build import load_config
    from mlflow_llmeff.monitor.account import FlopsAccount

    cfg = load_config("llama-tiny")
    cfg._attn_implementation = attn
    account = FlopsAccount(cfg)
    account.read_flops(None, activation_checkpointing=False, compiled=False)
    assert account.ratio(32.0) == pytest.approx(ratio, rel=1e-15)
    assert f"(kernel {kernel}" in account.hfu_note


def _counted_ratio(s: int, attn: str = "sdpa", pad: int = 0) -> tuple[float, str]:
    """HFU / MFU and llmeff.hfu.method of a monitored llama-tiny step at ``s`` tokens, counted with
    FlopCounterMode (CPU SDPA added analytically); ``pad`` padding tokens at the end of a second row."""
    from contextlib import nullcontext

    import mlflow
    import torch
    from transformers import AutoModelForCausalLM

    from mlflow_llmeff import names
    from mlflow_llmeff.models.build import load_config
    from mlflow_llmeff.monitor.meter import EfficiencyMonitor
    from mlflow_llmeff.testing import FakeClock

    cfg = load_config("llama-tiny")
    cfg.max_position_embeddings = s
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn)
    model.train()
    ids = torch.randint(0, 259, (2 if pad else 1, s), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids}
    if pad:
        mask = torch.ones_like(ids)
        mask[1, -pad:] = 0
        batch = {"input_ids": ids, "attention_mask": mask}
    clock = FakeClock()
    mon = EfficiencyMonitor(log_every_n_steps=2, warmup_steps=0, model=model, peak_tflops=1.0, clock=clock,
                            measure_energy="none", measure_peak=False)
    for i in range(2):
        with mon.counting_hardware_flops() if i == 0 else nullcontext():
            model(**batch, labels=ids).loss.backward()
            model.zero_grad()
            mon.count(batch)
        clock.t += 0.5
        mon.step()
    out = mon.finish()
    return out[names.SUM_HFU] / out[names.SUM_MFU], mlflow.MlflowClient().get_run(mon.run_id).data.tags[names.HFU_METHOD]


@pytest.fixture
def tracking_uri(module_store, monkeypatch):
    from conftest import use_store

    yield from use_store(module_store, monkeypatch)


def test_causal_sdpa_at_4096_reads_hfu_over_mfu_within_3_percent_of_one(tracking_uri):
    # llama-tiny (h 64: attention is 83% of its FLOPs at s = 4,096), one sequence, no recomputation. Per token:
    # model (megatron) 652,416 + 768 * 4,096 = 3,798,144; executed by the causal kernel: + 768 (the diagonal).
    ratio, method = _counted_ratio(4096)
    assert ratio == pytest.approx(1.0, abs=0.03)
    assert ratio == pytest.approx((3_798_144 + 768) / 3_798_144, rel=1e-9)  # 1.000202
    assert "CPU SDPA attention added analytically (causal: s(s+1)/2 pairs per sequence, is_causal=True" in method


def test_the_narrow_model_that_read_1_7_at_2048_now_reads_one(tracking_uri):
    """Before issue 51 this run read HFU / MFU = 1.7068 (reproduced at commit 2bbda7a: the CPU SDPA
    attention was added as the dense square, palm 652,416 + 1,536 * 2,048 = 3,798,144 per token over
    the megatron 652,416 + 768 * 2,048 = 2,225,280). The causal kernel computes the triangle:
    (2,225,280 + 768) / 2,225,280 = 1.000345."""
    ratio, _ = _counted_ratio(2048)
    assert 3_798_144 / 2_225_280 == pytest.approx(1.7068, abs=1e-4)
    assert ratio == pytest.approx(1.0, abs=0.03)
    assert ratio == pytest.approx((2_225_280 + 768) / 2_225_280, rel=1e-9)


def test_a_padding_mask_makes_sdpa_compute_the_full_square_and_says_so(tracking_uri):
    # transformers passes the padding mask and is_causal=False: the kernel computes every pair
    ratio, method = _counted_ratio(256, pad=1)
    assert "dense: the full square, is_causal=False" in method
    dense = fl.hardware_model_ratio(load_tiny(), (256 ** 2 + 255 ** 2) / 511)
    assert ratio == pytest.approx(dense, rel=0.01)  # the padded position's matmuls are executed too


def test_eager_attention_is_counted_as_the_full_square(tracking_uri):
    ratio, method = _counted_ratio(256, attn="eager")
    assert ratio == pytest.approx(fl.hardware_model_ratio(load_tiny(), 256), rel=1e-9)
    assert "no fused attention call" in method


def load_tiny():
    from mlflow_llmeff.models.build import load_config

    return load_config("llama-tiny")


def test_the_is_causal_positions_match_the_attention_ops_schemas():
    import torch

    from mlflow_llmeff.meters.flopcount import CAUSAL_ARG

    for name, index in CAUSAL_ARG.items():
        op = getattr(torch.ops.aten, name, None)
        if op is not None:
            assert [a.name for a in op.default._schema.arguments].index("is_causal") == index, name
