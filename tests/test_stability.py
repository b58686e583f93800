"""Stability of the steady state: percentiles, stalls, the interval, the verdict,
stragglers; and the monitor's summary figures and tags with a fake clock (hand-computed values)."""

from __future__ import annotations

from types import SimpleNamespace

import math

import mlflow
import pytest
import torch

from mlflow_llmeff import names
from mlflow_llmeff.calc import stability as st
from mlflow_llmeff.monitor.meter import EfficiencyMonitor
from mlflow_llmeff.monitor.steptimes import DeviceStepClock, PhaseTimer, StepTimes
from mlflow_llmeff.testing import FakeClock

from conftest import use_store


@pytest.fixture
def tracking_uri(module_store, monkeypatch):
    yield from use_store(module_store, monkeypatch)


def stalled(n: int = 100, stalls: tuple[int, ...] = (30, 70)) -> list[float]:
    """``n`` steps of 10 ms with 1.7 s stalls at the given indices."""
    return [1.7 if i in stalls else 0.010 for i in range(n)]


# ------------------------------------------------------------------------------------------ pure
@pytest.mark.parametrize("q, expected", [(0, 1.0), (50, 2.5), (90, 3.7), (100, 4.0)])
def test_percentile_interpolates_linearly_between_order_statistics(q, expected):
    assert st.percentile([4.0, 1.0, 3.0, 2.0], q) == pytest.approx(expected, abs=1e-12)


def test_percentile_refuses_no_values_and_a_bad_q():
    with pytest.raises(ValueError, match="no values"):
        st.percentile([], 50)
    with pytest.raises(ValueError, match="q=101"):
        st.percentile([1.0], 101)


def test_two_stalls_in_100_steps_hand_computed():
    s = st.analyse(stalled(), [1000.0] * 100)
    assert s.p50_step_s == pytest.approx(0.010, abs=1e-15)
    assert s.p90_step_s == pytest.approx(0.010, abs=1e-15)
    assert s.stalls == 2 and s.stall_s == pytest.approx(3.4, abs=1e-12)
    # 98 x 0.010 + 2 x 1.7 = 4.38 s for 100,000 tokens: stalls stay in the mean
    assert s.total_s == pytest.approx(4.38, abs=1e-12)
    assert s.tokens_per_sec == pytest.approx(100_000 / 4.38, rel=1e-12)
    # cv: mean 0.0438; sum of squares 98 x 0.0338^2 + 2 x 1.6562^2 = 5.597956; / 99; sqrt; / mean
    assert s.cv == pytest.approx(math.sqrt(5.597956 / 99) / 0.0438, rel=1e-6)
    # the interval (tests/test_intervals.py has the method by hand): the step times' lag-1 autocorrelation
    # is (95 x 0.0338^2 - 4 x 0.0338 x 1.6562) / 5.597956 = -0.0206 and the next pair is negative, so
    # tau = -1 + 2 x 0.979 < 1: 100 independent steps, the lag-0 window. se / mean =
    # sqrt(5.597956 / 100 / (1 - 1/100) / 100) / 0.0438 = 0.542904; Student's t(0.975) on 100 / 2 = 50
    # degrees of freedom = 2.009 (NIST/SEMATECH table 1.3.6.7.2); on the log scale
    assert s.tau == 1.0 and s.n_eff == pytest.approx(100.0)
    low, high = s.ci95
    rel = math.log(high / s.tokens_per_sec)
    assert math.log(s.tokens_per_sec / low) == pytest.approx(rel, rel=1e-9)
    assert rel == pytest.approx(2.009 * 0.542904, rel=1e-3)  # [7,673, 67,937] tokens/s: never below 0
    v = st.verdict(s)
    # lopsided on the log scale: 1 - 7,673 / 22,831 = 66% below, 67,937 / 22,831 - 1 = 198% above, half width
    # (67,937 - 7,673) / 2 / 22,831 = 132%
    assert v == ("unstable: 2 stalls = 3.4 s of 4.38 s step time (steps over 5x the median step of 0.01 s); "
                 "95% interval -66% / +198% of the mean (half width 132% > 10%)")


@pytest.mark.parametrize("low, high, words", [
    (890.0, 1110.0, "+-11% of the mean (> 10%"),
    (897.0, 1103.0, "+-10.3% of the mean (> 10%"),  # never '+-10% ... (> 10%)'
    (899.6, 1100.4, "+-10.04% of the mean (> 10%"),
    (800.0, 1250.0, "-20% / +25% of the mean (half width 22% > 10%"),
    (496.8, 2013.4, "-50% / +101% of the mean (half width 76% > 10%")])
def test_an_interval_is_told_by_its_two_sides_when_they_differ_and_never_rounded_onto_the_threshold(low, high, words):
    # the second and third: a half width of 10.3% and 10.04% printed '+-10% (> 10%)', contradicting itself (a trial)
    assert st.interval_words(low, high, 1000.0) == words


def test_the_same_run_without_stalls_is_stable_with_a_narrow_interval():
    # 100 steps of 10 ms +- 0.3 ms (a deterministic wobble): the interval is real but within 2% of the mean
    secs = [0.010 + 0.0003 * math.sin(1.7 * i) for i in range(100)]
    s = st.analyse(secs, [1000.0] * 100)
    low, high = s.ci95
    assert low < s.tokens_per_sec < high
    assert 0 < (high - low) / 2 / s.tokens_per_sec < 0.02
    assert s.stalls == 0 and s.stall_s == 0.0
    assert st.verdict(s) == "stable"


def test_equal_steps_give_an_interval_of_zero_width_at_the_mean():
    s = st.analyse([0.01] * 50, [500.0] * 50)
    assert s.ci95 == (s.tokens_per_sec, s.tokens_per_sec)


def _documented_interval(seconds: list[float], tokens: list[float]) -> tuple[float, float, float, int]:
    """``(low, high, tau, M)`` by the method calc/stability.py's docstring and docs/stability.md state, written
    apart from it (plain loops, no FFT, no arrays): ratio R, linearized z, autocovariances about the mean over n,
    Geyer's initial monotone pairs, the AR(1)/ARMA(1,1) floor from the first two lags, the window's bias
    correction (at most x2), Student's t on n / (2 (2M + 1)), log scale, widened near 20 effective steps."""
    from scipy import stats

    n = len(seconds)
    r = sum(tokens) / sum(seconds)
    z = [t - r * x for t, x in zip(tokens, seconds)]
    zbar = sum(z) / n
    gamma = [sum((z[i] - zbar) * (z[i + h] - zbar) for i in range(n - h)) / n for h in range(n)]
    rho = [g / gamma[0] for g in gamma]
    total, smallest, pairs = 0.0, math.inf, 0
    for k in range(n // 2):
        pair = rho[2 * k] + rho[2 * k + 1]
        if pair <= 0:
            break
        smallest = min(smallest, pair)
        total, pairs = total + smallest, pairs + 1
    tau, lag = (-1 + 2 * total, 2 * pairs - 1) if -1 + 2 * total > 1 else (1.0, 0)
    r1 = min(max(rho[1], -0.99), 0.99)
    phi = min(max(rho[2] / r1, 0.0), 0.98, math.sqrt(r1)) if r1 > 0.3 else 0.0
    tau = max(tau, (1 + r1) / (1 - r1), 1 + 2 * max(r1, 0.0) / (1 - phi), 1.0)
    window = 2 * lag + 1
    sigma2 = gamma[0] * tau * min(1 / (1 - window / n), 2.0)
    rel = stats.t.ppf(0.975, n / (2 * window)) * math.sqrt(sigma2 / n) / (sum(seconds) / n) / r
    widening = 1 + 2.2 * min(max((35 - n / tau) / 15, 0.0), 1.0)
    return r * math.exp(-rel * widening), r * math.exp(rel * widening), tau, lag


def test_the_interval_of_a_stalled_run_is_the_documented_methods_computed_apart():
    # 60 steps of 10 ms with 1.7 s stalls at steps 5, 6 and 40, one token each: 10.58 tokens/s; the two
    # adjacent stalls give the first lags their weight (tau 1.85 over a window M = 1), 32.5 effective
    # steps, so widened 1.37x near the minimum: [1.248, 89.70] tokens/s
    secs = stalled(60, (5, 6, 40))
    iv = st.throughput_interval(secs, [1.0] * 60)
    low, high, tau, lag = _documented_interval(secs, [1.0] * 60)
    assert (iv.tau, iv.lag) == (pytest.approx(tau, rel=1e-9), lag) and lag == 1
    assert (iv.low, iv.high) == (pytest.approx(low, rel=1e-9), pytest.approx(high, rel=1e-9))
    assert (iv.low, iv.high) == (pytest.approx(1.2483, abs=1e-4), pytest.approx(89.702, abs=1e-3))


def test_the_interval_is_centred_on_the_ratio_of_sums_not_on_a_mean_of_rates():
    # steps of uneven tokens, the longer ones at the higher rate: the interval is symmetric on the log
    # scale about tokens / time, which weights each rate by its step's time
    secs = [0.01 * (1 + 0.5 * math.sin(2.9 * i)) for i in range(60)]
    toks = [1e5 * (1 + 0.3 * math.sin(2.9 * i)) * x for i, x in enumerate(secs)]
    iv = st.throughput_interval(secs, toks)
    ratio = sum(toks) / sum(secs)
    assert iv.mean == pytest.approx(ratio, rel=1e-12)
    assert math.sqrt(iv.low * iv.high) == pytest.approx(ratio, rel=1e-12) and iv.low < ratio < iv.high
    assert abs(sum(t / s for t, s in zip(toks, secs)) / 60 - ratio) > (iv.high - iv.low) / 10  # not the same figure


def test_too_few_steady_steps_have_no_interval_and_are_not_called_stable():
    s = st.analyse([0.01] * 5, [10.0] * 5)
    assert s.ci95 is None
    assert st.verdict(s) == "unstable: only 5 steady steps (fewer than 10: no interval)"
    assert st.verdict(None).startswith("unstable: no steady-state step")


def test_a_wide_spread_without_stalls_is_unstable_by_p90_over_p50():
    secs = [0.010] * 80 + [0.030] * 20  # p50 10 ms, p90 30 ms: ratio 3 (no stall: 30 ms < 5 x 10 ms)
    v = st.verdict(st.analyse(secs, [1.0] * 100))
    assert "p90/p50 step time 3 (> 1.5)" in v and "stall" not in v


def test_a_short_stall_in_a_long_run_does_not_make_it_unstable():
    secs = [0.010] * 1000
    secs[500] = 0.2  # one GC pause: 0.2 s of 10.19 s, under 5%
    s = st.analyse(secs, [1.0] * 1000)
    assert s.stalls == 1 and s.stall_s == pytest.approx(0.2)
    assert st.verdict(s) == "stable"


@pytest.mark.parametrize("per_rank, ratio, rank", [([1.0, 1.0, 1.2, 1.0], 1.2, 2), ([2.0, 3.0], 1.2, 1),
                                                   ([1.0, 1.0], 1.0, 0)])
def test_straggler_ratio_is_the_slowest_over_the_median(per_rank, ratio, rank):
    got = st.straggler(per_rank)
    assert got[0] == pytest.approx(ratio) and got[1] == rank
    assert st.straggler([1.0]) is None


# ------------------------------------------------------------------------------------ step timing
class FakeEvent:
    def __init__(self, clock):
        self.clock = clock
        self.t = clock()

    def record(self) -> None:
        self.t = self.clock()

    def elapsed_time(self, end) -> float:
        return (end.t - self.t) * 1000.0  # ms, as CUDA events report


def test_device_step_clock_splits_the_window_by_event_times():
    clock = FakeClock()
    dc = DeviceStepClock(lambda: FakeEvent(clock))
    dc.restart()
    for dt in (0.1, 0.3):
        clock.t += dt
        dc.step_end()
    # the events say 0.1 and 0.3 s; the synchronized window held 0.5 s: the split is kept, the total is the window's
    assert dc.take(window_s=0.5) == pytest.approx([0.125, 0.375])
    assert dc.take() is None  # nothing pending


def timed_model(clock, *, forward_s=0.25, backward_s=0.5, optimizer_s=0.125):
    """A linear model and SGD whose forward, backward and step each move ``clock`` by a known time
    (hooks registered after the timer's, so they run inside its spans)."""
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def later():
        model.register_forward_pre_hook(tick(clock, forward_s))
        model.weight.register_hook(tick(clock, backward_s))  # inside the backward, before accumulation
        opt.register_step_pre_hook(tick(clock, optimizer_s))
    return model, opt, later


def tick(clock, seconds: float):
    """A hook (any arguments) that moves ``clock`` by ``seconds`` and returns None (changes nothing)."""
    def hook(*args):
        clock.advance(seconds)
    return hook


def train_step(model, opt):
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    opt.zero_grad()


def test_phase_timer_times_forward_backward_and_optimizer_of_active_steps_only():
    clock = FakeClock()
    active = [True]
    model, opt, later = timed_model(clock)
    t = PhaseTimer(model, lambda: active[0], clock, optimizer=opt)
    later()
    train_step(model, opt)
    train_step(model, opt)
    active[0] = False
    train_step(model, opt)  # inside a pause (or warm-up): not counted
    with torch.no_grad():
        model(torch.zeros(1, 2))  # an eval forward: not counted either
    assert t.take() == {"forward": 0.5, "backward": 1.0, "optimizer": 0.25}
    assert t.take() == {"forward": 0.0, "backward": 0.0, "optimizer": 0.0} and t.timed["optimizer"]
    t.close()
    assert not model._forward_hooks and not model.weight._post_accumulate_grad_hooks


def test_the_wait_after_the_last_gradient_is_not_backward():
    # DDP's wait for its last all-reduces (and clipping) come after the last gradient: collective wait, not backward
    clock = FakeClock()
    model, opt, later = timed_model(clock)
    t = PhaseTimer(model, lambda: True, clock, optimizer=opt)
    later()
    model(torch.ones(1, 2)).sum().backward()
    clock.advance(2.0)
    opt.step()
    assert t.take() == {"forward": 0.25, "backward": 0.5, "optimizer": 0.125}
    t.close()


def test_a_backward_without_parameter_gradients_ends_at_the_optimizer_step():
    # an engine that accumulates gradients itself fires no parameter hook: the backward runs to the step
    clock = FakeClock()
    model, opt, later = timed_model(clock)
    for p in model.parameters():
        p.requires_grad_(False)
    inner = torch.nn.Linear(2, 2)
    wrapped = torch.nn.Sequential(model, inner)
    t = PhaseTimer(wrapped, lambda: True, clock, optimizer=opt)
    for p in inner.parameters():
        p.requires_grad_(False)  # after the timer hooked it: its gradients never accumulate
    opt.register_step_pre_hook(tick(clock, 0.125))
    x = torch.ones(1, 2, requires_grad=True)
    x.register_hook(tick(clock, 0.75))  # the backward's work
    wrapped(x).sum().backward()
    clock.advance(0.5)  # the engine's gradient collectives, clipping: between the backward and the step
    opt.step()
    assert t.take() == {"forward": 0.0, "backward": 1.25, "optimizer": 0.125}
    t.close()


def test_phase_timer_on_cuda_events_ends_the_backward_at_the_last_gradient():
    clock = FakeClock()
    model, opt, later = timed_model(clock)
    t = PhaseTimer(model, lambda: True, clock, event=lambda: FakeEvent(clock), optimizer=opt)
    later()
    train_step(model, opt)
    assert t.take() == pytest.approx({"forward": 0.25, "backward": 0.5, "optimizer": 0.125})
    t.close()


class LossModel(torch.nn.Module):
    """Two linear layers whose forward takes its own loss, as a transformers model given labels does."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)

    def forward(self, x):
        return SimpleNamespace(loss=self.b(self.a(x)).sum())


def test_a_forward_with_its_own_loss_starts_the_backward_at_its_end_with_one_parameter_hook():
    clock = FakeClock()
    model = LossModel()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    t = PhaseTimer(model, lambda: True, clock, optimizer=opt)
    # one gradient hook for the whole model (it queues the end of autograd's pass), not one per parameter
    assert [n for n, q in model.named_parameters() if q._post_accumulate_grad_hooks] == ["a.weight"]
    model.register_forward_pre_hook(tick(clock, 0.25))
    model.b.weight.register_hook(tick(clock, 0.5))  # inside the backward
    opt.register_step_pre_hook(tick(clock, 0.125))
    loss = model(torch.ones(1, 2)).loss
    clock.advance(0.0625)  # the loop's own lines between the forward and its backward: in the backward
    loss.backward()
    clock.advance(2.0)  # after autograd's pass (DDP's wait, clipping): in no phase
    opt.step()
    assert t.take() == {"forward": 0.25, "backward": 0.5625, "optimizer": 0.125}
    t.close()
    assert not any(q._post_accumulate_grad_hooks for q in model.parameters())


def test_a_loss_taken_outside_the_forward_is_in_neither_phase():
    clock = FakeClock()
    model, opt, later = timed_model(clock)
    t = PhaseTimer(model, lambda: True, clock, optimizer=opt)
    later()
    out = model(torch.ones(1, 2))
    clock.advance(0.0625)  # the loss function on the logits, before the backward reaches them
    out.sum().backward()
    opt.step()
    assert t.take() == {"forward": 0.25, "backward": 0.5, "optimizer": 0.125}
    t.close()


def test_an_optimizer_without_step_hooks_is_not_timed():
    clock = FakeClock()
    model = torch.nn.Linear(2, 2)
    t = PhaseTimer(model, lambda: True, clock, optimizer=SimpleNamespace(step=lambda: None))
    assert t.timed == {"forward": True, "backward": True, "optimizer": False}
    t.close()


def test_step_times_survive_a_checkpoint_in_float32():
    a = StepTimes()
    a.add_window([0.5, 0.25], 300)
    b = StepTimes()
    b.load_state_dict(a.state_dict())
    assert list(b.seconds) == [0.5, 0.25] and list(b.tokens) == [150.0, 150.0]


# ------------------------------------------------------------------------------ through the monitor
def run_monitor(step_seconds: list[float], warmup_steps: int = 3, log_every: int = 10) -> EfficiencyMonitor:
    clock = FakeClock()
    mon = EfficiencyMonitor(log_every_n_steps=log_every, warmup_steps=warmup_steps, clock=clock,
                            measure_energy="none", measure_peak=False, report=False)
    for dt in [0.010] * warmup_steps + step_seconds:
        clock.t += dt
        mon.step(tokens=1000, samples=4)
    mon.finish()
    return mon


def test_monitor_logs_the_stalled_runs_dispersion_and_calls_it_unstable(tracking_uri):
    mon = run_monitor(stalled())
    s = mon.summary
    assert s[names.SUM_STEP_TIME_P50_S] == pytest.approx(0.010, abs=1e-12)
    assert s[names.SUM_STEP_TIME_P90_S] == pytest.approx(0.010, abs=1e-12)
    assert s[names.SUM_STALL_S] == pytest.approx(3.4, abs=1e-9) and s[names.SUM_STALLS] == 2.0
    mean = s[names.SUM_TOKENS_PER_SEC]
    assert mean == pytest.approx(100_000 / 4.38, rel=1e-9)  # tokens / time: the stalls stay in the mean
    assert s[names.SUM_TPS_CI95_LOW] < mean < s[names.SUM_TPS_CI95_HIGH]
    tags = mlflow.MlflowClient().get_run(mon.run_id).data.tags
    assert tags[names.STABILITY].startswith("unstable: ") and "2 stalls = 3.4 s" in tags[names.STABILITY]
    assert "5x median" in tags[names.STABILITY_METHOD]


def test_monitor_calls_the_same_run_without_stalls_stable(tracking_uri):
    mon = run_monitor([0.010 + 0.0003 * math.sin(1.7 * i) for i in range(100)])
    s = mon.summary
    mean = s[names.SUM_TOKENS_PER_SEC]
    assert s[names.SUM_TPS_CI95_LOW] <= mean <= s[names.SUM_TPS_CI95_HIGH]
    assert (s[names.SUM_TPS_CI95_HIGH] - s[names.SUM_TPS_CI95_LOW]) / 2 / mean < 0.02
    assert s[names.SUM_STALL_S] == 0.0
    assert mlflow.MlflowClient().get_run(mon.run_id).data.tags[names.STABILITY] == "stable"


def test_warm_up_steps_are_not_in_the_step_time_figures(tracking_uri):
    # 3 warm-up steps of 10 s each would be stalls if counted
    clock = FakeClock()
    mon = EfficiencyMonitor(log_every_n_steps=5, warmup_steps=3, clock=clock, measure_energy="none",
                            measure_peak=False, report=False)
    for dt in [10.0] * 3 + [0.02] * 20:
        clock.t += dt
        mon.step(tokens=10)
    s = mon.finish()
    assert s[names.SUM_STEP_TIME_P90_S] == pytest.approx(0.02) and s[names.SUM_STALLS] == 0.0


def test_the_runs_description_leads_with_the_run_figure_and_its_interval(tracking_uri):
    # the runs table shows an interval metric's last window: the description says where the run's figure is
    mon = run_monitor([0.010] * 20)
    note = mlflow.MlflowClient().get_run(mon.run_id).data.tags["mlflow.note.content"]
    assert note.startswith("100,000 tokens/s steady state (95% interval 100,000 to 100,000), stable. ")
    assert "throughput/* are per-window rates" in note


def test_a_failed_run_keeps_the_description_that_says_why(tracking_uri):
    clock = FakeClock()
    mon = EfficiencyMonitor(log_every_n_steps=5, warmup_steps=1, clock=clock, measure_energy="none",
                            measure_peak=False, report=False)
    for _ in range(12):
        clock.t += 0.01
        mon.step(tokens=10)
    mon.set_tags({"mlflow.note.content": "Failed: loss became NaN at step 12"})
    mon.finish("FAILED")
    assert mlflow.MlflowClient().get_run(mon.run_id).data.tags["mlflow.note.content"] == \
        "Failed: loss became NaN at step 12"


def test_a_failing_timer_never_reaches_the_training_step():
    def broken():
        raise RuntimeError("timer bug")

    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    t = PhaseTimer(model, broken, FakeClock(), optimizer=opt)
    train_step(model, opt)
    assert model(torch.zeros(1, 2)).shape == (1, 2)
    assert t.take() == {"forward": 0.0, "backward": 0.0, "optimizer": 0.0}
    t.close()


def test_one_process_installs_no_phase_hook(tracking_uri):
    # phase times only feed the straggler figures (2+ ranks); their hooks run inside every step
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = EfficiencyMonitor(model=model, optimizer=opt, log_every_n_steps=5, warmup_steps=0, clock=FakeClock(),
                            measure_energy="none", measure_peak=False, report=False)
    assert mon.world_size == 1
    assert not model._forward_hooks and not model._forward_pre_hooks
    assert not any(q._post_accumulate_grad_hooks for q in model.parameters())
    assert not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks
    mon.finish()


def _ddp_phase_worker(rank: int, port: int, out: str) -> None:
    import json
    import threading

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    marks, now, cv = [0], [0.0], threading.Condition()

    def clock() -> float:  # the phase timer's clock: counts its marks; only the all-reduce moves it
        with cv:
            marks[0] += 1
            cv.notify_all()
            return now[0]

    def slow_all_reduce(state, bucket):  # DDP waits for this future in its own end-of-backward callback
        fut, buf, start = torch.futures.Future(), bucket.buffer(), marks[0]

        def later():
            with cv:  # released by the timer's end-of-backward mark; if that came after DDP's wait: 10 s, then 1 s in it
                cv.wait_for(lambda: marks[0] > start, timeout=10)
                now[0] += 1.0
            dist.all_reduce(buf)
            fut.set_result(buf / 2)
        threading.Thread(target=later, daemon=True).start()
        return fut

    model = LossModel()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    ddp.register_comm_hook(None, slow_all_reduce)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    t = PhaseTimer(model, lambda: True, clock, optimizer=opt)
    for _ in range(2):
        ddp(torch.ones(2, 2)).loss.backward()
        opt.step()
        opt.zero_grad()
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"phases": t.take(), "clock": now[0]}, f)
    dist.destroy_process_group()


def test_under_ddp_the_wait_for_the_last_all_reduce_is_not_backward(tmp_path):
    # DDP queues its wait on autograd's engine once its last gradient is ready; the timer's end of backward,
    # queued from a gradient hook, runs before it: the all-reduce's second lies in no phase
    import json

    import torch.multiprocessing as mp

    from conftest import free_port

    out = tmp_path / "phases.json"
    mp.spawn(_ddp_phase_worker, args=(free_port(), str(out)), nprocs=2, join=True)
    got = json.loads(out.read_text())
    assert got["clock"] == 2.0  # two steps, each waited 1 s for its all-reduce
    assert got["phases"] == {"forward": 0.0, "backward": 0.0, "optimizer": 0.0}
