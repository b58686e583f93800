"""Log-likelihood scorer: harness tokenization, hand-computed scores, batch/padding invariance."""

from __future__ import annotations

import math

import pytest
import torch
import transformers

from mlflow_llmeff.evals.scoring import LoglikelihoodScorer, _batches, encode_pair, resolve_max_length

V = 259  # ByT5Tokenizer(extra_ids=0): 3 specials + 256 bytes; byte b is id b + 3


def byte_ids(s: str) -> list[int]:
    return [b + 3 for b in s.encode("utf-8")]


@pytest.fixture(scope="module")
def tok():
    return transformers.ByT5Tokenizer(extra_ids=0)


@pytest.fixture(scope="module")
def llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    return transformers.LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def rigged_gpt2():
    """GPT-2 whose next-token distribution ignores the input: P('B') = 1/2, every other token 1/516.

    All weights are zero except the final layer-norm bias (e_0) and column 0 of the tied embedding, so
    the logits are wte[:, 0]: ln(258) for 'B' and 0 elsewhere -> softmax 258/516 and 1/516.
    """
    cfg = transformers.GPT2Config(vocab_size=V, n_embd=8, n_layer=1, n_head=2, n_positions=64,
                                  bos_token_id=1, eos_token_id=1)
    m = transformers.GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.zero_()
        m.transformer.ln_f.bias[0] = 1.0
        m.transformer.wte.weight[byte_ids("B")[0], 0] = math.log(258)
    return m


def naive(model, tok, context: str, continuation: str, max_length: int = 10**9) -> float:
    """Reference: the harness's recipe, one full forward per choice, no batching."""
    n = len(context) - len(context.rstrip())
    ctx, cont = context[: len(context) - n], context[len(context) - n :] + continuation
    c = byte_ids(ctx)
    whole = byte_ids(ctx + cont)
    k = whole[len(c) :]
    inp = whole[-(max_length + 1) :][:-1]
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([inp])).logits[0].float(), -1)
    return sum(float(lp[len(inp) - len(k) + j, t]) for j, t in enumerate(k))


DOCS = [[("The following are questions.\n\nQ: two plus two?\nA. 3\nB. 4\nAnswer: B\n\nQ: " + "x" * i + "?\nAnswer:",
          " " + letter) for letter in "ABCD"] for i in range(6)]
DOCS += [[("Making tea: A woman fills a kettle. She", " " + e)
          for e in ["puts it on.", "eats the kettle whole.", "puts it on the stove.", "x"]]]
FAMILIES = ["subject"] * 6 + [None]


def test_encode_pair_moves_trailing_space_into_continuation(tok):
    enc = LoglikelihoodScorer(torch.nn.Linear(1, 1), tok).encode
    assert encode_pair(enc, "Answer: ", "A") == (byte_ids("Answer:"), byte_ids(" A"))


def test_encoder_adds_no_eos_for_byt5(tok):
    assert LoglikelihoodScorer(torch.nn.Linear(1, 1), tok).encode("ab") == [100, 101]


def test_encode_pair_never_leaves_continuation_empty():
    def merging(s: str) -> list[int]:  # a tokenizer that makes one token of any string
        return [len(s)]

    assert encode_pair(merging, "ab", "c") == ([], [3])


def test_empty_continuation_is_rejected():
    with pytest.raises(ValueError, match="continuation '' is empty"):
        encode_pair(lambda s: [1], "a", "")


def test_hand_computed_logliks_on_rigged_model(rigged_gpt2, tok):
    scorer = LoglikelihoodScorer(rigged_gpt2, tok, batch_size=4)
    (lls,) = scorer.score([[("Q?\nAnswer:", " A"), ("Q?\nAnswer:", " B"), ("Q?\nAnswer:", " BB")]])
    # " A" = bytes ' ', 'A': 2 x ln(1/516); " B": ln(1/516) + ln(1/2); " BB": ln(1/516) + 2 ln(1/2)
    assert lls == pytest.approx([-2 * math.log(516), -math.log(516) - math.log(2), -math.log(516) - 2 * math.log(2)],
                                abs=1e-5)


@pytest.mark.parametrize("kw", [dict(share_prefix=False), dict(batch_size=1), dict(batch_size=8),
                                dict(batch_size=3, padding_side="left"), dict(batch_size=8, family_min_tokens=4)])
def test_scores_equal_one_forward_per_choice(llama, tok, kw):
    ref = [[naive(llama, tok, c, k) for c, k in doc] for doc in DOCS]
    got = LoglikelihoodScorer(llama, tok, **kw).score(DOCS, FAMILIES)
    # sums of ~20 log-probs of ~-5.5 nats: fp32 rounding of different kernels stays below 5e-5
    assert max(abs(a - b) for r, g in zip(ref, got) for a, b in zip(r, g)) < 5e-5


def test_batch_size_1_and_8_give_same_logliks(llama, tok):
    one = LoglikelihoodScorer(llama, tok, batch_size=1).score(DOCS, FAMILIES)
    eight = LoglikelihoodScorer(llama, tok, batch_size=8).score(DOCS, FAMILIES)
    assert max(abs(a - b) for r, g in zip(one, eight) for a, b in zip(r, g)) < 1e-5


def test_tokenizer_padding_side_does_not_matter(llama):
    out = []
    for side in ("left", "right"):
        t = transformers.ByT5Tokenizer(extra_ids=0)
        t.padding_side = side
        out.append(LoglikelihoodScorer(llama, t, batch_size=8).score(DOCS, FAMILIES))
    assert out[0] == out[1]


def test_long_inputs_are_left_truncated_like_the_harness(llama, tok):
    doc = [("a long context that will not fit " * 2, " yes"), ("a long context that will not fit " * 2, " no")]
    got = LoglikelihoodScorer(llama, tok, max_length=16).score([doc])[0]
    ref = [naive(llama, tok, c, k, max_length=16) for c, k in doc]
    assert got == pytest.approx(ref, abs=1e-5)


def test_sharing_runs_fewer_positions(llama, tok):
    shared = LoglikelihoodScorer(llama, tok, batch_size=8, family_min_tokens=4)
    plain = LoglikelihoodScorer(llama, tok, batch_size=8, share_prefix=False)
    shared.score(DOCS, FAMILIES)
    plain.score(DOCS, FAMILIES)
    assert shared.forward_tokens < plain.forward_tokens / 3


def test_max_length_from_config(llama, tok):
    assert resolve_max_length(llama, tok) == 512


def test_bad_padding_side_is_rejected(llama, tok):
    with pytest.raises(ValueError, match="padding_side 'middle' is not accepted; use 'left' or 'right'"):
        LoglikelihoodScorer(llama, tok, padding_side="middle")


def test_packed_short_documents_match_one_forward_per_choice(llama, tok):
    # one long question and four short ones: the short ones share rows (block-diagonal causal mask)
    docs = [[("Questions.\n\nQ: " + "y" * n + "?\nAnswer:", " " + c) for c in "ABCD"] for n in (40, 3, 5, 8, 2)]
    for kw in (dict(batch_size=1), dict(batch_size=2, padding_side="left"), dict(family_min_tokens=4)):
        scorer = LoglikelihoodScorer(llama, tok, **kw)
        got = scorer.score(docs, ["s"] * len(docs))
        ref = [[naive(llama, tok, c, k) for c, k in doc] for doc in docs]
        assert max(abs(a - b) for r, g in zip(ref, got) for a, b in zip(r, g)) < 5e-5
    # rows are as wide as the longest document: 15 + 40 + 9 context bytes + " " = 65 input tokens; the
    # short ones (28, 30, 33, 27 tokens) pack as 33 + 30 and 28 + 27: 3 rows, 3 forwards at batch size 1
    one = LoglikelihoodScorer(llama, tok, batch_size=1, family_min_tokens=100)
    one.score(docs, ["s"] * 5)
    assert one.forward_passes == 3


CTX = "Making tea: a cup."  # 18 bytes; with the " " every choice starts with, 19 shared input tokens


def _tails_doc(*lengths: int) -> list[tuple[str, str]]:
    """Choices whose inputs branch right after the shared ``CTX + " "`` (19 tokens with BOS): tails of
    the given numbers of input tokens (each ending's last byte is only a target)."""
    return [(CTX, " " + ch * n + "1") for ch, n in zip("xwvu", lengths)]


def test_branches_of_a_window_are_sorted_together(llama, tok):
    # batch size 2; documents' tails (9, 8), (9, 2), (9, 8), (9, 2). Each document's longest tail (9)
    # runs in its prefix's row: 4 rows of 19 + 9 = 28, no padding (112 positions). Branches: a window
    # of one batch (2 documents) holds 8 and 2 -> one pass of 2 x 8 = 16 (two passes, 8 + 2 + 2 x 48
    # pass cost, would cost more), twice: 32. A window of all four sorts 8, 8 | 2, 2 -> 16 + 4 = 20.
    docs = [_tails_doc(9, 8), _tails_doc(9, 2), _tails_doc(9, 8), _tails_doc(9, 2)]
    ref = [[naive(llama, tok, c, k) for c, k in doc] for doc in docs]
    tokens = {}
    for window in (1, 8):
        scorer = LoglikelihoodScorer(llama, tok, batch_size=2, branch_window=window)
        got = scorer.score(docs)
        assert max(abs(a - b) for r, g in zip(ref, got) for a, b in zip(r, g)) < 5e-5
        tokens[window] = scorer.forward_tokens
    assert tokens == {1: 112 + 32, 8: 112 + 20}


def test_longest_tail_runs_in_the_prefix_row(llama, tok):
    # tails of 9 ('x'), 5 ('w') and 9 ('v') tokens -> the lead is the first longest ('x'), run in the
    # prefix's row (19 + 9); 'w' and 'v' are branches on the cache, one pass of 2 rows x 9 (the
    # branches mask the lead's columns: the scores equal one forward per choice)
    docs = [_tails_doc(9, 5, 9)]
    scorer = LoglikelihoodScorer(llama, tok, batch_size=8)
    got = scorer.score(docs)
    ref = [naive(llama, tok, c, k) for c, k in docs[0]]
    assert max(abs(a - b) for a, b in zip(ref, got[0])) < 5e-5
    assert (scorer.forward_passes, scorer.forward_tokens) == (2, 28 + 2 * 9)


def _cost(widths, cuts, pass_positions):
    return sum((e - s) * widths[s] + pass_positions for s, e in cuts)


def test_batches_isolate_an_outlier_and_never_exceed_a_plain_cut():
    # HellaSwag's first 60 documents, the 8 longest tails; batch 8, pass cost 48 positions: the plain
    # cut 8 x 224 + 48 = 1,840; [224] [177 172 166] [157 152 152 143]: 272 + 579 + 676 = 1,527
    widths = [224, 177, 172, 166, 157, 152, 152, 143]
    assert _batches(widths, 8, 48) == [(0, 1), (1, 4), (4, 8)]
    assert _cost(widths, _batches(widths, 8, 48), 48) == 1527
    # the least cost over every way of cutting (2^7 of them), batches of at most 3 rows
    best = min(_cost(widths, c, 48) for c in _all_cuts(len(widths)) if max(e - s for s, e in c) <= 3)
    # [224] [177 172] [166 157] [152 152 143]
    assert _cost(widths, _batches(widths, 3, 48), 48) == best == 272 + 402 + 380 + 504
    assert _batches([5] * 5, 2, 48) == [(0, 2), (2, 4), (4, 5)]  # equal widths: the plain cut
    assert _batches([], 8, 48) == []
    cuts = _batches([300 - 3 * i for i in range(50)], 8, 0)  # no pass cost: no padding at all
    assert cuts == [(i, i + 1) for i in range(50)]


def _all_cuts(n):
    for mask in range(2 ** (n - 1)):
        starts = [0] + [i + 1 for i in range(n - 1) if mask >> i & 1]
        yield list(zip(starts, starts[1:] + [n]))


def test_branch_cache_is_cropped_to_the_attended_columns():
    cache = transformers.DynamicCache()
    keys = torch.arange(2 * 1 * 5 * 2, dtype=torch.float32).reshape(2, 1, 5, 2)
    cache.update(keys, keys + 100, 0)
    held = torch.tensor([[1, 1, 0, 0, 0], [1, 1, 1, 0, 0]])
    cropped, mask = LoglikelihoodScorer._crop_masked(cache, held)
    assert mask.tolist() == [[1, 1, 0], [1, 1, 1]]
    assert torch.equal(cropped.layers[0].keys, keys[:, :, :3])
    assert torch.equal(cropped.layers[0].values, keys[:, :, :3] + 100)


def test_last_layer_feed_forward_runs_on_scored_positions_only(llama, tok):
    # tails 9, 5 after a 19-token prefix: the prefix row (19 + 9 lead = 28 positions) scores the
    # positions predicting " " and the first byte of the endings (2) and the lead's 9; the branch
    # pass (5 positions) scores 5. Layer 0's feed-forward block sees all 33 positions, the last one 16.
    seen = {0: 0, 1: 0}
    hooks = [llama.model.layers[i].mlp.down_proj.register_forward_pre_hook(
        lambda m, a, i=i: seen.__setitem__(i, seen[i] + a[0].shape[:-1].numel())) for i in (0, 1)]
    try:
        scorer = LoglikelihoodScorer(llama, tok, batch_size=8)
        assert scorer._last_mlp() is llama.model.layers[1].mlp
        scorer._head_split()
        seen.update({0: 0, 1: 0})  # the probes' own passes
        got = scorer.score([_tails_doc(9, 5)])
    finally:
        for h in hooks:
            h.remove()
    assert seen == {0: 33, 1: 16}
    ref = [naive(llama, tok, c, k) for c, k in _tails_doc(9, 5)]
    assert max(abs(a - b) for a, b in zip(ref, got[0])) < 5e-5
    assert not llama.model.layers[1].mlp._forward_pre_hooks and not llama.model.layers[1].mlp._forward_hooks


def test_feed_forward_that_mixes_positions_keeps_the_full_pass(llama, tok):
    class Mixing(torch.nn.Module):
        """Not position-wise: each position's output depends on the mean over all positions."""

        def __init__(self, mlp):
            super().__init__()
            self.mlp = mlp

        def forward(self, x):
            return self.mlp(x) + x.mean(dim=1, keepdim=True)

    mixed = transformers.LlamaForCausalLM(llama.config).eval()
    mixed.load_state_dict(llama.state_dict())
    mixed.model.layers[-1].mlp = Mixing(mixed.model.layers[-1].mlp)
    assert LoglikelihoodScorer(mixed, tok)._last_mlp() is None  # the probe's logits moved
    # a compiled model (a training run's --compile) is left alone: hooks changing every pass recompile it
    assert LoglikelihoodScorer(torch.compile(llama), tok)._last_mlp() is None
    assert LoglikelihoodScorer(llama, tok)._last_mlp() is llama.model.layers[-1].mlp


def test_lm_head_runs_later_only_where_the_logits_are_the_head_output(llama, tok):
    class Scaled(transformers.LlamaForCausalLM):
        """Logits halved after the LM head (as logit scaling or soft-capping models do)."""

        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits = out.logits * 0.5
            return out

    scaled = Scaled(llama.config).eval()
    scaled.load_state_dict(llama.state_dict())
    docs = [_tails_doc(9, 5), _tails_doc(2, 3), DOCS[-1]]
    assert LoglikelihoodScorer(llama, tok)._head_split() is not None
    plain = LoglikelihoodScorer(scaled, tok)
    assert plain._head_split() is None
    for model, scorer in ((llama, LoglikelihoodScorer(llama, tok)), (scaled, plain)):
        ref = [[naive(model, tok, c, k) for c, k in doc] for doc in docs]
        got = scorer.score(docs)
        assert max(abs(a - b) for r, g in zip(ref, got) for a, b in zip(r, g)) < 5e-5
    # halving the logits changes every score: the plain path really used the model's own logits
    assert abs(plain.score(docs)[0][0] - LoglikelihoodScorer(llama, tok).score(docs)[0][0]) > 0.1


def test_bad_branch_window_is_rejected(llama, tok):
    with pytest.raises(ValueError, match="branch_window 0 is not accepted; use an integer >= 1"):
        LoglikelihoodScorer(llama, tok, branch_window=0)


def test_a_family_of_identical_documents_scores_every_position(llama, tok):
    # two copies of one question (MMLU's test split holds duplicates): their common prefix is the whole
    # context, so the family prefix must stop before the position that predicts the first answer token
    doc = [("Q: two plus two?\nAnswer:", " " + c) for c in "ABCD"]
    ref = [naive(llama, tok, c, k) for c, k in doc]
    got = LoglikelihoodScorer(llama, tok, family_min_tokens=4).score([doc, doc], ["s", "s"])
    assert max(abs(a - b) for g in got for a, b in zip(ref, g)) < 5e-5


def test_each_accuracy_is_printed_with_its_wilson_interval_and_count():
    # a trial read 'mmlu/acc 0.2702 285' with no interval (lm-eval prints a standard error)
    from mlflow_llmeff.evals.api import EvalResult

    r = EvalResult(metrics={"mmlu/acc": 77 / 285, "mmlu_anatomy/acc": 3 / 5, "hellaswag/acc_norm": 0.0},
                   examples=[], counts={"mmlu_anatomy": 5, "mmlu_astronomy": 280, "hellaswag": 0})
    # Wilson's formula by hand: centre (p + z^2/2n) / (1 + z^2/n), half z sqrt(p(1-p)/n + z^2/4n^2) / (1 + z^2/n)
    p, n, z = 77 / 285, 285, 1.959963984540054
    centre, half = (p + z * z / (2 * n)) / (1 + z * z / n), z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    low, high = r.interval("mmlu/acc")
    assert (low, high) == (pytest.approx(centre - half, abs=1e-12), pytest.approx(centre + half, abs=1e-12))
    assert (round(low, 4), round(high, 4)) == (0.2219, 0.3245)
    assert r.interval("hellaswag/acc_norm") is None  # no document: no interval
    lines = r.table().splitlines()
    assert lines[2] == "hellaswag/acc_norm  0.0000  -                      0"
    assert lines[3] == "mmlu/acc            0.2702  [0.2219, 0.3245]       285"
    # 3 of 5: centre 0.5641..., the interval wide as five documents leave it
    assert lines[4].startswith("mmlu_anatomy/acc    0.6000  [0.2307, 0.8824]")
