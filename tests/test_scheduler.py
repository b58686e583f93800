"""meters/scheduler.py and meters/schedulers/: SLURM's, a PyTorchJob's, a Kubeflow Trainer v2 TrainJob's
and Ray Train's environment read as the machines' layout and the llmeff.scheduler.* tags, with a faked
environment, a fake scontrol and a fake Ray train context; train/placement.py applies it."""

from __future__ import annotations

import subprocess

import mlflow
import pytest

from mlflow_llmeff import names
from mlflow_llmeff.meters import scheduler
from mlflow_llmeff.meters.schedulers import slurm as slurm_engine
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
    monkeypatch.setattr(slurm_engine, "hostnames", lambda text, run=None: ["gpu-07", "gpu-08"])
    monkeypatch.setattr(slurm_engine, "queue_wait_s", lambda job, run=None: None)
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
    monkeypatch.setattr(subprocess, "run", fake)
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


# ------------------------------------------------------------------ one class per engine
TRAINJOB_ENV = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "JOB_COMPLETION_INDEX": "1", "PET_NNODES": "2",
                "PET_NPROC_PER_NODE": "auto", "PET_NODE_RANK": "1",
                "PET_MASTER_ADDR": "llmeff-train-node-0-0.llmeff-train", "PET_MASTER_PORT": "29400"}


def test_the_engines_are_asked_in_order_and_each_detects_only_its_own():
    from mlflow_llmeff.meters import schedulers

    assert [e.name for e in schedulers.ENGINES] == ["ray", "slurm", "kubeflow-trainer", "torchrun"]
    assert schedulers.detect(STEP_ENV).name == "slurm"
    assert schedulers.detect(TRAINJOB_ENV).name == "kubeflow-trainer"
    pytorchjob = {k: v for k, v in TRAINJOB_ENV.items() if k != "JOB_COMPLETION_INDEX"}
    assert schedulers.detect(pytorchjob).name == "torchrun"  # read as "kubernetes": KUBERNETES_SERVICE_HOST
    assert schedulers.detect({"HOME": "/root"}) is None


@pytest.mark.parametrize("accelerators, cpus, value, want", [
    (1, 16, "auto", 1),   # one GPU: torchrun starts one process
    (8, 16, "auto", 8),
    (0, 2, "auto", 2),    # no accelerator: torchrun's auto is the CPU count
    (0, 2, "cpu", 2),
    (4, 2, "gpu", 4),
    (4, 2, "3", 3),
])
def test_nproc_per_node_resolves_as_torchrun_does(accelerators, cpus, value, want):
    from mlflow_llmeff.meters.schedulers.torchrun import nproc_per_node

    assert nproc_per_node(value, accelerators=lambda: accelerators, cpus=lambda: cpus) == want


@pytest.mark.parametrize("value, match", [("many", r"^PET_NPROC_PER_NODE='many' is not accepted; use a positive "
                                                    r"integer or one of: auto, cpu, gpu$"),
                                          ("0", r"PET_NPROC_PER_NODE='0' is not accepted"),
                                          ("gpu", r"^PET_NPROC_PER_NODE='gpu' but this machine has no accelerator")])
def test_nproc_per_node_refuses_what_torchrun_refuses(value, match):
    from mlflow_llmeff.meters.schedulers.torchrun import nproc_per_node

    with pytest.raises(ValueError, match=match):
        nproc_per_node(value, accelerators=lambda: 0, cpus=lambda: 2)


def test_a_trainjob_node_with_auto_processes_on_a_one_device_machine_reads_as_one():
    from mlflow_llmeff.meters.schedulers import KubeflowTrainer

    engine = KubeflowTrainer(accelerators=lambda: 1, cpus=lambda: 16)
    assert engine.detect(TRAINJOB_ENV)
    p = engine.read(TRAINJOB_ENV)
    assert (p.scheduler, p.num_machines, p.machine_rank, p.main_process_host, p.main_process_port,
            p.processes_per_node, p.job_id) == ("kubeflow-trainer", 2, 1, "llmeff-train-node-0-0.llmeff-train",
                                                29400, 1, "llmeff-train")
    assert scheduler.tags(p) == {names.SCHEDULER_NAME: "kubeflow-trainer", names.SCHEDULER_JOB_ID: "llmeff-train",
                                 names.SCHEDULER_NODES: "2"}
    cfg = from_scheduler(TrainConfig(), p, say=False)
    assert (cfg.num_machines, cfg.machine_rank, cfg.main_process_ip, cfg.main_process_port, cfg.num_processes) == \
        (2, 1, "llmeff-train-node-0-0.llmeff-train", 29400, 1)


def test_a_trainjob_node_on_this_cpu_machine_reads_auto_as_torchrun_would_here():
    import os

    import torch

    p = scheduler.read(TRAINJOB_ENV)  # the real device count: no accelerator in this venv's torch
    want = torch.accelerator.device_count() if torch.accelerator.is_available() else len(os.sched_getaffinity(0))
    assert p.scheduler == "kubeflow-trainer" and p.processes_per_node == want


def test_a_contradicting_machine_rank_under_a_trainjob_names_the_trainers_variable():
    p = scheduler.read({**TRAINJOB_ENV, "PET_NPROC_PER_NODE": "2"})
    with pytest.raises(ValueError, match=r"^machine_rank=0 contradicts kubeflow-trainer's 1 \(PET_NODE_RANK\)"):
        scheduler.layout(p, num_machines=2, machine_rank=0, main_process_ip="", defaults=(1, 9, ""))


class FakeRayContext:
    """``ray.train.get_context()`` of a worker: run name, world, ranks (Ray Train V2's TrainContext methods)."""

    def __init__(self, world=4, rank=2, local=1, local_world=2, node=1, name="llmeff-ray"):
        self.world, self.rank, self.local, self.local_world, self.node, self.name = world, rank, local, local_world, node, name

    def get_world_size(self): return self.world
    def get_world_rank(self): return self.rank
    def get_local_rank(self): return self.local
    def get_local_world_size(self): return self.local_world
    def get_node_rank(self): return self.node
    def get_experiment_name(self): return self.name


def test_a_ray_train_worker_is_tagged_with_its_run_and_world_and_gives_no_launch_layout():
    from mlflow_llmeff.meters.schedulers import RayTrain

    engine = RayTrain(context=lambda: FakeRayContext())
    assert engine.detect({}) and not RayTrain(context=lambda: None).detect({})
    p = engine.read({"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "1"})
    assert (p.scheduler, p.job_id, p.world_size, p.processes_per_node, p.machine_rank, p.nodes) == \
        ("ray", "llmeff-ray", 4, 2, 1, None)
    assert "Ray Train starts the processes" in p.why_no_layout
    assert scheduler.tags(p) == {names.SCHEDULER_NAME: "ray", names.SCHEDULER_JOB_ID: "llmeff-ray",
                                 names.SCHEDULER_WORLD_SIZE: "4"}
    assert scheduler.layout(p, num_machines=1, machine_rank=0, main_process_ip="") == \
        {"num_machines": 1, "machine_rank": 0, "main_process_ip": ""}
    one_node = RayTrain(context=lambda: FakeRayContext(world=2, local_world=2, node=0)).read({})
    assert one_node.nodes == 1 and scheduler.tags(one_node)[names.SCHEDULER_NODES] == "1"


def test_outside_a_ray_worker_ray_is_not_detected_nor_imported():
    import sys

    from mlflow_llmeff.meters.schedulers.ray import train_context

    if "ray.train" not in sys.modules:
        assert train_context() is None and "ray.train" not in sys.modules
    else:  # imported by an earlier test of this process: still no run here
        assert train_context() is None
