"""LoRA adapters on a model with peft (the optional ``lora`` extra), for the entrypoint's ``--lora-rank``."""

from __future__ import annotations

__all__ = ["apply_lora"]

_INSTALL = "pip install 'mlflow-llmeff[lora]'"


def apply_lora(model, rank: int, targets: str):
    """Wrap ``model`` with LoRA adapters of rank ``rank`` on the ``targets`` modules; the base weights freeze.

    peft's ``get_peft_model(model, LoraConfig(r=rank, lora_alpha=2*rank, target_modules=...,
    lora_dropout=0.0))`` (Hu et al. 2021, "LoRA": ``W x + B A x * alpha/r``, ``A: (r, d_in)``,
    ``B: (d_out, r)`` zero-initialised). The FLOPs of what then trains are read by
    :func:`mlflow_llmeff.meters.trainable.read_trainable`.

    Args:
        model: a ``torch.nn.Module`` (a transformers causal LM).
        rank: ``r`` (an integer >= 1).
        targets: comma-separated module names (``q_proj,v_proj``); each must match a module's last name.

    Returns:
        The peft ``PeftModel`` (its base is ``model``, modified in place).

    Raises:
        ValueError: one line when peft is not installed, the rank is below 1, no target is given,
            or a target matches no module of ``model``.
    """
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ValueError(f"LoRA rank {rank!r} is not accepted; give an integer >= 1")
    wanted = [t.strip() for t in str(targets or "").split(",") if t.strip()]
    if not wanted:
        raise ValueError(f"LoRA targets {targets!r} are empty; give comma-separated module names such as q_proj,v_proj")
    present = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules() if name}
    missing = [t for t in wanted if t not in present]
    if missing:
        linear = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules()
                         if name and type(m).__name__ in ("Linear", "Conv1D")})
        raise ValueError(f"LoRA targets {', '.join(missing)} match no module of the model; its linear layers: "
                         f"{', '.join(linear) or 'none'}")
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise ValueError(f"LoRA needs peft, which is not installed: {_INSTALL}") from None
    config = LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=wanted, bias="none")
    return get_peft_model(model, config)
