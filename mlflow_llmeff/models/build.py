"""Building the models of ``mlflow_llmeff.models.presets`` (random init) or of Hugging Face ids and directories,
and their tokenizers.

The catalog itself (:data:`~mlflow_llmeff.models.presets.PRESETS`, :func:`~mlflow_llmeff.models.presets.load_config`)
lives in :mod:`mlflow_llmeff.models.presets`, beside the pure calculators that read it; it is re-exported here.
"""

from __future__ import annotations

from mlflow_llmeff.models.presets import PRESETS, is_preset, load_config, max_positions

__all__ = ["PRESETS", "is_preset", "load_config", "max_positions", "build_model", "load_tokenizer", "tokenizer_name"]


def build_model(model: str, config=None, *, attn_implementation: str = "sdpa", dtype=None):
    """Build the causal LM: random init for presets, ``from_pretrained`` weights for a directory/id.

    Args:
        model: as for :func:`load_config`.
        config: the config from :func:`load_config` (loaded again when None).
        attn_implementation: ``sdpa`` (fast) or ``eager`` (counted by FlopCounterMode on CPU).
        dtype: torch dtype for the weights; None keeps fp32 (mixed precision is Accelerate's job).

    Returns:
        ``transformers.PreTrainedModel`` in train mode.
    """
    from transformers import AutoModelForCausalLM

    config = config if config is not None else load_config(model)
    if model in PRESETS:
        config._attn_implementation = attn_implementation
        m = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
    else:
        m = AutoModelForCausalLM.from_pretrained(model, attn_implementation=attn_implementation,
                                                 **({"dtype": dtype} if dtype is not None else {}))
    m.train()
    return m


def load_tokenizer(model: str):
    """Byte-level tokenizer for presets (no files: ``ByT5Tokenizer``), else the checkpoint's own."""
    if model in PRESETS:
        from transformers import ByT5Tokenizer

        return ByT5Tokenizer(extra_ids=0)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def tokenizer_name(model: str) -> str:
    """Human-readable tokenizer label for the ``llmeff.tokenizer`` tag."""
    return "byte-level (transformers ByT5Tokenizer, 259 ids)" if model in PRESETS else f"{model} (own tokenizer)"
