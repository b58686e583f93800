"""How reproducible one configuration's figures are on this machine, and how honest their intervals are.

Runs the same ``llmeff train`` configuration N times back to back (N >= 5; fresh processes, one
sqlite store) and prints, measured:

* the spread of the runs' mean throughput (``summary/tokens_per_sec``): min, median, max, the
  max/min ratio and the coefficient of variation across runs;
* the same for the median-step figure (tokens per step / ``summary/step_time_p50_s``), which a
  stall cannot move;
* each run's 95% interval (``summary/tokens_per_sec_ci95_*``) and ``llmeff.stability``;
* coverage: how often one run's interval covers the median of the other runs' means (an interval
  that holds within a run but not across runs says the machine's noise between runs is larger
  than within one: repeats are needed to compare configurations, which ``llmeff compare`` does).

    python bench/stability.py [--runs 6] [--max-steps 80] [--model llama-tiny]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=6)
    p.add_argument("--max-steps", type=int, default=80)
    p.add_argument("--model", default="llama-tiny")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--micro-batch-size", type=int, default=8)
    args = p.parse_args()
    if args.runs < 5:
        raise SystemExit("--runs must be >= 5")

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
    covered = total = 0
    for i, x in enumerate(rows):
        if x["low"] is None:
            continue
        others = statistics.median([y["tps"] for j, y in enumerate(rows) if j != i])
        total += 1
        covered += x["low"] <= others <= x["high"]
    print(f"one run's 95% interval covers the median of the other runs' means: {covered} of {total} runs"
          + (f" ({covered / total:.0%})" if total else ""))
    stable = sum(x["stability"] == "stable" for x in rows)
    print(f"runs tagged stable: {stable} of {len(rows)}")


if __name__ == "__main__":
    main()
