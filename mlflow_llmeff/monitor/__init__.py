"""The one meter every path reports through: :class:`EfficiencyMonitor` and its components.

``from mlflow_llmeff.monitor import EfficiencyMonitor`` is the documented path; the class lives in
:mod:`mlflow_llmeff.monitor.meter` and is loaded on first access (the components import torch lazily).
"""

__all__ = ["EfficiencyMonitor", "PRECISIONS", "unwrap_model", "infer_precision", "infer_strategy"]


def __getattr__(name):
    if name in __all__:
        from . import meter

        return getattr(meter, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
