import pytest
import torch

from mlflow_llmeff.models import build as M


def meta_params(name):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        m = AutoModelForCausalLM.from_config(M.load_config(name))
    return sum(p.numel() for p in m.parameters())


@pytest.mark.parametrize("name, params", [
    ("llama-7b", 6_738_415_616),   # Llama-2-7B, published count
    ("gpt2-124m", 124_439_808),    # GPT-2 small, tied embeddings
    ("llama3-8b", 8_030_261_248),  # Meta-Llama-3-8B
])
def test_presets_have_published_sizes(name, params):
    assert meta_params(name) == params


def test_local_directory_loads_through_from_pretrained(tmp_path):
    m = M.build_model("llama-tiny")
    m.save_pretrained(tmp_path)
    M.load_tokenizer("llama-tiny").save_pretrained(tmp_path)
    cfg = M.load_config(str(tmp_path))
    m2 = M.build_model(str(tmp_path), cfg)
    assert cfg.num_hidden_layers == 2
    assert torch.equal(m2.get_input_embeddings().weight, m.get_input_embeddings().weight)
    assert M.load_tokenizer(str(tmp_path))("ab")["input_ids"] == [100, 101, 1]


def test_directory_without_config_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="has no config.json"):
        M.load_config(str(tmp_path))
