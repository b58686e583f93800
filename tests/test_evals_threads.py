"""Tests for mlflow_llmeff.evals.threads: the eval's thread count from injected affinity sets, cgroup
quotas and CPU counters (no wall time), and evaluate() recording and restoring it."""

from __future__ import annotations

import pytest
import torch

from mlflow_llmeff import names
from mlflow_llmeff.evals import evaluate
from mlflow_llmeff.evals import threads as th
from mlflow_llmeff.evals.threads import CpuShare, ThreadChooser, WorkerCount, choose_threads, usable_cpus
from mlflow_llmeff.evals.workers import processes_cpu_seconds

from eval_fixtures import tiny_llama, eval_fixture_dir

FIX = eval_fixture_dir()


@pytest.mark.parametrize("affinity, quota, n", [
    ({0, 1, 2, 3}, 1.5, 1),    # cpu.max "150000 100000": 1.5 CPUs rounded down
    ({0, 1, 2, 3}, 2.5, 2),    # "250000 100000"
    ({0, 1, 2, 3}, 2.0, 2),
    ({0, 1, 2, 3}, 0.5, 1),    # under one CPU: at least 1 thread
    ({0, 1}, 8.0, 2),          # the affinity set is the smaller bound
    ({5}, None, 1),            # no quota: the affinity set alone
    (set(range(64)), 3.0, 3),  # a 64-CPU host, a 3-CPU container
])
def test_usable_cpus_from_affinity_and_the_quota_rounded_down(affinity, quota, n):
    assert usable_cpus(affinity, quota, read_quota=False)[0] == n


def test_usable_cpus_says_where_it_came_from():
    n, where = usable_cpus({0, 1, 2, 3}, 1.5, read_quota=False)
    assert n == 1 and "affinity 4 of" in where and "cgroup quota 1.5 CPUs" in where and "rounded down to 1" in where
    assert usable_cpus({0, 1}, None, read_quota=False)[1].endswith("no cgroup CPU quota")


def test_usable_cpus_reads_the_containers_quota(monkeypatch):
    from mlflow_llmeff.meters import cgroup

    monkeypatch.setattr(cgroup, "cpu_quota", lambda: cgroup.CpuQuota(1.5, "cgroup v2 cpu.max", "/x/cpu.max"))
    n, where = usable_cpus({0, 1, 2, 3})
    assert n == 1 and "(cgroup v2 cpu.max)" in where


@pytest.mark.parametrize("bad, match", [(dict(affinity=set()), "affinity set"), (dict(affinity={0}, quota=0.0), "quota 0.0")])
def test_bad_affinity_or_quota_is_refused(bad, match):
    with pytest.raises(ValueError, match=match):
        usable_cpus(read_quota=False, **bad)


@pytest.mark.parametrize("usable, others, cap, n", [
    (2, 0.0, None, 2),    # quiet
    (2, 2.0, None, 1),    # two CPU hogs: one thread
    (2, 1.0, None, 1),    # one hog
    (2, 0.4, None, 2),    # 1.6 free rounds to 2
    (2, 0.6, None, 1),    # 1.4 free rounds to 1
    (4, 1.5, None, 3),    # 2.5 free rounds half up
    (2, None, None, 2),   # unknown load: every usable CPU
    (8, 0.0, 3, 3),       # OMP_NUM_THREADS=3 caps it
])
def test_choose_threads_leaves_the_cpus_others_hold(usable, others, cap, n):
    assert choose_threads(usable, others, cap) == n


def test_choose_threads_refuses_no_cpu():
    with pytest.raises(ValueError, match="usable 0"):
        choose_threads(0, 0.0)


class Counters:
    """Injected busy seconds of the CPUs, own CPU seconds and a clock."""

    def __init__(self):
        self.busy, self.own, self.t = 100.0, 10.0, 0.0

    def share(self) -> CpuShare:
        return CpuShare(lambda: self.busy, lambda: self.own, lambda: self.t)

    def advance(self, seconds: float, others: float, own: float) -> None:
        self.t += seconds
        self.own += own * seconds
        self.busy += (others + own) * seconds


def test_cpu_share_is_busy_time_less_our_own_per_second():
    c = Counters()
    share = c.share()
    assert share.mark()
    c.advance(2.0, others=1.5, own=0.5)
    assert share.others() == 1.5
    c.advance(1.0, others=0.0, own=2.0)  # a new window started at the last reading
    assert share.others() == 0.0


def test_cpu_share_without_readable_counters_is_none():
    share = CpuShare(lambda: None, lambda: 0.0, lambda: 0.0)
    assert not share.mark() and share.others() is None


def test_chooser_follows_others_load_and_restores_the_count_found():
    c = Counters()
    calls = []
    ch = ThreadChooser(2, "2 usable: test", c.share(), set_threads=calls.append, get_threads=lambda: 8)
    ch.begin()
    c.advance(0.3, others=2.0, own=1.0)  # data loading while two hogs run
    assert ch.start() == 1
    c.advance(0.2, others=2.0, own=0.7)
    assert ch.tick() == 1 and calls == [1]  # under every_s (0.5 s): no new decision
    c.advance(0.4, others=2.0, own=0.7)
    assert ch.tick() == 1
    c.advance(1.0, others=0.0, own=1.0)  # the hogs ended
    assert ch.tick() == 2 and calls == [1, 2]
    c.advance(0.5, others=0.0, own=2.0)
    ch.stop()
    assert calls == [1, 2, 8]  # restored
    assert ch.seconds_at == pytest.approx({1: 1.6, 2: 0.5})
    assert ch.describe() == "intra-op 1-2: 1 for 1.6 s, 2 for 0.5 s (2 usable: test)"


def test_chooser_starts_on_every_usable_cpu_after_a_too_short_window():
    c = Counters()
    calls = []
    ch = ThreadChooser(2, "2 usable: test", c.share(), set_threads=calls.append, get_threads=lambda: 2)
    ch.begin()
    c.advance(0.01, others=2.0, own=1.0)  # 10 ms says nothing
    assert ch.start() == 2


def test_omp_num_threads_caps_the_chooser(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    ch = ThreadChooser.for_this_process()
    assert ch.cap == 1 and "OMP_NUM_THREADS=1" in ch.where


def _settle(received, windows: int = 14, usable: int = 2, cap: int = 4) -> tuple[list[int], WorkerCount]:
    """Worker counts decided window after window, ``received(count, window)`` giving the CPUs' worth
    the workers received in that window (an injected scheduler, no wall time)."""
    count = WorkerCount(usable, cap)
    return [count.decide(received(count.current, w)) for w in range(windows)], count


def test_worker_count_grows_where_the_cpus_are_shared_per_thread():
    # two busy loops beside k workers on 2 CPUs shared per runnable thread: k workers receive 2k / (k + 2)
    counts, count = _settle(lambda k, w: 2 * k / (k + 2))
    # 2 -> 3 (1.0 -> 1.2 received, +20% >= 8%), 3 -> 4 (+11%), held 4 windows at the cap, then one less
    # is tried (1.33 -> 1.2: -10%) and taken back
    assert counts == [3, 3, 4, 4, 4, 4, 4, 4, 3, 4, 4, 4, 4, 4]
    assert count.decisions[:3] == [(1.0, 2, 3), (1.2, 3, 3), (1.2, 3, 4)]
    assert count.describe() == ("2-4 workers over 14 windows (2->3 at 1.00 CPUs received, 3->4 at 1.20 CPUs "
                                "received, 4->3 at 1.33 CPUs received, 3->4 at 1.20 CPUs received); cap 4")


def test_worker_count_stays_where_more_workers_receive_nothing_more():
    # other sessions' jobs under autogroup: this session's share, 0.6 CPUs, whatever the count
    counts, _ = _settle(lambda k, w: 0.6)
    assert counts == [3, 2, 2, 2, 2, 2, 3, 2, 2, 2, 2, 2, 3, 2]  # a probe every 6 windows, taken back


def test_worker_count_never_probes_while_the_workers_receive_their_cpus():
    counts, count = _settle(lambda k, w: 0.99 * min(k, 2))
    assert counts == [2] * 14 and count.describe() == "2 workers over 14 windows; cap 4"


def test_worker_count_goes_back_to_the_usable_cpus_once_the_load_leaves():
    counts, _ = _settle(lambda k, w: 2 * k / (k + 2) if w < 6 else min(k, 2) * 1.0)
    assert counts == [3, 3, 4, 4, 4, 4, 2, 2, 2, 2, 2, 2, 2, 2]


def test_worker_count_without_room_to_grow_never_probes_up():
    counts, _ = _settle(lambda k, w: 0.5, windows=4, usable=2, cap=2)
    assert counts == [2, 2, 2, 2]


@pytest.mark.parametrize("usable, cap", [(0, 2), (3, 2)])
def test_worker_count_refuses_a_cap_under_the_usable_cpus(usable, cap):
    with pytest.raises(ValueError, match=f"usable {usable} / cap {cap} is not accepted"):
        WorkerCount(usable, cap)


def test_processes_cpu_seconds_reads_this_process_and_none_without_pids():
    import os
    import time

    before = processes_cpu_seconds([os.getpid()])
    if before is None:  # no /proc (macOS): nothing to read
        assert not os.path.isdir("/proc/self")
        return
    t = time.process_time()
    while time.process_time() - t < 0.05:  # 50 ms of CPU counted by the process itself, not wall time
        pass
    after = processes_cpu_seconds([os.getpid()])
    assert after - before >= 0.04
    assert processes_cpu_seconds([]) is None


@pytest.fixture(scope="module")
def llama():
    return tiny_llama()


def test_evaluate_records_the_threads_as_its_measurement_condition_and_restores_them(llama):
    model, tok = llama
    before = torch.get_num_threads()
    r = evaluate(model, tok, ["hellaswag"], data_dir=FIX, threads=1)
    assert r.config[names.THREADS].startswith("intra-op 1 (threads=1 asked; ")
    assert r.config[names.CPU_AFFINITY] == th.affinity_tag()
    assert torch.get_num_threads() == before


def test_evaluate_rechooses_between_batches_without_changing_scores(llama, monkeypatch):
    model, tok = llama
    c = Counters()
    seen = []

    def chooser():
        def set_threads(n):
            seen.append(n)
            c.advance(1.0, others=2.0 if len(seen) % 2 else 0.0, own=1.0)  # hogs come and go between batches

        return ThreadChooser(2, "2 usable: test", c.share(), set_threads=set_threads, get_threads=lambda: 2)

    monkeypatch.setattr(ThreadChooser, "for_this_process", staticmethod(chooser))
    c.advance(1.0, others=2.0, own=0.0)
    got = evaluate(model, tok, ["hellaswag", "mmlu_anatomy"], data_dir=FIX, batch_size=1)
    fixed = evaluate(model, tok, ["hellaswag", "mmlu_anatomy"], data_dir=FIX, batch_size=1, threads=2)
    assert len(seen) >= 3 and seen[-1] == 2  # decided again between batches, the count found restored
    assert [e["pred"] for e in got.examples] == [e["pred"] for e in fixed.examples]
    assert got.config[names.THREADS].startswith("intra-op 1-2: ")


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_bad_threads_is_refused(llama, bad):
    model, tok = llama
    with pytest.raises(ValueError, match="threads"):
        evaluate(model, tok, ["hellaswag"], data_dir=FIX, threads=bad)
