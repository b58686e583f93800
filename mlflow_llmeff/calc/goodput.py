"""The explicit clock: what every second of a training run was spent on, and goodput from it.

A :class:`TimeLedger` is always in exactly one state, and every interval between two clock reads
is credited to the state it was in, so the parts of the wall time add up to the wall time by
construction (up to float rounding), across restarts too. The states:

* ``init``: from the start of the attempt (process start for ``llmeff train``, monitor creation
  for a user's loop) until the first step begins (:meth:`TimeLedger.begin`);
* ``step``: inside optimizer steps. Each :meth:`TimeLedger.step_done` closes a step and returns its
  seconds; the caller says whether it was a warm-up step. Throughput windows, step time, tokens/s
  and MFU use these seconds only;
* a declared pause (:meth:`TimeLedger.pause`): ``eval``, ``checkpoint_save``, ``checkpoint_load``,
  ``init`` (set-up after the clock started), ``other``. Pauses stop the step clock: an eval
  between two steps never lands in either step;
* ``data_wait``: host time blocked on the next batch, declared like a pause but *inside* the step:
  it stays in the step's seconds (so throughput is wall-clock throughput, as torchtitan and
  Lightning report it, and on an asynchronous device waiting for data can overlap device work, so
  taking it out would overstate tokens/s), and the breakdown carves it out of productive time;
* ``other``: time after the last completed step (a step never closed), and pauses of an unknown
  kind.

Breakdown (:func:`breakdown`): ``productive`` = step seconds - data wait - the warm-up's excess,
where the warm-up excess (``warmup``, or ``compile`` when the model is compiled) is how much longer
the warm-up steps took than the same number of steady-state steps (Google's ML Goodput "program
startup" overhead, measured per attempt: first-step compilation, allocator and kernel warm-up, the
FlopCounterMode step); ``lost_progress`` is the time a crashed attempt ran after its last checkpoint
(its work is redone). ``wall`` = productive + every badput category, exactly. Goodput =
productive / wall. The clock is injected; no I/O, no torch.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable

__all__ = ["PAUSES", "TimeLedger", "breakdown", "goodput"]

#: Categories a caller may declare with :meth:`TimeLedger.pause`.
PAUSES = ("eval", "checkpoint_save", "checkpoint_load", "data_wait", "init", "other")
#: Ledger keys: seconds credited directly (pauses, init, lost progress) and step seconds by phase.
_KEYS = ("init", "op_build", "eval", "checkpoint_save", "checkpoint_load", "lost_progress", "other",
         "warmup_step", "steady_step", "warmup_data_wait", "steady_data_wait")


@dataclass
class TimeLedger:
    """Seconds per state over one or more attempts of a run.

    Args:
        clock: monotonic seconds (tests inject a fake clock).
        started_at: clock value at which this attempt started (default: now); the time up to
            :meth:`begin` is ``init``.

    Attributes:
        seconds: seconds per ledger key, all attempts (see module docstring).
        warmup_steps: warm-up steps closed, all attempts; ``steady_steps`` likewise.
    """

    clock: Callable[[], float] = time.perf_counter
    started_at: float | None = None
    seconds: dict[str, float] = field(default_factory=lambda: {k: 0.0 for k in _KEYS})
    warmup_steps: int = 0
    steady_steps: int = 0
    _state: str = "init"
    _mark: float = 0.0
    _open_step_s: float = 0.0  # seconds of the step in progress (data wait included)
    _open_wait_s: float = 0.0  # data wait inside the step in progress
    _depth: int = 0  # nested pauses: the outermost one holds the time
    _outer: str = "init"  # state to return to when the outermost pause ends
    _closed: bool = False

    def __post_init__(self) -> None:
        self._mark = self.clock() if self.started_at is None else float(self.started_at)

    # ------------------------------------------------------------------------------ transitions
    def _credit(self) -> float:
        """Credit the time since the last read to the current state; returns now."""
        now = self.clock()
        if self._closed:
            return now
        dt = now - self._mark
        self._mark = now
        if self._state == "step":
            self._open_step_s += dt
        elif self._state == "data_wait":
            self._open_step_s += dt
            self._open_wait_s += dt
        else:
            self.seconds[self._state] += dt
        return now

    def start_earlier(self, started_at: float) -> None:
        """Move the attempt's start back to ``started_at`` (clock seconds) while still in ``init``."""
        if self._state == "init" and self._depth == 0 and started_at < self._mark:
            self._mark = float(started_at)

    def begin(self) -> None:
        """End ``init``: the first step starts now."""
        if self._state == "init":
            self._credit()
            self._state = "step"

    def enter(self, category: str) -> None:
        """Start a pause of ``category`` (one of :data:`PAUSES`); nested pauses stay in the outer one.

        ``data_wait`` before the first step starts that step (the first batch is awaited inside it).

        Raises:
            ValueError: for a category outside :data:`PAUSES`.
        """
        if category == "data_wait" and self._state == "step" and not self._depth and not self._closed:
            # the wait for a batch, declared at every step: credited here in one frame (no _credit call)
            now = self.clock()
            self._open_step_s += now - self._mark
            self._mark = now
            self._depth, self._outer, self._state = 1, "step", "data_wait"
            return
        if category not in PAUSES:
            raise ValueError(f"pause category {category!r} is not accepted; use one of: {', '.join(PAUSES)}")
        self._depth += 1
        if self._depth > 1:
            return
        self._credit()
        self._outer = "step" if (category == "data_wait" and self._state == "init") else self._state
        self._state = category

    def exit(self) -> None:
        """End the innermost pause (the time since the outermost one began goes to it)."""
        if self._depth == 1 and self._state == "data_wait" and not self._closed:  # a step's wait for its batch
            now = self.clock()
            dt = now - self._mark
            self._mark = now
            self._open_step_s += dt
            self._open_wait_s += dt
            self._depth, self._state = 0, self._outer
            return
        if self._depth == 0:
            return
        self._depth -= 1
        if self._depth:
            return
        self._credit()
        self._state = self._outer

    @contextmanager
    def pause(self, category: str):
        """``with ledger.pause("eval"): ...``: the block's time goes to ``category``."""
        self.enter(category)
        try:
            yield
        finally:
            self.exit()

    def step_done(self, warmup: bool) -> float:
        """Close the step in progress; returns its seconds (declared pauses excluded, data wait included).

        Called inside a pause (a step that ends during an eval), the step closes with the time it
        had when the pause began. Without :meth:`begin`, the time since the ledger started is the
        first step's.

        Args:
            warmup: True when the step is one of this attempt's warm-up steps.
        """
        if self._closed:
            return 0.0
        if self._state == "step" and not self._depth:  # the common case, credited here in one frame
            now = self.clock()
            step_s = self._open_step_s + (now - self._mark)
            self._mark = now
        else:
            if self._state == "init":
                self._state = "step"
            if self._depth == 0:
                self._credit()
            step_s = self._open_step_s
        wait_s, seconds = self._open_wait_s, self.seconds
        if warmup:
            seconds["warmup_step"] += step_s
            seconds["warmup_data_wait"] += wait_s
            self.warmup_steps += 1
        else:
            seconds["steady_step"] += step_s
            seconds["steady_data_wait"] += wait_s
            self.steady_steps += 1
        self._open_step_s = self._open_wait_s = 0.0
        return step_s

    def carve(self, category: str, seconds: float) -> float:
        """Name ``seconds`` of this attempt's ``init`` so far as ``category`` (``op_build``: a
        strategy's C++ ops compiled before the meter existed, e.g. DeepSpeed's JIT build).

        Capped at the ``init`` seconds up to now (it cannot name more than has passed); returns the
        seconds moved.

        Raises:
            ValueError: for a category other than ``op_build``, a negative ``seconds``, or once a step has closed.
        """
        if category != "op_build":
            raise ValueError(f"category {category!r} is not accepted; use op_build")
        if seconds < 0:
            raise ValueError(f"seconds={seconds!r} is negative")
        if self.warmup_steps or self.steady_steps:
            raise ValueError("carve() names set-up time: call it before the first step closes")
        if self._state == "init":
            self._credit()
        moved = min(float(seconds), self.seconds["init"])
        self.seconds["init"] -= moved
        self.seconds["op_build"] += moved
        return moved

    def add(self, category: str, seconds: float) -> None:
        """Credit ``seconds`` that passed outside this attempt's clock (``lost_progress``)."""
        if category not in self.seconds or category.endswith("_step"):
            raise ValueError(f"category {category!r} is not accepted; use lost_progress")
        self.seconds[category] += float(seconds)

    # ------------------------------------------------------------------------------ readings
    @property
    def paused(self) -> bool:
        """True inside a declared pause other than ``data_wait`` (which stays inside its step)."""
        return self._depth > 0 and self._state != "data_wait"

    def close(self) -> dict[str, float]:
        """Credit the time up to now and stop the clock; returns the final seconds.

        A step left open (never closed) becomes ``other``. Idempotent.
        """
        if not self._closed:
            self._credit()
            self.seconds["other"] += self._open_step_s  # a step (or a wait for a batch) no step closed
            self._open_step_s = self._open_wait_s = 0.0
            self._closed = True
        return dict(self.seconds)

    def snapshot(self) -> dict[str, float]:
        """The ledger's seconds up to now (the open step counted as ``other``), without changing it."""
        out = dict(self.seconds)
        if self._closed:
            return out
        pending = self.clock() - self._mark
        if self._state in ("step", "data_wait"):
            out["other"] += self._open_step_s + pending
        else:
            out[self._state] += pending
            out["other"] += self._open_step_s
        return out

    def wall_s(self) -> float:
        """Wall seconds of all attempts up to now (the sum of every part)."""
        return wall_of(self.snapshot())

    def train_s(self) -> float:
        """Seconds inside closed steps, all attempts (eval and checkpoint time excluded)."""
        return self.seconds["warmup_step"] + self.seconds["steady_step"]

    # ------------------------------------------------------------------------------ restarts
    def state_dict(self) -> dict:
        """Seconds up to now, for a checkpoint (the open step counts as ``other``)."""
        return {"seconds": self.snapshot(), "warmup_steps": self.warmup_steps, "steady_steps": self.steady_steps}

    def load_state_dict(self, state: dict) -> None:
        """Carry the seconds of earlier attempts into this one."""
        for k, v in state["seconds"].items():
            if k in self.seconds:
                self.seconds[k] += float(v)
        self.warmup_steps += int(state.get("warmup_steps", 0))
        self.steady_steps += int(state.get("steady_steps", 0))


def breakdown(seconds: dict[str, float], warmup_steps: int, steady_steps: int, *,
              compiled: bool = False) -> dict[str, float]:
    """Split a ledger's seconds into productive time and the badput categories.

    Args:
        seconds: :meth:`TimeLedger.snapshot` (all attempts).
        warmup_steps: warm-up steps in it; ``steady_steps``: steady-state steps.
        compiled: the model is compiled: the warm-up excess is named ``compile``, else ``warmup``.
            Seconds of op builds (``op_build``, :meth:`TimeLedger.carve`) are ``compile`` too.

    Returns:
        ``{"productive", "wall", "init", "warmup" | "compile", "data_wait", "eval",
        "checkpoint_save", "checkpoint_load", "lost_progress", "other"}`` in seconds, where
        ``productive`` plus every other entry but ``wall`` equals ``wall``.

    The warm-up excess is ``max(0, warm - warmup_steps * steady / steady_steps)`` over the step
    seconds net of data wait, capped at ``warm``; when no steady step ran it is all of ``warm``, an
    upper bound (nothing to measure it against): the monitor then logs neither it nor goodput
    (``docs/time.md``).
    """
    s = seconds
    warm = max(0.0, s["warmup_step"] - s["warmup_data_wait"])
    steady = max(0.0, s["steady_step"] - s["steady_data_wait"])
    if steady_steps > 0:
        excess = min(warm, max(0.0, warm - warmup_steps * steady / steady_steps))
    else:
        excess = warm
    out = {c: s[c] for c in ("init", "eval", "checkpoint_save", "checkpoint_load", "lost_progress", "other")}
    out["compile" if compiled else "warmup"] = excess
    if s.get("op_build", 0.0) > 0:  # an op build (DeepSpeed's JIT) is compilation too, compiled model or not
        out["compile"] = out.get("compile", 0.0) + s["op_build"]
    out["data_wait"] = s["warmup_data_wait"] + s["steady_data_wait"]
    out["productive"] = (warm - excess) + steady
    out["wall"] = wall_of(s)
    return out


def wall_of(seconds: dict[str, float]) -> float:
    """Wall seconds of a ledger's seconds: every key once (data wait lies inside the step keys)."""
    return sum(v for k, v in seconds.items() if not k.endswith("_data_wait"))


def goodput(parts: dict[str, float]) -> float | None:
    """``productive / wall`` of :func:`breakdown`, a fraction in [0, 1].

    Returns:
        None for zero wall time: a share of no time is undefined, not 0 (``docs/formulas.md``).
    """
    return parts["productive"] / parts["wall"] if parts["wall"] > 0 else None
