"""Assembling a monitor: argument checks, what the model says, and the meters a monitor reads.

The parts of :class:`~mlflow_llmeff.monitor.meter.EfficiencyMonitor`'s constructor that do not
touch MLflow (that is :mod:`~mlflow_llmeff.monitor.binding`): :func:`check_args` (shared with
``autolog``, which checks its settings before any training starts), :func:`read_model` (device,
precision, strategy, compile and checkpointing flags, the FLOPs account), :func:`set_up_measurement`
(accelerator, energy meter, peaks, price, carbon tracker, consumption),
:func:`set_up_step_timing` (per-step times, phase timer, contention meter), :func:`start_meters` and
:func:`start_clock` (the attempt's clock starts), :func:`stop_meters`, and a checkpoint's state
(:func:`state`, :func:`resume`). The set-up functions fill the monitor's
:class:`~mlflow_llmeff.monitor.parts.Parts` in the order the constructor calls them.
"""

from __future__ import annotations

import math
import time

from mlflow_llmeff import names
from mlflow_llmeff.calc import cost as cost_mod
from mlflow_llmeff.calc.goodput import wall_of
from mlflow_llmeff.calc.throughput import ThroughputMeter
from mlflow_llmeff.meters import energy as en
from mlflow_llmeff.meters import hardware as hw
from mlflow_llmeff.meters.carbon import CarbonTracker
from mlflow_llmeff.monitor.account import FlopsAccount
from mlflow_llmeff.monitor.conditions import (infer_precision, infer_strategy, is_compiled, unwrap_model,
                                              uses_activation_checkpointing)
from mlflow_llmeff.monitor.consumption import Consumption
from mlflow_llmeff.monitor.contention import ContentionMeter
from mlflow_llmeff.monitor.precision import fp8_layers
from mlflow_llmeff.monitor.parts import Parts
from mlflow_llmeff.monitor.steptimes import DeviceStepClock, PhaseTimer, StepTimes, cuda_event_factory

__all__ = ["PRECISIONS", "assumed_tag", "assumed_line", "check_args", "replication", "token_counting", "read_model",
           "set_up_measurement", "set_up_step_timing", "start_meters", "note_energy_head_gap", "start_clock",
           "stop_meters", "state", "resume"]

#: Compute precisions the monitor accepts (the ``llmeff.precision`` tag).
PRECISIONS = ("fp32", "bf16", "fp16", "fp8", "fp4")  # fp4: NVFP4/MXFP4 matmuls, against the FP4 peak


def check_args(log_every_n_steps, warmup_steps, precision, measure_energy, energy_meter, peak_tflops,
               device_hour_usd, usd_per_kwh) -> None:
    """Check the monitor's arguments (as :class:`~mlflow_llmeff.monitor.meter.EfficiencyMonitor` documents them).

    Raises:
        ValueError: naming the bad argument and what is accepted.
    """
    def bad_int(v, lo):
        return not isinstance(v, int) or isinstance(v, bool) or v < lo

    if bad_int(log_every_n_steps, 1):
        raise ValueError(f"log_every_n_steps={log_every_n_steps!r} is not accepted; give an int >= 1")
    if bad_int(warmup_steps, 0):
        raise ValueError(f"warmup_steps={warmup_steps!r} is not accepted; give an int >= 0")
    if precision is not None and precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r} is not accepted; use one of {', '.join(PRECISIONS)}")
    if energy_meter is None and measure_energy not in en.MODES:
        raise ValueError(f"measure_energy={measure_energy!r} is not accepted; use one of {', '.join(en.MODES)}")
    if peak_tflops is not None and not (isinstance(peak_tflops, (int, float)) and peak_tflops > 0):
        raise ValueError(f"peak_tflops={peak_tflops!r} is not accepted; give TFLOP/s > 0 or None")
    for name, v in (("device_hour_usd", device_hour_usd), ("usd_per_kwh", usd_per_kwh)):
        if v is not None and not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
            raise ValueError(f"{name}={v!r} is not accepted; give a price >= 0 in USD or None")


def replication(world_size: int, data_parallel_size: int | None) -> int:
    """Ranks counting the same tokens (``world / data_parallel_size``; 1 without model parallelism).

    Raises:
        ValueError: for a ``data_parallel_size`` that is not an int >= 1 dividing ``world_size``.
    """
    return token_counting(world_size, data_parallel_size).copies


def token_counting(world_size: int, data_parallel_size: int | None, context_parallel_size: int = 1):
    """The run's :class:`~mlflow_llmeff.parallel.degrees.TokenCounting` (the one rule of
    :func:`~mlflow_llmeff.parallel.degrees.token_counting`) from the monitor's arguments.

    ``data_parallel_size`` ranks hold different sequences (default: every rank that is not a
    context-parallel peer), ``context_parallel_size`` ranks each counted their own slice of the
    same sequences, and the rest of the world (``world / (dp x cp)``: tensor and pipeline peers)
    holds copies.

    Raises:
        ValueError: for a degree that is not an int >= 1, or ``dp x cp`` not dividing ``world_size``.
    """
    from mlflow_llmeff.parallel.degrees import Degrees
    from mlflow_llmeff.parallel.degrees import token_counting as rule

    cp = context_parallel_size
    if not isinstance(cp, int) or isinstance(cp, bool) or cp < 1 or world_size % cp:
        raise ValueError(f"context_parallel_size={cp!r} is not accepted; give an int >= 1 dividing the world "
                         f"size {world_size}")
    dp = world_size // cp if data_parallel_size is None else data_parallel_size
    if not isinstance(dp, int) or isinstance(dp, bool) or dp < 1 or world_size % (dp * cp):
        raise ValueError(f"data_parallel_size={dp!r} is not accepted; give an int >= 1 dividing the world "
                         f"size {world_size}" + (f" with context_parallel_size={cp}" if cp > 1 else ""))
    return rule(Degrees(dp_replicate=dp, cp=cp, tp=world_size // (dp * cp)))


def read_model(p: Parts, model, model_config, precision, strategy, compile, act_ckpt) -> None:
    """Device, precision, strategy, compile and activation-checkpointing flags, and the config (the
    monitor's :class:`~mlflow_llmeff.monitor.account.FlopsAccount`), from the model, into ``p``."""
    inner = unwrap_model(model) if model is not None else None
    p.device = None
    if inner is not None:
        try:
            p.device = next(inner.parameters()).device
        except Exception:  # noqa: BLE001 - a model without parameters
            p.device = None
    p.precision = precision or (infer_precision(inner) if inner is not None else "fp32")
    p.assumed = {}  # input -> what was taken and why (llmeff.assumed)
    p.precision_source = "option" if precision else "parameters"
    found = fp8_layers(model) if model is not None else None
    if found is not None:  # FP8 layers run the matmuls, whatever was given (docs/formulas.md)
        p.precision, p.precision_source = "fp8", found.source()
    elif precision is None:  # the peak MFU divides by follows it
        p.assumed["precision"] = (
            f"{p.precision} (read off the model parameters' dtype; matmuls under torch.autocast run in "
            "the autocast dtype instead: then pass precision=)" if inner is not None else "fp32 (no model to read a dtype from: pass precision=)")
    p.strategy = strategy or infer_strategy(model, p.world_size)
    p.compiled = bool(compile) if compile is not None else (model is not None and is_compiled(model))
    p.activation_checkpointing = (bool(act_ckpt) if act_ckpt is not None
                                  else model is not None and uses_activation_checkpointing(model))
    p.account = FlopsAccount(model_config if model_config is not None else getattr(inner, "config", None))


def set_up_measurement(p: Parts, peak_tflops, measure_peak, device_hour_usd, usd_per_kwh, measure_energy,
                       energy_meter, country_iso_code, cloud_provider, cloud_region, carbon_tracker) -> None:
    """Peaks (datasheet and measured), price, energy meter and carbon tracker, into ``p``."""
    device_type = p.device.type if p.device is not None else None
    p.accelerator = hw.detect_accelerator(count=p.world_size, device_type=device_type)
    if energy_meter is None:
        idx = [p.device.index or 0] if device_type == "cuda" else None
        energy_meter = (en.make_meter(measure_energy, device_indices=idx) if measure_energy != "none"
                        else en.NullMeter("measure_energy=none"))
    p.energy = energy_meter
    if not p.energy.started:  # first: the energy's span starts here (a caller may start it earlier)
        p.energy.start()
    p.user_peak_tflops = peak_tflops  # a precision found after the first step re-resolves with it
    p.account.resolve_peak(p.accelerator, p.precision, peak_tflops)
    if measure_peak:
        p.account.measure_peak(p.precision, p.device)
    price, price_source = cost_mod.device_hour_price(p.accelerator.short, device_hour_usd)
    p.cost_tags = cost_mod.cost_tags(price, price_source, usd_per_kwh)
    if device_hour_usd is None and price is not None:  # a list price the user did not give
        p.assumed["device_hour_usd"] = f"{price:g} USD per device-hour ({price_source}: pass device_hour_usd for yours)"
    p.carbon = carbon_tracker or CarbonTracker(
        country_iso_code=country_iso_code, cloud_provider=cloud_provider, cloud_region=cloud_region,
        enabled=measure_energy != "none")
    p.consumption = Consumption(devices=p.world_size, device_hour_usd=price, usd_per_kwh=usd_per_kwh)


def assumed_tag(found: dict[str, str]) -> dict[str, str]:
    """``{llmeff.assumed: ...}`` of what was assumed (:meth:`Parts.assumptions
    <mlflow_llmeff.monitor.parts.Parts.assumptions>`), each ``<input>: <value> (<why>)`` joined by ``; ``;
    ``{}`` when nothing."""
    return {names.ASSUMED: "; ".join(f"{k}: {v}" for k, v in found.items())} if found else {}


def assumed_line(found: dict[str, str]) -> str | None:
    """The terminal's line of what was assumed (:meth:`Parts.assumptions
    <mlflow_llmeff.monitor.parts.Parts.assumptions>`): ``assumed for you: country_iso_code USA, pue 1 (why and
    how to give yours: tag llmeff.assumed)``, each value up to its ``(why)``; None when nothing."""
    if not found:
        return None
    told = ", ".join(f"{k} {v.split(' (')[0]}" for k, v in found.items())
    return f"assumed for you: {told} (why and how to give yours: tag {names.ASSUMED})"


def set_up_step_timing(p: Parts, model, contention_meter) -> None:
    """Per-step times (device events on CUDA), each rank's phase times (forward, backward, optimizer), and
    the contention meter, into ``p``.

    The phase timer runs on several ranks only: its times feed the straggler figures, which compare
    ranks (one process has no straggler), and its hooks run inside every step (~20 us of a 15 ms CPU
    step, ``bench/overhead.py``)."""
    cuda = p.device is not None and p.device.type == "cuda"
    p.steps = StepTimes()
    p.devclock = DeviceStepClock(cuda_event_factory()) if cuda else None
    # this attempt's steady steps' phase times (stragglers) are summed in p.phase_totals; the timer takes them
    p.phases = None
    inner = unwrap_model(model) if model is not None else None
    if inner is not None and p.world_size > 1 and hasattr(inner, "register_forward_pre_hook"):
        try:
            p.phases = PhaseTimer(inner, p.forward_counts, p.clock,
                                  event=cuda_event_factory() if cuda else None, optimizer=p.optimizer)
        except Exception:  # noqa: BLE001 - a model that takes no hooks: no phase times (the stragglers say why)
            p.phases = None
    p.contention = contention_meter or ContentionMeter(device=p.device)


def start_meters(p: Parts) -> None:
    """Start the carbon tracker (its grid intensity prices the consumption's carbon) and note the set-up
    seconds of this attempt before the energy meter started (:func:`note_energy_head_gap`)."""
    p.carbon.start()
    p.consumption.price_carbon(p.carbon.intensity_g_per_kwh)
    note_energy_head_gap(p)


def note_energy_head_gap(p: Parts) -> None:
    """Set-up seconds of this attempt before the energy meter started: in summary/wall_s, not in the energy."""
    if not p.energy.measures:
        return
    try:
        elapsed = p.energy.read().elapsed_s
    except Exception:  # noqa: BLE001 - an unreadable meter leaves the span as it is
        return
    attempt = p.ledger.snapshot()["init"] - p.ledger.seconds["init"]  # still in init: this attempt so far
    p.consumption.add_head_gap(max(0.0, attempt - elapsed))


def start_clock(p: Parts) -> None:
    """The attempt's first step starts now: the ledger's clock, the device step clock, the consumption's
    first interval, and (without warm-up) the contention meter's steady window."""
    p.ledger.begin()
    if p.compiles is not None:  # a model compiled before the monitor: torch._dynamo is imported
        p.compiles.install()
    if p.devclock is not None:
        p.devclock.restart()
    p.consumption.start_interval(p.ledger.wall_s(), p.meter.total.tokens)
    if p.meter.warmup_end_step == p.meter.step:  # no warm-up: the steady window starts now
        p.contention.begin(collective=p.world_size > 1)


def stop_meters(p: Parts) -> None:
    """Stop what :func:`set_up_measurement` and :func:`set_up_step_timing` started (a failure is ignored)."""
    for closer in (p.energy.close, p.carbon.stop, p.contention.close,
                   p.phases.close if p.phases is not None else (lambda: None),
                   p.compiles.close if p.compiles is not None else (lambda: None)):
        try:
            closer()
        except Exception:  # noqa: BLE001
            pass


def state(p: Parts) -> dict:
    """Everything a resumed attempt needs to continue, JSON-safe (what :func:`resume` reads): counters,
    clock, consumption with the device-seconds its seconds date, reached targets, attempts, the counted
    HFU ratio, step times and batch shapes (:meth:`~mlflow_llmeff.monitor.meter.EfficiencyMonitor.state_dict`
    accounts the pending steps and reads the consumption first)."""
    ledger = p.ledger.state_dict()  # its seconds date the device-seconds below
    seconds = ledger["seconds"]
    consumption = p.consumption.state_dict(wall_s=wall_of(seconds), init_s=seconds.get("init", 0.0))
    return {"step": p.meter.step, "throughput": p.meter.state_dict(),
            "ledger": ledger, "consumption": consumption,
            "ttq_reached": p.reached.state(), "ttq_best": p.reached.best_state(), "attempts": p.job.attempts,
            "run_id": p.logger.run_id,
            "hfu_counted": p.account.state(),
            "step_times": p.steps.state_dict(), "shapes": p.tally.shape_state(),
            "saved_at_unix": time.time()}


def resume(p: Parts, state: dict) -> None:
    """Continue counters, clock, consumption, step times, reached targets, the counted HFU ratio and the
    batch shapes seen from a checkpoint's state (:meth:`~mlflow_llmeff.monitor.meter.EfficiencyMonitor.state_dict`)."""
    job = p.job
    p.meter = ThroughputMeter(num_devices=p.world_size, warmup_steps=p.warmup_steps)
    p.meter.load_state_dict(state["throughput"])
    p.ledger.load_state_dict(state["ledger"])
    # the checkpoint's clock at the devices its attempts held (a checkpoint without them: this many)
    seconds, held = state["ledger"]["seconds"], state.get("consumption", {})
    job.written_on(int(held.get("devices") or p.world_size))  # the writer's, for its lost tail
    wall, init = wall_of(seconds), float(seconds.get("init", 0.0))
    p.consumption.add_earlier(wall, device_s=float(held.get("device_s", wall * job.tail_devices)), init_s=init,
                              init_device_s=float(held.get("init_device_s", init * job.tail_devices)))
    p.consumption.earlier_devices(tuple(int(n) for n in held.get("device_counts", [job.tail_devices])))
    p.reached.load(state.get("ttq_reached", {}), state.get("ttq_best"))
    job.set_attempts(int(state.get("attempts", 1)) + 1)
    p.consumption.resume(state.get("consumption", {}), {})
    p.steps.load_state_dict(state.get("step_times"))
    p.account.load(state.get("hfu_counted"))  # counted in an earlier attempt: not again
    p.tally.load_shape_state(state.get("shapes"))  # a length that varied before the checkpoint still did
