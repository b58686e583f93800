"""``mlflow_llmeff.autolog()``: the standard efficiency metrics for HF Trainer, Accelerate and plain PyTorch loops.

Built on MLflow's autologging utilities (``mlflow.utils.autologging_utils``): the integration is
registered with ``autologging_integration("mlflow_llmeff")`` and every patch goes through
``safe_patch``, so ``autolog(disable=True)`` reverts all of them, ``silent=True`` silences our
warnings, and an exception in our code is logged as a warning while the user's call goes on
(``MLFLOW_AUTOLOGGING_TESTING=true`` makes it raise, as for MLflow's own integrations).

What is patched (``safe_patch``; once-per-run entry points only, so the per-call cost of
``safe_patch``, ~30 us, never lands on the hot path):

* ``transformers.Trainer.__init__``: adds our ``TrainerCallback`` (steps from ``on_step_end``,
  ``train/loss`` from ``on_log``, summary at ``on_train_end``, before the Trainer's own MLflow
  callback ends the run, so both share one run and no key is logged twice);
* ``accelerate.Accelerator.prepare`` (the prepared model gets the token hook) and
  ``Accelerator.end_training`` (summary, on every rank);
* ``torch.optim.Optimizer.__init__`` (arms discovery of the model a new optimizer trains);
* ``torch.distributed.destroy_process_group`` (summary on every rank before the group goes);
* ``mlflow.end_run`` (summary before the run the metrics go to ends; also at interpreter exit);
* ``ray.train.report`` (a Ray Train worker): the meter's state goes into rank 0's checkpoint, and a
  restarted worker group continues the run from it (:mod:`mlflow_llmeff.autologging.ray`);
* ``torch.utils.data.DataLoader.__iter__`` and Accelerate's prepared loaders' ``__iter__`` (once an
  epoch; not through ``safe_patch``, which returns the original's result: set on the classes and
  restored by the cleanup callback): the iterator a loop gets times each batch it awaits as the
  monitor's ``data_wait`` (:mod:`mlflow_llmeff.autologging.batches`; one pause a batch).

Hot path (torch hooks, removed by the cleanup callback that ``revert_patches`` runs):

* one global optimizer step post-hook (``register_optimizer_step_post_hook``): one optimizer step
  = one step of the first optimizer that steps after counting began (Accelerate's wrapper only
  steps the torch optimizer at gradient-sync boundaries, so accumulation is handled);
* one forward hook (with kwargs) on the root model: counts ``input_ids`` / ``attention_mask`` /
  ``labels`` of every training forward (``module.training`` and grad enabled; evaluation under
  ``no_grad`` or ``eval()`` is not counted) and reads ``output.loss`` when there is one;
* discovery: after an optimizer is created and while no model is hooked, global forward hooks find
  the outermost module called with token ids, hook it and remove themselves (they cost only during
  the first forward).

The torch hooks and the state of one enablement are :mod:`mlflow_llmeff.autologging.hooks`; this
module holds ``autolog()`` and the patches of the once-per-run entry points.

The public entry is ``mlflow_llmeff.autolog`` (this module's :func:`autolog`, exported lazily by
the package); the module is named ``autologging`` so that the function and the module never clash.
"""

from __future__ import annotations

import logging
import math
import sys
import weakref
from contextlib import contextmanager

from mlflow.utils.autologging_utils import autologging_integration, autologging_is_disabled, safe_patch

from mlflow_llmeff.autologging import ray as ray_train
from mlflow_llmeff.autologging.batches import ACCELERATE_LOADERS
from mlflow_llmeff.autologging.hooks import INTEGRATION, _Session, _Settings

__all__ = ["autolog", "INTEGRATION", "is_enabled", "active_monitor", "pause", "HIDDEN_FROM_AUTOLOG",
           "HIDDEN_FROM_MONITOR"]

log = logging.getLogger(__name__)

#: What ``llmeff train`` logs that an explicit :class:`~mlflow_llmeff.monitor.meter.EfficiencyMonitor`
#: cannot know unless the caller passes it (``tags=``, ``params=``): key (or ``params``) -> why.
HIDDEN_FROM_MONITOR = {
    "llmeff.dataset": "the loop's data source is the loop's own (pass tags={'llmeff.dataset': ...})",
    "llmeff.dataset.kind": "likewise",
    "llmeff.tokenizer": "the loop's tokenizer is the loop's own",
    "llmeff.eval.batch_size": "the loop's evaluations are the loop's own (pass tags={'llmeff.eval.batch_size': ...})",
    "llmeff.eval.num_fewshot": "likewise (pass tags={'llmeff.eval.num_fewshot': ...} when the loop scores MMLU)",
    "params": "llmeff train logs its settings as params; a loop's settings are the caller's to log (params=)",
}
#: What ``llmeff train`` logs that a user's loop hides from ``autolog()``: key, key prefix or
#: ``params`` -> why. Listed in docs/autolog.md; a test checks the three paths against it.
HIDDEN_FROM_AUTOLOG = {
    **HIDDEN_FROM_MONITOR,
    "eval/": ("evaluations a loop runs itself are timed (a forward outside training opens an eval pause) but "
              "their results are not seen; HF Trainer's evaluate() is (eval_loss -> eval/val_loss); report "
              "others with mlflow_llmeff.active_monitor().log_eval(...)"),
    "ttq/": "time-to-quality needs those evaluation results",
}

_SESSION: _Session | None = None


def is_enabled() -> bool:
    """True while ``mlflow_llmeff.autolog()`` is enabled in this process."""
    return _SESSION is not None and not autologging_is_disabled(INTEGRATION)


def active_monitor():
    """The :class:`~mlflow_llmeff.monitor.meter.EfficiencyMonitor` of the training in progress, or None."""
    return _SESSION.monitor if _SESSION is not None else None


@contextmanager
def pause(category: str):
    """Declare non-step work to autolog's meter: ``with mlflow_llmeff.pause("checkpoint_save"): ...``.

    A no-op while no training is being followed. Categories as
    :meth:`~mlflow_llmeff.monitor.meter.EfficiencyMonitor.pause`.

    Raises:
        ValueError: for an unknown category (also when no training is followed).
    """
    from mlflow_llmeff.calc.goodput import PAUSES

    if category not in PAUSES:
        raise ValueError(f"pause category {category!r} is not accepted; use one of: {', '.join(PAUSES)}")
    mon = active_monitor()
    if mon is None or mon.finished:
        yield
        return
    with mon.pause(category):
        yield


# ------------------------------------------------------------------------------------ patches
def _session() -> _Session | None:
    return _SESSION if is_enabled() else None


def _patched_optimizer_init(original, self, *args, **kwargs):
    original(self, *args, **kwargs)
    s = _session()
    if s is not None:
        s.optimizer = weakref.ref(self)
        s.arm_discovery()


def _patched_prepare(original, self, *args, **kwargs):
    result = original(self, *args, **kwargs)
    s = _session()
    if s is not None:
        import torch

        s.accelerator = weakref.ref(self)
        for obj in result if isinstance(result, tuple) else (result,):
            if isinstance(obj, torch.nn.Module):
                s.prepared.add(obj)
                s.attach(obj)
    return result


def _patched_end_training(original, self, *args, **kwargs):
    s = _session()
    if s is not None:
        s.finish(collective=True)
    return original(self, *args, **kwargs)


def _patched_destroy_process_group(original, *args, **kwargs):
    s = _session()
    if s is not None:
        s.finish(collective=True)
    return original(*args, **kwargs)


def _patched_end_run(original, *args, **kwargs):
    from mlflow_llmeff.monitor import lifecycle

    s = _session()
    status = str(kwargs.pop("status", args[0] if args else "FINISHED"))
    if lifecycle.exiting() and status == "FINISHED":
        status = lifecycle.exit_status()  # MLflow's exit hook says FINISHED even after a crash or SIGTERM
    if s is not None and s.monitor is not None:
        import mlflow

        active = mlflow.active_run()
        mon = s.monitor
        if active is not None:
            s.finish(collective=False, run_id=active.info.run_id, status=status)
            if mon.run_id == active.info.run_id and mon.end_run_later(status):
                # the server did not take the run's points: its end waits in the outbox with them,
                # instead of a request that would wait on the server again
                from mlflow_llmeff.tracking.runs import RunHandle, release

                release(RunHandle(active.info.run_id, owned=False, fluent=True, resumed=False))
                return None
    return original(status, *args[1:], **kwargs)


def _patched_trainer_train(original, self, *args, **kwargs):
    import time

    s = _session()
    if s is not None:
        s.trainer_started = time.perf_counter()  # the run's wall time starts with train(), as the Trainer's
    return original(self, *args, **kwargs)


def _paused(category: str):
    """A patch that runs the original inside ``monitor.pause(category)`` while a monitor is open."""

    def patched(original, self, *args, **kwargs):
        s = _session()
        mon = s.monitor if s is not None else None
        if mon is None or mon.finished:
            return original(self, *args, **kwargs)
        with mon.pause(category):
            return original(self, *args, **kwargs)

    return patched


def _patched_trainer_init(original, self, *args, **kwargs):
    original(self, *args, **kwargs)
    s = _session()
    if s is not None:
        cb_cls, first_cls = _trainer_callbacks()
        cb = cb_cls()
        cb.trainer_callbacks = self.callback_handler.callbacks  # to tell whether its MLflowCallback made the run
        self.add_callback(cb)  # after the Trainer's MLflowCallback: its run exists at on_train_begin
        self.callback_handler.callbacks.insert(0, first_cls(cb))  # summary before it ends the run


def _name_trainer_run(args, monitor, callbacks) -> None:
    """Name the run the Trainer's own MLflow callback started (``report_to="mlflow"``) from its
    configuration, unique in its experiment, as autolog names the runs it starts itself.

    That callback starts the run with ``run_name=args.run_name``, None unless the user gives one, so
    MLflow made up a name (``overjoyed-slug-911``; issue 31). A ``run_name`` the user gave, and a
    run the callback did not start (the user's own), keep their names. Never raises (a name is
    cosmetic)."""
    if getattr(args, "run_name", None) or monitor.run_id is None:
        return
    if not any(type(c).__name__ == "MLflowCallback" and getattr(c, "_auto_end_run", False) for c in callbacks):
        return
    try:
        import mlflow

        active = mlflow.active_run()
        if active is None or active.info.run_id != monitor.run_id:
            return
        monitor.name_adopted_run(active.info.experiment_id)
    except Exception:  # noqa: BLE001 - the run keeps MLflow's name
        log.debug("could not name the Trainer's run", exc_info=True)


_TRAINER_CALLBACKS = None
#: Trainer evaluation outputs that are timings, not quality: not logged under eval/.
_TRAINER_EVAL_SKIP = ("eval_runtime", "eval_samples_per_second", "eval_steps_per_second", "eval_model_preparation_time")


def _trainer_origin(args) -> str:
    """``llmeff.optimizer``'s origin for a Trainer: ``transformers Trainer optim=<args.optim>`` (its value)."""
    optim = getattr(args, "optim", None)
    return f"transformers Trainer optim={getattr(optim, 'value', optim) if optim is not None else 'unknown'}"


def _trainer_loss_weighting(args, model) -> str:
    """``llmeff.loss.weighting`` of a Trainer run, as transformers' Trainer decides it (``trainer.py``,
    ``model_accepts_loss_kwargs``: the unwrapped model's ``accepts_loss_kwargs``, else a ``**kwargs``
    forward; ``_get_num_items_in_batch``: across devices with ``average_tokens_across_devices``)."""
    import inspect

    inner = model
    for attr in ("module", "base_model", "model"):  # DDP/FSDP, then peft's wrappers
        if hasattr(inner, "accepts_loss_kwargs") or not hasattr(inner, attr):
            break
        inner = getattr(inner, attr)
    accepts = getattr(inner, "accepts_loss_kwargs", None)
    if accepts is None:
        try:
            accepts = any(p.kind == inspect.Parameter.VAR_KEYWORD
                          for p in inspect.signature(inner.forward).parameters.values())
        except (TypeError, ValueError, AttributeError):
            return "unknown: the model's forward could not be read"
    if not accepts:
        return ("mean of micro-batch means: the model's forward takes no loss kwargs, so transformers' Trainer "
                "passes no num_items_in_batch")
    across = bool(getattr(args, "average_tokens_across_devices", False))
    return ("token-weighted: transformers' Trainer passes num_items_in_batch (loss-bearing tokens of the step's "
            f"micro-batches{', counted across devices' if across else ', on each device'})")


def _trainer_callbacks():
    """Our TrainerCallback classes (defined on first use: importing transformers is slow)."""
    global _TRAINER_CALLBACKS
    if _TRAINER_CALLBACKS is not None:
        return _TRAINER_CALLBACKS
    from mlflow.utils.autologging_utils import ExceptionSafeClass
    from transformers import TrainerCallback

    from mlflow_llmeff import names

    class LlmeffTrainerCallback(TrainerCallback, metaclass=ExceptionSafeClass):
        """Standard efficiency metrics for ``Trainer.train()`` (added by ``mlflow_llmeff.autolog``)."""

        def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
            from mlflow_llmeff.monitor.conditions import infer_precision
            from mlflow_llmeff.monitor.meter import EfficiencyMonitor

            s = _session()
            if s is None:
                return
            s.finish(collective=True)  # a loop monitor left open before the Trainer started
            s.trainer_active, s.owner = True, "trainer"
            s.disarm_discovery()
            s.attach(model)
            precision = "bf16" if getattr(args, "bf16", False) else "fp16" if getattr(args, "fp16", False) \
                else infer_precision(model)
            s.monitor = EfficiencyMonitor(model=model, optimizer=optimizer, precision=precision,
                                          start_step=int(state.global_step), integration="trainer", track_loss=False,
                                          started_at=getattr(s, "trainer_started", None),
                                          optimizer_origin=_trainer_origin(args), **s.settings.monitor_kwargs())
            s.monitor.set_tags({names.LOSS_WEIGHTING: _trainer_loss_weighting(args, model)})
            _name_trainer_run(args, s.monitor, getattr(self, "trainer_callbacks", ()))

        def on_step_begin(self, args, state, control, optimizer=None, **kwargs):
            self.lr = None  # the rate this step uses: read before the scheduler steps at its end
            if optimizer is not None and getattr(optimizer, "param_groups", None):
                self.lr = float(optimizer.param_groups[0]["lr"])

        def on_step_end(self, args, state, control, **kwargs):
            s = _session()
            if s is not None and s.trainer_active and s.monitor is not None:
                s.monitor.step(learning_rate=getattr(self, "lr", None))

        def on_log(self, args, state, control, logs=None, **kwargs):
            s = _session()
            if s is not None and s.trainer_active and s.monitor is not None and logs and "loss" in logs:
                s.monitor.log_metrics({names.TRAIN_LOSS: float(logs["loss"])}, int(state.global_step))

        def on_evaluate(self, args, state, control, metrics=None, **kwargs):
            s = _session()
            if s is None or not s.trainer_active or s.monitor is None or not metrics:
                return
            values = {k[len("eval_"):]: float(v) for k, v in metrics.items()
                      if k.startswith("eval_") and isinstance(v, (int, float)) and k not in _TRAINER_EVAL_SKIP}
            if "loss" in values:  # the Trainer's eval_loss is the held-out loss: eval/val_loss
                values["val_loss"] = values.pop("loss")
                values["val_perplexity"] = math.exp(min(values["val_loss"], 700.0))
            s.monitor.log_eval(values, int(state.global_step))

        def finish(self):
            s = _session()
            if s is not None and s.trainer_active:
                s.finish(collective=True)
                s.trainer_active = False

    class LlmeffTrainerEnd(TrainerCallback, metaclass=ExceptionSafeClass):
        """First in the callback list: logs the summary before other callbacks end the run."""

        def __init__(self, main):
            self.main = main

        def on_train_end(self, args, state, control, **kwargs):
            self.main.finish()

    _TRAINER_CALLBACKS = (LlmeffTrainerCallback, LlmeffTrainerEnd)
    return _TRAINER_CALLBACKS


def _patch_transformers(module) -> None:
    s = _session()
    if s is None or "trainer" in getattr(s, "patched", ()):
        return
    s.patched = getattr(s, "patched", set()) | {"trainer"}
    safe_patch(INTEGRATION, module.Trainer, "__init__", _patched_trainer_init)
    safe_patch(INTEGRATION, module.Trainer, "train", _patched_trainer_train)
    for method, category in (("evaluate", "eval"), ("_save_checkpoint", "checkpoint_save"),
                             ("_load_from_checkpoint", "checkpoint_load")):
        if hasattr(module.Trainer, method):
            safe_patch(INTEGRATION, module.Trainer, method, _paused(category))


def _patch_accelerate_loaders(module) -> None:
    """Time the batches a loop awaits from Accelerate's prepared loaders (``accelerate.data_loader``)."""
    s = _session()
    if s is None or "accelerate_loaders" in getattr(s, "patched", ()):
        return
    s.patched = getattr(s, "patched", set()) | {"accelerate_loaders"}
    for name in ACCELERATE_LOADERS:
        cls = getattr(module, name, None)
        if cls is not None:
            s.loaders.patch(cls)


def _patch_accelerate(module) -> None:
    s = _session()
    if s is None or "accelerate" in getattr(s, "patched", ()):
        return
    s.patched = getattr(s, "patched", set()) | {"accelerate"}
    safe_patch(INTEGRATION, module.Accelerator, "prepare", _patched_prepare)
    safe_patch(INTEGRATION, module.Accelerator, "end_training", _patched_end_training)
    safe_patch(INTEGRATION, module.Accelerator, "save_state", _paused("checkpoint_save"))
    safe_patch(INTEGRATION, module.Accelerator, "load_state", _paused("checkpoint_load"))


def _patch_ray_train(module) -> None:
    """Ray Train's ``report`` carries the meter's state in rank 0's checkpoint (:mod:`.ray`)."""
    s = _session()
    if s is None or "ray.train" in getattr(s, "patched", ()) or not hasattr(module, "report"):
        return
    s.patched = getattr(s, "patched", set()) | {"ray.train"}
    ray_train.patch_report(INTEGRATION, active_monitor)


@autologging_integration(INTEGRATION)
def autolog(log_every_n_steps: int = 10, warmup_steps: int = 3, device_hour_usd: float | None = None,
            measure_energy: str = "auto", peak_tflops: float | None = None, usd_per_kwh: float | None = None,
            country_iso_code: str | None = None, cloud_provider: str | None = None, cloud_region: str | None = None,
            targets: str | None = None, tags: dict[str, str] | None = None, disable: bool = False,
            silent: bool = False) -> None:
    """Log the standard efficiency metrics and condition tags of HF Trainer, Accelerate and PyTorch loops.

    One line before training; nothing else in the script changes. Each training loop gives one MLflow
    run (the active run, the Trainer's run with ``report_to="mlflow"``, or a new run) with the same
    keys and definitions as ``llmeff train`` (``train/*``, ``throughput/*`` with MFU and HFU where
    the peak is known, ``energy/*``, ``carbon/*``, ``cost/*``, ``summary/*`` with goodput and the
    badput categories, ``ttq/*``) and the ``llmeff.*`` condition tags, except what a user's loop
    hides (:data:`HIDDEN_FROM_AUTOLOG`); only rank 0 logs, counts are summed over ranks.

    Args:
        log_every_n_steps: optimizer steps between logged points (>= 1).
        warmup_steps: first optimizer steps excluded from steady-state figures (>= 0).
        device_hour_usd: price per device-hour, USD, for ``cost/*`` (default: the dated table).
        measure_energy: ``auto``, ``nvml``, ``rapl`` or ``none`` (``none`` also turns codecarbon off).
        peak_tflops: dense peak TFLOP/s per device (default: the datasheet table; CPUs have none).
        usd_per_kwh: energy price added to the cost, USD/kWh (measured energy only).
        country_iso_code, cloud_provider, cloud_region: where the machines are (codecarbon, offline); with
            none of them the USA's grid, recorded in ``llmeff.assumed``.
        targets: time-to-quality targets on evaluations the integration sees, e.g. ``"val_loss<=2.0"``
            (HF Trainer's ``eval_loss`` is ``val_loss``).
        tags: extra tags for every run (keys MLflow refuses are mapped to allowed ones).
        disable: True reverts every patch and hook of a previous ``autolog()`` call.
        silent: True suppresses our warnings and MLflow's autologging event logs.

    Raises:
        ValueError: for a bad argument (autolog then stays disabled).
    """
    from mlflow.utils.autologging_utils import AUTOLOGGING_INTEGRATIONS

    from mlflow_llmeff.evals.targets import parse_targets
    from mlflow_llmeff.monitor.assembly import check_args

    try:
        check_args(log_every_n_steps, warmup_steps, None, measure_energy, None, peak_tflops, device_hour_usd,
                   usd_per_kwh)
        parse_targets(targets, any_metric=True)
        if tags is not None and not (isinstance(tags, dict) and all(isinstance(k, str) for k in tags)):
            raise ValueError(f"tags={tags!r} is not accepted; give a dict of str keys to values")
    except ValueError:
        AUTOLOGGING_INTEGRATIONS.setdefault(INTEGRATION, {})["disable"] = True
        raise

    settings = _Settings(log_every_n_steps, warmup_steps, device_hour_usd, usd_per_kwh, measure_energy, peak_tflops,
                         country_iso_code, cloud_provider, cloud_region, targets,
                         tuple((k, str(v)) for k, v in (tags or {}).items()))
    _install(_Session(settings))


def _install(session: _Session) -> None:
    """Make ``session`` current: its cleanup, the optimizer hook, every patch, the exit handling."""
    global _SESSION
    import torch
    import torch.optim.optimizer as topt
    from mlflow.utils.autologging_utils.safety import _AUTOLOGGING_CLEANUP_CALLBACKS

    import mlflow
    import mlflow.tracking.fluent as fluent
    from mlflow.utils.import_hooks import register_post_import_hook

    from mlflow_llmeff.monitor import lifecycle

    _SESSION = session

    def cleanup() -> None:  # run by revert_patches on autolog(disable=True) or a new autolog() call
        global _SESSION
        session.teardown()
        if _SESSION is session:
            _SESSION = None

    _AUTOLOGGING_CLEANUP_CALLBACKS.setdefault(INTEGRATION, []).append(cleanup)
    session.handles.append(topt.register_optimizer_step_post_hook(session.on_optimizer_step))
    safe_patch(INTEGRATION, torch.optim.Optimizer, "__init__", _patched_optimizer_init)
    if torch.distributed.is_available():
        safe_patch(INTEGRATION, torch.distributed, "destroy_process_group", _patched_destroy_process_group)
    safe_patch(INTEGRATION, fluent, "end_run", _patched_end_run)
    session.loaders.patch(torch.utils.data.DataLoader)  # data waits; restored by the cleanup (teardown)
    if mlflow.end_run is not fluent.end_run:
        safe_patch(INTEGRATION, mlflow, "end_run", _patched_end_run)
    # Trainer and Accelerator are patched when their modules are imported (now, if they already are).
    register_post_import_hook(_patch_transformers, "transformers.trainer", overwrite=True)
    register_post_import_hook(_patch_accelerate, "accelerate.accelerator", overwrite=True)
    register_post_import_hook(_patch_accelerate_loaders, "accelerate.data_loader", overwrite=True)
    register_post_import_hook(_patch_ray_train, "ray.train", overwrite=True)
    for name, fn in (("transformers.trainer", _patch_transformers), ("accelerate.accelerator", _patch_accelerate),
                     ("accelerate.data_loader", _patch_accelerate_loaders), ("ray.train", _patch_ray_train)):
        if name in sys.modules:
            fn(sys.modules[name])
    # A loop nobody ends (no end_run, end_training, destroy_process_group) is finished at exit with
    # the status the process ends with (FINISHED, FAILED, KILLED): see mlflow_llmeff.monitor.lifecycle.
    lifecycle.install()
