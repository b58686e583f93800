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
    assert five_names() == ["tiny-fp32-gbt1k-s128-cpu", "tiny-ddp2-fp32-gbt2k-s128-cpu",
                            "tiny-fp32-gbt4k-s128-cpu", "160m-fp32-gbt1k-s128-cpu",
                            "tiny-hs-fp32-gbt1k-s128-cpu"]


def _first_difference(a: str, b: str) -> int:
    """The 1-based position of the first character where two names differ."""
    return next((i + 1 for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)) + 1)


def test_two_batches_differ_within_the_20_characters_the_runs_table_shows():
    # issue 53: 'tiny-single-fp32-gbt512-s128-cpu' and 'tiny-single-fp32-gbt4k-s128-cpu' were one name in the
    # MLflow runs table, which cuts a name at 20 characters ('tiny-single-fp32-gbt')
    small, large = ({**BASE, names.GLOBAL_BATCH_TOKENS: str(n)} for n in (512, 4096))
    a, b = study_name(parts_from_tags(small)), study_name(parts_from_tags(large))
    assert (a, b) == ("tiny-fp32-gbt512-s128-cpu", "tiny-fp32-gbt4k-s128-cpu")
    assert a[:20] != b[:20] and _first_difference(a, b) == 14


@pytest.mark.parametrize("change, at", [
    ({names.GLOBAL_BATCH_TOKENS: "2048"}, 14),  # a batch sweep
    ({names.SEQ_LEN: "256"}, 18),  # a length sweep
    ({names.PRECISION: "bf16"}, 6),  # a precision sweep
    ({names.PAR_STRATEGY: "ddp", names.ACCEL_COUNT: "2"}, 6),  # one process against two
    ({names.MODEL_NAME: "llama-160m"}, 1),  # a model sweep
    ({names.OPTIMIZER: "AdamW8bit (torchao.optim)"}, 6),  # a memory lever
    ({names.ACCEL_SHORT: "h100"}, 22),  # another machine: the last part, past the table's cut
])
def test_what_a_study_varies_comes_within_the_first_20_characters(change, at):
    base = study_name(parts_from_tags(BASE))
    other = study_name(parts_from_tags({**BASE, **change}))
    assert _first_difference(base, other) == at


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


def test_a_batch_shape_that_varied_gives_no_batch_or_seq_part():
    dynamic = {**BASE, names.SEQ_LEN: "dynamic", names.GLOBAL_BATCH_TOKENS: "dynamic"}  # dynamic padding
    assert study_name(parts_from_tags(dynamic)) == "tiny-fp32-cpu"
    sizes = {**BASE, names.GLOBAL_BATCH_TOKENS: "dynamic"}  # only the micro-batch size varied
    assert study_name(parts_from_tags(sizes)) == "tiny-fp32-s128-cpu"


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


# ------------------------------------------------------- one configuration through every path: one stem
# llama-tiny on 2 processes (DDP, auto), fp32, micro batch 8, sequence 128, grad accum 1: 128 x 8 x 1 x 2 tokens
STEM = "tiny-ddp2-fp32-gbt2k-s128-cpu"
# what the meter measures of such a run (condition_tags) and the model's name as it reads it
MEASURED = {names.PAR_STRATEGY: "ddp", names.ACCEL_COUNT: "2", names.PRECISION: "fp32", names.ACCEL_SHORT: "cpu"}


class _Logger:
    run_id = None

    def __init__(self):
        self.renamed = []

    def rename(self, parts):
        self.renamed.append(study_name(parts))

    def set_tags(self, tags, synchronous=True):
        pass


@pytest.fixture
def meter(monkeypatch):
    """A rank-0 meter's parts: its conditions and model name (what binding reads), a logger that
    records renames."""
    from mlflow_llmeff.monitor import binding
    from mlflow_llmeff.monitor.parts import Parts

    monkeypatch.setattr(binding, "condition_tags", lambda p: dict(MEASURED))
    monkeypatch.setattr(binding, "model_name", lambda p: "llama-tiny")
    return Parts(logger=_Logger())


def _first_step(mon):
    """What the end of the first step does to the name (binding.tag_shape): the batch shape's parts."""
    from mlflow_llmeff.monitor import binding, conditions

    binding.rename_when_shaped(mon, conditions.shape_tags(8, 128, 1, 2))
    return mon.logger.renamed


def test_llmeff_train_names_the_configuration_at_creation_and_the_first_step_keeps_it(meter):
    from mlflow_llmeff.monitor import binding
    from mlflow_llmeff.planning.spec import Machine, resolve
    from mlflow_llmeff.train.config import TrainConfig

    cfg = TrainConfig(num_processes=2, precision="fp32")
    given = {names.MODEL_NAME: cfg.model, names.SEQ_LEN: str(cfg.seq_len),  # the tags train/loop.py gives
             names.GLOBAL_BATCH_TOKENS: str(resolve(cfg, Machine(cuda=False, bf16=True)).global_batch_tokens)}
    meter.naming.named(binding.name_parts(meter, given))
    meter.naming.given_by_caller(given, "")
    assert study_name(meter.naming.parts) == STEM
    assert _first_step(meter) == []  # nothing new: no rename


def test_autologs_own_run_gets_the_batch_parts_at_its_first_step(meter):
    from mlflow_llmeff.monitor import binding

    meter.naming.named(binding.name_parts(meter))  # created before any step: no batch shape yet
    assert study_name(meter.naming.parts) == "tiny-ddp2-fp32-cpu"
    assert _first_step(meter) == [STEM]  # the trial's HF Trainer run stayed 'llama-single-fp32-cpu'


def _shaped(meter, given: dict | None = None):
    """The stand-in meter after a first step of 8 rows padded to 128 (what binding.varying_shape reads)."""
    from types import SimpleNamespace

    from mlflow_llmeff.monitor import binding

    meter.rank, meter.world_size = 0, 2
    meter.tally = SimpleNamespace(first_shape=(8, 128, 1))
    meter.counting = SimpleNamespace(slices=1, copies=1)
    meter.naming.given_by_caller(given or {}, None)
    meter.naming.named(binding.name_parts(meter, given))
    return meter


def test_a_padded_length_that_varies_names_autologs_run_again_without_its_batch_parts(meter):
    from mlflow_llmeff.monitor import binding
    from mlflow_llmeff.monitor.counting import ShapeRange

    _shaped(meter)
    assert _first_step(meter) == [STEM]
    tags = binding.varying_shape(meter, ShapeRange(seq=(100, 128), batch=(8, 8)))
    assert meter.logger.renamed == [STEM, "tiny-ddp2-fp32-cpu"]
    assert tags == {names.SEQ_LEN: "dynamic", names.SEQ_LEN_RANGE: "100-128", names.GLOBAL_BATCH_TOKENS: "dynamic"}
    binding.varying_shape(meter, ShapeRange(seq=(90, 128), batch=(8, 8)))  # the end of the run: a wider range
    assert meter.logger.renamed == [STEM, "tiny-ddp2-fp32-cpu"]  # the same stem: no second rename


def test_a_shape_that_did_not_vary_changes_no_tag_and_no_name(meter):
    from mlflow_llmeff.monitor import binding
    from mlflow_llmeff.monitor.counting import ShapeRange

    _shaped(meter)
    assert binding.varying_shape(meter, ShapeRange(seq=(128, 128), batch=(8, 8))) == {}
    assert binding.varying_shape(meter, None) == {} and meter.logger.renamed == []


def test_llmeff_trains_own_shape_tags_win_over_a_varying_shape(meter):
    from mlflow_llmeff.monitor import binding
    from mlflow_llmeff.monitor.counting import ShapeRange

    given = {names.MODEL_NAME: "llama-tiny", names.SEQ_LEN: "128", names.MICRO_BATCH_SIZE: "8",
             names.GLOBAL_BATCH_TOKENS: "2048"}  # what train/loop.py passes
    _shaped(meter, given)
    assert binding.varying_shape(meter, ShapeRange(seq=(100, 128), batch=(4, 8))) == {}
    assert meter.logger.renamed == []  # its name keeps the parts it gave


def test_every_path_names_one_configuration_alike(meter, tracking_uri, monkeypatch):
    """The table: llmeff train (above), autolog's run (above), the HF Trainer's own run (report_to),
    a dry run's plan run, a run that failed before training; the outbox's name record sets the name."""
    import mlflow

    from mlflow_llmeff.train.failures import failed_run_name
    from mlflow_llmeff.meters import hardware
    from mlflow_llmeff.monitor import binding
    from mlflow_llmeff.tracking.outbox import name_run
    from mlflow_llmeff.planning.spec import Machine, resolve
    from mlflow_llmeff.train.launch import log_plan
    from mlflow_llmeff.train.config import TrainConfig
    from mlflow_llmeff.train.launch import plan_tags

    client = mlflow.MlflowClient()
    exp = client.create_experiment("paths")
    taken = client.create_run(exp, run_name=STEM).info.run_id  # an earlier repeat
    trainer = client.create_run(exp).info.run_id  # what the Trainer's MLflowCallback made: a random name
    meter.logger.run_id = trainer
    set_tags = lambda tags: [client.set_tag(trainer, k, v) for k, v in tags.items()]  # noqa: E731
    assert binding.name_adopted_run(meter, exp, set_tags) == "tiny-ddp2-fp32-cpu"
    assert _first_step(meter) == [STEM]
    parts = meter.naming.parts  # what the logger's name record carries
    assert name_run(client, trainer, {"name_parts": parts}) == STEM + "-2"  # a repeat: the suffix
    assert client.get_run(trainer).info.run_name == STEM + "-2" and client.get_run(taken).info.run_name == STEM

    plan = client.create_run(exp).info.run_id
    log_plan(plan, plan_tags(resolve(TrainConfig(num_processes=2), Machine(cuda=False, bf16=True, accelerator="cpu"))),
             {}, "fits")
    assert client.get_run(plan).info.run_name == "plan-" + STEM

    class Cpu:
        short = "cpu"

        def tags(self):
            return {names.ACCEL_SHORT: "cpu", names.ACCEL_COUNT: "2"}

    monkeypatch.setattr(hardware, "detect_accelerator", lambda count=1: Cpu())  # a GPU machine's runs too
    params = {"model": "llama-tiny", "num_processes": 2, "precision": "auto", "parallelism": "auto",
              "seq_len": 128, "micro_batch_size": 8, "grad_accum": 1}
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert failed_run_name(params) == STEM  # was 'tiny-s128-cpu': strategy and precision auto, no batch


def test_a_failed_run_never_takes_the_name_of_a_finished_repeat(tracking_uri, monkeypatch):
    """A trial: `mlflow run . -P max_steps=-5` failed and was named like the 50-step run that had
    finished in the same experiment, so a comparison note naming that run was ambiguous."""
    import mlflow

    from mlflow_llmeff.tracking.runs import record_failure

    client = mlflow.MlflowClient()
    exp = client.create_experiment("failed-names")
    done = client.create_run(exp, run_name=STEM).info.run_id
    client.set_terminated(done, "FINISHED")
    failed = client.create_run(exp, run_name="launcher-random-name").info.run_id
    assert record_failure("max_steps=-5 must be a positive integer (>= 1)", run_id=failed, run_name=STEM)
    run = client.get_run(failed)
    assert run.info.run_name == STEM + "-2" and client.get_run(done).info.run_name == STEM
    assert run.data.tags[names.ERROR] == "max_steps=-5 must be a positive integer (>= 1)"
    # a second failure of the same configuration: the next suffix (its own name does not count)
    again = client.create_run(exp).info.run_id
    record_failure("again", run_id=again, run_name=STEM)
    assert client.get_run(again).info.run_name == STEM + "-3"
    # a read that fails: the stem (a name is cosmetic; the failure is still written)
    def down(*a, **k):
        raise ConnectionError("the store is down")

    monkeypatch.setattr("mlflow_llmeff.tracking.runs.unique_run_name", down)
    last = client.create_run(exp).info.run_id
    record_failure("down", run_id=last, run_name=STEM)
    assert client.get_run(last).info.run_name == STEM


def test_a_single_process_gives_no_layout_part_and_another_layout_gives_its_count():
    assert "layout" not in parts_from_tags(BASE)
    assert parts_from_tags({**BASE, names.PAR_STRATEGY: "fsdp", names.ACCEL_COUNT: "4"})["layout"] == "fsdp4"


@pytest.mark.parametrize("levers, part", [
    ({names.OPTIMIZER: "AdamW (torch.optim); states float32; from llmeff train --optimizer adamw",
      names.ATTENTION: "sdpa", names.WEIGHTS: "fp32", names.ACT_CKPT: "false"}, None),
    ({names.OPTIMIZER: "AdamW8bit (torchao.optim); states int8 codes + float32 scales"}, "ao8bit"),
    ({names.OPTIMIZER: "AdamW8bit (bitsandbytes.optim.adamw); states uint8"}, "bnb8bit"),
    ({names.OPTIMIZER: "PagedAdamW8bit (bitsandbytes.optim)"}, "bnbpaged8bit"),
    ({names.OPTIMIZER: "Adafactor (torch.optim)"}, "adafactor"),
    ({names.ATTENTION: "eager"}, "eager"),
    ({names.ATTENTION: "flash_attention_2"}, "fa2"),
    ({names.WEIGHTS: "bf16", names.OPTIMIZER: "AdamW8bit (bitsandbytes.optim)"}, "bnb8bit-wbf16"),
    ({names.ACT_CKPT: "true", names.ATTENTION: "eager"}, "eager-ckpt"),
])
def test_a_memory_lever_off_its_default_is_named_right_after_the_model(levers, part):
    name = study_name(parts_from_tags({**BASE, **levers}))
    assert name == (f"tiny-{part}-fp32-gbt1k-s128-cpu" if part else "tiny-fp32-gbt1k-s128-cpu")


def test_lora_adapters_are_named_with_their_rank():
    trainable = "3,584 of 129,216 parameters trainable (2.7737%); LoRA r=8 on q_proj,v_proj in 2 layers"
    assert study_name(parts_from_tags({**BASE, names.FLOPS_TRAINABLE: trainable})) == \
        "tiny-lora8-fp32-gbt1k-s128-cpu"
