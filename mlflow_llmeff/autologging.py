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
* ``mlflow.end_run`` (summary before the run the metrics go to ends; also at interpreter exit).

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

The public entry is ``mlflow_llmeff.autolog`` (this module's :func:`autolog`, exported lazily by
the package); the module is named ``autologging`` so that the function and the module never clash.
"""

from __future__ import annotations

import logging
import math
import sys
import warnings
import weakref
from contextlib import contextmanager
from dataclasses import dataclass

from mlflow.utils.autologging_utils import (
    autologging_integration,
    autologging_is_disabled,
    get_autologging_config,
    is_testing,
    safe_patch,
)

from mlflow_llmeff import names

__all__ = ["autolog", "INTEGRATION", "is_enabled", "active_monitor", "pause", "HIDDEN_FROM_AUTOLOG",
           "HIDDEN_FROM_MONITOR"]

log = logging.getLogger(__name__)

#: The name under which MLflow's autologging utilities know this integration.
INTEGRATION = "mlflow_llmeff"

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


@dataclass(frozen=True)
class _Settings:
    """What ``autolog()`` was called with: the monitor arguments every integration passes on."""

    log_every_n_steps: int
    warmup_steps: int
    device_hour_usd: float | None
    usd_per_kwh: float | None
    measure_energy: str
    peak_tflops: float | None
    country_iso_code: str | None
    cloud_provider: str | None
    cloud_region: str | None
    targets: str | None
    tags: tuple[tuple[str, str], ...]

    def monitor_kwargs(self) -> dict:
        """Keyword arguments of :class:`~mlflow_llmeff.monitor.meter.EfficiencyMonitor` from these settings."""
        return dict(log_every_n_steps=self.log_every_n_steps, warmup_steps=self.warmup_steps,
                    device_hour_usd=self.device_hour_usd, usd_per_kwh=self.usd_per_kwh,
                    measure_energy=self.measure_energy, peak_tflops=self.peak_tflops,
                    country_iso_code=self.country_iso_code, cloud_provider=self.cloud_provider,
                    cloud_region=self.cloud_region, targets=self.targets, tags=dict(self.tags))


class _Session:
    """State of one ``autolog()`` enablement: hooks, the hooked models and the current monitor."""

    def __init__(self, settings: _Settings) -> None:
        self.settings = settings
        self.monitor = None  # EfficiencyMonitor of the training in progress
        self.owner: str | None = None  # trainer / accelerate / pytorch
        self.trainer_active = False
        self.opt_id: int | None = None  # the optimizer whose steps are counted
        self.hooked: weakref.WeakSet = weakref.WeakSet()
        self.handles: list = []  # module hooks and the optimizer hook
        self.discovery: list | None = None  # global forward hook handles while armed
        self.depth = 0
        self.accelerator = None  # weakref to the last Accelerator that prepared a model
        self.prepared: weakref.WeakSet = weakref.WeakSet()
        self.optimizer = None  # weakref to the last optimizer constructed
        self.positional: dict[int, tuple[str, ...]] = {}
        self.warned = False
        self.auto_eval = None  # the monitor whose automatic "eval" pause is open
        self.late = False  # autolog() came after the optimizer was built

    # -------------------------------------------------------------------------------- failures
    def fail(self, e: BaseException) -> None:
        """A failure in a hook: warn once (unless silent), never raise (except in MLflow test mode)."""
        if is_testing():
            raise e
        if not self.warned and not get_autologging_config(INTEGRATION, "silent", False):
            self.warned = True
            warnings.warn(f"mlflow_llmeff autolog: {type(e).__name__}: {e}; training continues", stacklevel=2)
        log.debug("autolog hook failure", exc_info=e)

    # -------------------------------------------------------------------------------- model hooks
    def attach(self, module) -> bool:
        """Hook ``module`` for token counting unless it, an ancestor or a descendant is hooked."""
        import torch

        if module is None or not isinstance(module, torch.nn.Module):
            return False
        for m in list(self.hooked):
            if m is module or any(sub is module for sub in m.modules()) or any(sub is m for sub in module.modules()):
                return False
        self.handles.append(module.register_forward_hook(self._forward_hook, with_kwargs=True))
        self.handles.append(module.register_forward_pre_hook(self._pre_hook, with_kwargs=True))
        self.hooked.add(module)
        return True

    def _pre_hook(self, module, args, kwargs):
        """Evaluation inside a loop: a forward outside training opens an ``eval`` pause that the
        next training forward (or optimizer step, or the end) closes, so eval time never lands in
        a step. The Trainer declares its evaluations itself (``Trainer.evaluate`` is paused)."""
        try:
            mon = self.monitor
            if mon is None or self.owner == "trainer":
                return
            import torch

            training = module.training and torch.is_grad_enabled()
            if not training and self.auto_eval is None:
                mon.enter_pause("eval")
                self.auto_eval = mon
            elif training:
                self.end_auto_eval()
        except Exception as e:  # noqa: BLE001
            self.fail(e)

    def end_auto_eval(self) -> None:
        mon, self.auto_eval = self.auto_eval, None
        if mon is not None:
            mon.exit_pause()

    def _batch(self, module, args, kwargs):
        """The forward's ``input_ids`` / ``attention_mask`` / ``labels`` (and a packed batch's
        document marks, :data:`~mlflow_llmeff.monitor.counting.BATCH_KEYS`) as a dict, or None."""
        import torch

        from mlflow_llmeff.monitor.counting import BATCH_KEYS

        batch = {k: kwargs[k] for k in BATCH_KEYS if k in kwargs}
        if args:
            key = id(module)
            if key not in self.positional:
                import inspect

                from mlflow_llmeff.monitor.meter import unwrap_model

                try:
                    params = tuple(inspect.signature(unwrap_model(module).forward).parameters)
                except (TypeError, ValueError):
                    params = ()
                self.positional[key] = params if "input_ids" in params else ()
            params = self.positional[key]
            if params:
                batch.update({k: v for k, v in zip(params, args) if k in BATCH_KEYS})
            elif "input_ids" not in batch and torch.is_tensor(args[0]) and not args[0].is_floating_point():
                batch["input_ids"] = args[0]
        ids = batch.get("input_ids")
        if not torch.is_tensor(ids) or ids.is_floating_point() or ids.dim() not in (1, 2):
            return None
        return batch

    def _forward_hook(self, module, args, kwargs, output):
        try:
            import torch

            if not (module.training and torch.is_grad_enabled()):
                return
            batch = self._batch(module, args, kwargs)
            if batch is None:
                return
            mon = self.monitor if self.monitor is not None else self.start_monitor(module)
            if mon is None:
                return
            loss = None
            if self.owner != "trainer":
                loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
                if loss is not None and not (torch.is_tensor(loss) and loss.dim() == 0):
                    loss = None
            mon.count(batch, loss=loss)
        except Exception as e:  # noqa: BLE001
            self.fail(e)

    # -------------------------------------------------------------------------------- discovery
    def arm_discovery(self) -> None:
        """After an optimizer is built: find the root model on its first training forward."""
        if self.discovery is not None:
            return
        from torch.nn.modules import module as tm

        self.depth = 0
        self.discovery = [tm.register_module_forward_pre_hook(self._discover_pre),
                          tm.register_module_forward_hook(self._discover_post, with_kwargs=True, always_call=True)]

    def disarm_discovery(self) -> None:
        for h in self.discovery or ():
            h.remove()
        self.discovery = None

    def _discover_pre(self, module, args):
        self.depth += 1

    def _discover_post(self, module, args, kwargs, output):
        self.depth = max(0, self.depth - 1)
        if self.depth:
            return
        try:
            import torch

            if not (module.training and torch.is_grad_enabled()) or self._batch(module, args, kwargs) is None:
                return
            self.disarm_discovery()
            if self.attach(module):
                self._forward_hook(module, args, kwargs, output)  # this first forward counts too
        except Exception as e:  # noqa: BLE001
            self.disarm_discovery()
            self.fail(e)

    # -------------------------------------------------------------------------------- monitors
    def start_monitor(self, module):
        """Create the monitor (and, on rank 0, the run) at the first counted forward of a loop."""
        if self.trainer_active:
            return None  # the Trainer callback owns the monitor
        from mlflow_llmeff.monitor.meter import EfficiencyMonitor, infer_precision, unwrap_model

        acc = self.accelerator() if self.accelerator is not None else None
        precision, strategy, owner = None, None, "pytorch"
        if acc is not None and module in self.prepared:
            owner = "accelerate"
            mp = str(getattr(acc, "mixed_precision", "no"))
            precision = mp if mp in ("bf16", "fp16", "fp8") else infer_precision(unwrap_model(module))
            strategy = _accelerate_strategy(acc)
        opt = self.optimizer() if self.optimizer is not None else None
        self.monitor = EfficiencyMonitor(model=module, optimizer=opt, precision=precision, strategy=strategy,
                                         integration=owner, **self.settings.monitor_kwargs())
        if getattr(self, "late", False):
            self.late = False
            msg = ("autolog() was enabled after the optimizer was built: counting started at the first forward "
                   "after its next step (call mlflow_llmeff.autolog() before building the optimizer)")
            warnings.warn(f"mlflow_llmeff: {msg}", stacklevel=2)
            self.monitor.set_tags({names.AUTOLOG_NOTE: msg})
        self.owner, self.opt_id = owner, None
        return self.monitor

    def on_optimizer_step(self, optimizer, args, kwargs) -> None:
        mon = self.monitor
        if mon is None and not self.trainer_active and self.discovery is None and not len(self.hooked):
            # autolog() came after the optimizer was built: find the model from the next forward on
            self.optimizer = weakref.ref(optimizer)
            self.late = True
            self.arm_discovery()
            return
        if mon is None or self.trainer_active:
            return
        try:
            if self.opt_id is None:
                self.opt_id = id(optimizer)
                if mon._optimizer is None:
                    mon._optimizer = optimizer
            elif self.opt_id != id(optimizer):
                return  # a second optimizer in the same loop: steps are counted once
            self.end_auto_eval()
            mon.step()
        except Exception as e:  # noqa: BLE001
            self.fail(e)

    def finish(self, *, collective: bool, run_id: str | None = None, status: str = "FINISHED") -> None:
        """Finish the current monitor (only if it logs into ``run_id``, when given) with ``status``."""
        mon = self.monitor
        if mon is None or mon.finished:
            self.monitor = None
            return
        if run_id is not None and mon.run_id is not None and mon.run_id != run_id:
            return
        if run_id is not None and mon.run_id is None and mon.is_main:
            return
        self.end_auto_eval()
        self.monitor, self.owner, self.opt_id = None, None, None
        mon.finish(status, collective=collective)

    def teardown(self) -> None:
        try:
            from mlflow_llmeff.monitor import lifecycle

            self.finish(collective=False, status=lifecycle.exit_status())
        except Exception as e:  # noqa: BLE001
            log.debug("finish at teardown failed", exc_info=e)
        self.disarm_discovery()
        for h in self.handles:
            try:
                h.remove()
            except Exception:  # noqa: BLE001
                pass
        self.handles.clear()


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


def _accelerate_strategy(acc) -> str:
    dt = str(getattr(getattr(acc, "distributed_type", None), "value", getattr(acc, "distributed_type", "")))
    dt = dt.upper()
    if "FSDP" in dt:
        return "fsdp"
    if "DEEPSPEED" in dt:
        try:
            return f"deepspeed_zero{acc.state.deepspeed_plugin.zero_stage}"
        except Exception:  # noqa: BLE001
            return "deepspeed"
    return "ddp" if getattr(acc, "num_processes", 1) > 1 else "single"


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
        self.add_callback(cb)  # after the Trainer's MLflowCallback: its run exists at on_train_begin
        self.callback_handler.callbacks.insert(0, first_cls(cb))  # summary before it ends the run


_TRAINER_CALLBACKS = None
#: Trainer evaluation outputs that are timings, not quality: not logged under eval/.
_TRAINER_EVAL_SKIP = ("eval_runtime", "eval_samples_per_second", "eval_steps_per_second", "eval_model_preparation_time")


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
                                          **s.settings.monitor_kwargs())

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


def _patch_accelerate(module) -> None:
    s = _session()
    if s is None or "accelerate" in getattr(s, "patched", ()):
        return
    s.patched = getattr(s, "patched", set()) | {"accelerate"}
    safe_patch(INTEGRATION, module.Accelerator, "prepare", _patched_prepare)
    safe_patch(INTEGRATION, module.Accelerator, "end_training", _patched_end_training)
    safe_patch(INTEGRATION, module.Accelerator, "save_state", _paused("checkpoint_save"))
    safe_patch(INTEGRATION, module.Accelerator, "load_state", _paused("checkpoint_load"))


@autologging_integration(INTEGRATION)
def autolog(log_every_n_steps: int = 10, warmup_steps: int = 3, device_hour_usd: float | None = None,
            measure_energy: str = "auto", peak_tflops: float | None = None, usd_per_kwh: float | None = None,
            country_iso_code: str | None = "USA", cloud_provider: str | None = None, cloud_region: str | None = None,
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
        country_iso_code, cloud_provider, cloud_region: where the machines are (codecarbon, offline).
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
    from mlflow_llmeff.monitor.meter import _check_args

    try:
        _check_args(log_every_n_steps, warmup_steps, None, measure_energy, None, peak_tflops, device_hour_usd,
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
    if mlflow.end_run is not fluent.end_run:
        safe_patch(INTEGRATION, mlflow, "end_run", _patched_end_run)
    # Trainer and Accelerator are patched when their modules are imported (now, if they already are).
    register_post_import_hook(_patch_transformers, "transformers.trainer", overwrite=True)
    register_post_import_hook(_patch_accelerate, "accelerate.accelerator", overwrite=True)
    for name, fn in (("transformers.trainer", _patch_transformers), ("accelerate.accelerator", _patch_accelerate)):
        if name in sys.modules:
            fn(sys.modules[name])
    # A loop nobody ends (no end_run, end_training, destroy_process_group) is finished at exit with
    # the status the process ends with (FINISHED, FAILED, KILLED): see mlflow_llmeff.monitor.lifecycle.
    lifecycle.install()
