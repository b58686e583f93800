"""The interface between a monitor and its helper modules: its components (:class:`Parts`) and its run record.

:class:`~mlflow_llmeff.monitor.meter.EfficiencyMonitor` tells the story of a step; what it measures
with lives in one :class:`Parts`, built once by its constructor (:mod:`~mlflow_llmeff.monitor.assembly`
fills it in the constructor's order) and handed to the helper modules, which work through its
public fields and the components' own public methods, never through the monitor's private state:
:mod:`~mlflow_llmeff.monitor.binding` (the MLflow run), :mod:`~mlflow_llmeff.monitor.points` (window
edges and the logged points) and :mod:`~mlflow_llmeff.monitor.summary` (the end of the run). The way
torchtitan's ``MetricsProcessor`` owns what a log step needs and the trainer only calls it.

A :class:`Parts` holds three kinds of things:

* what the construction decided (the world, the model and its device, precision, strategy, price,
  the targets): read-only afterwards, except ``precision`` (FP8 layers may tell only after the
  first step), ``device`` (a model-less monitor learns it from the first batch) and ``optimizer``
  (``autolog()`` may find it late);
* the components, each used through its own methods: the counting tally, the throughput meter, the
  time ledger, the FLOPs account, energy meter, carbon tracker, consumption, step times, device step
  clock, phase timer, contention meter, the run logger and the MLflow run;
* :class:`RunRecord`: what the monitor has recorded of its run so far beyond the components' own
  state (the window being counted, targets reached, the job's earlier attempts, the run's name,
  what was said once, the figures left undefined).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from mlflow_llmeff.monitor.steptimes import PhaseTotals, Window

if TYPE_CHECKING:  # the components' types, for the reader: parts.py builds none of them
    from mlflow_llmeff.calc.goodput import TimeLedger
    from mlflow_llmeff.calc.throughput import ThroughputMeter
    from mlflow_llmeff.meters.carbon import CarbonTracker
    from mlflow_llmeff.meters.energy import EnergyMeter
    from mlflow_llmeff.meters.hardware import AcceleratorInfo
    from mlflow_llmeff.monitor.account import FlopsAccount
    from mlflow_llmeff.monitor.compiles import CompileWatch
    from mlflow_llmeff.monitor.consumption import Consumption
    from mlflow_llmeff.monitor.contention import ContentionMeter
    from mlflow_llmeff.monitor.counting import StepTally
    from mlflow_llmeff.monitor.memwatch import MemoryWatch
    from mlflow_llmeff.monitor.steptimes import DeviceStepClock, PhaseTimer, StepTimes
    from mlflow_llmeff.parallel.degrees import TokenCounting
    from mlflow_llmeff.tracking.runs import RunHandle

__all__ = ["Parts", "RunRecord"]


@dataclass(eq=False)
class RunRecord:
    """What a monitor has recorded of its run, beyond its components' own state (one per monitor).

    Attributes:
        nonfinite: ``(step, value)`` of the first logged non-finite ``train/loss``, else None.
        totals_step: the step of the last logged running totals (-1: none yet).
        latest: the interval metrics of the last logged step.
        reached: target key -> the step it was first reached at (time to quality).
        attempts: the job's attempts, this one included (``llmeff.resume.attempts``).
        down_s: the job's seconds no attempt ran (``continue_job``).
        tail_lost: ``(lost progress added, Unix time the resumed checkpoint was written)``, else None.
        tail_devices: devices of the resumed checkpoint's writer (None: this attempt's).
        job_figures: ``end Unix time -> (summary metrics, tags, description line)`` (``set_job_figures``).
        job_note: the job's line added to the run's description at the end.
        extra_summary: figures measured outside the meter, logged with the ``summary/*``.
        name_parts: the run name's parts when the meter named the run (None: a name it did not give).
        name_given: ``(the caller's tags, eval_tasks)`` the name was made from.
        given_tags: keys of the tags the caller gave (they win over the meter's).
        created_after_s: seconds from the attempt's start to the run's creation (None: an earlier
            attempt's run).
        shape_tags_pending: the first step's batch shape is still to be tagged.
        shape_varied: a micro-batch's shape differed from the first one's (tagged ``dynamic``).
        replica_warned, mfu_warned, nothing_noted: the warning was given (each once per run).
        interval_absent: interval key -> why it is left out (``llmeff.interval.absent``).
        energy_ids: the energy device ids this rank reports (None: not gathered yet).
        unmeasured_seen: devices left out of the energy over every rank, when last gathered.
        memory_source: where the peak memory was read (``llmeff.memory.source``).
        memory_held: a CPU process's last peak-RSS reading, ``(monotonic s, allocated GiB, reserved GiB)``
            (:func:`~mlflow_llmeff.monitor.points.memory` reads it at most every ``CPU_MEMORY_REFRESH_S``).
        absent: ``summary/*`` key -> why it is undefined for this run (``llmeff.summary.absent``).
        stability_tags: ``llmeff.stability`` and the tags beside it, set by the summary.
        end_status: the MLflow status the run ends with.
    """

    nonfinite: tuple[int, float] | None = None
    totals_step: int = -1
    latest: dict[str, float] = field(default_factory=dict)
    reached: dict[str, int] = field(default_factory=dict)
    attempts: int = 1
    down_s: float = 0.0
    tail_lost: tuple[float, float] | None = None
    tail_devices: int | None = None
    job_figures: Callable[[float], tuple[dict, dict, str | None]] | None = None
    job_note: str | None = None
    extra_summary: dict[str, float] = field(default_factory=dict)
    name_parts: dict[str, str] | None = None
    name_given: tuple[dict, str | None] = ({}, None)
    given_tags: set[str] = field(default_factory=set)
    created_after_s: float | None = None
    shape_tags_pending: bool = True
    shape_varied: bool = False
    replica_warned: bool = False
    mfu_warned: bool = False
    nothing_noted: bool = False
    interval_absent: dict[str, str] = field(default_factory=dict)
    energy_ids: set[str] | None = None
    unmeasured_seen: float | None = None
    memory_source: str | None = None
    memory_held: tuple[float, float, float] | None = None
    absent: dict[str, str] = field(default_factory=dict)
    stability_tags: dict[str, str] = field(default_factory=dict)
    end_status: str | None = None


@dataclass(eq=False)
class Parts:
    """A monitor's components and what its construction decided (see the module's docstring).

    Attributes:
        world_size: processes in the job; rank: this one's (0: the main rank, the only one that logs).
        counting: the run's token-counting rule (:func:`~mlflow_llmeff.parallel.degrees.token_counting`).
        warmup_steps: first optimizer steps of every attempt excluded from steady-state figures.
        clock: monotonic seconds (the monitor's clock; tests inject one).
        attempt_start: this attempt's start on ``clock``.
        integration: ``llmeff.autolog.integration`` (train, monitor, trainer, accelerate, pytorch).
        model, optimizer: what the monitor was given (None when not).
        device: the torch device the counts and the model live on (None: not known yet).
        precision, precision_source: the compute precision (``llmeff.precision``) and where it was read.
        strategy, compiled, activation_checkpointing: the run's conditions (tags, FLOPs, HFU).
        accelerator: the detected :class:`~mlflow_llmeff.meters.hardware.AcceleratorInfo`.
        assumed: input -> what was taken for the user and why (``llmeff.assumed``).
        cost_tags: the price's provenance tags; user_peak_tflops: ``peak_tflops=`` as given.
        targets: the time-to-quality targets; subject_metrics: log MMLU subjects as metrics too.
        heartbeat_path, outbox_dir: where rank 0 writes its heartbeat and keeps what the server has not taken.
        tally, meter, ledger, account, energy, carbon, consumption, steps, devclock, phases, contention,
            logger, run: the components (the step tally, throughput meter, time ledger, FLOPs account,
            energy meter, carbon tracker, consumption totals, step times, device step clock or None,
            phase timer or None, contention meter, memory watch (where every byte goes), run logger, the MLflow run's handle or None).
        compiles: the :class:`~mlflow_llmeff.monitor.compiles.CompileWatch` (torch.compile inside steps).
        window: the steps since the last window edge (:class:`~mlflow_llmeff.monitor.steptimes.Window`).
        phase_totals: this attempt's steady phase seconds (:class:`~mlflow_llmeff.monitor.steptimes.PhaseTotals`).
        record: the :class:`RunRecord`.
    """

    world_size: int = 1
    rank: int = 0
    counting: TokenCounting | None = None
    warmup_steps: int = 0
    clock: Callable[[], float] | None = None
    attempt_start: float = 0.0
    integration: str = "monitor"
    model: Any = None
    optimizer: Any = None
    device: Any = None
    precision: str = "fp32"
    precision_source: str = "option"
    strategy: str | None = None
    compiled: bool = False
    activation_checkpointing: bool = False
    accelerator: AcceleratorInfo | None = None
    assumed: dict[str, str] = field(default_factory=dict)
    cost_tags: dict[str, str] = field(default_factory=dict)
    user_peak_tflops: float | None = None
    targets: list = field(default_factory=list)
    subject_metrics: bool = False
    heartbeat_path: str | None = None
    outbox_dir: str | None = None
    tally: StepTally | None = None
    meter: ThroughputMeter | None = None
    ledger: TimeLedger | None = None
    account: FlopsAccount | None = None
    energy: EnergyMeter | None = None
    carbon: CarbonTracker | None = None
    consumption: Consumption | None = None
    steps: StepTimes | None = None
    devclock: DeviceStepClock | None = None
    phases: PhaseTimer | None = None
    contention: ContentionMeter | None = None
    memory: MemoryWatch | None = None
    compiles: CompileWatch | None = None
    logger: Any = None
    run: RunHandle | None = None
    window: Window = field(default_factory=Window)
    phase_totals: PhaseTotals = field(default_factory=PhaseTotals)
    record: RunRecord = field(default_factory=RunRecord)

    @property
    def is_main(self) -> bool:
        """True on the main rank (rank 0), the only one that talks to MLflow."""
        return self.rank == 0

    @property
    def step_count(self) -> int:
        """Optimizer steps seen (earlier attempts and ``start_step`` included), the pending ones too."""
        return self.meter.step + self.window.steps

    def forward_counts(self) -> bool:
        """True while a forward pass is part of a steady step (not warm-up, not inside a declared pause)."""
        meter = self.meter  # (read by the phase timer's hooks inside every step: the step count inlined)
        return not self.ledger.paused and meter.step + self.window.steps + 1 > meter.warmup_end_step

    def assumptions(self) -> dict[str, str]:
        """What the monitor took for the user (precision, list price) and what its carbon figures assume
        (grid country, PUE): ``{input: '<value> (<why>)'}``, empty when nothing was assumed."""
        carbon = self.carbon
        return {**self.assumed, **(carbon.assumptions() if hasattr(carbon, "assumptions") else {})}
