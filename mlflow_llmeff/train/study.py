"""``llmeff study``: run each of several configurations N times, interleaved, as one MLflow parent run.

The run, not the step, is the unit of replication (``docs/stability.md``, "Repeats"): one run's own
interval comes from its steps and says nothing about the next run on a shared machine, so a
configuration's figure is a mean over repeated runs with a Student-t interval across them
(:mod:`mlflow_llmeff.report.repeats`). A study makes those repeats:

* **Order**: round-robin, every configuration's repeat ``i`` before any repeat ``i + 1``
  (A1 B1 A2 B2 ...), so that a slow stretch of the machine falls on every configuration alike
  instead of on all repeats of one (a blocked design: Box, Hunter and Hunter, *Statistics for
  Experimenters*, 2nd ed. 2005, ch. 4).
* **Runs**: a parent run tagged ``llmeff.study`` (no training, no summary figures; comparisons leave
  it out) and one child per repeat, tagged ``mlflow.parentRunId``, ``llmeff.study.config`` and
  ``llmeff.study.repeat``. Each child is a normal ``llmeff train`` run
  (:func:`mlflow_llmeff.train.launch.launch`) in a process of its own (one device too), so every
  repeat pays the interpreter's start, imports and set-up that a real job pays, whatever its place in
  the order (in one process only the first did: a trial's first child had 6.45 s of init and goodput
  0.20, the next three 0.09-0.17 s and 0.79-0.85). The study creates it and hands it to the training as
  the launcher's run (``MLFLOW_RUN_ID``, as ``mlflow run`` does), and the training names it with its
  configuration's standard stem, unique in the experiment (``tiny-fp32-gbt256-s32-cpu``,
  ``...-2``: :mod:`mlflow_llmeff.tracking.naming`). Each child's clock starts at its own start, so
  no repeat's ``summary/wall_s`` holds the repeats before it.
* A child that fails is recorded on its run (``llmeff.error``, FAILED) and the study goes on; the
  parent ends FAILED naming it. Ctrl-C ends the running child and the parent KILLED.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable

from mlflow_llmeff import names
from mlflow_llmeff.planning.spec import RunSpec
from mlflow_llmeff.train.config import TrainConfig, validate
from mlflow_llmeff.names import shorten

__all__ = ["StudyConfig", "Child", "Outcome", "StudyResult", "schedule", "check", "run_study", "TrainRunner",
           "summary_lines", "PARENT_TAG"]

#: MLflow's tag of a nested run's parent (the UI draws children under it).
PARENT_TAG = "mlflow.parentRunId"


@dataclass(frozen=True)
class StudyConfig:
    """One configuration of a study: the ``llmeff train`` options as given, and their settings."""

    options: str
    cfg: TrainConfig


@dataclass(frozen=True)
class Child:
    """One run of the study: configuration ``config`` (1..k, the order of ``--config``), repeat
    ``repeat`` (1..n), with the settings it trains with and, when :func:`check` resolved them, the
    resolved run (:class:`~mlflow_llmeff.planning.spec.RunSpec`: the child's launch reads it and
    resolves nothing again)."""

    config: int
    repeat: int
    cfg: TrainConfig
    spec: RunSpec | None = None


@dataclass(frozen=True)
class Outcome:
    """What a runner says of one child: its run id, its exit code (0: finished), for a failure the one
    line of why, and the start its clock counted from (unix s; None when the runner does not say)."""

    run_id: str
    code: int = 0
    error: str | None = None
    started_unix: float | None = None


@dataclass
class StudyResult:
    """A study's parent run, its experiment, and each child in the order run."""

    parent_run_id: str
    experiment_id: str
    children: list[tuple[Child, Outcome]] = field(default_factory=list)

    @property
    def failed(self) -> list[tuple[Child, Outcome]]:
        return [(c, o) for c, o in self.children if o.code != 0]


#: A runner trains one child: ``runner(child, tags) -> Outcome``, ``tags`` being the child run's
#: study tags (its parent, configuration and repeat). :class:`TrainRunner` is the real one.
Runner = Callable[[Child, dict], Outcome]


def _for_repeat(run: TrainConfig | RunSpec, repeat: int) -> Child:
    """One repeat's child: its own checkpoint and model folders (``<dir>/repeat-<i>``), so that a repeat
    never resumes from, or overwrites, another (folders nothing resolved reads: a spec keeps its resolution)."""
    cfg = run.options if isinstance(run, RunSpec) else run
    change = {k: os.path.join(getattr(cfg, k), f"repeat-{repeat}") for k in ("checkpoint_dir", "save_model")
              if getattr(cfg, k)}
    if isinstance(run, RunSpec):
        spec = run.with_options(**change) if change else run
        return Child(0, repeat, spec.options, spec)
    return Child(0, repeat, dataclasses.replace(cfg, **change) if change else cfg)


def schedule(configs: list[TrainConfig | RunSpec], repeats: int, *, seeds: bool = False) -> list[Child]:
    """The study's runs in the order they run: round-robin, repeat 1 of every configuration, then
    repeat 2 of every one, ... (``len(configs) x repeats`` children). ``configs``: the settings, or the
    runs :func:`check` resolved.

    Args:
        seeds: each repeat its own seed: repeat ``i`` trains with the configuration's ``seed + i - 1``
            (``llmeff study --seeds``: init, data order and validation split differ, as MLPerf's runs do);
            False: every repeat the configuration's seed (``--repeats``: the machine's noise alone).

    Raises:
        ValueError: ``repeats`` below 1, or no configuration.
    """
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats={repeats!r} is not accepted; give a positive integer (>= 1)")
    if not configs:
        raise ValueError("a study needs at least one configuration (--config \"<llmeff train options>\")")

    def child(i: int, run: TrainConfig | RunSpec, r: int) -> Child:
        c = dataclasses.replace(_for_repeat(run, r), config=i + 1)
        if not seeds:
            return c
        seed = c.cfg.seed + r - 1  # the seed is read by no resolution: a spec keeps its own
        return dataclasses.replace(c, cfg=dataclasses.replace(c.cfg, seed=seed),
                                   spec=c.spec.with_options(seed=seed) if c.spec is not None else None)

    return [child(i, run, r) for r in range(1, repeats + 1) for i, run in enumerate(configs)]


def to_target(configs: list[StudyConfig], target: str) -> tuple[list[StudyConfig], list]:
    """The configurations set to train to ``target`` or their step cap: ``targets`` the target in canonical
    form, ``stop_at_targets`` true (each run then stops at the eval that reaches it, or at ``max_steps``).

    Args:
        target: ``metric<=value`` / ``metric>=value`` (evals/targets.py), or ``metric=value`` for a loss
            (read ``<=``) or an accuracy (read ``>=``); several comma-separated.

    Returns:
        ``(configurations, targets)``, the parsed :class:`~mlflow_llmeff.evals.targets.Target` list.

    Raises:
        ValueError: a target that does not parse, a configuration whose own ``--targets`` differ, or one
            that evaluates only at its end (``--eval-every 0``: a run would never stop early).
    """
    from mlflow_llmeff.evals.targets import parse_targets

    targets = parse_targets(target, equals=True)
    if not targets:
        raise ValueError(f"--target {target!r} is not accepted; give e.g. 'val_loss<=3.0' or 'hellaswag/acc_norm>=0.3'")
    spec = ",".join(str(t) for t in targets)
    out = []
    for i, c in enumerate(configs, 1):
        where = f"configuration {i} ({c.options!r})"
        own = {str(t) for t in parse_targets(c.cfg.targets)} if c.cfg.targets else set()
        if own and own != {str(t) for t in targets}:
            raise ValueError(f"{where}: --targets {c.cfg.targets!r} and the study's --target {spec!r} differ; give one")
        if c.cfg.eval_every < 1:
            raise ValueError(f"{where}: --eval-every {c.cfg.eval_every} evaluates only at the end, so no run stops at "
                             f"{spec}; give --eval-every N (steps between evals) in --config")
        out.append(StudyConfig(c.options, dataclasses.replace(c.cfg, targets=spec, stop_at_targets=True)))
    return out, targets


def check(configs: list[StudyConfig], experiment: str | None = None) -> list[RunSpec]:
    """Every configuration's settings checked cheaply and resolved before anything runs, in the study's
    experiment (:func:`~mlflow_llmeff.train.config.validate`, once per configuration: the children's
    launches read these specs and check nothing again).

    Returns:
        The resolved runs, ``experiment_name`` set to the study's experiment where one is named.

    Raises:
        ValueError: one line naming the configuration and the bad value: a setting ``llmeff train``
            refuses, a dry run, several machines, a configuration naming another experiment than
            ``experiment`` (or than another configuration), two configurations sharing a checkpoint folder.
    """
    named = {c.cfg.experiment_name for c in configs if c.cfg.experiment_name}
    if experiment and named - {experiment}:
        raise ValueError(f"--experiment {experiment!r} and --experiment-name {sorted(named - {experiment})[0]!r} in a "
                         f"--config differ; a study's runs are in one experiment: give one of them")
    if len(named) > 1:
        raise ValueError(f"the configurations name different experiments ({', '.join(sorted(named))}); a study's "
                         "runs are in one experiment: give --experiment NAME")
    experiment = experiment or (named.pop() if named else "")
    out, folders = [], {}
    for i, c in enumerate(configs, 1):
        where = f"configuration {i} ({c.options!r})"
        if c.cfg.dry_run:
            raise ValueError(f"{where}: --dry-run true trains nothing; a study repeats training runs (llmeff plan "
                             "plans one)")
        if c.cfg.num_machines != 1:
            raise ValueError(f"{where}: --num-machines {c.cfg.num_machines} is not accepted in a study; it runs on "
                             "one machine (--num-machines 1)")
        if c.cfg.checkpoint_dir:
            if c.cfg.checkpoint_dir in folders:
                raise ValueError(f"{where}: --checkpoint-dir {c.cfg.checkpoint_dir!r} is also configuration "
                                 f"{folders[c.cfg.checkpoint_dir]}'s; give each configuration its own folder")
            folders[c.cfg.checkpoint_dir] = i
        cfg = dataclasses.replace(c.cfg, experiment_name=experiment)
        try:
            out.append(validate(cfg))
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
    return out


class TrainRunner:
    """The real runner: creates the child run (its study tags, in the study's experiment) and trains it
    with :func:`~mlflow_llmeff.train.launch.launch` as the launcher's run (``MLFLOW_RUN_ID``), in this
    process for one device, through ``accelerate launch`` for several."""

    def __init__(self, client, experiment_id: str, launch: Callable | None = None) -> None:
        from mlflow_llmeff.train.launch import launch as real_launch

        self.client, self.experiment_id = client, experiment_id
        # each child in a process of its own, as a real job: the same start-up on every repeat
        self.launch = launch or (lambda run, *, started_unix: real_launch(run, started_unix=started_unix,
                                                                          own_process=True))

    def __call__(self, child: Child, tags: dict) -> Outcome:
        from mlflow_llmeff.tracking import delivery
        from mlflow_llmeff.tracking.experiments import unique_run_name
        from mlflow_llmeff.tracking.runs import error_line
        from mlflow_llmeff.tracking.writer import RunWriter
        from mlflow_llmeff.train.loop import stopped_with_one_line

        started = time.time()  # the child's clock: its wall time starts here, not at the study's start
        run = child.spec or child.cfg  # the resolved run where check() resolved it
        if child.cfg.run_name:  # a name the user gave: the same stem on every repeat, -2, -3 for the later ones
            try:
                name = delivery.call(lambda: unique_run_name(self.client, self.experiment_id, child.cfg.run_name),
                                     "reading the run names taken", uri=self.client.tracking_uri)
            except delivery.Unreachable:  # the creation below says so: the stem it is
                name = child.cfg.run_name
            run = run.with_options(run_name=name) if child.spec else dataclasses.replace(run, run_name=name)
        # named until the training names it (the configuration's stem), or for good when it fails before
        placeholder = f"study-config{child.config}-repeat{child.repeat}"
        writer = RunWriter.create(placeholder, experiment_id=self.experiment_id, tags=tags, client=self.client)
        if not writer.answered:  # nothing to train into: the study stops here, its run kept, saying why
            why = f"not trained: {writer.unanswered_reason or 'the tracking server did not take its creation'}"
            _end_run(writer, "KILLED", error=why, note=f"Killed: {shorten(why, 2000)}")
            raise delivery.Unreachable(f"{writer.unanswered_reason}; configuration {child.config} repeat "
                                       f"{child.repeat} was not trained: its run waits in {writer.spilled_to}")
        run_id = writer.run_id
        before = os.environ.get("MLFLOW_RUN_ID")
        os.environ["MLFLOW_RUN_ID"] = run_id
        error = None
        try:
            code = int(self.launch(run, started_unix=started) or 0)
        except (KeyboardInterrupt, SystemExit):
            _end_open_child(self.client, run_id, "KILLED", "stopped by Ctrl-C")
            raise
        except Exception as e:  # noqa: BLE001 - one child's failure is recorded; the study goes on
            code, error = 1, stopped_with_one_line(e) or error_line(e)
            if not (isinstance(e, ValueError) or stopped_with_one_line(e)):  # unexpected: show where
                traceback.print_exc(file=sys.stderr)
        finally:
            if before is None:
                os.environ.pop("MLFLOW_RUN_ID", None)
            else:
                os.environ["MLFLOW_RUN_ID"] = before
        if code != 0:
            error = error or f"the training ended with exit code {code}"
            _end_open_child(self.client, run_id, "FAILED", error)
        return Outcome(run_id, code, error, started)


def _end_open_child(client, run_id: str, status: str, why: str) -> None:
    """End a child its training left open (it failed before its meter started) with ``why`` on it
    (``llmeff.error`` and the description ``Failed: <why>``, as :func:`~mlflow_llmeff.tracking.runs.record_failure`
    writes them), through the writer. Never raises: the failure is already on the terminal and in the parent."""
    from mlflow_llmeff.tracking import delivery
    from mlflow_llmeff.tracking.writer import RunWriter

    try:
        if delivery.call(lambda: client.get_run(run_id).info.status, "reading the child run",
                         uri=client.tracking_uri) == "RUNNING":
            _end_run(RunWriter.attach(run_id, client=client), status, error=why, note=f"Failed: {shorten(why, 2000)}")
    except Exception:  # noqa: BLE001
        pass


def _end_run(writer, status: str, error: str | None = None, note: str | None = None) -> bool:
    """End a study's run (the parent, or a child: a :class:`~mlflow_llmeff.tracking.writer.RunWriter`) with
    ``status``, ``error`` as ``llmeff.error`` and the description (``Failed: <error>`` for FAILED, else
    ``note``) where given; True when the server took it (else it waits in the outbox)."""
    tags = {names.ERROR: shorten(error, 2000)} if error else {}
    description = f"Failed: {shorten(error, 2000)}" if error and status == "FAILED" else note
    if description:
        tags["mlflow.note.content"] = description
    writer.set_tags(tags, synchronous=False)
    return writer.end(status)


def run_study(configs: list[StudyConfig], repeats: int, *, experiment: str | None = None, client=None,
              runner: Runner | None = None, echo: Callable[[str], None] = print, seeds: bool = False,
              target: str | None = None) -> StudyResult:
    """Run ``repeats`` repeats of every configuration in round-robin order under one parent run.

    With ``target`` every child trains to it or to its step cap (:func:`to_target`) and, once it
    ended, gets its MLPerf-style result log (``mllog/result_<seed>.txt``,
    :func:`mlflow_llmeff.tracking.mllog.log_result`); :func:`summary_lines` then scores each
    configuration as MLPerf Training does (:mod:`mlflow_llmeff.report.mlperf`).

    Args:
        configs: the configurations, in the order of ``--config``.
        repeats: runs per configuration, >= 1.
        seeds: each repeat its own seed (:func:`schedule`; ``llmeff study --seeds N``).
        target: the quality target every run trains to (``llmeff study --target``), None for none.
        experiment: the experiment of the parent and its children (created when missing); default: the
            one the configurations name, else MLflow's current experiment.
        client: an ``mlflow.MlflowClient`` (default: a new one for the current tracking URI).
        runner: trains one child (default :class:`TrainRunner`); tests inject a fake.
        echo: where the progress lines go.

    Raises:
        ValueError: bad settings (:func:`check`, :func:`schedule`) or an active MLflow run (the children
            would log into it), before any run is created.
        mlflow_llmeff.tracking.delivery.Unreachable: the tracking server did not answer the creation of the
            parent or of a child within the delivery wait (``LLMEFF_DELIVERY_WAIT_S``); the message (one
            line) names the server, the bound and where the study's runs wait (the outbox); the parent
            ends FAILED (nothing trained) or KILLED there.
    """
    from mlflow_llmeff.tracking import delivery, store
    from mlflow_llmeff.tracking.redact import clean, environment_secrets
    from mlflow_llmeff.tracking.writer import RunWriter

    goals = []
    if target:
        configs, goals = to_target(configs, target)
    specs = check(configs, experiment)
    children = schedule(specs, repeats, seeds=seeds)  # validates repeats before any run exists
    threads = _equal_threads(specs)  # before any run exists: a bad OMP_NUM_THREADS is one line
    active = store.active_run_id()
    if active is not None:
        raise ValueError(f"MLflow run {active} is active: llmeff study creates its own "
                         "parent run and children; end the active run first")
    client = client or store.client()
    k = len(configs)
    unit = "seed" if seeds else "repeat"
    what = f"{k} configuration{'s' if k != 1 else ''} x {repeats} {unit}{'s' if repeats != 1 else ''}, round-robin"
    spec = specs[0].options.targets if goals else ""
    if spec:
        what += f", each to {spec} or its step cap"
    secrets = environment_secrets()
    params = {"seeds" if seeds else "repeats": str(repeats), **({"target": spec} if spec else {}),
              **{f"config_{i}": shorten(clean(f"config_{i}", c.options, secrets), 6000)
                 for i, c in enumerate(configs, 1)}}
    # the parent's creation waits at most the delivery wait (LLMEFF_DELIVERY_WAIT_S); without an answer
    # nothing is trained, and the parent (the study's settings, FAILED with why) waits in the outbox
    parent = RunWriter.create(f"study-{k}x{repeats}", experiment_name=specs[0].options.experiment_name or None,
                              tags={names.STUDY: what, **({names.STUDY_TARGET: spec} if spec else {})},
                              params=params, unique=True, client=client)
    if not parent.answered:
        why = parent.unanswered_reason or "the tracking server did not take the study's parent run"
        _end_run(parent, "FAILED", error=f"{why}; nothing was trained")
        raise delivery.Unreachable(f"{why}; nothing was trained: the study's parent run ({what}, its settings) "
                                   f"waits in {parent.spilled_to} (llmeff sync {parent.outbox_dir} when it answers)")
    exp_id = parent.experiment_id
    runner = runner or TrainRunner(client, exp_id)
    result = StudyResult(parent.run_id, exp_id)
    echo(f"llmeff study: parent run {parent.run_id}, {what} ({len(children)} runs)")
    saved = {v: os.environ.get(v) for v in _THREAD_VARS}
    if threads:
        echo(f"llmeff study: {threads[0]} intra-op thread(s) in every process of every run ({threads[1]}), so "
             "runs of different process counts compare (llmeff.threads)")
        os.environ.update(dict.fromkeys(_THREAD_VARS, str(threads[0])))
    try:
        for n, child in enumerate(children, 1):
            echo(f"llmeff study: run {n} of {len(children)}: configuration {child.config}, {unit} {child.repeat} "
                 f"of {repeats}" + (f" (seed {child.cfg.seed})" if seeds else ""))
            tags = {PARENT_TAG: parent.run_id, names.STUDY_CONFIG: str(child.config),
                    names.STUDY_REPEAT: str(child.repeat)}
            if spec:
                tags[names.STUDY_TARGET] = spec
            outcome = runner(child, tags)
            result.children.append((child, outcome))
            if goals and outcome.code == 0:  # its MLPerf-style result log (the first target's eval)
                from mlflow_llmeff.tracking.mllog import fetch_hint, log_result

                logged, artifact = log_result(client, outcome.run_id, goals[0].eval_key, goals[0].key,
                                              outcome.started_unix)
                echo(f"llmeff study: run {outcome.run_id}: {logged}"
                     + fetch_hint(client.tracking_uri, outcome.run_id, artifact))
            if outcome.code:
                echo(f"llmeff study: configuration {child.config}, repeat {child.repeat} failed ({outcome.error}); "
                     "the study goes on")
    except BaseException as e:
        ended = _end_run(parent, "KILLED", error=f"stopped after {len(result.children)} of {len(children)} runs")
        if isinstance(e, delivery.Unreachable) and not ended:  # the one line says where the study's end is too
            raise delivery.Unreachable(
                f"{e}; the study stopped after {len(result.children)} of {len(children)} runs and its parent run "
                f"{parent.run_id} (KILLED) waits in {parent.spilled_to} (llmeff sync {parent.outbox_dir} when it "
                "answers)") from e
        raise
    finally:
        for var, value in saved.items():  # the study's process as it was
            if value is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = value
    failed = result.failed
    if failed:
        why = "; ".join(f"configuration {c.config} repeat {c.repeat} (run {o.run_id}): {o.error}" for c, o in failed)
        ended = _end_run(parent, "FAILED", error=f"{len(failed)} of {len(children)} runs failed: {why}")
    else:
        ended = _end_run(parent, "FINISHED", note=f"{what}: {len(children)} runs finished")
    if not ended:
        echo(f"llmeff study: the parent run's end waits in {parent.spilled_to} ({parent.unanswered_reason or 'no answer'}; "
             f"llmeff sync {parent.outbox_dir} sends it)")
    return result


#: What sets a launched process's intra-op threads (torch reads them as it starts).
_THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


def _equal_threads(specs) -> tuple[int, str] | None:
    """``(threads, why)`` every process of every run gets where the study's CPU configurations launch different
    process counts (:func:`~mlflow_llmeff.train.launch.threads_per_process`): Accelerate gives each of several
    processes 1 thread and a single one keeps all, and compare refuses the scaling of runs whose
    ``llmeff.threads`` differ (a trial's study). None where the counts agree or every run is on CUDA.

    Raises:
        ValueError: a bad ``OMP_NUM_THREADS`` (one line)."""
    counts = {s.processes_per_node for s in specs if not s.machine.cuda}
    if len(counts) < 2:
        return None
    from mlflow_llmeff.train.launch import threads_per_process

    return threads_per_process(sorted(counts))


def summary_lines(client, result: StudyResult) -> list[str]:
    """Each configuration's steady tokens/s over its finished repeats, mean and 95% Student-t interval
    across them (:meth:`mlflow_llmeff.report.repeats.Configuration.estimate`), for a study to a target
    its time, energy and cost to it scored as MLPerf Training scores a benchmark
    (:func:`mlflow_llmeff.report.mlperf.text_lines`, a failed child counted as not converged), and how
    to compare them.

    Grouped by ``llmeff.study.config``; a note says when two configurations differ in no condition tag
    (``llmeff compare`` pools such runs as repeats of one configuration).
    """
    from mlflow_llmeff.report.mlperf import config_scores, text_lines
    from mlflow_llmeff.report.repeats import CONFIG_TAGS, Configuration
    from mlflow_llmeff.report.source import select_runs

    from mlflow_llmeff.tracking.delivery import bounded_reads

    client = bounded_reads(client)  # every read within the delivery wait: Unreachable, one line, else
    query = f"tags.`{PARENT_TAG}` = '{result.parent_run_id}'"
    try:
        runs = select_runs(client, result.experiment_id, query).runs
    except ValueError:  # no child was recorded
        return []
    def number(r, tag: str) -> int:
        v = r.tags.get(tag, "")
        return int(v) if v.isdigit() else 0

    by_config: dict[int, Configuration] = {}
    failed: dict[int, list] = {}
    for r in sorted(runs, key=lambda r: number(r, names.STUDY_REPEAT)):
        if r.comparable:  # finished with its summary (report/calc.py)
            by_config.setdefault(number(r, names.STUDY_CONFIG), Configuration(())).runs.append(r)
        elif r.status in ("FAILED", "KILLED"):  # a run to a target that failed: not converged (MLPerf)
            failed.setdefault(number(r, names.STUDY_CONFIG), []).append(r)
    lines, scores = [], []
    for i, c in sorted(by_config.items()):
        e = c.estimate(names.SUM_TOKENS_PER_SEC)
        figure = f"{e.text()} tokens/s: {e.how()}" if e else "no summary/tokens_per_sec"
        lines.append(f"configuration {i} ({c.label}): {figure}")
        scores += config_scores(c, failed.get(i, []))
    lines += text_lines(scores)  # time, energy and cost to the target, MLPerf-scored (none without targets)
    keys: dict[tuple, list[int]] = {}
    for i, c in by_config.items():
        keys.setdefault(tuple(c.runs[0].tags.get(t) for t in CONFIG_TAGS), []).append(i)
    for same in (v for v in keys.values() if len(v) > 1):
        lines.append(f"note: configurations {', '.join(str(i) for i in sorted(same))} differ in no condition tag; llmeff compare "
                     "takes their runs as repeats of one configuration")
    exp = client.get_experiment(result.experiment_id).name
    lines.append(f"compare: llmeff compare --experiment {_shell_word(exp)} --filter {_shell_word(query)}")
    return lines


def _shell_word(text: str) -> str:
    """``text`` as one word for bash, readable: ``shlex.quote`` where it holds no single quote, else in double
    quotes with each backtick escaped by a backslash (a trial found ``shlex.quote``'s ``'"'"'`` hard to read;
    unescaped, bash ran the backticks as a command), else (a double quote, ``$``, a backslash or ``!`` inside)
    ``shlex.quote``'s."""
    import shlex

    if "'" not in text or any(c in text for c in '"$\\!'):
        return shlex.quote(text)
    return '"' + text.replace("`", "\\`") + '"'
