"""Scaling sweep: the repository's ``main`` entry point at several process counts, then ``llmeff compare``.

Run through ``mlflow run projects/scaling-sweep --env-manager local``: this process holds the parent
run (``MLFLOW_RUN_ID``); each process count is a child run of it (MLflow sets ``mlflow.parentRunId``
when a project is run inside an active run), with the same model, sequence length and micro-batch
per device, so the children differ only in device count (weak scaling). The comparison of the
children is logged as the parent's artifacts, and its scaling efficiency printed.

MLflow starts this script in ``projects/scaling-sweep/``, not where the user typed ``mlflow run``; so a
relative tracking store (``sqlite:///mlflow.db``) is resolved to the store that holds the parent run
(:func:`mlflow_llmeff.tracking.store.project_store`) and a relative ``--out`` against the user's folder
(:func:`mlflow_llmeff.tracking.store.launcher_folder`); the children get the absolute store.

Every process of every child runs with the same CPU threads (``OMP_NUM_THREADS`` and ``MKL_NUM_THREADS``,
torch's intra-op threads): a multi-process launch gives each process 1 unless set, a single process keeps
all the CPUs, and ``llmeff compare`` computes no scaling efficiency between runs whose recorded
``llmeff.threads`` differ. Torch's inter-op pool has no variable: its default (the machine's cores) is the
same in every process of one machine, and each run records it in the same tag.
"""

from __future__ import annotations

import argparse
import os
import pathlib

REPO = pathlib.Path(__file__).resolve().parents[2]


def process_counts(text: str) -> list[int]:
    """``"1,2"`` -> ``[1, 2]``; ``auto`` = 1, 2 on CPU, powers of two up to the GPUs present (at most 8)."""
    if text != "auto":
        counts = [int(x) for x in text.split(",") if x.strip()]
        if not counts or min(counts) < 1:
            raise SystemExit(f"process_counts={text!r} is not accepted; give counts >= 1, e.g. 1,2")
        return counts
    import torch

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return [c for c in (1, 2, 4, 8) if c <= n] if n else [1, 2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--process-counts", default="auto")
    p.add_argument("--model", default="llama-tiny")
    for name, typ, default in (("max-steps", int, 30), ("seq-len", int, 128), ("micro-batch-size", int, 8),
                               ("warmup-steps", int, 3), ("log-every-n-steps", int, 5), ("val-blocks", int, 32)):
        p.add_argument(f"--{name}", type=lambda v, t=typ: t(float(v)), default=default)
    p.add_argument("--device-hour-usd", type=float, default=0.0)
    p.add_argument("--threads", type=lambda v: int(float(v)), default=0)
    p.add_argument("--out", default="scaling-report")
    a = p.parse_args()

    import mlflow
    from mlflow.exceptions import MlflowException
    from mlflow.projects import ExecutionException

    from mlflow_llmeff.report.compare import compare
    from mlflow_llmeff.report.render import scaling_lines
    from mlflow_llmeff.tracking.store import StoreNotFound, launcher_folder, project_store

    try:
        uri = project_store()
    except StoreNotFound as e:
        raise SystemExit(f"scaling-sweep: {e}") from None
    os.environ["MLFLOW_TRACKING_URI"] = uri  # the children (their own folders) open this same store
    mlflow.set_tracking_uri(uri)
    out = os.path.join(launcher_folder(), a.out)  # an absolute --out stays as given
    counts = process_counts(a.process_counts)
    from mlflow_llmeff.train.launch import threads_per_process

    try:
        threads, why = threads_per_process(counts, a.threads)
    except ValueError as e:
        raise SystemExit(f"scaling-sweep: {e}") from None
    why = "threads parameter" if why == "given" else why
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(threads)
    print(f"scaling-sweep: {threads} intra-op thread(s) in every process of every child ({why})", flush=True)
    run_id = os.environ.get("MLFLOW_RUN_ID")
    try:
        parent = mlflow.start_run(run_id=run_id)
    except (MlflowException, OSError) as e:  # e.g. 'Run with id=... not found', a path through a file
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise SystemExit(f"scaling-sweep: cannot open {'run ' + run_id if run_id else 'a run'} in tracking store "
                         f"{uri}: {first}") from None
    with parent:
        mlflow.set_tag("mlflow.runName", f"scaling-sweep-{a.model}")
        exp_id = parent.info.experiment_id
        for n in counts:
            print(f"scaling-sweep: {n} process(es)", flush=True)
            try:
                mlflow.projects.run(str(REPO), entry_point="main", experiment_id=exp_id, env_manager="local",
                                    synchronous=True, parameters={
                                        "model": a.model, "num_processes": n, "max_steps": a.max_steps,
                                        "seq_len": a.seq_len, "micro_batch_size": a.micro_batch_size,
                                        "warmup_steps": a.warmup_steps, "log_every_n_steps": a.log_every_n_steps,
                                        "val_blocks": a.val_blocks, "device_hour_usd": a.device_hour_usd})
            except ExecutionException as e:
                raise SystemExit(f"scaling-sweep: the {n}-process child failed ({e}); its lines are above") from None
        exp = mlflow.MlflowClient().get_experiment(exp_id)
        rep, _, _ = compare(exp.name, filter_string=f"tags.mlflow.parentRunId = '{parent.info.run_id}'",
                            out_dir=out)
        mlflow.log_artifacts(out, "scaling-report")
        print(f"scaling-sweep: report in {out} (and the parent run's artifacts, scaling-report/)")
        for line in scaling_lines(rep):
            print(line)


if __name__ == "__main__":
    main()
