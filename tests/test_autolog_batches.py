"""Data waits under autolog() (autologging/batches.py): each batch a loop awaits from a DataLoader is data_wait,
pinned on a fake clock that the loader's collate moves; the patch is gone after autolog(disable=True)."""

from __future__ import annotations

import importlib

import mlflow
import pytest
import torch
from torch.utils.data import DataLoader

import mlflow_llmeff
from mlflow_llmeff import names
from mlflow_llmeff.autologging.batches import TimedBatches
from mlflow_llmeff.monitor.meter import EfficiencyMonitor
from mlflow_llmeff.testing import FakeClock

from conftest import use_store

AL = importlib.import_module("mlflow_llmeff.autologging")
WAIT_S = 0.05  # fake seconds the collate takes per batch
STEP_S = 1.0  # fake seconds of each step's compute


@pytest.fixture
def tracking_uri(module_store, monkeypatch):
    yield from use_store(module_store, monkeypatch)
    mlflow_llmeff.autolog(disable=True)


class TinyLm(torch.nn.Module):
    """Token ids ``(B, T)`` -> logits ``(B, T, 32)``."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.out = torch.nn.Embedding(32, 8), torch.nn.Linear(8, 32)

    def forward(self, input_ids):
        return self.out(self.emb(input_ids))


def _loss(model, ids):
    return torch.nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten())


def test_each_awaited_batch_is_data_wait_on_a_fake_clock(tracking_uri):
    steps, warmup = 20, 2
    clock = FakeClock()
    mlflow_llmeff.autolog(log_every_n_steps=5, warmup_steps=warmup, measure_energy="none")
    torch.manual_seed(0)
    model = TinyLm()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # arms the discovery of the model
    # the loop's monitor on the test's clock (autolog makes its own at the first forward otherwise)
    mon = AL._session().monitor = EfficiencyMonitor(log_every_n_steps=5, warmup_steps=warmup, clock=clock,
                                                    measure_energy="none", integration="pytorch", report=False)

    def collate(rows):  # the loader's work for one batch: 50 ms on the fake clock
        clock.advance(WAIT_S)
        return torch.stack(rows)

    loader = DataLoader([torch.arange(8) % 32 for _ in range(2 * steps)], batch_size=2, collate_fn=collate)
    batches = iter(loader)
    assert isinstance(batches, TimedBatches)
    for ids in batches:
        _loss(model, ids).backward()
        clock.advance(STEP_S)
        opt.step()  # autolog's optimizer hook ends the step
        opt.zero_grad()
    summary = mon.finish()
    assert summary[names.SUM_STEPS] == steps
    assert summary[names.SUM_BADPUT["data_wait"]] == pytest.approx(WAIT_S * steps, abs=1e-12)
    # the wait stays inside the step's seconds (docs/time.md): tokens/s over 1.05 s a steady step, as llmeff train
    assert summary[names.SUM_TOKENS_PER_SEC] == pytest.approx(16 / (STEP_S + WAIT_S), rel=1e-12)
    assert summary[names.SUM_WALL_S] == pytest.approx(steps * (STEP_S + WAIT_S), abs=1e-12)
    productive = summary[names.SUM_GOODPUT] * summary[names.SUM_WALL_S]
    assert productive == pytest.approx(steps * STEP_S, abs=1e-12)
    badput = sum(summary.get(names.SUM_BADPUT[c], 0.0) for c in names.BADPUT_CATEGORIES)
    assert productive + badput == pytest.approx(summary[names.SUM_WALL_S], abs=1e-12)


class Work(torch.utils.data.Dataset):
    """Rows of token ids that take real work to make (a 96 x 96 matmul each)."""

    def __len__(self) -> int:
        return 48

    def __getitem__(self, i: int) -> torch.Tensor:
        m = torch.randn(96, 96, generator=torch.Generator().manual_seed(i))
        return ((m @ m).abs().sum(0)[:8] * 1000).long() % 32


def test_a_real_dataloader_in_a_plain_loop_books_data_wait_and_disable_removes_the_wrapper(tracking_uri):
    original = vars(DataLoader)["__iter__"]
    mlflow_llmeff.autolog(log_every_n_steps=4, warmup_steps=1, measure_energy="none")
    assert vars(DataLoader)["__iter__"] is not original
    torch.manual_seed(0)
    model = TinyLm()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for ids in DataLoader(Work(), batch_size=4):
        _loss(model, ids).backward()
        opt.step()
        opt.zero_grad()
    run_id = AL.active_monitor().run_id
    mlflow.end_run()
    metrics = mlflow.MlflowClient().get_run(run_id).data.metrics
    assert metrics[names.SUM_BADPUT["data_wait"]] > 0.0
    mlflow_llmeff.autolog(disable=True)
    assert vars(DataLoader)["__iter__"] is original
    assert not isinstance(iter(DataLoader(Work(), batch_size=4)), TimedBatches)


def test_a_loader_inside_another_is_timed_once(tracking_uri):
    clock = FakeClock()
    mlflow_llmeff.autolog(measure_energy="none")
    s = AL._session()
    mon = s.monitor = EfficiencyMonitor(warmup_steps=0, clock=clock, measure_energy="none", report=False)

    def collate(rows):
        clock.advance(WAIT_S)
        return torch.stack(rows)

    inner = DataLoader([torch.zeros(2) for _ in range(4)], batch_size=2, collate_fn=collate)
    outer = TimedBatches(iter(inner), s)  # a wrapping loader (Accelerate's shard) over torch's
    for _ in outer:
        clock.advance(STEP_S)
        mon.step(tokens=4, samples=2)
    summary = mon.finish()
    assert summary[names.SUM_BADPUT["data_wait"]] == pytest.approx(2 * WAIT_S, abs=1e-12)


def test_an_accelerate_prepared_loader_is_timed_and_restored(tracking_uri):
    from accelerate import Accelerator

    mlflow_llmeff.autolog(measure_energy="none")
    loader = Accelerator(cpu=True).prepare(DataLoader([torch.zeros(3)] * 4, batch_size=2))
    batches = iter(loader)
    assert isinstance(batches, TimedBatches) and len(list(batches)) == 2
    mlflow_llmeff.autolog(disable=True)
    assert not isinstance(iter(loader), TimedBatches)
