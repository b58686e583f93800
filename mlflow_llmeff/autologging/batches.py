"""Data waits under ``autolog()``: each batch a loop awaits from a DataLoader, timed as ``data_wait``.

``autolog()`` patches ``torch.utils.data.DataLoader.__iter__`` and, once Accelerate is imported, the
``__iter__`` of its prepared loaders (``DataLoaderShard``, ``DataLoaderDispatcher``, ``SkipDataLoader``:
they do not go through torch's), so that the iterator a loop gets is a :class:`TimedBatches`: each
``next()`` runs inside the active monitor's ``data_wait`` pause (``EfficiencyMonitor.enter_pause``,
no device synchronization), as ``llmeff train`` declares every micro-batch's fetch and copy
(docs/time.md). The wait stays inside its step's seconds and is carved out of productive time.

Only a loader iterated while a monitor is open is timed; a loader inside another (Accelerate's shard
iterating torch's loader) is timed once, by the outer one, so an Accelerate batch's wait holds its
copy to the device and, for a dispatcher, the broadcast from rank 0. The cost is one pause a batch
(2 us a batch in a tight loop on the 2-core development machine, 2026-12-06; ~9 us right after a
real step, docs/time.md "The meter's own time"). ``autolog(disable=True)``
restores the original ``__iter__`` (:class:`LoaderPatch`); an iterator made before that passes its
batches through.
"""

from __future__ import annotations

import functools
from typing import Any

__all__ = ["TimedBatches", "LoaderPatch", "ACCELERATE_LOADERS"]

#: Accelerate's prepared loaders with their own ``__iter__`` (``accelerate.data_loader``).
ACCELERATE_LOADERS = ("DataLoaderShard", "DataLoaderDispatcher", "SkipDataLoader")


class TimedBatches:
    """An iterator over a loader's batches whose every ``next()`` is the open monitor's ``data_wait``.

    Args:
        it: the loader's own iterator.
        session: the autolog session (its ``monitor``, None while no loop is measured, and its
            ``fetching`` flag, True while an outer loader's fetch is timed).

    Other attributes are the wrapped iterator's (``len()``, torch's ``_BaseDataLoaderIter`` fields).
    """

    __slots__ = ("_it", "_session")

    def __init__(self, it, session) -> None:
        self._it, self._session = it, session

    def __iter__(self) -> "TimedBatches":
        return self

    def __next__(self):
        s = self._session
        mon = s.monitor
        if mon is None or s.fetching or mon.finished:
            return next(self._it)
        s.fetching = True
        mon.enter_pause("data_wait")  # never raises for this category; a monitor failure warns inside
        try:
            return next(self._it)
        finally:
            mon.exit_pause()
            s.fetching = False

    def __len__(self) -> int:
        return len(self._it)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._it, name)


class LoaderPatch:
    """The ``__iter__`` patches of one ``autolog()`` enablement: set on loader classes, restored at its teardown.

    Not ``safe_patch``: MLflow's safe patch returns the original's result (the iterator could not be
    wrapped) and costs ~30 us a call; ``__iter__`` runs once an epoch, the wrapper's ``next()`` once a batch.

    Args:
        session: the autolog session whose monitor the batches' waits go to.
    """

    def __init__(self, session) -> None:
        self._session = session
        self._patched: list[tuple[type, Any, Any]] = []  # (class, its own __iter__, ours)

    def patch(self, cls: type) -> bool:
        """Wrap ``cls.__iter__`` (a class that defines its own; once). Returns True when patched."""
        original = vars(cls).get("__iter__")
        if original is None or any(c is cls for c, _, _ in self._patched):
            return False
        session = self._session

        def __iter__(loader, *args, **kwargs):
            it = original(loader, *args, **kwargs)
            try:
                return TimedBatches(iter(it), session)
            except Exception:  # noqa: BLE001 - an iterator we cannot wrap is the loop's own, untimed
                return it

        functools.update_wrapper(__iter__, original)
        setattr(cls, "__iter__", __iter__)
        self._patched.append((cls, original, __iter__))
        return True

    def restore(self) -> None:
        """Put every patched class's own ``__iter__`` back (one patched over since is left: it passes through)."""
        for cls, original, ours in reversed(self._patched):
            if vars(cls).get("__iter__") is ours:
                setattr(cls, "__iter__", original)
        self._patched.clear()
