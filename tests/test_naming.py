"""Run names from the configuration alone: short parts in one fixed order, whatever the other runs."""

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
    return [study_name(parts_from_tags(tags, evals)) for tags, evals in FIVE]


def test_the_five_trial_runs_get_their_parts_in_the_fixed_order():
    assert five_names() == ["tiny-single-fp32-gbt1k-s128-cpu", "tiny-ddp2-fp32-gbt2k-s128-cpu",
                            "tiny-single-fp32-gbt4k-s128-cpu", "160m-single-fp32-gbt1k-s128-cpu",
                            "tiny-single-hs-fp32-gbt1k-s128-cpu"]


def test_a_configuration_has_one_name_stem_in_every_experiment():
    # the trial: repeats of the 2-process DDP run were 'tiny-ddp2-fp32-...' in one experiment and
    # 'ddp2-gbt2k-tiny-...' in another, where the other runs varied the batch
    ddp = parts_from_tags(FIVE[1][0])
    assert study_name(ddp) == "tiny-ddp2-fp32-gbt2k-s128-cpu"
    assert study_name(dict(reversed(list(ddp.items())))) == "tiny-ddp2-fp32-gbt2k-s128-cpu"  # not the dict's order


def test_every_condition_gives_its_part_in_the_fixed_order():
    tags = {**BASE, names.MODEL_NAME: "/models/Qwen3-0.6B", names.PAR_STRATEGY: "deepspeed_zero3",
            names.ACCEL_COUNT: "8", names.PRECISION: "bf16", names.GLOBAL_BATCH_TOKENS: str(4 * 2**20),
            names.SEQ_LEN: "4096", names.ACCEL_SHORT: "H100"}
    assert study_name(parts_from_tags(tags, "hellaswag,mmlu")) == "Qwen3-0.6B-zero3x8-hs+mmlu-bf16-gbt4M-s4k-h100"


def test_a_run_without_conditions_has_an_empty_stem():
    assert study_name(parts_from_tags({})) == ""


@pytest.mark.parametrize("n, text", [(128, "128"), (1024, "1k"), (1536, "1.5k"), (4 * 2**20, "4M"), (3000, "3000")])
def test_counts_in_short_binary_multiples(n, text):
    assert human_count(n) == text


def test_a_bad_count_is_one_line():
    with pytest.raises(ValueError, match="count 'x' is not accepted"):
        human_count("x")


def test_repeats_get_the_stem_in_every_experiment_and_a_suffix_where_it_is_taken(tracking_uri):
    import mlflow

    from mlflow_llmeff.tracking.runs import unique_run_name

    client = mlflow.MlflowClient()
    ddp = parts_from_tags(FIVE[1][0])
    batches = client.create_experiment("batches")  # the other runs vary the batch: the name does not follow them
    for tags, evals in FIVE[2:4]:
        client.create_run(batches, run_name=study_name(parts_from_tags(tags, evals)))
    assert unique_run_name(client, batches, "unused", parts=ddp) == "tiny-ddp2-fp32-gbt2k-s128-cpu"
    again = client.create_experiment("again")
    client.create_run(again, run_name="tiny-ddp2-fp32-gbt2k-s128-cpu")
    assert unique_run_name(client, again, "unused", parts=ddp) == "tiny-ddp2-fp32-gbt2k-s128-cpu-2"
