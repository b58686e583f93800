"""End to end against a real ``mlflow server --app-name llmeff`` on loopback (sqlite) holding a scaling sweep.

The sweep (``projects/scaling-sweep``, 1 and 2 CPU processes, a few steps) runs once per module, the way
README and docs/compare.md say: ``mlflow run projects/scaling-sweep --env-manager local`` from a folder
with ``MLFLOW_TRACKING_URI=sqlite:///mlflow.db`` and no ``OMP_NUM_THREADS``; that folder's store is the
server's. Its tests check what a fresh-user trial found broken (the relative store opened from the
project's folder, unequal threads per process, the report in the source tree); ``llmeff compare`` reads
it over HTTP; headless Chromium (Debian's package, driven by playwright) opens the HTML report and the
server's efficiency page.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from conftest import HEALTHY_SERVER_ENV, REPO, empty_store, stop_process_group

pytestmark = pytest.mark.slow
CHROMIUM = "/usr/bin/chromium"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """The folder of the server's store (``mlflow.db``), where the sweep is run from."""
    return tmp_path_factory.mktemp("server")


@pytest.fixture(scope="module")
def server(root):
    """``mlflow server --app-name llmeff`` over ``root/mlflow.db`` on a free loopback port; yields its URL,
    killed at the end."""
    port = _free_port()
    log = open(root / "server.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--app-name", "llmeff", "--backend-store-uri",
                             f"sqlite:///{root / 'mlflow.db'}", "--host", "127.0.0.1", "--port", str(port),
                             "--workers", "1"], cwd=root, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 180
    while True:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    break
        except OSError:
            pass
        if proc.poll() is not None or time.time() > deadline:
            _stop(proc)
            pytest.fail(f"mlflow server did not start: {(root / 'server.log').read_text()[-2000:]}")
        time.sleep(1)
    yield url
    _stop(proc)
    log.close()


def _stop(proc) -> None:
    """Stop the server and the workers it started (its own process group)."""
    stop_process_group(proc)


def _env(url: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_RUN_ID"}
    env.update(MLFLOW_TRACKING_URI=url, OMP_NUM_THREADS="1", CODECARBON_LOG_LEVEL="error", **HEALTHY_SERVER_ENV)
    return env


def _compare(url: str, *args: str):
    """``llmeff compare ARGS`` against the server at ``url``, over HTTP, run by click's test runner in this
    process: the command's own code, lines and exit code; a process of its own adds only an interpreter and
    its imports (mlflow, matplotlib, the report's modules). Returns click's ``Result`` (``exit_code``,
    ``stdout``, ``stderr``); the environment the command changes (its request settings) and MLflow's URI are
    put back after it."""
    from unittest import mock

    import mlflow
    from click.testing import CliRunner

    from conftest import _restore_tracking_uri
    from mlflow_llmeff.cli import main

    restore = _restore_tracking_uri()
    try:
        with mock.patch.dict(os.environ, _env(url), clear=True):
            mlflow.set_tracking_uri(url)
            return CliRunner().invoke(main, ["compare", *args])
    finally:
        restore()


def _failed(r) -> str:
    """What a failed :func:`_compare` said: its last lines and the exception click's runner caught."""
    import traceback

    caught = "" if r.exception is None or isinstance(r.exception, SystemExit) else "".join(
        traceback.format_exception(r.exception))
    return (r.output + caught)[-3000:]


def _files_under(folder) -> set[str]:
    return {os.path.join(d, f) for d, _, files in os.walk(folder) for f in files if "__pycache__" not in d}


@pytest.fixture(scope="module")
def launch(server, root):
    """The scaling sweep at 1 and 2 CPU processes, run as documented from ``root`` with the relative store
    ``sqlite:///mlflow.db`` (the server's) and no ``OMP_NUM_THREADS``: ``(completed process, the files under
    projects/ before it)``."""
    before = _files_under(REPO / "projects")
    env = {k: v for k, v in _env(server).items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    env["MLFLOW_TRACKING_URI"] = "sqlite:///mlflow.db"
    r = subprocess.run([sys.executable, "-m", "mlflow", "run", str(REPO / "projects" / "scaling-sweep"),
                        "--env-manager", "local", "--experiment-name", "sweep",
                        "-P", "process_counts=1,2", "-P", "max_steps=8", "-P", "warmup_steps=2",
                        "-P", "log_every_n_steps=2", "-P", "seq_len=64", "-P", "val_blocks=4",
                        "-P", "device_hour_usd=1.0"],  # a price, so the cost Pareto front has points
                       cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    return r, before


@pytest.fixture(scope="module")
def sweep(server, launch):
    """The sweep read over HTTP: (parent run id, experiment id, client)."""
    import mlflow

    client = mlflow.MlflowClient(server)
    exp = client.get_experiment_by_name("sweep")
    parents = client.search_runs([exp.experiment_id], "tags.`mlflow.runName` LIKE 'scaling-sweep-%'")
    assert len(parents) == 1
    return parents[0].info.run_id, exp.experiment_id, client


def test_sweep_run_with_a_relative_store_logs_into_the_store_of_its_folder(sweep, launch):
    r, _ = launch
    parent, exp_id, client = sweep
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    assert client.get_run(parent).info.status == "FINISHED"
    children = client.search_runs([exp_id], f"tags.mlflow.parentRunId = '{parent}'")
    assert sorted(int(c.data.tags["llmeff.accelerator.count"]) for c in children) == [1, 2]
    assert all(c.info.status == "FINISHED" for c in children)


def test_sweep_runs_every_process_with_the_same_threads_and_gives_the_efficiency(sweep, launch, root, tmp_path):
    from mlflow_llmeff.evals.threads import usable_cpus

    r, _ = launch
    parent, exp_id, client = sweep
    children = client.search_runs([exp_id], f"tags.mlflow.parentRunId = '{parent}'")
    threads = {int(c.data.tags["llmeff.accelerator.count"]): c.data.tags["llmeff.threads"] for c in children}
    expected = max(1, usable_cpus()[0] // 2)  # no OMP_NUM_THREADS: the usable CPUs over the largest count
    assert threads[1] == threads[2]
    assert threads[1].startswith(f"intra-op {expected}, inter-op ")
    assert f"scaling-sweep: {expected} intra-op thread(s) in every process of every child" in r.stdout
    by_n = {int(c.data.tags["llmeff.accelerator.count"]): c.data.metrics["summary/tokens_per_sec"] for c in children}
    m = re.search(r"\(2 devices\) vs baseline .* \(1\): weak scaling efficiency ([0-9.e+-]+) ", r.stdout)
    assert m, r.stdout[-3000:]
    assert float(m.group(1)) == float(f"{by_n[2] / (by_n[1] * 2):.3g}")
    # logged: the parent's report holds the same figure
    text = open(client.download_artifacts(parent, "scaling-report/report.md", str(tmp_path))).read()
    assert m.group(1) in text.split("## Scaling efficiency")[1]


def test_sweep_writes_its_report_where_it_was_run_from_and_nothing_under_projects(launch, root):
    r, before = launch
    assert {"report.md", "report.csv", "report.html"} <= {p.name for p in (root / "scaling-report").iterdir()}
    assert f"scaling-sweep: report in {root / 'scaling-report'}" in r.stdout
    assert _files_under(REPO / "projects") == before


def test_compare_over_http_prints_scaling_efficiency_recomputed_from_the_runs(server, sweep, tmp_path):
    parent, exp_id, client = sweep
    children = client.search_runs([exp_id], f"tags.mlflow.parentRunId = '{parent}'")
    assert len(children) == 2
    by_n = {int(c.data.tags["llmeff.accelerator.count"]): c.data.metrics["summary/tokens_per_sec"] for c in children}
    expected = by_n[2] / (by_n[1] * 2 / 1)
    out = tmp_path / "rep"
    r = _compare(server, "--experiment", "sweep", "--filter", f"tags.mlflow.parentRunId = '{parent}'", "--out", str(out))
    assert r.exit_code == 0, _failed(r)
    m = re.search(r"\(2 devices\) vs baseline .* \(1\): weak scaling efficiency ([0-9.e+-]+) ", r.stdout)
    assert m, r.stdout
    assert float(m.group(1)) == pytest.approx(float(f"{expected:.3g}"), rel=0, abs=0)
    assert math.isfinite(expected) and expected > 0
    written = {p.name for p in out.iterdir()}
    assert {"report.md", "report.csv", "report.html", "tokens_per_device.png", "loss.png"} <= written
    assert (out / "report.csv").read_text().count("\n") == 3  # header + one row per run
    # the sweep logged the same comparison as the parent's artifacts
    assert "scaling-report/report.html" in [a.path for a in client.list_artifacts(parent, "scaling-report")]


def _chromium():
    if not os.path.exists(CHROMIUM):
        if os.environ.get("CI"):
            pytest.fail(f"{CHROMIUM} missing: .ci/run installs Debian's chromium package")
        pytest.skip(f"{CHROMIUM} missing (apt-get install chromium)")
    from playwright.sync_api import sync_playwright

    return sync_playwright


@pytest.fixture(scope="module")
def browser():
    """One headless Chromium (and playwright's driver) for the module's page tests, each of which opens its own
    page (a context of its own: no cache or storage shared); a start of both is set-up, 1.5 s of CPU (measured)."""
    sync_playwright = _chromium()
    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            yield chromium
        finally:
            chromium.close()


def _open(page, url: str) -> tuple[list, int]:
    page.goto(url, wait_until="load")
    page.wait_for_function("Array.from(document.images).every(i => i.complete)", timeout=180_000)
    images = page.evaluate("Array.from(document.images).map(i => [i.alt, i.complete && i.naturalWidth > 0])")
    return images, page.locator("table#runs tbody tr").count()


def test_html_report_and_server_page_render_in_chromium(server, sweep, tmp_path, browser):
    parent, exp_id, client = sweep
    n_runs = len(client.search_runs([exp_id]))  # both children and the parent (a marked row: no summary)
    out = tmp_path / "rep"
    r = _compare(server, "--experiment", "sweep", "--out", str(out))
    assert r.exit_code == 0, _failed(r)
    pngs = sorted(p.name for p in out.glob("*.png"))  # every figure the report drew is an <img> of the page
    shots = tmp_path / "shots"
    shots.mkdir()
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    try:
        page_url = f"{server}/llmeff/experiments/{exp_id}"
        _open(page, page_url)  # the first view starts the drawing; every image waits for it
        for name, url in (("report", (out / "report.html").as_uri()), ("server", page_url)):
            images, rows = _open(page, url)  # the second view of the page: the figures drawn, from the cache
            page.screenshot(path=str(shots / f"{name}.png"), full_page=True)
            assert len(images) == len(pngs) >= 5, (name, images, pngs)
            assert all(ok for _, ok in images), (name, images)
            assert rows == n_runs, (name, rows, n_runs)
        # a condition-tag filter on the server page keeps the matching runs only
        _, rows = _open(page, f"{server}/llmeff/experiments/{exp_id}?accelerator.count=2")
        assert rows == 1
    finally:
        page.close()
    assert (shots / "report.png").stat().st_size > 10_000 and (shots / "server.png").stat().st_size > 10_000
    keep = os.environ.get("LLMEFF_SCREENSHOT_DIR")
    if keep:
        shutil.copytree(shots, keep, dirs_exist_ok=True)


@pytest.mark.parametrize("query, status, line", [
    ("?filter=metrics.x%20%3E%3E%3E%201", 400, "bad filter 'metrics.x >>> 1': "),
    ("?precision=fp8", 400, "no run of experiment 'sweep' matches the filter"),
    # the page's baseline error is compare's, naming the run ids it accepts
    ("?baseline=deadbeef", 400, "--baseline 'deadbeef' is not among the compared runs; accepted: '"),
])
def test_server_page_bad_input_is_one_line(server, sweep, query, status, line):
    import urllib.error

    _, exp_id, _ = sweep
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(f"{server}/llmeff/experiments/{exp_id}{query}", timeout=30)
    import html

    body = html.unescape(e.value.read().decode())
    assert e.value.code == status
    assert body.count("class='error'") == 1 and line in body and "Traceback" not in body


def test_a_drop_down_and_a_filter_together_select_the_runs_both_match(server, sweep):
    from mlflow_llmeff.report.server import filter_string

    assert filter_string({"precision": "fp32", "filter": "metrics.`summary/tokens_per_sec` > 3000"}) == (
        "tags.`llmeff.precision` = 'fp32' and metrics.`summary/tokens_per_sec` > 3000")  # was '... and (...)': 400
    _, exp_id, _ = sweep
    page = urllib.request.urlopen(f"{server}/llmeff/experiments/{exp_id}?accelerator.count=2&filter="
                                  "metrics.%60summary%2Ftokens_per_sec%60%20%3E%200", timeout=30)
    assert page.status == 200 and page.read().decode().count("data-run-id=") == 1  # one row, as the drop-down alone


def test_server_page_unknown_experiment_is_404(server):
    import urllib.error

    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(f"{server}/llmeff/experiments/98765", timeout=30)
    assert e.value.code == 404 and "experiment id '98765' not found" in e.value.read().decode()


# --------------------------------------------------------------------------- the five-run set (issue 21)
@pytest.fixture(scope="module")
def five(server):
    """The UI trial's five standard runs, logged into the server; yields the experiment id."""
    import mlflow

    from five_runs import log_five_runs

    exp_id, _ = log_five_runs(mlflow.MlflowClient(server), "five")
    return exp_id


def _first_screen_checks(page, where: str) -> dict:
    box = page.locator("table#headline").bounding_box()
    assert box is not None, where
    assert box["x"] >= 0 and box["y"] >= 0 and box["x"] + box["width"] <= 1600 and box["y"] + box["height"] <= 1000, \
        (where, box)
    assert page.evaluate("document.documentElement.scrollWidth") <= 1600, where  # no horizontal scroll
    assert page.locator(".warn").count() == 0, where  # all five runs are comparable: no warning
    heads = page.locator("table#headline th").all_inner_texts()
    return {"heads": [h.replace("\u2195", "").strip() for h in heads],
            "rows": page.locator("table#headline tbody tr").count()}


def test_page_and_report_lead_with_the_answer_in_the_first_1600x1000(server, five, tmp_path, browser):
    out = tmp_path / "rep"
    r = _compare(server, "--experiment", "five", "--out", str(out))
    assert r.exit_code == 0, _failed(r)
    assert "WARNING" not in r.stdout
    page = browser.new_page(viewport={"width": 1600, "height": 1000})
    try:
        for where, url in (("report", (out / "report.html").as_uri()),
                           ("server", f"{server}/llmeff/experiments/{five}")):
            _open(page, url)
            got = _first_screen_checks(page, where)
            assert got["heads"][:5] == ["configuration", "devices", "layout", "tokens/s per device [95%]", "vs best"]
            # CPU runs: MFU against the measured matmul peak, so not headed "(BF16 peak)" (a trial's finding)
            assert {"MFU", "USD / 1e9 tokens", "kg CO2e / 1e9 tokens", "goodput", "quality reached"} <= set(got["heads"])
            assert "MFU (BF16 peak)" not in got["heads"]
            assert got["rows"] == 4  # five runs, four configurations: the evals run repeats the default
            # sortable by any column: goodput ascending after one click
            page.locator("table#headline th", has_text="goodput").click()
            col = got["heads"].index("goodput")
            vals = page.evaluate(f"Array.from(document.querySelectorAll('#headline tbody tr')).map(r => "
                                 f"parseFloat(r.cells[{col}].dataset.v))")
            assert vals == sorted(vals), vals
            # the full table is one click away
            assert not page.locator("table#runs").is_visible()
            page.locator("details#all-runs summary").click()
            assert page.locator("table#runs").is_visible()
            assert page.evaluate("document.documentElement.scrollWidth") <= 1600, where
    finally:
        page.close()


def test_the_first_load_shows_every_figure_at_its_own_size(server, tmp_path, browser):
    # a trial: the first load drew the figures stretched and blurred until a reload (each PNG scaled to
    # half the page by the style). Each image now shows pixel for pixel, on the first load (figures still
    # being drawn: no size known) and after (drawn: width and height from the PNG, laid out before it comes).
    import mlflow

    from five_runs import log_five_runs
    from mlflow_llmeff.report import plots

    exp_id, _ = log_five_runs(mlflow.MlflowClient(server), "first-load")  # a run set no request has drawn
    measure = ("Array.from(document.querySelectorAll('.figs img')).map(i => ({alt: i.alt, w: i.naturalWidth, "
               "h: i.naturalHeight, cw: i.clientWidth, ch: i.clientHeight, box: i.getBoundingClientRect().width, "
               "attr: i.getAttribute('width')}))")
    page = browser.new_page(viewport={"width": 1600, "height": 1000})
    try:
        for load in ("first", "reload"):
            _open(page, f"{server}/llmeff/experiments/{exp_id}")
            page.screenshot(path=str(tmp_path / f"{load}.png"), full_page=True)
            imgs = page.evaluate(measure)
            if load == "first":  # every figure's URL while they are drawn, no size yet
                assert [i["alt"] for i in imgs] == [name for name, _ in plots.FIGURES]
                assert all(i["attr"] is None for i in imgs)
            else:  # the drawn ones, each with its PNG's size in the page
                assert imgs and all(i["attr"] == str(i["w"]) for i in imgs), imgs
            for i in imgs:
                assert i["w"] > 0 and (i["cw"], i["ch"]) == (i["w"], i["h"]), (load, i)  # 1:1, never scaled
                assert i["box"] == i["w"] + 2, (load, i)  # its 1-px border, nothing stretched
    finally:
        page.close()


def test_figures_keep_every_text_inside_their_images(tmp_path):
    import mlflow

    from five_runs import log_five_runs
    from mlflow_llmeff.report import plots
    from mlflow_llmeff.report.render import build_report
    from mlflow_llmeff.report.source import metric_history, select_runs

    client = mlflow.MlflowClient(empty_store(tmp_path / "m.db"))
    log_five_runs(client, "five")
    rep = build_report(client, select_runs(client, "five"), plots=False)
    drawn = 0
    for name, fn in plots.FIGURES:
        fig = fn(rep, lambda run_id, key: metric_history(client, run_id, key))
        if isinstance(fig, str):
            continue
        plots.lay_out(fig)
        assert plots.clipped_texts(fig) == [], name
        drawn += 1
    assert drawn >= 4


def test_a_figure_is_served_by_any_worker_of_the_server(tmp_path, monkeypatch):
    # the trial: mlflow server runs 4 uvicorn workers; the page came from one, its images from the
    # others, whose memory had no figures: 404 at random. Other workers read the drawn figures from
    # disk, or draw them from the experiment and query the image URL carries.
    import html as _html
    import re
    import tempfile

    import mlflow
    from flask import Flask

    from five_runs import log_five_runs
    from mlflow_llmeff.report import plots
    from mlflow_llmeff.report import server as srv

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    client = mlflow.MlflowClient(empty_store(tmp_path / "m.db"))
    exp_id, _ = log_five_runs(client, "five")
    monkeypatch.setattr(srv, "_store", lambda: client)
    app = Flask("t")
    srv.register(app)
    web = app.test_client()
    page = web.get(f"/llmeff/experiments/{exp_id}?precision=fp32").get_data(as_text=True)
    urls = [_html.unescape(u) for u in re.findall(r"src='(/llmeff/figures/[^']+)'", page)]
    assert len(urls) == len(plots.FIGURES)
    url = next(u for u in urls if "/tokens_per_device.png?" in u)
    assert f"experiment={exp_id}" in url and "precision=fp32" in url
    first = web.get(url)  # this worker: waits for its own drawing
    assert first.status_code == 200 and first.mimetype == "image/png"
    digest = url.split("/")[3]
    srv._figures.clear()  # another worker: nothing in its memory, the drawing on disk
    again = web.get(url)
    assert again.status_code == 200 and again.get_data() == first.get_data()
    srv._figures.clear()
    os.remove(srv._disk(digest))  # nor on disk: drawn again from the URL's experiment and query
    drawn = web.get(url)
    assert drawn.status_code == 200 and drawn.mimetype == "image/png"
    srv._figures.clear()
    os.remove(srv._disk(digest))
    assert web.get(url.split("?")[0]).status_code == 404  # a bare URL of figures gone: reload the page
