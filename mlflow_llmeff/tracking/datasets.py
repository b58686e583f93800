"""The ``mlflow.data`` dataset that carries a run's training data (the runs table's Dataset column).

``llmeff train`` reads the facts off its prepared data (:mod:`mlflow_llmeff.train.dataset_input`: name,
digest, profile); the MLflow objects are made here, and the logger delivers them
(:meth:`mlflow_llmeff.tracking.logger.RunLogger.log_inputs`).
"""

from __future__ import annotations

import json
import os

from mlflow.data.meta_dataset import MetaDataset

__all__ = ["TokenBlocksDataset", "dataset_source"]


class TokenBlocksDataset(MetaDataset):
    """A tokenized training set: ``MetaDataset`` with a content digest and a token/block profile."""

    def __init__(self, source, name: str, digest: str, profile: dict):
        self._profile = profile
        super().__init__(source=source, name=name, digest=digest)

    @property
    def profile(self) -> dict:
        return self._profile

    def to_dict(self) -> dict:
        return {**super().to_dict(), "profile": json.dumps(self._profile)}


def dataset_source(dataset: str, kind: str):
    """The ``mlflow.data`` source of the ``dataset`` setting of ``kind`` (``train/data.py``'s kinds): a
    Hugging Face hub dataset's, a local file's or folder's, else a code source naming the setting."""
    if kind == "hub":
        from mlflow.data.huggingface_dataset_source import HuggingFaceDatasetSource

        return HuggingFaceDatasetSource(path=dataset, split="train")
    if kind in ("text_file", "jsonl", "text_dir"):
        import warnings

        from mlflow.data.dataset_source_registry import resolve_dataset_source

        with warnings.catch_warnings():  # MLflow registers the local-file source twice and says so
            warnings.simplefilter("ignore")
            return resolve_dataset_source(os.path.abspath(dataset))
    from mlflow.data.code_dataset_source import CodeDatasetSource

    return CodeDatasetSource({"mlflow_llmeff.dataset": dataset, "kind": kind})
