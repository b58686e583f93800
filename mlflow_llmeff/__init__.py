"""mlflow_llmeff: standard efficiency metrics and condition tags for LLM training runs in MLflow.

Cheap to import: heavy modules (torch, mlflow, transformers) load only when a function needs them.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
