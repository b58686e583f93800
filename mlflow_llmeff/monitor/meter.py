"""EfficiencyMonitor: the one meter every path reports through (``llmeff train``, autolog, your loop).

It is the only place that counts tokens, keeps the clock, reads energy, computes FLOPs, MFU and
HFU, cost, carbon, goodput and time-to-quality, and talks to the logger; the training entrypoint
(``mlflow_llmeff/train/loop.py``) drives it exactly as a user's loop does, and the autolog
integrations drive the same object, so every figure means the same on every path
(``../shared/METRICS.md``):

* tokens are non-padding input tokens (``attention_mask.sum()``), counted on the device
  (:class:`~mlflow_llmeff.monitor.counting.StepTally`), summed over ranks at window edges (end of warm-up,
  every ``log_every_n_steps``-th step, steps the caller marks, the end), where the device is
  synchronized;
* the clock is explicit (:class:`~mlflow_llmeff.calc.goodput.TimeLedger`): non-step work is declared
  with :meth:`EfficiencyMonitor.pause` and never lands in a step; throughput, step time and MFU
  use step time only, and wall time is productive time plus the badput categories, exactly;
* the first ``warmup_steps`` steps of every attempt are excluded from steady-state figures;
* consumption totals (energy, codecarbon's estimate, carbon, cost) and the clock continue across
  resumes (:meth:`EfficiencyMonitor.state_dict`, ``resume_state=``);
* only rank 0 logs, through the batched asynchronous, validating
  :class:`~mlflow_llmeff.tracking.logger.RunLogger`; every ending gets its status
  (:mod:`mlflow_llmeff.monitor.lifecycle`).

Collectives: :meth:`step` at window edges, :meth:`log_eval`, :meth:`state_dict` and :meth:`finish`
(with ``collective=True``) must be called on every rank in the same order. A failure inside the
monitor after construction warns once and turns it into a no-op; it never stops training. Bad
arguments raise ``ValueError``.
"""

from __future__ import annotations

import logging
import math
import os
import time
import warnings
from contextlib import contextmanager
from typing import Any, Callable

from mlflow_llmeff.meters import collectives
from mlflow_llmeff.monitor import lifecycle
from mlflow_llmeff import names
from mlflow_llmeff.monitor.conditions import (FLOPS_FORMULA_NOTE, condition_tags, infer_precision, infer_strategy, is_compiled,
                         recompute_plan, shape_tags, unwrap_model, uses_activation_checkpointing)
from mlflow_llmeff.calc.goodput import PAUSES, TimeLedger, breakdown, goodput
from mlflow_llmeff.calc.throughput import ThroughputMeter

__all__ = ["EfficiencyMonitor", "PRECISIONS", "unwrap_model", "infer_precision", "infer_strategy"]

log = logging.getLogger(__name__)

#: Compute precisions the monitor accepts (the ``llmeff.precision`` tag).
PRECISIONS = ("fp32", "bf16", "fp16", "fp8")
#: Interval keys that are running totals (logged again at the end if the last step has none).
_TOTAL_KEYS = (names.ENERGY_TOTAL_KWH, names.CARBON_TOTAL_KG, names.COST_TOTAL_USD, names.ENERGY_ESTIMATE_CPU_KWH,
               names.ENERGY_ESTIMATE_RAM_KWH, names.CARBON_ESTIMATE_KG)


def _check_args(log_every_n_steps, warmup_steps, precision, measure_energy, energy_meter, peak_tflops,
                device_hour_usd, usd_per_kwh) -> None:
    from mlflow_llmeff.meters import energy as en

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



#: Strategy name prefixes whose data-parallel ranks shard model state (FSDP; every ZeRO stage shards at
#: least the optimizer state), as parallel/ gives their degrees and a user's loop names them.
_SHARDED_STRATEGIES = ("fsdp", "deepspeed", "zero")

class EfficiencyMonitor:
    """Standard throughput, MFU/HFU, energy, carbon, cost, goodput and time-to-quality for any loop.

    Example::

        with EfficiencyMonitor(model=model, optimizer=opt, log_every_n_steps=10) as mon:
            for batch in loader:
                loss = model(**batch).loss
                loss.backward(); opt.step(); opt.zero_grad()
                mon.step(batch=batch, loss=loss)
                if mon.step_count % 100 == 0:
                    with mon.pause("eval"):
                        mon.log_eval({"val_loss": evaluate(model)})

    Args:
        log_every_n_steps: optimizer steps between logged points (>= 1).
        warmup_steps: first optimizer steps of every attempt excluded from steady-state figures (>= 0).
        model: the model being trained (wrappers are looked through): its ``config`` gives FLOPs
            per token; its parameters the device, precision and ``llmeff.model.*`` tags.
        model_config: a Hugging Face config (or :class:`~mlflow_llmeff.calc.flops.ModelShape`) when
            ``model`` has none; without either, TFLOP/s, MFU and HFU are omitted.
        optimizer: read for ``train/learning_rate`` and ``summary/model_state_bytes_per_param``.
        peak_tflops: dense peak TFLOP/s per device; default: the datasheet table, else no MFU.
        precision: one of :data:`PRECISIONS`; default: the dtype of the model's parameters.
        strategy: ``llmeff.parallelism.strategy``; default: from the model's wrappers.
        compile: the model is compiled (warm-up excess named ``compile``); default: detected.
        activation_checkpointing: activation checkpointing is on (HFU adds the recomputed forward of the
            checkpointed layers, read off HF models: flops.Recompute); default: detected (HF models).
        run_id: MLflow run to continue (a resumed run); default: the active run, ``MLFLOW_RUN_ID``,
            else a new run (which :meth:`finish` ends). Only rank 0 touches MLflow.
        run_name: name of a new run; default ``<model>-<accelerator>-<count>x-<strategy>-<precision>``.
        experiment_name: experiment of a new run; default: MLflow's current experiment.
        tags: extra tags (keys MLflow refuses are mapped, see :mod:`mlflow_llmeff.tracking.keys`).
        params: MLflow params of the run (never re-logged with a new value on resume).
        device_hour_usd: price per device-hour for ``cost/*``; default: the dated table.
        usd_per_kwh: energy price added to the cost (measured energy only); default: none.
        measure_energy: ``auto``, ``nvml``, ``rapl`` or ``none`` (``none`` also turns carbon off).
        energy_meter: an :class:`~mlflow_llmeff.meters.energy.EnergyMeter` to use instead (tests), or one the
            caller started earlier (e.g. at process start) so that the energy covers the set-up too;
            a started meter is not restarted (``llmeff.energy.span``).
        country_iso_code, cloud_provider, cloud_region: where the machines are, for codecarbon's
            grid intensity (offline).
        carbon_tracker: a :class:`~mlflow_llmeff.meters.carbon.CarbonTracker` to use instead (tests).
        measure_peak: measure the achievable matmul peak (cached per device and dtype) for
            ``summary/mfu_measured_peak``.
        targets: time-to-quality targets, e.g. ``"val_loss<=1.9,hellaswag/acc_norm>=0.30"``.
        start_step: optimizer steps already done (a resumed loop without ``resume_state``).
        resume_state: :meth:`state_dict` of the checkpoint being resumed: counters, clock and
            consumption continue.
        started_at: ``clock()`` value at which this attempt started (default: now); the time
            until construction ends is ``init``.
        clock: monotonic seconds (tests inject a fake clock).
        integration: ``llmeff.autolog.integration`` (train, monitor, trainer, accelerate, pytorch).
        track_loss: log ``train/loss`` from the losses passed to :meth:`count` / :meth:`step`.
        heartbeat_path: a small JSON file (e.g. in the checkpoint folder) that rank 0 rewrites at
            every logged step with the time, step and consumption totals. After a SIGKILL the
            resumed attempt reads it for the lost progress and the energy so far, even when the
            last points never reached the tracking server.
        data_parallel_size: ranks that see different data (default: every rank). With tensor,
            context or pipeline parallelism the ``world / data_parallel_size`` ranks of a
            model-parallel group count the same tokens: the counts summed over all ranks are
            divided by that factor, so tokens count once per data-parallel rank; per-device
            figures still divide by the world size, and HFU scales each rank's counted FLOPs by it.
        outbox_dir: where points the tracking server has not taken spill (before checkpoints and at
            the end) while it does not answer; default ``$LLMEFF_OUTBOX_DIR`` or
            ``~/.cache/mlflow_llmeff/outbox``. ``llmeff sync DIR`` sends them later.
        report: log ``efficiency_report.json`` and figures at the end.
        contention_meter: a :class:`~mlflow_llmeff.monitor.contention.ContentionMeter` to use
            instead of one reading this machine (tests pass one over the fake NVML).
        eval_subject_metrics: also log per-subject MMLU scores as metrics (``eval/mmlu_<subject>/acc``);
            by default they are one table artifact per eval (``eval/mmlu_subjects/step_<step>.json``).

    Raises:
        ValueError: for a bad argument (the message names it and what is accepted).
    """

    def __init__(self, *, log_every_n_steps: int = 10, warmup_steps: int = 3, model=None, model_config=None,
                 optimizer=None, peak_tflops: float | None = None, precision: str | None = None,
                 strategy: str | None = None, compile: bool | None = None,
                 activation_checkpointing: bool | None = None, run_id: str | None = None,
                 run_name: str | None = None, experiment_name: str | None = None,
                 tags: dict[str, str] | None = None, params: dict[str, str] | None = None,
                 device_hour_usd: float | None = None, usd_per_kwh: float | None = None,
                 measure_energy: str = "auto", energy_meter=None, country_iso_code: str | None = "USA",
                 cloud_provider: str | None = None, cloud_region: str | None = None, carbon_tracker=None,
                 measure_peak: bool = True, targets: str | None = None, start_step: int = 0,
                 resume_state: dict | None = None, started_at: float | None = None,
                 clock: Callable[[], float] = time.perf_counter, integration: str = "monitor",
                 track_loss: bool = True, heartbeat_path: str | None = None, outbox_dir: str | None = None,
                 report: bool = True, contention_meter=None, eval_subject_metrics: bool = False,
                 data_parallel_size: int | None = None) -> None:
        from mlflow_llmeff.evals.targets import parse_targets

        self._heartbeat_path, self._outbox_dir = heartbeat_path, outbox_dir
        _check_args(log_every_n_steps, warmup_steps, precision, measure_energy, energy_meter, peak_tflops,
                    device_hour_usd, usd_per_kwh)
        self._targets = parse_targets(targets, any_metric=True)
        self._ledger = TimeLedger(clock, started_at)
        # this attempt's start on the meter's clock: MLflow's Duration starts at the run's creation instead
        self._attempt_start = clock() if started_at is None else float(started_at)
        self.log_every_n_steps, self.warmup_steps, self.track_loss = log_every_n_steps, warmup_steps, track_loss
        self._clock, self._optimizer, self._model, self._integration = clock, optimizer, model, integration
        self._report = report
        self._subject_metrics = bool(eval_subject_metrics)
        self._broken = self._finished = False
        self._summary: dict[str, float] = {}
        self._lr: float | None = None
        self._nonfinite: tuple[int, float] | None = None  # first logged non-finite train/loss
        self._pending_steps, self._pending_s = 0, 0.0
        self._reached: dict[str, int] = {}
        self._attempts = 1
        self._totals_step = -1  # step of the last logged running totals
        self._hfu_ratio: float | None = None
        self._hfu_note = "none: no model config (no FLOPs per token)"
        self._shape_tags_pending = True
        self.world_size, self.rank = collectives.world_and_rank()
        self.is_main = self.rank == 0
        self._model_parallel = self._replication(data_parallel_size)
        self._extra_summary: dict[str, float] = {}
        from mlflow_llmeff.monitor.counting import StepTally

        self._tally = StepTally()
        self._read_model(model, model_config, precision, strategy, compile, activation_checkpointing)
        self._meter = ThroughputMeter(num_devices=self.world_size, warmup_steps=warmup_steps, start_step=start_step)
        self._set_up_measurement(peak_tflops, measure_peak, device_hour_usd, usd_per_kwh, measure_energy,
                                 energy_meter, country_iso_code, cloud_provider, cloud_region, carbon_tracker)
        self._set_up_step_timing(model, contention_meter)
        self._read_flops(model)  # after the energy meter started: a meta-device count takes seconds
        from mlflow_llmeff.tracking.logger import NullLogger

        self._logger, self._run = NullLogger(), None
        if resume_state:
            self._load(resume_state)
        if self.is_main:
            self._open_run(run_id, run_name, experiment_name, tags or {}, params or {}, resume_state)
        self._carbon.start()
        self._consumption.intensity_g_per_kwh = self._carbon.intensity_g_per_kwh
        self._note_energy_head_gap()
        lifecycle.install()
        lifecycle.register(self)
        self._ledger.begin()
        if self._devclock is not None:
            self._devclock.restart()
        self._consumption.start_interval(self._ledger.wall_s(), self._meter.total.tokens)
        if self._meter.warmup_end_step == self._meter.step:  # no warm-up: the steady window starts now
            self._contention.begin(collective=self.world_size > 1)

    # ------------------------------------------------------------------------------ set-up
    def _replication(self, data_parallel_size: int | None) -> int:
        """Ranks counting the same tokens (``world / data_parallel_size``; 1 without model parallelism)."""
        if data_parallel_size is None:
            return 1
        dp = data_parallel_size
        if not isinstance(dp, int) or isinstance(dp, bool) or dp < 1 or self.world_size % dp:
            raise ValueError(f"data_parallel_size={dp!r} is not accepted; give an int >= 1 dividing the world "
                             f"size {self.world_size}")
        return self.world_size // dp

    def add_summary(self, metrics: dict[str, float]) -> None:
        """Figures measured outside the meter (e.g. ``summary/comm_*``) to log with the ``summary/*`` at
        :meth:`finish`; call it on rank 0 at least (other ranks' calls are ignored)."""
        self._extra_summary.update({k: float(v) for k, v in metrics.items()})

    def _read_model(self, model, model_config, precision, strategy, compile, act_ckpt) -> None:
        """Device, precision, strategy, compile and activation-checkpointing flags, and the config, from the model."""
        inner = unwrap_model(model) if model is not None else None
        self._device = None
        if inner is not None:
            try:
                self._device = next(inner.parameters()).device
            except Exception:  # noqa: BLE001 - a model without parameters
                self._device = None
        self.precision = precision or (infer_precision(inner) if inner is not None else "fp32")
        self.strategy = strategy or infer_strategy(model, self.world_size)
        self.compiled = bool(compile) if compile is not None else (model is not None and is_compiled(model))
        self.activation_checkpointing = (bool(act_ckpt) if act_ckpt is not None
                                         else model is not None and uses_activation_checkpointing(model))
        self._config = model_config if model_config is not None else getattr(inner, "config", None)

    def _read_flops(self, model) -> None:
        """FLOPs per token (formula, else counted on the meta device) and what checkpointing recomputes."""
        from mlflow_llmeff.calc import flops as fl

        self._recompute = None
        if self.activation_checkpointing:  # what the wrapper re-executes; transformers' default when unreadable
            self._recompute = recompute_plan(model) or fl.Recompute()
        config = self._config
        self._shape, self._fpt_note = None, "unknown: no model config (pass model= or model_config=)"
        self._flops_method = "none: no model config (pass model= or model_config=)"
        if config is not None:
            from mlflow_llmeff.meters.flopcount import resolve

            source = resolve(config, recompute=self._recompute)  # formula, else counted on the meta device
            self._shape, self._flops_method = source.flops, source.note
            if source.flops is None:
                self._fpt_note = f"unknown: {source.note}"
            else:
                self._fpt_note = FLOPS_FORMULA_NOTE
                why = ("compile=true (FlopCounterMode would stop torch.compile)" if self.compiled
                       else "no FlopCounterMode step on this path")
                recomputed = (f" + the recomputed forward of {self._recompute.describe()}, LM head and embedding "
                              "not recomputed" if self._recompute else "")
                self._hfu_note = (f"analytic: {why}; palm-convention FLOPs (dense attention, no causal discount)"
                                  f"{recomputed} over megatron model FLOPs")

    def _set_up_measurement(self, peak_tflops, measure_peak, device_hour_usd, usd_per_kwh, measure_energy,
                            energy_meter, country_iso_code, cloud_provider, cloud_region, carbon_tracker) -> None:
        """Peaks (datasheet and measured), price, energy meter and carbon tracker."""
        from mlflow_llmeff.calc import cost as cost_mod
        from mlflow_llmeff.meters import energy as en
        from mlflow_llmeff.meters import hardware as hw
        from mlflow_llmeff.meters.carbon import CarbonTracker
        from mlflow_llmeff.monitor.consumption import Consumption

        device_type = self._device.type if self._device is not None else None
        self.accelerator = hw.detect_accelerator(count=self.world_size, device_type=device_type)
        if energy_meter is None:
            idx = [self._device.index or 0] if device_type == "cuda" else None
            energy_meter = (en.make_meter(measure_energy, device_indices=idx) if measure_energy != "none"
                            else en.NullMeter("measure_energy=none"))
        self._energy = energy_meter
        if not self._energy.started:  # first: the energy's span starts here (a caller may start it earlier)
            self._energy.start()
        self.peak_tflops, self._peak_source = hw.resolve_peak(self.accelerator, self.precision, peak_tflops)
        self._measured_peak, self._measured_peak_note = None, "not measured (measure_peak=False)"
        if measure_peak:
            self._measure_peak()
        self._price, self._price_source = cost_mod.device_hour_price(self.accelerator.short, device_hour_usd)
        self._cost_tags = cost_mod.cost_tags(self._price, self._price_source, usd_per_kwh)
        self._carbon = carbon_tracker or CarbonTracker(
            country_iso_code=country_iso_code, cloud_provider=cloud_provider, cloud_region=cloud_region,
            enabled=measure_energy != "none")
        self._consumption = Consumption(devices=self.world_size, device_hour_usd=self._price, usd_per_kwh=usd_per_kwh)

    def _set_up_step_timing(self, model, contention_meter) -> None:
        """Per-step times (device events on CUDA), each rank's forward time, and the contention meter."""
        from mlflow_llmeff.monitor.contention import ContentionMeter
        from mlflow_llmeff.monitor.steptimes import DeviceStepClock, ForwardTimer, StepTimes, cuda_event_factory

        cuda = self._device is not None and self._device.type == "cuda"
        self._steps, self._pending_step_s = StepTimes(), []
        self._devclock = DeviceStepClock(cuda_event_factory()) if cuda else None
        self._fwd_s, self._fwd_steps, self._fwd = 0.0, 0, None
        inner = unwrap_model(model) if model is not None else None
        if inner is not None and hasattr(inner, "register_forward_pre_hook"):
            self._fwd = ForwardTimer(inner, self._forward_counts, self._clock,
                                     event=cuda_event_factory() if cuda else None)
        self._contention = contention_meter or ContentionMeter(device=self._device)

    def _forward_counts(self) -> bool:
        """True while a forward pass is part of a steady step (not warm-up, not inside a declared pause)."""
        return not self._ledger.paused and not self._meter.is_warmup(self.step_count + 1)

    def _measure_peak(self) -> None:
        """Achievable matmul TFLOP/s on this device and dtype (cached per machine: seconds, once)."""
        from mlflow_llmeff.meters import hardware as hw

        dev = self._device
        where = "cpu" if dev is None or dev.type == "cpu" else str(dev)
        try:
            self._measured_peak = hw.measure_matmul_peak(self.precision, where)
            self._measured_peak_note = f"{self._measured_peak:.4g}"
        except Exception as e:  # noqa: BLE001 - an unmeasurable peak leaves mfu_measured_peak out, with the reason
            self._measured_peak_note = f"unknown: {type(e).__name__}: {e}"
        if dev is not None and dev.type == "cuda":  # its matrices must not count in the run's peak memory
            import torch

            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(dev)

    def _load(self, state: dict) -> None:
        """Continue counters, clock, consumption and reached targets from a checkpoint's state."""
        self._meter = ThroughputMeter(num_devices=self.world_size, warmup_steps=self.warmup_steps)
        self._meter.load_state_dict(state["throughput"])
        self._ledger.load_state_dict(state["ledger"])
        self._reached = {k: int(v) for k, v in state.get("ttq_reached", {}).items()}
        self._attempts = int(state.get("attempts", 1)) + 1
        self._consumption.resume(state.get("consumption", {}), {})
        self._steps.load_state_dict(state.get("step_times"))
        if state.get("hfu_counted"):  # counted in an earlier attempt: not again (see counting_hardware_flops)
            self._hfu_ratio, self._hfu_note = float(state["hfu_counted"][0]), str(state["hfu_counted"][1])
            self._hfu_counted = True

    def _open_run(self, run_id, run_name, experiment_name, extra_tags, params, resume_state) -> None:
        """Rank 0: open or continue the MLflow run, tag the conditions, account a crashed attempt's tail."""
        import mlflow

        from mlflow_llmeff.tracking.naming import parts_from_tags, study_name
        from mlflow_llmeff.tracking.logger import RunLogger
        from mlflow_llmeff.tracking.runs import open_run

        client = mlflow.MlflowClient()
        parts = parts_from_tags({**self._condition_tags(), names.MODEL_NAME: self._model_name(), **extra_tags},
                                params.get("eval_tasks"))
        name = run_name or study_name(parts)  # the fixed order, until the experiment's runs are read
        self._run = open_run(client, run_id=run_id, run_name=name, experiment_name=experiment_name,
                             unique_name=run_name is None, outbox_dir=self._outbox_dir,
                             name_parts=parts if run_name is None else None)
        # seconds from this attempt's start to the run's creation (None: a run created by an earlier attempt)
        self._created_after_s = None if self._run.resumed and self._run.fresh_since_unix is None else \
            self._clock() - self._attempt_start
        if self._run.fresh_since_unix is not None and not resume_state:  # mlflow run: the run's wall time
            self._ledger.start_earlier(self._clock() - max(0.0, time.time() - self._run.fresh_since_unix))
            self._created_after_s = 0.0  # the launcher created it; the wall time starts there too
        self._logger = RunLogger(self._run.run_id, client, resume=self._run.resumed, outbox_dir=self._outbox_dir,
                                 first=self._run.pending, unanswered=self._run.unanswered,
                                 local_id=self._run.local_id)
        if resume_state:
            self._account_crashed_tail(resume_state)
        self._given_tags = set(extra_tags)
        changed = self._logger.log_params(params) if params else {}
        tags = {**self._condition_tags(), **extra_tags, names.RESUME_ATTEMPTS: str(self._attempts)}
        if resume_state:
            tags[names.RESUMED_FROM] = str(self._meter.step)
        if changed:
            tags[names.RESUME_CHANGED] = ", ".join(f"{k}: {a} -> {b} (not re-logged)" for k, (a, b) in changed.items())
        self._logger.set_tags(tags)

    def _account_crashed_tail(self, state: dict) -> None:
        """The crashed attempt ran on after its checkpoint until its last logged point: lost progress,
        and its energy and estimate continue from that point's totals."""
        last = {}
        for key in self._HEARTBEAT_KEYS:
            point = self._logger.last_point(key)
            if point is not None:
                last[key] = float(point[1])
        newest, saved = self._logger.last_timestamp_s, state.get("saved_at_unix")
        beat = self._read_heartbeat()
        if beat is not None and float(beat["unix"]) > (newest or 0.0):  # newer than what reached the server
            newest = float(beat["unix"])
            last.update({k: float(v) for k, v in beat.get("totals", {}).items()})
        # the server did not answer: the steps the crashed attempt logged (at least the checkpoint's) are
        # not logged again, so a replayed step never has two points
        self._logger.assume_logged_through(max(int(state.get("step", 0)), int(beat["step"]) if beat else 0))
        self._consumption.resume(state.get("consumption", {}), last)
        if newest is not None and saved is not None:
            self._ledger.add("lost_progress", max(0.0, float(newest) - float(saved)))

    def _model_name(self) -> str:
        from mlflow_llmeff.monitor.conditions import model_name

        return model_name(self._model, self._config)

    def _condition_tags(self) -> dict[str, str]:
        tags = self._conditions()
        dp = self.world_size // self._model_parallel
        # a user's loop: its data-parallel ranks hold sharded state under FSDP and ZeRO-3 (llmeff train
        # passes its layout's own degrees as tags, which win)
        shard = dp if str(self.strategy or "").startswith(_SHARDED_STRATEGIES) else 1
        tags.update({names.PAR_DP: str(dp), names.PAR_DP_SHARD: str(shard), names.PAR_DP_REPLICATE: str(dp // shard)})
        # communication is measured by llmeff train (docs/parallelism.md), which sets these again
        why = "none: measured by llmeff train only (a collective probe at its start, sampled warm-up steps)"
        tags.update({names.COMM_PROBE: why, names.COMM_SAMPLED: why})
        return tags

    def _conditions(self) -> dict[str, str]:
        return condition_tags(
            accelerator=self.accelerator, world=self.world_size, strategy=self.strategy, precision=self.precision,
            model=self._model, config=self._config, flops_note=self._fpt_note, peak_tflops=self.peak_tflops,
            peak_source=self._peak_source, measured_peak_note=self._measured_peak_note,
            warmup_steps=self.warmup_steps, energy_source=self._energy.source, energy_why=self._energy.why,
            integration=self._integration, compiled=self.compiled,
            activation_checkpointing=self.activation_checkpointing, cost_tags=self._cost_tags,
            flops_method=self._flops_method)

    # ------------------------------------------------------------------------------ failures
    def _fail(self, e: BaseException) -> None:
        if not self._broken:
            self._broken = True
            warnings.warn(f"mlflow_llmeff: EfficiencyMonitor stopped ({type(e).__name__}: {e}); training continues",
                          stacklevel=3)
        log.debug("monitor failure", exc_info=e)

    @property
    def _off(self) -> bool:
        return self._broken or self._finished

    # ------------------------------------------------------------------------------ counting
    def count(self, batch=None, *, tokens=None, padded_tokens=None, loss_tokens=None, samples=None,
              sum_len_sq=None, loss=None) -> None:
        """Count one micro-batch of the current optimizer step (gradient accumulation: call per micro-batch).

        Args:
            batch: a mapping with ``input_ids`` ``(B, T)`` and optionally ``attention_mask`` ``(B, T)``
                and ``labels`` ``(B, T)`` (-100 = no loss), or a ``(B, T)`` tensor of token ids.
                Counted on the device, without synchronizing.
            tokens: non-padding tokens of this micro-batch on this rank (instead of ``batch``).
            padded_tokens: input positions including padding (default: ``tokens``).
            loss_tokens: loss-bearing tokens (default: ``tokens - samples`` when ``samples`` is known,
                else ``tokens``).
            samples: sequences (default 0: ``throughput/samples_per_sec`` then reads 0).
            sum_len_sq: sum of squared sequence lengths (default: ``tokens^2 / samples``, i.e. equal
                lengths); sets the effective sequence length of the attention FLOPs.
            loss: this micro-batch's mean loss (float or 0-d tensor; not synchronized).
        """
        if self._off:
            return
        try:
            if batch is not None:
                self._tally.add_batch(batch)
                if self._device is None:
                    self._device = self._tally.device
            if tokens is not None:
                self._tally.add_numbers(tokens, padded_tokens, loss_tokens, samples, sum_len_sq)
            if loss is not None and self.track_loss:
                self._tally.add_loss(loss)
            self._tally.micro += 1
        except Exception as e:  # noqa: BLE001 - never stop training
            self._fail(e)

    def step(self, batch=None, *, tokens=None, padded_tokens=None, loss_tokens=None, samples=None,
             sum_len_sq=None, loss=None, learning_rate: float | None = None, edge: bool = False) -> None:
        """End one optimizer step; optionally count its last (or only) micro-batch first.

        Takes the same counting arguments as :meth:`count`, plus ``learning_rate`` (default: read
        from ``optimizer`` at logged steps) and ``edge``: True makes this step a window edge (a
        collective) so that an eval or checkpoint right after it sees exact totals. At window edges
        it synchronizes the device, sums the counts over ranks and logs (rank 0).
        """
        if self._off:
            return
        if batch is not None or tokens is not None or loss is not None:
            self.count(batch, tokens=tokens, padded_tokens=padded_tokens, loss_tokens=loss_tokens,
                       samples=samples, sum_len_sq=sum_len_sq, loss=loss)
        try:
            if learning_rate is not None:
                self._lr = float(learning_rate)
            self._tally.end_step()
            if self._devclock is not None:
                self._devclock.step_end()
            step = self.step_count + 1
            log_now = step % self.log_every_n_steps == 0
            at_edge = log_now or edge or step == self._meter.warmup_end_step
            if at_edge:
                collectives.synchronize(self._device)
            warmup = self._meter.is_warmup(step)
            seconds = self._ledger.step_done(warmup)
            self._pending_s += seconds
            self._pending_steps += 1
            if not warmup:
                self._pending_step_s.append(seconds)
            if self._shape_tags_pending:
                self._tag_shape()
            if at_edge:
                self._at_edge(step, log_now)
        except Exception as e:  # noqa: BLE001 - never stop training
            self._fail(e)

    def _at_edge(self, step: int, log_now: bool) -> None:
        """The meter's own work at a window edge (reductions, rates, sampling, handing points to the
        logger), timed as ``other`` so that it lands in no step: a step's time is the training's."""
        self._ledger.enter("other")
        try:
            self._edge()
            if step == self._meter.warmup_end_step:  # the steady window starts after this step
                self._contention.begin(collective=self.world_size > 1)
            if log_now:
                self._log_interval(step)
        finally:
            self._ledger.exit()
            if self._devclock is not None:
                self._devclock.restart()

    @property
    def step_count(self) -> int:
        """Optimizer steps seen (including earlier attempts and ``start_step``)."""
        return self._meter.step + self._pending_steps

    def _tag_shape(self) -> None:
        self._shape_tags_pending = False
        if self._tally.first_shape is not None and self.is_main:
            b, s, ga = self._tally.first_shape
            given = getattr(self, "_given_tags", set())
            tags = {k: v for k, v in shape_tags(b, s, max(1, ga), self.world_size // self._model_parallel).items()
                    if k not in given}
            if tags:
                self._logger.set_tags(tags, synchronous=False)  # inside the first step: no wait

    # ------------------------------------------------------------------------------ the clock
    @contextmanager
    def pause(self, category: str):
        """Declare non-step work: ``with monitor.pause("eval"): ...``.

        Categories: ``eval``, ``checkpoint_save``, ``checkpoint_load``, ``data_wait`` (host time
        blocked on the next batch; it stays inside the step, see docs/time.md), ``init``
        (set-up after the monitor started) and ``other``. The device is synchronized at both ends
        (except for ``data_wait``) so the pause holds exactly its own work. Not a collective: a
        pause on one rank only is fine. Nested pauses count in the outermost.

        Raises:
            ValueError: for a category not in :data:`~mlflow_llmeff.calc.goodput.PAUSES`.
        """
        self.enter_pause(category)
        try:
            yield
        finally:
            self.exit_pause()

    def enter_pause(self, category: str) -> None:
        """Start a pause (for hooks that cannot use ``with``); pair with :meth:`exit_pause`.

        Raises:
            ValueError: for a category not in :data:`~mlflow_llmeff.calc.goodput.PAUSES`.
        """
        if category not in PAUSES:
            raise ValueError(f"pause category {category!r} is not accepted; use one of: {', '.join(PAUSES)}")
        self._pause_sync = getattr(self, "_pause_sync", [])
        self._pause_sync.append(category != "data_wait")
        if self._off:
            return
        try:
            if self._pause_sync[-1]:
                collectives.synchronize(self._device)
            self._ledger.enter(category)
        except Exception as e:  # noqa: BLE001
            self._fail(e)

    def exit_pause(self) -> None:
        """End the pause :meth:`enter_pause` started."""
        sync = self._pause_sync.pop() if getattr(self, "_pause_sync", None) else False
        if self._broken:
            return
        try:
            if sync:
                collectives.synchronize(self._device)
            self._ledger.exit()
            if sync and self._devclock is not None and not self._ledger.paused:  # the next step starts here
                self._devclock.restart()
        except Exception as e:  # noqa: BLE001
            self._fail(e)

    @contextmanager
    def counting_hardware_flops(self):
        """Count the hardware FLOPs of the step run inside (``FlopCounterMode``) for HFU.

        Wrap one whole early step (all its micro-batches, before :meth:`step`); the ratio of its
        counted FLOPs to its model FLOPs then gives HFU = MFU x ratio. Not under ``torch.compile``
        (the counter stops dynamo from compiling): there the analytic ratio stays. CPU
        scaled-dot-product attention, which the counter cannot see, is added analytically
        (``palm`` convention, and its recomputation in checkpointed layers). Counted once per run:
        a resumed attempt keeps the checkpoint's ratio, so its first step runs exactly as an
        uninterrupted run's (the counter can change which kernels run, and so the last bits of the
        weights).
        """
        if self._off or self.compiled or self._shape is None or getattr(self, "_hfu_counted", False):
            yield
            return
        from torch.utils.flop_counter import FlopCounterMode

        counter = FlopCounterMode(display=False)
        before = self._tally.peek_tokens()
        with counter:
            yield
        try:
            self._set_counted_ratio(float(counter.get_total_flops()), before)
        except Exception as e:  # noqa: BLE001
            self._fail(e)

    def _set_counted_ratio(self, counted: float, before: tuple[int, int]) -> None:
        from mlflow_llmeff.calc import flops as fl

        tokens, sq = (a - b for a, b in zip(self._tally.peek_tokens(), before))
        if tokens <= 0 or counted <= 0:
            return
        s_eff = sq / tokens
        note = "FlopCounterMode on step {} of the attempt (eager attention counted)"
        attn_impl = getattr(self._config, "_attn_implementation", None)
        r = self._model_parallel  # a model-parallel rank executes about 1/r of its tokens' FLOPs
        if attn_impl == "sdpa" and (self._device is None or self._device.type == "cpu"):
            # the counter cannot see CPU SDPA: its training FLOPs (palm) and its recomputation, if any;
            # a model-parallel rank executes 1/r of them
            extra = (fl.attention_flops_per_token(self._shape, s_eff, "palm")
                     + fl.recompute_flops_per_token(self._shape, s_eff, self._recompute, attention_only=True))
            counted += extra * tokens / r
            note = "FlopCounterMode on step {} of the attempt; CPU SDPA attention added analytically (palm)"
        if r > 1:
            note += f"; this rank's FLOPs x {r} ranks sharing its tokens"
        self._hfu_ratio = counted * r / (fl.flops_per_token(self._shape, s_eff) * tokens)
        self._hfu_note = note.format(self.step_count + 1)
        self._hfu_counted = True

    def _ratio(self, s_eff: float) -> float | None:
        """Hardware FLOPs per model FLOP (counted, else analytic)."""
        if self._hfu_ratio is not None:
            return self._hfu_ratio
        if self._shape is None or s_eff <= 0:
            return None
        cache = self.__dict__.setdefault("_ratio_cache", {})
        if s_eff not in cache:
            from mlflow_llmeff.calc import flops as fl

            cache.clear()  # one batch shape at a time in practice
            cache[s_eff] = fl.hardware_model_ratio(self._shape, s_eff, recompute=self._recompute)
        return cache[s_eff]

    # ------------------------------------------------------------------------------ window edges
    def _edge(self, collective: bool = True) -> None:
        """Account the pending steps: counts summed over ranks, with their step seconds."""
        reduce = self._reduce_counts if (collective and self.world_size > 1) else None
        counts = self._tally.take(self._pending_steps, reduce=reduce)
        self._meter.add(counts, self._pending_s)
        self._time_steps(counts, self._pending_s)
        self._pending_steps, self._pending_s = 0, 0.0

    def _time_steps(self, counts, window_s: float) -> None:
        """Keep the per-step seconds (device events on CUDA) and forward time of a steady window just added."""
        device_s = self._devclock.take(window_s) if self._devclock is not None else None
        forward_s = self._fwd.take() if self._fwd is not None else 0.0
        host_s, self._pending_step_s = self._pending_step_s, []
        if counts.steps == 0 or self._meter.is_warmup(self._meter.step):
            return
        secs = device_s if device_s is not None and len(device_s) == len(host_s) else host_s
        self._steps.add_window(secs, counts.tokens)
        self._fwd_s += forward_s
        self._fwd_steps += counts.steps

    def _reduce_counts(self, t):
        """Counts summed over every rank, then divided by the ranks of a model-parallel group
        (they counted the same tokens): once per data-parallel rank."""
        t = collectives.reduce_tensor(t)
        r = self._model_parallel
        if r > 1:
            if bool((t % r).any()) and not getattr(self, "_replica_warned", False):
                self._replica_warned = True
                warnings.warn(f"mlflow_llmeff: token counts summed over ranks are not a multiple of the {r} ranks of "
                              "a model-parallel group: its ranks counted different batches", stacklevel=3)
            t = t // r
        return t

    def _fpt(self, s: float, convention: str = "megatron") -> float:
        from mlflow_llmeff.calc import flops as fl

        return fl.flops_per_token(self._shape, s, convention)

    def _refresh_consumption(self, collective: bool = True, loss: tuple[float, int] = (0.0, 0)) -> tuple[float, int]:
        """Read energy and codecarbon's estimate on every rank and sum them, with ``loss`` (sum, n) riding along.

        Each physical device is summed once: a rank adds only the devices it owns
        (:func:`~mlflow_llmeff.meters.energy.device_owners`: the lowest rank listing a device id reads it),
        so two ranks on one GPU count it once. Without a collective on several ranks (rank 0 alone at
        exit) the other ranks' readings cannot be had: the totals stay those of the last collective
        reading, and ``llmeff.energy.span`` says where the energy ends.
        """
        loss_sum, loss_n = loss
        many = self.world_size > 1
        if many and not collective:
            return loss_sum, int(loss_n)
        mine = self._energy_share(many)
        reading = self._energy.read() if self._energy.measures else None
        est = self._carbon.running_estimate()
        joules, devices, domains = 0.0, 0, 0
        if reading is not None:
            ours = [d for d in reading.per_device_j if d in mine]
            joules = sum(reading.per_device_j[d] for d in ours)
            domains = len(ours)
            devices = self._energy.num_devices if len(ours) == len(reading.per_device_j) else len(ours)
        local = [loss_sum, float(loss_n), joules, float(devices), est[0] if est else 0.0,
                 est[1] if est else 0.0, 1.0 if est else 0.0, float(domains)]
        g = collectives.all_reduce(local) if many else local
        self._consumption.update(joules=g[2], energy_devices=int(g[3]), estimate=(g[4], g[5]) if g[6] else None,
                                 measured_domains=int(g[7]), wall_s=self._ledger.wall_s())
        return g[0], int(g[1])

    def _energy_share(self, many: bool) -> set[str]:
        """The device ids this rank reports (once per run: one collective gathering every rank's devices)."""
        if getattr(self, "_energy_ids", None) is not None:
            return self._energy_ids
        from mlflow_llmeff.meters import energy as en

        owned = list(self._energy.owned)
        if not owned and self._energy.measures:  # a meter that names no devices: the ones it reads are its own
            owned = list(self._energy.read().per_device_j)
        mine = {"owned": owned, "unmeasured": self._energy.unmeasured}
        ranks = collectives.all_gather_object(mine) if many else [mine]
        owners = en.device_owners([r["owned"] for r in ranks])
        unmeasured = {d: why for r in ranks for d, why in r["unmeasured"].items() if d in owners}
        shared = {d: [i for i, r in enumerate(ranks) if d in r["owned"]] for d in owners}
        self._consumption.set_devices(len(owners), unmeasured, {d: rs for d, rs in shared.items() if len(rs) > 1})
        self._energy_ids = {d for d, rank in owners.items() if rank == self.rank}
        return self._energy_ids

    def _note_energy_head_gap(self) -> None:
        """Set-up seconds of this attempt before the energy meter started: in summary/wall_s, not in the energy."""
        if not self._energy.measures:
            return
        try:
            elapsed = self._energy.read().elapsed_s
        except Exception:  # noqa: BLE001 - an unreadable meter leaves the span as it is
            return
        attempt = self._ledger.snapshot()["init"] - self._ledger.seconds["init"]  # still in init: this attempt so far
        self._consumption.head_gap_s += max(0.0, attempt - elapsed)

    def _memory(self, collective: bool = True) -> tuple[float, float, str]:
        import torch

        from mlflow_llmeff.meters.probes import peak_memory_gib

        dev = self._device if self._device is not None else torch.device("cpu")
        alloc, reserved, source = peak_memory_gib(dev)
        self._memory_source = source
        if collective:
            alloc, reserved = collectives.all_reduce([alloc, reserved], op="max")
        return alloc, reserved, source

    def _learning_rate(self) -> float | None:
        if self._lr is not None:
            return self._lr
        try:
            lr = self._optimizer.param_groups[0]["lr"] if self._optimizer is not None else None
            return float(lr) if lr is not None else None
        except Exception:  # noqa: BLE001
            return None

    def _log_interval(self, step: int, collective: bool = True) -> None:
        """The interval metrics at a logged step (a collective: losses, energy and memory over ranks)."""
        total = self._meter.total
        loss_sum, loss_n = self._refresh_consumption(collective, self._tally.take_loss())
        alloc, reserved, _ = self._memory(collective)
        m: dict[str, float] = {names.TRAIN_TOKENS: total.tokens, names.TRAIN_PADDED_TOKENS: total.padded_tokens,
                               names.TRAIN_LOSS_TOKENS: total.loss_tokens,
                               names.MEM_MAX_ALLOC: alloc, names.MEM_MAX_RESERVED: reserved}
        if loss_n:
            m[names.TRAIN_LOSS] = loss_sum / loss_n
            if not math.isfinite(m[names.TRAIN_LOSS]) and self._nonfinite is None:
                self._nonfinite = (step, m[names.TRAIN_LOSS])
        lr = self._learning_rate()
        if lr is not None:
            m[names.TRAIN_LR] = lr
        rates = self._meter.interval()
        if rates is not None and self._meter.total.tokens == 0:
            self._note_nothing_counted()
            rates = None  # no token was counted: a rate of 0 tokens/s would be a number nobody measured
        if rates is not None:
            fpt = self._fpt if self._shape is not None else None
            m.update(rates.interval_metrics(fpt, self.peak_tflops, self._ratio(rates.counts.effective_seq_len)))
            self._warn_mfu(m.get(names.TPUT_DEVICE_MFU), f"step {step}")
        m.update(self._consumption.interval(self._ledger.wall_s(), total.tokens))
        m.update(self._contention.interval(collective))
        self._totals_step = step
        self._latest = m
        self._logger.log_metrics(m, step)
        if self._heartbeat_path and self.is_main:
            self._beat(step, m)

    _HEARTBEAT_KEYS = (names.ENERGY_TOTAL_KWH, names.ENERGY_ESTIMATE_CPU_KWH, names.ENERGY_ESTIMATE_RAM_KWH)

    def _beat(self, step: int, m: dict[str, float]) -> None:
        """Rewrite the heartbeat file (temp file + rename: a reader never sees half of it)."""
        import json

        beat = {"run_id": self.run_id, "step": step, "unix": time.time(),
                "totals": {k: m[k] for k in self._HEARTBEAT_KEYS if k in m}}
        tmp = f"{self._heartbeat_path}.tmp"
        try:
            os.makedirs(os.path.dirname(tmp) or ".", exist_ok=True)
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(beat, f)
            os.replace(tmp, self._heartbeat_path)
        except OSError as e:  # a full disk must not stop training
            log.debug("heartbeat not written: %s", e)

    def _read_heartbeat(self) -> dict | None:
        import json

        try:
            with open(self._heartbeat_path or "", encoding="utf-8") as f:
                beat = json.load(f)
        except (OSError, ValueError):
            return None
        return beat if beat.get("run_id") in (self.run_id, self._run.local_id if self._run else None) else None

    @property
    def nonfinite_loss(self) -> tuple[int, float] | None:
        """``(step, value)`` of the first logged step whose mean ``train/loss`` was NaN or infinite, else None.

        Checked where the loss is read anyway (logged steps, summed over ranks), so it costs no
        device synchronization; :meth:`check_loss` looks at the steps since the last logged one.
        """
        return self._nonfinite

    def check_loss(self, collective: bool = True) -> tuple[int, float] | None:
        """Like :attr:`nonfinite_loss`, also looking at the losses counted since the last logged step.

        Synchronizes the device (and, with ``collective``, reduces a flag over ranks: call it on
        every rank), so call it where the loop waits anyway, e.g. before a checkpoint save, so
        that a checkpoint never holds weights trained on a non-finite loss.
        """
        if self._nonfinite is not None or self._off:
            return self._nonfinite
        try:
            s, n = self._tally.peek_loss()
            bad = 1.0 if (n and not math.isfinite(s)) else 0.0
            if collective and self.world_size > 1:
                bad = collectives.all_reduce([bad], op="max")[0]
            if bad:
                self._nonfinite = (self.step_count, s / n if n else float("nan"))
        except Exception as e:  # noqa: BLE001
            self._fail(e)
        return self._nonfinite

    @property
    def latest_metrics(self) -> dict[str, float]:
        """The interval metrics of the last logged step (empty before the first)."""
        return getattr(self, "_latest", {})

    def _note_nothing_counted(self) -> None:
        if getattr(self, "_nothing_noted", False):
            return
        self._nothing_noted = True
        msg = ("EfficiencyMonitor.step() ran with no token counted (pass batch= or tokens= to step() or count()): "
               "no throughput, MFU or per-token figure is logged")
        warnings.warn(f"mlflow_llmeff: {msg}", stacklevel=4)
        self._logger.set_tags({names.AUTOLOG_NOTE: msg}, synchronous=False)

    def _warn_mfu(self, mfu: float | None, where: str) -> None:
        from mlflow_llmeff.calc import flops as fl

        warn = fl.mfu_warning(mfu)
        if warn and not getattr(self, "_mfu_warned", False):  # reported, never clipped
            self._mfu_warned = True
            log.warning(warn)
            self._logger.set_tags({names.MFU_WARNING: f"{where}: {warn}"}, synchronous=False)

    # ------------------------------------------------------------------------------ evals, extras
    def log_eval(self, values: dict[str, float], step: int | None = None) -> None:
        """Log evaluation results under ``eval/`` and record time-to-quality for targets they reach.

        Args:
            values: results by metric, e.g. ``{"val_loss": 2.1, "hellaswag/acc_norm": 0.31}`` (an
                ``eval/`` prefix is accepted and dropped); the keys the ``targets`` name.
            step: MLflow step (default: the current optimizer step).

        With several ranks, call it on every rank (it is a collective when steps are pending).
        """
        if self._off:
            return
        try:
            step = self.step_count if step is None else step
            clean = {(k[len("eval/"):] if k.startswith("eval/") else k): float(v) for k, v in values.items()}
            if "val_loss" in clean and "val_perplexity" not in clean:  # one definition on every path
                clean["val_perplexity"] = math.exp(min(clean["val_loss"], 700.0))
            if self.is_main:
                from mlflow_llmeff.evals.api import SUBJECT_TABLE, split_subjects

                shown, table = split_subjects(clean)
                if table is not None:  # one table per eval; per-subject metrics only when asked
                    self._logger.log_table(table, SUBJECT_TABLE.format(step=step))
                self._logger.log_metrics({f"eval/{k}": v for k, v in (clean if self._subject_metrics else shown).items()},
                                         step)
            newly = [t for t in self._targets if t.key not in self._reached and t.reached(clean.get(t.metric))]
            if newly:
                self._log_ttq(newly, step)
        except Exception as e:  # noqa: BLE001
            self._fail(e)

    def _log_ttq(self, newly, step: int) -> None:
        """``ttq/<target>_*`` at the first step a target is reached (METRICS.md, Time-to-quality)."""
        if self._pending_steps:
            self._edge()
        self._refresh_consumption()
        wall = self._ledger.wall_s() - self._ledger.snapshot()["init"]
        kwh = self._consumption.total_kwh
        usd = self._consumption.cost_usd(wall)
        figures = {"wall_s": wall, "train_s": self._ledger.train_s(), "tokens": float(self._meter.total.tokens),
                   "device_hours": self.world_size * wall / 3600.0, "kwh": kwh, "usd": usd,
                   "kg_co2e": self._consumption.kg_co2e(kwh)}
        for t in newly:
            self._reached[t.key] = step
            keys = t.metric_keys()
            self._logger.log_metrics({keys[k]: v for k, v in figures.items() if v is not None}, step)
            self._logger.set_tags({t.not_reached_tag: f"reached_at_step_{step}"})

    @property
    def targets_reached(self) -> bool:
        """True once every target has been reached (False without targets)."""
        return bool(self._targets) and all(t.key in self._reached for t in self._targets)

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        """Log extra metrics (rank 0) at ``step`` (default: the current optimizer step); keys MLflow
        refuses are mapped to allowed ones."""
        if not self._broken and self.is_main:
            self._logger.log_metrics(metrics, self.step_count if step is None else step)

    def set_tags(self, tags: dict[str, str]) -> None:
        """Set extra tags on the run (rank 0)."""
        if not self._broken and self.is_main:
            self._logger.set_tags(tags)

    # ------------------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed attempt needs to continue (JSON-safe). A collective: call on every rank."""
        if self._pending_steps and not self._broken:
            self._edge()
        if not self._broken:
            self._refresh_consumption()
        return {"step": self._meter.step, "throughput": self._meter.state_dict(),
                "ledger": self._ledger.state_dict(), "consumption": self._consumption.state_dict(),
                "ttq_reached": dict(self._reached), "attempts": self._attempts, "run_id": self.run_id,
                "hfu_counted": [self._hfu_ratio, self._hfu_note] if getattr(self, "_hfu_counted", False) else None,
                "step_times": self._steps.state_dict(), "saved_at_unix": time.time()}

    def flush(self) -> None:
        """Send every buffered point and wait until the tracking server has it (rank 0)."""
        if self.is_main and not self._broken:
            self._logger.flush()

    # ------------------------------------------------------------------------------ the end
    def finish(self, status: str | None = None, *, collective: bool = True) -> dict[str, float]:
        """Account the last steps, log ``summary/*`` and end the run if the monitor opened it.

        Args:
            status: MLflow status of the run; default FINISHED (KILLED after SIGTERM/SIGINT).
            collective: True when every rank calls ``finish`` (the tail after the last window edge
                is then summed over ranks). With several ranks and ``collective=False`` (only rank 0
                got here, e.g. at interpreter exit) the steps after the last edge are left out of the
                totals and ``llmeff.autolog.note`` says so. After a signal, never collective.

        Returns:
            The ``summary/*`` metrics (``{}`` after a failure inside the monitor).
        """
        if self._finished:
            return self._summary
        self._finished = True
        status = status or lifecycle.status_for(None)
        collective = (collective and lifecycle.signalled() is None) or self.world_size == 1
        self._end_status = status
        try:
            if not self._broken:
                self._summary = self._finish(collective)
        except Exception as e:  # noqa: BLE001 - never stop training
            self._fail(e)
        finally:
            self._close(status)
        return self._summary

    def end_at_exit(self, status: str) -> None:
        """Finish at interpreter exit (rank 0 alone, synchronous logging; see :mod:`mlflow_llmeff.monitor.lifecycle`)."""
        if not self._finished:
            self._logger.set_synchronous(True)
            self.finish(status, collective=False)

    def _finish(self, collective: bool) -> dict[str, float]:
        note = None
        step = self.step_count
        if self._pending_steps:
            if collective:
                self._edge()
            else:
                note = (f"steps {self._meter.step + 1}..{step} after the last window edge are not in the totals: "
                        "the run ended on rank 0 only (call finish on every rank, accelerator.end_training() "
                        "or torch.distributed.destroy_process_group())")
                step = self._meter.step
        seconds = self._ledger.close()  # the wall time ends here; cost and the summary use it
        self._carbon.stop()
        if step > 0 and self._totals_step != step:  # counters and totals at the last step, once
            self._log_interval(step, collective)
        else:  # each key is logged once per step: the end-of-run totals are the summary's
            self._refresh_consumption(collective)
        out = self._summary_figures(seconds, collective)
        out.update(self._stability_figures(collective))
        if self.is_main:
            tags = self._end_tags(note)
            if (self._end_status == "FINISHED" and names.SUM_TOKENS_PER_SEC in out
                    and "mlflow.note.content" not in getattr(self, "_given_tags", ())):  # a failure keeps its why
                tags["mlflow.note.content"] = self._headline(out)
            self._logger.set_tags(tags)
            self._logger.log_metrics(out, max(step, 0))
            self._warn_mfu(out.get(names.SUM_MFU), "summary")
        return out

    def _summary_figures(self, seconds: dict[str, float], collective: bool) -> dict[str, float]:
        """Every ``summary/*`` figure of the run (all attempts)."""
        from mlflow_llmeff.calc import flops as fl

        parts = breakdown(seconds, self._ledger.warmup_steps, self._ledger.steady_steps, compiled=self.compiled)
        tokens = self._meter.total.tokens
        out: dict[str, float] = {names.SUM_TOKENS: float(tokens), names.SUM_STEPS: float(self._meter.step),
                                 names.SUM_WALL_S: parts["wall"], names.SUM_GOODPUT: goodput(parts)}
        for c in names.BADPUT_CATEGORIES:
            if c in parts:
                out[names.SUM_BADPUT[c]] = parts[c]
        rates = self._meter.summary()
        tflops = None
        if rates is not None and tokens == 0:
            self._note_nothing_counted()
            rates = None
        if rates is not None:
            out.update({names.SUM_TOKENS_PER_SEC: rates.tokens_per_sec,
                        names.SUM_DEVICE_TOKENS_PER_SEC: rates.device_tokens_per_sec,
                        names.SUM_STEP_TIME_S: rates.step_time_s})
            if self._shape is not None and rates.counts.tokens > 0:
                tflops = rates.device_tflops_per_sec(self._fpt)
                out[names.SUM_DEVICE_TFLOPS] = tflops
                mfu = fl.utilization(tflops, self.peak_tflops)
                if mfu is not None:
                    out[names.SUM_MFU] = mfu
                    out[names.SUM_MFU_PALM] = fl.utilization(
                        rates.device_tflops_per_sec(lambda s: self._fpt(s, "palm")), self.peak_tflops)
                    ratio = self._ratio(rates.counts.effective_seq_len)
                    if ratio is not None:
                        out[names.SUM_HFU] = mfu * ratio
                if self._measured_peak:
                    out[names.SUM_MFU_MEASURED_PEAK] = fl.utilization(tflops, self._measured_peak)
        out.update(self._memory_figures(collective))
        out.update(self._consumption.summary(parts["wall"], tokens, tflops))
        out.update(self._extra_summary)
        return {k: v for k, v in out.items() if v is not None and math.isfinite(v)}

    def _stability_figures(self, collective: bool) -> dict[str, float]:
        """Dispersion and interval of the steady steps, contention and stragglers (docs/stability.md);
        their tags wait in ``_stability_tags`` for :meth:`_end_tags`."""
        from mlflow_llmeff.calc import stability as st

        s = self._steps.analyse()
        self._stability_tags = {names.STABILITY: st.verdict(s), names.STABILITY_METHOD: st.THRESHOLDS_TEXT}
        out: dict[str, float] = {}
        if s is not None:
            out.update({names.SUM_STEP_TIME_P50_S: s.p50_step_s, names.SUM_STEP_TIME_P90_S: s.p90_step_s,
                        names.SUM_STEP_TIME_CV: s.cv, names.SUM_STALL_S: s.stall_s, names.SUM_STALLS: float(s.stalls)})
            if s.ci95 is not None:
                # centred on the mean the summary reports (the same steps; they differ by float32
                # storage in checkpoints and device-event rounding only)
                tps = self._steady_tps()
                scale = tps / s.tokens_per_sec if tps and s.tokens_per_sec else 1.0
                out[names.SUM_TPS_CI95_LOW], out[names.SUM_TPS_CI95_HIGH] = s.ci95[0] * scale, s.ci95[1] * scale
        figures, tags = self._contention.finish(collective)
        out.update(figures)
        self._stability_tags.update(tags)
        if collective and self.world_size > 1:
            mine = [0.0] * self.world_size
            mine[self.rank] = self._fwd_s / self._fwd_steps if self._fwd_steps else 0.0
            per_rank = collectives.all_reduce(mine)
            found = st.straggler(per_rank) if all(v > 0 for v in per_rank) else None
            if found is not None:
                out[names.SUM_STRAGGLER_RATIO] = found[0]
                self._stability_tags[names.STRAGGLER_RANK] = (
                    f"rank {found[1]}: mean forward {per_rank[found[1]] * 1e3:.4g} ms/step vs median "
                    f"{st.percentile(per_rank, 50) * 1e3:.4g} ms")
        return out

    def _headline(self, out: dict[str, float]) -> str:
        """The run's description: its steady throughput with its interval and stability, and where its
        figures are (the runs table shows an interval metric's last window, not the run's figure)."""
        tps, low, high = (out.get(k) for k in (names.SUM_TOKENS_PER_SEC, names.SUM_TPS_CI95_LOW, names.SUM_TPS_CI95_HIGH))
        interval = f" (95% interval {low:,.0f} to {high:,.0f})" if low is not None and high is not None else ""
        return (f"{tps:,.0f} tokens/s steady state{interval}, {self.stability or 'stability unknown'}. "
                "The run's figures are the summary/* metrics; throughput/* are per-window rates (the runs table "
                "shows their last window).")

    def _steady_tps(self) -> float | None:
        rates = self._meter.summary()
        return rates.tokens_per_sec if rates is not None and rates.counts.tokens > 0 else None

    @property
    def stability(self) -> str | None:
        """``llmeff.stability`` after :meth:`finish` (``stable`` or ``unstable: <why>``), else None."""
        return getattr(self, "_stability_tags", {}).get(names.STABILITY)

    def _memory_figures(self, collective: bool) -> dict[str, float]:
        inner = unwrap_model(self._model) if self._model is not None else None
        if inner is None:
            return {}
        from mlflow_llmeff.meters.probes import model_state_bytes

        alloc, _, _ = self._memory(collective)
        out: dict[str, float] = {}
        if self._device is not None and self._device.type == "cuda":  # allocator statistics, never process RSS
            nparams = sum(int(getattr(p, "ds_numel", 0)) or p.numel() for p in inner.parameters())  # ZeRO-3: whole
            out[names.SUM_BYTES_PER_PARAM] = alloc * 2**30 / max(1, nparams)
        if self._optimizer is not None:
            state_bytes, model_params = model_state_bytes(inner, self._optimizer)
            bpp = state_bytes / max(1, model_params)
            out[names.SUM_MODEL_STATE_BYTES_PER_PARAM] = collectives.all_reduce([bpp], "max")[0] if collective else bpp
        return out

    def _end_tags(self, note: str | None) -> dict[str, str]:
        tags = {names.HFU_METHOD: self._hfu_note, **self._carbon.tags(
            energy_source=self._energy.source if self._consumption.measured else None),
            **self._consumption.tags(self._ledger.wall_s()), **getattr(self, "_stability_tags", {})}
        if getattr(self, "_memory_source", None) is not None:
            tags[names.MEMORY_SOURCE] = self._memory_source
        if not self._consumption.measured and self._consumption.estimate is not None:
            tags[names.ENERGY_SOURCE] = "codecarbon_estimate"
            tags[names.ENERGY_WHY] = (f"no measured energy ({self._energy.why}); only codecarbon's CPU/RAM estimate is "
                                      "logged, under energy/estimate/* and carbon/estimate_kg_co2e")
        for t in self._targets:
            if t.key not in self._reached:
                tags[t.not_reached_tag] = "not_reached"
        if note:
            tags[names.AUTOLOG_NOTE] = note
        tags[names.WALL_VS_DURATION] = self._wall_vs_duration()
        return tags

    def _wall_vs_duration(self) -> str:
        """Why MLflow's Duration and ``summary/wall_s`` differ (both are shown on the run's page)."""
        before = getattr(self, "_created_after_s", None)
        head = ("summary/wall_s runs from each attempt's start (process start for llmeff train: imports and "
                "set-up included; all attempts of a resumed run added) to the last summary figure")
        if before is None:
            return head + "; this attempt continued a run MLflow created earlier, whose Duration counts from then"
        before = max(0.0, before)
        return (head + f"; MLflow created the run {before:.1f} s after this attempt started, and its Duration runs "
                "from then to the run's end, after the end-of-run report was logged")

    def _close(self, status: str) -> None:
        """Stop the meters; deliver the points, the report and (if the monitor owns the run) its end with
        ``status``, waiting at most the delivery wait without an answer; what is left waits in the outbox."""
        lifecycle.unregister(self)
        for closer in (self._energy.close, self._carbon.stop, self._contention.close,
                       self._fwd.close if self._fwd is not None else (lambda: None)):
            try:
                closer()
            except Exception:  # noqa: BLE001
                pass
        if not self.is_main or self._run is None:
            return
        from mlflow_llmeff.tracking.runs import release

        try:
            self._log_report()
            self._logger.close(status if self._run.owned else None, urgent=status == "KILLED")  # a signal: spill first
        except Exception as e:  # noqa: BLE001
            self._fail(e)
        finally:
            release(self._run)  # no longer MLflow's active run; its end is delivered or in the outbox

    def _log_report(self) -> None:
        """Rank 0: ``efficiency_report.json`` and figures (``report=True``), built once every point before it
        is delivered (by ``llmeff sync`` when the server does not answer); a failure is a tag."""
        if self._report and self._summary:
            self._logger.queue_report()

    @property
    def run_id(self) -> str | None:
        """The MLflow run id (rank 0; None elsewhere), or ``local-...`` while the server has not created the run."""
        return self._logger.run_id

    @property
    def spilled_to(self) -> str | None:
        """The outbox file holding what the tracking server has not taken (None when it has everything)."""
        return self._logger.spilled_to

    def log_input(self, datasets: list, context: str = "training") -> None:
        """Log ``mlflow.data`` datasets as the run's inputs (rank 0; delivered in order with the points)."""
        if not self._broken and self.is_main:
            self._logger.log_inputs(datasets, context)

    def end_run_later(self, status: str) -> bool:
        """For a run the monitor does not own (the user's, the Trainer's) whose entries wait in the outbox:
        its end (``status``, now) waits there too, True. False when the server has everything (end it
        as usual) or the monitor owns the run (it ended it already)."""
        if self._run is None or self._run.owned or not self.spilled_to:
            return False
        self._logger.close(status)
        return True

    @property
    def summary(self) -> dict[str, float]:
        """The ``summary/*`` metrics after :meth:`finish` (empty before)."""
        return self._summary

    @property
    def finished(self) -> bool:
        return self._finished

    def __enter__(self) -> "EfficiencyMonitor":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.finish(lifecycle.status_for(exc), collective=exc is None)

