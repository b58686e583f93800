"""The one optimizer no library ships, :class:`AdamWBf16` (``llmeff train --optimizer adamw-bf16``), apart from
:mod:`mlflow_llmeff.train.optimizers` so that checking an optimizer's name imports no torch; that module
builds it and serves it as ``mlflow_llmeff.train.optimizers.AdamWBf16``.
"""

from __future__ import annotations

import torch

__all__ = ["AdamWBf16"]


class AdamWBf16(torch.optim.Optimizer):
    """AdamW with both moments stored in bf16 and the update computed in fp32.

    The algorithm is torch's ``torch.optim.AdamW`` (decoupled weight decay, Loshchilov & Hutter,
    "Decoupled Weight Decay Regularization", ICLR 2019, Algorithm 2; bias correction of Kingma & Ba
    2015), step ``t`` for a parameter ``p`` with gradient ``g`` (all in fp32 while computed)::

        p <- p * (1 - lr * weight_decay)
        m <- beta1 * m + (1 - beta1) * g            stored in bf16 afterwards
        v <- beta2 * v + (1 - beta2) * g^2          stored in bf16 afterwards
        p <- p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)

    The step reads the stored bf16 moments, updates them in fp32 with the fp32 gradient, takes the
    parameter update from those fp32 values, and rounds them to bf16 (round-to-nearest-even) only to
    store them. Moments cost 2 + 2 B per parameter instead of 4 + 4 (``calc/optimizers.py``); the
    rounding (at most 2^-8 of each stored moment, bf16's unit roundoff) is the only difference from
    torch's AdamW on fp32 moments. torch's AdamW cannot do this itself: its foreach and single-tensor paths need the
    moments in the parameter's dtype. Weights may be fp32 or bf16 (``--weights bf16``); the update is
    added in fp32 and written back in the weights' dtype.

    Args:
        params: parameters or parameter groups (``weight_decay`` per group, as torch's optimizers).
        lr: learning rate (> 0).
        betas: the moments' decay rates ``(beta1, beta2)``, each in [0, 1).
        eps: added to the denominator (> 0).
        weight_decay: decoupled weight decay per unit of learning rate (>= 0).

    Raises:
        ValueError: a value outside its range (the message names it and the range).
    """

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2) -> None:
        if not lr > 0:
            raise ValueError(f"lr={lr} must be > 0")
        if not all(0.0 <= b < 1.0 for b in betas) or len(betas) != 2:
            raise ValueError(f"betas={betas} must be two values in [0, 1)")
        if not eps > 0:
            raise ValueError(f"eps={eps} must be > 0")
        if weight_decay < 0:
            raise ValueError(f"weight_decay={weight_decay} must be >= 0")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        # torch's load_state_dict casts every floating state tensor to its parameter's dtype: a resumed
        # run would then hold fp32 moments; they go back to bf16 as they are loaded
        self.register_load_state_dict_post_hook(AdamWBf16._moments_to_bf16)

    @staticmethod
    def _moments_to_bf16(optimizer: "AdamWBf16") -> None:
        for state in optimizer.state.values():
            for k in ("exp_avg", "exp_avg_sq"):
                if k in state and state[k].dtype != torch.bfloat16:
                    state[k] = state[k].to(torch.bfloat16)

    @torch.no_grad()
    def step(self, closure=None):
        """One AdamW step over every parameter with a gradient; returns ``closure()``'s loss when given.

        Raises:
            RuntimeError: a sparse gradient (not supported, as torch's AdamW).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("AdamWBf16 does not support sparse gradients")
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.bfloat16, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.bfloat16,
                                                           memory_format=torch.preserve_format)
                state["step"] += 1
                t = float(state["step"])
                g = p.grad.float()                                     # same shape as p, fp32
                m = state["exp_avg"].float().lerp_(g, 1 - beta1)       # beta1 m + (1 - beta1) g
                v = state["exp_avg_sq"].float().mul_(beta2).addcmul_(g, g, value=1 - beta2)
                w = p.float() if p.dtype != torch.float32 else p      # fp32 view of the weights
                w.mul_(1 - lr * wd)
                denom = (v.sqrt() / (1 - beta2 ** t) ** 0.5).add_(eps)
                w.addcdiv_(m, denom, value=-lr / (1 - beta1 ** t))
                if w is not p:
                    p.copy_(w)
                state["exp_avg"].copy_(m)                              # rounded to bf16 to be stored
                state["exp_avg_sq"].copy_(v)
        return loss


AdamWBf16.__module__ = "mlflow_llmeff.train.optimizers"  # its public name, as calc/optimizers.py's table gives it
