"""Time-to-quality target parsing and testing."""

from __future__ import annotations

import math

import pytest

from mlflow_llmeff.evals.targets import Target, parse_targets


def test_parse_two_targets():
    ts = parse_targets("val_loss<=1.9, hellaswag/acc_norm>=0.30")
    assert ts == [Target("val_loss", "<=", 1.9, "1.9"), Target("hellaswag/acc_norm", ">=", 0.30, "0.30")]
    assert [t.key for t in ts] == ["val_loss_le_1.9", "hellaswag_acc_norm_ge_0.30"]
    assert ts[1].eval_key == "eval/hellaswag/acc_norm"
    assert ts[1].not_reached_tag == "llmeff.ttq.hellaswag_acc_norm_ge_0.30"
    assert ts[0].metric_keys()["wall_s"] == "ttq/val_loss_le_1.9_wall_s"


@pytest.mark.parametrize("spec,value,reached", [
    ("val_loss<=1.9", 1.9, True), ("val_loss<=1.9", 1.91, False), ("mmlu/acc>=0.35", 0.35, True),
    ("mmlu/acc>=0.35", 0.3499, False), ("mmlu_anatomy/acc>=0.5", 0.6, True), ("hellaswag/acc>=0.3", None, False),
    ("val_loss<=1.9", math.nan, False)])
def test_reached(spec, value, reached):
    assert parse_targets(spec)[0].reached(value) is reached


def test_empty_spec_is_no_target():
    assert parse_targets("") == [] and parse_targets(None) == []


@pytest.mark.parametrize("spec,match", [
    ("hellaswag/acc_norm>0.3", "target 'hellaswag/acc_norm>0.3' is not accepted; write metric>=value"),
    ("acc>=0.3", "target 'acc>=0.3' names unknown metric 'acc'; .*hellaswag/acc_norm"),
    ("mmlu_cooking/acc>=0.3", "unknown metric 'mmlu_cooking/acc'"),
    ("val_loss<=low", "non-numeric value 'low'"),
    ("val_loss<=1,val_loss<=1", "given twice"),
])
def test_bad_targets_are_named(spec, match):
    with pytest.raises(ValueError, match=match):
        parse_targets(spec)
