"""Scoring in forked worker processes of one torch thread each, pulling chunks of documents.

Why (measured on this project's 2-core machine, HellaSwag 40 documents, the byte-vocabulary bench
model of ``bench/evals.py``, other helpers' jobs running): an intra-op team of 2 threads meets at an
OpenMP barrier in every operator, and a preempted thread stalls it; 2 threads took 62 s quiet and
245 s beside two CPU hogs, against 9 s and 20 s on 1 thread. One thread per process has no barrier,
and a second process runs documents of its own on the second CPU. A busy loop in the same session
(``bench/evals.py --hogs``) also takes the CPU per runnable thread: one thread beside two hogs gets
a third of the session's CPUs, two processes half.

The plan (:func:`plan_chunks`): documents sorted longest first (the scorer's own order, so a chunk
has little padding), cut into chunks of ``batch_size * branch_window`` documents (one branch window
of :meth:`LoglikelihoodScorer._score_branching`); documents of one family (an MMLU subject: its
few-shot prefix runs once per chunk) into at most ``workers`` chunks. Workers take the next chunk
from a shared counter, so one slowed by other jobs takes fewer. A chunk is scored by the same
scorer code as in one process; only which documents share a batch differs, which moves scores by
float rounding (as batch size does; ``bench/evals.py`` checks the predictions equal lm-eval's).

How many take chunks may change while they run (``count``, a
:class:`mlflow_llmeff.evals.threads.WorkerCount`): its ``cap`` processes are forked at once, worker
``i`` takes a chunk only while ``i`` is under the count, and the parent re-decides the count every
``window_s`` from the CPU seconds the workers ran (:func:`processes_cpu_seconds`). The chunks are
planned before, so the scores do not depend on it.

Needs the ``fork`` start method (Linux, macOS); :func:`can_fork` says whether it is there. A worker
ends with ``os._exit`` (multiprocessing's fork child): no atexit handler of the parent runs twice.
"""

from __future__ import annotations

import math
import os
import time
from typing import Any, Callable, Hashable, Sequence

__all__ = ["can_fork", "plan_chunks", "processes_cpu_seconds", "score_in_workers"]


def can_fork() -> bool:
    """Whether this platform has the ``fork`` start method (not Windows)."""
    import multiprocessing

    return "fork" in multiprocessing.get_all_start_methods()


def processes_cpu_seconds(pids: Sequence[int]) -> float | None:
    """CPU seconds the processes ``pids`` have run (all their threads), summed; None where unreadable.

    Read from ``/proc/<pid>/schedstat`` (its first field: nanoseconds on a CPU; ``Documentation/
    scheduler/sched-stats.rst``), else ``/proc/<pid>/stat``'s utime + stime in clock ticks (fields
    14-15, ``proc(5)``). A process that has ended counts 0. None without ``/proc`` (macOS).
    """
    total, seen = 0.0, False
    for pid in pids:
        try:
            with open(f"/proc/{pid}/schedstat", encoding="ascii") as f:
                total += int(f.read().split()[0]) / 1e9
            seen = True
            continue
        except (OSError, ValueError, IndexError):
            pass
        try:
            with open(f"/proc/{pid}/stat", encoding="ascii") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
            seen = True
        except FileNotFoundError:  # ended: its time is no longer ours to read
            seen = seen or os.path.isdir("/proc/self")
        except (OSError, ValueError, IndexError, AttributeError):
            continue
    return total if seen else None


def plan_chunks(lengths: Sequence[int], families: Sequence[Hashable] | None, chunk: int,
                workers: int) -> list[list[int]]:
    """Document indices per chunk, in the order workers take them.

    Args:
        lengths: per document, its longest input in tokens.
        families: per document, its family key or None (no family prefix), or None for none at all.
        chunk: documents per chunk without a family (>= 1).
        workers: worker processes (>= 1); a family is cut into at most this many chunks (each chunk
            runs the family prefix once), each at least ``chunk`` documents.

    Returns:
        Chunks of document indices: families first (in order of first appearance), then the rest;
        within each, longest first (ties by index), so the longest chunks start first.

    Raises:
        ValueError: ``chunk`` or ``workers`` < 1.
    """
    if chunk < 1 or workers < 1:
        raise ValueError(f"chunk {chunk} / workers {workers} is not accepted; use integers >= 1")
    groups: dict[Hashable, list[int]] = {}
    for i in range(len(lengths)):
        f = families[i] if families is not None else None
        groups.setdefault(("fam", f) if f is not None else ("none",), []).append(i)
    out: list[list[int]] = []
    for key, members in sorted(groups.items(), key=lambda kv: kv[0][0] == "none"):
        order = sorted(members, key=lambda i: (-lengths[i], i))
        size = chunk if key[0] == "none" else max(chunk, math.ceil(len(order) / workers))
        out += [order[s : s + size] for s in range(0, len(order), size)]
    return out


def _work(scorer: Any, encoded: Sequence[Sequence[Any]], families: Sequence[Hashable] | None,
          chunks: list[list[int]], counter: Any, results: Any, index: int = 0, allowed: Any = None,
          idle_s: float = 0.05) -> None:
    """A worker: one torch thread, chunks from ``counter`` until none is left, each chunk's
    ``(index, scores, forward passes, input positions)`` on ``results``; an error as ``(-1, text)``.
    Worker ``index`` takes a chunk only while ``index < allowed.value`` (the parent's
    :class:`~mlflow_llmeff.evals.threads.WorkerCount`); otherwise it sleeps ``idle_s`` (not runnable:
    no CPU share) and looks again."""
    import torch

    torch.set_num_threads(1)
    scorer.progress, scorer.between = None, None
    parent = os.getppid()
    try:
        while os.getppid() == parent:  # a killed parent: no more chunks
            if allowed is not None and index >= allowed.value:
                if counter.value >= len(chunks):
                    break
                time.sleep(idle_s)
                continue
            with counter.get_lock():
                c = counter.value
                counter.value += 1
            if c >= len(chunks):
                break
            docs = chunks[c]
            p0, t0 = scorer.forward_passes, scorer.forward_tokens
            fams = [families[i] for i in docs] if families is not None else None
            scores = scorer.score_encoded([encoded[i] for i in docs], fams)
            results.put((c, scores, scorer.forward_passes - p0, scorer.forward_tokens - t0))
    except BaseException as e:  # noqa: BLE001 - the parent raises it, in one line
        results.put((-1, f"{type(e).__name__}: {e}"))


def score_in_workers(scorer: Any, encoded: Sequence[Sequence[Any]], families: Sequence[Hashable] | None,
                     workers: int, *, progress: Callable[[float], None] | None = None,
                     poll_s: float = 0.25, count: Any = None, window_s: float = 2.0,
                     cpu_seconds: Callable[[list[int]], float | None] | None = None,
                     clock: Callable[[], float] = time.monotonic) -> list[list[float]]:
    """:meth:`LoglikelihoodScorer.score_encoded` of ``encoded`` in ``workers`` forked processes.

    The scorer's structure probes run here first (once, not in every worker); its
    ``forward_passes`` and ``forward_tokens`` get the workers' counts added.

    Args:
        scorer: a :class:`mlflow_llmeff.evals.scoring.LoglikelihoodScorer` on a CPU device.
        encoded: per document, its encoded choices.
        families: per document, its family key (or None), or None.
        workers: processes (>= 1).
        progress: called with the documents of each chunk as it is scored.
        poll_s: how often a wait checks that the workers are alive (and the window below ended), s.
        count: a :class:`mlflow_llmeff.evals.threads.WorkerCount`: ``count.cap`` processes are forked
            and ``count.current`` of them take chunks, re-decided every ``window_s`` from the CPU
            seconds all workers ran in the window (``cpu_seconds`` of their pids, default
            :func:`processes_cpu_seconds`) per second of ``clock``.
            None: ``workers`` take chunks throughout.

    Returns:
        ``[doc][choice]`` log-likelihoods in nats, in the order given.

    Raises:
        RuntimeError: a worker failed (its error in one line) or ended without its results.
    """
    import multiprocessing
    import queue

    scorer.probe()  # once, before the fork
    lengths = [max((len(e.input_ids) for e in doc), default=0) for doc in encoded]
    chunks = plan_chunks(lengths, families, scorer.batch_size * scorer.branch_window, workers)
    out: list[list[float]] = [[0.0] * len(d) for d in encoded]
    if not chunks:
        return out
    ctx = multiprocessing.get_context("fork")
    counter, results = ctx.Value("l", 0), ctx.Queue()
    n_procs = min(count.cap if count is not None else workers, len(chunks))
    allowed = ctx.Value("i", count.current if count is not None else n_procs, lock=False)
    procs = [ctx.Process(target=_work, args=(scorer, encoded, families, chunks, counter, results, i, allowed),
                         daemon=True) for i in range(n_procs)]
    for p in procs:
        p.start()
    cpu_seconds = cpu_seconds or processes_cpu_seconds
    pids = [p.pid for p in procs]
    window = (clock(), cpu_seconds(pids)) if count is not None else None
    done = 0
    try:
        while done < len(chunks):
            if window is not None and window[1] is not None and clock() - window[0] >= window_s:
                now, cpu = clock(), cpu_seconds(pids)
                if cpu is not None and len(chunks) - counter.value > count.current:  # not at the tail
                    allowed.value = count.decide((cpu - window[1]) / (now - window[0]))
                window = (now, cpu)
            try:
                got = results.get(timeout=poll_s)
            except queue.Empty:
                if all(p.exitcode is not None for p in procs):
                    try:  # the last results may still be in the pipe
                        got = results.get(timeout=poll_s)
                    except queue.Empty:
                        codes = [p.exitcode for p in procs]
                        raise RuntimeError(f"eval workers ended with exit codes {codes} after {done} of "
                                           f"{len(chunks)} chunks; score with workers=1") from None
                else:
                    continue
            if got[0] == -1:
                raise RuntimeError(f"an eval worker failed: {got[1]}")
            c, scores, passes, tokens = got
            for i, s in zip(chunks[c], scores):
                out[i] = s
            scorer.forward_passes += passes
            scorer.forward_tokens += tokens
            done += 1
            if progress is not None:
                progress(len(chunks[c]))
    finally:
        for p in procs:
            if p.exitcode is None and done < len(chunks):
                p.kill()
        deadline = time.monotonic() + 5.0
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        results.close()
    return out
