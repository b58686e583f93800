"""The autolog hooks: one ``autolog()`` enablement's state, and the torch hooks that drive its monitor.

:class:`_Session` holds what :func:`mlflow_llmeff.autolog` installs (see :mod:`mlflow_llmeff.autologging`
for what is patched): the forward hooks on the root model that count tokens and open an ``eval``
pause around forwards outside training, the discovery hooks that find that model after an optimizer
is built, the optimizer step hook that ends a step, and the
:class:`~mlflow_llmeff.monitor.meter.EfficiencyMonitor` they drive (created at the first counted
forward of a loop; the Trainer callback creates its own). A failure in a hook warns once and never
stops training.
"""

from __future__ import annotations

import logging
import warnings
import weakref
from dataclasses import dataclass

from mlflow.utils.autologging_utils import get_autologging_config, is_testing

from mlflow_llmeff import names
from mlflow_llmeff.autologging import ray as ray_train
from mlflow_llmeff.autologging.batches import LoaderPatch

log = logging.getLogger("mlflow_llmeff.autologging")  # the integration's logger, as before the split

#: The name under which MLflow's autologging utilities know this integration.
INTEGRATION = "mlflow_llmeff"
#: ``llmeff.optimizer``'s origin by the loop that drives the monitor (a DeepSpeed engine's optimizer is named
#: by the torch optimizer it wraps: :func:`~mlflow_llmeff.meters.memory.optimizer_tag`).
_LOOP_ORIGIN = {"pytorch": "the user's loop", "accelerate": "the user's Accelerate loop"}


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
        self.fetching = False  # a loader's batch is being awaited (batches.py: an inner loader is not timed again)
        self.loaders = LoaderPatch(self)  # the loaders' __iter__ patches (data waits), restored at teardown
        import time

        # when autolog() was called (unix s, perf_counter s): a Ray Train attempt starts here (ray.py)
        self.created_unix, self.created_perf = time.time(), time.perf_counter()

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
        """The forward's ``input_ids`` / ``attention_mask`` / ``labels`` as a dict, or None."""
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
        precision, strategy, owner, degrees = None, None, "pytorch", {}
        if acc is not None and module in self.prepared:
            owner = "accelerate"
            mp = str(getattr(acc, "mixed_precision", "no"))
            precision = mp if mp in ("bf16", "fp16", "fp8") else infer_precision(unwrap_model(module))
            strategy = _accelerate_strategy(acc)
            degrees = _accelerate_degrees(acc)
        opt = self.optimizer() if self.optimizer is not None else None
        resumed = ray_train.resume_kwargs(self.created_perf)  # a Ray Train worker: run, state, attempt start
        self.monitor = EfficiencyMonitor(model=module, optimizer=opt, precision=precision, strategy=strategy,
                                         integration=owner, optimizer_origin=_LOOP_ORIGIN.get(owner), **degrees,
                                         **resumed, **self.settings.monitor_kwargs())
        if resumed.get("resume_state") and self.monitor.is_main:  # the gap since the killed attempt
            self.monitor.continue_job(down_s=ray_train.down_s(resumed["resume_state"], resumed.get("heartbeat_path"),
                                                              resumed["run_id"], self.created_unix))
        if resumed:  # a Ray Train worker: one alone is never given destroy_process_group, so its run ends here
            ray_train.finish_when_returned(lambda status: self.finish(collective=True, status=status),
                                           self.monitor.world_size)
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
                mon.use_optimizer(optimizer)
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
        self.loaders.restore()
        for h in self.handles:
            try:
                h.remove()
            except Exception:  # noqa: BLE001
                pass
        self.handles.clear()


def _accelerate_degrees(acc) -> dict:
    """``data_parallel_size`` / ``context_parallel_size`` of an Accelerator's ``ParallelismConfig``
    (accelerate >= 1.10), for the monitor's token counting
    (:func:`~mlflow_llmeff.parallel.degrees.token_counting`): the forward hook runs inside
    Accelerate's context-parallel region, so each cp rank counts its own slice; tensor-parallel
    ranks count copies. ``{}`` without a config, for a config of one rank, or when its degrees do
    not multiply to the processes (``WORLD_SIZE``); sequence parallelism (``sp_size``) is left to
    that case: its slices are not counted here."""
    import os

    pc = getattr(acc, "parallelism_config", None)
    if pc is None:
        return {}
    try:
        dp = int(pc.dp_replicate_size) * int(pc.dp_shard_size)
        cp, tp = int(getattr(pc, "cp_size", 1) or 1), int(getattr(pc, "tp_size", 1) or 1)
        sp = int(getattr(pc, "sp_size", 1) or 1)
    except (TypeError, ValueError, AttributeError):
        return {}
    world = int(os.environ.get("WORLD_SIZE", getattr(acc, "num_processes", 1)) or 1)
    if dp * cp * tp * sp != world or world == 1 or sp > 1:
        return {}
    return {"data_parallel_size": dp, "context_parallel_size": cp}


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
