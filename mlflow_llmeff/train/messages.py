"""How the training entrypoint's messages name a setting: ``-P name=value`` under ``mlflow run``,
``--name value`` on the ``llmeff`` command line.

Used by the launcher (:mod:`mlflow_llmeff.train.launch`) and the training loop
(:mod:`mlflow_llmeff.train.loop`), below both.
"""

from __future__ import annotations

import os

__all__ = ["message_style"]


def message_style() -> str:
    """``mlflow`` under ``mlflow run`` (messages speak of ``-P name=value``), else ``cli``."""
    return "mlflow" if os.environ.get("MLFLOW_RUN_ID") else "cli"
