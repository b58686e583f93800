"""The closing ``llmeff: run ...`` line: its text from a summary (hand-made figures), and a finished monitor
printing it once on stderr, on the main rank only, never for llmeff train (it prints its own report), never
under ``autolog(silent=True)``, never raising."""

from __future__ import annotations

import mlflow
import pytest
import torch

import mlflow_llmeff
from mlflow_llmeff import names
from mlflow_llmeff.meters import collectives
from mlflow_llmeff.monitor import closing
from mlflow_llmeff.monitor.closing import closing_line
from mlflow_llmeff.monitor.meter import EfficiencyMonitor
from mlflow_llmeff.testing import FakeClock

from conftest import use_store

BASE = {names.SUM_STEPS: 12.0, names.SUM_TOKENS: 1200.0, names.SUM_WALL_S: 6.21, names.SUM_GOODPUT: 0.88}


@pytest.fixture
def tracking_uri(module_store, monkeypatch):
    yield from use_store(module_store, monkeypatch)
    mlflow_llmeff.autolog(disable=True)


@pytest.mark.parametrize("extra, absent, tail", [
    ({names.SUM_TOKENS_PER_SEC: 2345.6, names.SUM_TPS_CI95_LOW: 2300.4, names.SUM_TPS_CI95_HIGH: 2390.5,
      names.SUM_MFU: 0.4125},
     # MFU's interval is tokens/s's scaled: 41.25% x 2,300.4 / 2,345.6 = 40.46%, x 2,390.5 / 2,345.6 = 42.04%
     {}, "2,346 tokens/s steady state [95% interval 2,300-2,390], MFU 41.2% [95% interval 40.5-42.0%], wall 6.2 s, "
         "goodput 0.88 (counted, not sampled: no interval)"),
    ({names.SUM_TOKENS_PER_SEC: 200.0, names.SUM_MFU_MEASURED_PEAK: 0.0204},
     {names.SUM_TPS_CI95_LOW: "7 steady steps (an interval needs at least 10)"},
     "200 tokens/s steady state [no 95% interval: 7 steady steps (an interval needs at least 10)], "
     "MFU 2.04% of the measured matmul peak [no 95% interval: 7 steady steps (an interval needs at least 10)], "
     "wall 6.2 s, goodput 0.88 (counted, not sampled: no interval)"),
    ({}, {names.SUM_TOKENS_PER_SEC: "no token counted (pass batch= or tokens= to step())"},
     "no steady-state tokens/s (no token counted (pass batch= or tokens= to step())), wall 6.2 s, goodput 0.88 "
     "(counted, not sampled: no interval)"),
])
def test_the_line_says_the_rate_its_interval_or_why_none_and_mfu_when_known(extra, absent, tail):
    line = closing_line({**BASE, **extra}, run_id="abc123", run_name="tiny-single-fp32-cpu", absent=absent)
    assert line == f"llmeff: run tiny-single-fp32-cpu (abc123): 12 steps, 1,200 tokens, {tail}"


def test_the_largest_loss_is_named_beside_goodput_when_it_is_a_tenth_of_the_wall_or_more():
    # a trial's 50-step run: goodput 0.25 read as three quarters of training wasted; 9.9 s of 13.9 s were set-up
    summary = {**BASE, names.SUM_WALL_S: 13.9, names.SUM_GOODPUT: 0.25, names.SUM_BADPUT["init"]: 9.9,
               names.SUM_BADPUT["eval"]: 0.12, names.SUM_BADPUT["warmup"]: 0.3}
    line = closing_line(summary, run_id="abc123")
    assert line.endswith("wall 13.9 s, goodput 0.25 (counted, not sampled: no interval; largest loss: set-up "
                         "before the first step, 9.9 s)")
    # the largest under 10% of the wall (1.3 s of 13.9 s) is not worth a word
    summary[names.SUM_BADPUT["init"]] = 1.3
    assert closing_line(summary, run_id="abc123").endswith(
        "wall 13.9 s, goodput 0.25 (counted, not sampled: no interval)")


@pytest.mark.parametrize("share, stability, threads, said", [
    # a fresh user's README run at load 11: 415 tokens/s with 2 threads (7,347 with OMP_NUM_THREADS=1), and the
    # report said only "unstable: p90/p50 step time 3.3"
    (0.857, "unstable: p90/p50 step time 3.3 (> 1.5)", 2,
     "contended: other processes took 86% of the host's CPU in the steady window (summary/host_other_cpu_fraction), "
     "so the steps waited for CPU; rerun on a quiet machine; its 2 intra-op threads (llmeff.threads) wait on each "
     "other whenever a core is taken: OMP_NUM_THREADS=1 avoids that on a shared machine (a configuration of its "
     "own: compare runs with the same threads)"),
    (0.40, "unstable: too few independent steps (5.0 of 47)", 1,
     "contended: other processes took 40% of the host's CPU in the steady window (summary/host_other_cpu_fraction), "
     "so the steps waited for CPU; rerun on a quiet machine"),
    (0.24, "unstable: p90/p50 step time 3.3 (> 1.5)", 2, None),  # under a quarter: not the machine's word
    (0.90, "stable", 2, None),  # stable in spite of it: nothing to explain
    (None, "unstable: p90/p50 step time 3.3 (> 1.5)", 2, None),  # not measured: nothing said
])
def test_an_unstable_run_on_a_contended_host_names_the_contention_and_its_threads(share, stability, threads, said):
    summary = dict(BASE) if share is None else {**BASE, names.SUM_HOST_OTHER_CPU: share}
    assert closing.contention_line(summary, stability, threads) == said


def test_without_a_name_the_run_is_its_id():
    line = closing_line({**BASE, names.SUM_GOODPUT: None}, run_id="local-1",
                        absent={names.SUM_GOODPUT: "no wall time (a share of no time is undefined)"})
    assert line == ("llmeff: run local-1: 12 steps, 1,200 tokens, no steady-state tokens/s, wall 6.2 s, "
                    "goodput undefined (no wall time (a share of no time is undefined))")


def _plain_loop(**kwargs) -> EfficiencyMonitor:
    """12 steps of 0.5 s and 100 tokens each, the first one warm-up: 1,100 steady tokens in 5.5 s = 200 tokens/s."""
    clock = FakeClock()
    mon = EfficiencyMonitor(log_every_n_steps=4, warmup_steps=1, clock=clock, measure_energy="none",
                            measure_peak=False, report=False, **kwargs)
    for _ in range(12):
        clock.t += 0.5
        mon.step(tokens=100, samples=4)
    return mon


def _llmeff_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if "llmeff:" in line]


def test_a_monitored_loop_prints_one_closing_line_with_its_name_and_tokens_per_sec_on_stderr(tracking_uri, capsys):
    mon = _plain_loop()
    capsys.readouterr()
    summary = mon.finish()
    out, err = capsys.readouterr()
    run = mlflow.MlflowClient().get_run(mon.run_id)
    tps = run.data.metrics[names.SUM_TOKENS_PER_SEC]
    assert tps == summary[names.SUM_TOKENS_PER_SEC] == 200.0  # by hand: 1,100 tokens in 11 x 0.5 s
    line, verdict, *rest = _llmeff_lines(err)
    assert line.startswith(f"llmeff: run {run.info.run_name} ({mon.run_id}): 12 steps, 1,200 tokens, "
                           f"{tps:,.0f} tokens/s steady state [")
    # then the verdict, as llmeff train prints it, and where to open the run (the local store's UI)
    assert verdict == f"llmeff: {run.data.tags[names.STABILITY]}" and verdict.startswith("llmeff: ")
    assert rest[-1].startswith(f"llmeff: view run: mlflow ui --backend-store-uri {tracking_uri} then open ")
    assert rest[-1].endswith(f"/runs/{mon.run_id}?workflowType=machine_learning")
    # between them only what was assumed, and the host's contention where the run is unstable beside other processes
    assert [x for x in rest[:-1] if not x.startswith(("llmeff: assumed for you: ", "llmeff: contended: "))] == []
    assert "llmeff:" not in out
    mon.finish()  # a second finish prints nothing more
    assert _llmeff_lines(capsys.readouterr().err) == []


def test_the_report_says_each_targets_fate_and_a_missed_ones_best_value(tracking_uri, capsys):
    # a trial's run with --targets 'val_loss<=3.5,hellaswag/acc_norm>=0.30' missed both, and only the tags said so
    mon = _plain_loop(targets="val_loss<=3.5,hellaswag/acc_norm>=0.30,mmlu/acc>=0.5,arc/acc>=0.5")
    mon.log_eval({"val_loss": 4.21, "hellaswag/acc_norm": 0.27, "arc/acc": float("nan")}, step=6)
    mon.log_eval({"val_loss": 4.07, "hellaswag/acc_norm": 0.31, "arc/acc": float("nan")}, step=12)
    mon.log_eval({"val_loss": 4.12}, step=12)
    capsys.readouterr()
    mon.finish()
    lines = _llmeff_lines(capsys.readouterr().err)
    assert ("llmeff: targets: val_loss<=3.5 not reached (best 4.07 in 3 evaluations); hellaswag/acc_norm>=0.30 "
            "reached at step 12; mmlu/acc>=0.5 not reached (no eval/mmlu/acc logged); arc/acc>=0.5 not reached "
            "(2 evaluations, every one NaN)") in lines
    tags = mlflow.MlflowClient().get_run(mon.run_id).data.tags  # the line says what the tags say
    assert (tags["llmeff.ttq.val_loss_le_3.5"], tags["llmeff.ttq.hellaswag_acc_norm_ge_0.30"]) == (
        "not_reached", "reached_at_step_12")
    assert not any(line.startswith("llmeff: targets:") for line in _llmeff_lines_of(_plain_loop()))


def _llmeff_lines_of(mon) -> list[str]:
    from mlflow_llmeff.monitor.closing import report_lines

    return report_lines(mon, mon.finish())


def test_the_best_value_of_a_target_survives_a_checkpoint():
    from types import SimpleNamespace

    from mlflow_llmeff.monitor.notes import Reached

    t = SimpleNamespace(key="val_loss_le_3.5", op="<=", metric="val_loss")
    r = Reached()
    r.saw(t, 4.2)
    r.saw(t, 4.07)
    again = Reached()
    again.load(r.state(), r.best_state())
    again.saw(t, 4.1)
    assert again.best_state() == {"val_loss_le_3.5": [4.07, 3]}


def test_a_second_rank_prints_no_closing_line(tracking_uri, monkeypatch, capsys):
    # rank 1 of 2 (no process group: every reduction is its own numbers)
    monkeypatch.setattr(collectives, "world_and_rank", lambda: (2, 1))
    mon = _plain_loop()
    assert not mon.is_main
    mon.finish()
    assert _llmeff_lines(capsys.readouterr().err) == []


def test_llmeff_trains_monitor_leaves_the_line_to_the_entrypoint(tracking_uri, capsys):
    mon = _plain_loop(integration="train")  # loop.py prints it on stdout with the rest of its report
    mon.finish()
    assert _llmeff_lines(capsys.readouterr().err) == []


def test_a_failure_while_printing_never_reaches_the_loop(tracking_uri, monkeypatch, capsys):
    def broken(*args, **kwargs):
        raise RuntimeError("no terminal")

    monkeypatch.setattr(closing, "closing_line", broken)
    mon = _plain_loop()
    assert mon.finish()[names.SUM_TOKENS_PER_SEC] == 200.0
    assert _llmeff_lines(capsys.readouterr().err) == []


@pytest.mark.parametrize("silent, lines", [(False, 1), (True, 0)])
def test_autolog_prints_the_line_unless_silent(tracking_uri, capsys, silent, lines):
    from transformers import LlamaForCausalLM

    from mlflow_llmeff.models.build import load_config

    mlflow_llmeff.autolog(log_every_n_steps=2, warmup_steps=1, measure_energy="none", silent=silent)
    torch.manual_seed(0)
    model = LlamaForCausalLM(load_config("llama-tiny"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.arange(16).view(2, 8) + 3
    for _ in range(3):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    run_id = mlflow_llmeff.autologging.active_monitor().run_id
    capsys.readouterr()
    mlflow.end_run()  # the run ends: the summary, then the line
    found = [line for line in _llmeff_lines(capsys.readouterr().err) if line.startswith("llmeff: run ")]
    assert len(found) == lines
    if lines:
        run = mlflow.MlflowClient().get_run(run_id)
        tps = run.data.metrics[names.SUM_TOKENS_PER_SEC]
        assert found[0].startswith(f"llmeff: run {run.info.run_name} ({run_id}): 3 steps, 48 tokens, "
                                   f"{tps:,.0f} tokens/s steady state [no 95% interval: 2 steady steps")
