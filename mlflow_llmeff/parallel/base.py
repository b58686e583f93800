"""What every parallelism strategy provides, and the shared machinery of the device-mesh ones.

A strategy is one small module of this package (``ddp.py``, ``fsdp.py``, ``tp.py``, ...) holding a
:class:`Strategy` object; the training entrypoint applies it step by step, as torchtitan's
``parallelize_*`` functions are applied:

1. :meth:`Strategy.degrees` (pure): how the world splits, from the settings; what it costs, also
   pure: :meth:`Strategy.bus_bytes` (communication per step) and :meth:`Strategy.model_state_bytes`
   (memory per device); :meth:`Strategy.wraps` / :meth:`Strategy.named_by` recognise it in a user's
   loop (:func:`mlflow_llmeff.parallel.detect`);
2. :meth:`Strategy.check` / :meth:`Strategy.check_model`: a one-line refusal of what cannot run;
3. :meth:`Strategy.launcher_args` / :meth:`Strategy.launcher_env`: the ``accelerate launch`` flags;
4. on every rank: :meth:`Strategy.accelerator_kwargs`, :meth:`Strategy.layout` (device mesh,
   data-parallel rank), :meth:`Strategy.building` (around the model build),
   :meth:`Strategy.parallelize` (before the optimizer exists), :meth:`Strategy.prepare`;
5. then :meth:`Strategy.save` / :meth:`Strategy.load` for checkpoints, :meth:`Strategy.eval_model`
   for benchmarks and :meth:`Strategy.full_state_dict` for ``save_pretrained``.

The defaults are Accelerate's own path (``accelerator.prepare``, ``save_state``), which DDP and
DeepSpeed use. :class:`MeshStrategy` is the path of FSDP2, HSDP, tensor and 2-D parallelism:
torch's ``fully_shard`` / ``parallelize_module`` on a device mesh that Accelerate's
``ParallelismConfig`` builds, sharded checkpoints with ``torch.distributed.checkpoint``. It is
used on CUDA too, so the path the CPU tests exercise is the one GPU runs take. Accelerate 1.15
cannot drive these on CPU: its FSDP plugin is silently ignored under ``MULTI_CPU`` (the run trains
plain DDP and ``save_state`` writes one ``model.safetensors``), and a ``ParallelismConfig`` with
``tp_size > 1`` is refused there ("only compatible with FSDP2, Multi-device or DeepSpeed"),
both measured with torch 2.13 over gloo.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Any

from mlflow_llmeff.calc.comm import CommEstimate, TrafficShape
from mlflow_llmeff.calc.optimizers import bytes_per_param, choice, weight_bytes
from mlflow_llmeff.parallel.degrees import Degrees
from mlflow_llmeff.parallel.mesh import apply_fsdp, apply_tp, autocast_forward, decoder_layers  # noqa: F401

__all__ = ["Strategy", "MeshStrategy", "Layout", "per_param_bytes"]


def per_param_bytes(optimizer: str = "adamw", weights: str = "fp32",
                    optimizer_per_param: float | None = None) -> tuple[float, float, float]:
    """(weights, gradients, optimizer-state) bytes per parameter before sharding: the weights' dtype
    for both weights and gradients (4 fp32, 2 bf16), the optimizer's state from
    :mod:`mlflow_llmeff.calc.optimizers` (``optimizer_per_param`` when the caller counted it over the
    model's tensors).

    Raises:
        ValueError: an unknown ``optimizer`` or ``weights``.
    """
    wb = float(weight_bytes(weights))
    o = optimizer_per_param if optimizer_per_param is not None else bytes_per_param(optimizer, int(wb))
    return wb, wb, float(o)


@dataclass
class Layout:
    """Where this rank sits, once the process group exists.

    Attributes:
        degrees: the run's :class:`~mlflow_llmeff.parallel.degrees.Degrees`.
        dp_rank: this rank's index among the data-parallel ranks (``0..dp-1``); the ranks of one
            model-parallel group share it, so they read the same batches.
        mesh: the torch ``DeviceMesh`` (dimensions ``dp_replicate``, ``dp_shard``, ``cp``, ``tp``
            as far as they are > 1, plus the flattened ``dp``), or None for strategies without one.
    """

    degrees: Degrees
    dp_rank: int = 0
    mesh: Any = None


class Strategy:
    """One parallelism strategy (see the module docstring for the order of the calls).

    Attributes:
        name: the ``parallelism`` value and the ``llmeff.parallelism.strategy`` tag.
        summary: one line for ``--help`` and the docs.
        needs_launcher: True when even one process runs under ``accelerate launch`` (a process
            group is needed); False runs one process in the calling process.
    """

    name = ""
    summary = ""
    needs_launcher = True

    # ------------------------------------------------------------------ pure: degrees and checks
    def degrees(self, world: int, *, tp_size: int = 0, dp_shard: int = 0, processes_per_node: int = 0) -> Degrees:
        """The degrees of ``world`` processes (default: every rank a data-parallel replica).

        Args:
            world: processes in all (``num_processes x num_machines``).
            tp_size: the ``tp_size`` setting (0 = the strategy's default).
            dp_shard: the ``dp_shard`` setting (0 = the strategy's default).
            processes_per_node: processes on each machine.

        Raises:
            ValueError: for degrees that do not fit ``world`` (one line naming the values).
        """
        return Degrees(dp_replicate=world)

    def check(self, *, cuda: bool, precision: str) -> None:
        """Raise ``ValueError`` (one line, the measured reason) when this strategy cannot run here."""

    # ------------------------------------------------------------------ pure: what it costs, how it is seen
    def bus_bytes(self, shape: TrafficShape, degrees: Degrees) -> CommEstimate:
        """Bus bytes each device sends per optimizer step, by collective (nccl-tests factors,
        :func:`mlflow_llmeff.calc.comm.bus_factor`), as torch 2.13 and DeepSpeed 0.19 run the strategy;
        ``llmeff plan`` prints them and a run's sampled steps are checked against them
        (``docs/parallelism.md``, "Communication"). Default: nothing (one process; context
        parallelism's ring is not predicted)."""
        return CommEstimate({})

    def model_state_bytes(self, params: int, dp: int, *, dp_shard: int | None = None, tp: int = 1,
                          tp_params: int = 0, precision: str = "bf16", persistent_params: int = 0,
                          optimizer: str = "adamw", weights: str = "fp32",
                          optimizer_per_param: float | None = None) -> tuple[float, float, float]:
        """(weights, gradients, optimizer) bytes per device for ``params`` parameters over ``dp``
        data-parallel ranks (``planning/plan.py``'s module docstring states the accounting).

        Default: a whole copy on every rank: the weights in ``weights``' dtype (fp32: 4 B, the master
        copy torch AMP autocasts from; bf16: 2 B, pure bf16 with no master), gradients in the same
        dtype (autograd accumulates into ``p.grad`` of ``p``'s dtype), and the optimizer's state
        (:func:`mlflow_llmeff.calc.optimizers.state_bytes`): 4 + 4 + 8 = 16 B/param for fp32 AdamW,
        whatever ``precision`` (autocast changes the matmuls, not the stored state).

        Args:
            params: model parameters.
            dp: data-parallel ranks.
            dp_shard: ranks the state is sharded over (HSDP's shard group; default ``dp``).
            tp: tensor-parallel degree.
            tp_params: parameters the tensor-parallel plan splits.
            precision: the run's precision (DeepSpeed keeps its working weights and gradients in it).
            persistent_params: parameters in tensors ZeRO-3 keeps whole on every rank.
            optimizer: an ``--optimizer`` value (:data:`mlflow_llmeff.calc.optimizers.OPTIMIZER_NAMES`).
            weights: ``fp32`` or ``bf16`` (:data:`mlflow_llmeff.calc.optimizers.WEIGHTS`).
            optimizer_per_param: optimizer-state bytes per parameter of this model (the plan counts
                them over the model's tensors, small-tensor rules included); None: one large tensor's
                (:func:`mlflow_llmeff.calc.optimizers.bytes_per_param`).

        Raises:
            ValueError: an unknown ``optimizer`` or ``weights``.
        """
        w, g, o = per_param_bytes(optimizer, weights, optimizer_per_param)
        p = float(params)
        return w * p, g * p, o * p

    def state_held(self, precision: str, weights: float, gradients: float, optimizer: float, *,
                   optimizer_name: str = "adamw", weights_dtype: str = "fp32") -> dict[str, str]:
        """What :meth:`model_state_bytes`' bytes per parameter (``weights``, ``gradients``,
        ``optimizer``, before sharding) are, in words: ``weights_held_as``, ``gradients_held_as``,
        ``optimizer_state`` (the plan's text and JSON). Default: torch AMP's fp32 master copy, or pure
        bf16 weights (``weights_dtype='bf16'``); the optimizer's layout from its catalogue entry."""
        sixteen = precision in ("bf16", "fp16")
        if weights_dtype == "bf16":
            held_w = f"bf16 weights, no fp32 master copy ({weights:g} B)"
        else:
            held_w = ("fp32 weights, the master copy; autocast runs the matmuls in " + precision
                      if sixteen else f"{precision} weights (the master copy)") + f" ({weights:g} B)"
        c = choice(optimizer_name)
        state = ("AdamW exp_avg and exp_avg_sq in fp32" if optimizer_name == "adamw" and weights_dtype == "fp32"
                 else f"{c.cls}: {c.states}")
        return {"weights_held_as": held_w,
                "gradients_held_as": f"{'bf16' if weights_dtype == 'bf16' else 'fp32'} gradients ({gradients:g} B)",
                "optimizer_state": f"{state} ({optimizer:.4g} B)"}

    def state_sharding(self, degrees: Degrees) -> str:
        """How a device's share of the model state follows from ``degrees``, in words. Default: none."""
        return "a whole copy on every rank"

    def wraps(self, module) -> bool:
        """True when ``module`` (one layer of a model's wrappers: DDP, FSDP, ``torch.compile``) is this
        strategy's wrapper, read off its class (a user's loop names no strategy: the meter reads it)."""
        return False

    def named_by(self, environ) -> bool:
        """True when Accelerate's launch environment (``environ``: ``ACCELERATE_USE_FSDP``,
        ``ACCELERATE_USE_DEEPSPEED``, ...) says this strategy runs."""
        return False

    def engine_missing(self, *, load: bool = False) -> str | None:
        """One line naming the package this strategy's engine needs and how to install it, when that
        package cannot be imported here; None when nothing is missing (torch and Accelerate only).
        ``load`` imports the package (an install that is found but fails to import counts as
        missing); without it the package is only looked up (``importlib.util.find_spec``, no import).

        Training needs the engine (:func:`mlflow_llmeff.train.config.validate` raises this line);
        ``llmeff plan`` does not (its figures are arithmetic) and reports it instead.
        """
        return None

    def check_model(self, config, degrees: Degrees) -> None:
        """Raise ``ValueError`` when the model's shape does not divide over ``degrees``."""

    # ------------------------------------------------------------------ launch
    def launcher_args(self, *, cuda: bool) -> list[str]:
        """``accelerate launch`` flags (before the script)."""
        return ["--multi_gpu"]

    def launcher_env(self, *, cuda: bool) -> dict[str, str]:
        """Environment of the launcher. On CPU, Accelerate's multi-process launcher needs
        ``ACCELERATE_USE_CPU=1`` (with ``--cpu`` alone it silently starts one process)."""
        return {} if cuda else {"ACCELERATE_USE_CPU": "1"}

    # ------------------------------------------------------------------ set-up, every rank
    def accelerator_kwargs(self, spec) -> dict:
        """Extra ``Accelerator`` arguments (plugins) for the resolved run ``spec`` (a
        :class:`~mlflow_llmeff.planning.spec.RunSpec`: its options, world and machine); ``cpu`` says
        which device."""
        return {"cpu": not spec.machine.cuda}

    def layout(self, accelerator, degrees: Degrees) -> Layout:
        """This rank's :class:`Layout` (no mesh: the data-parallel rank is the process index)."""
        return Layout(degrees, dp_rank=accelerator.process_index if degrees.dp > 1 else 0)

    def building(self, accelerator):
        """A context for building the model (default: nothing)."""
        return contextlib.nullcontext()

    def parallelize(self, model, layout: Layout, cfg, precision: str, device):
        """Apply the strategy to ``model`` before the optimizer is made; returns the model."""
        return model

    def prepare(self, accelerator, model, optimizer):
        """``(model, optimizer)`` ready to train (default: ``accelerator.prepare``)."""
        return accelerator.prepare(model, optimizer)

    clips_in_engine = False  # True: gradient clipping happens inside the strategy's engine (DeepSpeed)

    def other_world_refused(self) -> str | None:
        """Why a checkpoint this strategy wrote cannot be resumed by another number of processes (an
        elastic restart on fewer machines), or None when it can. Accelerate's ``save_state`` (single,
        DDP) holds the whole model and optimizer state, which any number of processes loads; the
        random states of ranks the writer did not have start from the seed (Accelerate logs it)."""
        return None

    # ------------------------------------------------------------------ state
    def save(self, accelerator, model, optimizer, path: str) -> None:
        """Write the training state into ``path`` (a collective: every rank calls it)."""
        accelerator.save_state(path)

    def load(self, accelerator, model, optimizer, path: str) -> None:
        """Read what :meth:`save` wrote (a collective)."""
        accelerator.load_state(path)

    def full_state_dict(self, accelerator, model) -> dict:
        """The whole model's state dict on the main process (a collective), for ``save_pretrained``."""
        return accelerator.get_state_dict(model)

    def eval_model(self, accelerator, model):
        """The module benchmark evals run on, on every rank with the same documents."""
        return accelerator.unwrap_model(model)

    def after_eval(self, model) -> None:
        """Undo what evaluation left behind (default: nothing)."""


class MeshStrategy(Strategy):
    """FSDP2 / HSDP / tensor / 2-D parallelism with torch's own APIs on a device mesh.

    The model goes to the device, is tensor-parallelized (:meth:`apply_tp`) and then fully sharded
    (:func:`~mlflow_llmeff.parallel.mesh.apply_fsdp`) as a subclass says; the optimizer is wrapped in
    Accelerate's ``AcceleratedOptimizer`` (it skips the steps inside gradient accumulation) but not registered,
    so ``save_state`` keeps the RNG and scheduler state while the model and optimizer go through
    ``torch.distributed.checkpoint`` (each rank writes its own shards, any layout reads them back).
    """

    fsdp_dims: tuple[str, ...] = ()  # mesh dimensions fully_shard uses ((): no FSDP)
    tp_dim: str | None = None  # mesh dimension of tensor parallelism (None: no TP)

    def check(self, *, cuda: bool, precision: str) -> None:
        if precision == "fp16":
            raise ValueError(f"parallelism={self.name!r} with precision='fp16' is not supported (its loss scaler "
                             "would need sharded gradients: torch's ShardedGradScaler); use bf16")

    def layout(self, accelerator, degrees: Degrees) -> Layout:
        from accelerate import ParallelismConfig

        pc = ParallelismConfig(dp_replicate_size=degrees.dp_replicate, dp_shard_size=degrees.dp_shard,
                               tp_size=degrees.tp, cp_size=degrees.cp)
        mesh = pc.build_device_mesh(accelerator.device.type)
        # the mesh is (dp_replicate, dp_shard, cp, tp), row-major: a model-parallel group is
        # model_parallel consecutive ranks, and its data-parallel index the quotient
        return Layout(degrees, dp_rank=accelerator.process_index // degrees.model_parallel, mesh=mesh)

    def parallelize(self, model, layout: Layout, cfg, precision: str, device):
        import logging

        # torch advises at every gradient-norm reduction over a 2-D mesh that one flattened all-reduce
        # would beat two; a performance note about clip_grad_norm_, not about the run
        logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
        model = model.to(device)
        if self.tp_dim is not None:
            model = self.apply_tp(model, layout.mesh[self.tp_dim])
        if self.fsdp_dims:
            dims = tuple(d for d in self.fsdp_dims if getattr(layout.degrees, d) > 1)
            mesh = layout.mesh[dims] if len(dims) > 1 else layout.mesh[dims[0]] if dims else None
            model = apply_fsdp(model, mesh, precision=precision, reshard_after_forward=cfg.reshard_after_forward)
        elif precision in ("bf16", "fp16"):
            model = autocast_forward(model, device, precision)
        return model

    def apply_tp(self, model, tp_mesh):
        """Tensor-parallelize ``model`` over ``tp_mesh`` (:func:`mlflow_llmeff.parallel.mesh.apply_tp`)."""
        return apply_tp(model, tp_mesh)

    def prepare(self, accelerator, model, optimizer):
        from accelerate.optimizer import AcceleratedOptimizer

        return model, AcceleratedOptimizer(optimizer, device_placement=False, scaler=accelerator.scaler)

    def save(self, accelerator, model, optimizer, path: str) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        accelerator.save_state(path)  # RNG states of every rank, the registered scheduler
        msd, osd = get_state_dict(model, _inner(optimizer))
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(path, "dcp"))

    def load(self, accelerator, model, optimizer, path: str) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        accelerator.load_state(path)
        msd, osd = get_state_dict(model, _inner(optimizer))
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=os.path.join(path, "dcp"))
        set_state_dict(model, _inner(optimizer), model_state_dict=state["model"], optim_state_dict=state["optim"])

    def other_world_refused(self) -> str | None:
        """None: ``torch.distributed.checkpoint`` reshards the model and optimizer shards to the layout
        that loads them (any world size whose degrees the settings accept)."""
        return None

    def full_state_dict(self, accelerator, model) -> dict:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def eval_model(self, accelerator, model):
        return model  # sharded: every rank runs every forward, as in training

    def after_eval(self, model) -> None:
        """Reshard every FSDP module: a forward without a backward leaves the parameters of modules
        that keep them between forward and backward (the root) gathered."""
        from torch.distributed.fsdp import FSDPModule

        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.reshard()


def _inner(optimizer):
    """The torch optimizer inside Accelerate's wrapper."""
    return getattr(optimizer, "optimizer", optimizer)


def tp_local(params: float, tp: int, tp_params: float) -> float:
    """Parameters one tensor-parallel rank holds: the plan's ``tp_params`` split over ``tp`` ranks, the
    rest (embeddings, norms, LM head) whole (``params`` when ``tp`` is 1)."""
    return params - tp_params + tp_params / tp if tp > 1 else params


def divides(name: str, value: int, by: int, what: str) -> None:
    """Raise a one-line ``ValueError`` unless ``by`` divides ``value``."""
    if value % by:
        raise ValueError(f"{what}: {name}={value} is not divisible by {by}")
