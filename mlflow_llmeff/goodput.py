"""Goodput: wall time split into productive training and named overhead ("badput") categories.

Categories follow ``../shared/METRICS.md``: init, compile, data_wait, eval, checkpoint_save,
checkpoint_load, lost_progress, other. Measured directly: init, data_wait, eval, checkpoint_save,
checkpoint_load, lost_progress (the time a crashed attempt ran after its last checkpoint, from the
checkpoint's save time to the attempt's last logged metric; metrics reach the server at least
every few seconds, so the last seconds before a crash can go unseen). Derived: ``compile`` is the
excess of the warm-up steps over steady-state speed, ``max(0, warmup_s - warmup_steps *
steady_step_s)`` (first-step compilation and allocator warm-up, the definition of Google's
ML Goodput "program startup" overhead applied per attempt); ``other`` is the remainder. Goodput is
``productive_s / wall_s`` (a fraction in [0, 1]). The clock is injected; no I/O here.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable

from .names import BADPUT_CATEGORIES

MEASURED = ("init", "data_wait", "eval", "checkpoint_save", "checkpoint_load", "lost_progress")


@dataclass
class TimeAccount:
    """Accumulates seconds per category over one or more attempts.

    Args:
        clock: monotonic seconds, injected for tests.
    """

    clock: Callable[[], float] = time.perf_counter
    seconds: dict[str, float] = field(default_factory=lambda: {c: 0.0 for c in MEASURED})
    previous_wall_s: float = 0.0  # wall time of earlier attempts (resume)
    _t0: float | None = None

    def start(self) -> None:
        """Mark the start of this attempt's wall time."""
        self._t0 = self.clock()

    def add(self, category: str, seconds: float) -> None:
        """Add ``seconds`` to a measured category.

        Raises:
            ValueError: for a category that is not measured directly.
        """
        if category not in self.seconds:
            raise ValueError(f"category {category!r} is not accepted; use one of: {', '.join(MEASURED)}")
        self.seconds[category] += seconds

    @contextmanager
    def measure(self, category: str):
        """Context manager adding its duration to ``category``."""
        t = self.clock()
        try:
            yield
        finally:
            self.add(category, self.clock() - t)

    def wall_s(self) -> float:
        """Wall seconds of all attempts up to now."""
        if self._t0 is None:
            raise RuntimeError("TimeAccount.start() was not called")
        return self.previous_wall_s + self.clock() - self._t0

    def breakdown(self, *, step_s: float, warmup_s: float, warmup_steps: int, steady_step_s: float | None,
                  data_wait_in_steps_s: float | None = None) -> dict[str, float]:
        """Split wall time into productive seconds and every badput category.

        Args:
            step_s: total wall seconds inside optimizer steps (warm-up and steady, all attempts).
            warmup_s: seconds of warm-up steps (all attempts); ``warmup_steps``: their number.
            steady_step_s: steady-state seconds per step (None when never reached).
            data_wait_in_steps_s: the part of ``data_wait`` that lies inside ``step_s`` (defaults to
                all of it).

        Returns:
            ``{"productive": s, "wall": s, "<category>": s for each badput category}``, where the
            categories and productive add up to wall.
        """
        wall = self.wall_s()
        s = dict(self.seconds)
        compile_s = max(0.0, warmup_s - warmup_steps * steady_step_s) if steady_step_s is not None else warmup_s
        compile_s = min(compile_s, step_s)
        dw = s["data_wait"] if data_wait_in_steps_s is None else data_wait_in_steps_s
        productive = max(0.0, step_s - compile_s - dw)
        out = {c: 0.0 for c in BADPUT_CATEGORIES}
        out.update({k: v for k, v in s.items()})
        out["compile"] = compile_s
        named = sum(out[c] for c in BADPUT_CATEGORIES if c != "other")
        out["other"] = max(0.0, wall - productive - named)
        out["productive"] = productive
        out["wall"] = wall
        return out

    def state_dict(self) -> dict:
        return {"seconds": dict(self.seconds), "wall_s": self.wall_s()}

    def load_state_dict(self, state: dict) -> None:
        self.seconds.update(state["seconds"])
        self.previous_wall_s = float(state["wall_s"])


def goodput(breakdown: dict[str, float]) -> float:
    """``productive / wall`` from :meth:`TimeAccount.breakdown` (0.0 for zero wall time)."""
    return breakdown["productive"] / breakdown["wall"] if breakdown["wall"] > 0 else 0.0
