"""Per-step timing for the stability figures: the steady steps' seconds and tokens, the device-side
clock of each step on CUDA, and each rank's forward time for the straggler ratio.

* :class:`StepTimes` keeps one ``(seconds, tokens)`` pair per steady-state optimizer step, all
  attempts (it travels in checkpoints compactly), and hands them to
  :func:`mlflow_llmeff.calc.stability.analyse`. Tokens are summed over ranks at window edges only (the
  meter synchronizes nowhere else), so a window's tokens are spread evenly over its steps: exact
  for packed sequences, and the window totals stay exact in any case.
* :class:`DeviceStepClock` times each step on the device with CUDA events recorded at step
  boundaries (and restarted after a declared pause), read after the window edge's synchronization:
  the host's per-step times of an asynchronous device are when the host queued work, not when the
  device did it. The events of a window are scaled to the window's synchronized wall seconds, so
  they split that total, never change it.
* :class:`ForwardTimer` times the model's forward passes inside steady steps (CUDA events on a
  CUDA model, the host clock otherwise). Under DDP the forward holds no gradient collective, so a
  rank's mean forward time is its compute speed before the collective waits; under FSDP and tensor
  parallelism the forward holds parameter all-gathers too (docs/stability.md).

Event classes and clocks are injected (tests use fakes); torch is imported only for real CUDA events.
"""

from __future__ import annotations

import base64
from array import array
from typing import Any, Callable, Sequence

__all__ = ["StepTimes", "DeviceStepClock", "ForwardTimer", "cuda_event_factory"]


def cuda_event_factory() -> Callable[[], Any]:
    """A factory of recorded CUDA timing events (``torch.cuda.Event(enable_timing=True)`` then ``record()``)."""
    import torch

    def make():
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    return make


def _pack(a: array) -> str:
    return base64.b64encode(array("f", a).tobytes()).decode("ascii")


def _unpack(text: str) -> array:
    f = array("f")
    f.frombytes(base64.b64decode(text.encode("ascii")))
    return array("d", f)


class StepTimes:
    """Seconds and tokens of every steady-state step, in step order, all attempts."""

    def __init__(self) -> None:
        self.seconds = array("d")
        self.tokens = array("d")

    def __len__(self) -> int:
        return len(self.seconds)

    def add_window(self, seconds: Sequence[float], tokens: float) -> None:
        """Add a window's steps: their seconds ``(n,)`` and the window's global tokens (spread evenly)."""
        if not seconds:
            return
        each = float(tokens) / len(seconds)
        self.seconds.extend(float(s) for s in seconds)
        self.tokens.extend([each] * len(seconds))

    def analyse(self):
        """:class:`mlflow_llmeff.calc.stability.Stability` of the steps (None without a step)."""
        from mlflow_llmeff.calc.stability import analyse

        return analyse(self.seconds, self.tokens)

    def state_dict(self) -> dict[str, Any]:
        """The steps as float32 base64 (8 bytes a step), JSON-safe, for a checkpoint."""
        return {"seconds": _pack(self.seconds), "tokens": _pack(self.tokens)}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Continue the steps of a checkpoint (no-op for an older checkpoint without them)."""
        if state:
            self.seconds, self.tokens = _unpack(state["seconds"]), _unpack(state["tokens"])


class DeviceStepClock:
    """Device-side seconds of each step from timing events.

    :meth:`restart` marks where the next step starts (the loop's first step, the end of a declared
    pause); :meth:`step_end` records the end of a step (which also starts the next). After the
    device is synchronized, :meth:`take` returns the pending steps' seconds.

    Args:
        event: makes and records a timing event with ``elapsed_time(other)`` in milliseconds
            (:func:`cuda_event_factory`).
    """

    def __init__(self, event: Callable[[], Any]) -> None:
        self._event = event
        self._start: Any = None
        self._pending: list[tuple[Any, Any]] = []

    def restart(self) -> None:
        self._start = self._event()

    def step_end(self) -> None:
        end = self._event()
        self._pending.append((self._start, end))
        self._start = end

    def take(self, window_s: float | None = None) -> list[float] | None:
        """Seconds of each step since the last call, scaled to sum to ``window_s``; None when a step had no start.

        Call after the device is synchronized (the events are complete).
        """
        pending, self._pending = self._pending, []
        if not pending or any(s is None for s, _ in pending):
            return None
        secs = [max(0.0, s.elapsed_time(e) / 1000.0) for s, e in pending]  # ms -> s at the boundary
        total = sum(secs)
        if window_s is not None and total > 0:
            secs = [x * window_s / total for x in secs]
        return secs


class ForwardTimer:
    """Seconds the model spent in forward passes while ``active()`` (steady steps, outside pauses).

    Args:
        module: the model whose ``forward`` is timed (the inner module, not a DDP wrapper, whose
            own forward may broadcast buffers).
        active: True while a forward should count.
        clock: host seconds (used without ``event``).
        event: timing-event factory (:func:`cuda_event_factory`) for a model on a CUDA device.
    """

    def __init__(self, module, active: Callable[[], bool], clock: Callable[[], float],
                 event: Callable[[], Any] | None = None) -> None:
        self._active, self._clock, self._event = active, clock, event
        self._start: Any = None
        self._seconds = 0.0
        self._events: list[tuple[Any, Any]] = []
        self._handles = [module.register_forward_pre_hook(self._pre), module.register_forward_hook(self._post)]

    def _pre(self, module, args) -> None:
        try:
            self._start = (self._event() if self._event else self._clock()) if self._active() else None
        except Exception:  # noqa: BLE001 - a timer never reaches the user's forward: it stops timing
            self._start, self._active = None, lambda: False

    def _post(self, module, args, output) -> None:
        if self._start is None:
            return
        try:
            if self._event:
                self._events.append((self._start, self._event()))
            else:
                self._seconds += self._clock() - self._start
        except Exception:  # noqa: BLE001
            self._active = lambda: False
        self._start = None

    def take(self) -> float:
        """Forward seconds since the last call (after a device synchronization on CUDA)."""
        secs = self._seconds + sum(s.elapsed_time(e) / 1000.0 for s, e in self._events)
        self._seconds, self._events = 0.0, []
        return secs

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
