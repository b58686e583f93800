"""Packed, padding-free batches (METRICS.md, "Setups that change the counting"): each document is a sequence."""

from __future__ import annotations

import importlib

import mlflow
import pytest
import torch

import mlflow_llmeff
from mlflow_llmeff import names

from conftest import use_store

AL = importlib.import_module("mlflow_llmeff.autologging")

# The tiny model's shape (models/configs llama-tiny): L=2 layers, h=64, n=4 query heads, g=2
# key/value heads, SwiGLU width f=176, vocabulary V=259. METRICS.md "FLOPs per token":
#   F = L*h^2*(12 + 12*g/n + 18*f/h + 6*s/h) + 6*h*V
# s = 64 (eight 64-token documents): 2*4096*(12 + 6 + 49.5 + 6) + 6*64*259 = 602112 + 99456
FLOPS_PER_TOKEN_S64 = 701_568
# s = 512 (the row taken as one sequence, the fault): 2*4096*(12 + 6 + 49.5 + 48) + 99456
FLOPS_PER_TOKEN_S512 = 1_045_632


@pytest.fixture
def tracking_uri(module_store, monkeypatch):
    yield from use_store(module_store, monkeypatch)
    mlflow_llmeff.autolog(disable=True)


def tiny_model():
    from transformers import LlamaForCausalLM

    from mlflow_llmeff.models.build import load_config

    torch.manual_seed(0)
    return LlamaForCausalLM(load_config("llama-tiny"))


def packed_batch(**collator_kw):
    """Eight 64-token documents through transformers' DataCollatorWithFlattening: one 512-token row."""
    from transformers import DataCollatorWithFlattening

    docs = [{"input_ids": [(7 * d + i) % 250 + 3 for i in range(64)]} for d in range(8)]
    return DataCollatorWithFlattening(**collator_kw)(docs)


def test_the_flattening_collator_gives_one_row_without_a_mask():
    b = packed_batch()
    assert b["input_ids"].shape == (1, 512) and "attention_mask" not in b
    assert b["position_ids"][0, 64].item() == 0 and b["position_ids"][0, 63].item() == 63


@pytest.mark.parametrize("collator_kw", [{}, {"return_flash_attn_kwargs": True}])
def test_autolog_on_a_plain_loop_counts_packed_documents_as_sequences(tracking_uri, collator_kw):
    mlflow_llmeff.autolog(log_every_n_steps=2, warmup_steps=1, measure_energy="none", peak_tflops=1.0)
    model = tiny_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    b = packed_batch(**collator_kw)
    for _ in range(4):
        model(**b).loss.backward()
        opt.step()
        opt.zero_grad()
    run_id = AL.active_monitor().run_id
    mlflow.end_run()
    client = mlflow.MlflowClient()
    run = client.get_run(run_id)
    m = run.data.metrics
    assert m[names.SUM_TOKENS] == 4 * 512 and m[names.TRAIN_PADDED_TOKENS] == 4 * 512
    assert m[names.TRAIN_LOSS_TOKENS] == 4 * (512 - 8)  # the collator masks each document's first label
    # model FLOPs per token = achieved TFLOP/s per device / tokens/s per device (one device)
    tflops = client.get_metric_history(run_id, names.TPUT_DEVICE_TFLOPS)[-1].value
    tps = client.get_metric_history(run_id, names.TPUT_DEVICE_TOKENS)[-1].value
    assert tflops * 1e12 / tps == pytest.approx(FLOPS_PER_TOKEN_S64, rel=1e-6)
    assert m[names.SUM_DEVICE_TFLOPS] * 1e12 / m[names.SUM_DEVICE_TOKENS_PER_SEC] == pytest.approx(
        FLOPS_PER_TOKEN_S64, rel=1e-6)


def test_the_tally_of_a_packed_batch_has_effective_length_64():
    from mlflow_llmeff.monitor.counting import StepTally

    tally = StepTally()
    tally.add_batch(packed_batch())
    got = tally.take(steps=1)
    assert (got.tokens, got.samples, got.effective_seq_len) == (512, 8, 64.0)


def test_the_formula_at_the_hand_lengths():
    from mlflow_llmeff.calc import flops as fl
    from mlflow_llmeff.models.build import load_config

    cfg = load_config("llama-tiny")
    assert fl.flops_per_token(cfg, 64) == FLOPS_PER_TOKEN_S64
    assert fl.flops_per_token(cfg, 512) == FLOPS_PER_TOKEN_S512


# ------------------------------------------------------------------------------ llmeff train
def test_document_batch_restarts_positions_after_each_eos():
    from mlflow_llmeff.train.batches import document_batch

    ids = torch.tensor([[5, 6, 2, 7, 2, 8, 9, 9]])  # EOS = 2: documents 5 6 2 | 7 2 | 8 9 9
    b = document_batch(ids, eos_id=2)
    assert b["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 1, 2]]
    assert b["labels"].tolist() == [[-100, 6, 2, -100, 2, -100, 9, 9]] and "attention_mask" not in b


def test_document_batch_keeps_the_model_inside_each_document():
    # transformers builds a block-diagonal mask from the positions: a document's logits equal its own
    from mlflow_llmeff.train.batches import document_batch

    model = tiny_model()  # train() mode; setup turns the cache off as llmeff train does
    model.config.use_cache = False
    a, b = torch.arange(3, 13), torch.arange(20, 26)
    packed = document_batch(torch.cat([a, torch.tensor([2]), b])[None], eos_id=2)
    with torch.no_grad():
        got = model(input_ids=packed["input_ids"], position_ids=packed["position_ids"]).logits[0, 11:]
        alone = model(input_ids=b[None]).logits[0]
    assert torch.allclose(got, alone, atol=1e-5)


def test_packing_modes_are_one_list_and_bools_still_read():
    from mlflow_llmeff.train import config, data
    from mlflow_llmeff.train.config import TrainConfig, validate

    assert config.PACKING_MODES == data.PACKING_MODES == ("true", "false", "documents")
    assert TrainConfig(packing=False).packing == "false" and TrainConfig().packing == "true"
    with pytest.raises(ValueError, match="packing='rows' is not accepted; use one of: true, false, documents"):
        validate(TrainConfig(packing="rows"), cuda_available=False, bf16_supported=True)


def eight_documents(tmp_path):
    """A .txt of eight 63-byte documents: with the byte tokenizer's EOS, eight 64-token documents."""
    p = tmp_path / "eight.txt"
    p.write_text("\n\n".join(chr(ord("a") + d) * 63 for d in range(8)))
    return str(p)


@pytest.mark.parametrize("packing, flops_per_token", [("documents", FLOPS_PER_TOKEN_S64),
                                                      ("true", FLOPS_PER_TOKEN_S512)])
def test_llmeff_train_packing_modes_count_hand_computed_flops(tracking_uri, tmp_path, packing, flops_per_token):
    from mlflow_llmeff.train.config import TrainConfig
    from mlflow_llmeff.train.loop import run_training

    # one 512-token block (8 x 64), one block a step; documents: s_eff = 64, true: one 512-token sequence
    out = run_training(TrainConfig(dataset=eight_documents(tmp_path), packing=packing, seq_len=512,
                                   micro_batch_size=1, max_steps=4, log_every_n_steps=2, warmup_steps=1,
                                   val_fraction=0.0, measure_energy="none", peak_tflops=1.0,
                                   data_cache_dir=str(tmp_path / "cache"), experiment_name=f"pack-{packing}"))
    s = out["summary"]
    assert s[names.SUM_TOKENS] == 4 * 512
    assert s[names.SUM_DEVICE_TFLOPS] * 1e12 / s[names.SUM_DEVICE_TOKENS_PER_SEC] == pytest.approx(
        flops_per_token, rel=1e-6)
    loss_tokens = mlflow.MlflowClient().get_run(out["run_id"]).data.metrics[names.TRAIN_LOSS_TOKENS]
    # documents: the first label of each of the 8 documents is masked; true: only the row's first
    assert loss_tokens == 4 * (512 - 8 if packing == "documents" else 511)
