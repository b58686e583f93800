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
