"""What a real model trains, read from its ``requires_grad`` flags and PEFT LoRA modules, as a pure
:class:`~mlflow_llmeff.calc.model_shape.Trainable` for the FLOPs formula.

:func:`read_trainable` walks the model once (no forward): every parameter with ``requires_grad``
is placed in its decoder layer (transformers' ``GradientCheckpointingLayer`` modules, in order) and
named by its module as the formula names matrices (:meth:`~mlflow_llmeff.calc.model_shape.ModelShape.layer_matrices`:
Llama's ``q_proj`` ... ``down_proj``; GPT-2's ``c_attn``, GPT-NeoX's ``query_key_value`` and the
other fused or renamed projections map to theirs); a PEFT ``LoraLayer`` (``lora_A`` / ``lora_B`` per
adapter, rank ``r[adapter]``, Hu et al. 2021) becomes an :class:`~mlflow_llmeff.calc.model_shape.Adapter`.
A trainable parameter it cannot name marks its whole layer trainable (an overcount of that
layer's weight gradients, never an undercount), and says so in the description.
"""

from __future__ import annotations

from mlflow_llmeff.calc.model_shape import Adapter, Trainable

__all__ = ["read_trainable", "canonical_names"]

#: Module name (last one or two path components) -> the formula's matrix names it holds.
_ALIASES = {
    "q_proj": ("q_proj",), "k_proj": ("k_proj",), "v_proj": ("v_proj",), "o_proj": ("o_proj",),
    "query": ("q_proj",), "key": ("k_proj",), "value": ("v_proj",),
    "qkv_proj": ("q_proj", "k_proj", "v_proj"), "c_attn": ("q_proj", "k_proj", "v_proj"),
    "query_key_value": ("q_proj", "k_proj", "v_proj"), "Wqkv": ("q_proj", "k_proj", "v_proj"),
    "attn.c_proj": ("o_proj",), "attention.dense": ("o_proj",), "out_proj": ("o_proj",), "dense": ("o_proj",),
    "q_a_proj": ("q_a_proj",), "q_b_proj": ("q_b_proj",), "kv_a_proj_with_mqa": ("kv_a_proj_with_mqa",),
    "kv_b_proj": ("kv_b_proj",),
    "gate_proj": ("gate_proj",), "up_proj": ("up_proj",), "down_proj": ("down_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"), "c_fc": ("up_proj",), "mlp.c_proj": ("down_proj",),
    "dense_h_to_4h": ("up_proj",), "dense_4h_to_h": ("down_proj",), "fc1": ("up_proj",), "fc2": ("down_proj",),
    "mlp.gate": ("router",), "router": ("router",), "experts.gate_up_proj": ("experts_in",),
    "experts.down_proj": ("experts_out",), "shared_expert_gate": ("shared_gate",),
}
_NORMS = {"input_layernorm": "input_norm", "ln_1": "input_norm", "attention_norm": "input_norm",
          "post_attention_layernorm": "post_norm", "ln_2": "post_norm", "ffn_norm": "post_norm",
          "pre_feedforward_layernorm": "post_norm"}


def canonical_names(path: str) -> tuple[str, ...]:
    """The formula's matrix names a module path (``model.layers.0.self_attn.q_proj``) holds, or ``()``.

    Experts and shared experts of an MoE block map by their place (``experts.*.up_proj`` ->
    ``experts_in``, ``shared_expert.down_proj`` -> ``shared_out``); a norm maps to ``input_norm`` or
    ``post_norm``.

    Args:
        path: a module's name in ``model.named_modules()`` (PEFT's ``base_layer`` is looked through).

    Returns:
        The canonical names (several for a fused projection: ``c_attn`` -> q, k and v), or ``()``.
    """
    parts = [p for p in path.split(".") if p and not p.isdigit() and p != "base_layer"]
    if not parts:
        return ()
    if parts[-1] in _NORMS:
        return (_NORMS[parts[-1]],)
    shared = any(p.startswith("shared_expert") for p in parts[:-1])
    expert = "experts" in parts[:-1] and not shared
    if shared or expert:
        kind = "shared" if shared else "experts"
        if parts[-1] in ("down_proj", "w2", "c_proj"):
            return (f"{kind}_out",)
        if parts[-1] in ("gate_proj", "up_proj", "gate_up_proj", "w1", "w3"):
            return (f"{kind}_in",)
    for key in (".".join(parts[-2:]), parts[-1]):
        if key in _ALIASES:
            return _ALIASES[key]
    return ()


def _decoder_layers(model) -> list:
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:  # transformers < 4.52
        return []
    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def _lora_adapters(module) -> list[tuple[str, int, int, int]]:
    """``(adapter name, rank, d_in, d_out)`` of a PEFT ``LoraLayer``'s trainable adapters (duck-typed:
    ``lora_A``/``lora_B`` module dicts and ``r``), else ``[]``."""
    lora_a, ranks = getattr(module, "lora_A", None), getattr(module, "r", None)
    if lora_a is None or not isinstance(ranks, dict) or not hasattr(lora_a, "items"):
        return []
    out = []
    for name, a in lora_a.items():
        b = module.lora_B[name] if name in module.lora_B else None
        weights = [p for m in (a, b) if m is not None for p in m.parameters()]
        if not weights or not any(p.requires_grad for p in weights):
            continue  # a frozen (inactive) adapter: its forward may run, but it trains nothing
        d_in = getattr(a, "in_features", None) or getattr(module, "in_features", 0)
        d_out = getattr(b, "out_features", None) or getattr(module, "out_features", 0)
        out.append((name, int(ranks[name]), int(d_in), int(d_out)))
    return out


def read_trainable(model) -> Trainable | None:
    """What ``model`` trains, for :func:`~mlflow_llmeff.calc.flops.flops_per_token` (``trainable=``).

    Args:
        model: a ``torch.nn.Module``: a transformers causal LM, or a PEFT ``PeftModel`` around one
            (any wrapper whose ``modules()`` reach the decoder layers).

    Returns:
        None when every parameter trains and there is no adapter (the ``6N`` count, unchanged);
        else the :class:`~mlflow_llmeff.calc.model_shape.Trainable`.

    Raises:
        ValueError: one line, when some weights are frozen but the model has no decoder layers
            this reader knows (the FLOPs of a partly frozen model cannot be placed).
    """
    params = list(model.parameters())
    total = sum(p.numel() for p in params)
    trained = sum(p.numel() for p in params if p.requires_grad)
    modules = dict(model.named_modules())
    loras = {path: _lora_adapters(m) for path, m in modules.items()}
    loras = {k: v for k, v in loras.items() if v}
    if trained == total and not loras:
        return None
    layers = _decoder_layers(model)
    if not layers:
        raise ValueError(f"{trained:,} of {total:,} parameters train, but no decoder layers "
                         "(transformers GradientCheckpointingLayer) were found to place them")
    layer_of = {id(sub): i for i, layer in enumerate(layers) for sub in layer.modules()}
    names: list[set[str]] = [set() for _ in layers]
    unnamed: set[int] = set()
    adapters: list[Adapter] = []
    lora_parts = {id(p) for path in loras for p in modules[path].parameters()
                  if not any(p is q for q in _base_params(modules[path]))}
    for path, module in modules.items():
        i = layer_of.get(id(module))
        if path in loras and i is not None:
            matrix = (canonical_names(path) or ("*",))[0]
            adapters += [Adapter(i, matrix, d_in, d_out, r) for _, r, d_in, d_out in loras[path]]
        for pname, p in module.named_parameters(recurse=False):
            if not p.requires_grad or id(p) in lora_parts or i is None:
                continue
            found = canonical_names(path if p.dim() >= 2 or path.split(".")[-1] in _NORMS else "")
            if found and not (p.dim() < 2 and found[0] not in ("input_norm", "post_norm")):
                names[i].update(found)
            else:  # a bias, or a module this reader cannot name: the whole layer, from its first stage
                names[i].add("*")
                unnamed.add(i)
    unknown = [a for a in adapters if a.matrix == "*"]
    for a in unknown:
        names[a.layer].add("*")
    adapters = [a for a in adapters if a.matrix != "*"]
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    source = "requires_grad and PEFT LoRA modules of the model"
    if unnamed or unknown:
        source += (f" (layers {sorted(unnamed | {a.layer for a in unknown})} hold trainable parameters of modules "
                   "not named by the formula: counted as wholly trainable)")
    return Trainable(layers=tuple(frozenset(n) for n in names),
                     embedding=emb is not None and any(p.requires_grad for p in emb.parameters()),
                     lm_head=head is not None and any(p.requires_grad for p in head.parameters()),
                     adapters=tuple(adapters), trainable_params=trained, total_params=total, source=source)


def _base_params(module) -> list:
    """The wrapped base layer's own parameters of a PEFT LoRA module (its weight and bias)."""
    base = getattr(module, "base_layer", None)
    return list(base.parameters()) if base is not None else []
