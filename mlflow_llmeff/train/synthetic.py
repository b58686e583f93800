"""The ``synthetic`` training data: uniform random token ids held in memory as one numpy array.

:class:`TokenArray` is the table :class:`~mlflow_llmeff.train.data.TokenBlocks` reads, standing in for
the one-column ``datasets.Dataset`` the synthetic blocks were once wrapped in: importing ``datasets``
(and through it pandas and pyarrow) took 0.72-0.84 s of CPU in every rank of a synthetic run, torch
already loaded, for an array that is already in memory (issue 52; 0.011-0.013 s without it). Its rows, their order, and so every batch, split, shard and
digest are the same as that dataset's (tests/test_synthetic.py compares them).
"""

from __future__ import annotations

__all__ = ["TokenArray", "synthetic_blocks", "synthetic_description", "synthetic_ids"]


def synthetic_blocks(blocks: int, seq_len: int, vocab_size: int, seed: int):
    """The synthetic data as ``prepare_data`` splits it: ``(TokenArray, "synthetic", description)``.

    Args, Raises: as :func:`synthetic_ids`.
    """
    return TokenArray(synthetic_ids(blocks, seq_len, vocab_size, seed)), "synthetic", synthetic_description(vocab_size)


def synthetic_ids(blocks: int, seq_len: int, vocab_size: int, seed: int):
    """``blocks`` rows of ``seq_len`` token ids drawn uniformly from ``[0, vocab_size)``.

    Args:
        blocks: rows, >= 1.
        seq_len: ids per row, >= 1.
        vocab_size: the id range's end (exclusive), >= 1.
        seed: the generator's seed (numpy ``default_rng``; the split's permutation uses the same seed).

    Returns:
        An int64 array ``(blocks, seq_len)``.

    Raises:
        ValueError: a count below 1.
    """
    import numpy as np

    for name, v in (("synthetic_blocks", blocks), ("seq_len", seq_len), ("vocab_size", vocab_size)):
        if v < 1:
            raise ValueError(f"{name}={v} for the synthetic data; accepted: an integer >= 1")
    return np.random.default_rng(seed).integers(0, vocab_size, (blocks, seq_len), dtype=np.int64)


def synthetic_description(vocab_size: int) -> str:
    """The ``description`` of synthetic :class:`~mlflow_llmeff.train.data.PreparedData` (messages)."""
    return f"synthetic: uniform random token ids in [0, {vocab_size}) (not text)"


class TokenArray:
    """Token rows in memory, read as ``TokenBlocks`` reads a ``datasets.Dataset`` in numpy format.

    What ``TokenBlocks`` and its callers use of a table and no more: ``len``, ``with_format`` (the
    array already is numpy), ``table[rows]["input_ids"]`` for a list of rows, ``table[i]`` for one row,
    ``column_names``, and :meth:`full_block_chunks` (the gather's views: the array itself).

    Args:
        ids: int ``(rows, seq_len)`` array; every row is a full block.

    Raises:
        ValueError: ``ids`` is not two-dimensional.
    """

    column_names = ["input_ids"]

    def __init__(self, ids) -> None:
        if getattr(ids, "ndim", None) != 2:
            raise ValueError(f"token rows of shape {getattr(ids, 'shape', None)}; accepted: a (rows, seq_len) array")
        self.ids = ids

    def __len__(self) -> int:
        return self.ids.shape[0]

    def with_format(self, kind: str) -> "TokenArray":
        """Itself: its rows are numpy already (``kind`` is ``"numpy"`` as ``TokenBlocks`` asks)."""
        if kind != "numpy":
            raise ValueError(f"format {kind!r} of in-memory token rows; accepted: 'numpy'")
        return self

    def __getitem__(self, key):
        import numpy as np

        if isinstance(key, str):
            if key != "input_ids":
                raise KeyError(f"column {key!r} of in-memory token rows; accepted: 'input_ids'")
            return self.ids
        if isinstance(key, (int, np.integer)):
            return {"input_ids": self.ids[key]}
        return {"input_ids": self.ids[np.asarray(key, dtype=np.int64)]}  # (len(key), seq_len)

    def full_block_chunks(self, seq_len: int):
        """``(chunk start rows, [(rows, seq_len) array])`` as :func:`~mlflow_llmeff.train.data._full_block_chunks`
        gives for a dataset: one chunk, the array itself; None when its rows are not ``seq_len`` long."""
        import numpy as np

        if self.ids.shape[1] != seq_len:
            return None
        return np.zeros(1, dtype=np.int64), [self.ids]
