"""Figures that are undefined for a run are absent, never 0 or 1.0, and ``llmeff.summary.absent`` says why
(METRICS.md, "Intervals that hold their level"): the spread of one steady step, the goodput of no wall
time, an interval with no steady tokens/s to centre it on or too few steps, rates of a run that never
left warm-up, a straggler ratio over a rank without a timed step, bytes per parameter of a model
without parameters, a cost whose energy part has no measured energy; compare names a repeat left out
of a figure with its run's why, and sorts an unknown device count last, not as 0."""

from __future__ import annotations

from types import SimpleNamespace

import mlflow
import pytest
import torch

from mlflow_llmeff import names
from mlflow_llmeff.monitor import summary
from mlflow_llmeff.monitor.meter import EfficiencyMonitor
from mlflow_llmeff.monitor.parts import Parts
from mlflow_llmeff.monitor.steptimes import StepTimes

from conftest import use_store


@pytest.fixture
def tracking_uri(module_store, monkeypatch):
    yield from use_store(module_store, monkeypatch)


def _static_proc_stat() -> str:
    """A /proc/stat that never moves: these runs' host share is then deterministic (0 CPU ticks in the
    steady window: absent, and said why), not whatever the real machine's few ticks were."""
    import tempfile

    f = tempfile.NamedTemporaryFile("w", prefix="llmeff-stat-", delete=False)
    f.write("cpu  0 0 0 0 0 0 0 0\n")
    f.close()
    return f.name


STAT = _static_proc_stat()
#: a monitor without a model: no FLOPs figure, each named (a trial found HFU gone with no word of why)
NO_FLOPS = ("summary/device_tflops_per_sec, summary/mfu, summary/mfu_palm, summary/hfu, summary/mfu_measured_peak: "
            "no FLOPs per token (no model config (pass model= or model_config=)); ")
NO_TICKS = ("summary/host_other_cpu_fraction, summary/host_steal_fraction: 0 CPU ticks in the steady window "
            "(a host share needs at least 100, 1% resolution)")


def monitor(clock, **kw) -> EfficiencyMonitor:
    from mlflow_llmeff.monitor.contention import ContentionMeter

    return EfficiencyMonitor(clock=clock, measure_energy="none", measure_peak=False, report=False,
                             contention_meter=ContentionMeter(proc_stat=STAT, env={}), **kw)


def test_one_steady_step_logs_no_step_time_cv_and_says_why(tracking_uri):
    t = [0.0]
    mon = monitor(lambda: t[0], log_every_n_steps=10, warmup_steps=3)
    for _ in range(4):  # 3 warm-up steps and 1 steady step of 10 ms
        t[0] += 0.010
        mon.step(tokens=1000)
    out = mon.finish()
    run = mlflow.MlflowClient().get_run(mon.run_id)
    assert names.SUM_STEP_TIME_CV not in out and names.SUM_STEP_TIME_CV not in run.data.metrics
    assert run.data.metrics[names.SUM_STEP_TIME_P50_S] == pytest.approx(0.010)  # one step has a median
    assert run.data.tags[names.SUMMARY_ABSENT] == (
        NO_FLOPS + "summary/step_time_cv: 1 steady step (a spread needs at least 2); "
        "summary/stall_s, summary/stalls: 1 steady step (a stall is a step over 5x the median: none can be among "
        "fewer than 3); summary/tokens_per_sec_ci95_low, summary/tokens_per_sec_ci95_high: 1 steady step (an interval needs at least 10); "
        + NO_TICKS)


def test_two_steady_steps_log_the_spread_and_only_the_interval_is_absent(tracking_uri):
    t = [0.0]
    mon = monitor(lambda: t[0], log_every_n_steps=10, warmup_steps=1)
    for dt in (0.010, 0.010, 0.030):  # steady steps of 10 and 30 ms: sd sqrt(2) x 10 ms over mean 20 ms
        t[0] += dt
        mon.step(tokens=1000)
    out = mon.finish()
    assert out[names.SUM_STEP_TIME_CV] == pytest.approx(2 ** 0.5 * 0.010 / 0.020, rel=1e-6)
    # the spread is defined; a stall count (none can exist in 2 steps) and the interval are not, and the tag says so
    assert mlflow.MlflowClient().get_run(mon.run_id).data.tags[names.SUMMARY_ABSENT] == (
        NO_FLOPS + "summary/stall_s, summary/stalls: 2 steady steps (a stall is a step over 5x the median: none can be "
        "among fewer than 3); "
        "summary/tokens_per_sec_ci95_low, summary/tokens_per_sec_ci95_high: 2 steady steps (an interval needs at least 10); "
        + NO_TICKS)


def test_a_monitored_loop_logs_no_attempts_and_says_why(tracking_uri):
    # the trial: no summary/attempts and no why; docs/metrics.md's '1 = never restarted' read as always there
    t = [0.0]
    mon = monitor(lambda: t[0], log_every_n_steps=10, warmup_steps=1)
    for _ in range(3):
        t[0] += 0.010
        mon.step(tokens=1000)
    out = mon.finish()
    run = mlflow.MlflowClient().get_run(mon.run_id)
    assert names.SUM_ATTEMPTS not in out and names.SUM_FAILURES not in run.data.metrics
    assert run.data.tags[names.RELIABILITY_WHY] == (
        "a monitored loop sees one process, not its job's restarts: no summary/attempts, failures, down time "
        "or MTBF (llmeff train with --checkpoint-dir counts them)")


def test_no_wall_time_logs_no_goodput_and_says_why(tracking_uri):
    mon = monitor(lambda: 5.0, log_every_n_steps=10, warmup_steps=1)  # a clock that never moves
    for _ in range(3):
        mon.step(tokens=1000)
    out = mon.finish()
    run = mlflow.MlflowClient().get_run(mon.run_id)
    assert out[names.SUM_WALL_S] == 0.0
    assert names.SUM_GOODPUT not in out and names.SUM_GOODPUT not in run.data.metrics
    assert "summary/goodput: no wall time (a share of no time is undefined)" in run.data.tags[names.SUMMARY_ABSENT]


def test_an_interval_without_a_steady_tokens_per_sec_to_centre_on_is_absent_not_scaled_by_1():
    # the step times carry an interval, but the meter has no steady-state mean (no window was summed)
    steps = StepTimes()
    steps.add_window([0.010 + 0.0003 * (i % 3) for i in range(40)], 40_000)
    mon = Parts(steps=steps, meter=SimpleNamespace(summary=lambda: None),
                contention=SimpleNamespace(finish=lambda collective: ({}, {})), world_size=1)
    out = summary.stability_figures(mon, collective=False)
    assert steps.analyse().ci95 is not None
    assert names.SUM_TPS_CI95_LOW not in out and names.SUM_TPS_CI95_HIGH not in out
    why = "no steady-state tokens/s to centre the interval on"
    assert mon.summary_absent.why == {names.SUM_TPS_CI95_LOW: why, names.SUM_TPS_CI95_HIGH: why}


def test_a_run_that_never_left_warm_up_logs_no_rate_and_says_why(tracking_uri):
    t = [0.0]
    mon = monitor(lambda: t[0], log_every_n_steps=10, warmup_steps=3)
    for _ in range(3):  # every step is a warm-up step: no steady time to divide by
        t[0] += 0.010
        mon.step(tokens=1000)
    out = mon.finish()
    tags = mlflow.MlflowClient().get_run(mon.run_id).data.tags
    assert out[names.SUM_TOKENS] == 3000.0
    for key in (names.SUM_TOKENS_PER_SEC, names.SUM_STEP_TIME_S, names.SUM_STEP_TIME_P50_S, names.SUM_TPS_CI95_LOW):
        assert key not in out
    # the warm-up excess is warm-up time above as many steady steps: with no steady step it is unknown,
    # and so is the productive time (goodput was logged 0.0: a trial); the wall time is still measured,
    # 3 x 10 ms of steps on the injected clock
    assert names.SUM_GOODPUT not in out and names.SUM_BADPUT["warmup"] not in out
    assert out[names.SUM_WALL_S] == pytest.approx(0.030, abs=1e-9)
    assert tags[names.SUMMARY_ABSENT] == (
        "summary/goodput, summary/badput_warmup_s: no steady-state step (all 3 steps were warm-up): the warm-up "
        "excess over steady speed, and so the productive time, is unknown; "
        "summary/tokens_per_sec, summary/device_tokens_per_sec, summary/step_time_s: no steady-state step time "
        "(all 3 steps were warm-up, or took no time); summary/step_time_p50_s, summary/step_time_p90_s, "
        "summary/step_time_cv, summary/stall_s, summary/stalls, summary/tokens_per_sec_ci95_low, "
        "summary/tokens_per_sec_ci95_high: no steady-state step time; " + NO_TICKS)


def _stub(**kw):
    """A monitor's parts as stability_figures reads them: 12 steady steps of 10 ms, 1,000 tokens each."""
    steps = StepTimes()
    steps.add_window([0.010] * 12, 12_000)
    base = dict(steps=steps, meter=SimpleNamespace(summary=lambda: None),
                contention=SimpleNamespace(finish=lambda collective: ({}, {})), world_size=1, rank=0,
                phases=SimpleNamespace(timed={"forward": True, "backward": True, "optimizer": True}))
    return Parts(**{**base, **kw})  # its run record: no phase timed yet


def _ranks(*phases, steps=12):
    """Every rank's gathered times (summary._rank_times' shape): ``phases`` = (forward, backward, optimizer) s/step."""
    return [{"host": f"h{r}", "steps": steps if p else 0, "step_s": 0.05 if p else None,
             "phases": dict(zip(("forward", "backward", "optimizer"), p)) if p else {}} for r, p in enumerate(phases)]


def test_a_straggler_ratio_over_a_rank_without_a_timed_step_is_absent_not_computed(monkeypatch):
    from mlflow_llmeff.meters import collectives

    # rank 0 timed no step (no model hooked); rank 1 did: the ratio would be over a 0, and is not logged
    monkeypatch.setattr(collectives, "all_gather_object", lambda obj: _ranks((), (0.004, 0.008, 0.001)))
    mon = _stub(world_size=2)
    out = summary.stability_figures(mon, collective=True)
    assert names.SUM_STRAGGLER_RATIO not in out and names.SUM_PHASE_STRAGGLER["backward"] not in out
    assert mon.summary_absent.why[names.SUM_STRAGGLER_RATIO] == "no timed steady step on rank 0"
    # both ranks timed theirs: compute 12 ms vs a median of (10 + 12) / 2 ms
    monkeypatch.setattr(collectives, "all_gather_object",
                        lambda obj: _ranks((0.003, 0.006, 0.001), (0.003, 0.008, 0.001)))
    mon = _stub(world_size=2)
    out = summary.stability_figures(mon, collective=True)
    assert out[names.SUM_STRAGGLER_RATIO] == pytest.approx(0.012 / 0.011)
    assert out[names.SUM_PHASE_STRAGGLER["backward"]] == pytest.approx(0.008 / 0.007)
    assert out[names.SUM_PHASE_STRAGGLER["forward"]] == 1.0
    assert names.SUM_STRAGGLER_RATIO not in mon.summary_absent.why


def test_a_phase_not_timed_on_some_rank_has_no_ratio_and_says_why(monkeypatch):
    from mlflow_llmeff.meters import collectives

    got = _ranks((0.003, 0.006, 0.001), (0.003, 0.008, 0.001))
    del got[1]["phases"]["optimizer"]  # rank 1's optimizer had no step hooks
    monkeypatch.setattr(collectives, "all_gather_object", lambda obj: got)
    mon = _stub(world_size=2)
    out = summary.stability_figures(mon, collective=True)
    assert out[names.SUM_STRAGGLER_RATIO] == pytest.approx(0.011 / 0.010)  # forward + backward only
    assert mon.summary_absent.why[names.SUM_PHASE_STRAGGLER["optimizer"]] == "optimizer not timed on rank 1 (its optimizer has no step hooks)"


def test_model_state_bytes_per_param_of_a_model_without_parameters_is_absent_not_0():
    import torch

    mon = Parts(model=torch.nn.Module(), optimizer=SimpleNamespace(state={}))
    assert summary._memory_figures(mon, collective=False) == {}  # was {summary/model_state_bytes_per_param: 0.0}
    assert mon.summary_absent.why == {names.SUM_MODEL_STATE_BYTES_PER_PARAM: "the model has no parameters"}
    mon = Parts(model=torch.nn.Linear(4, 2, bias=False), optimizer=SimpleNamespace(state={}))
    # 8 fp32 weights and their 8 gradients (counted at their size), no optimizer state: 8 bytes a parameter
    assert summary._memory_figures(mon, collective=False) == {names.SUM_MODEL_STATE_BYTES_PER_PARAM: 8.0}


def test_an_energy_price_without_measured_energy_gives_no_cost_rather_than_0_kwh_priced():
    from mlflow_llmeff.monitor.consumption import Consumption

    c = Consumption(devices=2, device_hour_usd=3.6, usd_per_kwh=0.2)
    c.update(joules=0.0, energy_devices=0)  # nothing measured (no NVML, no RAPL)
    assert c.cost_usd(1000.0) is None  # was 3.6 x 2 x 1000 / 3600 = 2.0 USD, the energy priced as 0 kWh
    s = c.summary(1000.0, tokens=10_000, device_tflops=None)
    assert names.SUM_COST_USD not in s and names.SUM_USD_PER_BTOK not in s
    why = "usd_per_kwh given but no energy is measured to price"
    assert c.absent() == {names.SUM_COST_USD: why, names.SUM_USD_PER_BTOK: why}
    assert c.tags(1000.0)[names.COST_USD_PER_KWH] == "0.2 (cost/* omitted: no energy is measured to price)"
    # without an energy price the device-hours are the cost, measured or not
    plain = Consumption(devices=2, device_hour_usd=3.6)
    plain.update(joules=0.0, energy_devices=0)
    assert plain.cost_usd(1000.0) == pytest.approx(2.0) and plain.absent() == {}
    # every device measured: device-hours plus 1 kWh x 0.2
    c.set_devices(2)
    c.update(joules=3.6e6, energy_devices=2, measured_domains=2, wall_s=1000.0)
    assert c.cost_usd(1000.0) == pytest.approx(2.2) and c.absent() == {}


def test_compare_names_a_repeat_left_out_with_the_why_its_run_gives():
    from mlflow_llmeff.report.calc import RunRecord, absent_why
    from mlflow_llmeff.report.repeats import configurations

    tags = {names.ACCEL_SHORT: "cpu", names.ACCEL_COUNT: "1", names.STABILITY: "stable"}
    a = RunRecord("a" * 32, "run-a", metrics={names.SUM_TOKENS_PER_SEC: 100.0, names.SUM_GOODPUT: 0.5}, tags=tags)
    b = RunRecord("b" * 32, "run-b", metrics={names.SUM_TOKENS_PER_SEC: 110.0}, tags={
        **tags, names.SUMMARY_ABSENT: "summary/step_time_cv: 1 steady step (a spread needs at least 2); "
                                      "summary/goodput: no wall time (a share of no time is undefined)"})
    assert absent_why(b, names.SUM_GOODPUT) == "no wall time (a share of no time is undefined)"
    assert absent_why(b, names.SUM_MFU) is None and absent_why(a, names.SUM_GOODPUT) is None
    (c,) = configurations([a, b])
    assert c.estimate(names.SUM_GOODPUT).left_out == (
        "run-b: no summary/goodput (no wall time (a share of no time is undefined))",)


def test_the_headline_sorts_an_unknown_device_count_last_not_as_0():
    from mlflow_llmeff.report.calc import RunRecord
    from mlflow_llmeff.report.headline import headline
    from mlflow_llmeff.report.repeats import configurations

    run = RunRecord("c" * 32, "run-c", metrics={names.SUM_DEVICE_TOKENS_PER_SEC: 50.0}, tags={names.STABILITY: "stable"})
    h = headline(configurations([run]))
    devices = h.rows[0][h.columns.index("devices")]
    assert (devices.text, devices.sort) == ("", None)  # was sort 0.0: first in an ascending sort


# ------------------------------------------------------------------ counts the loop did not give
def _history(run_id: str, key: str) -> list[tuple[int, float]]:
    return [(m.step, m.value) for m in mlflow.MlflowClient().get_metric_history(run_id, key)]


def _two_logged_steps(**count) -> EfficiencyMonitor:
    """Steps 1 (warm-up) and 2 of 1 s each on a fake clock, logged at step 2, each counting ``count``."""
    t = [0.0]
    mon = monitor(lambda: t[0], log_every_n_steps=2, warmup_steps=1)
    for _ in range(2):
        t[0] += 1.0
        mon.step(**count)
    mon.finish()
    return mon


def test_samples_per_sec_of_unknown_samples_is_absent_with_why_and_logged_when_given(tracking_uri):
    # the fault: count(tokens=100) logged throughput/samples_per_sec 0.0, "no sequence a second"
    mon = _two_logged_steps(tokens=100)
    tags = mlflow.MlflowClient().get_run(mon.run_id).data.tags
    assert _history(mon.run_id, names.TPUT_SAMPLES) == [] and _history(mon.run_id, names.TPUT_TOKENS) == [(2, 100.0)]
    # padded and loss-bearing tokens were not given either: no train/padded_tokens = tokens, no loss = tokens
    assert _history(mon.run_id, names.TRAIN_PADDED_TOKENS) == [] and _history(mon.run_id, names.TRAIN_LOSS_TOKENS) == []
    assert tags[names.INTERVAL_ABSENT] == (
        "train/padded_tokens: padded positions unknown (a micro-batch counted as tokens= without padded_tokens=); "
        "train/loss_tokens: loss-bearing tokens unknown (a micro-batch counted as tokens= without loss_tokens= or "
        "samples=, or a flat (N,) batch without labels); "
        "throughput/samples_per_sec: sequences unknown (a micro-batch counted as tokens= without samples=, or a flat "
        "(N,) batch without position_ids, cu_seqlens or seq_idx)")
    # given: 4 sequences of 25 in the steady second -> 4 samples/s; loss tokens 100 - 4 per step, padded given
    mon = _two_logged_steps(tokens=100, samples=4, padded_tokens=128)
    assert _history(mon.run_id, names.TPUT_SAMPLES) == [(2, 4.0)]
    assert _history(mon.run_id, names.TRAIN_LOSS_TOKENS) == [(2, 192.0)]
    assert _history(mon.run_id, names.TRAIN_PADDED_TOKENS) == [(2, 256.0)]
    assert names.INTERVAL_ABSENT not in mlflow.MlflowClient().get_run(mon.run_id).data.tags


LENGTHS_UNKNOWN = (
    "sequence lengths unknown (a micro-batch counted as tokens= without samples= or sum_len_sq=, or a flat (N,) "
    "batch without position_ids, cu_seqlens or seq_idx): attention FLOPs grow with the sequence length, and all "
    "of a micro-batch's tokens taken as one sequence would grow with the micro-batch size")


def _llama_tiny_steps(micro_batches, clock_s: float = 0.5) -> EfficiencyMonitor:
    """llama-tiny (L 2, h 64, n 4, g 2, f 176, V 259) at a 2 TFLOP/s peak, no warm-up, 2 steps of
    ``clock_s`` logged at step 2; each step counts the batches ``micro_batches`` gives (one per micro-batch)."""
    from mlflow_llmeff.models.presets import load_config

    t = [0.0]
    mon = monitor(lambda: t[0], log_every_n_steps=2, warmup_steps=0, model_config=load_config("llama-tiny"),
                  peak_tflops=2.0)
    for _ in range(2):
        t[0] += clock_s
        *first, last = micro_batches()
        for b in first:
            mon.count(b)
        mon.step(last)
    mon.finish()
    return mon


def test_flops_of_a_micro_batch_of_2_or_8_rows_are_the_same_per_token(tracking_uri):
    # 8 rows of 32 tokens a step, as one micro-batch of 8 or four of 2: s = 32 either way. FLOPs per token
    # by hand (METRICS.md; tests/test_monitor.py): 2 x 4096 x (12 + 6 + 49.5 + 3) + 99,456 = 676,992;
    # 512 tokens in 1 s -> 512 x 676,992 / 1e12 TFLOP/s, MFU that / 2
    tflops = 512 * 676_992 / 1e12
    for rows, micro in ((8, 1), (2, 4)):
        mon = _llama_tiny_steps(lambda: [torch.zeros(rows, 32, dtype=torch.long)] * micro)
        assert mon.summary[names.SUM_DEVICE_TFLOPS] == pytest.approx(tflops, rel=1e-12), rows
        assert mon.summary[names.SUM_MFU] == pytest.approx(tflops / 2.0, rel=1e-12), rows
        assert _history(mon.run_id, names.TPUT_DEVICE_MFU) == [(2, pytest.approx(tflops / 2.0, rel=1e-12))]


def test_flops_of_unknown_sequence_lengths_are_absent_not_grown_with_the_micro_batch(tracking_uri):
    # the same 256 tokens a step flattened to (256,) or four (64,): one sequence of all of them gave s = 256
    # or 64, FLOPs per token 2 x 4096 x (67.5 + 6 x 256 / 64) + 99,456 = 849,024 vs 701,568 (+21%), an MFU
    # that grew with the micro-batch; both are now absent, and the run says why
    for micro in (1, 4):
        mon = _llama_tiny_steps(lambda: [torch.zeros(256 // micro, dtype=torch.long)] * micro)
        run = mlflow.MlflowClient().get_run(mon.run_id)
        for key in (names.SUM_DEVICE_TFLOPS, names.SUM_MFU, names.SUM_MFU_PALM, names.SUM_HFU):
            assert key not in mon.summary and key not in run.data.metrics
        assert mon.summary[names.SUM_TOKENS_PER_SEC] == 512.0  # what is known stays
        assert run.data.tags[names.SUMMARY_ABSENT].startswith(
            "summary/device_tflops_per_sec, summary/mfu, summary/mfu_palm, summary/hfu, summary/mfu_measured_peak: "
            + LENGTHS_UNKNOWN + ";")
        assert _history(mon.run_id, names.TPUT_DEVICE_TFLOPS) == [] and _history(mon.run_id, names.TPUT_DEVICE_MFU) == []
        assert (f"throughput/device/model_tflops_per_sec, throughput/device/mfu, throughput/device/hfu: "
                f"{LENGTHS_UNKNOWN}") in run.data.tags[names.INTERVAL_ABSENT]


def test_flops_of_counts_given_as_numbers_need_samples_or_sum_len_sq(tracking_uri):
    from mlflow_llmeff.models.presets import load_config

    def run(**count):
        t = [0.0]
        mon = monitor(lambda: t[0], log_every_n_steps=2, warmup_steps=0, model_config=load_config("llama-tiny"),
                      peak_tflops=2.0)
        for _ in range(2):
            t[0] += 0.5
            mon.step(**count)
        return mon.finish()

    assert names.SUM_MFU not in run(tokens=64)  # was s = 64: one sequence of the micro-batch's 64 tokens
    # two sequences of 32 (equal lengths from samples=, or sum(l^2) = 2 x 32^2 given): 128 tokens/s x 676,992
    for given in (dict(samples=2), dict(sum_len_sq=2048)):
        assert run(tokens=64, **given)[names.SUM_MFU] == pytest.approx(128 * 676_992 / 1e12 / 2.0, rel=1e-12)
