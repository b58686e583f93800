"""Run a torch elastic launcher (``accelerate launch``, ``torchrun``) in this process and keep what it
knows of its workers' ends: ``python -m mlflow_llmeff.train.elastic FILE MODULE ARG...``.

When a worker fails, torch elastic's agent stops the others (SIGTERM, then SIGKILL) and raises
``torch.distributed.elastic.multiprocessing.errors.ChildFailedError``, whose ``failures`` map each
failed global rank to a ``ProcessFailure`` (its exit code, negative for a signal, the signal's name,
the time it was seen, the message of its error file when it left one). The launcher process prints
it and exits 1, so its parent learns only "exit 1". This wrapper writes those failures as JSON to
``FILE`` (temp file + rename) before the error goes on as before, so ``llmeff train`` can say which
rank was lost and how (:func:`mlflow_llmeff.train.job.launch_ending`; ``docs/time.md``).
"""

from __future__ import annotations

import json
import os
import runpy
import sys

from mlflow_llmeff.names import shorten

NO_FILE = "-"  # FILE when nothing is to be kept (no job folder)


def failure_records(error: BaseException) -> list[dict]:
    """The failed workers of a ``ChildFailedError`` (anything with ``failures``), first seen first.

    Each record: ``rank`` (global), ``local_rank``, ``pid``, ``exitcode`` (negative: killed by that
    signal), ``signal`` (its name, or None), ``unix`` (when the agent saw it), ``message`` (the
    worker's error file, 300 characters at most). Empty for any other error.
    """
    failures = getattr(error, "failures", None)
    if not isinstance(failures, dict):
        return []
    out = []
    for rank, f in failures.items():
        try:
            exitcode = int(getattr(f, "exitcode", 0))
            sig = f.signal_name() if exitcode < 0 else None
        except (TypeError, ValueError):
            exitcode, sig = 0, None
        sig = None if sig in (None, "<N/A>") else sig
        out.append({"rank": int(rank), "local_rank": getattr(f, "local_rank", None), "pid": getattr(f, "pid", None),
                    "exitcode": exitcode, "signal": sig, "unix": float(getattr(f, "timestamp", 0) or 0),
                    "message": shorten(str(getattr(f, "message", "") or ""), 300)})
    return sorted(out, key=lambda r: (r["unix"], r["rank"]))


def write_failures(path: str, records: list[dict]) -> None:
    """Write ``records`` to ``path`` as ``{"failures": [...]}`` (temp file + rename; never raises)."""
    try:
        tmp = path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump({"failures": records}, f, indent=1)
        os.replace(tmp, path)
    except OSError:
        pass


def read_failures(path: str) -> list[dict]:
    """The records :func:`write_failures` left in ``path`` (empty when there are none)."""
    try:
        with open(path, encoding="utf-8") as f:
            return list(json.load(f).get("failures", []))
    except (OSError, ValueError, AttributeError):
        return []


def main(argv: list[str] | None = None) -> None:
    """``FILE MODULE ARG...``: run ``python -m MODULE ARG...`` here, recording its workers' failures in
    FILE (``-``: nowhere); a normal end or ``sys.exit`` ends this process at once with its code
    (:func:`mlflow_llmeff.monitor.lifecycle.exit_now`), an error goes on as before (exit 1)."""
    path, module, *args = sys.argv[1:] if argv is None else argv
    sys.argv = [module, *args]
    import signal

    # the scheduler's warning (SLURM --signal=USR1@N) reaches every process of the step: the agent ignores it
    # (its default action would end the agent and with it the workers); the workers and llmeff train act on it
    # (train/preempt.py)
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    code = 0
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException as e:
        records = failure_records(e)
        if records and path != NO_FILE:
            write_failures(path, records)
        raise
    from mlflow_llmeff.monitor.lifecycle import exit_now

    exit_now(code)  # the workers are gone: return to llmeff train now, not after torch's module teardown


if __name__ == "__main__":
    main()
