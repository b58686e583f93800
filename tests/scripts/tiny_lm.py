"""The model of the plain-loop scripts here (ending_loop.py, hang_loop.py): a next-token model of about a
thousand weights, called as a Hugging Face causal LM is (``model(input_ids=..., labels=...).loss``).

What those scripts test is how a run ends and what reaches the tracking server, not the model: this one
keeps transformers out of their processes (its import and llama-tiny's config took 1.5-2.3 s of the
7.5-9.6 s of CPU of each launch, measured).
"""

import types

import torch


class TinyLM(torch.nn.Module):
    """An embedding and a linear head over ``vocab`` token ids; the loss is cross-entropy on the next token."""

    def __init__(self, vocab: int = 32, dim: int = 16) -> None:
        super().__init__()
        self.emb, self.head = torch.nn.Embedding(vocab, dim), torch.nn.Linear(dim, vocab)

    def forward(self, input_ids, labels=None):
        logits = self.head(self.emb(input_ids))
        loss = None if labels is None else torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1))
        return types.SimpleNamespace(loss=loss, logits=logits)
