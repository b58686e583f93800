"""Time-to-quality target parsing and testing."""

from __future__ import annotations

import math
import re

import pytest

from mlflow_llmeff.evals.targets import Target, canonical_value, parse_targets


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
    ("hellaswag/acc_norm>0.3", "target 'hellaswag/acc_norm>0.3' is not accepted; write metric=value"),
    ("acc>=0.3", "target 'acc>=0.3' names unknown metric 'acc'; .*hellaswag/acc_norm"),
    ("mmlu_cooking/acc>=0.3", "unknown metric 'mmlu_cooking/acc'"),
    ("val_loss<=low", "non-numeric value 'low'"),
    ("val_loss<=1,val_loss<=1", "given twice"),
])
def test_bad_targets_are_named(spec, match):
    with pytest.raises(ValueError, match=match):
        parse_targets(spec)


@pytest.mark.parametrize("written,threshold,text,key", [
    ("0.30", 0.30, "0.30", "val_loss_le_0.30"),  # trailing zero kept as written
    ("+9.5", 9.5, "9.5", "val_loss_le_9.5"),  # leading '+' dropped (MLflow refuses '+')
    ("-1.5", -1.5, "-1.5", "val_loss_le_-1.5"),
    ("2", 2.0, "2", "val_loss_le_2"),
    (".5", 0.5, "0.5", "val_loss_le_0.5"),  # leading-dot fraction gets its zero
    ("-.5", -0.5, "-0.5", "val_loss_le_-0.5"),
    ("1e-3", 1e-3, "1e-3", "val_loss_le_1e-3"),
    ("1e+3", 1e3, "1e3", "val_loss_le_1e3"),  # exponent '+' dropped
    ("2E+1", 20.0, "2E1", "val_loss_le_2E1"),
    ("+1.25e-2", 0.0125, "1.25e-2", "val_loss_le_1.25e-2"),
])
def test_plain_decimal_values_are_accepted_in_canonical_form(written, threshold, text, key):
    (t,) = parse_targets(f"val_loss<={written}")
    assert (t.threshold, t.text, t.key, str(t)) == (threshold, text, key, f"val_loss<={text}")


@pytest.mark.parametrize("written", ["inf", "-inf", "nan", "NaN", "Infinity", "1_000", "0x10", "1.", "1e", "e3",
                                     "+-1", "--1", "1.2.3", "١", "0b1", "5%"])
def test_values_that_are_not_plain_decimal_numbers_are_rejected(written):
    with pytest.raises(ValueError, match=rf"^target 'val_loss<={re.escape(written)}' has non-numeric value "
                                         rf"'{re.escape(written)}'; write metric=value \(<= for a loss or perplexity, >= for an accuracy\), "
                                         r"metric>=value or metric<=value with value "
                                         r"a plain decimal number"):
        parse_targets(f"val_loss<={written}")


def test_an_empty_value_is_rejected():
    with pytest.raises(ValueError, match=r"^target 'val_loss<=' is not accepted; write metric=value"):
        parse_targets("val_loss<=")


def test_a_value_beyond_the_float_range_is_rejected():
    with pytest.raises(ValueError, match=r"^target 'val_loss<=1e999' has value '1e999' beyond the float range; write"):
        parse_targets("val_loss<=1e999")


def test_the_same_number_written_two_ways_is_given_twice():
    with pytest.raises(ValueError, match="target 'val_loss<=9.5' is given twice"):
        parse_targets("val_loss<=+9.5,val_loss<=9.5")


def test_canonical_value_rejects_what_is_not_a_plain_decimal():
    assert canonical_value("+1e+3") == "1e3"
    with pytest.raises(ValueError, match=r"^threshold 'inf' is not a plain decimal number; write e.g. 0.30"):
        canonical_value("inf")


def test_case_a_every_target_key_is_accepted_by_mlflow():
    from mlflow_llmeff.tracking.keys import key_accepted

    t = parse_targets("val_loss<=+9.5")[0]
    keys = [*t.metric_keys().values(), t.not_reached_tag]
    assert keys[0] == "ttq/val_loss_le_9.5_wall_s" and t.not_reached_tag == "llmeff.ttq.val_loss_le_9.5"
    assert all(key_accepted(k) for k in keys)


# llmeff study --target's 'metric=value': the operator from the metric
@pytest.mark.parametrize("spec, op", [("val_loss=3.0", "<="), ("val_perplexity=20", "<="), ("mmlu/acc=0.3", ">="),
                                      ("hellaswag/acc_norm=0.3", ">="), ("mmlu_anatomy/acc=0.4", ">=")])
def test_the_equals_form_reads_a_loss_as_at_most_and_an_accuracy_as_at_least(spec, op):
    t, = parse_targets(spec, equals=True)
    assert t.op == op and str(t) == spec.replace("=", op)


def test_one_grammar_everywhere_and_the_equals_form_refused_where_the_direction_is_unknown():
    # a trial: llmeff study --target val_loss=3.0 was accepted where llmeff train --targets val_loss=3.0 was refused
    assert [str(t) for t in parse_targets("val_loss=3.0")] == ["val_loss<=3.0"]  # llmeff train --targets
    assert [str(t) for t in parse_targets("hellaswag/acc_norm=0.3", any_metric=True)] == ["hellaswag/acc_norm>=0.3"]
    with pytest.raises(ValueError, match=r"^target 'val_loss=3.0' is not accepted; write metric>=value"):
        parse_targets("val_loss=3.0", equals=False)
    with pytest.raises(ValueError, match=r"^target metric 'bleu' is unknown, so 'metric=value' cannot say whether "
                                         r"to reach it from above or below; write metric=value"):
        parse_targets("bleu=0.3", equals=True)
    # an error quotes the target as written, and where metric=value is accepted it says so (a trial's
    # '--target val_loss=abc' was quoted as 'val_loss<=abc' with only the >= and <= forms named)
    equals_form = ("write metric=value (<= for a loss or perplexity, >= for an accuracy), metric>=value or "
                   "metric<=value with value a plain decimal number")
    for spec, why in (("val_loss=abc", "has non-numeric value 'abc'"), ("val_loss=1e999", "has value '1e999' beyond "
                      "the float range"), ("mmlu/acc", "is not accepted"), ("val_loss=3,val_loss<=3", "is given twice")):
        with pytest.raises(ValueError) as e:
            parse_targets(spec, equals=True)
        given = spec.split(",")[-1] if "twice" in why else spec
        assert str(e.value).startswith(f"target '{given}' {why}; {equals_form}"), str(e.value)
    with pytest.raises(ValueError, match=r"^target metric 'bleu' is unknown, .*; write metric=value \(<= for a loss"):
        parse_targets("bleu=0.3", equals=True)
