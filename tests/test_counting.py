import torch

from mlflow_llmeff.monitor.counting import BatchCounter


def test_counts_non_padding_padded_and_loss_tokens():
    c = BatchCounter()
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    labels = torch.tensor([[5, 6, 7, -100], [5, 6, 7, 8]])
    c.add(torch.zeros(2, 4, dtype=torch.long), mask, labels)
    c.add(torch.zeros(2, 4, dtype=torch.long), mask, labels)
    got = c.take(steps=1)
    assert (got.tokens, got.padded_tokens, got.loss_tokens, got.samples) == (14, 16, 10, 4)
    assert got.sum_len_sq == 2 * (9 + 16)
    assert got.effective_seq_len == 50 / 14
    assert c.take(steps=0).tokens == 0  # reset after take


def test_without_mask_or_labels_every_position_counts():
    c = BatchCounter()
    c.add(torch.zeros(3, 8, dtype=torch.long))
    got = c.take(steps=1)
    assert (got.tokens, got.padded_tokens, got.loss_tokens) == (24, 24, 21)


def test_reduce_sums_over_ranks():
    c = BatchCounter()
    c.add(torch.zeros(1, 4, dtype=torch.long))
    got = c.take(steps=1, reduce=lambda t: t * 2)  # two identical ranks
    assert got.tokens == 8 and got.samples == 2
