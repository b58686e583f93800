"""MLPerf-style result logs (mllog) of finished runs, written with MLCommons' ``mlperf-logging`` and checked
by its compliance checker.

A run that trained to a quality target (``llmeff study --target``) gets the artifact
``mllog/result_<seed>.txt``: the ``:::MLLOG`` lines an MLPerf Training run writes, made by
:class:`mlperf_logging.mllog.MLLogger` from what the run recorded (each line's ``time_ms`` from the
run's own clock, below), and the tag ``llmeff.mllog`` saying what it is or why there is none. What is
claimed: *MLPerf-style*, not an MLPerf result. The lines follow the keys and order every MLPerf
Training 6.0.0 benchmark shares, and :func:`check_log` runs ``python -m
mlperf_logging.compliance_checker`` on them with those shared rules (:func:`generic_rules`); a
benchmark's own rules (Small LLM pretraining, ``llama31_8b``, the benchmark named: MLPerf's Open
division admits any model, data and stopping criterion) fix a sequence length of 8,192, hyper-
parameters and a quality band a tiny run does not meet, and are not applied. ``submission_status``
is ``research``; ``cache_clear`` is logged false (the run did not drop the OS caches MLPerf asks for).

The timeline, in milliseconds since the epoch, from the run's figures (``docs/compare.md``):

* job start ``t0`` = the start the training's clock counts from (``llmeff study`` hands each child its
  start, ``started_unix``), else the stamp of the ``summary/wall_s`` point minus ``summary/wall_s`` (the
  summary is stamped after its clock stops: 20-40 ms on a quiet machine, 0.8 s seen on a busy one);
* ``init_start`` = ``t0``; ``init_stop`` = ``run_start`` = ``t0 + summary/badput_init_s``;
* ``run_stop`` (``status: success``) = ``run_start + ttq/<target>_wall_s``: the MLPerf result, run
  stop minus run start, is the run's time to the target; a run that did not reach it stops at the end
  of its training, ``t0 + summary/wall_s``, ``status: aborted``;
* ``eval_accuracy`` at each eval of the target's metric (the stamp MLflow holds, capped at run stop),
  ``samples_count`` = step x global batch (sequences), the epoch reporting MLPerf asks of
  Llama 3.1 8B ("training samples starting from 0"); a ``block_start``/``block_stop`` pair spans the
  training between two evals.
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field

from mlflow_llmeff import names

__all__ = ["BENCHMARK", "RULESET", "ARTIFACT_DIR", "RunFacts", "facts_from_run", "events", "write_log",
           "log_result", "fetch_hint", "generic_rules", "check_log", "CheckResult"]

#: The MLPerf Training benchmark the logs name: Small LLM pretraining (its reference is Llama 3.1 8B).
BENCHMARK = "llama31_8b"
#: The compliance checker's ruleset the logs are checked against.
RULESET = "6.0.0"
#: Where on the run the logs go.
ARTIFACT_DIR = "mllog"
#: submission_org of an unofficial run.
ORG = "unofficial: mlflow_llmeff (MLPerf-style, not an MLPerf submission)"


@dataclass(frozen=True)
class RunFacts:
    """What a result log is made of, read off one finished run.

    Attributes:
        seed: the run's seed.
        global_batch_size: sequences per optimizer step (``llmeff.global_batch_tokens / llmeff.seq_len``).
        seq_len: tokens per sequence.
        grad_accum: micro-batches per optimizer step.
        job_start_ms: when the job started (ms since the epoch).
        init_s: set-up before the first step (``summary/badput_init_s``), seconds.
        wall_s: the job's wall time (``summary/wall_s``), seconds.
        evals: ``(step, stamp in ms, value)`` of every eval of the target's metric, by step.
        target_s: the time to the target (``ttq/<target>_wall_s``), None when not reached.
        reached_step: the step whose eval reached it (``llmeff.ttq.<target>=reached_at_step_<n>``); evals
            after it are not the run's (MLPerf stops the clock there). None when not reached or not told.
        steps: optimizer steps trained (``summary/steps``).
        platform: ``<count>x<accelerator name>``.
        precision: the ``llmeff.precision`` tag (``fp8``, ``bf16``, ...).
        params: the keys MLPerf logs as hyperparameters, where the run has them (``max_steps``,
            ``opt_base_learning_rate``, ``opt_name``, ``train_samples``, ``eval_samples``).
    """

    seed: int
    global_batch_size: int
    seq_len: int
    grad_accum: int
    job_start_ms: int
    init_s: float
    wall_s: float
    evals: tuple[tuple[int, int, float], ...]
    target_s: float | None
    steps: int
    platform: str
    precision: str = ""
    params: dict = field(default_factory=dict)
    reached_step: int | None = None


#: llmeff.precision -> MLPerf's lowest_numerical_precision_in_linear values.
_PRECISION = {"fp4": "fp4", "fp8": "fp8", "bf16": "bfloat16", "fp16": "fp16", "fp32": "fp32", "tf32": "tf32"}


def events(f: RunFacts) -> list[tuple[str, str, object, dict, int]]:
    """The result log's lines as ``(kind, key, value, metadata, time_ms)``, kind ``event``/``start``/``end``,
    in the order written (module docstring: the timeline)."""
    t0 = f.job_start_ms
    run_start = t0 + round(f.init_s * 1000)
    reached = f.target_s is not None
    stop = run_start + round(f.target_s * 1000) if reached else t0 + round(f.wall_s * 1000)
    out = [("event", k, v, {}, t0) for k, v in (
        ("submission_benchmark", BENCHMARK), ("submission_org", ORG), ("submission_division", "open"),
        ("submission_status", "research"), ("submission_platform", f.platform))]
    out += [("event", "cache_clear", False, {}, t0), ("start", "init_start", None, {}, t0)]
    out += [("event", k, v, {}, t0) for k, v in (
        ("seed", f.seed), ("global_batch_size", f.global_batch_size), ("gradient_accumulation_steps", f.grad_accum),
        ("max_sequence_length", f.seq_len), *sorted(f.params.items()))]
    if f.precision in _PRECISION:
        out.append(("event", "lowest_numerical_precision_in_linear", _PRECISION[f.precision], {}, t0))
    out += [("end", "init_stop", None, {}, run_start), ("start", "run_start", None, {}, run_start)]
    last_step, last_t = 0, run_start
    for step, stamp, value in f.evals:
        t = min(max(stamp, last_t), stop)
        out += [("start", "block_start", None, {"samples_count": last_step * f.global_batch_size}, last_t),
                ("end", "block_stop", None, {"samples_count": step * f.global_batch_size}, t),
                ("event", "eval_accuracy", value, {"samples_count": step * f.global_batch_size, "step": step}, t)]
        last_step, last_t = step, t
        if reached and f.reached_step is not None and step >= f.reached_step:  # the clock stopped at this eval
            break
    out.append(("end", "run_stop", None, {"status": "success" if reached else "aborted",
                                          "samples_count": (last_step if reached else f.steps) * f.global_batch_size},
                stop))
    return out


def write_log(f: RunFacts, path: str) -> str:
    """Write :func:`events` of ``f`` to ``path`` through ``mlperf_logging.mllog.MLLogger`` (one ``:::MLLOG``
    line each); returns ``path``."""
    from mlperf_logging.mllog.mllog import MLLogger

    logger = logging.getLogger(f"mlflow_llmeff.mllog.{os.path.abspath(path)}")
    logger.propagate, logger.handlers = False, []
    logger.setLevel(logging.INFO)
    handler = logging.FileHandler(path, mode="w", encoding="utf-8")
    logger.addHandler(handler)
    try:
        ml = MLLogger(logger=logger, default_stack_offset=1)
        for kind, key, value, metadata, t in events(f):
            getattr(ml, kind)(key=key, value=value, metadata=metadata or None, time_ms=t)
    finally:
        handler.close()
        logger.removeHandler(handler)
    return path


def _profile(run) -> dict:
    """The ``profile`` of the run's training dataset input (train and validation blocks), {} without one."""
    try:
        for d in run.inputs.dataset_inputs:
            return json.loads(d.dataset.profile or "{}")
    except Exception:  # noqa: BLE001 - a run without inputs
        pass
    return {}


def facts_from_run(client, run_id: str, eval_key: str, stem: str, started_unix: float | None = None) -> RunFacts:
    """:class:`RunFacts` of a finished run for the target whose eval is ``eval_key`` (``eval/val_loss``) and
    whose key stem is ``stem`` (``val_loss_le_3.0``); ``started_unix``: when the run's clock started (unix
    seconds; default: read back from its ``summary/wall_s`` point, module docstring).

    Raises:
        ValueError: one line naming what the run lacks (its summary, a batch of fixed shape, any eval of
            ``eval_key``).
    """
    run = client.get_run(run_id)
    m, tags, params = run.data.metrics, run.data.tags, run.data.params
    missing = [k for k in (names.SUM_WALL_S, names.SUM_STEPS) if k not in m]
    if missing:
        raise ValueError(f"run {run_id} has no {', '.join(missing)} (it did not finish its summary)")
    try:
        gbs = int(tags[names.GLOBAL_BATCH_TOKENS]) // int(tags[names.SEQ_LEN])
        seq_len, accum = int(tags[names.SEQ_LEN]), int(tags.get(names.GRAD_ACCUM, "1"))
    except (KeyError, ValueError):
        raise ValueError(f"run {run_id} has no fixed global batch (llmeff.global_batch_tokens "
                         f"{tags.get(names.GLOBAL_BATCH_TOKENS)!r}, llmeff.seq_len {tags.get(names.SEQ_LEN)!r})") from None
    evals = tuple(sorted((int(p.step), int(p.timestamp), float(p.value)) for p in client.get_metric_history(run_id, eval_key)))
    if not evals:
        raise ValueError(f"run {run_id} has no {eval_key}: nothing to log as eval_accuracy")
    [wall_point] = [p for p in client.get_metric_history(run_id, names.SUM_WALL_S)][-1:]
    wall = float(m[names.SUM_WALL_S])
    profile = _profile(run)
    extra = {}
    if params.get("max_steps", "").isdigit():
        extra["max_steps"] = int(params["max_steps"])
    try:
        extra["opt_base_learning_rate"] = float(params["learning_rate"])
        extra["opt_name"] = "adamw"  # llmeff train's optimizer (train/setup.py: torch.optim.AdamW)
    except (KeyError, ValueError):
        pass
    if "train_blocks" in profile:
        extra["train_samples"] = int(profile["train_blocks"])
    if eval_key in (names.EVAL_VAL_LOSS, names.EVAL_VAL_PPL) and "val_blocks" in profile:
        scored = int(params.get("val_blocks", "0") or 0)
        extra["eval_samples"] = min(scored, int(profile["val_blocks"])) if scored > 0 else int(profile["val_blocks"])
    docs = re.match(r"(\d+) drawn", tags.get(names.EVAL_DOCUMENTS, ""))
    if eval_key not in (names.EVAL_VAL_LOSS, names.EVAL_VAL_PPL) and docs:
        extra["eval_samples"] = int(docs.group(1))
    target = m.get(f"ttq/{stem}_wall_s")
    at = re.fullmatch(r"reached_at_step_(\d+)", tags.get(names.TTQ_TAG_PREFIX + stem, ""))
    return RunFacts(seed=int(params.get("seed", "0") or 0), global_batch_size=gbs, seq_len=seq_len, grad_accum=accum,
                    job_start_ms=(round(started_unix * 1000) if started_unix is not None
                                  else int(wall_point.timestamp - round(wall * 1000))),
                    init_s=float(m.get(names.SUM_BADPUT["init"], 0.0)), wall_s=wall, evals=evals, target_s=target,
                    steps=int(m[names.SUM_STEPS]),
                    platform=f"{tags.get(names.ACCEL_COUNT, '1')}x{tags.get(names.ACCEL_NAME, 'unknown')}",
                    precision=tags.get(names.PRECISION, ""), params=extra,
                    reached_step=int(at.group(1)) if at and target is not None else None)


@dataclass(frozen=True)
class CheckResult:
    """What the compliance checker said: ``ok`` when it reported success, and its output."""

    ok: bool
    output: str


def generic_rules(ruleset: str = RULESET, where: str | None = None) -> str:
    """A compliance-checker config of the rules every MLPerf Training ``ruleset`` benchmark shares: the package's
    ``training_<ruleset>/common.yaml`` and ``open_common.yaml``, with each ``enqueue_config(...)`` call removed
    from their code (the call that would load the benchmark's own file). Written into ``where`` (default: a
    new temporary folder); returns its absolute path, which the checker's ``--config`` takes as it is.

    Raises:
        ValueError: a ruleset the installed mlperf-logging does not have.
    """
    import yaml
    from mlperf_logging import compliance_checker

    base = os.path.join(os.path.dirname(compliance_checker.__file__), f"training_{ruleset}")
    records = []
    for name in ("common.yaml", "open_common.yaml"):
        p = os.path.join(base, name)
        if not os.path.exists(p):
            raise ValueError(f"ruleset {ruleset!r} is not accepted: mlperf-logging has no {p}")
        with open(p, encoding="utf-8") as fh:
            records += yaml.load(fh, Loader=yaml.BaseLoader) or []
    for r in records:
        for body in r.values():
            if isinstance(body, dict) and isinstance(body.get("POST"), str):
                body["POST"] = re.sub(r"enqueue_config\([^;]*\)\s*;?", "", body["POST"]).strip() or "pass"
    path = os.path.join(where or tempfile.mkdtemp(prefix="llmeff-mllog-"), f"training_{ruleset}_shared.yaml")
    with open(path, "w", encoding="utf-8") as fh:
        yaml.safe_dump(records, fh, sort_keys=False)
    return os.path.abspath(path)


def check_log(path: str, ruleset: str = RULESET, config: str | None = None) -> CheckResult:
    """Run ``python -m mlperf_logging.compliance_checker --usage training --ruleset <ruleset> --config <config>``
    on the log at ``path`` (default config: :func:`generic_rules`); ``ok`` when it exits 0 having printed
    ``SUCCESS``."""
    config = config or generic_rules(ruleset)
    out_log = os.path.join(os.path.dirname(config), "compliance_checker.log")
    p = subprocess.run([sys.executable, "-m", "mlperf_logging.compliance_checker", "--usage", "training",
                        "--ruleset", ruleset, "--config", config, "--log_output", out_log, path],
                       capture_output=True, text=True, timeout=120)
    text = p.stdout + p.stderr
    return CheckResult(p.returncode == 0 and "SUCCESS" in text, text)


def log_result(client, run_id: str, eval_key: str, stem: str, started_unix: float | None = None) -> tuple[str, str | None]:
    """Write a finished run's result log (:func:`facts_from_run`, :func:`write_log`) and log it as its artifact
    ``mllog/result_<seed>.txt``, with the tag ``llmeff.mllog`` saying what it is; a run whose log cannot be
    made gets the tag saying why instead. Returns the tag's value and the log's artifact path in the run (None
    where no log was written). Never raises (a study goes on).

    The run is read within the delivery wait (``LLMEFF_DELIVERY_WAIT_S``, :func:`mlflow_llmeff.tracking.delivery.call`)
    and written through :class:`~mlflow_llmeff.tracking.writer.RunWriter` (what the server does not take
    in that wait is kept in the outbox)."""
    from mlflow_llmeff.tracking import delivery
    from mlflow_llmeff.tracking.writer import RunWriter

    artifact = None
    writer = RunWriter.attach(run_id, client=client)
    try:
        f = delivery.call(lambda: facts_from_run(client, run_id, eval_key, stem, started_unix), "reading the run",
                          uri=getattr(client, "tracking_uri", None))
        with tempfile.TemporaryDirectory(prefix="llmeff-mllog-") as d:
            local = write_log(f, os.path.join(d, f"result_{f.seed}.txt"))
            writer.log_file(local, ARTIFACT_DIR)
            if not writer.flush():  # the file is gone after this block: kept in a folder of its own
                raise delivery.Unreachable(writer.unanswered_reason or "the tracking server did not take the log")
        status = "success" if f.target_s is not None else "aborted"
        artifact = f"{ARTIFACT_DIR}/result_{f.seed}.txt"
        what = (f"{artifact}: MLPerf-style result log (mlperf-logging; the rules every "
                f"MLPerf Training {RULESET} benchmark shares, not an MLPerf submission), run_stop {status}")
    except Exception as e:  # noqa: BLE001 - the log is a by-product; the training run stands
        what = f"not written: {names.shorten(f'{type(e).__name__}: {e}', 500)}"
    try:
        writer.set_tags({names.MLLOG: what}, synchronous=False)
        writer.end(None)
    except Exception:  # noqa: BLE001
        pass
    return what, artifact


def fetch_hint(tracking_uri: str, run_id: str, artifact: str | None) -> str:
    """The words after :func:`log_result`'s tag value that say where the log is: an artifact of the run in the
    store at ``tracking_uri``, not a file under the working directory, with the ``mlflow artifacts download``
    command that fetches ``artifact`` (its path in the run) into the working directory; the command names the
    store (:func:`~mlflow_llmeff.tracking.redact.store_arg`: never a credential), without which it looks in
    MLflow's default store and finds no such run. ``""`` where no log was written (``artifact`` None)."""
    from mlflow_llmeff.tracking.redact import store_arg

    if artifact is None:
        return ""
    return (f" (an artifact of the run, not a local file: MLFLOW_TRACKING_URI={store_arg(tracking_uri)} mlflow "
            f"artifacts download --run-id {run_id} --artifact-path {artifact} --dst-path .)")
