"""Tests for mlflow_llmeff.evals.workers: the chunk plan, scores from forked worker processes equal to
one process's, failures raised in one line, and the worker count rule (no wall time)."""

from __future__ import annotations

import pytest
import torch

from mlflow_llmeff import names
from mlflow_llmeff.evals import evaluate
from mlflow_llmeff.evals.api import EVAL_WORKER_COUNT, EVAL_WORKERS
from mlflow_llmeff.evals.scoring import LoglikelihoodScorer
from mlflow_llmeff.evals.threads import WorkerCount, choose_workers
from mlflow_llmeff.evals.workers import can_fork, plan_chunks, score_in_workers

from eval_fixtures import tiny_llama


def test_plan_chunks_cuts_longest_first_and_a_family_into_at_most_workers_chunks():
    lengths = [5, 9, 7, 9, 1, 3, 8, 2]
    assert plan_chunks(lengths, None, 3, 2) == [[1, 3, 6], [2, 0, 5], [7, 4]]
    fams = ["a", None, "a", None, "a", "a", None, "a"]  # family "a": 5 documents, 2 workers -> chunks of 3
    assert plan_chunks(lengths, fams, 2, 2) == [[2, 0, 5], [7, 4], [1, 3], [6]]
    assert plan_chunks(lengths, fams, 4, 2) == [[2, 0, 5, 7], [4], [1, 3, 6]]  # never under `chunk`
    assert plan_chunks([], None, 8, 2) == []


@pytest.mark.parametrize("chunk, workers", [(0, 2), (8, 0)])
def test_plan_chunks_refuses_empty_chunks_or_no_worker(chunk, workers):
    with pytest.raises(ValueError, match=f"chunk {chunk} / workers {workers}"):
        plan_chunks([1], None, chunk, workers)


@pytest.mark.parametrize("usable, cap, threads, forkable, distributed, n", [
    (2, None, None, True, False, 2),   # this machine: 2 CPUs, 2 processes of 1 thread
    (8, 3, None, True, False, 3),      # OMP_NUM_THREADS=3 caps it
    (8, 1, None, True, False, 1),      # torchrun's OMP_NUM_THREADS=1: in this process
    (1, None, None, True, False, 1),   # one usable CPU (a 1.5-CPU quota, rounded down)
    (4, None, 2, True, False, 1),      # threads=2 asked: in this process
    (4, None, None, False, False, 1),  # no fork (Windows)
    (4, None, None, True, True, 1),    # a torch.distributed group is up
])
def test_choose_workers(usable, cap, threads, forkable, distributed, n):
    assert choose_workers(usable, cap, threads, forkable, distributed) == n


def test_choose_workers_refuses_no_cpu():
    with pytest.raises(ValueError, match="usable 0"):
        choose_workers(0, None, None, True, False)


@pytest.fixture(scope="module")
def llama():
    return tiny_llama()


def _docs(n: int) -> list[list[tuple[str, str]]]:
    return [[(f"Document {i} says that the {'long ' * (i % 5)}answer is", f" {w} {i}.") for w in
             ("yes", "no", "maybe so", "never")] for i in range(n)]


@pytest.mark.skipif(not can_fork(), reason="no fork start method on this platform")
def test_workers_score_as_one_process_and_count_their_passes(llama):
    model, tok = llama
    one = LoglikelihoodScorer(model, tok, batch_size=2, branch_window=2)
    encoded = [[one.encode_request(c, k) for c, k in d] for d in _docs(19)]
    ref = one.score_encoded(encoded)
    many = LoglikelihoodScorer(model, tok, batch_size=2, branch_window=2)
    seen = []
    got = score_in_workers(many, encoded, None, 2, progress=seen.append)
    assert len(got) == 19 and all(len(g) == 4 for g in got)
    assert all(g == pytest.approx(r, abs=1e-4) for g, r in zip(got, ref))
    assert seen and sum(seen) == 19  # chunks of 4 documents, the last 3
    assert sorted(seen) == [3] + [4] * 4
    assert many.forward_passes > 0 and many.forward_tokens > 0


@pytest.mark.skipif(not can_fork(), reason="no fork start method on this platform")
def test_workers_follow_the_count_decided_from_the_cpu_they_receive(llama):
    model, tok = llama
    one = LoglikelihoodScorer(model, tok, batch_size=2, branch_window=2)
    encoded = [[one.encode_request(c, k) for c, k in d] for d in _docs(40)]  # 10 chunks of 4 documents
    ref = one.score_encoded(encoded)
    ticks = {"clock": 0.0, "cpu": 0.0}

    def clock():  # an injected clock: 1 s per reading
        ticks["clock"] += 1.0
        return ticks["clock"]

    def cpu_seconds(pids):  # the workers receive 0.5 CPU s per reading: 0.25 CPUs over a 2 s window
        assert len(pids) == 2  # the cap's processes, forked at once
        ticks["cpu"] += 0.5
        return ticks["cpu"]

    count = WorkerCount(1, 2)
    many = LoglikelihoodScorer(model, tok, batch_size=2, branch_window=2)
    got = score_in_workers(many, encoded, None, 1, count=count, window_s=0.5, cpu_seconds=cpu_seconds,
                           clock=clock)
    assert all(g == pytest.approx(r, abs=1e-4) for g, r in zip(got, ref))
    # first window: readings (clock 1, cpu 0.5) -> (3, 1.0): 0.25 CPUs < 0.9 -> a second worker is probed
    assert count.decisions[0] == (0.25, 1, 2)


@pytest.mark.skipif(not can_fork(), reason="no fork start method on this platform")
def test_a_failing_worker_is_raised_in_one_line(llama, monkeypatch):
    model, tok = llama
    scorer = LoglikelihoodScorer(model, tok, batch_size=2, branch_window=2)
    encoded = [[scorer.encode_request(c, k) for c, k in d] for d in _docs(8)]

    def broken(*a, **k):
        raise KeyError("boom")

    monkeypatch.setattr(scorer, "score_encoded", broken)
    with pytest.raises(RuntimeError, match="an eval worker failed: KeyError: 'boom'"):
        score_in_workers(scorer, encoded, None, 2)


@pytest.mark.skipif(not can_fork(), reason="no fork start method on this platform")
def test_evaluate_in_two_workers_predicts_as_one_process_and_records_it(llama, shared_data):
    model, tok = llama
    data = shared_data
    before = torch.get_num_threads()
    kw = dict(data_dir=str(data), limit=20, batch_size=1)  # chunks of 8 documents: 3
    two = evaluate(model, tok, ["hellaswag"], workers=2, **kw)
    one = evaluate(model, tok, ["hellaswag"], workers=1, threads=1, **kw)
    assert [e["pred"] for e in two.examples] == [e["pred"] for e in one.examples]
    assert [e["pred_norm"] for e in two.examples] == [e["pred_norm"] for e in one.examples]
    assert two.config[EVAL_WORKERS] == 2 and one.config[EVAL_WORKERS] == 1
    assert two.config[names.THREADS].startswith("intra-op 1 (1 per process, 2 worker processes; ")
    assert two.config["forward_passes"] > 0
    assert torch.get_num_threads() == before
    few = evaluate(model, tok, ["hellaswag"], workers=2, **dict(kw, limit=10))  # under 2 chunks: in this process
    assert few.config[EVAL_WORKERS] == 1


@pytest.mark.skipif(not can_fork(), reason="no fork start method on this platform")
def test_evaluate_probes_the_worker_count_only_when_it_chose_it(llama, shared_data, monkeypatch):
    model, tok = llama
    kw = dict(data_dir=str(shared_data), limit=20, batch_size=1)  # 3 chunks of 8 documents
    monkeypatch.setattr("mlflow_llmeff.evals.threads.default_workers", lambda threads=None: 2)
    chosen = evaluate(model, tok, ["hellaswag"], **kw)
    asked = evaluate(model, tok, ["hellaswag"], workers=2, **kw)
    assert chosen.config[EVAL_WORKERS] == 2 and chosen.config[EVAL_WORKER_COUNT].endswith("; cap 4")
    assert EVAL_WORKER_COUNT not in asked.config  # workers=2 asked: 2 throughout
    assert [e["pred"] for e in chosen.examples] == [e["pred"] for e in asked.examples]


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_bad_workers_is_refused(llama, bad, shared_data):
    model, tok = llama
    with pytest.raises(ValueError, match="workers"):
        evaluate(model, tok, ["hellaswag"], data_dir=str(shared_data), workers=bad, limit=2)
