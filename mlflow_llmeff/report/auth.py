"""The efficiency page with MLflow's basic authentication: ``mlflow server --app-name llmeff-auth``.

MLflow's ``basic-auth`` is itself an ``mlflow.app`` (``mlflow.server.auth:create_app``), and a server
runs one ``--app-name``, so ``llmeff`` and ``basic-auth`` cannot both be chosen. This app is
``basic-auth`` with the efficiency pages layered on it:

* every MLflow endpoint is exactly what ``mlflow.server.auth.create_app`` makes of it (its before- and
  after-request hooks, its FastAPI permission middleware under uvicorn): nothing of it is changed;
* the pages (``/llmeff/...``, behind ``--static-prefix P`` ``P/llmeff/...``) are a second Flask app that
  MLflow's WSGI entry hands those paths to, so basic-auth's fail-closed net (a route it has no validator
  for answers 403 to every non-admin, ``MLFLOW_BASIC_AUTH_FAIL_CLOSED``, on by default) does not shut
  them for readers. That app authenticates each request with basic-auth's own function
  (``mlflow.server.auth.authenticate_request``: 401 with ``WWW-Authenticate`` without valid
  credentials) and reads only experiments the user may read, by the check MLflow's run search applies
  (``mlflow.server.auth.filter_experiment_ids``: admins read all; others need READ on the experiment,
  from a grant or the configured ``default_permission``): the list shows the readable experiments, an
  experiment's page and its figures answer 403 to a user who may not read it.

Configured as basic-auth is (``MLFLOW_AUTH_CONFIG_PATH``, ``MLFLOW_AUTH_ADMIN_PASSWORD``); users and
grants are managed with its API (``mlflow.server.auth.client.AuthServiceClient``).
"""

from __future__ import annotations

from mlflow_llmeff.report import server

__all__ = ["create_app", "readable", "setup_lock", "setup_lock_path"]


def readable(experiment_ids: list[str]) -> list[str]:
    """The ids of ``experiment_ids`` the current request's user may read, by MLflow basic-auth's check
    (``filter_experiment_ids``, the filter of its run search). Call inside an authenticated request."""
    from mlflow.server import auth

    return auth.filter_experiment_ids(list(experiment_ids))


def _authenticate():
    """Flask ``before_request`` of the pages: basic-auth's authentication, its 401 response when it fails."""
    from mlflow.server import auth
    from werkzeug.datastructures import Authorization
    from werkzeug.wrappers import Response

    result = auth.authenticate_request()
    if isinstance(result, Response):
        return result
    if not isinstance(result, Authorization):  # an authorization_function returning anything else: refuse
        return auth.make_forbidden_response()
    return None


def setup_lock_path() -> str:
    """The lock file of :func:`setup_lock`: one per basic-auth configuration (``MLFLOW_AUTH_CONFIG_PATH``),
    in the temporary folder."""
    import hashlib
    import os
    import tempfile

    key = hashlib.sha1(os.path.abspath(os.environ.get("MLFLOW_AUTH_CONFIG_PATH", "basic_auth.ini")).encode())
    return os.path.join(tempfile.gettempdir(), f"llmeff-auth-setup-{key.hexdigest()[:16]}.lock")


def setup_lock():
    """An exclusive lock (``fcntl.flock``) over basic-auth's set-up in this process.

    ``mlflow.server.auth.create_app`` migrates its user database and creates the admin user when
    each server worker starts; ``--workers 4`` ran it four times at once on one fresh database, and a
    worker died with ``sqlite3.OperationalError: table workspace_permissions already exists`` (1 start
    in 3 here, MLflow 3.17). Under the lock the workers set up one after another; the later ones find
    the tables made. Where ``fcntl`` is missing (not POSIX) it locks nothing."""
    import contextlib

    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def held():
        with open(setup_lock_path(), "a+") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    return held()


class _Mount:
    """WSGI: requests under ``root`` (``<static prefix>/llmeff``) to ``pages``, every other to ``mlflow``."""

    def __init__(self, mlflow, pages, root: str):
        self.mlflow, self.pages, self.root = mlflow, pages, root

    def __call__(self, environ, start_response):
        path = environ.get("PATH_INFO", "")
        ours = path == self.root or path.startswith(self.root + "/")
        return (self.pages if ours else self.mlflow)(environ, start_response)


def pages_app():
    """The Flask app of the efficiency pages with basic-auth's authentication and read permissions."""
    from flask import Flask

    pages = Flask("mlflow_llmeff.report.auth")
    pages.config["LLMEFF_READABLE"] = readable
    pages.before_request(_authenticate)
    server.register(pages)
    return pages


def create_app(app=None):
    """The ``mlflow.app`` factory ``llmeff-auth``: MLflow's basic-auth app with the efficiency pages.

    Args:
        app: MLflow's Flask app (default: ``mlflow.server.app``).

    Returns:
        What ``mlflow.server.auth.create_app`` returns for ``app`` (the Flask app, or under uvicorn
        MLflow's FastAPI app wrapping it), its WSGI entry now handing ``/llmeff/...`` to the pages.

    Raises:
        RuntimeError: this MLflow's basic-auth has no ``filter_experiment_ids`` (the permission check
            the pages use).
    """
    from mlflow.server import app as mlflow_app
    from mlflow.server import auth

    if not hasattr(auth, "filter_experiment_ids"):
        raise RuntimeError("llmeff-auth needs mlflow.server.auth.filter_experiment_ids (a newer MLflow)")
    app = app or mlflow_app
    with setup_lock():
        served = auth.create_app(app)
    app.wsgi_app = _Mount(app.wsgi_app, pages_app(), server.base())
    return served
