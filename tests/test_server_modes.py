"""The efficiency page in the server modes teams deploy, against real ``mlflow server`` processes.

First, in this process (fast): the pages' permission hook and figure keys. Then (slow) one module
fixture starts three servers at once over one SQLite store holding the five standard runs (``five``)
and a second experiment (``secret``):

* ``plain``: ``--app-name llmeff --workers 4 --static-prefix /mlflow --allowed-hosts ...`` (uvicorn);
* ``auth``: ``--app-name llmeff-auth --workers 4`` (MLflow basic-auth with the pages, report/auth.py), default
  permission NO_PERMISSIONS, user ``reader`` granted READ on ``five``, user ``nobody`` no grant;
* ``gunicorn``: ``--app-name llmeff --workers 2 --gunicorn-opts ...`` (two gunicorn workers).
"""

from __future__ import annotations

import base64
import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from conftest import stop_process_group

CHROMIUM = "/usr/bin/chromium"
ADMIN = ("admin", "admin-pass-8c1f2e")
READER = ("reader", "reader-pass-41d07a")
NOBODY = ("nobody", "nobody-pass-9e33b5")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _http(url: str, *, user=None, method: str = "GET", body=None, host: str | None = None):
    """``(status, content type, body bytes)`` of one request (each its own connection)."""
    req = urllib.request.Request(url, method=method, data=None if body is None else json.dumps(body).encode())
    if body is not None:
        req.add_header("Content-Type", "application/json")
    if user:
        req.add_header("Authorization", "Basic " + base64.b64encode(f"{user[0]}:{user[1]}".encode()).decode())
    if host:
        req.add_header("Host", host)
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.headers.get("Content-Type", ""), r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("Content-Type", ""), e.read()


def _stop(proc) -> None:
    stop_process_group(proc)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """``(folder, store URI, client, {"five": id, "secret": id})``: one SQLite store of the five standard
    runs, twice, shared by every test of the file."""
    import mlflow

    from five_runs import log_five_runs

    root = tmp_path_factory.mktemp("modes")
    db = f"sqlite:///{root / 'mlflow.db'}"
    client = mlflow.MlflowClient(db)
    five, _ = log_five_runs(client, "five")
    secret, _ = log_five_runs(client, "secret")
    return root, db, client, {"five": five, "secret": secret}


@pytest.fixture(scope="module")
def five_app(store):
    """``(Flask app with the pages, experiment id of five)`` over the store, in this process."""
    import tempfile

    from flask import Flask

    from mlflow_llmeff.report import server as srv

    root, _, client, exps = store
    exp_id = exps["five"]
    mp = pytest.MonkeyPatch()
    mp.setattr(tempfile, "tempdir", str(root / "tmp"))
    (root / "tmp").mkdir()
    mp.setattr(srv, "_store", lambda: client)
    app = Flask("t")
    srv.register(app)
    yield app, exp_id
    mp.undo()


def test_a_figure_key_that_is_not_the_experiments_run_set_is_never_drawn(five_app):
    import glob
    import tempfile

    app, exp_id = five_app
    key = f"{exp_id}-{'0' * 20}"  # names the experiment, but not its run set's digest
    status = app.test_client().get(f"/llmeff/figures/{key}/loss?experiment={exp_id}").status_code
    assert status == 404
    assert not glob.glob(f"{tempfile.gettempdir()}/llmeff-figures-*/{key}.pkl")
    assert app.test_client().get(f"/llmeff/figures/{'0' * 20}/loss?experiment={exp_id}").status_code == 404


def test_basic_auths_set_up_runs_under_one_lock_per_configuration(tmp_path, monkeypatch):
    """Four workers set basic-auth up at once on one fresh user database (a worker died: table already
    exists): ``create_app`` holds an exclusive lock, per ``MLFLOW_AUTH_CONFIG_PATH``, over it."""
    import fcntl

    from flask import Flask
    from mlflow.server import auth as mlflow_auth

    from mlflow_llmeff.report import auth

    monkeypatch.setenv("MLFLOW_AUTH_CONFIG_PATH", str(tmp_path / "a.ini"))
    path = auth.setup_lock_path()
    monkeypatch.setenv("MLFLOW_AUTH_CONFIG_PATH", str(tmp_path / "b.ini"))
    assert auth.setup_lock_path() != path  # another configuration, another lock
    monkeypatch.setenv("MLFLOW_AUTH_CONFIG_PATH", str(tmp_path / "a.ini"))
    seen = []

    def fake_create_app(app):
        with open(path, "a+") as other:  # a second worker's attempt, from another open file
            try:
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
                seen.append("free")
                fcntl.flock(other, fcntl.LOCK_UN)
            except BlockingIOError:
                seen.append("held")
        return app

    monkeypatch.setattr(mlflow_auth, "create_app", fake_create_app)
    app = Flask("t")
    assert auth.create_app(app) is app
    assert seen == ["held"]
    with open(path, "a+") as after:  # released once set up
        fcntl.flock(after, fcntl.LOCK_EX | fcntl.LOCK_NB)


def test_the_pages_apply_the_permission_check_the_app_holds(five_app):
    app, exp_id = five_app
    web = app.test_client()
    page = web.get(f"/llmeff/experiments/{exp_id}").get_data(as_text=True)
    figure = _figure_urls(page.encode())[0].replace("&amp;", "&")
    app.config["LLMEFF_READABLE"] = lambda ids: []
    try:
        assert web.get(f"/llmeff/experiments/{exp_id}").status_code == 403
        assert web.get(figure).status_code == 403
        assert f"/llmeff/experiments/{exp_id}'" not in web.get("/llmeff/").get_data(as_text=True)
    finally:
        app.config["LLMEFF_READABLE"] = None
    assert web.get(figure).status_code == 200
    assert f"/llmeff/experiments/{exp_id}'" in web.get("/llmeff/").get_data(as_text=True)


@pytest.fixture(scope="module")
def servers(store):
    """``{mode: (url, experiment ids by name)}`` of the three servers, started together, killed at the end."""
    from importlib.metadata import entry_points

    if "llmeff-auth" not in {e.name for e in entry_points(group="mlflow.app")}:
        pytest.fail("the mlflow.app entry point llmeff-auth is not registered: pip install -e . (pyproject.toml)")
    try:
        import flask_wtf  # noqa: F401 - MLflow's basic-auth app needs it
    except ImportError:
        pytest.fail("Flask-WTF missing: pip install 'mlflow[auth]' (in the dev extra of pyproject.toml)")
    root, db, _, exps = store
    five, secret = exps["five"], exps["secret"]
    ini = root / "auth.ini"
    ini.write_text(f"[mlflow]\ndefault_permission = NO_PERMISSIONS\ndatabase_uri = sqlite:///{root / 'auth.db'}\n"
                   f"admin_username = {ADMIN[0]}\n"
                   "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n")
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", "MLFLOW_AUTH_CONFIG_PATH": str(ini),
           "MLFLOW_AUTH_ADMIN_PASSWORD": ADMIN[1], "MLFLOW_FLASK_SERVER_SECRET_KEY": "llmeff-test-secret"}
    modes = {"plain": ["--app-name", "llmeff", "--workers", "4", "--static-prefix", "/mlflow",
                       "--allowed-hosts", "127.0.0.1:*,localhost:*"],
             "auth": ["--app-name", "llmeff-auth", "--workers", "4"],
             # MLflow puts its own -w <--workers> after the --gunicorn-opts: workers go in --workers
             "gunicorn": ["--app-name", "llmeff", "--workers", "2", "--gunicorn-opts", "--timeout 120"]}
    procs, urls = {}, {}
    for mode, args in modes.items():
        port = _free_port()
        log = open(root / f"{mode}.log", "w")
        procs[mode] = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--backend-store-uri", db,
                                        "--host", "127.0.0.1", "--port", str(port), *args],
                                       cwd=root, stdout=log, stderr=subprocess.STDOUT, env=env,
                                       start_new_session=True)
        urls[mode] = f"http://127.0.0.1:{port}" + ("/mlflow" if mode == "plain" else "")
    try:
        deadline = time.time() + 180
        for mode, proc in procs.items():
            while not _up(urls[mode]):
                if proc.poll() is not None or time.time() > deadline:
                    pytest.fail(f"{mode} server did not start: {(root / f'{mode}.log').read_text()[-3000:]}")
                time.sleep(0.5)
        # four workers set basic-auth up on one fresh user database: none may die doing it
        assert "Traceback" not in (root / "auth.log").read_text(), (root / "auth.log").read_text()[-3000:]
        api = urls["auth"] + "/api/2.0/mlflow/users/create"
        for user in (READER, NOBODY):
            assert _http(api, user=ADMIN, method="POST", body={"username": user[0], "password": user[1]})[0] == 200
        grant = {"username": READER[0], "resource_type": "experiment", "resource_id": five, "permission": "READ"}
        status, _, text = _http(urls["auth"] + "/api/3.0/mlflow/users/permissions/grant", user=ADMIN, method="POST",
                                body=grant)
        assert status == 200, text
        yield {mode: (url, {"five": five, "secret": secret}) for mode, url in urls.items()}
    finally:
        for proc in procs.values():
            _stop(proc)


def _up(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2):
            return True
    except (OSError, urllib.error.HTTPError):
        return False


def _figure_urls(page: bytes) -> list[str]:
    return re.findall(r"<img[^>]* src=['\"]([^'\"]+)['\"]", page.decode())


def _origin(url: str) -> str:
    return re.match(r"https?://[^/]+", url).group(0)


@pytest.mark.slow
def test_workers_4_every_figure_url_answers_200_on_every_request(servers):
    url, exps = servers["plain"]
    status, _, page = _http(f"{url}/llmeff/experiments/{exps['five']}")
    assert status == 200
    figures = _figure_urls(page)
    assert len(figures) >= 5, page.decode()[:2000]
    for _ in range(3):  # separate connections, spread over the four workers
        for src in figures:
            status, kind, body = _http(_origin(url) + src.replace("&amp;", "&"))
            assert (status, kind, body[:8]) == (200, "image/png", b"\x89PNG\r\n\x1a\n"), src


@pytest.mark.slow
def test_static_prefix_page_links_and_images_carry_the_prefix(servers):
    url, exps = servers["plain"]
    _, _, listing = _http(f"{url}/llmeff/")
    assert f"href='/mlflow/llmeff/experiments/{exps['five']}'" in listing.decode()
    assert f"href='/mlflow/#/experiments/{exps['five']}/runs?" in listing.decode()
    _, _, page = _http(f"{url}/llmeff/experiments/{exps['five']}")
    text = page.decode()
    figures = _figure_urls(page)
    assert figures and all(src.startswith("/mlflow/llmeff/figures/") for src in figures)
    assert f"action='/mlflow/llmeff/experiments/{exps['five']}'" in text
    assert re.findall(r"href='(/[^']*)'", text) and all(h.startswith("/mlflow/") for h in re.findall(r"href='(/[^']*)'", text))
    assert _http(_origin(url) + f"/llmeff/experiments/{exps['five']}")[0] == 404  # not outside the prefix
    # MLflow's REST API is under the prefix too: MLFLOW_TRACKING_URI carries it (README)
    assert _http(f"{url}/api/2.0/mlflow/experiments/get?experiment_id={exps['five']}")[0] == 200


@pytest.mark.slow
def test_allowed_hosts_refuses_another_host_header_on_the_page(servers):
    url, exps = servers["plain"]
    assert _http(f"{url}/llmeff/experiments/{exps['five']}", host="evil.example")[0] == 403
    assert _http(f"{url}/llmeff/experiments/{exps['five']}", host="localhost:5000")[0] == 200


@pytest.mark.slow
def test_gunicorn_serves_the_page_and_its_figures(servers):
    url, exps = servers["gunicorn"]
    status, _, page = _http(f"{url}/llmeff/experiments/{exps['five']}")
    assert status == 200
    src = _figure_urls(page)[0].replace("&amp;", "&")
    assert _http(url + src)[:2] == (200, "image/png")


@pytest.mark.slow
def test_auth_unauthenticated_request_is_refused_with_401(servers):
    url, exps = servers["auth"]
    for path in ("/llmeff/", f"/llmeff/experiments/{exps['five']}"):
        assert _http(url + path)[0] == 401
    assert _http(url + f"/llmeff/experiments/{exps['five']}", user=(READER[0], "wrong"))[0] == 401
    assert _http(url + "/api/2.0/mlflow/experiments/search?max_results=10")[0] == 401  # MLflow's own API too


@pytest.mark.slow
def test_auth_user_without_read_permission_is_refused_the_page_and_its_figures(servers):
    url, exps = servers["auth"]
    _, _, page = _http(url + f"/llmeff/experiments/{exps['five']}", user=READER)
    figure = _figure_urls(page)[0].replace("&amp;", "&")
    assert _http(url + f"/llmeff/experiments/{exps['five']}", user=NOBODY)[0] == 403
    assert _http(url + figure, user=NOBODY)[0] == 403
    _, _, listing = _http(url + "/llmeff/", user=NOBODY)
    assert "/llmeff/experiments/" not in listing.decode()
    assert _http(url + f"/llmeff/experiments/{exps['secret']}", user=READER)[0] == 403


@pytest.mark.slow
def test_auth_reader_and_admin_see_what_they_may_read(servers):
    url, exps = servers["auth"]
    status, _, page = _http(url + f"/llmeff/experiments/{exps['five']}", user=READER)
    assert status == 200 and "<table id='runs'" in page.decode().replace('"', "'")
    figure = _figure_urls(page)[0].replace("&amp;", "&")
    assert _http(url + figure, user=READER)[:2] == (200, "image/png")
    listed = re.findall(r"/llmeff/experiments/(\d+)'", _http(url + "/llmeff/", user=READER)[2].decode())
    assert listed == [exps["five"]]
    listed = re.findall(r"/llmeff/experiments/(\d+)'", _http(url + "/llmeff/", user=ADMIN)[2].decode())
    assert {exps["five"], exps["secret"]} <= set(listed)  # and MLflow's Default experiment
    assert _http(url + f"/llmeff/experiments/{exps['secret']}", user=ADMIN)[0] == 200


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["auth", "plain"])  # basic-auth; 4 uvicorn workers behind /mlflow (both 4 workers)
def test_the_page_in_chromium_shows_the_headline_table(servers, tmp_path, mode):
    if not os.path.exists(CHROMIUM):
        if os.environ.get("CI"):
            pytest.fail(f"{CHROMIUM} missing: .ci/run installs Debian's chromium package")
        pytest.skip(f"{CHROMIUM} missing (apt-get install chromium)")
    from playwright.sync_api import sync_playwright

    url, exps = servers[mode]
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            context = browser.new_context(**({"http_credentials": {"username": READER[0], "password": READER[1]}}
                                             if mode == "auth" else {}))
            page = context.new_page()
            response = page.goto(f"{url}/llmeff/experiments/{exps['five']}", wait_until="load")
            assert response.status == 200
            page.wait_for_function("Array.from(document.images).every(i => i.complete)", timeout=120_000)
            shot = page.screenshot(path=str(tmp_path / f"{mode}-page.png"), full_page=True)
            # where the best configuration's name and the first figure sit on the page (CSS pixels, scale 1)
            boxes = page.evaluate("""[document.querySelector('table#headline tbody tr td'), document.images[0]]
                .map(e => { const r = e.getBoundingClientRect();
                            return [r.left + scrollX, r.top + scrollY, r.right + scrollX, r.bottom + scrollY]; })""")
            images = page.evaluate("Array.from(document.images).map(i => i.complete && i.naturalWidth > 0)")
            configs = page.locator("table#headline tbody tr td:first-child").all_inner_texts()
            verdicts = page.locator("table#headline tbody tr td:nth-child(5)").all_inner_texts()
            runs = page.locator("table#runs tbody tr").count()
        finally:
            browser.close()
    assert images and all(images)
    # the five runs' tokens/s per device (tests/five_runs.py): 47,500; 42,816 and 41,900 (repeats, mean
    # 42,358); 61,000 / 2 devices = 30,500; 1,950: best first
    assert configs == ["llama-tiny-cpu-1x-single-fp32-s128-gbt4096",
                       "llama-tiny-cpu-1x-single-fp32-s128-gbt1024 (+1 repeat)",
                       "llama-tiny-cpu-2x-ddp-fp32-s128-gbt2048", "llama-160m-cpu-1x-single-fp32-s128-gbt1024"]
    assert verdicts[0] == "best (2 within noise)" and verdicts[3] == "0.0411x best"
    assert runs == 5
    # what the screenshot shows, not only that one was written (its size > 0 could not fail): the best
    # configuration's cell holds drawn text, dark glyph pixels on a light cell (781 of 7,172 measured;
    # a cell made transparent, or text the colour of its background, leaves 0), and the first figure is a
    # drawn plot, 17% of it inked in about 950 colours (faded to 2% opacity: 0 inked, 45 colours). The DOM
    # checks above see neither fault: the text and a loaded image are there either way
    import io

    from PIL import Image

    page_png = Image.open(io.BytesIO(shot))
    assert page_png.size[0] >= boxes[1][2] and page_png.size[1] >= boxes[0][3]
    cell = list(page_png.convert("L").crop(tuple(round(v) for v in boxes[0])).getdata())
    dark, light = sum(v < 100 for v in cell), sum(v > 200 for v in cell)
    assert dark >= 50 and light > dark, (dark, light, len(cell))
    figure = list(page_png.convert("RGB").crop(tuple(round(v) for v in boxes[1])).getdata())
    inked = sum(min(px) < 200 for px in figure)  # axes, lines, labels: not the white of the canvas
    assert inked >= 0.01 * len(figure) and len(set(figure)) >= 50, (inked, len(figure), len(set(figure)))
