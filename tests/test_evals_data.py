"""Evaluation documents from their sources: the hub loaders, exercised on local files with the hub
datasets' columns and splits (nothing is downloaded), against the local release layout."""

from __future__ import annotations

import pytest

from mlflow_llmeff.evals import data
from mlflow_llmeff.evals.api import check_inputs

SUBJECTS = ("anatomy", "abstract_algebra")


@pytest.fixture
def hub_copy(tmp_path, shared_data, monkeypatch):
    """Parquet files laid out as the hub repos are (``cais/mmlu/<subject>/<split>-*.parquet`` with columns
    question, subject, choices, answer; ``Rowan/hellaswag/data/validation-*.parquet`` with its 10 columns,
    ``label`` a string), written from the shared copy; ``datasets.load_dataset(repo, config, split=...)``
    is served from them through the parquet builder."""
    import csv
    import json

    import datasets

    for subject in SUBJECTS:
        for split, hub_split in (("test", "test"), ("dev", "dev")):
            with open(shared_data / "mmlu" / split / f"{subject}_{split}.csv", newline="", encoding="utf-8") as f:
                rows = list(csv.reader(f))
            datasets.Dataset.from_dict({
                "question": [r[0] for r in rows], "subject": [subject] * len(rows),
                "choices": [r[1:5] for r in rows], "answer": ["ABCD".index(r[5]) for r in rows],
            }).to_parquet(str(tmp_path / "cais/mmlu" / subject / f"{hub_split}-00000-of-00001.parquet"))
    with open(shared_data / "hellaswag" / "hellaswag_val.jsonl", encoding="utf-8") as f:
        recs = [json.loads(line) for line in f]
    cols = ["ind", "activity_label", "ctx_a", "ctx_b", "ctx", "endings", "source_id", "split", "split_type", "label"]
    hs = {c: [str(r[c]) if c == "label" else r[c] for r in recs] for c in cols}
    datasets.Dataset.from_dict(hs).to_parquet(str(tmp_path / "Rowan/hellaswag/data/validation-00000-of-00001.parquet"))

    real = datasets.load_dataset
    calls = []

    def from_local(path, name=None, split=None, **kw):
        calls.append((path, name, split))
        sub = name if name else "data"
        return real("parquet", data_files=str(tmp_path / path / sub / f"{split}-*.parquet"), split="train")

    monkeypatch.setattr(datasets, "load_dataset", from_local)
    monkeypatch.delenv(data.DATA_DIR_ENV, raising=False)
    data._hub_rows.cache_clear()
    yield calls
    data._hub_rows.cache_clear()


def test_no_data_dir_reads_the_hub_datasets_lm_eval_reads(hub_copy):
    data.load_mmlu(None, "anatomy", "test")
    data.load_mmlu(None, "anatomy", "dev")
    data.load_hellaswag(None)
    assert hub_copy == [("cais/mmlu", "anatomy", "test"), ("cais/mmlu", "anatomy", "dev"),
                        ("Rowan/hellaswag", None, "validation")]


@pytest.mark.parametrize("subject", SUBJECTS)
@pytest.mark.parametrize("split", ["test", "dev"])
def test_hub_mmlu_documents_equal_the_local_layout(hub_copy, shared_data, subject, split):
    hub = data.load_mmlu(None, subject, split)
    local = data.load_mmlu(str(shared_data), subject, split)
    assert hub == local and len(hub) == {"test": {"anatomy": 135, "abstract_algebra": 100}[subject], "dev": 5}[split]


def test_hub_hellaswag_documents_equal_the_local_layout(hub_copy, shared_data):
    hub = data.load_hellaswag(None)
    assert len(hub) == 10_042 and hub == data.load_hellaswag(str(shared_data))
    assert isinstance(hub[0]["label"], int)


def test_hub_rows_are_loaded_once_per_process(hub_copy):
    data.load_hellaswag("hub")
    data.load_hellaswag("hub")
    assert len(hub_copy) == 1


def test_offline_without_cache_is_one_line_naming_ids_and_the_alternative(monkeypatch, tmp_path):
    import datasets

    monkeypatch.delenv(data.DATA_DIR_ENV, raising=False)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "empty-cache")
    data._hub_rows.cache_clear()
    for tasks, repo in (("hellaswag", "Rowan/hellaswag"), ("mmlu_anatomy", "cais/mmlu")):
        with pytest.raises(ValueError) as e:
            check_inputs(tasks)
        msg = str(e.value)
        assert "\n" not in msg and msg.startswith(repo)
        assert "could not be loaded from the Hugging Face hub" in msg and "--data-dir" in msg
        assert "$LLMEFF_DATA_DIR" in msg
    data._hub_rows.cache_clear()
