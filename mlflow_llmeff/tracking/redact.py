"""Secrets never reach a run: values of secret-looking names masked, URI user-info removed.

Applied by :class:`~mlflow_llmeff.tracking.logger.RunLogger` to every tag and param it sends, and
by anything that writes a report artifact. Three rules:

1. A tag or param whose *name* looks like a secret (a ``token``, ``secret``, ``password``,
   ``credential`` or ``auth`` word, or an ``api``/``access``/``secret``/``private`` ``key``) is
   recorded as ``***``. ``tokenizer`` or ``global_batch_tokens`` are not secret words.
2. Any value of an environment variable with such a name (at least 8 characters long, so ``1``
   or ``true`` never match) is replaced by ``***`` wherever it appears in a value.
3. URIs lose their user-info (``https://user:pass@host/x`` becomes ``https://host/x``) and the
   values of secret-looking query parameters (``?token=...``, ``&sig=...``) become ``***``.
"""

from __future__ import annotations

import functools
import os
import re
import shlex

MASK = "***"
_SECRET_WORDS = frozenset({"token", "secret", "secrets", "password", "passwd", "pwd", "passphrase",
                           "credential", "credentials", "auth", "apikey", "bearer", "cookie"})
_KEY_OWNERS = frozenset({"api", "access", "secret", "private", "auth", "ssh", "license", "signing", "encryption"})
_WORD_SPLIT = re.compile(r"[^A-Za-z0-9]+|(?<=[a-z])(?=[A-Z])")
_USERINFO = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.\-]*://)(?P<userinfo>[^/?#@\s]+)@")
_SECRET_QUERY = re.compile(r"(?P<name>[?&](?:[A-Za-z0-9_.\-]*?)(?:token|key|secret|password|passwd|sig|signature|"
                           r"credential|auth)[A-Za-z0-9_.\-]*=)(?P<value>[^&#\s]+)", re.IGNORECASE)
_MIN_SECRET_LEN = 8


def secret_name(name: str) -> bool:
    """True when ``name`` (an env var, param or tag key) looks like it holds a secret.

    >>> [secret_name(n) for n in ("HF_TOKEN", "AWS_SECRET_ACCESS_KEY", "api_key", "tokenizer", "train/tokens")]
    [True, True, True, False, False]
    """
    return _secret_name(name)


@functools.lru_cache(maxsize=4096)
def _secret_name(name: str) -> bool:
    """:func:`secret_name`, remembered per name (the page masks 10,000 runs' tags: a few keys, each once)."""
    words = [w.lower() for w in _WORD_SPLIT.split(name) if w]
    for i, w in enumerate(words):
        if w in _SECRET_WORDS:
            return True
        if w == "key" and i > 0 and words[i - 1] in _KEY_OWNERS:
            return True
        if w.endswith("apikey") or w.endswith("accesskey") or w.endswith("secretkey"):
            return True
    return False


def environment_secrets(environ=None) -> list[str]:
    """Values of environment variables with secret-looking names, longest first (8+ characters)."""
    env = os.environ if environ is None else environ
    vals = {v for k, v in env.items() if secret_name(k) and v and len(v) >= _MIN_SECRET_LEN}
    return sorted(vals, key=len, reverse=True)


def strip_uri_secrets(text: str) -> str:
    """``text`` with every URI's user-info removed and secret-looking query values masked.

    >>> strip_uri_secrets("https://alice:s3cret@mlflow.example.com/api?token=abc&x=1")
    'https://mlflow.example.com/api?token=***&x=1'
    """
    if "://" not in text and "=" not in text:
        return text
    text = _USERINFO.sub(lambda m: m.group("scheme"), text)
    return _SECRET_QUERY.sub(lambda m: m.group("name") + MASK, text)


#: What a printed command holds in place of a store URI that carries a credential (:func:`store_arg`).
UNPRINTED_STORE = "<this store's URI: not printed, it holds a credential>"


def store_arg(uri: str) -> str:
    """``uri`` as one shell word for a command printed to a terminal or a job's log (``shlex.quote``), or
    :data:`UNPRINTED_STORE` where it carries a credential (user-info or a secret query value, which
    :func:`strip_uri_secrets` would remove): a printed command never holds one, and a stripped URI would
    name a store the command cannot open. A local store given by a relative path (``sqlite:///m.db``,
    ``mlruns``) is printed with the absolute path it resolves to from this process's folder, so the
    command works from any folder (a trial's printed ``sqlite:///mlflow.db`` opened an empty store
    elsewhere).

    >>> store_arg("sqlite:////tmp/m.db"), store_arg("sqlite:////tmp/my runs/m.db")
    ('sqlite:////tmp/m.db', "'sqlite:////tmp/my runs/m.db'")
    >>> store_arg("postgresql://alice:s3cret@db:5432/mlflow") == UNPRINTED_STORE
    True
    """
    if strip_uri_secrets(uri) != uri:
        return UNPRINTED_STORE
    return shlex.quote(absolute_store(uri))


#: tracking URIs MLflow takes without a scheme that are not paths
_SCHEMELESS = ("databricks", "databricks-uc", "uc")


def absolute_store(uri: str, cwd: str | None = None) -> str:
    """``uri`` with a relative local path made absolute against ``cwd`` (default: this process's folder):
    ``sqlite:///m.db`` -> ``sqlite:////<cwd>/m.db`` (SQLAlchemy: three slashes then a relative path, four
    an absolute one), a bare path (MLflow's file store) -> its absolute path; any other URI as given
    (``sqlite:///:memory:``, ``databricks`` included)."""
    base = cwd or os.getcwd()
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        path, q, query = uri[len("sqlite:///"):].partition("?")
        if path and path != ":memory:":
            return "sqlite:///" + os.path.normpath(os.path.join(base, path)) + q + query
        return uri
    if uri and ":" not in uri and uri not in _SCHEMELESS:  # a bare path: MLflow's file store
        return os.path.normpath(os.path.join(base, uri))
    return uri


def clean(key: str, value: str, secrets: list[str] | None = None) -> str:
    """The value to record for tag or param ``key``: masked when the key looks secret, else ``value``
    with environment secrets masked and URIs stripped of user-info.

    Args:
        key: the tag or param name.
        value: its value, as a string.
        secrets: secret values to mask (default: :func:`environment_secrets` now).
    """
    if secret_name(key):
        return MASK if value else value
    for s in environment_secrets() if secrets is None else secrets:
        if s in value:
            value = value.replace(s, MASK)
    return strip_uri_secrets(value)


def clean_obj(obj, secrets: list[str] | None = None):
    """A copy of a JSON-like ``obj`` (dicts, lists, strings) with :func:`clean` applied to every string,
    keyed by its dict key where there is one; for report artifacts."""
    secrets = environment_secrets() if secrets is None else secrets
    if isinstance(obj, dict):
        return {k: (clean(str(k), v, secrets) if isinstance(v, str) else clean_obj(v, secrets)) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [clean_obj(v, secrets) for v in obj]
    if isinstance(obj, str):
        return clean("", obj, secrets)
    return obj
