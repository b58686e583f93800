"""The meter's counted work per step (issue 53): what ``EfficiencyMonitor`` does with a batch and at a logged
step, counted, never timed (bench/overhead.py times it beside its A/A floor).

- The loss-bearing tokens of a micro-batch are compared once: ``llmeff train`` counts them for its loss
  weights (train/batches.py) and hands the count to the meter (``count(batch, loss_tokens=n)``), which then
  reads no label; without the count (autolog, a user's loop) the meter reads the labels itself, as before.
"""

from __future__ import annotations

import sys

import pytest
import torch

from mlflow_llmeff import names
from mlflow_llmeff.monitor.counting import BatchCounter, StepTally
from mlflow_llmeff.monitor.meter import EfficiencyMonitor

# value reads of a tensor (what comparing its labels takes), as torch dispatches them; metadata (shape, dim,
# dtype, is_cpu, _version) is not a read
_READS = {"__getitem__", "detach", "stack", "ne", "__ne__", "eq", "__eq__", "sum", "numpy", "to", "long", "clone",
          "masked_fill", "reshape", "unsqueeze", "__array__", "item", "tolist"}


class Watched(torch.Tensor):
    """A label tensor that records every value read made on it, with the file that made it."""

    reads: list[tuple[str, str]] = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in _READS:
            cls.reads.append((name, sys._getframe(1).f_code.co_filename.replace("\\", "/")))
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))


def _labels_reads(where: str) -> list[str]:
    return [name for name, file in Watched.reads if where in file]


def _batch(watched: bool = True):
    """A (2, 6) micro-batch with 8 loss-bearing tokens: row 0's shifted labels [6, -100, 7, -100, 8] hold 3,
    row 1's 5; one padded position in row 0's mask (11 real tokens)."""
    labels = torch.tensor([[5, 6, -100, 7, -100, 8], [1, 2, 3, 4, 5, 6]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]])
    return {"input_ids": labels.clamp(min=0), "attention_mask": mask,
            "labels": labels.as_subclass(Watched) if watched else labels}


LOSS_TOKENS_A_BATCH = 3 + 5


@pytest.mark.parametrize("defer", [True, False])
def test_a_given_loss_count_is_added_and_the_labels_are_not_read(defer):
    counter = BatchCounter()
    Watched.reads = []
    for _ in range(5):  # a window of 5 micro-batches: deferred to the edge, or read at once
        b = _batch()
        counter.add(b["input_ids"], b["attention_mask"], b["labels"], loss_tokens=LOSS_TOKENS_A_BATCH)
        if not defer:
            counter.defer = False
    counts = counter.take(1)
    assert _labels_reads("mlflow_llmeff/") == []
    assert counts.loss_tokens == 5 * LOSS_TOKENS_A_BATCH == 40
    assert counts.tokens == 5 * 11 and counts.samples == 10 and counts.padded_tokens == 60
    assert counts.sum_len_sq == 5 * (5 * 5 + 6 * 6)


def test_without_a_count_the_meter_reads_the_labels_and_finds_the_same_total():
    counter = BatchCounter()
    Watched.reads = []
    for _ in range(5):
        b = _batch()
        counter.add(b["input_ids"], b["attention_mask"], b["labels"])
    assert counter.take(1).loss_tokens == 40
    assert _labels_reads("mlflow_llmeff/monitor/counting.py")  # the old path compares them itself


def test_a_given_count_on_a_packed_batch_replaces_the_labels_comparison():
    b = _batch()
    pos = torch.tensor([[0, 1, 2, 0, 1, 2], [0, 1, 2, 3, 4, 5]])
    counter = BatchCounter()
    Watched.reads = []
    counter.add(b["input_ids"], None, b["labels"], position_ids=pos, loss_tokens=torch.tensor(LOSS_TOKENS_A_BATCH))
    c = counter.take(1)
    assert _labels_reads("mlflow_llmeff/") == []
    assert (c.loss_tokens, c.tokens, c.samples, c.sum_len_sq) == (8, 12, 3, 9 + 9 + 36)


def test_step_tally_hands_the_count_through():
    tally = StepTally()
    Watched.reads = []
    tally.add_batch(_batch(), loss_tokens=LOSS_TOKENS_A_BATCH)
    tally.add_batch(_batch(), loss_tokens=LOSS_TOKENS_A_BATCH)
    assert tally.take(1).loss_tokens == 16
    assert _labels_reads("mlflow_llmeff/") == []


def test_the_monitor_logs_the_hand_computed_loss_tokens_with_and_without_the_count(tracking_uri):
    got = {}
    for given in (True, False):
        Watched.reads = []
        mon = EfficiencyMonitor(log_every_n_steps=2, warmup_steps=0, measure_energy="none", report=False)
        for _ in range(4):  # 4 steps of 2 micro-batches
            for _ in range(2):
                mon.count(_batch(), loss_tokens=LOSS_TOKENS_A_BATCH if given else None)
            mon.step()
        got[given] = (mon.latest_metrics[names.TRAIN_LOSS_TOKENS], mon.latest_metrics[names.TRAIN_TOKENS],
                      len(_labels_reads("mlflow_llmeff/")))
        mon.finish()
    assert got[True][:2] == got[False][:2] == (8 * LOSS_TOKENS_A_BATCH, 8 * 11) == (64, 88)
    assert got[True][2] == 0 and got[False][2] > 0


def test_llmeff_train_compares_each_micro_batchs_labels_once(tracking_uri, monkeypatch):
    """The loop's one comparison a micro-batch (train/batches.py, for its loss weights) and none in the meter;
    train/loss_tokens = steps x micro-batches x B x (T - 1) (synthetic full blocks: every label counts)."""
    from mlflow_llmeff.train import batches
    from mlflow_llmeff.train.config import TrainConfig
    from mlflow_llmeff.train.loop import run_training

    steps, accum, mbs, seq = 3, 2, 2, 16
    original = batches.BatchStream.__next__

    def watched_next(self):
        b = original(self)
        b["labels"] = b["labels"].as_subclass(Watched)
        return b

    monkeypatch.setattr(batches.BatchStream, "__next__", watched_next)
    Watched.reads = []
    out = run_training(TrainConfig(dataset="synthetic", seq_len=seq, micro_batch_size=mbs, grad_accum=accum,
                                   max_steps=steps, warmup_steps=1, log_every_n_steps=1, val_fraction=0,
                                   measure_energy="none"))
    assert _labels_reads("mlflow_llmeff/monitor/") == []
    assert _labels_reads("mlflow_llmeff/train/batches.py") == ["__getitem__"] * (steps * accum)  # labels[..., 1:]
    import mlflow

    hist = mlflow.MlflowClient().get_metric_history(out["run_id"], names.TRAIN_LOSS_TOKENS)
    assert max(m.value for m in hist) == steps * accum * mbs * (seq - 1) == 180


def test_the_scripts_commit_is_read_once_a_process(monkeypatch):
    """Set-up and the first step's renaming both ask for the commit: one ``git`` subprocess, not one a call."""
    from mlflow_llmeff.meters import probes
    from mlflow_llmeff.monitor import conditions

    calls = []
    monkeypatch.setattr(conditions, "_COMMITS", {})
    monkeypatch.setattr(probes, "git_commit", lambda d: calls.append(d) or "abc123")
    assert [conditions.script_git_commit() for _ in range(3)] == ["abc123"] * 3
    assert len(calls) == 1
