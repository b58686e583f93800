"""The optimizers ``llmeff train --optimizer`` offers, and what each one stores per parameter (pure, no I/O).

One entry per choice: the package that implements it, the class, and its state layout (bytes per
element of each tensor as stored, block scales, the small tensors a library keeps unquantized).
``train/optimizers.py`` builds them; ``planning/plan.py`` counts their bytes; the measurement
(``meters/memory.py``) reads any optimizer's states as stored and needs no entry here.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["OptimizerChoice", "OPTIMIZERS", "OPTIMIZER_NAMES", "WEIGHTS", "choice"]


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
    OptimizerChoice("adamw-bf16", "torch", "torch.optim.AdamW", "",
                    "two moments in bf16 (4 B/param), update computed in fp32"),
    OptimizerChoice("adamw8bit", "torchao", "torchao.optim.AdamW8bit", "torchao",
                    "two moments as int8 codes with an fp32 scale per 256-element block (about 2.03 B/param); "
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
