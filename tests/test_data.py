import json
import os

import pytest
import torch

from mlflow_llmeff.train import data as D
from mlflow_llmeff.train.batches import BatchStream
from mlflow_llmeff.models.build import load_tokenizer


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("llama-tiny")  # ByT5: one id per byte (+3 offset), EOS=1, pad=0


@pytest.fixture
def cache(tmp_path):
    return str(tmp_path / "cache")


def ids(text):
    return [b + 3 for b in text.encode()]


def test_packing_makes_full_blocks_without_padding(tok):
    out = D.Packer(tok, 4, True)({"text": ["\x07" * 5, "\x08" * 6]})  # 5 + 1 + 6 + 1 = 13 -> 3 blocks, 1 dropped
    assert out["input_ids"].tolist() == [[10, 10, 10, 10], [10, 1, 11, 11], [11, 11, 11, 11]]
    assert out["input_ids"].dtype.name == "uint16"


TEXTS = ["Caf\u00e9 \u4e2d\u6587 \U0001f600", "", "plain ascii, then a NUL \x00 and a tab\t", "x" * 11]


@pytest.mark.parametrize("packing", [True, False])
def test_direct_byte_encoding_equals_the_tokenizer(tok, packing):
    fast = D.Packer(tok, 4, packing)
    slow = D.Packer(tok, 4, packing)
    slow.byte_offset = None  # the ByT5 tokenizer's own Python code
    assert fast.byte_offset == 3
    a, b = fast({"text": TEXTS}), slow({"text": TEXTS})
    rows = [list(map(int, r)) for r in a["input_ids"]]
    assert rows == [list(map(int, r)) for r in b["input_ids"]]
    if packing:  # 17 + 1 (EOS) + 0 + 36 + 1 + 11 + 1 = 67 tokens -> 16 blocks of 4, 3 dropped
        assert len(rows) == 16 and rows[4] == [ids("\U0001f600")[-1], 1, *ids("pl")]  # emoji end, EOS
    else:  # the empty document makes no row; rows are cut to 4 tokens
        assert rows == [ids("Caf\u00e9")[:4], ids("plai"), ids("xxxx")]


def test_text_spelling_a_special_token_goes_through_the_tokenizer(tok):
    out = D.Packer(tok, 3, True)({"text": ["a</s>b"]})  # "</s>" is EOS (1) for the tokenizer, not 4 bytes
    assert out["input_ids"].tolist() == [[ids("a")[0], 1, ids("b")[0]]]


def test_padding_masks_and_ignores_pad_positions(tok, tmp_path, cache):
    p = tmp_path / "a.txt"
    p.write_text("\x07\x07\n\n" + "\x08" * 9)
    d = D.prepare_data(str(p), tok, 5, packing=False, val_fraction=0.0, cache_dir=cache)
    b = d.train[sorted(range(2), key=lambda i: int(d.train[i]["attention_mask"].sum()))]
    assert b["attention_mask"].tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]
    assert b["labels"].tolist()[0] == [10, 10, 1, -100, -100]
    assert d.cache.tokens == 3 + 5  # non-padding tokens only: "\x07\x07"+EOS, and 9 bytes cut to 5


def test_text_file_gives_exact_token_and_block_counts(tmp_path, tok, cache):
    p = tmp_path / "a.txt"
    p.write_text("\n\n".join("doc %02d " % i * 4 for i in range(50)))  # 50 docs of 28 bytes, + EOS each
    c = D.tokenize_to_cache(str(p), tok, 32, cache_dir=cache)
    assert c.meta["documents"] == 50 and c.blocks == 50 * 29 // 32 == 45 and c.tokens == 45 * 32
    first = c.load()[0]["input_ids"]
    assert first[:28] == ids("doc 00 " * 4) and first[28] == tok.eos_token_id


def test_split_is_seeded_and_holds_out_val_fraction(tmp_path, tok, cache):
    p = tmp_path / "a.txt"
    p.write_text("\n\n".join("doc %d " % i * 20 for i in range(50)))
    d1 = D.prepare_data(str(p), tok, 32, val_fraction=0.1, seed=3, cache_dir=cache)
    d2 = D.prepare_data(str(p), tok, 32, val_fraction=0.1, seed=3, cache_dir=cache)
    n = len(d1.train) + len(d1.val)
    assert len(d1.val) == round(n * 0.1) and d1.kind == "text_file"
    assert torch.equal(d1.train[:]["input_ids"], d2.train[:]["input_ids"])
    held = {tuple(r) for r in d1.val[:]["input_ids"].tolist()}
    assert not held & {tuple(r) for r in d1.train[:]["input_ids"].tolist()}


def test_cache_hit_skips_tokenization_and_each_key_part_misses(tmp_path, tok, cache, monkeypatch):
    p = tmp_path / "a.jsonl"
    p.write_text("\n".join(json.dumps({"text": f"document {i} " * 10}) for i in range(30)))
    first = D.tokenize_to_cache(str(p), tok, 16, cache_dir=cache)
    calls = []
    real = D.Packer.__call__
    monkeypatch.setattr(D.Packer, "__call__", lambda self, b: calls.append(1) or real(self, b))
    again = D.tokenize_to_cache(str(p), tok, 16, cache_dir=cache)
    assert (first.hit, again.hit, calls) == (False, True, [])
    assert (again.path, again.tokens, again.blocks) == (first.path, first.tokens, first.blocks)
    other_tok = type(tok)(extra_ids=5)  # another vocabulary
    variants = [dict(seq_len=32), dict(packing=False), dict(tokenizer=other_tok)]
    paths = {first.path}
    for v in variants:
        kw = dict(seq_len=16, packing=True, tokenizer=tok) | v
        c = D.tokenize_to_cache(str(p), kw.pop("tokenizer"), kw.pop("seq_len"), cache_dir=cache, **kw)
        assert not c.hit and c.path not in paths
        paths.add(c.path)
    assert calls  # the misses tokenized
    os.utime(p, (1, 1))  # the file changed (its modification time): a miss
    assert not D.tokenize_to_cache(str(p), tok, 16, cache_dir=cache).hit


def test_streaming_gives_the_same_first_blocks_as_the_cached_path(tmp_path, tok, cache):
    p = tmp_path / "a.jsonl"  # 2,500 documents: three map batches of PACK_BATCH_DOCS, packed alike
    p.write_text("\n".join(json.dumps({"text": f"doc {i} " + "x" * (i % 37)}) for i in range(2500)))
    cached = D.tokenize_to_cache(str(p), tok, 64, cache_dir=cache).load()
    stream, kind, _ = D.stream_blocks(str(p), tok, 64)
    streamed = [r["input_ids"].tolist() for r in stream]
    assert kind == "jsonl" and len(streamed) == len(cached) > 300
    assert streamed == [list(r) for r in cached["input_ids"]]


def test_each_rank_gets_a_disjoint_shard_and_together_all_blocks(tok):
    d = D.prepare_data("synthetic", tok, 8, synthetic_blocks=23, vocab_size=50, val_fraction=0.0)
    rows = lambda b: [tuple(r) for r in b[:]["input_ids"].tolist()]  # noqa: E731
    shards = [rows(d.train.shard(3, r)) for r in range(3)]
    assert [len(s) for s in shards] == [8, 8, 7]
    assert sorted(sum(shards, [])) == sorted(rows(d.train))
    assert not set(shards[0]) & set(shards[1]) and not set(shards[1]) & set(shards[2])
    # the batch streams of 2 ranks never read the same block in an epoch (micro_batch 2: 5 steps per epoch)
    seen = [[tuple(r) for _ in range(5) for r in next(s)["input_ids"].tolist()]
            for s in (BatchStream(d, 2, 2, rank, 0, 0, "cpu") for rank in (0, 1))]
    assert len(set(seen[0])) == 10 and not set(seen[0]) & set(seen[1])


def test_data_parallel_ranks_split_the_batches_of_one_process(tok):
    # the global batch, not the layout, decides the data: 2 ranks of 2 read one process's 4 (train/batches.py)
    d = D.prepare_data("synthetic", tok, 8, synthetic_blocks=40, vocab_size=50, val_fraction=0.0)
    one = BatchStream(d, 4, 1, 0, 5, 0, "cpu")
    two = [BatchStream(d, 2, 2, rank, 5, 0, "cpu") for rank in (0, 1)]
    for _ in range(12):  # crosses the epoch boundary (10 global micro-batches of 4 per epoch)
        assert torch.equal(next(one)["input_ids"], torch.cat([next(s)["input_ids"] for s in two]))


def test_resumed_stream_sees_the_same_batches_as_an_uninterrupted_one(tok):
    d = D.prepare_data("synthetic", tok, 8, synthetic_blocks=40, vocab_size=50, val_fraction=0.0)
    full = BatchStream(d, 4, 1, 0, 7, 0, "cpu")
    want = [next(full)["input_ids"] for _ in range(14)]  # crosses the epoch boundary (10 per epoch)
    resumed = BatchStream(d, 4, 1, 0, 7, 6, "cpu")
    assert all(torch.equal(next(resumed)["input_ids"], w) for w in want[6:])


def test_dataloader_workers_give_the_same_batches(tok):
    d = D.prepare_data("synthetic", tok, 8, synthetic_blocks=32, vocab_size=50, val_fraction=0.0)
    a, b = BatchStream(d, 4, 1, 0, 0, 0, "cpu"), BatchStream(d, 4, 1, 0, 0, 0, "cpu", num_workers=1)
    assert all(torch.equal(next(a)["input_ids"], next(b)["input_ids"]) for _ in range(3))


def test_streamed_training_batches_follow_the_stream(tok):
    d = D.prepare_data("python-docs", tok, 32, streaming=True, val_fraction=0.05, stream_val_blocks=3)
    head = [r["input_ids"].tolist() for _, r in zip(range(7), D.stream_blocks("python-docs", tok, 32)[0])]
    assert d.val[:]["input_ids"].tolist() == head[:3]
    assert next(BatchStream(d, 2, 1, 0, 0, 1, "cpu"))["input_ids"].tolist() == head[5:7]  # resumed at micro-step 1


def test_parquet_and_mixed_directory(tmp_path, tok, cache):
    import datasets

    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "x.jsonl").write_text("\n".join(json.dumps({"body": "hello world " * 10}) for _ in range(4)))
    (tmp_path / "d" / "y.txt").write_text("plain text " * 30)
    datasets.Dataset.from_dict({"body": ["from parquet"] * 3}).to_parquet(str(tmp_path / "d" / "z.parquet"))
    raw, kind, _ = D.load_text(str(tmp_path / "d"), text_field="body")
    assert kind == "text_dir" and raw["text"] == ["plain text " * 30] + ["hello world " * 10] * 4 + ["from parquet"] * 3
    assert D.dataset_kind(str(tmp_path / "d" / "z.parquet")) == "parquet"


@pytest.mark.parametrize("name, match", [
    ("notes.csv", r"dataset file '.*notes.csv' has an unknown extension; accepted: .txt"),
    ("missing.txt", r"dataset '.*missing.txt' does not exist; accepted: 'python-docs'"),
])
def test_bad_dataset_paths_give_one_line(tmp_path, name, match):
    if name.endswith(".csv"):
        (tmp_path / name).write_text("a,b\n")
    with pytest.raises(ValueError, match=match):
        D.dataset_kind(str(tmp_path / name))


def test_jsonl_missing_field_names_the_columns(tmp_path):
    p = tmp_path / "x.jsonl"
    p.write_text('{"content": "a"}\n')
    with pytest.raises(ValueError, match=r"has no column 'text' \(columns: content\); set text_field"):
        D.load_text(str(p))


def test_builtin_default_is_real_text_without_files():
    raw, kind, desc = D.load_text("python-docs")
    assert kind == "python_docs" and sum(map(len, raw["text"])) > 400_000
    assert "assert" in raw[0]["text"]


def test_synthetic_is_tagged_and_in_vocab(tok):
    d = D.prepare_data("synthetic", tok, 16, synthetic_blocks=20, vocab_size=100, val_fraction=0.0)
    assert d.kind == "synthetic" and "not text" in d.description and d.cache is None
    assert int(d.train[:]["input_ids"].max()) < 100 and len(d.train) == 20


def test_hub_id_goes_through_datasets(monkeypatch, tmp_path, tok):
    import datasets

    p = tmp_path / "train.jsonl"
    p.write_text("\n".join(json.dumps({"body": f"text number {i}"}) for i in range(3)))
    calls = []
    real_load = datasets.load_dataset

    def fake_load(name, split, streaming=False):  # the hub is unreachable here: serve local files for the id
        calls.append((name, split, streaming))
        return real_load("json", data_files=str(p), split=split, streaming=streaming)

    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    raw, kind, _ = D.load_text("someorg/somecorpus", text_field="body")
    assert kind == "hub" and raw["text"] == ["text number 0", "text number 1", "text number 2"]
    streamed, _, _ = D.load_text("someorg/somecorpus", text_field="body", streaming=True)
    assert [r["text"] for r in streamed] == raw["text"]
    assert calls == [("someorg/somecorpus", "train", False), ("someorg/somecorpus", "train", True)]
    with pytest.raises(ValueError, match=r"has no column 'text' \(columns: body\)"):
        D.load_text("someorg/somecorpus")


def test_unknown_hub_id_offline_is_one_line():
    with pytest.raises(ValueError, match=r"dataset 'nobody-llmeff/no-such-corpus' could not be loaded with "
                                         r"datasets.load_dataset \(.*\); accepted:"):
        D.load_text("nobody-llmeff/no-such-corpus")


def test_epoch_order_is_deterministic_and_changes_per_epoch():
    assert D.epoch_order(10, 0, 1) == D.epoch_order(10, 0, 1)
    assert D.epoch_order(10, 0, 1) != D.epoch_order(10, 1, 1)
    assert sorted(D.epoch_order(10, 2, 1)) == list(range(10))


def test_validation_scores_a_fixed_subset_of_blocks(cache):
    from accelerate import Accelerator
    from transformers import LlamaForCausalLM

    from mlflow_llmeff.train.evaluate import validation_loss
    from mlflow_llmeff.models.build import load_config

    torch.manual_seed(0)
    model = LlamaForCausalLM(load_config("llama-tiny"))
    data = D.prepare_data("python-docs", load_tokenizer("llama-tiny"), 32, val_fraction=0.05, seed=0, cache_dir=cache)
    assert len(data.val) > 4
    acc = Accelerator(cpu=True)
    got = validation_loss(acc, model, data.val, 2, 1, 0, blocks=4)
    with torch.no_grad():  # packed blocks, no padding: 31 loss tokens each, so the mean of the 4 losses
        want = sum(float(model(**data.val[i:i + 1]).loss) for i in range(4)) / 4
    assert got == pytest.approx(want, rel=1e-5)
    assert validation_loss(acc, model, data.val, 2, 1, 0, blocks=0) != pytest.approx(got)  # 0 = every block


def test_prepare_data_command_fills_the_cache_training_reads(tmp_path, tok, cache):
    from click.testing import CliRunner

    from mlflow_llmeff.cli import main

    p = tmp_path / "a.txt"
    p.write_text("\n\n".join("doc %02d " % i * 4 for i in range(50)))
    args = ["prepare-data", "--dataset", str(p), "--seq-len", "32", "--data-cache-dir", cache]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    out = r.output[r.output.index(f"{p}: "):]  # after datasets' progress output
    assert out.startswith(f"{p}: 50 documents -> 1,440 tokens in 45 full blocks of seq_len 32; tokenized in")
    assert out.splitlines()[1].startswith(f"cache: {cache}{os.sep}")
    got = json.loads(CliRunner().invoke(main, args + ["--json"]).output)
    assert got["cache_hit"] is True and got["tokens"] == 1440 and got["blocks"] == 45
    d = D.prepare_data(str(p), tok, 32, val_fraction=0.1, cache_dir=cache)
    assert d.cache.hit and d.cache.path == got["cache_path"]


def test_two_tokenizing_workers_give_the_same_blocks_as_one(tmp_path, tok):
    p = tmp_path / "a.jsonl"
    p.write_text("\n".join(json.dumps({"text": f"doc {i} " * (1 + i % 5)}) for i in range(2200)))
    one = D.tokenize_to_cache(str(p), tok, 16, cache_dir=str(tmp_path / "c1"), num_proc=1)
    two = D.tokenize_to_cache(str(p), tok, 16, cache_dir=str(tmp_path / "c2"), num_proc=2)
    assert len(two.meta["files"]) == 2 and two.blocks == one.blocks
    assert two.load()["input_ids"] == one.load()["input_ids"]


def test_one_file_given_by_two_paths_is_one_dataset_condition(tmp_path, monkeypatch):
    # a trial's ../shared/data/... and /work/shared/data/... of one file made two configurations in compare
    from mlflow_llmeff.train.data import dataset_label

    (tmp_path / "corpus").mkdir()
    f = tmp_path / "corpus" / "text.txt"
    f.write_text("hello\n")
    (tmp_path / "link").symlink_to(tmp_path / "corpus")
    monkeypatch.chdir(tmp_path / "corpus")
    assert dataset_label("text.txt") == dataset_label(str(f)) == dataset_label(str(tmp_path / "link" / "text.txt")) \
        == str(f.resolve())
    assert dataset_label("synthetic") == "synthetic" and dataset_label("python-docs") == "python-docs"
    assert dataset_label("roneneldan/TinyStories") == "roneneldan/TinyStories"


@pytest.mark.parametrize("dataset", ["synthetic", "text"])
def test_full_blocks_are_gathered_from_the_columns_views_exactly_as_datasets_reads_them(tok, tmp_path, cache, dataset):
    if dataset == "text":
        p = tmp_path / "a.txt"
        p.write_text("".join(chr(0x20 + i % 90) for i in range(400)))
        dataset = str(p)
    d = D.prepare_data(dataset, tok, 8, packing=True, val_fraction=0.0, cache_dir=cache, synthetic_blocks=20,
                       vocab_size=259)
    blocks = d.train
    assert blocks._chunks is not None  # every row holds seq_len ids: numpy views of the Arrow column
    idx = [7, 0, 3, 3, 11]
    fast = blocks.__getitems__(idx)
    blocks._chunks = None  # the datasets path
    slow = blocks.__getitems__(idx)
    assert fast.keys() == slow.keys()
    for k in slow:
        assert fast[k].dtype == slow[k].dtype == torch.int64 and torch.equal(fast[k], slow[k])


def test_padded_rows_keep_the_datasets_path(tok, tmp_path, cache):
    p = tmp_path / "a.txt"
    p.write_text("\x07\x07\n\n" + "\x08" * 9)
    d = D.prepare_data(str(p), tok, 5, packing=False, val_fraction=0.0, cache_dir=cache)
    assert d.train._chunks is None  # rows of 3 and 5 ids: not full blocks
