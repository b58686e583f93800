"""FLOPs of what is trained: frozen weights and LoRA adapters, from the pure description to a monitored run.

The hand count used throughout, llama-tiny (L2 h64 n4 g2 d16 f176 V259; q 64x64, k and v 64x32,
o 64x64, gate/up/down 64x176) with peft LoRA r=8 on q_proj and v_proj, base weights, embedding and
LM head frozen, megatron attention (k = s/2 keys per query). Per token:

    adapters: q  A (8x64) B (64x8): 512 + 512 weights;  v  A (8x64) B (32x8): 512 + 256 weights
    layer 0 (nothing trainable below it):
      q, k, v frozen, input needs no gradient: forward only  2 * (4096 + 2048 + 2048)   =  16,384
      LoRA q: A forward + weight grad 2*2*512, B forward + input + weight grad 6*512    =   5,120
      LoRA v: A 2*2*512,                     B 6*256                                   =   3,584
      attention (q, v train below it): 6 * n*2d * k = 6 * 128 * s/2                     = 384 s
      o_proj frozen, input needs a gradient: forward + input grad 4 * 4096               =  16,384
      MLP frozen: 4 * 3 * 64 * 176                                                       = 135,168
    layer 1 (everything below trains): q, k, v 4 * 8192 = 32,768; LoRA q 3*2*512 + 6*512 = 6,144;
      LoRA v 3*2*512 + 6*256 = 4,608; attention 384 s; o 16,384; MLP 135,168
    LM head frozen, input grad needed: 4 * 64 * 259                                      =  66,304
    total: 438,016 + 768 s   (s = 32: 462,592; s = 8: 444,160)

The same model trained in full: 6 * (2 * 46,080 + 64 * 259) + 768 s = 652,416 + 768 s (s = 32: 676,992).
"""

from __future__ import annotations

import json
import sys

import mlflow
import pytest
import torch

from mlflow_llmeff import names
from mlflow_llmeff.calc import flops as fl
from mlflow_llmeff.models.build import load_config

from conftest import require_peft, use_store

require_peft(load=False)  # found, not imported: collecting this file costs every worker nothing

LORA = lambda s: 438_016 + 768 * s  # noqa: E731 - the hand count above
FULL = lambda s: 652_416 + 768 * s  # noqa: E731


@pytest.fixture
def tracking_uri(module_store, monkeypatch):
    yield from use_store(module_store, monkeypatch)


def tiny(attn: str = "sdpa"):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(load_config("llama-tiny"), attn_implementation=attn)


def lora_model(attn: str = "sdpa"):
    from mlflow_llmeff.models.lora import apply_lora

    return apply_lora(tiny(attn), 8, "q_proj,v_proj")


# ------------------------------------------------------------------------------------ the pure count
def test_hand_count_of_lora_r8_on_q_and_v_of_llama_tiny():
    from mlflow_llmeff.meters.trainable import read_trainable

    cfg = load_config("llama-tiny")
    assert LORA(32) == 16_384 + 5_120 + 3_584 + 384 * 32 + 16_384 + 135_168 \
        + 32_768 + 6_144 + 4_608 + 384 * 32 + 16_384 + 135_168 + 66_304 == 462_592
    read = read_trainable(lora_model())
    assert fl.flops_per_token(cfg, 32, trainable=read) == LORA(32)
    assert fl.flops_per_token(cfg, 32) == FULL(32) == 676_992  # unchanged without a description
    by_hand = fl.Trainable.lora(fl.model_shape(cfg), 8, "q_proj,v_proj")
    assert by_hand.adapters == read.adapters and fl.flops_per_token(cfg, 32, trainable=by_hand) == LORA(32)
    assert (read.trainable_params, read.total_params) == (2 * (1_024 + 768), 125_632 + 3_584)  # r(d_in + d_out)


@pytest.mark.parametrize("preset", ["llama-7b", "llama3-8b", "gpt2-124m", "mistral-7b"])
@pytest.mark.parametrize("convention", ["megatron", "palm"])
def test_a_description_where_everything_trains_gives_todays_numbers_exactly(preset, convention):
    cfg = load_config(preset)
    shape = fl.model_shape(cfg)
    everything = fl.Trainable(layers=(frozenset({"*"}),) * shape.layers, embedding=True, lm_head=True)
    assert fl.flops_per_token(cfg, 4096, convention, everything) == fl.flops_per_token(cfg, 4096, convention)


def test_each_layers_matrices_add_up_to_its_weights_for_every_formula_family():
    for preset in ("llama-tiny", "gpt2-124m", "mistral-7b"):
        shape = fl.model_shape(load_config(preset))
        assert all(sum(m.weights for m in shape.layer_matrices(i)) == shape.layer_weights(i)
                   for i in range(shape.layers))


def test_a_frozen_lower_layer_runs_forward_only_and_the_flop_counter_agrees():
    # embedding and layer 0 frozen, layer 1 (its norms too), final norm and LM head train, s = 32:
    # layer 0 forward only 2 * 46,080 + 2 * 128 * 16 = 96,256; layer 1 6 * 46,080 + 6 * 128 * 16 = 288,768;
    # LM head 6 * 64 * 259 = 99,456: 484,480 per token. Eager autograd computes exactly these.
    from torch.utils.flop_counter import FlopCounterMode

    from mlflow_llmeff.meters.trainable import read_trainable

    model = tiny("eager")
    for p in list(model.model.embed_tokens.parameters()) + list(model.model.layers[0].parameters()):
        p.requires_grad_(False)
    t = read_trainable(model)
    assert t.layers[0] == frozenset() and "q_proj" in t.layers[1] and "input_norm" in t.layers[1]
    assert not t.embedding and t.lm_head
    cfg = load_config("llama-tiny")
    assert fl.flops_per_token(cfg, 32, trainable=t) == 96_256 + 288_768 + 99_456
    ids = torch.randint(0, 259, (2, 32), generator=torch.Generator().manual_seed(0))
    counter = FlopCounterMode(display=False)
    with counter:
        model(input_ids=ids, labels=ids).loss.backward()
    # eager attention computes the full square: 2 * 128 * 16 more in layer 0, 6 * 128 * 16 in layer 1
    assert counter.get_total_flops() / 64 == fl.hardware_flops_per_token(cfg, 32, trainable=t) \
        == 484_480 + 2 * 128 * 16 + 6 * 128 * 16


def test_an_eager_lora_step_skips_one_unneeded_key_gradient_and_the_hardware_count_knows_it():
    # Autograd skips dK of layer 0's score matmul (k_proj frozen and unadapted, nothing below it
    # trains): 2 * n*d * s = 2 * 64 * 32 = 4,096 FLOPs per token the formula (both input gradients of
    # the attention matmuls, as the fused kernels compute them) counts and eager does not run.
    from torch.utils.flop_counter import FlopCounterMode

    from mlflow_llmeff.meters.trainable import read_trainable

    model = lora_model("eager")
    cfg = load_config("llama-tiny")
    ids = torch.randint(0, 259, (2, 32), generator=torch.Generator().manual_seed(0))
    counter = FlopCounterMode(display=False)
    with counter:
        model(input_ids=ids, labels=ids).loss.backward()
    read = read_trainable(model)
    dense = fl.hardware_flops_per_token(cfg, 32, trainable=read)
    assert dense == LORA(32) + 2 * 384 * 32  # the full square: 32 keys per query, not 16, in both layers
    assert counter.get_total_flops() / 64 == dense - 2 * 64 * 32 == 483_072
    # which is what the hardware count of eager attention runs (the monitor's expectation of such a step)
    assert fl.hardware_flops_per_token(cfg, 32, trainable=read, autograd_attention=True) == 483_072


def test_lora_targets_the_model_lacks_are_rejected_in_one_line():
    shape = fl.model_shape(load_config("llama-tiny"))
    with pytest.raises(ValueError, match="LoRA targets c_attn match no matrix of this model; accepted: down_proj"):
        fl.Trainable.lora(shape, 8, "q_proj,c_attn")
    with pytest.raises(ValueError, match="LoRA rank 0 is not accepted"):
        fl.Trainable.lora(shape, 0, "q_proj")


def test_apply_lora_rejects_a_target_that_matches_no_module():
    from mlflow_llmeff.models.lora import apply_lora

    with pytest.raises(ValueError, match="LoRA targets qproj match no module of the model; its linear layers: "):
        apply_lora(tiny(), 8, "qproj")


def test_apply_lora_without_peft_names_the_extra(monkeypatch):
    from mlflow_llmeff.models.lora import apply_lora

    monkeypatch.setitem(sys.modules, "peft", None)
    with pytest.raises(ValueError, match=r"pip install 'mlflow-llmeff\[lora\]'"):
        apply_lora(tiny(), 8, "q_proj")


def test_a_fully_trainable_model_reads_as_none():
    from mlflow_llmeff.meters.trainable import read_trainable

    assert read_trainable(tiny()) is None


# ------------------------------------------------------------------------------------ the monitor and MLflow
def _run(model, clock_step: float = 0.5):
    from mlflow_llmeff.monitor.meter import EfficiencyMonitor
    from mlflow_llmeff.testing import FakeClock

    clock = FakeClock()
    mon = EfficiencyMonitor(log_every_n_steps=2, warmup_steps=0, model=model, peak_tflops=1.0, clock=clock,
                            measure_energy="none", measure_peak=False)
    for _ in range(2):
        clock.t += clock_step
        mon.step(tokens=64, samples=2)  # two sequences of 32
    return mon, mon.finish()


def test_a_monitored_lora_run_counts_the_hand_flops_and_its_mfu_ratio_to_full_training(tracking_uri):
    lora_mon, lora = _run(lora_model())
    full_mon, full = _run(tiny())
    # 64 tokens per 0.5 s on one device: 128 tokens/s, so TFLOP/s = 128 * FLOPs per token / 1e12
    assert lora[names.SUM_DEVICE_TFLOPS] == pytest.approx(128 * LORA(32) / 1e12, rel=1e-12)
    assert full[names.SUM_DEVICE_TFLOPS] == pytest.approx(128 * FULL(32) / 1e12, rel=1e-12)
    assert full[names.SUM_MFU] / lora[names.SUM_MFU] == pytest.approx(676_992 / 462_592, rel=1e-12)  # 1.4635
    tags = mlflow.MlflowClient().get_run(lora_mon.run_id).data.tags
    assert tags[names.FLOPS_METHOD].startswith(
        "formula: llama config fields (flops.flops_per_token; docs/formulas.md); trainable: 3,584 of 129,216 "
        "parameters trainable (2.7737%); LoRA r=8 on q_proj,v_proj in 2 layers; embedding frozen, LM head frozen")
    assert "trainable" not in mlflow.MlflowClient().get_run(full_mon.run_id).data.tags[names.FLOPS_METHOD]


def test_trainer_autolog_of_a_peft_model_logs_the_hand_count_flops_per_token(tracking_uri, tmp_path):
    # FLOPs per token read back from MLflow: summary/device_tflops_per_sec over summary/device_tokens_per_sec
    # (the same steady tokens and device-seconds), x 1e12. Rows of 8 real tokens: s = 8, 444,160 by hand.
    import mlflow_llmeff
    from transformers import Trainer, TrainingArguments

    class Rows(torch.utils.data.Dataset):
        def __len__(self):
            return 8

        def __getitem__(self, i):
            ids = (torch.arange(8) + i) % 200 + 3
            return {"input_ids": ids, "attention_mask": torch.ones(8, dtype=torch.long), "labels": ids}

    mlflow_llmeff.autolog(log_every_n_steps=2, warmup_steps=1, measure_energy="none", peak_tflops=1.0)
    try:
        args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=4,
                                 save_strategy="no", report_to="none", use_cpu=True, dataloader_num_workers=0,
                                 disable_tqdm=True, seed=0, logging_steps=2)
        Trainer(model=lora_model(), args=args, train_dataset=Rows()).train()
    finally:
        mlflow_llmeff.autolog(disable=True)
    run = mlflow.MlflowClient().search_runs([e.experiment_id for e in mlflow.search_experiments()],
                                            order_by=["attributes.start_time DESC"])[0]
    m = run.data.metrics
    assert run.data.tags[names.AUTOLOG_INTEGRATION] == "trainer"
    assert m[names.SUM_DEVICE_TFLOPS] * 1e12 / m[names.SUM_DEVICE_TOKENS_PER_SEC] == pytest.approx(LORA(8), rel=1e-9)
    assert LORA(8) == 444_160
    assert "LoRA r=8 on q_proj,v_proj" in run.data.tags[names.FLOPS_METHOD]


# ------------------------------------------------------------------------------------ llmeff flops
def test_cli_flops_with_lora_prints_the_hand_count_and_the_trainable_share():
    from click.testing import CliRunner

    from mlflow_llmeff.cli import main

    args = ["flops", "--model", "llama-tiny", "--seq-len", "32", "--lora-rank", "8", "--lora-targets", "q_proj,v_proj"]
    out = json.loads(CliRunner().invoke(main, args + ["--json"]).output)
    assert out["flops_per_token_megatron"] == LORA(32)
    assert out["params_trainable"] == 3_584 and out["trainable_share"] == 3_584 / 129_216
    text = CliRunner().invoke(main, args).output
    assert "trainable share 2.7737%: 3,584 of 129,216 parameters trainable" in text
    assert "LoRA r=8 on q_proj,v_proj" in text


def test_cli_flops_needs_the_lora_rank_and_targets_together():
    from click.testing import CliRunner

    from mlflow_llmeff.cli import main

    result = CliRunner().invoke(main, ["flops", "--model", "llama-tiny", "--seq-len", "32", "--lora-rank", "8"])
    assert result.exit_code != 0 and "give --lora-rank and --lora-targets together" in result.output


def test_a_counted_eager_lora_step_is_no_counter_gap_and_reads_what_autograd_ran(tracking_uri):
    # The step FlopCounterMode counts runs 483,072 FLOPs per token (the eager test above) over 462,592 model
    # FLOPs: HFU / MFU = 1.044272, counted (not mistaken for a kernel the counter could not see).
    from contextlib import nullcontext

    from mlflow_llmeff.monitor.meter import EfficiencyMonitor
    from mlflow_llmeff.testing import FakeClock

    model = lora_model("eager")
    ids = torch.randint(0, 259, (2, 32), generator=torch.Generator().manual_seed(0))
    clock = FakeClock()
    mon = EfficiencyMonitor(log_every_n_steps=2, warmup_steps=0, model=model, peak_tflops=1.0, clock=clock,
                            measure_energy="none", measure_peak=False)
    for i in range(2):
        with mon.counting_hardware_flops() if i == 0 else nullcontext():
            model(input_ids=ids, labels=ids).loss.backward()
            model.zero_grad()
            mon.count({"input_ids": ids})
        clock.t += 0.5
        mon.step()
    s = mon.finish()
    assert s[names.SUM_HFU] / s[names.SUM_MFU] == pytest.approx(483_072 / 462_592, rel=1e-12)
    tags = mlflow.MlflowClient().get_run(mon.run_id).data.tags
    assert tags[names.HFU_METHOD].startswith("FlopCounterMode on step 1") and names.FLOPS_COUNTER_GAP not in tags


def test_gpt2_fused_and_renamed_projections_are_placed_by_name():
    # GPT-2: c_attn holds q, k and v (one 64 x 192 Conv1D), attn.c_proj is o_proj, mlp.c_proj down_proj
    from transformers import GPT2Config, GPT2LMHeadModel

    from mlflow_llmeff.meters.trainable import canonical_names, read_trainable
    from mlflow_llmeff.models.lora import apply_lora

    assert canonical_names("transformer.h.0.attn.c_proj") == ("o_proj",)
    assert canonical_names("transformer.h.0.mlp.c_proj") == ("down_proj",)
    assert canonical_names("base_model.model.transformer.h.1.attn.c_attn.base_layer") == ("q_proj", "k_proj", "v_proj")
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=64))
    t = read_trainable(apply_lora(model, 4, "c_attn"))
    assert t.adapters[0] == fl.Adapter(0, "q_proj", 64, 192, 4) and len(t.adapters) == 2
    assert t.layers == (frozenset(), frozenset())
    frozen_but_one = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=64))
    for name, p in frozen_but_one.named_parameters():
        p.requires_grad_(name == "transformer.h.1.mlp.c_proj.weight")
    assert read_trainable(frozen_but_one).layers == (frozenset(), frozenset({"down_proj"}))
