"""Time-to-quality targets: parse ``"val_loss<=1.9,hellaswag/acc_norm>=0.30"`` and test them (pure)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from mlflow_llmeff import names
from mlflow_llmeff.evals.data import MMLU_SUBJECTS

__all__ = ["TARGET_METRICS", "Target", "parse_targets"]

# eval keys without the "eval/" prefix, from names.py; plus "mmlu_<subject>/acc" (checked by pattern)
TARGET_METRICS: tuple[str, ...] = tuple(
    k[len("eval/"):] for k in (names.EVAL_VAL_LOSS, names.EVAL_VAL_PPL, names.EVAL_MMLU_ACC,
                               names.EVAL_HELLASWAG_ACC, names.EVAL_HELLASWAG_ACC_NORM)
)
_SUBJECT_METRICS = frozenset(f"mmlu_{s}/acc" for s in MMLU_SUBJECTS)
_TARGET_RE = re.compile(r"^\s*([A-Za-z0-9_/]+)\s*(>=|<=)\s*([^\s]+)\s*$")
_ACCEPTED = (f"write metric>=value or metric<=value with metric one of {', '.join(TARGET_METRICS)}, "
             f"mmlu_<subject>/acc")


@dataclass(frozen=True)
class Target:
    """One quality target.

    Attributes:
        metric: eval key without ``eval/``, e.g. ``hellaswag/acc_norm``.
        op: ``">="`` (higher is better) or ``"<="`` (lower is better).
        threshold: the value as a float.
        text: the value exactly as written (``"0.30"``), kept for the key.
    """

    metric: str
    op: str
    threshold: float
    text: str

    @property
    def key(self) -> str:
        """Key stem, e.g. ``hellaswag_acc_norm_ge_0.30`` (``names.target_key``)."""
        return names.target_key(self.metric, self.op, self.text)

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


def parse_targets(spec: str | None) -> list[Target]:
    """Parse a comma-separated target list; ``None`` or ``""`` gives ``[]``.

    Raises:
        ValueError: one line naming the bad target and the accepted metrics and operators.
    """
    if spec is None or not spec.strip():
        return []
    out: list[Target] = []
    for part in spec.split(","):
        m = _TARGET_RE.match(part)
        if not m:
            raise ValueError(f"target {part.strip()!r} is not accepted; {_ACCEPTED}")
        metric, op, text = m.groups()
        if metric not in TARGET_METRICS and metric not in _SUBJECT_METRICS:
            raise ValueError(f"target {part.strip()!r} names unknown metric {metric!r}; {_ACCEPTED}")
        try:
            threshold = float(text)
        except ValueError:
            threshold = float("nan")
        if math.isnan(threshold) or math.isinf(threshold):
            raise ValueError(f"target {part.strip()!r} has non-numeric value {text!r}; {_ACCEPTED}")
        t = Target(metric, op, threshold, text)
        if any(o.key == t.key for o in out):
            raise ValueError(f"target {part.strip()!r} is given twice; {_ACCEPTED}")
        out.append(t)
    return out
