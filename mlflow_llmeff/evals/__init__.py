"""MMLU and HellaSwag evaluation with lm-evaluation-harness 0.4.x definitions (``evaluate()``).

Importing this package is cheap; torch loads when :func:`evaluate` runs.
"""

from mlflow_llmeff.evals.api import EvalResult, evaluate, log_to_mlflow, mlflow_metrics
from mlflow_llmeff.evals.targets import Target, parse_targets

__all__ = ["EvalResult", "Target", "evaluate", "log_to_mlflow", "mlflow_metrics", "parse_targets"]
