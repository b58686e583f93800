"""What a training run leaves for the MLflow UI: the per-run efficiency report, the dataset input, the run link."""

from __future__ import annotations

import json

import mlflow
import pytest

from mlflow_llmeff import names
from mlflow_llmeff.monitor.meter import EfficiencyMonitor
from mlflow_llmeff.tracking.runs import run_url_line
from mlflow_llmeff.testing import FakeClock, FakeEnergyMeter


def _artifacts(client, run_id, path=None):
    return sorted(a.path for a in client.list_artifacts(run_id, path))


def test_monitor_logs_the_efficiency_report_at_the_end(tracking_uri):
    clock = FakeClock()
    with EfficiencyMonitor(log_every_n_steps=2, warmup_steps=1, measure_energy="none", clock=clock,
                           measure_peak=False) as mon:
        for _ in range(6):
            clock.t += 0.5  # 100 tokens per 0.5 s step
            mon.step(tokens=100, samples=1, loss=2.0)
    client = mlflow.MlflowClient()
    assert _artifacts(client, mon.run_id) == ["efficiency", "efficiency_report.json", "efficiency_summary.json"]
    assert _artifacts(client, mon.run_id, "efficiency") == ["efficiency/loss_tokens.png",
                                                            "efficiency/throughput_mfu.png"]
    report = mlflow.artifacts.load_dict(f"runs:/{mon.run_id}/efficiency_report.json")
    # steps 2..6 are steady state: 500 tokens in 2.5 s
    assert report["summary"][names.SUM_TOKENS_PER_SEC] == {"value": 200.0, "unit": "tokens/s",
                                                           "meaning": "steady-state global non-padding tokens/s"}
    assert report["conditions"][names.PRECISION] == "fp32"
    assert report["formulas"][names.SUM_TOKENS_PER_SEC]["source"].startswith("docs/time.md")
    # sources that ship with the package's repository or papers, never a path outside it
    assert not [f["source"] for f in report["formulas"].values() if "../" in f["source"] or "shared/" in f["source"]]
    assert names.REPORT_WARNING not in client.get_run(mon.run_id).data.tags


def test_measured_power_gets_its_figure(tracking_uri):

    clock = FakeClock()
    with EfficiencyMonitor(log_every_n_steps=2, warmup_steps=1, energy_meter=FakeEnergyMeter(300.0, clock=clock),
                           clock=clock, measure_peak=False) as mon:
        for _ in range(4):
            clock.t += 1.0
            mon.step(tokens=100, samples=1)
    client = mlflow.MlflowClient()
    assert "efficiency/power.png" in _artifacts(client, mon.run_id, "efficiency")
    report = mlflow.artifacts.load_dict(f"runs:/{mon.run_id}/efficiency_report.json")
    # 300 W for 4 s of one device = 1200 J = 1200 / 3.6e6 kWh
    assert report["summary"][names.SUM_ENERGY_KWH]["value"] == pytest.approx(1200 / 3.6e6)
    assert report["summary"][names.SUM_ENERGY_KWH]["unit"] == "kWh"


def test_report_failure_is_a_warning_tag_not_an_error(tracking_uri, monkeypatch):
    from mlflow_llmeff.tracking import run_report

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(run_report, "build_report_dict", boom)
    with EfficiencyMonitor(log_every_n_steps=1, warmup_steps=0, measure_energy="none", measure_peak=False) as mon:
        mon.step(tokens=10, samples=1)
    run = mlflow.MlflowClient().get_run(mon.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.tags[names.REPORT_WARNING] == "efficiency report not (fully) logged: OSError: disk full"


@pytest.mark.parametrize("uri, expected", [
    # workflowType=machine_learning: a fresh browser opens the run as a training run, not under GenAI "Evaluations"
    ("http://127.0.0.1:5000", "view run at http://127.0.0.1:5000/#/experiments/3/runs/abc?workflowType=machine_learning"),
    ("sqlite:////data/m.db", "view run: mlflow ui --backend-store-uri sqlite:////data/m.db then open "
                             "http://127.0.0.1:5000/#/experiments/3/runs/abc?workflowType=machine_learning"),
    # a store's path with a space is one shell word
    ("sqlite:////tmp/my runs/m.db", "view run: mlflow ui --backend-store-uri 'sqlite:////tmp/my runs/m.db' then open "
                                    "http://127.0.0.1:5000/#/experiments/3/runs/abc?workflowType=machine_learning"),
    # a credential in the URI is never printed: a server's address loses its user-info, a store's URI is not printed
    ("https://alice:s3cret@mlflow.example.com", "view run at https://mlflow.example.com/#/experiments/3/runs/abc?"
                                                "workflowType=machine_learning"),
    ("postgresql://alice:s3cret@db:5432/mlflow", "view run: mlflow ui --backend-store-uri <this store's URI: not "
                                                 "printed, it holds a credential> then open http://127.0.0.1:5000/#/"
                                                 "experiments/3/runs/abc?workflowType=machine_learning"),
])
def test_run_link_opens_the_training_runs_view(uri, expected):
    assert run_url_line(uri, "3", "abc") == expected


def test_a_relative_local_store_is_printed_by_its_absolute_path(tmp_path, monkeypatch):
    # a trial's printed sqlite:///mlflow.db opened an empty store from any other folder
    from mlflow_llmeff.tracking.redact import absolute_store

    monkeypatch.chdir(tmp_path)
    assert run_url_line("sqlite:///mlflow.db", "3", "abc").startswith(
        f"view run: mlflow ui --backend-store-uri sqlite:///{tmp_path}/mlflow.db then open ")
    assert absolute_store("sqlite:///runs/../m.db?timeout=5", cwd="/srv/a") == "sqlite:////srv/a/m.db?timeout=5"
    assert absolute_store("mlruns", cwd="/srv/a") == "/srv/a/mlruns"
    for kept in ("sqlite:////abs/m.db", "sqlite:///:memory:", "http://h:5000", "databricks", "file:///x/mlruns"):
        assert absolute_store(kept, cwd="/srv/a") == kept


def test_training_run_has_a_dataset_input_distinct_names_and_the_run_link(tracking_uri, capsys):
    from mlflow_llmeff.train.config import TrainConfig
    from mlflow_llmeff.train.loop import run_training

    cfg = dict(seq_len=32, micro_batch_size=2, max_steps=3, log_every_n_steps=1, warmup_steps=1, val_blocks=2,
               measure_energy="none")
    first = run_training(TrainConfig(**cfg))
    second = run_training(TrainConfig(**cfg))
    client = mlflow.MlflowClient()
    r1, r2 = client.get_run(first["run_id"]), client.get_run(second["run_id"])
    assert r1.info.run_name == "tiny-fp32-gbt64-s32-cpu"
    assert r2.info.run_name == "tiny-fp32-gbt64-s32-cpu-2"  # everything else equal: a repeat index
    (inp,) = r1.inputs.dataset_inputs
    assert inp.dataset.name == "python-docs" and len(inp.dataset.digest) == 16
    assert {t.key: t.value for t in inp.tags}["mlflow.data.context"] == "training"
    profile = json.loads(inp.dataset.profile)
    assert profile["seq_len"] == 32 and profile["train_blocks"] > 0
    assert profile["train_tokens"] == profile["train_blocks"] * 32  # packed: no padding
    assert r2.inputs.dataset_inputs[0].dataset.digest == inp.dataset.digest  # same data, same digest
    out = capsys.readouterr().out
    assert f"/#/experiments/{r1.info.experiment_id}/runs/{first['run_id']}?workflowType=machine_learning" in out
    assert r1.data.tags[names.EVAL_BATCH_SIZE] == "2"
    assert "efficiency_report.json" in _artifacts(client, first["run_id"])


@pytest.mark.parametrize("kind", ["text_file", "hub", "synthetic"])
def test_dataset_input_source_names_where_the_data_came_from(tmp_path, kind):
    import torch

    import datasets

    from mlflow_llmeff.train.data import PreparedData, TokenBlocks
    from mlflow_llmeff.train.dataset_input import training_dataset

    rows = [list(range(0, 8)), list(range(8, 16)), list(range(16, 22))]  # the last row padded: 22 real tokens

    def prepared(rows):
        return PreparedData(TokenBlocks(datasets.Dataset.from_dict({"input_ids": rows}), 8, 0), None, kind, "")

    data = prepared(rows)
    path = tmp_path / "docs.txt"
    path.write_text("x")
    dataset = {"text_file": str(path), "hub": "org/corpus", "synthetic": "synthetic"}[kind]
    ds = training_dataset(dataset, data, seq_len=8, packing=False)
    entity = ds._to_mlflow_entity()
    assert json.loads(entity.profile) == {"train_tokens": 22, "train_blocks": 3, "val_blocks": 0, "seq_len": 8,
                                          "packing": False, "kind": kind}
    if kind == "text_file":
        assert entity.name == "docs.txt" and json.loads(entity.source) == {"uri": str(path)}
    elif kind == "hub":
        assert entity.name == "org/corpus" and json.loads(entity.source)["path"] == "org/corpus"
    else:
        assert entity.source_type == "code" and entity.name == "synthetic"
    # the digest follows the tokens: another block changes it
    rows2 = [[99] + rows[0][1:]] + rows[1:]
    assert training_dataset(dataset, prepared(rows2), 8, False).digest != ds.digest


def test_dataset_digest_of_large_data_reads_blocks_in_storage_order(monkeypatch):
    import hashlib

    import datasets
    import numpy as np

    from mlflow_llmeff.train import dataset_input
    from mlflow_llmeff.train.data import PreparedData, TokenBlocks

    table = datasets.Dataset.from_dict({"input_ids": [[10 * r + c for c in range(4)] for r in range(6)]})
    monkeypatch.setattr(dataset_input, "DIGEST_TOKENS", 8)  # 2 blocks of 4 tokens are hashed
    read = []
    real = TokenBlocks.__getitems__
    monkeypatch.setattr(TokenBlocks, "__getitems__", lambda self, idx: read.append(self.rows[idx].tolist()) or real(self, idx))
    train = TokenBlocks(table, 4, 0, rows=np.array([5, 3, 0, 1, 4]))  # a shuffled split: block 2 held out
    ds = dataset_input.training_dataset("synthetic", PreparedData(train, None, "synthetic", ""), 4, True)
    # the training order would touch blocks 5 and 3 (pages all over a memory-mapped cache); storage
    # order reads blocks 0 and 1, one contiguous range
    assert read == [[0, 1]]
    h = hashlib.sha256(repr((5, 4)).encode())
    h.update(np.array([[0, 1, 2, 3], [10, 11, 12, 13]], dtype=np.int64).tobytes())
    assert ds.digest == h.hexdigest()[:16]
    assert json.loads(ds._to_mlflow_entity().profile)["train_tokens"] == 5 * 4
