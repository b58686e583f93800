"""The ``llmeff`` command line: each command parses options and hands off, nothing else."""

from __future__ import annotations

import contextlib
import os

import click

from mlflow_llmeff.names import shorten


class OneLineErrors(click.Group):
    """A :class:`click.Group` whose usage errors are one line on stderr: ``Error: <message>``, exit code 2.

    Click shows a usage error as the command's usage, a ``Try '... --help' for help.`` line, a blank
    line and then ``Error: ...``; the project's rule is one line naming the value and the accepted
    ones, which Click's message already does (the choices, the close option names, the type, the
    range). Every usage error passes through this group's :meth:`make_context` (its own options) or
    :meth:`invoke` (resolving, parsing and running a command); there it is raised again as a plain
    ``UsageError`` of its message joined onto one line and without its context, which is what makes
    Click print the message alone. ``--help`` and ``llmeff`` with no command (the help) are unchanged.
    """

    def make_context(self, info_name, args, parent=None, **extra):
        with _one_line_usage_errors():
            return super().make_context(info_name, args, parent=parent, **extra)

    def invoke(self, ctx):
        with _one_line_usage_errors():
            return super().invoke(ctx)

    def resolve_command(self, ctx, args):
        """Click's, with the accepted commands named when the one given is unknown (Click names only close ones)."""
        try:
            return super().resolve_command(ctx, args)
        except click.UsageError as e:
            if args[0].startswith("-"):  # the group's own options were parsed again: not a command name
                raise
            raise click.UsageError(f"{e.format_message()} Commands: {', '.join(self.list_commands(ctx))}.",
                                   ctx) from None


@contextlib.contextmanager
def _one_line_usage_errors():
    """Raise a usage error again as one line without its context (:class:`OneLineErrors`)."""
    try:
        yield
    except click.UsageError as e:
        if isinstance(e, getattr(click.exceptions, "NoArgsIsHelpError", ())):  # click >= 8.2: `llmeff` alone
            raise  # shows the help
        lines = (line.strip() for line in e.format_message().splitlines())
        message = " ".join(line for line in lines if line)
        if isinstance(e, click.NoSuchOption) and e.ctx is not None:  # Click names only close ones: name them all
            accepted = sorted({o for p in e.ctx.command.params if isinstance(p, click.Option) for o in p.opts
                               if o.startswith("--")} | {"--help"})
            message += f" Options: {', '.join(accepted)}."
        raise click.UsageError(message) from None


class IntRange(click.IntRange):
    """:class:`click.IntRange` whose error for a non-integer names the range, as its error for an integer
    outside does (``'abc' is not an integer in the range x>=1.``; Click says ``'abc' is not a valid
    integer range.``). Help is unchanged (``INTEGER RANGE``)."""

    def convert(self, value, param, ctx):
        if isinstance(value, str):
            try:
                int(value)
            except ValueError:
                self.fail(f"{value!r} is not an integer in the range {self._describe_range()}.", param, ctx)
        return super().convert(value, param, ctx)


@click.group(cls=OneLineErrors, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="mlflow-llmeff")
def main() -> None:
    """Standard efficiency metrics for LLM training runs in MLflow."""


# Commands are registered below, one block per concern (train, flops/peak/plan, eval, ...).

# True when this process is the command line itself (``llmeff``, ``python -m mlflow_llmeff``), not a
# caller of ``main`` (click's CliRunner in tests): only then may ``llmeff train`` end the process itself
_PROCESS_ENTRY = {"on": False}


def console_main() -> None:
    """The ``llmeff`` console script: :func:`main` as this process's own entry point."""
    _PROCESS_ENTRY["on"] = True
    main(prog_name="llmeff")


# ---- train commands
def _train_options(f):
    """Add one click option per TrainConfig field (same names as the MLproject parameters)."""
    import dataclasses

    from mlflow_llmeff.train.config import TrainConfig

    for fld in reversed(dataclasses.fields(TrainConfig)):
        opt = "--" + fld.name.replace("_", "-")
        tname = fld.type if isinstance(fld.type, str) else fld.type.__name__
        typ = {"int": int, "float": float, "str": str, "bool": click.BOOL}[tname]
        # a switch works alone (--dry-run) and with a value (--dry-run true, as MLproject passes it)
        flag = {"is_flag": False, "flag_value": True} if tname == "bool" else {}
        f = click.option(opt, fld.name, type=typ, default=fld.default, show_default=True,
                         help=fld.metadata.get("help"), **flag)(f)
    return f


@main.command("train")
@_train_options
def train_cmd(**kwargs) -> None:
    """Train a decoder-only LLM with Accelerate and log standard efficiency metrics to MLflow."""
    from mlflow_llmeff.train.config import TrainConfig
    from mlflow_llmeff.train.launch import launch, settle

    spec = None  # the run resolved once (train/launch.py settle); its failure tags read it
    try:
        spec = settle(TrainConfig(**kwargs))
        code = launch(spec)
    except ValueError as e:
        fail(str(e), kwargs, spec)
    except (KeyboardInterrupt, SystemExit):
        raise
    except Exception as e:
        from mlflow_llmeff.train.loop import stopped_with_one_line

        line = stopped_with_one_line(e)
        if line:  # a known ending (diverged loss, OOM, data error): the run already says why
            click.echo(f"Error: {line}", err=True)
            raise SystemExit(1) from None
        # unexpected: say why on the run, then show the traceback
        from mlflow_llmeff.tracking.runs import error_line, record_failure
        from mlflow_llmeff.train.failures import failure_conditions

        tags, name = failure_conditions(kwargs, spec)
        record_failure(error_line(e), tags, run_name=name)
        raise
    if _PROCESS_ENTRY["on"]:  # logged and done: return to the user now, not after torch's module teardown
        from mlflow_llmeff.monitor.lifecycle import exit_now

        exit_now(code)
    raise SystemExit(code)


def fail(message: str, params: dict | None = None, spec=None):
    """Stop with one line. Under ``mlflow run`` the line also goes onto the launcher's run
    (``llmeff.error``, its description, the known conditions: ``spec``'s where the run was resolved)
    and speaks of ``-P name=value``."""
    import os

    if not os.environ.get("MLFLOW_RUN_ID"):
        raise click.UsageError(message)
    from mlflow_llmeff.tracking.runs import record_failure
    from mlflow_llmeff.train.failures import failure_conditions

    tags, name = failure_conditions(params or {}, spec)
    record_failure(message, tags, run_name=name)
    click.echo(f"Error: {message}", err=True)
    raise SystemExit(2)


def run_as_project() -> None:
    """``python -m mlflow_llmeff``: under ``mlflow run`` a bad ``-P`` value is one line, named as ``-P``."""
    import os
    import re

    _PROCESS_ENTRY["on"] = True
    if not os.environ.get("MLFLOW_RUN_ID"):
        main(prog_name="llmeff")
        return
    from mlflow_llmeff.tracking.store import StoreNotFound, project_store
    try:  # the run's store, not the one a relative URI names from the project's folder (mlflow run's cwd)
        os.environ["MLFLOW_TRACKING_URI"] = project_store()
    except StoreNotFound as e:
        raise SystemExit(f"Error: {e}") from None
    try:
        main(prog_name="llmeff", standalone_mode=False)
    except click.ClickException as e:
        msg = re.sub(r"'--([a-z0-9-]+)'", lambda m: "-P " + m.group(1).replace("-", "_"), e.format_message())
        fail(msg.replace("\n", " "))
    except click.exceptions.Abort:
        raise SystemExit(130) from None


# ---- study command (repeats of configurations, interleaved, under one parent run: train/study.py)
def _study_config(text: str):
    """One ``--config`` value: ``llmeff train`` options parsed by the train command itself.

    Raises:
        click.BadParameter: one line naming the value and what is wrong in it (an unknown option, a bad
            value, unbalanced quotes).
    """
    import shlex

    from mlflow_llmeff.train.config import TrainConfig
    from mlflow_llmeff.train.study import StudyConfig

    try:
        args = shlex.split(text)
        ctx = train_cmd.make_context("train", args)
    except ValueError as e:  # shlex: "No closing quotation"
        raise click.BadParameter(f"{text!r}: {e}", param_hint="'--config'") from None
    except click.exceptions.Exit:  # --help inside the value: click printed the train options
        raise click.BadParameter(f"{text!r}: --help is not a training option (the list above is)",
                                 param_hint="'--config'") from None
    except click.ClickException as e:
        raise click.BadParameter(f"{text!r}: {' '.join(e.format_message().split())}", param_hint="'--config'") from None
    return StudyConfig(text, TrainConfig(**ctx.params))


@main.command("study")
@click.option("--repeats", type=IntRange(min=1), default=None,
              help="Runs of every configuration, same seed; the study runs repeat 1 of each, then repeat 2, ... "
                   "[default with --config and no --seeds: 1]")
@click.option("--seeds", type=IntRange(min=1), default=None,
              help="Runs of every configuration, run i with its seed + i - 1 (init, data order, split); not --repeats.")
@click.option("--target", default=None,
              help="Quality target every run trains to or to its --max-steps cap ('val_loss<=3.0'; 'val_loss=3.0': <= "
                   "for a loss, >= for an accuracy), scored as MLPerf Training does, an MLPerf-style log per run "
                   "(docs/compare.md); the configurations need --eval-every N.")
@click.option("--config", "configs", multiple=True,
              help='The llmeff train options of one configuration, quoted, e.g. --config "--model llama-tiny '
                   '--micro-batch-size 4"; give --config once per configuration [default with --seeds: one '
                   'configuration of llmeff train\'s defaults].')
@click.option("--experiment", default=None,
              help="MLflow experiment of the study's parent run and its children [default: the one the "
                   "configurations name, else MLflow's current].")
def study_cmd(repeats: int | None, seeds: int | None, target: str | None, configs: tuple[str, ...],
              experiment: str | None) -> None:
    """Run each configuration N times, interleaved (A1 B1 A2 B2 ...), as children of one MLflow parent run.

    Each child is a normal llmeff train run; llmeff compare takes a configuration's children as its
    repeats (mean and 95% Student-t interval across them). docs/stability.md, "Repeats"; with --target,
    docs/compare.md, "Time to target, MLPerf-style".
    """
    from mlflow_llmeff.train.study import run_study, summary_lines

    if repeats is None and seeds is None and configs:
        repeats = 1  # one run of each configuration: a study over levers (--config "--optimizer adamw8bit" ...)
    if (repeats is None) == (seeds is None) or not (configs or seeds):
        raise click.UsageError("give --repeats N (the same seed) or --seeds N (seed + i - 1 for run i), and with "
                               "--repeats a --config per configuration (llmeff train options)")
    from mlflow_llmeff.tracking.delivery import Unreachable

    parsed = [_study_config(text) for text in configs] or [_study_config("")]
    try:
        result = run_study(parsed, repeats or seeds, experiment=experiment, echo=click.echo, seeds=seeds is not None,
                           target=target)
        import mlflow

        lines = summary_lines(mlflow.MlflowClient(), result)
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    except Unreachable as e:  # one line: the server, the bound, what was kept (the outbox)
        click.echo(f"Error: {e}", err=True)
        raise SystemExit(1) from None
    for line in lines:
        click.echo(line)
    code = 1 if result.failed else 0
    if code:
        click.echo(f"Error: {len(result.failed)} of {len(result.children)} runs of the study failed "
                   f"(parent run {result.parent_run_id} says which)", err=True)
    if _PROCESS_ENTRY["on"]:  # logged and done: return now, not after torch's module teardown
        from mlflow_llmeff.monitor.lifecycle import exit_now

        exit_now(code)
    raise SystemExit(code)


# ---- flops / peak commands (FLOPs per token, measured matmul peak)
@main.command("flops")
@click.option("--model", required=True,
              help="Preset name (llama-7b, gpt2-124m, ...), a local HF model directory (config.json) or a hub id.")
@click.option("--seq-len", type=IntRange(min=1), required=True, help="Tokens per sequence.")
@click.option("--micro-batch-size", type=IntRange(min=1), default=1, show_default=True,
              help="Sequences per micro-batch per device.")
@click.option("--grad-accum", type=IntRange(min=1), default=1, show_default=True,
              help="Micro-batches per optimizer step.")
@click.option("--num-processes", type=IntRange(min=1), default=1, show_default=True,
              help="Data-parallel devices.")
@click.option("--lora-rank", type=IntRange(min=1), default=None,
              help="LoRA rank r: the base model frozen, adapters of rank r on --lora-targets of every layer.")
@click.option("--lora-targets", default=None,
              help="Comma-separated module names LoRA adapts, e.g. q_proj,v_proj (with --lora-rank).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text.")
def flops_cmd(model: str, seq_len: int, micro_batch_size: int, grad_accum: int, num_processes: int,
              lora_rank: int | None, lora_targets: str | None, as_json: bool) -> None:
    """Parameters and training FLOPs per token / per step (megatron and palm conventions).

    The formula reads the config's own fields for the families it knows; any other causal LM
    is counted once on the meta device (FlopCounterMode, no weights); the output says which.
    With --lora-rank and --lora-targets the base weights are frozen (no weight gradients, input
    gradients only above the lowest adapter) and the adapters' matmuls are added.
    """
    import json

    from mlflow_llmeff.meters.flopcount import resolve
    from mlflow_llmeff.calc.flops import FORMULA_TAGS, Trainable, flops_summary, param_counts
    from mlflow_llmeff.models.presets import load_config

    try:
        config = load_config(model)
    except Exception as e:  # noqa: BLE001 - a bad directory or an unreachable hub: one line, no trace
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise click.ClickException(msg if isinstance(e, ValueError) else f"model {model!r}: {type(e).__name__}: {msg}")
    if (lora_rank is None) != (lora_targets is None):
        raise click.BadParameter("give --lora-rank and --lora-targets together (e.g. --lora-rank 8 "
                                 "--lora-targets q_proj,v_proj)")
    source = resolve(config)
    if source.flops is None:
        raise click.ClickException(f"model {model!r}: no FLOPs per token ({source.note})")
    try:
        trainable = None
        if lora_rank is not None:
            if source.method != "formula":
                raise ValueError(f"LoRA FLOPs need the formula's per-matrix shapes; {source.note}")
            trainable = Trainable.lora(source.flops, lora_rank, lora_targets,
                                       params_total=param_counts(source.flops)["total"])
        s = flops_summary(source.flops, seq_len, micro_batch_size, grad_accum, num_processes, trainable)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None
    trained = trainable.describe() if trainable is not None else "every parameter (6 FLOPs per weight per token)"
    s = {"model": model, "method": source.method, "method_note": source.note, "trainable": trained, **s}
    if as_json:
        click.echo(json.dumps(s, indent=1))
        return
    active = f"{s['params_active']:,}" if s["params_active"] is not None else "unknown (MoE counted on meta)"
    click.echo(f"model {model}: {s['params_total']:,} params total, {s['params_non_embedding']:,} "
               f"non-embedding, {active} active")
    click.echo(f"seq_len {seq_len}, {s['tokens_per_step']:,} tokens/step "
               f"({micro_batch_size} x {grad_accum} x {num_processes} sequences)")
    for conv in ("megatron", "palm"):
        click.echo(f"{conv:>8}: {s[f'flops_per_token_{conv}'] / 1e9:.4f} GFLOP/token, "
                   f"{s[f'flops_per_step_{conv}'] / 1e12:.4f} TFLOP/step "
                   f"({s[f'flops_per_step_per_device_{conv}'] / 1e12:.4f} per device)")
    share = f"{s['trainable_share']:.4%}" if s["trainable_share"] is not None else "unknown"
    click.echo(f"trainable share {share}: {trained}")
    click.echo(f"method: {source.note}")
    click.echo(f"formula: {FORMULA_TAGS['megatron']}")


@main.command("peak")
@click.option("--dtype", type=click.Choice(["fp32", "tf32", "bf16", "fp16", "fp8"]), default=None,
              help="Compute dtype [default: bf16 on CUDA, fp32 on CPU].")
@click.option("--device", default=None, help="cpu, cuda or cuda:<index> [default: cuda when available].")
@click.option("--refresh", is_flag=True, help="Measure again even when a cached value exists.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text.")
def peak_cmd(dtype: str | None, device: str | None, refresh: bool, as_json: bool) -> None:
    """Measure (or read the cache of) the achievable matmul TFLOP/s, next to the datasheet peak."""
    import json

    from mlflow_llmeff.meters.hardware import default_cache_dir, detect_accelerator, matmul_peak, resolve_peak

    info = detect_accelerator(device_type=None if device is None else device.split(":")[0])
    assumed = {}  # input -> what was taken and why (as the plan's and the run's llmeff.assumed)
    if device is None:
        assumed["device"] = (f"{info.device_type} ({'a CUDA device is present' if info.device_type == 'cuda' else 'no CUDA device'}"
                             ": pass --device)")
    device = device or info.device_type
    if dtype is None:
        dtype = "bf16" if info.device_type == "cuda" else "fp32"
        assumed["dtype"] = f"{dtype} (the default on {info.device_type}: pass --dtype)"
    try:
        m = matmul_peak(dtype, device, refresh=refresh)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None
    measured = m.tflops
    peak, source = resolve_peak(info, dtype)
    out = {"device": info.name, "short": info.short, "dtype": dtype, "measured_tflops": measured,
           "from_cache": m.from_cache, "measured_at": m.measured_at, "measured_on": m.key,
           "datasheet_tflops": peak, "datasheet_source": source,
           "measured_fraction_of_datasheet": None if peak is None else measured / peak,
           "cache": str(default_cache_dir() / "mamf.json"), "assumed": assumed}
    if as_json:
        click.echo(json.dumps(out, indent=1))
        return
    when = (f" (read from the cache: measured {m.measured_at or 'at an unknown time'} on {m.key}; "
            "--refresh measures again)" if m.from_cache else "")
    click.echo(f"{info.name} ({info.short}), {dtype}: measured {measured:.4g} TFLOP/s{when}")
    if peak is None:
        click.echo(f"datasheet peak: {source}")
    else:
        click.echo(f"datasheet peak: {peak:g} TFLOP/s dense ({measured / peak:.1%} reached); {source}")
    click.echo(f"cache: {out['cache']}")
    if assumed:
        click.echo("assumed: " + "; ".join(f"{k}: {v}" for k, v in assumed.items()))


# ---- energy / carbon / cost commands
@main.command("energy-probe")
@click.option("--measure-energy", type=click.Choice(["auto", "nvml", "rapl", "none"]), default="auto",
              show_default=True, help="Energy meter to build (as the measure_energy parameter).")
@click.option("--country-iso-code", default="USA", show_default=True,
              help="ISO alpha-3 country for codecarbon's grid intensity.")
@click.option("--cloud-provider", default=None, help="Cloud provider code as in codecarbon's impact.csv (gcp, aws, azure).")
@click.option("--cloud-region", default=None, help="Cloud region, e.g. us-central1.")
def energy_probe_cmd(measure_energy: str, country_iso_code: str, cloud_provider: str | None,
                     cloud_region: str | None) -> None:
    """Say how this process would measure energy and which grid intensity carbon would use."""
    import torch  # noqa: F401  (imported first so the meter sees this process's CUDA devices)

    from mlflow_llmeff.meters.carbon import grid_intensity_g_per_kwh
    from mlflow_llmeff.meters.energy import make_meter

    try:
        meter = make_meter(measure_energy, sampling_thread=False)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None
    try:
        click.echo(f"energy.source: {meter.source} ({meter.num_devices} device(s))")
        if meter.why:
            click.echo(f"energy.why: {meter.why}")
    finally:
        meter.close()
    try:
        g, src = grid_intensity_g_per_kwh(country_iso_code=country_iso_code, cloud_provider=cloud_provider,
                                          cloud_region=cloud_region)
        click.echo(f"carbon.intensity_g_per_kwh: {g:g} ({src})")
    except ImportError as e:
        click.echo(f"carbon: none (codecarbon not installed: {e})")


@main.command("models")
@click.option("--seq-len", type=IntRange(min=2), default=2048, show_default=True,
              help="Sequence length of the FLOPs and activation figures (capped at a model's positions).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON list instead of a table.")
def models_cmd(seq_len: int, as_json: bool) -> None:
    """List the model presets: shape, parameters, FLOPs per token and training memory."""
    import json

    from mlflow_llmeff.planning.plan import models_table

    rows = models_table(seq_len)
    if as_json:
        click.echo(json.dumps(rows, indent=1))
        return
    click.echo(f"{'preset':<11} {'params':>15} {'layers':>6} {'hidden':>6} {'seq':>5} {'GFLOP/token':>11} "
               f"{'train GiB':>9}  shape from")
    for r in rows:
        click.echo(f"{r['preset']:<11} {r['params']:>15,} {r['layers']:>6} {r['hidden']:>6} {r['seq_len']:>5} "
                   f"{r['flops_per_token'] / 1e9:>11.4g} {r['train_memory_gib']:>9.1f}  {r['source']}")
    click.echo(f"GFLOP/token: training FLOPs per token (megatron convention) at seq = min({seq_len}, the model's "
               "positions). train GiB: one device, bf16 mixed precision with AdamW, the peak of a step "
               "(the larger of the optimizer step with its temporaries and the backward at the loss, one sequence; "
               "docs/memory.md), without the allocator margin (llmeff plan gives any configuration and lever).")


@main.command("sync")
@click.argument("folder", type=click.Path(file_okay=False))
def sync_cmd(folder: str) -> None:
    """Send what a run could not deliver while its tracking server was down or did not answer (an
    outbox FOLDER: <checkpoint_dir>/outbox for llmeff train, $LLMEFF_OUTBOX_DIR or
    ~/.cache/mlflow_llmeff/outbox otherwise): create the runs it never created, send their points
    with their original timestamps, log their efficiency report, and end them with the status and
    end time they recorded."""
    from mlflow_llmeff.tracking.delivery import apply_request_settings
    from mlflow_llmeff.tracking.outbox import deliver_outbox

    apply_request_settings()
    try:
        delivered = deliver_outbox(folder)
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    except Exception as e:  # noqa: BLE001 - the server still does not answer: one line, files kept
        raise click.ClickException(f"the tracking server did not take the outbox ({type(e).__name__}: "
                                   f"{str(e).splitlines()[0] if str(e) else ''}); the files are kept") from None
    if not delivered:
        click.echo(f"nothing to send in {folder}")
    for d in delivered:
        was = f" (local run {d.local_id} until now)" if d.local_id else ""
        click.echo(f"run {d.run_id}{was}: {d.entries} entries sent" + (f", ended {d.status}" if d.status else ""))


@main.command("prices")
def prices_cmd() -> None:
    """Print the dated default device-hour price table (pass device_hour_usd to override)."""
    from mlflow_llmeff.calc.cost import DEFAULT_DEVICE_HOUR_USD

    for short, row in DEFAULT_DEVICE_HOUR_USD.items():
        click.echo(f"{short:<16} ${row.usd:>5.2f}/device-hour  {row.offer}; {row.source} "
                   f"(listed {row.listed_on}, read {row.read_on})")


# ---- eval commands (MMLU, HellaSwag; mlflow_llmeff/evals)
@main.command("eval")
@click.option("--model", "model_dir", required=True, help="Hugging Face causal LM directory or hub id.")
@click.option("--tokenizer", "tokenizer_name", default=None,
              help="Tokenizer directory or id (default: --model); 'byt5' = ByT5Tokenizer(extra_ids=0), no files.")
@click.option("--tasks", default="mmlu,hellaswag", show_default=True,
              help="Comma-separated: mmlu, hellaswag, mmlu_<subject>.")
@click.option("--num-fewshot", default=0, show_default=True, type=int, help="MMLU few-shot examples (0-5).")
@click.option("--limit", default=None, type=int, help="Score only the first N documents of each task.")
@click.option("--subset-seed", default=None, type=int,
              help="With --limit: score N documents drawn with this seed instead of the first N: a training "
                   "run's --seed with its --eval-limit gives the documents its in-training evals scored.")
@click.option("--data-dir", default=None,
              help="Local data directory (mmlu/dev, mmlu/test, hellaswag/hellaswag_val.jsonl); default "
                   "$LLMEFF_DATA_DIR, else the hub datasets cais/mmlu and Rowan/hellaswag (or their cache).")
@click.option("--batch-size", default=8, show_default=True, type=int, help="Sequences per forward pass.")
@click.option("--device", default=None, help="torch device (default: cuda if available, else cpu).")
@click.option("--output-json", default=None, type=click.Path(dir_okay=False),
              help="Write metrics and per-example records here.")
@click.option("--run-id", default=None,
              help="Log into this run (e.g. the training run whose --save-model this is), at its last step, "
                   "so comparisons show this evaluation; tag llmeff.eval.last says what was scored.")
@click.option("--subject-metrics/--no-subject-metrics", default=False, show_default=True,
              help="Also log the 57 per-subject MMLU scores as metrics; by default they are one table artifact "
                   "(eval/mmlu_subjects/...) beside the aggregate eval/mmlu/acc.")
def eval_cmd(model_dir: str, tokenizer_name: str | None, tasks: str, num_fewshot: int, limit: int | None,
             subset_seed: int | None, data_dir: str | None, batch_size: int, device: str | None,
             output_json: str | None, run_id: str | None, subject_metrics: bool) -> None:
    """Score MMLU / HellaSwag with lm-evaluation-harness 0.4.x definitions; log to the active MLflow run, if any."""
    import json

    import torch
    import transformers

    from mlflow_llmeff.evals import evaluate, log_to_mlflow
    from mlflow_llmeff.evals.api import check_inputs, check_run, eval_documents, log_to_run

    if subset_seed is not None and limit is None:
        raise click.UsageError(f"--subset-seed {subset_seed} needs --limit N (the subset's size per task); "
                               f"without --limit every document is scored")
    try:  # the run, names, few-shot and data files are checked before any model is loaded
        found = check_run(run_id) if run_id else None
        check_inputs(tasks, data_dir=data_dir, num_fewshot=num_fewshot)
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    try:
        if tokenizer_name == "byt5":
            tok = transformers.ByT5Tokenizer(extra_ids=0)
        else:
            tok = transformers.AutoTokenizer.from_pretrained(tokenizer_name or model_dir)
    except Exception as e:  # noqa: BLE001 - one line, not the library's stack trace
        raise click.UsageError(f"no tokenizer could be loaded from {tokenizer_name or model_dir!r} "
                               f"({type(e).__name__}); pass --tokenizer DIR, or --tokenizer byt5 for models "
                               f"trained from the byte-level presets") from None
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    except Exception as e:  # noqa: BLE001
        raise click.UsageError(f"--model {model_dir!r} is not a loadable causal LM directory or hub id "
                               f"({type(e).__name__}: {shorten(str(e).splitlines()[0], 160)})") from None
    if found is False:
        click.echo(f"llmeff: the tracking server did not answer when run {run_id} was looked up; scoring goes on, "
                   "and the results wait in the outbox if it still does not answer")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        result = evaluate(model, tok, tasks, data_dir=data_dir, num_fewshot=num_fewshot, limit=limit,
                          batch_size=batch_size, device=device, subset_seed=subset_seed, progress=True)
    except ValueError as e:
        raise click.UsageError(str(e)) from e
    click.echo(result.table())
    click.echo(f"{len(result.examples)} documents in {result.seconds:.1f} s ({result.examples_per_sec:.1f} docs/s)")
    if output_json:
        with open(output_json, "w", encoding="utf-8") as f:
            json.dump(result.to_dict(), f, indent=1)
    if run_id:
        note = f"llmeff eval: {tasks}, documents {eval_documents(limit, subset_seed)}, {num_fewshot}-shot"
        try:
            step = log_to_run(result, run_id, note, found=found, subject_metrics=subject_metrics)
        except ValueError as e:
            raise click.UsageError(str(e)) from None
        if step is not None:
            click.echo(f"logged to run {run_id} at step {step} (its last train/tokens step)")
    elif log_to_mlflow(result, subject_metrics=subject_metrics):
        click.echo("logged to the active MLflow run")
    else:
        click.echo("not logged to MLflow: no active run (--run-id ID logs into a run; under `mlflow run . -e eval` "
                   "it logs to that run)")


# ---- plan command (dry run: parameters, FLOPs, memory per device, predictions)
@main.command("plan")
@_train_options
@click.option("--accelerator", "accelerator_short", default=None,
              help="plan for this accelerator short name (e.g. H100-SXM); default: this machine's")
@click.option("--json", "as_json", is_flag=True, help="print JSON")
def plan_cmd(accelerator_short, as_json, **kwargs) -> None:
    """Plan a run without training: parameters, FLOPs/step, memory per device, predicted time and cost.

    Memory is the step's peak per device (the largest of forward, backward and optimizer step:
    ``memory_peak_gib``, ``memory_peak_phase``) for the run's levers: ``--optimizer`` (its state as
    stored and its step's temporaries), ``--weights`` (fp32 master or pure bf16), ``--attn-implementation``
    and ``--activation-checkpointing``; docs/memory.md lists every term.
    """
    from mlflow_llmeff.train.config import TrainConfig
    from mlflow_llmeff.train.launch import dry_run

    # DeepSpeed is not imported (its import logs "Setting accelerator to CPU" to stdout, and it need
    # not be installed): the plan's figures are arithmetic, and engine_installed says whether it is
    try:
        raise SystemExit(dry_run(TrainConfig(**kwargs), accelerator_short=accelerator_short, as_json=as_json))
    except ValueError as e:
        raise click.UsageError(str(e)) from None


# ---- compare command (mlflow_llmeff/report)
@main.command("compare")
@click.option("--experiment", required=True, help="Experiment name (or id) whose runs are compared.")
@click.option("--filter", "filter_string", default="", show_default=False,
              help="MLflow search filter, e.g. \"tags.`llmeff.precision` = 'bf16'\" ('' = every run).")
@click.option("--group-by", default="accelerator.name,parallelism.strategy,precision", show_default=True,
              help="Comma-separated llmeff tag names the plots group by.")
@click.option("--baseline", default=None, help="Run id of the scaling-efficiency baseline [default: fewest devices].")
@click.option("--out", "out_dir", default="llmeff-compare", show_default=True, type=click.Path(file_okay=False),
              help="Folder for report.md, report.csv, report.html and the PNGs.")
@click.option("--log-to-mlflow", is_flag=True, help="Also log the report as artifacts of one comparison run.")
@click.option("--ui-url", default=None,
              help="MLflow UI address for run links [default: the tracking URI when it is a server, "
                   "else http://127.0.0.1:5000].")
def compare_cmd(experiment, filter_string, group_by, baseline, out_dir, log_to_mlflow, ui_url) -> None:
    """Compare runs on efficiency: table, scaling efficiency, Pareto fronts (reads any tracking URI)."""
    from mlflow_llmeff.report.compare import compare
    from mlflow_llmeff.report.mlperf import text_lines
    from mlflow_llmeff.report.render import headline_text, reliability_text, scaling_lines
    from mlflow_llmeff.tracking.delivery import Unreachable

    try:
        rep, paths, run_id = compare(experiment, filter_string=filter_string, group_by=group_by,
                                     baseline=baseline or None, out_dir=out_dir, log_to_mlflow=log_to_mlflow,
                                     ui_base=ui_url)
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    except Unreachable as e:  # one line: the server and the bound; nothing compared
        click.echo(f"Error: {e}; nothing was compared", err=True)
        raise SystemExit(1) from None
    for w in rep.warnings:
        click.echo(f"WARNING: {w.text()}", err=True)
    for r in rep.runs:
        if rep.missing_summary(r):
            click.echo(f"marked row: {r.label} ({r.run_id}): {rep.row_note(r)}", err=True)
    n = len(rep.runs)
    click.echo(f"{n} run{'s' if n != 1 else ''} of {rep.selection.experiment_name!r} compared: {rep.selection.scope()}")
    click.echo("Configurations, best first (repeats as samples; within noise = intervals overlap, not ranked):")
    click.echo(headline_text(rep))
    for line in text_lines(rep.targets):  # time, energy and cost to each target, MLPerf-scored
        click.echo(line)
    reliability = reliability_text(rep)
    if reliability:
        click.echo(reliability)
    for line in scaling_lines(rep) or ["scaling efficiency: no runs that differ only in device count"]:
        click.echo(line)
    click.echo(f"report: {os.path.join(out_dir, 'report.html')} ({len(paths)} files)")
    if run_id:
        click.echo(f"logged as comparison run {run_id}")


# ---- prepare-data command (tokenize ahead of time into the cache llmeff train reads)
@main.command("prepare-data")
@click.option("--dataset", default="python-docs", show_default=True,
              help="'python-docs', a .txt/.jsonl/.json/.parquet file or directory, or a HF dataset id.")
@click.option("--model", default="llama-tiny", show_default=True,
              help="Preset or model directory / hub id whose tokenizer is used (as llmeff train --model).")
@click.option("--seq-len", type=IntRange(min=2), default=128, show_default=True, help="Tokens per block.")
@click.option("--packing", type=click.BOOL, default=True, show_default=True,
              help="Join documents into full seq_len blocks (true) or one padded row per document (false).")
@click.option("--text-field", default="text", show_default=True, help="Text column of .jsonl/.parquet/hub data.")
@click.option("--data-cache-dir", default="", help="Token cache directory ('' = $LLMEFF_CACHE_DIR or "
                                                   "~/.cache/mlflow_llmeff/tokens), as llmeff train --data-cache-dir.")
@click.option("--tokenize-workers", type=IntRange(min=0), default=0, show_default=True,
              help="Tokenizing processes (datasets map num_proc; 0 = one per CPU for large data).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text.")
def prepare_data_cmd(dataset: str, model: str, seq_len: int, packing: bool, text_field: str, data_cache_dir: str,
                     tokenize_workers: int, as_json: bool) -> None:
    """Tokenize and pack a dataset into the on-disk cache that llmeff train with the same settings reads.

    Run it ahead of time (e.g. on a CPU node with the cache directory on shared storage); it prints
    the documents, tokens and blocks and the cache path, and whether the cache was already there.
    """
    import json

    from mlflow_llmeff.train.data import tokenize_to_cache
    from mlflow_llmeff.models.build import load_tokenizer

    if dataset == "synthetic":
        raise click.UsageError("dataset 'synthetic' is generated at start-up; there is nothing to prepare")
    try:
        tok = load_tokenizer(model)
    except Exception as e:  # noqa: BLE001 - one line, not the library's stack trace
        raise click.UsageError(f"--model {model!r}: no tokenizer could be loaded ({type(e).__name__}); use a preset "
                               f"(llmeff models) or a model directory with its tokenizer") from None
    try:
        c = tokenize_to_cache(dataset, tok, seq_len, packing=packing, text_field=text_field,
                              cache_dir=data_cache_dir or None, num_proc=tokenize_workers)
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    out = {"dataset": dataset, "cache_path": c.path, "cache_hit": c.hit, "documents": c.meta.get("documents"),
           "tokens": c.tokens, "blocks": c.blocks, "seq_len": seq_len, "packing": packing, "seconds": round(c.seconds, 3),
           "num_proc": c.meta.get("num_proc")}
    if as_json:
        click.echo(json.dumps(out))
        return
    how = "already cached" if c.hit else f"tokenized in {c.seconds:.1f} s with {out['num_proc']} process(es)"
    layout = "full blocks" if packing else "padded rows"
    click.echo(f"{dataset}: {out['documents']:,} documents -> {c.tokens:,} tokens in {c.blocks:,} {layout} of "
               f"seq_len {seq_len}; {how}")
    click.echo(f"cache: {c.path}")
