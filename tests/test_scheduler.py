"""meters/scheduler.py: SLURM's and a PyTorchJob's environment read as the machines' layout and the
llmeff.scheduler.* tags, with a faked environment and a fake scontrol; train/placement.py applies it."""

from __future__ import annotations

import subprocess

import mlflow
import pytest

from mlflow_llmeff import names
from mlflow_llmeff.meters import scheduler
from mlflow_llmeff.train.config import TrainConfig
from mlflow_llmeff.train.placement import from_scheduler

from conftest import use_store


@pytest.fixture
def tracking_uri(module_store, monkeypatch):
    yield from use_store(module_store, monkeypatch)


class FakeScontrol:
    """``scontrol show hostnames`` and ``scontrol show job -o`` answered from fixed text; records the calls."""

    def __init__(self, hosts: list[str], job: str = "", fail: bool = False) -> None:
        self.hosts, self.job, self.fail, self.calls = hosts, job, fail, []

    def __call__(self, argv, **kw):
        self.calls.append(list(argv))
        if self.fail:
            raise FileNotFoundError("scontrol")
        if argv[:3] == ["scontrol", "show", "hostnames"]:
            return subprocess.CompletedProcess(argv, 0, "\n".join(self.hosts) + "\n", "")
        if argv[:3] == ["scontrol", "show", "job"]:
            return subprocess.CompletedProcess(argv, 0, self.job, "")
        return subprocess.CompletedProcess(argv, 1, "", "unknown")


JOB_TEXT = ("JobId=4242 JobName=train UserId=root(0) JobState=RUNNING Reason=None Requeue=1 Restarts=1 "
            "SubmitTime=2026-12-04T15:56:36 EligibleTime=2026-12-04T15:56:38 StartTime=2026-12-04T15:57:20 "
            "Partition=gpu NodeList=gpu-[07-08] NumNodes=2")

STEP_ENV = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NUM_NODES": "2", "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "gpu-[07-08]",
            "SLURM_JOB_PARTITION": "gpu", "SLURM_RESTART_COUNT": "1", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_NODES": "2",
            "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_NODELIST": "gpu-[07-08]", "SLURM_NODEID": "1", "SLURM_PROCID": "1",
            "SLURM_LOCALID": "0"}


def test_a_slurm_step_on_two_nodes_gives_the_layout_and_the_tags():
    fake = FakeScontrol(["gpu-07", "gpu-08"], JOB_TEXT)
    p = scheduler.read(STEP_ENV, run=fake)
    assert (p.scheduler, p.num_machines, p.machine_rank, p.main_process_host) == ("slurm", 2, 1, "gpu-07")
    assert ["scontrol", "show", "hostnames", "gpu-[07-08]"] in fake.calls
    assert p.queue_wait_s == 44.0  # 15:57:20 - 15:56:36
    assert scheduler.tags(p) == {names.SCHEDULER_NAME: "slurm", names.SCHEDULER_JOB_ID: "4242",
                                 names.SCHEDULER_NODES: "2", names.SCHEDULER_NODE_LIST: "gpu-[07-08]",
                                 names.SCHEDULER_RESTART_COUNT: "1", names.SCHEDULER_PARTITION: "gpu",
                                 names.SCHEDULER_QUEUE_WAIT_S: "44"}
    assert scheduler.layout(p, num_machines=1, machine_rank=0, main_process_ip="") == \
        {"num_machines": 2, "machine_rank": 1, "main_process_ip": "gpu-07"}


def test_a_batch_script_outside_srun_is_tagged_but_keeps_one_machine():
    env = {k: v for k, v in STEP_ENV.items() if not k.startswith("SLURM_STEP")}
    env.pop("SLURM_RESTART_COUNT")
    p = scheduler.read(env, run=FakeScontrol(["gpu-07", "gpu-08"], JOB_TEXT))
    assert p.num_machines is None and "outside srun" in p.why_no_layout
    assert scheduler.layout(p, num_machines=1, machine_rank=0, main_process_ip="") == \
        {"num_machines": 1, "machine_rank": 0, "main_process_ip": ""}
    assert scheduler.tags(p)[names.SCHEDULER_RESTART_COUNT] == "0"  # never requeued


def test_without_scontrol_the_node_list_is_expanded_here_and_the_queue_wait_is_absent():
    p = scheduler.read(STEP_ENV, run=FakeScontrol([], fail=True))
    assert p.main_process_host == "gpu-07" and p.queue_wait_s is None
    assert names.SCHEDULER_QUEUE_WAIT_S not in scheduler.tags(p)


@pytest.mark.parametrize("text, hosts", [
    ("gpu-[07-09]", ["gpu-07", "gpu-08", "gpu-09"]),
    ("n[1,3-4],login", ["n1", "n3", "n4", "login"]),
    ("a[008-010]b", ["a008b", "a009b", "a010b"]),
    ("single", ["single"]),
])
def test_expand_hostlist_follows_slurms_notation(text, hosts):
    assert scheduler.expand_hostlist(text) == hosts


@pytest.mark.parametrize("text, match", [("gpu-[3-1]", r"the range '3-1' runs backwards"),
                                         ("gpu-[x]", r"'x' is not a number or range"),
                                         ("gpu-[1-2", r"is malformed")])
def test_expand_hostlist_refuses_a_malformed_list(text, match):
    with pytest.raises(ValueError, match=match):
        scheduler.expand_hostlist(text)


@pytest.mark.parametrize("given, match", [
    (dict(num_machines=3), r"^num_machines=3 contradicts slurm's 2 \(SLURM_STEP_NUM_NODES\); leave num_machines out"),
    (dict(machine_rank=1, env={"SLURM_NODEID": "0"}),
     r"^machine_rank=1 contradicts slurm's 0 \(SLURM_NODEID\) on this node; leave machine_rank out$"),
    (dict(main_process_ip="gpu-08"), r"^main_process_ip='gpu-08' names node 1 of the job, but machine 0 is 'gpu-07' "
                                     r"\(the first host of SLURM_STEP_NODELIST\)"),
    (dict(env={"SLURM_STEP_NUM_TASKS": "4"}), r"^the SLURM step runs 4 tasks on 2 nodes; .*srun --ntasks-per-node=1\)$"),
])
def test_given_options_that_contradict_slurm_are_refused_in_one_line(given, match):
    env = {**STEP_ENV, **given.pop("env", {})}
    p = scheduler.read(env, run=FakeScontrol(["gpu-07", "gpu-08"], JOB_TEXT))
    args = {"num_machines": 1, "machine_rank": 0, "main_process_ip": "", **given}
    with pytest.raises(ValueError, match=match):
        scheduler.layout(p, **args)


def test_given_options_that_agree_with_slurm_are_kept():
    p = scheduler.read(STEP_ENV, run=FakeScontrol(["gpu-07", "gpu-08"], JOB_TEXT))
    # machine 0's address of another network (its InfiniBand name) is the user's choice
    assert scheduler.layout(p, num_machines=2, machine_rank=1, main_process_ip="gpu-07-ib") == \
        {"num_machines": 2, "machine_rank": 1, "main_process_ip": "gpu-07-ib"}


def test_a_pytorchjob_pod_gives_its_node_rank_master_and_processes():
    env = {"KUBERNETES_SERVICE_HOST": "10.0.0.1", "PET_NNODES": "2", "PET_NODE_RANK": "1", "PET_NPROC_PER_NODE": "4",
           "MASTER_ADDR": "llmeff-train-master-0", "MASTER_PORT": "23456", "WORLD_SIZE": "8", "RANK": "1"}
    p = scheduler.read(env)
    assert (p.scheduler, p.num_machines, p.machine_rank, p.main_process_host, p.main_process_port,
            p.processes_per_node) == ("kubernetes", 2, 1, "llmeff-train-master-0", 23456, 4)
    assert scheduler.tags(p) == {names.SCHEDULER_NAME: "kubernetes", names.SCHEDULER_NODES: "2"}
    cfg = from_scheduler(TrainConfig(), p, say=False)
    assert (cfg.num_machines, cfg.machine_rank, cfg.main_process_ip, cfg.main_process_port, cfg.num_processes) == \
        (2, 1, "llmeff-train-master-0", 23456, 4)


def test_an_elastic_node_range_gives_no_layout_and_a_launchers_worker_env_is_not_a_scheduler():
    p = scheduler.read({"PET_NNODES": "1:4", "MASTER_ADDR": "m"})
    assert p.num_machines is None and "elastic range" in p.why_no_layout
    # a worker that torchrun or accelerate launch started: RANK / WORLD_SIZE / GROUP_RANK are its launcher's
    assert scheduler.read({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "GROUP_RANK": "1",
                           "MASTER_ADDR": "127.0.0.1"}) is None


def test_from_scheduler_fills_the_options_not_given_and_keeps_a_given_port(capsys):
    p = scheduler.read(STEP_ENV, run=FakeScontrol(["gpu-07", "gpu-08"], JOB_TEXT))
    cfg = from_scheduler(TrainConfig(num_processes=2, main_process_port=29600), p)
    assert (cfg.num_machines, cfg.machine_rank, cfg.main_process_ip, cfg.main_process_port, cfg.num_processes) == \
        (2, 1, "gpu-07", 29600, 2)
    assert capsys.readouterr().err.strip() == \
        "llmeff: SLURM job 4242 on 2 nodes: num_machines=2, machine_rank=1, main_process_ip=gpu-07"
    assert from_scheduler(TrainConfig(), None) == TrainConfig()  # outside a scheduler: unchanged


def test_llmeff_train_refuses_a_contradicting_layout_before_any_heavy_work(monkeypatch, capsys):
    from mlflow_llmeff.cli import main

    for k, v in STEP_ENV.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(scheduler, "hostnames", lambda text, run=None: ["gpu-07", "gpu-08"])
    monkeypatch.setattr(scheduler, "queue_wait_s", lambda job, run=None: None)
    with pytest.raises(SystemExit) as e:
        main(["train", "--num-machines", "4"])
    assert e.value.code != 0
    err = capsys.readouterr().err
    assert "num_machines=4 contradicts slurm's 2 (SLURM_STEP_NUM_NODES)" in err and "Traceback" not in err


def test_a_monitored_run_under_slurm_carries_the_scheduler_tags(tracking_uri, monkeypatch):
    from mlflow_llmeff.monitor.meter import EfficiencyMonitor
    from mlflow_llmeff.testing import FakeClock

    env = {"SLURM_JOB_ID": "77", "SLURM_JOB_NUM_NODES": "1", "SLURM_JOB_NODELIST": "n1", "SLURM_JOB_PARTITION": "debug"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    fake = FakeScontrol(["n1"], "JobId=77 SubmitTime=2026-12-04T10:00:00 StartTime=2026-12-04T10:00:05")
    monkeypatch.setattr(scheduler.subprocess, "run", fake)
    clock = FakeClock()
    mon = EfficiencyMonitor(log_every_n_steps=1, warmup_steps=0, clock=clock, measure_energy="none",
                            measure_peak=False)
    clock.t += 1.0
    mon.step(tokens=10, samples=1)
    mon.finish()
    tags = mlflow.MlflowClient().get_run(mon.run_id).data.tags
    assert {k: tags.get(k) for k in (names.SCHEDULER_NAME, names.SCHEDULER_JOB_ID, names.SCHEDULER_NODES,
                                     names.SCHEDULER_NODE_LIST, names.SCHEDULER_RESTART_COUNT,
                                     names.SCHEDULER_PARTITION, names.SCHEDULER_QUEUE_WAIT_S)} == \
        {names.SCHEDULER_NAME: "slurm", names.SCHEDULER_JOB_ID: "77", names.SCHEDULER_NODES: "1",
         names.SCHEDULER_NODE_LIST: "n1", names.SCHEDULER_RESTART_COUNT: "0", names.SCHEDULER_PARTITION: "debug",
         names.SCHEDULER_QUEUE_WAIT_S: "5"}


def test_outside_a_scheduler_no_scheduler_tag_is_made_up():
    assert scheduler.read({"HOME": "/root"}) is None and scheduler.tags(None) == {}
