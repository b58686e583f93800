"""``llmeff compare --log-to-mlflow``: the comparison run that holds a report's files."""

from __future__ import annotations

import os

__all__ = ["log_comparison"]


def log_comparison(client, experiment_id: str, tags: dict[str, str], run_ids: list[str], out_dir: str,
                   run_ids_artifact: str) -> str:
    """Log ``out_dir`` as the artifacts of one comparison run with ``tags``, every compared id in the
    artifact ``run_ids_artifact`` (one a line); returns the run's id.

    The run is a new FINISHED run of ``experiment_id``, or under ``mlflow run -e compare`` the launcher's
    run (``MLFLOW_RUN_ID``, which the launcher ends).

    Raises:
        mlflow.exceptions.MlflowException: what the store raises.
    """
    launcher = os.environ.get("MLFLOW_RUN_ID")
    run_id = launcher or client.create_run(experiment_id).info.run_id
    for k, v in tags.items():
        client.set_tag(run_id, k, v)
    client.log_text(run_id, "".join(f"{i}\n" for i in run_ids), run_ids_artifact)
    client.log_artifacts(run_id, os.path.abspath(out_dir))
    if not launcher:
        client.set_terminated(run_id, "FINISHED")
    return run_id
