"""Reliability across a job's life (calc/reliability.py; docs/time.md), on hand-computed ledgers.

The three-attempt job of issue 29, on a fake clock (seconds from the user's command):

attempt 1: start 0; set-up 3 s; step 1 takes 2 s (1 s warm-up excess), steps 2-4 1 s each (step 4
  done at 8); checkpoint 4 written 8-9; steps 5, 6, 7 done at 10, 11, 12; SIGKILL right after
  step 7 (last sign of life: the heartbeat at 12).
down 20 s: attempt 2 starts at 32; set-up 4 s, checkpoint load 1 s (to 37); step 5 takes 2 s
  (1 s re-warm-up), steps 6-8 1 s each (step 8 done at 42); checkpoint 8 written 42-43; steps 9
  and 10 done at 44 and 45; step 10's loss is NaN: the attempt exits with its record at 45.
down 5 s: attempt 3 starts at 50; set-up 4 s, load 1 s (to 55); step 9 takes 2 s (1 s re-warm-up),
  steps 10-12 1 s each (done at 60); checkpoint 12 written 60-61; finished at 61.
"""

from __future__ import annotations

import pytest

from mlflow_llmeff.calc import reliability as rel
from mlflow_llmeff.calc.goodput import TimeLedger, breakdown, goodput

# chi-square quantiles written out from a printed table of critical values (4 decimals), not from
# scipy: chi2(0.975; 6 df), chi2(0.025; 4 df), chi2(0.975; 2 df)
CHI2_0975_DF6 = 14.4494
CHI2_0025_DF4 = 0.4844
CHI2_0975_DF2 = 7.3778


def three_attempts() -> list[rel.Attempt]:
    return [
        rel.Attempt(start=0.0, last_alive=12.0, end="signal", detail="SIGKILL", steps=7, start_step=0,
                    checkpoint_step=4, checkpoint_at=9.0, checkpoints=(4,), setup_s=3.0, load_s=0.0, rewarm_s=1.0),
        rel.Attempt(start=32.0, last_alive=45.0, end="nan", detail="NaN loss", steps=10, start_step=4,
                    checkpoint_step=8, checkpoint_at=43.0, checkpoints=(8,), setup_s=4.0, load_s=1.0, rewarm_s=1.0),
        rel.Attempt(start=50.0, last_alive=61.0, end=rel.FINISHED, steps=12, start_step=8,
                    checkpoint_step=12, checkpoint_at=61.0, checkpoints=(12,), setup_s=4.0, load_s=1.0, rewarm_s=1.0),
    ]


def test_down_time_is_the_sum_of_the_gaps():
    r = rel.compute(three_attempts())
    assert r.down_s == pytest.approx(20.0 + 5.0)  # (32 - 12) + (50 - 45)
    assert r.wall_s == pytest.approx(61.0)
    assert r.operating_s == pytest.approx(36.0)
    assert (r.attempts, r.failures) == (3, 2)


def _attempt_ledgers() -> dict[str, float]:
    """The meter's own ledger of the three attempts, driven on a fake clock, with the job's down time."""
    now = [0.0]
    led = TimeLedger(clock=lambda: now[0], started_at=0.0)

    def tick(dt):
        now[0] += dt

    def steps(times, warm):  # step seconds, the first `warm` of them warm-up steps
        for i, dt in enumerate(times):
            tick(dt)
            led.step_done(warmup=i < warm)

    # attempt 1 up to its checkpoint (the meter's state in checkpoint 4), then its lost tail
    tick(3.0)
    led.begin()
    steps([2.0, 1.0, 1.0, 1.0], warm=1)
    with led.pause("checkpoint_save"):
        tick(1.0)
    seconds = led.state_dict()
    # attempt 2 continues checkpoint 4's seconds and adds attempt 1's lost tail: 12 - 9 s
    now[0] = 32.0
    led = TimeLedger(clock=lambda: now[0], started_at=32.0)
    led.load_state_dict(seconds)
    led.add("lost_progress", 12.0 - 9.0)
    tick(4.0)
    led.begin()
    with led.pause("checkpoint_load"):
        tick(1.0)
    steps([2.0, 1.0, 1.0, 1.0], warm=1)
    with led.pause("checkpoint_save"):
        tick(1.0)
    seconds = led.state_dict()
    # attempt 3 from checkpoint 8, attempt 2's lost tail 45 - 43 s
    now[0] = 50.0
    led = TimeLedger(clock=lambda: now[0], started_at=50.0)
    led.load_state_dict(seconds)
    led.add("lost_progress", 45.0 - 43.0)
    tick(4.0)
    led.begin()
    with led.pause("checkpoint_load"):
        tick(1.0)
    steps([2.0, 1.0, 1.0, 1.0], warm=1)
    with led.pause("checkpoint_save"):
        tick(1.0)
    led.close()
    return breakdown(led.seconds, led.warmup_steps, led.steady_steps)


def test_wall_time_is_productive_plus_every_badput_down_time_included():
    parts = rel.with_down(_attempt_ledgers(), rel.compute(three_attempts()).down_s)
    # productive 12 steps of 1 s; init 3+4+4; warm-up excess 1+1+1; saves 3; loads 2; lost 3+2; down 25
    assert parts["productive"] == pytest.approx(12.0)
    assert (parts["init"], parts["warmup"], parts["checkpoint_save"], parts["checkpoint_load"],
            parts["lost_progress"], parts["down"]) == pytest.approx((11.0, 3.0, 3.0, 2.0, 5.0, 25.0))
    assert parts["wall"] == pytest.approx(61.0)
    assert parts["productive"] + sum(v for k, v in parts.items() if k not in ("productive", "wall")) \
        == pytest.approx(parts["wall"])


def test_goodput_covers_the_whole_job():
    parts = rel.with_down(_attempt_ledgers(), 25.0)
    assert goodput(parts) == pytest.approx(12.0 / 61.0)  # 0.1967; without the down time it was 12/36


def test_mtbf_and_its_chi_square_interval():
    r = rel.compute(three_attempts())
    assert r.mtbf_s == pytest.approx(36.0 / 2)  # operating 36 s / 2 failures
    # T = 36 s, r = 2: low = 2T / chi2(0.975, 6), high = 2T / chi2(0.025, 4)
    assert r.mtbf_ci95_low_s == pytest.approx(72.0 / CHI2_0975_DF6, rel=1e-4)  # 4.983 s
    assert r.mtbf_ci95_high_s == pytest.approx(72.0 / CHI2_0025_DF4, rel=1e-4)  # 148.6 s


def test_recovery_time_and_its_parts():
    r = rel.compute(three_attempts())
    # failure 1: 12 -> 38 (32 + 4 set-up + 1 load + 1 re-warm-up) = 26; failure 2: 45 -> 56 = 11
    assert r.recovery_s == pytest.approx((26.0 + 11.0) / 2)
    assert r.recovery_parts_s == pytest.approx({"down": 12.5, "setup": 4.0, "load": 1.0, "rewarm": 1.0})
    assert [row["recovery_s"] for row in r.failed] == pytest.approx([26.0, 11.0])


def test_failure_cost_is_recovery_plus_lost_progress():
    r = rel.compute(three_attempts())
    assert r.lost_s == pytest.approx((12.0 - 9.0) + (45.0 - 43.0))
    assert r.failure_cost_s == pytest.approx((26.0 + 3.0) + (11.0 + 2.0))  # 42


def test_tor_is_failure_free_time_over_observed_time():
    r = rel.compute(three_attempts())
    # 61 - 42 = 19 s: 3 s set-up + 1 s warm-up + 12 steps + 3 checkpoint writes, the job without failures
    assert r.tor == pytest.approx(19.0 / 61.0)


def test_successful_interval_ratio_over_checkpoint_intervals():
    r = rel.compute(three_attempts())
    # intervals (0,4], (4,8], (8,12] completed; (4,8] retried (kill at 7), (8,12] retried (NaN at 10)
    assert r.successful_interval_ratio == pytest.approx(1.0 / 3.0)


def test_failures_are_listed_with_cause_step_and_time():
    r = rel.compute(three_attempts())
    assert [(x["attempt"], x["cause"], x["step"], x["at_s"], x["lost_steps"]) for x in r.failed] == \
        [(1, "signal", 7, 12.0, 3), (2, "nan", 10, 45.0, 2)]
    assert rel.describe(r) == "3 attempts, 2 failures (SIGKILL at step 7, NaN loss at step 10), recovery 18 s, down 25 s"
    assert rel.failures_line(r).startswith("attempt 1: signal (SIGKILL) at step 7, 12.0 s into the job, checkpoint 4, "
                                           "3 steps redone, down 20.0 s, recovery 26.0 s, lost 3.0 s; attempt 2: nan")
    assert rel.failures_line(r).endswith(", lost 2.0 s")  # 45 - 43: the NaN at 45 s, its checkpoint at 43 s


def test_no_failure_gives_no_mtbf_but_its_lower_bound():
    r = rel.compute([rel.Attempt(start=0.0, last_alive=100.0, steps=10, checkpoints=(5, 10))])
    assert (r.failures, r.mtbf_s, r.mtbf_ci95_high_s) == (0, None, None)
    assert r.mtbf_ci95_low_s == pytest.approx(200.0 / CHI2_0975_DF2, rel=1e-4)  # 27.1 s
    assert "no failure" in r.why["mtbf_s"]
    assert (r.failure_cost_s, r.tor, r.successful_interval_ratio) == (0.0, 1.0, 1.0)


def test_failure_before_the_first_checkpoint_loses_every_step_since_the_first_productive_one():
    a = rel.Attempt(start=0.0, last_alive=20.0, end="signal", detail="SIGKILL", steps=10, setup_s=5.0, rewarm_s=1.0)
    assert a.lost_s == pytest.approx(20.0 - 6.0)


def test_a_failure_without_a_next_attempt_has_no_recovery():
    r = rel.compute([rel.Attempt(start=0.0, last_alive=10.0, end="oom", steps=3)])
    assert (r.recovery_s, r.failure_cost_s, r.tor) == (None, None, None)
    assert r.why["recovery_s"] == "no attempt followed the failure yet"


def test_overlapping_attempts_are_refused():
    with pytest.raises(ValueError, match="overlaps the previous one"):
        rel.compute([rel.Attempt(start=0.0, last_alive=10.0, end="signal"), rel.Attempt(start=5.0, last_alive=20.0)])


def test_an_unknown_end_is_refused():
    with pytest.raises(ValueError, match="attempt end 'crashed' is not accepted"):
        rel.Attempt(start=0.0, last_alive=1.0, end="crashed")


def test_with_down_refuses_negative_down_time():
    with pytest.raises(ValueError, match="is negative"):
        rel.with_down({"wall": 1.0, "productive": 1.0}, -1.0)


# ------------------------------------------------------------------------------ the job's ledger (train/job.py)
def _drive(job, clock, first, last, ckpt_every, step_s=1.0):
    for step in range(first, last + 1):
        job.step_started()
        clock[0] += step_s
        job.step_done(step)
        if step % ckpt_every == 0:
            clock[0] += 1.0
            job.checkpoint(step)


def test_a_killed_attempt_is_closed_by_the_next_one_at_its_heartbeat(tmp_path):
    from mlflow_llmeff.train import job as jobs

    clock = [100.0]
    job = jobs.Job(str(tmp_path), clock=lambda: clock[0])
    assert job.begin(start_unix=97.0, start_step=0, warmup_steps=0) is None  # a new job
    job.record_run("run-1")
    _drive(job, clock, 1, 7, ckpt_every=4)  # step 4 done at 104, checkpoint at 105, step 7 done at 108
    # SIGKILL: no end record; the next attempt starts 20 s later
    clock[0] = 128.0
    job2 = jobs.Job(str(tmp_path), clock=lambda: clock[0])
    assert job2.begin(start_unix=128.0, start_step=4, warmup_steps=0) == "run-1"  # the same run
    assert job2.attempt == 2
    first = job2.attempts()[0]
    assert (first.end, first.steps, first.last_alive) == ("unknown", 7, 108.0)
    assert (first.checkpoint_step, first.checkpoint_at, first.setup_s) == (4, 105.0, 3.0)  # 97 -> first step 100


def test_the_ledger_gives_the_job_figures(tmp_path):
    from mlflow_llmeff.train import job as jobs

    clock = [100.0]
    job = jobs.Job(str(tmp_path), clock=lambda: clock[0])
    job.begin(start_unix=100.0, start_step=0, warmup_steps=0)
    _drive(job, clock, 1, 3, ckpt_every=100)  # no checkpoint; killed after step 3 at 103
    clock[0] = 110.0
    job = jobs.Job(str(tmp_path), clock=lambda: clock[0])
    job.begin(start_unix=110.0, start_step=0, warmup_steps=0)
    _drive(job, clock, 1, 5, ckpt_every=5)  # steps done at 111..115, checkpoint 5 at 116
    r = rel.compute(job.attempts(step=5, end=rel.FINISHED))
    assert (r.attempts, r.failures, r.down_s, r.wall_s) == (2, 1, 7.0, 16.0)  # 103 -> 110; 100 -> 116
    assert r.failed[0]["lost_s"] == 3.0  # no checkpoint: every step of the attempt is redone
    assert r.mtbf_s == 9.0  # (16 - 7) / 1


def test_the_heartbeat_ignores_a_torn_record(tmp_path):
    from mlflow_llmeff.train import job as jobs

    hb = jobs.Heartbeat(str(tmp_path / "p"), attempt=3, clock=lambda: 5.0)
    hb.beat(12)
    assert jobs.read_heartbeat(str(tmp_path / "p")) == {"attempt": 3, "step": 12, "unix": 5.0}
    with open(tmp_path / "p", "r+b") as f:
        f.write(b"3 13")  # the step changed, the CRC not
    assert jobs.read_heartbeat(str(tmp_path / "p")) is None


@pytest.mark.parametrize("exc, signalled, expected", [
    (None, None, ("finished", "")),
    (SystemExit(143), "SIGTERM", ("signal", "SIGTERM")),
    (SystemExit(3), None, ("exit_code", "exit 3")),
    (RuntimeError("Connection closed by peer [127.0.0.1]:29500"), None, ("lost_rank", "a peer rank was lost (RuntimeError)")),
    (RuntimeError("CUDA out of memory. Tried to allocate 2 GiB"), None, ("oom", "out of memory")),
])
def test_an_attempt_end_is_classified(exc, signalled, expected):
    from mlflow_llmeff.train.job import classify

    assert classify(exc, signalled) == expected


def test_a_nan_failure_is_classified_nan():
    from mlflow_llmeff.train.job import classify
    from mlflow_llmeff.train.loop import NonFiniteLoss

    assert classify(NonFiniteLoss("train/loss is nan at step 10"), None) == ("nan", "NaN loss")


# ------------------------------------------------------------------------------ a real job (slow)
ARGS = ["--max-steps", "12", "--log-every-n-steps", "2", "--seq-len", "32", "--micro-batch-size", "2",
        "--checkpoint-every", "100", "--warmup-steps", "1", "--measure-energy", "none", "--seed", "3"]


@pytest.mark.slow
def test_a_run_killed_before_its_first_checkpoint_continues_the_same_run(tmp_path, tracking_uri):
    import os
    import subprocess
    import sys
    import time

    import mlflow

    from mlflow_llmeff import names
    from mlflow_llmeff.train import faults

    from conftest import START_TICK_S, process_start_unix_of
    from test_train_e2e import env_for, last_sign_of_life, only_run, parts_add_up

    ck = tmp_path / "ck"

    def train(extra):
        t0 = time.time()
        proc = subprocess.Popen([sys.executable, "-m", "mlflow_llmeff", "train", *ARGS, "--checkpoint-dir", str(ck)],
                                cwd=tmp_path, env={**env_for(tracking_uri), **extra}, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        started = process_start_unix_of(proc.pid)  # read off /proc while it runs
        out, err = proc.communicate(timeout=300)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), t0, started, time.time()

    first, t0, _, t1 = train({faults.ENV["kill_at_step"]: "6"})  # SIGKILL right after step 6, no checkpoint yet
    assert first.returncode == -9, first.stderr[-2000:]
    assert not os.path.isdir(ck / "step_00000006")
    last_alive = last_sign_of_life(ck, attempt=1, step=6)  # before the second attempt changes the files
    assert last_alive <= t1
    time.sleep(3.0)  # down time
    second, t2, second_start, t3 = train({})
    assert second.returncode == 0, second.stderr[-3000:]
    assert t2 - START_TICK_S <= second_start <= t3
    assert "continuing MLflow run" in second.stdout
    mlflow.set_tracking_uri(tracking_uri)
    run = only_run()  # the second attempt continued the first one's run
    assert run.info.status == "FINISHED"
    m = run.data.metrics
    assert (m[names.SUM_ATTEMPTS], m[names.SUM_FAILURES]) == (2.0, 1.0)
    # down (docs/time.md): the first attempt's last sign of life (its heartbeat after step 6, just before
    # the kill) to the second's process start (read off /proc here): those two, to the tick
    assert m[names.SUM_BADPUT_DOWN_S] == pytest.approx(second_start - last_alive, abs=START_TICK_S)
    # the first attempt's time is in the job: the wall time covers both attempts and the gap between them
    assert (t1 - t0) + (t2 - t1) < m[names.SUM_WALL_S] <= (t3 - t0) + 0.5
    assert parts_add_up(m) == pytest.approx(m[names.SUM_WALL_S], rel=0.01)
    # MTBF over the operating time: the job's wall time less its down time, one failure
    assert m[names.SUM_MTBF_S] == pytest.approx(m[names.SUM_WALL_S] - m[names.SUM_BADPUT_DOWN_S], rel=1e-3)
    assert run.data.tags[names.RESUME_ATTEMPTS] == "2"
    tag = run.data.tags[names.RELIABILITY_FAILURES]
    assert tag.startswith("attempt 1: unknown (no exit record (killed or lost)) at step 6"), tag
    assert run.data.tags[names.RELIABILITY].startswith("2 attempts, 1 failure (no exit record (killed or lost) at step 6)")
    assert "llmeff: 2 attempts, 1 failure" in second.stdout
    assert "2 attempts, 1 failure" in run.data.tags["mlflow.note.content"]  # the run's description


def test_a_process_start_is_read_to_a_clock_tick_not_to_a_whole_boot_second():
    """The start of an attempt is the process's start, read off ``/proc`` on the boot clock. Through
    psutil (``btime``, whole seconds) it came out up to 1 s early: CI measured a 3.0 s restart gap as
    2.51 s of down time."""
    import subprocess
    import sys
    import time

    code = "from mlflow_llmeff.meters import probes; import time; print(repr(probes.process_start_unix()), repr(time.time()))"
    for _ in range(3):
        before = time.time()
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
        start, printed = map(float, out.split())
        # truncated to a tick (10 ms at 100 Hz), so at most one tick before the spawn; never after the print
        assert before - 0.011 <= start <= printed


def test_carry_gives_the_meter_what_no_checkpoint_holds():
    from mlflow_llmeff.train.job import carry

    a = three_attempts()
    # attempt 3 resumed checkpoint 8 written by attempt 2: attempt 2's tail ends at 45; no attempt in between
    assert carry(a, 8) == {"down_s": 25.0, "earlier_s": {}, "tail_end_unix": 45.0, "attempts": 3}
    # no checkpoint at all: attempts 1 and 2 are in no meter state (set-up 3 + 4, load 1, the rest redone)
    assert carry(a, None) == {"down_s": 25.0, "earlier_s": {"init": 7.0, "checkpoint_load": 1.0,
                                                            "lost_progress": (12.0 - 3.0) + (13.0 - 5.0)},
                              "tail_end_unix": None, "attempts": 3}


def test_an_elastic_restart_does_not_start_at_the_launchers_start(tmp_path):
    from mlflow_llmeff.train import job as jobs

    clock = [100.0]
    job = jobs.Job(str(tmp_path), clock=lambda: clock[0])
    job.begin(start_unix=90.0, start_step=0, warmup_steps=0)  # the launcher started at 90
    _drive(job, clock, 1, 2, ckpt_every=100)  # killed after step 2 at 102
    clock[0] = 104.0
    job = jobs.Job(str(tmp_path), clock=lambda: clock[0])
    job.begin(start_unix=90.0, start_step=0, warmup_steps=0)  # the same launcher's start, passed again
    assert job.start_unix >= 102.0  # this process's start (later than the previous attempt's end)


def test_a_finished_job_is_known_as_finished(tmp_path):
    from mlflow_llmeff.train import job as jobs

    job = jobs.Job(str(tmp_path), clock=lambda: 10.0)
    job.begin(start_unix=5.0, start_step=0, warmup_steps=0)
    assert not job.finished()
    job.end("finished", 3)
    assert jobs.Job(str(tmp_path)).finished()


def test_fleet_mtbf_sums_operating_time_and_failures():
    mtbf, low, high = rel.fleet_mtbf([(36.0, 2), (100.0, 0), (64.0, 2)])
    assert mtbf == pytest.approx(200.0 / 4)
    # T = 200 s, r = 4: 2T / chi2(0.975; 10) = 400 / 20.4832, 2T / chi2(0.025; 8) = 400 / 2.1797
    assert (low, high) == (pytest.approx(400.0 / 20.4832, rel=1e-4), pytest.approx(400.0 / 2.1797, rel=1e-4))


# ------------------------------------------------------------------------------ the meter's side (monitor/)
def test_the_meter_puts_the_jobs_down_time_and_earlier_attempts_in_the_wall_time(tracking_uri):
    import mlflow

    from mlflow_llmeff import names
    from mlflow_llmeff.monitor.meter import EfficiencyMonitor
    from mlflow_llmeff.testing import FakeClock

    clock = FakeClock()
    mon = EfficiencyMonitor(log_every_n_steps=2, warmup_steps=1, clock=clock, measure_energy="none")
    # an earlier attempt with no checkpoint: 3 s set-up, 6 s of steps redone; 20 s down before this one
    mon.continue_job(down_s=20.0, earlier_s={"init": 3.0, "lost_progress": 6.0}, attempts=2)
    ended = []

    def figures(end_unix):
        ended.append(end_unix)
        return {names.SUM_FAILURES: 1.0}, {names.RELIABILITY: "2 attempts, 1 failure"}, "2 attempts, 1 failure"

    mon.set_job_figures(figures)
    for _ in range(4):  # 4 steps of 1 s: no warm-up excess, 4 s productive
        clock.t += 1.0
        mon.step(tokens=100, samples=4)
    s = mon.finish()
    assert s[names.SUM_BADPUT_DOWN_S] == 20.0
    assert s[names.SUM_WALL_S] == 4.0 + 3.0 + 6.0 + 20.0
    assert s[names.SUM_GOODPUT] == pytest.approx(4.0 / 33.0)
    assert s[names.SUM_FAILURES] == 1.0 and len(ended) == 1
    run = mlflow.MlflowClient().get_run(mon.run_id)
    assert run.data.tags[names.RESUME_ATTEMPTS] == "2"
    assert run.data.tags[names.RELIABILITY] == "2 attempts, 1 failure"
    assert run.data.tags["mlflow.note.content"].endswith("\n\n2 attempts, 1 failure")
    assert run.data.tags[names.ENERGY_SPAN] == ("cost/* covers the attempts' device time: the job's 20.000 s of "
                                                "summary/badput_down_s (no attempt ran) are not priced")


def test_continue_job_refuses_negative_down_time(tracking_uri):
    from mlflow_llmeff.monitor.meter import EfficiencyMonitor
    from mlflow_llmeff.testing import FakeClock

    mon = EfficiencyMonitor(log_every_n_steps=2, warmup_steps=0, clock=FakeClock(), measure_energy="none")
    with pytest.raises(ValueError, match="down time -1.0 s is negative"):
        mon.continue_job(down_s=-1.0)
    mon.finish()


def test_the_launcher_closes_an_attempt_its_workers_left_open(tmp_path):
    from mlflow_llmeff.train import job as jobs

    clock = [100.0]
    job = jobs.Job(str(tmp_path), clock=lambda: clock[0])
    job.begin(start_unix=90.0, start_step=0, warmup_steps=0)
    _drive(job, clock, 1, 3, ckpt_every=100)  # rank 0 killed after step 3 (heartbeat at 103)
    jobs.Job(str(tmp_path)).close_open(-9)
    end = jobs.Job(str(tmp_path)).events()[-1]
    assert (end["kind"], end["detail"], end["step"], end["unix"], end["by"]) == ("signal", "SIGKILL", 3, 103.0, "launcher")
    jobs.Job(str(tmp_path)).close_open(1)  # already closed: nothing more
    assert len(jobs.Job(str(tmp_path)).events()) == len(job.events())


def test_a_diverged_attempt_records_its_nan_end(tracking_uri, tmp_path):
    from mlflow_llmeff.train import job as jobs
    from mlflow_llmeff.train.config import TrainConfig
    from mlflow_llmeff.train.loop import NonFiniteLoss, run_training

    cfg = TrainConfig(max_steps=20, log_every_n_steps=1, seq_len=32, micro_batch_size=2, learning_rate=1e8,
                      checkpoint_dir=str(tmp_path / "ck"), checkpoint_every=1, measure_energy="none")
    with pytest.raises(NonFiniteLoss):
        run_training(cfg)
    job = jobs.Job(str(tmp_path / "ck"))
    end = job.events()[-1]
    assert (end["event"], end["kind"], end["detail"], end["by"]) == ("end", "nan", "NaN loss", "itself")
    assert job.record()["run_id"]  # the run is recorded for a restart
    a = job.attempts()[0]
    assert a.failed and a.checkpoint_step == a.steps - 1  # the checkpoint before the NaN step


# ------------------------------------------------------------------------------ the launcher's view (train/elastic.py)
def test_an_exit_status_is_read_as_its_signal():
    from mlflow_llmeff.train.job import signal_of

    assert [signal_of(c) for c in (-9, 137, -15, 143, 1, 0, 128, 255)] == \
        ["SIGKILL", "SIGKILL", "SIGTERM", "SIGTERM", None, None, None, None]


def _failure(rank, exitcode, unix):
    return {"rank": rank, "exitcode": exitcode, "signal": None, "unix": unix}


@pytest.mark.parametrize("returncode, failures, own, expected", [
    # rank 1 SIGKILLed; rank 0 then saw its peer go (gloo) and was stopped by the agent (143), a second later
    (1, [_failure(1, -9, 100), _failure(0, 143, 101)], {"kind": "lost_rank"}, ("lost_rank", "lost rank 1 (SIGKILL)")),
    # the same second: the signalled rank is the cause, not rank 0's exit
    (1, [_failure(0, 1, 100), _failure(1, -9, 100)], {"kind": "signal"}, ("lost_rank", "lost rank 1 (SIGKILL)")),
    (1, [_failure(2, 3, 100)], {"kind": "signal", "detail": "SIGTERM"}, ("lost_rank", "lost rank 2 (exit 3)")),
    (1, [_failure(1, 137, 100)], None, ("lost_rank", "lost rank 1 (SIGKILL)")),  # a shell's 128 + 9
    (1, [_failure(0, -9, 100)], None, ("signal", "SIGKILL")),   # rank 0 itself killed: no record of its own
    (1, [_failure(0, 1, 100)], {"kind": "nan"}, None),            # rank 0 said why itself: kept
    (-9, [], None, ("signal", "SIGKILL")),                        # the launcher itself was killed
    (137, [], None, ("signal", "SIGKILL (exit 137)")),
    (1, [], None, ("exit_code", "launcher exit 1, rank 0 left no exit record")),
    (1, [_failure(1, -9, 100)], {"kind": "finished"}, None),       # a rank lost after the job finished
])
def test_the_launcher_names_the_lost_rank_and_its_signal(returncode, failures, own, expected):
    from mlflow_llmeff.train.job import launch_ending

    assert launch_ending(returncode, failures, own) == expected


def test_torch_elastics_failures_are_recorded_first_seen_first(tmp_path):
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from mlflow_llmeff.train import elastic

    err = ChildFailedError("loop", {0: ProcessFailure(local_rank=0, pid=11, exitcode=143, error_file="<N/A>"),
                                    1: ProcessFailure(local_rank=1, pid=12, exitcode=-9, error_file="<N/A>")})
    err.failures[0].timestamp, err.failures[1].timestamp = 1001, 1000
    records = elastic.failure_records(err)
    assert [(r["rank"], r["exitcode"], r["signal"], r["unix"]) for r in records] == \
        [(1, -9, "SIGKILL", 1000.0), (0, 143, None, 1001.0)]
    assert records[0]["message"] == "Signal 9 (SIGKILL) received by PID 12"
    elastic.write_failures(str(tmp_path / "f.json"), records)
    assert elastic.read_failures(str(tmp_path / "f.json")) == records
    assert elastic.failure_records(RuntimeError("x")) == [] and elastic.read_failures(str(tmp_path / "none")) == []


def test_the_launcher_replaces_rank_0s_view_with_the_lost_rank(tmp_path):
    from mlflow_llmeff.train import job as jobs

    clock = [100.0]
    job = jobs.Job(str(tmp_path), clock=lambda: clock[0])
    job.begin(start_unix=90.0, start_step=0, warmup_steps=0)
    _drive(job, clock, 1, 4, ckpt_every=3)  # checkpoint 3 at 104, step 4 at 105; then rank 1 is killed
    job.end("lost_rank", 4, "a peer rank was lost (RuntimeError)")  # rank 0's collective fails, at 105
    jobs.Job(str(tmp_path)).close_open(1, [_failure(1, -9, 105), _failure(0, 143, 106)])
    (a,) = jobs.Job(str(tmp_path)).attempts()
    assert (a.end, a.detail, a.steps, a.last_alive) == ("lost_rank", "lost rank 1 (SIGKILL)", 4, 105.0)
    assert jobs.Job(str(tmp_path)).events()[-1]["rank0"] == "lost_rank (a peer rank was lost (RuntimeError))"
    assert rel.failures_line(rel.compute([a])).startswith("attempt 1: lost_rank (lost rank 1 (SIGKILL)) at step 4")


def test_a_short_attempts_set_up_is_in_its_recovery_before_it_ends(tmp_path):
    # the job's figures are computed when the meter's clock stops, before the attempt's end record:
    # an attempt of fewer steps than 2 x warmup_steps had not written its set-up yet (recovery = down only)
    from mlflow_llmeff.train import job as jobs

    clock = [100.0]
    job = jobs.Job(str(tmp_path), clock=lambda: clock[0])
    job.begin(start_unix=100.0, start_step=0, warmup_steps=0)
    _drive(job, clock, 1, 3, ckpt_every=3)  # checkpoint 3 at 104, killed: heartbeat at 103... 104
    clock[0] = 110.0
    job = jobs.Job(str(tmp_path), clock=lambda: clock[0])
    job.begin(start_unix=110.0, start_step=3, warmup_steps=3)
    clock[0] = 115.0  # 5 s of set-up
    _drive(job, clock, 4, 5, ckpt_every=100)  # 2 steps of 1 s: fewer than the 6 that write the record
    job.settle()
    r = rel.compute(job.attempts(step=5, end=rel.FINISHED))
    assert r.recovery_parts_s["setup"] == 5.0
    assert r.recovery_s == pytest.approx((110.0 - 104.0) + 5.0 + 2.0)  # down, set-up, 2 warm-up steps


@pytest.mark.slow
def test_a_job_killed_between_its_final_checkpoint_and_its_runs_end_is_closed_by_its_rerun(tmp_path, tracking_uri,
                                                                                            monkeypatch):
    # issue 52: the rerun said 'already the end of this run; nothing to do' and the run stayed RUNNING for ever
    import subprocess
    import sys

    import mlflow

    from mlflow_llmeff import names
    from mlflow_llmeff.train import faults

    from test_train_e2e import env_for, only_run

    ck = tmp_path / "ck"
    args = [sys.executable, "-m", "mlflow_llmeff", "train", "--model", "llama-tiny", "--dataset", "synthetic",
            "--max-steps", "4", "--seq-len", "32", "--micro-batch-size", "2", "--log-every-n-steps", "2",
            "--checkpoint-every", "2", "--warmup-steps", "1", "--measure-energy", "none", "--checkpoint-dir", str(ck)]

    def train(extra):
        return subprocess.run(args, cwd=tmp_path, env={**env_for(tracking_uri), **extra}, capture_output=True,
                              text=True, timeout=300)

    first = train({faults.ENV["kill_at_step"]: "4"})  # SIGKILL after the final checkpoint (step 4), before the end
    assert first.returncode == -9 and (ck / "step_00000004").is_dir(), first.stderr[-2000:]
    mlflow.set_tracking_uri(tracking_uri)
    assert only_run().info.status == "RUNNING"
    second = train({})
    assert second.returncode == 0, second.stderr[-3000:]
    assert "nothing to do" not in second.stdout
    run = only_run()
    assert run.info.status == "FINISHED"
    m = run.data.metrics
    assert (m[names.SUM_ATTEMPTS], m[names.SUM_FAILURES], m[names.SUM_STEPS]) == (2.0, 1.0, 4.0)
    assert run.data.tags[names.RELIABILITY].startswith("2 attempts, 1 failure (no exit record (killed or lost) at step 4)")
    # the job finished: its final checkpoint is now the end, nothing to do. The same command in this process
    # (click's runner): it starts no attempt and reads no process start, so only an interpreter's imports
    # differed (this test and the in-process one before it, whole-tree CPU: 30.6, 29.6 s in a process; 26.6,
    # 24.3 s here)
    from click.testing import CliRunner

    from mlflow_llmeff.cli import main

    monkeypatch.chdir(tmp_path)
    third = CliRunner().invoke(main, args[3:])
    assert third.exit_code == 0 and "nothing to do" in third.stdout, third.output[-3000:]
    assert only_run().data.metrics[names.SUM_ATTEMPTS] == 2.0


@pytest.mark.slow
def test_sigterm_to_llmeff_train_ends_its_whole_process_tree_and_the_run_keeps_its_points(tmp_path, tracking_uri):
    # issue 52: SIGTERM (scancel, a Kubernetes pod's stop) to `llmeff train --num-processes 2` ended the launcher
    # alone; its torch elastic agent and both workers went on
    import signal
    import subprocess
    import sys
    import time

    import mlflow
    import psutil

    from mlflow_llmeff import names

    from test_train_e2e import env_for

    proc = subprocess.Popen([sys.executable, "-m", "mlflow_llmeff", "train", "--num-processes", "2", "--max-steps",
                             "100000", "--log-every-n-steps", "2", "--seq-len", "32", "--micro-batch-size", "2",
                             "--measure-energy", "none", "--measure-comm", "false"],
                            cwd=tmp_path, env={**env_for(tracking_uri), "ACCELERATE_USE_CPU": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _sigterm_the_tree(proc, tracking_uri)
    finally:  # a failed assertion leaves no process behind either
        for p in [proc.pid] + [c.pid for c in psutil.Process(proc.pid).children(recursive=True)] \
                if psutil.pid_exists(proc.pid) else []:
            try:
                psutil.Process(p).kill()
            except psutil.Error:
                pass


@pytest.mark.slow
def test_sigterm_with_a_checkpoint_folder_checkpoints_ends_the_attempt_preempted_and_the_rerun_goes_on(
        tmp_path, tracking_uri):
    # issue 52: SIGTERM and a checkpoint folder, "checkpoint and end the attempt as preemption does when there is
    # time". Held at step 3 on rank 0 when the SIGTERM comes: both ranks agree on step 5 (4 is the first step end
    # that reads the flag, 5 the next for two ranks), write checkpoint 5, end the run KILLED and the attempt
    # preempted; llmeff train exits 143 (not 75: nothing asks a scheduler to requeue after scancel) with no
    # process of the tree left; the rerun trains step 6 alone, in the same run
    import json
    import os
    import signal
    import subprocess
    import sys
    import time

    import mlflow
    import psutil

    from mlflow_llmeff import names
    from mlflow_llmeff.train import faults
    from mlflow_llmeff.train import job as jobs

    from test_train_e2e import env_for, history, only_run

    ck, hold = tmp_path / "ck", tmp_path / "hold"
    cmd = [sys.executable, "-m", "mlflow_llmeff", "train", "--num-processes", "2", "--max-steps", "6",
           "--log-every-n-steps", "1", "--seq-len", "32", "--micro-batch-size", "2", "--measure-energy", "none",
           "--measure-comm", "false", "--checkpoint-dir", str(ck), "--checkpoint-every", "100"]
    env = {**env_for(tracking_uri), "ACCELERATE_USE_CPU": "1"}
    proc = subprocess.Popen(cmd, cwd=tmp_path, env={**env, faults.ENV["hold_at_step"]: "3",
                                                    faults.HOLD_FILE_ENV: str(hold)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    tree = []
    try:
        deadline = time.monotonic() + 300
        while not os.path.exists(f"{hold}.reached") and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        assert os.path.exists(f"{hold}.reached"), proc.communicate()[1][-3000:]
        tree = psutil.Process(proc.pid).children(recursive=True)
        proc.send_signal(signal.SIGTERM)
        hold.write_text("go")
        out, err = proc.communicate(timeout=120)
        gone, alive = psutil.wait_procs(tree, timeout=30)
        assert alive == [], [p.cmdline() for p in alive]
    finally:  # a failed assertion leaves no process behind either
        for p in [proc] + tree:
            try:
                p.kill()
            except (psutil.Error, OSError):
                pass
    assert proc.returncode == 143, err[-3000:]
    assert ("llmeff: preempted: SIGTERM (a stop request: scancel, a pod's stop), stopped after step 5; checkpoint "
            "step 5 written, the job continues in this run when run again") in out
    assert "requeue" not in err
    assert os.path.isdir(ck / "step_00000005") and not os.path.exists(ck / "step_00000006")
    ends = [json.loads(x) for x in (ck / jobs.LEDGER_FILE).read_text().splitlines() if '"end"' in x]
    assert [(e["kind"], e["step"]) for e in ends] == [("preempted", 5)]
    mlflow.set_tracking_uri(tracking_uri)
    run = only_run()
    assert run.info.status == "KILLED" and run.data.tags[names.ERROR].startswith("preempted: SIGTERM (a stop request")
    # 2 ranks x 2 sequences x 32 tokens a step, every step's point kept
    assert history(run, names.TRAIN_TOKENS) == [(s, 128.0 * s) for s in range(1, 6)]

    again = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    run = only_run()
    m = run.data.metrics
    assert run.info.status == "FINISHED" and run.data.tags[names.RESUMED_FROM] == "5"
    assert (m[names.SUM_ATTEMPTS], m[names.SUM_FAILURES], m[names.SUM_PREEMPTIONS]) == (2.0, 0.0, 1.0)
    assert history(run, names.TRAIN_TOKENS) == [(s, 128.0 * s) for s in range(1, 7)]


def _sigterm_the_tree(proc, tracking_uri):
    import signal
    import subprocess
    import time

    import mlflow
    import psutil

    from mlflow_llmeff import names

    mlflow.set_tracking_uri(tracking_uri)
    client, run, tree = mlflow.MlflowClient(), None, []
    deadline = time.time() + 240
    while time.time() < deadline:  # until the run has logged steps from both workers' job
        runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
        run = runs[0] if runs else None
        if run is not None and run.data.metrics.get(names.TRAIN_TOKENS, 0) > 0:
            break
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(1.0)
    assert run is not None and run.data.metrics.get(names.TRAIN_TOKENS, 0) > 0
    tree = psutil.Process(proc.pid).children(recursive=True)
    assert len(tree) >= 3  # torch elastic's agent and the two workers (and their helpers)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=60)
    gone, alive = psutil.wait_procs(tree, timeout=30)
    assert alive == [], [p.cmdline() for p in alive]
    run = client.get_run(run.info.run_id)
    assert run.info.status in ("KILLED", "FAILED")
    assert client.get_metric_history(run.info.run_id, names.TRAIN_TOKENS)  # its points were kept
