"""A monitor's memory component: where every byte of a device goes, its peak and capacity, the
optimizer's provenance, and torch's memory snapshot on a CUDA out-of-memory failure (docs/metrics.md)."""

from __future__ import annotations

__all__ = ["MemoryWatch"]


class MemoryWatch:
    """What a monitor knows of its memory from its start to its end.

    Args:
        device: the torch device the model lives on (None: not known yet, read as CPU).
        origin: where the optimizer came from (``llmeff.optimizer``); None: ``the user's loop``.
    """

    def __init__(self, device=None, *, origin: str | None = None) -> None:
        self.device = device
        self.origin = origin
