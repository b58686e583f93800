"""The LM head, run where it pays: on scored positions only, late and in large blocks.

:func:`_kept_positions_only` runs a position-wise module (the last decoder layer's feed-forward
block) on the scored positions only; :class:`_Picks` gathers the hidden states of scored positions
from many small forward passes and runs the LM head and log-softmax on many of them at once;
:func:`_picked_sums` sums the picked log-probabilities in float64. Used by
:mod:`mlflow_llmeff.evals.scoring` and :mod:`mlflow_llmeff.evals.prefix_cache`.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch


@contextlib.contextmanager
def _kept_positions_only(mlp: torch.nn.Module, keep: torch.Tensor):
    """Within the block, ``mlp`` (a position-wise module ``(B, T, H) -> (B, T, H)``) runs on the
    ``keep`` positions (bool ``(B, T)``) only; its output elsewhere is zero (never read). Forward
    hooks, removed on exit: the module itself is not changed."""
    def pre(module: Any, args: tuple) -> tuple:
        return (args[0][keep][None],) + tuple(args[1:])

    def post(module: Any, args: tuple, out: Any) -> torch.Tensor:
        if not isinstance(out, torch.Tensor):
            raise TypeError("the feed-forward module returned no tensor")
        full = torch.zeros(keep.shape + out.shape[-1:], dtype=out.dtype, device=out.device)
        full[keep] = out[0]
        return full

    handles = [mlp.register_forward_pre_hook(pre), mlp.register_forward_hook(post)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


class _Picks:
    """Log-likelihood terms waiting for their LM head: hidden states of scored positions are
    gathered from many small forward passes (short HellaSwag tails) and the LM head and
    log-softmax run on ``block_rows`` of them at once. On this project's 2-core CPU a 32k-vocabulary
    head ran at 79 GFLOP/s on 264 rows and 110 GFLOP/s on 2,048 (``bench/evals.py``). Without a
    head split (see ``LoglikelihoodScorer._head_split``) the states given are logits and are scored
    at once.

    Args:
        head: the LM head (``(N, H) -> (N, V)``), or None when ``add`` receives logits.
        block_rows: rows per LM-head call (memory: ``block_rows * V`` float32 twice).
    """

    def __init__(self, head: Any, block_rows: int) -> None:
        self.head, self.block_rows = head, block_rows
        self.states: list[torch.Tensor] = []
        self.rows: list[int] = []
        self.targets: list[int] = []
        self.counts: list[int] = []
        self.owners: list[tuple[list[float], int]] = []
        self.n = 0

    def add(self, states: torch.Tensor, rows: list[int], targets: list[int], counts: list[int],
            owners: list[tuple[list[float], int]]) -> None:
        """``states`` ``(N, H or V)``; ``rows``/``targets`` aligned (row of ``states``, token id);
        ``counts[k]`` consecutive entries are summed into ``owners[k] = (results row, choice)``."""
        self.states.append(states)
        self.rows += [self.n + r for r in rows]
        self.targets += targets
        self.counts += counts
        self.owners += owners
        self.n += states.shape[0]
        if self.head is None or self.n >= self.block_rows:
            self.flush()

    def flush(self) -> None:
        """Run the LM head on what is waiting and add every sum to its owner."""
        if not self.owners:
            self.states, self.n = [], 0
            return
        states = self.states[0] if len(self.states) == 1 else torch.cat(self.states)
        logits = states if self.head is None else self.head(states)
        dev = logits.device
        slot = torch.repeat_interleave(torch.arange(len(self.counts)), torch.tensor(self.counts))
        sums = _picked_sums(logits, torch.tensor(self.rows, device=dev), torch.tensor(self.targets, device=dev),
                            slot.to(dev), len(self.counts))
        for (res, i), v in zip(self.owners, sums):
            res[i] += v
        self.states, self.rows, self.targets, self.counts, self.owners, self.n = [], [], [], [], [], 0


def _picked_sums(logits: torch.Tensor, rows: torch.Tensor, targets: torch.Tensor, slot: torch.Tensor,
                 n_slots: int) -> list[float]:
    """Per slot, the float64 sum of ``log_softmax(logits)[rows, targets]`` over its entries.

    ``logits`` is ``(N, V)``; ``rows``, ``targets`` and ``slot`` are aligned 1D index tensors.
    Log-softmax in float32 as the harness computes it, then only the picked entries are read (a
    fused log-softmax measured faster on CPU than ``logit - logsumexp``, which makes three passes).
    """
    picked = torch.log_softmax(logits.float(), dim=-1)[rows, targets].double()
    return torch.zeros(n_slots, dtype=torch.float64, device=logits.device).index_add_(0, slot, picked).tolist()
