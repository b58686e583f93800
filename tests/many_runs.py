"""Many finished runs in one experiment, logged fast through MLflow's API (three calls a run, no training).

Run ``i`` is a repeat of the UI trial's standard run ``i % 5`` (tests/five_runs.py: its condition
tags and figures), with tokens/s varied by -1 %, 0 or +1 % across repeats so every configuration has
an interval, and a loss history of ten points. Start times are one second apart (run 0 oldest), so
MLflow's newest-first order is known. Used by tests/test_scale.py and bench/page.py.
"""

from __future__ import annotations

from mlflow_llmeff import names

from five_runs import COMMON, FIVE

#: Start time of run 0 (ms since the epoch: 2026-01-01 00:00 UTC); run i starts i seconds later.
START_MS = 1_767_225_600_000


def tokens_per_sec(i: int) -> float:
    """The logged ``summary/tokens_per_sec`` of run ``i``."""
    return FIVE[i % 5][2] * (1.0 + 0.01 * ((i // 5) % 3 - 1))


def log_many_runs(client, experiment_name: str, n: int, run_name=None, history: bool = True) -> tuple[str, list[str]]:
    """Log ``n`` finished runs into ``experiment_name`` (created if missing); ``(experiment id, run ids)``,
    oldest first.

    Args:
        client: ``MlflowClient`` (or a store with ``create_run``/``log_batch``/``update_run_info``).
        run_name: ``run_name(i)`` -> the name of run ``i`` (default: the standard run's name and ``-r<i>``).
        history: also log the ten-point loss history (False: the summary only, a third faster).
    """
    from mlflow.entities import Metric, Param, RunTag

    exp = client.get_experiment_by_name(experiment_name)
    exp_id = exp.experiment_id if exp else client.create_experiment(experiment_name)
    ids = []
    for i in range(n):
        base, tags, _, good = FIVE[i % 5]
        name = run_name(i) if run_name else f"{base}-r{i}"
        devices = int(tags[names.ACCEL_COUNT])
        tps = tokens_per_sec(i)
        ts = START_MS + 1000 * i
        all_tags = {**COMMON, **tags, names.PAR_DP: str(devices), "mlflow.runName": name}
        run = client.create_run(exp_id, start_time=ts, tags=all_tags, run_name=name)
        m = {names.SUM_TOKENS_PER_SEC: tps, names.SUM_DEVICE_TOKENS_PER_SEC: tps / devices,
             names.SUM_TPS_CI95_LOW: 0.98 * tps, names.SUM_TPS_CI95_HIGH: 1.02 * tps,
             names.SUM_DEVICE_TFLOPS: tps / devices * 2.9e6 / 1e12, names.SUM_MFU_MEASURED_PEAK: 0.05,
             names.SUM_GOODPUT: good, names.SUM_WALL_S: 10.0, names.SUM_TOKENS: 51_200.0 * devices,
             names.SUM_STEPS: 50.0, names.SUM_ESTIMATE_KG_CO2E_PER_BTOK: 0.04 * (i % 5 + 1)}
        points = [Metric(k, v, ts + 10_000, 50) for k, v in m.items()]
        points += [] if not history else [Metric(names.TRAIN_LOSS, 5.6 - 0.05 * step, ts + 200 * step, step) for step in range(5, 51, 5)]
        client.log_batch(run.info.run_id, metrics=points, params=[Param("model", tags[names.MODEL_NAME])],
                         tags=[RunTag(names.STABILITY, "stable")])
        client.set_terminated(run.info.run_id, "FINISHED", end_time=ts + 12_000)
        ids.append(run.info.run_id)
    return exp_id, ids
