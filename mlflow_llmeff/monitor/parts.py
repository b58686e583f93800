"""The interface between a monitor and its helper modules: its components and what set-up decided (:class:`Parts`).

:class:`~mlflow_llmeff.monitor.meter.EfficiencyMonitor` tells the story of a step; what it measures
with lives in one :class:`Parts`, built once by its constructor (:mod:`~mlflow_llmeff.monitor.assembly`
fills it in the constructor's order) and handed to the helper modules, which work through its
public fields and the components' own public methods, never through the monitor's private state:
:mod:`~mlflow_llmeff.monitor.binding` (the MLflow run), :mod:`~mlflow_llmeff.monitor.points` (window
edges and the logged points) and :mod:`~mlflow_llmeff.monitor.summary` (the end of the run). The way
torchtitan's ``MetricsProcessor`` owns what a log step needs and the trainer only calls it.

A :class:`Parts` holds two kinds of things:

* what the construction decided (the world, the model and its device, precision, strategy, price,
  the targets): read-only afterwards, except ``precision`` (FP8 layers may tell only after the
  first step), ``device`` (a model-less monitor learns it from the first batch) and ``optimizer``
  (``autolog()`` may find it late);
* the components, each owning its fields and used through its own methods: the counting tally, the
  throughput meter, the time ledger, the FLOPs account, energy meter, carbon tracker, consumption,
  step times, device step clock, phase timer, contention meter, the run logger and the MLflow run;
  and what the monitor notes of its run beside them, one small component per concern (the window
  being counted, the phase totals, the run's name and the caller's tags, the warnings said once, the
  keys left undefined, the last logged point, the targets reached, the job's earlier attempts, what
  the end collects, the held peak memory, this rank's energy devices). A helper module calls their
  methods; none assigns another component's fields (tests/test_architecture.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from mlflow_llmeff.monitor.conditions import RunNaming
from mlflow_llmeff.monitor.consumption import EnergyShare
from mlflow_llmeff.monitor.memwatch import HeldPeak
from mlflow_llmeff.monitor.notes import Absences, Ending, JobHistory, LastPoint, Notices, Reached
from mlflow_llmeff.monitor.steptimes import PhaseTotals, Window

if TYPE_CHECKING:  # the set-up components' types, for the reader: parts.py builds none of these
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

__all__ = ["Parts"]


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
        naming: the run's name, the caller's tags, the batch-shape tags the name follows
            (:class:`~mlflow_llmeff.monitor.conditions.RunNaming`).
        notices: the warnings said once (:class:`~mlflow_llmeff.monitor.notes.Notices`).
        interval_absent, summary_absent: interval and ``summary/*`` keys left undefined and why
            (:class:`~mlflow_llmeff.monitor.notes.Absences`: ``llmeff.interval.absent``, ``llmeff.summary.absent``).
        last: the last logged point and the first non-finite loss (:class:`~mlflow_llmeff.monitor.notes.LastPoint`).
        reached: the time-to-quality targets reached (:class:`~mlflow_llmeff.monitor.notes.Reached`).
        job: the job's earlier attempts (:class:`~mlflow_llmeff.monitor.notes.JobHistory`).
        ending: the run's end status, stability tags and figures given from outside
            (:class:`~mlflow_llmeff.monitor.notes.Ending`).
        peak: the peak memory last read for the interval keys (:class:`~mlflow_llmeff.monitor.memwatch.HeldPeak`).
        energy_share: the energy devices this rank reports (:class:`~mlflow_llmeff.monitor.consumption.EnergyShare`).
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
    naming: RunNaming = field(default_factory=RunNaming)
    notices: Notices = field(default_factory=Notices)
    interval_absent: Absences = field(default_factory=Absences)
    summary_absent: Absences = field(default_factory=Absences)
    last: LastPoint = field(default_factory=LastPoint)
    reached: Reached = field(default_factory=Reached)
    job: JobHistory = field(default_factory=JobHistory)
    ending: Ending = field(default_factory=Ending)
    peak: HeldPeak = field(default_factory=HeldPeak)
    energy_share: EnergyShare = field(default_factory=EnergyShare)

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
