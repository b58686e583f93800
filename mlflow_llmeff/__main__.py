"""``python -m mlflow_llmeff ...`` runs the ``llmeff`` command line (used by the MLproject)."""

from .cli import run_as_project

run_as_project()
