"""Cross-check against EleutherAI lm-evaluation-harness 0.4.x on the same tiny model and examples (slow)."""

from __future__ import annotations


import pytest
import torch
import transformers

from conftest import require

require("lm_eval", "pip install -e '.[dev]'", load=False)  # skips locally, fails under CI; imported where used

from mlflow_llmeff.evals import evaluate  # noqa: E402
from mlflow_llmeff.evals.harness import run_harness  # noqa: E402

from eval_fixtures import eval_fixture_dir  # noqa: E402

FIX = eval_fixture_dir()  # invented documents in the release layout, written to a temp folder
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model_and_tok(tmp_path_factory):
    """A random Llama saved in Hugging Face format and loaded back, with the byte tokenizer beside it."""
    torch.manual_seed(3)
    cfg = transformers.LlamaConfig(vocab_size=259, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    d = tmp_path_factory.mktemp("model")
    transformers.LlamaForCausalLM(cfg).save_pretrained(d)
    transformers.ByT5Tokenizer(extra_ids=0).save_pretrained(d)
    return (transformers.AutoModelForCausalLM.from_pretrained(d).eval(), transformers.AutoTokenizer.from_pretrained(d))


@pytest.fixture(autouse=True)
def _offline(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf_datasets"))


def _same(ours, theirs):
    assert [(e["task"], e["doc_index"]) for e in ours.examples] == [(e["task"], e["doc_index"]) for e in theirs.examples]
    assert [e["pred"] for e in ours.examples] == [e["pred"] for e in theirs.examples]
    assert [e["correct"] for e in ours.examples] == [e["correct"] for e in theirs.examples]
    hs = [(a["correct_norm"], b["correct_norm"]) for a, b in zip(ours.examples, theirs.examples) if a["task"] == "hellaswag"]
    assert all(a == b for a, b in hs)
    assert max(abs(p - q) for a, b in zip(ours.examples, theirs.examples)
               for p, q in zip(a["logliks"], b["logliks"])) < 5e-4  # fp32 sums of up to ~100 log-probs
    assert ours.metrics == theirs.metrics


@pytest.mark.parametrize("fewshot", [0, 5])
def test_fixtures_match_harness(model_and_tok, fewshot):
    m, tok = model_and_tok
    tasks = "mmlu_abstract_algebra,mmlu_anatomy" + (",hellaswag" if fewshot == 0 else "")
    _same(evaluate(m, tok, tasks, data_dir=FIX, num_fewshot=fewshot),
          run_harness(m, tok, tasks, data_dir=FIX, num_fewshot=fewshot))


@pytest.mark.parametrize("fewshot", [0, 5])
def test_shared_data_matches_harness(model_and_tok, shared_data, fewshot):
    m, tok = model_and_tok
    tasks = "mmlu_anatomy,mmlu_college_physics" + (",hellaswag" if fewshot == 0 else "")
    kw = dict(data_dir=str(shared_data), num_fewshot=fewshot, limit=12, batch_size=8)
    _same(evaluate(m, tok, tasks, **kw), run_harness(m, tok, tasks, **kw))
