"""DeepSpeed's JIT op build named as such: timed, announced on the terminal, 0 s when cached.

A fake op builder stands in for DeepSpeed's (whose real build compiles C++ for minutes); its
``load`` advances an injected clock by a counted amount, as a build would take.
"""

from __future__ import annotations

import pytest

from mlflow_llmeff.parallel import deepspeed as ds


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class FakeBuilder:
    """What ``ZeRO.build_ops`` uses of DeepSpeed's ``OpBuilder``: name, is_compatible, load."""

    def __init__(self, name: str, clock: FakeClock, seconds: float, compatible: bool = True) -> None:
        self.name, self.clock, self.seconds, self.compatible, self.loads = name, clock, seconds, compatible, 0

    def is_compatible(self, verbose: bool = True) -> bool:
        return self.compatible

    def load(self):
        self.loads += 1
        self.clock.t += self.seconds
        return object()


@pytest.fixture
def said():
    lines: list[str] = []
    return lines, lambda line, flush=False: lines.append(line)


def test_a_first_build_is_timed_and_announced(monkeypatch, said):
    lines, say = said
    monkeypatch.setattr(ds, "_built", lambda name: False)
    clock = FakeClock()
    shm = FakeBuilder("deepspeed_shm_comm", clock, 270.0)
    seconds = ds.ZeRO(2).build_ops(cuda=False, builders=[shm], clock=clock, say=say)
    assert seconds == 270.0 and shm.loads == 1
    assert lines == ["llmeff: building DeepSpeed ops (first run on this machine; later runs reuse the cache) ..."]


def test_a_cached_op_is_loaded_silently_and_counts_no_build_time(monkeypatch, said):
    lines, say = said
    monkeypatch.setattr(ds, "_built", lambda name: True)
    clock = FakeClock()
    shm = FakeBuilder("deepspeed_shm_comm", clock, 0.4)  # importing the cached shared object
    assert ds.ZeRO(3).build_ops(cuda=False, builders=[shm], clock=clock, say=say) == 0.0
    assert shm.loads == 1 and lines == []


def test_only_the_uncached_compatible_ops_count(monkeypatch, said):
    lines, say = said
    monkeypatch.setattr(ds, "_built", lambda name: name == "cached_op")
    clock = FakeClock()
    ops = [FakeBuilder("new_op", clock, 120.0), FakeBuilder("cached_op", clock, 0.5),
           FakeBuilder("cpu_only_op", clock, 99.0, compatible=False), FakeBuilder("other_new_op", clock, 30.0)]
    assert ds.ZeRO(1).build_ops(cuda=False, builders=ops, clock=clock, say=say) == 150.0
    assert [b.loads for b in ops] == [1, 1, 0, 1]  # an incompatible op is skipped, as DeepSpeed skips it
    assert len(lines) == 2  # one line for each op compiled


def test_only_rank_zero_prints_the_line(monkeypatch, said):
    lines, say = said
    monkeypatch.setattr(ds, "_built", lambda name: False)
    monkeypatch.setenv("RANK", "1")
    clock = FakeClock()
    assert ds.ZeRO(2).build_ops(cuda=False, builders=[FakeBuilder("op", clock, 5.0)], clock=clock, say=say) == 5.0
    assert lines == []


def test_cuda_runs_build_no_cpu_op(said):
    lines, say = said
    assert ds.ZeRO(2).build_ops(cuda=True, say=say) == 0.0 and lines == []


def test_the_training_set_up_carries_the_build_seconds():
    from mlflow_llmeff.train.setup import Training

    assert Training(*[None] * 10).op_build_s == 0.0  # strategies without ops: no build time


def test_a_ledger_names_set_up_seconds_as_an_op_build_capped_at_the_set_up_so_far():
    from mlflow_llmeff.calc.goodput import TimeLedger, breakdown
    from mlflow_llmeff.testing import FakeClock

    clock = FakeClock()
    led = TimeLedger(clock, 0.0)
    clock.advance(10.0)
    assert led.carve("op_build", 6.0) == 6.0
    assert led.carve("op_build", 99.0) == 4.0  # only the 4 s of set-up left
    with pytest.raises(ValueError, match="op_build"):
        led.carve("init", 1.0)
    led.begin()
    clock.advance(1.0)
    led.step_done(warmup=False)
    parts = breakdown(led.close(), 0, 1)
    assert (parts["init"], parts["compile"], parts["productive"], parts["wall"]) == (0.0, 10.0, 1.0, 11.0)
    assert "warmup" in parts  # not compiled: the warm-up excess keeps its own name beside the build


def test_the_op_build_is_compile_badput_not_init(tracking_uri):
    from mlflow_llmeff import names
    from mlflow_llmeff.monitor import EfficiencyMonitor
    from mlflow_llmeff.testing import FakeClock

    clock = FakeClock(10.0)  # the process started at 0; 10 s of set-up, 6 of them DeepSpeed's op build
    mon = EfficiencyMonitor(log_every_n_steps=2, warmup_steps=1, clock=clock, started_at=0.0, measure_energy="none")
    assert mon.credit_build(6.0) == 6.0
    for _ in range(4):
        clock.advance(1.0)
        mon.step(tokens=100, samples=4)
    s = mon.finish()
    # wall 14 = init 4 + compile 6 + 4 one-second steps (warm-up step as long as the steady ones: no excess)
    assert (s[names.SUM_BADPUT["init"]], s[names.SUM_BADPUT["compile"]], s[names.SUM_WALL_S]) == (4.0, 6.0, 14.0)
    with pytest.raises(ValueError, match="before the first step"):
        mon.credit_build(1.0)
