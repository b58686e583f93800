"""Evaluation during training: held-out loss and the benchmark tasks, on every rank."""

from __future__ import annotations

import math


def validation_loss(accelerator, model, val, micro_batch_size: int, world: int, rank: int, blocks: int = 0) -> float:
    """Token-weighted mean loss (nats/token) over the held-out blocks; each rank scores its strided share.

    Args:
        blocks: score the first ``blocks`` held-out blocks only (0: all). The held-out split is a
            seeded draw, so these are the same blocks at every eval of a run, and for a given seed.
    """
    import torch

    model.eval()
    tot = torch.zeros(2, dtype=torch.float64, device=accelerator.device)  # (loss x tokens, tokens)
    scored = min(len(val), blocks) if blocks else len(val)
    with torch.no_grad(), accelerator.autocast():
        idx_all = list(range(rank, scored, world))
        for i in range(0, len(idx_all), micro_batch_size):
            idx = idx_all[i: i + micro_batch_size]
            b = {k: v.to(accelerator.device) for k, v in val[idx].items()}
            out = model(**b)
            n = (b["labels"][:, 1:] != -100).sum()
            tot[0] += out.loss.double() * n
            tot[1] += n
    model.train()
    if world > 1:
        tot = accelerator.reduce(tot, reduction="sum")
    return float(tot[0] / tot[1])


def evaluate(cfg, t) -> dict[str, float]:
    """Validation loss and perplexity, then ``cfg.eval_tasks``; results keyed as targets name them.

    Benchmarks run on every rank (FSDP needs all ranks in each forward; with DDP the ranks compute
    the same numbers) on the fixed seeded subset of ``eval_limit`` documents per task.

    Args:
        cfg: the :class:`~mlflow_llmeff.train.config.TrainConfig`.
        t: the :class:`~mlflow_llmeff.train.setup.Training`.

    Returns:
        ``{"val_loss": ..., "val_perplexity": ..., "mmlu/acc": ..., "hellaswag/acc_norm": ...}``.
    """
    values: dict[str, float] = {}
    if t.data.val is not None:
        vl = validation_loss(t.accelerator, t.model, t.data.val, cfg.micro_batch_size, t.world, t.rank,
                             blocks=cfg.val_blocks)
        values.update({"val_loss": vl, "val_perplexity": math.exp(min(vl, 700))})
    if cfg.eval_tasks:
        from ..evals.api import evaluate as run_tasks

        eval_model = t.model if cfg.parallelism == "fsdp" else t.accelerator.unwrap_model(t.model)
        res = run_tasks(eval_model, t.tokenizer, cfg.eval_tasks, data_dir=cfg.eval_data_dir or None,
                        num_fewshot=cfg.eval_num_fewshot, limit=cfg.eval_limit or None,
                        batch_size=cfg.micro_batch_size, device=t.device, subset_seed=cfg.seed,
                        progress=t.accelerator.is_main_process)
        values.update(res.metrics)
    return values
