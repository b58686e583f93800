"""MMLU/HellaSwag prompts, data loading, evaluate(), MLflow logging and the `llmeff eval` command."""

from __future__ import annotations

import json
import math

import pytest
import torch
import transformers
from click.testing import CliRunner

from mlflow_llmeff import names
from mlflow_llmeff.evals import data, evaluate, hellaswag, log_to_mlflow, mmlu

from eval_fixtures import eval_fixture_dir

FIX = eval_fixture_dir()  # invented documents in the release layout, written to a temp folder
LN = math.log(259)  # a uniform model gives every byte token -ln(259)


@pytest.fixture(scope="module")
def tok():
    return transformers.ByT5Tokenizer(extra_ids=0)


@pytest.fixture(scope="module")
def uniform():
    """A Llama with every weight zero: logits 0, so each token has log-prob -ln(259)."""
    cfg = transformers.LlamaConfig(vocab_size=259, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=4096)
    m = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.zero_()
    return m


@pytest.fixture(scope="module")
def random_llama():
    torch.manual_seed(1)
    cfg = transformers.LlamaConfig(vocab_size=259, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    return transformers.LlamaForCausalLM(cfg).eval()


def test_mmlu_zero_shot_prompt():
    doc = data.load_mmlu(FIX, "abstract_algebra", "test")[2]
    assert mmlu.context(doc, []) == (
        "The following are multiple choice questions (with answers) about abstract algebra.\n\n"
        "How many subgroups does Z_2 have?\nA. 1\nB. 2\nC. 3\nD. 4\nAnswer:")
    assert [c for _, c in mmlu.requests(doc, [])] == [" A", " B", " C", " D"]


def test_mmlu_five_shot_prompt_uses_first_dev_rows():
    dev = data.load_mmlu(FIX, "anatomy", "dev")
    doc = data.load_mmlu(FIX, "anatomy", "test")[0]
    ctx = mmlu.context(doc, dev[:2])
    assert ctx == ("The following are multiple choice questions (with answers) about anatomy.\n\n"
                   "Which organ pumps blood?\nA. lung\nB. heart\nC. liver\nD. kidney\nAnswer: B\n\n"
                   "How many chambers has the human heart?\nA. two\nB. three\nC. four\nD. five\nAnswer: C\n\n"
                   "Which organ filters blood?\nA. heart\nB. kidney\nC. stomach\nD. skin\nAnswer:")


def test_mmlu_csv_quotes_and_answers():
    docs = data.load_mmlu(FIX, "abstract_algebra", "test")
    assert docs[1] == {"question": "Is Z_7 a field, yes or no?", "subject": "abstract_algebra",
                       "choices": ["yes", "no", "only for odd n, not here", "it depends"], "answer": 0}


def test_hellaswag_preprocessing():
    raw = data.load_hellaswag(FIX)
    assert hellaswag.process_doc(raw[1]) == {
        "query": "Tying shoes: How to tie shoes. Cross the laces. Pull the ends",
        "choices": ["tight and make a loop.", "into the sky.", " apart and walk away.", "sideways."],
        "gold": 0}
    assert hellaswag.process_doc(raw[2])["query"] == "Running: A man runs on a track."
    assert hellaswag.process_doc(raw[2])["gold"] == 1


def test_acc_norm_divides_by_characters():
    assert hellaswag.predictions([-10.0, -12.0], ["abcde", "abcdefghij"]) == (0, 1)


def test_mmlu_group_acc_is_weighted_by_size():
    assert mmlu.aggregate_acc({"a": (1.0, 3), "b": (0.0, 1)}) == 0.75


def test_evaluate_on_uniform_model_gives_hand_computed_numbers(uniform, tok):
    r = evaluate(uniform, tok, "mmlu_abstract_algebra,mmlu_anatomy,hellaswag", data_dir=FIX)
    # MMLU: all four choices tie (2 bytes each) -> first choice 'A': algebra answers B,A,B; anatomy B,B
    assert r.metrics["mmlu_abstract_algebra/acc"] == pytest.approx(1 / 3)
    assert r.metrics["mmlu_anatomy/acc"] == 0.0
    assert "mmlu/acc" not in r.metrics  # subjects asked for one by one: no group
    # HellaSwag: ll = -(1 + bytes of ending) ln 259 -> acc picks the shortest ending, acc_norm the longest
    # doc 0: shortest 1, longest 0, gold 2; doc 1: shortest 3, longest 0, gold 0; doc 2: shortest 0 (tie), longest 3, gold 1
    assert r.metrics["hellaswag/acc"] == 0.0
    assert r.metrics["hellaswag/acc_norm"] == pytest.approx(1 / 3)
    hs = [e for e in r.examples if e["task"] == "hellaswag"]
    assert [(e["pred"], e["pred_norm"]) for e in hs] == [(1, 0), (3, 0), (0, 3)]
    assert hs[0]["logliks"][0] == pytest.approx(-37 * LN, abs=1e-4)  # " throws the kettle out of the window."
    assert r.examples[0] == {"task": "mmlu_abstract_algebra", "doc_index": 0, "logliks": pytest.approx([-2 * LN] * 4),
                             "gold": 1, "pred": 0, "correct": False}


def test_batch_size_1_and_8_same_example_logliks(random_llama, tok):
    kw = dict(data_dir=FIX, num_fewshot=5)
    a = evaluate(random_llama, tok, "mmlu_abstract_algebra,mmlu_anatomy", batch_size=1, **kw)
    b = evaluate(random_llama, tok, "mmlu_abstract_algebra,mmlu_anatomy", batch_size=8, **kw)
    c = evaluate(random_llama, tok, "hellaswag", batch_size=1, data_dir=FIX)
    d = evaluate(random_llama, tok, "hellaswag", batch_size=8, data_dir=FIX)
    for x, y in ((a, b), (c, d)):
        assert max(abs(p - q) for e, f in zip(x.examples, y.examples) for p, q in zip(e["logliks"], f["logliks"])) < 1e-5
        assert x.metrics == y.metrics


def test_limit_takes_first_documents(uniform, tok):
    r = evaluate(uniform, tok, ["mmlu_abstract_algebra"], data_dir=FIX, limit=2)
    assert [e["doc_index"] for e in r.examples] == [0, 1] and r.counts == {"mmlu_abstract_algebra": 2}


def test_training_mode_is_restored(uniform, tok):
    uniform.train()
    evaluate(uniform, tok, "mmlu_anatomy", data_dir=FIX, limit=1)
    assert uniform.training
    uniform.eval()


def test_missing_file_names_file_and_layout(uniform, tok, tmp_path):
    with pytest.raises(ValueError, match=r"mmlu/test/anatomy_test.csv: file not found; expected layout: .*mmlu/dev/"):
        evaluate(uniform, tok, "mmlu_anatomy", data_dir=str(tmp_path))


def test_mmlu_group_needs_every_subject(uniform, tok):
    with pytest.raises(ValueError, match="anatomy|astronomy|abstract_algebra"):
        evaluate(uniform, tok, "mmlu", data_dir=FIX)


def test_malformed_csv_row_is_named(tmp_path):
    (tmp_path / "mmlu" / "test").mkdir(parents=True)
    (tmp_path / "mmlu" / "test" / "anatomy_test.csv").write_text("q,a,b,c,d,A\nonly,three,cols\n")
    with pytest.raises(ValueError, match=r"anatomy_test.csv: row 2 is malformed"):
        data.load_mmlu(str(tmp_path), "anatomy", "test")


def test_malformed_hellaswag_line_is_named(tmp_path):
    (tmp_path / "hellaswag").mkdir()
    (tmp_path / "hellaswag" / "hellaswag_val.jsonl").write_text('{"ctx_a": "x"}\n')
    with pytest.raises(ValueError, match=r"hellaswag_val.jsonl: line 1 is malformed.*expected layout"):
        data.load_hellaswag(str(tmp_path))


def test_unknown_task_lists_accepted(uniform, tok):
    with pytest.raises(ValueError, match="task 'arc' is not accepted; use mmlu, hellaswag or mmlu_<subject>"):
        evaluate(uniform, tok, "arc", data_dir=FIX)


def test_hellaswag_fewshot_is_rejected(uniform, tok):
    with pytest.raises(ValueError, match="num_fewshot 5 is not accepted"):
        evaluate(uniform, tok, "hellaswag", data_dir=FIX, num_fewshot=5)


def test_data_dir_from_env(monkeypatch):
    monkeypatch.setenv(data.DATA_DIR_ENV, "/some/where")
    assert data.resolve_data_dir() == "/some/where"
    monkeypatch.delenv(data.DATA_DIR_ENV)
    assert data.resolve_data_dir() == data.HUB  # no folder beside the repository: the hub datasets
    assert data.resolve_data_dir("") == data.HUB and data.resolve_data_dir("/d") == "/d"


def test_logs_standard_keys_to_active_run(uniform, tok, tracking_uri):
    import mlflow

    r = evaluate(uniform, tok, "hellaswag", data_dir=FIX)
    with mlflow.start_run() as run:
        assert log_to_mlflow(r, step=7)
    got = mlflow.get_run(run.info.run_id).data.metrics
    assert got == {names.EVAL_HELLASWAG_ACC: 0.0, names.EVAL_HELLASWAG_ACC_NORM: pytest.approx(1 / 3)}
    assert not log_to_mlflow(r)  # no active run


def test_cli_eval_prints_table_and_writes_json(uniform, tok, tmp_path, tracking_uri):
    from mlflow_llmeff.cli import main

    uniform.save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    out = tmp_path / "eval.json"
    res = CliRunner().invoke(main, ["eval", "--model", str(tmp_path / "model"), "--tasks", "mmlu_anatomy,hellaswag",
                                    "--data-dir", FIX, "--batch-size", "2", "--device", "cpu",
                                    "--output-json", str(out)])
    assert res.exit_code == 0, res.output
    assert "hellaswag/acc_norm" in res.output and "0.3333" in res.output
    js = json.loads(out.read_text())
    assert js["metrics"]["mmlu_anatomy/acc"] == 0.0 and len(js["examples"]) == 5
    assert set(js["examples"][0]) == {"task", "doc_index", "logliks", "gold", "pred", "correct"}
    assert "not logged to MLflow: no active run" in res.output  # said, not silently skipped


def test_cli_eval_subset_seed_scores_the_documents_a_training_run_scored(uniform, tok, tmp_path, shared_data):
    # the trial: in-training evals score a seeded subset (--eval-limit, --seed), llmeff eval the first
    # N; --subset-seed gives the training run's documents: random.Random(1234).sample(range(10042), 3)
    from mlflow_llmeff.cli import main
    from mlflow_llmeff.evals.api import eval_documents

    uniform.save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    out = tmp_path / "eval.json"
    args = ["eval", "--model", str(tmp_path / "model"), "--tasks", "hellaswag", "--data-dir", str(shared_data),
            "--device", "cpu"]
    res = CliRunner().invoke(main, args + ["--limit", "3", "--subset-seed", "1234", "--output-json", str(out)])
    assert res.exit_code == 0, res.output
    assert [e["doc_index"] for e in json.loads(out.read_text())["examples"]] == [122, 1914, 7220]
    assert eval_documents(3, 1234) == "3 drawn with seed 1234" and eval_documents(0, 1234) == "all"
    res = CliRunner().invoke(main, args + ["--subset-seed", "1234"])
    assert res.exit_code == 2 and "--subset-seed 1234 needs --limit N" in res.output


def test_cli_eval_run_id_makes_the_evaluation_the_runs_last_eval_point(uniform, tok, tmp_path, tracking_uri):
    # the trial: a saved model scored after training could not reach its training run's comparison
    import mlflow

    from mlflow_llmeff.cli import main

    client = mlflow.MlflowClient()
    rid = client.create_run("0").info.run_id
    for step in (10, 20):
        client.log_metric(rid, names.TRAIN_TOKENS, step * 1024.0, step=step)
    client.log_metric(rid, names.EVAL_HELLASWAG_ACC_NORM, 0.9, step=20)  # the in-training eval
    client.set_terminated(rid, "FINISHED")
    uniform.save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    args = ["eval", "--model", str(tmp_path / "model"), "--tasks", "hellaswag", "--data-dir", FIX, "--device", "cpu"]
    res = CliRunner().invoke(main, args + ["--run-id", rid])
    assert res.exit_code == 0, res.output
    assert f"logged to run {rid} at step 20" in res.output
    run = client.get_run(rid)
    assert run.data.metrics[names.EVAL_HELLASWAG_ACC_NORM] == pytest.approx(1 / 3)  # the latest value: ours
    points = sorted(client.get_metric_history(rid, names.EVAL_HELLASWAG_ACC_NORM), key=lambda m: m.timestamp)
    assert [(m.step, round(m.value, 4)) for m in points] == [(20, 0.9), (20, 0.3333)]
    assert run.data.tags[names.EVAL_LAST] == "llmeff eval: hellaswag, documents all, 0-shot; logged at step 20"
    assert run.info.status == "FINISHED"
    res = CliRunner().invoke(main, args + ["--run-id", "0123456789abcdef"])
    assert res.exit_code == 2 and "--run-id '0123456789abcdef': no such run" in res.output


def test_cli_eval_bad_data_dir_is_a_usage_error(uniform, tok, tmp_path):
    from mlflow_llmeff.cli import main

    uniform.save_pretrained(tmp_path / "model")
    res = CliRunner().invoke(main, ["eval", "--model", str(tmp_path / "model"), "--tokenizer", "byt5",
                                    "--tasks", "hellaswag", "--data-dir", str(tmp_path)])
    assert res.exit_code == 2 and "hellaswag_val.jsonl: file not found" in res.output


def test_shared_data_loads(shared_data, uniform, tok):
    assert len(data.load_mmlu(str(shared_data), "anatomy", "dev")) == 5
    r = evaluate(uniform, tok, "mmlu_anatomy,hellaswag", data_dir=str(shared_data), num_fewshot=0, limit=3)
    assert r.counts == {"mmlu_anatomy": 3, "hellaswag": 3}


def test_a_progress_bar_counts_the_documents(capsys):
    import torch
    from transformers import LlamaForCausalLM

    from mlflow_llmeff.evals.api import evaluate
    from mlflow_llmeff.models.build import load_config, load_tokenizer

    torch.manual_seed(0)
    model = LlamaForCausalLM(load_config("llama-tiny"))
    evaluate(model, load_tokenizer("llama-tiny"), "hellaswag", data_dir=FIX, progress=True)
    err = capsys.readouterr().err
    assert "eval hellaswag" in err and "3/3" in err  # the fixture's three documents


def test_progress_counts_documents_when_long_ones_are_scored_choice_by_choice(capsys):
    # a 64-position model: the fixture's documents are longer, so each is scored as 4 separate
    # (truncated) choices; the bar still counts 3 documents, as the result does
    import torch
    from transformers import LlamaForCausalLM

    from mlflow_llmeff.evals.api import evaluate
    from mlflow_llmeff.models.build import load_config, load_tokenizer

    torch.manual_seed(0)
    cfg = load_config("llama-tiny")
    cfg.max_position_embeddings = 64
    r = evaluate(LlamaForCausalLM(cfg), load_tokenizer("llama-tiny"), "hellaswag", data_dir=FIX, progress=True)
    err = capsys.readouterr().err
    assert r.counts == {"hellaswag": 3}
    assert "3/3" in err and "12/12" not in err and "/12" not in err
