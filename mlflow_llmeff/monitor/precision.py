"""The precision the matmuls run in, read off the modules that run: FP8 layers of torchao and TransformerEngine.

An FP8 recipe converts a model's linear layers in place: torchao's ``convert_to_float8_training`` swaps
``nn.Linear`` for ``torchao.float8.float8_linear.Float8Linear`` (torchtitan's float8 path), and
TransformerEngine's ``te.Linear`` / ``te.LayerNormLinear`` / ``te.LayerNormMLP`` (and the
``te.TransformerLayer`` built of them) run their GEMMs in FP8 under ``te.fp8_autocast`` (or hold FP8 weights under ``te.fp8_model_init``).
Their parameters stay BF16 or FP32, so a precision read off the parameters' dtype, or the
``bf16`` a launcher was given, says ``bf16`` while the matmuls run at twice the BF16 rate: MFU against
the BF16 peak then reads double (torchtitan #560, "too good to be true"). This module finds those
layers by their class's name and module path, without importing torchao or TransformerEngine (neither
is a dependency; a model holding their layers has already imported them).

A TransformerEngine layer counts as FP8 when it says so after a forward under ``fp8_autocast``
(``fp8``, set by ``init_fp8_metadata``), holds FP8 weights (``fp8_parameters``,
``primary_weights_in_fp8``), or when FP8 autocast is active as the model is read
(``FP8GlobalStateManager.is_fp8_enabled()`` of the loaded TransformerEngine). Before its first
forward a layer cannot tell: the meter looks again after the first step
(:func:`mlflow_llmeff.monitor.binding.tag_shape`).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

__all__ = ["Fp8Layers", "fp8_layers", "TORCHAO_FP8", "TE_LAYERS"]

#: torchao's float8 training layer: (module path prefix, class name).
TORCHAO_FP8 = ("torchao.float8", "Float8Linear")
#: TransformerEngine's PyTorch layers whose GEMMs run in FP8 under fp8_autocast.
#: (A ``TransformerLayer`` is counted through the layers it holds.)
TE_LAYERS = ("Linear", "LayerNormLinear", "LayerNormMLP", "GroupedLinear")
_TE_PREFIX = "transformer_engine.pytorch"
# where TransformerEngine keeps FP8GlobalStateManager (older releases: fp8; newer: quantization)
_TE_STATE_MODULES = ("transformer_engine.pytorch.fp8", "transformer_engine.pytorch.quantization")


@dataclass(frozen=True)
class Fp8Layers:
    """FP8 layers found in a model.

    Attributes:
        fp8: layers that run their matmuls in FP8.
        linear: linear layers of the model (classes named ``*Linear``, and TransformerEngine's
            ``LayerNormMLP``), FP8 or not.
        classes: the FP8 layers' qualified class names, sorted, e.g.
            ``("torchao.float8.float8_linear.Float8Linear",)``.
    """

    fp8: int
    linear: int
    classes: tuple[str, ...]

    def source(self) -> str:
        """The ``llmeff.precision.source`` value, e.g. ``modules: 12 of 13 Linear layers are
        torchao.float8.float8_linear.Float8Linear``."""
        return f"modules: {self.fp8} of {self.linear} Linear layers are {', '.join(self.classes)}"


def _qualified(m) -> str:
    t = type(m)
    return f"{t.__module__}.{t.__qualname__}"


def _te_autocast_on() -> bool:
    """FP8 autocast of a loaded TransformerEngine is active now (never imports it)."""
    for name in _TE_STATE_MODULES:
        state = getattr(sys.modules.get(name), "FP8GlobalStateManager", None)
        if state is not None:
            try:
                return bool(state.is_fp8_enabled())
            except Exception:  # noqa: BLE001 - another release's API: no evidence
                return False
    return False


def _is_fp8(m, autocast: bool) -> bool:
    t = type(m)
    module, name = t.__module__ or "", t.__name__
    if module.startswith(TORCHAO_FP8[0]) and name == TORCHAO_FP8[1]:
        return True
    if module.startswith(_TE_PREFIX) and name in TE_LAYERS:
        return autocast or any(getattr(m, a, False) is True for a in ("fp8", "fp8_parameters", "primary_weights_in_fp8"))
    return False


def fp8_layers(model) -> Fp8Layers | None:
    """The FP8 layers of ``model`` (its ``modules()``; wrappers such as DDP, FSDP and ``torch.compile``
    included), or None when it has none (or no ``modules``). Never raises."""
    try:
        autocast = _te_autocast_on()
        fp8, linear, classes = 0, 0, set()
        for m in model.modules():
            name = type(m).__name__
            if name.endswith("Linear") or name == "LayerNormMLP":
                linear += 1
            if _is_fp8(m, autocast):
                fp8 += 1
                classes.add(_qualified(m))
        return Fp8Layers(fp8, max(linear, fp8), tuple(sorted(classes))) if fp8 else None
    except Exception:  # noqa: BLE001 - a model we cannot walk: no evidence of FP8
        return None
