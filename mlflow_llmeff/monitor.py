"""EfficiencyMonitor: the standard efficiency metrics for any training loop, one call per optimizer step.

A user loop (or :mod:`mlflow_llmeff.autologging`) reports each micro-batch with :meth:`EfficiencyMonitor.count`
and each optimizer step with :meth:`EfficiencyMonitor.step`; the monitor logs the same keys, with the
same meaning, as the training entrypoint (``mlflow_llmeff/train/loop.py``, ``../shared/METRICS.md``):

* tokens are non-padding input tokens (``attention_mask.sum()``), counted on the device with
  :class:`~mlflow_llmeff.counting.BatchCounter` so counting never synchronizes;
* window edges are the end of warm-up, every ``log_every_n_steps``-th step and the last step; there
  the device is synchronized and the counts are summed over ranks (``torch.distributed.all_reduce``
  when a process group is initialized), then fed to the pure
  :class:`~mlflow_llmeff.throughput.ThroughputMeter`;
* the first ``warmup_steps`` steps are excluded from ``throughput/*`` and ``summary/*``;
* only rank 0 logs, through the batched asynchronous :class:`~mlflow_llmeff.tracking.logger.RunLogger`.

Every rank must call :meth:`step` the same number of times (window edges are collectives). A failure
inside the monitor after construction warns once and turns the monitor into a no-op: it never
stops training. Bad arguments at construction raise ``ValueError``.

Not covered here (the entrypoint has them): HFU (needs a FlopCounterMode step), goodput/badput
time accounting, codecarbon's kg-CO2e.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
import warnings
from typing import Any, Callable

from . import names
from .throughput import Counts, ThroughputMeter

__all__ = ["EfficiencyMonitor", "PRECISIONS"]

log = logging.getLogger(__name__)

#: Compute precisions the monitor accepts (the ``llmeff.precision`` tag).
PRECISIONS = ("fp32", "bf16", "fp16", "fp8")

WARMUP_NOTE = ("first warmup_steps optimizer steps of the run (torch.compile, allocator and kernel "
               "warm-up, MLflow run creation) excluded from throughput/*, summary/*")

# Host-side explicit counts, in BatchCounter's accumulator order.
_FIELDS = ("tokens", "padded_tokens", "loss_tokens", "samples", "sum_len_sq")


def unwrap_model(model):
    """The user's module inside DDP / FSDP / Accelerate / ``torch.compile`` wrappers."""
    seen = 0
    while model is not None and seen < 8:
        inner = getattr(model, "_orig_mod", None) or getattr(model, "module", None)
        if inner is None or inner is model:
            break
        model, seen = inner, seen + 1
    return model


def infer_precision(model) -> str:
    """``fp32`` / ``bf16`` / ``fp16`` from the dtype of the model's first floating parameter."""
    try:
        import torch

        for p in model.parameters():
            if p.is_floating_point():
                return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(p.dtype, "fp32")
    except Exception:  # noqa: BLE001
        pass
    return "fp32"


def infer_strategy(model, world: int) -> str:
    """``single``, ``ddp`` or ``fsdp`` from the wrapper classes around the model and the world size."""
    m, depth = model, 0
    while m is not None and depth < 8:
        cls = type(m).__name__
        if "FullyShardedDataParallel" in cls or cls.startswith("FSDP"):
            return "fsdp"
        if cls == "DistributedDataParallel":
            return "ddp"
        m, depth = getattr(m, "_orig_mod", None) or getattr(m, "module", None), depth + 1
    if os.environ.get("ACCELERATE_USE_FSDP", "").lower() in ("1", "true"):
        return "fsdp"
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() in ("1", "true"):
        return f"deepspeed_zero{os.environ.get('ACCELERATE_DEEPSPEED_ZERO_STAGE', '2')}"
    return "ddp" if world > 1 else "single"


def _script_git_commit() -> str:
    """Git commit of the directory holding the user's script (``sys.argv[0]``), where known."""
    from .probes import git_commit

    return git_commit(os.path.dirname(os.path.abspath(sys.argv[0])) if sys.argv and sys.argv[0] else os.getcwd())


def _dist():
    """``torch.distributed`` when a process group is initialized, else None."""
    try:
        import torch.distributed as dist

        return dist if dist.is_available() and dist.is_initialized() else None
    except Exception:  # noqa: BLE001
        return None


class EfficiencyMonitor:
    """Standard throughput, MFU, energy and cost metrics for a training loop you write yourself.

    Example::

        with EfficiencyMonitor(model=model, optimizer=opt, log_every_n_steps=10) as mon:
            for batch in loader:
                loss = model(**batch).loss
                loss.backward(); opt.step(); opt.zero_grad()
                mon.step(batch=batch, loss=loss)

    Args:
        log_every_n_steps: optimizer steps between logged points (>= 1).
        warmup_steps: first optimizer steps excluded from steady-state figures (>= 0).
        model: the model being trained (wrappers are looked through); its ``config`` gives the
            FLOPs per token, its parameters the device, precision and ``llmeff.model.*`` tags.
        model_config: a Hugging Face config (or :class:`~mlflow_llmeff.flops.ModelShape`) when
            ``model`` has none; without either, TFLOP/s and MFU are omitted.
        optimizer: read for ``train/learning_rate`` (``param_groups[0]["lr"]``) and
            ``summary/model_state_bytes_per_param``.
        peak_tflops: dense peak TFLOP/s per device; default: the datasheet table, else no MFU.
        precision: one of :data:`PRECISIONS`; default: the dtype of the model's parameters.
        run_id: MLflow run to log into; default: the active run, else a new run (ended by
            :meth:`finish`). Only rank 0 touches MLflow.
        run_name: name of a run the monitor creates; default
            ``<model>-<accelerator><count>x-<strategy>-<precision>``.
        device_hour_usd: price per device-hour for ``cost/*``; default: the dated table.
        measure_energy: ``auto``, ``nvml``, ``rapl`` or ``none`` (see :mod:`mlflow_llmeff.energy`).
        energy_meter: an :class:`~mlflow_llmeff.energy.EnergyMeter` to use instead (tests).
        strategy: ``llmeff.parallelism.strategy``; default: from the model's wrappers.
        start_step: optimizer steps already done (a resumed loop); MLflow steps continue from it.
        tags: extra tags for the run.
        clock: monotonic seconds (tests inject a fake clock).

    Raises:
        ValueError: for a bad argument (the message names it and what is accepted).
    """

    def __init__(self, *, log_every_n_steps: int = 10, warmup_steps: int = 3, model=None, model_config=None,
                 optimizer=None, peak_tflops: float | None = None, precision: str | None = None,
                 run_id: str | None = None, run_name: str | None = None, device_hour_usd: float | None = None,
                 measure_energy: str = "auto", energy_meter=None, strategy: str | None = None,
                 start_step: int = 0, tags: dict[str, str] | None = None,
                 clock: Callable[[], float] = time.perf_counter, integration: str = "monitor",
                 track_loss: bool = True) -> None:
        from . import cost as cost_mod
        from . import energy as en
        from . import hardware as hw

        if not isinstance(log_every_n_steps, int) or log_every_n_steps < 1:
            raise ValueError(f"log_every_n_steps={log_every_n_steps!r} is not accepted; give an int >= 1")
        if not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ValueError(f"warmup_steps={warmup_steps!r} is not accepted; give an int >= 0")
        if precision is not None and precision not in PRECISIONS:
            raise ValueError(f"precision={precision!r} is not accepted; use one of {', '.join(PRECISIONS)}")
        if energy_meter is None and measure_energy not in en.MODES:
            raise ValueError(f"measure_energy={measure_energy!r} is not accepted; use one of {', '.join(en.MODES)}")

        self.log_every_n_steps = log_every_n_steps
        self.warmup_steps = warmup_steps
        self.track_loss = track_loss
        self._clock = clock
        self._optimizer = optimizer
        self._model = model
        self._broken = False
        self._finished = self._finishing = False
        self._summary: dict[str, float] = {}
        self._integration = integration

        dist = _dist()
        self.world_size = dist.get_world_size() if dist else 1
        self.rank = dist.get_rank() if dist else 0
        self.is_main = self.rank == 0

        inner = unwrap_model(model) if model is not None else None
        self._device = None
        if inner is not None:
            try:
                self._device = next(inner.parameters()).device
            except Exception:  # noqa: BLE001 - a model without parameters
                self._device = None
        device_type = self._device.type if self._device is not None else None
        self.precision = precision or (infer_precision(inner) if inner is not None else "fp32")
        self.strategy = strategy or infer_strategy(model, self.world_size)

        # FLOPs per token as a function of the effective sequence length (None: unknown model).
        config = model_config if model_config is not None else getattr(inner, "config", None)
        self._config = config
        self._fpt_note = "no model config: TFLOP/s and MFU omitted (pass model= or model_config=)"
        if config is not None:
            try:
                from . import flops as fl

                fl.model_shape(config)
                self._fpt_note = ("megatron: L*h^2*(12+12g/n+18f/h+6s/h)+6hV per token, causal attention counted "
                                  "once (Megatron-LM num_floating_point_operations); palm beside it")
            except ValueError as e:
                config, self._config = None, None
                self._fpt_note = f"unknown: {e}"

        self.accelerator = hw.detect_accelerator(count=self.world_size, device_type=device_type)
        self.peak_tflops, self._peak_source = hw.resolve_peak(self.accelerator, self.precision, peak_tflops)
        self._price, self._price_source = cost_mod.device_hour_price(self.accelerator.short, device_hour_usd)
        if energy_meter is None:
            idx = [self._device.index or 0] if device_type == "cuda" else None
            energy_meter = en.make_meter(measure_energy, device_indices=idx) if measure_energy != "none" \
                else en.NullMeter("measure_energy=none")
        self._energy = energy_meter

        self._meter = ThroughputMeter(num_devices=self.world_size, warmup_steps=warmup_steps,
                                      start_step=start_step, clock=clock)
        self._counter = None  # BatchCounter, created on the first batch's device
        self._host = [0] * len(_FIELDS)  # explicit counts passed as numbers
        self._loss: list[Any] = []  # per micro-batch losses (floats or 0-d tensors) since the last log
        self._loss_sum, self._loss_n = 0.0, 0  # reduced, since the last log
        self._micro = 0  # micro-batches counted in the current step
        self._pending_steps = 0  # optimizer steps since the last window edge
        self._first_shape: tuple[int, int, int] | None = None  # (micro batch, seq len, grad accum)
        self._last_edge = start_step
        self._joules_edge = 0.0  # measured energy (all ranks) at the last edge, J
        self._energy_devices = 0
        self._log_mark = (0.0, 0, 0.0)  # (joules, tokens, clock) at the last logged point
        self._lr: float | None = None

        # ---- the MLflow run (rank 0 only) ----------------------------------------------------
        from .tracking.logger import NullLogger

        self._logger = NullLogger()
        self._owns_run = False
        self.run_id: str | None = None
        if self.is_main:
            self._open_run(run_id, run_name, tags or {})
        self._energy.start()
        self._t0 = clock()
        self._log_mark = (0.0, 0, self._t0)
        self._meter.begin()

    # ------------------------------------------------------------------------------ run set-up
    def _open_run(self, run_id: str | None, run_name: str | None, extra_tags: dict[str, str]) -> None:
        import mlflow

        from .tracking.logger import RunLogger, default_run_name, ensure_experiment_kind

        client = mlflow.MlflowClient()
        if run_id is None:
            active = mlflow.active_run()
            if active is not None:
                run_id = active.info.run_id
            else:
                model_name = self._model_name()
                name = run_name or default_run_name(model_name, self.accelerator.short, self.world_size,
                                                    self.strategy, self.precision)
                run_id = mlflow.start_run(run_name=name).info.run_id
                self._owns_run = True
                ensure_experiment_kind(client, client.get_run(run_id).info.experiment_id)
        self.run_id = run_id
        self._logger = RunLogger(run_id, client)
        self._logger.set_tags({**self._condition_tags(), **extra_tags})

    def _model_name(self) -> str:
        inner = unwrap_model(self._model) if self._model is not None else None
        cfg = self._config if self._config is not None else getattr(inner, "config", None)
        for attr in ("name_or_path", "_name_or_path"):
            v = getattr(cfg, attr, None)
            if isinstance(v, str) and v:
                return v
        mt = getattr(cfg, "model_type", None)
        if isinstance(mt, str) and mt:
            return mt
        return type(inner).__name__.lower() if inner is not None else "model"

    def _condition_tags(self) -> dict[str, str]:
        from . import cost as cost_mod
        from .probes import param_counts, software_versions

        world = self.world_size
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world) or world)
        tags = {**self.accelerator.tags(), **software_versions()}
        tags.update({
            names.NODES: str(max(1, world // max(1, local))),
            names.PAR_STRATEGY: self.strategy, names.PAR_DP: str(world), names.PAR_TP: "1", names.PAR_PP: "1",
            names.PAR_CP: "1", names.PRECISION: self.precision, names.MODEL_NAME: self._model_name(),
            names.FLOPS_FORMULA: self._fpt_note,
            names.PEAK_TFLOPS: f"{self.peak_tflops:g}" if self.peak_tflops else "unknown",
            names.PEAK_SOURCE: self._peak_source, names.WARMUP_STEPS: str(self.warmup_steps),
            names.WARMUP_NOTE: WARMUP_NOTE, names.GIT_COMMIT: _script_git_commit(),
            names.ENERGY_SOURCE: self._energy.source,
            names.AUTOLOG_INTEGRATION: self._integration,
        })
        if self._energy.why:
            tags[names.ENERGY_WHY] = self._energy.why
        tags.update(cost_mod.cost_tags(self._price, self._price_source))
        inner = unwrap_model(self._model) if self._model is not None else None
        if inner is not None:
            try:
                total, non_emb = param_counts(inner)
                tags[names.MODEL_PARAMS], tags[names.MODEL_NON_EMB_PARAMS] = str(total), str(non_emb)
            except Exception:  # noqa: BLE001 - not a Hugging Face model: total only
                tags[names.MODEL_PARAMS] = str(sum(p.numel() for p in inner.parameters()))
        cfg = self._config
        if cfg is not None:
            tags[names.MODEL_LAYERS] = str(getattr(cfg, "num_hidden_layers", getattr(cfg, "n_layer", "unknown")))
            tags[names.MODEL_HIDDEN] = str(getattr(cfg, "hidden_size", getattr(cfg, "n_embd", "unknown")))
        return tags

    # ------------------------------------------------------------------------------ counting
    def _fail(self, e: BaseException) -> None:
        if not self._broken:
            self._broken = True
            warnings.warn(f"mlflow_llmeff: EfficiencyMonitor stopped ({type(e).__name__}: {e}); training continues",
                          stacklevel=3)
        log.debug("monitor failure", exc_info=e)

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
        if self._broken or self._finished:
            return
        try:
            if batch is not None:
                self._count_batch(batch)
            if tokens is not None:
                self._count_numbers(tokens, padded_tokens, loss_tokens, samples, sum_len_sq)
            if loss is not None and self.track_loss:
                self._loss.append(loss.detach() if hasattr(loss, "detach") else float(loss))
            self._micro += 1
        except Exception as e:  # noqa: BLE001 - never stop training
            self._fail(e)

    def _count_batch(self, batch) -> None:
        import torch

        if torch.is_tensor(batch):
            ids, mask, labels = batch, None, None
        else:
            get = batch.get if hasattr(batch, "get") else (lambda k: getattr(batch, k, None))
            ids, mask, labels = get("input_ids"), get("attention_mask"), get("labels")
        if mask is not None and (not torch.is_tensor(mask) or mask.dim() > 2):
            mask = None  # 4-D custom masks: count input_ids positions instead
        ref = mask if mask is not None else ids
        if ref is None or not torch.is_tensor(ref):
            return
        if self._counter is None:
            from .counting import BatchCounter

            self._counter = BatchCounter(ref.device)
            if self._device is None:
                self._device = ref.device
        self._counter.add(ids, mask, labels if torch.is_tensor(labels) else None)
        if self._first_shape is None:
            shape = ref.shape if ref.dim() == 2 else (1, ref.shape[-1])
            self._first_shape = (int(shape[0]), int(shape[1]), 0)

    def _count_numbers(self, tokens, padded_tokens, loss_tokens, samples, sum_len_sq) -> None:
        t = int(tokens)
        s = int(samples) if samples is not None else 0
        self._host[0] += t
        self._host[1] += int(padded_tokens) if padded_tokens is not None else t
        self._host[2] += int(loss_tokens) if loss_tokens is not None else (t - s if s else t)
        self._host[3] += s
        self._host[4] += int(sum_len_sq) if sum_len_sq is not None else (t * t // s if s else t * t)

    def step(self, batch=None, *, tokens=None, padded_tokens=None, loss_tokens=None, samples=None,
             sum_len_sq=None, loss=None, learning_rate: float | None = None) -> None:
        """End one optimizer step; optionally count its last (or only) micro-batch first.

        Takes the same counting arguments as :meth:`count`, plus ``learning_rate`` (default: read
        from ``optimizer`` at logged steps). At window edges it synchronizes the device, sums the
        counts over ranks and logs (rank 0).
        """
        if self._broken or self._finished:
            return
        if batch is not None or tokens is not None or loss is not None:
            self.count(batch, tokens=tokens, padded_tokens=padded_tokens, loss_tokens=loss_tokens,
                       samples=samples, sum_len_sq=sum_len_sq, loss=loss)
        try:
            if learning_rate is not None:
                self._lr = float(learning_rate)
            if self._first_shape is not None and self._first_shape[2] == 0:
                b, s, _ = self._first_shape
                self._first_shape = (b, s, max(1, self._micro))
            self._micro = 0
            self._pending_steps += 1
            step = self._meter.step + self._pending_steps
            log_now = step % self.log_every_n_steps == 0
            if log_now or step == self._meter.warmup_end_step:
                self._edge(step)
                if log_now:
                    self._log_interval(step)
        except Exception as e:  # noqa: BLE001 - never stop training
            self._fail(e)

    @property
    def step_count(self) -> int:
        """Optimizer steps seen (including ``start_step``)."""
        return self._meter.step + self._pending_steps

    # ------------------------------------------------------------------------------ window edges
    def _sync(self) -> None:
        if self._device is not None and self._device.type == "cuda":
            import torch

            torch.cuda.synchronize(self._device)

    def _reduce_device(self):
        """Torch device for collectives: CUDA for NCCL, else CPU."""
        import torch

        dist = _dist()
        if dist is not None and dist.get_backend() == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _all_reduce(self, values: list[float], op: str = "sum") -> list[float]:
        dist = _dist()
        if dist is None or self.world_size == 1:
            return values
        import torch

        t = torch.tensor(values, dtype=torch.float64, device=self._reduce_device())
        dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
        return t.tolist()

    def _edge(self, step: int, collective: bool = True) -> None:
        """Account steps ``(last edge, step]``: synchronize, sum over ranks, feed the meter."""
        import torch

        self._sync()
        steps = step - self._last_edge
        dist = _dist() if collective else None
        host = list(self._host)
        reduce_needed = dist is not None and self.world_size > 1
        if self._counter is not None:
            def reduce(t):
                # Explicit (host) counts ride along in the same collective as the device counts.
                t = t + torch.tensor(host, dtype=torch.int64, device=t.device)
                if reduce_needed:
                    t = t.to(self._reduce_device())
                    dist.all_reduce(t)
                return t

            counts = self._counter.take(steps, reduce=reduce)
        else:
            vals = [int(v) for v in self._all_reduce([float(v) for v in host])] if reduce_needed else host
            counts = Counts(steps, *vals)
        self._host = [0] * len(_FIELDS)
        # Losses and energy ride in one float collective.
        loss_vals = [float(v) for v in self._loss]
        self._loss = []
        reading = self._energy.read() if self._energy.measures else None
        local = [sum(loss_vals), float(len(loss_vals)), reading.joules if reading else 0.0,
                 float(self._energy.num_devices if reading else 0)]
        g = self._all_reduce(local) if reduce_needed else local
        self._loss_sum += g[0]
        self._loss_n += int(g[1])
        self._joules_edge, self._energy_devices = g[2], int(g[3])
        self._meter.add(counts)
        self._last_edge = step
        self._pending_steps = 0

    def _memory(self, collective: bool = True) -> tuple[float, float, str]:
        from .probes import peak_memory_gib

        import torch

        dev = self._device if self._device is not None else torch.device("cpu")
        alloc, reserved, source = peak_memory_gib(dev)
        if collective:
            alloc, reserved = self._all_reduce([alloc, reserved], op="max")
        return alloc, reserved, source

    def _fpt(self, s: float, convention: str = "megatron") -> float:
        from . import flops as fl

        return fl.flops_per_token(self._config, s, convention)

    def _learning_rate(self) -> float | None:
        if self._lr is not None:
            return self._lr
        opt = self._optimizer
        try:
            lr = opt.param_groups[0]["lr"] if opt is not None else None
            return float(lr) if lr is not None else None
        except Exception:  # noqa: BLE001
            return None

    def _log_interval(self, step: int, collective: bool = True) -> None:
        from . import energy as en

        total = self._meter.total
        alloc, reserved, _ = self._memory(collective)
        m: dict[str, float] = {names.TRAIN_TOKENS: total.tokens, names.TRAIN_PADDED_TOKENS: total.padded_tokens,
                               names.TRAIN_LOSS_TOKENS: total.loss_tokens,
                               names.MEM_MAX_ALLOC: alloc, names.MEM_MAX_RESERVED: reserved}
        if self._loss_n:
            m[names.TRAIN_LOSS] = self._loss_sum / self._loss_n
            self._loss_sum, self._loss_n = 0.0, 0
        lr = self._learning_rate()
        if lr is not None:
            m[names.TRAIN_LR] = lr
        rates = self._meter.interval()
        if rates is not None:
            m.update(rates.interval_metrics(self._fpt if self._config is not None else None, self.peak_tflops))
        now = self._clock()
        j0, tok0, t0 = self._log_mark
        if self._energy_devices:
            dj, dtok, dt = self._joules_edge - j0, total.tokens - tok0, now - t0
            m[names.ENERGY_TOTAL_KWH] = en.joules_to_kwh(self._joules_edge)
            if dt > 0:
                m[names.ENERGY_DEVICE_AVG_POWER_W] = en.average_power_w(dj, dt, self._energy_devices)
            if dtok > 0:
                m[names.ENERGY_J_PER_TOKEN] = en.j_per_token(dj, dtok)
        if self._price is not None:
            m[names.COST_TOTAL_USD] = self._cost(now)
        self._log_mark = (self._joules_edge, total.tokens, now)
        self._log(m, step)

    def _log(self, metrics: dict[str, float], step: int) -> None:
        """Queue metrics asynchronously; during :meth:`finish`, write them synchronously.

        ``finish`` may run at interpreter exit (MLflow ends open runs in an ``atexit`` handler),
        when MLflow's asynchronous logging thread pool has already shut down.
        """
        from .tracking.logger import RunLogger

        if not (self._finishing and isinstance(self._logger, RunLogger)):
            self._logger.log_metrics(metrics, step)
            return
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        batch = [Metric(k, float(v), ts, step) for k, v in metrics.items() if v is not None and math.isfinite(float(v))]
        try:
            if batch:
                self._logger.client.log_batch(self.run_id, metrics=batch, synchronous=True)
        except Exception as e:  # noqa: BLE001
            self._logger._warn(e)

    def _cost(self, now: float) -> float:
        from . import cost as cost_mod

        return cost_mod.total_cost_usd(device_hour_usd=self._price, devices=self.world_size, wall_s=now - self._t0)

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        """Log extra metrics (rank 0) at ``step`` (default: the current optimizer step) through the monitor's logger."""
        if not self._broken and self.is_main:
            self._logger.log_metrics(metrics, self.step_count if step is None else step)

    # ------------------------------------------------------------------------------ the end
    def finish(self, status: str = "FINISHED", *, collective: bool = True) -> dict[str, float]:
        """Account the last steps, log ``summary/*`` and end the run if the monitor created it.

        Args:
            status: MLflow status for a run the monitor created.
            collective: True when every rank calls ``finish`` (the tail after the last window edge
                is then summed over ranks). With several ranks and ``collective=False`` (only rank 0
                got here, e.g. at interpreter exit) the steps after the last edge are left out of the
                totals and ``llmeff.autolog.note`` says so.

        Returns:
            The ``summary/*`` metrics (identical on every rank when collective; ``{}`` after a failure).
        """
        if self._finished:
            return self._summary
        self._finished = self._finishing = True
        try:
            if not self._broken:
                self._summary = self._finish(status, collective)
        except Exception as e:  # noqa: BLE001 - never stop training
            self._fail(e)
        finally:
            try:
                self._energy.close()
            except Exception:  # noqa: BLE001
                pass
            self._close_run(status)
        return self._summary

    def _finish(self, status: str, collective: bool) -> dict[str, float]:
        from . import energy as en
        from . import flops as fl

        step = self.step_count
        can_reduce = collective or self.world_size == 1
        note = None
        if self._pending_steps:
            if can_reduce:
                self._edge(step)
                self._log_interval(step)
            else:
                note = (f"steps {self._last_edge + 1}..{step} after the last window edge are not in the totals: "
                        "the run ended on rank 0 only (call finish on every rank, accelerator.end_training() "
                        "or torch.distributed.destroy_process_group())")
                step = self._last_edge
        meter = self._meter
        now = self._clock()  # one instant for wall_s and the cost, so usd_per_billion_tokens matches both
        out: dict[str, float] = {names.SUM_TOKENS: float(meter.total.tokens), names.SUM_STEPS: float(meter.step),
                                 names.SUM_WALL_S: now - self._t0}
        rates = meter.summary()
        tflops = None
        if rates is not None:
            out.update({names.SUM_TOKENS_PER_SEC: rates.tokens_per_sec,
                        names.SUM_DEVICE_TOKENS_PER_SEC: rates.device_tokens_per_sec,
                        names.SUM_STEP_TIME_S: rates.step_time_s})
            if self._config is not None and rates.counts.tokens > 0:
                tflops = rates.device_tflops_per_sec(self._fpt)
                out[names.SUM_DEVICE_TFLOPS] = tflops
                mfu = fl.utilization(tflops, self.peak_tflops)
                if mfu is not None:
                    out[names.SUM_MFU] = mfu
                    out[names.SUM_MFU_PALM] = fl.utilization(
                        rates.device_tflops_per_sec(lambda s: self._fpt(s, "palm")), self.peak_tflops)
        alloc, _, mem_source = self._memory(can_reduce)
        inner = unwrap_model(self._model) if self._model is not None else None
        if inner is not None:
            from .probes import model_state_bytes

            nparams = sum(p.numel() for p in inner.parameters())
            out[names.SUM_BYTES_PER_PARAM] = alloc * 2**30 / max(1, nparams)
            if self._optimizer is not None:
                state_bytes, local_params = model_state_bytes(inner, self._optimizer)
                bpp = state_bytes / max(1, local_params)
                out[names.SUM_MODEL_STATE_BYTES_PER_PARAM] = self._all_reduce([bpp], "max")[0] if can_reduce else bpp
        tokens = meter.total.tokens
        if self._energy_devices and tokens > 0:
            kwh = en.joules_to_kwh(self._joules_edge)
            out[names.SUM_J_PER_TOKEN] = en.j_per_token(self._joules_edge, tokens)
            out[names.SUM_KWH_PER_BTOK] = en.kwh_per_billion_tokens(kwh, tokens)
            wall = out[names.SUM_WALL_S]
            if tflops is not None and wall > 0:
                power = en.average_power_w(self._joules_edge, wall, self._energy_devices)
                if power > 0:
                    out[names.SUM_TFLOPS_PER_W] = en.tflops_per_w(tflops, power)
        if self._price is not None and tokens > 0:
            from . import cost as cost_mod

            out[names.SUM_USD_PER_BTOK] = cost_mod.usd_per_billion_tokens(self._cost(now), tokens)
        out = {k: v for k, v in out.items() if v is not None and math.isfinite(v)}
        if self.is_main:
            tags = {names.MEMORY_SOURCE: mem_source}
            if self._first_shape is not None:
                b, s, ga = self._first_shape
                ga = max(1, ga)
                tags.update({names.SEQ_LEN: str(s), names.MICRO_BATCH_SIZE: str(b), names.GRAD_ACCUM: str(ga),
                             names.GLOBAL_BATCH_TOKENS: str(s * b * ga * self.world_size)})
            warn = fl.mfu_warning(out.get(names.SUM_MFU))
            if warn:
                tags[names.MFU_WARNING] = warn
            if note:
                tags[names.AUTOLOG_NOTE] = note
            self._logger.set_tags(tags)
            self._log(out, max(step, 0))
        return out

    def _close_run(self, status: str) -> None:
        if not self.is_main:
            return
        from .tracking.logger import RunLogger

        logger = self._logger
        if isinstance(logger, RunLogger):
            logger.flush()
        if not self._owns_run or self.run_id is None:
            return
        try:
            import mlflow

            active = mlflow.active_run()
            if active is not None and active.info.run_id == self.run_id:
                mlflow.end_run(status)
            else:
                logger.close(status)
        except Exception as e:  # noqa: BLE001
            self._fail(e)

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
        self.finish("FAILED" if exc_type is not None else "FINISHED")
