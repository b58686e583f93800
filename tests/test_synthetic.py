"""The synthetic data in memory (train/synthetic.py) gives exactly the batches its ``datasets.Dataset`` gave.

The reference is the construction ``prepare_data`` used before (issue 52): the same ids wrapped in
``datasets.Dataset.from_dict``, split with the same seeded permutation, read by the same ``TokenBlocks``.
"""

import pickle
import sys

import numpy as np
import pytest
import torch

from mlflow_llmeff.train import data as D
from mlflow_llmeff.train.batches import BatchStream, loss_token_counts
from mlflow_llmeff.train.dataset_input import training_dataset
from mlflow_llmeff.train.synthetic import TokenArray, synthetic_blocks


class ByteTokenizer:
    """What ``prepare_data`` reads of the presets' ByT5 tokenizer: pad 0, EOS 1, 259 ids."""

    pad_token_id, eos_token_id = 0, 1

    def __len__(self) -> int:
        return 259


TOK = ByteTokenizer()


def datasets_synthetic(seq_len, blocks, vocab, seed, val_fraction, packing="true"):
    """``prepare_data("synthetic", ...)`` as it was: the ids in a ``datasets.Dataset``."""
    import dataclasses

    import datasets

    ids = np.random.default_rng(seed).integers(0, vocab, (blocks, seq_len), dtype=np.int64)
    table = datasets.Dataset.from_dict({"input_ids": ids})
    n = len(table)
    n_val = D._n_val(n, val_fraction)
    perm = np.random.default_rng(seed).permutation(n)
    val = D.TokenBlocks(table, seq_len, 0, np.sort(perm[:n_val])) if n_val else None
    train = D.TokenBlocks(table, seq_len, 0, perm[n_val:])
    desc = f"synthetic: uniform random token ids in [0, {vocab}) (not text)"
    data = D.PreparedData(train, val, "synthetic", desc, None, False, seq_len, 0)
    return dataclasses.replace(data, documents=packing == "documents", eos_id=1)


def equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


#: (seq_len, blocks, vocab, seed, val_fraction, micro batch, data-parallel world, packing): llmeff train's
#: llama-tiny x2 default (64 blocks of 128, 5 % held out, 8 a rank), 3 uneven ranks, documents, no split
CONFIGS = [(128, 64, 259, 0, 0.05, 8, 2, "true"), (8, 23, 50, 7, 0.1, 2, 3, "true"),
           (16, 40, 259, 3, 0.05, 4, 1, "documents"), (8, 32, 50, 5, 0.0, 2, 2, "true")]


@pytest.mark.parametrize("seq_len, blocks, vocab, seed, val_fraction, mb, world, packing", CONFIGS)
def test_synthetic_batches_equal_the_datasets_construction(seq_len, blocks, vocab, seed, val_fraction, mb, world,
                                                           packing):
    new = D.prepare_data("synthetic", TOK, seq_len, packing=packing, val_fraction=val_fraction, seed=seed,
                         synthetic_blocks=blocks, vocab_size=vocab)
    old = datasets_synthetic(seq_len, blocks, vocab, seed, val_fraction, packing)
    assert isinstance(new.train.table, TokenArray) and new.train._chunks is not None
    assert (new.kind, new.description, new.cache, new.streaming, new.seq_len, new.pad_id, new.documents,
            new.eos_id) == (old.kind, old.description, old.cache, old.streaming, old.seq_len, old.pad_id,
                            old.documents, old.eos_id)
    # the split: the same blocks in the same order, train and held out
    assert len(new.train) == len(old.train) and np.array_equal(new.train.rows, old.train.rows)
    assert equal(new.train[:], old.train[:])
    if old.val is None:
        assert new.val is None
    else:
        assert len(new.val) == len(old.val) and equal(new.val[:], old.val[:])
        idx = list(range(1, len(old.val), world))  # a rank's strided share, as validation_loss reads it
        assert equal(new.val[idx], old.val[idx])
    # each rank's batch stream, crossing the epoch boundary, and what the loop counts of it
    per_epoch = len(old.train) // (mb * world)
    for rank in range(world):
        a, b = (BatchStream(d, mb, world, rank, seed, 0, "cpu") for d in (new, old))
        for _ in range(per_epoch + 2):
            x, y = next(a), next(b)
            assert equal(x, y)
            assert loss_token_counts([x]) == loss_token_counts([y])
            if packing == "true":  # full blocks: every position but the first bears loss (documents: not after EOS)
                assert loss_token_counts([x]) == [mb * (seq_len - 1)] and int(x["attention_mask"].sum()) == mb * seq_len
        assert [tuple(new.train.shard(world, rank).rows)] == [tuple(old.train.shard(world, rank).rows)]
        assert equal(new.train.shard(world, rank)[:], old.train.shard(world, rank)[:])
    # the run's MLflow dataset: the same digest and profile
    x, y = (training_dataset("synthetic", d, seq_len, packing) for d in (new, old))
    assert (x.digest, x.profile) == (y.digest, y.profile)


def test_the_rows_read_without_their_views_give_the_same_batch():
    # the general path of TokenBlocks (no gather views), as after a pickle to a DataLoader worker
    d = D.prepare_data("synthetic", TOK, 8, synthetic_blocks=20, vocab_size=259, val_fraction=0.0)
    idx = [7, 0, 3, 3, 11]
    fast = d.train.__getitems__(idx)
    copy = pickle.loads(pickle.dumps(d.train))
    assert copy._chunks is not None and equal(copy.__getitems__(idx), fast)
    copy._chunks = None
    assert equal(copy.__getitems__(idx), fast)
    assert equal(d.train[3], {k: v[2] for k, v in fast.items()})


def test_synthetic_training_reads_no_datasets_pandas_or_pyarrow(monkeypatch):
    # None in sys.modules makes an import of the name raise ImportError: every step below ran without them
    for name in ("datasets", "pandas", "pyarrow"):
        monkeypatch.setitem(sys.modules, name, None)
    d = D.prepare_data("synthetic", TOK, 16, synthetic_blocks=64, vocab_size=259, val_fraction=0.05)
    stream = BatchStream(d, 4, 2, 1, 0, 0, "cpu")
    batches = [next(stream) for _ in range(9)]  # 61 training blocks, 7 global micro-batches of 8 an epoch
    assert [int(b["attention_mask"].sum()) for b in batches] == [64] * 9
    assert d.val[[0, 2]]["input_ids"].shape == (2, 16)
    assert training_dataset("synthetic", d, 16, True).profile["train_tokens"] == 61 * 16


@pytest.mark.parametrize("args, match", [
    ((0, 8, 259, 0), r"synthetic_blocks=0 for the synthetic data; accepted: an integer >= 1"),
    ((4, 8, 0, 0), r"vocab_size=0 for the synthetic data; accepted: an integer >= 1"),
])
def test_bad_synthetic_sizes_give_one_line(args, match):
    with pytest.raises(ValueError, match=match):
        synthetic_blocks(*args)


def test_token_array_reads_as_a_numpy_table():
    ids = np.arange(12, dtype=np.int64).reshape(3, 4)
    t = TokenArray(ids)
    assert len(t) == 3 and t.with_format("numpy") is t and t.column_names == ["input_ids"]
    assert t["input_ids"] is ids and t[1]["input_ids"].tolist() == [4, 5, 6, 7]
    assert t[[2, 0]]["input_ids"].tolist() == [[8, 9, 10, 11], [0, 1, 2, 3]]
    assert t.full_block_chunks(4)[1][0] is ids and t.full_block_chunks(5) is None
    with pytest.raises(ValueError, match=r"token rows of shape \(12,\); accepted: a \(rows, seq_len\) array"):
        TokenArray(np.arange(12))
