"""The training loop's counted work per step (issue 53): what ``llmeff train`` does in a step beyond a bare loop.

Counted, never timed: the calls into Accelerate's wrappers (whose own per-call work a bare loop does not do),
the host reads of tensors the loop makes, and the weights and losses the leaner path trains to, bit for bit
the ones through the wrappers. bench/peers.py times the same loop beside a bare one.
"""

from __future__ import annotations

import importlib.util
import sys

import mlflow
import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from mlflow_llmeff import names
from mlflow_llmeff.train.config import TrainConfig
from mlflow_llmeff.train.loop import run_training

# 4 optimizer steps of 2 micro-batches of 2 synthetic blocks of 16 tokens, clipped AdamW (the defaults)
STEPS, ACCUM, MBS, SEQ = 4, 2, 2, 16


def _config(**kw) -> TrainConfig:
    return TrainConfig(dataset="synthetic", seq_len=SEQ, micro_batch_size=MBS, grad_accum=ACCUM, max_steps=STEPS,
                       warmup_steps=1, log_every_n_steps=1, val_fraction=0, measure_energy="none", **kw)


def _counting(monkeypatch, owner, attr: str, calls: list, name: str) -> None:
    """Wrap ``owner.attr`` so each call appends ``name`` to ``calls``."""
    original = getattr(owner, attr)

    def counted(*a, **k):
        calls.append(name)
        return original(*a, **k)

    monkeypatch.setattr(owner, attr, counted)


def test_a_single_process_step_goes_through_no_accelerate_wrapper(tracking_uri, monkeypatch):
    from accelerate import Accelerator
    from accelerate.optimizer import AcceleratedOptimizer

    calls: list[str] = []
    _counting(monkeypatch, AcceleratedOptimizer, "step", calls, "AcceleratedOptimizer.step")
    _counting(monkeypatch, AcceleratedOptimizer, "zero_grad", calls, "AcceleratedOptimizer.zero_grad")
    _counting(monkeypatch, Accelerator, "backward", calls, "Accelerator.backward")
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",  # Accelerate's step asks for lomo_optim twice a call
                        lambda n, *a: calls.append(f"find_spec({n})") or find_spec(n, *a) if n == "lomo_optim"
                        else find_spec(n, *a))
    stepped = []
    handle = register_optimizer_step_post_hook(lambda opt, a, k: stepped.append(type(opt)))
    try:
        out = run_training(_config())
    finally:
        handle.remove()
    assert calls == ["find_spec(lomo_optim)"]  # once, in set-up (Accelerator.prepare_optimizer); none in a step
    assert stepped == [torch.optim.AdamW] * STEPS  # the torch optimizer itself, once an optimizer step
    assert out["summary"][names.SUM_STEPS] == STEPS


def test_the_loop_reads_one_number_a_micro_batch_from_the_host(tracking_uri, monkeypatch):
    """The loss of each micro-batch (handed to the meter as a number: a CPU tensor the meter would read
    itself) and nothing else from train/loop.py: no read of the gradients, the clipping norm or a flag."""
    reads: list[str] = []
    here = "mlflow_llmeff/train/loop.py"
    for attr in ("item", "tolist", "__int__", "__float__", "__bool__"):
        original = getattr(torch.Tensor, attr)

        def counted(self, *a, _original=original, _attr=attr, **k):
            caller = sys._getframe(1).f_code
            if caller.co_filename.replace("\\", "/").endswith(here):
                reads.append(f"{caller.co_name}:{_attr}")
            return _original(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, attr, counted)
    run_training(_config())
    assert reads == ["_train:item"] * (STEPS * ACCUM)


def test_the_direct_path_trains_the_weights_and_losses_of_accelerates_wrappers(tracking_uri, monkeypatch, tmp_path):
    """Accumulation (the loss / 2 Accelerate's backward divides by), clipping and AdamW, step for step: the
    saved weights and the logged losses are bit for bit those of the path through Accelerate's wrappers."""
    from safetensors.torch import load_file

    from mlflow_llmeff.train import setup

    kept = {}
    for way in ("wrappers", "direct"):
        with monkeypatch.context() as mp:
            if way == "wrappers":
                mp.setattr(setup, "direct_optimizer", lambda *a, **k: None)
            out = run_training(_config(save_model=str(tmp_path / way), run_name=way))
        losses = [m.value for m in mlflow.MlflowClient().get_metric_history(out["run_id"], names.TRAIN_LOSS)]
        kept[way] = losses, load_file(str(tmp_path / way / "model.safetensors"))
    (loss_w, w_w), (loss_d, w_d) = kept["wrappers"], kept["direct"]
    assert len(loss_d) == STEPS and loss_d == loss_w
    assert w_d.keys() == w_w.keys() and all(torch.equal(w_d[k], w_w[k]) for k in w_w)


@pytest.mark.parametrize("strategy, scaler, expected", [("single", None, True), ("ddp", None, True),
                                                         ("single", object(), False), ("fsdp", None, False)])
def test_the_direct_optimizer_only_where_the_wrapper_adds_nothing(strategy, scaler, expected):
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    from mlflow_llmeff.train.setup import direct_optimizer

    inner = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    acc = SimpleNamespace(distributed_type=DistributedType.NO, scaler=scaler)
    assert (direct_optimizer(acc, SimpleNamespace(optimizer=inner), strategy) is inner) is expected
    deepspeed = SimpleNamespace(distributed_type=DistributedType.DEEPSPEED, scaler=None)
    assert direct_optimizer(deepspeed, SimpleNamespace(optimizer=inner), "single") is None
