"""Settings of the training entrypoint: one dataclass, validated before any heavy work.

The same fields are the MLproject parameters, the ``llmeff train`` options and the MLflow params
(a test keeps ``MLproject`` in step with :class:`TrainConfig`).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from importlib.util import find_spec  # a module attribute: tests fake a missing package here

PRECISIONS = ("auto", "fp32", "bf16", "fp16")
from mlflow_llmeff.parallel import NAMES as _STRATEGY_NAMES

PARALLELISMS = ("auto",) + _STRATEGY_NAMES  # docs/parallelism.md
RESUME_MODES = ("auto", "never")
NAN_POLICIES = ("fail", "skip_step")
#: Attention kernels (transformers' attn_implementation): sdpa and eager run anywhere; the others need
#: CUDA and a package (:func:`attention_missing`).
ATTN_IMPLS = ("sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention")
ENERGY_MODES = ("auto", "nvml", "rapl", "none")
from mlflow_llmeff.train.data import PACKING_MODES  # noqa: E402 - stdlib imports only
from mlflow_llmeff.calc.optimizers import OPTIMIZER_NAMES, WEIGHTS
from mlflow_llmeff.names import shorten
from mlflow_llmeff.planning import spec as specs
from mlflow_llmeff.planning.spec import Machine, RunSpec


@dataclass
class TrainConfig:
    """Every knob of a training run, with its unit. Defaults run the tiny CPU demo in seconds."""

    model: str = field(default="llama-tiny", metadata={"help": "preset name, local HF model directory, or hub id"})
    dataset: str = field(default="python-docs", metadata={"help": "'python-docs' (built in, real text), 'synthetic', a .txt/.jsonl file or directory, or a HF dataset id"})
    text_field: str = field(default="text", metadata={"help": "text column of .jsonl files and hub datasets"})
    streaming: bool = field(default=False, metadata={"help": "read the dataset lazily (datasets streaming) and pack on the fly, for hub datasets too large to download"})
    data_cache_dir: str = field(default="", metadata={"help": "directory of tokenized datasets, reused across runs ('' = $LLMEFF_CACHE_DIR or ~/.cache/mlflow_llmeff/tokens)"})
    tokenize_workers: int = field(default=0, metadata={"help": "processes tokenizing the dataset (datasets map num_proc; 0 = one per CPU for large data)"})
    data_workers: int = field(default=-1, metadata={"help": "DataLoader worker processes per rank (-1 = 2 on CUDA, 0 on CPU)"})
    packing: str = field(default="true", metadata={"help": "true: join documents with EOS into full seq_len blocks (no padding, attention across documents); false: pad each document; documents: the same blocks with position_ids restarting at each document and no attention mask (padding-free, attention within documents)"})
    val_fraction: float = field(default=0.05, metadata={"help": "fraction of blocks held out for validation loss, in [0, 0.5]"})
    val_blocks: int = field(default=32, metadata={"help": "held-out blocks scored at each validation: a fixed subset, the same for a given seed (0 = all)"})
    max_steps: int = field(default=50, metadata={"help": "optimizer steps to train (total, across resumes)"})
    seq_len: int = field(default=128, metadata={"help": "tokens per sequence"})
    micro_batch_size: int = field(default=8, metadata={"help": "sequences per micro-batch per device"})
    grad_accum: int = field(default=1, metadata={"help": "micro-batches per optimizer step"})
    learning_rate: float = field(default=1e-3, metadata={"help": "peak AdamW learning rate"})
    weight_decay: float = field(default=0.1, metadata={"help": "decoupled weight decay of matrices (vectors: none); sgd: L2"})
    optimizer: str = field(default="adamw", metadata={"help": "adamw (torch, fp32 moments: 8 B/param), adamw-bf16 (bf16 moments, fp32 update: 4 B/param), adamw8bit / adamw4bit (torchao block-quantized moments, step compiled on the first step), bnb-adamw8bit / bnb-paged-adamw8bit (bitsandbytes), adafactor (torch, factored second moment), sgd (momentum 0.9); docs/training.md#memory-levers"})
    lr_warmup_steps: int = field(default=-1, metadata={"help": "linear LR warm-up steps before cosine decay; -1 = 5% of max_steps"})
    max_grad_norm: float = field(default=1.0, metadata={"help": "gradient clipping norm; 0 disables"})
    precision: str = field(default="auto", metadata={"help": "auto (bf16 on GPUs that support it, or with weights=bf16; else fp32), fp32, bf16, fp16"})
    lora_rank: int = field(default=0, metadata={"help": "LoRA rank r of adapters on lora_targets of every layer, the base weights frozen (peft, the lora extra; FLOPs per token count what trains: docs/formulas.md); 0 = train every weight"})
    lora_targets: str = field(default="q_proj,v_proj", metadata={"help": "comma-separated module names the LoRA adapters wrap (with lora_rank > 0)"})
    weights: str = field(default="fp32", metadata={"help": "fp32 (fp32 weights, the master copy under bf16/fp16 mixed precision) or bf16 (pure bf16 weights and gradients, no fp32 master copy: 2 + 2 B/param; needs precision bf16 or auto)"})
    num_processes: int = field(default=1, metadata={"help": "processes (devices) on this machine; > 1 launches through accelerate launch"})
    num_machines: int = field(default=1, metadata={"help": "machines (nodes) in the job; > 1 launches through accelerate launch on each, with machine_rank and main_process_ip"})
    machine_rank: int = field(default=0, metadata={"help": "this machine's rank in 0..num_machines-1 (0 logs to MLflow)"})
    main_process_ip: str = field(default="", metadata={"help": "address of machine 0 for the rendezvous (with num_machines > 1)"})
    main_process_port: int = field(default=29500, metadata={"help": "TCP port of the rendezvous of the processes (on machine 0 with several machines)"})
    rendezvous_timeout_s: float = field(default=300.0, metadata={"help": "with several machines: seconds each machine waits at the start for the others at main_process_ip:main_process_port (and checks they were given the same settings) before it fails with one line"})
    link_peak_gbps: float = field(default=0.0, metadata={"help": "busbw peak of the link the collectives cross, GB/s per direction (1e9 bytes/s; 200 Mbit/s = 0.025; across machines the node's aggregate network rate); 0: read it (NVLink/PCIe, InfiniBand/RoCE adapters, the tc shaper or line speed of the interface toward machine 0)"})
    parallelism: str = field(default="auto", metadata={"help": "auto (single or ddp), single, ddp, fsdp, hsdp, tp, fsdp_tp, deepspeed_zero1/2/3 (cp: refused on CPU, see docs/parallelism.md)"})
    tp_size: int = field(default=0, metadata={"help": "tensor-parallel degree for tp (0 = every process) and fsdp_tp (> 1, dividing the processes)"})
    dp_shard: int = field(default=0, metadata={"help": "hsdp: ranks each replica shards the model state over (0 = the processes of one machine)"})
    reshard_after_forward: bool = field(default=True, metadata={"help": "FSDP2 (fsdp, hsdp, fsdp_tp): free gathered layer weights after their forward and gather again for the backward (false: keep them, one all-gather fewer, more memory)"})
    measure_comm: bool = field(default=True, metadata={"help": "with several processes: time all-reduce/all-gather/reduce-scatter at start (cached per machine) and profile warm-up steps for exposed communication and bytes per step"})
    activation_checkpointing: bool = field(default=False, metadata={"help": "recompute layer activations in the backward pass"})
    compile: bool = field(default=False, metadata={"help": "torch.compile the model (compile time falls in warm-up)"})
    attn_implementation: str = field(default="sdpa", metadata={"help": "attention kernel: sdpa, eager, flash_attention_2 (CUDA, flash_attn), flash_attention_3 (CUDA, flash_attn_interface), flex_attention (CUDA, torch >= 2.5)"})
    warmup_steps: int = field(default=3, metadata={"help": "optimizer steps per attempt excluded from steady-state figures"})
    log_every_n_steps: int = field(default=5, metadata={"help": "interval between logged steps"})
    eval_every: int = field(default=0, metadata={"help": "validation loss every N steps (0: only at the end)"})
    eval_tasks: str = field(default="", metadata={"help": "benchmarks scored at each eval: comma-separated mmlu, hellaswag, mmlu_<subject> ('' = none)"})
    eval_limit: int = field(default=100, metadata={"help": "documents per benchmark task at each eval: a fixed subset drawn once with seed (0 = all)"})
    eval_num_fewshot: int = field(default=0, metadata={"help": "MMLU few-shot examples (0-5)"})
    eval_data_dir: str = field(default="", metadata={"help": "directory with mmlu/ and hellaswag/ ('' = $LLMEFF_DATA_DIR, else the hub datasets cais/mmlu and Rowan/hellaswag)"})
    eval_subject_metrics: bool = field(default=False, metadata={"help": "also log each MMLU subject's accuracy as a metric (eval/mmlu_<subject>/acc); the per-subject table artifact is logged either way"})
    targets: str = field(default="", metadata={"help": "time-to-quality targets, e.g. 'val_loss<=1.9,hellaswag/acc_norm>=0.30'"})
    stop_at_targets: bool = field(default=False, metadata={"help": "stop training once every target is reached"})
    checkpoint_dir: str = field(default="", metadata={"help": "directory for accelerate.save_state checkpoints ('' disables)"})
    checkpoint_every: int = field(default=0, metadata={"help": "save a checkpoint every N steps (0: only at the end when checkpoint_dir is set)"})
    checkpoint_keep: int = field(default=2, metadata={"help": "newest checkpoints kept"})
    resume: str = field(default="auto", metadata={"help": "auto (continue from the latest checkpoint and its MLflow run) or never"})
    save_model: str = field(default="", metadata={"help": "directory for the final model and tokenizer (save_pretrained), "
                                                          "loadable by `llmeff eval --model DIR` ('' saves none)"})
    nan_policy: str = field(default="fail", metadata={"help": "a NaN or infinite training loss: fail (end FAILED naming the step; checked at logged steps and before checkpoints, no extra sync) or skip_step (skip that optimizer step, count train/skipped_steps; one sync per micro-batch)"})
    seed: int = field(default=0, metadata={"help": "seed for init, data order and the validation split"})
    peak_tflops: float = field(default=0.0, metadata={"help": "dense peak TFLOP/s per device overriding the datasheet table (0: table)"})
    device_hour_usd: float = field(default=0.0, metadata={"help": "price per device-hour in USD (0: the dated default table, none for CPU)"})
    usd_per_kwh: float = field(default=0.0, metadata={"help": "energy price in USD/kWh added to the cost (0: energy not priced)"})
    measure_energy: str = field(default="auto", metadata={"help": "auto (NVML counters, NVML power, RAPL), nvml, rapl, none"})
    country_iso_code: str = field(default="", metadata={"help": "ISO 3166 alpha-3 country of the machines, for codecarbon's grid intensity (offline); '' with no cloud region: USA, recorded in llmeff.assumed"})
    cloud_provider: str = field(default="", metadata={"help": "cloud provider in codecarbon's cloud table (gcp) for a per-region grid intensity; elsewhere give country_iso_code"})
    cloud_region: str = field(default="", metadata={"help": "cloud region (e.g. us-central1), with cloud_provider"})
    dry_run: bool = field(default=False, metadata={"help": "plan only: parameters, FLOPs, memory per device, fit and predictions; no training"})
    force: bool = field(default=False, metadata={"help": "train even when the memory estimate says the run does not fit the device"})
    run_name: str = field(default="", metadata={"help": "MLflow run name ('' = the configuration's parts in a fixed order, e.g. tiny-ddp2-fp32-gbt2k-s128-cpu, -2 for a repeat)"})
    experiment_name: str = field(default="", metadata={"help": "MLflow experiment for llmeff train ('' = MLflow's active/default)"})

    def __post_init__(self) -> None:
        if isinstance(self.packing, bool):  # packing was a bool: True / False read as "true" / "false"
            self.packing = "true" if self.packing else "false"

    # ----------------------------------------------------------------------------------- helpers
    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    def to_params(self) -> dict[str, str]:
        """MLflow params: every field as a string (booleans lowercase, as MLproject passes them)."""
        out = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            out[f.name] = str(v).lower() if isinstance(v, bool) else str(v)
        return out


def _one_of(name: str, value: str, accepted: tuple[str, ...]) -> None:
    if value not in accepted:
        raise ValueError(f"{name}={value!r} is not accepted; use one of: {', '.join(accepted)}")


def _positive(name: str, value: int) -> None:
    if value < 1:
        raise ValueError(f"{name}={value} must be a positive integer (>= 1)")


def attention_missing(name: str, *, cuda: bool, packages: bool = True) -> str | None:
    """Why ``attn_implementation=name`` cannot run on this machine (the first half of a sentence), or None.

    ``sdpa`` and ``eager`` run anywhere; ``flash_attention_2`` needs CUDA and ``flash_attn``,
    ``flash_attention_3`` CUDA and ``flash_attn_interface`` (FlashAttention-3, built from
    flash-attention's ``hopper/``), ``flex_attention`` CUDA and torch >= 2.5
    (``torch.nn.attention.flex_attention``). Packages are looked up, not imported; with
    ``packages=False`` (a plan for another machine) only the device is checked.
    """
    if name in ("sdpa", "eager"):
        return None
    if not cuda:
        return "needs a CUDA device"
    if not packages:
        return None
    package = {"flash_attention_2": ("flash_attn", "pip install flash-attn --no-build-isolation"),
               "flash_attention_3": ("flash_attn_interface", "build flash-attention's hopper/ (FlashAttention-3)"),
               "flex_attention": ("torch.nn.attention.flex_attention", "torch >= 2.5 has it")}[name]
    try:
        found = find_spec(package[0]) is not None
    except ModuleNotFoundError:  # a parent package (torch.nn.attention before torch 2.2) is missing
        found = False
    return None if found else f"needs {package[0]}, which is not installed here ({package[1]})"


def probe_machine(accelerator_count: int | None = None) -> Machine:
    """This machine's :class:`~mlflow_llmeff.planning.spec.Machine`: CUDA and bf16 support probed through
    torch and, given ``accelerator_count`` (the devices a plan is for), the accelerator's short name.

    A torch built without CUDA or ROCm (:func:`~mlflow_llmeff.meters.probes.torch_built_without_gpu`) has no
    CUDA device, as its ``torch.cuda.is_available()`` says: ``llmeff train``'s own process then hands off
    without importing torch (1.8 s of CPU at each launch), which its training processes import anyway."""
    short = None
    if accelerator_count is not None:
        from mlflow_llmeff.meters.hardware import detect_accelerator

        short = detect_accelerator(count=accelerator_count).short
    from mlflow_llmeff.meters.probes import torch_built_without_gpu

    if torch_built_without_gpu():
        return Machine(cuda=False, bf16=True, accelerator=short)
    import torch

    cuda = torch.cuda.is_available()
    return Machine(cuda=cuda, bf16=torch.cuda.is_bf16_supported() if cuda else True, accelerator=short)


def validate(cfg: TrainConfig, machine: Machine | None = None, *, cuda_available: bool | None = None,
             bf16_supported: bool | None = None, engine: bool = True) -> RunSpec:
    """Check every setting cheaply (configs only, no weights, no data read) and resolve the run, once.

    The settings are checked in order, the run resolved (:func:`mlflow_llmeff.planning.spec.resolve`:
    strategy, degrees, precision, world over every machine, global batch) once the plain values are
    known good, and what needs the resolved run (the strategy on this device, its engine, the model's
    shape over the degrees) checked on it. Every later step reads the returned spec; nothing resolves
    or validates again (in a launched process: ``--resolved-json``, docs/training.md).

    Args:
        cfg: the settings.
        machine: what the machine offers; probed through torch when None (:func:`probe_machine`).
        cuda_available / bf16_supported: the machine's facts given one by one (tests); probed when None.
        engine: the strategy's engine must be importable here (training; the strategy's
            ``engine_missing`` line names the package to install). ``llmeff plan`` passes False: its
            figures are arithmetic and it says instead that the engine is not installed.

    Returns:
        The resolved :class:`~mlflow_llmeff.planning.spec.RunSpec`.

    Raises:
        ValueError: one line naming the bad value and the accepted ones.
    """
    from mlflow_llmeff.train.data import dataset_kind
    from mlflow_llmeff.models.build import is_preset, load_tokenizer, max_positions
    from mlflow_llmeff.models.presets import shape_config

    for name in ("max_steps", "seq_len", "micro_batch_size", "grad_accum", "num_processes", "log_every_n_steps"):
        _positive(name, getattr(cfg, name))
    for name in ("warmup_steps", "eval_every", "checkpoint_every", "val_blocks", "tokenize_workers", "tp_size", "dp_shard"):
        if getattr(cfg, name) < 0:
            raise ValueError(f"{name}={getattr(cfg, name)} must be >= 0")
    _positive("checkpoint_keep", cfg.checkpoint_keep)
    if cfg.data_workers < -1:
        raise ValueError(f"data_workers={cfg.data_workers} must be >= 0 (or -1 = auto)")
    if cfg.seq_len < 2:
        raise ValueError(f"seq_len={cfg.seq_len} must be >= 2 (a causal LM predicts token t+1 from t)")
    if not 0.0 <= cfg.val_fraction <= 0.5:
        raise ValueError(f"val_fraction={cfg.val_fraction} must be in [0, 0.5]")
    if cfg.learning_rate <= 0:
        raise ValueError(f"learning_rate={cfg.learning_rate} must be > 0")
    if cfg.peak_tflops < 0:
        raise ValueError(f"peak_tflops={cfg.peak_tflops} must be >= 0 (0 = datasheet table)")
    _one_of("precision", cfg.precision, PRECISIONS)
    _one_of("parallelism", cfg.parallelism, PARALLELISMS)
    _one_of("resume", cfg.resume, RESUME_MODES)
    _one_of("nan_policy", cfg.nan_policy, NAN_POLICIES)
    _one_of("attn_implementation", cfg.attn_implementation, ATTN_IMPLS)
    _one_of("optimizer", cfg.optimizer, OPTIMIZER_NAMES)
    _one_of("weights", cfg.weights, WEIGHTS)
    if cfg.weights == "bf16" and cfg.precision not in ("bf16", "auto"):
        raise ValueError(f"weights=bf16 needs precision bf16 or auto (precision={cfg.precision!r}); "
                         f"accepted with precision={cfg.precision!r}: weights=fp32")
    _one_of("measure_energy", cfg.measure_energy, ENERGY_MODES)
    _one_of("packing", cfg.packing, PACKING_MODES)
    for name in ("device_hour_usd", "usd_per_kwh"):
        if getattr(cfg, name) < 0:
            raise ValueError(f"{name}={getattr(cfg, name)} must be >= 0 USD")
    if cfg.cloud_region and not cfg.cloud_provider:
        raise ValueError(f"cloud_region={cfg.cloud_region!r} needs cloud_provider (codecarbon's cloud table has gcp)")
    if cfg.measure_energy != "none" and (cfg.country_iso_code or cfg.cloud_provider or cfg.cloud_region):
        # nothing to check without a location (codecarbon's tables, with pandas, cost ~1 s of CPU to import)
        from mlflow_llmeff.meters.carbon import check_location

        check_location(country_iso_code=cfg.country_iso_code or None, cloud_provider=cfg.cloud_provider or None,
                       cloud_region=cfg.cloud_region or None)

    if machine is None:
        if cuda_available is None or bf16_supported is None:
            probed = probe_machine()
            cuda_available = probed.cuda if cuda_available is None else cuda_available
            bf16_supported = probed.bf16 if bf16_supported is None else bf16_supported
        machine = Machine(cuda=cuda_available, bf16=bf16_supported)
    if cfg.precision == "fp16" and not machine.cuda:
        raise ValueError("precision='fp16' needs a CUDA device (fp16 mixed precision is GPU-only); accepted on CPU: fp32, bf16")
    if cfg.precision == "bf16" and not machine.bf16:
        raise ValueError("precision='bf16' is not supported by this device; accepted here: fp32, fp16")
    _check_levers(cfg, machine, packages=engine)
    if cfg.num_machines < 1 or not 0 <= cfg.machine_rank < cfg.num_machines:
        raise ValueError(f"machine_rank={cfg.machine_rank} with num_machines={cfg.num_machines}; "
                         f"machine_rank must be in 0..{max(0, cfg.num_machines - 1)}")
    if cfg.num_machines > 1 and not cfg.main_process_ip:
        raise ValueError(f"num_machines={cfg.num_machines} needs main_process_ip (the address of machine 0)")
    if not 0 < cfg.main_process_port < 65536:
        raise ValueError(f"main_process_port={cfg.main_process_port} must be a TCP port in 1..65535")
    if not cfg.rendezvous_timeout_s > 0:
        raise ValueError(f"rendezvous_timeout_s={cfg.rendezvous_timeout_s} must be > 0 seconds")
    if not cfg.link_peak_gbps >= 0:
        raise ValueError(f"link_peak_gbps={cfg.link_peak_gbps} must be >= 0 GB/s (0: read the link's rate)")
    run = specs.resolve(cfg, machine)  # raises when the degrees do not fit the processes
    run.strategy.check(cuda=machine.cuda, precision=run.precision)
    if cfg.weights == "bf16" and run.strategy_name.startswith("deepspeed_zero"):
        others = ", ".join(n for n in _STRATEGY_NAMES if not n.startswith("deepspeed_zero"))
        raise ValueError(f"weights=bf16 with parallelism={run.strategy_name!r}: DeepSpeed keeps its own fp32 master "
                         f"weights; accepted with weights=bf16: {others}")
    missing = run.strategy.engine_missing(load=True) if engine else None
    if missing:
        raise ValueError(missing)
    if cfg.checkpoint_dir and os.path.exists(cfg.checkpoint_dir) and not os.path.isdir(cfg.checkpoint_dir):
        raise ValueError(f"checkpoint_dir={cfg.checkpoint_dir!r} exists and is not a directory")

    if cfg.eval_limit < 0:
        raise ValueError(f"eval_limit={cfg.eval_limit} must be >= 0 (0 = all documents)")
    if cfg.eval_tasks:
        from mlflow_llmeff.evals.api import check_inputs

        check_inputs(cfg.eval_tasks, data_dir=cfg.eval_data_dir or None, num_fewshot=cfg.eval_num_fewshot)
    from mlflow_llmeff.evals.targets import parse_targets

    for t in parse_targets(cfg.targets):
        task = t.metric.split("/")[0]
        if task in ("val_loss", "val_perplexity"):
            if cfg.val_fraction <= 0:
                raise ValueError(f"target {t} needs a validation split; set val_fraction > 0")
        elif task not in [x.strip() for x in cfg.eval_tasks.split(",")] and not (
                task.startswith("mmlu_") and "mmlu" in cfg.eval_tasks.split(",")):
            raise ValueError(f"target {t} needs eval_tasks to include {task!r} (eval_tasks={cfg.eval_tasks!r})")

    config = shape_config(cfg.model)  # a preset's without importing transformers (models/preset_shapes.py)
    if not is_preset(cfg.model):
        try:
            load_tokenizer(cfg.model)
        except Exception as e:  # noqa: BLE001 - one line instead of the library's stack trace
            raise ValueError(f"model {cfg.model!r} has no usable tokenizer ({type(e).__name__}: "
                             f"{shorten(str(e).splitlines()[0], 160)}); save one beside the weights "
                             f"(tokenizer.save_pretrained) or use a preset") from None
    limit = max_positions(config)
    if limit is not None and cfg.seq_len > limit:
        raise ValueError(f"seq_len={cfg.seq_len} exceeds the {limit} positions of model {cfg.model!r}; use seq_len <= {limit}")
    run.strategy.check_model(config, run.degrees)
    dataset_kind(cfg.dataset)
    return run


def _check_levers(cfg: TrainConfig, machine: Machine, *, packages: bool) -> None:
    """The memory levers on this machine: the attention kernel, the optimizer's package, bf16 weights.
    ``packages``: the attention kernel's and the optimizer's packages must be installed here (training;
    a plan, whose figures are arithmetic, passes False, as it does for the strategy's engine).

    Raises:
        ValueError: one line naming the value and what is accepted here.
    """
    why = attention_missing(cfg.attn_implementation, cuda=machine.cuda, packages=packages)
    if why:
        here = [a for a in ATTN_IMPLS if attention_missing(a, cuda=machine.cuda, packages=packages) is None]
        raise ValueError(f"attn_implementation={cfg.attn_implementation!r} {why}; accepted here: {', '.join(here)}")
    from mlflow_llmeff.train.optimizers import compiles_step, missing

    if cfg.optimizer == "bnb-paged-adamw8bit" and not machine.cuda:  # its lever is CUDA's unified memory
        raise ValueError("optimizer='bnb-paged-adamw8bit' pages its states through CUDA unified memory and needs a "
                         "CUDA device (on CPU bitsandbytes falls back to unpaged states: the run would be "
                         "bnb-adamw8bit under another name); accepted here: bnb-adamw8bit")
    why = missing(cfg.optimizer, cuda=machine.cuda) if packages else None
    if why:
        raise ValueError(why)
    if compiles_step(cfg.optimizer) and cfg.warmup_steps == 0:
        raise ValueError(f"optimizer={cfg.optimizer!r} compiles its step on the first optimizer step; warmup_steps=0 "
                         "would count that compilation as a steady step; use warmup_steps >= 1")
    if cfg.weights == "bf16" and not machine.bf16:
        raise ValueError("weights=bf16 is not supported by this device (no bf16 compute); accepted here: weights=fp32")
    if cfg.lora_rank < 0:
        raise ValueError(f"lora_rank={cfg.lora_rank} must be >= 0 (0 = train every weight)")
    if cfg.lora_rank:
        import importlib.util

        if packages and importlib.util.find_spec("peft") is None:
            raise ValueError(f"lora_rank={cfg.lora_rank} needs peft, which is not installed here; "
                             "pip install 'mlflow-llmeff[lora]'")
        if not [t for t in cfg.lora_targets.split(",") if t.strip()]:
            raise ValueError(f"lora_targets={cfg.lora_targets!r} names no module; give e.g. q_proj,v_proj")
        from mlflow_llmeff.models.presets import shape_config
        from mlflow_llmeff.planning.plan import lora_trainable

        lora_trainable(cfg, shape_config(cfg.model))  # a target the model lacks: one line, before any weight
        if cfg.parallelism not in ("auto", "single", "ddp"):
            raise ValueError(f"lora_rank={cfg.lora_rank} with parallelism={cfg.parallelism!r}: LoRA adapters train "
                             "here with parallelism auto, single or ddp")


def render_mlproject() -> str:
    """The ``MLproject`` file, generated from :class:`TrainConfig` (a test keeps the file equal)."""
    lines = ["name: mlflow_llmeff", "",
             "# Generated by `python -m mlflow_llmeff.train.config > MLproject`; edit TrainConfig instead.",
             "# Environments: `--env-manager local` (the README's command), virtualenv (python_env.yaml,",
             "# needs that exact Python under pyenv) or conda (conda.yaml).",
             "python_env: python_env.yaml", "", "entry_points:", "  main:", "    parameters:"]
    args = []
    for f in dataclasses.fields(TrainConfig):
        tname = f.type if isinstance(f.type, str) else f.type.__name__
        mtype = {"int": "float", "float": "float", "str": "string", "bool": "string"}[tname]
        d = f.default
        dv = f'"{str(d).lower()}"' if isinstance(d, bool) else (f'"{d}"' if isinstance(d, str) else d)
        lines += [f"      # {f.metadata['help']}", f"      {f.name}: {{type: {mtype}, default: {dv}}}"]
        args.append(f"--{f.name.replace('_', '-')} {{{f.name}}}")
    lines += ["    command: >-", "      python -m mlflow_llmeff train"] + ["      " + a for a in args]
    lines += ["", "  # Score a saved model on MMLU / HellaSwag (lm-evaluation-harness 0.4 definitions).", "  eval:",
              "    parameters:"]
    for name, mtype, default, doc in EVAL_ENTRY_PARAMS:
        lines += [f"      # {doc}", f"      {name}: {{type: {mtype}, default: {default}}}"]
    lines += ["    command: >-", "      python -m mlflow_llmeff eval"]
    lines += [f"      --{n.replace('_', '-')} {{{n}}}" for n, *_ in EVAL_ENTRY_PARAMS]
    lines += ["", "  # Compare the runs of an experiment: table, scaling efficiency, Pareto fronts (docs/compare.md).",
              "  compare:", "    parameters:"]
    for name, mtype, default, doc in COMPARE_ENTRY_PARAMS:
        spec = f"{{type: {mtype}}}" if default is None else f"{{type: {mtype}, default: {default}}}"
        lines += [f"      # {doc}", f"      {name}: {spec}"]
    lines += ["    command: >-", "      python -m mlflow_llmeff compare --log-to-mlflow"]
    lines += [f"      --{n.replace('_', '-')} {{{n}}}" for n, *_ in COMPARE_ENTRY_PARAMS]
    return "\n".join(lines) + "\n"


EVAL_ENTRY_PARAMS = (
    ("model", "string", '"./model"', "Hugging Face causal LM directory (save_pretrained) or hub id"),
    ("tokenizer", "string", '"byt5"', "tokenizer directory or id; 'byt5' = the presets' byte-level tokenizer"),
    ("tasks", "string", '"mmlu,hellaswag"', "comma-separated: mmlu, hellaswag, mmlu_<subject>"),
    ("num_fewshot", "float", 0, "MMLU few-shot examples (0-5)"),
    ("limit", "float", 100, "first N documents of each task"),
    ("data_dir", "string", '""', "directory with mmlu/dev, mmlu/test, hellaswag/hellaswag_val.jsonl ('' = $LLMEFF_DATA_DIR, else the hub)"),
    ("batch_size", "float", 8, "sequences per forward pass"),
    ("output_json", "string", '"eval_results.json"', "metrics and per-example records"),
)

# The compare entry point's parameters: the `llmeff compare` options (a test runs the command).
# --log-to-mlflow is a flag, always on here: the report lands in the MLflow UI's artifact viewer.
COMPARE_ENTRY_PARAMS = (
    ("experiment", "string", None, "experiment name (or id) whose runs are compared (required)"),
    ("filter", "string", '""', "MLflow search filter ('' = every run)"),
    ("group_by", "string", '"accelerator.name,parallelism.strategy,precision"', "llmeff tag names the plots group by"),
    ("out", "string", '"llmeff-compare"', "folder for report.md, report.csv, report.html and the PNGs"),
)


if __name__ == "__main__":  # pragma: no cover
    print(render_mlproject(), end="")
