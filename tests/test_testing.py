"""The shipped fakes (mlflow_llmeff.testing): the injected clock, and the fakes it gathers from the package."""

from __future__ import annotations

import pytest

from mlflow_llmeff import testing
from mlflow_llmeff.meters.carbon import FakeCarbonTracker
from mlflow_llmeff.meters.energy import FakeEnergyMeter


def test_fake_clock_moves_only_when_the_test_moves_it():
    clock = testing.FakeClock(100.0)
    assert (clock(), clock.now) == (100.0, 100.0)
    assert clock.advance(2.5) == 102.5
    clock.t = 7.0
    assert clock() == 7.0


def test_fake_clock_refuses_to_go_back():
    with pytest.raises(ValueError, match="dt=-1.0 is negative"):
        testing.FakeClock().advance(-1.0)


def test_testing_serves_the_package_fakes_themselves():
    assert (testing.FakeEnergyMeter, testing.FakeCarbonTracker) == (FakeEnergyMeter, FakeCarbonTracker)
