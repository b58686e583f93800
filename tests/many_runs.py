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


def copy_runs(uri: str, logged: list[str], indices, run_name) -> list[str]:
    """Add run ``i`` for each of ``indices`` to ``uri``'s sqlite store as :func:`log_many_runs` would log it,
    copied from ``logged[i % len(logged)]`` (its rows of every table keyed by ``run_uuid``: runs, tags, params,
    metrics, latest_metrics) under a new id, the name ``run_name(i, the logged run's name)``, and its times
    (start, end, every point's time stamp) moved by ``i - i % len(logged)`` seconds, as :func:`log_many_runs`
    spaces runs; the new ids in order.
    One sqlite3 transaction: about 1/30 of the time of MLflow's three calls a run (tests/test_scale.py's
    1,001 runs, bench/page.py's stores)."""
    import sqlite3
    import uuid

    db = sqlite3.connect(uri[len("sqlite:///"):])
    tables = [t for (t,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
              if "run_uuid" in [c[1] for c in db.execute(f"PRAGMA table_info({t})")]]
    assert {"runs", "tags", "params", "metrics", "latest_metrics"} <= set(tables), tables
    marks = ",".join("?" * len(logged))
    cols, rows = {}, {}  # rows[table][run id]: that run's rows of the table
    for t in tables:
        cur = db.execute(f"SELECT * FROM {t} WHERE run_uuid IN ({marks})", logged)
        cols[t] = [d[0] for d in cur.description]
        rows[t] = {}
        for r in cur.fetchall():
            rows[t].setdefault(r[cols[t].index("run_uuid")], []).append(r)
    new, ids = {t: [] for t in tables}, []
    for i in indices:
        src, rid, shift = logged[i % len(logged)], uuid.uuid4().hex, 1000 * (i - i % len(logged))
        name = run_name(i, rows["runs"][src][0][cols["runs"].index("name")])
        for t in tables:
            c = cols[t]
            for r in rows[t].get(src, ()):
                r = list(r)
                r[c.index("run_uuid")] = rid
                for k in ("start_time", "end_time", "timestamp"):
                    if k in c and r[c.index(k)] is not None:
                        r[c.index(k)] += shift
                if t == "runs":
                    r[c.index("name")] = name
                    r[c.index("artifact_uri")] = r[c.index("artifact_uri")].replace(src, rid)
                elif t == "tags" and r[c.index("key")] == "mlflow.runName":
                    r[c.index("value")] = name
                new[t].append(r)
        ids.append(rid)
    with db:
        for t in tables:
            db.executemany(f"INSERT INTO {t} ({', '.join(cols[t])}) VALUES ({', '.join('?' * len(cols[t]))})", new[t])
    db.close()
    return ids
