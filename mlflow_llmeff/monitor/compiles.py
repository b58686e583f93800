"""torch.compile inside steps: each compilation's time booked as ``compile`` badput, and those after the warm-up counted.

A recompilation after the warm-up (a new sequence length, a guard that failed) stops the step for
as long as dynamo and the backend take. Left in the step, it reads as a stall and moves the figures
that decide ``stable``; it is compilation, so it is compile time (docs/time.md, "Compilation
inside steps"). :class:`CompileWatch` listens to torch's compile callbacks
(``torch._dynamo.callback_handler``: ``register_start_callback`` /
``register_end_callback``, run around every dynamo compilation of a frame, an AOTAutograd backward
compiled lazily at its first run, and a CUDA graph's recording; torch 2.13 has no public
``torch.compiler`` call for them) and, while a step is in progress and no pause is declared, holds
the ledger in a pause for the compilation's span and then names that span ``op_build`` seconds (the
ledger's compile time, ``summary/badput_compile_s``): the step keeps the rest of its time. The
callbacks run on the compiling thread and read the monitor's clock, so a test's fake clock moved
inside a callback is compile time exactly. A compilation inside a declared pause (an evaluation's
own graph) stays in that pause, as nested pauses do.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, Callable

__all__ = ["CompileWatch", "DYNAMO_TRIGGER"]

log = logging.getLogger("mlflow_llmeff.monitor.meter")

#: The callback trigger of a dynamo compilation of a frame (``torch._dynamo.callback.CallbackTrigger.DYNAMO``);
#: the other triggers (a lazy backward, a CUDA graph recording) are compile time but not counted as compilations.
DYNAMO_TRIGGER = "DYNAMO"


class CompileWatch:
    """Books the compilations that run inside steps as compile time and counts those after the warm-up.

    Args:
        ledger: the monitor's :class:`~mlflow_llmeff.calc.goodput.TimeLedger`.
        in_step: True while a step is in progress outside every declared pause (then a compilation is
            booked as compile time).
        after_warmup: True while the step in progress is a steady (post-warm-up) step.

    Attributes:
        recompiles: dynamo compilations booked inside steady steps (``summary/recompiles``), count.
        seconds: compile seconds taken out of steps (warm-up steps included), s.
        seen: True once a compilation was booked (the warm-up excess is then named ``compile``).
        window_touched: True when a compilation was booked since the last :meth:`take_touched`: that
            window's per-step device times hold the compilation's gap (the host's do not).
    """

    def __init__(self, ledger, in_step: Callable[[], bool], after_warmup: Callable[[], bool]) -> None:
        self._ledger, self._in_step, self._after_warmup = ledger, in_step, after_warmup
        self.recompiles = 0
        self.seconds = 0.0
        self.seen = False
        self.window_touched = False
        self._open: float | None = None  # the ledger's ``other`` seconds when the booked compilation began
        self._handler: Any = None

    # ------------------------------------------------------------------------------ torch's callbacks
    def install(self) -> bool:
        """Register with torch's compile callbacks once ``torch._dynamo`` is imported (``torch.compile``
        imports it; importing it here would cost ~1.4 s of every run that never compiles). Idempotent;
        returns True when registered."""
        if self._handler is not None:
            return True
        if "torch._dynamo" not in sys.modules:
            return False
        try:
            import torch

            callback_handler = torch._dynamo.callback_handler  # torch/_dynamo/callback.py
            callback_handler.register_start_callback(self._on_start)
            callback_handler.register_end_callback(self._on_end)
            self._handler = callback_handler
        except Exception as e:  # noqa: BLE001 - a torch without them: compilations stay in their steps
            log.debug("torch's compile callbacks are not available", exc_info=e)
            return False
        return True

    def close(self) -> None:
        """Unregister (``torch._dynamo.reset()`` may have cleared the callbacks already)."""
        handler, self._handler = self._handler, None
        if handler is None:
            return
        for remove, fn in ((handler.remove_start_callback, self._on_start), (handler.remove_end_callback, self._on_end)):
            try:
                remove(fn)
            except ValueError:
                pass
        if self._open is not None:
            self.ended()

    def _on_start(self, args) -> None:
        try:
            trigger = getattr(getattr(args, "callback_trigger", None), "name", DYNAMO_TRIGGER)
            self.started(counted=trigger == DYNAMO_TRIGGER)
        except Exception as e:  # noqa: BLE001 - never reaches torch.compile
            log.debug("compile start not booked", exc_info=e)

    def _on_end(self, args) -> None:
        try:
            self.ended()
        except Exception as e:  # noqa: BLE001
            log.debug("compile end not booked", exc_info=e)

    # ------------------------------------------------------------------------------ the hooks
    def started(self, counted: bool = True) -> bool:
        """A compilation starts now (torch's start callback; tests call it directly with a fake clock).

        Args:
            counted: a dynamo compilation of a frame (counted after the warm-up); False for the other
                compile work (a lazy backward, a CUDA graph recording): timed, not counted.

        Returns:
            True when it is booked (a step is in progress outside every pause): its time until
            :meth:`ended` is compile time, not the step's.
        """
        if self._open is not None or not self._in_step():
            return False
        if counted and self._after_warmup():
            self.recompiles += 1
        self._ledger.enter("other")  # stops the step's clock; the span is renamed at the end
        self._open = self._ledger.seconds["other"]
        return True

    def ended(self) -> float:
        """The compilation :meth:`started` booked ends now; returns its seconds (0.0 when none was booked)."""
        if self._open is None:
            return 0.0
        ledger = self._ledger
        ledger.exit()
        span = max(0.0, ledger.seconds["other"] - self._open)
        self._open = None
        ledger.seconds["other"] -= span  # the span was credited to ``other``: it is compile time
        ledger.seconds["op_build"] += span
        self.seconds += span
        self.seen = self.window_touched = True
        return span

    def take_touched(self) -> bool:
        """True when a compilation was booked since the last call (the window's device step times then
        hold its gap: the host's per-step times, which do not, are kept instead)."""
        touched, self.window_touched = self.window_touched, False
        return touched
