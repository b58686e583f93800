"""Time-to-quality targets: parse ``"val_loss<=1.9,hellaswag/acc_norm>=0.30"`` and test them (pure)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from mlflow_llmeff import names
from mlflow_llmeff.evals.data import MMLU_SUBJECTS
from mlflow_llmeff.tracking import keys

__all__ = ["TARGET_METRICS", "Target", "canonical_value", "parse_targets", "better_direction"]

# eval keys without the "eval/" prefix, from names.py; plus "mmlu_<subject>/acc" (checked by pattern)
TARGET_METRICS: tuple[str, ...] = tuple(
    k[len("eval/"):] for k in (names.EVAL_VAL_LOSS, names.EVAL_VAL_PPL, names.EVAL_MMLU_ACC,
                               names.EVAL_HELLASWAG_ACC, names.EVAL_HELLASWAG_ACC_NORM)
)
_SUBJECT_METRICS = frozenset(f"mmlu_{s}/acc" for s in MMLU_SUBJECTS)
_TARGET_RE = re.compile(r"^\s*([A-Za-z0-9_/]+)\s*(>=|<=)\s*([^\s]+)\s*$")
# ``metric=value`` (``llmeff study --target``): the operator follows from the metric (better_direction)
_EQUALS_RE = re.compile(r"^\s*([A-Za-z0-9_/]+)\s*=\s*([^\s<>=]+)\s*$")
#: Metrics a lower value of is better (losses); every other target metric is an accuracy, higher is better.
_LOWER_IS_BETTER = frozenset(k[len("eval/"):] for k in (names.EVAL_VAL_LOSS, names.EVAL_VAL_PPL))
_ANY_TARGET_RE = re.compile(r"^\s*([A-Za-z0-9_./-]+?)\s*(>=|<=)\s*([^\s]+)\s*$")
# a plain decimal number: optional sign, digits with an optional fraction or a leading-dot fraction,
# optional exponent; ASCII digits only (no "inf", "nan", "1_000", "0x10", "1.")
_NUMBER_RE = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]+)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")
_ACCEPTED = (f"write metric>=value or metric<=value with value a plain decimal number (0.30, -1.5, 1e-3) "
             f"and metric one of {', '.join(TARGET_METRICS)}, mmlu_<subject>/acc")
#: the same where ``metric=value`` is accepted too (``llmeff study --target``)
_ACCEPTED_EQUALS = _ACCEPTED.replace("write metric>=value or metric<=value",
                                     "write metric=value (<= for a loss or perplexity, >= for an accuracy), "
                                     "metric>=value or metric<=value")


@dataclass(frozen=True)
class Target:
    """One quality target.

    Attributes:
        metric: eval key without ``eval/``, e.g. ``hellaswag/acc_norm``.
        op: ``">="`` (higher is better) or ``"<="`` (lower is better).
        threshold: the value as a float.
        text: the value as written, in canonical form (:func:`canonical_value`): ``"0.30"`` stays
            ``"0.30"``, ``"+9.5"`` is ``"9.5"``; the key stem is built from it.
    """

    metric: str
    op: str
    threshold: float
    text: str

    @property
    def key(self) -> str:
        """Key stem, e.g. ``hellaswag_acc_norm_ge_0.30`` (``names.target_key`` with ``keys.safe_key``; always a
        valid MLflow key)."""
        return names.target_key(self.metric, self.op, self.text, keys.safe_key)

    @property
    def eval_key(self) -> str:
        """The MLflow metric the target watches, e.g. ``eval/hellaswag/acc_norm``."""
        return "eval/" + self.metric

    @property
    def not_reached_tag(self) -> str:
        """Tag key set to ``not_reached`` when the run ends without reaching the target."""
        return names.TTQ_TAG_PREFIX + self.key

    def metric_keys(self) -> dict[str, str]:
        """``{suffix: "ttq/<key>_<suffix>"}`` for every time-to-quality suffix of names.py."""
        return {s: f"ttq/{self.key}_{s}" for s in names.TTQ_SUFFIXES}

    def reached(self, value: float | None) -> bool:
        """True when ``value`` meets the target (inclusive); a missing or NaN value never does."""
        if value is None or math.isnan(value):
            return False
        return value >= self.threshold if self.op == ">=" else value <= self.threshold

    def __str__(self) -> str:
        return f"{self.metric}{self.op}{self.text}"


def canonical_value(text: str) -> str:
    """Return the key text of a threshold ``text`` that matches the plain decimal form.

    Kept as written, so ``0.30`` stays ``0.30`` and ``-1.5`` stays ``-1.5``, except: a leading ``+``
    is dropped (``+9.5`` -> ``9.5``), an exponent's ``+`` is dropped (``1e+3`` -> ``1e3``; ``1e-3``
    stays), and a leading-dot fraction gets its zero (``.5`` -> ``0.5``, ``-.5`` -> ``-0.5``),
    which reads as a number in a key rather than as a separator. Equal texts name equal targets.

    Raises:
        ValueError: when ``text`` is not a plain decimal number (see ``parse_targets``).
    """
    if not _NUMBER_RE.fullmatch(text):
        raise ValueError(f"threshold {text!r} is not a plain decimal number; write e.g. 0.30, -1.5 or 1e-3")
    out = text[1:] if text.startswith("+") else text
    out = re.sub(r"([eE])\+", r"\1", out)
    if out.startswith("."):
        out = "0" + out
    elif out.startswith("-."):
        out = "-0" + out[1:]
    return out


def better_direction(metric: str) -> str:
    """The operator a target on ``metric`` takes: ``"<="`` for a loss or perplexity (minimised), ``">="`` for
    an accuracy (MMLU, HellaSwag, an MMLU subject: maximised).

    Raises:
        ValueError: for a metric not among :data:`TARGET_METRICS` and ``mmlu_<subject>/acc``.
    """
    if metric in _LOWER_IS_BETTER:
        return "<="
    if metric in TARGET_METRICS or metric in _SUBJECT_METRICS:
        return ">="
    raise ValueError(f"target metric {metric!r} is unknown, so 'metric=value' cannot say whether to reach it from "
                     f"above or below; {_ACCEPTED_EQUALS}")


def parse_targets(spec: str | None, *, any_metric: bool = False, equals: bool = True) -> list[Target]:
    """Parse a comma-separated target list; ``None`` or ``""`` gives ``[]``.

    A value must be a plain decimal number: optional sign, then digits with an optional ``.digits``
    fraction or a ``.digits`` fraction alone, then an optional exponent (``0.30``, ``+9.5``, ``-1.5``,
    ``.5``, ``1e-3``, ``2E+1``), finite as a float. ``inf``, ``nan``, ``1_000``, ``0x10``, ``1.``
    and empty values are rejected. ``Target.text`` is :func:`canonical_value` of what was written.

    Args:
        spec: e.g. ``"val_loss<=1.9,hellaswag/acc_norm>=0.30"``.
        any_metric: accept any metric name (letters, digits, ``_ . - /``), e.g. one a loop reports
            with ``EfficiencyMonitor.log_eval``; False (``llmeff train``) accepts the evals it runs.
        equals: also accept ``metric=value`` for a metric :func:`better_direction` knows, read as
            ``val_loss<=value`` for a loss and ``acc>=value`` for an accuracy: one grammar for
            ``llmeff train --targets``, ``llmeff study --target``, ``autolog(targets=)`` and the monitor
            (the default; False accepts the two explicit forms only).

    Raises:
        ValueError: one line naming the bad target and the accepted metrics, operators and values.
    """
    if spec is None or not spec.strip():
        return []
    if ";" in spec:
        raise ValueError(f"targets {spec!r} use ';'; separate targets with commas, e.g. "
                         f"'val_loss<=1.9,hellaswag/acc_norm>=0.30'")
    accepted = _ACCEPTED_EQUALS if equals else _ACCEPTED
    out: list[Target] = []
    for part in spec.split(","):
        given = part.strip()  # quoted in an error as written, not as ``metric=value`` was read
        if not given:
            raise ValueError(f"targets {spec!r} hold an empty target (a comma too many); {accepted}")
        m = (_ANY_TARGET_RE if any_metric else _TARGET_RE).match(part)
        bare = _EQUALS_RE.match(part) if equals and not m else None
        if bare:
            metric, written = bare.groups()
            part = f"{metric}{better_direction(metric)}{written}"
            m = _TARGET_RE.match(part)
        if not m:
            raise ValueError(f"target {given!r} is not accepted; {accepted}")
        metric, op, written = m.groups()
        if not any_metric and metric not in TARGET_METRICS and metric not in _SUBJECT_METRICS:
            raise ValueError(f"target {given!r} names unknown metric {metric!r}; {accepted}")
        if not _NUMBER_RE.fullmatch(written):
            raise ValueError(f"target {given!r} has non-numeric value {written!r}; {accepted}")
        threshold = float(written)
        if not math.isfinite(threshold):
            raise ValueError(f"target {given!r} has value {written!r} beyond the float range; {accepted}")
        t = Target(metric, op, threshold, canonical_value(written))
        if any(o.key == t.key for o in out):
            raise ValueError(f"target {given!r} is given twice; {accepted}")
        out.append(t)
    return out
