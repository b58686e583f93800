"""mlflow_llmeff.autolog() in-process: plain PyTorch loop counts, enable/disable restores, failures stay inside."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys

import mlflow
import pytest
import torch

import mlflow_llmeff
from mlflow_llmeff import names

AL = importlib.import_module("mlflow_llmeff.autologging")

from conftest import empty_store, use_store


@pytest.fixture
def tracking_uri(module_store, monkeypatch):
    yield from use_store(module_store, monkeypatch)
    mlflow_llmeff.autolog(disable=True)


def tiny_model():
    from transformers import LlamaForCausalLM

    from mlflow_llmeff.models.build import load_config

    torch.manual_seed(0)
    return LlamaForCausalLM(load_config("llama-tiny"))


def batch(lengths: list[int], t: int = 8) -> dict[str, torch.Tensor]:
    """Rows of ``t`` positions whose first ``lengths[i]`` are real tokens."""
    ids = torch.arange(len(lengths) * t).view(len(lengths), t) % 200 + 3
    mask = (torch.arange(t)[None, :] < torch.tensor(lengths)[:, None]).long()
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def test_import_is_cheap_and_autolog_is_the_function():
    code = ("import sys, mlflow_llmeff; assert 'torch' not in sys.modules and 'mlflow' not in sys.modules; "
            "assert callable(mlflow_llmeff.autolog) and "
            "mlflow_llmeff.autolog.integration_name == 'mlflow_llmeff'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_plain_loop_counts_non_padding_tokens_over_accumulated_micro_batches(tracking_uri):
    mlflow_llmeff.autolog(log_every_n_steps=2, warmup_steps=1, measure_energy="none", peak_tflops=1.0)
    model = tiny_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    micro = [batch([8, 5]), batch([3, 8])]  # 13 + 11 = 24 non-padding tokens per step, 32 positions
    for _ in range(4):
        for b in micro:  # gradient accumulation: two forwards per optimizer step
            model(**b).loss.backward()
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        model(**micro[0])  # evaluation: not counted
    run_id = AL.active_monitor().run_id
    mlflow.end_run()  # the run ends: summary logged first
    client = mlflow.MlflowClient()
    run = client.get_run(run_id)
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, names.TRAIN_TOKENS)] == [(2, 48.0), (4, 96.0)]
    assert run.data.metrics[names.TRAIN_PADDED_TOKENS] == 128.0
    assert run.data.metrics[names.TRAIN_LOSS_TOKENS] == 4 * (7 + 4 + 2 + 7)
    assert run.data.metrics[names.SUM_TOKENS] == 96.0 and run.data.metrics[names.SUM_STEPS] == 4.0
    assert names.SUM_MFU in run.data.metrics and names.TPUT_DEVICE_MFU in run.data.metrics  # peak given
    assert run.data.tags[names.AUTOLOG_INTEGRATION] == "pytorch"
    assert run.data.tags[names.GRAD_ACCUM] == "2" and run.data.tags[names.ACCEL_SHORT] == "cpu"
    assert run.info.status == "FINISHED"


def test_disable_restores_every_patched_function_and_hook(tracking_uri):
    import accelerate
    import torch.optim.optimizer as topt
    import transformers
    from torch.nn.modules import module as tm

    import mlflow.tracking.fluent as fluent

    targets = [(torch.optim.Optimizer, "__init__"), (torch.distributed, "destroy_process_group"),
               (fluent, "end_run"), (mlflow, "end_run"), (transformers.Trainer, "__init__"),
               (transformers.Trainer, "train"), (transformers.Trainer, "evaluate"), (transformers.Trainer, "_save_checkpoint"),
               (transformers.Trainer, "_load_from_checkpoint"), (accelerate.Accelerator, "prepare"),
               (accelerate.Accelerator, "end_training"), (accelerate.Accelerator, "save_state"),
               (accelerate.Accelerator, "load_state")]
    before = [vars(obj)[name] for obj, name in targets]
    hooks_before = (len(topt._global_optimizer_post_hooks), len(tm._global_forward_hooks),
                    len(tm._global_forward_pre_hooks))

    mlflow_llmeff.autolog(log_every_n_steps=1, warmup_steps=0, measure_energy="none")
    assert all(vars(obj)[name] is not orig for (obj, name), orig in zip(targets, before))
    model = tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(**batch([8])).loss.backward()
    opt.step()
    # autolog's counting hook only: one process installs no phase timer (its times feed the straggler figures)
    assert len(model._forward_hooks) == 1 and AL.active_monitor() is not None
    run_id = AL.active_monitor().run_id

    mlflow_llmeff.autolog(disable=True)
    assert all(vars(obj)[name] is orig for (obj, name), orig in zip(targets, before))
    assert (len(topt._global_optimizer_post_hooks), len(tm._global_forward_hooks),
            len(tm._global_forward_pre_hooks)) == hooks_before
    assert len(model._forward_hooks) == 0 and len(model._forward_pre_hooks) == 0 and not AL.is_enabled()
    assert mlflow.MlflowClient().get_run(run_id).data.metrics[names.SUM_STEPS] == 1.0  # finished on disable
    # The loop now runs untouched: no new run, no metrics.
    n_runs = len(mlflow.search_runs(search_all_experiments=True))
    model(**batch([8])).loss.backward()
    opt.step()
    assert AL.active_monitor() is None and mlflow.active_run() is None
    assert len(mlflow.search_runs(search_all_experiments=True)) == n_runs


def test_an_exception_in_our_hooks_never_reaches_the_loop(tracking_uri, monkeypatch):
    mlflow_llmeff.autolog(log_every_n_steps=1, warmup_steps=0, measure_energy="none")

    def boom(self, module):
        raise RuntimeError("autolog bug")

    monkeypatch.setattr(AL._Session, "start_monitor", boom)
    model = tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.warns(UserWarning, match="autolog bug"):
        for _ in range(2):
            model(**batch([8])).loss.backward()
            opt.step()
    assert AL.active_monitor() is None


@pytest.mark.parametrize("kwargs, match", [
    ({"log_every_n_steps": 0}, "log_every_n_steps=0"),
    ({"warmup_steps": -1}, "warmup_steps=-1"),
    ({"measure_energy": "magic"}, "measure_energy='magic'.*auto, nvml, rapl, none"),
    ({"peak_tflops": 0}, "peak_tflops=0"),
])
def test_bad_arguments_raise_and_leave_autolog_disabled(tracking_uri, kwargs, match):
    with pytest.raises(ValueError, match=match):
        mlflow_llmeff.autolog(**kwargs)
    assert not AL.is_enabled()


def test_script_that_dies_with_an_exception_leaves_a_failed_run(tmp_path):
    script = tmp_path / "dies.py"
    script.write_text(
        "import torch, mlflow_llmeff\n"
        "from transformers import LlamaConfig, LlamaForCausalLM\n"
        "mlflow_llmeff.autolog(log_every_n_steps=1, warmup_steps=0, measure_energy='none')\n"
        "m = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,\n"
        "    num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2))\n"
        "opt = torch.optim.SGD(m.parameters(), lr=0.1)\n"
        "ids = torch.randint(0, 32, (2, 8))\n"
        "for step in range(3):\n"
        "    m(input_ids=ids, labels=ids).loss.backward(); opt.step(); opt.zero_grad()\n"
        "raise RuntimeError('user code failed')\n")
    own_store = empty_store(tmp_path / "own.db")  # this module's shared store holds other tests' runs
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "MLFLOW_TRACKING_URI": own_store})
    assert r.returncode == 1 and "user code failed" in r.stderr
    runs = mlflow.MlflowClient(tracking_uri=own_store).search_runs(["0"])
    assert [x.info.status for x in runs] == ["FAILED"]
    assert runs[0].data.metrics["train/tokens"] == 3 * 16


def parts_add_up(m: dict) -> float:
    return m[names.SUM_GOODPUT] * m[names.SUM_WALL_S] + sum(m.get(k, 0.0) for k in names.SUM_BADPUT.values())


def test_an_eval_inside_a_plain_loop_is_timed_as_eval_not_as_a_step(tracking_uri, monkeypatch):
    from mlflow_llmeff.autologging import hooks
    from mlflow_llmeff.testing import FakeClock

    # the monitor autolog starts runs on a clock only this test moves (autolog() takes no clock: its
    # settings hand the monitor one more keyword argument)
    clock = FakeClock(100.0)
    given = hooks._Settings.monitor_kwargs
    monkeypatch.setattr(hooks._Settings, "monitor_kwargs", lambda self: {**given(self), "clock": clock})
    mlflow_llmeff.autolog(log_every_n_steps=2, warmup_steps=1, measure_energy="none")
    model = tiny_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(1, 5):
        model(**batch([8, 8])).loss.backward()  # step 1's forward starts the monitor, and its clock
        clock.t += 0.01  # each optimizer step takes 10 ms
        opt.step()
        opt.zero_grad()
        if step == 2:  # the loop's own evaluation, as users write it
            model.eval()
            with torch.no_grad():
                model(**batch([8]))  # opens the eval pause
                clock.t += 1.0  # a slow eval data loader: 1 s
                model(**batch([8]))
            model.train()  # the pause closes at step 3's training forward
    run_id = AL.active_monitor().run_id
    mlflow.end_run()  # the clock has not moved since step 4
    m = mlflow.MlflowClient().get_run(run_id).data.metrics
    # by hand: 4 steps x 0.01 s + the 1 s eval = 1.04 s of wall, from the monitor's start (step 1's
    # forward) to the end; the eval is exactly its 1 s, every steady step (2, 3, 4) exactly 0.01 s.
    # An eval landing in step 3 makes that step 1.01 s: a mean of (0.01 + 1.01 + 0.01) / 3 = 0.343 s
    # (to 1e-12 s: the float rounding of the clock's sums, about 1e-14 s here)
    assert m[names.SUM_BADPUT["eval"]] >= 1.0 and m[names.SUM_BADPUT["eval"]] == pytest.approx(1.0, abs=1e-12)
    assert m[names.SUM_STEP_TIME_S] == pytest.approx(0.01, abs=1e-12)
    assert m[names.SUM_WALL_S] == pytest.approx(1.04, abs=1e-12)
    assert parts_add_up(m) == pytest.approx(m[names.SUM_WALL_S], rel=1e-9)
    assert m[names.TRAIN_TOKENS] == 4 * 16  # the eval's tokens are not training tokens


def test_accelerate_save_state_and_load_state_are_checkpoint_time(tracking_uri, tmp_path):
    from accelerate import Accelerator

    mlflow_llmeff.autolog(log_every_n_steps=2, warmup_steps=0, measure_energy="none")
    acc = Accelerator(cpu=True)
    model = acc.prepare(tiny_model())
    opt = acc.prepare(torch.optim.AdamW(model.parameters(), lr=1e-3))
    for step in range(1, 5):
        acc.backward(model(**batch([8])).loss)
        opt.step()
        opt.zero_grad()
        if step == 2:
            acc.save_state(str(tmp_path / "ckpt"))
            acc.load_state(str(tmp_path / "ckpt"))
    run_id = AL.active_monitor().run_id
    acc.end_training()
    m = mlflow.MlflowClient().get_run(run_id).data.metrics
    assert m[names.SUM_BADPUT["checkpoint_save"]] > 0 and m[names.SUM_BADPUT["checkpoint_load"]] > 0
    assert parts_add_up(m) == pytest.approx(m[names.SUM_WALL_S], rel=1e-9)
    assert m[names.SUM_STEPS] == 4.0


def test_trainer_evaluate_is_eval_time_and_its_loss_reaches_time_to_quality(tracking_uri, tmp_path):
    from transformers import Trainer, TrainingArguments

    class Rows(torch.utils.data.Dataset):
        def __len__(self):
            return 8

        def __getitem__(self, i):
            b = batch([8 - i % 3])
            return {k: v[0] for k, v in b.items()}

    mlflow_llmeff.autolog(log_every_n_steps=2, warmup_steps=1, measure_energy="none", targets="val_loss<=100")
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, per_device_eval_batch_size=2,
                             max_steps=4, eval_strategy="steps", eval_steps=2, save_strategy="no", report_to="none",
                             use_cpu=True, dataloader_num_workers=0, disable_tqdm=True, seed=0, logging_steps=2)
    trainer = Trainer(model=tiny_model(), args=args, train_dataset=Rows(), eval_dataset=Rows())
    trainer.train()
    runs = mlflow.MlflowClient().search_runs([e.experiment_id for e in mlflow.search_experiments()],
                                             order_by=["attributes.start_time DESC"])
    run = runs[0]
    assert run.data.tags[names.AUTOLOG_INTEGRATION] == "trainer"
    m = run.data.metrics
    hist = mlflow.MlflowClient().get_metric_history(run.info.run_id, names.EVAL_VAL_LOSS)
    assert sorted(p.step for p in hist) == [2, 4]
    assert [p.step for p in mlflow.MlflowClient().get_metric_history(run.info.run_id,
                                                                      "ttq/val_loss_le_100_wall_s")] == [2]
    assert m[names.SUM_BADPUT["eval"]] > 0
    assert parts_add_up(m) == pytest.approx(m[names.SUM_WALL_S], rel=1e-9)
    assert run.data.tags["llmeff.ttq.val_loss_le_100"] == "reached_at_step_2"
    # transformers' Llama takes loss kwargs: the Trainer passes num_items_in_batch, across devices by default
    assert trainer.model_accepts_loss_kwargs and args.average_tokens_across_devices
    assert run.data.tags[names.LOSS_WEIGHTING] == (
        "token-weighted: transformers' Trainer passes num_items_in_batch (loss-bearing tokens of the step's "
        "micro-batches, counted across devices)")
    # the learning rate of each logged step is the one that step used, as the Trainer logs it
    theirs = {e["step"]: e["learning_rate"] for e in trainer.state.log_history if "learning_rate" in e}
    ours = {p.step: p.value for p in mlflow.MlflowClient().get_metric_history(run.info.run_id, names.TRAIN_LR)}
    assert set(ours) == {2, 4} and ours == pytest.approx({k: theirs[k] for k in ours}, rel=1e-6)


def test_autolog_enabled_after_the_optimizer_still_gives_a_run_and_says_so(tracking_uri):
    model = tiny_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)  # built before autolog()
    mlflow_llmeff.autolog(log_every_n_steps=2, warmup_steps=0, measure_energy="none")
    with pytest.warns(UserWarning, match="after the optimizer was built"):
        for _ in range(5):
            model(**batch([8])).loss.backward()
            opt.step()
            opt.zero_grad()
    run_id = AL.active_monitor().run_id
    mlflow.end_run()
    run = mlflow.MlflowClient().get_run(run_id)
    assert run.data.metrics[names.SUM_STEPS] == 4.0 and run.data.metrics[names.TRAIN_TOKENS] == 4 * 8
    assert "after the optimizer was built" in run.data.tags[names.AUTOLOG_NOTE]


# ------------------------------------------------------------ dynamic padding: the shape is no condition
@pytest.fixture
def experiment(tracking_uri, monkeypatch, request):
    """A fresh experiment of its own (run names are unique per experiment), left again at teardown."""
    import mlflow.tracking.fluent as fluent

    monkeypatch.setattr(fluent, "_active_experiment_id", None)  # restored at teardown
    # set_experiment exports MLFLOW_EXPERIMENT_ID (for subprocesses): gone again at teardown, or the
    # next test's subprocess on this worker looks for this store's experiment in its own (setenv records
    # the variable's absence, which delenv alone does not)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_ID", "")
    monkeypatch.delenv("MLFLOW_EXPERIMENT_ID")
    return mlflow.set_experiment(f"shapes-{request.node.name}").experiment_id


def padded_loop(shapes: list[tuple[int, int]]):
    """A plain loop under autolog, one optimizer step per ``(rows, t)``: ``rows`` rows padded to the
    longest, ``t`` (row ``j`` holds ``t - j`` tokens), as a collator padding each batch does; its run."""
    mlflow_llmeff.autolog(log_every_n_steps=2, warmup_steps=1, measure_energy="none")
    model = tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    for rows, t in shapes:
        model(**batch([t - j for j in range(rows)], t)).loss.backward()
        opt.step()
        opt.zero_grad()
    run_id = AL.active_monitor().run_id
    mlflow.end_run()
    mlflow_llmeff.autolog(disable=True)
    return mlflow.MlflowClient().get_run(run_id)


def shape_tags(run) -> dict[str, str]:
    return {k: v for k, v in run.data.tags.items()
            if k.startswith((names.SEQ_LEN, names.MICRO_BATCH_SIZE, names.GRAD_ACCUM, names.GLOBAL_BATCH_TOKENS))}


def test_padded_lengths_that_vary_make_seq_len_and_global_batch_dynamic_and_drop_them_from_the_name(experiment):
    first = padded_loop([(2, 25), (2, 23)] * 3)  # the first batch padded to 25: named ...-gbt50-s25-... at step 1
    second = padded_loop([(2, 23), (2, 25)] * 3)  # the first padded to 23: ...-gbt46-s23-... at step 1
    for run in (first, second):
        assert shape_tags(run) == {names.SEQ_LEN: "dynamic", names.SEQ_LEN_RANGE: "23-25",
                                   names.MICRO_BATCH_SIZE: "2", names.GRAD_ACCUM: "1",
                                   names.GLOBAL_BATCH_TOKENS: "dynamic"}
    # one configuration, one stem: the second is its repeat
    assert [first.info.run_name, second.info.run_name] == ["llama-sgd-fp32-cpu", "llama-sgd-fp32-cpu-2"]


def test_varying_padded_lengths_still_count_the_non_padding_tokens(experiment):
    run = padded_loop([(2, 25), (2, 23)] * 3)
    m = run.data.metrics
    assert m[names.SUM_TOKENS] == 3 * ((25 + 24) + (23 + 22)) == 282  # row j of a batch padded to t: t - j tokens
    assert m[names.TRAIN_PADDED_TOKENS] == 3 * (2 * 25 + 2 * 23) == 288
    assert m[names.TRAIN_LOSS_TOKENS] == 282 - 6 * 2  # one token per row carries no loss


def test_a_constant_shape_keeps_its_batch_parts_and_tags(experiment):
    run = padded_loop([(2, 25)] * 4)
    assert shape_tags(run) == {names.SEQ_LEN: "25", names.MICRO_BATCH_SIZE: "2", names.GRAD_ACCUM: "1",
                               names.GLOBAL_BATCH_TOKENS: "50"}
    assert run.info.run_name == "llama-sgd-fp32-gbt50-s25-cpu"
    assert run.data.metrics[names.SUM_TOKENS] == 4 * (25 + 24)


def test_a_partial_last_batch_is_no_varying_batch_size(experiment):
    # 7 rows of one length in batches of 2 (drop_last=False): the last batch holds 1 row
    run = padded_loop([(2, 25)] * 3 + [(1, 25)])
    assert shape_tags(run) == {names.SEQ_LEN: "25", names.MICRO_BATCH_SIZE: "2", names.GRAD_ACCUM: "1",
                               names.GLOBAL_BATCH_TOKENS: "50"}
    assert run.info.run_name == "llama-sgd-fp32-gbt50-s25-cpu"


def test_a_micro_batch_size_that_varies_drops_the_global_batch_but_keeps_the_length(experiment):
    run = padded_loop([(2, 25), (1, 25), (2, 25), (2, 25)])
    assert shape_tags(run) == {names.SEQ_LEN: "25", names.MICRO_BATCH_SIZE: "dynamic",
                               names.MICRO_BATCH_SIZE_RANGE: "1-2", names.GRAD_ACCUM: "1",
                               names.GLOBAL_BATCH_TOKENS: "dynamic"}
    assert run.info.run_name == "llama-sgd-fp32-s25-cpu"


def test_a_trainer_model_without_loss_kwargs_is_said_to_average_micro_batch_means():
    from mlflow_llmeff.autologging import _trainer_loss_weighting

    class Plain(torch.nn.Module):
        def forward(self, input_ids, labels=None):  # no **kwargs: the Trainer cannot pass num_items_in_batch
            return input_ids

    class Says(Plain):
        accepts_loss_kwargs = False

    class Args:
        average_tokens_across_devices = True

    assert _trainer_loss_weighting(Args(), Plain()).startswith("mean of micro-batch means: the model's forward")
    assert _trainer_loss_weighting(Args(), Says()).startswith("mean of micro-batch means")
    assert _trainer_loss_weighting(Args(), tiny_model()).endswith("counted across devices)")
