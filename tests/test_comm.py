"""Communication arithmetic (nccl-tests bus bandwidth, link peaks, exposed time, bytes per step) and the probe on gloo."""

from __future__ import annotations

import json
import os

import pytest

from mlflow_llmeff.calc import comm
from mlflow_llmeff import names
from mlflow_llmeff.parallel import Degrees


@pytest.mark.parametrize("op, n, factor", [
    ("all_reduce", 2, 1.0),          # 2(n-1)/n
    ("all_reduce", 8, 1.75),
    ("all_gather", 8, 0.875),        # (n-1)/n
    ("reduce_scatter", 4, 0.75),
    ("all_to_all", 4, 0.75),
    ("broadcast", 8, 1.0),
    ("all_reduce", 1, 0.0),          # one rank moves nothing
])
def test_bus_factors_are_the_nccl_tests_ones(op, n, factor):
    assert comm.bus_factor(op, n) == factor


def test_bus_bandwidth_hand_computed():
    # 1 GiB all-reduced over 8 ranks in 10 ms: algbw 107.374 GB/s, busbw x 7/4 = 187.904 GB/s
    size = 2**30
    assert comm.algbw_gbps(size, 0.01) == pytest.approx(107.3741824)
    assert comm.busbw_gbps("all_reduce", size, 0.01, 8) == pytest.approx(107.3741824 * 1.75)
    # an all-gather whose 256 MB output took 2 ms on 4 ranks: 128 GB/s algbw, 96 GB/s busbw
    assert comm.busbw_gbps("all_gather", 256e6, 0.002, 4) == pytest.approx(96.0)


@pytest.mark.parametrize("bad, match", [
    (lambda: comm.bus_factor("gather", 2), "collective 'gather' is not accepted"),
    (lambda: comm.bus_factor("all_reduce", 0), "ranks n=0 is not accepted"),
    (lambda: comm.algbw_gbps(10, 0.0), "need size >= 0 and time > 0"),
    (lambda: comm.nvlink_peak(9, 18), "NVLink version 9 is not known"),
    (lambda: comm.pcie_peak(4, 0), "width=0 must be >= 1"),
    (lambda: comm.nic_peak("Token Ring", 1, 1), "network kind 'Token Ring' is not known"),
])
def test_bad_input_is_one_line(bad, match):
    with pytest.raises(ValueError, match=match):
        bad()


@pytest.mark.parametrize("peak, link, gbps", [
    (comm.nvlink_peak(4, 18), "NVLink 4 x18", 450.0),       # H100 SXM: 900 GB/s bidirectional
    (comm.nvlink_peak(3, 12), "NVLink 3 x12", 300.0),       # A100 SXM: 600 GB/s bidirectional
    (comm.nvlink_peak(5, 18), "NVLink 5 x18", 900.0),       # B200: 1.8 TB/s bidirectional
    (comm.pcie_peak(4, 16), "PCIe 4.0 x16", 16 * 16 * 128 / 130 / 8),  # 31.5 GB/s
    (comm.pcie_peak(5, 16), "PCIe 5.0 x16", 32 * 16 * 128 / 130 / 8),  # 63.0 GB/s
    (comm.nic_peak("InfiniBand NDR", 8, 8), "8 x InfiniBand NDR for 8 devices", 50.0),  # one 400G port per GPU
    (comm.nic_peak("RoCE 200GbE", 2, 8), "2 x RoCE 200GbE for 8 devices", 6.25),
])
def test_link_peaks_from_datasheet_rates(peak, link, gbps):
    assert peak.link == link and peak.gbps == pytest.approx(gbps)
    assert peak.source


def test_every_table_row_names_its_datasheet():
    assert {r.link.split(" x")[0] for r in comm.LINKS} >= {"NVLink 3", "NVLink 4", "NVLink 5", "PCIe 4.0", "PCIe 5.0"}
    assert all(r.source and r.gbps > 0 for r in comm.LINKS)


def test_link_choice_and_unknown_with_the_reason():
    peak, why = comm.link_peak(backend="gloo", nodes=1)
    assert peak is None and why.startswith("unknown: gloo collectives go through shared memory")
    peak, why = comm.link_peak(backend="nccl", nodes=1, nvlink=(4, 18), pcie=(5, 16))
    assert peak.gbps == 450.0 and why == ""  # NVLink before PCIe on one machine
    peak, _ = comm.link_peak(backend="nccl", nodes=1, nvlink=None, pcie=(4, 16))
    assert peak.link == "PCIe 4.0 x16"
    peak, why = comm.link_peak(backend="nccl", nodes=2, nvlink=(4, 18))
    assert peak is None and "no InfiniBand/RoCE adapter rate" in why  # across machines the network decides
    peak, _ = comm.link_peak(backend="nccl", nodes=2, nic=("InfiniBand NDR", 8), devices_per_node=8)
    assert peak.gbps == 50.0


def test_exposed_time_is_the_collective_time_no_compute_covers():
    # collectives 0-10 and 20-30 (the second overlapping the first: union 0-10, 20-35); compute 5-25
    comm_iv, compute = [(0, 10), (20, 30), (25, 35)], [(5, 25)]
    assert comm.union_length(comm_iv) == 25
    assert comm.exposed_time(comm_iv, compute) == 5 + 10   # 0-5 and 25-35
    assert comm.exposed_time(comm_iv, []) == 25
    assert comm.exposed_time([], compute) == 0


P, LAYERS, TP_PARAMS = 125_632, 92_416, 92_160  # llama-tiny: all, inside the decoder layers, split by its TP plan


def bus_bytes(strategy: str, degrees, **kw):
    """The strategy's own prediction (its module in mlflow_llmeff/parallel/) for a llama-tiny step."""
    from mlflow_llmeff import parallel

    shape = dict(params=P, layer_params=LAYERS, tp_params=TP_PARAMS, grad_accum=1, tokens_per_micro_batch=256,
                 hidden=64, layers=2, precision="fp32")
    return parallel.get(strategy).bus_bytes(comm.TrafficShape(**{**shape, **kw}), degrees)


@pytest.mark.parametrize("strategy, degrees, precision, expected", [
    ("single", Degrees(), "fp32", 0.0),
    ("ddp", Degrees(dp_replicate=2), "fp32", 1.0 * 4 * P),                           # all-reduce 2(n-1)/n = 1
    ("ddp", Degrees(dp_replicate=8), "bf16", 1.75 * 4 * P),                          # fp32 gradients under AMP
    ("fsdp", Degrees(dp_shard=2), "fp32", 0.5 * 4 * (P + LAYERS) + 0.5 * 4 * P),     # gather fwd + layers again, RS
    ("fsdp", Degrees(dp_shard=2), "bf16", 0.5 * 2 * (P + LAYERS) + 0.5 * 4 * P),     # bf16 gathers, fp32 RS
    ("hsdp", Degrees(dp_replicate=2, dp_shard=2), "fp32",
     0.5 * 4 * (P + LAYERS) + 0.5 * 4 * P + 1.0 * 4 * P / 2),                        # + replicas' all-reduce of a shard
    ("tp", Degrees(tp=2), "fp32", 1.0 * 7 * 2 * 256 * 64 * 4),                        # 7 all-reduces/layer of 256x64 fp32
    ("deepspeed_zero1", Degrees(dp_shard=2), "fp32", 1.0 * 4 * P + 0.5 * 4 * P),     # AR gradients + AG parameters
    ("deepspeed_zero3", Degrees(dp_shard=2), "bf16", 0.5 * 2 * P + 0.5 * 2 * P),     # AG parameters + RS gradients
])
def test_predicted_bus_bytes_per_step_hand_computed(strategy, degrees, precision, expected):
    assert bus_bytes(strategy, degrees, precision=precision).total == pytest.approx(expected)


def test_predicted_bytes_scale_with_accumulation_where_the_collectives_run_per_micro_batch():
    ddp = [bus_bytes("ddp", Degrees(dp_replicate=2), grad_accum=g).total for g in (1, 4)]
    fsdp = [bus_bytes("fsdp", Degrees(dp_shard=2), grad_accum=g).total for g in (1, 4)]
    assert ddp[1] == ddp[0] and fsdp[1] == 4 * fsdp[0]  # DDP syncs once per step (no_sync), FSDP2 each micro-batch
    z = {s: [bus_bytes(s, Degrees(dp_shard=2), grad_accum=g).total for g in (1, 2)]
         for s in ("deepspeed_zero1", "deepspeed_zero2")}
    # as counted on DeepSpeed 0.19.8 over gloo: ZeRO-1 6P either way, ZeRO-2 6P then 10P (its all-reduce per micro-batch)
    assert z == {"deepspeed_zero1": [6.0 * P, 6.0 * P], "deepspeed_zero2": [6.0 * P, 10.0 * P]}


def test_probe_figures_without_a_peak_say_why():
    from mlflow_llmeff.meters.commprobe import ProbeResult, probe_figures

    r = ProbeResult({"all_reduce": 2.0, "all_gather": 1.5, "reduce_scatter": 1.0}, 2, "gloo", 4 * 2**20, 3, False)
    metrics, tags = probe_figures(r, None, "unknown: gloo")
    assert metrics == {names.COMM_ALLREDUCE_BUSBW: 2.0, names.COMM_ALLGATHER_BUSBW: 1.5,
                       names.COMM_REDUCESCATTER_BUSBW: 1.0}  # no utilization without a peak
    assert tags[names.COMM_PEAK_GBPS] == "unknown" and tags[names.COMM_PEAK_SOURCE] == "unknown: gloo"
    metrics, tags = probe_figures(r, comm.nvlink_peak(4, 18), "")
    assert metrics[names.COMM_BUSBW_UTIL] == 2.0 / 450.0 and tags[names.COMM_PEAK_GBPS] == "450"


def _probe_worker(rank: int, port: int, cache: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    from mlflow_llmeff.meters import commprobe

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        first = commprobe.measure(torch.device("cpu"), device_name="cpu-test", cache_dir=cache, size_bytes=2**20)
        again = commprobe.measure(torch.device("cpu"), device_name="cpu-test", cache_dir=cache, size_bytes=2**20)
        counter = commprobe.CommCounter()
        with counter.counting():
            t = torch.ones(1000)
            dist.all_reduce(t)
            out_t = torch.empty(2000)
            dist.all_gather_into_tensor(out_t, t)
        if rank == 0:
            with open(out, "w") as f:
                json.dump({"first": first.busbw_gbps, "cached": [first.cached, again.cached],
                           "again": again.busbw_gbps, "calls": counter.calls, "bus": counter.bus_bytes}, f)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_probe_on_gloo_measures_caches_and_counts_collectives(tmp_path):
    import torch.multiprocessing as mp

    from conftest import free_port

    out = tmp_path / "probe.json"
    mp.spawn(_probe_worker, args=(free_port(), str(tmp_path / "cache"), str(out)), nprocs=2, join=True)
    got = json.loads(out.read_text())
    assert got["cached"] == [False, True] and got["again"] == got["first"]  # the second read rank 0's cache
    assert all(v > 0 for v in got["first"].values())
    cache = json.loads((tmp_path / "cache" / "comm.json").read_text())
    (key, entry), = cache.items()
    assert key.startswith("gloo|world=2|nodes=1|cpu-test|") and entry["all_reduce"] == got["first"]["all_reduce"]
    # 4000 bytes all-reduced (x 2(n-1)/n = 1) and an 8000-byte all-gather output (x (n-1)/n = 1/2) over 2 ranks
    assert [tuple(c) for c in got["calls"]] == [("all_reduce", 4000, 2), ("all_gather", 8000, 2)]
    assert got["bus"] == 4000 + 4000
    assert os.path.getsize(tmp_path / "cache" / "comm.json") > 0
