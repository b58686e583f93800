"""Will it fit? Memory per device against what the device has, before a model is built.

The need is the step's peak from :func:`mlflow_llmeff.planning.plan.estimate_memory` (the estimator
``llmeff plan`` prints: the largest of a step's phases, :meth:`~mlflow_llmeff.planning.plan.MemoryEstimate.peak`,
each holding its share of the model state under the chosen sharding and the run's optimizer and
weights, the activations with or without checkpointing, the loss path at the vocabulary and the
optimizer step's temporaries), plus a stated allocator margin: :data:`MARGIN_FRACTION` of the estimate
(PyTorch's caching allocator fragments; PyTorch's own memory docs and the FSDP/ZeRO papers report
10-20% above the tensors' bytes) and :data:`MARGIN_FIXED_GIB` per device (the CUDA context,
cuBLAS workspaces and NCCL buffers; on a CPU the interpreter and its libraries).

What the device has: on CUDA the free memory of every local device (``torch.cuda.mem_get_info``,
the smallest); on a CPU the host memory available to this process (``MemAvailable``, bounded by a
cgroup limit where one is set), shared by all the processes of the run. Planning for a named
accelerator uses its datasheet capacity (:data:`mlflow_llmeff.meters.hardware.MEMORY_GB`).

When it does not fit, :func:`verdict` lists the cheapest configurations that do: the same compute
first (bf16 activations, a smaller micro-batch with more accumulation so the global batch stays,
sharding with FSDP over the same devices), then more devices with FSDP, then activation
checkpointing (about 4/3 of the compute), then the memory levers on the asked devices (an 8-bit
optimizer, bf16 weights, LoRA adapters; each set of them with its own micro-batch or checkpointing),
each with the GiB ``llmeff plan`` prints for it. "Nothing fits" is said only when none of these does,
with the configuration tried that needs the least.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from dataclasses import dataclass, field

from mlflow_llmeff.planning.plan import GIB, estimate_memory, levers, lora_trainable

__all__ = ["MARGIN_FRACTION", "MARGIN_FIXED_GIB", "Candidate", "Verdict", "needed_bytes", "verdict", "check",
           "host_available_bytes", "cuda_free_bytes"]

MARGIN_FRACTION = 0.10
MARGIN_FIXED_GIB = 1.5
_DEVICE_STEPS = (2, 4, 8, 16, 32, 64, 128, 256)


def needed_bytes(estimate_bytes: float) -> float:
    """The estimate plus the allocator margin, bytes per device."""
    return estimate_bytes * (1.0 + MARGIN_FRACTION) + MARGIN_FIXED_GIB * GIB


@dataclass(frozen=True)
class Candidate:
    """A configuration that fits.

    Attributes:
        changes: parameter -> new value (the names of ``llmeff train`` / MLproject parameters).
        estimate_bytes: the step's estimated peak bytes per device (without the margin).
        devices: devices it uses.
        compute: compute relative to the asked configuration (4/3 with activation checkpointing added).
        needs: what a lever's package needs on this machine (``needs peft: pip install ...``), '' when installed.
    """

    changes: dict
    estimate_bytes: float
    devices: int
    compute: float
    needs: str = ""

    def describe(self, style: str = "cli") -> str:
        """``--micro-batch-size 2 --grad-accum 4 (46 GiB)`` or ``-P micro_batch_size=2 ...`` (``style="mlflow"``);
        ``(15.7 GiB, needs peft: pip install 'mlflow-llmeff[lora]')`` where a lever's package is missing."""
        if style == "mlflow":
            opts = " ".join(f"-P {k}={_text(v)}" for k, v in self.changes.items())
        else:
            opts = " ".join(f"--{k.replace('_', '-')} {_text(v)}" for k, v in self.changes.items())
        return f"{opts} ({_gib(self.estimate_bytes)} GiB{', ' + self.needs if self.needs else ''})"


def _gib(b: float) -> str:
    """Bytes as GiB with sensible digits: 109, 22.4, 0.61."""
    g = b / GIB
    return f"{g:.0f}" if g >= 100 else f"{g:.1f}" if g >= 1 else f"{g:.2g}"


def _text(v) -> str:
    return str(v).lower() if isinstance(v, bool) else str(v)


@dataclass(frozen=True)
class Verdict:
    """Whether a configuration fits a device, and what would.

    Attributes:
        model: the model name.
        estimate_bytes: the step's estimated peak bytes per device (the largest of its phases).
        available_bytes: what the device has (None: unknown, no verdict).
        where: the device in words, e.g. ``an 80 GiB H100-SXM`` or ``this CPU``.
        processes_share: True when the processes share the memory (CPU: one host for all).
        processes: processes of the run.
        candidates: cheapest fitting configurations when it does not fit.
        why_none: why nothing fits, when no candidate does (the model state's need as asked).
        strategy: the parallelism strategy the estimate is for.
        smallest: when nothing fits, the configuration tried that needs the least memory (levers included).
        presets: when nothing fits, the largest presets that would (``; the largest preset that fits ...``).
    """

    model: str
    estimate_bytes: float
    available_bytes: float | None
    where: str
    processes_share: bool
    processes: int
    candidates: list[Candidate] = field(default_factory=list)
    why_none: str = ""
    strategy: str = ""
    smallest: Candidate | None = None
    presets: str = ""

    @property
    def needed_bytes(self) -> float:
        """With the margin, for everything that must fit into ``available_bytes``."""
        return needed_bytes(self.estimate_bytes) * (self.processes if self.processes_share else 1)

    @property
    def fits(self) -> bool | None:
        return None if self.available_bytes is None else self.needed_bytes <= self.available_bytes

    def line(self, style: str = "cli") -> str:
        """One line: the verdict, the need and the room, and what would fit."""
        per = "per process" if self.processes_share else "per device"
        need = (f"{self.model} needs about {_gib(self.estimate_bytes)} GiB {per} "
                f"({_gib(needed_bytes(self.estimate_bytes))} GiB with the allocator margin"
                + (f", x{self.processes} processes" if self.processes_share and self.processes > 1 else "") + ")")
        if self.available_bytes is None:
            return f"{need}; the memory of {self.where} is unknown, so it is not checked"
        room = f"against {_gib(self.available_bytes)} GiB available"
        if self.fits:
            return f"fits {self.where}: {need}, {room} ({_gib(self.available_bytes - self.needed_bytes)} GiB to spare)"
        force = "-P force=true" if style == "mlflow" else "--force true"
        if self.candidates:
            alts = "; ".join(c.describe(style) for c in self.candidates)
            return f"does not fit {self.where}: {need}, {room}. Fits with: {alts} ({force} skips this check)"
        least = ""
        if self.smallest is not None and self.smallest.changes:
            least = f"; the least any configuration tried needs is {self.smallest.describe(style)}"
        return (f"does not fit {self.where}: {need}, {room}. {self.why_none}{least}{self.presets} "
                f"({force} skips this check)")


def _estimate(config, cfg, *, micro_batch_size, precision, strategy, devices, ckpt, degrees=None, cuda=True) -> float:
    """The step's peak bytes per device of ``cfg`` changed as given (its optimizer, weights, LoRA adapters,
    attention kernel and accumulation kept: a lever is changed by passing a ``cfg`` with it changed)."""
    from mlflow_llmeff.parallel import get

    if degrees is None:
        try:  # tensor / shard degrees of the strategy over these devices (None: all data-parallel)
            degrees = get(strategy).degrees(devices * cfg.num_machines, tp_size=cfg.tp_size, dp_shard=cfg.dp_shard,
                                            processes_per_node=devices)
        except ValueError:
            degrees = None
    optimizer, weights = levers(cfg)
    mem = estimate_memory(config, seq_len=cfg.seq_len, micro_batch_size=micro_batch_size, strategy=strategy,
                          dp=devices, precision=precision, eager_attention=cfg.attn_implementation == "eager",
                          degrees=degrees, optimizer=optimizer, weights=weights, cuda=cuda,
                          grad_accum=cfg.grad_accum * (cfg.micro_batch_size // micro_batch_size),
                          trainable=lora_trainable(cfg, config))
    return mem.total(ckpt)


#: LoRA rank a suggestion offers (``--lora-rank``): PEFT's ``LoraConfig`` default ``r=8`` (Hu et al. 2021,
#: "LoRA", Sec. 7.2: ranks 1-8 already match full fine-tuning on GPT-3's adaptation tasks).
LORA_RANK = 8

#: How far each memory lever moves the training away from what was asked, for ordering suggestions after
#: the ones that train the same weights the same way: an 8-bit optimizer and bf16 weights change the
#: numerics (1 each); LoRA trains adapters instead of the model (2).
_LEVER_WEIGHT = {"optimizer": 1, "weights": 1, "lora_rank": 2}

#: Lever packages: the module ``find_spec`` looks for, and the pip extra that installs it (pyproject.toml).
_LEVER_PACKAGES = {"lora_rank": ("peft", "lora"), "adamw8bit": ("torchao", "torchao"),
                   "bnb-adamw8bit": ("bitsandbytes", "bnb")}


def _installed(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def _lever_sets(config, cfg, *, precision: str, strategy: str, bf16_ok: bool) -> list[dict]:
    """Every combination of the memory levers ``llmeff train`` has that ``cfg`` does not use yet and that its
    strategy and machine allow, as ``{parameter: value}`` (``{}``: none; precision bf16 with bf16 weights).

    The levers (docs/memory.md): an 8-bit optimizer (``adamw8bit``, torchao, or
    ``bnb-adamw8bit`` where only bitsandbytes is installed: about 2.03 B/param of state instead of AdamW's 8),
    bf16 weights (2 + 2 B/param, no fp32 master; needs precision bf16, not under DeepSpeed), and LoRA
    adapters of rank :data:`LORA_RANK` on ``cfg.lora_targets`` (the base frozen: no gradients or state for
    it; single or ddp only), each as :func:`mlflow_llmeff.train.config.validate` accepts it.
    """
    one: list[dict] = []
    zero = strategy.startswith("deepspeed")
    if cfg.optimizer in ("adamw", "adamw-bf16") and not zero:
        eight = "adamw8bit" if _installed("torchao") or not _installed("bitsandbytes") else "bnb-adamw8bit"
        one.append({"optimizer": eight})
    if cfg.weights == "fp32" and bf16_ok and not zero:
        one.append({"weights": "bf16", **({"precision": "bf16"} if precision != "bf16" else {})})
    if not cfg.lora_rank and strategy in ("single", "ddp"):
        try:
            lora_trainable(dataclasses.replace(cfg, lora_rank=LORA_RANK), config)
            one.append({"lora_rank": LORA_RANK})
        except ValueError:  # the model has no matrix the targets name: no LoRA to offer
            pass
    return [{k: v for part in combo for k, v in part.items()}
            for n in range(len(one) + 1) for combo in itertools.combinations(one, n)]


def _candidates(config, cfg, *, precision, strategy, available, cpu, bf16_ok) -> tuple[list[Candidate], Candidate]:
    """Every variation of the asked configuration that fits, cheapest first, minimal changes only; and the
    variation tried that needs the least memory (named when none fits).

    Tried: smaller micro-batches (more accumulation), bf16, other layouts (CPU: fewer processes; CUDA: FSDP,
    then more devices), activation checkpointing, and each set of memory levers (:func:`_lever_sets`) on
    the asked devices; each estimated by :func:`_estimate`, the figure ``llmeff plan`` prints for it.
    """
    mbs_options = [cfg.micro_batch_size]
    while mbs_options[-1] > 1:
        mbs_options.append(mbs_options[-1] // 2)
    ckpts = [cfg.activation_checkpointing] + ([True] if not cfg.activation_checkpointing else [])
    if cpu:  # processes share the host: fewer of them, never sharding
        layouts = [(n, strategy if n > 1 else "single") for n in range(cfg.num_processes, 0, -1)]
    else:
        layouts = [(cfg.num_processes, strategy)]
        if strategy != "fsdp" and not strategy.startswith("deepspeed"):
            layouts.append((cfg.num_processes, "fsdp"))
        layouts += [(n, "fsdp" if not strategy.startswith("deepspeed") else "deepspeed_zero3")
                    for n in _DEVICE_STEPS if n > cfg.num_processes]
    found: list[Candidate] = []
    smallest: Candidate | None = None
    for lever in _lever_sets(config, cfg, precision=precision, strategy=strategy, bf16_ok=bf16_ok):
        changed = dataclasses.replace(cfg, **{k: v for k, v in lever.items() if k != "precision"}) if lever else cfg
        precisions = ([lever.get("precision", precision)] if "weights" in lever
                      else [precision] + (["bf16"] if precision == "fp32" and bf16_ok else []))
        # levers are tried on the asked devices (they are there to spare buying more); LoRA stays replicated
        shapes = [(n, s) for n, s in layouts if not lever or n == cfg.num_processes]
        shapes = [(n, s) for n, s in shapes if "lora_rank" not in lever or s in ("single", "ddp")]
        for mbs, prec, ckpt, (n, strat) in itertools.product(mbs_options, precisions, ckpts, shapes):
            est = _estimate(config, changed, micro_batch_size=mbs, precision=prec, strategy=strat, devices=n,
                            ckpt=ckpt, cuda=not cpu)
            changes = {}
            if prec != precision:
                changes["precision"] = prec
            changes.update({k: v for k, v in lever.items() if k != "precision"})
            if mbs != cfg.micro_batch_size:
                changes["micro_batch_size"] = mbs
                changes["grad_accum"] = cfg.grad_accum * (cfg.micro_batch_size // mbs)
            if n != cfg.num_processes:
                changes["num_processes"] = n
            if strat != strategy:
                changes["parallelism"] = strat
            if ckpt != cfg.activation_checkpointing:
                changes["activation_checkpointing"] = ckpt
            cand = Candidate(changes, est, n, 4 / 3 if ckpt and not cfg.activation_checkpointing else 1.0,
                             _needs(lever))
            need = needed_bytes(est) * (n if cpu else 1)
            if smallest is None or need < needed_bytes(smallest.estimate_bytes) * (smallest.devices if cpu else 1):
                smallest = cand
            if need <= available and changes:
                found.append(cand)
    # drop a candidate that changes more than a cheaper one that fits; then the cheapest of each kind
    found = [c for c in found if not any(set(o.changes) < set(c.changes) and _cost(o) <= _cost(c) for o in found)]
    best: dict[str, Candidate] = {}
    for c in sorted(found, key=_cost):
        best.setdefault(_kind(c), c)
    return sorted(best.values(), key=_cost), smallest


def _needs(lever: dict) -> str:
    """What a lever's package needs here: ``needs peft: pip install 'mlflow-llmeff[lora]'``, or ''."""
    for key in (lever.get("optimizer"), "lora_rank" if "lora_rank" in lever else None):
        module, extra = _LEVER_PACKAGES.get(key, (None, None))
        if module and not _installed(module):
            return f"needs {module}: pip install 'mlflow-llmeff[{extra}]'"
    return ""


def _cost(c: Candidate) -> tuple:
    """Levers last (how far they move the training, :data:`_LEVER_WEIGHT`), then compute (recomputation costs
    4/3), then devices, then how much changes."""
    return (sum(w for k, w in _LEVER_WEIGHT.items() if k in c.changes), c.compute, c.devices, len(c.changes),
            -c.changes.get("micro_batch_size", 10**9))


def _kind(c: Candidate) -> str:
    lever = sorted(k for k in _LEVER_WEIGHT if k in c.changes)
    if lever:  # one suggestion per set of levers
        return "levers: " + ", ".join(lever)
    if "activation_checkpointing" in c.changes:
        return "checkpointing"
    if "num_processes" in c.changes:
        return "devices"
    if "parallelism" in c.changes:
        return "sharding"
    if "precision" in c.changes:
        return "precision"
    return "micro_batch"


def check(spec, *, available_bytes: float | None, where: str) -> Verdict:
    """:func:`verdict` of a resolved run (a :class:`~mlflow_llmeff.planning.spec.RunSpec`): its strategy,
    degrees and precision as resolved; its machine says whether the processes share host memory (no
    CUDA) and whether bf16 is there to offer."""
    return verdict(spec.options, precision=spec.precision, strategy=spec.strategy_name,
                   available_bytes=available_bytes, where=where, cpu=not spec.machine.cuda,
                   bf16_ok=spec.machine.bf16, degrees=spec.degrees)


def verdict(cfg, *, precision: str, strategy: str, available_bytes: float | None, where: str, cpu: bool,
            bf16_ok: bool = True, degrees=None) -> Verdict:
    """Check ``cfg`` against ``available_bytes`` (see the module docstring).

    Args:
        cfg: a :class:`~mlflow_llmeff.train.config.TrainConfig`.
        precision, strategy: resolved precision and parallelism strategy.
        available_bytes: free bytes per device (CUDA) or host bytes for all processes (CPU); None
            when unknown.
        where: the device in words for the message.
        cpu: the processes share host memory (and cannot shard).
        bf16_ok: bf16 is possible there (bf16 precision and bf16 weights are offered).
        degrees: the run's resolved degrees (:func:`check` passes its spec's); None: the strategy's
            degrees over the processes, as for every configuration the verdict tries instead.
    """
    from mlflow_llmeff.models.presets import PRESETS, shape_config

    config = shape_config(cfg.model)
    est = _estimate(config, cfg, micro_batch_size=cfg.micro_batch_size, precision=precision, strategy=strategy,
                    devices=cfg.num_processes, ckpt=cfg.activation_checkpointing, degrees=degrees, cuda=not cpu)
    v = Verdict(cfg.model, est, available_bytes, where, cpu, cfg.num_processes, strategy=strategy)
    if available_bytes is None or v.fits:
        return v
    cands, smallest = _candidates(config, cfg, precision=precision, strategy=strategy, available=available_bytes,
                                  cpu=cpu, bf16_ok=bf16_ok)
    if not cands:
        optimizer, weights = levers(cfg)
        state = estimate_memory(config, seq_len=cfg.seq_len, micro_batch_size=1, strategy=strategy,
                                dp=cfg.num_processes, precision=precision, optimizer=optimizer, weights=weights,
                                cuda=not cpu, trainable=lora_trainable(cfg, config))
        named = "AdamW" if optimizer == "adamw" else optimizer
        why = (f"Nothing fits there, memory levers included: weights, gradients and {named} state alone need "
               f"{_gib(state.weights + state.gradients + state.optimizer)} GiB as asked")
        presets = ""

        def largest(prec: str) -> tuple[float, str] | None:
            fitting = []
            for name in PRESETS:
                if name == cfg.model:
                    continue
                need = needed_bytes(_estimate(shape_config(name), cfg, micro_batch_size=cfg.micro_batch_size,
                                              precision=prec, strategy=strategy, devices=cfg.num_processes,
                                              ckpt=cfg.activation_checkpointing, cuda=not cpu))
                if need * (cfg.num_processes if cpu else 1) <= available_bytes:
                    fitting.append((need, name))
            return max(fitting) if fitting else None

        asked = largest(precision)
        if asked:
            presets += f"; the largest preset that fits as asked is {asked[1]} ({_gib(asked[0])} GiB with the margin)"
        if precision == "fp32" and bf16_ok:
            half = largest("bf16")
            if half and (asked is None or half[1] != asked[1]):
                presets += f"; in bf16 precision, {half[1]} ({_gib(half[0])} GiB with the margin)"
        return Verdict(cfg.model, est, available_bytes, where, cpu, cfg.num_processes, [], why, strategy,
                       smallest, presets)
    return Verdict(cfg.model, est, available_bytes, where, cpu, cfg.num_processes, cands, "", strategy)


def host_available_bytes() -> float | None:
    """Host memory this process can still take: ``MemAvailable``, bounded by a cgroup limit."""
    avail = None
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = float(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            raw = open(limit_file, encoding="ascii").read().strip()
            if raw == "max" or int(raw) > 1 << 60:
                continue
            room = int(raw) - int(open(usage_file, encoding="ascii").read().strip())
            avail = room if avail is None else min(avail, room)
        except (OSError, ValueError):
            continue
    return avail


def cuda_free_bytes() -> float | None:
    """The smallest free memory over this process's CUDA devices (``torch.cuda.mem_get_info``)."""
    import torch

    if not torch.cuda.is_available():
        return None
    local = os.environ.get("LOCAL_RANK")
    indices = [int(local)] if local is not None else range(torch.cuda.device_count())
    return float(min(torch.cuda.mem_get_info(i)[0] for i in indices))
