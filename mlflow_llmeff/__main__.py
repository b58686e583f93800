"""``python -m mlflow_llmeff ...`` runs the ``llmeff`` command line (used by the MLproject)."""

from .cli import main

main(prog_name="llmeff")
