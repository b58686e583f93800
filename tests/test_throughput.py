import pytest

from mlflow_llmeff.calc.throughput import Counts, ThroughputMeter


def step_counts(micro=4, batch=8, seq=512, pad_frac=0.0, steps=1):
    padded = micro * batch * seq * steps
    tokens = round(padded * (1 - pad_frac))
    return Counts(steps=steps, tokens=tokens, padded_tokens=padded, loss_tokens=tokens - micro * batch * steps,
                  samples=micro * batch * steps, sum_len_sq=0)


def test_grad_accum_tokens_per_second_hand_computed():
    # 4 micro-batches x 8 sequences x 512 tokens per step at 2.0 s/step = 16,384 / 2 = 8,192 tokens/s.
    m = ThroughputMeter(num_devices=1, warmup_steps=0)
    for _ in range(5):
        m.add(step_counts(), 2.0)
    r = m.interval()
    assert r.tokens_per_sec == 8192.0
    assert r.step_time_s == 2.0
    assert r.samples_per_sec == 16.0
    assert m.total.tokens == 5 * 16384


def test_padding_lowers_non_padding_throughput():
    m = ThroughputMeter(num_devices=1, warmup_steps=0)
    m.add(step_counts(pad_frac=0.3), 2.0)
    r = m.interval()
    assert r.tokens_per_sec == 11469 / 2.0  # vs 8,192 tokens/s without padding
    assert m.total.padded_tokens == 16384
    assert m.total.tokens == 11469  # round(16384 * 0.7)


def test_warmup_steps_excluded_from_steady_state():
    m = ThroughputMeter(num_devices=2, warmup_steps=3)
    m.add(step_counts(steps=3), 30.0)  # three slow warm-up steps (compile)
    assert m.interval() is None and m.summary() is None
    m.add(step_counts(steps=2), 4.0)
    s = m.summary()
    assert s.counts.steps == 2
    assert s.tokens_per_sec == 2 * 16384 / 4.0
    assert s.device_tokens_per_sec == 2 * 16384 / 4.0 / 2
    assert m.total.tokens == 5 * 16384  # cumulative counter keeps warm-up tokens
    assert m.warmup_s == 30.0


def test_stretch_straddling_warmup_end_is_rejected():
    m = ThroughputMeter(num_devices=1, warmup_steps=3)
    with pytest.raises(ValueError, match="straddle the end of warm-up at step 3"):
        m.add(step_counts(steps=5), 5.0)


def test_device_tflops_uses_effective_sequence_length():
    m = ThroughputMeter(num_devices=4, warmup_steps=0)
    m.add(Counts(steps=1, tokens=400, padded_tokens=600, loss_tokens=398, samples=2, sum_len_sq=100_000), 1.0)
    # two sequences of 100 and 300 tokens: s_eff = (100^2 + 300^2) / 400 = 250
    r = m.interval()
    assert r.counts.effective_seq_len == 250.0
    # FLOPs/token = 1e9 + 1e6 * s -> 1.25e9 at s=250; 400 tokens/s / 4 devices -> 1.25e11 FLOP/s = 0.125 TFLOP/s
    assert r.device_tflops_per_sec(lambda s: 1e9 + 1e6 * s) == pytest.approx(0.125)


def test_state_dict_round_trip_continues_counters():
    m = ThroughputMeter(num_devices=1, warmup_steps=1)
    for _ in range(4):
        m.add(step_counts(), 1.0)
    m2 = ThroughputMeter(num_devices=1, warmup_steps=1)
    m2.load_state_dict(m.state_dict())
    assert m2.step == 4 and m2.warmup_end_step == 5
    assert m2.total.tokens == 4 * 16384
    assert m2.summary().counts.steps == 3


def test_invalid_devices_rejected():
    with pytest.raises(ValueError, match="num_devices=0"):
        ThroughputMeter(num_devices=0, warmup_steps=0)


def test_interval_metrics_hand_computed_with_and_without_a_peak():
    from mlflow_llmeff import names
    m = ThroughputMeter(num_devices=2, warmup_steps=0)
    m.add(Counts(steps=1, tokens=1000, padded_tokens=1000, loss_tokens=990, samples=10, sum_len_sq=100_000), 2.0)
    r = m.interval()
    # 500 tokens/s; per device 250; FLOPs/token 1e9 -> 250e9 FLOP/s = 0.25 TFLOP/s per device
    got = r.interval_metrics(lambda s: 1e9, peak_tflops=1.0)
    assert got == {names.TRAIN_STEP_TIME_S: 2.0, names.TPUT_TOKENS: 500.0, names.TPUT_SAMPLES: 5.0,
                   names.TPUT_DEVICE_TOKENS: 250.0, names.TPUT_DEVICE_TFLOPS: 0.25, names.TPUT_DEVICE_MFU: 0.25}
    assert names.TPUT_DEVICE_MFU not in r.interval_metrics(lambda s: 1e9)  # unknown peak: no MFU
    assert names.TPUT_DEVICE_TFLOPS not in r.interval_metrics()            # unknown model: no TFLOP/s


def test_hfu_is_mfu_times_the_hardware_to_model_flops_ratio():
    from mlflow_llmeff import names

    m = ThroughputMeter(num_devices=1, warmup_steps=0)
    m.add(Counts(steps=1, tokens=1000, padded_tokens=1000, loss_tokens=999, samples=1, sum_len_sq=1_000_000), 1.0)
    got = m.interval().interval_metrics(lambda s: 1e9, peak_tflops=2.0, hfu_ratio=4 / 3)
    assert got[names.TPUT_DEVICE_MFU] == 0.5  # 1e12 FLOP/s of 2 TFLOP/s
    assert got[names.TPUT_DEVICE_HFU] == pytest.approx(0.5 * 4 / 3, rel=1e-15)
