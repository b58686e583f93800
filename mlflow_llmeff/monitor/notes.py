"""What a monitor notes of its run beside its meters' readings, one small component per concern.

Each class owns its fields and is called through its methods; the monitor's
:class:`~mlflow_llmeff.monitor.parts.Parts` holds one of each, and the helper modules
(:mod:`~mlflow_llmeff.monitor.points`, :mod:`~mlflow_llmeff.monitor.summary`,
:mod:`~mlflow_llmeff.monitor.binding`, :mod:`~mlflow_llmeff.monitor.assembly`) call them:

* :class:`Notices`: the warnings given once per run;
* :class:`Absences`: the keys left undefined for the run and why (``llmeff.interval.absent``,
  ``llmeff.summary.absent``);
* :class:`LastPoint`: the last logged point and the first non-finite loss;
* :class:`Reached`: the time-to-quality targets reached and at which step (kept across attempts);
* :class:`JobHistory`: the job's earlier attempts as this attempt knows them;
* :class:`Ending`: what the end of the run collects: its status, the stability tags, figures given
  from outside the meter.

None of them reads a clock, a device or MLflow.
"""

from __future__ import annotations

from typing import Callable

__all__ = ["Notices", "Absences", "absent_text", "LastPoint", "Reached", "JobHistory", "Ending"]


class Notices:
    """The warnings a run gives once (a model-parallel count, an implausible MFU, nothing counted)."""

    __slots__ = ("_said",)

    def __init__(self) -> None:
        self._said: set[str] = set()

    def first(self, what: str) -> bool:
        """True the first time ``what`` is asked for (say it now), False every later time."""
        if what in self._said:
            return False
        self._said.add(what)
        return True


def absent_text(absent: dict[str, str]) -> str:
    """``llmeff.summary.absent`` and ``llmeff.interval.absent``: ``<key>: <why>`` joined by ``; ``, keys
    with the same why named together (``summary/a, summary/b: <why>``), in the order they were found."""
    by_why: dict[str, list[str]] = {}
    for key, why in absent.items():
        by_why.setdefault(why, []).append(key)
    return "; ".join(f"{', '.join(keys)}: {why}" for why, keys in by_why.items())


class Absences:
    """Keys left undefined for a run (never logged as 0) and why each is, in the order they were found."""

    __slots__ = ("_why",)

    def __init__(self) -> None:
        self._why: dict[str, str] = {}

    def add(self, key: str, why: str) -> None:
        """``key`` is undefined because of ``why`` (a later why for the same key replaces it)."""
        self._why[key] = why

    def note(self, why: dict[str, str]) -> bool:
        """Add ``why`` (``{key: why}``); True when that added or changed an entry (the tag is to be set again)."""
        if why and not why.items() <= self._why.items():
            self._why = {**self._why, **why}
            return True
        return False

    def clear(self) -> None:
        """Forget every key (the summary finds them again)."""
        self._why = {}

    @property
    def why(self) -> dict[str, str]:
        """``{key: why}`` as found (the component's own dict: read it, do not change it)."""
        return self._why

    def text(self) -> str:
        """The tag's value (:func:`absent_text`)."""
        return absent_text(self._why)

    def __bool__(self) -> bool:
        return bool(self._why)


class LastPoint:
    """The last logged point of the run and the first non-finite loss it logged.

    Attributes (read them; :meth:`logged` and :meth:`note_nonfinite` change them):
        step: the step of the last logged running totals (-1: none yet).
        metrics: the interval metrics of that step (empty before the first).
        nonfinite: ``(step, value)`` of the first non-finite ``train/loss``, else None.
    """

    __slots__ = ("step", "metrics", "nonfinite")

    def __init__(self) -> None:
        self.step, self.metrics, self.nonfinite = -1, {}, None

    def logged(self, step: int, metrics: dict[str, float]) -> None:
        """``metrics`` were logged at ``step`` (the dict is kept, not copied)."""
        self.step, self.metrics = step, metrics

    def note_nonfinite(self, step: int, value: float) -> None:
        """The loss at ``step`` was ``value``, NaN or infinite; only the first one is kept."""
        if self.nonfinite is None:
            self.nonfinite = (step, value)


class Reached:
    """Time-to-quality targets reached: target key -> the optimizer step it was first reached at; and per
    target the best value its metric took and how many evaluations gave one (the closing report's line
    of a target not reached)."""

    __slots__ = ("_at", "_best")

    def __init__(self) -> None:
        self._at: dict[str, int] = {}
        self._best: dict[str, list] = {}  # target key -> [best value, evaluations]

    def __contains__(self, key: str) -> bool:
        return key in self._at

    def reach(self, key: str, step: int) -> None:
        """Target ``key`` was reached at ``step``."""
        self._at[key] = step

    def saw(self, target, value: float) -> None:
        """An evaluation gave ``target``'s metric ``value`` (a NaN counts as an evaluation, never as best)."""
        best = self._best.setdefault(target.key, [None, 0])
        best[1] += 1
        if value == value and (best[0] is None or (value > best[0] if target.op == ">=" else value < best[0])):
            best[0] = value

    def every(self, targets) -> bool:
        """True when there are ``targets`` and every one has been reached."""
        return bool(targets) and all(t.key in self._at for t in targets)

    def line(self, targets) -> str | None:
        """``targets: val_loss<=3.5 not reached (best 4.07 in 2 evaluations); hellaswag/acc_norm>=0.3 reached at
        step 30``: each target's fate, as the run's ``llmeff.ttq.*`` tags say it; None without targets."""
        if not targets:
            return None
        parts = []
        for t in targets:
            if t.key in self._at:
                parts.append(f"{t} reached at step {self._at[t.key]}")
                continue
            best, n = self._best.get(t.key, [None, 0])
            if not n:
                parts.append(f"{t} not reached (no eval/{t.metric} logged)")
            elif best is None:
                parts.append(f"{t} not reached ({n} evaluation{'s' if n != 1 else ''}, every one NaN)")
            else:
                parts.append(f"{t} not reached (best {best:.4g} in {n} evaluation{'s' if n != 1 else ''})")
        return "targets: " + "; ".join(parts)

    def state(self) -> dict[str, int]:
        """``{key: step}``, a copy for a checkpoint."""
        return dict(self._at)

    def best_state(self) -> dict[str, list]:
        """``{key: [best value or None, evaluations]}``, a copy for a checkpoint."""
        return {k: list(v) for k, v in self._best.items()}

    def load(self, state: dict, best: dict | None = None) -> None:
        """Continue the targets a checkpoint's attempt reached (``{key: step}``) and the best values it saw."""
        self._at = {k: int(v) for k, v in state.items()}
        self._best = {k: [None if v[0] is None else float(v[0]), int(v[1])] for k, v in (best or {}).items()}


class JobHistory:
    """The job's earlier attempts as this attempt knows them (``llmeff train``'s job ledger, a checkpoint).

    Attributes (read them; the methods change them):
        attempts: the job's attempts, this one included (``llmeff.resume.attempts``, >= 1).
        down_s: the job's seconds no attempt ran (s, >= 0).
        tail_devices: devices of the resumed checkpoint's writer (None: this attempt's).
        tail_lost: ``(lost progress added (s), Unix time the resumed checkpoint was written)``, else None.
        note: the job's line added to the run's description at the end (None: none).
    """

    __slots__ = ("attempts", "down_s", "tail_devices", "tail_lost", "note", "_figures")

    def __init__(self) -> None:
        self.attempts, self.down_s, self.tail_devices, self.tail_lost, self.note = 1, 0.0, None, None, None
        self._figures: Callable[[float], tuple[dict, dict, str | None]] | None = None

    def set_attempts(self, attempts: int) -> None:
        """The job has made ``attempts`` attempts, this one included."""
        self.attempts = attempts

    def set_down(self, seconds: float) -> None:
        """The job's seconds between attempts (``continue_job``)."""
        self.down_s = seconds

    def written_on(self, devices: int) -> None:
        """The resumed checkpoint's writer held ``devices`` devices (its lost tail ran on them)."""
        self.tail_devices = devices

    def lose_tail(self, lost: float, saved_unix: float) -> None:
        """``lost`` seconds after the checkpoint written at ``saved_unix`` were lost progress."""
        self.tail_lost = (lost, saved_unix)

    def move_tail_end(self, end_unix: float | None) -> float | None:
        """The writer's last completed step ended at ``end_unix``: its lost tail runs to it. Returns the
        seconds to add to the lost progress (negative: to take off), None when there is no tail or no end."""
        if end_unix is None or self.tail_lost is None:
            return None
        added, saved = self.tail_lost
        lost = max(0.0, float(end_unix) - saved)
        self.tail_lost = (lost, saved)
        return lost - added

    def set_figures(self, figures: Callable[[float], tuple[dict, dict, str | None]]) -> None:
        """``figures(end_unix) -> (summary metrics, tags, description line)``, computed at the end."""
        self._figures = figures

    @property
    def has_figures(self) -> bool:
        return self._figures is not None

    def figures(self, end_unix: float) -> tuple[dict, dict]:
        """The job's metrics and tags at ``end_unix``; its description line is kept as :attr:`note`.

        Raises:
            Exception: what the figures' function raises.
        """
        metrics, tags, self.note = self._figures(end_unix)
        return metrics, tags


class Ending:
    """What the end of a run collects beside the figures it computes.

    Attributes (read them; the methods change them):
        status: the MLflow status the run ends with (None before ``finish``).
    """

    __slots__ = ("status", "_stability", "_extra")

    def __init__(self) -> None:
        self.status: str | None = None
        self._stability: dict[str, str] = {}
        self._extra: dict[str, float] = {}

    def ended(self, status: str) -> None:
        """The run ends with ``status``."""
        self.status = status

    def add_figures(self, metrics: dict[str, float]) -> None:
        """Figures measured outside the meter, logged with the ``summary/*`` (values as floats)."""
        self._extra.update({k: float(v) for k, v in metrics.items()})

    @property
    def figures(self) -> dict[str, float]:
        """The figures :meth:`add_figures` was given (the component's own dict: read it)."""
        return self._extra

    def start_stability(self, tags: dict[str, str]) -> None:
        """``llmeff.stability`` and the tags beside it, replacing any earlier ones."""
        self._stability = tags

    def add_stability(self, tags: dict[str, str]) -> None:
        """More stability tags (contention, stragglers, data wait)."""
        self._stability.update(tags)

    @property
    def stability(self) -> dict[str, str]:
        """The stability tags (the component's own dict: read it)."""
        return self._stability
