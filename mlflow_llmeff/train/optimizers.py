"""The optimizer ``llmeff train --optimizer NAME`` trains with: built here, checked cheaply before any build.

The choices and what each stores per parameter are :data:`mlflow_llmeff.calc.optimizers.OPTIMIZERS`;
this module turns a name into a ``torch.optim.Optimizer`` over the run's parameter groups
(:func:`build_optimizer`), says in one line why a name cannot run here (:func:`missing`, a package
look-up that imports nothing), and holds the one optimizer no library ships: :class:`AdamWBf16`.
"""

from __future__ import annotations

import os
import shutil
from importlib.util import find_spec  # a module attribute: tests fake a missing package here

import torch

from mlflow_llmeff.calc.optimizers import choice

__all__ = ["AdamWBf16", "build_optimizer", "missing", "compiles_step", "COMPILE_NOTE"]

#: SGD's momentum for ``--optimizer sgd`` (the classic heavy-ball value; calc/optimizers.py counts one buffer).
SGD_MOMENTUM = 0.9

#: The line rank 0 prints before the first optimizer step of an optimizer that compiles its step
#: (``{cls}``: the class name). The seconds fall in a warm-up step, counted as compile badput.
COMPILE_NOTE = ("llmeff: torchao {cls} compiles its step on the first optimizer step (torch.compile; "
                "counted as compile badput, not steady)")


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


def _cpp_compiler() -> str | None:
    """The C++ compiler Inductor would call on CPU (``$CXX``, else ``g++``, ``c++``, ``clang++`` on PATH), or None."""
    cxx = os.environ.get("CXX")
    if cxx and shutil.which(cxx):
        return cxx
    return next((c for c in ("g++", "c++", "clang++") if shutil.which(c)), None)


def compiles_step(name: str) -> bool:
    """True for the choices whose step ``torch.compile`` compiles on its first call (torchao's
    ``AdamW8bit`` / ``AdamW4bit``: 15-90 s on a 2-core CPU, seconds on a GPU)."""
    return choice(name).package == "torchao"


def missing(name: str, *, cuda: bool) -> str | None:
    """Why ``--optimizer name`` cannot run on this machine, in one line, or None when it can.

    Nothing is imported: packages are looked up with ``importlib.util.find_spec``.

    Args:
        name: one of :data:`~mlflow_llmeff.calc.optimizers.OPTIMIZER_NAMES`.
        cuda: the run trains on CUDA devices (torchao's compiled step then needs triton; on CPU it
            needs a C++ compiler, Inductor's CPU backend).

    Returns:
        The reason, naming the package and the pip extra that installs it
        (``pip install 'mlflow-llmeff[torchao]'``, ``[bnb]``), or None.

    Raises:
        ValueError: ``name`` is not an accepted value (the message lists them).
    """
    c = choice(name)
    if c.package == "mlflow_llmeff":  # our own (AdamWBf16): nothing to install
        return None
    if c.package == "torch":
        cls = c.cls.rsplit(".", 1)[1]
        if not hasattr(torch.optim, cls):
            return (f"optimizer={name!r} needs torch.optim.{cls}, which torch {torch.__version__} lacks "
                    "(torch >= 2.5 has it); upgrade torch")
        return None
    module = c.cls.rsplit(".", 2)[0]  # 'torchao', 'bitsandbytes'
    if find_spec(module) is None:
        return (f"optimizer={name!r} needs {c.package}, which is not installed here; "
                f"pip install 'mlflow-llmeff[{c.extra}]'")
    if compiles_step(name):
        if cuda and find_spec("triton") is None:
            return (f"optimizer={name!r} compiles its step with torch.compile, which on CUDA needs triton "
                    "(not installed here); pip install triton")
        if not cuda and _cpp_compiler() is None:
            return (f"optimizer={name!r} compiles its step with torch.compile, which on CPU needs a C++ "
                    "compiler (none of $CXX, g++, c++, clang++ is on PATH); install one, e.g. apt-get install g++")
    return None


def _fused_where_torch_can(param_groups) -> dict:
    """``{"fused": True}`` when torch's fused AdamW kernel can step every parameter, else ``{}`` (torch's default).

    torch picks its fused kernel by default nowhere and its multi-tensor (foreach) path only on CUDA
    (torch/optim/optimizer.py ``_default_to_fused_or_foreach``): on a CPU the default is a Python loop of
    ~12 kernels per tensor. The fused kernel (``torch._fused_adamw_``, CPU and CUDA since torch 2.4) computes
    the same AdamW update (Loshchilov & Hutter 2019) in one pass per tensor and holds no temporaries; it is what
    the best loops use (torchtitan's default ``implementation="fused"``; transformers' ``adamw_torch_fused``,
    the Trainer's default optimizer). Measured on llama-tiny (21 tensors, 125,632 parameters), 2-core CPU:
    3.4 ms a step single-tensor, 1.2 ms fused. Left to torch's default: sharded (DTensor) parameters of
    FSDP2 and tensor parallelism, a non-floating parameter, another device type.
    """
    params = [p for g in param_groups for p in (g["params"] if isinstance(g, dict) else [g])]
    plain = all(type(p) is torch.nn.Parameter or type(p) is torch.Tensor for p in params)
    if params and plain and all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params):
        return {"fused": True}
    return {}


def build_optimizer(name: str, param_groups, *, lr: float, betas: tuple[float, float], eps: float,
                    weight_decay: float) -> torch.optim.Optimizer:
    """The optimizer ``--optimizer name`` stands for, over ``param_groups``.

    Args:
        name: one of :data:`~mlflow_llmeff.calc.optimizers.OPTIMIZER_NAMES`.
        param_groups: parameters or groups (``llmeff train``: decay for matrices, none for vectors).
        lr: learning rate (the scheduler scales it per step).
        betas: AdamW's ``(beta1, beta2)`` (the AdamW family; Adafactor and SGD ignore them).
        eps: AdamW's denominator term (the AdamW family only).
        weight_decay: decoupled weight decay where a group gives none (SGD: L2, added to the gradient).

    Returns:
        ``adamw``: ``torch.optim.AdamW``, its fused kernel where every parameter is a plain floating tensor on
        a CPU or CUDA device (:func:`_fused_where_torch_can`); ``adamw-bf16``: :class:`AdamWBf16`; ``adamw8bit`` /
        ``adamw4bit``: ``torchao.optim.AdamW8bit`` / ``AdamW4bit`` (block-quantized states; tensors
        too small or not divisible by the block keep plain ones); ``bnb-adamw8bit`` /
        ``bnb-paged-adamw8bit``: ``bitsandbytes.optim.AdamW8bit`` / ``PagedAdamW8bit``;
        ``adafactor``: ``torch.optim.Adafactor`` (``lr`` as given, torch's other defaults);
        ``sgd``: ``torch.optim.SGD`` with momentum :data:`SGD_MOMENTUM`.

    Raises:
        ValueError: ``name`` is not accepted (the message lists the accepted ones).
        ImportError: the package is not installed (:func:`missing` says so first, at validation).
    """
    c = choice(name)
    param_groups = list(param_groups)  # a generator (model.parameters()) is read twice below
    adam = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
    if name == "adamw":
        return torch.optim.AdamW(param_groups, **adam, **_fused_where_torch_can(param_groups))
    if name == "adamw-bf16":
        return AdamWBf16(param_groups, **adam)
    if name == "adafactor":
        return torch.optim.Adafactor(param_groups, lr=lr, weight_decay=weight_decay)
    if name == "sgd":
        return torch.optim.SGD(param_groups, lr=lr, momentum=SGD_MOMENTUM, weight_decay=weight_decay)
    if c.package == "torchao":  # imported only when chosen (transformers would import it at every build)
        import torchao.optim as library
    else:
        import bitsandbytes.optim as library
    return getattr(library, c.cls.rsplit(".", 1)[1])(param_groups, **adam)

