"""MLflow-safe keys and values: map user text to keys MLflow accepts, and check entries before sending.

MLflow's own validators (``mlflow.utils.validation``) are the authority: a key they accept is
returned unchanged, so every key of ``names.py`` and every ordinary user key stays as written.
Anything else gets a deterministic, readable mapping (:func:`safe_key`). The ``check_*`` helpers
apply the rest of MLflow's rules to one metric, tag or param and say in words what they changed,
so that :class:`~mlflow_llmeff.tracking.logger.RunLogger` can log every valid entry, repair or drop
the invalid ones, and name them in ``llmeff.logging.warnings``.

No torch here; ``mlflow.utils.validation`` is imported on first use.
"""

from __future__ import annotations

import functools
import hashlib
import posixpath
import re
from typing import NamedTuple

__all__ = ["Checked", "check_metric", "check_param", "check_tag", "key_accepted", "safe_key", "tag_value_limit"]

# User text -> key text, longest match first. Word replacements are set off with created
# underscores, so "mfu(%)" reads "mfu_pct" and "team@lab" reads "team_at_lab".
_WORDS = (("<=", "le"), (">=", "ge"), ("<", "lt"), (">", "gt"), ("=", "eq"), ("%", "pct"), ("@", "at"),
          ("+", "plus"))
_CREATED = "\x00"  # marks an underscore the mapping created; never survives in a returned key
_HASH_CHARS = 8  # hex characters of sha1 appended to a shortened key
_FALLBACK_MAX_KEY = 250  # MLflow 3 MAX_ENTITY_KEY_LENGTH, used only if MLflow's constant moves
_FALLBACK_NAME_RE = re.compile(r"^[/\w.\- :]*$")


def _validation():
    """``mlflow.utils.validation``, or None when this MLflow lacks the private helpers used here."""
    try:
        from mlflow.utils import validation as v

        v._validate_metric_name, v._validate_param_name, v._validate_tag_name  # noqa: B018
        v._validate_length_limit, v.validate_param_and_metric_name, v.MAX_ENTITY_KEY_LENGTH  # noqa: B018
        return v
    except (ImportError, AttributeError):  # pragma: no cover - a future MLflow; fall back to 3.x rules
        return None


def _max_key_length() -> int:
    v = _validation()
    return v.MAX_ENTITY_KEY_LENGTH if v is not None else _FALLBACK_MAX_KEY


def _limit(name: str, fallback: int) -> int:
    v = _validation()
    return getattr(v, name, fallback) if v is not None else fallback


@functools.lru_cache(maxsize=4096)
def key_accepted(text: str) -> bool:
    """True when MLflow accepts ``text`` as a metric, param and tag key.

    Uses MLflow's own checks: ``_validate_metric_name``, ``_validate_param_name`` and
    ``_validate_tag_name`` (allowed characters: letters, digits, ``_ - . / space`` and, except on
    Windows, ``:``; and the path rule that rejects a key ``posixpath.normpath`` would change, such
    as ``a/../b``, ``a//b``, ``/a``, ``a/``, ``.`` or one starting with ``..``), and
    ``_validate_length_limit`` with ``MAX_ENTITY_KEY_LENGTH`` (250 characters).
    """
    if not isinstance(text, str):
        return False
    v = _validation()
    if v is None:  # pragma: no cover - a future MLflow
        norm = posixpath.normpath(text)
        return (bool(_FALLBACK_NAME_RE.match(text)) and norm == text and norm != "."
                and not norm.startswith(("..", "/")) and len(text) <= _FALLBACK_MAX_KEY)
    from mlflow.exceptions import MlflowException

    try:
        v._validate_metric_name(text)
        v._validate_param_name(text)
        v._validate_tag_name(text)
        v._validate_length_limit("key", v.MAX_ENTITY_KEY_LENGTH, text)
    except MlflowException:
        return False
    return True


@functools.lru_cache(maxsize=256)
def _char_allowed(char: str) -> bool:
    """True when MLflow allows ``char`` anywhere in a key (the character rule alone)."""
    v = _validation()
    if v is None:  # pragma: no cover - a future MLflow
        return bool(_FALLBACK_NAME_RE.match(char))
    return bool(v.validate_param_and_metric_name(char))


def _short_hash(text: str) -> str:
    return hashlib.sha1(text.encode("utf-8", "surrogatepass")).hexdigest()[:_HASH_CHARS]


def safe_key(text: str) -> str:
    """Return ``text`` if MLflow accepts it as a key, else a deterministic readable key it accepts.

    The mapping, applied only to keys MLflow rejects (see :func:`key_accepted`):

    ========================  ==========================================================
    in ``text``               in the key
    ========================  ==========================================================
    ``<=`` ``>=``             ``_le_`` ``_ge_``
    ``<`` ``>`` ``=``         ``_lt_`` ``_gt_`` ``_eq_``
    ``%``                     ``_pct_`` (``mfu(%)`` -> ``mfu_pct``)
    ``@``                     ``_at_`` (``team@lab`` -> ``team_at_lab``)
    ``+``                     ``_plus_`` (``c++`` -> ``c_plus_plus``)
    any other character       ``_`` (``x[0]`` -> ``x_0``, ``a,b`` -> ``a_b``)
    MLflow rejects
    ========================  ==========================================================

    Then: a run of underscores that contains a created one becomes one ``_`` (the user's own
    ``a__b`` is kept); created underscores at the start or end of the key or of a ``/`` segment are
    removed; empty, ``.`` and ``..`` segments are removed (``/a//b/`` -> ``a/b``, ``a/../b`` ->
    ``a/b``) and leading dots of a first segment that starts with ``..`` are removed. A key longer
    than ``MAX_ENTITY_KEY_LENGTH`` (250) is cut and ends in ``_`` plus the first 8 hex digits of
    the SHA-1 of ``text``, so distinct long keys stay distinct; a key that maps to nothing becomes
    ``key_<8 hex digits>``. The result is always accepted, hence ``safe_key(safe_key(x)) ==
    safe_key(x)``.

    Args:
        text: a key as the user or a config gave it.

    Returns:
        A key MLflow accepts, at most 250 characters, never empty.
    """
    text = str(text)
    if key_accepted(text):
        return text
    out = _map_characters(text)
    out = _fix_path(out)
    limit = _max_key_length()
    if len(out) > limit:
        out = out[:limit - 1 - _HASH_CHARS].rstrip("/_") + "_" + _short_hash(text)
    if not out or not key_accepted(out):
        out = "key_" + _short_hash(text)
    return out


def _map_characters(text: str) -> str:
    """Replace what MLflow rejects per the table of :func:`safe_key`; created ``_`` is ``_CREATED``."""
    parts: list[str] = []
    i = 0
    while i < len(text):
        for src, word in _WORDS:
            if text.startswith(src, i):
                parts.append(_CREATED + word + _CREATED)
                i += len(src)
                break
        else:
            ch = text[i]
            parts.append(ch if _char_allowed(ch) else _CREATED)
            i += 1
    mapped = "".join(parts)
    # a run of "_" holding a created one: one "_" if the user wrote one there, else one created mark
    return re.sub(f"[_{_CREATED}]*{_CREATED}[_{_CREATED}]*",
                  lambda m: "_" if "_" in m.group(0) else _CREATED, mapped)


def _fix_path(mapped: str) -> str:
    """Drop created marks at segment edges and the segments that would make MLflow resolve the key."""
    segments = [s.strip(_CREATED) for s in mapped.split("/")]
    segments = [s for s in segments if s not in ("", ".", "..")]
    while segments and segments[0].startswith(".."):
        segments[0] = segments[0].lstrip(".")
        if segments[0] in ("", "."):
            segments.pop(0)
    return "/".join(segments).replace(_CREATED, "_")


class Checked(NamedTuple):
    """One entry after checking: what to log, and what was changed, in words.

    Attributes:
        key: the key to log (mapped by :func:`safe_key` when needed), or None: drop the entry.
        value: the value to log: a float for a metric, a string for a tag or param.
        problems: one line per change, e.g. ``metric 'mfu(%)' renamed to 'mfu_pct'``; empty when
            the entry is logged exactly as given.
    """

    key: str | None
    value: float | str | None
    problems: tuple[str, ...]


def _show(text: str, limit: int = 80) -> str:
    """``repr`` of a key for a problem note, middle elided beyond ``limit`` characters."""
    if len(text) <= limit:
        return repr(text)
    return repr(text[:limit // 2] + "..." + text[-(limit // 2):]) + f" ({len(text)} characters)"


@functools.lru_cache(maxsize=4096)
def _checked_key(kind: str, key: str) -> tuple[str, tuple[str, ...]]:
    new = safe_key(key)
    return new, (() if new == key else (f"{kind} {_show(key)} renamed to {_show(new)}",))


def _key(kind: str, key) -> tuple[str | None, tuple[str, ...]]:
    if key is None:
        return None, (f"{kind} with key None dropped",)
    return _checked_key(kind, key if isinstance(key, str) else str(key))


def check_metric(key: str, value, step) -> Checked:
    """Check one metric point against MLflow's rules.

    NaN and +/-inf are valid MLflow metric values and pass unchanged (a diverged loss must show);
    SQL stores keep NaN and store +/-inf as +/-1.7976931348623157e308, the largest double.

    Args:
        key: the metric key; mapped with :func:`safe_key` when MLflow rejects it.
        value: a real number (int, float, numpy scalar, or anything ``float()`` takes except
            ``str``/``bytes``); ``None``, strings and bools are dropped.
        step: the MLflow step, an integer (an integral float such as ``3.0`` is taken as 3).

    Returns:
        :class:`Checked` with ``value`` a float, or ``key=None`` when the point is dropped.
    """
    new, problems = _key("metric", key)
    if new is None:
        return Checked(None, None, problems)
    number = None
    if value is not None and not isinstance(value, (bool, str, bytes)):
        try:
            number = float(value)
        except (TypeError, ValueError, OverflowError):
            pass
    if number is None:
        why = f"value of type {type(value).__name__} is not a real number"
    elif not _is_step(step):
        why = f"step of type {type(step).__name__} is not an integer"
    else:
        return Checked(new, number, problems)
    return Checked(None, None, problems + (f"metric {_show(str(key))} dropped: {why}",))


def _is_step(step) -> bool:
    if isinstance(step, bool):
        return False
    try:
        return int(step) == step
    except (TypeError, ValueError, OverflowError):
        return False


def _check_text(kind: str, key, value, limit_name: str, fallback_limit: int) -> Checked:
    new, problems = _key(kind, key)
    if new is None:
        return Checked(None, None, problems)
    text = value if isinstance(value, str) else str(value)
    limit = _limit(limit_name, fallback_limit)
    if len(text) > limit:
        problems += (f"{kind} {_show(new)} value shortened from {len(text)} to {limit} characters",)
        text = text[:limit]
    return Checked(new, text, problems)


def tag_value_limit() -> int:
    """The longest tag value MLflow accepts, in characters: ``mlflow.utils.validation.MAX_TAG_VAL_LENGTH``
    (8,000 on MLflow 2.x and 3.x; 8,000 when this MLflow lacks the constant)."""
    return _limit("MAX_TAG_VAL_LENGTH", 8000)


def check_tag(key: str, value) -> Checked:
    """Check one tag: key mapped with :func:`safe_key`, value ``str(value)`` cut to ``MAX_TAG_VAL_LENGTH`` (8000)."""
    return _check_text("tag", key, value, "MAX_TAG_VAL_LENGTH", 8000)


def check_param(key: str, value) -> Checked:
    """Check one param: key mapped with :func:`safe_key`, value ``str(value)`` cut to ``MAX_PARAM_VAL_LENGTH`` (6000)."""
    return _check_text("param", key, value, "MAX_PARAM_VAL_LENGTH", 6000)
