"""Accelerator detection, the dense peak TFLOP/s table with its datasheets, and the measured peak.

torch and pynvml are imported inside the functions that need them, so importing this module is
cheap and works without either. Every peak is DENSE (NVIDIA and AMD datasheets print the 2:4
structured-sparsity figure, twice the dense one, marked with an asterisk or "with sparsity"; those
figures are halved here and never stored) and per device (board-level figures such as HGX B200's
are divided by the GPUs on the board). FP4 is NVFP4 on NVIDIA Blackwell and MXFP4 on AMD CDNA4; an
FP4 run's denominator is named ``fp4`` as an FP8 run's is ``fp8``. A figure no citable source gives
is left out, so that dtype has no peak on that device (MFU omitted, the source says why).

Device names are matched by whole tokens, longest pattern first: the name is upper-cased and split
on spaces, ``-``, ``_`` and ``/``; a row matches when its pattern appears as consecutive tokens.
So ``NVIDIA H20`` never matches the ``H200`` row, ``NVIDIA L4`` never matches ``L40S``, and
``NVIDIA H100 PCIe`` is tried as ``H100 PCIE`` before any shorter H100 pattern. A name no row
matches gets no peak: MFU is omitted and the source says why, unless the user passes one.
"""

from __future__ import annotations

import json
import os
import platform
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from mlflow_llmeff import names

__all__ = [
    "DTYPES",
    "PeakMeasurement",
    "matmul_peak",
    "AcceleratorInfo",
    "PeakEntry",
    "PeakRow",
    "PEAK_TABLE",
    "FAMILY_DEFAULT",
    "resolve_short",
    "detect_accelerator",
    "match_row",
    "lookup_peak",
    "resolve_peak",
    "Denominators",
    "resolve_denominators",
    "mfu_figures",
    "measure_matmul_peak",
    "default_cache_dir",
]

#: Compute dtypes the peak table and the measured peak know.
DTYPES = ("bf16", "fp16", "tf32", "fp8", "fp4", "fp32")


@dataclass(frozen=True)
class PeakEntry:
    """A dense peak for one device and dtype.

    Attributes:
        tflops: dense peak TFLOP/s per device (1 TFLOP/s = 1e12 FLOP/s).
        source: the datasheet it comes from (and how it was derived from it).
    """

    tflops: float
    source: str


@dataclass(frozen=True)
class PeakRow:
    """One row of the peak table.

    Attributes:
        short: short device name used in tags and run names, e.g. ``H100-SXM``.
        generation: architecture, e.g. ``Hopper``.
        patterns: token sequences that identify the device in driver-reported names.
        tflops: dense peak TFLOP/s per device by dtype; a dtype the device cannot run on its
            matrix units is absent.
        source: datasheet (title, revision or date, URL) and how per-device dense values follow.
    """

    short: str
    generation: str
    patterns: tuple[tuple[str, ...], ...]
    tflops: dict[str, float] = field(default_factory=dict)
    source: str = ""


def _p(*names_: str) -> tuple[tuple[str, ...], ...]:
    return tuple(tuple(n.upper().split()) for n in names_)


_NV_A100 = ("NVIDIA A100 Tensor Core GPU datasheet (1758950-r4, 2021), "
            "nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf; "
            "dense = the unstarred figures (TF32 156, BF16/FP16 312; starred = 2:4 sparse); FP32 19.5 non-tensor")
_A100 = {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0}
_NV_H100 = ("NVIDIA H100 Tensor Core GPU datasheet (2023/2024), resources.nvidia.com/en-us-tensor-core/"
            "nvidia-tensor-core-gpu-datasheet; table figures are with sparsity, dense = half")
_NV_H200 = ("NVIDIA H200 Tensor Core GPU datasheet (2024), nvidia.com/en-us/data-center/h200/; "
            "table figures are with sparsity, dense = half")
_AMD_MI300 = ("AMD Instinct MI300X / MI325X data sheets (2023 / 2024), amd.com/en/products/accelerators/instinct/"
              "mi300/mi300x.html and .../mi325x.html; dense figures (the sparsity figures are twice these)")

_AMD_MI350 = ("AMD Instinct MI350 Series specifications: 256 CUs (ROCm GPU specifications, rocm.docs.amd.com/en/"
              "latest/reference/gpu-specs.html), 8,192 dense FP8 FLOPs per CU per clock and 4,096 FP16/BF16 (ISSCC "
              "2026 paper as reported at tomshardware.com 'Inside the Instinct MI355X'), peak clock 2.2 GHz MI350X / "
              "2.4 GHz MI355X (Hot Chips 2025, wccftech.com): dense = CUs x FLOPs/clock x clock. No MXFP4, TF32 "
              "or FP32 matrix: the stored copies disagree on whether MXFP4's 9.2/10.1 or 18.5/20.1 PFLOPS is "
              "dense; ")

#: The dense peak table. Order does not matter: matching sorts patterns longest first.
PEAK_TABLE: tuple[PeakRow, ...] = (
    PeakRow("V100-SXM2", "Volta", _p("V100 SXM2", "V100 SXM3"),
            {"fp32": 15.7, "fp16": 125.0},
            "NVIDIA Tesla V100 datasheet (1165301-r5, 2020), images.nvidia.com/content/technologies/volta/pdf/"
            "volta-v100-datasheet-update-us-1165301-r5.pdf: SXM2 FP32 15.7, Tensor 125 (dense; Volta has no "
            "sparsity, BF16, TF32 or FP8)"),
    PeakRow("V100-PCIe", "Volta", _p("V100 PCIE"), {"fp32": 14.0, "fp16": 112.0},
            "NVIDIA Tesla V100 datasheet (1165301-r5, 2020): PCIe FP32 14, Tensor 112"),
    PeakRow("V100S-PCIe", "Volta", _p("V100S"), {"fp32": 16.4, "fp16": 130.0},
            "NVIDIA Tesla V100S datasheet (2019), images.nvidia.com/content/technologies/volta/pdf/"
            "v100s-datasheet.pdf: FP32 16.4, Tensor 130"),
    PeakRow("A10", "Ampere", _p("A10"), {"fp32": 31.2, "tf32": 62.5, "bf16": 125.0, "fp16": 125.0},
            "NVIDIA A10 datasheet (2021), nvidia.com/content/dam/en-zz/Solutions/Data-Center/a10/pdf/"
            "a10-datasheet.pdf: TF32 62.5, BF16/FP16 125 (unstarred = dense), FP32 31.2"),
    PeakRow("A10G", "Ampere", _p("A10G"), {"fp32": 31.2, "tf32": 35.0, "bf16": 70.0, "fp16": 70.0},
            "AWS EC2 G5 instance specifications for the NVIDIA A10G (no public NVIDIA A10G datasheet; the A10G "
            "is an AWS-specific GA102 part with lower tensor rate than the A10): TF32 35, BF16/FP16 70 dense; "
            "FP32 taken as the A10's 31.2. Prefer the measured peak (llmeff peak) on A10G"),
    PeakRow("A100-SXM4-40GB", "Ampere", _p("A100 SXM4 40GB"), _A100, _NV_A100),
    PeakRow("A100-80GB", "Ampere", _p("A100 SXM4 80GB", "A100 SXM 80GB"), _A100, _NV_A100),
    PeakRow("A100-PCIe-40GB", "Ampere", _p("A100 PCIE 40GB"), _A100, _NV_A100),
    PeakRow("A100-PCIe-80GB", "Ampere", _p("A100 80GB PCIE", "A100 PCIE 80GB"), _A100, _NV_A100),
    PeakRow("A100", "Ampere", _p("A100"), _A100, _NV_A100 + " (all A100 variants share these peaks)"),
    PeakRow("L4", "Ada", _p("L4"), {"fp32": 30.3, "tf32": 60.0, "bf16": 121.0, "fp16": 121.0, "fp8": 242.5},
            "NVIDIA L4 Tensor Core GPU datasheet (2023), nvidia.com/en-us/data-center/l4/: TF32 120*, BF16/FP16 "
            "242*, FP8 485* are with sparsity, dense = half (60, 121, 242.5); FP32 30.3"),
    PeakRow("L40S", "Ada", _p("L40S"), {"fp32": 91.6, "tf32": 183.0, "bf16": 362.05, "fp16": 362.05, "fp8": 733.0},
            "NVIDIA L40S datasheet (2023), nvidia.com/en-us/data-center/l40s/: TF32 183|366*, BF16/FP16 "
            "362.05|733*, FP8 733|1466* (dense|sparse); FP32 91.6"),
    PeakRow("H100-SXM", "Hopper", _p("H100 SXM5", "H100 SXM", "H100 80GB HBM3", "H100 HBM3"),
            {"fp32": 67.0, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4, "fp8": 1978.9},
            _NV_H100 + ": H100 SXM TF32 989, BF16/FP16 1979, FP8 3958 sparse -> 494.7, 989.4, 1978.9; FP32 67"),
    PeakRow("H100-PCIe", "Hopper", _p("H100 PCIE"),
            {"fp32": 51.0, "tf32": 378.0, "bf16": 756.0, "fp16": 756.0, "fp8": 1513.0},
            _NV_H100 + ": H100 PCIe TF32 756, BF16/FP16 1513, FP8 3026 sparse -> 378, 756, 1513; FP32 51"),
    PeakRow("H100-NVL", "Hopper", _p("H100 NVL"),
            {"fp32": 60.0, "tf32": 417.5, "bf16": 835.5, "fp16": 835.5, "fp8": 1670.5},
            _NV_H100 + ": H100 NVL (per GPU) TF32 835, BF16/FP16 1671, FP8 3341 sparse -> 417.5, 835.5, 1670.5; "
            "FP32 60"),
    PeakRow("H200", "Hopper", _p("H200"),
            {"fp32": 67.0, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4, "fp8": 1978.9},
            _NV_H200 + ": H200 SXM TF32 989, BF16/FP16 1979, FP8 3958 sparse; FP32 67"),
    PeakRow("H200-NVL", "Hopper", _p("H200 NVL"),
            {"fp32": 60.0, "tf32": 417.5, "bf16": 835.5, "fp16": 835.5, "fp8": 1670.5},
            _NV_H200 + ": H200 NVL TF32 835, BF16/FP16 1671, FP8 3341 sparse; FP32 60"),
    PeakRow("GH200", "Hopper", _p("GH200"),
            {"fp32": 67.0, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4, "fp8": 1978.9},
            "NVIDIA GH200 Grace Hopper Superchip datasheet (2023), nvidia.com/en-us/data-center/grace-hopper-"
            "superchip/: H100/H200 GPU, TF32 494|989*, BF16/FP16 990|1979*, FP8 1979|3958*; FP32 67"),
    PeakRow("B100", "Blackwell", _p("B100"),
            {"fp32": 60.0, "tf32": 875.0, "bf16": 1750.0, "fp16": 1750.0, "fp8": 3500.0},
            "NVIDIA HGX B100 specifications (8 GPUs, 2024), nvidia.com/en-us/data-center/hgx/: TF32 14, "
            "BF16/FP16 28, FP8 56 PFLOPS with sparsity, FP32 480 TFLOPS per board -> /8 GPUs, /2 dense"),
    PeakRow("B200", "Blackwell", _p("B200"),
            {"fp32": 75.0, "tf32": 1125.0, "bf16": 2250.0, "fp16": 2250.0, "fp8": 4500.0},
            "NVIDIA HGX B200 specifications (8 GPUs, 2024), nvidia.com/en-us/data-center/hgx/: TF32 18, "
            "BF16/FP16 36, FP8 72 PFLOPS with sparsity, FP32 600 TFLOPS per board -> /8 GPUs, /2 dense"),
    PeakRow("GB200", "Blackwell", _p("GB200"),
            {"fp32": 90.0, "tf32": 1250.0, "bf16": 2500.0, "fp16": 2500.0, "fp8": 5000.0},
            "NVIDIA GB200 NVL72 specifications (72 GPUs, 2024), nvidia.com/en-us/data-center/gb200-nvl72/: "
            "TF32 180, BF16/FP16 360, FP8 720 PFLOPS with sparsity, FP32 6,480 TFLOPS per rack -> /72, /2 dense"),
    PeakRow("B300", "Blackwell", _p("B300"),
            {"fp32": 75.0, "tf32": 1125.0, "bf16": 2250.0, "fp16": 2250.0, "fp8": 4500.0},
            "NVIDIA HGX B300 specifications (8 Blackwell Ultra GPUs, 2025), nvidia.com/en-us/data-center/hgx/ "
            "(table as reproduced at fibermall.com/blog/?p=17161): TF32 18, BF16/FP16 36, FP8 72 PFLOPS with "
            "sparsity, FP32 600 TFLOPS per board -> /8 GPUs, /2 dense. No FP4: the dense NVFP4 figure differs "
            "between the stored copies (13.1, 13.5, 14 PFLOPS per GPU), so none is kept"),
    PeakRow("GB300", "Blackwell", _p("GB300"),
            {"tf32": 1250.0, "bf16": 2500.0, "fp16": 2500.0, "fp8": 5000.0, "fp4": 15000.0},
            "NVIDIA GB300 NVL72 specifications (72 Blackwell Ultra GPUs, 2025), nvidia.com/en-us/data-center/"
            "gb300-nvl72/ (as tabulated at vendordeep.com/report/nvidia-launches-blackwell-ultra-gb300 and "
            "verda.com/blog/gb300-nvl72-architecture): NVFP4 1,440 sparse | 1,080 PFLOPS dense, FP8 720, BF16/FP16 "
            "360, TF32 180 PFLOPS with sparsity per rack -> /72, /2 dense (FP4 dense as printed). No FP32: the "
            "stored copies disagree"),
    PeakRow("H20", "Hopper", _p("H20"), {"fp32": 44.0, "tf32": 74.0, "bf16": 148.0, "fp16": 148.0},
            "NVIDIA H20 specifications (2024; no public NVIDIA datasheet: the partner spec sheet as reported at "
            "zangshuxian.com/new/674733024499207168 and willitrunai.com/es/gpus/h20-96gb): dense BF16/FP16 148, "
            "TF32 74, FP32 44. No FP8: only INT8 296 TOPS is stated. Prefer the measured peak (llmeff peak)"),
    PeakRow("RTX-5090", "Blackwell", _p("RTX 5090"),
            {"fp32": 104.8, "tf32": 104.8, "bf16": 209.5, "fp16": 209.5, "fp8": 419.0, "fp4": 1676.0},
            "NVIDIA RTX Blackwell GPU architecture whitepaper (2025), appendix table for the GeForce RTX 5090 (as "
            "quoted in main-horse.github.io/posts/5090-mm-perf); specifications nvidia.com/en-us/geforce/"
            "graphics-cards/50-series/ (3,352 AI TOPS = sparse FP4): dense BF16/FP16 209.5 and FP8 419 with FP32 "
            "accumulate (GeForce runs FP32 accumulation at half the FP16-accumulate rate, 419/838), NVFP4 1676 "
            "(3352 sparse / 2), TF32 104.8, FP32 104.8"),
    PeakRow("MI250X", "CDNA2", _p("MI250X"), {"fp32": 95.7, "bf16": 383.0, "fp16": 383.0},
            "AMD Instinct MI250X data sheet (2021), amd.com/en/products/accelerators/instinct/mi200/mi250x.html: "
            "FP16/BF16 matrix 383, FP32 matrix 95.7 (per OAM module of 2 GCDs; no TF32 or FP8)"),
    PeakRow("MI300X", "CDNA3", _p("MI300X"),
            {"fp32": 163.4, "tf32": 653.7, "bf16": 1307.4, "fp16": 1307.4, "fp8": 2614.9},
            _AMD_MI300 + ": MI300X TF32 653.7, BF16/FP16 1307.4, FP8 2614.9, FP32 matrix 163.4"),
    PeakRow("MI325X", "CDNA3", _p("MI325X"),
            {"fp32": 163.4, "tf32": 653.7, "bf16": 1307.4, "fp16": 1307.4, "fp8": 2614.9},
            _AMD_MI300 + ": MI325X TF32 653.7, BF16/FP16 1307.4, FP8 2614.9, FP32 matrix 163.4"),
    PeakRow("MI350X", "CDNA4", _p("MI350X"), {"bf16": 2306.9, "fp16": 2306.9, "fp8": 4613.7},
            _AMD_MI350 + "MI350X at 2.2 GHz: FP8 4613.7, BF16/FP16 2306.9 (= huggingface.co/hardware/mi350x)"),
    PeakRow("MI355X", "CDNA4", _p("MI355X"), {"bf16": 2516.6, "fp16": 2516.6, "fp8": 5033.2},
            _AMD_MI350 + "MI355X at 2.4 GHz: FP8 5033.2, BF16/FP16 2516.6"),
)

#: Memory per device, GB as the same datasheets state it (HBM/GDDR capacity; the usable part torch
#: reports is 1-2% less). Only where the short name fixes the capacity: A100, V100 and GH200 come in
#: several sizes and are absent (pass the memory, or plan on the machine itself).
MEMORY_GB: dict[str, float] = {
    "V100S-PCIe": 32, "A10": 24, "A10G": 24, "A100-SXM4-40GB": 40, "A100-80GB": 80, "A100-PCIe-40GB": 40,
    "A100-PCIe-80GB": 80, "L4": 24, "L40S": 48, "H100-SXM": 80, "H100-PCIe": 80, "H100-NVL": 94, "H200": 141,
    "H200-NVL": 141, "B100": 192, "B200": 180, "GB200": 186, "MI250X": 128, "MI300X": 192, "MI325X": 256,
    # B300/GB300 288 GB HBM3e (docs.nvidia.com/nim/bionemo/boltz2 release notes 1.7.0), H20 96 GB HBM3, RTX 5090
    # 32 GB GDDR7 (50-series specifications), MI350X/MI355X 288 GB HBM3E (ROCm GPU specifications)
    "B300": 288, "GB300": 288, "H20": 96, "RTX-5090": 32, "MI350X": 288, "MI355X": 288,
}


_TOKEN_SPLIT = re.compile(r"[\s\-_/()]+")


def _tokens(name: str) -> tuple[str, ...]:
    return tuple(t for t in _TOKEN_SPLIT.split(name.upper()) if t)


def _patterns_longest_first() -> list[tuple[tuple[str, ...], PeakRow]]:
    pats = [(p, row) for row in PEAK_TABLE for p in row.patterns]
    return sorted(pats, key=lambda pr: (len(pr[0]), len(" ".join(pr[0]))), reverse=True)


_PATTERNS = _patterns_longest_first()


def match_row(name: str) -> PeakRow | None:
    """Return the table row for a driver-reported device name, or None.

    Whole tokens only, longest pattern first (see the module docstring), so ``NVIDIA H20`` is not
    an ``H200`` and ``NVIDIA L40`` is not an ``L4``.
    """
    toks = _tokens(name)
    for pat, row in _PATTERNS:
        n = len(pat)
        if any(toks[i:i + n] == pat for i in range(len(toks) - n + 1)):
            return row
    return None


def _check_dtype(dtype: str) -> None:
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not accepted; use one of {', '.join(DTYPES)}")


def lookup_peak(name: str, dtype: str) -> PeakEntry | None:
    """Dense peak TFLOP/s per device for a device name and compute dtype, or None when unknown.

    Args:
        name: device name as the driver reports it, e.g. ``NVIDIA H100 80GB HBM3``.
        dtype: one of ``bf16``, ``fp16``, ``tf32``, ``fp8``, ``fp4``, ``fp32``.

    Returns:
        The :class:`PeakEntry`, or None when no row matches or the device has no such matrix unit.

    Raises:
        ValueError: for a dtype outside :data:`DTYPES`.
    """
    _check_dtype(dtype)
    row = match_row(name)
    if row is None or dtype not in row.tflops:
        return None
    return PeakEntry(row.tflops[dtype], row.source)


@dataclass(frozen=True)
class AcceleratorInfo:
    """The accelerator a run uses, as tags record it.

    Attributes:
        name: device name as the driver reports it (``NVIDIA H200``), or the CPU model.
        short: short name (``H200``, ``H100-SXM``, ``A100-80GB``) or ``cpu``.
        count: devices taking part (world size); on CPU a device is a process.
        memory_gib: memory per device in GiB, None when unknown (CPU).
        generation: Ampere, Hopper, Blackwell, CDNA3, cpu, ...
        driver_version: accelerator driver version, None on CPU or when unreadable.
        cuda_version: CUDA (or HIP) runtime torch was built with, None on CPU builds.
        device_type: ``cuda`` or ``cpu``.
    """

    name: str
    short: str
    count: int
    memory_gib: float | None
    generation: str
    driver_version: str | None
    cuda_version: str | None
    device_type: str

    def tags(self) -> dict[str, str]:
        """The ``llmeff.accelerator.*``, ``driver.version`` and ``cuda.version`` tags as strings."""
        return {
            names.ACCEL_NAME: self.name,
            names.ACCEL_SHORT: self.short,
            names.ACCEL_COUNT: str(self.count),
            names.ACCEL_MEMORY_GIB: "unknown" if self.memory_gib is None else f"{self.memory_gib:.1f}",
            names.ACCEL_GENERATION: self.generation,
            names.DRIVER_VERSION: self.driver_version or "none",
            names.CUDA_VERSION: self.cuda_version or "none",
        }


def cpuinfo_value(keys: tuple[str, ...] = ("model name",), path: str = "/proc/cpuinfo") -> str | None:
    """The first non-empty value of a ``path`` line whose key (lower case) starts with one of ``keys`` (proc(5):
    ``model name`` on x86, ``Hardware`` / ``cpu model`` elsewhere), else None (no such line or file)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.lower().startswith(keys):
                    value = line.split(":", 1)[1].strip() if ":" in line else ""
                    if value:
                        return value
    except OSError:
        pass
    return None


def _cpu_model() -> str:
    return (cpuinfo_value(("model name", "hardware", "cpu model")) or platform.processor() or platform.machine()
            or "cpu")


# Compute capability major -> NVIDIA architecture (CUDA C Programming Guide, compute capabilities).
_CC_GENERATION = {7: "Volta", 8: "Ampere", 9: "Hopper", 10: "Blackwell", 12: "Blackwell"}


def _generation(name: str, cc: tuple[int, int] | None, arch: str | None) -> str:
    row = match_row(name)
    if row is not None:
        return row.generation
    if arch:  # ROCm gcnArchName, e.g. gfx942:sramecc+:xnack-
        gfx = arch.split(":")[0]
        return {"gfx90a": "CDNA2", "gfx940": "CDNA3", "gfx941": "CDNA3", "gfx942": "CDNA3",
                "gfx950": "CDNA4"}.get(gfx, gfx)
    if cc is not None:
        if cc == (7, 5):
            return "Turing"
        if cc == (8, 9):
            return "Ada"
        return _CC_GENERATION.get(cc[0], f"sm_{cc[0]}{cc[1]}")
    return "unknown"


def _short(name: str) -> str:
    row = match_row(name)
    if row is not None:
        return row.short
    stripped = re.sub(r"^(NVIDIA|AMD|Tesla|AMD Instinct)\s+", "", name.strip(), flags=re.I)
    stripped = re.sub(r"^Instinct\s+", "", stripped, flags=re.I)
    return re.sub(r"[^A-Za-z0-9.]+", "-", stripped).strip("-") or "unknown"


def _nvml_driver_version() -> str | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            v = pynvml.nvmlSystemGetDriverVersion()
            return v.decode() if isinstance(v, bytes) else str(v)
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - no NVML (CPU, ROCm, container without the library)
        return None


def detect_accelerator(count: int = 1, device_type: str | None = None) -> AcceleratorInfo:
    """Describe the accelerator of this process; never raises (unknown fields become None).

    Args:
        count: devices taking part (world size).
        device_type: ``cuda`` or ``cpu``; None picks ``cuda`` when torch sees a GPU.

    Returns:
        :class:`AcceleratorInfo` for device 0 of this process (``torch.cuda.current_device()``),
        or for the CPU (model name from ``/proc/cpuinfo``, else ``platform.processor()``).
    """
    from mlflow_llmeff.meters.probes import torch_built_without_gpu

    try:
        if torch_built_without_gpu():  # no GPU to ask torch about: not imported for it (llmeff plan)
            torch, cuda_ok = None, False
        else:
            import torch

            cuda_ok = torch.cuda.is_available()
    except Exception:  # noqa: BLE001
        torch, cuda_ok = None, False
    if device_type is None:
        device_type = "cuda" if cuda_ok else "cpu"
    if device_type == "cuda" and cuda_ok:
        try:
            idx = torch.cuda.current_device()
            props = torch.cuda.get_device_properties(idx)
            name = props.name
            arch = getattr(props, "gcnArchName", None) if torch.version.hip else None
            gen = _generation(name, (props.major, props.minor), arch)
            runtime = torch.version.cuda or (f"hip {torch.version.hip}" if torch.version.hip else None)
            return AcceleratorInfo(
                name=name, short=_short(name), count=count,
                memory_gib=round(props.total_memory / 2**30, 1), generation=gen,
                driver_version=_nvml_driver_version(), cuda_version=runtime, device_type="cuda")
        except Exception:  # noqa: BLE001 - fall through to a CPU description
            pass
    return AcceleratorInfo(name=_cpu_model(), short="cpu", count=count, memory_gib=None,
                           generation="cpu", driver_version=None, cuda_version=None, device_type="cpu")


def resolve_peak(info: AcceleratorInfo, dtype: str,
                 user_peak_tflops: float | None = None) -> tuple[float | None, str]:
    """The dense peak to divide by, and where it comes from (for ``llmeff.peak.source``).

    Args:
        info: the accelerator (:func:`detect_accelerator`).
        dtype: compute dtype, one of :data:`DTYPES`.
        user_peak_tflops: a peak the user passed (``peak_tflops``); it wins over the table.

    Returns:
        ``(peak TFLOP/s per device or None, source)``; source is the datasheet, ``user``, or
        ``unknown: <why>`` (then MFU is omitted).

    Raises:
        ValueError: for a dtype outside :data:`DTYPES` or a non-positive ``user_peak_tflops``.
    """
    _check_dtype(dtype)
    if user_peak_tflops is not None:
        if not user_peak_tflops > 0:
            raise ValueError(f"peak_tflops {user_peak_tflops!r} is not accepted; give TFLOP/s > 0")
        return float(user_peak_tflops), "user"
    if info.device_type == "cpu":
        return None, ("unknown: CPUs have no datasheet peak in the table; see "
                      f"{names.SUM_MFU_MEASURED_PEAK} (llmeff peak) or pass peak_tflops")
    row = match_row(info.name)
    if row is None:
        return None, (f"unknown: {info.name!r} is not in the peak table (no peak is guessed); "
                      "pass peak_tflops")
    if dtype not in row.tflops:
        return None, (f"unknown: {row.short} has no {dtype} matrix peak in its datasheet; "
                      f"it lists {', '.join(row.tflops)}")
    return row.tflops[dtype], row.source


@dataclass(frozen=True)
class Denominators:
    """MFU's denominator and the BF16 peak it is compared on (``docs/formulas.md``, "MFU and HFU").

    Attributes:
        tflops: dense peak TFLOP/s per device of ``precision`` (MFU's denominator), or None.
        source: where it comes from (as :func:`resolve_peak`: datasheet, ``user`` or ``unknown: ...``).
        precision: the dtype whose peak divides (``llmeff.peak.precision``): the compute dtype the
            matmuls ran in, e.g. ``fp8`` for an FP8 run, never silently another one.
        bf16_tflops: the device's dense BF16 peak (``summary/mfu_bf16_peak``'s denominator), or
            None where the table has none (CPU, unknown device, Volta); the user's peak when the
            run is BF16 and the user gave one.
    """

    tflops: float | None
    source: str
    precision: str
    bf16_tflops: float | None


def resolve_denominators(info: AcceleratorInfo, dtype: str, user_peak_tflops: float | None = None) -> Denominators:
    """MFU's denominator for compute dtype ``dtype`` and the BF16 peak beside it.

    An FP8 run divides by the FP8 dense peak (H100 SXM: 1978.9 TFLOP/s) and names it in
    ``llmeff.peak.precision``; ``summary/mfu_bf16_peak`` divides the same achieved TFLOP/s by the
    BF16 dense peak (989.4), so FP8 and BF16 runs compare on one scale. A user's ``peak_tflops``
    is taken as the peak of ``dtype``.

    Args:
        info: the accelerator (:func:`detect_accelerator`).
        dtype: compute dtype, one of :data:`DTYPES`.
        user_peak_tflops: the user's peak for ``dtype`` (wins over the table).

    Raises:
        ValueError: as :func:`resolve_peak`.
    """
    peak, source = resolve_peak(info, dtype, user_peak_tflops)
    if dtype == "bf16":
        bf16 = peak
    else:
        row = match_row(info.name) if info.device_type != "cpu" else None
        bf16 = row.tflops.get("bf16") if row is not None else None
    return Denominators(peak, source, dtype, bf16)


def mfu_figures(device_tflops: float, denominators: Denominators) -> dict[str, float]:
    """``{summary/mfu: ..., summary/mfu_bf16_peak: ...}`` for achieved model TFLOP/s per device.

    Each figure is present only where its peak is known (an undefined figure is absent, never 0).

    Raises:
        ValueError: for a negative ``device_tflops``.
    """
    if not device_tflops >= 0:
        raise ValueError(f"device_tflops={device_tflops!r} must be >= 0 TFLOP/s")
    out = {}
    if denominators.tflops is not None:
        out[names.SUM_MFU] = device_tflops / denominators.tflops
    if denominators.bf16_tflops is not None:
        out[names.SUM_MFU_BF16_PEAK] = device_tflops / denominators.bf16_tflops
    return out


# --------------------------------------------------------------------------- measured peak (MAMF)
def default_cache_dir() -> Path:
    """``$LLMEFF_CACHE_DIR`` or ``~/.cache/mlflow_llmeff``."""
    env = os.environ.get("LLMEFF_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "mlflow_llmeff"


_CPU_SIZES = (128, 256, 512, 1024)
#: ``(m, k, n)`` products timed on a CPU beside the squares: a transformer's thin matmuls (a head's 64
#: columns, a small model's widths). On this 2-core EPYC in bf16 the squares of 256-1024 ran at 0.9-1.4
#: GFLOP/s and ``(1024 x 64) @ (64 x 172)`` at 2.3-2.9 GFLOP/s: a peak timed on squares alone put a
#: fresh user's bf16 run at 148% "MFU" (trial, 2026-12-07). As in Stas Bekman's mamf-finder, the peak is
#: the best over shapes, never one shape.
_CPU_SHAPES = ((1024, 64, 1024), (1024, 1024, 64), (4096, 64, 256), (4096, 256, 64), (1024, 64, 172))
_GPU_SIZES = (4096, 8192, 12288)


def _cache_key(device: str, dtype: str) -> str:
    import torch

    if device.startswith("cuda"):
        idx = torch.device(device).index or 0
        ident = torch.cuda.get_device_name(idx)
    else:
        ident = f"{_cpu_model()} threads={torch.get_num_threads()}"
    return f"{device.split(':')[0]}|{ident}|{dtype}|torch {torch.__version__}"


def _time_matmul(n: int | tuple[int, int, int], dtype: str, device: str, min_time_s: float) -> float:
    """Best TFLOP/s of an ``(n x n) @ (n x n)`` matmul (or ``(m x k) @ (k x n)`` for ``n = (m, k, n)``: ``2mkn``
    FLOPs) over repeats filling ``min_time_s``."""
    import torch

    m, k, n = (n, n, n) if isinstance(n, int) else n
    tdt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32,
           "tf32": torch.float32, "fp8": torch.float8_e4m3fn}[dtype]
    is_cuda = device.startswith("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    make = torch.float32 if dtype == "fp8" else tdt
    a = torch.randn(m, k, device=device, dtype=make, generator=gen)
    b = torch.randn(k, n, device=device, dtype=make, generator=gen)
    if dtype == "fp8":
        a = a.to(tdt)
        b = b.to(tdt).t().contiguous().t()  # column-major second operand, as _scaled_mm needs
        one = torch.ones((), device=device)
        def op():  # noqa: E306
            return torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    else:
        def op():  # noqa: E306
            return a @ b
    sync = torch.cuda.synchronize if is_cuda else (lambda: None)
    op()
    sync()  # warm-up: kernel selection, allocator
    best = float("inf")
    spent = 0.0
    reps = 0
    while spent < min_time_s or reps < 3:
        t0 = time.perf_counter()
        op()
        sync()
        dt = time.perf_counter() - t0
        best = min(best, dt)
        spent += dt
        reps += 1
    return 2.0 * m * k * n / best / 1e12


@dataclass(frozen=True)
class PeakMeasurement:
    """A measured achievable matmul peak (:func:`matmul_peak`) and what it was measured on.

    Attributes:
        tflops: TFLOP/s per device.
        measured_at: local time of the measurement, ISO 8601 (None for a cache entry without one).
        key: what it was measured on: the device, the CPU's threads (a CPU figure moves with
            ``OMP_NUM_THREADS``: 0.10 TFLOP/s on 1 thread against 0.034 on 2 on a shared 2-core
            machine), the dtype and torch.
        from_cache: read from ``mamf.json`` rather than measured by this call.
    """

    tflops: float
    measured_at: str | None
    key: str
    from_cache: bool


def measure_matmul_peak(dtype: str = "fp32", device: str = "cpu", *, cache_dir: str | Path | None = None,
                        refresh: bool = False, sizes: Sequence[int] | None = None,
                        min_time_s: float = 0.2) -> float:
    """:func:`matmul_peak`'s TFLOP/s alone (same arguments, same errors)."""
    return matmul_peak(dtype, device, cache_dir=cache_dir, refresh=refresh, sizes=sizes, min_time_s=min_time_s).tflops


def matmul_peak(dtype: str = "fp32", device: str = "cpu", *, cache_dir: str | Path | None = None,
                refresh: bool = False, sizes: Sequence[int] | None = None,
                min_time_s: float = 0.2) -> PeakMeasurement:
    """Measured achievable matmul TFLOP/s (MAMF) for a dtype on a device, cached per device.

    Times square matmuls of each size in ``sizes`` (``2*n^3`` FLOPs each, device synchronized
    around every call), on a CPU also the thin products of :data:`_CPU_SHAPES` (``2mkn`` FLOPs), and keeps
    the best rate: what this device really sustains on dense GEMMs, the denominator of
    ``summary/mfu_measured_peak``. A sweep over many shapes (as in Stas Bekman's mamf-finder) would find a
    few percent more; a handful keep it to seconds. A cached figure timed on squares alone (written before
    the thin shapes: no ``shapes`` entry) is measured again.

    Args:
        dtype: ``fp32``, ``tf32`` (CUDA only; TF32 matmuls switched on for the measurement),
            ``bf16``, ``fp16`` or ``fp8`` (CUDA with ``torch._scaled_mm`` only).
        device: ``cpu``, ``cuda`` or ``cuda:<index>``.
        cache_dir: folder of ``mamf.json``; default :func:`default_cache_dir`.
        refresh: measure again even when a cached value exists.
        sizes: matrix sizes ``n`` to try; default 128/256/512/1024 on CPU (and :data:`_CPU_SHAPES`),
            4096/8192/12288 on CUDA. Given: only these squares.
        min_time_s: time spent repeating each size (seconds; the best repeat counts).

    Returns:
        A :class:`PeakMeasurement`: TFLOP/s (1e12 FLOP/s) per device, when and on what it was measured,
        and whether it came from the cache.

    Raises:
        ValueError: for a dtype outside :data:`DTYPES`, ``fp4`` (never measured), ``tf32``/``fp8`` on CPU, or a CUDA device
            when torch sees none.
    """
    import torch

    _check_dtype(dtype)
    if device.startswith("cpu:"):  # torch names a DDP rank's CPU device "cpu:<rank>"; one CPU either way
        device = "cpu"
    is_cuda = device.startswith("cuda")
    if not is_cuda and device != "cpu":
        raise ValueError(f"device {device!r} is not accepted; use 'cpu', 'cuda' or 'cuda:<index>'")
    if is_cuda and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} was asked for but torch sees no CUDA device")
    if dtype == "fp4":
        raise ValueError("dtype 'fp4' cannot be measured (no portable torch FP4 matmul); pass peak_tflops")
    if not is_cuda and dtype in ("tf32", "fp8"):
        raise ValueError(f"dtype {dtype!r} cannot be measured on cpu; use fp32, bf16 or fp16")

    path = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    file = path / "mamf.json"
    key = _cache_key(device, dtype)
    cache: dict = {}
    if file.is_file():
        try:
            cache = json.loads(file.read_text())
        except (OSError, ValueError):
            cache = {}
    shapes = () if sizes or is_cuda else _CPU_SHAPES
    sizes = tuple(sizes) if sizes else (_GPU_SIZES if is_cuda else _CPU_SIZES)
    got = cache.get(key)
    # an entry without "shapes" was timed on squares alone (before the thin shapes): measured again
    if not refresh and isinstance(got, dict) and "tflops" in got and "shapes" in got:
        return PeakMeasurement(float(got["tflops"]), got.get("measured_at"), key, True)

    prev_tf32 = torch.backends.cuda.matmul.allow_tf32 if is_cuda else None
    try:
        if is_cuda:
            torch.backends.cuda.matmul.allow_tf32 = dtype == "tf32"
        with torch.no_grad():
            best = max(_time_matmul(n, dtype, device, min_time_s) for n in sizes + shapes)
    finally:
        if is_cuda:
            torch.backends.cuda.matmul.allow_tf32 = prev_tf32

    stamp = time.strftime("%Y-%m-%dT%H:%M:%S")
    cache[key] = {"tflops": best, "sizes": list(sizes), "shapes": [list(x) for x in shapes], "measured_at": stamp}
    try:
        path.mkdir(parents=True, exist_ok=True)
        tmp = file.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(cache, indent=1, sort_keys=True))
        tmp.replace(file)
    except OSError:
        pass  # an unwritable cache only costs a re-measurement next time
    return PeakMeasurement(best, stamp, key, False)
