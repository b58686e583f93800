"""How steady a run's steady state was: step-time dispersion, stalls, the interval of the mean throughput.

A pure calculator (no I/O, no torch, no clock; ``../shared/METRICS.md``, "Uncertainty and
stability"). Input: the post-warm-up optimizer steps of a run, each with its seconds and its
tokens. Output: :class:`Stability`, whose figures sit beside the run's steady-state mean.

* The mean throughput stays tokens / time over every steady step: stalls are a real cost, so
  they stay in the mean and are counted apart (``stall_s``).
* Percentiles are linear interpolation between order statistics (Hyndman & Fan 1996, definition
  7; NumPy's and R's default). ``cv`` is the sample standard deviation (n - 1) over the mean.
* A stall is a step longer than :data:`STALL_FACTOR` x the median step (METRICS.md).
* The 95% interval of the mean throughput allows for autocorrelated step times (a slow stretch of
  many steps: another job, throttling): consecutive steps are cut into ``k`` non-overlapping
  batches of about ``sqrt(n)`` steps (the batch-size rule ``b = floor(sqrt(n))`` of Flegal & Jones
  2010, "Batch means and spectral variance estimators in MCMC", Ann. Statist. 38(2)), and the
  batches are resampled with replacement (the non-overlapping block bootstrap, Carlstein 1986,
  Ann. Statist. 14(3); Kunsch 1989, Ann. Statist. 17(3)) :data:`BOOTSTRAP_RESAMPLES` times with a
  fixed seed; each resample's throughput is its tokens over its seconds (the ratio estimator, so
  uneven tokens per step are weighted as the mean weights them), and the interval is the 2.5th and
  97.5th percentile of those (Efron & Tibshirani 1993, ch. 13). A percentile interval never leaves
  the range of the batches' own throughputs, unlike a normal interval on a heavy-tailed mean, and a
  run of equal steps gets an interval of zero width. Deterministic for equal input.
* :func:`verdict` is ``stable`` or ``unstable: <why>`` from the thresholds below; docs/stability.md
  gives their reasons.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

__all__ = ["STALL_FACTOR", "P90_P50_LIMIT", "STALL_SHARE_LIMIT", "CI_HALF_WIDTH_LIMIT", "MIN_STEPS",
           "BOOTSTRAP_RESAMPLES", "Stability", "percentile", "batch_bounds", "throughput_interval", "analyse",
           "verdict", "straggler", "THRESHOLDS_TEXT"]

#: A step longer than this many median steps is a stall (METRICS.md).
STALL_FACTOR = 5.0
#: Unstable when the 90th percentile step is more than this many median steps.
P90_P50_LIMIT = 1.5
#: Unstable when stalls take more than this share of the steady step time.
STALL_SHARE_LIMIT = 0.05
#: Unstable when the 95% interval's half width is more than this share of the mean throughput.
CI_HALF_WIDTH_LIMIT = 0.10
#: Fewer steady steps than this give no interval and an ``unstable`` verdict (too few to tell).
MIN_STEPS = 10
#: Block-bootstrap resamples for the interval.
BOOTSTRAP_RESAMPLES = 2000
_SEED = 20261201

#: The thresholds in words, for the ``llmeff.stability.method`` tag.
THRESHOLDS_TEXT = (f"stall = step > {STALL_FACTOR:g}x median; unstable when p90/p50 > {P90_P50_LIMIT:g}, "
                   f"stalls > {STALL_SHARE_LIMIT:.0%} of step time, 95% interval half width > "
                   f"{CI_HALF_WIDTH_LIMIT:.0%} of the mean, or fewer than {MIN_STEPS} steady steps; interval: "
                   f"block bootstrap over ~sqrt(n)-step batches, {BOOTSTRAP_RESAMPLES} resamples, percentile")


def percentile(xs: Sequence[float], q: float) -> float:
    """The ``q``-th percentile of ``xs`` by linear interpolation (Hyndman & Fan definition 7).

    Args:
        xs: values (any order, at least one).
        q: percentile in [0, 100].

    Raises:
        ValueError: for an empty ``xs`` or ``q`` outside [0, 100].
    """
    if not xs:
        raise ValueError("percentile of no values; give at least one")
    if not 0 <= q <= 100:
        raise ValueError(f"q={q!r} is not accepted; give a percentile in [0, 100]")
    s = sorted(xs)
    h = (len(s) - 1) * q / 100.0
    lo = math.floor(h)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (h - lo) * (s[hi] - s[lo])


def batch_bounds(n: int) -> list[tuple[int, int]]:
    """``[start, end)`` of ``k = floor(n / b)`` consecutive batches, ``b = floor(sqrt(n))``, sizes differing by <= 1.

    Args:
        n: number of steps (>= 1).

    Raises:
        ValueError: for ``n < 1``.
    """
    if n < 1:
        raise ValueError(f"n={n!r} steps is not accepted; give n >= 1")
    b = max(1, math.isqrt(n))
    k = max(1, n // b)
    base, extra = divmod(n, k)
    out, start = [], 0
    for j in range(k):
        end = start + base + (1 if j < extra else 0)
        out.append((start, end))
        start = end
    return out


def throughput_interval(seconds: Sequence[float], tokens: Sequence[float], *, level: float = 0.95,
                        resamples: int = BOOTSTRAP_RESAMPLES, seed: int = _SEED) -> tuple[float, float]:
    """95% (``level``) block-bootstrap interval of ``sum(tokens) / sum(seconds)``.

    Args:
        seconds: seconds of each step, ``(n,)``, in step order (all > 0 in total).
        tokens: tokens of each step, ``(n,)``.
        level: coverage in (0, 1).
        resamples: bootstrap resamples (>= 1).
        seed: seed of the resampling (fixed: equal input gives an equal interval).

    Returns:
        ``(low, high)`` in tokens/s.

    Raises:
        ValueError: for lengths that differ, fewer than 2 steps, no time, or a bad ``level``.
    """
    if len(seconds) != len(tokens):
        raise ValueError(f"{len(seconds)} step times but {len(tokens)} token counts; give one of each per step")
    if len(seconds) < 2 or sum(seconds) <= 0:
        raise ValueError("an interval needs at least 2 steps and a positive total time")
    if not 0 < level < 1:
        raise ValueError(f"level={level!r} is not accepted; give a coverage in (0, 1)")
    import numpy as np

    bt = np.array([(sum(seconds[a:b]), sum(tokens[a:b])) for a, b in batch_bounds(len(seconds))], dtype=np.float64)
    mean = float(bt[:, 1].sum() / bt[:, 0].sum())
    rates = bt[:, 1] / bt[:, 0]
    if np.allclose(rates, rates[0], rtol=1e-12, atol=0.0):  # every batch alike: no spread to resample
        return mean, mean
    # (resamples, k) batch indices: row i is one bootstrap resample of the k batches (PCG64: stable stream)
    idx = np.random.default_rng(seed).integers(0, len(bt), size=(resamples, len(bt)))
    ratios = bt[idx, 1].sum(axis=1) / bt[idx, 0].sum(axis=1)
    alpha = (1 - level) / 2 * 100
    low, high = (float(np.percentile(ratios, q)) for q in (alpha, 100 - alpha))  # linear: definition 7
    return min(low, mean), max(high, mean)


@dataclass(frozen=True)
class Stability:
    """Dispersion of a run's steady-state steps.

    Attributes:
        steps: steady steps analysed.
        mean_step_s, p50_step_s, p90_step_s: mean and percentiles of the step time, s.
        cv: sample standard deviation / mean of the step time (0 for one step).
        stalls: steps longer than :data:`STALL_FACTOR` x the median.
        stall_s: seconds in those steps (kept in the mean).
        total_s: seconds of every steady step.
        tokens_per_sec: sum of tokens / sum of seconds.
        ci95: ``(low, high)`` of ``tokens_per_sec``, None below :data:`MIN_STEPS` steps.
    """

    steps: int
    mean_step_s: float
    p50_step_s: float
    p90_step_s: float
    cv: float
    stalls: int
    stall_s: float
    total_s: float
    tokens_per_sec: float
    ci95: tuple[float, float] | None


def analyse(seconds: Sequence[float], tokens: Sequence[float]) -> Stability | None:
    """The :class:`Stability` of steady steps ``seconds`` (s each) carrying ``tokens`` each.

    Args:
        seconds: per-step seconds, ``(n,)``, in step order.
        tokens: per-step tokens, ``(n,)``.

    Returns:
        None when there is no step or no time.

    Raises:
        ValueError: when the two lengths differ.
    """
    if len(seconds) != len(tokens):
        raise ValueError(f"{len(seconds)} step times but {len(tokens)} token counts; give one of each per step")
    n, total = len(seconds), float(sum(seconds))
    if n == 0 or total <= 0:
        return None
    mean = total / n
    var = sum((x - mean) ** 2 for x in seconds) / (n - 1) if n > 1 else 0.0
    p50 = percentile(seconds, 50)
    long = [x for x in seconds if x > STALL_FACTOR * p50]
    tps = float(sum(tokens)) / total
    ci = throughput_interval(seconds, tokens) if n >= MIN_STEPS else None
    if ci is not None:  # the same mean summed in another order: keep it inside its own interval
        ci = (tps, tps) if ci[0] == ci[1] else (min(ci[0], tps), max(ci[1], tps))
    return Stability(steps=n, mean_step_s=mean, p50_step_s=p50, p90_step_s=percentile(seconds, 90),
                     cv=math.sqrt(var) / mean, stalls=len(long), stall_s=float(sum(long)), total_s=total,
                     tokens_per_sec=tps, ci95=ci)


def _g(x: float) -> str:
    return f"{x:.3g}"


def verdict(s: Stability | None) -> str:
    """``stable``, or ``unstable: <why>`` naming every figure past its threshold.

    E.g. ``unstable: 2 stalls = 3.4 s of 4.37 s step time; 95% interval +-38% of the mean``.
    """
    if s is None:
        return "unstable: no steady-state step (all steps were warm-up)"
    why = []
    if s.steps < MIN_STEPS:
        why.append(f"only {s.steps} steady steps (fewer than {MIN_STEPS}: no interval)")
    ratio = s.p90_step_s / s.p50_step_s if s.p50_step_s > 0 else math.inf
    if ratio > P90_P50_LIMIT:
        why.append(f"p90/p50 step time {_g(ratio)} (> {P90_P50_LIMIT:g})")
    if s.stalls and s.stall_s > STALL_SHARE_LIMIT * s.total_s:
        why.append(f"{s.stalls} stall{'s' if s.stalls > 1 else ''} = {_g(s.stall_s)} s of {_g(s.total_s)} s step time"
                   f" (steps > {STALL_FACTOR:g}x the median {_g(s.p50_step_s)} s)")
    if s.ci95 is not None and s.tokens_per_sec > 0:
        half = (s.ci95[1] - s.ci95[0]) / 2 / s.tokens_per_sec
        if half > CI_HALF_WIDTH_LIMIT:
            why.append(f"95% interval +-{half:.0%} of the mean (> {CI_HALF_WIDTH_LIMIT:.0%})")
    return "unstable: " + "; ".join(why) if why else "stable"


def straggler(per_rank_s: Sequence[float]) -> tuple[float, int] | None:
    """``(slowest rank's time / median rank's time, slowest rank)`` of per-rank mean step compute times.

    The median of an even number of ranks is the mean of the middle two (so with 2 ranks the ratio
    is the slower one over their mean).

    Args:
        per_rank_s: mean forward (compute) seconds per step of each rank, indexed by global rank.

    Returns:
        None for fewer than 2 ranks or a median of 0.
    """
    if len(per_rank_s) < 2:
        return None
    med = percentile(per_rank_s, 50)
    if med <= 0:
        return None
    slowest = max(range(len(per_rank_s)), key=lambda r: per_rank_s[r])
    return per_rank_s[slowest] / med, slowest
