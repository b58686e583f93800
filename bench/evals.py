"""Examples/s of mlflow_llmeff.evals vs lm-evaluation-harness 0.4.x on the same model and documents, per task.

    python bench/evals.py --tasks mmlu_anatomy,mmlu_high_school_biology,hellaswag --limit 60 --vocabs 259,32000
    python bench/evals.py --model DIR --tasks mmlu --limit 5 --num-fewshot 5 --device cuda

Without --model, a random Llama (--hidden/--layers) is built in memory for each vocabulary of --vocabs
(259 = the byte vocabulary; 32000 gives a real LM-head / log-softmax cost with the same byte inputs).
Each task (hellaswag; the MMLU subjects listed, together) is scored by both sides in the same
process, --rounds times, interleaved with the order alternating (this machine's speed drifts); the
ratio printed is the median of the rounds' ratios, each round's listed beside it. The predictions must
be identical (checked every round, the run fails otherwise).
Times: ours = tokenization + scoring; harness = its HFLM.loglikelihood calls (tokenization +
scoring). "positions/doc" = input positions the model actually runs per document (padding
included), counted by a forward pre-hook on the model for both sides ("-" for ours when it scored in worker processes,
which the hook in this process does not see). HellaSwag is scored 0-shot.
Documents come from --data-dir, else $LLMEFF_DATA_DIR, else the hub (cais/mmlu, Rowan/hellaswag).
Needs `pip install lm-eval`.

Under load (``--hogs N``, e.g. 2): N busy-loop processes (pure Python, :data:`HOG`) run beside both sides in
half of the rounds. Each round runs both conditions (quiet, then hogs; the order alternating between
rounds) and in each both sides (their order alternating too). Each side's slowdown = median of its hog
rounds' seconds / median of its quiet rounds'; printed with each round's load average (1 min), the
threads and worker processes our side used (and how their count moved: ``evals.threads.WorkerCount``),
and both sides' median seconds (the lead in absolute terms).
The hogs are children of this process, in its session (Linux's autogroup, when on, shares CPU time
between sessions and then between the runnable threads of one): beside two hogs, one thread gets a
third of the session's CPU time, two processes half. The run exits 1 unless our slowdown <= lm-eval's for every task (and, as
always, when predictions differ); the speed targets below are not checked in this mode.

    python bench/evals.py --tasks hellaswag --limit 1000 --vocabs 32000 --hogs 2 --rounds 3

Targets (docs/evals.md, "Cross-check and speed"): HellaSwag 1.8x with the byte vocabulary (259) and
2.5x with 32000; few-shot MMLU 3x at either. 0-shot MMLU and a --model have none (printed so).
The script exits 1 naming every missed target (``target NOT met``), as when predictions differ;
``--target R`` puts one ratio in place of every target (a check of the check: ``--target 100``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

#: Median speed-up targets over the harness: (task group, vocabulary) -> ratio; MMLU only few-shot
#: (docs/evals.md, "Cross-check and speed").
TARGETS = {("hellaswag", 259): 1.8, ("hellaswag", 32000): 2.5, ("mmlu", 259): 3.0, ("mmlu", 32000): 3.0}


def target_for(label: str, vocab: int | None, shots: int, override: float | None = None) -> float | None:
    """The median ratio ``label`` (``hellaswag``, or an MMLU group or subject) must reach with
    ``vocab`` and ``shots``; None where there is none (0-shot MMLU, a model of its own, another
    vocabulary), unless ``override`` puts one ratio in place of every target."""
    if override is not None:
        return override
    if vocab is None:
        return None
    group = "hellaswag" if label == "hellaswag" else "mmlu"
    if group == "mmlu" and shots == 0:
        return None
    return TARGETS.get((group, vocab))


def missed_targets(rows: list[tuple[str, int | None, int, float]], override: float | None = None) -> list[str]:
    """``'<label> vocab <v>: <ratio>x < <target>x'`` for each ``(label, vocab, shots, median ratio)``
    below its :func:`target_for`."""
    out = []
    for label, vocab, shots, ratio in rows:
        target = target_for(label, vocab, shots, override)
        if target is not None and ratio < target:
            out.append(f"{label} vocab {vocab if vocab else 'model'}: {ratio:.2f}x < {target:g}x")
    return out


def slowdowns(quiet: list[float], loaded: list[float]) -> float:
    """A side's slowdown under load: median of its loaded rounds' seconds / median of its quiet rounds'."""
    if not quiet or not loaded:
        raise ValueError(f"rounds quiet={quiet} loaded={loaded}: both need at least one round")
    return statistics.median(loaded) / statistics.median(quiet)


def slower_than_theirs(rows: list[tuple[str, int | None, float, float]]) -> list[str]:
    """``'<label> vocab <v>: ours <a>x > lm-eval <b>x'`` for each ``(label, vocab, our slowdown,
    lm-eval's slowdown)`` where ours is the larger (the ``--hogs`` check)."""
    return [f"{label} vocab {vocab if vocab else 'model'}: ours {a:.2f}x > lm-eval {b:.2f}x"
            for label, vocab, a, b in rows if a > b]


#: A CPU hog: a pure-Python busy loop that ends by itself once its parent is gone (a killed bench leaves none).
HOG = "import os\np = os.getppid()\nwhile os.getppid() == p:\n    for _ in range(1_000_000):\n        pass\n"


class Hogs:
    """``n`` busy-loop processes (:data:`HOG`), started and ended by their ids."""

    def __init__(self, n: int) -> None:
        self.n, self.procs = n, []

    def __enter__(self) -> "Hogs":
        import subprocess

        self.procs = [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(self.n)]
        time.sleep(0.2)  # let them reach the loop
        return self

    def __exit__(self, *exc) -> None:
        for p in self.procs:
            p.kill()
        for p in self.procs:
            p.wait()
        self.procs = []


def _per_doc(positions: int, docs: int) -> str:
    """Positions per document as printed: ``-`` where the hook saw none (our side scored in worker
    processes, which this process's hook does not see), never a 0 that was not measured."""
    return f"{positions / docs:.0f}" if positions else "-"


def _positions_counter(model):
    """A forward pre-hook counting the input positions of every call of the model's decoder (both
    sides run it: the harness through the model, our scorer also directly, see
    ``LoglikelihoodScorer._head_split``); returns (counter, handle)."""
    count = {"n": 0}
    model = model.get_decoder() if hasattr(model, "get_decoder") and model.get_decoder() is not None else model

    def hook(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not None:
            count["n"] += int(ids.numel())

    return count, model.register_forward_pre_hook(hook, with_kwargs=True)


def _build(args, vocab):
    import torch
    import transformers

    if args.model:
        model = transformers.AutoModelForCausalLM.from_pretrained(args.model)
        try:
            tok = transformers.AutoTokenizer.from_pretrained(args.model)
        except (OSError, ValueError):
            tok = transformers.ByT5Tokenizer(extra_ids=0)
    else:
        torch.manual_seed(0)
        cfg = transformers.LlamaConfig(vocab_size=max(259, vocab), hidden_size=args.hidden,
                                       intermediate_size=4 * args.hidden, num_hidden_layers=args.layers,
                                       num_attention_heads=max(1, args.hidden // 64), max_position_embeddings=8192)
        model = transformers.LlamaForCausalLM(cfg)
        tok = transformers.ByT5Tokenizer(extra_ids=0)
    return model.to(args.device).eval(), tok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF causal LM dir (default: random Llama)")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocabs", default="259,32000",
                    help="random Llama vocabularies, comma-separated (>= 259; ignored with --model)")
    ap.add_argument("--tasks", default="mmlu_anatomy,mmlu_high_school_biology,hellaswag")
    ap.add_argument("--num-fewshot", type=int, default=0, help="MMLU few-shot examples (HellaSwag: 0)")
    ap.add_argument("--limit", type=int, default=50)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rounds", type=int, default=3,
                    help="interleaved rounds of both sides (order alternating); the median ratio is printed")
    ap.add_argument("--hogs", type=int, default=0,
                    help="busy-loop processes beside both sides in alternate rounds; checks slowdowns (docstring)")
    ap.add_argument("--target", type=float, default=None,
                    help="one median ratio in place of every target (default: the targets of the docstring)")
    args = ap.parse_args()
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import torch
    from lm_eval.models.huggingface import HFLM

    from mlflow_llmeff.evals import evaluate
    from mlflow_llmeff.evals.harness import run_harness

    spent = {"s": 0.0}
    original = HFLM.loglikelihood

    def timed(self, requests, *a, **k):
        t = time.perf_counter()
        try:
            return original(self, requests, *a, **k)
        finally:
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            spent["s"] += time.perf_counter() - t

    HFLM.loglikelihood = timed
    names = [t.strip() for t in args.tasks.split(",") if t.strip()]
    groups = [(t, [t], 0) for t in names if t == "hellaswag"]
    mmlu = [t for t in names if t != "hellaswag"]
    if mmlu:
        groups.insert(0, ("mmlu" if len(mmlu) > 1 else mmlu[0], mmlu, args.num_fewshot))
    vocabs = [None] if args.model else [int(v) for v in args.vocabs.split(",")]
    failed, rows, slow = [], [], []
    for vocab in vocabs:
        model, tok = _build(args, vocab)
        params = sum(p.numel() for p in model.parameters())
        print(f"\nmodel: {'random Llama, vocab ' + str(vocab) if vocab else args.model}, {params:,} params; "
              f"limit={args.limit} batch_size={args.batch_size} device={args.device}")
        print(f"{'task':<12}{'shots':>6}{'docs':>6}{'ours ex/s':>11}{'harness':>9}{'ratio':>8}"
              f"{'pos/doc ours':>14}{'harness':>9}{'same preds':>12}")
        for label, tasks, shots in groups:
            kw = dict(data_dir=args.data_dir, num_fewshot=shots, limit=args.limit, batch_size=args.batch_size)
            evaluate(model, tok, tasks, **dict(kw, limit=2))  # warm-up (allocator, kernels)
            count, handle = _positions_counter(model)
            ours_s, theirs_s, pos, same = [], [], {}, True
            loaded = {"ours": [], "harness": []}  # --hogs: seconds of the rounds with hogs
            conditions = (0, args.hogs) if args.hogs else (0,)
            for r in range(args.rounds):  # interleaved, the order alternating: the machine's drift hits both
                for hogs in (conditions if r % 2 == 0 else conditions[::-1]):
                    with Hogs(hogs):
                        load = os.getloadavg()[0]
                        for side in (("harness", "ours") if r % 2 == 0 else ("ours", "harness")):
                            count["n"], spent["s"] = 0, 0.0
                            if side == "harness":
                                theirs = run_harness(model, tok, tasks, **kw)
                                (loaded["harness"] if hogs else theirs_s).append(spent["s"])
                            else:
                                ours = evaluate(model, tok, tasks, **kw)
                                (loaded["ours"] if hogs else ours_s).append(ours.seconds)
                            if args.device.startswith("cuda"):
                                torch.cuda.synchronize()
                            pos[side] = count["n"]
                    if args.hogs:
                        print(f"  round {r + 1} {'hogs ' + str(hogs) if hogs else 'quiet  '}: load {load:5.1f}  "
                              f"ours {(loaded['ours'] if hogs else ours_s)[-1]:7.2f} s  "
                              f"lm-eval {(loaded['harness'] if hogs else theirs_s)[-1]:7.2f} s  "
                              f"threads {ours.config.get('llmeff.threads', '-')}, "
                              f"workers {ours.config.get('llmeff.eval.workers', '-')}"
                              f"{' (' + ours.config['llmeff.eval.worker_count'] + ')' if 'llmeff.eval.worker_count' in ours.config else ''}",
                              flush=True)
                    same = same and [a["pred"] for a in ours.examples] == [b["pred"] for b in theirs.examples]
                    if "hellaswag" in tasks:  # acc_norm's prediction too (the harness records whether it was right)
                        same = same and ([a["correct_norm"] for a in ours.examples]
                                         == [b["correct_norm"] for b in theirs.examples])
            handle.remove()
            if args.hogs:
                mine, theirs_x = slowdowns(ours_s, loaded["ours"]), slowdowns(theirs_s, loaded["harness"])
                under = statistics.median(loaded["harness"]) / statistics.median(loaded["ours"])
                print(f"{label}: slowdown under {args.hogs} hogs: ours {mine:.2f}x, lm-eval {theirs_x:.2f}x; "
                      f"median s quiet / hogs: ours {statistics.median(ours_s):.2f} / "
                      f"{statistics.median(loaded['ours']):.2f}, lm-eval {statistics.median(theirs_s):.2f} / "
                      f"{statistics.median(loaded['harness']):.2f}; lm-eval / ours quiet "
                      f"{statistics.median(theirs_s) / statistics.median(ours_s):.2f}x, "
                      f"under hogs {under:.2f}x; same preds {same}")
                slow.append((label, vocab, mine, theirs_x))
            n = len(ours.examples)
            ratios = sorted(t / o for t, o in zip(theirs_s, ours_s))
            a, b = n / statistics.median(ours_s), n / statistics.median(theirs_s)
            target = target_for(label, vocab, shots, args.target)
            print(f"{label:<12}{shots:>6}{n:>6}{a:>11.1f}{b:>9.1f}{statistics.median(ratios):>7.2f}x"
                  f"{_per_doc(pos['ours'], n):>14}{_per_doc(pos['harness'], n):>9}{str(same):>12}"
                  f"   rounds: {' '.join(f'{x:.2f}' for x in ratios)}"
                  f"   target: {f'{target:g}x' if target is not None else 'none'}")
            rows.append((label, vocab, shots, statistics.median(ratios)))
            if not same:
                failed.append((vocab, label))
    missed = missed_targets(rows, args.target) if not args.hogs else slower_than_theirs(slow)
    if args.hogs:
        print(f"load average now: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
        if missed:
            print(f"slowdown NOT within lm-eval's: {'; '.join(missed)}", file=sys.stderr)
        else:
            print("our slowdown <= lm-eval's for every task")
    elif missed:
        print(f"target NOT met: {'; '.join(missed)}", file=sys.stderr)
    else:
        print("targets met" if any(target_for(*r[:3], args.target) is not None for r in rows) else "no target applies")
    if failed:
        print(f"predictions differ: {failed}", file=sys.stderr)
    if missed or failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
