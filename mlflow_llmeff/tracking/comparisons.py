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

    Written through :class:`~mlflow_llmeff.tracking.writer.RunWriter`, waiting at most the delivery wait.

    Raises:
        mlflow_llmeff.tracking.delivery.Unreachable: the server did not take it all (it waits in the outbox;
            the message says where).
        mlflow.exceptions.MlflowException: a refusal of the store.
    """
    from mlflow_llmeff.tracking import delivery
    from mlflow_llmeff.tracking.writer import RunWriter

    launcher = os.environ.get("MLFLOW_RUN_ID")
    writer = (RunWriter.attach(launcher, client=client) if launcher else
              RunWriter.create(tags.get("mlflow.runName", ""), experiment_id=experiment_id, client=client))
    writer.set_tags(tags, synchronous=False)
    writer.write_text("".join(f"{i}\n" for i in run_ids), run_ids_artifact)
    writer.log_folder(os.path.abspath(out_dir))
    if not writer.end(None if launcher else "FINISHED"):
        raise delivery.Unreachable(f"{writer.unanswered_reason or 'the tracking server did not take the comparison run'}; "
                                   f"the comparison run waits in {writer.spilled_to} (llmeff sync {writer.outbox_dir})")
    return writer.run_id
