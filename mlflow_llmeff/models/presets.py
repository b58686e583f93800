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
        except Exception as e:  # noqa: BLE001 - turn any hub failure into one line, saying which
            # (a trial offline waited 27 s for the hub's retries, then read only "(OSError)")
            why = " ".join(str(e).split()).split(". ")[0][:200].rstrip(".")
            offline = "" if os.environ.get("HF_HUB_OFFLINE") else "; HF_HUB_OFFLINE=1 reads the local cache only"
            raise ValueError(f"model {model!r} is not a preset, not a local directory, and could not be "
                             f"loaded from the Hugging Face hub ({type(e).__name__}: {why}{offline}); presets: "
                             f"{', '.join(PRESETS)}") from None
    raise ValueError(f"unknown model {model!r}; accepted: a preset ({', '.join(PRESETS)}), "
                     f"a local Hugging Face model directory, or a hub id like 'org/name'")


class PresetShape:
    """A preset's config as plain attributes (:data:`~mlflow_llmeff.models.preset_shapes.SHAPES`: what
    ``transformers`` builds for it, aliases included), for the readers of shapes only (``validate``, the
    fit check, the plan): they read the same values as from :func:`load_config`'s config without importing
    transformers. Building a model still takes :func:`load_config`'s."""

    def __init__(self, name: str, fields: dict[str, Any], param_shapes: list) -> None:
        self.__dict__.update(fields)
        self._preset = name
        self._param_shapes = param_shapes

    def param_shapes(self) -> list[tuple[int, ...]]:
        """The shapes of the model's parameter tensors in ``model.parameters()`` order (tied tensors
        once), as the model built from :func:`load_config`'s config on the meta device has them."""
        return expand_shapes(self._param_shapes)

    def __repr__(self) -> str:
        return f"PresetShape({self._preset!r})"


def expand_shapes(runs: list) -> list[tuple[int, ...]]:
    """The list :func:`squeeze_shapes` wrote: each ``[n, [shape, ...]]`` is that block ``n`` times over."""
    out: list[tuple[int, ...]] = []
    for run in runs:
        if isinstance(run, list):
            out.extend(tuple(x) for x in run[1] * run[0])
        else:
            out.append(tuple(run))
    return out


def squeeze_shapes(shapes: list[tuple[int, ...]]) -> list:
    """``shapes`` with each repeated block of up to 15 shapes (a decoder layer's) written once with its
    count, ``[n, [shape, ...]]``; :func:`expand_shapes` gives the list back."""
    out, i = [], 0
    while i < len(shapes):
        best_len, best_n = 1, 1
        for length in range(1, 16):
            block = shapes[i:i + length]
            if len(block) < length:
                break
            n = 1
            while shapes[i + n * length:i + (n + 1) * length] == block:
                n += 1
            if n > 1 and n * length > best_len * best_n:
                best_len, best_n = length, n
        out.append([best_n, shapes[i:i + best_len]] if best_n > 1 else shapes[i])
        i += best_len * best_n
    return out


def shape_config(model: str):
    """The config the shape readers read: a preset's :class:`PresetShape` (no transformers import), else
    :func:`load_config`'s (a local directory or hub id).

    Raises:
        ValueError: as :func:`load_config`.
    """
    if model in PRESETS:
        from mlflow_llmeff.models.preset_shapes import PARAM_SHAPES, SHAPES

        if model in SHAPES and model in PARAM_SHAPES:
            return PresetShape(model, SHAPES[model], PARAM_SHAPES[model])
    return load_config(model)


def render_shapes() -> str:
    """The source of :mod:`mlflow_llmeff.models.preset_shapes`, from the installed transformers (``to_dict()``
    of each preset's config, each field as the config answers it, and its ``attribute_map`` aliases; the shapes of the parameters of the model built
    from it on the meta device, :func:`squeeze_shapes`)."""
    import pprint

    import transformers

    import torch
    from transformers import AutoModelForCausalLM

    shapes, params = {}, {}
    for name in PRESETS:
        config = load_config(name)
        fields = {k: getattr(config, k) for k in config.to_dict()}  # what the config answers for each field
        for alias in getattr(config, "attribute_map", {}):
            fields[alias] = getattr(config, alias)
        fields.update(_class_fields(config, skip=fields))
        shapes[name] = fields
        with torch.device("meta"):  # as planning.plan.param_shapes builds it
            model = AutoModelForCausalLM.from_config(config)
        params[name] = squeeze_shapes([tuple(p.shape) for p in model.parameters()])
    return (f'''"""The presets' configs as transformers {transformers.__version__} builds them, for reading shapes without it.

Each is ``to_dict()`` of :func:`mlflow_llmeff.models.presets.load_config`'s config with the config's
``attribute_map`` aliases (GPT-2's ``hidden_size`` for ``n_embd``): what ``validate``, the fit check and
the plan read of a preset in ``llmeff train``'s own process, which then hands off without importing
transformers (2.8 s of CPU there). Generated: ``python -c "from mlflow_llmeff.models.presets import
render_shapes; print(render_shapes(), end='')" > mlflow_llmeff/models/preset_shapes.py``; a test checks
that it equals what the installed transformers builds.
"""

SHAPES = ''' + _packed(shapes) + "\n\n"
            "#: The shapes of each preset's parameter tensors (``model.parameters()`` order, tied ones once) on the\n"
            "#: meta device, a repeated block as ``[count, [shape, ...]]`` (presets.expand_shapes).\n"
            "PARAM_SHAPES = " + pprint.pformat(params, width=118, sort_dicts=False, compact=True) + "\n")


def _packed(shapes: dict[str, dict[str, Any]], width: int = 118) -> str:
    """``shapes`` as a Python literal with several ``key: value`` items a line (a value too long for one line
    is pretty-printed over several)."""
    import pprint

    out = ["{"]
    for name, fields in shapes.items():
        out.append(f"    {name!r}: {{")
        line = "        "
        for key, value in fields.items():
            item = f"{key!r}: {value!r},"
            if len(item) > width - 8:
                if line.strip():
                    out.append(line.rstrip())
                text = pprint.pformat(value, width=width - 8 - len(repr(key)) - 2, sort_dicts=False)
                out.append(f"        {key!r}: " + text.replace("\n", "\n" + " " * (10 + len(repr(key)))) + ",")
                line = "        "
            elif len(line) + len(item) + 1 > width:
                out.append(line.rstrip())
                line = "        " + item + " "
            else:
                line += item + " "
        if line.strip():
            out.append(line.rstrip())
        out.append("    },")
    out.append("}")
    return "\n".join(out)


_PLAIN = (dict, list, tuple, set, str, int, float, bool, type(None))


def _class_fields(config, skip) -> dict[str, Any]:
    """The public fields the config's class gives (``base_model_tp_plan``, ``base_model_pp_plan``, properties
    such as ``rope_scaling``) whose values are plain data, as the config answers them; methods, the deprecated
    ``torch_dtype`` / ``use_return_dict`` and fields that raise are left out (a reader's ``getattr`` default
    answers for those, as it would for a missing one)."""
    import ast
    import warnings

    out = {}
    for key in dir(type(config)):
        if key.startswith("_") or key in skip or key in ("torch_dtype", "use_return_dict"):
            continue
        member = getattr(type(config), key)
        if callable(member) and not isinstance(member, property):
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                value = getattr(config, key)
        except Exception:  # noqa: BLE001 - a property that raises here: left out
            continue
        try:
            plain = isinstance(value, _PLAIN) and ast.literal_eval(repr(value)) == value  # written as a literal
        except (ValueError, SyntaxError):
            plain = False
        if plain:
            out[key] = value
    return out


def max_positions(config) -> int | None:
    """Longest sequence the model's position scheme supports, or None when unbounded/unknown."""
    for attr in ("max_position_embeddings", "n_positions"):
        v = getattr(config, attr, None)
        if isinstance(v, int) and v > 0:
            return v
    return None
