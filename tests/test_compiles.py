"""torch.compile inside steps (monitor/compiles.py): a recompilation after the warm-up is compile time, counted,
never a steady step; pinned on a fake clock that torch's own compile callbacks move."""

from __future__ import annotations

import mlflow
import pytest
import torch

from mlflow_llmeff import names
from mlflow_llmeff.calc.goodput import TimeLedger, breakdown
from mlflow_llmeff.monitor.compiles import CompileWatch
from mlflow_llmeff.monitor.meter import EfficiencyMonitor
from mlflow_llmeff.testing import FakeClock

from conftest import use_store

COMPILE_S = 5.0  # fake seconds each dynamo compilation takes (the test's callback moves the clock)


@pytest.fixture
def tracking_uri(module_store, monkeypatch):
    yield from use_store(module_store, monkeypatch)


def _badput_sum(summary: dict[str, float]) -> float:
    return sum(summary.get(names.SUM_BADPUT[c], 0.0) for c in names.BADPUT_CATEGORIES)


def _compiled_loop(clock: FakeClock, *, dynamic: bool | None, steps: int = 40, new_len_at: int = 20):
    """``steps`` steps of 1 fake second of a compiled tiny model (backend ``eager``: dynamo runs, nothing
    is generated), sequences of 8 tokens, then of 12 from step ``new_len_at + 1`` on; every dynamo
    compilation moves the fake clock ``COMPILE_S`` inside torch's callback. Returns the monitor's summary."""
    import torch._dynamo
    from torch._dynamo.callback import CallbackTrigger, callback_handler

    torch._dynamo.reset()  # (also clears every compile callback)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(64, 16), torch.nn.Linear(16, 64))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    compiled = torch.compile(model, backend="eager", dynamic=dynamic)
    mon = EfficiencyMonitor(log_every_n_steps=10, warmup_steps=3, clock=clock, measure_energy="none",
                            compile=True, report=False)

    def compiling(args):  # registered after the monitor's: runs once its span is open
        if args.callback_trigger == CallbackTrigger.DYNAMO:
            clock.advance(COMPILE_S)

    callback_handler.register_start_callback(compiling)
    try:
        for i in range(steps):
            ids = torch.randint(0, 64, (2, 8 if i < new_len_at else 12))
            loss = compiled(ids).float().logsumexp(-1).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            clock.advance(1.0)
            mon.step(batch={"input_ids": ids})
        return mon.finish()
    finally:
        callback_handler.remove_start_callback(compiling)


def test_a_recompile_after_warmup_is_compile_time_counted_and_not_a_steady_step(tracking_uri):
    with_recompile = _compiled_loop(FakeClock(), dynamic=False)
    baseline = _compiled_loop(FakeClock(), dynamic=True)  # one dynamic-shape compilation: no recompile
    assert with_recompile[names.SUM_RECOMPILES] == 1.0
    assert baseline[names.SUM_RECOMPILES] == 0.0
    # the first compilation (warm-up) and the recompilation: 5 s each; the 40 steps kept 1 s each
    assert with_recompile[names.SUM_BADPUT["compile"]] == 2 * COMPILE_S
    assert baseline[names.SUM_BADPUT["compile"]] == COMPILE_S
    assert with_recompile[names.SUM_WALL_S] == 40.0 + 2 * COMPILE_S
    # steady figures as without the recompile: tokens/s exactly, no stall, the step time of 1 s
    assert with_recompile[names.SUM_TOKENS_PER_SEC] == baseline[names.SUM_TOKENS_PER_SEC]
    assert with_recompile[names.SUM_TOKENS_PER_SEC] == (17 * 16 + 20 * 24) / 37.0
    assert with_recompile[names.SUM_STALLS] == 0.0
    assert with_recompile[names.SUM_STEP_TIME_P90_S] == 1.0
    # wall = productive + every badput, exactly
    assert with_recompile[names.SUM_GOODPUT] * with_recompile[names.SUM_WALL_S] + _badput_sum(with_recompile) \
        == pytest.approx(with_recompile[names.SUM_WALL_S], abs=1e-12)
    assert with_recompile[names.SUM_GOODPUT] == 40.0 / 50.0


def test_a_real_recompile_is_detected_and_counted(tracking_uri):
    import torch._dynamo

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(64, 16), torch.nn.Linear(16, 64))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    compiled = torch.compile(model, backend="eager", dynamic=False)
    with EfficiencyMonitor(log_every_n_steps=5, warmup_steps=2, measure_energy="none", report=False) as mon:
        for i in range(10):
            ids = torch.randint(0, 64, (2, 8 if i < 5 else 12))
            compiled(ids).float().mean().backward()
            opt.step()
            opt.zero_grad()
            mon.step(batch={"input_ids": ids})
    assert mon.summary[names.SUM_RECOMPILES] == 1.0
    assert mon.summary[names.SUM_BADPUT["compile"]] > 0.0
    run = mlflow.get_run(mon.run_id)
    assert run.data.metrics[names.SUM_RECOMPILES] == 1.0


def test_a_compile_inside_a_pause_stays_in_the_pause_and_is_not_counted():
    clock = FakeClock()
    ledger = TimeLedger(clock)
    ledger.begin()
    watch = CompileWatch(ledger, in_step=lambda: not ledger.paused, after_warmup=lambda: True)
    with ledger.pause("eval"):
        assert watch.started() is False
        clock.advance(3.0)
        assert watch.ended() == 0.0
    assert watch.recompiles == 0 and ledger.seconds["eval"] == 3.0 and ledger.seconds["op_build"] == 0.0


def test_a_compile_inside_a_step_leaves_the_step_its_own_time():
    clock = FakeClock()
    ledger = TimeLedger(clock)
    ledger.begin()
    watch = CompileWatch(ledger, in_step=lambda: not ledger.paused, after_warmup=lambda: True)
    clock.advance(0.25)
    assert watch.started() is True
    assert watch.started() is False  # torch runs its callbacks once for nested compilations
    clock.advance(2.0)
    assert watch.ended() == 2.0
    clock.advance(0.75)
    assert ledger.step_done(warmup=False) == 1.0
    parts = breakdown(ledger.close(), 0, 1, compiled=True)
    assert (parts["compile"], parts["productive"], parts["wall"]) == (2.0, 1.0, 3.0)
    assert watch.recompiles == 1 and watch.seconds == 2.0


def test_lazy_backward_compile_is_timed_but_not_counted():
    clock = FakeClock()
    ledger = TimeLedger(clock)
    ledger.begin()
    watch = CompileWatch(ledger, in_step=lambda: True, after_warmup=lambda: True)
    watch.started(counted=False)
    clock.advance(1.5)
    watch.ended()
    assert (watch.recompiles, watch.seconds) == (0, 1.5)
