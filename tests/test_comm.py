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
    (comm.nic_peak("InfiniBand NDR", 8, 8), "8 x InfiniBand NDR for 8 devices", 400.0),  # the node's 8 x 50 GB/s
    (comm.nic_peak("RoCE 200GbE", 2, 8), "2 x RoCE 200GbE for 8 devices", 50.0),          # 2 x 25, not / 8
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
    assert "give link_peak_gbps" in why
    peak, _ = comm.link_peak(backend="nccl", nodes=2, nic=("InfiniBand NDR", 8), devices_per_node=8)
    assert peak.gbps == 400.0  # 8 x 400 Gb/s: the node's 400 GB/s (8 x NVLink 4 would allow 450)


# ------------------------------------------------------------------ the peak across nodes (NR5-06)
def test_nr5_06_eight_gpus_with_eight_200g_nics_read_0_96_not_7_68():
    # NVIDIA/nccl#812: 192 GB/s all-reduce busbw on 8 GPUs per node, 8 x 200 Gb/s NICs. The peak is the
    # node's 8 x 25 = 200 GB/s; dividing it by the 8 GPUs (200 / 8 = 25 GB/s "per GPU") read 192 / 25 = 7.68
    peak, why = comm.link_peak(backend="nccl", nodes=2, nic=("InfiniBand HDR", 8), devices_per_node=8,
                               nvlink=(4, 18))
    assert why == "" and peak.gbps == 200.0
    assert comm.utilization(192.0, peak.gbps) == (0.96, None)
    assert comm.internode_peak_gbps(25.0, 8, 8) == 200.0


def test_two_nodes_of_one_gpu_over_200_mbit_peak_at_the_link_rate():
    # one 200 Mbit/s link per node, one rank per node: 200e6 / 8 / 1e9 = 0.025 GB/s
    assert comm.internode_peak_gbps(200e6 / 8 / 1e9, 1, 1) == 0.025
    assert comm.utilization(0.024, 0.025)[0] == pytest.approx(0.96)


def test_fewer_nics_than_gpus_share_the_nodes_rate_not_a_per_gpu_slice():
    # 8 GPUs, 2 x 400 Gb/s: the node's 100 GB/s (busbw is per rank but the ring's inter-node edges carry
    # the node's bytes once); 8 GPUs, 1 x 100 Gb/s: 12.5 GB/s
    assert comm.internode_peak_gbps(50.0, 2, 8) == 100.0
    assert comm.nic_peak("InfiniBand EDR", 1, 8).gbps == 12.5
    # 4 x 400 Gb/s (200 GB/s) on 8 GPUs behind PCIe 4.0 x16 (31.5 GB/s): a GPU's own link is the bound
    assert comm.internode_peak_gbps(50.0, 4, 8, intra_gbps=31.5) == 31.5
    assert comm.internode_peak_gbps(50.0, 4, 1, intra_gbps=31.5) == 200.0  # one GPU a node: no intra-node edge
    peak, _ = comm.link_peak(backend="nccl", nodes=4, nic=("InfiniBand NDR", 4), devices_per_node=8, pcie=(4, 16))
    assert peak.gbps == pytest.approx(16 * 16 * 128 / 130 / 8) and "below the network's 200 GB/s" in peak.link


def test_a_given_peak_wins_and_a_measured_ratio_above_1_is_logged_with_why_never_clipped():
    peak, why = comm.link_peak(backend="gloo", nodes=2, given_gbps=0.025)
    assert (peak.gbps, peak.link, why) == (0.025, "link_peak_gbps", "")
    ratio, note = comm.utilization(0.0275, 0.025)
    assert ratio == pytest.approx(1.1) and note.startswith("busbw 0.0275 GB/s is 1.1x the peak 0.025 GB/s")
    assert "loopback" in note


def test_gloo_across_machines_takes_the_interfaces_rate_or_says_why_not():
    eth = comm.LinkPeak("eth0 (tbf rate 200Mbit)", 0.025, "tc")
    assert comm.link_peak(backend="gloo", nodes=2, interface=(eth, ""))[0] is eth
    peak, why = comm.link_peak(backend="gloo", nodes=2, interface=(None, "eth0 is a virtual interface"))
    assert peak is None and why.startswith("unknown: several machines (gloo); eth0 is a virtual interface; give")


@pytest.mark.parametrize("peak, nccl, size", [
    (None, True, 64 * 2**20), (None, False, 4 * 2**20),   # unknown peak: the defaults
    (0.025, False, 16 * 2**20),                           # 200 Mbit/s: 12.5 MB in 0.5 s -> 16 MiB
    (450.0, True, 64 * 2**20), (1.25, False, 64 * 2**20),  # fast links: capped at 64 MiB
    (0.001, False, 4 * 2**20),                            # 8 Mbit/s: 4 MiB already lasts 4 s
])
def test_probe_messages_last_half_a_second_at_the_peak(peak, nccl, size):
    assert comm.probe_message_bytes(peak, nccl=nccl) == size


@pytest.mark.parametrize("bad, match", [
    (lambda: comm.internode_peak_gbps(0.0, 1), "rates must be > 0"),
    (lambda: comm.internode_peak_gbps(25.0, 0, 8), "nics=0, devices_per_node=8: both must be >= 1"),
    (lambda: comm.given_peak(-1.0), "link_peak_gbps=-1.0 must be > 0 GB/s"),
    (lambda: comm.utilization(1.0, 0.0), "need busbw >= 0 and peak > 0"),
])
def test_bad_peak_input_is_one_line(bad, match):
    with pytest.raises(ValueError, match=match):
        bad()


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
    assert names.COMM_PEAK_EXCEEDED not in tags
    metrics, tags = probe_figures(r, comm.given_peak(1.6), "")  # 2.0 GB/s over a 1.6 GB/s peak: 1.25, kept
    assert metrics[names.COMM_BUSBW_UTIL] == 1.25
    assert tags[names.COMM_PEAK_EXCEEDED].startswith("all-reduce busbw 2 GB/s is 1.25x the peak 1.6 GB/s")


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


def test_kineto_start_and_stop_notes_are_dropped_from_stderr_and_the_rest_kept(capfd):
    # a trial found four 'USDT:... SyncActivityProfilerHandler.cpp:52] profiler_start' lines in every 2-process
    # CPU run's output: torch.profiler's library writes them to fd 2 as the sampled steps' profiles start and stop
    import torch
    from torch.profiler import ProfilerActivity, profile

    from mlflow_llmeff.meters.commprobe import kineto_notes_dropped

    prof = profile(activities=[ProfilerActivity.CPU])
    with kineto_notes_dropped():
        prof.start()
        os.write(2, b"a line of the run's own\n")
    torch.ones(4) @ torch.ones(4)
    with kineto_notes_dropped():
        prof.stop()
    err = capfd.readouterr().err
    assert err == "a line of the run's own\n"
    assert any(e.name == "aten::matmul" for e in prof.events())  # the profile itself is whole
    os.write(2, b"USDT:2026-12-07 17:36:15 8199:8199 SyncActivityProfilerHandler.cpp:52] profiler_start\n")
    assert "profiler_start" in capfd.readouterr().err  # outside the window nothing is dropped
