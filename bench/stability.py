"""How reproducible one configuration's figures are on this machine, and how honest their intervals are.

Two measurements, printed as figures:

1. **Simulation** (seconds, no training): the coverage of the 95% interval of the mean throughput
   (``mlflow_llmeff.calc.stability``) on AR(1) step times with a known true throughput, at
   autocorrelation 0, 0.5 and 0.9 and 100, 400 and 1,000 steps (``--sim-runs`` runs a cell, 100x
   that at 0.9/100 where an interval is rarely given; fixed seeds, the model of
   tests/test_intervals.py): the share of runs given an interval, the coverage where given, and the
   median half width; then the same at 5, 10 and 20 effective steps (``n (1 - rho)`` = 10, 20, 40)
   over 400 and 1,000 steps: the kind of run that passes the minimum only by looking less correlated
   than it is. Targets: coverage >= ``--sim-target`` (0.93) in every cell where at least 100 runs
   are given an interval, and an interval given in every run at autocorrelation 0 from 100 steps,
   in 90% at 0.5 from 100, in half at 0.9 from 400.
2. **Real runs**: the same ``llmeff train`` configuration N times back to back (N >= 5; fresh
   processes, one sqlite store): the spread of the runs' mean throughput
   (``summary/tokens_per_sec``: min, median, max, max/min, coefficient of variation across runs),
   the same for the median-step figure (tokens per step / ``summary/step_time_p50_s``, which a
   stall cannot move), each run's interval and ``llmeff.stability``, and the coverage of one run's
   interval over the repeats: the share of runs whose interval covers the mean of the other runs'
   means (leave-one-out) and the mean of all runs' means. An interval that holds within a run but
   not across runs says the machine's noise between runs is larger than within one: repeats are
   needed to compare configurations (``llmeff compare``). This is a measurement, not a target.

Exits 1 when a simulation target is missed (and says which cell), 0 otherwise.

    python bench/stability.py [--runs 6] [--max-steps 80] [--model llama-tiny]
    python bench/stability.py --quick          # 5 runs of 60 steps (a few minutes on 2 CPU cores)
    python bench/stability.py --sim-only       # the simulation alone (seconds)
    python bench/stability.py --sim-only --frontier   # and the refusal threshold's trade-off (a minute)
    python bench/stability.py --sim-only --regime     # and slow stretches of a machine with two speeds

``--frontier`` also prints, for minimum effective steps of 20 (the product's) to 35, the share of
runs given an interval at autocorrelation 0.5 over 100 steps and 0.9 over 400 (where docs/stability.md,
"What the interval is held to", asks for one), and the share given and its coverage at 0.9 over 100 steps (about 5 independent
steps, where an interval should be refused): a measurement of what any threshold on the estimated
effective sample size can do, not a target. It then prints what the widening near the minimum
(``calc/stability.near_minimum_widening``) buys and costs: coverage, median half width and the
share of runs whose half width passes the 10% stability threshold, with and without it.

``--regime`` prints the coverage on step times that are not AR(1): a machine that is 30% slower in
stretches of 10 to 50 steps (a two-state Markov chain) plus 5% independent noise, where the true
throughput includes the slow stretches. A run that never entered a slow stretch cannot know of it:
a measurement of what no interval from one run can cover (docs/stability.md), not a target.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import subprocess
import sys
import tempfile

CELLS = [(rho, n) for rho in (0.0, 0.5, 0.9) for n in (100, 400, 1000)]
MU, SIGMA, TOKENS = 0.010, 0.1, 1000.0  # the model of tests/test_intervals.py: true throughput TOKENS / MU
#: least share of runs given an interval (docs/stability.md, "What the interval is held to")
GIVEN = {(0.0, 100): 1.0, (0.5, 100): 0.90, (0.9, 400): 0.50}


def simulate(rho: float, n: int, runs: int, varying_tokens: bool, part: int = 0):
    """``runs`` x ``n`` AR(1) step times ``MU (1 + SIGMA e_t) w_t`` (stationary start) and tokens ``TOKENS w_t``,
    ``w_t = 1`` or uniform in [0.5, 1.5]: E[tokens] / E[seconds] = TOKENS / MU. ``part`` > 0 draws another
    block of runs (its own seed) of a cell simulated in blocks."""
    import numpy as np

    rng = np.random.default_rng([int(rho * 10), n, int(varying_tokens), 2026] + ([part] if part else []))
    e = np.empty((runs, n))
    e[:, 0] = rng.standard_normal(runs)
    shocks = rng.standard_normal((runs, n)) * math.sqrt(1 - rho ** 2)
    for t in range(1, n):
        e[:, t] = rho * e[:, t - 1] + shocks[:, t]
    w = rng.uniform(0.5, 1.5, (runs, n)) if varying_tokens else np.ones((runs, n))
    return MU * (1 + SIGMA * e) * w, TOKENS * w


#: cells where an interval is rarely given are simulated with this many times the runs
RARE = {(0.9, 100): 100}
#: effective steps n (1 - rho) / 2 (about n / tau) of the second table, at these lengths
SAME_N_EFF = [(c, n) for c in (10, 20, 40) for n in (400, 1000)]
#: runs for a cell of the second table, per ``--sim-runs`` of 1,000 (few are given where c is small)
SAME_N_EFF_RUNS = {10: 60, 20: 10, 40: 2}
#: least runs given an interval for a coverage to be measured (standard error about 0.02 at 100)
MIN_GIVEN = 100


def blocks(rho: float, n: int, runs: int, varying: bool, block: int = 20_000):
    """The product's intervals (``throughput_intervals``' dict) of ``runs`` simulated runs, one dict per block of
    at most ``block`` runs (memory)."""
    from mlflow_llmeff.calc import stability as st

    for part, start in enumerate(range(0, runs, block)):
        yield st.throughput_intervals(*simulate(rho, n, min(block, runs - start), varying, part))


def intervals(rho: float, n: int, runs: int, varying: bool):
    """``(given, err, rel, widening)`` arrays over ``runs`` simulated runs: ``given`` for every run, and for the
    runs given an interval ``|log(mean / truth)|``, the interval's half width on the log scale (``[mean
    exp(-rel), mean exp(rel)]`` holds the truth exactly when ``err <= rel``) and its widening."""
    import numpy as np

    truth = TOKENS / MU
    out = []
    for r in blocks(rho, n, runs, varying):
        g = r["given"]
        out.append((g, np.abs(np.log(r["mean"][g] / truth)), np.log(r["high"][g] / r["mean"][g]), r["widening"][g]))
    return tuple(np.concatenate(a) for a in zip(*out))


def half_width(rel):
    """The relative half width ``(high - low) / 2 / mean`` of log-scale half widths ``rel``: ``sinh(rel)``, what
    the stability verdict holds against its 10%."""
    import numpy as np

    return np.sinh(rel)


def _row(kind: str, label: str, n: int, runs: int, given, err, rel, target: float, missed: list[str]) -> None:
    import numpy as np

    share, count = float(given.mean()), int(given.sum())
    cover = float(np.mean(err <= rel)) if count else math.nan
    width = float(np.median(half_width(rel))) if count else math.nan
    flag = "" if count >= MIN_GIVEN else f"  (fewer than {MIN_GIVEN} given: too few to measure; raise --sim-runs)"
    if count >= MIN_GIVEN and not cover >= target:
        missed.append(f"{kind} tokens, {label}, {n} steps: coverage {cover:.3f} < {target:g}")
        flag = "  NOT MET"
    print(f"{kind:<9} {label:>24} {n:>6} {runs:>10,} {share:>11.2%} {count:>10,} {cover:>9.3f} {width:>17.1%}{flag}")


def simulation(runs: int, target: float) -> list[str]:
    """Print the simulated coverage tables; returns the cells that miss ``target`` or a least share given."""
    print(f"Simulated coverage of the 95% interval: AR(1) step times of 10 ms +- 10%, {runs:,} simulated runs a "
          f"cell\n({runs * RARE[(0.9, 100)]:,} at autocorrelation 0.9 over 100 steps, where an interval is rarely "
          "given); 'share given' and 'runs given' count the runs that got an interval, 'coverage' the share of "
          "those whose interval holds the true throughput:\n")
    head = (f"{'tokens':<9} {'step times':>24} {'steps':>6} {'runs':>10} {'share given':>11} {'runs given':>10} "
            f"{'coverage':>9} {'median half width':>17}")
    print(head)
    missed: list[str] = []
    for varying in (False, True):
        kind = "varying" if varying else "constant"
        for rho, n in CELLS:
            k = runs * RARE.get((rho, n), 1)
            given, err, rel, _ = intervals(rho, n, k, varying)
            _row(kind, f"autocorrelation {rho:g}", n, k, given, err, rel, target, missed)
            if given.mean() < GIVEN.get((rho, n), 0.0):
                missed.append(f"{kind} tokens, autocorrelation {rho:g}, {n} steps: given in {given.mean():.1%} of "
                              f"runs < {GIVEN[(rho, n)]:.0%}")
                print("  NOT MET: given too rarely")
    print(f"\nThe same effective sample size at other lengths: autocorrelation 1 - c / n leaves about c / 2 "
          f"independent steps in n (c = 10: 0.9 over 100 steps above); {SAME_N_EFF_RUNS[10]}, {SAME_N_EFF_RUNS[20]} "
          f"and {SAME_N_EFF_RUNS[40]} times the runs at c = 10, 20 and 40:\n")
    print(head)
    for varying in (False, True):
        kind = "varying" if varying else "constant"
        for c, n in SAME_N_EFF:
            k = runs * SAME_N_EFF_RUNS[c]
            _row(kind, f"c = {c} (rho {1 - c / n:g})", n, k, *intervals(1 - c / n, n, k, varying)[:3], target, missed)
    print(f"\ntargets: coverage >= {target:g} in every cell (measured where at least {MIN_GIVEN} runs got an "
          "interval, so that a coverage means something; a cell with fewer says so); given in "
          + ", ".join(f"{v:.0%} of runs at autocorrelation {r:g} from {n} steps" for (r, n), v in GIVEN.items()))
    return missed


FRONTIER_THRESHOLDS = (20, 22, 25, 28, 30, 35)


def frontier(runs: int) -> None:
    """Print the trade-off of the refusal threshold (module docstring, ``--frontier``); ``10 x runs`` at 0.9/100."""
    import numpy as np

    from mlflow_llmeff.calc import stability as st

    truth = TOKENS / MU
    print(f"\nRefusal threshold's trade-off (minimum effective steps; {runs} runs at 0.5/100 and 0.9/400, "
          f"{10 * runs} at 0.9/100):\n")
    print(f"{'tokens':<9} {'min n_eff':>9} {'given 0.5/100':>14} {'given 0.9/400':>14} {'given 0.9/100':>14} "
          f"{'coverage 0.9/100':>17}")
    for varying in (False, True):
        data = [simulate(0.5, 100, runs, varying), simulate(0.9, 400, runs, varying),
                simulate(0.9, 100, 10 * runs, varying)]
        for k in FRONTIER_THRESHOLDS:
            res = [st.throughput_intervals(s, t, min_effective_steps=k) for s, t in data]
            g = [float(r["given"].mean()) for r in res]
            r = res[2]
            cover = (r["low"] <= truth) & (truth <= r["high"])
            cov = float(cover[r["given"]].mean()) if r["given"].any() else math.nan
            print(f"{'varying' if varying else 'constant':<9} {k:>9} {g[0]:>14.1%} {g[1]:>14.1%} {g[2]:>14.2%} "
                  f"{cov:>17.3f}")


def widening(runs: int) -> None:
    """Print what the widening near the minimum (``near_minimum_widening``) buys and costs (``--frontier``):
    coverage, median half width and the share of half widths over the 10% stability threshold, with
    the product's interval and with the same half width divided by its widening."""
    import numpy as np

    from mlflow_llmeff.calc import stability as st

    print(f"\nThe widening near the minimum (x{st.NEAR_MINIMUM_WIDENING:g} at "
          f"{st.MIN_EFFECTIVE_STEPS:g} effective steps, tapering to 1x at "
          f"{st.NEAR_MINIMUM_END * st.MIN_EFFECTIVE_STEPS:g}), with and without it:\n")
    print(f"{'tokens':<9} {'cell':>10} {'given':>7} {'coverage':>9} {'without':>8} {'median half width':>18} "
          f"{'without':>8} {'half width > 10%':>17} {'without':>8}")
    for varying in (False, True):
        for rho, n, k in ((0.5, 100, 1), (0.9, 100, RARE[(0.9, 100)]), (0.9, 400, 1), (0.975, 400, 60)):
            g, err, wide, factor = intervals(rho, n, k * runs, varying)
            rel = wide / factor
            row = [float(np.mean(err <= wide)), float(np.mean(err <= rel)), float(np.median(half_width(wide))),
                   float(np.median(half_width(rel))), float(np.mean(half_width(wide) > st.CI_HALF_WIDTH_LIMIT)),
                   float(np.mean(half_width(rel) > st.CI_HALF_WIDTH_LIMIT))]
            print(f"{'varying' if varying else 'constant':<9} {f'{rho:g}/{n}':>10} {g.mean():>7.2%} {row[0]:>9.3f} "
                  f"{row[1]:>8.3f} {row[2]:>18.1%} {row[3]:>8.1%} {row[4]:>17.0%} {row[5]:>8.0%}")


def regime(runs: int) -> None:
    """Print the coverage on a machine with two speeds (module docstring, ``--regime``): a measurement."""
    import numpy as np

    from mlflow_llmeff.calc import stability as st

    print("\nA machine 30% slower in stretches (two-state Markov chain, mean stretch lengths; 5% noise), "
          f"{runs} runs a cell; not AR(1), not a target:\n")
    print(f"{'slow stretch':>12} {'fast stretch':>12} {'steps':>6} {'given':>7} {'coverage':>9} {'no slow step':>13}")
    for slow, fast in ((10, 30), (30, 90)):
        for n in (100, 400, 1000):
            rng = np.random.default_rng([slow, fast, n, 2026])
            enter, leave = 1 / fast, 1 / slow
            busy = np.empty((runs, n), dtype=bool)
            busy[:, 0] = rng.random(runs) < enter / (enter + leave)  # the stationary share of slow steps
            u = rng.random((runs, n))
            for t in range(1, n):
                busy[:, t] = np.where(busy[:, t - 1], u[:, t] >= leave, u[:, t] < enter)
            seconds = MU * (1 + 0.3 * busy + 0.05 * rng.standard_normal((runs, n)))
            truth = TOKENS / (MU * (1 + 0.3 * enter / (enter + leave)))
            r = st.throughput_intervals(seconds, np.full((runs, n), TOKENS))
            g = r["given"]
            cover = float(((r["low"][g] <= truth) & (truth <= r["high"][g])).mean()) if g.any() else math.nan
            print(f"{slow:>12} {fast:>12} {n:>6} {g.mean():>7.1%} {cover:>9.3f} {(~busy.any(axis=1)).mean():>13.1%}")


def real_runs(args) -> None:
    """Run the configuration ``args.runs`` times and print the spread and the coverage over repeats."""
    import mlflow

    from mlflow_llmeff import names

    tmp = tempfile.mkdtemp(prefix="llmeff_stability_")
    uri = f"sqlite:///{tmp}/mlflow.db"
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri, "OMP_NUM_THREADS": "1", "CODECARBON_LOG_LEVEL": "error"}
    cmd = [sys.executable, "-m", "mlflow_llmeff", "train", "--model", args.model, "--max-steps", str(args.max_steps),
           "--seq-len", str(args.seq_len), "--micro-batch-size", str(args.micro_batch_size), "--log-every-n-steps",
           "10", "--experiment-name", "stability-bench"]
    for i in range(args.runs):
        r = subprocess.run(cmd + ["--run-name", f"repeat-{i}"], env=env, cwd=tmp, capture_output=True, text=True)
        if r.returncode != 0:
            raise SystemExit(f"run {i} failed:\n{r.stderr[-3000:]}")
        print(f"run {i}: done", flush=True)

    client = mlflow.MlflowClient(uri)
    exp = client.get_experiment_by_name("stability-bench")
    runs = sorted(client.search_runs([exp.experiment_id]), key=lambda r: r.info.start_time)
    tokens_per_step = args.seq_len * args.micro_batch_size
    rows = []
    for r in runs:
        m, t = r.data.metrics, r.data.tags
        rows.append({"name": r.info.run_name, "tps": m[names.SUM_TOKENS_PER_SEC],
                     "median_step_tps": tokens_per_step / m[names.SUM_STEP_TIME_P50_S],
                     "low": m.get(names.SUM_TPS_CI95_LOW), "high": m.get(names.SUM_TPS_CI95_HIGH),
                     "stall_s": m.get(names.SUM_STALL_S, 0.0), "other_cpu": m.get(names.SUM_HOST_OTHER_CPU),
                     "stability": t.get(names.STABILITY, "?")})

    print(f"\n{args.model}, seq {args.seq_len}, micro-batch {args.micro_batch_size}, {args.max_steps} steps, "
          f"{len(rows)} runs of the same configuration, one after another on this machine:\n")
    print(f"{'run':<10} {'tokens/s':>10} {'95% interval':>23} {'median-step tok/s':>18} {'stall s':>8} "
          f"{'other CPU':>9}  stability")
    for x in rows:
        ci = f"[{x['low']:,.0f}, {x['high']:,.0f}]" if x["low"] is not None else "none"
        other = f"{x['other_cpu']:.0%}" if x["other_cpu"] is not None else "?"
        print(f"{x['name']:<10} {x['tps']:>10,.0f} {ci:>23} {x['median_step_tps']:>18,.0f} {x['stall_s']:>8.2f} "
              f"{other:>9}  {x['stability']}")

    def spread(key: str, label: str) -> None:
        v = [x[key] for x in rows]
        cv = statistics.stdev(v) / statistics.mean(v)
        print(f"{label}: min {min(v):,.0f}, median {statistics.median(v):,.0f}, max {max(v):,.0f}; "
              f"max/min {max(v) / min(v):.3f}; CV across runs {cv:.3f}")

    print()
    spread("tps", "mean tokens/s          ")
    spread("median_step_tps", "median-step tokens/s   ")
    with_ci = [i for i, x in enumerate(rows) if x["low"] is not None]
    grand = statistics.mean(x["tps"] for x in rows)
    loo = sum(rows[i]["low"] <= statistics.mean(y["tps"] for j, y in enumerate(rows) if j != i) <= rows[i]["high"]
              for i in with_ci)
    allm = sum(rows[i]["low"] <= grand <= rows[i]["high"] for i in with_ci)
    k = len(with_ci)
    print(f"runs with an interval: {k} of {len(rows)}")
    if k:
        print(f"coverage over repeats: one run's 95% interval covers the mean of the other runs' means in "
              f"{loo} of {k} runs ({loo / k:.2f}), the mean of all runs' means ({grand:,.0f}) in {allm} of {k} "
              f"({allm / k:.2f})")
    stable = sum(x["stability"] == "stable" for x in rows)
    print(f"runs tagged stable: {stable} of {len(rows)}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=6)
    p.add_argument("--max-steps", type=int, default=80)
    p.add_argument("--model", default="llama-tiny")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--quick", action="store_true", help="5 runs of 60 steps")
    p.add_argument("--sim-only", action="store_true", help="the simulation alone (no training runs)")
    p.add_argument("--sim-runs", type=int, default=1000, help="simulated runs a cell (>= 400)")
    p.add_argument("--sim-target", type=float, default=0.93, help="least coverage in a cell where given")
    p.add_argument("--frontier", action="store_true", help="also the refusal threshold's trade-off (a measurement)")
    p.add_argument("--regime", action="store_true", help="also a machine with two speeds (a measurement)")
    args = p.parse_args()
    if args.quick:
        args.runs, args.max_steps = 5, 60
    if args.runs < 5:
        raise SystemExit("--runs must be >= 5")
    if args.sim_runs < 400:
        raise SystemExit("--sim-runs must be >= 400")

    missed = simulation(args.sim_runs, args.sim_target)
    if args.frontier:
        frontier(args.sim_runs)
        widening(args.sim_runs)
    if args.regime:
        regime(args.sim_runs)
    if not args.sim_only:
        print()
        real_runs(args)
    if missed:
        print("\nNOT MET: " + "; ".join(missed))
        sys.exit(1)
    print("\nmet: the simulation targets")


if __name__ == "__main__":
    main()
