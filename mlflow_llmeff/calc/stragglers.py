"""Which rank the others wait for, on which host, and in which phase of the step (pure).

Input: each rank's mean seconds per steady step of its compute phases, ``forward``, ``backward``
and ``optimizer`` (the meter's :class:`~mlflow_llmeff.monitor.steptimes.PhaseTimer`), its mean
step time, and its host. Output: :class:`Stragglers`.

* A rank's compute time is the sum of its phases; the rest of its step is collective wait (and
  the loop's other work: clipping, the scheduler). In a synchronous step every rank's step time
  is about the slowest rank's compute plus the communication, so the straggler is the rank with
  the largest compute time, and the others show its excess as collective wait: a rank's own wait
  never names it (the fast ranks wait longest).
* ``ratio`` = the straggler's compute time / the median rank's (the metric standard's "slowest
  rank's mean step compute time / median rank's (before the collective waits)", docs/stability.md;
  the median of an even count is the mean of the middle two, so with 2 ranks it is the slower
  over their mean).
* The phase named is the straggler's phase with the most seconds above that phase's median rank:
  a rank slow only in its backward is named in its backward, whatever its forward does; a uniform
  slowdown (a CPU-limited host) names its longest phase.
* Each phase's own ratio, the slowest rank in it over its median rank, is given apart (a rank
  can be slowest in a phase without being the straggler).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

from mlflow_llmeff.calc.stability import percentile

__all__ = ["PHASES", "RankTimes", "Stragglers", "stragglers"]

#: The compute phases, in step order.
PHASES = ("forward", "backward", "optimizer")


@dataclass(frozen=True)
class RankTimes:
    """One rank's mean seconds per steady step.

    Attributes:
        host: the host name the rank ran on.
        phases: ``{phase: s}`` for the phases it timed (a phase it could not time is left out).
        step_s: its mean step time (s), or None.
    """

    host: str
    phases: Mapping[str, float]
    step_s: float | None = None


@dataclass(frozen=True)
class Stragglers:
    """The straggler of a run and the phase figures (see the module docstring).

    Attributes:
        rank: the straggler (the rank with the largest compute time).
        host: its host.
        ratio: its compute time / the median rank's (>= 1).
        phase: its phase with the most seconds above that phase's median.
        phase_ratio: its time in ``phase`` / that phase's median rank's (None when that median is 0).
        compute_s: every rank's compute time (s per step), by rank.
        wait_s: every rank's step time minus its compute time (s per step; None without a step time).
        phase_ratios: each phase's slowest rank / its median rank (phases with a median above 0).
        medians: each phase's median rank's seconds, and ``compute``'s.
        phases: the phases summed.
    """

    rank: int
    host: str
    ratio: float
    phase: str
    phase_ratio: float | None
    compute_s: list[float]
    wait_s: list[float | None]
    phase_ratios: dict[str, float] = field(default_factory=dict)
    medians: dict[str, float] = field(default_factory=dict)
    phases: tuple[str, ...] = PHASES


def stragglers(ranks: Sequence[RankTimes]) -> Stragglers | None:
    """The straggler of ``ranks`` (indexed by global rank), or None.

    Only phases every rank timed are summed. None for fewer than 2 ranks, no phase timed by every
    rank, or a median compute time of 0 (a ratio over it is undefined, never 1).

    Raises:
        ValueError: for a negative phase time.
    """
    if len(ranks) < 2:
        return None
    phases = tuple(p for p in PHASES if all(p in r.phases for r in ranks))
    if not phases:
        return None
    for r in ranks:
        bad = {p: v for p, v in r.phases.items() if v < 0}
        if bad:
            raise ValueError(f"phase seconds {bad} on host {r.host!r} are negative; give seconds >= 0")
    compute = [sum(r.phases[p] for p in phases) for r in ranks]
    med = percentile(compute, 50)
    if med <= 0:
        return None
    slow = max(range(len(ranks)), key=lambda i: compute[i])
    medians = {p: percentile([r.phases[p] for r in ranks], 50) for p in phases}
    phase = max(phases, key=lambda p: ranks[slow].phases[p] - medians[p])
    ratios = {p: max(r.phases[p] for r in ranks) / medians[p] for p in phases if medians[p] > 0}
    wait = [max(0.0, r.step_s - c) if r.step_s is not None else None for r, c in zip(ranks, compute)]
    return Stragglers(rank=slow, host=ranks[slow].host, ratio=compute[slow] / med, phase=phase,
                      phase_ratio=ranks[slow].phases[phase] / medians[phase] if medians[phase] > 0 else None,
                      compute_s=compute, wait_s=wait, phase_ratios=ratios, medians={**medians, "compute": med},
                      phases=phases)
