"""Set-up of a training run: Accelerate, data, model, optimizer and schedule (no measurement here).

Every rank builds the same things; :func:`build` returns them in one :class:`Training`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from .config import TrainConfig


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

    @property
    def world(self) -> int:
        return self.accelerator.num_processes

    @property
    def rank(self) -> int:
        return self.accelerator.process_index

    @property
    def device(self):
        return self.accelerator.device


def build_accelerator(cfg: TrainConfig, precision: str, cuda: bool):
    """An ``Accelerator`` for ``cfg``: mixed precision, gradient accumulation, FSDP or DeepSpeed plugin."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import GradientAccumulationPlugin

    kwargs = {}
    if cfg.parallelism == "fsdp":
        from accelerate import FullyShardedDataParallelPlugin

        kwargs["fsdp_plugin"] = FullyShardedDataParallelPlugin(
            auto_wrap_policy="transformer_based_wrap", activation_checkpointing=cfg.activation_checkpointing,
            state_dict_type="SHARDED_STATE_DICT")
    elif cfg.parallelism.startswith("deepspeed_zero"):
        from accelerate.utils import DeepSpeedPlugin

        kwargs["deepspeed_plugin"] = DeepSpeedPlugin(zero_stage=int(cfg.parallelism[-1]),
                                                     gradient_accumulation_steps=cfg.grad_accum,
                                                     gradient_clipping=cfg.max_grad_norm or None)
    # AcceleratorState is process-wide and keeps the first run's settings (precision, ...): a second
    # run in the same process (a notebook, a sweep, tests) would silently inherit them. The
    # distributed PartialState is kept.
    if hasattr(AcceleratorState, "_reset_state"):
        AcceleratorState._reset_state()
    return Accelerator(
        mixed_precision={"fp32": "no", "bf16": "bf16", "fp16": "fp16"}[precision],
        gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=cfg.grad_accum, sync_with_dataloader=False),
        cpu=not cuda, **kwargs)


def build(cfg: TrainConfig, precision: str, cuda: bool) -> Training:
    """Build every rank's accelerator, data, model (compiled if asked), AdamW and cosine schedule."""
    import torch
    from accelerate.utils import set_seed
    from transformers import get_cosine_schedule_with_warmup

    from .config import resolve_strategy
    from .data import prepare_data
    from .models import build_model, load_config, load_tokenizer

    accelerator = build_accelerator(cfg, precision, cuda)
    world = accelerator.num_processes
    set_seed(cfg.seed)
    model_config = load_config(cfg.model)
    tokenizer = load_tokenizer(cfg.model)
    # The main process tokenizes into the cache first (on a miss); the others then find it there.
    t_data = time.perf_counter()
    with accelerator.main_process_first():
        data = prepare_data(cfg.dataset, tokenizer, cfg.seq_len, packing=cfg.packing, val_fraction=cfg.val_fraction,
                            seed=cfg.seed, text_field=cfg.text_field,
                            synthetic_blocks=max(64, 2 * cfg.micro_batch_size * world * cfg.grad_accum),
                            vocab_size=min(len(tokenizer), model_config.vocab_size),
                            cache_dir=cfg.data_cache_dir or None, num_proc=cfg.tokenize_workers,
                            streaming=cfg.streaming, world=world, rank=accelerator.process_index,
                            stream_val_blocks=cfg.val_blocks or 32)
    if accelerator.is_main_process and data.cache is not None:
        c = data.cache
        print(f"llmeff: data: {c.tokens:,} tokens in {c.blocks:,} blocks of {cfg.seq_len} "
              f"({'from the cache' if c.hit else 'tokenized'}; data set-up {time.perf_counter() - t_data:.2f} s: {c.path})")
    model = build_model(cfg.model, model_config, attn_implementation=cfg.attn_implementation)
    if cfg.activation_checkpointing and cfg.parallelism != "fsdp":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if hasattr(model.config, "use_cache"):
        model.config.use_cache = False
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=cfg.learning_rate, betas=(0.9, 0.95), eps=1e-8)
    scheduler = get_cosine_schedule_with_warmup(optimizer, cfg.resolved_lr_warmup_steps(), cfg.max_steps)
    if cfg.compile:  # compiled here rather than through Accelerate's dynamo plugin (see build_accelerator)
        model = torch.compile(model)
    model, optimizer = accelerator.prepare(model, optimizer)
    # The scheduler is stepped by the loop once per optimizer step (Accelerate's wrapper would step
    # it num_processes times per call), and registered so save_state/load_state carry it.
    accelerator.register_for_checkpointing(scheduler)
    return Training(accelerator, model, optimizer, scheduler, tokenizer, data, model_config,
                    resolve_strategy(cfg, world), precision)


def teardown(t: Training) -> None:
    """Free the DDP/FSDP model while its process group is alive, then end Accelerate's training.

    A gloo group whose last reference goes at interpreter exit can deadlock there (its worker
    thread needs the GIL the exiting thread holds).
    """
    t.accelerator.wait_for_everyone()
    t.accelerator.free_memory()
    t.model = t.optimizer = None
    t.accelerator.end_training()
