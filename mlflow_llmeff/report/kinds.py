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

from mlflow_llmeff import names

__all__ = ["kinds", "per_kind", "kind_counts", "Kinds", "per_run", "column", "TABLE"]

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


#: The metric keys the report reads of every run (configurations' lengths, scaling's tokens/s, the headline's
#: figures, the time to a target's end of a run): read together in one pass over the runs (:meth:`Kinds.column`).
TABLE = (names.SUM_STEPS, names.SUM_TOKENS_PER_SEC, names.SUM_DEVICE_TOKENS_PER_SEC, names.SUM_MFU_BF16_PEAK,
         names.SUM_MFU_MEASURED_PEAK, names.SUM_MFU, names.SUM_USD_PER_BTOK, names.SUM_KG_CO2E_PER_BTOK,
         names.SUM_ESTIMATE_KG_CO2E_PER_BTOK, names.SUM_GOODPUT, names.SUM_WALL_S, names.SUM_BADPUT["init"])


class Kinds:
    """A list of runs and the kind of each, read in one pass, and the values read of them, kept.

    Attributes:
        runs: the runs, in the order given.
        of: each run's kind, a number (the position of the kind's first run in the list it was first read
            from); a run whose kind is not known (``alike`` None) is a kind of its own.
        first: ``{kind: its first run in runs}``, in the order the kinds are first seen.

    A :class:`Kinds` made of another's (:meth:`subset`, :meth:`join`) takes each value it is asked for from
    the other's (read once for all of them, then picked out in C).
    """

    __slots__ = ("runs", "of", "first", "_kept", "_made_of")

    def __init__(self, runs: list, of: list | None = None, made_of: tuple | None = None):
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
        self._kept: dict = {}
        self._made_of = made_of  # ("subset", kinds, flags) or ("join", kinds, kinds)

    def column(self, key: str) -> list:
        """:func:`column` of metric ``key`` over :attr:`runs` (None where a run has none), kept. The keys of
        :data:`TABLE` that every kind holds are read together, in one pass over the runs (:meth:`_table`); a
        :class:`Kinds` made of another takes a value the other has read from it."""
        got = self._kept.get(("column", key))
        if got is None:
            index, rows = self._table() if key in TABLE else ({}, [])
            if key in index:
                got = list(map(operator.itemgetter(index[key]), rows))
            else:
                got = self._derived(("column", key))
                got = column(self.runs, key) if got is None else got
            self._kept[("column", key)] = got
        return got

    def attribute(self, name: str) -> list:
        """Each run's attribute ``name`` (``status``, ``start_time_ms``, ...), kept; taken from the
        :class:`Kinds` this one is made of where that one has read it."""
        got = self._kept.get(("attribute", name))
        if got is None:
            got = self._derived(("attribute", name))
            got = self._kept[("attribute", name)] = list(map(operator.attrgetter(name), self.runs)) if got is None else got
        return got

    def _derived(self, what) -> list | None:
        """``what`` (a key of :attr:`_kept`) picked out of what the :class:`Kinds` this one is made of has kept
        (in C, without reading a run), or None."""
        if self._made_of is None:
            return None
        how, a, b = self._made_of
        if how == "subset":
            got = a._kept.get(what)
            return None if got is None else list(compress(got, b))
        x, y = a._kept.get(what), b._kept.get(what)
        return None if x is None or y is None else x + y

    def _table(self) -> tuple[dict, list]:
        """``({key: its place in a row}, each run's row)`` of the keys of :data:`TABLE` that every kind holds
        (``itemgetter`` of every key, one pass over the runs, where a pass a key fetched each run's dict from
        memory again), kept; picked out of the table of the :class:`Kinds` this one is made of where it has one."""
        got = self._kept.get(_TABLE)
        if got is None:
            if self._made_of is not None:
                how, a, b = self._made_of
                if how == "subset":
                    kept = a._kept.get(_TABLE)
                    got = None if kept is None else (kept[0], list(compress(kept[1], b)))
                else:
                    (ia, ra), (ib, rb) = a._table(), b._table()
                    got = (ia, ra + rb) if ia == ib else None
            got = self._kept[_TABLE] = self._read_table() if got is None else got
        return got

    def _read_table(self) -> tuple[dict, list]:
        each = list(self.first.values())
        keys = [k for k in TABLE if each and all(k in r.metrics for r in each)]
        if len(keys) < 2:  # itemgetter of one key gives the value, not a row
            return {}, []
        return {k: i for i, k in enumerate(keys)}, list(map(operator.itemgetter(*keys), map(_METRICS, self.runs)))

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
        return Kinds(list(compress(self.runs, flags)), list(compress(self.of, flags)), ("subset", self, flags))

    def split(self, fn) -> tuple[Kinds, Kinds]:
        """``(the runs for which fn(r) is true, the others)``, ``fn`` worked out once a kind."""
        flags = self.per_run(fn)
        return self.split_by(flags)

    def split_by(self, flags: list) -> tuple[Kinds, Kinds]:
        """``(the runs whose flags are true, the others)``."""
        if all(flags):
            return self, Kinds([], [])
        return self.subset(flags), self.subset(list(map(operator.not_, flags)))

    def join(self, other: Kinds) -> Kinds:
        """These runs, then ``other``'s."""
        return Kinds(self.runs + other.runs, self.of + other.of, ("join", self, other))


def per_run(runs: list, fn) -> list:
    """``[fn(r) for r in runs]``, ``fn`` worked out once for each kind of runs on its first run (as for
    :func:`per_kind`), the answers spread over the runs in C (:class:`Kinds`): 100,000 repeats of 5
    configurations are 5 calls."""
    return Kinds(runs).per_run(fn)


_TABLE = object()  # where a Kinds keeps its table


def column(runs: list, key: str) -> list:
    """Each run's value of metric ``key`` (None where it has none), in the order of ``runs``: ``dict.get``
    mapped in C."""
    return list(map(dict.get, map(_METRICS, runs), repeat(key)))
