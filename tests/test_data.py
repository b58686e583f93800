import json

import pytest
import torch

from mlflow_llmeff.train import data as D
from mlflow_llmeff.train.models import load_tokenizer


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("llama-tiny")


def test_packing_makes_full_blocks_without_padding(tok):
    # ByT5: one id per byte (+3 offset) and EOS=1 after each document.
    docs = [[10] * 5, [11] * 6]  # 5 + 1 + 6 + 1 = 13 tokens -> 3 blocks of 4, one token dropped
    b = D.pack(docs, 4, tok.eos_token_id)
    assert b.input_ids.tolist() == [[10, 10, 10, 10], [10, 1, 11, 11], [11, 11, 11, 11]]
    assert int(b.attention_mask.sum()) == 12


def test_padding_masks_and_ignores_pad_positions(tok):
    b = D.pad([[10] * 2, [11] * 9], 5, tok.eos_token_id, tok.pad_token_id)
    assert b.attention_mask.tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]
    assert b.labels.tolist()[0] == [10, 10, 1, -100, -100]


def test_text_file_split_and_seeded_shuffle(tmp_path, tok):
    p = tmp_path / "a.txt"
    p.write_text("\n\n".join("doc %d " % i * 20 for i in range(50)))
    d1 = D.prepare_data(str(p), tok, 32, val_fraction=0.1, seed=3)
    d2 = D.prepare_data(str(p), tok, 32, val_fraction=0.1, seed=3)
    n = len(d1.train) + len(d1.val)
    assert len(d1.val) == round(n * 0.1)
    assert torch.equal(d1.train.input_ids, d2.train.input_ids)
    assert d1.kind == "text_file"


def test_jsonl_and_directory(tmp_path, tok):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "x.jsonl").write_text("\n".join(json.dumps({"text": "hello world " * 10}) for _ in range(4)))
    (tmp_path / "d" / "y.txt").write_text("plain text " * 30)
    docs, kind, _ = D.read_documents(str(tmp_path / "d"))
    assert kind == "text_dir" and len(docs) == 5


def test_jsonl_missing_field_names_file_and_line(tmp_path):
    p = tmp_path / "x.jsonl"
    p.write_text('{"content": "a"}\n')
    with pytest.raises(ValueError, match=r"x.jsonl:1: no field 'text' \(fields: content\); set text_field"):
        D.read_documents(str(p))


def test_builtin_default_is_real_text_without_files(tok):
    docs, kind, desc = D.read_documents("python-docs")
    assert kind == "python_docs" and sum(map(len, docs)) > 400_000
    assert "assert" in docs[0]


def test_synthetic_is_tagged_and_in_vocab(tok):
    d = D.prepare_data("synthetic", tok, 16, synthetic_blocks=20, vocab_size=100, val_fraction=0.0)
    assert d.kind == "synthetic" and "not text" in d.description
    assert int(d.train.input_ids.max()) < 100 and len(d.train) == 20


def test_hub_id_goes_through_datasets(monkeypatch, tmp_path, tok):
    import datasets

    p = tmp_path / "train.jsonl"
    p.write_text("\n".join(json.dumps({"body": f"text number {i}"}) for i in range(3)))
    calls = []
    real_load = datasets.load_dataset

    def fake_load(name, split):  # the hub is unreachable here: serve local files for the id
        calls.append((name, split))
        return real_load("json", data_files=str(p), split=split)

    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    docs, kind, _ = D.read_documents("someorg/somecorpus", text_field="body")
    assert calls == [("someorg/somecorpus", "train")] and kind == "hub"
    assert docs == ["text number 0", "text number 1", "text number 2"]
    with pytest.raises(ValueError, match=r"has no column 'text' \(columns: body\)"):
        D.read_documents("someorg/somecorpus")


def test_epoch_order_is_deterministic_and_changes_per_epoch():
    assert D.epoch_order(10, 0, 1) == D.epoch_order(10, 0, 1)
    assert D.epoch_order(10, 0, 1) != D.epoch_order(10, 1, 1)
    assert sorted(D.epoch_order(10, 2, 1)) == list(range(10))


def test_validation_scores_a_fixed_subset_of_blocks():
    import torch
    from accelerate import Accelerator
    from transformers import LlamaForCausalLM

    from mlflow_llmeff.train.data import prepare_data
    from mlflow_llmeff.train.evaluate import validation_loss
    from mlflow_llmeff.train.models import load_config, load_tokenizer

    torch.manual_seed(0)
    model = LlamaForCausalLM(load_config("llama-tiny"))
    data = prepare_data("python-docs", load_tokenizer("llama-tiny"), 32, val_fraction=0.05, seed=0)
    assert len(data.val) > 4
    acc = Accelerator(cpu=True)
    got = validation_loss(acc, model, data.val, 2, 1, 0, blocks=4)
    with torch.no_grad():  # packed blocks, no padding: 31 loss tokens each, so the mean of the 4 losses
        want = sum(float(model(**data.val[i:i + 1]).loss) for i in range(4)) / 4
    assert got == pytest.approx(want, rel=1e-5)
    assert validation_loss(acc, model, data.val, 2, 1, 0, blocks=0) != pytest.approx(got)  # 0 = every block
