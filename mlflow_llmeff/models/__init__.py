"""Model presets, the byte tokenizer, building a model from a preset or a directory."""
