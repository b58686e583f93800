"""How a process ends, so every run gets its status: FINISHED, FAILED or KILLED, with an end time.

The rule, for ``llmeff train``, :class:`~mlflow_llmeff.monitor.meter.EfficiencyMonitor` and every autolog
integration alike (:func:`status_for`):

* the code returned normally, or ``sys.exit(0)`` / ``sys.exit()``: ``FINISHED``;
* an uncaught exception, or ``sys.exit(n)`` with ``n`` not 0 (or a message): ``FAILED``;
* ``KeyboardInterrupt`` (SIGINT, Ctrl-C) or SIGTERM: ``KILLED``.

Python gives exit hooks no exit code, and SIGTERM's default action kills the process without
running any hook, so a meter that is still open when the process goes would leave a RUNNING run
with its buffered points lost. :func:`install` therefore (once per process, from the main thread):

* registers an exit hook that ends every open meter with the status above, after flushing its
  buffered points; it runs from ``threading``'s exit hooks, before ``concurrent.futures`` shuts
  the thread pool down that MLflow's asynchronous logging needs;
* wraps ``sys.exit`` to remember the code it was called with (a bare ``raise SystemExit(n)``
  outside any ``with`` block is seen as ``FINISHED``: Python does not tell);
* with autolog on, MLflow's own exit hook, which ends a still-active run FINISHED whatever
  happened, ends it with this status instead (``mlflow.end_run`` is patched);
* where SIGTERM has its default action, installs a handler that raises ``SystemExit(143)`` in the
  main thread (the shell's 128 + 15), so ``finally`` blocks and the exit hook run. After a signal,
  meters end without collectives (other ranks may be gone already).
"""

from __future__ import annotations

import atexit
import signal
import sys
import threading
import weakref

__all__ = ["install", "register", "unregister", "status_for", "exit_status", "exiting", "signalled", "sigterm_to_exit",
           "exit_now"]

_live: "weakref.WeakSet" = weakref.WeakSet()
_state = {"installed": False, "exit_code": None, "signal": None, "exiting": False}
_orig_exit = sys.exit


def signalled() -> str | None:
    """``"SIGTERM"`` or ``"SIGINT"`` once such a signal asked this process to stop, else None."""
    return _state["signal"]


def status_for(exc: BaseException | None) -> str:
    """The MLflow status of a run whose code ended with ``exc`` (None: it returned normally)."""
    if _state["signal"] is not None:
        return "KILLED"
    if exc is None:
        return "FINISHED"
    if isinstance(exc, KeyboardInterrupt):
        return "KILLED"
    if isinstance(exc, SystemExit):
        return "FINISHED" if exc.code in (None, 0) else "FAILED"
    return "FAILED"


def exit_status() -> str:
    """The status for meters still open at interpreter exit (see the module docstring)."""
    if _state["signal"] is not None:
        return "KILLED"
    err = getattr(sys, "last_value", None)  # set when the interpreter printed an uncaught traceback
    if err is not None:
        return status_for(err)
    code = _state["exit_code"]
    return "FINISHED" if code in (None, 0) else "FAILED"


def register(meter) -> None:
    """Track an open meter; it must have ``end_at_exit(status)``."""
    _live.add(meter)


def unregister(meter) -> None:
    _live.discard(meter)


def _recording_exit(code=None):
    if threading.current_thread() is threading.main_thread():  # elsewhere it only ends that thread
        _state["exit_code"] = code
    _orig_exit(code)


def sigterm_to_exit(signum, frame):  # noqa: ARG001
    """SIGTERM handler: record the signal and raise ``SystemExit(128 + signum)`` in the main thread."""
    _state["signal"] = "SIGTERM"
    raise SystemExit(128 + signum)


def note_signal(name: str) -> None:
    """Record that a signal (``SIGINT``, ``SIGTERM``) is ending the process (for handlers of the caller's own)."""
    _state["signal"] = name


def exiting() -> bool:
    """True once the interpreter runs its exit hooks (then MLflow's own exit hook ends active runs)."""
    return _state["exiting"]


def _at_exit() -> None:
    _state["exiting"] = True
    status = exit_status()
    for meter in list(_live):
        try:
            meter.end_at_exit(status)
        except Exception:  # noqa: BLE001 - interpreter shutdown: nothing may escape
            pass


def install() -> None:
    """Install the exit hook, the ``sys.exit`` recorder and the SIGTERM handler (idempotent)."""
    if _state["installed"]:
        return
    _state["installed"] = True
    import concurrent.futures.thread  # noqa: F401 - its exit hook must be registered before ours

    register_hook = getattr(threading, "_register_atexit", None)
    if register_hook is not None:
        register_hook(_at_exit)
    atexit.register(_at_exit)  # runs too when threading's hook did not (idempotent per meter)
    if sys.exit is _orig_exit:
        sys.exit = _recording_exit
    if threading.current_thread() is threading.main_thread():
        try:
            if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
                signal.signal(signal.SIGTERM, sigterm_to_exit)
        except (ValueError, OSError):  # not the main interpreter, or no signals here
            pass


def exit_now(code: int) -> None:
    """End this process with ``code`` once everything it owes is out, without the interpreter's finalization.

    Runs what interpreter exit runs first, in its order (CPython's ``Py_FinalizeEx``): ``threading``'s
    shutdown (its exit hooks, among them the meter's, and joining the non-daemon threads), then the
    ``atexit`` handlers (MLflow's, logging's flush), flushes stdout and stderr, and ends with
    ``os._exit(code)``. What it skips is the module teardown and garbage collection of a process
    that imported torch: measured 5.8 s per worker after a 2-process CPU run on the development
    machine (2 shared cores), 1.5 s for ``llmeff train``'s own launcher; seconds after
    ``summary/wall_s`` ends, before the user's command returns (docs/time.md, "The job clock").
    Only for a process's own entry point (``llmeff train``, the workers): it never returns.
    """
    import os

    shutdown = getattr(threading, "_shutdown", None)  # CPython's own first step of interpreter exit
    try:
        if shutdown is not None:
            shutdown()
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - a closed stream: nothing left to flush
                pass
        os._exit(code)
