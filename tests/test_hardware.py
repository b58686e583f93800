"""Tests for mlflow_llmeff.meters.hardware: peak table look-ups, detection, resolution, measured peak."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from mlflow_llmeff import names
from mlflow_llmeff.meters.hardware import (DTYPES, PEAK_TABLE, AcceleratorInfo, detect_accelerator, lookup_peak,
                                    match_row, measure_matmul_peak, resolve_peak)


# --------------------------------------------------------------------------- look-ups
@pytest.mark.parametrize("name, dtype, tflops", [
    ("NVIDIA H200", "bf16", 989.4),
    ("NVIDIA H20", "bf16", 148.0),              # the H20 row, never the H200 one
    ("NVIDIA L4", "bf16", 121.0),
    ("NVIDIA L40S", "bf16", 362.05),
    ("NVIDIA L40", "bf16", None),               # not the L4 row either
    ("NVIDIA H100 PCIe", "bf16", 756.0),
    ("NVIDIA H100 80GB HBM3", "bf16", 989.4),   # the SXM part's driver name
    ("NVIDIA H100 NVL", "bf16", 835.5),
    ("NVIDIA H200 NVL", "bf16", 835.5),
    ("NVIDIA A100-SXM4-80GB", "bf16", 312.0),
    ("NVIDIA A100-SXM4-80GB", "tf32", 156.0),
    ("NVIDIA A100-SXM4-80GB", "fp32", 19.5),
    ("NVIDIA A100-SXM4-80GB", "fp8", None),     # Ampere has no FP8 tensor cores
    ("NVIDIA GH200 480GB", "bf16", 989.4),
    ("NVIDIA B200", "bf16", 2250.0),
    ("NVIDIA A10G", "bf16", 70.0),
    ("NVIDIA A10", "bf16", 125.0),
    ("AMD Instinct MI300X", "bf16", 1307.4),
    ("AMD Instinct MI250X/MI250", "bf16", 383.0),
    ("Tesla V100-SXM2-32GB", "fp16", 125.0),
    ("Tesla V100-SXM2-32GB", "bf16", None),     # Volta has no BF16
    ("NVIDIA GeForce RTX 4090", "bf16", None),  # unknown: no invented peak
    ("NVIDIA H100", "bf16", None),              # ambiguous form factor: not guessed
])
def test_lookup_peak_gives_the_dense_value_or_none(name, dtype, tflops):
    entry = lookup_peak(name, dtype)
    assert (entry.tflops if entry else None) == tflops


@pytest.mark.parametrize("name, short", [
    ("Tesla V100-SXM2-16GB", "V100-SXM2"), ("Tesla V100-PCIE-32GB", "V100-PCIe"), ("NVIDIA A10G", "A10G"),
    ("NVIDIA A100-SXM4-40GB", "A100-SXM4-40GB"), ("NVIDIA A100-SXM4-80GB", "A100-80GB"),
    ("NVIDIA A100-PCIE-40GB", "A100-PCIe-40GB"), ("NVIDIA A100 80GB PCIe", "A100-PCIe-80GB"),
    ("NVIDIA L4", "L4"), ("NVIDIA L40S", "L40S"), ("NVIDIA H100 80GB HBM3", "H100-SXM"),
    ("NVIDIA H100 PCIe", "H100-PCIe"), ("NVIDIA H100 NVL", "H100-NVL"), ("NVIDIA H200", "H200"),
    ("NVIDIA GH200 480GB", "GH200"), ("NVIDIA B100", "B100"), ("NVIDIA B200", "B200"), ("NVIDIA GB200", "GB200"),
    ("AMD Instinct MI250X", "MI250X"), ("AMD Instinct MI300X", "MI300X"), ("AMD Instinct MI325X", "MI325X"),
    ("NVIDIA B300 SXM6 AC", "B300"), ("NVIDIA GB300", "GB300"), ("NVIDIA H20", "H20"),
    ("NVIDIA GeForce RTX 5090", "RTX-5090"), ("AMD Instinct MI350X", "MI350X"), ("AMD Instinct MI355X", "MI355X"),
])
def test_required_devices_are_in_the_table(name, short):
    assert match_row(name).short == short


# Datasheet figures WITH 2:4 sparsity (the big number on NVIDIA/AMD pages); the table must hold half.
SPARSE_BF16 = {"H100-SXM": 1979, "H100-PCIe": 1513, "H100-NVL": 1671, "H200": 1979, "GH200": 1979,
               "L4": 242, "L40S": 733, "A100-80GB": 624, "B200": 4500, "B100": 3500, "GB200": 5000,
               "MI300X": 2614.9, "MI325X": 2614.9}


@pytest.mark.parametrize("short, sparse", sorted(SPARSE_BF16.items()))
def test_table_holds_the_dense_half_of_the_sparse_datasheet_figure(short, sparse):
    row = next(r for r in PEAK_TABLE if r.short == short)
    # 1.5%: the datasheets' own rounding (L40S prints 362.05 dense beside 733 sparse).
    assert row.tflops["bf16"] == pytest.approx(sparse / 2, rel=0.015)
    assert row.tflops["bf16"] < 0.6 * sparse


@pytest.mark.parametrize("row", PEAK_TABLE, ids=lambda r: r.short)
def test_every_row_is_dense_consistent_and_sourced(row):
    # Dense tensor-core ratios since Ampere: FP16 == BF16, TF32 == BF16/2, FP8 == 2*BF16 (within
    # datasheet rounding, up to 1.2% for L40S's TF32 183 beside BF16 362.05), so a row mixing a
    # sparse figure (2x) with dense ones would fail here.
    t = row.tflops
    assert set(t) <= set(DTYPES) and all(v > 0 for v in t.values())
    if "bf16" in t:
        assert t["fp16"] == t["bf16"]
        if "tf32" in t:
            assert t["tf32"] == pytest.approx(t["bf16"] / 2, rel=0.015)
        if "fp8" in t:
            assert t["fp8"] == pytest.approx(2 * t["bf16"], rel=0.015)
    if "fp4" in t:  # FP4 is at least the FP8 rate (2x on B200-class, 3x on GB300, 4x on GeForce's FP32-acc FP8)
        assert t["fp4"] >= 2 * t["fp8"]
    assert t.get("fp32", 0) < min(t.get(k, float("inf")) for k in ("bf16", "fp16"))
    assert any(w in row.source.lower() for w in ("datasheet", "data sheet", "specifications")), row.source


# --------------------------------------------------------------------------- resolve
H200 = AcceleratorInfo(name="NVIDIA H200", short="H200", count=8, memory_gib=139.8, generation="Hopper",
                       driver_version="570.124.06", cuda_version="12.8", device_type="cuda")


def test_resolve_peak_uses_the_datasheet():
    peak, source = resolve_peak(H200, "bf16")
    assert peak == 989.4 and "H200" in source and "datasheet" in source


def test_resolve_peak_user_value_wins():
    assert resolve_peak(H200, "bf16", user_peak_tflops=800.0) == (800.0, "user")


def test_resolve_peak_unknown_device_says_why():
    info = AcceleratorInfo("NVIDIA H800", "H800", 1, 80.0, "Hopper", None, "12.8", "cuda")
    peak, source = resolve_peak(info, "bf16")
    assert peak is None and source.startswith("unknown:") and "'NVIDIA H800' is not in the peak table" in source


def test_resolve_peak_dtype_the_device_lacks_says_why():
    info = AcceleratorInfo("Tesla V100-SXM2-32GB", "V100-SXM2", 1, 32.0, "Volta", None, None, "cuda")
    peak, source = resolve_peak(info, "bf16")
    assert peak is None and source == "unknown: V100-SXM2 has no bf16 matrix peak in its datasheet; it lists fp32, fp16"


def test_resolve_peak_on_cpu_points_to_the_measured_peak():
    peak, source = resolve_peak(detect_accelerator(device_type="cpu"), "fp32")
    assert peak is None and source.startswith("unknown:") and "llmeff peak" in source


@pytest.mark.parametrize("kwargs, match", [({"dtype": "int8"}, "dtype 'int8'.*bf16"),
                                           ({"dtype": "bf16", "user_peak_tflops": 0.0}, "peak_tflops 0.0")])
def test_resolve_peak_rejects_bad_inputs(kwargs, match):
    with pytest.raises(ValueError, match=match):
        resolve_peak(H200, **kwargs)


# --------------------------------------------------------------------------- detection
def test_detect_accelerator_on_cpu_describes_the_cpu():
    info = detect_accelerator(count=4, device_type="cpu")
    assert (info.short, info.count, info.memory_gib, info.generation, info.device_type) == ("cpu", 4, None, "cpu", "cpu")
    assert isinstance(info.name, str) and info.name.strip()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU fallback")
def test_detect_accelerator_asked_for_cuda_without_gpu_falls_back_to_cpu():
    assert detect_accelerator(device_type="cuda").device_type == "cpu"


def test_tags_are_strings_under_the_standard_keys():
    assert H200.tags() == {
        names.ACCEL_NAME: "NVIDIA H200", names.ACCEL_SHORT: "H200", names.ACCEL_COUNT: "8",
        names.ACCEL_MEMORY_GIB: "139.8", names.ACCEL_GENERATION: "Hopper",
        names.DRIVER_VERSION: "570.124.06", names.CUDA_VERSION: "12.8"}
    cpu = detect_accelerator(device_type="cpu").tags()
    assert cpu[names.ACCEL_MEMORY_GIB] == "unknown"
    assert cpu[names.DRIVER_VERSION] == cpu[names.CUDA_VERSION] == "none"


# --------------------------------------------------------------------------- measured peak
def test_measured_peak_is_cached_and_reused(tmp_path):
    first = measure_matmul_peak("fp32", "cpu", cache_dir=tmp_path, sizes=(64,), min_time_s=0.01)
    assert first > 0
    cache = json.loads((tmp_path / "mamf.json").read_text())
    (key,) = cache
    assert key.startswith("cpu|") and "|fp32|" in key and cache[key]["sizes"] == [64]
    cache[key]["tflops"] = 123.0                              # a value no CPU reaches: must come from the cache
    (tmp_path / "mamf.json").write_text(json.dumps(cache))
    assert measure_matmul_peak("fp32", "cpu", cache_dir=tmp_path, sizes=(64,)) == 123.0
    assert measure_matmul_peak("fp32", "cpu", cache_dir=tmp_path, sizes=(64,), min_time_s=0.01,
                               refresh=True) != 123.0


def test_a_thin_matmul_counts_2mkn_flops_over_its_best_repeat(monkeypatch):
    from mlflow_llmeff.meters import hardware as hw_mod

    ticks = iter(range(1000))  # an injected clock: every call 0.5 s later, so every repeat takes 0.5 s
    monkeypatch.setattr(hw_mod.time, "perf_counter", lambda: next(ticks) * 0.5)
    assert hw_mod._time_matmul((64, 16, 32), "fp32", "cpu", 0.01) == 2 * 64 * 16 * 32 / 0.5 / 1e12
    assert hw_mod._time_matmul(8, "fp32", "cpu", 0.01) == 2 * 8 ** 3 / 0.5 / 1e12


def test_the_cpu_peak_is_the_best_of_squares_and_thin_shapes_and_an_old_square_only_entry_is_measured_again(
        tmp_path, monkeypatch):
    # a trial's bf16 run read 148% "MFU": the peak, timed on squares of 256-1024 (1.3 GFLOP/s), was below the
    # model's thin matmuls ((1024 x 64) @ (64 x 172): 2.9 GFLOP/s)
    from mlflow_llmeff.meters import hardware as hw_mod

    rates = {128: 3.0e-3, 256: 1.4e-3, 512: 1.3e-3, 1024: 0.9e-3, (1024, 64, 172): 2.9e-3}
    timed = []
    monkeypatch.setattr(hw_mod, "_time_matmul", lambda n, *a: timed.append(n) or rates.get(n, 1e-3))
    key = hw_mod._cache_key("cpu", "bf16")
    (tmp_path / "mamf.json").write_text(json.dumps({key: {"tflops": 0.9e-3, "sizes": [256, 512, 1024],
                                                          "measured_at": "2026-12-01T00:00:00"}}))
    m = hw_mod.matmul_peak("bf16", "cpu", cache_dir=tmp_path)  # the old entry had no thin shapes: measured again
    assert (m.tflops, m.from_cache) == (3.0e-3, False)
    assert timed == [128, 256, 512, 1024, *hw_mod._CPU_SHAPES]
    entry = json.loads((tmp_path / "mamf.json").read_text())[key]
    assert entry["shapes"] == [list(s) for s in hw_mod._CPU_SHAPES] and entry["tflops"] == 3.0e-3
    rates[(1024, 64, 172)] = 5.0e-3  # the best is whichever shape is fastest
    assert hw_mod.matmul_peak("bf16", "cpu", cache_dir=tmp_path).tflops == 3.0e-3  # now read from the cache
    assert hw_mod.matmul_peak("bf16", "cpu", cache_dir=tmp_path, refresh=True).tflops == 5.0e-3


def test_cli_peak_prints_a_cpus_bf16_peak_with_its_digits(tmp_path, monkeypatch):
    # a trial's bf16 CPU peak printed as "measured 0.001 TFLOP/s": three decimals lost the figure
    from mlflow_llmeff.cli import main

    monkeypatch.setenv("LLMEFF_CACHE_DIR", str(tmp_path))
    measure_matmul_peak("bf16", "cpu", sizes=(64,), min_time_s=0.01)
    file = tmp_path / "mamf.json"
    file.write_text(json.dumps({k: {**v, "tflops": 0.0030947} for k, v in json.loads(file.read_text()).items()}))
    text = CliRunner().invoke(main, ["peak", "--device", "cpu", "--dtype", "bf16"]).output
    assert ", bf16: measured 0.003095 TFLOP/s (read from the cache: " in text.splitlines()[0]


def test_measured_peak_cache_dir_env_override(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMEFF_CACHE_DIR", str(tmp_path))
    measure_matmul_peak("bf16", "cpu", sizes=(64,), min_time_s=0.01)
    assert "|bf16|" in next(iter(json.loads((tmp_path / "mamf.json").read_text())))


@pytest.mark.parametrize("dtype, device, match", [("tf32", "cpu", "dtype 'tf32' cannot be measured on cpu"),
                                                  ("int4", "cpu", "dtype 'int4'"),
                                                  ("fp32", "tpu", "device 'tpu'")])
def test_measured_peak_rejects_what_it_cannot_measure(dtype, device, match, tmp_path):
    with pytest.raises(ValueError, match=match):
        measure_matmul_peak(dtype, device, cache_dir=tmp_path)


def test_cli_peak_json_reads_the_cache(tmp_path, monkeypatch):
    from mlflow_llmeff.cli import main
    from mlflow_llmeff.meters import hardware as hw_mod

    monkeypatch.setenv("LLMEFF_CACHE_DIR", str(tmp_path))
    measure_matmul_peak("fp32", "cpu", sizes=(64,), min_time_s=0.01)
    file = tmp_path / "mamf.json"
    cache = {k: {**v, "tflops": 0.25} for k, v in json.loads(file.read_text()).items()}
    file.write_text(json.dumps(cache))
    result = CliRunner().invoke(main, ["peak", "--device", "cpu", "--dtype", "fp32", "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert out["measured_tflops"] == 0.25 and out["datasheet_tflops"] is None
    assert out["datasheet_source"].startswith("unknown:")
    # a cached figure says so, when it was measured and on what (a CPU's is per thread count)
    assert out["from_cache"] is True and out["measured_at"] == cache[out["measured_on"]]["measured_at"]
    assert out["measured_on"] == f"cpu|{hw_mod._cpu_model()} threads={torch.get_num_threads()}|fp32|torch {torch.__version__}"
    assert out["assumed"] == {}  # both given: nothing assumed
    from mlflow_llmeff.meters import hardware as hw

    cpu = AcceleratorInfo("AMD EPYC", "cpu", 1, None, "cpu", None, None, "cpu")
    monkeypatch.setattr(hw, "detect_accelerator", lambda count=1, device_type=None: cpu)  # also on a GPU host
    result = CliRunner().invoke(main, ["peak", "--json"])  # neither given: cpu and fp32, said so
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert out["dtype"] == "fp32" and out["measured_tflops"] == 0.25
    assert out["assumed"] == {"device": "cpu (no CUDA device: pass --device)",
                              "dtype": "fp32 (the default on cpu: pass --dtype)"}
    text = CliRunner().invoke(main, ["peak"]).output
    assert text.splitlines()[0].endswith(f" 0.25 TFLOP/s (read from the cache: measured {out['measured_at']} on "
                                         f"{out['measured_on']}; --refresh measures again)")
    assert text.splitlines()[-1] == ("assumed: device: cpu (no CUDA device: pass --device); "
                                     "dtype: fp32 (the default on cpu: pass --dtype)")


# --------------------------------------------------------------------------- on a GPU
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_detection_and_measured_bf16_peak_below_datasheet(tmp_path):
    info = detect_accelerator()
    assert info.device_type == "cuda" and info.memory_gib > 0 and info.cuda_version
    measured = measure_matmul_peak("bf16", "cuda", cache_dir=tmp_path)
    peak, source = resolve_peak(info, "bf16")
    print(f"{info.name}: measured bf16 {measured:.1f} TFLOP/s, datasheet {peak} ({source[:40]})")
    # the lent GPUs (H100, H200, A100) are in the datasheet table: a missing peak is a fault, not a pass
    assert peak is not None, f"{info.name}: no datasheet bf16 peak ({source})"
    assert 0.3 * peak < measured < 1.0 * peak


def test_the_run_says_when_and_on_what_its_measured_peak_was_measured(tmp_path, monkeypatch):
    from mlflow_llmeff.meters import hardware as hw_mod
    from mlflow_llmeff.monitor.account import FlopsAccount as Account

    monkeypatch.setenv("LLMEFF_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(hw_mod, "_CPU_SIZES", (64,))
    monkeypatch.setattr(hw_mod, "_CPU_SHAPES", ((64, 16, 32),))
    on = f"cpu|{hw_mod._cpu_model()} threads={torch.get_num_threads()}|fp32|torch {torch.__version__}"
    first = Account()
    first.measure_peak("fp32", None)
    stamp = json.loads((tmp_path / "mamf.json").read_text())[on]["measured_at"]
    assert first.measured_peak_at == f"{stamp} (measured in this run: {on})"
    again = Account()
    again.measure_peak("fp32", None)
    assert again.measured_peak == first.measured_peak
    assert again.measured_peak_at == f"{stamp} (read from the cache: {on})"
    assert Account().measured_peak_at is None  # nothing measured: no tag


def test_measured_peak_accepts_a_ddp_rank_cpu_device(tmp_path):
    from mlflow_llmeff.meters.hardware import measure_matmul_peak

    assert measure_matmul_peak("fp32", "cpu:1", cache_dir=tmp_path, sizes=[64], min_time_s=0.01) > 0


@pytest.mark.parametrize("typed, short, note", [
    ("H100", "H100-SXM", "'H100' taken as H100-SXM (also: H100-NVL, H100-PCIe)"),  # the trial: refused before
    ("h100-sxm", "H100-SXM", None), ("H200", "H200", None), ("a100", "A100", None), ("CPU", "cpu", None),
    ("mi300x", "MI300X", None), ("NVIDIA H100 80GB HBM3", "H100-SXM", "'NVIDIA H100 80GB HBM3' is H100-SXM"),
])
def test_every_short_name_and_family_is_accepted_case_insensitively(typed, short, note):
    from mlflow_llmeff.meters.accelerator_names import resolve_short

    assert resolve_short(typed) == (short, note)


@pytest.mark.parametrize("typed, short, note", [
    # a fresh user's `llmeff plan --accelerator A100-40GB` was the size-less A100: memory unknown, no fit checked
    ("A100-40GB", "A100-SXM4-40GB", "'A100-40GB' taken as A100-SXM4-40GB (also A100-PCIe-40GB: the same peaks and memory)"),
    ("a100 80gb", "A100-80GB", "'a100 80gb' taken as A100-80GB (also A100-PCIe-80GB: the same peaks and memory)"),
])
def test_a_family_name_with_a_memory_size_is_the_part_of_that_size(typed, short, note):
    from mlflow_llmeff.meters.accelerator_names import resolve_short
    from mlflow_llmeff.meters.hardware import MEMORY_GB

    assert resolve_short(typed) == (short, note)
    assert MEMORY_GB[short] == float(typed.upper().split("GB")[0][-2:])  # its memory is known: the fit is checked


def test_a_memory_size_no_part_of_the_family_has_is_one_line_naming_the_parts():
    from mlflow_llmeff.meters.accelerator_names import resolve_short

    with pytest.raises(ValueError) as e:
        resolve_short("A100-32GB")
    assert str(e.value) == ("accelerator 'A100-32GB': no A100 part has 32 GB; use one of: A100-SXM4-40GB (40 GB), "
                            "A100-80GB (80 GB), A100-PCIe-40GB (40 GB), A100-PCIe-80GB (80 GB)")


def test_an_unknown_accelerator_is_one_line_listing_the_short_names():
    from mlflow_llmeff.meters.accelerator_names import resolve_short

    with pytest.raises(ValueError, match=r"accelerator 'H30' is not known; use one of: A10, A100, .*H100-SXM"):
        resolve_short("H30")


# --------------------------------------------------------------------------- FP8: MFU's denominator named
FP8_DENSE = {"H100-SXM": 1978.9, "H200": 1978.9, "B200": 4500.0, "MI300X": 2614.9}


@pytest.mark.parametrize("short, tflops", sorted(FP8_DENSE.items()))
def test_fp8_dense_peaks_of_the_datasheets(short, tflops):
    # H100/H200 SXM: FP8 3,958 with sparsity -> 1978.9; HGX B200: 72 PFLOPS sparse / 8 GPUs / 2;
    # MI300X: 2614.9 dense (5229.8 with sparsity)
    row = next(r for r in PEAK_TABLE if r.short == short)
    assert row.tflops["fp8"] == tflops and "FP8" in row.source


H100 = AcceleratorInfo("NVIDIA H100 80GB HBM3", "H100-SXM", 8, 79.6, "Hopper", None, "12.8", "cuda")


def test_an_fp8_run_divides_by_the_fp8_peak_and_logs_the_bf16_one_beside_it():
    from mlflow_llmeff.meters.hardware import mfu_figures, resolve_denominators

    d = resolve_denominators(H100, "fp8")
    assert (d.tflops, d.precision, d.bf16_tflops) == (1978.9, "fp8", 989.4)
    got = mfu_figures(700.0, d)  # 700 achieved model TFLOP/s per device
    assert got[names.SUM_MFU] == pytest.approx(700 / 1978.9) == pytest.approx(0.353731871)
    assert got[names.SUM_MFU_BF16_PEAK] == pytest.approx(700 / 989.4) == pytest.approx(0.707499495)


def test_a_bf16_run_gives_the_same_figure_twice():
    from mlflow_llmeff.meters.hardware import mfu_figures, resolve_denominators

    d = resolve_denominators(H100, "bf16")
    assert d.precision == "bf16" and d.tflops == d.bf16_tflops == 989.4
    got = mfu_figures(400.0, d)
    assert got[names.SUM_MFU] == got[names.SUM_MFU_BF16_PEAK] == pytest.approx(400 / 989.4)


def test_a_user_peak_is_the_compute_dtype_s_and_the_bf16_peak_stays_the_table_s():
    from mlflow_llmeff.meters.hardware import resolve_denominators

    d = resolve_denominators(H100, "fp8", user_peak_tflops=1800.0)
    assert (d.tflops, d.source, d.precision, d.bf16_tflops) == (1800.0, "user", "fp8", 989.4)
    assert resolve_denominators(H100, "bf16", user_peak_tflops=900.0).bf16_tflops == 900.0


def test_without_a_bf16_peak_only_mfu_is_given():
    from mlflow_llmeff.meters.hardware import mfu_figures, resolve_denominators

    v100 = AcceleratorInfo("Tesla V100-SXM2-32GB", "V100-SXM2", 1, 32.0, "Volta", None, None, "cuda")
    d = resolve_denominators(v100, "fp16")
    assert (d.tflops, d.bf16_tflops) == (125.0, None)
    assert mfu_figures(50.0, d) == {names.SUM_MFU: 0.4}
    cpu = AcceleratorInfo("some cpu", "cpu", 1, None, "cpu", None, None, "cpu")
    assert mfu_figures(1.0, resolve_denominators(cpu, "fp32")) == {}  # no peak: both absent
    with pytest.raises(ValueError, match="device_tflops=-1.0 must be >= 0"):
        mfu_figures(-1.0, d)


# --------------------------------------------------------------------------- issue 51: new rows, FP4
@pytest.mark.parametrize("name, short", [("NVIDIA H20", "H20"), ("NVIDIA H200", "H200"), ("NVIDIA H200 NVL", "H200-NVL"),
                                         ("NVIDIA B300", "B300"), ("NVIDIA GB300", "GB300")])
def test_h20_and_h200_each_match_their_own_row(name, short):
    # whole tokens, longest first: H20 is a prefix of H200 as a string, never as a token
    assert match_row(name).short == short


# Per-device dense figures by hand from the boards' sparse figures (see each row's source).
NEW_ROWS = {
    "B300": {"bf16": 36e3 / 8 / 2, "tf32": 18e3 / 8 / 2, "fp8": 72e3 / 8 / 2, "fp32": 600 / 8},
    "GB300": {"bf16": 360e3 / 72 / 2, "tf32": 180e3 / 72 / 2, "fp8": 720e3 / 72 / 2, "fp4": 1080e3 / 72},
    "H20": {"bf16": 148.0, "tf32": 74.0, "fp32": 44.0},
    "RTX-5090": {"bf16": 419 / 2, "fp8": 838 / 2, "fp4": 3352 / 2, "fp32": 104.8},
    "MI350X": {"bf16": 256 * 4096 * 2.2e9 / 1e12, "fp8": 256 * 8192 * 2.2e9 / 1e12},
    "MI355X": {"bf16": 256 * 4096 * 2.4e9 / 1e12, "fp8": 256 * 8192 * 2.4e9 / 1e12},
}


@pytest.mark.parametrize("short, want", sorted(NEW_ROWS.items()))
def test_new_rows_hold_the_dense_figures_worked_by_hand(short, want):
    row = next(r for r in PEAK_TABLE if r.short == short)
    assert {k: row.tflops[k] for k in want} == pytest.approx(want, abs=0.05)


@pytest.mark.parametrize("short, absent, said", [("B300", "fp4", "No FP4"), ("GB300", "fp32", "No FP32"),
                                                 ("H20", "fp8", "No FP8"), ("MI355X", "fp4", "No MXFP4"),
                                                 ("MI350X", "tf32", "TF32")])
def test_a_figure_no_citable_source_gives_is_absent_and_the_source_says_so(short, absent, said):
    row = next(r for r in PEAK_TABLE if r.short == short)
    assert absent not in row.tflops and said in row.source


def test_memory_per_device_of_the_new_rows():
    from mlflow_llmeff.meters.hardware import MEMORY_GB

    assert {k: MEMORY_GB[k] for k in ("B300", "GB300", "H20", "RTX-5090", "MI350X", "MI355X")} == {
        "B300": 288, "GB300": 288, "H20": 96, "RTX-5090": 32, "MI350X": 288, "MI355X": 288}


def test_an_fp4_run_divides_by_the_fp4_peak_and_names_it():
    from mlflow_llmeff.meters.hardware import mfu_figures, resolve_denominators

    gb300 = AcceleratorInfo("NVIDIA GB300", "GB300", 72, 279.0, "Blackwell", None, "12.9", "cuda")
    d = resolve_denominators(gb300, "fp4")
    assert (d.tflops, d.precision, d.bf16_tflops) == (15000.0, "fp4", 2500.0)
    assert mfu_figures(3000.0, d) == {names.SUM_MFU: 0.2, names.SUM_MFU_BF16_PEAK: 1.2}


def test_an_fp4_peak_the_device_lacks_says_why():
    b300 = AcceleratorInfo("NVIDIA B300", "B300", 8, 270.0, "Blackwell", None, "12.9", "cuda")
    peak, source = resolve_peak(b300, "fp4")
    assert peak is None and source.startswith("unknown: B300 has no fp4 matrix peak")


def test_fp4_is_never_measured(tmp_path):
    with pytest.raises(ValueError, match="dtype 'fp4' cannot be measured"):
        measure_matmul_peak("fp4", "cpu", cache_dir=tmp_path)
