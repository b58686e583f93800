"""The optimizer ``llmeff train --optimizer NAME`` trains with: built here, checked cheaply before any build.

The choices and what each stores per parameter are :data:`mlflow_llmeff.calc.optimizers.OPTIMIZERS`;
this module turns a name into a ``torch.optim.Optimizer`` over the run's parameter groups
(:func:`build_optimizer`), says in one line why a name cannot run here (:func:`missing`, a package
look-up that imports nothing), and serves the one optimizer no library ships, :class:`AdamWBf16`
(train/adamw_bf16.py). It imports torch only to build: ``llmeff train``'s own process checks the name
and hands off without it (1.8 s of CPU at each launch).
"""

from __future__ import annotations

import os
import shutil
import sys
from importlib.util import find_spec  # a module attribute: tests fake a missing package here

from mlflow_llmeff.calc.optimizers import choice

__all__ = ["AdamWBf16", "build_optimizer", "missing", "compiles_step", "COMPILE_NOTE"]

#: SGD's momentum for ``--optimizer sgd`` (the classic heavy-ball value; calc/optimizers.py counts one buffer).
SGD_MOMENTUM = 0.9

#: The line rank 0 prints before the first optimizer step of an optimizer that compiles its step
#: (``{cls}``: the class name). The seconds fall in a warm-up step, counted as compile badput.
COMPILE_NOTE = ("llmeff: torchao {cls} compiles its step on the first optimizer step (torch.compile; "
                "counted as compile badput, not steady)")


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
        if not _torch_optim_has(cls):
            import torch

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


def _torch_optim_has(cls: str) -> bool:
    """``hasattr(torch.optim, cls)``; before torch is imported, read from the installed ``torch/optim/__init__.py``'s
    ``__all__`` (every optimizer class torch.optim exports is listed there) without importing torch
    (:func:`~mlflow_llmeff.meters.probes.torch_source_constants`); torch is asked when that file cannot be read."""
    if "torch" not in sys.modules:
        from mlflow_llmeff.meters.probes import torch_source_constants

        exported = (torch_source_constants("optim/__init__.py") or {}).get("__all__")
        if isinstance(exported, tuple):
            return cls in exported
    import torch

    return hasattr(torch.optim, cls)


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
    import torch

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
    import torch

    c = choice(name)
    param_groups = list(param_groups)  # a generator (model.parameters()) is read twice below
    adam = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
    if name == "adamw":
        return torch.optim.AdamW(param_groups, **adam, **_fused_where_torch_can(param_groups))
    if name == "adamw-bf16":
        from mlflow_llmeff.train.adamw_bf16 import AdamWBf16

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


def __getattr__(name: str):
    """:class:`~mlflow_llmeff.train.adamw_bf16.AdamWBf16` as ``optimizers.AdamWBf16`` (imported, with torch, on first use)."""
    if name == "AdamWBf16":
        from mlflow_llmeff.train.adamw_bf16 import AdamWBf16

        return AdamWBf16
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
