"""How long mlflow_llmeff waits on a tracking server: MLflow's request settings, the delivery wait, bounded calls.

Two bounds, documented in ``docs/training.md`` ("How long anything waits for the tracking server"):

* **One request** (made by the logger's delivery thread, never by a training step) is bounded by
  MLflow's own request settings, read by ``mlflow.utils.rest_utils.http_request`` at every
  request: ``MLFLOW_HTTP_REQUEST_TIMEOUT`` (seconds a connect or a read may take),
  ``MLFLOW_HTTP_REQUEST_MAX_RETRIES`` and ``MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR``. MLflow's defaults
  (120 s, 7 retries, factor 2) let one request against a server that accepts and never answers
  run for about 20 minutes; :func:`apply_request_settings` sets :data:`REQUEST_DEFAULTS` instead,
  for every variable the user has not set, so an outage is noticed in about half a minute.
* **The process** waits for the server only at stated points (the creation of a new run, before
  a checkpoint counts as written, the end of the run) and at each for at most the delivery wait
  :func:`delivery_wait_s` (``LLMEFF_DELIVERY_WAIT_S``, default 30 s) without an answer; what is
  not delivered by then waits in the outbox (:mod:`mlflow_llmeff.tracking.outbox`).

:func:`bounded` runs one call on a daemon thread and stops waiting for it after a timeout (the
call itself is abandoned, never joined), for the few reads a process needs before it can go on;
:func:`call` is one such call against the current store (direct for a local store), turning a server
that does not answer, or fails without refusing the request itself, into :class:`Unreachable`: one
line naming the server and the bound, which ``llmeff compare`` and ``llmeff study`` print as their
``Error:`` line. :class:`BoundedReads` is a client whose every read is such a call (the reads of
``llmeff compare`` and of the study's summary).
"""

from __future__ import annotations

import os
import threading

__all__ = ["REQUEST_DEFAULTS", "WAIT_ENV", "DEFAULT_WAIT_S", "NoAnswer", "Unreachable", "apply_request_settings",
           "request_settings", "request_bound_s", "delivery_wait_s", "is_server", "bounded", "call", "BoundedReads", "bounded_reads"]

#: MLflow's request settings as mlflow_llmeff sets them unless the environment already does:
#: a connect or read may take 10 s, a request is tried 3 times, backoff 1 s x 2^(retry-1).
REQUEST_DEFAULTS = {"MLFLOW_HTTP_REQUEST_TIMEOUT": "10", "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
                    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1"}
#: MLflow's own defaults (mlflow/environment_variables.py), for the bound when a variable is unset.
_MLFLOW_DEFAULTS = {"MLFLOW_HTTP_REQUEST_TIMEOUT": 120.0, "MLFLOW_HTTP_REQUEST_MAX_RETRIES": 7.0,
                    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": 2.0, "MLFLOW_HTTP_REQUEST_BACKOFF_JITTER": 1.0}
#: urllib3's cap on one backoff sleep (``Retry.DEFAULT_BACKOFF_MAX``), seconds.
_BACKOFF_MAX_S = 120.0

WAIT_ENV = "LLMEFF_DELIVERY_WAIT_S"
DEFAULT_WAIT_S = 30.0


class NoAnswer(TimeoutError):
    """The tracking server did not answer within the wait (the message says which call and how long)."""


class Unreachable(ConnectionError):
    """The tracking server did not answer a call within the delivery wait, or failed without refusing the
    request itself (connection refused, a 5xx answer after MLflow's retries). The message is one line
    naming the server (no credential) and the bound; ``one_line`` marks it as the line to print."""

    one_line = True

#: MLflow error codes that say the request is wrong, not that the server is away: raised as they are.
REFUSALS = frozenset({"INVALID_PARAMETER_VALUE", "BAD_REQUEST", "PERMISSION_DENIED", "UNAUTHENTICATED",
                      "RESOURCE_DOES_NOT_EXIST", "RESOURCE_ALREADY_EXISTS"})


def apply_request_settings() -> dict[str, str]:
    """Set :data:`REQUEST_DEFAULTS` in ``os.environ`` for each variable not set yet; returns the effective values.

    MLflow reads these variables at every request (``http_request``), so setting them after
    ``import mlflow`` takes effect for the next request. A value the user set is kept.
    """
    for name, value in REQUEST_DEFAULTS.items():
        os.environ.setdefault(name, value)
    return request_settings()


def request_settings() -> dict[str, str]:
    """The request settings in effect (``os.environ``, else MLflow's defaults), by variable name."""
    return {name: os.environ.get(name, _fmt(default)) for name, default in _MLFLOW_DEFAULTS.items()}


def _fmt(x: float) -> str:
    return f"{x:g}"


def request_bound_s(settings: dict[str, str] | None = None) -> float:
    """Worst-case seconds one MLflow HTTP request can take under ``settings`` (default: in effect).

    ``(retries + 1)`` attempts, each at most a connect and a read of ``timeout`` seconds, plus the
    sleeps between them: urllib3 sleeps 0 before the first retry and ``factor * 2^(k-1)`` (at most
    120 s) plus up to ``jitter`` seconds before retry ``k >= 2`` (``urllib3.util.Retry.get_backoff_time``).
    With :data:`REQUEST_DEFAULTS`: 3 x 2 x 10 + (2 + 1) = 63 s; against a server that accepts the
    connection and never answers (the connect is immediate) about 3 x 10 + 3 = 33 s.
    """
    s = settings or request_settings()
    timeout = float(s["MLFLOW_HTTP_REQUEST_TIMEOUT"])
    retries = int(float(s["MLFLOW_HTTP_REQUEST_MAX_RETRIES"]))
    factor = float(s["MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR"])
    jitter = float(s["MLFLOW_HTTP_REQUEST_BACKOFF_JITTER"])
    sleeps = sum(min(_BACKOFF_MAX_S, factor * 2 ** (k - 1)) + jitter for k in range(2, retries + 1))
    return (retries + 1) * 2 * timeout + sleeps


def delivery_wait_s() -> float:
    """``LLMEFF_DELIVERY_WAIT_S`` (default 30): seconds the process waits for an unanswered tracking server.

    Raises:
        ValueError: when the variable is not a number >= 0.
    """
    raw = os.environ.get(WAIT_ENV, "")
    try:
        value = float(raw) if raw.strip() else DEFAULT_WAIT_S
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise ValueError(f"{WAIT_ENV}={raw!r} is not accepted; give seconds >= 0 (default {DEFAULT_WAIT_S:g})")
    return value


def is_server(tracking_uri: str | None) -> bool:
    """True for a tracking server reached over HTTP (``http://``, ``https://``, ``databricks``), whose
    calls can hang; a local store (``sqlite:``, a file path, a database URI) is called directly."""
    uri = (tracking_uri or "").lower()
    return uri.startswith(("http://", "https://", "databricks"))


def bounded(fn, timeout_s: float, what: str):
    """``fn()`` on a daemon thread; its result, or its exception re-raised, within ``timeout_s`` seconds.

    Raises:
        NoAnswer: ``fn`` did not return within ``timeout_s`` (it goes on alone; nothing waits for it).
    """
    box: dict = {}
    done = threading.Event()

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            box["error"] = e
        finally:
            done.set()

    threading.Thread(target=run, name="llmeff-bounded", daemon=True).start()
    if not done.wait(timeout_s):
        raise NoAnswer(f"the tracking server did not answer {what} within {timeout_s:g} s ({WAIT_ENV})")
    if "error" in box:
        raise box["error"]
    return box.get("value")


def _server_name(uri: str | None) -> str:
    from mlflow_llmeff.tracking.redact import strip_uri_secrets

    return strip_uri_secrets(uri or "")


def call(fn, what: str, *, uri: str | None = None, wait_s: float | None = None):
    """``fn()``, one call of the tracking store at ``uri`` (default: MLflow's current tracking URI):
    directly for a local store; for a tracking server within ``wait_s`` seconds (default
    :func:`delivery_wait_s`), MLflow's request settings applied first (:func:`apply_request_settings`).

    Raises:
        Unreachable: the server did not answer ``what`` within ``wait_s`` (``fn`` goes on alone), or
            failed without refusing the request (the message names the server, ``what`` and the bound).
        Exception: what ``fn`` raises otherwise (a refusal: an error code of :data:`REFUSALS`; any error
            of a local store).
    """
    if uri is None:
        import mlflow

        uri = mlflow.get_tracking_uri()
    if not is_server(uri):
        return fn()
    apply_request_settings()
    wait = delivery_wait_s() if wait_s is None else float(wait_s)
    server = _server_name(uri)
    try:
        return bounded(fn, wait, what)
    except NoAnswer:
        raise Unreachable(f"the tracking server {server} did not answer {what} within {wait:g} s "
                          f"({WAIT_ENV})") from None
    except Exception as e:  # noqa: BLE001
        if getattr(e, "error_code", None) in REFUSALS or isinstance(e, Unreachable):
            raise
        from mlflow_llmeff.names import shorten

        text = str(getattr(e, "message", None) or e).strip()
        if "Connection refused" in text or isinstance(e, ConnectionRefusedError):
            first = "connection refused"  # MLflow's message is a page of urllib3's retry text
        elif "Max retries exceeded" in text:
            first = "no answer after MLflow's retries"
        else:
            first = f"{type(e).__name__}: {shorten((text.splitlines() or [''])[0], 200)}"
        raise Unreachable(f"the tracking server {server} did not answer {what} ({first}; each call waits at "
                          f"most {wait:g} s, {WAIT_ENV})") from None


def bounded_reads(client):
    """``client`` as :class:`BoundedReads` when it is an ``MlflowClient`` of a tracking server (it says
    its ``tracking_uri``); anything else (a local store, a server's own tracking store) as it is."""
    uri = getattr(client, "tracking_uri", None)
    if isinstance(client, BoundedReads) or not isinstance(uri, str) or not is_server(uri):
        return client
    return BoundedReads(client, uri)


class BoundedReads:
    """An ``MlflowClient`` whose every method call is one :func:`call` (bounded for a tracking server);
    once one did not answer, every later call raises :class:`Unreachable` at once, so a run of reads
    against a server that is away costs one wait, not one per read. Attributes that are not methods
    are the client's."""

    def __init__(self, client, uri: str | None = None, wait_s: float | None = None) -> None:
        tracking = getattr(client, "tracking_uri", None)  # an MlflowClient's; a tracking store has none
        self.client, self.uri = client, uri or (tracking if isinstance(tracking, str) else None)
        self.wait_s = wait_s
        self.down: Unreachable | None = None

    def __getattr__(self, name):
        attr = getattr(self.client, name)
        if not callable(attr):
            return attr

        def bounded_call(*args, **kwargs):
            if self.down is not None:
                raise self.down
            try:
                return call(lambda: attr(*args, **kwargs), f"a {name} request", uri=self.uri, wait_s=self.wait_s)
            except Unreachable as e:
                self.down = e
                raise

        return bounded_call

