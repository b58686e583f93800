"""The model of ending_loop.py: a next-token model of about a thousand weights, called as a Hugging Face
causal LM is (``model(input_ids=..., labels=...).loss``).

What that script tests is how a run ends, not the model: this one keeps transformers out of its
processes (its import and llama-tiny's config took 1.5-2.3 s of the 7.5-9.6 s of CPU of each launch,
measured). hang_loop.py keeps llama-tiny: with this model its run spent 1.54 s between its last step and
its close where llama-tiny's spent 0.33 s (quiet machine, one run each), and test_delivery's (c) bound
allows 2 s of that on a loaded CI (18.0 s > 17 s in the fresh-clone CI at 9ea8431).
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
