"""The optimizers ``llmeff train --optimizer`` offers, and what each one stores per parameter (pure, no I/O).

One entry per choice: the package that implements it, the class, and its state layout (bytes per
element of each tensor as stored, block scales, the small tensors a library keeps unquantized).
``train/optimizers.py`` builds them; ``planning/plan.py`` counts their bytes; the measurement
(``meters/memory.py``) reads any optimizer's states as stored and needs no entry here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["OptimizerChoice", "OPTIMIZERS", "OPTIMIZER_NAMES", "WEIGHTS", "choice", "weight_bytes",
           "state_bytes", "step_temporary_bytes", "bytes_per_param"]


@dataclass(frozen=True)
class OptimizerChoice:
    """One ``--optimizer`` value.

    Attributes:
        name: the option's value, e.g. ``adamw8bit``.
        package: the distribution that implements it (``torch``, ``torchao``, ``bitsandbytes``).
        cls: the class, dotted (``torchao.optim.AdamW8bit``).
        extra: the pip extra of mlflow-llmeff that installs ``package`` ('' for torch).
        states: what the states are, in words (for the plan's assumptions).
    """

    name: str
    package: str
    cls: str
    extra: str
    states: str

    def __post_init__(self) -> None:
        if not self.name or not self.cls.startswith(self.package.replace("-", "_").split("[")[0]):
            raise ValueError(f"optimizer {self.name!r}: class {self.cls!r} is not in package {self.package!r}")


OPTIMIZERS: dict[str, OptimizerChoice] = {c.name: c for c in (
    OptimizerChoice("adamw", "torch", "torch.optim.AdamW", "",
                    "two moments in the weights' dtype (fp32: 8 B/param)"),
    OptimizerChoice("adamw-bf16", "mlflow_llmeff", "mlflow_llmeff.train.optimizers.AdamWBf16", "",
                    "two moments in bf16 (4 B/param), update computed in fp32"),
    OptimizerChoice("adamw8bit", "torchao", "torchao.optim.AdamW8bit", "torchao",
                    "two moments as uint8 codes with an fp32 scale per 256-element block (about 2.03 B/param); "
                    "tensors under 4,096 elements or not divisible by 256 keep plain moments"),
    OptimizerChoice("adamw4bit", "torchao", "torchao.optim.AdamW4bit", "torchao",
                    "two moments as 4-bit codes with an fp32 scale per 128-element block (about 1.06 B/param); "
                    "tensors under 4,096 elements or not divisible by 128 keep plain moments"),
    OptimizerChoice("bnb-adamw8bit", "bitsandbytes", "bitsandbytes.optim.AdamW8bit", "bnb",
                    "two moments as uint8 codes with an fp32 absmax per 256-element block (about 2.03 B/param); "
                    "tensors under 4,096 elements keep fp32 moments; the two quantization maps once per optimizer"),
    OptimizerChoice("bnb-paged-adamw8bit", "bitsandbytes", "bitsandbytes.optim.PagedAdamW8bit", "bnb",
                    "as bnb-adamw8bit, the states in paged (CUDA unified) memory; on CPU bitsandbytes falls back to "
                    "unpaged states with a warning"),
    OptimizerChoice("adafactor", "torch", "torch.optim.Adafactor", "",
                    "no first moment; the second moment factored into a row and a column vector per matrix "
                    "(full for vectors)"),
    OptimizerChoice("sgd", "torch", "torch.optim.SGD", "",
                    "SGD with momentum 0.9: one momentum buffer in the weights' dtype (fp32: 4 B/param)"),
)}

#: The accepted ``--optimizer`` values, in the order the help lists them.
OPTIMIZER_NAMES: tuple[str, ...] = tuple(OPTIMIZERS)

#: The accepted ``--weights`` values: ``fp32`` (fp32 weights; the master copy under bf16/fp16 mixed
#: precision) and ``bf16`` (pure bf16 weights and gradients, no fp32 master copy).
WEIGHTS: tuple[str, ...] = ("fp32", "bf16")


def choice(name: str) -> OptimizerChoice:
    """The :class:`OptimizerChoice` called ``name``.

    Raises:
        ValueError: ``name`` is not one of :data:`OPTIMIZER_NAMES` (the message lists them).
    """
    try:
        return OPTIMIZERS[name]
    except KeyError:
        raise ValueError(f"optimizer={name!r} is not accepted; use one of: {', '.join(OPTIMIZER_NAMES)}") from None


#: Bytes per element of the weights (and of their gradients) for each ``--weights`` value: fp32 weights
#: (the master copy under mixed precision, whose gradients are fp32 too) or pure bf16.
_WEIGHT_BYTES = {"fp32": 4, "bf16": 2}

#: Bytes of the 0-d fp32 ``step`` tensor torch's Adam family and Adafactor keep per parameter tensor
#: (torch/optim/adam.py ``Adam._init_group``, _adafactor.py ``Adafactor._init_group``:
#: ``torch.tensor(0.0, dtype=_get_scalar_dtype())``); torchao's ``_AdamBase.step`` (torchao/optim/adam.py)
#: keeps the same ``torch.tensor(0.0)``. bitsandbytes counts steps in a Python int.
STEP_BYTES = 4

#: The low-bit rules: (code bytes per element, elements per fp32 scale, entries of the fp32 lookup
#: table each state tensor carries, smallest quantized tensor, whether the numel must divide by the
#: block). torchao 0.18 ``optim/adam.py`` ``_AdamBase._new_buffer``: a tensor is quantized when
#: ``numel >= 4096 and numel % block_size == 0``, else ``torch.zeros_like(p)``; ``AdamW8bit``
#: block_size=256, ``subclass_8bit.py`` ``OptimState8bit.zeros``: uint8 codes, ``numel // block_size``
#: fp32 scales, a 256-entry fp32 ``qmap`` tensor per state tensor; ``AdamW4bit`` block_size=128,
#: ``subclass_4bit.py`` ``OptimState4bit.zeros``: ``numel // 2`` uint8 codes, a 16-entry fp32 qmap.
#: bitsandbytes 0.50.2 ``optim/optimizer.py`` ``Optimizer2State.init_state``: ``numel <
#: min_8bit_size`` (4096) keeps fp32 ``state1``/``state2`` whatever the weights' dtype, else uint8
#: states and fp32 ``absmax1``/``absmax2`` of ``ceil(numel / 256)`` blocks; the two 256-entry fp32
#: maps (``name2qmap['dynamic']``, ``['udynamic']``) are shared by every tensor of the optimizer.
_LOW_BIT = {
    "adamw8bit": (1.0, 256, 256, 4096, True),
    "adamw4bit": (0.5, 128, 16, 4096, True),
    "bnb-adamw8bit": (1.0, 256, 0, 4096, False),
    "bnb-paged-adamw8bit": (1.0, 256, 0, 4096, False),
}


def weight_bytes(weights: str) -> int:
    """Bytes per element of the weights (and their gradients) for a ``--weights`` value: 4 (fp32) or 2 (bf16).

    Raises:
        ValueError: ``weights`` is not one of :data:`WEIGHTS`.
    """
    if weights not in _WEIGHT_BYTES:
        raise ValueError(f"weights={weights!r} is not accepted; use one of: {', '.join(WEIGHTS)}")
    return _WEIGHT_BYTES[weights]


def _numel(t) -> int:
    return int(t) if isinstance(t, int) else math.prod(int(d) for d in t)


def state_bytes(name: str, numels: Sequence, weight_bytes: int) -> float:
    """Bytes of optimizer state, as stored, for parameter tensors of ``numels`` elements.

    Per choice (each read in the installed source: torch 2.13, bitsandbytes 0.50.2, torchao 0.18):

    * ``adamw``: ``exp_avg`` and ``exp_avg_sq`` as ``torch.zeros_like(p)`` (the weights' dtype) plus
      the 4-byte 0-d ``step`` tensor per tensor (torch/optim/adam.py ``Adam._init_group``; AdamW is
      Adam with decoupled weight decay, torch/optim/adamw.py): ``2 x wb x numel + 4``.
    * ``adamw-bf16``: the two moments in bf16: ``2 x 2 x numel + 4``.
    * ``adamw8bit`` / ``adamw4bit`` (torchao): a tensor of at least 4,096 elements whose numel
      divides by the block (256 / 128) holds per moment the codes (1 / 0.5 B each), an fp32 scale
      per block and its fp32 lookup table (256 / 16 entries); others plain moments in the weights'
      dtype (torchao/optim/adam.py ``_AdamBase._new_buffer``, subclass_8bit.py / subclass_4bit.py
      ``zeros``); plus the 4-byte step.
    * ``bnb-adamw8bit`` / ``bnb-paged-adamw8bit``: at least 4,096 elements: two uint8 states and two
      fp32 absmax vectors of ``ceil(numel / 256)`` blocks; smaller tensors two fp32 states (4 B
      each whatever the weights' dtype); plus the two 256-entry fp32 quantization maps once per
      optimizer (bitsandbytes/optim/optimizer.py ``Optimizer2State.init_state``, ``fill_qmap``).
      Paged states have the same size (unified memory on CUDA; plain tensors on CPU).
    * ``adafactor``: for a tensor of 2 or more dims, the row and column factors of the second moment
      (``p.grad.new_zeros``: the gradients' dtype), ``numel / last_dim`` and ``numel / second_last``
      elements; a 1-D tensor a full ``variance``; no first moment; plus the step
      (torch/optim/_adafactor.py ``Adafactor._init_group``).
    * ``sgd`` (momentum 0.9): one ``momentum_buffer`` (a clone of the gradient: the weights' dtype),
      created at the first step (torch/optim/sgd.py ``_single_tensor_sgd``).

    Args:
        name: an ``--optimizer`` value (:data:`OPTIMIZER_NAMES`).
        numels: one entry per parameter tensor: its element count (int), or its shape (a sequence of
            ints; only ``adafactor`` reads more than the count, an int counts as a 1-D tensor).
        weight_bytes: bytes per element of the weights and gradients (4 fp32, 2 bf16).

    Returns:
        Bytes (float, >= 0).

    Raises:
        ValueError: an unknown ``name`` or ``weight_bytes`` not 2 or 4.
    """
    choice(name)
    if weight_bytes not in (2, 4):
        raise ValueError(f"weight_bytes={weight_bytes!r} is not accepted; use 4 (fp32) or 2 (bf16)")
    total = 0.0
    if name in ("adamw", "adamw-bf16"):
        b = weight_bytes if name == "adamw" else 2
        return float(sum(2 * b * _numel(t) + STEP_BYTES for t in numels))
    if name == "sgd":
        return float(sum(weight_bytes * _numel(t) for t in numels))
    if name == "adafactor":
        for t in numels:
            shape = (int(t),) if isinstance(t, int) else tuple(int(d) for d in t)
            n = math.prod(shape)
            factored = n // shape[-1] + n // shape[-2] if len(shape) > 1 else n
            total += weight_bytes * factored + STEP_BYTES
        return total
    code, block, table, smallest, divides = _LOW_BIT[name]
    bnb = name.startswith("bnb")
    for t in numels:
        n = _numel(t)
        if n >= smallest and (not divides or n % block == 0):
            total += 2 * (code * n + 4 * math.ceil(n / block) + 4 * table)
        else:
            total += 2 * (4 if bnb else weight_bytes) * n
        total += 0 if bnb else STEP_BYTES
    if bnb and any(_numel(t) >= smallest for t in numels):
        total += 2 * 256 * 4  # the signed and unsigned dynamic maps, once per optimizer
    return total


def bytes_per_param(name: str, weight_bytes: int) -> float:
    """Optimizer-state bytes per parameter of large tensors (quantized where the choice quantizes),
    without the per-tensor and per-optimizer constants (steps, lookup tables): the marginal bytes of
    one more parameter, e.g. 8 for fp32 AdamW, 2 + 8/256 = 2.03125 for the 8-bit ones.

    Raises:
        ValueError: as :func:`state_bytes`.
    """
    small, large = state_bytes(name, [(1024, 1024)], weight_bytes), state_bytes(name, [(1024, 2048)], weight_bytes)
    return (large - small) / (1024 * 1024) if name != "adafactor" else small / (1024 * 1024)


def step_temporary_bytes(name: str, numels: Sequence, weight_bytes: int, *, foreach: bool,
                         cpu: bool = False) -> float:
    """Bytes ``optimizer.step()`` allocates on top of weights, gradients and state at its peak.

    Per choice, from the installed source (torch 2.13 picks ``foreach`` by default only when every
    parameter is on CUDA: torch/optim/optimizer.py ``_default_to_fused_or_foreach``; on a CPU the
    single-tensor loop runs; ``fused`` is never the default):

    * ``adamw``, foreach (torch/optim/adam.py ``_multi_tensor_adam``, decoupled weight
      decay in place): ``exp_avg_sq_sqrt = torch._foreach_sqrt(exp_avg_sqs)``, one model's worth in the
      state dtype, held to the final ``_foreach_addcdiv_`` (the divisions and ``eps`` are in place; the
      bias corrections are Python floats). torchtune PR #389 reports about one more model of fp32.
      ``llmeff train``'s groups (decay for matrices, none for vectors) step one after the other; the
      vectors' group is small, so one model's worth is the count (an upper bound by the vectors).
      Single-tensor (``_single_tensor_adam``): ``denom = (exp_avg_sq.sqrt() / bc2_sqrt).add_(eps)``
      holds two tensors of the largest parameter at once. Fused: none.
    * ``adamw-bf16`` (mlflow_llmeff/train/optimizers.py ``AdamWBf16.step``, one tensor at a time
      whatever ``foreach``): the fp32 moments ``m`` and ``v`` and ``denom``'s two tensors, plus with bf16
      weights the fp32 gradient and weights: ``16 x max numel`` (fp32 weights), ``24 x`` (bf16),
      measured exactly on a 1M-element tensor.
    * ``adamw8bit`` / ``adamw4bit`` (torchao ``single_param_adam``, one tensor at a time): the
      dequantized fp32 moments and the fp32 update of the largest tensor, ``3 x 4 x max numel``
      (read, not measured: the step is torch.compile'd and inductor may fuse some away).
    * ``bnb-*`` on CUDA: none significant (fused in-place kernels, ``optimizer_update_8bit_blockwise``).
      On a CPU (``cpu=True``; bitsandbytes/backends/cpu/ops.py ``_optimizer_update_8bit_blockwise_cpu``):
      both moments dequantized to fp32, ``g.float() * gnorm_scale``, and ``denom``'s two tensors, about
      ``5 x 4 x max numel`` (measured 5.25 on the narrow model of tests/test_plan_memory.py).
    * ``adafactor``: ``var_estimate`` (``row_var @ col_var``, full size, the weights' dtype) of the
      largest tensor (single-tensor), or of every tensor (foreach).
    * ``sgd``: none (the momentum and the update are in place).

    Gradient clipping (``torch.nn.utils.clip_grad_norm_``, ``max_grad_norm`` 1.0) allocates only
    one 0-d norm per tensor and scales in place: nothing significant (measured: the clip phase is
    weights + gradients + state + the held logits to the byte).

    Args:
        name: an ``--optimizer`` value.
        numels: element counts (or shapes) of the parameter tensors, as :func:`state_bytes`.
        weight_bytes: bytes per element of the weights (4 or 2).
        foreach: torch's multi-tensor path (its default on CUDA).
        cpu: the step runs on a CPU (only bitsandbytes' CPU backend differs).

    Returns:
        Bytes (float, >= 0).

    Raises:
        ValueError: as :func:`state_bytes`.
    """
    state_bytes(name, [], weight_bytes)  # validates name and weight_bytes
    sizes = [_numel(t) for t in numels]
    largest = max(sizes, default=0)
    if name == "adamw":
        return float(weight_bytes * sum(sizes)) if foreach else float(2 * weight_bytes * largest)
    if name == "adamw-bf16":
        return float((16 if weight_bytes == 4 else 24) * largest)
    if name in ("adamw8bit", "adamw4bit"):
        return float(3 * 4 * largest)
    if name.startswith("bnb"):
        return float(5 * 4 * largest) if cpu else 0.0
    if name == "adafactor":
        return float(weight_bytes * (sum(sizes) if foreach else largest))
    return 0.0
