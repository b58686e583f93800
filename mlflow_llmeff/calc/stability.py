"""How steady a run's steady state was: step-time dispersion, stalls, the interval of the mean throughput.

A pure calculator (no I/O, no torch, no clock; ``docs/stability.md``, "Per run", and its
"What the interval is held to"). Input: the post-warm-up optimizer steps of a
run, each with its seconds and its tokens. Output: :class:`Stability`, whose figures sit beside
the run's steady-state mean.

* The mean throughput stays tokens / time over every steady step: stalls are a real cost, so
  they stay in the mean and are counted apart (``stall_s``).
* Percentiles are linear interpolation between order statistics (Hyndman & Fan 1996, definition
  7; NumPy's and R's default). ``cv`` is the sample standard deviation (n - 1) over the mean;
  undefined (None) for one step.
* A stall is a step longer than :data:`STALL_FACTOR` x the median step (``docs/stability.md``).
* The 95% interval of the mean throughput (:func:`throughput_interval`) allows for autocorrelated
  step times (a slow stretch of many steps: another job, throttling). The mean is the ratio
  estimator ``R = sum(tokens) / sum(seconds)``; linearized (the delta method for a ratio, Cochran
  1977, *Sampling Techniques*, 3rd ed., ch. 6), ``R_hat - R ~ mean(z) / mean(seconds)`` with
  ``z_i = tokens_i - R_hat * seconds_i``, so ``Var(R_hat) ~ sigma2 / (n * mean(seconds)^2)``
  where ``sigma2`` is the long-run variance of ``z`` (the sum of its autocovariances over all
  lags), not its variance. ``sigma2`` is estimated by the sum of the sample autocovariances of
  ``z`` over lags ``|h| <= M``, with ``M`` chosen from the data by Geyer's initial monotone
  sequence estimator (Geyer 1992, "Practical Markov chain Monte Carlo", Statist. Sci. 7(4),
  sec. 3.3: sums of adjacent pairs of autocorrelations, cut at the first pair that is not
  positive and made non-increasing; the estimator of Stan's effective sample size). The same
  sum over the variance is the integrated autocorrelation time ``tau = 1 + 2 sum_h rho_h``
  (steps per independent step; Sokal 1997 writes half of it); at most 1 is taken as
  independent steps (``tau = 1``, ``M = 0``). A short run's Geyer sum stops where the sample
  autocorrelations dip to zero, too early for a slow stretch, so ``tau`` is at least the time
  the first two lags imply (:func:`short_run_tau`: AR(1) and ARMA(1,1)), and ``n_eff = n / tau``. Sample autocovariances
  about the sample mean are biased by about ``-sigma2 / n`` each (Priestley 1981, *Spectral
  Analysis and Time Series*, ch. 5), so the window's sum is divided by ``1 - (2M + 1) / n`` (at
  most doubled). With
  ``se = sqrt(sigma2 / n) / mean(seconds)`` and Student's t (``scipy.stats.t``) on
  ``nu = n / (2 (2M + 1))`` degrees of freedom (half the equivalent degrees of freedom of a
  truncated lag window at frequency zero, Priestley 1981, ch. 6, because the window is chosen
  from the same data: :data:`_DF_FACTOR`), the interval is ``R_hat * exp(+-t(0.975, nu) * se /
  R_hat)``: the delta method on the log scale, so it stays above 0 beside a stall, and for a
  half width of 10% it is within 0.2% of the mean of ``R_hat +- t * se``. Below
  :data:`MIN_EFFECTIVE_STEPS` effective steps no interval is given and the verdict says
  ``too few independent steps (<n_eff> of <n>)``. Just above that minimum the interval is widened
  (:func:`near_minimum_widening`: x :data:`NEAR_MINIMUM_WIDENING` at the minimum, tapering to 1 at
  :data:`NEAR_MINIMUM_END` x the minimum): an interval is stated only for runs
  that pass the minimum, so it must hold its level among the runs that pass, and the runs of
  strong autocorrelation that pass (their slow stretch spans the whole run, so they look like
  runs of weaker correlation) pass just above it, where nothing the run measured tells them from
  honest runs (selective inference: Fithian, Sun & Taylor 2014, arXiv:1410.2597; Berk et al.
  2013, Ann. Statist. 41(2)). A run whose ``z`` is constant (equal steps) has an interval of zero
  width; steps without tokens have none. Coverage is measured, not assumed: on simulated AR(1)
  step times (tests/test_intervals.py, docs/stability.md) the interval covers the true throughput
  in at least 0.93 of the runs where it is given (0.934-1.000 measured), at autocorrelation 0, 0.5
  and 0.9 over 100 to 1,000 steps and at every autocorrelation that leaves 5 or more independent
  steps (``n (1 - rho) >= 10``). What no run can show, a slow stretch it never entered, is between-run noise (repeats,
  ``report/repeats.py``).
  Deterministic for equal input.
* :func:`verdict` is ``stable`` or ``unstable: <why>`` from the thresholds below; docs/stability.md
  gives their reasons.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

__all__ = ["STALL_FACTOR", "P90_P50_LIMIT", "STALL_SHARE_LIMIT", "CI_HALF_WIDTH_LIMIT", "MIN_STEPS",
           "MIN_EFFECTIVE_STEPS", "Stability", "Interval", "percentile", "autocorrelation", "autocorrelation_time",
           "short_run_tau", "near_minimum_widening", "interval_words", "NEAR_MINIMUM_WIDENING", "NEAR_MINIMUM_END",
           "throughput_intervals", "throughput_interval", "analyse", "verdict", "straggler", "THRESHOLDS_TEXT"]

#: A step longer than this many median steps is a stall (docs/stability.md, "Per run").
STALL_FACTOR = 5.0
#: Unstable when the 90th percentile step is more than this many median steps.
P90_P50_LIMIT = 1.5
#: Unstable when stalls take more than this share of the steady step time.
STALL_SHARE_LIMIT = 0.05
#: Unstable when the 95% interval's half width is more than this share of the mean throughput.
CI_HALF_WIDTH_LIMIT = 0.10
#: Fewer steady steps than this give no interval and an ``unstable`` verdict (too few to tell).
MIN_STEPS = 10
#: Fewer effective (independent) steps than this, ``n / tau``, give no interval (docs/stability.md: the most
#: that still gives one in 90% of the runs at autocorrelation 0.5 over 100 steps and in half at 0.9 over 400).
MIN_EFFECTIVE_STEPS = 20.0
#: At the minimum of effective steps the interval's half width (log scale) is multiplied by this, tapering
#: linearly to 1 at :data:`NEAR_MINIMUM_END` x the minimum (:func:`near_minimum_widening`; measured,
#: docs/stability.md, "Near the minimum": about the least that covers 0.95 of the runs given an interval at
#: every AR(1) autocorrelation that leaves 5 or more independent steps, 100 to 1,000 steps).
NEAR_MINIMUM_WIDENING = 3.2
#: ... and 1 from this many times the minimum (35 effective steps for the minimum of 20).
NEAR_MINIMUM_END = 1.75
#: The correction for the sample mean never more than doubles the long-run variance.
_MAX_MEAN_CORRECTION = 2.0
#: Student's t degrees of freedom are this share of the window's asymptotic ``n / (2M + 1)``: the window
#: is chosen from the same data as the estimate (measured, docs/stability.md: coverage 0.93 at
#: autocorrelation 0.9 over 400 steps with the whole, 0.96 with half).
_DF_FACTOR = 0.5

#: The thresholds in words, for the ``llmeff.stability.method`` tag.
THRESHOLDS_TEXT = (f"stall = step > {STALL_FACTOR:g}x median; unstable when p90/p50 > {P90_P50_LIMIT:g}, "
                   f"stalls > {STALL_SHARE_LIMIT:.0%} of step time, 95% interval half width > "
                   f"{CI_HALF_WIDTH_LIMIT:.0%} of the mean, fewer than {MIN_STEPS} steady steps, or fewer than "
                   f"{MIN_EFFECTIVE_STEPS:g} effective steps (n / integrated autocorrelation time, no interval); "
                   "interval: ratio estimator linearized (delta method), long-run variance over Geyer's initial "
                   "monotone sequence window, Student's t on n/(2(2M+1)) degrees of freedom, log scale; half width x "
                   f"{NEAR_MINIMUM_WIDENING:g} at {MIN_EFFECTIVE_STEPS:g} effective steps, tapering to 1x at "
                   f"{NEAR_MINIMUM_END * MIN_EFFECTIVE_STEPS:g} (docs/stability.md)")


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


def _as_rows(x, name: str):
    import numpy as np

    a = np.asarray(x, dtype=np.float64)
    if a.ndim == 1:
        a = a[None, :]
    if a.ndim != 2:
        raise ValueError(f"{name} has shape {a.shape}; give (n,) steps or (runs, n)")
    return a


def autocorrelation(x):
    """Sample autocovariances and autocorrelations of each row of ``x`` about its own mean.

    ``gamma_h = sum_{t < n-h} (x_t - mean)(x_{t+h} - mean) / n`` (the biased, positive semi-definite
    estimator; Priestley 1981, ch. 5), computed through a zero-padded FFT (Wiener-Khinchin).

    Args:
        x: ``(n,)`` or ``(runs, n)`` values in step order.

    Returns:
        ``(gamma, rho)``, each ``(runs, n)`` for lags ``0 .. n-1``; ``rho = gamma / gamma_0``, and
        ``rho`` is 0 beyond lag 0 for a constant row (``gamma_0 = 0``).
    """
    import numpy as np

    a = _as_rows(x, "x")
    n = a.shape[1]
    c = a - a.mean(axis=1, keepdims=True)
    f = np.fft.rfft(c, n=2 * n, axis=1)
    gamma = np.fft.irfft(f * np.conj(f), n=2 * n, axis=1)[:, :n] / n
    g0 = gamma[:, :1]
    rho = np.where(g0 > 0, gamma / np.where(g0 > 0, g0, 1.0), 0.0)
    rho[:, 0] = 1.0
    return gamma, rho


def autocorrelation_time(rho):
    """Integrated autocorrelation time ``tau = 1 + 2 sum_{h>=1} rho_h`` by Geyer's initial monotone sequence.

    Pairs ``G_k = rho_{2k} + rho_{2k+1}`` (``k = 0 .. n//2 - 1``) are summed up to the first one that
    is not positive, each replaced by the smallest pair before it (Geyer 1992, Statist. Sci. 7(4),
    sec. 3.3): ``tau = -1 + 2 sum_k G_k``. A sum of at most 1 is taken as independent steps,
    ``tau = 1`` over the lag-0 window (no run is credited with more independent steps than steps).

    Args:
        rho: autocorrelations ``(n,)`` or ``(runs, n)``, lag 0 first (:func:`autocorrelation`).

    Returns:
        ``(tau, lag)``: ``(runs,)`` autocorrelation times in steps and ``(runs,)`` ints, the last
        lag ``M`` in the window (``2 K - 1`` for ``K`` pairs summed; 0 for independent steps).
    """
    import numpy as np

    r = _as_rows(rho, "rho")
    m, n = r.shape
    k = n // 2
    if k == 0:
        return np.ones(m), np.zeros(m, dtype=int)
    pairs = r[:, 0:2 * k:2] + r[:, 1:2 * k:2]
    positive = pairs > 0
    first = np.where((~positive).any(axis=1), (~positive).argmax(axis=1), k)  # pairs summed
    mono = np.minimum.accumulate(np.where(positive, pairs, 0.0), axis=1)
    used = np.arange(k)[None, :] < first[:, None]
    tau = -1.0 + 2.0 * np.where(used, mono, 0.0).sum(axis=1)
    independent = tau <= 1.0  # taken as independent steps: the variance alone, one lag
    return np.where(independent, 1.0, tau), np.where(independent, 0, np.maximum(2 * first - 1, 0))


def short_run_tau(rho):
    """Autocorrelation time implied by the first two lags alone: the larger of the AR(1) and ARMA(1,1) values.

    AR(1): ``rho_h = rho_1^h``, ``tau = (1 + rho_1) / (1 - rho_1)``; ARMA(1,1): ``rho_h = rho_1 phi^(h-1)``
    with ``phi = rho_2 / rho_1`` (Box & Jenkins 1976, *Time Series Analysis*, sec. 3.4.1), ``tau = 1 +
    2 rho_1 / (1 - phi)`` (taken where ``rho_1 > 0.3``, and ``phi <= sqrt(rho_1)``: an independent
    run's ``rho_1`` of 0.3 by chance with ``rho_2`` as large would otherwise claim a reach of
    tens of steps; with both limits the interval is given in 100% of simulated independent runs of
    100 steps and in 94.5-96.4% at autocorrelation 0.5, measured over two seeds). Geyer's sum
    (:func:`autocorrelation_time`) cuts a slowly decaying correlation off where the sample
    autocorrelations of a short run (their mean removed) dip to zero, long before the true ones
    do; the first two lags are the best-estimated and say how far the correlation reaches. The
    interval uses the larger of the two times (a guard, not a second method): on simulated AR(1)
    steps at autocorrelation 0.9 over 100 steps it refuses the runs whose Geyer sum saw 3-5
    steps per independent step, where the truth is 19 (docs/stability.md).

    Args:
        rho: autocorrelations ``(n,)`` or ``(runs, n)``, lag 0 first (:func:`autocorrelation`).

    Returns:
        ``(runs,)`` times in steps, at least 1 (``rho_1`` clipped to at most 0.99, ``phi`` to [0, 0.98]
        and at most ``sqrt(rho_1)``).
    """
    import numpy as np

    r = _as_rows(rho, "rho")
    if r.shape[1] < 3:
        return np.ones(r.shape[0])
    r1 = np.clip(r[:, 1], -0.99, 0.99)
    ar1 = (1 + r1) / (1 - r1)
    reach = r1 > 0.3
    phi = np.where(reach, np.clip(r[:, 2] / np.where(reach, r1, 1.0), 0.0, 0.98), 0.0)
    phi = np.minimum(phi, np.sqrt(np.maximum(r1, 0.0)))
    arma = 1 + 2 * np.maximum(r1, 0.0) / (1 - phi)
    return np.maximum(1.0, np.maximum(ar1, arma))


def near_minimum_widening(n_eff, min_effective_steps: float = MIN_EFFECTIVE_STEPS):
    """The factor on the interval's half width (log scale) of a run with ``n_eff`` effective steps.

    ``1 + (NEAR_MINIMUM_WIDENING - 1) (END - n_eff) / (END - min_effective_steps)`` between the minimum
    and ``END = NEAR_MINIMUM_END x min_effective_steps`` (3.2 at 20 effective steps, 1 from 35), the
    same 3.2 below the minimum (where no interval is given), 1 above; 1 everywhere when
    ``min_effective_steps <= 0`` (no run is refused, so none is selected). The reason is selection:
    an interval is stated only for runs with at least ``min_effective_steps``, and a run of strong
    autocorrelation passes that screen exactly when its slow stretch spans the
    whole run and its estimated autocorrelation time comes out a third to a quarter of the truth;
    it then passes just above the minimum, among honest runs that nothing it measured tells it from
    (docs/stability.md, "Near the minimum", measures both; the Neyman-Pearson most powerful test
    between autocorrelation 0.9 and 0.5 over 100 steps still passes 0.05% of the first while
    keeping 90% of the second). The interval must hold its level among the runs that pass
    (selective inference: Fithian, Sun & Taylor 2014, "Optimal inference after model selection",
    arXiv:1410.2597; Berk, Brown, Buja, Zhang & Zhao 2013, "Valid post-selection inference",
    Ann. Statist. 41(2)), so near the screen it is wide. The two constants are measured: about the
    least widening that covers 0.95 of the runs given an interval at every AR(1) autocorrelation
    leaving 5 or more independent steps, over 100 to 1,000 steps (docs/stability.md says how they
    were searched; ``bench/stability.py`` and tests/test_intervals.py check them on other seeds).

    Args:
        n_eff: effective steps, a float or an array.
        min_effective_steps: the minimum that refuses an interval.

    Returns:
        The factor (>= 1), a float or an array of ``n_eff``'s shape.
    """
    import numpy as np

    x = np.asarray(n_eff, dtype=np.float64)
    if min_effective_steps <= 0:
        f = np.ones_like(x)
    else:
        end = NEAR_MINIMUM_END * min_effective_steps
        f = 1.0 + (NEAR_MINIMUM_WIDENING - 1.0) * np.clip((end - x) / (end - min_effective_steps), 0.0, 1.0)
    return float(f) if f.ndim == 0 else f


def throughput_intervals(seconds, tokens, *, level: float = 0.95,
                         min_effective_steps: float = MIN_EFFECTIVE_STEPS) -> dict:
    """Intervals of ``sum(tokens) / sum(seconds)`` for one run or many at once (rows), module docstring's method.

    Args:
        seconds: seconds of each step, ``(n,)`` or ``(runs, n)``, in step order (each row > 0 in total).
        tokens: tokens of each step, the same shape.
        level: coverage in (0, 1).
        min_effective_steps: fewer effective steps than this give no interval (NaN ends).

    Returns:
        Arrays of shape ``(runs,)``: ``mean`` (tokens/s), ``low``, ``high`` (NaN where refused, and
        for a run without tokens),
        ``tau`` (steps), ``n_eff``, ``lag`` (``M``), ``df`` (``nu``), ``widening`` (the factor on the half
        width, :func:`near_minimum_widening`), ``given`` (bool).

    Raises:
        ValueError: for shapes that differ, fewer than 2 steps, a row without time, or a bad ``level``.
    """
    import numpy as np
    from scipy import stats

    s, t = _as_rows(seconds, "seconds"), _as_rows(tokens, "tokens")
    if s.shape != t.shape:
        raise ValueError(f"{s.shape[-1]} step times but {t.shape[-1]} token counts; give one of each per step")
    n = s.shape[1]
    total = s.sum(axis=1)
    if n < 2 or not (total > 0).all():
        raise ValueError("an interval needs at least 2 steps and a positive total time")
    if not 0 < level < 1:
        raise ValueError(f"level={level!r} is not accepted; give a coverage in (0, 1)")
    mean = t.sum(axis=1) / total
    z = t - mean[:, None] * s  # linearized ratio: sums to 0 up to rounding
    gamma, rho = autocorrelation(z)
    # a row whose z is constant up to rounding (equal steps): no variation seen, an interval of zero width
    flat = np.abs(z - z.mean(axis=1, keepdims=True)).max(axis=1) <= 1e-9 * np.abs(t).max(axis=1)
    rho[flat, 1:] = 0.0
    tau, lag = autocorrelation_time(rho)
    tau = np.maximum(tau, short_run_tau(rho))
    n_eff = n / tau
    window = 2 * lag + 1
    correction = np.minimum(1.0 / np.maximum(1.0 - window / n, 1e-12), _MAX_MEAN_CORRECTION)
    sigma2 = np.where(flat, 0.0, gamma[:, 0] * tau * correction)
    df = _DF_FACTOR * n / window
    has_tokens = mean > 0
    rel = (stats.t.ppf(0.5 + level / 2, df) * np.sqrt(sigma2 / n) / (total / n)
           / np.where(has_tokens, mean, 1.0))  # t * se(R) / R
    given = (n_eff >= min_effective_steps) & has_tokens
    widening = near_minimum_widening(n_eff, min_effective_steps)
    rel = rel * widening
    low = np.where(given, mean * np.exp(-rel), np.nan)  # on the log scale: positive, and within 0.2%
    high = np.where(given, mean * np.exp(rel), np.nan)  # of R +- t * se(R) for a half width of 10%
    return {"mean": mean, "low": low, "high": high, "tau": tau, "n_eff": n_eff, "lag": lag, "df": df,
            "widening": widening, "given": given}


@dataclass(frozen=True)
class Interval:
    """The interval of one run's mean throughput and what it rests on (:func:`throughput_interval`).

    Attributes:
        mean: ``sum(tokens) / sum(seconds)``, tokens/s.
        low, high: its 95% (``level``) interval, tokens/s; None when ``n_eff`` is too small.
        steps: steps used; ``tau``: integrated autocorrelation time, steps; ``n_eff``: ``steps / tau``.
        lag: the window's last lag ``M``; ``df``: Student's t degrees of freedom ``steps / (2 (2M + 1))``.
        widening: the factor on the half width near the minimum (:func:`near_minimum_widening`), >= 1.
    """

    mean: float
    low: float | None
    high: float | None
    steps: int
    tau: float
    n_eff: float
    lag: int
    df: float
    widening: float = 1.0


def throughput_interval(seconds: Sequence[float], tokens: Sequence[float], *, level: float = 0.95,
                        min_effective_steps: float = MIN_EFFECTIVE_STEPS) -> Interval:
    """The :class:`Interval` of one run's ``sum(tokens) / sum(seconds)`` (module docstring's method).

    Args:
        seconds: seconds of each step, ``(n,)``, in step order (> 0 in total).
        tokens: tokens of each step, ``(n,)``.
        level: coverage in (0, 1).
        min_effective_steps: fewer effective steps than this give ``low = high = None``.

    Raises:
        ValueError: for lengths that differ, fewer than 2 steps, no time, or a bad ``level``.
    """
    if len(seconds) != len(tokens):
        raise ValueError(f"{len(seconds)} step times but {len(tokens)} token counts; give one of each per step")
    r = throughput_intervals(seconds, tokens, level=level, min_effective_steps=min_effective_steps)
    given = bool(r["given"][0])
    return Interval(mean=float(r["mean"][0]), low=float(r["low"][0]) if given else None,
                    high=float(r["high"][0]) if given else None, steps=len(seconds), tau=float(r["tau"][0]),
                    n_eff=float(r["n_eff"][0]), lag=int(r["lag"][0]), df=float(r["df"][0]),
                    widening=float(r["widening"][0]))


@dataclass(frozen=True)
class Stability:
    """Dispersion of a run's steady-state steps.

    Attributes:
        steps: steady steps analysed.
        mean_step_s, p50_step_s, p90_step_s: mean and percentiles of the step time, s.
        cv: sample standard deviation / mean of the step time; None for one step (undefined).
        stalls: steps longer than :data:`STALL_FACTOR` x the median.
        stall_s: seconds in those steps (kept in the mean).
        total_s: seconds of every steady step.
        tokens_per_sec: sum of tokens / sum of seconds.
        ci95: ``(low, high)`` of ``tokens_per_sec``; None below :data:`MIN_STEPS` steps or
            :data:`MIN_EFFECTIVE_STEPS` effective steps, or without tokens.
        n_eff: effective (independent) steps, ``steps / tau``; None below :data:`MIN_STEPS` steps
            or without tokens.
        tau: integrated autocorrelation time of the linearized throughput, steps; None likewise.
        widening: the factor on the interval's half width near the minimum of effective steps
            (:func:`near_minimum_widening`); None without an interval.
    """

    steps: int
    mean_step_s: float
    p50_step_s: float
    p90_step_s: float
    cv: float | None
    stalls: int
    stall_s: float
    total_s: float
    tokens_per_sec: float
    ci95: tuple[float, float] | None
    n_eff: float | None = None
    tau: float | None = None
    widening: float | None = None


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
    cv = math.sqrt(sum((x - mean) ** 2 for x in seconds) / (n - 1)) / mean if n > 1 else None
    p50 = percentile(seconds, 50)
    long = [x for x in seconds if x > STALL_FACTOR * p50]
    tps = float(sum(tokens)) / total
    ci = n_eff = tau = widening = None
    if n >= MIN_STEPS and tps > 0:
        iv = throughput_interval(seconds, tokens)
        n_eff, tau = iv.n_eff, iv.tau
        if iv.low is not None:
            widening = iv.widening
        if iv.low is not None and iv.low == iv.high:  # equal steps: zero width at the mean
            ci = (tps, tps)
        elif iv.low is not None:  # the same mean summed in another order: keep it inside its own interval
            ci = (min(iv.low, tps), max(iv.high, tps))
    return Stability(steps=n, mean_step_s=mean, p50_step_s=p50, p90_step_s=percentile(seconds, 90), cv=cv,
                     stalls=len(long), stall_s=float(sum(long)), total_s=total, tokens_per_sec=tps, ci95=ci,
                     n_eff=n_eff, tau=tau, widening=widening)


def _g(x: float) -> str:
    return f"{x:.3g}"


def _share_over(x: float, limit: float) -> str:
    """``x`` as a percentage with the fewest decimals (0 to 3) that still show it is over ``limit``
    (a half width of 10.3% against 10% reads ``10.3%``, never ``10%``)."""
    for d in range(4):
        if round(x * 100, d) > limit * 100:
            return f"{x * 100:.{d}f}%"
    return f"{x * 100:.3f}%"


def interval_words(low: float, high: float, mean: float, limit: float = CI_HALF_WIDTH_LIMIT) -> str:
    """An interval as shares of its mean against a half-width ``limit``: ``+-20% of the mean (> 10%``
    when both sides round alike, else ``-50% / +101% of the mean (half width 76% > 10%`` (the
    interval is symmetric on the log scale, so a wide one is lopsided: ``+-76%`` misread [1,338,
    5,422] around 2,693). The bracket is left open for the caller to add to and close."""
    down, up = 1 - low / mean, high / mean - 1
    half = (high - low) / 2 / mean
    if f"{down:.0%}" == f"{up:.0%}":
        return f"+-{_share_over(half, limit)} of the mean (> {limit:.0%}"
    return f"-{down:.0%} / +{up:.0%} of the mean (half width {_share_over(half, limit)} > {limit:.0%}"


def verdict(s: Stability | None) -> str:
    """``stable``, or ``unstable: <why>`` naming every figure past its threshold.

    E.g. ``unstable: 2 stalls = 3.4 s of 4.37 s step time (...); 95% interval +-38% of the mean (> 10%)``,
    ``95% interval -50% / +101% of the mean (half width 76% > 10%)`` for a wide (lopsided) one, or
    ``unstable: too few independent steps (9.9 of 100)`` when no interval could be given.
    """
    if s is None:
        return "unstable: no steady-state step time (no step after warm-up, or none that took time)"
    why = []
    if s.steps < MIN_STEPS:
        why.append(f"only {s.steps} steady step{'' if s.steps == 1 else 's'} (fewer than {MIN_STEPS}: no interval)")
    elif s.ci95 is None and s.n_eff is not None:
        why.append(f"too few independent steps ({s.n_eff:.1f} of {s.steps})")
    ratio = s.p90_step_s / s.p50_step_s if s.p50_step_s > 0 else math.inf
    if ratio > P90_P50_LIMIT:
        why.append(f"p90/p50 step time {_g(ratio)} (> {P90_P50_LIMIT:g})")
    if s.stalls and s.stall_s > STALL_SHARE_LIMIT * s.total_s:
        why.append(f"{s.stalls} stall{'s' if s.stalls > 1 else ''} = {_g(s.stall_s)} s of {_g(s.total_s)} s step time"
                   f" (steps over {STALL_FACTOR:g}x the median step of {_g(s.p50_step_s)} s)")
    if s.ci95 is not None and s.tokens_per_sec > 0:
        half = (s.ci95[1] - s.ci95[0]) / 2 / s.tokens_per_sec
        if half > CI_HALF_WIDTH_LIMIT:
            near = (f"; widened {s.widening:.3g}x: {s.n_eff:.1f} independent steps of {s.steps} is near the "
                    f"minimum of {MIN_EFFECTIVE_STEPS:g}, a longer run has more" if s.widening and s.widening > 1
                    and s.n_eff else "")
            why.append(f"95% interval {interval_words(s.ci95[0], s.ci95[1], s.tokens_per_sec)}{near})")
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
