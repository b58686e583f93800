"""Set-up of a training run: Accelerate, data, model, optimizer and schedule (no measurement here).

Every rank builds the same things; :func:`build` returns them in one :class:`Training`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from mlflow_llmeff.planning.spec import RunSpec


@dataclass
class Training:
    """What the loop trains with.

    Attributes:
        accelerator: the ``accelerate.Accelerator``.
        model, optimizer, scheduler: prepared by Accelerate (the scheduler is stepped by the loop
            once per optimizer step and registered so checkpoints carry it).
        tokenizer, data: the tokenizer and :class:`~mlflow_llmeff.train.data.PreparedData`.
        model_config: the model's Hugging Face config.
        strategy: the ``llmeff.parallelism.strategy`` tag.
        precision: ``fp32``, ``bf16`` or ``fp16``.
        parallel: the :class:`~mlflow_llmeff.parallel.base.Strategy` applied.
        layout: this rank's :class:`~mlflow_llmeff.parallel.base.Layout` (degrees, data-parallel
            rank, device mesh).
        op_build_s: seconds this process spent compiling the strategy's C++ ops before the
            ``Accelerator`` was made (DeepSpeed's JIT build on a machine's first run; 0.0 when
            cached or none): build time, not set-up.
        direct_optimizer: the torch optimizer inside Accelerate's wrapper where the loop may call it
            and ``loss.backward()`` itself (:func:`direct_optimizer`), else None.
    """

    accelerator: Any
    model: Any
    optimizer: Any
    scheduler: Any
    tokenizer: Any
    data: Any
    model_config: Any
    strategy: str
    precision: str
    parallel: Any = None
    layout: Any = None
    op_build_s: float = 0.0
    direct_optimizer: Any = None

    @property
    def world(self) -> int:
        return self.accelerator.num_processes

    @property
    def dp_world(self) -> int:
        """Data-parallel ranks (ranks reading different batches)."""
        return self.layout.degrees.dp if self.layout is not None else self.world

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel index (the ranks of a tensor-parallel group share it)."""
        return self.layout.dp_rank if self.layout is not None else self.rank

    @property
    def rank(self) -> int:
        return self.accelerator.process_index

    @property
    def device(self):
        return self.accelerator.device


def build_accelerator(spec: RunSpec):
    """An ``Accelerator`` for the resolved run: its mixed precision (:attr:`RunSpec.mixed_precision`: ``no``
    for fp32 and for bf16 weights), gradient accumulation and its strategy's plugin."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import GradientAccumulationPlugin

    # AcceleratorState is process-wide and keeps the first run's settings (precision, ...): a second
    # run in the same process (a notebook, a sweep, tests) would silently inherit them. The
    # distributed PartialState is kept.
    if hasattr(AcceleratorState, "_reset_state"):
        AcceleratorState._reset_state()
    return Accelerator(
        mixed_precision=spec.mixed_precision,
        gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=spec.options.grad_accum,
                                                                sync_with_dataloader=False),
        **spec.strategy.accelerator_kwargs(spec))


def direct_optimizer(accelerator, optimizer, strategy: str):
    """The torch optimizer inside Accelerate's ``AcceleratedOptimizer`` where calling it directly does what the
    wrapper does, else None.

    That is one process or DDP (``strategy`` ``single`` or ``ddp``; Accelerate's ``DistributedType`` ``NO``,
    ``MULTI_CPU`` or ``MULTI_GPU``) without a gradient scaler (fp16 has one): there the wrapper's ``step`` and
    ``zero_grad`` call the optimizer's at the accumulation boundary only, and ``Accelerator.backward`` is
    ``(loss / grad_accum).backward()``. The wrapper's own per-call work is then what it adds: Accelerate 1.x's
    ``step`` asks ``importlib.util.find_spec("lomo_optim")`` twice (a walk of ``sys.path``) and ``zero_grad``
    builds ``inspect.signature`` of the optimizer's, every step (~140 us of CPU a step on the development
    machine, against 21 ms for a llama-tiny step: ``bench/peers.py``). The loop calls the optimizer itself,
    at the same boundary (:func:`mlflow_llmeff.train.loop._micro_step`): the same arithmetic, step for step;
    the monitor's hooks are on this very optimizer (monitor/steptimes.py) and fire as before. Checkpoints
    still save and load through the wrapper.
    """
    import torch

    from accelerate.utils import DistributedType

    inner = getattr(optimizer, "optimizer", None)
    plain = accelerator.distributed_type in (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU)
    if strategy in ("single", "ddp") and plain and getattr(accelerator, "scaler", None) is None \
            and isinstance(inner, torch.optim.Optimizer):
        return inner
    return None


def build(spec: RunSpec) -> Training:
    """Build every rank's accelerator, layout (device mesh), data, model, optimizer (``--optimizer``,
    :func:`mlflow_llmeff.train.optimizers.build_optimizer`) and cosine schedule, and apply the resolved
    run's parallelism strategy (:mod:`mlflow_llmeff.parallel`) to the model before the optimizer is made
    (sharded parameters are the optimizer's). With ``weights=bf16`` the model is built in fp32 (the
    initialisation's arithmetic) and cast to bf16 before the strategy and the optimizer see it.

    Raises:
        ValueError: the launcher started another number of processes than the run was resolved for.
    """
    import torch
    from accelerate.utils import set_seed
    from transformers import get_cosine_schedule_with_warmup

    from mlflow_llmeff.train.data import prepare_data
    from mlflow_llmeff.train.optimizers import build_optimizer
    from mlflow_llmeff.models.build import build_model, load_config, load_tokenizer

    cfg, strategy, precision = spec.options, spec.strategy, spec.precision
    # DeepSpeed JIT-compiles its ops inside the Accelerator's construction: built first, timed, announced
    op_build_s = strategy.build_ops(cuda=spec.machine.cuda) if hasattr(strategy, "build_ops") else 0.0
    accelerator = build_accelerator(spec)
    if accelerator.num_processes != spec.world:
        raise ValueError(f"{accelerator.num_processes} processes were started for a run resolved for {spec.world} "
                         f"(num_processes={cfg.num_processes} x num_machines={cfg.num_machines}); launch it with "
                         "llmeff train, or give the settings that match the launcher")
    layout = strategy.layout(accelerator, spec.degrees)
    dp = layout.degrees.dp
    set_seed(cfg.seed)
    model_config = load_config(cfg.model)
    tokenizer = load_tokenizer(cfg.model)
    # The main process tokenizes into the cache first (on a miss); the others then find it there.
    t_data = time.perf_counter()
    with accelerator.main_process_first():
        data = prepare_data(cfg.dataset, tokenizer, cfg.seq_len, packing=cfg.packing, val_fraction=cfg.val_fraction,
                            seed=cfg.seed, text_field=cfg.text_field,
                            synthetic_blocks=max(64, 2 * cfg.micro_batch_size * dp * cfg.grad_accum),
                            vocab_size=min(len(tokenizer), model_config.vocab_size),
                            cache_dir=cfg.data_cache_dir or None, num_proc=cfg.tokenize_workers,
                            streaming=cfg.streaming, world=dp, rank=layout.dp_rank,
                            stream_val_blocks=cfg.val_blocks or 32)
    if accelerator.is_main_process and data.cache is not None:
        c = data.cache
        print(f"llmeff: data: {c.tokens:,} tokens in {c.blocks:,} blocks of {cfg.seq_len} "
              f"({'from the cache' if c.hit else 'tokenized'}; data set-up {time.perf_counter() - t_data:.2f} s: {c.path})")
    with strategy.building(accelerator):
        model = build_model(cfg.model, model_config, attn_implementation=cfg.attn_implementation)
    if spec.weights == "bf16":  # pure bf16: no fp32 copy anywhere (Accelerate's mixed_precision is 'no')
        model = model.to(torch.bfloat16)
    if cfg.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if hasattr(model.config, "use_cache"):
        model.config.use_cache = False
    if cfg.lora_rank:  # the base frozen, adapters of rank r on the targets (the meter reads what trains)
        from mlflow_llmeff.models.lora import apply_lora

        model = apply_lora(model, cfg.lora_rank, cfg.lora_targets)
    model = strategy.parallelize(model, layout, cfg, precision, accelerator.device)
    trained = [p for p in model.parameters() if p.requires_grad]  # frozen weights get no optimizer state
    decay = [p for p in trained if p.dim() >= 2]
    no_decay = [p for p in trained if p.dim() < 2]
    optimizer = build_optimizer(cfg.optimizer, [{"params": decay, "weight_decay": cfg.weight_decay},
                                                {"params": no_decay, "weight_decay": 0.0}],
                                lr=cfg.learning_rate, betas=(0.9, 0.95), eps=1e-8, weight_decay=cfg.weight_decay)
    scheduler = get_cosine_schedule_with_warmup(optimizer, spec.lr_warmup_steps, cfg.max_steps)
    if cfg.compile:  # compiled here rather than through Accelerate's dynamo plugin (see build_accelerator)
        model = torch.compile(model)
    model, optimizer = strategy.prepare(accelerator, model, optimizer)
    # The scheduler is stepped by the loop once per optimizer step (Accelerate's wrapper would step
    # it num_processes times per call), and registered so save_state/load_state carry it.
    accelerator.register_for_checkpointing(scheduler)
    return Training(accelerator, model, optimizer, scheduler, tokenizer, data, model_config,
                    spec.strategy_name, precision, strategy, layout, op_build_s,
                    direct_optimizer(accelerator, optimizer, spec.strategy_name))


def teardown(t: Training) -> None:
    """Free the DDP/FSDP model while its process group is alive, then end Accelerate's training.

    A gloo group whose last reference goes at interpreter exit can deadlock there (its worker
    thread needs the GIL the exiting thread holds).
    """
    t.accelerator.wait_for_everyone()
    t.accelerator.free_memory()
    t.model = t.optimizer = None
    t.accelerator.end_training()
