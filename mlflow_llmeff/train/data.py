"""Training data: read text, tokenize, pack into ``seq_len`` blocks, hold out a validation split.

Accepted ``dataset`` values:
  * ``python-docs`` (the default): the Python language reference topics that ship with every
    CPython (``pydoc_data.topics``, ~465 kB of real English prose, PSF licence): real text that
    needs no download and no data directory.
  * a ``.txt`` file (documents separated by blank lines), a ``.jsonl`` file (one JSON object a
    line, text in ``text_field``), or a directory holding such files (read in sorted order);
  * a Hugging Face dataset id such as ``org/name`` (through ``datasets.load_dataset``, split
    ``train``, column ``text_field``);
  * ``synthetic``: uniformly random token ids (not text: tagged ``dataset.kind=synthetic``).

With ``packing`` on (default) documents are joined with EOS and cut into full blocks: no padding.
With packing off every document is truncated or right-padded to ``seq_len`` and the attention mask
marks the padding, so padded and non-padding token counts differ.
"""

from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass

DEFAULT_DATASET = "python-docs"


@dataclass
class Blocks:
    """Tokenized sequences ready for a causal LM.

    Attributes:
        input_ids: int64 tensor ``(N, seq_len)``.
        attention_mask: int64 tensor ``(N, seq_len)``, 1 on real tokens, 0 on padding.
        labels: int64 tensor ``(N, seq_len)``, ``-100`` on padding (ignored by the loss).
    """

    input_ids: "object"
    attention_mask: "object"
    labels: "object"

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    def __getitem__(self, i):
        return {"input_ids": self.input_ids[i], "attention_mask": self.attention_mask[i], "labels": self.labels[i]}


@dataclass
class PreparedData:
    """Train and validation blocks plus provenance for the tags."""

    train: Blocks
    val: Blocks | None
    kind: str
    description: str


def dataset_kind(dataset: str) -> str:
    """Classify ``dataset`` without reading it; raises ValueError for a missing local path.

    Returns one of ``python_docs``, ``synthetic``, ``text_file``, ``jsonl``, ``text_dir``, ``hub``.
    """
    if dataset == DEFAULT_DATASET:
        return "python_docs"
    if dataset == "synthetic":
        return "synthetic"
    if os.path.isfile(dataset):
        if dataset.endswith(".jsonl"):
            return "jsonl"
        return "text_file"
    if os.path.isdir(dataset):
        if not _dir_files(dataset):
            raise ValueError(f"dataset directory {dataset!r} holds no .txt or .jsonl files")
        return "text_dir"
    looks_local = dataset.startswith((".", "/", "~")) or dataset.endswith((".txt", ".jsonl")) or dataset.count("/") != 1
    if looks_local:
        raise ValueError(f"dataset {dataset!r} does not exist; accepted: '{DEFAULT_DATASET}' (built in), "
                         f"'synthetic', a .txt/.jsonl file or directory, or a Hugging Face dataset id 'org/name'")
    return "hub"


def _dir_files(path: str) -> list[str]:
    files = glob.glob(os.path.join(path, "**", "*.txt"), recursive=True)
    files += glob.glob(os.path.join(path, "**", "*.jsonl"), recursive=True)
    return sorted(files)


def _read_txt(path: str) -> list[str]:
    with open(path, encoding="utf-8", errors="replace") as f:
        text = f.read()
    return [d.strip("\n") for d in text.split("\n\n") if d.strip()]


def _read_jsonl(path: str, text_field: str) -> list[str]:
    docs = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not valid JSON ({e.msg}); expected one object per line") from None
            if text_field not in rec:
                raise ValueError(f"{path}:{n}: no field {text_field!r} (fields: {', '.join(rec)}); set text_field")
            docs.append(str(rec[text_field]))
    return docs


def read_documents(dataset: str, *, text_field: str = "text") -> tuple[list[str], str, str]:
    """Read raw documents. Returns ``(documents, kind, description)``; raises ValueError on bad input."""
    kind = dataset_kind(dataset)
    if kind == "python_docs":
        import pydoc_data.topics as topics

        docs = [topics.topics[k] for k in sorted(topics.topics)]
        return docs, kind, "Python language reference topics (pydoc_data, ships with CPython)"
    if kind == "text_file":
        return _read_txt(dataset), kind, dataset
    if kind == "jsonl":
        return _read_jsonl(dataset, text_field), kind, dataset
    if kind == "text_dir":
        docs: list[str] = []
        for f in _dir_files(dataset):
            docs += _read_jsonl(f, text_field) if f.endswith(".jsonl") else _read_txt(f)
        return docs, kind, dataset
    if kind == "hub":
        try:
            import datasets

            ds = datasets.load_dataset(dataset, split="train")
        except Exception as e:  # noqa: BLE001 - one line, not a deep stack trace
            raise ValueError(f"dataset {dataset!r} could not be loaded with datasets.load_dataset "
                             f"({type(e).__name__}: {str(e).splitlines()[0][:200]})") from None
        if text_field not in ds.column_names:
            raise ValueError(f"dataset {dataset!r} has no column {text_field!r} (columns: {', '.join(ds.column_names)})")
        return [str(t) for t in ds[text_field]], kind, dataset
    raise AssertionError(kind)  # synthetic has no documents


def _tokenize(tokenizer, docs: list[str]) -> list[list[int]]:
    out: list[list[int]] = []
    for i in range(0, len(docs), 256):
        enc = tokenizer(docs[i:i + 256], add_special_tokens=False)["input_ids"]
        out += enc
    return out


def pack(token_docs: list[list[int]], seq_len: int, eos_id: int) -> Blocks:
    """Join documents (each followed by ``eos_id``) and cut full blocks of ``seq_len``; drops the tail."""
    import torch

    flat: list[int] = []
    for ids in token_docs:
        flat += ids
        flat.append(eos_id)
    n = len(flat) // seq_len
    ids = torch.tensor(flat[: n * seq_len], dtype=torch.long).view(n, seq_len)
    return Blocks(ids, torch.ones_like(ids), ids.clone())


def pad(token_docs: list[list[int]], seq_len: int, eos_id: int, pad_id: int) -> Blocks:
    """One block per document: ``doc + [eos]`` truncated to ``seq_len``, right-padded with ``pad_id``."""
    import torch

    n = len(token_docs)
    ids = torch.full((n, seq_len), pad_id, dtype=torch.long)
    mask = torch.zeros((n, seq_len), dtype=torch.long)
    for i, d in enumerate(token_docs):
        d = (d + [eos_id])[:seq_len]
        ids[i, : len(d)] = torch.tensor(d, dtype=torch.long)
        mask[i, : len(d)] = 1
    labels = ids.masked_fill(mask == 0, -100)
    return Blocks(ids, mask, labels)


def prepare_data(dataset: str, tokenizer, seq_len: int, *, packing: bool = True, val_fraction: float = 0.05,
                 seed: int = 0, text_field: str = "text", synthetic_blocks: int = 4096,
                 vocab_size: int | None = None) -> PreparedData:
    """Read, tokenize, pack or pad, shuffle with ``seed`` and split off ``val_fraction`` of blocks.

    Args:
        dataset: see the module docstring.
        tokenizer: a Hugging Face tokenizer (needs ``eos_token_id``; ``pad_token_id`` when not packing).
        seq_len: tokens per block, >= 2.
        packing: join documents into full blocks (True) or pad each document (False).
        val_fraction: fraction of blocks held out, in [0, 0.5]; at least one block when > 0.
        seed: shuffle seed.
        synthetic_blocks: number of random blocks for ``synthetic``.
        vocab_size: id range for ``synthetic`` (defaults to ``len(tokenizer)``).

    Raises:
        ValueError: unreadable data, or too little text for one training block.
    """
    import torch

    g = torch.Generator().manual_seed(seed)
    if dataset == "synthetic":
        v = vocab_size or len(tokenizer)
        ids = torch.randint(0, v, (synthetic_blocks, seq_len), generator=g)
        blocks = Blocks(ids, torch.ones_like(ids), ids.clone())
        kind, desc = "synthetic", f"synthetic: uniform random token ids in [0, {v}) (not text)"
    else:
        docs, kind, desc = read_documents(dataset, text_field=text_field)
        tok_docs = [d for d in _tokenize(tokenizer, docs) if d]
        eos = tokenizer.eos_token_id
        blocks = pack(tok_docs, seq_len, eos) if packing else pad(tok_docs, seq_len, eos, tokenizer.pad_token_id)
    perm = torch.randperm(len(blocks), generator=g)
    n_val = 0 if val_fraction <= 0 else max(1, int(round(len(blocks) * val_fraction)))
    if len(blocks) - n_val < 1:
        raise ValueError(f"dataset {dataset!r} yields {len(blocks)} block(s) of seq_len={seq_len}: too little "
                         f"text for training plus a validation split; use a smaller seq_len or more text")

    def take(idx):
        return Blocks(blocks.input_ids[idx], blocks.attention_mask[idx], blocks.labels[idx])

    val = take(perm[:n_val]) if n_val else None
    return PreparedData(train=take(perm[n_val:]), val=val, kind=kind, description=desc)


def epoch_order(n: int, epoch: int, seed: int) -> list[int]:
    """Deterministic sample order of epoch ``epoch`` (a fresh permutation per epoch, from ``seed``)."""
    import torch

    return torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch)).tolist()
