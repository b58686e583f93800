"""The worker functions test_ray_train.py hands Ray Train, in a module of their own: Ray's worker processes
import the module a function is defined in to unpickle it, and this one costs them only torch (which the
worker function needs anyway), not the test module's pytest, conftest and mlflow imports."""

from __future__ import annotations

import os
import signal
import tempfile

import torch


class Tiny(torch.nn.Module):
    """The smallest causal LM the hooks count: ``forward(input_ids, labels)`` returning ``{"loss"}``."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.out = torch.nn.Embedding(64, 16), torch.nn.Linear(16, 64)

    def forward(self, input_ids, attention_mask=None, labels=None):
        logits = self.out(self.emb(input_ids))
        return {"loss": torch.nn.functional.cross_entropy(logits.view(-1, 64), labels.view(-1)), "logits": logits}


def train_loop(config):
    """Ray Train's worker loop: autolog, a DDP model, ``config["steps"]`` steps, rank 0's checkpoint after
    step 2; with ``config["kill"]``, rank 1 of the first attempt dies (SIGKILL) before step 4."""
    import ray.train
    import ray.train.torch

    import mlflow_llmeff

    mlflow_llmeff.autolog(log_every_n_steps=1, warmup_steps=0, measure_energy="none")
    torch.manual_seed(0)
    model = ray.train.torch.prepare_model(Tiny())
    inner = getattr(model, "module", model)  # one worker: prepare_model wraps no DDP
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rank = ray.train.get_context().get_world_rank()
    ckpt, start = ray.train.get_checkpoint(), 0
    if ckpt is not None:
        with ckpt.as_directory() as folder:
            saved = torch.load(os.path.join(folder, "model.pt"))
        inner.load_state_dict(saved["model"])
        start = saved["step"]
    for step in range(start, config["steps"]):
        if config["kill"] and ckpt is None and step == 3 and rank == 1:
            ray.train.get_all_reported_checkpoints()  # Ray holds the checkpoint before the worker dies
            os.kill(os.getpid(), signal.SIGKILL)
        ids = torch.randint(0, 64, (2, 8 + rank))
        model(input_ids=ids, labels=ids)["loss"].backward()
        opt.step()
        opt.zero_grad()
        if step == 1:
            with tempfile.TemporaryDirectory() as folder:
                if rank == 0:
                    torch.save({"model": inner.state_dict(), "step": step + 1}, os.path.join(folder, "model.pt"))
                ray.train.report({"step": step + 1},
                                 checkpoint=ray.train.Checkpoint.from_directory(folder) if rank == 0 else None)


def killed_once(config):
    """:func:`mlflow_llmeff.train.ray.train_loop_per_worker`, whose first attempt is SIGKILLed after step
    ``config["kill_at"]`` (train/faults.py), before its first checkpoint."""
    from mlflow_llmeff.train.faults import ENV
    from mlflow_llmeff.train.ray import train_loop_per_worker

    marker = config.pop("marker")
    if not os.path.exists(marker):
        open(marker, "w").close()
        os.environ[ENV["kill_at_step"]] = str(config.pop("kill_at"))
    else:
        os.environ.pop(ENV["kill_at_step"], None)
    train_loop_per_worker(config)
