"""The one door to MLflow (tracking/writer.py, issue 52): RunWriter creates, writes (keys checked, secrets
masked) and ends a run; a server that does not answer costs one bounded wait and leaves the run in the
outbox; ``llmeff study --seeds 2`` and ``llmeff compare`` against a server that accepts and never answers,
and against none (a closed port), end with one ``Error:`` line naming the server and the bound, no
traceback, the study's parent run kept in the outbox."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading

import mlflow
import pytest

from mlflow_llmeff import names
from mlflow_llmeff.tracking import outbox
from mlflow_llmeff.tracking.writer import RunWriter

#: The delivery wait the subprocess tests set (LLMEFF_DELIVERY_WAIT_S), seconds.
WAIT_S = 2
#: A guard, not a measurement: the commands must end long before this (unbounded, they ran ~4 and ~20 min).
GUARD_S = 120


@pytest.fixture
def sqlite_uri(tmp_path, monkeypatch):
    from conftest import empty_store

    uri = empty_store(tmp_path / "mlflow.db")  # a copy of an empty store: its tables made once a process
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    mlflow.set_tracking_uri(uri)
    yield uri
    mlflow.set_tracking_uri(None)


@pytest.fixture
def silent_server():
    """A loopback port that accepts connections and never answers; its URI."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(64)
    held, stop = [], threading.Event()

    def accept():
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(srv.accept()[0])  # held open, never read, never answered
            except OSError:
                continue

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.getsockname()[1]}"
    stop.set()
    t.join()
    for c in held:
        c.close()
    srv.close()


@pytest.fixture
def closed_port():
    """A loopback port nothing listens on; its URI."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return f"http://127.0.0.1:{port}"


def test_a_writer_creates_writes_masked_and_ends_a_run(sqlite_uri, monkeypatch):
    monkeypatch.setenv("MY_API_TOKEN", "s3cr3t-value")
    w = RunWriter.create("writer-run", experiment_name="writer", tags={"k": "v", "note": "uses s3cr3t-value"},
                         params={"p": "1", "bad key?": "x"}, unique=True)
    assert w.answered and w.experiment_id == mlflow.get_experiment_by_name("writer").experiment_id
    w.log_metrics({"m/x_s": 2.5, "not a number": "NaN?"}, step=3)
    w.write_text("a\nb\n", "ids.txt")
    assert w.end("FINISHED") is True
    run = mlflow.MlflowClient().get_run(w.run_id)
    assert (run.info.status, run.info.run_name) == ("FINISHED", "writer-run")
    assert run.data.tags["k"] == "v" and "s3cr3t-value" not in run.data.tags["note"]  # masked
    assert run.data.params["p"] == "1" and run.data.metrics == {"m/x_s": 2.5}
    assert "llmeff.logging.warnings" in run.data.tags  # the refused key and the dropped value, named
    local = mlflow.artifacts.download_artifacts(run_id=w.run_id, artifact_path="ids.txt")
    assert open(local).read() == "a\nb\n"
    again = RunWriter.create("writer-run", experiment_name="writer", unique=True)
    again.end("FINISHED")
    assert mlflow.MlflowClient().get_run(again.run_id).info.run_name == "writer-run-2"


def test_a_writer_against_a_closed_port_keeps_the_run_in_the_outbox(closed_port, tmp_path, monkeypatch):
    monkeypatch.setenv("LLMEFF_DELIVERY_WAIT_S", str(WAIT_S))
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    w = RunWriter.create("kept", experiment_name="writer", params={"p": "1"}, outbox_dir=str(tmp_path),
                         client=mlflow.MlflowClient(closed_port))
    assert not w.answered and outbox.is_local_id(w.run_id)
    assert closed_port in w.unanswered_reason
    w.set_tags({"t": "1"}, synchronous=False)
    assert w.end("FAILED") is False
    header, records = outbox.read_outbox(w.spilled_to)
    assert header["run_id"] == w.run_id
    assert records[0]["create"]["run_name"] == "kept" and records[0]["create"]["experiment_name"] == "writer"
    assert {"p": ["p", "1"]} in records and {"t": ["t", "1"]} in records
    assert records[-1]["end"][0] == "FAILED"


def _llmeff(args: list[str], uri: str, box) -> subprocess.CompletedProcess:
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri, "LLMEFF_DELIVERY_WAIT_S": str(WAIT_S),
           "LLMEFF_OUTBOX_DIR": str(box), "MLFLOW_HTTP_REQUEST_TIMEOUT": "5"}
    env.pop("MLFLOW_RUN_ID", None)
    return subprocess.run([sys.executable, "-m", "mlflow_llmeff", *args], env=env, capture_output=True, text=True,
                          timeout=GUARD_S)


def _one_error_line(r: subprocess.CompletedProcess, uri: str) -> str:
    assert "Traceback" not in r.stdout + r.stderr
    errors = [line for line in (r.stdout + r.stderr).splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, r.stdout + r.stderr
    assert f"the tracking server {uri} did not answer" in errors[0] and f"{WAIT_S} s" in errors[0]
    return errors[0]


@pytest.mark.parametrize("server", ["silent_server", "closed_port"])
def test_study_against_a_server_that_does_not_answer_says_so_in_one_line_and_keeps_its_run(server, request, tmp_path):
    uri = request.getfixturevalue(server)
    box = tmp_path / "outbox"
    r = _llmeff(["study", "--seeds", "2", "--config", "--model llama-tiny --dataset synthetic --max-steps 2"], uri, box)
    assert r.returncode == 1, r.stdout + r.stderr
    line = _one_error_line(r, uri)
    assert "nothing was trained" in line and str(box) in line
    files = [f for f in os.listdir(box) if f.endswith(".jsonl")]
    assert len(files) == 1  # the study's parent run, with its settings and its end
    header, records = outbox.read_outbox(str(box / files[0]))
    assert outbox.is_local_id(header["run_id"]) and records[0]["create"]["run_name"] == "study-1x2"
    assert records[0]["create"]["tags"][names.STUDY] == "1 configuration x 2 seeds, round-robin"
    assert {"p": ["seeds", "2"]} in records
    assert records[-1]["end"][0] == "FAILED"
    assert json.dumps(records).count("nothing was trained") == 2  # llmeff.error and the description


@pytest.mark.parametrize("server", ["silent_server", "closed_port"])
def test_compare_against_a_server_that_does_not_answer_says_so_in_one_line(server, request, tmp_path):
    uri = request.getfixturevalue(server)
    r = _llmeff(["compare", "--experiment", "any", "--out", str(tmp_path / "out")], uri, tmp_path / "outbox")
    assert r.returncode == 1, r.stdout + r.stderr
    assert _one_error_line(r, uri).endswith("; nothing was compared")
    assert not (tmp_path / "out").exists()


def test_the_plans_history_is_read_within_the_wait_and_says_why_it_has_none(closed_port, monkeypatch):
    """``llmeff plan``'s predictions read earlier runs through ``store.reader()``: a server that does not answer
    is one bounded read, named in the prediction's basis, and later reads do not wait again."""
    from mlflow_llmeff.planning.predict import history_power_w, history_tflops
    from mlflow_llmeff.tracking import store

    monkeypatch.setenv("LLMEFF_DELIVERY_WAIT_S", str(WAIT_S))
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    reader = store.reader(closed_port)
    tflops, n, basis = history_tflops(reader, "CPU", "llama-tiny")
    assert (tflops, n) == (None, 0)
    assert basis.startswith(f"no tracking server reachable (the tracking server {closed_port} did not answer a "
                            "search_experiments request")
    assert reader.down is not None and history_power_w(reader, "CPU") is None  # no second wait: it is known down


def test_llmeff_evals_run_check_tells_a_missing_run_from_a_server_that_does_not_answer(sqlite_uri, closed_port,
                                                                                     monkeypatch):
    from mlflow_llmeff.evals.api import check_run

    run_id = mlflow.MlflowClient().create_run("0").info.run_id
    assert check_run(run_id) is True
    with pytest.raises(ValueError, match=r"^--run-id 'f{32}': no such run in the tracking store 'sqlite:"):
        check_run("f" * 32)
    monkeypatch.setenv("LLMEFF_DELIVERY_WAIT_S", str(WAIT_S))
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    mlflow.set_tracking_uri(closed_port)
    assert check_run(run_id) is False  # no answer is not "no such run": the scores wait in the outbox
