"""The GPU figures against references: ``llmeff train`` beside a bare PyTorch loop of the same model.

A run of ``llmeff train`` (Llama-1B, bf16, synthetic full-length blocks) and a bare loop that trains
the same model the way the entrypoint does (fp32 weights under bf16 autocast, AdamW with betas
(0.9, 0.95), gradient clipping at 1.0, one fixed batch already on the device, no meter, no MLflow),
each in a process of its own, interleaved ``bare, llmeff, bare, ...`` so that the machine's drift
falls on both. The bare loop times its post-warm-up steps between two ``torch.cuda.synchronize``
calls, as the meter does. What is checked, each a line of the output and a target:

* **tokens/s**: ``summary/tokens_per_sec`` of llmeff / the mean of the bare loops around it
  (target >= ``--ratio-target``, default 0.95: the meter, data loading and logging cost at most 5% of
  a GPU step of a 1B model);
* **MFU**: ``summary/mfu`` against a hand computation from the datasheet: llmeff's own tokens/s x
  the FLOPs per token of docs/formulas.md's formula, written out here independently of
  ``mlflow_llmeff.calc.flops`` (``L h^2 (12 + 12 g/n + 18 f/h + 6 s/h) + 6 h V``, Megatron-LM's
  ``num_floating_point_operations`` with causal attention counted once) / the dense bf16 peak of
  the device's datasheet row (``--peak-tflops``, default the H100/H200 SXM 989.4 TFLOP/s of NVIDIA's
  H200 datasheet) (target: within ``--mfu-rel`` = 1%); the bare loop's MFU by the same hand
  formula is printed beside it, and the peak llmeff tagged (``llmeff.peak.tflops``) must be that row.

    python bench/gpu_reference.py [--model llama-1b] [--seq-len 2048] [--micro-batch-size 8]
                                  [--steps 40] [--rounds 1] [--out DIR]

Exits 1 naming each missed target (``NOT MET: ...``), 0 when all are met. On a machine without a GPU
``--device cpu --model llama-tiny --peak-tflops 1`` runs the same comparison as a smoke test of the
script (the CPU figures are no reference of anything).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def flops_per_token(L: int, h: int, n: int, g: int, f: int, V: int, s: float) -> float:
    """Model FLOPs per token of a SwiGLU decoder, docs/formulas.md's ``megatron`` formula (causal once)."""
    return L * h * h * (12 + 12 * g / n + 18 * f / h + 6 * s / h) + 6 * h * V


def bare(args) -> None:
    """One bare contender: prints ``{"tokens_per_sec": ..., "steps": ...}`` as its last line."""
    import torch

    from mlflow_llmeff.models.build import build_model, load_config

    dev = torch.device(args.device)
    torch.manual_seed(0)
    cfg = load_config(args.model)
    model = build_model(args.model, cfg).to(dev)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=1e-4, betas=(0.9, 0.95), eps=1e-8)
    ids = torch.randint(0, min(259, cfg.vocab_size), (args.micro_batch_size, args.seq_len), device=dev)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    amp = torch.autocast(dev.type, dtype=torch.bfloat16) if args.precision == "bf16" else None

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def step():
        if amp is not None:
            with torch.autocast(dev.type, dtype=torch.bfloat16):
                loss = model(**batch).loss
        else:
            loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(args.warmup):
        step()
    sync()
    t0 = time.perf_counter()
    for _ in range(args.steps - args.warmup):
        step()
    sync()
    dt = time.perf_counter() - t0
    tokens = (args.steps - args.warmup) * args.micro_batch_size * args.seq_len
    print(json.dumps({"tokens_per_sec": tokens / dt, "steps": args.steps - args.warmup}))


def _bare_run(args) -> float:
    cmd = [sys.executable, os.path.abspath(__file__), "bare", "--model", args.model, "--seq-len", str(args.seq_len),
           "--micro-batch-size", str(args.micro_batch_size), "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--precision", args.precision, "--device", args.device]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"bare loop failed: {r.stderr[-1500:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])["tokens_per_sec"]


def _llmeff_run(args, uri: str, i: int) -> dict:
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri}
    cmd = [sys.executable, "-m", "mlflow_llmeff", "train", "--model", args.model, "--dataset", "synthetic",
           "--seq-len", str(args.seq_len), "--micro-batch-size", str(args.micro_batch_size),
           "--max-steps", str(args.steps), "--warmup-steps", str(args.warmup), "--log-every-n-steps", "10",
           "--precision", args.precision, "--val-fraction", "0", "--experiment-name", "gpu-reference",
           "--run-name", f"reference-{i}"]
    if args.peak_tflops_given:
        cmd += ["--peak-tflops", str(args.peak_tflops)]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise RuntimeError(f"llmeff train failed: {r.stdout[-800:]} {r.stderr[-1500:]}")
    import mlflow

    client = mlflow.MlflowClient(uri)
    exp = client.get_experiment_by_name("gpu-reference")
    run = client.search_runs([exp.experiment_id], filter_string=f"tags.mlflow.runName = 'reference-{i}'")[0]
    return {"metrics": run.data.metrics, "tags": run.data.tags}


def verdict(*, llmeff_tps: float, bare_tps: list[float], mfu: float | None, peak_tag: str | None,
            fpt: float, peak_tflops: float, ratio_target: float, mfu_rel: float) -> tuple[list[str], list[str]]:
    """``(lines, missed)``: what the comparison found and the targets missed (pure; see the module docstring)."""
    lines, missed = [], []
    ref = statistics.mean(bare_tps)
    ratio = llmeff_tps / ref
    lines.append(f"tokens/s: llmeff {llmeff_tps:,.0f}, bare {', '.join(f'{b:,.0f}' for b in bare_tps)} "
                 f"(mean {ref:,.0f}); ratio {ratio:.4f} (target >= {ratio_target:g}: "
                 f"{'met' if ratio >= ratio_target else 'NOT met'})")
    if ratio < ratio_target:
        missed.append(f"tokens/s ratio {ratio:.4f} < {ratio_target:g}")
    hand = llmeff_tps * fpt / (peak_tflops * 1e12)
    bare_mfu = ref * fpt / (peak_tflops * 1e12)
    if mfu is None:
        lines.append("MFU: summary/mfu absent")
        missed.append("summary/mfu absent")
    else:
        rel = mfu / hand - 1
        ok = abs(rel) <= mfu_rel
        lines.append(f"MFU: summary/mfu {mfu:.4f}; by hand {hand:.4f} ({fpt / 1e9:.4f} GFLOP/token x llmeff's tokens/s "
                     f"/ {peak_tflops:g} TFLOP/s), {100 * rel:+.2f}% (target within {100 * mfu_rel:g}%: "
                     f"{'met' if ok else 'NOT met'}); the bare loop's MFU by hand {bare_mfu:.4f}")
        if not ok:
            missed.append(f"summary/mfu {mfu:.4f} vs {hand:.4f} by hand")
    if peak_tag is not None:
        try:
            same = abs(float(peak_tag) - peak_tflops) < 1e-6
        except ValueError:
            same = False
        lines.append(f"peak: llmeff.peak.tflops {peak_tag} (datasheet {peak_tflops:g}: {'met' if same else 'NOT met'})")
        if not same:
            missed.append(f"llmeff.peak.tflops {peak_tag} != {peak_tflops:g}")
    return lines, missed


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("verb", nargs="?", default="compare", choices=("compare", "bare"))
    p.add_argument("--model", default="llama-1b")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=40, help="optimizer steps per contender, warm-up included")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=1, help="llmeff runs, each between two bare loops")
    p.add_argument("--precision", default="bf16")
    p.add_argument("--device", default="cuda")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="dense peak of the device's datasheet (default 989.4: NVIDIA H100 SXM / H200 bf16)")
    p.add_argument("--ratio-target", type=float, default=0.95)
    p.add_argument("--mfu-rel", type=float, default=0.01)
    p.add_argument("--out", default=os.environ.get("OUT", "gpu_reference_out"))
    args = p.parse_args(argv)
    if args.verb == "bare":
        return bare(args)
    args.peak_tflops_given = args.peak_tflops is not None
    if args.peak_tflops is None:
        args.peak_tflops = 989.4
    os.makedirs(args.out, exist_ok=True)
    uri = f"sqlite:///{os.path.abspath(args.out)}/reference.db"
    from mlflow_llmeff.models.presets import load_config

    c = load_config(args.model)
    fpt = flops_per_token(c.num_hidden_layers, c.hidden_size, c.num_attention_heads,
                          getattr(c, "num_key_value_heads", c.num_attention_heads), c.intermediate_size,
                          c.vocab_size, args.seq_len)
    bares, runs = [_bare_run(args)], []
    for i in range(args.rounds):
        runs.append(_llmeff_run(args, uri, i))
        bares.append(_bare_run(args))
        print(f"round {i + 1}: bare {bares[-2]:,.0f} / {bares[-1]:,.0f} tok/s, llmeff "
              f"{runs[-1]['metrics'].get('summary/tokens_per_sec', float('nan')):,.0f} tok/s", flush=True)
    missed = []
    for i, run in enumerate(runs):
        m, t = run["metrics"], run["tags"]
        lines, miss = verdict(llmeff_tps=m["summary/tokens_per_sec"], bare_tps=bares[i:i + 2],
                              mfu=m.get("summary/mfu"), peak_tag=t.get("llmeff.peak.tflops"), fpt=fpt,
                              peak_tflops=args.peak_tflops, ratio_target=args.ratio_target, mfu_rel=args.mfu_rel)
        print("\n".join(lines))
        print(f"   llmeff: hfu {m.get('summary/hfu')}, mfu_palm {m.get('summary/mfu_palm')}, "
              f"step_time_s {m.get('summary/step_time_s')}, stability {t.get('llmeff.stability')}, "
              f"accelerator {t.get('llmeff.accelerator.name')}, energy {t.get('llmeff.energy.source')}")
        missed += miss
    with open(os.path.join(args.out, "reference.json"), "w") as f:
        json.dump({"bare_tokens_per_sec": bares, "flops_per_token": fpt, "peak_tflops": args.peak_tflops,
                   "runs": runs, "missed": missed}, f, indent=1)
    if missed:
        print("NOT MET: " + "; ".join(missed), file=sys.stderr)
        sys.exit(1)
    print("met: every reference target")


if __name__ == "__main__":
    main()
