"""Training data through Hugging Face ``datasets``: load text, tokenize and pack once into an on-disk cache.

Accepted ``dataset`` values:
  * ``python-docs`` (the default): the Python language reference topics that ship with every
    CPython (``pydoc_data.topics``, ~465 kB of real English prose, PSF licence): real text that
    needs no download and no data directory.
  * a ``.txt`` file (documents separated by blank lines), a ``.jsonl``/``.json`` file (one JSON
    object a line, text in ``text_field``), a ``.parquet`` file (text in column ``text_field``), or
    a directory holding such files (read in sorted order, ``.txt`` files first, then ``.jsonl``/
    ``.json``, then ``.parquet``);
  * a Hugging Face dataset id such as ``org/name`` (split ``train``, column ``text_field``);
  * ``synthetic``: uniform random token ids in memory, no ``datasets`` (not text: ``dataset.kind=synthetic``).

Everything is loaded with ``datasets.load_dataset`` (Arrow, memory-mapped: a corpus larger than
memory is fine) and tokenized with a batched ``Dataset.map`` over ``num_proc`` workers into a token
dataset written under a cache directory, keyed by the data's fingerprint, the tokenizer, ``seq_len``,
packing and ``text_field`` (:func:`cache_key`). A second run with the same inputs memory-maps the
cached tokens instead of tokenizing again; ``llmeff prepare-data`` fills the cache ahead of time.

With ``packing`` on (default) the documents of each map batch of :data:`PACK_BATCH_DOCS` documents
are joined with EOS and cut into full ``seq_len`` blocks; the tail of each batch that does not fill
a block is dropped (as Hugging Face's ``run_clm`` ``group_texts`` does), so every block is real text
and no padding. With packing off every document (+ EOS) is one row, truncated to ``seq_len`` and
right-padded when batched; the attention mask marks the padding, so padded and non-padding token
counts differ. Token ids are stored as ``uint16`` when the vocabulary fits (2 bytes/token), else
``int32``.

``streaming=True`` reads a dataset too large to download through ``datasets``' streaming mode and
packs on the fly with the same function, so its blocks equal the cached path's, in the same order.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass, field
from typing import Any

from mlflow_llmeff.names import shorten

DEFAULT_DATASET = "python-docs"
CACHE_DIR_ENV = "LLMEFF_CACHE_DIR"
PACK_BATCH_DOCS = 1000  # documents per batched map call; packing carries no tokens across batches
CACHE_FORMAT = 3  # bump when the cached layout or the packing rule changes
_META = "llmeff_tokens.json"
#: ``packing`` settings: ``true`` joins documents with EOS into full blocks (attention runs across
#: the documents of a block), ``false`` pads each document to its own row, ``documents`` trains on
#: the same full blocks (the same cache) with ``position_ids`` restarting after each EOS and no
#: attention mask, so attention stays inside each document (padding-free packing with document
#: boundaries, as transformers' ``DataCollatorWithFlattening``; :func:`document_batch`).
PACKING_MODES = ("true", "false", "documents")
_TEXT_EXT = (".txt",)
_JSON_EXT = (".jsonl", ".json")
_PARQUET_EXT = (".parquet",)
ACCEPTED = ("'python-docs' (built in), 'synthetic', a .txt/.jsonl/.json/.parquet file or a directory of them, "
            "or a Hugging Face dataset id 'org/name'")


def packing_mode(packing) -> str:
    """The ``packing`` setting as one of :data:`PACKING_MODES` (booleans as ``true`` / ``false``).

    Raises:
        ValueError: for any other value (one line naming the accepted ones).
    """
    if isinstance(packing, bool):
        return "true" if packing else "false"
    mode = str(packing).strip().lower()
    if mode not in PACKING_MODES:
        raise ValueError(f"packing={packing!r} is not accepted; use one of: {', '.join(PACKING_MODES)}")
    return mode


def packs_blocks(packing) -> bool:
    """Whether ``packing`` (any accepted form) stores full blocks: ``true`` and ``documents`` do."""
    return packing_mode(packing) != "false"


# ------------------------------------------------------------------------------------------ sources
def dataset_label(dataset: str) -> str:
    """The ``llmeff.dataset`` condition of ``dataset``: a local file or directory by its absolute path with
    links resolved (``os.path.realpath``), so one file given as ``../data/x.txt`` and as ``/home/me/data/x.txt``
    is one condition (a trial's two spellings were two configurations); anything else as given."""
    if dataset not in (DEFAULT_DATASET, "synthetic") and os.path.exists(dataset):
        return os.path.realpath(dataset)
    return dataset


def dataset_kind(dataset: str) -> str:
    """Classify ``dataset`` without reading it.

    Returns:
        One of ``python_docs``, ``synthetic``, ``text_file``, ``jsonl``, ``parquet``, ``text_dir``, ``hub``.

    Raises:
        ValueError: a local path that does not exist, a file of an unknown type, or an empty directory.
    """
    if dataset == DEFAULT_DATASET:
        return "python_docs"
    if dataset == "synthetic":
        return "synthetic"
    if os.path.isfile(dataset):
        return _file_kind(dataset)
    if os.path.isdir(dataset):
        if not _dir_files(dataset):
            raise ValueError(f"dataset directory {dataset!r} holds no .txt, .jsonl, .json or .parquet files")
        return "text_dir"
    looks_local = (dataset.startswith((".", "/", "~")) or dataset.endswith(_TEXT_EXT + _JSON_EXT + _PARQUET_EXT)
                   or dataset.count("/") != 1)
    if looks_local:
        raise ValueError(f"dataset {dataset!r} does not exist; accepted: {ACCEPTED}")
    return "hub"


def _file_kind(path: str) -> str:
    if path.endswith(_TEXT_EXT):
        return "text_file"
    if path.endswith(_JSON_EXT):
        return "jsonl"
    if path.endswith(_PARQUET_EXT):
        return "parquet"
    raise ValueError(f"dataset file {path!r} has an unknown extension; accepted: .txt (blank-line separated "
                     f"documents), .jsonl/.json (one object a line), .parquet")


def _dir_files(path: str) -> dict[str, list[str]]:
    """``{builder: sorted files}`` of a directory tree, for the builders that have files."""
    out = {}
    for builder, exts in (("text", _TEXT_EXT), ("json", _JSON_EXT), ("parquet", _PARQUET_EXT)):
        files = sorted(f for e in exts for f in glob.glob(os.path.join(path, "**", "*" + e), recursive=True))
        if files:
            out[builder] = files
    return out


def load_text(dataset: str, *, text_field: str = "text", streaming: bool = False):
    """The documents of ``dataset`` as a ``datasets`` dataset with one string column ``text``.

    Args:
        dataset: see the module docstring (not ``synthetic``).
        text_field: the text column of .jsonl/.json/.parquet files and hub datasets.
        streaming: return a ``datasets.IterableDataset`` read lazily (nothing downloaded up front).

    Returns:
        ``(ds, kind, description)``: ``ds`` a memory-mapped ``datasets.Dataset`` (or
        ``IterableDataset`` when streaming) with column ``text``.

    Raises:
        ValueError: a missing path, unknown file type, missing column, or a hub id that cannot be loaded.
    """
    import datasets

    kind = dataset_kind(dataset)
    if kind == "synthetic":
        raise ValueError("dataset 'synthetic' has no text; it is generated by prepare_data")
    if kind == "python_docs":
        import pydoc_data.topics as topics

        ds = datasets.Dataset.from_dict({"text": [topics.topics[k] for k in sorted(topics.topics)]})
        ds = ds.to_iterable_dataset() if streaming else ds
        return ds, kind, "Python language reference topics (pydoc_data, ships with CPython)"
    if kind == "hub":
        try:
            ds = datasets.load_dataset(dataset, split="train", streaming=streaming)
        except Exception as e:  # noqa: BLE001 - one line, not a deep stack trace
            raise ValueError(f"dataset {dataset!r} could not be loaded with datasets.load_dataset "
                             f"({type(e).__name__}: {shorten(str(e).splitlines()[0], 200) if str(e) else ''}); accepted: "
                             f"{ACCEPTED}") from None
        return _text_column(ds, text_field, dataset), kind, dataset
    groups = _dir_files(dataset) if kind == "text_dir" else {
        {"text_file": "text", "jsonl": "json", "parquet": "parquet"}[kind]: [dataset]}
    parts = []
    for builder, files in groups.items():
        kw = {"sample_by": "paragraph"} if builder == "text" else {}
        try:
            part = datasets.load_dataset(builder, data_files=files, split="train", streaming=streaming, **kw)
        except Exception as e:  # noqa: BLE001
            raise ValueError(f"dataset {dataset!r}: {builder} files could not be read ({type(e).__name__}: "
                             f"{shorten(str(e).splitlines()[0], 200) if str(e) else ''})") from None
        parts.append(_text_column(part, "text" if builder == "text" else text_field, dataset))
    ds = parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)
    return ds, kind, dataset


def _text_column(ds, text_field: str, dataset: str):
    cols = list(ds.column_names or [])
    if cols and text_field not in cols:
        raise ValueError(f"dataset {dataset!r} has no column {text_field!r} (columns: {', '.join(cols)}); "
                         f"set text_field")
    ds = ds.select_columns([text_field])
    return ds.rename_column(text_field, "text") if text_field != "text" else ds


# ------------------------------------------------------------------------------- tokenize and pack
class Packer:
    """The batched ``map`` function: tokenize a batch of documents, then pack (or truncate) them.

    Picklable (a class, not a closure), so ``map(num_proc=N)`` can ship it to worker processes.

    Args:
        tokenizer: a Hugging Face tokenizer (``eos_token_id`` required).
        seq_len: tokens per block.
        packing: join documents with EOS into full blocks (True) or one row per document (False).
    """

    def __init__(self, tokenizer, seq_len: int, packing: bool) -> None:
        from mlflow_llmeff.models.bytetok import byte_offset, special_strings

        self.tokenizer, self.seq_len, self.packing = tokenizer, seq_len, packing
        self.eos = tokenizer.eos_token_id
        self.dtype = token_dtype(len(tokenizer))
        # the presets' ByT5 tokenizer: ids are UTF-8 bytes + offset, encoded with numpy (same ids,
        # checked on a probe; ~50x its Python code); a batch spelling a special token uses the tokenizer
        self.byte_offset = byte_offset(tokenizer)
        self.specials = special_strings(tokenizer) if self.byte_offset is not None else ()

    def _direct(self, texts: list[str]):
        """(UTF-8 bytes + offset of all non-empty documents, each followed by EOS; one array),
        or None when a text holds a special-token string."""
        import numpy as np

        if any(sp in t for sp in self.specials for t in texts):
            return None
        docs = [t.encode("utf-8") for t in texts]
        docs = [d for d in docs if d]
        lens = np.fromiter((len(d) for d in docs), dtype=np.int64, count=len(docs))
        out = np.empty(int(lens.sum()) + len(docs), dtype=self.dtype)
        eos_at = np.cumsum(lens + 1) - 1
        is_text = np.ones(out.shape[0], dtype=bool)
        is_text[eos_at] = False
        out[is_text] = np.frombuffer(b"".join(docs), dtype=np.uint8).astype(self.dtype) + self.byte_offset
        out[eos_at] = self.eos
        return out, eos_at

    def __call__(self, batch: dict[str, list]) -> dict[str, Any]:
        import numpy as np

        direct = self._direct(batch["text"]) if self.byte_offset is not None else None
        if direct is not None:
            flat_arr, eos_at = direct
            if not self.packing:  # one row per document: doc + EOS, truncated to seq_len
                starts = np.concatenate([[0], eos_at[:-1] + 1])
                return {"input_ids": [flat_arr[a : min(e + 1, a + self.seq_len)] for a, e in zip(starts, eos_at)]}
            n = len(flat_arr) // self.seq_len
            return {"input_ids": flat_arr[: n * self.seq_len].reshape(n, self.seq_len)}
        ids = self.tokenizer(batch["text"], add_special_tokens=False)["input_ids"]
        if not self.packing:  # one row per document: doc + EOS, truncated to seq_len; padded when batched
            return {"input_ids": [(d + [self.eos])[: self.seq_len] for d in ids if d]}
        flat: list[int] = []
        for d in ids:
            if d:
                flat += d
                flat.append(self.eos)
        n = len(flat) // self.seq_len
        blocks = np.asarray(flat[: n * self.seq_len], dtype=self.dtype).reshape(n, self.seq_len)
        return {"input_ids": blocks}  # (n, seq_len)


def token_dtype(vocab_size: int) -> str:
    """``uint16`` when every id fits in 16 bits (vocabularies up to 65,536), else ``int32``."""
    return "uint16" if vocab_size <= 65_536 else "int32"


def _features(tokenizer, seq_len: int, packing: bool):
    import datasets

    value = datasets.Value(token_dtype(len(tokenizer)))
    return datasets.Features({"input_ids": datasets.List(value, length=seq_len if packing else -1)})


def tokenizer_fingerprint(tokenizer) -> str:
    """A stable hash of a tokenizer (its vocabulary, merges and settings, as ``datasets`` hashes it)."""
    from datasets.fingerprint import Hasher

    return Hasher.hash(tokenizer)


def cache_key(source_fingerprint: str, tokenizer, seq_len: int, packing: bool, text_field: str) -> str:
    """The cache key: 16 hex digits over everything that changes the token dataset.

    Args:
        source_fingerprint: the raw dataset's ``datasets`` fingerprint (for local files it covers
            their paths and modification times; for the built-in text its content).
        tokenizer: the tokenizer (hashed whole, see :func:`tokenizer_fingerprint`).
        seq_len, packing, text_field: as in :func:`prepare_data`.
    """
    raw = json.dumps([CACHE_FORMAT, PACK_BATCH_DOCS, source_fingerprint, tokenizer_fingerprint(tokenizer),
                      seq_len, bool(packing), text_field])
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def default_cache_dir() -> str:
    """``$LLMEFF_CACHE_DIR``, else ``$XDG_CACHE_HOME/mlflow_llmeff/tokens`` (``~/.cache/...``)."""
    env = os.environ.get(CACHE_DIR_ENV)
    if env:
        return env
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "mlflow_llmeff", "tokens")


def _source_fingerprint(raw, kind: str) -> str:
    if kind == "python_docs":  # in memory: datasets gives it a random fingerprint; hash the content
        from datasets.fingerprint import Hasher

        return Hasher.hash(raw["text"])
    return raw._fingerprint


@dataclass
class TokenCache:
    """A token dataset on disk and what it holds.

    Attributes:
        path: its directory (``<cache_dir>/<key>``).
        tokens: non-padding tokens in it (EOS included).
        blocks: rows (packed: full ``seq_len`` blocks; padded: documents).
        hit: True when it was already there (no tokenization ran).
        seconds: wall time of this call (s).
    """

    path: str
    tokens: int
    blocks: int
    hit: bool
    seconds: float
    meta: dict = field(default_factory=dict)

    def load(self):
        """The token dataset, memory-mapped from its Arrow files (column ``input_ids``)."""
        import datasets

        parts = [datasets.Dataset.from_file(os.path.join(self.path, "data", f)) for f in self.meta["files"]]
        return parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)


def num_proc_for(rows: int, num_proc: int = 0) -> int:
    """Workers for the tokenizing ``map``: ``num_proc`` when > 0, else one per CPU for large data
    (>= 20,000 documents per worker), else 1 (starting workers costs seconds)."""
    if num_proc > 0:
        return num_proc
    return max(1, min(os.cpu_count() or 1, rows // 20_000))


def tokenize_to_cache(dataset: str, tokenizer, seq_len: int, *, packing: bool = True, text_field: str = "text",
                      cache_dir: str | None = None, num_proc: int = 0) -> TokenCache:
    """Tokenize and pack ``dataset`` into the on-disk cache, or find it there.

    Concurrent callers (ranks) may race: the dataset is written to a temporary directory and
    renamed into place, so a reader never sees a half-written cache.

    Args:
        dataset: see the module docstring (not ``synthetic``).
        tokenizer: a Hugging Face tokenizer.
        seq_len: tokens per block, >= 2.
        packing, text_field: as in :func:`prepare_data`.
        cache_dir: where token datasets live (default :func:`default_cache_dir`).
        num_proc: tokenizing workers (0: :func:`num_proc_for`).

    Raises:
        ValueError: unreadable data (see :func:`load_text`).
    """
    t0 = time.perf_counter()
    packing = packs_blocks(packing)  # ``documents`` trains on the blocks of ``true``
    raw, kind, desc = load_text(dataset, text_field=text_field)
    key = cache_key(_source_fingerprint(raw, kind), tokenizer, seq_len, packing, text_field)
    root = cache_dir or default_cache_dir()
    path = os.path.join(root, key)
    meta_path = os.path.join(path, _META)
    if os.path.isfile(meta_path):
        with open(meta_path, encoding="utf-8") as f:
            meta = json.load(f)
        return TokenCache(path, meta["tokens"], meta["blocks"], True, time.perf_counter() - t0, meta)
    os.makedirs(root, exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(os.path.join(tmp, "data"))
    procs = num_proc_for(len(raw), num_proc)
    with _quiet_datasets(show=len(raw) >= 100_000):
        # map's own output files (one per worker) are the cache: nothing is copied afterwards
        tokens = raw.map(Packer(tokenizer, seq_len, packing), batched=True, batch_size=PACK_BATCH_DOCS,
                         num_proc=procs if procs > 1 else None, remove_columns=raw.column_names,
                         features=_features(tokenizer, seq_len, packing), new_fingerprint=key,
                         cache_file_name=os.path.join(tmp, "data", "tokens.arrow"), desc="llmeff: tokenizing",
                         writer_batch_size=_writer_rows(seq_len, len(tokenizer)))
    files = [os.path.relpath(f["filename"], os.path.join(tmp, "data")) for f in tokens.cache_files]
    n_tokens = len(tokens) * seq_len if packing else _count_tokens(tokens)
    meta = {"format": CACHE_FORMAT, "dataset": dataset, "kind": kind, "description": desc, "seq_len": seq_len,
            "packing": bool(packing), "text_field": text_field, "tokens": int(n_tokens), "blocks": len(tokens),
            "vocab_size": len(tokenizer), "documents": len(raw), "num_proc": procs, "files": files,
            "tokenize_s": round(time.perf_counter() - t0, 3)}
    del tokens
    with open(os.path.join(tmp, _META), "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=1)
    try:
        os.replace(tmp, path)
    except OSError:  # another process renamed its copy first: theirs is as good
        shutil.rmtree(tmp, ignore_errors=True)
    return TokenCache(path, meta["tokens"], meta["blocks"], False, time.perf_counter() - t0, meta)


def _writer_rows(seq_len: int, vocab_size: int) -> int:
    """Rows per Arrow record batch of the cache: about 32 MB each. Opening a memory-mapped file reads
    every batch's header, and the kernel reads ahead around each, so small batches (datasets'
    default, 1,000 rows) put ~1 GB of a 4 GB cache into the trainer's resident memory."""
    item = 2 if token_dtype(vocab_size) == "uint16" else 4
    return max(1000, (32 << 20) // (seq_len * item))


def _count_tokens(tokens) -> int:
    import pyarrow.compute as pc

    return int(pc.sum(pc.list_value_length(tokens.data.column("input_ids"))).as_py() or 0)


class _quiet_datasets:
    """Silence ``datasets``' progress bars for a block, unless ``show`` (large data: minutes of work)."""

    def __init__(self, show: bool = False) -> None:
        self._show = show

    def __enter__(self):
        import datasets

        self._was = datasets.utils.logging.is_progress_bar_enabled()
        if not self._show:
            datasets.utils.logging.disable_progress_bar()

    def __exit__(self, *exc):
        import datasets

        if self._was:
            datasets.utils.logging.enable_progress_bar()


def stream_blocks(dataset: str, tokenizer, seq_len: int, *, packing: bool = True, text_field: str = "text",
                  world: int = 1, rank: int = 0):
    """``dataset`` read lazily and packed on the fly: a ``datasets.IterableDataset`` of ``input_ids``.

    Each rank reads only its part (``datasets.distributed.split_dataset_by_node``: whole files when
    their number divides by ``world``, else every ``world``-th document). With ``world=1`` the rows
    equal :func:`tokenize_to_cache`'s, in the same order.
    """
    from datasets.distributed import split_dataset_by_node

    raw, kind, desc = load_text(dataset, text_field=text_field, streaming=True)
    if world > 1:
        raw = split_dataset_by_node(raw, rank=rank, world_size=world)
    packed = raw.map(Packer(tokenizer, seq_len, packs_blocks(packing)), batched=True, batch_size=PACK_BATCH_DOCS,
                     remove_columns=["text"])
    return packed, kind, desc


# --------------------------------------------------------------------------------------- blocks
def _full_block_chunks(table, seq_len: int):
    """``(chunk start rows, [(rows, seq_len) array per chunk])``: zero-copy numpy views of the Arrow
    ``input_ids`` column when each row holds ``seq_len`` ids (a fixed-size list, as the token cache stores
    packed blocks, or a list whose every row is full), without nulls, and the table reads its Arrow rows in
    order (no index mapping: as many rows, the first and last the same); else None. In-memory rows
    (:class:`~mlflow_llmeff.train.synthetic.TokenArray`) give their own views, without pyarrow.

    A micro-batch is then one numpy gather of ``B x T`` ids: 8 x 128 took ~400 us through ``datasets``' row
    formatting, ~30 us here (2-core CPU), inside every step of ``llmeff train`` and no bare loop's."""
    if hasattr(table, "full_block_chunks"):
        return table.full_block_chunks(seq_len)
    import numpy as np
    import pyarrow as pa

    try:
        if table.data.num_rows != len(table):  # an index mapping over the Arrow rows: datasets reads through it
            return None
        column = table.data.column("input_ids")
        fixed = pa.types.is_fixed_size_list(column.type)
        if fixed and column.type.list_size != seq_len:
            return None
        if column.null_count or not (fixed or pa.types.is_list(column.type) or pa.types.is_large_list(column.type)):
            return None
        starts, views, at = [], [], 0
        for chunk in column.chunks:
            if not fixed and not (np.diff(chunk.offsets.to_numpy()) == seq_len).all():  # a list: full rows only
                return None
            values = chunk.flatten()  # the chunk's own slice of the child values
            if values.null_count or not pa.types.is_integer(values.type):
                return None
            views.append(values.to_numpy(zero_copy_only=True).reshape(-1, seq_len))
            starts.append(at)
            at += len(chunk)
        last = len(table) - 1  # a same-length index mapping (a permutation) would show at the ends
        if not views or not (np.array_equal(np.asarray(table[0]["input_ids"]), views[0][0])
                and np.array_equal(np.asarray(table[last]["input_ids"]), views[-1][last - starts[-1]])):
            return None
        return np.asarray(starts, dtype=np.int64), views
    except Exception:  # noqa: BLE001 - any other layout reads through datasets
        return None


class TokenBlocks:
    """Rows of a token dataset as model inputs: a map-style torch dataset, memory-mapped.

    ``blocks[i]`` is a dict of ``(seq_len,)`` int64 tensors; ``blocks[idx]`` (a list or slice) and
    ``blocks.__getitems__(idx)`` (the torch ``DataLoader`` batched fetch) a dict of ``(B, seq_len)``
    tensors: ``input_ids``, ``attention_mask`` (1 on real tokens, 0 on padding) and ``labels``
    (``-100`` on padding, ignored by the loss).

    Args:
        table: a ``datasets.Dataset`` (or synthetic ``TokenArray``) with column ``input_ids`` (rows <= ``seq_len`` ids).
        seq_len: the padded length.
        pad_id: id written on padding positions (masked out and ignored by the loss).
        rows: which rows of ``table`` these blocks are, in order (an int64 array; default all).
            Kept as an array rather than a ``datasets`` index mapping: 8 bytes a block, nothing
            written beside the cache.
    """

    def __init__(self, table, seq_len: int, pad_id: int, rows=None) -> None:
        import numpy as np

        self.table = table.with_format("numpy")
        self.seq_len, self.pad_id = seq_len, pad_id
        self.rows = np.arange(len(table), dtype=np.int64) if rows is None else np.asarray(rows, dtype=np.int64)
        self._chunks = _full_block_chunks(table, seq_len)

    def __len__(self) -> int:
        return len(self.rows)

    def __getstate__(self) -> dict:  # a worker started by spawn maps the column again (no copy in the pickle)
        return {**self.__dict__, "_chunks": None}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _chunks=_full_block_chunks(state["table"], state["seq_len"]))

    def __getitem__(self, i):
        if isinstance(i, int):
            return {k: v[0] for k, v in self.__getitems__([i]).items()}
        rows = range(len(self))[i] if isinstance(i, slice) else i
        return self.__getitems__(list(rows))

    def __getitems__(self, idx: list[int]) -> dict:
        import numpy as np
        import torch

        if self._chunks is not None and len(idx):  # full blocks: rows of the memory-mapped column, no copy but B x T
            starts, views = self._chunks
            picked = self.rows[np.asarray(idx, dtype=np.int64)]
            if len(views) == 1:
                col = views[0][picked]
            else:
                at = np.searchsorted(starts, picked, side="right") - 1
                col = np.stack([views[c][r - starts[c]] for c, r in zip(at.tolist(), picked.tolist())])
            ids = torch.from_numpy(col.astype(np.int64))  # (B, T)
            return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
        col = self.table[self.rows[np.asarray(idx, dtype=np.int64)].tolist()]["input_ids"] if len(idx) \
            else np.zeros((0, self.seq_len))
        if isinstance(col, np.ndarray) and col.dtype != object and col.ndim == 2 and col.shape[1] == self.seq_len:
            ids = torch.from_numpy(col.astype(np.int64))  # (B, T): packed, no padding
            return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
        ids = torch.full((len(idx), self.seq_len), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(idx), self.seq_len), dtype=torch.long)
        for r, row in enumerate(col):
            ids[r, : len(row)] = torch.from_numpy(np.asarray(row, dtype=np.int64))
            mask[r, : len(row)] = 1
        return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}

    def shard(self, world: int, rank: int) -> "TokenBlocks":
        """This rank's contiguous shard, split as ``datasets.distributed.split_dataset_by_node`` splits a
        map-style dataset (the first ``len % world`` shards hold one block more): disjoint across
        ranks, together all blocks."""
        if world == 1:
            return self
        div, mod = divmod(len(self.rows), world)
        start = div * rank + min(rank, mod)
        return TokenBlocks(self.table, self.seq_len, self.pad_id, self.rows[start: start + div + (rank < mod)])


@dataclass
class PreparedData:
    """Train and validation blocks plus provenance for the tags.

    Attributes:
        train: :class:`TokenBlocks` (or, when streaming, a ``datasets.IterableDataset`` of this
            rank's ``input_ids``).
        val: held-out :class:`TokenBlocks`, or None.
        kind, description: for the ``dataset.kind`` tag and messages.
        cache: the :class:`TokenCache` used (None for synthetic and streaming data).
        streaming: whether ``train`` is a stream.
        documents: ``packing=documents``: batches carry ``position_ids`` restarting after each
            ``eos_id`` and no attention mask (:func:`document_batch`).
        eos_id: the tokenizer's end-of-sequence id (document boundaries).
    """

    train: Any
    val: TokenBlocks | None
    kind: str
    description: str
    cache: TokenCache | None = None
    streaming: bool = False
    seq_len: int = 0
    pad_id: int = 0
    documents: bool = False
    eos_id: int | None = None


def _n_val(n: int, val_fraction: float) -> int:
    return 0 if val_fraction <= 0 else max(1, int(round(n * val_fraction)))


def prepare_data(dataset: str, tokenizer, seq_len: int, *, packing: bool = True, val_fraction: float = 0.05,
                 seed: int = 0, text_field: str = "text", synthetic_blocks: int = 4096,
                 vocab_size: int | None = None, cache_dir: str | None = None, num_proc: int = 0,
                 streaming: bool = False, world: int = 1, rank: int = 0, stream_val_blocks: int = 32) -> PreparedData:
    """Tokenized train and validation blocks: from the cache (tokenizing on a miss) or a stream.

    The blocks are split with a seeded permutation: ``val_fraction`` of them (at least one when
    > 0) are held out, the rest train, so the split depends only on the data and ``seed``.

    Args:
        dataset: see the module docstring.
        tokenizer: a Hugging Face tokenizer (needs ``eos_token_id``; ``pad_token_id`` when not packing).
        seq_len: tokens per block, >= 2.
        packing: join documents into full blocks (True / ``"true"``), pad each document (False /
            ``"false"``), or full blocks trained with document boundaries (``"documents"``: the
            same blocks and cache as ``true``, see :data:`PACKING_MODES`).
        val_fraction: fraction of blocks held out, in [0, 0.5].
        seed: split seed.
        synthetic_blocks: number of random blocks for ``synthetic``.
        vocab_size: id range for ``synthetic`` (defaults to ``len(tokenizer)``).
        cache_dir, num_proc: see :func:`tokenize_to_cache`.
        streaming: read the data lazily (see :func:`stream_blocks`); the first ``stream_val_blocks``
            blocks of the stream are held out when ``val_fraction`` > 0, the rest is split over ranks.
        world, rank: only used when streaming (map-style data is sharded by the batch stream).

    Raises:
        ValueError: unreadable data, or too little text for one training block.
    """
    import dataclasses

    mode = packing_mode(packing)
    data = _prepare_data(dataset, tokenizer, seq_len, mode != "false", val_fraction, seed, text_field,
                         synthetic_blocks, vocab_size, cache_dir, num_proc, streaming, world, rank, stream_val_blocks)
    return dataclasses.replace(data, documents=mode == "documents", eos_id=tokenizer.eos_token_id)


def _prepare_data(dataset, tokenizer, seq_len, packing, val_fraction, seed, text_field, synthetic_blocks,
                  vocab_size, cache_dir, num_proc, streaming, world, rank, stream_val_blocks) -> PreparedData:
    import numpy as np

    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if dataset == "synthetic":  # in memory as numpy: no datasets, pandas or pyarrow in the rank
        from mlflow_llmeff.train.synthetic import synthetic_blocks as made

        blocks, kind, desc, cache = *made(synthetic_blocks, seq_len, vocab_size or len(tokenizer), seed), None
    elif streaming:
        return _prepare_stream(dataset, tokenizer, seq_len, packing, val_fraction, seed, text_field, world, rank,
                               stream_val_blocks, pad_id)
    else:
        cache = tokenize_to_cache(dataset, tokenizer, seq_len, packing=packing, text_field=text_field,
                                  cache_dir=cache_dir, num_proc=num_proc)
        blocks, kind, desc = cache.load(), cache.meta.get("kind", dataset_kind(dataset)), cache.meta.get("description", dataset)
    n = len(blocks)
    n_val = _n_val(n, val_fraction)
    if n - n_val < 1:
        raise ValueError(f"dataset {dataset!r} yields {n} block(s) of seq_len={seq_len}: too little "
                         f"text for training plus a validation split; use a smaller seq_len or more text")
    perm = np.random.default_rng(seed).permutation(n)
    val = TokenBlocks(blocks, seq_len, pad_id, np.sort(perm[:n_val])) if n_val else None
    train = TokenBlocks(blocks, seq_len, pad_id, perm[n_val:])
    return PreparedData(train, val, kind, desc, cache, False, seq_len, pad_id)


def _prepare_stream(dataset, tokenizer, seq_len, packing, val_fraction, seed, text_field, world, rank,
                    val_blocks, pad_id) -> PreparedData:
    import datasets

    full, kind, desc = stream_blocks(dataset, tokenizer, seq_len, packing=packing, text_field=text_field)
    n_val = val_blocks if val_fraction > 0 else 0
    val = None
    if n_val:
        rows = [r["input_ids"] for r in full.take(n_val)]
        val = TokenBlocks(datasets.Dataset.from_dict({"input_ids": rows}), seq_len, pad_id)
    train = full.skip(n_val) if n_val else full
    if world > 1:
        from datasets.distributed import split_dataset_by_node

        train = split_dataset_by_node(train, rank=rank, world_size=world)
    return PreparedData(train, val, kind, f"{desc} (streaming)", None, True, seq_len, pad_id)


def epoch_permutation(n: int, epoch: int, seed: int):
    """Deterministic sample order of epoch ``epoch``: an int64 tensor ``(n,)``, a fresh permutation per
    epoch from ``seed`` (8 bytes a block; a Python list would take ~36)."""
    import torch

    return torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))


def epoch_order(n: int, epoch: int, seed: int) -> list[int]:
    """:func:`epoch_permutation` as a list."""
    return epoch_permutation(n, epoch, seed).tolist()
