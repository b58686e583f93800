"""Time to serve the efficiency page of ``mlflow server --app-name llmeff`` for 50 runs: first and second request.

Starts a real server on loopback over a fresh sqlite store, logs 50 finished runs into one
experiment (ten copies of the UI trial's five standard runs, tests/five_runs.py: every summary key,
intervals, conditions, loss histories), then times, in this order: the first request of the page
(the figures are drawn and cached), the figures it links, a second request (the run set is
unchanged: cached figures), and a request after one more point was logged (drawn again).

    python bench/page.py [--runs 50]

Target (issue 21): under 2 s for 50 runs on this machine.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> tuple[float, bytes]:
    t = time.perf_counter()
    with urllib.request.urlopen(url, timeout=300) as r:
        body = r.read()
    return time.perf_counter() - t, body


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=50, help="a multiple of 5")
    args = p.parse_args()
    sys.path.insert(0, os.path.join(HERE, "..", "tests"))
    import mlflow

    from five_runs import log_five_runs

    root = tempfile.mkdtemp(prefix="llmeff_page_")
    port = _port()
    server = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--app-name", "llmeff", "--backend-store-uri",
                               f"sqlite:///{root}/mlflow.db", "--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
                              cwd=root, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                              env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})
    url = f"http://127.0.0.1:{port}"
    try:
        t0 = time.perf_counter()
        while True:
            try:
                _get(url + "/health")
                break
            except OSError:
                if time.perf_counter() - t0 > 180:
                    raise SystemExit("mlflow server did not start")
                time.sleep(0.5)
        client = mlflow.MlflowClient(url)
        ids = []
        for _ in range(args.runs // 5):
            exp_id, more = log_five_runs(client, "page-bench")
            ids += more
        time.sleep(3)  # the server has imported matplotlib in the background by now, as it would have
        page = f"{url}/llmeff/experiments/{exp_id}"
        first, body = _get(page)
        figs = re.findall(r"src='(/llmeff/figures/[^']+)'", body.decode())
        fig_s = sum(_get(url + f)[0] for f in figs)
        second, _ = _get(page)
        client.log_metric(ids[0], "train/loss", 1.0, step=60)
        changed, _ = _get(page)
        print(f"{len(ids)} runs, {len(figs)} figures, page {len(body) / 1024:.0f} KiB")
        print(f"first request (figures drawn):      {first:.2f} s")
        print(f"its {len(figs)} figures (from the cache):   {fig_s:.2f} s")
        print(f"second request (run set unchanged): {second:.2f} s")
        print(f"after one new point (drawn again):  {changed:.2f} s")
        print(f"first / second: {first / second:.1f}x; target: under 2 s")
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(30)


if __name__ == "__main__":
    main()
