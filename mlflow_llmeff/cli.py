"""The ``llmeff`` command line: each command parses options and hands off, nothing else."""

from __future__ import annotations

import click


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="mlflow-llmeff")
def main() -> None:
    """Standard efficiency metrics for LLM training runs in MLflow."""


# Commands are registered below, one block per concern (train, flops/peak/plan, eval, ...).
