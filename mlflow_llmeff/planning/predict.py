"""Predictions of a planned run from earlier runs in the tracking server (time, cost, energy).

``llmeff plan`` first estimates from the model's shape (:mod:`mlflow_llmeff.planning.plan`, pure); this
module reads MLflow for what only measurement gives: the achieved model TFLOP/s per device of
earlier runs on the same accelerator (median, preferring runs of the same shape and layout) and
their measured power.
"""

from __future__ import annotations

import statistics

from mlflow_llmeff import names

__all__ = ["history_tflops", "history_power_w", "add_predictions"]


def _pages(search) -> list:
    """Every result of ``search(page_token)`` (an MLflow search returning a ``PagedList``), page after
    page: one page is MLflow's 1,000 results, and earlier runs past them would be silently ignored.
    (The same loop as :mod:`mlflow_llmeff.tracking.search`, which this lower layer cannot import.)"""
    out, token = [], None
    while True:
        page = search(token)
        out += list(page)
        token = getattr(page, "token", None)
        if not token or not page:
            return out


def _finished_runs_on(client, accelerator_short: str) -> list:
    """Every FINISHED run of every active experiment tagged ``llmeff.accelerator.short`` = ``accelerator_short``.

    Raises:
        mlflow.exceptions.MlflowException (or a connection error): the tracking store fails.
    """
    exps = [e.experiment_id for e in _pages(lambda t: client.search_experiments(max_results=1000, page_token=t))]
    wanted = f"tags.`{names.ACCEL_SHORT}` = '{accelerator_short}' and attributes.status = 'FINISHED'"
    return _pages(lambda t: client.search_runs(exps, filter_string=wanted, max_results=1000, page_token=t))


def history_tflops(client, accelerator_short: str, model: str, strategy: str | None = None,
                   devices: int | None = None, shape: dict[str, str] | None = None, seq_len: int | None = None,
                   micro_batch_size: int | None = None, machines: int = 1) -> tuple[float | None, int, str]:
    """Median achieved model TFLOP/s per device of earlier runs on ``accelerator_short``.

    Args:
        shape: ``{tag: value}`` of the planned model's shape (``llmeff.model.params``, ``.layers``,
            ``.hidden``); a run with the same values (or the same model name) has the same shape.
        seq_len / micro_batch_size: the planned run's; achieved TFLOP/s changes with both (matrix
            sizes, attention's share of the FLOPs).
        machines: the machines the planned devices span (``llmeff.nodes`` of a run; a run without the
            tag ran on one): devices over a network are not devices on one host.

    Returns:
        ``(tflops or None, runs used, basis)``. Preferred, in order: runs of the same shape with the
        same strategy, device count, sequence length and micro batch size; the same without the
        last two; runs of the same shape; runs of other models, whose TFLOP/s are scaled by this
        model's FLOPs per token, and the basis says so.
    """
    try:
        runs = _finished_runs_on(client, accelerator_short)
    except Exception as e:  # noqa: BLE001 - no tracking server: no prediction, and why
        why = names.shorten(str(e).strip().splitlines()[0], 300) if str(e).strip() else type(e).__name__
        return None, 0, f"no tracking server reachable ({why})"
    runs = [r for r in runs if r.data.metrics.get(names.SUM_DEVICE_TFLOPS, 0) > 0]

    def same_shape(r) -> bool:
        if r.data.tags.get(names.MODEL_NAME) == model:
            return True
        return bool(shape) and all(r.data.tags.get(k) == v for k, v in shape.items())

    same = [r for r in runs if same_shape(r)]
    alike = [r for r in same if r.data.tags.get(names.PAR_STRATEGY) == strategy
             and r.data.tags.get(names.ACCEL_COUNT) == str(devices)
             and r.data.tags.get(names.NODES, "1") == str(machines)]
    exact = [r for r in alike if r.data.tags.get(names.SEQ_LEN) == str(seq_len)
             and r.data.tags.get(names.MICRO_BATCH_SIZE) == str(micro_batch_size)]
    on = f"{strategy} on {devices} device{'s' if devices != 1 else ''}"
    if machines > 1:
        on += f" over {machines} machines"
    for use, which in ((exact, f"runs of {model}'s shape with {on}, seq_len {seq_len}, micro batch {micro_batch_size}"),
                       (alike, f"runs of {model}'s shape with {on} (other sequence lengths or micro batches)"),
                       (same, f"runs of {model}'s shape")):
        if use:
            return statistics.median(r.data.metrics[names.SUM_DEVICE_TFLOPS] for r in use), len(use), which
    if runs:
        big = max(runs, key=lambda r: int(r.data.tags.get(names.MODEL_PARAMS, "0") or 0))
        which = (f"runs of other models on {accelerator_short}, scaled by FLOPs per token (largest: "
                 f"{big.data.tags.get(names.MODEL_NAME, '?')}, {int(big.data.tags.get(names.MODEL_PARAMS, '0') or 0):,} "
                 "params); models of another size reach other TFLOP/s, so this is a rough guess")
        return statistics.median(r.data.metrics[names.SUM_DEVICE_TFLOPS] for r in runs), len(runs), which
    return None, 0, f"no earlier run on {accelerator_short}"


def history_power_w(client, accelerator_short: str) -> float | None:
    """Median measured average power per device (W) of earlier runs on the accelerator."""
    try:
        runs = _finished_runs_on(client, accelerator_short)
    except Exception:  # noqa: BLE001
        return None
    w = [r.data.metrics[names.SUM_DEVICE_TFLOPS] / r.data.metrics[names.SUM_TFLOPS_PER_W] for r in runs
         if r.data.metrics.get(names.SUM_TFLOPS_PER_W, 0) > 0 and names.SUM_DEVICE_TFLOPS in r.data.metrics]
    return statistics.median(w) if w else None


def add_predictions(plan: dict, cfg, *, client, accelerator_short: str, strategy: str,
                    device_hour_usd: float | None = None) -> dict:
    """Add ``prediction_basis`` and, where earlier runs allow, predicted tokens/s, wall time, cost
    and energy to ``plan`` (:func:`mlflow_llmeff.planning.plan.make_plan`'s dict, changed in place and returned).

    Args:
        plan: the pure plan.
        cfg: the :class:`~mlflow_llmeff.train.config.TrainConfig`.
        client: an ``MlflowClient``; for a tracking server one whose reads are bounded
            (``tracking/store.reader()``: each read waits at most the delivery wait, ``LLMEFF_DELIVERY_WAIT_S``),
            so that a server that does not answer costs one wait and the plan says why it has no prediction.
        accelerator_short: accelerator planned for (history and price are looked up by it).
        strategy: the resolved strategy.
        device_hour_usd: price per device-hour (None: no cost prediction).
    """
    devices = plan["devices"]
    shape = {names.MODEL_PARAMS: str(plan["params_total"]), names.MODEL_LAYERS: str(plan.get("layers", "")),
             names.MODEL_HIDDEN: str(plan.get("hidden", ""))}
    shape = {k: v for k, v in shape.items() if v}
    tflops, n, which = history_tflops(client, accelerator_short, cfg.model, strategy, devices, shape,
                                      cfg.seq_len, cfg.micro_batch_size, machines=cfg.num_machines)
    plan["prediction_basis"] = f"median of {n} {which}" if tflops else which
    if tflops:
        fpt, tokens_per_step = plan["flops_per_token_megatron"], plan["tokens_per_step"]
        tps = tflops * 1e12 * devices / fpt
        wall = cfg.max_steps * tokens_per_step / tps
        plan.update({"predicted_tokens_per_sec": tps, "predicted_wall_s": wall,
                     "predicted_wall_covers": f"{cfg.max_steps} steps at the steady-state rate; start-up "
                                              "(imports, model build, data set-up), warm-up and evals excluded"})
        if device_hour_usd is not None:
            plan["predicted_usd"] = device_hour_usd * devices * wall / 3600
        power = history_power_w(client, accelerator_short)
        if power:
            plan["predicted_kwh"] = power * devices * wall / 3.6e6
    return plan
