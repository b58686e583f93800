"""train/preempt.py: the scheduler's warning signal becomes a checkpoint, an attempt that ends
``preempted`` (no failure) and a requeue; the ranks agree on the step to stop after through two files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import mlflow
import pytest

from mlflow_llmeff import names
from mlflow_llmeff.calc import reliability as rel
from mlflow_llmeff.train import preempt
from mlflow_llmeff.train.preempt import Preemption


# ------------------------------------------------------------------------------ the agreement
def test_two_ranks_stop_after_the_same_step_whichever_saw_the_signal(tmp_path):
    a, b = Preemption(str(tmp_path), main=True, world=2), Preemption(str(tmp_path), main=False, world=2)
    a.begin()
    assert a.due(3) is None and b.due(3) is None  # no signal yet
    a.signalled = "SIGUSR1"  # rank 0 got it during step 4
    assert a.due(4) is None  # it fixes the stop at 5: rank 1 may have passed its check of step 4
    assert b.due(4) is None  # rank 1's check of step 4 comes after: it reads 5 and goes on too
    stop_a, stop_b = a.due(5), b.due(5)
    assert stop_a == stop_b and stop_a["step"] == 5 and stop_a["signal"] == "SIGUSR1"
    b.signalled = "SIGUSR1"  # a late signal on rank 1 does not move the agreed step
    assert b.due(5)["step"] == 5


def test_a_launchers_request_is_seen_by_the_first_rank_that_checks(tmp_path):
    a, b = Preemption(str(tmp_path), main=True, world=2), Preemption(str(tmp_path), main=False, world=2)
    preempt.request(str(tmp_path), "SIGUSR1")  # llmeff train's launcher got the signal
    assert b.due(7) is None and preempt.stop_step(str(tmp_path))["step"] == 8  # rank 1 checked first
    assert a.due(7) is None and a.due(8)["step"] == 8 and b.due(8)["step"] == 8


def test_one_process_stops_after_the_step_it_sees_the_signal_at(tmp_path):
    p = Preemption(str(tmp_path), main=True, world=1)
    p.signalled = "SIGUSR1"
    assert p.due(6)["step"] == 6


def test_a_new_attempt_clears_the_last_attempts_stop(tmp_path):
    p = Preemption(str(tmp_path), main=True, world=2)
    preempt.request(str(tmp_path))
    p.due(2)
    assert os.path.exists(tmp_path / preempt.STOP_FILE)
    Preemption(str(tmp_path), main=True, world=2).begin()
    assert not os.listdir(tmp_path)
    assert Preemption(str(tmp_path), main=True, world=2).due(9) is None


def test_the_signal_only_sets_a_flag_in_the_main_thread(tmp_path):
    import signal

    p = Preemption(str(tmp_path), main=True)
    p.install()
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.05)
        assert p.signalled == "SIGUSR1" and not os.listdir(tmp_path)  # nothing written in the handler
    finally:
        p.uninstall()
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL


def test_a_sigterm_is_a_stop_request_agreed_as_the_warning_is(tmp_path):
    # issue 52: SIGTERM (scancel, a Kubernetes pod's stop) with a checkpoint folder checkpoints and ends the
    # attempt as preemption does; a later warning does not rename the stop
    import signal

    p = Preemption(str(tmp_path), main=True, world=2, deadline_s=60)
    previous = signal.getsignal(signal.SIGTERM)
    p.install()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
        assert p.signalled == "SIGTERM" and not os.listdir(tmp_path)  # a flag, nothing written in the handler
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.05)
        assert p.signalled == "SIGTERM" and not p.stopping
        assert p.due(4) is None  # two ranks: the stop is the next step
        assert p.due(5) == {**preempt.stop_step(str(tmp_path)), "step": 5, "signal": "SIGTERM"} and p.stopping
    finally:
        p.uninstall()
    assert signal.getsignal(signal.SIGTERM) == previous and signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL


def _sigterm_then_wait(p, seconds: float, stop_at: float | None = None) -> float | None:
    """SIGTERM to this process, then sleep in the main thread for ``seconds`` (reaching the agreed stop after
    ``stop_at`` seconds): the time at which SystemExit came, or None."""
    import signal

    t0 = time.monotonic()
    os.kill(os.getpid(), signal.SIGTERM)
    try:
        while time.monotonic() - t0 < seconds:
            if stop_at is not None and time.monotonic() - t0 >= stop_at and not p.stopping:
                assert p.due(3) is not None
            time.sleep(0.01)
    except SystemExit as e:
        assert e.code == 143
        return time.monotonic() - t0
    return None


def test_a_rank_that_does_not_reach_the_stop_in_time_ends_as_sigterm_ends_it(tmp_path, monkeypatch):
    from mlflow_llmeff.monitor import lifecycle

    monkeypatch.setitem(lifecycle._state, "signal", None)  # this process's record, restored after the test
    p = Preemption(str(tmp_path), main=True, world=1, deadline_s=0.2)
    p.install()
    try:
        ended = _sigterm_then_wait(p, 5.0)  # no step ends: a long eval, a step that hangs
    finally:
        p.uninstall()
    assert ended is not None and ended >= 0.2  # SystemExit(143) once the deadline passed, not at the signal
    assert lifecycle.signalled() == "SIGTERM"


def test_a_rank_that_reached_the_stop_is_not_cut_by_the_deadline(tmp_path):
    p = Preemption(str(tmp_path), main=True, world=1, deadline_s=0.2)
    p.install()
    try:
        ended = _sigterm_then_wait(p, 0.6, stop_at=0.0)  # its checkpoint and its run's end take longer
    finally:
        p.uninstall()
    assert ended is None and p.stopping and preempt.stop_step(str(tmp_path))["signal"] == "SIGTERM"


def test_after_a_stop_request_nothing_is_requeued_and_the_status_is_sigterms(monkeypatch, capsys):
    from types import SimpleNamespace

    from mlflow_llmeff.train import launch

    monkeypatch.setenv("SLURM_JOB_ID", "77")
    asked = []
    monkeypatch.setattr(preempt, "requeue", lambda *a, **k: asked.append(a) or "requeued")
    cfg = SimpleNamespace(machine_rank=0)
    assert launch._after_preemption(cfg, "SIGTERM") == 143 and asked == []  # scancel: not requeued
    assert launch._after_preemption(cfg, "SIGUSR1") == preempt.EXIT_PREEMPTED and len(asked) == 1
    assert capsys.readouterr().err == "llmeff: requeued\n"


# ------------------------------------------------------------------------------ the requeue
def _fake(code: int, err: str = ""):
    calls = []

    def run(argv, **kw):
        calls.append(argv)
        return subprocess.CompletedProcess(argv, code, "", err)
    return run, calls


def test_requeue_asks_slurm_for_this_job_and_says_so():
    run, calls = _fake(0)
    assert preempt.requeue({"SLURM_JOB_ID": "31"}, run) == \
        "SLURM job 31 requeued: it resumes from the checkpoint in the same MLflow run"
    assert calls == [["scontrol", "requeue", "31"]]


def test_a_refused_requeue_is_one_line_never_an_error():
    run, _ = _fake(1, "scontrol: error: Requested operation is presently disabled for job 31\n")
    assert preempt.requeue({"SLURM_JOB_ID": "31"}, run) == (
        "scontrol requeue 31 refused (scontrol: error: Requested operation is presently disabled for job 31); "
        "submit with sbatch --requeue, or resubmit the job, to resume")
    assert preempt.requeue({}, run) == "run the same command again to resume from the checkpoint"


def test_a_preempted_attempt_is_no_failure_and_its_wait_is_down_time():
    a = [rel.Attempt(start=0.0, last_alive=100.0, end=rel.PREEMPTED, detail="SIGUSR1", steps=8, checkpoints=(8,),
                     checkpoint_step=8, checkpoint_at=99.0),
         rel.Attempt(start=130.0, last_alive=200.0, steps=16, start_step=8, checkpoint_step=8)]
    r = rel.compute(a)
    assert (r.attempts, r.failures, r.down_s, r.mtbf_s, r.failure_cost_s, r.lost_s) == (2, 0, 30.0, None, 0.0, 0.0)
    assert r.preempted == [{"attempt": 1, "detail": "SIGUSR1", "step": 8, "at_s": 100.0, "down_s": 30.0}]
    assert rel.describe(r) == "2 attempts, 1 preemption (at step 8), no failure, down 30 s"
    assert rel.summary_metrics(r)[names.SUM_PREEMPTIONS] == 1.0


# ------------------------------------------------------------------------------ end to end, one process
ARGS = ["--max-steps", "10", "--log-every-n-steps", "2", "--seq-len", "32", "--micro-batch-size", "2",
        "--checkpoint-every", "100", "--warmup-steps", "1", "--measure-energy", "none", "--seed", "3"]


@pytest.mark.slow
def test_a_preempted_llmeff_train_checkpoints_exits_75_and_the_rerun_finishes_the_same_run(tmp_path, tracking_uri):
    """SIGUSR1 while step 3's hold waits: the process stops after step 4 (the first step end that reads
    the flag), writes checkpoint 4, ends its run KILLED and the attempt ``preempted``, exits 75. The
    rerun resumes step 4 in the same run: FINISHED, 2 attempts, 0 failures, 1 preemption, and its
    down time is the gap from the first attempt's last sign of life to the rerun's process start."""
    from mlflow_llmeff.train import faults
    from mlflow_llmeff.train import job as jobs

    from conftest import START_TICK_S, process_start_unix_of
    from test_train_e2e import env_for, only_run

    ck, hold = tmp_path / "ck", tmp_path / "hold"

    def train(extra):
        proc = subprocess.Popen([sys.executable, "-m", "mlflow_llmeff", "train", *ARGS, "--checkpoint-dir", str(ck)],
                                cwd=tmp_path, env={**env_for(tracking_uri), **extra}, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        return proc, process_start_unix_of(proc.pid)

    first, _ = train({faults.ENV["hold_at_step"]: "3", faults.HOLD_FILE_ENV: str(hold)})
    deadline = time.monotonic() + 240
    while not os.path.exists(f"{hold}.reached") and time.monotonic() < deadline and first.poll() is None:
        time.sleep(0.05)
    first.send_signal(__import__("signal").SIGUSR1)  # the scheduler's warning, while step 3 is held
    hold.write_text("go")
    out, err = first.communicate(timeout=240)
    assert first.returncode == preempt.EXIT_PREEMPTED, err[-3000:]
    assert "llmeff: preempted: SIGUSR1 from the scheduler, stopped after step 4; checkpoint step 4 written" in out
    assert "run the same command again to resume from the checkpoint" in err
    assert os.path.isdir(ck / "step_00000004")
    ends = [json.loads(x) for x in (ck / jobs.LEDGER_FILE).read_text().splitlines() if '"end"' in x]
    assert [(e["kind"], e["step"]) for e in ends] == [("preempted", 4)]
    mlflow.set_tracking_uri(tracking_uri)
    run = only_run()
    assert run.info.status == "KILLED" and run.data.tags[names.ERROR].startswith("preempted: SIGUSR1")
    last_alive = float(ends[0]["unix"])

    time.sleep(1.0)  # the queue
    second, second_start = train({})
    out2, err2 = second.communicate(timeout=300)
    assert second.returncode == 0, err2[-3000:]
    run = only_run()
    m = run.data.metrics
    assert run.info.status == "FINISHED" and run.data.tags[names.RESUMED_FROM] == "4"
    assert (m[names.SUM_ATTEMPTS], m[names.SUM_FAILURES], m[names.SUM_PREEMPTIONS]) == (2.0, 0.0, 1.0)
    assert m[names.SUM_BADPUT_DOWN_S] == pytest.approx(second_start - last_alive, abs=START_TICK_S)
    assert run.data.tags[names.RELIABILITY].startswith("2 attempts, 1 preemption (at step 4), no failure, down ")
    assert not (ck / preempt.STOP_FILE).exists()  # the rerun cleared the stop
