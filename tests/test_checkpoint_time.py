"""A checkpoint's time is the checkpoint's (train/checkpoint.py ``save``): the wait for the tracking server
between its writes is an ``other`` pause, not ``checkpoint_save``; on an injected clock, a server delayed
1 s per request leaves the save time exactly that of a fast server."""

from __future__ import annotations

import os

import pytest

from mlflow_llmeff.calc.goodput import TimeLedger, breakdown
from mlflow_llmeff.testing import FakeClock
from mlflow_llmeff.train import checkpoint as ckpt
from mlflow_llmeff.train.config import TrainConfig

WRITE_S = 0.3  # what the state write takes on the fake clock


class FakeAccelerator:
    """One process; ``save_state`` writes a file and moves the clock by :data:`WRITE_S`."""

    is_main_process, num_processes = True, 1

    def __init__(self, clock: FakeClock) -> None:
        self.clock, self.barriers = clock, 0

    def wait_for_everyone(self) -> None:
        self.barriers += 1

    def save_state(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "model.bin"), "wb") as f:
            f.write(b"w" * 64)
        self.clock.t += WRITE_S


class SlowServerMonitor:
    """The meter's surface ``save`` uses, on a real :class:`TimeLedger`; ``flush`` waits ``delay_s`` per
    request on the fake clock (the tracking server), ``requests`` of them."""

    run_id = "r" * 32

    def __init__(self, clock: FakeClock, delay_s: float, requests: int = 1) -> None:
        self.clock, self.delay_s, self.requests = clock, delay_s, requests
        self.ledger = TimeLedger(clock, started_at=clock.t)
        self.ledger.begin()

    def pause(self, category: str):
        return self.ledger.pause(category)

    def state_dict(self) -> dict:
        return {"clock": self.ledger.state_dict()}

    def flush(self) -> None:
        self.clock.t += self.delay_s * self.requests


def _save(tmp_path, delay_s: float) -> dict:
    clock = FakeClock(100.0)
    monitor = SlowServerMonitor(clock, delay_s, requests=5)
    cfg = TrainConfig(checkpoint_dir=str(tmp_path / f"ckpt{delay_s:g}"))
    ckpt.save(FakeAccelerator(clock), cfg, 4, monitor, {"dp_world": 1})
    assert ckpt.latest(cfg.checkpoint_dir)[1]["step"] == 4
    return breakdown(monitor.ledger.close(), 0, 0)


def test_a_slow_tracking_server_does_not_lengthen_the_checkpoint(tmp_path):
    fast, slow = _save(tmp_path, 0.0), _save(tmp_path, 1.0)
    # 5 requests x 1 s: the wait is other time, the save time is the write's either way
    assert fast["checkpoint_save"] == pytest.approx(WRITE_S) == slow["checkpoint_save"]
    assert abs(slow["checkpoint_save"] - fast["checkpoint_save"]) < 0.5
    assert slow["other"] == pytest.approx(5.0) and fast["other"] == 0.0
    assert slow["wall"] == pytest.approx(5.0 + WRITE_S)
