"""A plain PyTorch training loop with ``mlflow_llmeff.autolog()``: the one added line is marked.

A tiny Llama built from its config (random weights, nothing downloaded) learns eight hand-made
sentences, bytes as token ids, two sentences per batch, padded to the longer one. Eight optimizer
steps cover the sentences twice, so the run's ``train/tokens`` must be 2 x 197 = 394 non-padding
tokens (the padded batches hold 436 positions). The padded length changes from batch to batch
(25, 32, 27, 25), so the run's ``llmeff.seq_len`` is ``dynamic`` (``llmeff.seq_len.range`` 25-32) and
its name ``llama-fp32-cpu`` has no batch or length part (docs/autolog.md).

    MLFLOW_TRACKING_URI=sqlite:///mlflow.db python examples/plain_pytorch.py
"""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import mlflow_llmeff

mlflow_llmeff.autolog(log_every_n_steps=2, warmup_steps=1)  # <- the only line autolog needs

SENTENCES = [
    "The cat sat on the mat.", "Tokens per second matter.", "MLflow tracks runs.",
    "Small models train fast on CPUs.", "Padding is not a token.", "Warm-up steps are excluded.",
    "One line enables autolog.", "Every rank counts once.",
]  # 197 bytes in all
PAD = 256  # token id of padding; ids 0..255 are bytes


def batches(sentences, size):
    """Yield dicts of input_ids / attention_mask / labels, (B, T) each, T = longest sentence."""
    for i in range(0, len(sentences), size):
        rows = [list(s.encode()) for s in sentences[i:i + size]]
        t = max(len(r) for r in rows)
        ids = torch.full((len(rows), t), PAD)
        mask = torch.zeros((len(rows), t), dtype=torch.long)
        for j, r in enumerate(rows):
            ids[j, :len(r)] = torch.tensor(r)
            mask[j, :len(r)] = 1
        yield {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def main(epochs: int = 2) -> None:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=257, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         pad_token_id=PAD)
    model = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for epoch in range(epochs):
        for batch in batches(SENTENCES, 2):
            loss = model(**batch).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        print(f"epoch {epoch}: loss {loss.item():.3f}")
    with torch.no_grad():  # evaluation is not counted as training tokens
        model.eval()
        model(**next(batches(SENTENCES, 2)))


if __name__ == "__main__":
    main()
