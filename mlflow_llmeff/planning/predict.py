"""Predictions of a planned run from earlier runs in the tracking server (time, cost, energy).

``llmeff plan`` first estimates from the model's shape (:mod:`mlflow_llmeff.planning.plan`, pure); this
module reads MLflow for what only measurement gives: the achieved model TFLOP/s per device of
earlier runs on the same accelerator (median, preferring runs of the same shape and layout) and
their measured power.

Only runs measured under the plan's speed conditions feed a prediction (:func:`speed_conditions`:
precision, optimizer, weights, what trains (LoRA), attention kernel, torch.compile, activation
checkpointing; the tags ``llmeff compare`` also keeps configurations apart by): fp32 and bf16 runs of
one model differ many times over on a GPU, and a median over both predicts neither. A run that does not
record a condition does not match it. Where no run matches, the prediction is absent and its basis says
which conditions the runs there differ in. Threads (``llmeff.threads``) are no input of a plan: the
basis names the threads of the runs it used, and says when they were mixed.
"""

from __future__ import annotations

import re
import statistics
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from mlflow_llmeff import names
from mlflow_llmeff.calc.optimizers import OPTIMIZERS

__all__ = ["Condition", "speed_conditions", "optimizer_of", "trainable_of", "history_tflops", "history_power_w",
           "add_predictions"]


@dataclass(frozen=True)
class Condition:
    """A measurement condition that changes speed, as the plan asks for it and as a run's tags record it.

    Attributes:
        name: the condition in words (``precision``, ``optimizer``, ...).
        wanted: the plan's value, in the form :attr:`read` gives (``fp32``, ``adamw``, ``LoRA r=8 on q_proj,v_proj``).
        words: how the basis names the plan's value (``precision fp32``, ``not compiled``).
        read: a run's tags -> its value in that form, or None where the run does not record it.
    """

    name: str
    wanted: str
    words: str
    read: Callable[[dict], str | None]


def _tag(key: str) -> Callable[[dict], str | None]:
    """The tag's value, lowercased, up to a first `` (`` (``bf16 (of the trainable weights also ...)``), or None
    where absent or ``unknown: ...``."""
    def read(tags: dict) -> str | None:
        v = (tags.get(key) or "").split(" (")[0].strip().lower()
        return v if v and not v.startswith("unknown") else None
    return read


def optimizer_of(tag: str | None) -> str | None:
    """The ``--optimizer`` value a run's ``llmeff.optimizer`` tag describes, or None where it cannot tell.

    ``AdamW8bit (torchao.optim); states ...; from llmeff train --optimizer adamw8bit`` names it; a run from
    another loop (``AdamW (torch.optim); states fp32; from the user's loop``) is known by its class
    (:data:`mlflow_llmeff.calc.optimizers.OPTIMIZERS`' ``cls``: ``torch.optim.AdamW`` is ``adamw``); any other
    class is its own condition (its lowercased class name), matching no ``--optimizer`` value.
    """
    if not tag or tag.startswith("unknown"):
        return None
    named = re.search(r"--optimizer (\S+)", tag)
    if named:
        return named.group(1)
    cls, _, rest = tag.split(";")[0].partition(" (")
    package = rest.split(")")[0].strip()
    for name, c in OPTIMIZERS.items():
        if c.cls == f"{package}.{cls.strip()}":
            return name
    return cls.strip().lower() or None


def trainable_of(tag: str | None) -> str | None:
    """What a run trained, from its ``llmeff.flops.trainable`` tag: ``LoRA r=8 on q_proj,v_proj``, ``every weight``,
    ``partly frozen`` (frozen layers or embeddings, no LoRA), or None where not recorded or not read."""
    if not tag or tag.startswith("every weight counted trainable"):  # the trainable part could not be read
        return None
    lora = re.search(r"LoRA (r=\S+ on \S+)", tag)
    if lora:
        return f"LoRA {lora.group(1)}"
    return "every weight" if tag.startswith("all ") else "partly frozen"


def speed_conditions(plan: dict, cfg) -> list[Condition]:
    """The conditions a run must share with the plan to predict it (see the module docstring).

    Args:
        plan: :func:`mlflow_llmeff.planning.plan.make_plan`'s dict (its resolved ``precision``).
        cfg: the :class:`~mlflow_llmeff.train.config.TrainConfig` (optimizer, weights, LoRA, attention,
            compile, activation checkpointing).
    """
    from mlflow_llmeff.models.presets import shape_config
    from mlflow_llmeff.planning.plan import lora_trainable

    lora = lora_trainable(cfg, shape_config(cfg.model)) if cfg.lora_rank else None
    trains = f"LoRA {lora.lora_summary()}" if lora is not None else "every weight"
    ckpt, compiled = str(bool(cfg.activation_checkpointing)).lower(), str(bool(cfg.compile)).lower()
    return [
        Condition("precision", plan["precision"], f"precision {plan['precision']}", _tag(names.PRECISION)),
        Condition("optimizer", cfg.optimizer, f"optimizer {cfg.optimizer}",
                  lambda t: optimizer_of(t.get(names.OPTIMIZER))),
        Condition("weights", cfg.weights, f"{cfg.weights} weights", _tag(names.WEIGHTS)),
        Condition("training", trains, trains + (" trained" if lora is None else ""),
                  lambda t: trainable_of(t.get(names.FLOPS_TRAINABLE))),
        Condition("attention", cfg.attn_implementation, f"{cfg.attn_implementation} attention", _tag(names.ATTENTION)),
        Condition("compile", compiled, "compiled" if cfg.compile else "not compiled", _tag(names.COMPILE)),
        Condition("activation checkpointing", ckpt,
                  "activation checkpointing" if cfg.activation_checkpointing else "no activation checkpointing",
                  _tag(names.ACT_CKPT)),
    ]


def _differences(runs: list, conditions: Sequence[Condition]) -> str:
    """What ``runs`` hold where they differ from the plan, conditions with the same counts named together:
    ``precision bf16 in 4; optimizer, weights not recorded in 2``."""
    said: dict[str, list[str]] = {}
    for c in conditions:
        seen = Counter(c.read(r.data.tags) for r in runs)
        seen.pop(c.wanted, None)
        if seen:
            held = ", ".join(f"{v if v is not None else 'not recorded'} in {n}" for v, n in seen.most_common())
            said.setdefault(held, []).append(c.name)
    return "; ".join(f"{', '.join(which)} {held}" for held, which in said.items())


def _threads(runs: list) -> str:
    """``; threads intra-op 2, inter-op 2`` of the runs used, ``; threads mixed: ... (3 runs), ... (1 run)`` when
    they differ, '' when none records them."""
    seen = Counter(r.data.tags.get(names.THREADS) or "not recorded" for r in runs)
    if set(seen) == {"not recorded"}:
        return ""
    if len(seen) == 1:
        return f"; threads {next(iter(seen))}"
    return "; threads mixed: " + ", ".join(f"{v} ({n} run{'s' if n != 1 else ''})" for v, n in seen.most_common())


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
                   micro_batch_size: int | None = None, machines: int = 1, *,
                   conditions: Sequence[Condition] = ()) -> tuple[float | None, int, str]:
    """Median achieved model TFLOP/s per device of earlier runs on ``accelerator_short`` under ``conditions``.

    Args:
        shape: ``{tag: value}`` of the planned model's shape (``llmeff.model.params``, ``.layers``,
            ``.hidden``); a run with the same values (or the same model name) has the same shape.
        seq_len / micro_batch_size: the planned run's; achieved TFLOP/s changes with both (matrix
            sizes, attention's share of the FLOPs).
        machines: the machines the planned devices span (``llmeff.nodes`` of a run; a run without the
            tag ran on one): devices over a network are not devices on one host.
        conditions: :func:`speed_conditions` of the plan: only runs that record every one with the
            plan's value are used (``()``: every run).

    Returns:
        ``(tflops or None, runs used, basis)``. Among the runs under ``conditions``, preferred in order:
        runs of the same shape with the same strategy, device count, sequence length and micro batch
        size; the same without the last two; runs of the same shape; runs of other models, whose
        TFLOP/s are scaled by this model's FLOPs per token, and the basis says so. The basis ends with
        the conditions (``; all with precision fp32, ...``) and the runs' threads. Where no run on the
        accelerator matches the conditions: None, and the basis says what the runs there differ in.
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

    matching = [r for r in runs if all(c.read(r.data.tags) == c.wanted for c in conditions)]
    under = f"; all with {', '.join(c.words for c in conditions)}" if conditions else ""
    same = [r for r in matching if same_shape(r)]
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
            return (statistics.median(r.data.metrics[names.SUM_DEVICE_TFLOPS] for r in use), len(use),
                    which + under + _threads(use))
    if matching:
        big = max(matching, key=lambda r: int(r.data.tags.get(names.MODEL_PARAMS, "0") or 0))
        which = (f"runs of other models on {accelerator_short}, scaled by FLOPs per token (largest: "
                 f"{big.data.tags.get(names.MODEL_NAME, '?')}, {int(big.data.tags.get(names.MODEL_PARAMS, '0') or 0):,} "
                 "params); models of another size reach other TFLOP/s, so this is a rough guess")
        return (statistics.median(r.data.metrics[names.SUM_DEVICE_TFLOPS] for r in matching), len(matching),
                which + under + _threads(matching))
    if runs:  # runs there, none under the plan's conditions: no prediction from mismatched runs
        pool = [r for r in runs if same_shape(r)]
        of = f"of {model}'s shape " if pool else ""
        pool = pool or runs
        return None, 0, (f"no prediction: no earlier run {of}on {accelerator_short} was measured with "
                         f"{', '.join(c.words for c in conditions)} (of the {len(pool)} there: "
                         f"{_differences(pool, conditions)})")
    return None, 0, f"no earlier run on {accelerator_short}"


def history_power_w(client, accelerator_short: str, *, conditions: Sequence[Condition] = ()) -> float | None:
    """Median measured average power per device (W) of earlier runs on the accelerator under ``conditions``
    (:func:`speed_conditions`; ``()``: every run), None where none measured it."""
    try:
        runs = _finished_runs_on(client, accelerator_short)
    except Exception:  # noqa: BLE001
        return None
    w = [r.data.metrics[names.SUM_DEVICE_TFLOPS] / r.data.metrics[names.SUM_TFLOPS_PER_W] for r in runs
         if r.data.metrics.get(names.SUM_TFLOPS_PER_W, 0) > 0 and names.SUM_DEVICE_TFLOPS in r.data.metrics
         and all(c.read(r.data.tags) == c.wanted for c in conditions)]
    return statistics.median(w) if w else None


def add_predictions(plan: dict, cfg, *, client, accelerator_short: str, strategy: str,
                    device_hour_usd: float | None = None) -> dict:
    """Add ``prediction_basis`` and, where earlier runs under the plan's :func:`speed_conditions` allow,
    predicted tokens/s, wall time, cost and energy to ``plan`` (:func:`mlflow_llmeff.planning.plan.make_plan`'s
    dict, changed in place and returned).

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
    conditions = speed_conditions(plan, cfg)
    tflops, n, which = history_tflops(client, accelerator_short, cfg.model, strategy, devices, shape,
                                      cfg.seq_len, cfg.micro_batch_size, machines=cfg.num_machines,
                                      conditions=conditions)
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
        power = history_power_w(client, accelerator_short, conditions=conditions)
        if power:
            plan["predicted_kwh"] = power * devices * wall / 3.6e6
    return plan
