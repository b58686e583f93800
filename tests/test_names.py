import pathlib
import re

import pytest

from mlflow_llmeff import names
from mlflow_llmeff.tracking.keys import safe_key


def test_docs_metrics_md_is_generated_from_names():
    doc = pathlib.Path(__file__).parents[1] / "docs" / "metrics.md"
    assert doc.read_text() == names.render_docs()


def test_every_key_is_accepted_by_mlflow_and_unique():
    keys = [d.key for d in names.METRICS] + [d.key for d in names.TAGS]
    assert len(keys) == len(set(keys))
    assert all(re.fullmatch(r"[A-Za-z0-9_\-./ ]+", k) for k in keys)


def test_metrics_md_keys_from_the_standard_are_present():
    std = {"train/loss", "train/tokens", "throughput/device/mfu", "summary/usd_per_billion_tokens",
           "summary/badput_lost_progress_s", "energy/j_per_token", "carbon/total_kg_co2e", "eval/hellaswag/acc_norm"}
    assert std <= {d.key for d in names.METRICS}


def test_target_key_keeps_the_value_verbatim():
    assert names.target_key("hellaswag/acc_norm", ">=", "0.30", safe_key) == "hellaswag_acc_norm_ge_0.30"
    assert names.target_key("val_loss", "<=", "1.8", safe_key) == "val_loss_le_1.8"


def test_target_key_is_always_a_key_mlflow_accepts():
    from mlflow_llmeff.tracking.keys import key_accepted

    assert names.target_key("val_loss", "<=", "-1.5", safe_key) == "val_loss_le_-1.5"
    assert names.target_key("val_loss", "<=", "+9.5", safe_key) == "val_loss_le_plus_9.5"  # parse_targets drops the '+' first
    assert key_accepted(names.target_key("mmlu_high_school_physics/acc", ">=", "1e-3", safe_key))


def test_target_key_rejects_other_operators():
    with pytest.raises(ValueError, match=r"^target operator '>' is not accepted; use '>=' or '<='$"):
        names.target_key("val_loss", ">", "1", safe_key)


def test_every_tag_is_an_llmeff_key_documented_with_its_meaning():
    # METRICS.md: tags are provenance under the llmeff. prefix; a reader finds each one's meaning in the docs
    doc = names.render_docs()
    for d in names.TAGS:
        assert d.key.startswith("llmeff.") and d.meaning, d.key
        assert f"| `{d.key}` | {d.meaning} |" in doc, d.key
    for d in names.METRICS:
        assert f"| `{d.key}` | {d.unit} | {d.meaning} |" in doc, d.key


def test_the_logger_reports_what_it_changed_under_the_documented_warnings_tag(tracking_uri):
    # what names.LOGGING_WARNINGS is for: the tag the run logger writes its renames to, documented in the docs
    import mlflow

    from mlflow_llmeff.tracking.logger import RunLogger

    client = mlflow.MlflowClient()
    run_id = client.create_run(client.create_experiment("names")).info.run_id
    log = RunLogger(run_id)
    log.log_metrics({"mfu(%)": 41.0}, 1)
    log.close()
    tags = client.get_run(run_id).data.tags
    assert tags[names.LOGGING_WARNINGS] == "metric 'mfu(%)' renamed to 'mfu_pct'"
    assert f"| `{names.LOGGING_WARNINGS}` |" in names.render_docs()
