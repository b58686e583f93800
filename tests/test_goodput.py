"""The explicit clock: every second is credited once, pauses never land in steps, restarts add up."""

import pytest

from mlflow_llmeff import names
from mlflow_llmeff.calc.goodput import TimeLedger, breakdown, goodput
from mlflow_llmeff.testing import FakeClock


def parts_sum(parts: dict[str, float]) -> float:
    return sum(v for k, v in parts.items() if k != "wall")


def test_eval_between_steps_is_eval_time_not_step_time():
    clock = FakeClock(100.0)
    ledger = TimeLedger(clock, started_at=90.0)  # 10 s of set-up before the ledger was built
    ledger.begin()
    steps = []
    for i in range(4):
        clock.t += 1.0
        steps.append(ledger.step_done(warmup=i == 0))
        if i == 1:
            with ledger.pause("eval"):
                clock.t += 30.0
    assert steps == [1.0, 1.0, 1.0, 1.0]  # the 30 s eval is in no step
    clock.t += 0.5  # after the last step: other
    parts = breakdown(ledger.close(), ledger.warmup_steps, ledger.steady_steps)
    assert parts["init"] == 10.0 and parts["eval"] == 30.0 and parts["other"] == 0.5
    assert parts["warmup"] == 0.0 and parts["productive"] == 4.0
    assert parts["wall"] == 44.5 == parts_sum(parts)
    assert goodput(parts) == 4.0 / 44.5


def test_goodput_of_no_wall_time_is_undefined_not_zero():
    ledger = TimeLedger(lambda: 0.0)  # a clock that never moves: no second passed
    parts = breakdown(ledger.close(), ledger.warmup_steps, ledger.steady_steps)
    assert parts["wall"] == 0.0 and parts["productive"] == 0.0
    assert goodput(parts) is None


def test_warmup_excess_is_named_warmup_or_compile():
    clock = FakeClock(100.0)
    ledger = TimeLedger(clock)
    for i, dt in enumerate([9.0, 3.0, 2.0, 2.0, 2.0]):  # 2 warm-up steps (12 s), steady 2 s/step
        clock.t += dt
        ledger.step_done(warmup=i < 2)
    seconds = ledger.close()
    plain = breakdown(seconds, ledger.warmup_steps, ledger.steady_steps)
    assert plain["warmup"] == 12.0 - 2 * 2.0 and "compile" not in plain
    assert plain["productive"] == 2 * 2.0 + 6.0
    compiled = breakdown(seconds, ledger.warmup_steps, ledger.steady_steps, compiled=True)
    assert compiled["compile"] == 8.0 and "warmup" not in compiled
    assert plain["wall"] == 18.0 == parts_sum(plain) == parts_sum(compiled)


def test_data_wait_stays_in_the_step_and_is_carved_out_of_productive():
    clock = FakeClock(100.0)
    ledger = TimeLedger(clock)
    ledger.begin()
    for _ in range(2):
        with ledger.pause("data_wait"):
            clock.t += 0.25
        clock.t += 1.0
        assert ledger.step_done(warmup=False) == 1.25  # throughput sees the wait (wall-clock rate)
    parts = breakdown(ledger.close(), 0, 2)
    assert parts["data_wait"] == 0.5 and parts["productive"] == 2.0
    assert parts["wall"] == 2.5 == parts_sum(parts)


def test_a_step_and_its_data_wait_read_the_clock_once_each_and_credit_the_general_paths_seconds():
    # issue 53: the wait for a batch and the step's end are credited in one frame each (no _credit call); the
    # same seconds as the general path, which a wait nesting an eval and a wait before begin() still take
    clock = FakeClock(100.0)
    reads = []

    def counted():
        reads.append(clock.t)
        return clock()

    ledger = TimeLedger(counted)
    ledger.begin()
    del reads[:]
    with ledger.pause("data_wait"):  # the fast path: a wait inside a step
        clock.t += 0.25
    clock.t += 1.0
    assert ledger.step_done(warmup=True) == 1.25 and len(reads) == 3
    with ledger.pause("data_wait"):  # a nested eval inside the wait: the general path, counted in the wait
        clock.t += 0.5
        with ledger.pause("eval"):
            clock.t += 2.0
    clock.t += 1.0
    assert ledger.step_done(warmup=False) == 3.5
    assert ledger.seconds["warmup_step"] == 1.25 and ledger.seconds["warmup_data_wait"] == 0.25
    assert ledger.seconds["steady_step"] == 3.5 and ledger.seconds["steady_data_wait"] == 2.5
    assert ledger.seconds["eval"] == 0.0 and (ledger.warmup_steps, ledger.steady_steps) == (1, 1)
    early = TimeLedger(FakeClock(100.0), started_at=99.0)  # a wait before begin(): it starts the first step
    with early.pause("data_wait"):
        early.clock.t += 0.5
    early.clock.t += 1.0
    assert early.step_done(warmup=False) == 1.5 and early.seconds["init"] == 1.0
    assert early.seconds["steady_data_wait"] == 0.5


def test_data_wait_inside_an_eval_is_eval_and_nested_pauses_count_once():
    clock = FakeClock(100.0)
    ledger = TimeLedger(clock)
    ledger.begin()
    with ledger.pause("eval"):
        clock.t += 1.0
        with ledger.pause("data_wait"):
            clock.t += 2.0
        with ledger.pause("checkpoint_save"):
            clock.t += 3.0
    parts = breakdown(ledger.close(), 0, 0)
    assert parts["eval"] == 6.0 and parts["data_wait"] == 0.0 and parts["checkpoint_save"] == 0.0


def test_a_step_never_closed_is_other():
    clock = FakeClock(100.0)
    ledger = TimeLedger(clock)
    ledger.begin()
    clock.t += 1.0
    ledger.step_done(warmup=False)
    clock.t += 0.75  # a step that was cut off
    parts = breakdown(ledger.close(), 0, 1)
    assert parts["other"] == 0.75 and parts["productive"] == 1.0


def test_restart_adds_earlier_attempts_and_lost_progress_exactly():
    clock = FakeClock(100.0)
    first = TimeLedger(clock, started_at=95.0)  # 5 s init
    first.begin()
    for i in range(3):
        clock.t += 2.0
        first.step_done(warmup=i == 0)
    with first.pause("checkpoint_save"):
        clock.t += 4.0
        state = first.state_dict()  # taken inside the save: what the checkpoint holds
    # attempt 2 starts later (queue time is no part of the run), 7 s after the checkpoint lost
    clock.t = 1000.0
    second = TimeLedger(clock, started_at=997.0)  # 3 s init
    second.load_state_dict(state)
    second.add("lost_progress", 7.0)
    second.begin()
    with second.pause("checkpoint_load"):
        clock.t += 1.5
    for i in range(2):
        clock.t += 2.0
        second.step_done(warmup=i == 0)
    parts = breakdown(second.close(), second.warmup_steps, second.steady_steps)
    assert (parts["init"], parts["checkpoint_save"], parts["checkpoint_load"], parts["lost_progress"]) == (8.0, 4.0, 1.5, 7.0)
    assert second.warmup_steps == 2 and second.steady_steps == 3
    assert parts["productive"] == 10.0 and parts["warmup"] == 0.0
    assert parts["wall"] == (5 + 6 + 4) + 7 + (3 + 1.5 + 4) == parts_sum(parts)


def test_every_badput_category_has_a_summary_key():
    parts = breakdown(TimeLedger(FakeClock(100.0)).close(), 0, 0)
    assert set(parts) - {"productive", "wall"} <= set(names.BADPUT_CATEGORIES)
    assert names.SUM_BADPUT["warmup"] == "summary/badput_warmup_s"


def test_unknown_pause_category_is_rejected():
    with pytest.raises(ValueError, match="pause category 'compile' is not accepted; use one of: eval"):
        TimeLedger(FakeClock(100.0)).enter("compile")
