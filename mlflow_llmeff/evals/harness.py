"""Cross-check: run EleutherAI lm-evaluation-harness 0.4.x on the same model and documents.

Used by the slow cross-check test and ``bench/evals.py``; needs ``pip install lm-eval`` (not a
runtime dependency). The harness's own task YAMLs (``mmlu/default/mmlu_<subject>.yaml``,
``hellaswag/hellaswag.yaml``) are included unchanged; only the dataset is pointed at json files
written from the documents we score (a local directory or the hub; rows in the ``cais/mmlu`` and
``Rowan/hellaswag`` layouts), so prompts,
few-shot sampling and metrics are the harness's, with no hub access.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

from mlflow_llmeff.evals import data
from mlflow_llmeff.evals.api import EvalResult, expand_tasks
from mlflow_llmeff.evals.mmlu import aggregate_acc

__all__ = ["run_harness"]


def _write_tasks(root: Path, scored: Sequence[str], data_dir: str | None) -> None:
    import lm_eval

    tasks_dir = Path(lm_eval.__file__).parent / "tasks"
    for task in scored:
        if task == "hellaswag":
            src = root / "hellaswag_validation.jsonl"
            with open(src, "w", encoding="utf-8") as f:  # from the same source as ours (a directory or the hub)
                for d in data.load_hellaswag(data_dir):
                    f.write(json.dumps(d) + "\n")
            files = {"validation": str(src)}
            base = tasks_dir / "hellaswag" / "hellaswag.yaml"
            extra = "training_split: null\n"
        else:
            subject = task[len("mmlu_"):]
            files = {}
            for split in ("test", "dev"):
                path = root / f"{task}_{split}.jsonl"
                with open(path, "w", encoding="utf-8") as f:
                    for d in data.load_mmlu(data_dir, subject, split):
                        f.write(json.dumps(d) + "\n")
                files[split] = str(path)
            base = tasks_dir / "mmlu" / "default" / f"{task}.yaml"
            extra = ""
        (root / f"{task}.yaml").write_text(
            f"include: {base}\ntask: {task}\ndataset_path: json\ndataset_name: null\n"
            f"dataset_kwargs:\n  data_files: {json.dumps(files)}\n{extra}", encoding="utf-8")


def run_harness(model: Any, tokenizer: Any, tasks: str | Sequence[str], *, data_dir: str | None = None,
                num_fewshot: int = 0, limit: int | None = None, batch_size: int = 8,
                add_bos_token: bool = False, seed: int = 1234) -> EvalResult:
    """Run lm-eval's ``simple_evaluate`` with its HF model wrapper and return an :class:`EvalResult`.

    ``seconds`` covers ``simple_evaluate`` (task building and scoring), not writing the json files.
    ``add_bos_token=False`` matches our encoder for tokenizers without a BOS (ByT5, GPT-2).
    """
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    scored, group = expand_tasks(tasks)
    with tempfile.TemporaryDirectory(prefix="llmeff_harness_") as tmp:
        root = Path(tmp)
        _write_tasks(root, scored, data_dir)
        lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, add_bos_token=add_bos_token,
                  device=str(next(model.parameters()).device))
        tm = TaskManager(include_path=str(root), include_defaults=False)
        t0 = time.perf_counter()
        out = lm_eval.simple_evaluate(model=lm, tasks=list(scored), num_fewshot=num_fewshot, limit=limit,
                                      task_manager=tm, log_samples=True, bootstrap_iters=0, random_seed=seed,
                                      fewshot_random_seed=seed)
        seconds = time.perf_counter() - t0
    metrics: dict[str, float] = {}
    counts: dict[str, int] = {}
    examples: list[dict[str, Any]] = []
    per_subject: dict[str, tuple[float, int]] = {}
    for task in scored:
        res = out["results"][task]
        samples = sorted(out["samples"][task], key=lambda s: s["doc_id"])
        counts[task] = len(samples)
        metrics[f"{task}/acc"] = float(res["acc,none"])
        if task == "hellaswag":
            metrics["hellaswag/acc_norm"] = float(res["acc_norm,none"])
        else:
            per_subject[task] = (metrics[f"{task}/acc"], len(samples))
        for s in samples:
            lls = [float(r[0]) for r in s["filtered_resps"]]
            rec = {"task": task, "doc_index": s["doc_id"], "logliks": lls, "gold": int(s["target"]),
                   "pred": max(range(4), key=lambda i: (lls[i], -i)), "correct": bool(s["acc"])}
            if task == "hellaswag":
                rec["correct_norm"] = bool(s["acc_norm"])
            examples.append(rec)
    if group and per_subject:
        metrics["mmlu/acc"] = aggregate_acc(per_subject)
    return EvalResult(metrics, examples, counts, {"harness": lm_eval.__version__ if hasattr(lm_eval, "__version__")
                                                  else "0.4"}, seconds)
