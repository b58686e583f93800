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


def test_logging_warnings_tag_key():
    assert names.LOGGING_WARNINGS == "llmeff.logging.warnings"
    assert "llmeff.logging.warnings" in {d.key for d in names.TAGS}
