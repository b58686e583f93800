"""mlflow_llmeff: standard efficiency metrics and condition tags for LLM training runs in MLflow.

Cheap to import: heavy modules (torch, mlflow, transformers) load only when a function needs them.
``autolog`` and ``EfficiencyMonitor`` are loaded on first access.
"""

__version__ = "0.1.0"

__all__ = ["__version__", "autolog", "EfficiencyMonitor"]


def __getattr__(name):
    if name == "autolog":
        from .autologging import autolog

        return autolog
    if name == "EfficiencyMonitor":
        from .monitor import EfficiencyMonitor

        return EfficiencyMonitor
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | {"autolog", "EfficiencyMonitor"})
