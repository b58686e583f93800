"""Evaluation during training: held-out loss and the benchmark tasks, on every rank."""

from __future__ import annotations

import math


def validation_loss(accelerator, model, val, micro_batch_size: int, world: int, rank: int, blocks: int = 0) -> float:
    """Token-weighted mean loss (nats/token) over the held-out blocks; each data-parallel rank scores its strided share.

    Every rank runs the same number of forward passes (a sharded or tensor-parallel model needs
    all ranks in each): a rank whose share is one batch shorter scores its last block once more
    with weight 0. The ranks of a tensor-parallel group share ``rank`` and score the same blocks,
    which scales the summed loss and token count alike and leaves the mean unchanged.

    Args:
        world, rank: data-parallel ranks and this rank's data-parallel index.
        blocks: score the first ``blocks`` held-out blocks only (0: all). The held-out split is a
            seeded draw, so these are the same blocks at every eval of a run, and for a given seed.
    """
    import torch

    model.eval()
    tot = torch.zeros(2, dtype=torch.float64, device=accelerator.device)  # (loss x tokens, tokens)
    scored = min(len(val), blocks) if blocks else len(val)
    idx_all = list(range(rank, scored, world))
    longest = -(-scored // world) if scored else 0  # the largest share, in blocks
    passes = -(-longest // micro_batch_size)
    with torch.no_grad(), accelerator.autocast():
        for i in range(passes):
            idx = idx_all[i * micro_batch_size: (i + 1) * micro_batch_size]
            weight = 1.0 if idx else 0.0
            idx = idx or idx_all[-1:] or [0]
            b = {k: v.to(accelerator.device) for k, v in val[idx].items()}
            out = model(**b)
            n = (b["labels"][:, 1:] != -100).sum() * weight
            tot[0] += out.loss.double() * n
            tot[1] += n
    model.train()
    if accelerator.num_processes > 1:
        tot = accelerator.reduce(tot, reduction="sum")
    return float(tot[0] / tot[1])


def evaluate(cfg, t) -> dict[str, float]:
    """Validation loss and perplexity, then ``cfg.eval_tasks``; results keyed as targets name them.

    Benchmarks run on every rank with the same documents (a sharded or tensor-parallel model needs
    all ranks in each forward; with DDP the ranks compute the same numbers) on the fixed seeded
    subset of ``eval_limit`` documents per task, on the module the strategy gives
    (:meth:`~mlflow_llmeff.parallel.base.Strategy.eval_model`).

    Args:
        cfg: the :class:`~mlflow_llmeff.train.config.TrainConfig`.
        t: the :class:`~mlflow_llmeff.train.setup.Training`.

    Returns:
        ``{"val_loss": ..., "val_perplexity": ..., "mmlu/acc": ..., "hellaswag/acc_norm": ...}``.
    """
    values: dict[str, float] = {}
    if t.data.val is not None:
        vl = validation_loss(t.accelerator, t.model, t.data.val, cfg.micro_batch_size, t.dp_world, t.dp_rank,
                             blocks=cfg.val_blocks)
        values.update({"val_loss": vl, "val_perplexity": math.exp(min(vl, 700))})
    try:
        _benchmarks(cfg, t, values)
    finally:
        t.parallel.after_eval(t.model)
    return values


def _benchmarks(cfg, t, values: dict) -> None:
    if cfg.eval_tasks:
        from mlflow_llmeff.evals.api import evaluate as run_tasks

        eval_model = t.parallel.eval_model(t.accelerator, t.model)
        res = run_tasks(eval_model, t.tokenizer, cfg.eval_tasks, data_dir=cfg.eval_data_dir or None,
                        num_fewshot=cfg.eval_num_fewshot, limit=cfg.eval_limit or None,
                        batch_size=cfg.micro_batch_size, device=t.device, subset_seed=cfg.seed,
                        progress=t.accelerator.is_main_process)
        values.update(res.metrics)
