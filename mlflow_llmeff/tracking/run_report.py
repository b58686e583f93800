"""The per-run efficiency report logged at the end of every run: ``efficiency_report.json`` and a few figures.

Written by rank 0 from what the run holds in MLflow once its points are flushed (the summary, the
``llmeff.*`` conditions, the interval histories), through MLflow's own artifact APIs:
``log_dict`` (``efficiency_report.json``), ``log_table`` (``efficiency_summary.json``, one row per
summary figure, shown as a table in the artifact viewer) and ``log_figure`` (``efficiency/*.png``).
:func:`report_artifacts` builds them; the background worker logs them
(:func:`mlflow_llmeff.tracking.outbox.log_report`, the one place that writes them), and a failure
becomes the ``llmeff.report.warning`` tag.
"""

from __future__ import annotations

from mlflow_llmeff import names

__all__ = ["FORMULAS", "build_report_dict", "report_artifacts"]

#: Formula and source of each headline figure (docs/formulas.md has the derivations).
FORMULAS = {
    names.SUM_TOKENS_PER_SEC: ("non-padding tokens of the steady-state steps / their step time, all ranks",
                               "docs/time.md (step seconds), docs/training.md (counting); warm-up steps excluded"),
    names.SUM_MFU: ("achieved model FLOP/s per device / dense datasheet peak; model FLOPs per token "
                    "L*h^2*(12+12g/n+18f/h+6s/h)+6hV", "Megatron-LM num_floating_point_operations; "
                    "Chowdhery et al. 2022 (PaLM) App. B for MFU"),
    names.SUM_MFU_PALM: ("as summary/mfu with 6N + 12*L*h*s FLOPs per token (no causal discount)",
                         "Chowdhery et al. 2022 (PaLM) App. B"),
    names.SUM_HFU: ("hardware FLOP/s (recomputation included) per device / dense peak",
                    "Korthikanti et al. 2022, Reducing Activation Recomputation, Sec. 6"),
    names.SUM_MFU_MEASURED_PEAK: ("as summary/mfu against the measured achievable matmul peak (MAMF)",
                                  "Bekman, ML Engineering, 'Maximum Achievable Matmul FLOPS'"),
    names.SUM_TPS_CI95_LOW: ("lower end of the 95% interval of steady tokens / time: delta method with the "
                             "long-run variance of autocorrelated steps (Geyer's initial monotone sequence), "
                             "Student's t", "Cochran 1977; Geyer 1992; Priestley 1981; docs/stability.md"),
    names.SUM_STEP_TIME_P90_S: ("90th percentile step time, linear interpolation", "Hyndman & Fan 1996, def. 7"),
    names.SUM_GOODPUT: ("productive step time / wall time", "docs/time.md"),
    names.SUM_COST_USD: ("device_hour_usd * devices * wall hours (+ kWh * usd_per_kwh)", "docs/energy_carbon_cost.md"),
    names.SUM_USD_PER_BTOK: ("summary/cost_usd * 1e9 / summary/tokens", "docs/energy_carbon_cost.md"),
    names.SUM_KG_CO2E: ("measured kWh * grid intensity (codecarbon, offline)", "docs/energy_carbon_cost.md"),
    names.SUM_ESTIMATE_KG_CO2E_PER_BTOK: ("codecarbon CPU+RAM estimate kg CO2e * 1e9 / tokens",
                                          "docs/energy_carbon_cost.md"),
}

_UNITS = {d.key: d.unit for d in names.METRICS}
_MEANINGS = {d.key: d.meaning for d in names.METRICS}


def build_report_dict(run_id: str, metrics: dict[str, float], tags: dict[str, str]) -> dict:
    """The content of ``efficiency_report.json``.

    Args:
        run_id: the run.
        metrics: the run's latest metric values by key.
        tags: the run's tags by key.

    Returns:
        ``{"run_id", "summary": {key: {"value", "unit", "meaning"}}, "time_to_quality": {key: value},
        "conditions": {llmeff tag: value}, "formulas": {key: {"formula", "source"}}}``.
    """
    summary = {k: {"value": v, "unit": _UNITS.get(k, "-"), "meaning": _MEANINGS.get(k, "")}
               for k, v in sorted(metrics.items()) if k.startswith("summary/")}
    return {"run_id": run_id, "run_name": tags.get("mlflow.runName", ""),
            "summary": summary,
            "time_to_quality": {k: v for k, v in sorted(metrics.items()) if k.startswith("ttq/")},
            "conditions": {k: v for k, v in sorted(tags.items()) if k.startswith("llmeff.")},
            "stability": {"verdict": tags.get(names.STABILITY, "unknown: not measured"),
                          "tokens_per_sec": [metrics.get(k) for k in (names.SUM_TPS_CI95_LOW, names.SUM_TOKENS_PER_SEC,
                                                                      names.SUM_TPS_CI95_HIGH)],
                          "contention": tags.get(names.CONTENTION), "method": tags.get(names.STABILITY_METHOD),
                          "note": "throughput/* metrics are per-window rates; the run's figure is summary/*"},
            "formulas": {k: {"formula": f, "source": s} for k, (f, s) in FORMULAS.items() if k in metrics},
            "docs": "docs/metrics.md (keys), docs/formulas.md (derivations), docs/compare.md (comparing runs)"}


def _history(client, run_id: str, key: str) -> list[tuple[int, int, float]]:
    return sorted((int(m.step), int(m.timestamp), float(m.value)) for m in client.get_metric_history(run_id, key))


def _figures(client, run_id: str, summary: dict | None = None) -> dict:
    """``{file name: matplotlib figure}`` for the histories the run has (none drawn for an empty one);
    ``summary`` (the run's latest metrics) adds the run's mean throughput and its interval."""
    summary = summary or {}
    import matplotlib

    matplotlib.use("Agg", force=True)
    from matplotlib.figure import Figure  # no pyplot: no global figure registry, nothing to close

    out = {}
    tps, mfu = _history(client, run_id, names.TPUT_TOKENS), _history(client, run_id, names.TPUT_DEVICE_MFU)
    if tps:
        fig = Figure(figsize=(6, 3.5))
        ax = fig.subplots()
        ax.plot([s for s, _, _ in tps], [v for _, _, v in tps], marker=".", color="tab:blue", label="per window")
        mean, low, high = (summary.get(k) for k in (names.SUM_TOKENS_PER_SEC, names.SUM_TPS_CI95_LOW,
                                                     names.SUM_TPS_CI95_HIGH))
        if mean is not None:  # the run's figure beside the windows, so the last window is not read as it
            ax.axhline(mean, color="tab:blue", ls="--", lw=1, label="run (summary/tokens_per_sec)")
            if low is not None and high is not None:
                ax.axhspan(low, high, color="tab:blue", alpha=0.12, label="95% interval")
            ax.legend(fontsize=7, loc="lower right")
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("tokens/s (global)", color="tab:blue")
        if mfu:
            ax2 = ax.twinx()
            ax2.plot([s for s, _, _ in mfu], [v for _, _, v in mfu], marker=".", color="tab:red")
            ax2.set_ylabel("MFU (fraction)", color="tab:red")
        ax.set_title("Throughput and MFU over steps" if mfu else "Throughput over steps (no MFU: no datasheet peak)")
        fig.tight_layout()
        out["efficiency/throughput_mfu.png"] = fig
    power = _history(client, run_id, names.ENERGY_DEVICE_AVG_POWER_W)
    if power:
        fig = Figure(figsize=(6, 3.5))
        ax = fig.subplots()
        ax.plot([s for s, _, _ in power], [v for _, _, v in power], marker=".")
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("average power per device, W")
        ax.set_title("Measured power")
        fig.tight_layout()
        out["efficiency/power.png"] = fig
    loss, tokens = _history(client, run_id, names.TRAIN_LOSS), dict(
        (s, v) for s, _, v in _history(client, run_id, names.TRAIN_TOKENS))
    pts = [(tokens[s], v) for s, _, v in loss if s in tokens]
    if pts:
        fig = Figure(figsize=(6, 3.5))
        ax = fig.subplots()
        ax.plot(*zip(*pts), marker=".")
        ax.set_xlabel("tokens (non-padding, all ranks)")
        ax.set_ylabel("train/loss, nats/token")
        ax.set_title("Loss against tokens")
        fig.tight_layout()
        out["efficiency/loss_tokens.png"] = fig
    return out


def report_artifacts(client, run_id: str) -> tuple[dict, dict | None, dict]:
    """The run's efficiency report as artifacts to log (the writes are the background worker's:
    :func:`mlflow_llmeff.tracking.outbox.log_report`).

    Args:
        client: ``mlflow.MlflowClient`` of the run's tracking store (read only).
        run_id: the run, with its points already delivered.

    Returns:
        ``(efficiency_report.json's dict, efficiency_summary.json's table or None, {artifact path: figure})``;
        the report's tags and params masked (no secrets).

    Raises:
        Exception: what MLflow raises reading the run.
    """
    run = client.get_run(run_id)
    from mlflow_llmeff.tracking.redact import clean_obj

    report = clean_obj(build_report_dict(run_id, dict(run.data.metrics), dict(run.data.tags)))  # no secrets
    table = None
    if report["summary"]:
        rows = list(report["summary"].items())
        table = {"key": [k for k, _ in rows], "value": [d["value"] for _, d in rows], "unit": [d["unit"] for _, d in rows]}
    return report, table, _figures(client, run_id, dict(run.data.metrics))
