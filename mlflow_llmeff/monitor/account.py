"""The FLOPs and peak account of a monitor: FLOPs per token, the peaks, MFU and HFU (counted or formula).

:class:`FlopsAccount` holds what the :class:`~mlflow_llmeff.monitor.meter.EfficiencyMonitor` knows
about the model's arithmetic: its shape (formula, else counted on the meta device,
:func:`~mlflow_llmeff.meters.flopcount.resolve`), what activation checkpointing recomputes, the dense
peak per device (datasheet, ``peak_tflops=``, or measured) and the hardware-to-model FLOPs ratio
that turns MFU into HFU: counted by ``FlopCounterMode`` on one early step, else analytic
(:func:`~mlflow_llmeff.calc.flops.hardware_model_ratio`). What the model trains (frozen weights, LoRA
adapters: :func:`~mlflow_llmeff.meters.trainable.read_trainable`) enters both counts, and hardware FLOPs
count attention as the model's kernel runs it (a causal kernel computes the triangle,
:func:`~mlflow_llmeff.meters.flopcount.attention_kernel`). Formulas: ``docs/formulas.md``.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable

from mlflow_llmeff import names
from mlflow_llmeff.calc import flops as fl
from mlflow_llmeff.meters import hardware as hw
from mlflow_llmeff.meters.flopcount import attention_kernel, resolve
from mlflow_llmeff.meters.trainable import read_trainable
from mlflow_llmeff.monitor.conditions import FLOPS_FORMULA_NOTE, recompute_plan
from mlflow_llmeff.monitor.counting import UNKNOWN_WHY

__all__ = ["FlopsAccount"]


class FlopsAccount:
    """FLOPs per token, peaks and the HFU ratio of one monitored model (state of the monitor; no I/O).

    Args:
        config: the model's config (Hugging Face config or :class:`~mlflow_llmeff.calc.flops.ModelShape`),
            or None: then TFLOP/s, MFU and HFU are omitted, with the notes saying why.
    """

    def __init__(self, config=None) -> None:
        self.config = config
        self.shape = None  # ModelShape-like: what flops_per_token takes; None: no FLOPs per token
        self.recompute = None  # fl.Recompute when activation checkpointing re-executes layers
        self.fpt_note = "unknown: no model config (pass model= or model_config=)"
        self.flops_method = "none: no model config (pass model= or model_config=)"
        self.hfu_ratio: float | None = None  # hardware FLOPs per model FLOP, counted (None: analytic)
        self.hfu_note = "none: no model config (no FLOPs per token)"
        self.hfu_counted = False
        self.trainable: fl.Trainable | None = None  # what trains; None: every weight (6N)
        self.trainable_note: str | None = None  # llmeff.flops.trainable (also in llmeff.flops.method)
        self.causal_kernel = False  # the attention kernel skips the masked triangle (hardware FLOPs)
        self.kernel_note = "unset: kernel unknown, the full square assumed"
        self.peak_tflops: float | None = None
        self.peak_source = None
        self.peak_precision: str | None = None  # the dtype whose peak divides (llmeff.peak.precision)
        self.bf16_peak_tflops: float | None = None  # summary/mfu_bf16_peak's denominator
        self.counter_gap: str | None = None  # llmeff.flops.counter_gap: a real-step count below the formula
        self.measured_peak: float | None = None
        self.measured_peak_note = "not measured (measure_peak=False)"
        self.measured_peak_at: str | None = None  # llmeff.peak.measured_at
        self._ratio_cache: dict[float, float | None] = {}

    # ------------------------------------------------------------------------------ set-up
    def read_flops(self, model, *, activation_checkpointing: bool, compiled: bool) -> None:
        """FLOPs per token (formula, else counted on the meta device) and what checkpointing recomputes."""
        self.recompute = None
        if activation_checkpointing:  # what the wrapper re-executes; transformers' default when unreadable
            self.recompute = recompute_plan(model) or fl.Recompute()
        config = self.config
        self.shape, self.fpt_note = None, "unknown: no model config (pass model= or model_config=)"
        self.flops_method = "none: no model config (pass model= or model_config=)"
        if config is not None:
            source = resolve(config, recompute=self.recompute)  # formula, else counted on the meta device
            self.shape, self.flops_method = source.flops, source.note
            if source.flops is None:
                self.fpt_note = f"unknown: {source.note}"
            else:
                self.fpt_note = FLOPS_FORMULA_NOTE
                self.causal_kernel, self.kernel_note = attention_kernel(getattr(self.config, "_attn_implementation", None))
                self._read_trainable(model)
                why = ("compile=true (FlopCounterMode would stop torch.compile)" if compiled
                       else "no FlopCounterMode step on this path")
                recomputed = (f" + the recomputed forward of {self.recompute.describe()}, LM head and embedding "
                              "not recomputed" if self.recompute else "")
                attention = ("executed attention of a causal kernel: s(s+1)/2 query-key pairs per sequence"
                             if self.causal_kernel else "palm-convention FLOPs (dense attention, no causal discount)")
                self.hfu_note = (f"analytic: {why}; {attention} (kernel {self.kernel_note})"
                                 f"{recomputed} over megatron model FLOPs")

    def _read_trainable(self, model) -> None:
        """What ``model`` trains (:func:`~mlflow_llmeff.meters.trainable.read_trainable`) into
        :attr:`trainable`, and the ``llmeff.flops.trainable`` line, which ``llmeff.flops.method`` carries
        too; a description the FLOPs cannot use leaves every weight trainable and says why."""
        self.trainable, self.trainable_note = None, None
        if model is None:
            return
        try:
            found = read_trainable(model)
        except Exception as e:  # noqa: BLE001 - never a crash for a figure: every weight counted, with why
            self.trainable_note = f"every weight counted trainable: {type(e).__name__}: {e}"
        else:
            if found is None:
                total = sum(p.numel() for p in model.parameters())
                self.trainable_note = (f"all {total:,} parameters trainable: 6 FLOPs per weight per token "
                                       "(Kaplan et al. 2020; docs/formulas.md)")
                return
            if isinstance(self.shape, fl.CountedFlops) or len(found.layers) != self.shape.layers:
                why = ("a meta-device count has no per-matrix breakdown" if isinstance(self.shape, fl.CountedFlops)
                       else f"{len(found.layers)} decoder layers found, the config has {self.shape.layers}")
                self.trainable_note = f"{found.describe()}; NOT applied ({why}): every weight counted trainable"
            else:
                self.trainable, self.trainable_note = found, found.describe()
        self.flops_method = f"{self.flops_method}; trainable: {self.trainable_note}"

    def resolve_peak(self, accelerator, precision: str, peak_tflops: float | None) -> None:
        """The dense peak TFLOP/s per device: ``peak_tflops`` when given, else the datasheet table
        (:func:`~mlflow_llmeff.meters.hardware.resolve_peak`), else None (no MFU); the peak's
        precision (``llmeff.peak.precision``) and the device's BF16 peak beside it
        (:func:`~mlflow_llmeff.meters.hardware.resolve_denominators`)."""
        d = hw.resolve_denominators(accelerator, precision, peak_tflops)
        self.peak_tflops, self.peak_source = d.tflops, d.source
        self.peak_precision, self.bf16_peak_tflops = d.precision, d.bf16_tflops

    def measure_peak(self, precision: str, device) -> None:
        """Achievable matmul TFLOP/s on this device and dtype (cached per machine: seconds, once)."""
        dev = device
        where = "cpu" if dev is None or dev.type == "cpu" else str(dev)
        try:
            m = hw.matmul_peak(precision, where)
            self.measured_peak = m.tflops
            self.measured_peak_note = f"{self.measured_peak:.4g}"
            # when and on what (a cached CPU figure is per thread count)
            self.measured_peak_at = (f"{m.measured_at or 'unknown time'} "
                                     f"({'read from the cache' if m.from_cache else 'measured in this run'}: {m.key})")
        except Exception as e:  # noqa: BLE001 - an unmeasurable peak leaves mfu_measured_peak out, with the reason
            self.measured_peak_note = f"unknown: {type(e).__name__}: {e}"
        if dev is not None and dev.type == "cuda":  # its matrices must not count in the run's peak memory
            import torch

            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(dev)

    # ------------------------------------------------------------------------------ FLOPs
    def fpt(self, s: float, convention: str = "megatron") -> float:
        """Training FLOPs per token at effective sequence length ``s`` (tokens; ``convention`` as in
        :func:`~mlflow_llmeff.calc.flops.flops_per_token`); the last few lengths asked are kept (a run's
        windows mostly share one batch shape, and every window asks)."""
        key = (s, convention)
        cache = self.__dict__.setdefault("_fpt_cache", {})
        if key not in cache:
            if len(cache) >= 8:
                cache.clear()
            cache[key] = fl.flops_per_token(self.shape, s, convention, self.trainable)
        return cache[key]

    def ratio(self, s_eff: float) -> float | None:
        """Hardware FLOPs per model FLOP (counted, else analytic); None without FLOPs per token."""
        if self.hfu_ratio is not None:
            return self.hfu_ratio
        if self.shape is None or s_eff <= 0:
            return None
        cache = self._ratio_cache
        if s_eff not in cache:
            cache.clear()  # one batch shape at a time in practice
            cache[s_eff] = fl.hardware_model_ratio(self.shape, s_eff, recompute=self.recompute,
                                                   causal_kernel=self.causal_kernel, trainable=self.trainable,
                                                   autograd_attention=self._eager())
        return cache[s_eff]

    def _eager(self) -> bool:
        """Attention runs as two autograd matmuls (eager): its backward skips gradients nothing needs."""
        return getattr(self.config, "_attn_implementation", None) == "eager"

    def count_ratio(self, counted: float, tokens: int, sq: int, *, step: int, device, model_parallel: int,
                    unseen=(), failed_ops=(), attention=None) -> None:
        """Set the HFU ratio from ``counted`` FLOPs (``FlopCounterMode``) of one step of ``tokens`` tokens
        whose squared sequence lengths sum to ``sq``; ``step`` is the attempt's step number it names.

        A count below the formula's hardware FLOPs for the same tokens (by more than
        :data:`~mlflow_llmeff.meters.flopcount.GAP_TOLERANCE`) is a measurement gap, never a lower
        HFU: the analytic ratio stays, :attr:`counter_gap` says so and names ``unseen``
        (:func:`~mlflow_llmeff.meters.flopcount.unseen_modules`: the modules the counter could not see);
        so is any count in which an op's formula failed (``failed_ops``, counted 0), whatever its size.
        ``attention``: the counter's ``(kernel, is_causal)`` of each attention call it saw
        (:func:`~mlflow_llmeff.meters.flopcount.step_counter`): a causal call counts its triangle.
        """
        if tokens <= 0 or counted <= 0:
            return
        s_eff = sq / tokens
        seen = list(attention or ())
        causal = all(c for _, c in seen) if seen else self.causal_kernel  # what ran, else the config's kernel
        kernels = ", ".join(sorted({k for k, _ in seen})) or "none seen"
        calls = f"{sum(c for _, c in seen)} of {len(seen)} calls causal" if seen else "no fused attention call"
        note = f"FlopCounterMode on step {{}} of the attempt (attention kernels: {kernels}; {calls})"
        attn_impl = getattr(self.config, "_attn_implementation", None)
        r = model_parallel  # a model-parallel rank executes about 1/r of its tokens' FLOPs
        cpu_calls = [c for k, c in seen if k.endswith("for_cpu")]
        if attn_impl == "sdpa" and (device is None or device.type == "cpu") and (cpu_calls or not seen):
            # the counter cannot see CPU SDPA: its training FLOPs and its recomputation, if any, at the
            # share the kernel computed (is_causal of its calls); a model-parallel rank executes 1/r of them
            causal = all(cpu_calls) if cpu_calls else self.causal_kernel
            extra = (fl.attention_flops_per_token(self.shape, s_eff, causal_kernel=causal, trainable=self.trainable)
                     + fl.recompute_flops_per_token(self.shape, s_eff, self.recompute, attention_only=True,
                                                    causal_kernel=causal, trainable=self.trainable))
            counted += extra * tokens / r
            share = ("causal: s(s+1)/2 pairs per sequence, is_causal=True" if causal
                     else "dense: the full square, is_causal=False")
            note = (f"FlopCounterMode on step {{}} of the attempt; CPU SDPA attention added analytically ({share}"
                    f"{'' if cpu_calls else ', assumed: no call seen'}; its 3x forward, not the kernel's score "
                    "recomputation in backward)")
        if r > 1:
            note += f"; this rank's FLOPs x {r} ranks sharing its tokens"
        from mlflow_llmeff.meters.flopcount import counter_gap

        expected = fl.hardware_flops_per_token(self.shape, s_eff, self.recompute, causal_kernel=causal,
                                               trainable=self.trainable,
                                               autograd_attention=self._eager() and not seen) * tokens / r
        gap = counter_gap(counted, expected, unseen, failed_ops=failed_ops)
        self.hfu_counted = True
        if gap is not None:  # what the counter could not see is a gap in the count, not in the hardware
            self.counter_gap = f"step {step}: {gap.note()}"
            self.hfu_ratio = None
            self.hfu_note = (self.hfu_note.replace("no FlopCounterMode step on this path",
                                                   "the FlopCounterMode step counted less than the formula "
                                                   "(llmeff.flops.counter_gap)"))
            return
        self.hfu_ratio = counted * r / (fl.flops_per_token(self.shape, s_eff, "megatron", self.trainable) * tokens)
        self.hfu_note = note.format(step)

    # ------------------------------------------------------------------------------ figures
    @contextmanager
    def counting(self, tally, model, *, slices: int, model_parallel: int, now: Callable[[], tuple[int, Any]],
                 on_error: Callable[[BaseException], None]):
        """Count the hardware FLOPs of the step run inside (``FlopCounterMode``) into :meth:`count_ratio`
        (when: :meth:`~mlflow_llmeff.monitor.meter.EfficiencyMonitor.counting_hardware_flops`).

        Args:
            tally: the monitor's :class:`~mlflow_llmeff.monitor.counting.StepTally`: the step's tokens
                and squared sequence lengths are what it counted inside.
            model: the model (the modules the counter could not see are named), or None.
            slices: context-parallel slices each sequence was counted in (``sum(l^2)`` grows by it).
            model_parallel: ranks sharing this rank's tokens.
            now: ``(the attempt's step it names, the device)``, read when the step ends.
            on_error: gets a failure after the step; none reaches the training.
        """
        from mlflow_llmeff.meters.flopcount import modules_that_run, step_counter, unseen_modules

        counter = step_counter()  # a formula that raises counts 0 and is named, never ends the step
        before = tally.peek_tokens()
        with modules_that_run() as rows, counter:
            yield
        try:
            after = tally.peek_tokens()
            if after[1] is None or before[1] is None:  # sequence lengths unknown: no model FLOPs to divide by
                return
            tokens, sq = (a - b for a, b in zip(after, before))
            step, device = now()
            self.count_ratio(float(counter.get_total_flops()), tokens, sq * slices, step=step, device=device,
                             model_parallel=model_parallel, failed_ops=counter.llmeff_failed_ops,
                             attention=counter.llmeff_attention,
                             unseen=unseen_modules(model, counter.get_flop_counts(), rows) if model is not None else ())
        except Exception as e:  # noqa: BLE001
            on_error(e)

    def interval_metrics(self, rates) -> dict[str, float]:
        """The ``throughput/*`` figures of one window (:meth:`~mlflow_llmeff.calc.throughput.Rates.interval_metrics`)."""
        fpt = self.fpt if self.shape is not None else None
        s_eff = rates.counts.effective_seq_len  # None: lengths unknown, no FLOPs figure
        return rates.interval_metrics(fpt, self.peak_tflops, self.ratio(s_eff) if s_eff is not None else None)

    def summary_figures(self, rates) -> tuple[dict[str, float], float | None]:
        """The run's ``summary/device_tflops_per_sec``, MFU (megatron, palm), MFU against the device's
        BF16 peak (``summary/mfu_bf16_peak``, where the table has one), HFU and MFU against the
        measured peak from the steady-state ``rates``, with the TFLOP/s per device (None: unknown)."""
        out: dict[str, float] = {}
        if self.shape is None or rates.counts.tokens <= 0 or rates.counts.effective_seq_len is None:
            return out, None
        tflops = rates.device_tflops_per_sec(self.fpt)
        out[names.SUM_DEVICE_TFLOPS] = tflops
        mfu = fl.utilization(tflops, self.peak_tflops)
        if self.bf16_peak_tflops is not None:  # the same TFLOP/s on the BF16 scale, beside MFU
            out[names.SUM_MFU_BF16_PEAK] = fl.utilization(tflops, self.bf16_peak_tflops)
        if mfu is not None:
            out[names.SUM_MFU] = mfu
            out[names.SUM_MFU_PALM] = fl.utilization(
                rates.device_tflops_per_sec(lambda s: self.fpt(s, "palm")), self.peak_tflops)
            ratio = self.ratio(rates.counts.effective_seq_len)
            if ratio is not None:
                out[names.SUM_HFU] = mfu * ratio
        if self.measured_peak and self.above_measured_peak(out) is None:
            # above 1 the measurement bounds nothing: left out, why in absent_figures (a trial read 148% in bf16)
            out[names.SUM_MFU_MEASURED_PEAK] = fl.utilization(tflops, self.measured_peak)
        return out, tflops

    def above_measured_peak(self, out: dict[str, float]) -> float | None:
        """The run's steady TFLOP/s per device over the measured matmul peak where it is above 1 (then the
        peak, timed on a handful of shapes, is no bound on what this device does, and
        ``summary/mfu_measured_peak`` is left out), else None."""
        tflops = out.get(names.SUM_DEVICE_TFLOPS)
        if not self.measured_peak or tflops is None:
            return None
        ratio = fl.utilization(tflops, self.measured_peak)
        return ratio if ratio > 1.0 else None

    def absent_figures(self, out: dict[str, float], rates=None) -> dict[str, str]:
        """Why each FLOPs figure :meth:`summary_figures` left out of ``out`` is undefined for this run
        (``llmeff.summary.absent``): no FLOPs per token, sequence lengths of the steady ``rates``
        unknown (every FLOPs figure), no dense peak for the device (MFU, its palm twin and HFU; a
        trial found HFU gone with no word of why), no hardware-to-model ratio, no measured peak.
        Only the figures that follow a steady rate: call it when there was one."""
        why: dict[str, str] = {}
        flops_keys = (names.SUM_DEVICE_TFLOPS, names.SUM_MFU, names.SUM_MFU_PALM, names.SUM_HFU,
                      names.SUM_MFU_MEASURED_PEAK)
        if self.shape is None:
            for key in flops_keys:
                why[key] = f"no FLOPs per token ({self.fpt_note.removeprefix('unknown: ')})"
            return why
        if rates is not None and rates.counts.effective_seq_len is None:
            extra = (names.SUM_MFU_BF16_PEAK,) if self.bf16_peak_tflops is not None else ()
            return dict.fromkeys(flops_keys + extra, UNKNOWN_WHY["lengths"])
        if names.SUM_MFU not in out:
            no_peak = (f"no dense datasheet peak for this device and precision (llmeff.peak.source: "
                       f"{self.peak_source or 'unknown'})")
            for key in (names.SUM_MFU, names.SUM_MFU_PALM, names.SUM_HFU):
                why[key] = no_peak
            if names.SUM_MFU_MEASURED_PEAK in out:
                why[names.SUM_MFU] += "; against the measured matmul peak: summary/mfu_measured_peak"
        elif names.SUM_HFU not in out:
            why[names.SUM_HFU] = f"no hardware-to-model FLOPs ratio (llmeff.hfu.method: {self.hfu_note})"
        over = self.above_measured_peak(out)
        if over is not None:
            why[names.SUM_MFU_MEASURED_PEAK] = (
                f"the run's steady {out[names.SUM_DEVICE_TFLOPS]:.4g} TFLOP/s per device is {over:.0%} of the "
                f"measured matmul peak ({self.measured_peak:.4g} TFLOP/s, {self.measured_peak_at or 'unknown'}): "
                "that measurement does not bound this device (llmeff peak --refresh measures it again)")
        elif names.SUM_MFU_MEASURED_PEAK not in out:
            why[names.SUM_MFU_MEASURED_PEAK] = f"no measured matmul peak ({self.measured_peak_note})"
        return why

    # ------------------------------------------------------------------------------ checkpoints
    def state(self) -> list | None:
        """``[ratio, note]`` once the ratio was counted (a resumed attempt does not count again), else None."""
        return [self.hfu_ratio, self.hfu_note, self.counter_gap] if self.hfu_counted else None

    def load(self, counted) -> None:
        """Continue with the ratio an earlier attempt counted (:meth:`state`; None or empty: nothing)."""
        if counted:
            self.hfu_ratio = float(counted[0]) if counted[0] is not None else None  # None: a counter gap
            self.hfu_note = str(counted[1])
            self.counter_gap = str(counted[2]) if len(counted) > 2 and counted[2] else None
            self.hfu_counted = True
