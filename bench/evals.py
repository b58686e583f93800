"""Examples/s of mlflow_llmeff.evals vs lm-evaluation-harness 0.4.x on the same model and documents.

    python bench/evals.py --tasks mmlu_anatomy,hellaswag --limit 100 --num-fewshot 0
    python bench/evals.py --model DIR --tasks mmlu --limit 5 --num-fewshot 5 --device cuda

Without --model, a random Llama (byte vocabulary 259 or --vocab, --hidden/--layers) is built in memory. Both
sides score the same documents in the same process, one after the other; the predictions must be
identical (checked, the run fails otherwise). Times: ours = tokenization + scoring; harness
"scoring" = its HFLM.loglikelihood calls (tokenization + scoring), "end-to-end" = simple_evaluate
(task building from local json files too). Needs `pip install lm-eval`.
"""

from __future__ import annotations

import argparse
import os
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF causal LM dir (default: random Llama)")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=259,
                    help="random Llama's vocabulary (>= 259); e.g. 32000 gives a real LM-head/log-softmax cost "
                         "with byte inputs")
    ap.add_argument("--tasks", default="mmlu_anatomy,mmlu_high_school_biology,hellaswag")
    ap.add_argument("--num-fewshot", type=int, default=0)
    ap.add_argument("--limit", type=int, default=50)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import torch
    import transformers
    from lm_eval.models.huggingface import HFLM

    from mlflow_llmeff.evals import evaluate
    from mlflow_llmeff.evals.harness import run_harness

    if args.model:
        model = transformers.AutoModelForCausalLM.from_pretrained(args.model)
        try:
            tok = transformers.AutoTokenizer.from_pretrained(args.model)
        except (OSError, ValueError):
            tok = transformers.ByT5Tokenizer(extra_ids=0)
    else:
        torch.manual_seed(0)
        cfg = transformers.LlamaConfig(vocab_size=max(259, args.vocab), hidden_size=args.hidden,
                                       intermediate_size=4 * args.hidden,
                                       num_hidden_layers=args.layers, num_attention_heads=max(1, args.hidden // 64),
                                       max_position_embeddings=8192)
        model = transformers.LlamaForCausalLM(cfg)
        tok = transformers.ByT5Tokenizer(extra_ids=0)
    model = model.to(args.device).eval()

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
    kw = dict(data_dir=args.data_dir, num_fewshot=args.num_fewshot, limit=args.limit, batch_size=args.batch_size)
    evaluate(model, tok, args.tasks, **dict(kw, limit=2))  # warm-up (allocator, kernels)
    theirs = run_harness(model, tok, args.tasks, **kw)
    ours = evaluate(model, tok, args.tasks, **kw)
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()

    same = [a["pred"] for a in ours.examples] == [b["pred"] for b in theirs.examples]
    n = len(ours.examples)
    diff = max(abs(p - q) for a, b in zip(ours.examples, theirs.examples) for p, q in zip(a["logliks"], b["logliks"]))
    print(f"tasks={args.tasks} num_fewshot={args.num_fewshot} limit={args.limit} batch_size={args.batch_size} "
          f"device={args.device} documents={n} params={sum(p.numel() for p in model.parameters()):,}")
    print(f"{'':<26}{'ours':>12}{'harness':>12}{'ratio':>8}")
    rows = [("scoring examples/s", n / ours.seconds, n / spent["s"]),
            ("end-to-end examples/s", n / ours.seconds, n / theirs.seconds)]
    for name, a, b in rows:
        print(f"{name:<26}{a:>12.1f}{b:>12.1f}{a / b:>7.2f}x")
    print(f"forward positions (ours): {ours.config['forward_tokens']:,}")
    print(f"same predictions: {same}; max |loglik diff| = {diff:.2e} nats")
    for k in sorted(ours.metrics):
        print(f"  {k:<40} ours {ours.metrics[k]:.4f}  harness {theirs.metrics.get(k, float('nan')):.4f}")
    if not same:
        raise SystemExit("predictions differ")


if __name__ == "__main__":
    main()
