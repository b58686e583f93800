"""Fault injection: kill and restart one ``llmeff train`` job N times, and check the product's
reliability figures against the injector's own ledger.

The job (``llmeff train`` with a ``--checkpoint-dir``, one sqlite store) is started, killed at a
random point (seeded) with the kill hooks of ``mlflow_llmeff/train/faults.py`` (SIGKILL right
after a step, ``LLMEFF_FAULT_KILL_AT_STEP``, or inside a step, after its first backward,
``LLMEFF_FAULT_KILL_IN_STEP``), left down for a random time and started again, N times; the last
attempt runs to the end. The injector keeps its own ledger from what it sees, not from the product:

* **failures**: the kills it injected (each attempt must die of SIGKILL, return code -9);
* **down time**: from the moment ``subprocess.run`` of the killed attempt returns to the moment it
  starts the next one (``time.time()`` around its own calls);
* **lost work**: steps redone = the step the attempt had completed when killed (the kill step;
  one less for a kill inside a step) minus the newest complete checkpoint on disk
  (``step_XXXXXXXX/llmeff_state.json``, which is where the next attempt resumes);
* **recovery**: from the kill's return to the next attempt's first completed step, seen as the
  first change of the heartbeat file ``llmeff_progress`` (polled every 20 ms). This covers the
  next attempt's first step whole, where the product's recovery ends at its first *productive*
  step (down + set-up + load + re-warm-up), so the two differ by about one steady step.

Beside it, the product's figures from the MLflow run: ``summary/failures``, ``summary/attempts``,
``summary/badput_down_s``, ``summary/recovery_s`` (a mean over failures), the
``llmeff.reliability.failures`` entries (each failure's step, steps redone, down and recovery).

Pass criteria (exit 1 otherwise, naming what differs): the product's failures equal the injected
kills; one MLflow run (FINISHED); the product's down time per failure within the heartbeat period
plus ``--tolerance`` (default 1.5 s: the SIGKILLed process's exit and the injector's own calls) of
the injector's, and the total within N times that. The heartbeat is written once per step, so its
period is the step time: the product's ``summary/step_time_p90_s``. The product's down time starts
at the last heartbeat, the injector's at the kill's return, so the product's is the longer by the
time from the last completed step to the process's death. Recovery and lost steps are printed
beside each other and checked the same way (recovery: two heartbeat periods, the first step
being in the injector's; lost steps: equal).

    python bench/faults.py                 # N=5 kills, ~5 minutes on 2 CPU cores
    python bench/faults.py --quick         # N=2 kills, short runs (~1.5 minutes)
    python bench/faults.py --kills 8 --seed 3 --max-steps 120

The temporary store and the training log are removed after a pass and kept (the path printed) after a failure.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time

CKPT_RE = re.compile(r"^step_(\d{8})$")
ENTRY_RE = re.compile(r"attempt (\d+): .*? at step (\d+), [\d.]+ s into the job, checkpoint \w+, (\d+) steps redone"
                      r"(?:, down ([\d.]+) s, recovery ([\d.]+) s)?")


def newest_checkpoint(ck: str) -> int:
    """The newest complete checkpoint's step in ``ck`` (0: none): a ``step_XXXXXXXX`` folder holding
    ``llmeff_state.json`` (written last, mlflow_llmeff/train/checkpoint.py)."""
    best = 0
    for name in os.listdir(ck) if os.path.isdir(ck) else ():
        m = CKPT_RE.match(name)
        if m and os.path.exists(os.path.join(ck, name, "llmeff_state.json")):
            best = max(best, int(m.group(1)))
    return best


def heartbeat_mtime(ck: str) -> float | None:
    try:
        return os.stat(os.path.join(ck, "llmeff_progress")).st_mtime
    except OSError:
        return None


def start(cmd: list[str], env: dict, cwd: str, log) -> tuple[subprocess.Popen, float]:
    t = time.time()
    return subprocess.Popen(cmd, env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT), t


def first_beat_after(p: subprocess.Popen, ck: str, before: float | None) -> float | None:
    """Poll the heartbeat file until it changes (the attempt's first completed step); the time seen."""
    while p.poll() is None:
        m = heartbeat_mtime(ck)
        if m is not None and (before is None or m > before):
            return time.time()
        time.sleep(0.02)
    return None


def plan(rng: random.Random, kills: int, max_steps: int, every: int) -> list[tuple[str, int]]:
    """(hook, step) per kill: steps rising, each past the next checkpoint the previous kill left."""
    out, resume = [], 0
    span = (max_steps - 2) // kills
    for k in range(kills):
        lo = max(resume + 2, 2 + k * span)
        hi = max(lo, min(max_steps - 1, 2 + (k + 1) * span - 1))
        step = rng.randint(lo, hi)
        hook = rng.choice(("kill_at_step", "kill_in_step"))
        done = step if hook == "kill_at_step" else step - 1
        resume = done // every * every
        out.append((hook, step))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kills", type=int, default=5, help="failures to inject (N >= 5 by default)")
    ap.add_argument("--max-steps", type=int, default=60)
    ap.add_argument("--checkpoint-every", type=int, default=5)
    ap.add_argument("--down-min", type=float, default=2.0, help="shortest down time, s")
    ap.add_argument("--down-max", type=float, default=8.0, help="longest down time, s")
    ap.add_argument("--seed", type=int, default=29)
    ap.add_argument("--tolerance", type=float, default=1.5, help="s, beyond the heartbeat period")
    ap.add_argument("--model", default="llama-tiny")
    ap.add_argument("--quick", action="store_true", help="N=2 kills, 24 steps, 1-3 s down")
    a = ap.parse_args(argv)
    if a.quick:
        a.kills, a.max_steps, a.checkpoint_every, a.down_min, a.down_max = 2, 24, 4, 1.0, 3.0
    if a.kills < 1 or a.max_steps < 2 * a.kills + 4:
        ap.error(f"--max-steps {a.max_steps} leaves no room for {a.kills} kills")
    rng = random.Random(a.seed)
    kills = plan(rng, a.kills, a.max_steps, a.checkpoint_every)
    downs = [round(rng.uniform(a.down_min, a.down_max), 2) for _ in kills]

    import mlflow

    from mlflow_llmeff import names
    from mlflow_llmeff.train import faults

    tmp = tempfile.mkdtemp(prefix="llmeff-faults-")
    ck = os.path.join(tmp, "ck")
    uri = f"sqlite:///{tmp}/mlflow.db"
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri, "OMP_NUM_THREADS": "1", "CODECARBON_LOG_LEVEL": "error"}
    env.pop("MLFLOW_RUN_ID", None)
    cmd = [sys.executable, "-m", "mlflow_llmeff", "train", "--model", a.model, "--max-steps", str(a.max_steps),
           "--log-every-n-steps", "2", "--seq-len", "32", "--micro-batch-size", "2", "--warmup-steps", "1",
           "--checkpoint-every", str(a.checkpoint_every), "--checkpoint-dir", ck, "--measure-energy", "none",
           "--seed", "3", "--experiment-name", "faults"]
    ledger = []
    log = open(os.path.join(tmp, "train.log"), "ab")
    t_job = time.time()
    print(f"injecting {a.kills} kills into one {a.max_steps}-step job (seed {a.seed}); store {uri}", flush=True)
    for i, ((hook, step), down) in enumerate(zip(kills, downs)):
        before = heartbeat_mtime(ck)
        p, t_start = start(cmd, {**env, faults.ENV[hook]: str(step)}, tmp, log)
        first = first_beat_after(p, ck, before)
        rc = p.wait()
        t_dead = time.time()
        if rc != -9:
            print(f"attempt {i + 1}: expected SIGKILL (-9) at {hook}={step}, got return code {rc}; log {tmp}/train.log")
            return 1
        done = step if hook == "kill_at_step" else step - 1
        ckpt = newest_checkpoint(ck)
        ledger.append({"attempt": i + 1, "hook": hook, "step": done, "ckpt": ckpt, "lost_steps": done - ckpt,
                       "start": t_start, "first_beat": first, "dead": t_dead, "planned_down": down})
        print(f"attempt {i + 1}: {hook}={step}: killed after {t_dead - t_start:.1f} s, checkpoint {ckpt}; "
              f"down {down:.2f} s", flush=True)
        time.sleep(down)
    before = heartbeat_mtime(ck)
    p, t_start = start(cmd, env, tmp, log)
    first = first_beat_after(p, ck, before)
    rc = p.wait()
    t_end = time.time()
    if rc != 0:
        print(f"last attempt: return code {rc}; log {tmp}/train.log")
        return 1
    starts = [row["start"] for row in ledger[1:]] + [t_start]
    firsts = [row["first_beat"] for row in ledger[1:]] + [first]
    for row, nxt, fb in zip(ledger, starts, firsts):
        row["down_s"] = nxt - row["dead"]
        row["recovery_s"] = (fb - row["dead"]) if fb is not None else None

    mlflow.set_tracking_uri(uri)
    client = mlflow.MlflowClient()
    exp = client.get_experiment_by_name("faults")
    runs = client.search_runs([exp.experiment_id])
    problems = []
    if len(runs) != 1:
        problems.append(f"{len(runs)} MLflow runs for one job")
    run = runs[0]
    m, tags = run.data.metrics, run.data.tags
    if run.info.status != "FINISHED":
        problems.append(f"run status {run.info.status}")
    entries = {int(g[0]): g for g in ENTRY_RE.findall(tags.get(names.RELIABILITY_FAILURES, ""))}
    period = m.get(names.SUM_STEP_TIME_P90_S) or m.get(names.SUM_STEP_TIME_S) or 0.0
    allow = period + a.tolerance

    inj_down = sum(r["down_s"] for r in ledger)
    rec = [r["recovery_s"] for r in ledger if r["recovery_s"] is not None]
    inj_rec = sum(rec) / len(rec) if rec else None
    prod_fail, prod_down = int(m.get(names.SUM_FAILURES, -1)), m.get(names.SUM_BADPUT_DOWN_S)
    prod_rec = m.get(names.SUM_RECOVERY_S)

    print(f"\njob: {t_end - t_job:.1f} s at the injector, summary/wall_s {m.get(names.SUM_WALL_S, float('nan')):.1f} s; "
          f"heartbeat period (summary/step_time_p90_s) {period:.3f} s; tolerance {a.tolerance} s\n")
    head = ["failure", "hook", "step (inj/prod)", "steps redone (inj/prod)", "down s (inj/prod)",
            "recovery s (inj/prod)"]
    rows = []
    for r in ledger:
        e = entries.get(r["attempt"])
        p_step, p_lost, p_down, p_rec = (int(e[1]), int(e[2]), float(e[3]) if e[3] else None,
                                         float(e[4]) if e[4] else None) if e else (None, None, None, None)
        fmt = lambda v, d=2: "-" if v is None else f"{v:.{d}f}"  # noqa: E731
        rows.append([str(r["attempt"]), r["hook"], f"{r['step']} / {p_step if p_step is not None else '-'}",
                     f"{r['lost_steps']} / {p_lost if p_lost is not None else '-'}",
                     f"{fmt(r['down_s'])} / {fmt(p_down)}", f"{fmt(r['recovery_s'])} / {fmt(p_rec)}"])
        if e is None:
            problems.append(f"failure {r['attempt']}: not in {names.RELIABILITY_FAILURES}")
            continue
        if p_step != r["step"] or p_lost != r["lost_steps"]:
            problems.append(f"failure {r['attempt']}: step/steps redone {p_step}/{p_lost}, injector {r['step']}/{r['lost_steps']}")
        if p_down is None or abs(p_down - r["down_s"]) > allow:
            problems.append(f"failure {r['attempt']}: down {p_down} s vs injector {r['down_s']:.2f} s (allowed +-{allow:.2f})")
        if p_rec is not None and r["recovery_s"] is not None and abs(p_rec - r["recovery_s"]) > 2 * period + a.tolerance:
            problems.append(f"failure {r['attempt']}: recovery {p_rec} s vs injector {r['recovery_s']:.2f} s")
    widths = [max(len(x[i]) for x in [head] + rows) for i in range(len(head))]
    for line in [head, ["-" * w for w in widths]] + rows:
        print("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip())
    print()
    fmt = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    summary = [("failures", str(len(ledger)), str(prod_fail)),
               ("attempts", str(len(ledger) + 1), str(int(m.get(names.SUM_ATTEMPTS, -1)))),
               ("down time, s (summary/badput_down_s)", fmt(inj_down), fmt(prod_down)),
               ("lost work, steps", str(sum(r["lost_steps"] for r in ledger)),
                str(sum(int(e[2]) for e in entries.values()))),
               ("recovery, s (mean; summary/recovery_s)", fmt(inj_rec), fmt(prod_rec)),
               ("failure cost, s (summary/failure_cost_s)", "-", fmt(m.get(names.SUM_FAILURE_COST_S))),
               ("MTBF, s (summary/mtbf_s)", "-", fmt(m.get(names.SUM_MTBF_S))),
               ("TOR (summary/tor)", "-", fmt(m.get(names.SUM_TOR)))]
    w0 = max(len(s[0]) for s in summary)
    print(f"{'figure'.ljust(w0)}  injector  product")
    for name, inj, prod in summary:
        print(f"{name.ljust(w0)}  {inj.rjust(8)}  {prod.rjust(7)}")
    print(f"\n{names.RELIABILITY}: {tags.get(names.RELIABILITY, '-')}")
    if prod_fail != len(ledger):
        problems.append(f"product counts {prod_fail} failures, the injector {len(ledger)}")
    if prod_down is None or abs(prod_down - inj_down) > len(ledger) * allow:
        problems.append(f"down time {prod_down} s vs injector {inj_down:.2f} s (allowed +-{len(ledger) * allow:.2f})")
    for pr in problems:
        print(f"DIFFERS: {pr}")
    print("PASS: the product's failures, down time and recovery equal the injector's ledger within the "
          "heartbeat period" if not problems else f"FAIL ({len(problems)}); log and store in {tmp}")
    log.close()
    if not problems:  # a failed check keeps the store and the log for a look
        shutil.rmtree(tmp, ignore_errors=True)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
