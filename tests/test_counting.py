import pytest
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


def test_position_ids_restarting_at_each_document_count_documents_as_sequences():
    # one packed row: documents of 3, 2 and 4 tokens; sum(l^2) = 9 + 4 + 16 = 29 over 9 tokens
    c = BatchCounter()
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])
    c.add(torch.zeros(1, 9, dtype=torch.long), position_ids=pos)
    got = c.take(steps=1)
    assert (got.tokens, got.padded_tokens, got.samples, got.sum_len_sq) == (9, 9, 3, 29)
    assert got.loss_tokens == 9 - 3  # no labels: one token per document carries no loss
    assert got.effective_seq_len == 29 / 9


def test_position_ids_that_do_not_start_at_zero_still_cut_at_each_reset():
    c = BatchCounter()
    c.add(torch.zeros(1, 5, dtype=torch.long), position_ids=torch.tensor([[1, 2, 3, 1, 2]]))
    assert c.take(steps=1).sum_len_sq == 9 + 4


def test_cu_seqlens_give_document_lengths_and_take_precedence():
    c = BatchCounter()
    c.add(torch.zeros(1, 9, dtype=torch.long), cu_seqlens=torch.tensor([0, 3, 5, 9], dtype=torch.int32),
          position_ids=torch.arange(9)[None])  # positions say one sequence; cu_seqlens wins
    got = c.take(steps=1)
    assert (got.tokens, got.samples, got.sum_len_sq) == (9, 3, 29)


def test_cu_seqlens_shorter_than_the_row_leave_the_tail_as_padding():
    c = BatchCounter()
    c.add(torch.zeros(1, 8, dtype=torch.long), cu_seqlens=torch.tensor([0, 3, 5], dtype=torch.int32))
    got = c.take(steps=1)
    assert (got.tokens, got.padded_tokens, got.sum_len_sq) == (5, 8, 13)


def test_seq_idx_marks_documents():
    c = BatchCounter()
    c.add(torch.zeros(1, 6, dtype=torch.long), seq_idx=torch.tensor([[0, 0, 0, 0, 1, 1]], dtype=torch.int32))
    got = c.take(steps=1)
    assert (got.samples, got.sum_len_sq) == (2, 16 + 4)


def test_positions_of_a_padded_batch_keep_rows_as_sequences():
    # left padding with positions 0.. over the whole row: the first real token starts the sequence
    c = BatchCounter()
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 0]])
    c.add(torch.zeros(2, 5, dtype=torch.long), mask, position_ids=torch.arange(5).expand(2, 5))
    got = c.take(steps=1)
    assert (got.tokens, got.samples, got.sum_len_sq) == (7, 2, 9 + 16)


def test_positions_of_several_packed_rows_cut_each_row_apart():
    c = BatchCounter()
    pos = torch.tensor([[0, 1, 0, 1, 2], [0, 1, 2, 3, 4]])  # 2 + 3 and 5
    c.add(torch.zeros(2, 5, dtype=torch.long), position_ids=pos)
    got = c.take(steps=1)
    assert (got.samples, got.sum_len_sq) == (3, 4 + 9 + 25)


def test_three_dimensional_positions_are_ignored():
    c = BatchCounter()
    c.add(torch.zeros(1, 4, dtype=torch.long), position_ids=torch.zeros(3, 1, 4, dtype=torch.long))
    got = c.take(steps=1)
    assert (got.samples, got.sum_len_sq) == (1, 16)


def test_step_tally_reads_packed_keys_of_a_collator_batch():
    from transformers import DataCollatorWithFlattening

    from mlflow_llmeff.monitor.counting import StepTally

    feats = [{"input_ids": list(range(3, 3 + n))} for n in (3, 2, 4)]
    for collator in (DataCollatorWithFlattening(), DataCollatorWithFlattening(return_flash_attn_kwargs=True),
                     DataCollatorWithFlattening(return_position_ids=False, return_seq_idx=True)):
        tally = StepTally()
        tally.add_batch(collator(feats))
        got = tally.take(steps=1)
        assert (got.tokens, got.samples, got.sum_len_sq, got.loss_tokens) == (9, 3, 29, 6)


# ------------------------------------------------------------------ what a micro-batch does not say
def test_a_flat_tensor_without_document_marks_has_unknown_sequences_not_one_of_all_its_tokens():
    # 64 ids in one (64,) tensor: 2 rows of 32 or 8 of 8 flattened look the same, so no sequence is guessed
    c = BatchCounter()
    c.add(torch.zeros(64, dtype=torch.long))
    got = c.take(steps=1)
    assert (got.tokens, got.padded_tokens) == (64, 64)
    assert (got.samples_unknown, got.lengths_unknown, got.loss_unknown) == (1, 1, 1)
    assert got.effective_seq_len is None  # was 64: one sequence of all the tokens
    # documents marked: known again, 3 documents of 3, 2 and 4 (position_ids restarting)
    c.add(torch.zeros(9, dtype=torch.long), position_ids=torch.tensor([0, 1, 2, 0, 1, 0, 1, 2, 3]),
          labels=torch.arange(9))
    got = c.take(steps=1)
    assert (got.samples, got.sum_len_sq, got.loss_tokens, got.lengths_unknown, got.samples_unknown) == (3, 29, 8, 0, 0)


def test_a_2d_batch_gives_every_count_and_rows_are_its_sequences():
    c = BatchCounter()
    c.add(torch.zeros(8, 32, dtype=torch.long))
    got = c.take(steps=1)
    assert (got.samples, got.effective_seq_len, got.loss_tokens) == (8, 32.0, 8 * 31)
    assert (got.padded_unknown, got.loss_unknown, got.samples_unknown, got.lengths_unknown) == (0, 0, 0, 0)


def test_numbers_without_samples_or_lengths_count_them_as_unknown():
    from mlflow_llmeff.monitor.counting import StepTally

    tally = StepTally()
    tally.add_numbers(100)  # tokens alone
    got = tally.take(steps=1)
    assert (got.padded_unknown, got.loss_unknown, got.samples_unknown, got.lengths_unknown) == (1, 1, 1, 1)
    assert got.effective_seq_len is None
    tally.add_numbers(100, samples=4)  # equal lengths of 25: sum(l^2) = 4 x 625 = 2,500; loss 100 - 4
    got = tally.take(steps=1)
    assert (got.samples, got.sum_len_sq, got.loss_tokens, got.effective_seq_len) == (4, 2500, 96, 25.0)
    assert (got.loss_unknown, got.samples_unknown, got.lengths_unknown, got.padded_unknown) == (0, 0, 0, 1)
    tally.add_numbers(100, padded_tokens=128, loss_tokens=90, sum_len_sq=3000)  # lengths without samples
    got = tally.take(steps=1)
    assert (got.padded_tokens, got.loss_tokens, got.effective_seq_len) == (128, 90, 30.0)
    assert (got.samples_unknown, got.lengths_unknown, got.padded_unknown) == (1, 0, 0)


def test_unknowns_ride_the_reduce_as_sums_and_a_batch_beside_numbers_keeps_them():
    from mlflow_llmeff.monitor.counting import REDUCE_LAYOUT, StepTally

    tally = StepTally()
    tally.add_batch({"input_ids": torch.zeros(2, 4, dtype=torch.long)})
    tally.add_numbers(10)
    seen = []
    got = tally.take(steps=1, reduce=lambda t: seen.append(t.tolist()) or t * 2)  # two identical ranks
    assert dict(zip(REDUCE_LAYOUT, seen[0])) == {"tokens": 18, "loss_tokens": 6, "sum_len_sq": 32, "padded_tokens": 8,
                                                 "samples": 2, "padded_unknown": 1, "loss_unknown": 1,
                                                 "samples_unknown": 1, "lengths_unknown": 1}
    assert (got.tokens, got.samples_unknown, got.effective_seq_len) == (36, 2, None)


# ------------------------------------------------------------------ padded shapes (dynamic padding, packing)
def _padded(rows: int, t: int) -> dict:
    """``rows`` rows padded to ``t`` positions, the first ``t - j`` of row ``j`` real (dynamic padding)."""
    mask = (torch.arange(t)[None, :] < (t - torch.arange(rows))[:, None]).long()
    return {"input_ids": torch.zeros(rows, t, dtype=torch.long), "attention_mask": mask}


def _tally(shapes):
    from mlflow_llmeff.monitor.counting import StepTally

    tally = StepTally()
    for rows, t in shapes:
        tally.add_batch(_padded(rows, t))
    return tally


def test_one_padded_shape_in_every_batch_does_not_vary():
    r = _tally([(2, 25)] * 4).shapes
    assert (r.seq, r.batch, r.varies) == ((25, 25), (2, 2), False)


def test_padded_lengths_that_change_between_batches_vary_with_their_range():
    r = _tally([(2, 25), (2, 23), (2, 25), (2, 24)]).shapes
    assert (r.seq, r.seq_varies, r.batch_varies, r.varies) == ((23, 25), True, False, True)


def test_packed_rows_of_varying_length_vary():
    from transformers import DataCollatorWithFlattening

    from mlflow_llmeff.monitor.counting import StepTally

    tally = StepTally()
    for lengths in ((3, 2, 4), (5, 5)):  # one row of 9, then one of 10 positions
        tally.add_batch(DataCollatorWithFlattening()([{"input_ids": list(range(3, 3 + n))} for n in lengths]))
    assert (tally.shapes.seq, tally.shapes.batch) == ((9, 10), (1, 1))


def test_a_smaller_last_batch_is_a_partial_batch_not_a_varying_size():
    # 7 rows in batches of 2 (drop_last=False): 2, 2, 2, 1
    assert _tally([(2, 8), (2, 8), (2, 8), (1, 8)]).shapes.batch == (2, 2)


def test_a_smaller_batch_that_another_follows_varies_the_size():
    r = _tally([(2, 8), (1, 8), (2, 8)]).shapes  # a second epoch after a partial batch, or a ramp
    assert (r.batch, r.batch_varies, r.seq_varies) == ((1, 2), True, False)
    assert _tally([(1, 8), (2, 8)]).shapes.batch == (1, 2)  # a larger latest batch counts at once


def test_the_cheap_varies_flag_agrees_with_the_range_after_every_batch():
    from mlflow_llmeff.monitor.counting import StepTally

    # (shapes noted so far, whether they vary): hand-read from the partial-last-batch rule
    cases = [([(2, 8)], False), ([(2, 8), (2, 8)], False), ([(2, 8), (1, 8)], False),  # a partial last batch
             ([(2, 8), (1, 8), (2, 8)], True), ([(2, 8), (3, 8)], True), ([(2, 8), (2, 9)], True),
             ([(2, 8), (1, 9)], True)]  # a smaller last batch of another length: the length varies
    for shapes, varies in cases:
        tally = _tally(shapes)
        assert (tally.varies, tally.shapes.varies) == (varies, varies), shapes
    assert StepTally().varies is False
    flat = StepTally()
    flat.load_shape_state([8, 8, 2, 2])
    assert flat.varies is False
    flat.add_batch(_padded(2, 9))
    assert flat.varies is True
    resumed = StepTally()
    resumed.load_shape_state([23, 25, 1, 2])
    assert resumed.varies is True


def test_shapes_do_not_change_what_is_counted():
    got = _tally([(2, 25), (2, 23)]).take(steps=2)
    assert (got.tokens, got.padded_tokens) == (25 + 24 + 23 + 22, 2 * 25 + 2 * 23)


def test_a_checkpoints_shapes_continue_in_the_resumed_tally():
    from mlflow_llmeff.monitor.counting import StepTally

    state = _tally([(2, 25), (2, 23), (1, 24)]).shape_state()
    assert state == [23, 25, 1, 2]  # the run went on: its latest batch was no last batch
    resumed = StepTally()
    resumed.load_shape_state(state)
    assert (resumed.shapes.seq, resumed.shapes.batch) == ((23, 25), (1, 2))
    resumed.add_batch(_padded(2, 24))
    assert (resumed.shapes.seq, resumed.shapes.batch) == ((23, 25), (1, 2))
    assert StepTally().shape_state() is None and StepTally().shapes is None


def test_a_dense_batch_counts_the_same_on_the_host_and_on_an_accelerator(monkeypatch):
    # the dense fast path reads CPU sums at once and keeps an accelerator's on the device, unsynchronized;
    # both give the hand counts: rows of 3 and 4 real tokens, 10 labels kept, 4 rows, 16 positions
    import mlflow_llmeff.monitor.counting as counting

    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    labels = torch.tensor([[5, 6, 7, -100], [5, 6, 7, 8]])
    for on_host in (True, False):
        monkeypatch.setattr(counting, "_host_readable", lambda device, v=on_host: v)
        c = BatchCounter()
        c.add(torch.zeros(2, 4, dtype=torch.long), mask, labels)
        c.add(torch.zeros(2, 4, dtype=torch.long), mask)  # no labels: l - 1 a row, 2 + 3
        c.add(torch.zeros(2, 4, dtype=torch.long), None, labels)  # no mask: 8 real, 2 x 16 for sum(l^2)
        assert c.peek_tokens() == (7 + 7 + 8, 25 + 25 + 32)
        got = c.take(steps=1)
        assert (got.tokens, got.padded_tokens, got.loss_tokens, got.samples, got.sum_len_sq) == (
            22, 24, 5 + 5 + 5, 6, 82), on_host


def _dense(rows_real: list[int], t: int = 4):
    """A (B, T) batch: row i has rows_real[i] real tokens, labels everywhere but the last padding."""
    mask = torch.tensor([[1] * n + [0] * (t - n) for n in rows_real])
    return torch.zeros(len(rows_real), t, dtype=torch.long), mask, torch.where(mask.bool(), 7, -100)


def test_cpu_batches_are_read_at_the_window_edge_with_the_hand_counts():
    # the first batch is read at once (the probation), later fresh batches when the edge takes them
    c = BatchCounter()
    for rows in ([3, 4], [2, 4], [1, 1]):
        c.add(*_dense(rows))
    assert c.defer is True and len(c._deferred) == 2
    got = c.take(steps=1)
    # tokens 7 + 6 + 2; sum(l^2) 25 + 20 + 2; loss-bearing labels[:, 1:] != -100: (2+3) + (1+3) + (0+0)
    assert (got.tokens, got.sum_len_sq, got.loss_tokens, got.samples, got.padded_tokens) == (15, 47, 9, 6, 24)
    assert c.refilled == 0 and c._deferred == []


def test_a_loop_that_refills_its_batch_tensors_in_place_is_read_at_once():
    c = BatchCounter()
    ids, mask, labels = _dense([3, 4])
    c.add(ids, mask, labels)
    mask.copy_(_dense([1, 2])[1])  # the same tensors, written in place for the next micro-batch
    labels.copy_(_dense([1, 2])[2])
    c.add(ids, mask, labels)
    assert c.defer is False and c._deferred == []
    mask.copy_(_dense([4, 4])[1])
    labels.copy_(_dense([4, 4])[2])
    c.add(ids, mask, labels)
    got = c.take(steps=1)
    assert (got.tokens, got.sum_len_sq, got.loss_tokens) == (7 + 3 + 8, 25 + 5 + 32, 5 + 1 + 6)


def test_the_same_unchanged_batch_again_is_kept_and_a_later_refill_is_counted_as_refilled():
    c = BatchCounter()
    ids, mask, labels = _dense([3, 4])
    c.add(ids, mask, labels)
    c.add(ids, mask, labels)  # the very tensors, unwritten: a fixed batch, kept for the edge
    assert c.defer is True
    mask.copy_(_dense([1, 1])[1])  # then written in place before the edge: read as it is, and said so
    got = c.take(steps=1)
    assert got.tokens == 7 + 2 and c.refilled == 1 and c.defer is False


def test_a_kept_batch_written_in_place_before_its_edge_is_named_on_the_run(tracking_uri):
    import mlflow

    from mlflow_llmeff import names
    from mlflow_llmeff.monitor.meter import EfficiencyMonitor

    mon = EfficiencyMonitor(measure_energy="none", measure_peak=False, log_every_n_steps=100, warmup_steps=0)
    ids, mask, labels = _dense([3, 4])
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    mon.step(batch)
    mon.step(batch)  # the same unwritten tensors: kept for the edge
    mask.copy_(_dense([1, 1])[1])  # written in place before the edge (the end of the run)
    summary = mon.finish()
    run = mlflow.MlflowClient().get_run(mon.run_id)
    assert run.data.tags[names.COUNTING_REFILLED] == (
        "1 CPU micro-batches kept for their window's edge had their tensors written in place before it: "
        "counted as they then were")
    assert summary[names.SUM_TOKENS] == 7 + 2


def _step_tally_batches():
    """Dict micro-batches as llmeff train hands them: dense CPU masks of two shapes, labels, a loss count."""
    out = []
    for rows, t in (([3, 4], 4), ([2, 4], 4), ([1, 5], 5), ([5, 5, 2], 5), ([1], 4)):
        ids, mask, labels = _dense(rows, t)
        out.append(({"input_ids": ids, "attention_mask": mask, "labels": labels},
                    int((labels[:, 1:] != -100).sum())))
    return out


@pytest.mark.parametrize("given", [True, False], ids=["loss-count-given", "labels-read"])
def test_the_step_tallys_short_path_counts_and_shapes_as_the_general_path(monkeypatch, given):
    # once the counter keeps CPU batches for the edge, a dict with a dense CPU mask (and a given loss count, or
    # labels) takes StepTally's short path; a mapping that is no dict always takes the general one: the same
    # counts and shapes
    from collections import UserDict

    from mlflow_llmeff.monitor.counting import StepTally

    defer, checked = BatchCounter._defer, []  # the general path's checks of a CPU batch
    monkeypatch.setattr(BatchCounter, "_defer", lambda self, *a: (checked.append(self), defer(self, *a))[1])
    short, general = StepTally(), StepTally()
    for batch, n in _step_tally_batches():
        general.add_batch(UserDict(batch), loss_tokens=n if given else None)
    general_checked, checked[:] = len(checked), []
    kept = []
    for batch, n in _step_tally_batches():
        short.add_batch(batch, loss_tokens=n if given else None)
        kept.append(len(short.counter._deferred))
    assert kept == [0, 1, 2, 3, 4] and short.counter.defer is True  # the first read at once, the rest kept
    assert general_checked == 5 and checked == [short.counter] * 2  # the 3rd to 5th took the short path
    a, b = short.take(steps=2), general.take(steps=2)
    # tokens 7 + 6 + 6 + 12 + 1; sum(l^2) 25 + 20 + 26 + 54 + 1; samples 2 + 2 + 2 + 3 + 1; padded 8 + 8 + 10 + 15 + 4
    assert (a.tokens, a.sum_len_sq, a.samples, a.padded_tokens) == (32, 126, 10, 45)
    assert a == b and a.loss_tokens == 5 + 4 + 4 + 9 + 0
    assert (short.shapes, short.varies) == (general.shapes, general.varies) and short.shapes.seq == (4, 5)


def test_a_batch_refilled_in_place_after_the_short_path_kept_it_is_counted_as_refilled():
    from mlflow_llmeff.monitor.counting import StepTally

    tally = StepTally()
    batches = _step_tally_batches()
    for batch, n in batches[:3]:
        tally.add_batch(batch, loss_tokens=n)
    batches[2][0]["attention_mask"].copy_(_dense([1, 1], 5)[1])  # written in place before the edge
    got = tally.take(steps=1)
    assert got.tokens == 7 + 6 + 2 and tally.refilled == 1 and tally.counter.defer is False


def test_counts_from_host_ints_equal_the_keyword_build_field_by_field():
    # issue 53: ints (the host's, tolist()'s) are passed positionally without int(); other numbers go through int()
    from mlflow_llmeff.calc.throughput import Counts
    from mlflow_llmeff.monitor.counting import REDUCE_LAYOUT, counts_from

    v = [11, 22, 33, 44, 55, 1, 2, 3, 4]  # REDUCE_LAYOUT order, every value distinct
    want = Counts(steps=5, **dict(zip(REDUCE_LAYOUT, v)))
    assert want.tokens == 11 and want.loss_tokens == 22 and want.sum_len_sq == 33 and want.padded_tokens == 44
    assert want.samples == 55 and (want.padded_unknown, want.loss_unknown, want.samples_unknown,
                                   want.lengths_unknown) == (1, 2, 3, 4)
    assert counts_from(5, v) == want
    assert counts_from(5, torch.tensor(v)) == want and counts_from(5, [float(x) for x in v]) == want
