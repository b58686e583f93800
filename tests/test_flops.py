"""Tests for mlflow_llmeff.calc.flops: reference FLOPs, hand-computed shapes, the flop counter, MFU/HFU."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from click.testing import CliRunner
from transformers import (AutoModelForCausalLM, DeepseekV3Config, Gemma2Config, GPT2Config, LlamaConfig,
                          MistralConfig, MixtralConfig, Qwen2Config, Qwen3Config)

from mlflow_llmeff.calc.flops import (Recompute, attention_flops_per_token, effective_seq_len, flops_per_token,
                                      flops_summary, hardware_model_ratio, mean_attended_keys, mfu_warning,
                                      model_shape, param_counts, recompute_flops_per_token, utilization)
from mlflow_llmeff.meters.flopcount import measure_step_flops
from mlflow_llmeff.calc import flops as fl
from mlflow_llmeff.models.build import load_config


def llama(L, h, n, g, f, V, **kw):
    return LlamaConfig(num_hidden_layers=L, hidden_size=h, num_attention_heads=n, num_key_value_heads=g,
                       intermediate_size=f, vocab_size=V, **kw)


LLAMA2_7B = llama(32, 4096, 32, 32, 11008, 32000)
LLAMA3_8B = llama(32, 4096, 32, 8, 14336, 128256)
LLAMA2_70B = llama(80, 8192, 64, 8, 28672, 32000)
MIXTRAL_8X7B = MixtralConfig(num_hidden_layers=32, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
                             intermediate_size=14336, vocab_size=32000, num_local_experts=8, num_experts_per_tok=2)
MISTRAL_7B = MistralConfig(num_hidden_layers=32, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
                           intermediate_size=14336, vocab_size=32000, sliding_window=4096)
GPT2_124M = GPT2Config(n_layer=12, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024)

# Tiny models for the flop counter: attention is a sizeable share (s = 64 = h), so a miscounted
# attention term would show.
TINY = {
    "llama": llama(2, 64, 4, 2, 176, 259),
    "gpt2": GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=259, n_positions=128, bos_token_id=0,
                       eos_token_id=0),
    "moe": MixtralConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=96, vocab_size=259, num_local_experts=4, num_experts_per_tok=2),
}


# --------------------------------------------------------------------------- published references
@pytest.mark.parametrize("config, s, megatron, palm", [
    (LLAMA2_7B, 4096, "42.8637", "46.0849"),
    (LLAMA3_8B, 8192, "51.4704", "57.9129"),
    (LLAMA2_70B, 4096, "428.3852", "444.4914"),
], ids=["llama2-7b", "llama3-8b", "llama2-70b"])
def test_flops_per_token_matches_metrics_md_reference_values(config, s, megatron, palm):
    assert f"{flops_per_token(config, s) / 1e9:.4f}" == megatron
    assert f"{flops_per_token(config, s, 'palm') / 1e9:.4f}" == palm


def test_megatron_formula_is_the_metrics_md_closed_form():
    L, h, n, g, f, V, s = 32, 4096, 32, 8, 14336, 128256, 8192
    closed = L * h * h * (12 + 12 * g / n + 18 * f / h + 6 * s / h) + 6 * h * V
    assert flops_per_token(LLAMA3_8B, s) == closed


def test_palm_is_six_n_plus_twelve_lhs():
    # N: matmul weights without the input embedding (norms left out, as METRICS.md's table does).
    n_matmul = param_counts(LLAMA2_7B)["non_embedding"] - (2 * 32 + 1) * 4096
    assert flops_per_token(LLAMA2_7B, 4096, "palm") == 6 * n_matmul + 12 * 32 * 4096 * 4096


def test_llama2_7b_param_counts_match_published_6_74b():
    assert param_counts(LLAMA2_7B) == {"total": 6_738_415_616, "non_embedding": 6_607_343_616,
                                       "active": 6_738_415_616}


# --------------------------------------------------------------------------- hand-computed shapes
def test_gpt2_124m_flops_plain_mlp_tied_head_learned_positions():
    L, h, V, s = 12, 768, 50257, 1024
    # Per layer: QKV+O 6*4h^2, plain MLP (f = 4h, two matrices) 6*2*h*4h, attention 6*h*s.
    per_layer = 6 * 4 * h * h + 6 * 2 * h * 4 * h + 6 * h * s     # 47,185,920
    head = 6 * h * V                                              # 231,584,256 (tied, still counted)
    assert per_layer * L + head == 797_815_296
    assert flops_per_token(GPT2_124M, s) == 797_815_296
    assert flops_per_token(GPT2_124M, s, "palm") == 797_815_296 + 6 * L * h * s


def test_gpt2_124m_param_counts_match_published_124m():
    # total: the well-known 124,439,808; non-embedding drops wte (50257*768) and wpe (1024*768).
    assert param_counts(GPT2_124M) == {"total": 124_439_808, "non_embedding": 124_439_808 - 50257 * 768 - 1024 * 768,
                                       "active": 124_439_808}


def test_mixtral_flops_count_top_k_experts_and_router_only():
    L, h, g_d, f, V, E, k, s = 32, 4096, 1024, 14336, 32000, 8, 2, 4096
    attn_proj = 6 * (2 * h * h + 2 * h * g_d)     # 251,658,240
    experts = k * 6 * 3 * h * f                   # 2 of 8 experts: 2,113,929,216
    router = 6 * h * E                            # 196,608
    attention = 6 * h * s                         # causal, counted once: 100,663,296
    expected = L * (attn_proj + experts + router + attention) + 6 * h * V
    assert expected == 79_712_747_520
    assert flops_per_token(MIXTRAL_8X7B, s) == expected


def test_mixtral_param_counts_total_and_active():
    # Published: 46.7B total, 12.9B active (2 of 8 experts per token).
    p = param_counts(MIXTRAL_8X7B)
    assert p["total"] == 46_702_792_704
    assert p["active"] == p["total"] - 32 * 6 * 3 * 4096 * 14336 == 12_879_925_248


def test_tied_embeddings_keep_lm_head_flops_but_count_weights_once():
    untied, tied = llama(2, 64, 4, 4, 176, 259), llama(2, 64, 4, 4, 176, 259, tie_word_embeddings=True)
    assert flops_per_token(tied, 64) == flops_per_token(untied, 64)
    assert param_counts(untied)["total"] - param_counts(tied)["total"] == 259 * 64


def test_sliding_window_uses_mean_attended_keys():
    # Mistral-7B, s = 8192, window 4096: mean keys per query (megatron) = w - w^2/(2s) = 3072.
    L, h, s, w = 32, 4096, 8192, 4096
    no_attention = flops_per_token(MISTRAL_7B, 1) - L * 12 * h * 0.5       # s = 1 -> 1/2 key
    assert no_attention == 42_662_363_136
    assert mean_attended_keys(s, w) == 3072
    assert flops_per_token(MISTRAL_7B, s) == no_attention + L * 12 * h * 3072 == 47_494_201_344
    assert flops_per_token(MISTRAL_7B, s, "palm") == no_attention + L * 12 * h * w   # min(s, w) keys


def test_sliding_window_wider_than_sequence_changes_nothing():
    assert flops_per_token(MISTRAL_7B, 4096) == flops_per_token(
        llama(32, 4096, 32, 8, 14336, 32000), 4096)


def test_qwen2_windows_only_the_layers_its_layer_types_mark():
    q = Qwen2Config(num_hidden_layers=4, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                    intermediate_size=176, vocab_size=259, use_sliding_window=True, sliding_window=16,
                    max_window_layers=2)
    assert model_shape(q).windows == (None, None, 16, 16)
    # 2 full layers (64/2 = 32 keys) + 2 windowed layers (16 - 16^2/128 = 14 keys), 12*h*k each.
    assert attention_flops_per_token(q, 64) == 12 * 64 * (32 + 32 + 14 + 14)


def test_effective_seq_len_is_sum_of_squares_over_sum():
    assert effective_seq_len([4, 2]) == pytest.approx(20 / 6)
    assert effective_seq_len([512, 512]) == 512


def test_variable_lengths_give_the_effective_length_flops():
    lengths = [1000, 200, 50]
    # by hand: s_eff = (1000^2 + 200^2 + 50^2) / 1250 = 834, megatron keys s_eff / 2 = 417; matmul weights
    # 6,607,343,616 non-embedding less 65 norms of 4096 = 6,607,077,376: 6 x that + 12 x 32 x 4096 x 417
    assert effective_seq_len(lengths) == 834
    assert flops_per_token(LLAMA2_7B, lengths) == 6 * 6_607_077_376 + 12 * 32 * 4096 * 417 == 40_298_348_544
    assert flops_per_token(LLAMA2_7B, lengths) == pytest.approx(flops_per_token(LLAMA2_7B, 834.0), rel=1e-12)


def test_shape_object_is_read_as_llama():
    shape = SimpleNamespace(num_hidden_layers=32, hidden_size=4096, num_attention_heads=32,
                            num_key_value_heads=32, intermediate_size=11008, vocab_size=32000)
    assert flops_per_token(shape, 4096) == flops_per_token(LLAMA2_7B, 4096)


@pytest.mark.parametrize("name", list(TINY) + ["qwen2", "mistral", "llama_biased_tied"])
def test_param_counts_match_the_built_model(name):
    extra = {
        "qwen2": Qwen2Config(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                             intermediate_size=176, vocab_size=259),
        "mistral": MistralConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                 intermediate_size=176, vocab_size=259, sliding_window=16),
        "llama_biased_tied": llama(2, 64, 4, 2, 176, 259, attention_bias=True, mlp_bias=True,
                                   tie_word_embeddings=True),
    }
    config = TINY.get(name) or extra[name]
    model = AutoModelForCausalLM.from_config(config)
    assert param_counts(config)["total"] == sum(p.numel() for p in model.parameters())


# --------------------------------------------------------------------------- families beyond Llama
def qwen3_06b(tied=True):
    # Qwen/Qwen3-0.6B config.json: head_dim 128 with 16 heads, so n*d = 2048 != hidden 1024; tied embeddings.
    return Qwen3Config(num_hidden_layers=28, hidden_size=1024, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=128, intermediate_size=3072, vocab_size=151936, tie_word_embeddings=tied)


def test_qwen3_flops_use_head_dim_apart_from_hidden_over_heads():
    L, h, n, g, d, f, V, s = 28, 1024, 16, 8, 128, 3072, 151936, 4096
    attn_proj = h * n * d + 2 * h * g * d + n * d * h     # Q, K, V, O: 6,291,456 (h*h*(2 + 2g/n) would be 3,145,728)
    mlp = 3 * h * f                                        # 9,437,184
    head = h * V                                           # 155,582,464: the LM head, tied or not
    weights = 6 * (L * (attn_proj + mlp) + head)           # 3,575,906,304
    attention = L * 12 * n * d                             # per attended key: 688,128
    assert weights + attention * s // 2 == 4_985_192_448
    assert flops_per_token(qwen3_06b(), s) == 4_985_192_448              # megatron: s/2 keys
    assert flops_per_token(qwen3_06b(), s, "palm") == weights + attention * s == 6_394_478_592


def test_qwen3_tied_and_untied_embeddings_give_the_same_flops():
    tied, untied = qwen3_06b(True), qwen3_06b(False)
    for conv in ("megatron", "palm"):
        assert flops_per_token(tied, 4096, conv) == flops_per_token(untied, 4096, conv)
    # parameters: the tied LM head is the embedding, counted once (published: 0.6B, 0.44B non-embedding)
    assert param_counts(tied) == {"total": 596_049_920, "non_embedding": 440_467_456, "active": 596_049_920}
    assert param_counts(untied)["total"] - param_counts(tied)["total"] == 151936 * 1024


def test_gemma2_flops_window_every_other_layer_and_head_dim_256():
    # google/gemma-2-2b config.json: 26 layers, h 2304, 8 heads of 256 (n*d = 2048), 4 KV heads, f 9216,
    # V 256000, tied; layer_types alternate sliding (window 4096) and full attention.
    g2 = Gemma2Config(num_hidden_layers=26, hidden_size=2304, num_attention_heads=8, num_key_value_heads=4,
                      head_dim=256, intermediate_size=9216, vocab_size=256000, sliding_window=4096)
    L, h, n, g, d, f, V, s, w = 26, 2304, 8, 4, 256, 9216, 256000, 8192, 4096
    assert model_shape(g2).windows == (w, None) * 13
    weights = 6 * (L * (2 * h * n * d + 2 * h * g * d + 3 * h * f) + h * V)      # 15,684,599,808
    per_key = 12 * n * d                                                          # 24,576 per layer
    sliding_keys = w - w * w / (2 * s)                                            # 3,072 (megatron band)
    assert flops_per_token(g2, s) == weights + 13 * per_key * (s / 2 + sliding_keys) == 17_974_689_792
    assert flops_per_token(g2, s, "palm") == weights + 13 * per_key * (s + w) == 19_610_468_352
    assert param_counts(g2)["total"] == 2_614_341_888  # published 2.61B (four norms per layer)


def deepseek_v3():
    # deepseek-ai/DeepSeek-V3 config.json (the multi-token-prediction layer, not in transformers' model, left out)
    return DeepseekV3Config(num_hidden_layers=61, hidden_size=7168, num_attention_heads=128, num_key_value_heads=128,
                            q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
                            v_head_dim=128, first_k_dense_replace=3, intermediate_size=18432,
                            moe_intermediate_size=2048, n_routed_experts=256, num_experts_per_tok=8,
                            n_shared_experts=1, vocab_size=129280)


def test_deepseek_v3_flops_mla_dense_layers_then_moe_with_a_shared_expert():
    L, h, n, V, s = 61, 7168, 128, 129280, 4096
    mla = (h * 1536 + 1536 * n * (128 + 64)        # q_a, q_b (low-rank query)
           + h * (512 + 64) + 512 * n * (128 + 128)  # kv_a (latent + shared rope key), kv_b (keys and values)
           + n * 128 * h)                           # o: 187,105,280
    dense = 3 * h * 18432                          # the first 3 layers: 396,361,728
    moe = 8 * 3 * h * 2048 + 1 * 3 * h * 2048 + h * 256   # 8 routed + 1 shared expert + router: 398,196,736
    weights = 3 * (mla + dense) + 58 * (mla + moe) + h * V
    assert weights == 36_624_596_992                 # the "37B activated" of the DeepSeek-V3 report
    per_key = 6 * n * (192 + 128)                    # QK^T over 192-wide heads, scores @ V over 128
    assert flops_per_token(deepseek_v3(), s) == 6 * weights + L * per_key * s / 2 == 250_449_887_232
    assert flops_per_token(deepseek_v3(), s, "palm") == 6 * weights + L * per_key * s == 281_152_192_512
    p = param_counts(deepseek_v3())
    assert p["total"] == 671_026_404_352 and p["active"] == 37_552_282_624   # published: 671B total, 37B active


def test_chunked_attention_keys_per_query_stay_in_the_chunk():
    # 10 tokens in chunks of 4: chunks of 4, 4, 2 -> causal pairs 8 + 8 + 2 = 18 (megatron), 16 + 16 + 4 = 36 (palm)
    assert mean_attended_keys(10, chunk=4) == 1.8
    assert mean_attended_keys(10, chunk=4, convention="palm") == 3.6
    assert mean_attended_keys(8, chunk=8) == mean_attended_keys(8) == 4.0   # a chunk as long as the sequence


# --------------------------------------------------------------------------- recomputation (HFU)
def test_recompute_is_each_layers_forward_less_the_early_stopped_down_projection():
    config, s = TINY["llama"], 64                   # L2 h64 n4 g2 d16 f176 V259
    layer_fwd = 2 * (4096 + 2048 + 2048 + 4096 + 3 * 64 * 176) + 2 * 128 * s   # 108,544 per token
    down = 2 * 64 * 176                             # 22,528: its output only feeds the residual add
    assert recompute_flops_per_token(config, s, Recompute(early_stop=False)) == 2 * layer_fwd
    assert recompute_flops_per_token(config, s, Recompute()) == 2 * (layer_fwd - down) == 172_032
    assert recompute_flops_per_token(config, s, Recompute(layers=(0,))) == layer_fwd - down
    assert recompute_flops_per_token(config, s, None) == 0
    # HFU / MFU: palm plus the recomputation over megatron; the LM head (6*64*259) is in neither's recompute
    assert hardware_model_ratio(config, s, recompute=True) == pytest.approx(
        (flops_per_token(config, s, "palm") + 172_032) / flops_per_token(config, s))


# --------------------------------------------------------------------------- errors
def test_unknown_convention_is_rejected():
    with pytest.raises(ValueError, match="convention 'chinchilla'.*megatron, palm"):
        flops_per_token(LLAMA2_7B, 4096, "chinchilla")


def test_a_model_type_the_formula_does_not_know_is_rejected_by_the_formula():
    with pytest.raises(ValueError, match="model_type 'bloom'.*llama.*meta device"):
        flops_per_token(SimpleNamespace(model_type="bloom"), 128)


@pytest.mark.parametrize("bad", [0, -5, [], [3, -1]])
def test_bad_lengths_are_rejected(bad):
    with pytest.raises(ValueError, match="seq_len"):
        flops_per_token(LLAMA2_7B, bad)


# --------------------------------------------------------------------------- flop counter
def _model(name, attn="eager"):
    kw = {"attn_implementation": attn}
    if name == "moe":
        kw["experts_implementation"] = "eager"  # grouped_mm is not counted by FlopCounterMode
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(TINY[name], **kw)
    m.train()
    return m


def _step(model, batch=2, seq=64):
    ids = torch.randint(0, 259, (batch, seq), generator=torch.Generator().manual_seed(0))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step():
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    return step


@pytest.mark.parametrize("name", list(TINY))
def test_analytic_count_agrees_with_flop_counter_within_2_percent(name):
    # Eager attention materialises the full s x s score matrix (the mask is applied after the
    # matmul), so the counter sees the palm convention (no causal discount). Everything the
    # counter counts is a matmul the formula has; what the formula leaves out (norms, softmax,
    # activations, RoPE's tiny frequency product, biases) is not a counted matmul or is well under
    # 1% here. 2% leaves room for such transformers implementation details; today it is exact.
    counted = measure_step_flops(_step(_model(name)))
    analytic = flops_per_token(TINY[name], 64, "palm") * 2 * 64
    assert counted == pytest.approx(analytic, rel=0.02)


def test_cpu_sdpa_attention_is_invisible_to_the_flop_counter():
    counted = measure_step_flops(_step(_model("llama", attn="sdpa")))
    tokens = 2 * 64
    expected = (flops_per_token(TINY["llama"], 64, "palm") - attention_flops_per_token(TINY["llama"], 64, "palm"))
    assert counted == pytest.approx(expected * tokens, rel=0.02)


def test_activation_checkpointing_raises_hardware_flops_by_a_third_of_the_layers():
    from torch.utils.checkpoint import set_checkpoint_early_stop

    config, tokens = TINY["llama"], 2 * 64
    model_flops = flops_per_token(config, 64, "palm") * tokens   # MFU numerator: no recomputation
    plain = measure_step_flops(_step(_model("llama")))
    m = _model("llama")
    m.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    # Early stop would skip recomputing each layer's last matmul (its output is not saved for
    # backward); turn it off to count the full recomputation the "4/3" refers to.
    with set_checkpoint_early_stop(False):
        ckpt = measure_step_flops(_step(m))
    head = 6 * 64 * 259 * tokens                                   # LM head: not checkpointed
    assert plain == pytest.approx(model_flops, rel=1e-9)           # without recomputation, HW == model
    assert (ckpt - head) / (plain - head) == pytest.approx(4 / 3, rel=1e-9)   # layers: fwd counted twice
    assert 1 < ckpt / plain < 4 / 3
    # by hand: palm FLOPs per token at s 64 = 2 * 4096 * (12 + 6 + 49.5 + 12) + 99,456 = 750,720, x 128 tokens
    # = 96,092,160; recomputed: head 12,730,368 + 4/3 x 83,361,792 = 123,879,424; over 0.5 s against 1 TFLOP/s
    assert (model_flops, ckpt) == (96_092_160, pytest.approx(123_879_424, rel=1e-9))
    seconds, peak = 0.5, 1.0
    assert utilization(model_flops / seconds / 1e12, peak) == pytest.approx(1.9218432e-4, rel=1e-12)
    assert utilization(ckpt / seconds / 1e12, peak) == pytest.approx(2.47758848e-4, rel=1e-9)


def test_hf_activation_checkpointing_reruns_exactly_the_recompute_the_formula_gives():
    # transformers 5 default (activation_checkpointing_enable()): every decoder layer, non-reentrant,
    # early stop. Counted on a real step it adds 172,032 FLOPs per token (hand-computed in
    # test_recompute_is_each_layers_forward_less_the_early_stopped_down_projection): each layer's
    # forward less its down projection; no LM head (6*64*259 = 99,456 per token) and no embedding.
    from mlflow_llmeff.monitor.conditions import recompute_plan

    tokens = 2 * 64
    plain = measure_step_flops(_step(_model("llama")))
    m = _model("llama")
    m.activation_checkpointing_enable()
    assert recompute_plan(m) == Recompute(layers=None, early_stop=True)
    ckpt = measure_step_flops(_step(m))
    assert ckpt - plain == 172_032 * tokens
    assert (plain + recompute_flops_per_token(TINY["llama"], 64, recompute_plan(m)) * tokens) / plain \
        == pytest.approx(ckpt / plain, rel=1e-12)
    every_other = _model("llama")
    every_other.activation_checkpointing_enable(every_n_layers=2)   # layer 0 only
    assert recompute_plan(every_other) == Recompute(layers=(0,), early_stop=True)
    assert measure_step_flops(_step(every_other)) - plain == 172_032 // 2 * tokens


# --------------------------------------------------------------------------- MFU arithmetic
def test_utilization_is_achieved_over_peak():
    assert utilization(494.7, 989.4) == 0.5


def test_utilization_without_peak_is_none():
    assert utilization(100.0, None) is None


def test_utilization_above_one_is_not_clipped_and_warned():
    value = utilization(1200.0, 989.4)
    assert value == pytest.approx(1.2128562765)
    assert "1.2129 > 1" in mfu_warning(value)
    assert mfu_warning(0.45) is None and mfu_warning(None) is None


@pytest.mark.parametrize("achieved, peak, match", [(-1.0, 100.0, "achieved"), (1.0, 0.0, "peak_tflops")])
def test_utilization_rejects_bad_inputs(achieved, peak, match):
    with pytest.raises(ValueError, match=match):
        utilization(achieved, peak)


# --------------------------------------------------------------------------- summary and CLI
def test_flops_summary_multiplies_out_the_batch():
    s = flops_summary(LLAMA2_7B, 4096, micro_batch_size=2, grad_accum=4, num_processes=8)
    assert s["tokens_per_step"] == 4096 * 2 * 4 * 8
    assert s["flops_per_step_megatron"] == flops_per_token(LLAMA2_7B, 4096) * 262_144
    assert s["flops_per_step_per_device_palm"] == flops_per_token(LLAMA2_7B, 4096, "palm") * 262_144 / 8


def test_cli_flops_json_prints_params_and_both_conventions():
    from mlflow_llmeff.cli import main

    result = CliRunner().invoke(main, ["flops", "--model", "llama-7b", "--seq-len", "4096", "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert out["params_total"] == 6_738_415_616
    assert f"{out['flops_per_token_megatron'] / 1e9:.4f}" == "42.8637"
    assert f"{out['flops_per_token_palm'] / 1e9:.4f}" == "46.0849"


def test_cli_flops_text_names_both_conventions():
    from mlflow_llmeff.cli import main

    result = CliRunner().invoke(main, ["flops", "--model", "gpt2-124m", "--seq-len", "1024"])
    assert result.exit_code == 0, result.output
    assert "124,439,808 params total" in result.output
    assert "megatron: 0.7978 GFLOP/token" in result.output
    assert "palm: 0.8544 GFLOP/token" in result.output


def test_checkpointing_reruns_only_the_layers_backward_reaches_and_their_adapters():
    # llama-tiny, s = 32, every layer checkpointed (early stop skips down_proj, 64 x 176 = 11,264):
    # per recomputed layer 2 * (46,080 - 11,264) weights + 2 * 128 * 32 dense attention = 77,824.
    # Layer 0 frozen with the embedding: backward never reaches it, nothing is recomputed there.
    # LoRA r=8 on q, v reaches both layers and reruns its adapters too: + 2 * (1,024 + 768) each.
    cfg = load_config("llama-tiny")
    top = fl.Trainable(layers=(frozenset(), frozenset({"*"})), lm_head=True)
    assert fl.recompute_flops_per_token(cfg, 32, fl.Recompute(), trainable=top) == 77_824
    lora = fl.Trainable.lora(fl.model_shape(cfg), 8, "q_proj,v_proj")
    assert fl.recompute_flops_per_token(cfg, 32, fl.Recompute(), trainable=lora) == 2 * (77_824 + 2 * 1_792)
    # a causal kernel reruns 16.5 keys a query, not 32
    assert fl.recompute_flops_per_token(cfg, 32, fl.Recompute(), causal_kernel=True) == \
        2 * (2 * 34_816 + 2 * 128 * 16.5)


def test_a_meta_device_count_cannot_take_frozen_weights():
    counted = fl.CountedFlops(model_type="bloom", weight_flops=10.0, attention_per_key=(1.0,), windows=(None,),
                              chunks=(None,))
    with pytest.raises(ValueError, match="counted on the meta device, which has no per-matrix breakdown"):
        fl.flops_per_token(counted, 8, trainable=fl.Trainable(layers=(frozenset(),)))
