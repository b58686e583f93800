"""EfficiencyMonitor: the one meter every path reports through (``llmeff train``, autolog, your loop).

It is the only place that counts tokens, keeps the clock, reads energy, computes FLOPs, MFU and
HFU, cost, carbon, goodput and time-to-quality, and talks to the logger; the training entrypoint
(``mlflow_llmeff/train/loop.py``) drives it exactly as a user's loop does, and the autolog
integrations drive the same object, so every figure means the same on every path
(``docs/formulas.md``, "Counting rules"):

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

The class reads as the story of a step. What it measures with is one
:class:`~mlflow_llmeff.monitor.parts.Parts` (the components and what set-up decided),
the one interface of its helper modules: set-up (:mod:`~mlflow_llmeff.monitor.assembly`), the MLflow run
(:mod:`~mlflow_llmeff.monitor.binding`), the logged points and window edges
(:mod:`~mlflow_llmeff.monitor.points`) and the end-of-run summary (:mod:`~mlflow_llmeff.monitor.summary`);
each component (tally, throughput meter, time ledger, FLOPs account, ...) is used through its own methods.
"""

from __future__ import annotations

import logging
import time
import warnings
from contextlib import contextmanager
from typing import Any, Callable

from mlflow_llmeff import names
from mlflow_llmeff.calc.goodput import PAUSES, TimeLedger
from mlflow_llmeff.calc.throughput import ThroughputMeter
from mlflow_llmeff.evals.targets import parse_targets
from mlflow_llmeff.meters import collectives
from mlflow_llmeff.monitor import assembly, binding, closing, lifecycle, points, summary
from mlflow_llmeff.monitor.assembly import PRECISIONS, check_args
from mlflow_llmeff.monitor.compiles import CompileWatch
from mlflow_llmeff.monitor.conditions import infer_precision, infer_strategy, unwrap_model
from mlflow_llmeff.monitor.counting import StepTally
from mlflow_llmeff.monitor.memwatch import MemoryWatch
from mlflow_llmeff.monitor.parts import Parts
from mlflow_llmeff.monitor.pointwork import PointWorker
from mlflow_llmeff.tracking.logger import NullLogger

__all__ = ["EfficiencyMonitor", "PRECISIONS", "unwrap_model", "infer_precision", "infer_strategy"]

log = logging.getLogger(__name__)


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
        run_name: name of a new run; default the configuration's parts in a fixed order (``tiny-ddp2-fp32-cpu``,
            :mod:`mlflow_llmeff.tracking.naming`), ``-2``, ``-3`` for a repeat.
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
            grid intensity (offline); with none of them the USA's, recorded in ``llmeff.assumed``.
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
        context_parallel_size: ranks that each hold a different slice of the same sequences and
            count their own slice (a loop inside torch's ``context_parallel``, a forward hook): every
            token is counted once, and attention FLOPs use the full sequence length
            (:func:`~mlflow_llmeff.parallel.degrees.token_counting`). ``data_parallel_size`` then
            counts the ranks that hold different sequences, without these. Ranks that counted the
            whole sequences before the split are copies: leave this at 1.
        outbox_dir: where points the tracking server has not taken spill (before checkpoints and at
            the end) while it does not answer; default ``$LLMEFF_OUTBOX_DIR`` or
            ``~/.cache/mlflow_llmeff/outbox``. ``llmeff sync DIR`` sends them later.
        report: log ``efficiency_report.json`` and figures at the end.
        contention_meter: a :class:`~mlflow_llmeff.monitor.contention.ContentionMeter` to use
            instead of one reading this machine (tests pass one over the fake NVML).
        eval_subject_metrics: also log per-subject MMLU scores as metrics (``eval/mmlu_<subject>/acc``);
            by default they are one table artifact per eval (``eval/mmlu_subjects/step_<step>.json``).
        optimizer_origin: where the optimizer came from, for ``llmeff.optimizer`` (``llmeff train
            --optimizer adamw8bit``, ``transformers Trainer optim=adamw_torch``); default ``the user's loop``.

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
                 measure_energy: str = "auto", energy_meter=None, country_iso_code: str | None = None,
                 cloud_provider: str | None = None, cloud_region: str | None = None, carbon_tracker=None,
                 measure_peak: bool = True, targets: str | None = None, start_step: int = 0,
                 resume_state: dict | None = None, started_at: float | None = None,
                 clock: Callable[[], float] = time.perf_counter, integration: str = "monitor",
                 track_loss: bool = True, heartbeat_path: str | None = None, outbox_dir: str | None = None,
                 report: bool = True, contention_meter=None, eval_subject_metrics: bool = False,
                 data_parallel_size: int | None = None, context_parallel_size: int = 1,
                 optimizer_origin: str | None = None) -> None:
        check_args(log_every_n_steps, warmup_steps, precision, measure_energy, energy_meter, peak_tflops,
                   device_hour_usd, usd_per_kwh)
        targets_ = parse_targets(targets, any_metric=True)
        ledger = TimeLedger(clock, started_at)
        # this attempt's start on the meter's clock: MLflow's Duration starts at the run's creation instead
        attempt_start = clock() if started_at is None else float(started_at)
        self.log_every_n_steps, self.warmup_steps, self.track_loss = log_every_n_steps, warmup_steps, track_loss
        self._report = report
        self._broken = self._finished = False
        self._off = False  # broken or finished: every call is a no-op (a field, read at every call)
        self._pause_sync: list[bool] = []  # per open pause: the device is synchronized at its ends
        self._data_wait = _Pause(self, "data_wait")  # declared at every step: one context manager, kept
        self._summary: dict[str, float] = {}
        self.world_size, self.rank = collectives.world_and_rank()
        self.is_main = self.rank == 0
        self._points = PointWorker() if self.world_size == 1 else None  # one process: points built off-thread
        counting = assembly.token_counting(self.world_size, data_parallel_size, context_parallel_size)
        # the components and what set-up decided, the one object the helper modules work on (parts.py)
        self._p = p = Parts(world_size=self.world_size, rank=self.rank, counting=counting, warmup_steps=warmup_steps,
                            clock=clock, attempt_start=attempt_start, integration=integration, model=model,
                            optimizer=optimizer, targets=targets_, subject_metrics=bool(eval_subject_metrics),
                            heartbeat_path=heartbeat_path, outbox_dir=outbox_dir, ledger=ledger, tally=StepTally())
        assembly.read_model(p, model, model_config, precision, strategy, compile, activation_checkpointing)
        p.memory = MemoryWatch(p.device, origin=optimizer_origin)  # the CPU peak's baseline, CUDA's history
        p.memory.start(unwrap_model(model), optimizer)
        p.meter = ThroughputMeter(num_devices=self.world_size, warmup_steps=warmup_steps, start_step=start_step)
        # torch.compile inside a step: compile time, not the step's (compiles.py, docs/time.md)
        p.compiles = CompileWatch(ledger, in_step=lambda: not (self._off or self._pause_sync
                                                               or ledger.paused),
                                  after_warmup=lambda: not p.meter.is_warmup(p.step_count + 1))
        assembly.set_up_measurement(p, peak_tflops, measure_peak, device_hour_usd, usd_per_kwh, measure_energy,
                                    energy_meter, country_iso_code, cloud_provider, cloud_region, carbon_tracker)
        assembly.set_up_step_timing(p, model, contention_meter)
        # after the energy meter started: a meta-device count takes seconds
        p.account.read_flops(model, activation_checkpointing=p.activation_checkpointing, compiled=p.compiled)
        p.logger, p.run = NullLogger(), None
        if resume_state:
            assembly.resume(p, resume_state)
        if self.is_main:
            binding.open_run(p, run_id, run_name, experiment_name, tags or {}, params or {}, resume_state)
        assembly.start_meters(p)
        lifecycle.install()
        lifecycle.register(self)
        # this attempt's last warm-up step (meter.warmup_end_step), fixed once set-up and a resume are done
        self._steady_from = p.meter.warmup_end_step
        assembly.start_clock(p)

    # ------------------------------------------------------------------------------ set-up
    def credit_build(self, seconds: float) -> float:
        """Name ``seconds`` of the set-up so far as an op build (``summary/badput_compile_s``, not ``init``):
        a strategy's C++ ops compiled before the meter existed (DeepSpeed's JIT). Call before the first
        step; returns the seconds named (capped at the set-up time so far).

        Raises:
            ValueError: negative ``seconds``, or after the first step.
        """
        return self._p.ledger.carve("op_build", seconds)

    def continue_job(self, *, down_s: float = 0.0, earlier_s: dict[str, float] | None = None,
                     tail_end_unix: float | None = None, attempts: int | None = None,
                     earlier_device_s: dict[str, float] | None = None) -> None:
        """Account the job's earlier attempts that no checkpoint holds (docs/time.md, "Reliability
        across a job's life"; ``llmeff train`` reads them from its attempts ledger, train/job.py).
        Call once on rank 0, before the first step.

        Args:
            down_s: seconds no attempt ran: ``summary/badput_down_s``, part of ``summary/wall_s``.
            earlier_s: seconds of attempts in no checkpoint's state (those after the resumed
                checkpoint's writer, or every earlier attempt when none was written), by ledger
                category (``init``, ``checkpoint_load``, ``lost_progress``); with no checkpoint
                resumed, energy also continues from the run's newest logged totals.
            tail_end_unix: Unix time of the resumed checkpoint's writer's last completed step (its
                per-step heartbeat): its lost progress runs to it rather than to its newest logged point.
            attempts: the job's attempts, this one included (``llmeff.resume.attempts``).
            earlier_device_s: device-seconds of ``earlier_s`` by category, each attempt at the devices it
                held (``summary/device_hours``, cost; default: ``earlier_s`` at this attempt's devices).

        Raises:
            ValueError: negative ``down_s`` or a category the ledger does not take.
        """
        if down_s < 0:
            raise ValueError(f"down time {down_s} s is negative")
        binding.continue_job(self._p, float(down_s), earlier_s or {}, tail_end_unix, earlier_device_s or {})
        if attempts:
            self._p.job.set_attempts(int(attempts))
            self.set_tags({names.RESUME_ATTEMPTS: str(self._p.job.attempts)})

    def set_job_figures(self, figures: Callable[[float], tuple[dict, dict, str | None]]) -> None:
        """The job's reliability figures, computed at :meth:`finish` when the clock stops (rank 0).

        ``figures(end_unix)`` returns ``(summary metrics, tags, line)``: metrics logged with the
        ``summary/*``, tags set at the end, and a line (or None) added to the run's description,
        so figures over the job's wall time end where ``summary/wall_s`` ends. A failure in it is
        the tag ``llmeff.reliability.why``, never the end of the run.
        """
        self._p.job.set_figures(figures)

    def add_summary(self, metrics: dict[str, float]) -> None:
        """Figures measured outside the meter (e.g. ``summary/comm_*``) to log with the ``summary/*`` at
        :meth:`finish`; call it on rank 0 at least (other ranks' calls are ignored)."""
        self._p.ending.add_figures(metrics)

    # ------------------------------------------------------------------------------ failures
    def _drain(self, close: bool = False) -> None:
        """Wait for the points built off the training thread (pointwork.py; ``close``: end it); a failure stops us."""
        w = self._points
        if w is not None and (w.submitted != w.done or w.error is not None or close):
            e = w.close() if close else w.drain()
            if e is not None:
                self._fail(e)

    def _fail(self, e: BaseException) -> None:
        if not self._broken:
            self._broken = self._off = True
            warnings.warn(f"mlflow_llmeff: EfficiencyMonitor stopped ({type(e).__name__}: {e}); training continues",
                          stacklevel=3)
        log.debug("monitor failure", exc_info=e)

    # ------------------------------------------------------------------------------ counting
    def count(self, batch=None, *, tokens=None, padded_tokens=None, loss_tokens=None, samples=None,
              sum_len_sq=None, loss=None) -> None:
        """Count one micro-batch of the current optimizer step (gradient accumulation: call per micro-batch).

        Args:
            batch: a mapping with ``input_ids`` ``(B, T)`` and optionally ``attention_mask`` ``(B, T)``
                and ``labels`` ``(B, T)`` (-100 = no loss), or a ``(B, T)`` tensor of token ids.
                Counted on the device, without synchronizing.
            tokens: non-padding tokens of this micro-batch on this rank (instead of ``batch``).
            padded_tokens: input positions including padding (not given: ``train/padded_tokens`` is
                absent, ``llmeff.interval.absent`` says why).
            loss_tokens: loss-bearing tokens (default: ``tokens - samples`` when ``samples`` is given;
                neither: ``train/loss_tokens`` is absent). With ``batch`` (and no ``tokens``): the batch's
                loss-bearing tokens as the caller already counted them (an int, or a 0-d tensor on the
                batch's device, not synchronized), so its labels are not compared again; default: counted
                from ``labels[:, 1:] != -100``.
            samples: sequences (not given: ``throughput/samples_per_sec`` is absent, never 0).
            sum_len_sq: sum of squared sequence lengths (default: ``tokens^2 / samples``, i.e. equal
                lengths); sets the effective sequence length of the attention FLOPs. With neither
                this nor ``samples`` the lengths are unknown and TFLOP/s, MFU and HFU are absent
                (``llmeff.interval.absent``, ``llmeff.summary.absent``), never computed as one
                sequence of all the tokens.
            loss: this micro-batch's mean loss (float or 0-d tensor; not synchronized).
        """
        if self._off:
            return
        try:
            p = self._p
            tally = p.tally
            if batch is not None:
                tally.add_batch(batch, loss_tokens if tokens is None else None)
                if p.device is None:
                    p.device = tally.device
            if tokens is not None:
                tally.add_numbers(tokens, padded_tokens, loss_tokens, samples, sum_len_sq)
            if loss is not None and self.track_loss:
                tally.add_loss(loss)
            tally.micro += 1
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
            p = self._p
            meter, tally, window = p.meter, p.tally, p.window
            tally.end_step()
            if p.devclock is not None:
                p.devclock.step_end()
            step = meter.step + window.steps + 1
            steady_from = self._steady_from
            log_now = step % self.log_every_n_steps == 0
            at_edge = log_now or edge or step == steady_from
            if at_edge:
                collectives.synchronize(p.device)
            warmup = step <= steady_from  # meter.is_warmup(step)
            seconds = p.ledger.step_done(warmup)
            window.add(seconds, warmup, learning_rate)
            naming = p.naming
            if naming.shape_pending or (not naming.shape_varied and tally.varies):  # the first step, or the
                binding.note_shape(p)  # first whose batch shape differs from the first one's: once each
            if at_edge:
                self._at_edge(step, log_now)
        except Exception as e:  # noqa: BLE001 - never stop training
            self._fail(e)

    def _at_edge(self, step: int, log_now: bool) -> None:
        """The meter's own work at a window edge (reductions, rates, sampling, handing points to the
        logger), timed as ``other`` so that it lands in no step: a step's time is the training's."""
        p = self._p
        p.ledger.enter("other")
        try:
            self._drain()  # the last point's figures are built (they update the consumption totals)
            if self._broken:
                return
            points.edge(p)
            if step == p.meter.warmup_end_step:  # the steady window starts after this step
                p.contention.begin(collective=self.world_size > 1)
            if log_now:
                points.log_interval(p, step, later=self._points and self._points.submit)
        finally:
            p.ledger.exit()
            if p.devclock is not None:
                p.devclock.restart()

    @property
    def step_count(self) -> int:
        """Optimizer steps seen (including earlier attempts and ``start_step``)."""
        return self._p.step_count

    # ------------------------------------------------------------------------------ the clock
    def pause(self, category: str) -> "_Pause":
        """Declare non-step work: ``with monitor.pause("eval"): ...``.

        Categories: ``eval``, ``checkpoint_save``, ``checkpoint_load``, ``data_wait`` (host time
        blocked on the next batch; it stays inside the step, see docs/time.md), ``init``
        (set-up after the monitor started) and ``other``. The device is synchronized at both ends
        (except for ``data_wait``) so the pause holds exactly its own work. Not a collective: a
        pause on one rank only is fine. Nested pauses count in the outermost.

        Raises:
            ValueError: for a category not in :data:`~mlflow_llmeff.calc.goodput.PAUSES` (on entering).
        """
        if category == "data_wait":  # (it holds no state: the open pauses are the monitor's)
            return self._data_wait
        return _Pause(self, category)

    def enter_pause(self, category: str) -> None:
        """Start a pause (for hooks that cannot use ``with``); pair with :meth:`exit_pause`.

        Raises:
            ValueError: for a category not in :data:`~mlflow_llmeff.calc.goodput.PAUSES`.
        """
        sync = category != "data_wait"
        if sync and category not in PAUSES:
            raise ValueError(f"pause category {category!r} is not accepted; use one of: {', '.join(PAUSES)}")
        self._pause_sync.append(sync)
        if self._off:
            return
        try:
            if sync:
                collectives.synchronize(self._p.device)
            self._p.ledger.enter(category)
        except Exception as e:  # noqa: BLE001
            self._fail(e)

    def exit_pause(self) -> None:
        """End the pause :meth:`enter_pause` started."""
        stack = self._pause_sync
        sync = stack.pop() if stack else False
        if self._broken:
            return
        try:
            p = self._p
            if not sync:  # a data wait: it stays inside its step
                p.ledger.exit()
                return
            collectives.synchronize(p.device)
            p.ledger.exit()
            if p.devclock is not None and not p.ledger.paused:  # the next step starts here
                p.devclock.restart()
        except Exception as e:  # noqa: BLE001
            self._fail(e)

    # ------------------------------------------------------------------------------ hardware FLOPs
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
        p = self._p
        if self._off or p.compiled or p.account.shape is None or p.account.hfu_counted:
            yield
            return
        with p.account.counting(p.tally, p.model, slices=p.counting.slices, model_parallel=p.counting.copies,
                                now=lambda: (self.step_count + 1, p.device), on_error=self._fail):
            yield

    # ------------------------------------------------------------------------------ loss checks
    @property
    def nonfinite_loss(self) -> tuple[int, float] | None:
        """``(step, value)`` of the first logged step whose mean ``train/loss`` was NaN or infinite, else None.

        Checked where the loss is read anyway (logged steps, summed over ranks), so it costs no
        device synchronization; :meth:`check_loss` looks at the steps since the last logged one.
        """
        return self._p.last.nonfinite

    def check_loss(self, collective: bool = True) -> tuple[int, float] | None:
        """Like :attr:`nonfinite_loss`, also looking at the losses counted since the last logged step.

        Synchronizes the device (and, with ``collective``, reduces a flag over ranks: call it on
        every rank), so call it where the loop waits anyway, e.g. before a checkpoint save, so
        that a checkpoint never holds weights trained on a non-finite loss.
        """
        last = self._p.last
        if last.nonfinite is None and not self._off:
            try:
                points.check_loss(self._p, collective)
            except Exception as e:  # noqa: BLE001
                self._fail(e)
        return last.nonfinite

    @property
    def latest_metrics(self) -> dict[str, float]:
        """The interval metrics of the last logged step (empty before the first; waits for its figures)."""
        self._drain()
        return self._p.last.metrics

    latest_built = property(lambda self: self._p.last.metrics, doc="latest_metrics without waiting (progress bars)")

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
        self._drain()  # (time-to-quality reads the consumption totals the last point updated)
        try:
            points.log_eval(self._p, values, self.step_count if step is None else step)
        except Exception as e:  # noqa: BLE001
            self._fail(e)

    @property
    def targets_reached(self) -> bool:
        """True once every target has been reached (False without targets)."""
        return self._p.reached.every(self._p.targets)

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        """Log extra metrics (rank 0) at ``step`` (default: the current optimizer step); keys MLflow
        refuses are mapped to allowed ones."""
        if not self._broken and self.is_main:
            self._p.logger.log_metrics(metrics, self.step_count if step is None else step)

    def set_tags(self, tags: dict[str, str]) -> None:
        """Set extra tags on the run (rank 0)."""
        if not self._broken and self.is_main:
            self._p.logger.set_tags(tags)
            self._p.memory.note_given(tags)  # an llmeff.error given is kept (an OOM adds its largest term)

    # ------------------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed attempt needs to continue (JSON-safe). A collective: call on every rank."""
        p = self._p
        self._drain()
        if p.window.steps and not self._broken:
            points.edge(p)
        if not self._broken:
            points.refresh_consumption(p)
        return assembly.state(p)

    def flush(self) -> None:
        """Send every buffered point and wait until the tracking server has it (rank 0)."""
        self._drain()  # the points of the steps so far reach the logger first
        if self.is_main and not self._broken:
            self._p.logger.flush()

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
        self._drain(close=True)  # every point built off the training thread is in the logger and the totals
        self._finished = self._off = True
        status = status or lifecycle.status_for(None)
        collective = (collective and lifecycle.signalled() is None) or self.world_size == 1
        self._p.ending.ended(status)
        try:
            if not self._broken:
                self._summary = summary.conclude(self._p, collective)
        except Exception as e:  # noqa: BLE001 - never stop training
            self._fail(e)
        finally:
            self._close(status)
        self.targets_line = self._p.reached.line(self._p.targets)  # each target's fate, for the closing report
        closing.print_closing_line(self)  # llmeff: run <name> (<id>): ... tokens/s ... (main rank, stderr)
        return self._summary

    def end_at_exit(self, status: str) -> None:
        """Finish at interpreter exit (rank 0 alone, synchronous logging; see :mod:`mlflow_llmeff.monitor.lifecycle`)."""
        if not self._finished:
            self._p.logger.set_synchronous(True)
            self.finish(status, collective=False)

    def _close(self, status: str) -> None:
        """Stop the meters; deliver the points, the report and (if the monitor owns the run) its end with
        ``status``, waiting at most the delivery wait without an answer; what is left waits in the outbox."""
        p = self._p
        lifecycle.unregister(self)
        assembly.stop_meters(p)
        if not self.is_main or p.run is None:
            return
        try:
            binding.close_run(p, status, report=bool(self._report and self._summary))
        except Exception as e:  # noqa: BLE001
            self._fail(e)  # no longer MLflow's active run; its end is delivered or in the outbox

    # ------------------------------------------------------------------------------ what the run shows
    @property
    def stability(self) -> str | None:
        """``llmeff.stability`` after :meth:`finish` (``stable`` or ``unstable: <why>``), else None."""
        return self._p.ending.stability.get(names.STABILITY)

    @property
    def peak_tflops(self) -> float | None:
        """Dense peak TFLOP/s per device the MFU divides by (``peak_tflops=``, else the datasheet; None: no MFU)."""
        return self._p.account.peak_tflops

    @property
    def run_id(self) -> str | None:
        """The MLflow run id (rank 0; None elsewhere), or ``local-...`` while the server has not created the run."""
        return self._p.logger.run_id

    @property
    def spilled_to(self) -> str | None:
        """The outbox file holding what the tracking server has not taken (None when it has everything)."""
        return self._p.logger.spilled_to

    def log_input(self, datasets: list, context: str = "training") -> None:
        """Log ``mlflow.data`` datasets as the run's inputs (rank 0; delivered in order with the points)."""
        if not self._broken and self.is_main:
            self._p.logger.log_inputs(datasets, context)

    def end_run_later(self, status: str) -> bool:
        """For a run the monitor does not own (the user's, the Trainer's) whose entries wait in the outbox:
        its end (``status``, now) waits there too, True. False when the server has everything (end it
        as usual) or the monitor owns the run (it ended it already)."""
        self._drain()
        run = self._p.run
        if run is None or run.owned or not self.spilled_to:
            return False
        self._p.logger.close(status)
        return True

    @property
    def summary(self) -> dict[str, float]:
        """The ``summary/*`` metrics after :meth:`finish` (empty before)."""
        return self._summary

    @property
    def finished(self) -> bool:
        return self._finished

    # what set-up decided (read-only; precision may become fp8 after the first step)
    precision = property(lambda self: self._p.precision, doc="Compute precision (``llmeff.precision``).")
    precision_source = property(lambda self: self._p.precision_source, doc="Where ``precision`` was read.")
    strategy = property(lambda self: self._p.strategy, doc="``llmeff.parallelism.strategy``.")
    compiled = property(lambda self: self._p.compiled, doc="The model is compiled.")
    activation_checkpointing = property(lambda self: self._p.activation_checkpointing,
                                        doc="Activation checkpointing is on (HFU counts the recomputation).")
    accelerator = property(lambda self: self._p.accelerator, doc="The detected accelerator (name, peaks).")
    integration = property(lambda self: self._p.integration, doc="``llmeff.autolog.integration``.")

    @property
    def summary_absent(self) -> dict[str, str]:
        """``summary/*`` key -> why it is undefined for this run (``llmeff.summary.absent``), after :meth:`finish`."""
        return self._p.summary_absent.why

    def assumptions(self) -> dict[str, str]:
        """What was assumed for the user (``llmeff.assumed``): ``{input: '<value> (<why>)'}``, empty when nothing."""
        return self._p.assumptions()

    def use_optimizer(self, optimizer) -> None:
        """The optimizer to read (learning rate, model-state bytes) when none was given at construction
        (``autolog()`` sees it at its first step); one given earlier stays."""
        if self._p.optimizer is None:
            self._p.optimizer = optimizer

    def name_adopted_run(self, experiment_id: str) -> str:
        """Name the run this monitor logs into but did not create as it names its own
        (:func:`~mlflow_llmeff.monitor.binding.name_adopted_run`); returns the name set ('' for none).

        Raises:
            mlflow.exceptions.MlflowException: what MLflow raises.
        """
        return binding.name_adopted_run(self._p, experiment_id, self.set_tags)

    def __enter__(self) -> "EfficiencyMonitor":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.finish(lifecycle.status_for(exc), collective=exc is None)


class _Pause:
    """The context manager :meth:`EfficiencyMonitor.pause` returns (a class, not a generator: a data
    wait is declared at every step, and a generator's context manager costs several times as much)."""

    __slots__ = ("_monitor", "_category")

    def __init__(self, monitor: EfficiencyMonitor, category: str) -> None:
        self._monitor, self._category = monitor, category

    def __enter__(self) -> None:
        self._monitor.enter_pause(self._category)

    def __exit__(self, *exc) -> bool:
        self._monitor.exit_pause()
        return False
