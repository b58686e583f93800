import pytest

from mlflow_llmeff.goodput import TimeAccount, goodput


class FakeClock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_breakdown_adds_up_to_wall_time():
    clock = FakeClock()
    acc = TimeAccount(clock=clock)
    acc.start()
    acc.add("init", 10.0)
    acc.add("eval", 5.0)
    acc.add("data_wait", 2.0)
    clock.t += 100.0
    # 80 s in steps: 3 warm-up steps took 12 s, steady steps take 1 s -> 9 s compile overhead.
    bd = acc.breakdown(step_s=80.0, warmup_s=12.0, warmup_steps=3, steady_step_s=1.0)
    assert bd["compile"] == 9.0
    assert bd["productive"] == 80.0 - 9.0 - 2.0
    assert bd["other"] == 100.0 - 69.0 - (10 + 5 + 2 + 9)
    assert sum(bd[c] for c in ("init", "compile", "data_wait", "eval", "checkpoint_save", "checkpoint_load",
                               "lost_progress", "other")) + bd["productive"] == pytest.approx(bd["wall"])
    assert goodput(bd) == 0.69


def test_resume_carries_previous_wall_time():
    clock = FakeClock()
    a = TimeAccount(clock=clock)
    a.start()
    clock.t += 50.0
    b = TimeAccount(clock=clock)
    b.load_state_dict(a.state_dict())
    b.start()
    clock.t += 25.0
    assert b.wall_s() == 75.0


def test_unknown_category_rejected():
    with pytest.raises(ValueError, match="category 'compile' is not accepted"):
        TimeAccount().add("compile", 1.0)
