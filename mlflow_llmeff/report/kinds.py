"""Runs by kind: what depends only on a run's metric keys, tags (but its name) and params is worked out once
for all the runs alike (:attr:`~mlflow_llmeff.report.calc.RunRecord.alike`) and spread over them in passes of C.

At 100,000 runs (bench/page.py, issue 53) every pass over the records costs 10-60 ms of CPU here: they lie all
over memory and each step reads a record, its dict and a value from it. :class:`Kinds` reads each record's kind
once; a figure then asks each kind once and spreads the answers over the runs with ``map`` and ``compress`` over
small numbers, without reading a record again (a step of Python a run cost 0.3 s for some figures).

The runs are :class:`~mlflow_llmeff.report.calc.RunRecord` values (not imported: calc imports this module).
"""

from __future__ import annotations

import operator
from collections import Counter
from itertools import compress, count, repeat

__all__ = ["kinds", "per_kind", "kind_counts", "Kinds", "per_run", "column"]

_ALIKE = operator.attrgetter("alike")
_METRICS = operator.attrgetter("metrics")


def kinds(runs: list) -> list:
    """One run of each kind among ``runs`` (``alike``: the same metric keys, tags but the name, and params) and
    every run whose kind is not known: what a figure that depends on nothing else needs to look at (5 runs for
    100,000 repeats of 5 configurations). Order: by kind, first seen."""
    by = dict(zip(map(_ALIKE, runs), runs))
    if None not in by:
        return list(by.values())
    del by[None]
    return list(by.values()) + [r for r in runs if r.alike is None]


_UNSET = object()


def per_kind(r, memo: dict, fn):
    """``fn(r)``, worked out once for the runs alike ``r`` and kept in ``memo``: for an ``fn`` that reads only
    the run's tags (but its name), params and metric keys."""
    a = r.alike
    if a is None:
        return fn(r)
    got = memo.get(a, _UNSET)
    if got is _UNSET:
        got = memo[a] = fn(r)
    return got


def kind_counts(runs: list) -> list[tuple]:
    """``(a run of each kind, how many runs of ``runs`` are of it)`` (:func:`kinds`; a run of no known kind
    counts 1), in the order each kind is first seen, with its first run (:meth:`Kinds.counts`)."""
    return Kinds(runs).counts()


class Kinds:
    """A list of runs and the kind of each, read in one pass.

    Attributes:
        runs: the runs, in the order given.
        of: each run's kind, a number (the position of the kind's first run in the list it was first read
            from); a run whose kind is not known (``alike`` None) is a kind of its own.
        first: ``{kind: its first run in runs}``, in the order the kinds are first seen.
    """

    __slots__ = ("runs", "of", "first")

    def __init__(self, runs: list, of: list | None = None):
        self.runs = runs
        if of is None:
            index: dict = {}
            of = list(map(index.setdefault, map(_ALIKE, runs), count()))
            if None in index:  # runs of no known kind: each its own
                of = [i if r.alike is None else k for i, (r, k) in enumerate(zip(runs, of))]
        self.of = of
        at: dict = {}
        list(map(at.setdefault, of, count()))  # each kind's first position in these runs
        self.first = {k: runs[i] for k, i in at.items()}

    def answers(self, fn) -> dict:
        """``{kind: fn(its first run)}``, in the order the kinds are first seen (``fn`` as for :func:`per_kind`)."""
        return {k: fn(r) for k, r in self.first.items()}

    def per_run(self, fn) -> list:
        """``[fn(r) for r in runs]``, ``fn`` worked out once a kind (as for :func:`per_kind`)."""
        return list(map(self.answers(fn).__getitem__, self.of))

    def kinds(self) -> list:
        """The first run of each kind (what :func:`kinds` answers, with each kind's first run, not its last)."""
        return list(self.first.values())

    def counts(self) -> list[tuple]:
        """:func:`kind_counts`: the first run of each kind with how many runs are of it."""
        return [(self.first[k], n) for k, n in Counter(self.of).items()]

    def subset(self, flags: list) -> Kinds:
        """The runs whose ``flags`` are true, with their kinds (no record read again)."""
        return Kinds(list(compress(self.runs, flags)), list(compress(self.of, flags)))

    def split(self, fn) -> tuple[Kinds, Kinds]:
        """``(the runs for which fn(r) is true, the others)``, ``fn`` worked out once a kind."""
        flags = self.per_run(fn)
        if all(flags):
            return self, Kinds([], [])
        return self.subset(flags), self.subset(list(map(operator.not_, flags)))


def per_run(runs: list, fn) -> list:
    """``[fn(r) for r in runs]``, ``fn`` worked out once for each kind of runs on its first run (as for
    :func:`per_kind`), the answers spread over the runs in C (:class:`Kinds`): 100,000 repeats of 5
    configurations are 5 calls."""
    return Kinds(runs).per_run(fn)


def column(runs: list, key: str) -> list:
    """Each run's value of metric ``key`` (None where it has none), in the order of ``runs``: ``dict.get``
    mapped in C."""
    return list(map(dict.get, map(_METRICS, runs), repeat(key)))
