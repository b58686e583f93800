"""Parallelism strategies: one small module each (``ddp.py``, ``fsdp.py``, ``tp.py``,
``fsdp_tp.py``, ``deepspeed.py``, ``cp.py``), found here by name.

A module holds ``STRATEGIES``, a tuple of :class:`~mlflow_llmeff.parallel.base.Strategy` objects;
adding a strategy is adding (or extending) one module: how it splits the world, what it sends per
step (``bus_bytes``), the model state a device holds (``model_state_bytes``), how a user's loop shows
it (``wraps``, ``named_by``: :func:`detect`) and how it is applied. Importing this package imports no torch.
"""

from __future__ import annotations

import importlib
import os
import pkgutil

from mlflow_llmeff.parallel.base import Layout, MeshStrategy, Strategy
from mlflow_llmeff.parallel.degrees import Degrees

__all__ = ["Degrees", "Layout", "MeshStrategy", "Strategy", "NAMES", "get", "all_strategies", "detect"]

_INFRA = {"base", "degrees"}


def _discover() -> dict[str, Strategy]:
    found: dict[str, Strategy] = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if info.name in _INFRA or info.name.startswith("_"):
            continue
        for s in getattr(importlib.import_module(f"{__name__}.{info.name}"), "STRATEGIES", ()):
            found[s.name] = s
    return found


_REGISTRY = _discover()
_ORDER = ("single", "ddp", "fsdp", "hsdp", "tp", "fsdp_tp", "cp", "deepspeed_zero1", "deepspeed_zero2", "deepspeed_zero3")
#: Every strategy name, in the order the docs list them (new ones at the end).
NAMES: tuple[str, ...] = tuple([n for n in _ORDER if n in _REGISTRY] + sorted(set(_REGISTRY) - set(_ORDER)))


def get(name: str) -> Strategy:
    """The strategy called ``name``.

    Raises:
        ValueError: for an unknown name (lists the accepted ones).
    """
    if name not in _REGISTRY:
        raise ValueError(f"parallelism={name!r} is not accepted; use one of: auto, {', '.join(NAMES)}")
    return _REGISTRY[name]


def all_strategies() -> list[Strategy]:
    """Every strategy, in :data:`NAMES` order."""
    return [_REGISTRY[n] for n in NAMES]


def detect(model, world: int, environ=None) -> str:
    """The strategy a user's loop runs, by name: the first of the model's wrappers (outermost first,
    through ``torch.compile``'s ``_orig_mod`` and ``.module``, at most 8 deep) a strategy recognises
    (:meth:`Strategy.wraps`), else the one Accelerate's launch environment names
    (:meth:`Strategy.named_by`), else ``ddp`` for several processes and ``single`` for one.

    Args:
        model: the model as the loop holds it (None: the environment only).
        world: processes in all.
        environ: the environment (default ``os.environ``).
    """
    environ = os.environ if environ is None else environ
    m, depth = model, 0
    while m is not None and depth < 8:
        for s in all_strategies():
            if s.wraps(m):
                return s.name
        m, depth = getattr(m, "_orig_mod", None) or getattr(m, "module", None), depth + 1
    for s in all_strategies():
        if s.named_by(environ):
            return s.name
    return "ddp" if world > 1 else "single"
