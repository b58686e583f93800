"""``evaluate()``: MMLU and HellaSwag accuracies of a causal LM, plus logging them to MLflow."""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

from mlflow_llmeff import names
from mlflow_llmeff.evals import data, hellaswag, mmlu

__all__ = ["EvalResult", "TASK_NAMES", "check_inputs", "evaluate", "expand_tasks", "log_to_mlflow", "mlflow_metrics"]

TASK_NAMES = ("mmlu", "hellaswag") + tuple(f"mmlu_{s}" for s in data.MMLU_SUBJECTS)
# the keys docs/metrics.md lists; other metrics are logged as "eval/<metric>"
#: ``EvalResult.config`` key: the worker processes that scored (1: this process; :mod:`.workers`)
EVAL_WORKERS = "llmeff.eval.workers"
#: ``EvalResult.config`` key: how the worker count moved while scoring (:class:`.threads.WorkerCount`)
EVAL_WORKER_COUNT = "llmeff.eval.worker_count"
_STANDARD_KEYS = {"mmlu/acc": names.EVAL_MMLU_ACC, "hellaswag/acc": names.EVAL_HELLASWAG_ACC,
                  "hellaswag/acc_norm": names.EVAL_HELLASWAG_ACC_NORM}


@dataclass
class EvalResult:
    """Outcome of :func:`evaluate`.

    Attributes:
        metrics: ``{"mmlu/acc", "mmlu_<subject>/acc", "hellaswag/acc", "hellaswag/acc_norm"}`` as
            fractions in [0, 1] (only those of the tasks asked for).
        examples: one record per scored document: ``task``, ``doc_index`` (in the file, 0-based),
            ``logliks`` (per choice, nats), ``gold``, ``pred``, ``correct``; HellaSwag also
            ``pred_norm``, ``correct_norm``.
        counts: documents scored per task (``mmlu_<subject>``, ``hellaswag``).
        config: the settings used (tasks, num_fewshot, limit, batch_size, ...).
        seconds: wall time of tokenization and scoring, data loading excluded (s).
    """

    metrics: dict[str, float]
    examples: list[dict[str, Any]]
    counts: dict[str, int]
    config: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def examples_per_sec(self) -> float:
        """Scored documents per second of :attr:`seconds`."""
        return len(self.examples) / self.seconds if self.seconds > 0 else float("nan")

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict: metrics, counts, config, seconds, examples."""
        return asdict(self)

    def count(self, key: str) -> int:
        """Documents behind metric ``key``: its task's (``mmlu/acc``: every subject's together)."""
        task = key.split("/")[0]
        return (sum(v for t, v in self.counts.items() if t.startswith("mmlu_")) if task == "mmlu"
                else self.counts.get(task, 0))

    def interval(self, key: str) -> tuple[float, float] | None:
        """The 95% Wilson score interval of accuracy ``key`` over its :meth:`count` documents (each scored right
        or wrong; ``mmlu/acc`` is the size-weighted mean of its subjects, so all its documents' share right);
        None without documents. Source: Wilson (1927), "Probable inference, the law of succession, and
        statistical inference", JASA 22:209-212, through ``scipy.stats.binomtest(...).proportion_ci``; a
        trial found the accuracies printed with 4 decimals and no interval (lm-eval prints a standard error).
        """
        from scipy.stats import binomtest

        n = self.count(key)
        if n <= 0 or key not in self.metrics:
            return None
        ci = binomtest(round(self.metrics[key] * n), n).proportion_ci(confidence_level=0.95, method="wilson")
        return float(ci.low), float(ci.high)

    def table(self) -> str:
        """Plain-text table of the metrics (aggregates first, then subjects), each with its 95% interval
        (:meth:`interval`) and its number of documents."""
        keys = sorted(self.metrics, key=lambda k: (k.startswith("mmlu_"), k))
        width = max([len(k) for k in keys] + [6])
        lines = [f"{'metric':<{width}}  value   95% interval (Wilson)  n", f"{'-' * width}  ------  {'-' * 21}  -----"]
        for k in keys:
            ci = self.interval(k)
            shown = f"[{ci[0]:.4f}, {ci[1]:.4f}]" if ci else "-"
            lines.append(f"{k:<{width}}  {self.metrics[k]:.4f}  {shown:<21}  {self.count(k)}")
        return "\n".join(lines)


def expand_tasks(tasks: str | Sequence[str]) -> tuple[list[str], bool]:
    """Task names -> (scored tasks: ``mmlu_<subject>``/``hellaswag``, whether the ``mmlu`` group was asked).

    Raises:
        ValueError: for an unknown task name, listing the accepted ones.
    """
    if isinstance(tasks, str):
        tasks = [t for t in tasks.split(",")]
    out: list[str] = []
    group = False
    for raw in tasks:
        t = raw.strip()
        if t == "mmlu":
            group = True
            out += [f"mmlu_{s}" for s in data.MMLU_SUBJECTS]
        elif t in TASK_NAMES:
            out.append(t)
        else:
            raise ValueError(f"task {raw!r} is not accepted; use mmlu, hellaswag or mmlu_<subject> with subject one of "
                             f"{', '.join(data.MMLU_SUBJECTS)}")
    if not out:
        raise ValueError("tasks [] is empty; use mmlu, hellaswag or mmlu_<subject>")
    return list(dict.fromkeys(out)), group


def check_inputs(tasks: str | Sequence[str], *, data_dir: str | None = None, num_fewshot: int = 0) -> None:
    """Check task names, ``num_fewshot`` and that the data files exist, without reading them.

    Cheap enough to run before a model is loaded or a training run starts.

    Raises:
        ValueError: one line naming the bad task, value or missing file (and where data is looked for).
    """
    import os

    scored, _ = expand_tasks(tasks)
    if not 0 <= num_fewshot <= 5:
        raise ValueError(f"num_fewshot {num_fewshot} is not accepted; use 0-5 (MMLU has 5 dev examples per subject)")
    if num_fewshot and "hellaswag" in scored:
        raise ValueError(f"num_fewshot {num_fewshot} applies to every task, but HellaSwag is scored 0-shot only here "
                         f"(its few-shot examples come from a training split); score hellaswag in a separate 0-shot call")
    root = data.resolve_data_dir(data_dir)
    if root == data.HUB:  # load the first task's data now: offline without a cache fails here, in one line
        first = scored[0]
        data.load_hellaswag(root) if first == "hellaswag" else data.load_mmlu(root, first[len("mmlu_"):], "test")
        return
    where = (f"data directory {root!r} (from --data-dir / eval_data_dir, else ${data.DATA_DIR_ENV}; "
             f"without either, the hub datasets {data.MMLU_HUB} and {data.HELLASWAG_HUB} are read)")
    for task in scored:
        if task == "hellaswag":
            paths = [os.path.join(root, "hellaswag", "hellaswag_val.jsonl")]
        else:
            subj = task[len("mmlu_"):]
            paths = [os.path.join(root, "mmlu", "test", f"{subj}_test.csv")]
            if num_fewshot:
                paths.append(os.path.join(root, "mmlu", "dev", f"{subj}_dev.csv"))
        for path in paths:
            if not os.path.isfile(path):
                raise ValueError(f"{path}: file not found in the {where}; {data.LAYOUT}")


def eval_documents(limit: int | None, subset_seed: int | None) -> str:
    """The ``llmeff.eval.documents`` tag of in-training evals: ``"all"`` (no limit), ``"N drawn with
    seed S"`` (``limit`` with ``subset_seed``, as :func:`evaluate` scores them) or ``"first N"``."""
    if not limit:
        return "all"
    return f"{limit} drawn with seed {subset_seed}" if subset_seed is not None else f"first {limit}"


def _first(docs: list, limit: int | float | None, subset_seed: int | None = None) -> list:
    """The first ``limit`` documents, as the harness's ``--limit`` (a float < 1 is a fraction, rounded up).

    With ``subset_seed``, a seeded random subset of that size instead, in file order (a fixed
    sample for evaluations during training); each document keeps its index in the file.
    """
    if limit is None:
        return list(enumerate(docs))
    if limit <= 0:
        raise ValueError(f"limit {limit} is not accepted; use a positive integer (or a fraction in (0, 1))")
    n = math.ceil(len(docs) * limit) if limit < 1.0 else int(limit)
    if subset_seed is None or n >= len(docs):
        return list(enumerate(docs))[:n]
    import random

    keep = sorted(random.Random(subset_seed).sample(range(len(docs)), n))
    return [(i, docs[i]) for i in keep]


def _argmax(values: Sequence[float]) -> int:
    return max(range(len(values)), key=lambda i: (values[i], -i))  # first of ties, as numpy.argmax


def _progress_bar(total: int, what: str):
    """A tqdm bar of documents: every second on a terminal, at most every 30 s into a log."""
    import sys

    from tqdm.auto import tqdm

    tty = sys.stderr.isatty()
    return tqdm(total=total, desc=f"eval {what}", unit="doc", mininterval=1.0 if tty else 30.0, leave=True,
                dynamic_ncols=True)


def evaluate(model: Any, tokenizer: Any, tasks: str | Sequence[str], *, data_dir: str | None = None,
             num_fewshot: int = 0, limit: int | float | None = None, batch_size: int = 8, device: Any = None,
             seed: int = 1234, share_prefix: bool = True, add_bos: bool | None = None,
             subset_seed: int | None = None, progress: bool = False, threads: int | None = None,
             workers: int | None = None) -> EvalResult:
    """Score MMLU and/or HellaSwag with lm-evaluation-harness 0.4.x definitions.

    Args:
        model: a Hugging Face causal LM; put in eval mode for the call, its mode restored after.
        tokenizer: any Hugging Face tokenizer (e.g. ``ByT5Tokenizer(extra_ids=0)``).
        tasks: names or one comma-separated string: ``mmlu`` (57 subjects and the group),
            ``mmlu_<subject>``, ``hellaswag``.
        data_dir: local data directory (see :mod:`.data`), ``"hub"``, or None for
            ``$LLMEFF_DATA_DIR``, else the hub datasets ``cais/mmlu`` and ``Rowan/hellaswag``.
        num_fewshot: MMLU solved examples per prompt, the first k of the subject's dev split
            (0-5). HellaSwag supports 0 only (its few-shot examples come from a training split
            that the data directory does not hold).
        limit: score only the first ``limit`` documents of each task, as the harness does.
        batch_size: sequences per forward pass; results do not depend on it.
        device: where to run; default the model's device.
        seed: kept for parity with the harness; the ``first_n`` few-shot sampler draws nothing.
        share_prefix: reuse shared prefixes (see :mod:`.scoring`); False runs the harness's plan.
        add_bos: see :class:`.scoring.LoglikelihoodScorer`.
        subset_seed: with ``limit``, score a seeded random subset of ``limit`` documents per task
            instead of the first ones (training-time evals use one fixed subset per run).
        progress: show a progress bar on stderr (documents scored of all, rate, ETA); redrawn at
            most every 30 s when stderr is not a terminal, so logs stay short.
        threads: torch intra-op threads while scoring (restored after). None (default): the CPUs
            this process may use (affinity, the cgroup CPU quota rounded down, ``OMP_NUM_THREADS``),
            fewer while other processes hold them, re-decided every 0.5 s
            (:mod:`mlflow_llmeff.evals.threads`); on a CUDA device torch's setting is left alone.
            What was used is ``config["llmeff.threads"]`` and ``config["llmeff.cpu.affinity"]``.
        workers: on CPU, score in this many forked processes of one torch thread each
            (:mod:`mlflow_llmeff.evals.workers`: no OpenMP barrier to stall while other jobs hold the
            CPUs). None (default): the CPUs this process may use (as ``threads``, without others'
            load) when ``threads`` is None, at least two chunks of documents are to be scored, the
            platform can fork and no ``torch.distributed`` group is up; else 1 (in this process).
            ``config["llmeff.eval.workers"]`` records it. Chosen so (None), the count then follows
            what the workers receive: one more while one more raises the CPU time they get, up to
            twice as many (:class:`mlflow_llmeff.evals.threads.WorkerCount`; beside busy jobs that
            share the CPUs per thread); ``config["llmeff.eval.worker_count"]`` says how it moved.

    Raises:
        ValueError: unknown task, bad ``num_fewshot``/``limit``/``threads``/``workers``, missing or
            malformed data files.
        RuntimeError: a worker process failed (its error in one line).
    """
    from mlflow_llmeff.evals.scoring import LoglikelihoodScorer  # torch is imported here, not at module load
    from mlflow_llmeff.evals.threads import ThreadChooser, WorkerCount, affinity_tag, default_workers, usable_cpus
    from mlflow_llmeff.evals.workers import score_in_workers

    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise ValueError(f"threads {threads!r} is not accepted; use an integer >= 1 or None (chosen from the CPUs)")
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 1):
        raise ValueError(f"workers {workers!r} is not accepted; use an integer >= 1 or None (chosen from the CPUs)")
    chooser = count = None
    on_cpu = str(device if device is not None else next(model.parameters()).device).startswith("cpu")
    probe_workers = on_cpu and workers is None
    if on_cpu:
        if workers is None:
            workers = default_workers(threads)
        if threads is None:
            chooser = ThreadChooser.for_this_process()
        else:
            n, where = usable_cpus()
            chooser = ThreadChooser(threads, f"threads={threads} asked; {n} usable: {where}", None)
        chooser.begin()  # data loading below is the first window of others' load
    scored, group = expand_tasks(tasks)
    if not 0 <= num_fewshot <= 5 or (num_fewshot and "hellaswag" in scored):
        raise ValueError(f"num_fewshot {num_fewshot} is not accepted; use 0-5 for MMLU (5 dev examples per subject) "
                         f"and 0 for HellaSwag")
    # load everything first so a missing file fails before any compute
    plans: list[tuple[str, list[tuple[int, Any]], list[dict]]] = []  # (task, [(doc index, doc)], fewshot)
    for task in scored:
        if task == "hellaswag":
            docs = _first(data.load_hellaswag(data_dir), limit, subset_seed)
            plans.append((task, [(i, hellaswag.process_doc(d)) for i, d in docs], []))
        else:
            subject = task[len("mmlu_"):]
            docs = _first(data.load_mmlu(data_dir, subject, "test"), limit, subset_seed)
            shots = data.load_mmlu(data_dir, subject, "dev")[:num_fewshot] if num_fewshot else []
            plans.append((task, docs, shots))

    was_training = getattr(model, "training", False)
    model.eval()
    if device is not None:
        model.to(device)
    t0 = time.perf_counter()
    try:
        scorer = LoglikelihoodScorer(model, tokenizer, batch_size=batch_size, device=device,
                                     share_prefix=share_prefix, add_bos=add_bos)
        all_reqs: list[list[tuple[str, str]]] = []
        families: list[str] = []
        for task, docs, shots in plans:
            for _, d in docs:
                all_reqs.append(hellaswag.requests(d) if task == "hellaswag" else mmlu.requests(d, shots))
                families.append(task if task != "hellaswag" else None)  # MMLU: one family per subject
        label = ",".join(dict.fromkeys("mmlu" if t.startswith("mmlu_") and len(scored) >= 4 else t for t in scored))
        scorer.progress = _progress_bar(len(all_reqs), label) if progress else None
        encoded = [[scorer.encode_request(c, k) for c, k in doc] for doc in all_reqs]
        if not on_cpu or (workers or 1) < 2 or len(encoded) < 2 * scorer.batch_size * scorer.branch_window:
            workers = 1
        if chooser is not None and workers > 1:  # one torch thread per worker process
            chooser = ThreadChooser(1, f"1 per process, {workers} worker processes; {chooser.where}", None)
            if probe_workers:  # more while more receive more CPU (threads.WorkerCount), at most twice as many
                count = WorkerCount(workers, 2 * workers)
        if chooser is not None:
            chooser.start()
            scorer.between = chooser.tick
        try:
            if workers > 1:
                lls = score_in_workers(scorer, encoded, families, workers, count=count,
                                       progress=scorer.progress.update if scorer.progress is not None else None)
            else:
                lls = scorer.score_encoded(encoded, families)
        finally:
            if chooser is not None:
                chooser.stop()
            if scorer.progress is not None:
                scorer.progress.close()
    finally:
        if was_training:
            model.train()
    seconds = time.perf_counter() - t0

    metrics: dict[str, float] = {}
    examples: list[dict[str, Any]] = []
    counts: dict[str, int] = {}
    per_subject: dict[str, tuple[float, int]] = {}
    k = 0
    for task, docs, _ in plans:
        correct = correct_norm = 0
        for idx, d in docs:
            ll = lls[k]
            k += 1
            if task == "hellaswag":
                pred, pred_norm = hellaswag.predictions(ll, d["choices"])
                rec = {"task": task, "doc_index": idx, "logliks": ll, "gold": d["gold"], "pred": pred,
                       "correct": pred == d["gold"], "pred_norm": pred_norm, "correct_norm": pred_norm == d["gold"]}
                correct_norm += rec["correct_norm"]
            else:
                pred = _argmax(ll)
                rec = {"task": task, "doc_index": idx, "logliks": ll, "gold": d["answer"], "pred": pred,
                       "correct": pred == d["answer"]}
            correct += rec["correct"]
            examples.append(rec)
        n = len(docs)
        counts[task] = n
        if n == 0:
            continue
        metrics[f"{task}/acc"] = correct / n
        if task == "hellaswag":
            metrics["hellaswag/acc_norm"] = correct_norm / n
        else:
            per_subject[task] = (correct / n, n)
    if group and per_subject:
        metrics["mmlu/acc"] = mmlu.aggregate_acc(per_subject)
    config = {"tasks": list(tasks) if not isinstance(tasks, str) else tasks.split(","), "num_fewshot": num_fewshot,
              "limit": limit, "batch_size": batch_size, "seed": seed, "share_prefix": share_prefix,
              "data_dir": data.resolve_data_dir(data_dir), "max_length": scorer.max_length,
              "forward_passes": scorer.forward_passes, "forward_tokens": scorer.forward_tokens}
    if chooser is not None:  # the measurement condition, under the training runs' tag names
        config[names.THREADS] = chooser.describe()
        config[names.CPU_AFFINITY] = affinity_tag()
        config[EVAL_WORKERS] = workers
        if count is not None:
            config[EVAL_WORKER_COUNT] = count.describe()
    return EvalResult(metrics, examples, counts, config, seconds)


#: Where a run keeps each eval's per-subject MMLU scores (``{step}``: the eval's MLflow step).
SUBJECT_TABLE = "eval/mmlu_subjects/step_{step:07d}.json"


def split_subjects(metrics: dict[str, float], prefix: str = "") -> tuple[dict[str, float], dict[str, list] | None]:
    """``(the metrics without per-subject MMLU scores, their table or None)``.

    57 per-subject metrics made 57 one-chart sections in MLflow's UI ahead of everything else; a
    run logs them as one table artifact per eval (:data:`SUBJECT_TABLE`, columns ``subject``,
    ``acc``) and the aggregate ``mmlu/acc`` as a metric.

    Args:
        metrics: by key, e.g. ``mmlu_anatomy/acc`` (after ``prefix``, e.g. ``eval/``).
        prefix: what precedes ``mmlu_`` in the keys.
    """
    head, tail = prefix + "mmlu_", "/acc"
    subjects = sorted(k for k in metrics if k.startswith(head) and k.endswith(tail))
    rest = {k: v for k, v in metrics.items() if k not in subjects}
    if not subjects:
        return rest, None
    return rest, {"subject": [k[len(head):-len(tail)] for k in subjects], "acc": [float(metrics[k]) for k in subjects]}


def mlflow_metrics(result: EvalResult) -> dict[str, float]:
    """MLflow keys of a result: ``eval/mmlu/acc`` etc. (names.py), ``eval/mmlu_<subject>/acc``."""
    return {_STANDARD_KEYS.get(k, f"eval/{k}"): v for k, v in result.metrics.items()}


def check_run(run_id: str) -> bool:
    """Raise ValueError (one line naming the id and the tracking store) when ``run_id`` is no run.

    Waits at most the delivery wait (``LLMEFF_DELIVERY_WAIT_S``, :func:`mlflow_llmeff.tracking.delivery.call`)
    for a tracking server; one that does not answer (or is unreachable, or fails without saying the run is
    not there) is not a missing run: False, and the results will wait in the outbox. True when the run was found.
    """
    from mlflow_llmeff.tracking import delivery, store

    client = store.client()
    try:
        delivery.call(lambda: client.get_run(run_id), "looking up the run")
        return True
    except delivery.Unreachable:
        return False
    except Exception as e:  # noqa: BLE001 - one line instead of the store's stack trace
        missing = getattr(e, "error_code", None) in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE")
        if delivery.is_server(store.tracking_uri()) and not missing:
            return False  # the server is away, or refuses us, not the run
        raise ValueError(f"--run-id {run_id!r}: no such run in the tracking store {store.tracking_uri()!r} "
                         f"({type(e).__name__})") from None


def log_to_run(result: EvalResult, run_id: str, note: str, *, found: bool | None = None,
               subject_metrics: bool = False) -> int | None:
    """Log a finished run's evaluation (``llmeff eval --run-id``) as its last eval points.

    The metrics go in at the run's last ``train/tokens`` step (0 without one), so MLflow's latest
    value (and ``llmeff compare``'s column) is this evaluation; the run's status is not touched. The
    tag ``llmeff.eval.last`` gets ``note`` (what was scored) and the step. Delivered by the logger's
    delivery thread, waiting at most the delivery wait without an answer; when the server does not
    take them, they wait in the outbox (a line says how to send them: ``llmeff sync``).

    ``found``: what :func:`check_run` said already (None: it is called here). Per-subject MMLU
    scores are the table ``eval/mmlu_subjects/llmeff_eval.json``, and metrics too with ``subject_metrics``.

    Returns:
        The step, or None when the results wait in the outbox.

    Raises:
        ValueError: ``run_id`` names no run of the tracking store (one line).
    """
    from mlflow_llmeff.tracking.logger import RunLogger

    found = check_run(run_id) if found is None else found
    logger = RunLogger(run_id, unanswered=None if found else "it did not answer when the run was looked up")
    metrics, table = split_subjects(mlflow_metrics(result), "eval/")
    if table is not None:
        logger.log_table(table, "eval/mmlu_subjects/llmeff_eval.json")
    logger.log_eval(mlflow_metrics(result) if subject_metrics else metrics, note)
    return logger.eval_step if logger.close(None) else None


def log_to_mlflow(result: EvalResult, step: int | None = None, *, subject_metrics: bool = False) -> bool:
    """Log the metrics to the active MLflow run (or ``$MLFLOW_RUN_ID``); False when there is none.

    Per-subject MMLU scores are one table artifact (``eval/mmlu_subjects/llmeff_eval.json``), and
    metrics too with ``subject_metrics``.
    """
    import os

    from mlflow_llmeff.tracking.store import active_run_id
    from mlflow_llmeff.tracking.writer import RunWriter

    run_id = active_run_id() or os.environ.get("MLFLOW_RUN_ID")
    if not run_id:
        return False
    metrics, table = split_subjects(mlflow_metrics(result), "eval/")
    writer = RunWriter.attach(run_id)  # the one door: checked, bounded, the outbox when the server is away
    writer.log_metrics(mlflow_metrics(result) if subject_metrics else metrics, step=int(step or 0))
    if table is not None:
        writer.log_table(table, "eval/mmlu_subjects/llmeff_eval.json")
    writer.end(None)
    return True
