"""On a real CUDA device (bench/gpu_check.sh runs the gpu tests; skipped on CPU): NVML's clocks-event reasons
are read as bits or, unreadable, None (never a made-up 0), every interval gives system/device/throttled and
other_processes a value or a why, and a flat CUDA tensor's sequences count as unknown beside a (B, T) batch."""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_real_nvml_readings_are_known_or_said_unknown():
    import pynvml

    from mlflow_llmeff import names
    from mlflow_llmeff.meters import contention as ct
    from mlflow_llmeff.monitor.contention import ContentionMeter

    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
    x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    y = x @ x  # a context on the device: this process is one of its compute processes
    torch.cuda.synchronize()
    s = ct.read_device(pynvml, "this GPU", handle, own_pids=[os.getpid()])
    print(s)
    assert s.throttle is None or isinstance(s.throttle, int)
    meter = ContentionMeter(device=torch.device("cuda", torch.cuda.current_device()), env={}, gpu_period_s=None)
    assert meter.gpu_why is None
    meter.begin(collective=False)
    for _ in range(50):
        y = x @ y
    torch.cuda.synchronize()
    out = meter.interval(collective=False)
    print(out, meter.interval_why)
    for key in (names.SYS_DEV_THROTTLED, names.SYS_DEV_OTHER_PROCS):
        assert (key in out) != (key in meter.interval_why), key
    tags = meter.finish(collective=False)[1]
    print(tags)
    assert "throttle: " in tags[names.CONTENTION]


def test_a_flat_cuda_tensor_counts_its_sequences_as_unknown_beside_a_batch():
    from mlflow_llmeff.monitor.counting import BatchCounter, StepTally

    c = BatchCounter("cuda")
    c.add(torch.zeros(8, 32, dtype=torch.long, device="cuda"))
    c.add(torch.zeros(64, dtype=torch.long, device="cuda"))
    got = c.take(steps=1)
    assert (got.tokens, got.samples, got.samples_unknown, got.lengths_unknown, got.loss_unknown) == (320, 8, 1, 1, 1)
    assert got.effective_seq_len is None
    tally = StepTally()
    tally.add_batch({"input_ids": torch.zeros(2, 4, dtype=torch.long, device="cuda")})
    tally.add_numbers(10, samples=1)  # numbers beside a CUDA batch: one reduce on the device
    got = tally.take(steps=1)
    assert (got.samples, got.sum_len_sq, got.lengths_unknown, got.padded_unknown) == (3, 2 * 16 + 100, 0, 1)
