"""Windowed tokens/s and step timing: a pure calculator (no I/O, no torch, no clock).

Counting rules (``docs/formulas.md``, "Counting rules"): a step is one optimizer step; tokens are non-padding
input tokens summed over micro-batches and data-parallel ranks; the first ``warmup_steps`` steps of
every attempt (a fresh process, also after a resume) are excluded from steady-state figures;
throughput over an interval is tokens in the interval divided by its step time (the interval's
wall time less declared pauses: evals, checkpoints). The caller reduces counts over ranks and
synchronizes the device before each :meth:`ThroughputMeter.add`, so every window edge is a
synchronized instant.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from typing import Callable

from mlflow_llmeff import names
from mlflow_llmeff.calc.flops import utilization


@dataclass
class Counts:
    """Global (all data-parallel ranks) counts over a run of optimizer steps.

    Attributes:
        steps: optimizer steps.
        tokens: non-padding input tokens (``attention_mask.sum()``).
        padded_tokens: input positions including padding (``input_ids.numel()``).
        loss_tokens: tokens that carry a loss (``labels[:, 1:] != -100``).
        samples: sequences.
        sum_len_sq: sum over sequences of (non-padding length)^2, for the effective sequence length
            ``sum(l^2) / sum(l)`` that the FLOPs formula uses.
        padded_unknown, loss_unknown, samples_unknown, lengths_unknown: micro-batches counted without
            their padded positions, loss-bearing tokens, sequences or sequence lengths (counts passed
            as numbers without them). Above 0, that figure of these counts is unknown: the figures
            built on it are absent, never made of the others' defaults.
    """

    steps: int = 0
    tokens: int = 0
    padded_tokens: int = 0
    loss_tokens: int = 0
    samples: int = 0
    sum_len_sq: int = 0
    padded_unknown: int = 0
    loss_unknown: int = 0
    samples_unknown: int = 0
    lengths_unknown: int = 0

    def __iadd__(self, other: "Counts") -> "Counts":
        mine, theirs = self.__dict__, other.__dict__  # (three additions a window edge: no fields() walk)
        for name in _COUNT_FIELDS:
            mine[name] += theirs[name]
        return self

    @property
    def effective_seq_len(self) -> float | None:
        """``sum(l_i^2) / sum(l_i)``, tokens; 0.0 when no tokens were seen, None when some micro-batch's
        sequence lengths are unknown (``lengths_unknown``)."""
        if self.lengths_unknown:
            return None
        return self.sum_len_sq / self.tokens if self.tokens else 0.0


#: :class:`Counts`' field names, in order
_COUNT_FIELDS = tuple(f.name for f in fields(Counts))


@dataclass(frozen=True)
class Rates:
    """Throughput over a stretch of steady-state steps.

    Attributes:
        counts: the global counts of the stretch.
        elapsed_s: its wall time in seconds.
        num_devices: devices taking part.
        device_s: device-seconds of the stretch, each step at the devices of the attempt it ran in
            (None: ``elapsed_s x num_devices``). Per-device figures divide by it: over attempts that
            held different numbers of devices (an elastic restart on fewer machines) a per-device
            rate is tokens per device-second, ``tokens / sum(devices_i x seconds_i)``.
    """

    counts: Counts
    elapsed_s: float
    num_devices: int
    device_s: float | None = None

    @property
    def tokens_per_sec(self) -> float:
        return self.counts.tokens / self.elapsed_s

    @property
    def samples_per_sec(self) -> float | None:
        """Sequences per second; None when some micro-batch's sequences are unknown (``samples_unknown``)."""
        return None if self.counts.samples_unknown else self.counts.samples / self.elapsed_s

    @property
    def held_device_s(self) -> float:
        """Device-seconds of the stretch (``device_s``, else ``elapsed_s x num_devices``)."""
        return self.device_s if self.device_s else self.elapsed_s * self.num_devices

    @property
    def device_tokens_per_sec(self) -> float:
        return self.counts.tokens / self.held_device_s

    @property
    def step_time_s(self) -> float:
        return self.elapsed_s / self.counts.steps

    def device_tflops_per_sec(self, flops_per_token: Callable[[float], float]) -> float | None:
        """Achieved model TFLOP/s per device (per device-second held: an attempt's own device count), given
        FLOPs/token as a function of effective seq len; None when the sequence lengths are unknown
        (attention FLOPs grow with them)."""
        s = self.counts.effective_seq_len
        if s is None:
            return None
        return self.counts.tokens * flops_per_token(s) / self.held_device_s / 1e12

    def interval_metrics(self, flops_per_token: Callable[[float], float] | None = None,
                         peak_tflops: float | None = None, hfu_ratio: float | None = None) -> dict[str, float]:
        """The interval's ``train/step_time_s`` and ``throughput/*`` metrics, keyed as in names.py.

        Achieved TFLOP/s needs ``flops_per_token`` (and tokens, and their sequence lengths); MFU also
        needs ``peak_tflops`` (never clipped); HFU is MFU x ``hfu_ratio`` (hardware FLOPs per model FLOP,
        :func:`mlflow_llmeff.calc.flops.hardware_model_ratio` or a counted step). Samples/s is left out
        when the sequences are unknown, the FLOPs figures when their lengths are.
        """
        m = {names.TRAIN_STEP_TIME_S: self.step_time_s, names.TPUT_TOKENS: self.tokens_per_sec,
             names.TPUT_DEVICE_TOKENS: self.device_tokens_per_sec}
        if self.samples_per_sec is not None:
            m[names.TPUT_SAMPLES] = self.samples_per_sec
        if flops_per_token is not None and self.counts.tokens > 0 and self.counts.effective_seq_len is not None:
            tflops = self.device_tflops_per_sec(flops_per_token)
            m[names.TPUT_DEVICE_TFLOPS] = tflops
            mfu = utilization(tflops, peak_tflops)
            if mfu is not None:
                m[names.TPUT_DEVICE_MFU] = mfu
                if hfu_ratio is not None:
                    m[names.TPUT_DEVICE_HFU] = mfu * hfu_ratio
        return m


@dataclass
class ThroughputMeter:
    """Cumulative counters and steady-state windows over optimizer steps.

    Usage: :meth:`add` the global counts of the steps since the previous call together with their
    step seconds (from :class:`~mlflow_llmeff.calc.goodput.TimeLedger`: declared pauses such as evals
    and checkpoints are not in them), at least at the end of warm-up and at every logged step;
    :meth:`interval` takes the steady-state rates since the last interval. No clock here: the
    caller synchronizes the device before reading the seconds at each edge.

    Args:
        num_devices: devices taking part (>= 1).
        warmup_steps: steps of each attempt excluded from steady-state figures (>= 0).
        start_step: optimizer steps already done before this attempt (resume), 0 for a new run.
    """

    num_devices: int
    warmup_steps: int
    start_step: int = 0
    total: Counts = field(default_factory=Counts)
    steady: Counts = field(default_factory=Counts)
    steady_s: float = 0.0
    steady_device_s: float = 0.0  # device-seconds of the steady steps, each at its attempt's num_devices
    warmup_s: float = 0.0
    _window: Counts = field(default_factory=Counts)
    _window_s: float = 0.0
    _step: int = 0

    def __post_init__(self) -> None:
        if self.num_devices < 1:
            raise ValueError(f"num_devices={self.num_devices} must be >= 1")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps={self.warmup_steps} must be >= 0")
        self._step = self.start_step

    @property
    def step(self) -> int:
        """Last optimizer step accounted for."""
        return self._step

    @property
    def warmup_end_step(self) -> int:
        """The step after which this attempt is in steady state."""
        return self.start_step + self.warmup_steps

    def is_warmup(self, step: int) -> bool:
        """True for a warm-up step of this attempt."""
        return step <= self.warmup_end_step

    def add(self, counts: Counts, seconds: float) -> None:
        """Account the steps ``(self.step, self.step + counts.steps]`` that took ``seconds`` of step time.

        Raises:
            ValueError: when the stretch straddles the end of warm-up (the caller must cut there).
        """
        first, last = self._step + 1, self._step + counts.steps
        if first <= self.warmup_end_step < last:
            raise ValueError(f"steps {first}..{last} straddle the end of warm-up at step {self.warmup_end_step}")
        self._step = last
        self.total += counts
        if last <= self.warmup_end_step:
            self.warmup_s += seconds
        else:
            self.steady += counts
            self.steady_s += seconds
            self.steady_device_s += seconds * self.num_devices
            self._window += counts
            self._window_s += seconds

    def interval(self) -> Rates | None:
        """Steady-state rates since the previous call, or None when no steady step happened."""
        if self._window.steps == 0 or self._window_s <= 0:
            return None
        r = Rates(self._window, self._window_s, self.num_devices)
        self._window, self._window_s = Counts(), 0.0
        return r

    def summary(self) -> Rates | None:
        """Steady-state rates over the whole attempt(s), or None when all steps were warm-up."""
        if self.steady.steps == 0 or self.steady_s <= 0:
            return None
        return Rates(Counts(**asdict(self.steady)), self.steady_s, self.num_devices, self.steady_device_s or None)

    # -- resume ----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Counters to store in a checkpoint."""
        return {"total": asdict(self.total), "steady": asdict(self.steady), "steady_s": self.steady_s,
                "steady_device_s": self.steady_device_s, "num_devices": self.num_devices,
                "warmup_s": self.warmup_s, "step": self._step}

    def load_state_dict(self, state: dict) -> None:
        """Continue the counters of a checkpoint; the new attempt warms up again from its step.

        Its steady steps keep the devices they ran on (``steady_device_s``; a checkpoint without it was
        written by as many devices as this meter has, the only resume allowed then)."""
        self.total = Counts(**state["total"])
        self.steady = Counts(**state["steady"])
        self.steady_s = float(state["steady_s"])
        self.steady_device_s = float(state.get("steady_device_s",
                                               self.steady_s * int(state.get("num_devices", self.num_devices))))
        self.warmup_s = float(state["warmup_s"])
        self._step = self.start_step = int(state["step"])


def finite(x: float | None) -> bool:
    """True for a real, finite number."""
    return x is not None and isinstance(x, (int, float)) and math.isfinite(x)


def global_batch_tokens(seq_len: int, micro_batch_size: int, grad_accum: int, data_parallel: int) -> int:
    """Token positions of one optimizer step over every data-parallel rank (padding included): the
    ``llmeff.global_batch_tokens`` tag and a plan's ``tokens_per_step``.

    ``seq_len x micro_batch_size x grad_accum x data_parallel``: each data-parallel rank reads its own
    ``micro_batch_size`` sequences of ``seq_len`` positions per micro-batch, ``grad_accum`` micro-batches
    a step; tensor-, context- and pipeline-parallel peers of a rank read the same sequences and add
    none (``docs/formulas.md``, "Counting rules"). The one formula: the resolved run
    (:class:`mlflow_llmeff.planning.spec.RunSpec`), the plan and a monitored loop's shape tags call it.

    Args:
        seq_len: positions per sequence.
        micro_batch_size: sequences per micro-batch per data-parallel rank.
        grad_accum: micro-batches per optimizer step.
        data_parallel: data-parallel ranks (``dp_replicate x dp_shard``; not the world size).

    Raises:
        ValueError: when a factor is below 1.
    """
    for name, v in (("seq_len", seq_len), ("micro_batch_size", micro_batch_size), ("grad_accum", grad_accum),
                    ("data_parallel", data_parallel)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name}={v!r} is not accepted; give an int >= 1")
    return seq_len * micro_batch_size * grad_accum * data_parallel
