"""MLflow-safe keys and the per-entry checks the logger applies before sending."""

from __future__ import annotations

import hashlib
import math

import numpy as np
import pytest
from mlflow.exceptions import MlflowException
from mlflow.utils.validation import _validate_metric_name, _validate_param_name, _validate_tag_name

from mlflow_llmeff.tracking.keys import check_metric, check_param, check_tag, key_accepted, safe_key


def mlflow_accepts(key: str) -> bool:
    try:
        _validate_metric_name(key), _validate_param_name(key), _validate_tag_name(key)
    except MlflowException:
        return False
    return len(key) <= 250


@pytest.mark.parametrize("key", ["train/loss", "llmeff.model.name", "a b", "summary/badput_data_wait_s",
                                 "eval/mmlu_high_school_physics/acc", "a__b", "_x", "x-y.z", ".hidden", "a/..b"])
def test_keys_mlflow_accepts_are_unchanged(key):
    assert key_accepted(key) and safe_key(key) == key


@pytest.mark.parametrize("text,key", [
    ("mfu(%)", "mfu_pct"), ("cost(%)", "cost_pct"), ("team@lab", "team_at_lab"), ("c++", "c_plus_plus"),
    ("val_loss<=1.9", "val_loss_le_1.9"), ("acc>=0.3", "acc_ge_0.3"), ("a<b", "a_lt_b"), ("a>b", "a_gt_b"),
    ("a=b", "a_eq_b"), ("x[0]", "x_0"), ("a,b", "a_b"), ("tab\there", "tab_here"), ("é@x", "é_at_x"),
    ("a__b%", "a__b_pct"),  # the user's own "__" is kept; only created underscores collapse
    ("_(x)", "_x"), ("ttq/val_loss_le_+9.5_wall_s", "ttq/val_loss_le_plus_9.5_wall_s"),
])
def test_rejected_characters_map_by_the_table(text, key):
    assert not mlflow_accepts(text)
    assert safe_key(text) == key and mlflow_accepts(key)


@pytest.mark.parametrize("text,key", [
    ("a/../b", "a/b"), ("/a", "a"), ("a//b", "a/b"), ("a/", "a"), ("./a", "a"), ("a/./b", "a/b"),
    ("..a", "a"), ("a/(x)/b", "a/x/b"), ("/@/b", "at/b"),
])
def test_path_problems_are_fixed(text, key):
    assert not mlflow_accepts(text)
    assert safe_key(text) == key


@pytest.mark.parametrize("text", ["", ".", "..", "...", "/", "//", "()"])
def test_a_key_that_maps_to_nothing_gets_a_hash_name(text):
    assert safe_key(text) == "key_" + hashlib.sha1(text.encode()).hexdigest()[:8]


def test_over_long_keys_are_cut_to_250_and_stay_distinct():
    a, b = "x" * 300 + "a", "x" * 300 + "b"
    ka, kb = safe_key(a), safe_key(b)
    assert len(ka) == len(kb) == 250 and ka != kb
    assert ka == "x" * 241 + "_" + hashlib.sha1(a.encode()).hexdigest()[:8]
    assert mlflow_accepts(ka) and mlflow_accepts(kb)


def test_a_key_the_mapping_makes_too_long_is_cut_too():
    key = safe_key("@" * 100)  # 100 * "_at_" collapsed: 299 characters before the cut
    assert len(key) == 250 and key.startswith("at_at_") and mlflow_accepts(key)


@pytest.mark.parametrize("text", ["mfu(%)", "a/../b", "", "x" * 300, "@" * 100, "a/" + "." * 300, "/a b/@/c%",
                                  "val_loss<=+9.5", "a\x00b"])
def test_safe_key_is_idempotent_and_never_empty(text):
    key = safe_key(text)
    assert key and mlflow_accepts(key) and safe_key(key) == key


def test_check_metric_renames_and_says_so():
    assert check_metric("mfu(%)", 0.41, 3) == ("mfu_pct", 0.41, ("metric 'mfu(%)' renamed to 'mfu_pct'",))


@pytest.mark.parametrize("value,kind", [(None, "NoneType"), ("0.5", "str"), (True, "bool"), (b"1", "bytes"),
                                        (1 + 2j, "complex"), ([1.0], "list")])
def test_check_metric_drops_values_that_are_not_real_numbers(value, kind):
    assert check_metric("train/loss", value, 1) == (
        None, None, (f"metric 'train/loss' dropped: value of type {kind} is not a real number",))


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_check_metric_passes_nan_and_inf(value):
    key, out, problems = check_metric("train/loss", value, 1)
    assert key == "train/loss" and problems == () and (math.isnan(out) if math.isnan(value) else out == value)


@pytest.mark.parametrize("value,out", [(3, 3.0), (np.float32(0.5), 0.5), (np.int64(7), 7.0)])
def test_check_metric_takes_ints_and_numpy_scalars_as_floats(value, out):
    assert check_metric("a", value, 1) == ("a", out, ())
    assert type(check_metric("a", value, 1).value) is float


def test_check_metric_drops_a_step_that_is_not_an_integer():
    assert check_metric("a", 1.0, 1.5) == (None, None, ("metric 'a' dropped: step of type float is not an integer",))
    assert check_metric("a", 1.0, 2.0).key == "a"


def test_check_tag_shortens_a_value_over_8000_characters():
    assert check_tag("note", "v" * 9000) == ("note", "v" * 8000, ("tag 'note' value shortened from 9000 to 8000 characters",))
    assert check_tag("note", "v" * 8000) == ("note", "v" * 8000, ())


def test_check_param_shortens_a_value_over_6000_characters_and_renames():
    assert check_param("lr@warmup", 1e-3) == ("lr_at_warmup", "0.001", ("param 'lr@warmup' renamed to 'lr_at_warmup'",))
    key, value, problems = check_param("p", "v" * 6001)
    assert (key, len(value)) == ("p", 6000) and problems == ("param 'p' value shortened from 6001 to 6000 characters",)
