"""Model presets with published shapes, and the configs of Hugging Face ids or local directories.

The catalog the pure calculators (``fit.py``, ``plan.py``) and the training entrypoint share; it
builds no model (``train/models.py`` does) and imports transformers only inside :func:`load_config`.
Presets are built from config with random initialisation (nothing is downloaded). Their shapes
follow the published configs named beside each entry, so FLOPs and memory figures match the real
models; the vocabulary keeps its published size even though the preset tokenizer is byte-level
(ids 0..258), so the LM head and embedding cost what they cost in the real model.
"""

from __future__ import annotations

import os
from typing import Any

# name -> (model_type, config kwargs, source of the shape)
PRESETS: dict[str, tuple[str, dict[str, Any], str]] = {
    # Tiny model for CPU tests and demos: 2 layers, hidden 64, GQA 4/2 heads, byte vocabulary.
    "llama-tiny": ("llama", dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                 num_key_value_heads=2, intermediate_size=176, vocab_size=259,
                                 max_position_embeddings=512), "mlflow_llmeff test shape"),
    "llama-160m": ("llama", dict(num_hidden_layers=12, hidden_size=768, num_attention_heads=12,
                                 num_key_value_heads=12, intermediate_size=3072, vocab_size=32000,
                                 max_position_embeddings=2048), "JackFram/llama-160m config.json"),
    "llama-1b": ("llama", dict(num_hidden_layers=22, hidden_size=2048, num_attention_heads=32,
                               num_key_value_heads=4, intermediate_size=5632, vocab_size=32000,
                               max_position_embeddings=2048), "TinyLlama/TinyLlama-1.1B config.json"),
    "llama-7b": ("llama", dict(num_hidden_layers=32, hidden_size=4096, num_attention_heads=32,
                               num_key_value_heads=32, intermediate_size=11008, vocab_size=32000,
                               max_position_embeddings=4096), "meta-llama/Llama-2-7b-hf config.json"),
    "llama-13b": ("llama", dict(num_hidden_layers=40, hidden_size=5120, num_attention_heads=40,
                                num_key_value_heads=40, intermediate_size=13824, vocab_size=32000,
                                max_position_embeddings=4096), "meta-llama/Llama-2-13b-hf config.json"),
    "llama-70b": ("llama", dict(num_hidden_layers=80, hidden_size=8192, num_attention_heads=64,
                                num_key_value_heads=8, intermediate_size=28672, vocab_size=32000,
                                max_position_embeddings=4096), "meta-llama/Llama-2-70b-hf config.json"),
    "llama3-8b": ("llama", dict(num_hidden_layers=32, hidden_size=4096, num_attention_heads=32,
                                num_key_value_heads=8, intermediate_size=14336, vocab_size=128256,
                                max_position_embeddings=8192, rope_theta=500000.0),
                  "meta-llama/Meta-Llama-3-8B config.json"),
    "llama3-70b": ("llama", dict(num_hidden_layers=80, hidden_size=8192, num_attention_heads=64,
                                 num_key_value_heads=8, intermediate_size=28672, vocab_size=128256,
                                 max_position_embeddings=8192, rope_theta=500000.0),
                   "meta-llama/Meta-Llama-3-70B config.json"),
    "mistral-7b": ("mistral", dict(num_hidden_layers=32, hidden_size=4096, num_attention_heads=32,
                                   num_key_value_heads=8, intermediate_size=14336, vocab_size=32000,
                                   max_position_embeddings=32768, sliding_window=4096,
                                   rope_theta=10000.0), "mistralai/Mistral-7B-v0.1 config.json"),
    "gpt2-124m": ("gpt2", dict(n_layer=12, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024),
                  "openai-community/gpt2 config.json"),
}


def is_preset(model: str) -> bool:
    """True when ``model`` names a built-in preset."""
    return model in PRESETS


def load_config(model: str):
    """Return a ``transformers.PretrainedConfig`` for a preset, a local directory or a hub id.

    Args:
        model: a preset name (see :data:`PRESETS`), a local directory holding ``config.json``, or a
            Hugging Face hub id (resolved by ``AutoConfig.from_pretrained``; offline use needs it in
            the local cache).

    Raises:
        ValueError: when ``model`` is none of these (names the value and the presets).
    """
    from transformers import AutoConfig, CONFIG_MAPPING

    if model in PRESETS:
        model_type, kwargs, _ = PRESETS[model]
        return CONFIG_MAPPING[model_type](**kwargs)
    if os.path.isdir(model):
        if not os.path.isfile(os.path.join(model, "config.json")):
            raise ValueError(f"model directory {model!r} has no config.json; expected a Hugging Face "
                             f"model directory (save_pretrained) or a preset: {', '.join(PRESETS)}")
        return AutoConfig.from_pretrained(model)
    if "/" in model and not model.startswith((".", "/")):
        try:
            return AutoConfig.from_pretrained(model)
        except Exception as e:  # noqa: BLE001 - turn any hub failure into one line
            raise ValueError(f"model {model!r} is not a preset, not a local directory, and could not be "
                             f"loaded from the Hugging Face hub ({type(e).__name__}); presets: "
                             f"{', '.join(PRESETS)}") from None
    raise ValueError(f"unknown model {model!r}; accepted: a preset ({', '.join(PRESETS)}), "
                     f"a local Hugging Face model directory, or a hub id like 'org/name'")


def max_positions(config) -> int | None:
    """Longest sequence the model's position scheme supports, or None when unbounded/unknown."""
    for attr in ("max_position_embeddings", "n_positions"):
        v = getattr(config, attr, None)
        if isinstance(v, int) and v > 0:
            return v
    return None
