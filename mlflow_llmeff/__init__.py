"""mlflow_llmeff: standard efficiency metrics and condition tags for LLM training runs in MLflow.

Cheap to import: heavy modules (torch, mlflow, transformers) load only when a function needs them.
``autolog``, ``EfficiencyMonitor``, ``active_monitor`` and ``pause`` are loaded on first access.
"""

__version__ = "0.1.0"

__all__ = ["__version__", "autolog", "EfficiencyMonitor", "active_monitor", "pause"]
_LAZY = {"autolog": "autologging", "active_monitor": "autologging", "pause": "autologging",
         "EfficiencyMonitor": "monitor"}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
