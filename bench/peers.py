"""``llmeff train`` beside its peers on one model and data: a bare PyTorch loop, Accelerate, the HF Trainer.

Each contender trains the same preset (``--model``, default llama-tiny) on the same blocks (the synthetic
blocks ``llmeff train --dataset synthetic`` makes: ``prepare_data`` with the same seed, read in the same
order by :func:`mlflow_llmeff.train.batches.micro_batches`) with the same hyper-parameters (AdamW with
decay/no-decay groups, betas (0.9, 0.95), weight decay 0.1, gradient clipping at 1.0, cosine schedule with
5% warm-up, fp32), each in a fresh process of its own, so no contender inherits another's threads, caches or
imports. Each reports its **steady tokens/s**: the tokens of the steps after ``--warmup`` over their seconds.

* ``bare``: the loop a user writes with torch's defaults (``torch.optim.AdamW(groups)``, which on a CPU is
  torch's single-tensor loop, ``clip_grad_norm_``), the blocks held in one in-memory tensor and indexed;
  timed with ``time.perf_counter`` around its steady steps.
* ``accelerate``: ``Accelerator().prepare(model, optimizer)``, ``accelerator.backward`` and
  ``accelerator.clip_grad_norm_``, timed the same way.
* ``trainer``: ``transformers.Trainer`` with its defaults (its default optimizer, its data loader), timed
  by a callback from ``on_step_begin`` of the first steady step to ``on_step_end`` of the last.
* ``llmeff``: ``llmeff train --dataset synthetic`` with its defaults (the meter, codecarbon, MLflow logging
  to a sqlite store), the command line's ``train`` run in the contender's process; its own
  ``summary/tokens_per_sec`` (the steady window; the meter's work at logged steps is booked as ``other``, not
  in a step: bench/overhead.py measures that work directly, and the round's line gives
  ``summary/badput_other_s``, the tokens/s with all of it counted inside the steps, and
  ``window_tokens_per_sec``: the bench's own clock on the bare loop's window, from the end of step
  ``--warmup`` to the end of the last, everything inside).

Each contender also reports the CPU time of its process (every thread, ``time.process_time``) per steady
step over the same window, and its torch threads. CPU time is counted work: on a machine other processes
load, the wall clock of every contender stretches with them, its CPU time far less, so ``bare/llmeff``
CPU ms a step is the comparison to read there (the target is still read from the tokens/s of quiet rounds).
``--threads N`` gives every contender ``OMP_NUM_THREADS=N``; contenders whose threads differ are named.

Contenders run interleaved, ``--rounds`` rounds (the order reversed every other round), and each round's
ratio to that round's bare loop is kept. A round is **contended** when other processes took more than
``--quiet-other`` of the host's CPU during it (``/proc/stat`` ticks less this bench's own and its children's
CPU time: :func:`mlflow_llmeff.meters.contention.host_fractions`, the figure ``system/host_other_cpu``
logs) or the hypervisor stole more than ``--quiet-steal``; its load average is printed beside it. The target
is read from the quiet rounds only: ``median(llmeff / bare) >= --target`` (default 1.00).

    python bench/peers.py [--model llama-tiny] [--seq-len 128] [--micro-batch-size 8] [--steps 60]
                          [--warmup 5] [--rounds 3] [--target 1.0] [--contenders bare,accelerate,trainer,llmeff]
                          [--threads N]

Exits 0 when the target is met, 1 when it is missed, 2 when no round was quiet (the target cannot be read).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

CONTENDERS = ("bare", "accelerate", "trainer", "llmeff")


# ------------------------------------------------------------------------------ the contenders (one process each)
def _setup(args):
    """Model, optimizer groups' parameters, the blocks ``(N, T)`` int64 and this run's micro-batch order."""
    import torch

    from mlflow_llmeff.models.build import build_model, load_config, load_tokenizer
    from mlflow_llmeff.train.batches import micro_batches
    from mlflow_llmeff.train.data import prepare_data

    torch.manual_seed(args.seed)
    cfg = load_config(args.model)
    tok = load_tokenizer(args.model)
    data = prepare_data("synthetic", tok, args.seq_len, packing="true", val_fraction=0.0, seed=args.seed,
                        synthetic_blocks=max(64, 2 * args.micro_batch_size), vocab_size=min(len(tok), cfg.vocab_size))
    blocks = data.train[list(range(len(data.train)))]["input_ids"]  # (N, T), in memory
    order = micro_batches(len(blocks), args.micro_batch_size, args.seed, 0)
    model = build_model(args.model, cfg)
    model.config.use_cache = False
    return model, blocks, order


def _groups(model):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]


def _schedule(opt, steps: int):
    from transformers import get_cosine_schedule_with_warmup

    return get_cosine_schedule_with_warmup(opt, int(0.05 * steps), steps)


def _threads() -> str:
    """This process's torch CPU threads, ``intra N, inter M`` (the ``llmeff.threads`` tag's form)."""
    import torch

    return f"intra {torch.get_num_threads()}, inter {torch.get_num_interop_threads()}"


def _steady(args, seconds: float, cpu_s: float) -> dict:
    """The steady window's figures: tokens/s, and CPU ms a step (this process, every thread: ``time.process_time``)."""
    n = args.steps - args.warmup
    return {"tokens_per_sec": n * args.micro_batch_size * args.seq_len / seconds,
            "cpu_ms_per_step": round(1e3 * cpu_s / n, 3), "threads": _threads()}


def _timed_loop(args, step) -> dict:
    """Run ``step()`` ``args.steps`` times; the steady figures (:func:`_steady`) of those after ``args.warmup``."""
    for _ in range(args.warmup):
        step()
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(args.steps - args.warmup):
        step()
    return _steady(args, time.perf_counter() - t0, time.process_time() - c0)


def run_bare(args) -> dict:
    import torch

    model, blocks, order = _setup(args)
    opt = torch.optim.AdamW(_groups(model), lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
    sched = _schedule(opt, args.steps)
    model.train()

    def step():
        ids = blocks[next(order)]
        loss = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)

    return _timed_loop(args, step)


def run_accelerate(args) -> dict:
    import torch
    from accelerate import Accelerator

    model, blocks, order = _setup(args)
    acc = Accelerator(cpu=not torch.cuda.is_available())
    opt = torch.optim.AdamW(_groups(model), lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
    model, opt = acc.prepare(model, opt)
    sched = _schedule(opt, args.steps)
    model.train()

    def step():
        ids = blocks[next(order)].to(acc.device)
        loss = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids).loss
        acc.backward(loss)
        acc.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)

    return _timed_loop(args, step)


def run_trainer(args) -> dict:
    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments

    model, blocks, order = _setup(args)
    rows = [i for _ in range(args.steps) for i in next(order)]  # the same order, as one sequence of rows

    class Rows(torch.utils.data.Dataset):
        def __len__(self):
            return len(rows)

        def __getitem__(self, i):
            ids = blocks[rows[i]]
            return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}

    clock = {}

    class Steady(TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):
            if state.global_step == args.warmup:
                clock["t0"], clock["c0"] = time.perf_counter(), time.process_time()

        def on_step_end(self, a, state, control, **kw):
            if state.global_step == args.steps:
                clock["t1"], clock["c1"] = time.perf_counter(), time.process_time()

    out = tempfile.mkdtemp()
    targs = TrainingArguments(output_dir=out, max_steps=args.steps, per_device_train_batch_size=args.micro_batch_size,
                              learning_rate=1e-3, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95, adam_epsilon=1e-8,
                              max_grad_norm=1.0, lr_scheduler_type="cosine", warmup_steps=int(0.05 * args.steps),
                              logging_steps=10 ** 6, save_strategy="no", report_to=[], dataloader_num_workers=0,
                              seed=args.seed, disable_tqdm=True, use_cpu=not torch.cuda.is_available())
    sampler = torch.utils.data.SequentialSampler  # the rows are already in the run's order
    trainer = Trainer(model=model, args=targs, train_dataset=Rows(), callbacks=[Steady()])
    trainer._get_train_sampler = lambda *a, **k: sampler(trainer.train_dataset)
    trainer.train()
    return {**_steady(args, clock["t1"] - clock["t0"], clock["c1"] - clock["c0"]),
            "optimizer": type(trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer")
                              else trainer.optimizer).__name__}


def run_llmeff(args) -> dict:
    """``llmeff train`` in this contender's own fresh process (the command line's ``train``, as
    ``python -m mlflow_llmeff train`` runs it: one process trains in the command's own), with the bench's clock
    on the same window as the bare loop's: from the end of step ``--warmup`` to the end of the last step
    (the end of ``EfficiencyMonitor.step``, so the window holds everything the loop and the meter do then,
    the meter's logged steps included)."""
    import contextlib
    import io

    store = tempfile.mkdtemp()
    uri = f"sqlite:///{store}/peers.db"
    os.environ["MLFLOW_TRACKING_URI"] = uri
    import mlflow

    from mlflow_llmeff.cli import main as cli
    from mlflow_llmeff.monitor.meter import EfficiencyMonitor

    clock, step = {"n": 0}, EfficiencyMonitor.step

    def timed_step(self, *a, **k):  # the bench's clock around the meter's own step end
        step(self, *a, **k)
        clock["n"] += 1
        if clock["n"] == args.warmup:
            clock["t0"], clock["c0"] = time.perf_counter(), time.process_time()
        elif clock["n"] == args.steps:
            clock["t1"], clock["c1"] = time.perf_counter(), time.process_time()

    EfficiencyMonitor.step = timed_step
    argv = ["train", "--model", args.model, "--dataset", "synthetic", "--seq-len", str(args.seq_len),
            "--micro-batch-size", str(args.micro_batch_size), "--max-steps", str(args.steps),
            "--warmup-steps", str(args.warmup), "--val-fraction", "0", "--seed", str(args.seed),
            "--experiment-name", "peers", "--run-name", "peers"]
    said = io.StringIO()
    try:
        with contextlib.redirect_stdout(said):  # this contender's last stdout line is its result
            cli(args=argv, prog_name="llmeff", standalone_mode=False)
    except SystemExit as e:
        if e.code not in (0, None):
            raise RuntimeError(f"llmeff train failed ({e.code}): {said.getvalue()[-1500:]}") from None
    finally:
        EfficiencyMonitor.step = step
    window = _steady(args, clock["t1"] - clock["t0"], clock["c1"] - clock["c0"])
    client = mlflow.MlflowClient(uri)
    exp = client.get_experiment_by_name("peers")
    m = client.search_runs([exp.experiment_id])[0].data.metrics
    # the meter's own work at logged steps is booked as badput 'other', outside every step: given beside the
    # figure, with the steady tokens/s it would read were all of it (warm-up edges included) inside the steps
    tokens = (args.steps - args.warmup) * args.micro_batch_size * args.seq_len
    other = m.get("summary/badput_other_s", 0.0)
    return {"tokens_per_sec": m["summary/tokens_per_sec"], "other_s": round(other, 4),
            "with_other_tokens_per_sec": round(tokens / (tokens / m["summary/tokens_per_sec"] + other), 1),
            "window_tokens_per_sec": round(window["tokens_per_sec"], 1),
            "cpu_ms_per_step": window["cpu_ms_per_step"], "threads": window["threads"]}


# ------------------------------------------------------------------------------ the comparison
def verdict(rounds: list[dict], *, target: float, quiet_other: float, quiet_steal: float) -> tuple[list[str], int]:
    """``(lines, exit status)`` of the comparison (pure: tested on injected numbers).

    Args:
        rounds: one mapping per round: ``tps`` (contender -> steady tokens/s, ``bare`` among them),
            ``other`` and ``steal`` (fractions of the host's CPU in [0, 1], None when unread) and ``load``
            (the 1-minute load average at the round's end); optionally ``cpu`` (contender -> CPU ms a steady
            step, every thread of its process) and ``threads`` (contender -> its torch threads, ``intra N,
            inter M``).
        target: the least median ``llmeff / bare`` of the quiet rounds.
        quiet_other, quiet_steal: a round with more of the host's CPU taken by other processes or stolen
            is contended (an unread share counts as contended).

    Returns:
        The lines to print (each round with its ratios and whether it was quiet; each contender's median ratio
        over all rounds and over the quiet ones; where given, each contender's median CPU ms a step and its
        ratio to bare's, a counted figure that other processes move far less than the wall clock, and
        contenders whose threads differ; the verdict) and 0 (met), 1 (missed) or 2 (no quiet round). The
        target is read from the tokens/s only.
    """
    lines, quiet = [], []
    names = [c for c in rounds[0]["tps"] if c != "bare"] if rounds else []
    for i, r in enumerate(rounds, 1):
        other, steal = r.get("other"), r.get("steal")
        calm = other is not None and steal is not None and other <= quiet_other and steal <= quiet_steal
        if calm:
            quiet.append(r)
        share = "unread" if other is None else f"{100 * other:.0f}% others, {100 * (steal or 0):.0f}% steal"
        lines.append(f"round {i} ({'quiet' if calm else 'CONTENDED'}: {share}, load {r.get('load', float('nan')):.2f}): "
                     f"bare {r['tps']['bare']:,.0f} tok/s, "
                     + ", ".join(f"{c} {r['tps'][c]:,.0f} ({r['tps'][c] / r['tps']['bare']:.3f}x)" for c in names))
    for c in names:
        every = statistics.median(r["tps"][c] / r["tps"]["bare"] for r in rounds)
        calm = (f"{statistics.median(r['tps'][c] / r['tps']['bare'] for r in quiet):.3f}x over {len(quiet)} quiet"
                if quiet else "no quiet round")
        lines.append(f"ratio {c}/bare: median {every:.3f}x over {len(rounds)} rounds, {calm}")
    timed = [r for r in rounds if r.get("cpu", {}).get("bare")]
    for c in ["bare", *names] if timed else []:
        has = [r["cpu"][c] for r in timed if r["cpu"].get(c)]
        if has:
            ratio = statistics.median(r["cpu"]["bare"] / r["cpu"][c] for r in timed if r["cpu"].get(c))
            lines.append(f"cpu per steady step {c}: median {statistics.median(has):.2f} ms over {len(has)} rounds"
                         + ("" if c == "bare" else f" (bare/{c} {ratio:.3f}x: above 1, {c} spends less CPU a step)"))
    differ = sorted({f"round {i}: " + ", ".join(f"{c} {v}" for c, v in r["threads"].items())
                     for i, r in enumerate(rounds, 1) if len(set(r.get("threads", {}).values())) > 1})
    lines += [f"threads differ ({d}): the ratios compare unlike settings" for d in differ]
    if "llmeff" not in names:
        lines.append("llmeff was not among the contenders: no target read")
        return lines, 0
    if not quiet:
        lines.append(f"target llmeff/bare >= {target:g}: not resolvable (no quiet round: other processes took more "
                     f"than {100 * quiet_other:g}% of the CPU in every round)")
        return lines, 2
    med = statistics.median(r["tps"]["llmeff"] / r["tps"]["bare"] for r in quiet)
    ok = med >= target
    lines.append(f"target llmeff/bare >= {target:g} in the median of {len(quiet)} quiet rounds: {med:.3f}x "
                 f"{'met' if ok else 'NOT met'}")
    return lines, 0 if ok else 1


def _contender(args, name: str) -> dict:
    """Run one contender in a fresh process; its result mapping."""
    cmd = [sys.executable, os.path.abspath(__file__), "--run", name, "--model", args.model, "--seq-len",
           str(args.seq_len), "--micro-batch-size", str(args.micro_batch_size), "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--seed", str(args.seed)]
    env = dict(os.environ)
    if args.threads:  # every contender the same intra-op threads (torch reads OMP_NUM_THREADS at start)
        env.update(OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads))
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise RuntimeError(f"contender {name} failed: {r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def _cpu_s() -> float:
    """CPU seconds of this process and its waited-for children (every contender ran as one)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def _round(args, order: list[str]) -> dict:
    from mlflow_llmeff.meters import contention as ct

    host0, own0 = ct.read_host_cpu(), _cpu_s()
    tps, cpu, threads, extra = {}, {}, {}, {}
    for name in order:
        res = _contender(args, name)
        tps[name] = res.pop("tokens_per_sec")
        if "cpu_ms_per_step" in res:
            cpu[name] = res.pop("cpu_ms_per_step")
        if "threads" in res:
            threads[name] = res.pop("threads")
        extra.update({f"{name}.{k}": v for k, v in res.items()})
    host1, own1 = ct.read_host_cpu(), _cpu_s()
    fr = ct.host_fractions(host0, host1, own1 - own0) if host0 and host1 else None
    return {"tps": {c: tps[c] for c in args.contenders}, "other": fr[0] if fr else None,
            "steal": fr[1] if fr else None, "load": os.getloadavg()[0], "extra": extra,
            "cpu": {c: cpu[c] for c in args.contenders if c in cpu},
            "threads": {c: threads[c] for c in args.contenders if c in threads}}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama-tiny")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=60, help="optimizer steps per contender, warm-up included")
    p.add_argument("--warmup", type=int, default=5, help="first steps left out of the steady tokens/s")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--target", type=float, default=1.0, help="least median llmeff/bare of the quiet rounds")
    p.add_argument("--quiet-other", type=float, default=0.10,
                   help="a round where other processes took more of the host's CPU than this is contended")
    p.add_argument("--quiet-steal", type=float, default=0.02)
    p.add_argument("--contenders", default=",".join(CONTENDERS))
    p.add_argument("--threads", type=int, default=0,
                   help="torch intra-op threads of every contender (OMP_NUM_THREADS); 0: torch's default")
    p.add_argument("--run", choices=CONTENDERS, help=argparse.SUPPRESS)  # one contender, in this process
    args = p.parse_args(argv)
    if args.warmup >= args.steps:
        p.error(f"--warmup {args.warmup} leaves no steady step of --steps {args.steps}")
    if args.run:
        print(json.dumps(globals()[f"run_{args.run}"](args)))
        return
    args.contenders = [c.strip() for c in args.contenders.split(",") if c.strip()]
    bad = [c for c in args.contenders if c not in CONTENDERS]
    if bad or "bare" not in args.contenders:
        p.error(f"--contenders {','.join(args.contenders)}: give bare and any of {', '.join(CONTENDERS[1:])}")
    rounds = []
    for r in range(args.rounds):
        order = args.contenders if r % 2 == 0 else args.contenders[::-1]
        rounds.append(_round(args, order))
        print(f"round {r + 1} done: " + ", ".join(f"{c} {v:,.0f} tok/s" for c, v in rounds[-1]["tps"].items())
              + f"; cpu ms/step {rounds[-1]['cpu']}; threads {rounds[-1]['threads']}"
              + (f" ({', '.join(f'{k} {v}' for k, v in rounds[-1]['extra'].items())})" if rounds[-1]["extra"] else ""),
              flush=True)
    lines, status = verdict(rounds, target=args.target, quiet_other=args.quiet_other, quiet_steal=args.quiet_steal)
    print("\n".join(lines))
    sys.exit(status)


if __name__ == "__main__":
    main()
