"""MLPerf Training's score of a set of runs to one quality target: the olympic mean, non-converged runs (pure).

The rule implemented, word for word from the MLPerf Training Rules (``training_rules.adoc`` of
mlcommons/training_policies, the version dated Dec 9, 2025, benchmarks "Latest version available
v6.0"), section "Benchmark Results":

    Each benchmark result is computed by dropping the fastest and slowest runs, then taking the mean
    of the remaining times. For this purpose, a single non-converging run may be treated as the
    slowest run and dropped. A benchmark result is invalid if there is more than one non-converging run.

and its section "Scoring": "Any failed runs ... would count as infinity time and need to be included
in the olympic scoring (could be thrown away as the slowest score)". So a run that never reached the
target (or failed) enters as an infinitely slow run: one such run is the slowest and is dropped, two
or more leave no score (:attr:`Olympic.why` says so). The same section's table fixes how many runs a
benchmark needs (:data:`MIN_RUNS`); this module scores whatever runs it is given, at least three, and
the caller says how that number compares. The deprecated UNET3D rule (40 runs, the 4 fastest and 4
slowest dropped, at most 4 non-converging) is the same rule with ``drop=4``.

Energy and cost to the target are scored on the runs the time score keeps (:func:`olympic_on_kept`):
the same fastest and slowest runs are dropped, as MLCommons' result summarizer scores power, "the
olympic average for the power scores sorting by the performance scores" (mlcommons/logging,
``mlperf_logging/result_summarizer``, ``_index_olympic_average``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

__all__ = ["RULES", "MIN_RUNS", "Olympic", "olympic", "olympic_on_kept"]

#: The rules this module implements, as cited in ``docs/compare.md``.
RULES = ("MLPerf Training Rules, Dec 9, 2025 (v6.0), 'Benchmark Results': drop the fastest and the slowest run, "
         "mean of the rest; a single non-converging run may be treated as the slowest and dropped; more than one "
         "makes the result invalid")

#: Minimum number of runs per LLM benchmark of MLPerf Training v6.0 ("Benchmark Results" table):
#: Small LLM pretraining (Llama 3.1 8B) and Small LLM MoE pretraining (GPT-OSS 20B) 10, LLM
#: pretraining (Llama 3.1 405B) and LLM MoE pretraining (DeepSeek-V3 671B) 3, LLM finetuning
#: (Llama 2 70B LoRA) 10.
MIN_RUNS = {"llama31_8b": 10, "gpt_oss_20b": 10, "llama31_405b": 3, "deepseekv3_671b": 3, "llama2_70b_lora": 10}


@dataclass(frozen=True)
class Olympic:
    """The olympic score of one figure (seconds, kWh or USD to the target) over a set of runs.

    Attributes:
        n: runs scored (converged and not).
        not_converged: runs that did not reach the target (infinite).
        score: the mean of :attr:`kept`, in the figure's unit; None when there is no valid result
            (:attr:`why`).
        kept: the values averaged, lowest first (the runs left after dropping).
        dropped_low: the values dropped as the fastest (lowest), lowest first.
        dropped_high: the finite values dropped as the slowest (highest); a non-converged run dropped
            as the slowest is not among them (it has no value) and is counted in :attr:`not_converged`.
        converged: every finite value, lowest first.
        drop: runs dropped at each end.
        why: "" for a valid result, else one line saying why there is none.
    """

    n: int
    not_converged: int
    score: float | None
    kept: tuple[float, ...]
    dropped_low: tuple[float, ...]
    dropped_high: tuple[float, ...]
    converged: tuple[float, ...]
    drop: int
    why: str = ""

    @property
    def valid(self) -> bool:
        return self.score is not None

    @property
    def low(self) -> float | None:
        """Lowest value averaged (None without a score): with :attr:`high`, the spread of the result."""
        return self.kept[0] if self.valid else None

    @property
    def high(self) -> float | None:
        """Highest value averaged (None without a score)."""
        return self.kept[-1] if self.valid else None


def _check(values: Sequence[float | None]) -> None:
    for v in values:
        if v is not None and not (math.isfinite(v) and v >= 0):
            raise ValueError(f"value {v!r} is not accepted; give a finite value >= 0, or None for a run that did "
                             "not reach the target")


def olympic(values: Sequence[float | None], drop: int = 1) -> Olympic:
    """MLPerf Training's olympic score (module docstring): drop the ``drop`` lowest and ``drop`` highest
    values, a run that did not converge (``None``) counting as infinitely high, and average the rest.

    ``score = mean(sorted(values)[drop : n - drop])`` with ``None`` sorted last as +infinity. No score
    (``why`` says which) when fewer than ``2 * drop + 1`` runs are given (nothing would be left) or
    more than ``drop`` did not converge (an infinity would be averaged: the rules call the result
    invalid).

    Example: times 100, 120, 90, 110 s and one run that never reached the target: sorted 90, 100, 110,
    120, inf; 90 and inf are dropped; score = (100 + 110 + 120) / 3 = 110 s.

    Args:
        values: one value per run (seconds, kWh or USD to the target, >= 0), ``None`` for a run that
            did not reach it.
        drop: runs dropped at each end (MLPerf: 1; UNET3D, deprecated: 4).

    Raises:
        ValueError: a negative, NaN or infinite value (write ``None`` for a run that did not converge),
            or ``drop`` below 1.
    """
    if isinstance(drop, bool) or not isinstance(drop, int) or drop < 1:
        raise ValueError(f"drop={drop!r} is not accepted; give the runs dropped at each end, an integer >= 1")
    _check(values)
    finite = tuple(sorted(float(v) for v in values if v is not None))
    n, failed = len(values), len(values) - len(finite)
    if n < 2 * drop + 1:
        return Olympic(n, failed, None, (), (), (), finite, drop,
                       f"{n} run{'s' if n != 1 else ''}: an olympic mean drops the {drop} fastest and the {drop} "
                       f"slowest, so it needs at least {2 * drop + 1}")
    if failed > drop:
        return Olympic(n, failed, None, (), (), (), finite, drop,
                       f"{failed} of {n} runs did not reach the target: at most {drop} may (dropped as the "
                       f"slowest); the result is invalid (MLPerf Training Rules, 'Benchmark Results')")
    kept = finite[drop:n - drop]  # the infinite runs are the last ``failed`` of the sorted n
    return Olympic(n, failed, sum(kept) / len(kept), kept, finite[:drop], finite[n - drop:], finite, drop)


def olympic_on_kept(times: Sequence[float | None], values: Sequence[float | None], drop: int = 1) -> Olympic:
    """A second figure of the same runs (kWh or USD to the target) scored on the runs the time score keeps.

    The runs are ordered by time (``None``, not converged, as +infinity; equal times in the order given),
    the ``drop`` fastest and ``drop`` slowest are dropped as :func:`olympic` drops them, and the score is
    the mean of ``values`` over the runs left: ``score = mean(values[i] for i in kept_by_time)``. This is
    how MLCommons' result summarizer scores power (module docstring); scoring each figure by its own
    olympic mean could keep a run the time score dropped. No score (``why`` says so) where the time score
    has none, or where a kept run has no value.

    Example: times 100, 90, 110, 120, 130 s and energies 1.5, 4.0, 2.0, 2.5, 3.0 kWh: the time score drops
    the 90 s run (4.0 kWh, also the most energy-hungry) and the 130 s run (3.0 kWh); the energy score is
    (1.5 + 2.0 + 2.5) / 3 = 2.0 kWh, where the energies' own olympic mean would drop 1.5 and 4.0 and give
    (2.0 + 2.5 + 3.0) / 3 = 2.5 kWh.

    Args:
        times: one time to the target per run (seconds, >= 0), ``None`` for a run that did not reach it.
        values: the figure of the same runs in the same order (kWh or USD, >= 0), ``None`` where a run has
            none (a run that did not reach the target).
        drop: runs dropped at each end, as :func:`olympic`.

    Returns:
        An :class:`Olympic` of ``values``: :attr:`~Olympic.kept` the values of the runs the time score
        kept, :attr:`~Olympic.dropped_low` / :attr:`~Olympic.dropped_high` those of the runs it dropped
        as the fastest / slowest, :attr:`~Olympic.not_converged` the runs without a time.

    Raises:
        ValueError: ``times`` and ``values`` of different lengths, or a bad value or ``drop`` (as
            :func:`olympic`).
    """
    if len(times) != len(values):
        raise ValueError(f"{len(times)} times and {len(values)} values are not accepted; give one value per run")
    t = olympic(times, drop)
    _check(values)
    n = len(times)
    converged = tuple(sorted(float(values[i]) for i in range(n) if times[i] is not None and values[i] is not None))
    if not t.valid:
        return Olympic(n, t.not_converged, None, (), (), (), converged, drop, t.why)
    order = sorted(range(n), key=lambda i: (math.inf if times[i] is None else times[i], i))
    low, kept, high = order[:drop], order[drop:n - drop], order[n - drop:]

    def of(idx: list[int]) -> tuple[float, ...]:
        return tuple(sorted(float(values[i]) for i in idx if values[i] is not None))

    if any(values[i] is None for i in kept):
        return Olympic(n, t.not_converged, None, (), of(low), of(high), converged, drop,
                       "a run the time score kept has no value for this figure")
    k = of(kept)
    return Olympic(n, t.not_converged, sum(k) / len(k), k, of(low), of(high), converged, drop)
