"""Run names that differ at their start: short parts, the most varying conditions first."""

from __future__ import annotations

import pytest

from mlflow_llmeff import names
from mlflow_llmeff.tracking.naming import human_count, parts_from_tags, study_name

BASE = {names.MODEL_NAME: "llama-tiny", names.PAR_STRATEGY: "single", names.ACCEL_COUNT: "1",
        names.PRECISION: "fp32", names.GLOBAL_BATCH_TOKENS: "1024", names.SEQ_LEN: "128", names.ACCEL_SHORT: "cpu"}
# the UI trial's five runs, in the order they were made: default, 2-process DDP, grad-accum 4, llama-160m, evals
FIVE = [(BASE, None),
        ({**BASE, names.PAR_STRATEGY: "ddp", names.ACCEL_COUNT: "2", names.GLOBAL_BATCH_TOKENS: "2048"}, None),
        ({**BASE, names.GLOBAL_BATCH_TOKENS: "4096"}, None),
        ({**BASE, names.MODEL_NAME: "llama-160m"}, None),
        (BASE, "hellaswag")]


def five_names() -> list[str]:
    made, others = [], []
    for tags, evals in FIVE:
        parts = parts_from_tags(tags, evals)
        made.append(study_name(parts, others))
        others.append(parts)
    return made


def test_the_five_trial_runs_get_names_that_differ_within_20_characters():
    made = five_names()
    assert made == ["tiny-single-fp32-gbt1k-s128-cpu", "ddp2-gbt2k-tiny-fp32-s128-cpu",
                    "gbt4k-single-tiny-fp32-s128-cpu", "gbt1k-160m-single-fp32-s128-cpu",
                    "gbt1k-tiny-single-hs-fp32-s128-cpu"]
    heads = [n[:20] for n in made]
    assert len(set(heads)) == 5, heads


def test_without_other_runs_the_parts_keep_their_fixed_order():
    tags = {**BASE, names.MODEL_NAME: "/models/Qwen3-0.6B", names.PAR_STRATEGY: "deepspeed_zero3",
            names.ACCEL_COUNT: "8", names.PRECISION: "bf16", names.GLOBAL_BATCH_TOKENS: str(4 * 2**20),
            names.SEQ_LEN: "4096", names.ACCEL_SHORT: "H100"}
    assert study_name(parts_from_tags(tags, "hellaswag,mmlu")) == "Qwen3-0.6B-zero3x8-hs+mmlu-bf16-gbt4M-s4k-h100"


@pytest.mark.parametrize("n, text", [(128, "128"), (1024, "1k"), (1536, "1.5k"), (4 * 2**20, "4M"), (3000, "3000")])
def test_counts_in_short_binary_multiples(n, text):
    assert human_count(n) == text


def test_a_bad_count_is_one_line():
    with pytest.raises(ValueError, match="count 'x' is not accepted"):
        human_count("x")
