"""MLflow run context provider: condition tags on runs created while llmeff autolog is enabled."""

from __future__ import annotations


class LlmeffRunContextProvider:
    """Tags runs with measurement conditions, only while ``mlflow_llmeff.autolog()`` is enabled.

    Cheap to construct and never raises into user code (MLflow calls it on every ``start_run``).
    """

    def in_context(self) -> bool:
        return False

    def tags(self) -> dict[str, str]:
        return {}
