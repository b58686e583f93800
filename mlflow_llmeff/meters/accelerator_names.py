"""Accelerator names as users type them (``llmeff plan --accelerator``): the peak table's short name for a
short name in any case, a family name, a family name with a memory size, or a driver-reported name.

The peak and memory tables and the driver-name matching are :mod:`mlflow_llmeff.meters.hardware`'s; this
module only reads them.
"""

from __future__ import annotations

import re

from mlflow_llmeff.meters.hardware import MEMORY_GB, PEAK_TABLE, PeakRow, match_row

__all__ = ["FAMILY_DEFAULT", "resolve_short"]


#: A bare family name stands for its flagship (SXM) part: what ``nvidia-smi`` calls e.g. an "H100"
#: in an 8-GPU HGX board. The resolution says which part it took.
FAMILY_DEFAULT = {"H100": "H100-SXM", "A100": "A100", "V100": "V100-SXM2", "H200": "H200"}


def resolve_short(text: str) -> tuple[str, str | None]:
    """The table's short name for an accelerator a user typed, and a note when it was an alias.

    Accepted, case-insensitive: every short name of :data:`PEAK_TABLE` and ``cpu`` (``h100-sxm``),
    a family name (``H100`` -> ``H100-SXM``, :data:`FAMILY_DEFAULT`), or a driver-reported device
    name that :func:`match_row` knows (``NVIDIA H100 80GB HBM3``).

    Returns:
        ``(short name, note)``; note is None for a short name (any case), else says what was taken.

    Raises:
        ValueError: for a name none of these knows (the message lists the short names).
    """
    want = (text or "").strip()
    shorts = {row.short.upper(): row.short for row in PEAK_TABLE}
    shorts["CPU"] = "cpu"
    if want.upper() in shorts:
        return shorts[want.upper()], None
    if want.upper() in FAMILY_DEFAULT:
        short = FAMILY_DEFAULT[want.upper()]
        parts = sorted(r.short for r in PEAK_TABLE if r.short.upper().startswith(want.upper() + "-"))
        return short, f"{want!r} taken as {short}" + (f" (also: {', '.join(p for p in parts if p != short)})"
                                                     if len(parts) > 1 else "")
    row = match_row(want)
    sized = _sized_part(want, row)
    if sized is not None:
        return sized
    if row is not None:
        return row.short, f"{want!r} is {row.short}"
    raise ValueError(f"accelerator {text!r} is not known; use one of: {', '.join(sorted(shorts.values(), key=str.lower))}")


def _sized_part(text: str, row: PeakRow | None) -> tuple[str, str] | None:
    """The part of ``row``'s family whose memory (:data:`MEMORY_GB`) is the size ``text`` names, where
    ``row`` stands for several sizes (``A100-40GB`` -> ``A100-SXM4-40GB``, not the size-less ``A100``),
    with a note naming the other parts of that size; None when ``text`` names no size or ``row`` fixes
    its own memory.

    Raises:
        ValueError: ``text`` names a size no part of the family has (the message lists the parts).
    """
    size = re.search(r"(\d+)\s*GB?\b", text.upper())
    if row is None or size is None or row.short in MEMORY_GB:
        return None
    family = [r.short for r in PEAK_TABLE if r.short != row.short and r.short.upper().startswith(row.short.upper())
              and r.short in MEMORY_GB]
    fit = [short for short in family if MEMORY_GB[short] == float(size.group(1))]
    if not fit:
        raise ValueError(f"accelerator {text!r}: no {row.short} part has {size.group(1)} GB; use one of: "
                         f"{', '.join(f'{s} ({MEMORY_GB[s]:g} GB)' for s in family)}")
    peaks = {r.short: r.tflops for r in PEAK_TABLE}
    same = "the same peaks and memory" if all(peaks[o] == peaks[fit[0]] for o in fit[1:]) else "the same memory"
    others = f" (also {', '.join(fit[1:])}: {same})" if len(fit) > 1 else ""
    return fit[0], f"{text!r} taken as {fit[0]}{others}"
