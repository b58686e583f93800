"""What ``llmeff train`` measures of its processes' communication, and the runs of its machines.

At step 0 every rank probes the bus bandwidth of the run's process group against its link's peak
(:func:`probe_comm`, ``summary``-free: ``comm/*`` at step 0 and ``llmeff.comm.*`` tags); during warm-up
the sampled steps' collectives give ``summary/comm_*`` (:func:`sampled_comm`, over
:class:`~mlflow_llmeff.meters.commprobe.StepSampler`); on several machines rank 0 marks the run each
machine's launcher made as part of its run (:func:`mark_machine_runs`). Each is a collective, called
on every rank at the same point, and never stops training: a failure is a tag.
"""

from __future__ import annotations

import os

from mlflow_llmeff import names
from mlflow_llmeff.names import shorten
from mlflow_llmeff.planning.spec import RunSpec
from mlflow_llmeff.train.config import TrainConfig

__all__ = ["mark_machine_runs", "probe_comm", "sampled_comm"]


def mark_machine_runs(cfg: TrainConfig, monitor) -> None:
    """Several machines: one run. Every rank tells rank 0 the run its machine's launcher made
    (``MLFLOW_RUN_ID`` under ``mlflow run``, on each machine's first rank), and rank 0 marks those of
    machines 1.. as parts of its run (tracking/runs.py ``mark_machine_runs``, MLflow issue #3787). A
    collective; never stops training."""
    import socket

    from mlflow_llmeff.meters import collectives
    from mlflow_llmeff.tracking.runs import mark_machine_runs

    first = os.environ.get("LOCAL_RANK", "0") == "0"
    mine = (cfg.machine_rank, os.environ.get("MLFLOW_RUN_ID", "") if first else "", socket.gethostname(),
            monitor.run_id if monitor.is_main else None)
    try:
        every = collectives.all_gather_object(mine)
        told = os.environ.get("LLMEFF_JOB_RUN_FILE")  # machines 1..: the launcher names the job's run at its end
        job_run = next((run for *_, run in every if run), None)
        if told and first and job_run:
            with open(told, "w", encoding="utf-8") as f:
                f.write(job_run)
        if monitor.is_main and monitor.run_id:
            said = mark_machine_runs(monitor.run_id, {r: (run, host) for r, run, host, _ in every if r > 0 and run},
                                       cfg.num_machines)
            if said:
                monitor.set_tags({names.MACHINE_RUNS: said})
                print(f"llmeff: {said}")
    except Exception as e:  # noqa: BLE001 - measurement never stops training
        if monitor.is_main:
            monitor.set_tags({names.MACHINE_RUNS: f"failed: {type(e).__name__}: {shorten(str(e), 300)}"})


def probe_comm(spec: RunSpec, t, monitor) -> None:
    """Bus bandwidth of the run's process group and its link's peak, at step 0 (every rank; cached
    per machine, so seconds once). Never stops training."""
    from mlflow_llmeff.calc.comm import probe_message_bytes
    from mlflow_llmeff.meters import collectives, commprobe

    cfg = spec.options

    if t.world < 2 or not cfg.measure_comm:
        why = "none: measure_comm=false" if t.world > 1 else "none: one process, no collectives"
        monitor.set_tags({names.COMM_PROBE: why})
        return
    try:
        with monitor.pause("init"):
            backend = str(__import__("torch").distributed.get_backend())
            peak, why = commprobe.detect_link(t.device, backend=backend, nodes=spec.nodes,
                                              devices_per_node=spec.processes_per_node, head=os.environ.get("MASTER_ADDR"),
                                              given_gbps=cfg.link_peak_gbps or None)
            size = probe_message_bytes(peak.gbps if peak else None, nccl=backend == "nccl")  # >= 0.5 s at the peak
            # every rank reads its own link: the probe's collectives need one size, the largest
            size = int(collectives.all_reduce([float(size)], op="max")[0])
            result = commprobe.measure(t.device, nodes=spec.nodes, device_name=monitor.accelerator.name,
                                       size_bytes=size)
        metrics, tags = commprobe.probe_figures(result, peak, why)
        monitor.log_metrics(metrics, 0)
        monitor.set_tags(tags)
        if t.accelerator.is_main_process and result is not None:
            bw = ", ".join(f"{k.split('/')[1].split('_busbw')[0]} {v:.3g}" for k, v in metrics.items()
                           if k.endswith("_gbps"))
            util = metrics.get(names.COMM_BUSBW_UTIL)
            of = (f"; all-reduce {util:.3g} of the {peak.gbps:.4g} GB/s peak ({peak.link})" if util is not None
                  else f"; peak {why}")
            print(f"llmeff: communication busbw GB/s ({result.describe().split(':')[0]}): {bw}{of}")
    except Exception as e:  # noqa: BLE001 - a failed probe is a tag, never the end of training
        monitor.set_tags({names.COMM_PROBE: f"failed: {type(e).__name__}: {shorten(str(e), 300)}"})


def sampled_comm(sampler, monitor) -> None:
    """The sampled steps' ``summary/comm_*`` figures (a collective), kept for the summary."""
    try:
        metrics, tags = sampler.figures()
        monitor.add_summary(metrics)
        monitor.set_tags(tags)
    except Exception as e:  # noqa: BLE001 - measurement never stops training
        monitor.set_tags({names.COMM_SAMPLED: f"failed: {type(e).__name__}: {shorten(str(e), 300)}"})
