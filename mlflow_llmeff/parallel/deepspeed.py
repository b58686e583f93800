"""``deepspeed_zero1/2/3``: DeepSpeed's ZeRO through Accelerate's DeepSpeed plugin.

ZeRO partitions over every data-parallel rank: stage 1 the optimizer state (with its fp32 master
weights), stage 2 also the gradients, stage 3 also the weights (Rajbhandari et al. 2020, "ZeRO",
Sec. 5). On CPU it runs with DeepSpeed's CPU accelerator (``DS_ACCELERATOR=cpu``) over gloo:
Accelerate makes a DeepSpeed state only when not told ``cpu=True``, so the ``Accelerator`` gets
``cpu=False`` and gloo as its process-group backend there (measured with DeepSpeed 0.19.8,
Accelerate 1.15, torch 2.13). DeepSpeed needs the batch sizes in its config when no DataLoader
goes through ``prepare``; they are written from the settings. The model is built whole on every
rank (not under ``deepspeed.zero.Init``) so that every strategy starts from the same weights.

Op builds: DeepSpeed JIT-compiles C++ ops the first time a machine needs them (torch's extension
cache, ``~/.cache/torch_extensions``), which takes minutes. On CPU ``deepspeed.init_distributed``
(which Accelerate calls when the ``Accelerator`` is made) would build its shared-memory all-reduce
(``ShareMemCommBuilder``, ``deepspeed_shm_comm``) even over gloo, though only
``inference_all_reduce`` (AutoTP inference) calls it; ZeRO's collectives are torch.distributed's
(DeepSpeed 0.19.8 ``comm/torch.py``). :meth:`ZeRO.build_ops` marks it not compatible, as DeepSpeed
marks an op it cannot build, so it is not built (measured on 2 cores: 67 CPU s and 170 s of wall
with the first ZeRO launch waiting, every first run of a machine or venv). Our configs pass torch's
AdamW, so no optimizer op (``FusedAdam``, ``CPUAdam``) is built either. An op that is needed
(:data:`CPU_OPS`) is built first, timed and announced, so the time is named as a build rather than
silent set-up.
"""

from __future__ import annotations

import contextlib
import os
import time

from mlflow_llmeff.calc.comm import CommEstimate, TrafficShape, bus_factor
from mlflow_llmeff.parallel.base import Strategy
from mlflow_llmeff.parallel.degrees import Degrees

#: The terminal line while an op is compiled (the rank-0 process prints it).
BUILD_LINE = "llmeff: building DeepSpeed ops (first run on this machine; later runs reuse the cache) ..."
#: The ops a CPU run builds (timed) before the ``Accelerator`` is made: none is needed by ZeRO training.
CPU_OPS: tuple[str, ...] = ()
#: The ops ``deepspeed.init_distributed`` would JIT-build on CPU (deepspeed/comm/torch.py, build_shm_op)
#: that training never calls (the shared-memory ``inference_all_reduce``): marked not compatible instead.
UNUSED_CPU_OPS = ("ShareMemCommBuilder",)
#: DeepSpeed's default ``stage3_param_persistence_threshold`` (elements; DeepSpeed 0.19
#: ``runtime/zero/config.py``, ``param_persistence_threshold = 1e5``): ZeRO-3 keeps every parameter of
#: at most this many elements whole on every rank (``parameter_offload.py``
#: ``mark_persistent_parameters``). Our configs leave it unset: Accelerate's plugin fills it (10 x
#: hidden) only where a config file says ``"auto"``.
ZERO3_PERSISTENCE_THRESHOLD = 100_000
#: The one line a plan of a ZeRO strategy with another optimizer or pure bf16 weights answers: ZeRO
#: keeps its own fp32 master weights and AdamW moments, counted for torch's AdamW only.
REFUSED = ("parallelism={name!r} is planned for optimizer='adamw' with weights='fp32' only (ZeRO keeps its own "
           "fp32 master weights and AdamW moments); got optimizer={optimizer!r}, weights={weights!r}")


class ZeRO(Strategy):
    summary = ""
    clips_in_engine = True  # DeepSpeed clips (gradient_clipping in its config) inside engine.step

    def __init__(self, stage: int) -> None:
        self.stage = stage
        self.name = f"deepspeed_zero{stage}"
        self.summary = {1: "DeepSpeed ZeRO-1: optimizer state (and fp32 master weights) partitioned",
                        2: "DeepSpeed ZeRO-2: optimizer state and gradients partitioned",
                        3: "DeepSpeed ZeRO-3: weights, gradients and optimizer state partitioned"}[stage]

    def degrees(self, world: int, *, tp_size: int = 0, dp_shard: int = 0, processes_per_node: int = 0) -> Degrees:
        if dp_shard not in (0, world):
            raise ValueError(f"parallelism={self.name!r} partitions over all {world} processes (dp_shard={dp_shard} given)")
        return Degrees(dp_shard=world)

    def bus_bytes(self, shape: TrafficShape, degrees: Degrees) -> CommEstimate:
        """As DeepSpeed 0.19 runs ZeRO with its defaults (counted; the ZeRO paper's volumes, Rajbhandari
        et al. 2020 Sec. 7, assume reduce-scatters): ZeRO-1 all-reduces the whole gradients once per step
        and all-gathers the updated weights; ZeRO-2 the same, its gradient all-reduce per micro-batch (its
        buckets span several ranks, which DeepSpeed all-reduces); ZeRO-3 all-gathers the weights once and
        reduce-scatters the gradients per micro-batch (gathered weights stay for the backward while they
        fit its live-parameter budget, ``stage3_max_live_parameters``). 16-bit runs move 2-byte weights
        and gradients."""
        n, b, P, ga = degrees.dp_shard, (2 if shape.half else 4), float(shape.params), shape.grad_accum
        if self.stage == 3:
            return CommEstimate({"parameter all-gather": bus_factor("all_gather", n) * b * P * ga,
                                 "gradient reduce-scatter": bus_factor("reduce_scatter", n) * b * P * ga})
        per = ga if self.stage == 2 else 1
        return CommEstimate({"gradient all-reduce": bus_factor("all_reduce", n) * b * P * per,
                             "parameter all-gather": bus_factor("all_gather", n) * b * P})

    def model_state_bytes(self, params, dp, *, dp_shard=None, tp=1, tp_params=0, precision="bf16",
                          persistent_params=0, optimizer="adamw", weights="fp32", optimizer_per_param=None):
        """ZeRO keeps its working weights and gradients in the run's precision (2 + 2 B in 16-bit, 4 + 4 B
        in fp32) plus K = 12 B of fp32 master weights and moments per parameter; stage 1 shards the 12,
        stage 2 also the gradients, stage 3 everything (Rajbhandari et al. 2020, "ZeRO", Sec. 5, Fig. 1).

        As DeepSpeed 0.19 runs it: 16-bit stages 1 and 2 add the fp32 copy of the rank's gradient
        partition the step makes (``stage_1_and_2.py``: ``single_grad_partition =
        flat_grad_partition.to(fp32)``, the 4 B/param / dp DeepSpeed's own estimators count in their
        18 B/param; fp32 runs step on their flat partition as it is). Stage 3 holds the most at one of
        two moments (``stage3.py`` ``step``): during forward and backward, the partitions, the
        ``persistent_params`` whole on every rank (over ``dp > 1`` ranks), the gradient partitions and
        the fp32 master weights and moments; at the optimizer step the persistent parameters are
        partitioned and the step holds an fp32 copy of the rank's gradient partition
        (``_prepare_fp32_grad_for_sub_group``, fp32 runs too), 4 B/param / dp. The larger of
        ``b x persistent_params`` and ``4 params / dp`` decides.

        Counted for torch's AdamW with DeepSpeed's own fp32 master only (its optimizer wraps the one
        it is given and keeps the master weights itself); ``optimizer`` and ``weights`` other than
        ``adamw`` / ``fp32`` are refused by the plan (``planning/plan.py`` ``model_state_bytes``).

        Raises:
            ValueError: ``optimizer`` is not ``adamw`` or ``weights`` not ``fp32`` (one line).
        """
        if optimizer != "adamw" or weights != "fp32":
            raise ValueError(REFUSED.format(name=self.name, optimizer=optimizer, weights=weights))
        p = float(params)
        b = 2.0 if precision in ("bf16", "fp16") else 4.0
        if self.stage == 3:
            whole = b * float(persistent_params) if dp > 1 else 0.0  # forward and backward
            step_grads = 4 * p / dp  # the optimizer step, in fp32 runs too
            if whole > step_grads:
                return b * p / dp + whole, b * p / dp, 12 * p / dp
            return b * p / dp, b * p / dp + step_grads, 12 * p / dp
        fp32_grads = 4 * p / dp if b == 2.0 else 0.0
        grads = b * p if self.stage == 1 else b * p / dp
        return b * p, grads + fp32_grads, 12 * p / dp

    def state_held(self, precision: str, weights: float, gradients: float, optimizer: float, *,
                   optimizer_name: str = "adamw", weights_dtype: str = "fp32") -> dict[str, str]:
        held_w = f"{precision} working weights ({weights:g} B)"
        if self.stage == 3:
            held_w += (f"; tensors of at most {ZERO3_PERSISTENCE_THRESHOLD:,} elements also whole on every rank "
                       "during forward and backward (stage3_param_persistence_threshold)")
        held_g = (f"{precision} gradients ({gradients - 4:g} B) + the fp32 copy of the rank's partition the step uses "
                  "(4 B)" if precision in ("bf16", "fp16") or self.stage == 3 else f"{precision} gradients ({gradients:g} B)")
        return {"weights_held_as": held_w, "gradients_held_as": held_g,
                "optimizer_state": "fp32 master weights (4 B) + AdamW exp_avg and exp_avg_sq in fp32 (8 B)"}

    def state_sharding(self, degrees: Degrees) -> str:
        what = {1: "optimizer state", 2: "gradients and optimizer state", 3: "all of it"}[self.stage]
        return f"{what} divided over the {degrees.dp} data-parallel ranks"

    def named_by(self, environ) -> bool:
        """Accelerate's DeepSpeed launch (``ACCELERATE_USE_DEEPSPEED``) of this stage
        (``ACCELERATE_DEEPSPEED_ZERO_STAGE``, Accelerate's default 2)."""
        return (environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() in ("1", "true")
                and environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2") == str(self.stage))

    def other_world_refused(self) -> str | None:
        return (f"{self.name} checkpoints hold the optimizer state partitioned over the processes that wrote "
                "them (DeepSpeed's universal-checkpoint conversion, which would reshape them, is not run)")

    def engine_missing(self, *, load: bool = False) -> str | None:
        import importlib.util

        try:
            if load:
                import deepspeed  # noqa: F401
            found = load or importlib.util.find_spec("deepspeed") is not None
        except (ImportError, ValueError):  # not installed, a None entry in sys.modules, a broken parent
            found = False
        if found:
            return None
        return (f"parallelism={self.name!r} needs the deepspeed package: install it after torch "
                "(pip install 'mlflow-llmeff[deepspeed]')")

    def build_ops(self, *, cuda: bool, builders=None, clock=time.perf_counter, say=print) -> float:
        """Build (or load from the cache) the C++ ops DeepSpeed would JIT-compile while the
        ``Accelerator`` is made, and return the seconds spent compiling (0.0 when every op was
        cached or none is needed).

        DeepSpeed keeps a loaded op (``OpBuilder._loaded_ops``), so its own load later reuses this
        one. Ops already built are loaded without the line and count 0 s (a cached load takes a
        fraction of a second; it stays set-up time). Ahead of time: ``DS_BUILD_OPS=1 pip install
        deepspeed`` (or ``DS_BUILD_SHM_COMM=1``), and ``ds_report`` lists what is built.

        On CPU the ops training never calls (:data:`UNUSED_CPU_OPS`) are first marked not compatible
        in DeepSpeed's ``deepspeed.ops.__compatible_ops__``, so ``deepspeed.init_distributed`` does not
        build them.

        Args:
            cuda: the run is on CUDA (no CPU op is needed there: our configs use torch's AdamW).
            builders: op builders to load (default: the CPU accelerator's :data:`CPU_OPS`; tests
                pass fakes with ``name``, ``is_compatible()`` and ``load()``).
            clock: seconds (``time.perf_counter``; tests pass a fake one).
            say: where the line goes (``print``).

        Raises:
            RuntimeError: what DeepSpeed's build raises (a compiler missing), unchanged.
        """
        if builders is None:
            if cuda:
                return 0.0
            import deepspeed.ops
            from deepspeed.accelerator import get_accelerator

            for unused in (get_accelerator().create_op_builder(n) for n in UNUSED_CPU_OPS):
                if unused is not None:  # build_shm_op reads this dict (probed once and kept: DeepSpeed 0.19.8)
                    deepspeed.ops.__compatible_ops__[unused.NAME] = False
            builders = [b for b in (get_accelerator().create_op_builder(n) for n in CPU_OPS) if b is not None]
        spent = 0.0
        for b in builders:
            if not b.is_compatible(False):  # DeepSpeed skips it too (deepspeed.ops.__compatible_ops__)
                continue
            if _built(b.name):
                b.load()
                continue
            if os.environ.get("RANK", "0") == "0":
                say(BUILD_LINE, flush=True)
            t0 = clock()
            b.load()
            spent += clock() - t0
        return spent

    def launcher_args(self, *, cuda: bool) -> list[str]:
        return ["--use_deepspeed", "--zero_stage", str(self.stage)]

    def launcher_env(self, *, cuda: bool) -> dict[str, str]:
        return {} if cuda else {"DS_ACCELERATOR": "cpu"}

    def accelerator_kwargs(self, spec) -> dict:
        from accelerate.utils import DeepSpeedPlugin, InitProcessGroupKwargs

        cfg, cuda = spec.options, spec.machine.cuda
        plugin = DeepSpeedPlugin(zero_stage=self.stage, gradient_accumulation_steps=cfg.grad_accum,
                                 gradient_clipping=float(cfg.max_grad_norm), zero3_init_flag=False)
        plugin.deepspeed_config.update({"train_micro_batch_size_per_gpu": cfg.micro_batch_size,
                                        "train_batch_size": cfg.micro_batch_size * cfg.grad_accum * spec.world})
        if self.stage == 3:  # save_pretrained needs the whole weights on the main process
            plugin.deepspeed_config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
        import warnings

        # DeepSpeed 0.19 calls the collectives torch 2.13 renamed (*_single) at every step
        warnings.filterwarnings("ignore", category=FutureWarning,
                                message=r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated")
        kwargs = {"deepspeed_plugin": plugin, "cpu": False}
        if not cuda:
            kwargs["kwargs_handlers"] = [InitProcessGroupKwargs(backend="gloo")]
        return kwargs

    def building(self, accelerator):
        """Build the whole model on every rank: transformers would build under ``deepspeed.zero.Init``
        (partitioned, from other random draws) while Accelerate's DeepSpeed config is registered."""
        if self.stage != 3:
            return contextlib.nullcontext()
        return _without_hf_deepspeed_config(accelerator)

    def eval_model(self, accelerator, model):
        # ZeRO-3 gathers each layer's weights in its forward on every rank; the engine's module runs it
        return model.module if self.stage == 3 else accelerator.unwrap_model(model)

    def after_eval(self, model) -> None:
        """ZeRO-3: release the parameters the eval forwards gathered (``empty_partition_cache``)."""
        if self.stage == 3 and hasattr(model, "empty_partition_cache"):
            model.empty_partition_cache()


def _built(name: str) -> bool:
    """Whether torch's extension cache already holds the op ``name`` (its shared object)."""
    import glob

    from torch.utils.cpp_extension import _get_build_directory

    return bool(glob.glob(os.path.join(_get_build_directory(name, verbose=False), f"{name}*.so")))


@contextlib.contextmanager
def _without_hf_deepspeed_config(accelerator):
    from transformers.integrations import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    try:
        yield
    finally:
        accelerator.state.deepspeed_plugin.set_deepspeed_weakref()


STRATEGIES = (ZeRO(1), ZeRO(2), ZeRO(3))
