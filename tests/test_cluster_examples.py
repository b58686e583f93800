"""The cluster examples: examples/k8s/pytorchjob.yaml checked against the PyTorchJob (kubeflow.org/v1)
and Pod API fields in Python, and its Worker's command dry-run with the variables the operator sets;
examples/slurm/train.sbatch's directives and command. No Kubernetes here, and ``kubectl
--dry-run=client`` needs an API server even on the client (it downloads the OpenAPI schema), so the
schema check is this file's: the fields and values below are the API reference's."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys

import pytest
import yaml

from conftest import REPO
from test_train_e2e import env_for

K8S = REPO / "examples" / "k8s" / "pytorchjob.yaml"
SBATCH = REPO / "examples" / "slurm" / "train.sbatch"

# kubeflow.org/v1 (training-operator pkg/apis/kubeflow.org/v1: PyTorchJobSpec, RunPolicy, ReplicaSpec) and
# the operator's validation (pkg/controller.v1/pytorch: one Master replica, a container named "pytorch")
PYTORCHJOB_SPEC = {"runPolicy", "elasticPolicy", "pytorchReplicaSpecs", "nprocPerNode"}
RUN_POLICY = {"cleanPodPolicy": ("All", "Running", "None"), "ttlSecondsAfterFinished": int,
              "activeDeadlineSeconds": int, "backoffLimit": int, "schedulingPolicy": dict, "suspend": bool,
              "managedBy": str}
REPLICA_TYPES = ("Master", "Worker")
REPLICA_SPEC = {"replicas", "template", "restartPolicy"}
RESTART_POLICIES = ("Always", "OnFailure", "Never", "ExitCode")
CONTAINER_NAME = "pytorch"
# core/v1 PodSpec and Container fields the example uses (a subset of the API reference's)
POD_SPEC = {"containers", "volumes", "terminationGracePeriodSeconds", "nodeSelector", "tolerations",
            "restartPolicy", "serviceAccountName", "affinity", "initContainers", "imagePullSecrets"}
CONTAINER = {"name", "image", "command", "args", "env", "resources", "volumeMounts", "lifecycle", "ports",
             "workingDir", "imagePullPolicy", "securityContext"}
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
LAYOUT_OPTIONS = ("--num-machines", "--machine-rank", "--main-process-ip", "--main-process-port")


def _problems(doc: dict) -> list[str]:
    """What in a PyTorchJob document does not follow the API reference, or llmeff train's use of it."""
    out = []
    if doc.get("apiVersion") != "kubeflow.org/v1" or doc.get("kind") != "PyTorchJob":
        out.append(f"apiVersion/kind {doc.get('apiVersion')}/{doc.get('kind')}, not kubeflow.org/v1 PyTorchJob")
    name = (doc.get("metadata") or {}).get("name", "")
    if not DNS_LABEL.match(name):
        out.append(f"metadata.name {name!r} is not a DNS-1123 label")
    spec = doc.get("spec") or {}
    out += [f"spec.{k} is not a PyTorchJobSpec field" for k in spec if k not in PYTORCHJOB_SPEC]
    if "nprocPerNode" in spec and not isinstance(spec["nprocPerNode"], str):
        out.append("spec.nprocPerNode must be a string (an int as text, auto, cpu or gpu)")
    for k, v in (spec.get("runPolicy") or {}).items():
        want = RUN_POLICY.get(k)
        if want is None or (isinstance(want, tuple) and v not in want) or (isinstance(want, type) and not isinstance(v, want)):
            out.append(f"spec.runPolicy.{k}={v!r} is not accepted")
    replicas = spec.get("pytorchReplicaSpecs") or {}
    if "Master" not in replicas:
        out.append("spec.pytorchReplicaSpecs has no Master")
    for rtype, r in replicas.items():
        where = f"spec.pytorchReplicaSpecs.{rtype}"
        if rtype not in REPLICA_TYPES:
            out.append(f"{where}: replica type not one of {REPLICA_TYPES}")
        out += [f"{where}.{k} is not a ReplicaSpec field" for k in r if k not in REPLICA_SPEC]
        if not isinstance(r.get("replicas"), int) or r["replicas"] < 1 or (rtype == "Master" and r["replicas"] != 1):
            out.append(f"{where}.replicas={r.get('replicas')!r}: an int >= 1, exactly 1 for Master")
        if r.get("restartPolicy", "OnFailure") not in RESTART_POLICIES:
            out.append(f"{where}.restartPolicy={r.get('restartPolicy')!r} not one of {RESTART_POLICIES}")
        pod = ((r.get("template") or {}).get("spec")) or {}
        out += [f"{where}.template.spec.{k} is not a PodSpec field used here" for k in pod if k not in POD_SPEC]
        volumes = {v.get("name") for v in pod.get("volumes", [])}
        containers = pod.get("containers") or []
        if not containers:
            out.append(f"{where}: a pod needs containers")
        if CONTAINER_NAME not in [c.get("name") for c in containers]:
            out.append(f"{where}: no container named {CONTAINER_NAME!r} (the operator sets its variables there)")
        for c in containers:
            out += [f"{where}: container field {k!r} unknown" for k in c if k not in CONTAINER]
            if not c.get("image") or not DNS_LABEL.match(c.get("name", "")):
                out.append(f"{where}: a container needs a DNS-label name and an image")
            for e in c.get("env", []):
                if "name" not in e or not ("value" in e or "valueFrom" in e):
                    out.append(f"{where}: env item {e} needs name and value or valueFrom")
            mounts = {m.get("name"): m.get("mountPath", "") for m in c.get("volumeMounts", [])}
            out += [f"{where}: volumeMount {m!r} has no volume" for m in mounts if m not in volumes]
            argv = list(c.get("command", [])) + list(c.get("args", []))
            if argv[:2] == ["llmeff", "train"]:
                out += [f"{where}: {o} is the operator's to give (PET_* variables)" for o in LAYOUT_OPTIONS if o in argv]
                ck = argv[argv.index("--checkpoint-dir") + 1] if "--checkpoint-dir" in argv else ""
                if not ck or not any(ck.startswith(p.rstrip("/") + "/") for p in mounts.values()):
                    out.append(f"{where}: --checkpoint-dir {ck!r} is not on a mounted volume every pod shares")
    return out


def _doc() -> dict:
    return yaml.safe_load(K8S.read_text())


def test_the_pytorchjob_example_follows_the_api_reference():
    assert _problems(_doc()) == []


@pytest.mark.parametrize("edit, problem", [
    (lambda d: d["spec"]["pytorchReplicaSpecs"]["Master"].update(replicas=2), "exactly 1 for Master"),
    (lambda d: d["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0].update(name="main"),
     "no container named 'pytorch'"),
    (lambda d: d["spec"]["pytorchReplicaSpecs"]["Worker"].update(restartPolicy="Sometimes"), "restartPolicy='Sometimes'"),
    (lambda d: d["spec"].update(nprocPerNode=8), "must be a string"),
    (lambda d: d["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["args"].extend(
        ["--num-machines", "2"]), "--num-machines is the operator's to give"),
    (lambda d: d["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"].update(volumes=[]),
     "volumeMount 'checkpoints' has no volume"),
])
def test_the_check_finds_what_the_api_or_llmeff_would_refuse(edit, problem):
    import copy

    d = copy.deepcopy(_doc())
    d["spec"]["pytorchReplicaSpecs"]["Worker"]["template"] = copy.deepcopy(d["spec"]["pytorchReplicaSpecs"]["Worker"]["template"])
    edit(d)
    assert any(problem in p for p in _problems(d)), _problems(d)


@pytest.mark.slow
def test_the_workers_command_takes_its_layout_from_the_operators_variables(tracking_uri, tmp_path):
    doc = _doc()
    c = doc["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
    operator = {"PET_NNODES": "2", "PET_NODE_RANK": "1", "PET_NPROC_PER_NODE": doc["spec"]["nprocPerNode"],
                "MASTER_ADDR": "llmeff-train-master-0", "MASTER_PORT": "23456", "WORLD_SIZE": "16", "RANK": "1",
                "KUBERNETES_SERVICE_HOST": "10.96.0.1"}
    r = subprocess.run([sys.executable, "-m", "mlflow_llmeff", *c["command"][1:], *c["args"], "--dry-run", "true"],
                       env={**env_for(tracking_uri), **operator}, capture_output=True, text=True, timeout=300,
                       cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert ("llmeff: kubernetes on 2 nodes: num_machines=2, machine_rank=1, main_process_ip=llmeff-train-master-0, "
            "main_process_port=23456, num_processes=8") in r.stderr
    assert re.search(r"^devices\s+16$", r.stdout, re.M) and re.search(r"^strategy\s+fsdp$", r.stdout, re.M)


def test_the_sbatch_example_runs_one_llmeff_train_per_node_and_leaves_the_layout_to_slurm():
    from mlflow_llmeff.cli import train_cmd

    text = SBATCH.read_text()
    directives = dict(re.findall(r"^#SBATCH --([\w-]+)(?:=(\S+))?", text, re.M))
    assert directives["nodes"] == "2" and directives["ntasks-per-node"] == "1"
    assert "requeue" in directives and directives["signal"] == "USR1@120"  # to the steps' processes, not B:
    command = " ".join(line.rstrip("\\").strip() for line in text[text.index("srun llmeff train"):].splitlines())
    argv = shlex.split(command)
    assert argv[:3] == ["srun", "llmeff", "train"]
    assert not [o for o in LAYOUT_OPTIONS if o in argv]
    ctx = train_cmd.make_context("train", [a.replace("${SLURM_JOB_NAME}", "job") for a in argv[3:]])
    assert ctx.params["checkpoint_dir"] == "/shared/checkpoints/job" and ctx.params["num_processes"] == 8
    assert subprocess.run(["bash", "-n", str(SBATCH)]).returncode == 0
