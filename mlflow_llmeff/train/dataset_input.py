"""The training data as an MLflow dataset input of the run (the runs table's Dataset column).

Its name, source (a local path, a Hugging Face hub id, or the built-in corpus), a digest of the
tokenized blocks themselves, and a profile of token and block counts, read off the prepared data
here; the ``mlflow.data`` dataset that carries them is made in :mod:`mlflow_llmeff.tracking.datasets`.
"""

from __future__ import annotations

import hashlib
import os

from mlflow_llmeff.tracking.datasets import TokenBlocksDataset, dataset_source
from mlflow_llmeff.train.data import TokenBlocks

__all__ = ["TokenBlocksDataset", "training_dataset"]

#: Tokens hashed for the digest: the first blocks up to this many (a digest, not a checksum of terabytes).
DIGEST_TOKENS = 1 << 24


def training_dataset(dataset: str, data, seq_len: int, packing: bool):
    """The MLflow dataset of prepared training data.

    Args:
        dataset: the ``dataset`` setting (path, hub id, ``python-docs``, ``synthetic``).
        data: :class:`~mlflow_llmeff.train.data.PreparedData` (``train``: :class:`TokenBlocks`, indexed to
            ``{"input_ids": (B, seq_len), "attention_mask": (B, seq_len)}``; or a stream).
        seq_len: tokens per block.
        packing: documents packed into full blocks (a bool or a
            :data:`~mlflow_llmeff.train.data.PACKING_MODES` value; ``documents`` adds
            ``"documents": true`` to the profile).
    """
    from mlflow_llmeff.train.data import packing_mode

    mode = packing_mode(packing)
    packing = mode != "false"
    if data.streaming:  # a stream has no length to profile: provenance only
        h = hashlib.sha256(f"stream:{dataset}:{seq_len}:{packing}".encode())
        profile = {"seq_len": int(seq_len), "packing": bool(packing), "kind": data.kind, "streaming": True}
    else:
        rows = max(1, min(len(data.train), DIGEST_TOKENS // max(1, seq_len)))
        if rows == len(data.train):  # all of it (small data): the training blocks themselves
            first = data.train[0:rows]  # {"input_ids": (rows, seq_len), "attention_mask": ...}
        else:  # the first blocks in storage order: the training order is a permutation over the
            # whole memory-mapped cache, and reading its first 131,072 blocks faulted nearly every
            # page of a 3.9 GB cache into the trainer (5.3 GB resident, bench/data.py at 2 GB)
            first = TokenBlocks(data.train.table, data.train.seq_len, data.train.pad_id)[0:rows]
        h = hashlib.sha256(repr((len(data.train), int(seq_len))).encode())
        h.update(first["input_ids"].contiguous().numpy().tobytes())
        extra = {}
        if packing:  # full blocks: every position is a token
            train_tokens = len(data.train) * int(seq_len)
        elif rows == len(data.train):
            train_tokens = int(first["attention_mask"].sum())
        else:  # padded rows: the exact split count would read every row; the cache's total is known
            train_tokens = None
            extra = {"cache_tokens": int(data.cache.tokens)} if data.cache is not None else {}
        profile = {"train_blocks": len(data.train), "val_blocks": len(data.val) if data.val is not None else 0,
                   "seq_len": int(seq_len), "packing": bool(packing), "kind": data.kind, **extra}
        if train_tokens is not None:
            profile["train_tokens"] = train_tokens
    if mode == "documents":
        profile["documents"] = True
    name = dataset if data.kind in ("python_docs", "synthetic", "hub") else os.path.basename(dataset.rstrip("/"))
    return TokenBlocksDataset(dataset_source(dataset, data.kind), name=name, digest=h.hexdigest()[:16], profile=profile)

