"""``python -m mlflow_llmeff ...`` runs the ``llmeff`` command line (used by the MLproject)."""

from mlflow_llmeff.cli import run_as_project

run_as_project()
