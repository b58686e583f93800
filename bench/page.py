"""Time to serve the efficiency page of ``mlflow server --app-name llmeff`` as the run count grows.

For each run count N (``--runs 50,1000,10000``): a fresh sqlite store holding N finished runs in one
experiment (repeats of the UI trial's five standard runs, tests/many_runs.py: condition tags,
summary figures with intervals, a loss history), a real server on loopback over it, then timed, in
this order: the first request of the page (the runs read, the report built, the figures started
in the background), the figures it links (drawn: each waits for the drawing), a second request
(the run set unchanged: the page served again), and a request after one more point was logged
(built again). A table of how the times grow with N follows; the exit status is 1 when the target
is missed.

The runs are made before the server starts: the first 15 through ``MlflowClient`` against the
sqlite file (three calls a run), the others copied from them row by row in SQL (tests/many_runs.py's ``copy_runs``: new ids, names
``<template name>-c<index>``, times moved one second a run; ``--api`` logs every run through MlflowClient instead, about 30 ms a run here).

    python bench/page.py --runs 50,1000          # docs/compare.md has the measured table

Targets (issue 53, :data:`TARGETS`): at 10,000 runs the second request under 0.5 s and the first under
1 s, at 100,000 runs the first under 3 s; (issue 31) the second under 2 s at 1,000 runs, and from
1,000 runs up the second request's growth over the runs' growth at most GROWTH_LIMIT (1.3: linear
within this shared machine's noise). A target is checked where its run count is measured. The page's
runs table shows the first 200 runs (docs/compare.md), so the page's size stops growing there; the
second request of an unchanged store reads no run (report/source.py ``change_token``).

    python bench/page.py --runs 10000,100000      # the issue-53 targets (the 100,000-run store: ~1 min)
    python bench/page.py --runs 10000 --against HEAD~3 --rounds 3   # interleaved with older code, one store

The first request's CPU time (user + system of the server's process tree, every thread: :func:`_tree_cpu`) is
printed beside its wall time: on this shared 2-core machine the wall time of one request moves 2x with the load,
its CPU time far less.

With ``--against REV`` each run count's store is made once and served in turn by this tree and by REV (a
``git worktree``, first on the server's ``PYTHONPATH``), the order alternating by round; each server is fresh
(its first request is its first) with a temporary folder of its own. It prints every server's times and
load average, whether the two codes' first pages are the same (figure keys aside), and each code's median.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
#: The second request's target (s) at TARGET_RUNS runs (issue 31).
TARGET_S, TARGET_RUNS = 2.0, 1000
#: (runs, request, seconds): a request of the page at that run count must take less (issue 53).
TARGETS = ((1000, "second", 2.0), (10_000, "second", 0.5), (10_000, "first", 1.0), (100_000, "first", 3.0))
#: From TARGET_RUNS runs up, the second request's growth / the runs' growth above this is worse than
#: linear beyond this shared machine's noise (+-30% between runs of the bench).
GROWTH_LIMIT = 1.3
#: Runs logged through the API before the rest are copied (three repeats of each standard run).
TEMPLATES = 15


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> tuple[float, bytes]:
    t = time.perf_counter()
    with urllib.request.urlopen(url, timeout=600) as r:
        body = r.read()
    return time.perf_counter() - t, body


def _tree_cpu(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` and its descendants (``mlflow server`` starts uvicorn as a
    child): every thread's, so the page's side-by-side reads count; unlike wall time, hardly moved by load."""
    import psutil

    procs = [psutil.Process(pid)]
    procs += procs[0].children(recursive=True)
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:  # gone between the listing and the read
            pass
    return total


def make_store(root: str, n: int, api: bool) -> tuple[str, str, list[str], float]:
    """``(store URI, experiment id, run ids, seconds it took)`` of ``n`` runs in a fresh sqlite file."""
    import mlflow

    from many_runs import copy_runs, log_many_runs

    uri = f"sqlite:///{root}/mlflow.db"
    client = mlflow.MlflowClient(uri)
    client.search_experiments()  # the database is made here, not in the timing
    t = time.perf_counter()
    exp_id, ids = log_many_runs(client, "page-bench", n if api else min(n, TEMPLATES))
    if len(ids) < n:
        ids += copy_runs(uri, ids, range(len(ids), n), lambda i, logged_name: f"{logged_name}-c{i}")
    return uri, exp_id, ids, time.perf_counter() - t


def measure(n: int, api: bool) -> dict:
    """Start a server over ``n`` fresh runs and time the page's requests; the figures in a dict."""
    root = tempfile.mkdtemp(prefix="llmeff_page_")
    try:
        uri, exp_id, ids, made_s = make_store(root, n, api)
        return serve(root, uri, exp_id, ids, n, made_s)
    finally:
        shutil.rmtree(root, ignore_errors=True)  # the store (about 1 MB per 1,000 runs)


def old_code(rev: str, root: str) -> str:
    """A checkout of this repository at ``rev`` (``git worktree``, detached) under ``root``: its folder, which
    a server started with it first on ``PYTHONPATH`` imports ``mlflow_llmeff`` from."""
    where = os.path.join(root, f"code-{rev}")
    subprocess.run(["git", "-C", os.path.join(HERE, ".."), "worktree", "add", "--detach", where, rev], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return where


def serve(root: str, uri: str, exp_id: str, ids: list[str], n: int, made_s: float, code: str | None = None,
          point: int = 0) -> dict:
    """Start a server over the store ``uri`` (``code``: the folder ``mlflow_llmeff`` is imported from, else the
    installed one) and time the page's requests; the figures in a dict. The store's first run gets a new
    ``train/loss`` point (step 60 + ``point``, a value of its own) before the "after a new point" request.
    The server's temporary folder is its own (no figures another server drew and left on disk)."""
    import mlflow

    port = _port()
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
           "TMPDIR": tempfile.mkdtemp(prefix="tmp-", dir=root)}
    if code:
        env["PYTHONPATH"] = code + os.pathsep + env.get("PYTHONPATH", "")
    server = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--app-name", "llmeff", "--backend-store-uri",
                               uri, "--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
                              cwd=root, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                              env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        t0 = time.perf_counter()
        while True:
            try:
                _get(url + "/health")
                break
            except OSError:
                if time.perf_counter() - t0 > 180 or server.poll() is not None:
                    raise SystemExit("mlflow server did not start")
                time.sleep(0.5)
        time.sleep(3)  # the server has imported matplotlib in the background by now, as it would have
        page = f"{url}/llmeff/experiments/{exp_id}"
        cpu0 = _tree_cpu(server.pid)
        first, body = _get(page)
        first_cpu = _tree_cpu(server.pid) - cpu0  # the figures start drawing as the page goes: a little of theirs
        figs = re.findall(r"src='(/llmeff/figures/[^']+)'", body.decode())
        fig_s = sum(_get(url + f.replace("&amp;", "&"))[0] for f in figs)
        second, _ = _get(page)
        mlflow.MlflowClient(url).log_metric(ids[0], "train/loss", 1.0 + point / 1000, step=60 + point)
        changed, _ = _get(page)
        return {"runs": n, "made_s": made_s, "figures": len(figs), "kib": len(body) / 1024, "first": first,
                "first_cpu": first_cpu,
                "figures_s": fig_s, "second": second, "changed": changed, "load": os.getloadavg()[0],
                "body": re.sub(r"/llmeff/figures/[^/]+/", "/llmeff/figures/K/", body.decode())}
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(30)


def growth_table(rows: list[dict]) -> list[str]:
    """Lines of a Markdown table: per run count the times, and how the second request grew against
    the previous row (time ratio / run ratio: 1 = linear, below 1 = slower than linear)."""
    out = ["| runs | runs made (s) | page (KiB) | first request (s) | its figures (s) | second request (s) | "
           "after a new point (s) | second: ms per run | second's growth / runs' growth |",
           "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    prev = None
    for r in rows:
        growth = "" if prev is None else f"{(r['second'] / prev['second']) / (r['runs'] / prev['runs']):.2f}"
        out.append(f"| {r['runs']:,} | {r['made_s']:.0f} | {r['kib']:.0f} | {r['first']:.2f} | {r['figures_s']:.2f} | "
                   f"{r['second']:.2f} | {r['changed']:.2f} | {1000 * r['second'] / r['runs']:.2f} | {growth} |")
        prev = r
    return out


def _median(rows: list[dict]) -> dict:
    """The row of each figure's median over ``rows`` (rounds of one code at one run count)."""
    import statistics

    return {**rows[0], **{k: statistics.median(r[k] for r in rows) for k in TIMED}}


#: The timed figures of a row (:func:`serve`).
TIMED = ("first", "first_cpu", "figures_s", "second", "changed", "load")


def compare(n: int, api: bool, rev: str, rounds: int) -> dict:
    """The page at ``n`` runs, this code and the code at ``rev``, interleaved on one store (``rounds`` rounds,
    the order alternating): prints a line a server and whether the two first pages are the same; the median
    row of this code."""
    root = tempfile.mkdtemp(prefix="llmeff_page_")
    try:
        old = old_code(rev, root)
        uri, exp_id, ids, made_s = make_store(root, n, api)
        got: dict[str, list[dict]] = {"old": [], "new": []}
        point = 0
        for i in range(rounds):
            for which in (("old", "new") if i % 2 == 0 else ("new", "old")):
                point += 1
                r = serve(root, uri, exp_id, ids, n, made_s, old if which == "old" else None, point)
                got[which].append(r)
                print(f"{n:,} runs, round {i + 1}, {which} code ({rev if which == 'old' else 'this tree'}), load "
                      f"{r['load']:.1f}: first {r['first']:.2f} s ({r['first_cpu']:.2f} s CPU), figures {r['figures_s']:.2f} s, second "
                      f"{r['second']:.2f} s, after a new point {r['changed']:.2f} s, page {r['kib']:.0f} KiB", flush=True)
            same = got["old"][-1]["body"] == got["new"][-1]["body"]
            print(f"  round {i + 1}: the first page of both codes is {'the same' if same else 'NOT the same'} "
                  "(figure keys aside)", flush=True)
        for which in ("old", "new"):
            m = _median(got[which])
            print(f"{n:,} runs, {which} code, median of {rounds}: first {m['first']:.2f} s ({m['first_cpu']:.2f} s CPU), "
                  f"second {m['second']:.2f} s, "
                  f"after a new point {m['changed']:.2f} s (load {m['load']:.1f})", flush=True)
        return _median(got["new"])
    finally:
        subprocess.run(["git", "-C", os.path.join(HERE, ".."), "worktree", "remove", "--force",
                        os.path.join(root, f"code-{rev}")], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        shutil.rmtree(root, ignore_errors=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", default="50", help="comma-separated run counts, e.g. 50,1000,10000")
    p.add_argument("--api", action="store_true", help="log every run through MlflowClient (no SQL copies)")
    p.add_argument("--against", metavar="REV", help="also time the code at this git revision, interleaved on the "
                   "same store (e.g. HEAD~3); the targets are checked on this tree's median")
    p.add_argument("--rounds", type=int, default=1, help="rounds per code with --against (default 1)")
    args = p.parse_args()
    counts = [int(x) for x in args.runs.split(",") if x.strip()]
    if not counts or min(counts) < 1:
        raise SystemExit("--runs: give positive run counts, e.g. 50,1000")
    if args.rounds < 1:
        raise SystemExit(f"--rounds {args.rounds}: give 1 or more")
    sys.path.insert(0, os.path.join(HERE, "..", "tests"))
    rows = []
    for n in counts:
        r = compare(n, args.api, args.against, args.rounds) if args.against else measure(n, args.api)
        rows.append(r)
        print(f"{n:,} runs (made in {r['made_s']:.0f} s), {r['figures']} figures, page {r['kib']:.0f} KiB: first "
              f"{r['first']:.2f} s ({r['first_cpu']:.2f} s CPU of the server), figures {r['figures_s']:.2f} s, second {r['second']:.2f} s, after a new point "
              f"{r['changed']:.2f} s", flush=True)
    print()
    print("\n".join(growth_table(rows)))
    missed = [(r, what, limit) for r in rows for n, what, limit in TARGETS if r["runs"] == n and r[what] >= limit]
    met = [(r, what, limit) for r in rows for n, what, limit in TARGETS if r["runs"] == n and r[what] < limit]
    for r, what, limit in met:
        print(f"target met: {what} request {r[what]:.2f} s at {r['runs']:,} runs (under {limit:g} s)")
    for r, what, limit in missed:
        print(f"target missed: {what} request {r[what]:.2f} s at {r['runs']:,} runs (target under {limit:g} s)")
    untested = not (met or missed)  # nothing measured that a target covers
    if untested:
        print("target not measured: give a run count of " + ", ".join(sorted({f"{n:,}" for n, _, _ in TARGETS})))
    steep = [(a, b) for a, b in zip(rows, rows[1:]) if a["runs"] >= TARGET_RUNS and b["runs"] > a["runs"]
             and (b["second"] / a["second"]) / (b["runs"] / a["runs"]) > GROWTH_LIMIT]
    for a, b in steep:
        print(f"target missed: the second request grew {(b['second'] / a['second']) / (b['runs'] / a['runs']):.2f}x "
              f"linear from {a['runs']:,} to {b['runs']:,} runs (limit {GROWTH_LIMIT:g})")
    if rows and not steep and len(rows) > 1:
        print(f"growth met: no worse than {GROWTH_LIMIT:g}x linear from {TARGET_RUNS:,} runs up")
    return 1 if missed or steep or untested else 0


if __name__ == "__main__":
    raise SystemExit(main())
