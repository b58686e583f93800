"""Per-step timing for the stability figures: the steady steps' seconds and tokens, the device-side
clock of each step on CUDA, and each rank's forward, backward and optimizer time for the stragglers.

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
* :class:`PhaseTimer` times the model's forward passes, its backward passes and the optimizer's
  steps inside steady steps (CUDA events on a CUDA model, the host clock otherwise). Under DDP none
  of them holds a collective wait, so a rank's phase times are its compute speed before the
  collective waits, and the step time minus them is its collective wait (and the loop's other
  work); under FSDP and tensor parallelism the phases hold parameter all-gathers and gradient
  reduce-scatters too (docs/stability.md).

Event classes and clocks are injected (tests use fakes); torch is imported only for real CUDA events.
"""

from __future__ import annotations

import base64
from array import array
from typing import Any, Callable, Sequence

__all__ = ["StepTimes", "Window", "DeviceStepClock", "PhaseTimer", "PhaseTotals", "PHASES", "cuda_event_factory"]


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


class Window:
    """The optimizer steps :meth:`~mlflow_llmeff.monitor.meter.EfficiencyMonitor.step` ended since the
    last window edge (not yet in the throughput meter), and the learning rate it was last given.

    Attributes (read them; :meth:`add`, :meth:`take_steady` and :meth:`close` change them):
        steps: optimizer steps since the last window edge (>= 0).
        seconds: their step seconds on the host clock (s).
        steady_s: seconds of each steady one of them, in step order (warm-up steps left out).
        lr: the learning rate last given to ``step()`` (None: read it from the optimizer).
    """

    __slots__ = ("steps", "seconds", "steady_s", "lr")

    def __init__(self) -> None:
        self.steps, self.seconds, self.steady_s, self.lr = 0, 0.0, [], None

    def add(self, seconds: float, warmup: bool, lr=None) -> None:
        """One more step of ``seconds`` (a warm-up one with ``warmup``), given ``lr`` (None: none given).
        Called at every step: the fields are updated in place, nothing is allocated."""
        if lr is not None:
            self.lr = float(lr)
        self.seconds += seconds
        self.steps += 1
        if not warmup:
            self.steady_s.append(seconds)

    def take_steady(self) -> list[float]:
        """The steady steps' seconds since the last call (the list itself, handed over; a new one starts)."""
        out, self.steady_s = self.steady_s, []
        return out

    def close(self) -> None:
        """The window's steps and seconds are in the throughput meter: count from 0 again."""
        self.steps, self.seconds = 0, 0.0


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


#: The compute phases of a step :class:`PhaseTimer` times; what is left of a step is collective wait and other.
PHASES = ("forward", "backward", "optimizer")


def _grad_root(out):
    """The tensor a backward through ``out`` starts at when the loss is taken outside the forward: the
    first tensor of ``out`` that needs a gradient (``logits``), else None."""
    import torch

    if isinstance(out, torch.Tensor):
        return out if out.requires_grad else None
    values = out.values() if isinstance(out, dict) else out if isinstance(out, (tuple, list)) else ()
    for v in values:
        if isinstance(v, torch.Tensor) and v.requires_grad:
            return v
    return None


def _has_loss(out) -> bool:
    """True when the forward computed its own loss (``out.loss`` needs a gradient: a transformers model
    given ``labels``); the backward then starts from it, right after the forward."""
    loss = getattr(out, "loss", None)
    return loss is not None and getattr(loss, "requires_grad", False)


def _torch_optimizer(optimizer):
    """The ``torch.optim.Optimizer`` inside wrappers (Accelerate's ``AcceleratedOptimizer.optimizer``, itself an
    Optimizer subclass whose ``step`` runs no hooks), or None."""
    for _ in range(4):
        inner = getattr(optimizer, "optimizer", None)
        if inner is None:
            break
        optimizer = inner
    return optimizer if hasattr(optimizer, "_optimizer_step_pre_hooks") else None


class PhaseTimer:
    """Seconds of each compute phase of the steps while ``active()`` (steady steps, outside pauses):
    ``forward``, ``backward`` and ``optimizer`` (:data:`PHASES`).

    * forward: the model's ``forward`` (pre- and post-forward hooks on the inner module);
    * backward: from its start to the end of autograd's pass. The end is a callback queued on torch's
      autograd engine (``Variable._execution_engine.queue_callback``, the call DDP and FSDP make for
      their own end of backward) from a gradient hook on one parameter (the first trainable one). DDP
      queues its own (the wait for its last all-reduces) once its last gradient is ready, which is
      this hook's moment at the earliest, and the engine runs a gradient's own hooks before DDP's:
      ours runs first. (Under reentrant activation checkpointing a parameter inside a checkpointed
      layer gets its gradient in a nested backward, which would end this one early; a transformers
      model's first parameter, its embedding, lies outside the layers.) The start: where the forward computed its own loss
      (``out.loss``, a transformers model given labels) the forward's end, for nothing but the
      loop's own lines runs between the two; otherwise the backward reaching the forward's output
      (a pre-hook on the ``grad_fn`` of its first tensor that needs a gradient), so a loss taken
      outside the forward is in neither phase. Under DDP the gradient all-reduces run
      asynchronously beside it, and the wait for the last ones (DDP's own end-of-backward callback)
      is not in it; an engine that finishes its gradient collectives after autograd returns
      (DeepSpeed's ``engine.backward`` epilogue) has them in the step's rest too. Where the hooked
      parameter gets no gradient (an engine that accumulates gradients itself: FSDP2's sharded
      parameters, DeepSpeed; a parameter frozen later), the backward ends at the next thing seen:
      the optimizer's step, the next forward, or the window's edge, and so holds the engine's
      gradient collectives. A transformers model's step costs two hook calls for the backward
      whatever its parameter count (one hook per parameter's gradient and one on each output, as
      before, cost ~60 us of a 16 ms CPU step, ``bench/overhead.py``);
    * optimizer: ``optimizer.step()`` (step pre- and post-hooks of the ``torch.optim.Optimizer``
      inside Accelerate's wrapper; none for an optimizer without them: :attr:`timed` says so).

    What a step holds besides these (the collective waits, gradient clipping, the scheduler, the
    loop itself) is the step time minus their sum. CUDA events on a CUDA model (read after the
    window edge's synchronization), the host clock otherwise. A hook that fails stops the timer,
    never the step.

    Args:
        module: the model (the inner module, not a DDP wrapper, whose own forward may broadcast buffers).
        active: True while a phase should count.
        clock: host seconds (used without ``event``).
        event: timing-event factory (:func:`cuda_event_factory`) for a model on a CUDA device.
        optimizer: the training optimizer (for the optimizer phase), or None.
    """

    def __init__(self, module, active: Callable[[], bool], clock: Callable[[], float],
                 event: Callable[[], Any] | None = None, optimizer=None) -> None:
        self._active, self._clock, self._event = active, clock, event
        self._mark = event or clock  # (a hook's first call: one frame fewer than the method)
        self._seconds = dict.fromkeys(PHASES, 0.0)
        self._spans: list[tuple[str, Any, Any]] = []  # (phase, start event, end event) on CUDA
        self._fwd: Any = None
        self._opt: Any = None
        self._bwd: Any = None  # start mark of the open backward
        self._bwd_end: Any = None  # its end mark (autograd's pass finished)
        self._queued = False  # the end callback of the open backward is queued
        self._handles = [module.register_forward_pre_hook(self._fwd_pre), module.register_forward_hook(self._fwd_post)]
        first = next((q for q in module.parameters() if q.requires_grad), None)
        if first is not None and hasattr(first, "register_post_accumulate_grad_hook"):
            from torch.autograd import Variable

            self._engine, self._done = Variable._execution_engine, self._bwd_done  # (bound once: the hook is hot)
            self._handles.append(first.register_post_accumulate_grad_hook(self._grad))
        inner, hooked = _torch_optimizer(optimizer), False
        if inner is not None:
            try:
                self._handles += [inner.register_step_pre_hook(self._opt_pre),
                                  inner.register_step_post_hook(self._opt_post)]
                hooked = True
            except Exception:  # noqa: BLE001 - an optimizer that takes no hooks: its phase is not timed
                pass
        #: the phases this timer can see (forward and backward with a model; optimizer with a torch optimizer)
        self.timed = {"forward": True, "backward": True, "optimizer": hooked}

    # ---- marks: a host time, or a recorded CUDA event
    def _mark(self) -> Any:
        """A host time, or a recorded CUDA event (the instance binds ``_mark`` to the one it uses)."""
        return self._event() if self._event else self._clock()

    def _add(self, phase: str, start: Any, end: Any) -> None:
        if self._event:
            self._spans.append((phase, start, end))
        else:
            self._seconds[phase] += end - start

    def _stop(self) -> None:
        """A hook failed: stop timing (the step goes on)."""
        self._active = lambda: False
        self._fwd = self._opt = self._bwd = self._bwd_end = None

    def _close_backward(self) -> None:
        """End an open backward: where autograd's pass ended, else now (a pass still running, or one
        whose callback never came)."""
        if self._bwd is not None:
            self._add("backward", self._bwd, self._bwd_end if self._bwd_end is not None else self._mark())
            self._bwd = self._bwd_end = None

    # ---- hooks
    def _fwd_pre(self, module, args) -> None:
        try:
            self._close_backward()
            self._fwd = self._mark() if self._active() else None
        except Exception:  # noqa: BLE001 - a timer never reaches the user's forward: it stops timing
            self._stop()

    def _fwd_post(self, module, args, output) -> None:
        if self._fwd is None:
            return
        try:
            end = self._mark()
            self._add("forward", self._fwd, end)
            self._fwd = None
            if _has_loss(output):  # the backward starts from the forward's own loss: it starts now
                self._close_backward()
                self._bwd, self._queued = end, False
                return
            root = _grad_root(output)
            if root is not None:
                node = root.grad_fn
                if node is not None:  # the first node of the backward through the output
                    node.register_prehook(self._bwd_start)
                else:  # a leaf that needs a gradient: its own hook
                    root.register_hook(self._bwd_start)
        except Exception:  # noqa: BLE001 - a timer never reaches the user's forward: it stops timing
            self._stop()

    def _bwd_start(self, grad) -> None:
        try:
            if self._active():
                self._close_backward()
                self._bwd, self._queued = self._mark(), False
        except Exception:  # noqa: BLE001
            self._stop()

    def _queue_end(self) -> None:
        """Queue :meth:`_bwd_done` on autograd's engine (only inside a backward pass), once a backward."""
        if not self._queued:
            self._queued = True
            self._engine.queue_callback(self._done)

    def _grad(self, param) -> None:
        if self._bwd is None:
            return
        try:
            self._queue_end()
        except Exception:  # noqa: BLE001
            self._stop()

    def _bwd_done(self) -> None:
        """Autograd's pass ended (the engine's callback): the backward's end mark."""
        self._queued = False
        if self._bwd is None:
            return
        try:
            self._bwd_end = self._mark()
        except Exception:  # noqa: BLE001
            self._stop()

    def _opt_pre(self, optimizer, args, kwargs) -> None:
        try:
            self._close_backward()
            self._opt = self._mark() if self._active() else None
        except Exception:  # noqa: BLE001
            self._stop()

    def _opt_post(self, optimizer, args, kwargs) -> None:
        if self._opt is None:
            return
        try:
            self._add("optimizer", self._opt, self._mark())
            self._opt = None
        except Exception:  # noqa: BLE001
            self._stop()

    def take(self) -> dict[str, float]:
        """Seconds of each phase since the last call, ``{phase: s}`` (after a device synchronization on CUDA)."""
        try:
            self._close_backward()
        except Exception:  # noqa: BLE001
            self._stop()
        out = dict(self._seconds)
        for phase, start, end in self._spans:
            out[phase] += start.elapsed_time(end) / 1000.0  # ms -> s at the boundary
        self._seconds, self._spans = dict.fromkeys(PHASES, 0.0), []
        return out

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


class PhaseTotals:
    """This attempt's steady steps' seconds by compute phase (:data:`PHASES`), summed window by window
    from a :class:`PhaseTimer`, and the step seconds of those steps: what a rank gives the straggler
    figures (mean seconds per step, :func:`~mlflow_llmeff.monitor.summary.straggler_figures`)."""

    __slots__ = ("_phase_s", "_steps", "_step_s")

    def __init__(self) -> None:
        self._phase_s = dict.fromkeys(PHASES, 0.0)
        self._steps, self._step_s = 0, 0.0

    def add(self, phase_s: dict[str, float], steps: int, step_s: Sequence[float]) -> None:
        """A steady window: its seconds by phase ``{phase: s}``, its ``steps`` and their seconds ``(steps,)``."""
        for phase, s in phase_s.items():
            self._phase_s[phase] += s
        self._steps += steps
        self._step_s += sum(step_s)

    @property
    def steps(self) -> int:
        """The steady steps whose phases were timed."""
        return self._steps

    def per_step(self, phases: Sequence[str]) -> tuple[dict[str, float], float | None]:
        """Mean seconds per timed step of each of ``phases``, and the mean step seconds
        (``({}, None)`` before a timed step)."""
        n = self._steps
        if not n:
            return {}, None
        return {phase: self._phase_s[phase] / n for phase in phases}, self._step_s / n
