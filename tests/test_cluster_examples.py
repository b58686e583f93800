"""The cluster examples: examples/k8s/pytorchjob.yaml checked against the PyTorchJob (kubeflow.org/v1)
and examples/k8s/trainjob.yaml (Kubeflow Trainer v2) against a JSON schema of the CRD written below,
and Pod API fields in Python, and its Worker's command dry-run with the variables the operator sets;
examples/slurm/train.sbatch's directives and command. No Kubernetes here, and ``kubectl
--dry-run=client`` needs an API server even on the client (it downloads the OpenAPI schema), so the
schema check is this file's: the fields and values below are the API reference's."""

from __future__ import annotations

import re
import shlex
import subprocess

import pytest
import yaml

from conftest import REPO

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
def test_the_workers_command_takes_its_layout_from_the_operators_variables(tracking_uri, tmp_path, monkeypatch):
    doc = _doc()
    c = doc["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
    operator = {"PET_NNODES": "2", "PET_NODE_RANK": "1", "PET_NPROC_PER_NODE": doc["spec"]["nprocPerNode"],
                "MASTER_ADDR": "llmeff-train-master-0", "MASTER_PORT": "23456", "WORLD_SIZE": "16", "RANK": "1",
                "KUBERNETES_SERVICE_HOST": "10.96.0.1"}
    assert c["command"][0] == "llmeff"
    # the dry run in this process, under the operator's variables (CliRunner sets them for the call alone):
    # what it prints is what the container's command prints; a process of its own proved no more
    from click.testing import CliRunner

    from mlflow_llmeff.cli import main

    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(main, [*c["command"][1:], *c["args"], "--dry-run", "true"], env=operator)
    assert r.exit_code == 0, (r.output[-3000:], r.exception)
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


# ------------------------------------------------------------------ Kubeflow Trainer v2
TRAINJOB = REPO / "examples" / "k8s" / "trainjob.yaml"
_NAME = {"type": "string", "pattern": r"^[a-z]([-a-z0-9]*[a-z0-9])?$", "maxLength": 63}
_ENV = {"type": "array", "maxItems": 128, "items": {
    "type": "object", "required": ["name"], "additionalProperties": False,
    "properties": {"name": {"type": "string"}, "value": {"type": "string"}, "valueFrom": {"type": "object"}}}}
_STRINGS = {"type": "array", "maxItems": 128, "items": {"type": "string"}}
_RESOURCES = {"type": "object", "additionalProperties": False, "properties": {
    "limits": {"type": "object"}, "requests": {"type": "object"}, "claims": {"type": "array"}}}
_META = {"type": "object", "required": ["name"], "properties": {
    "name": _NAME, "namespace": {"type": "string"}, "labels": {"type": "object"}, "annotations": {"type": "object"}}}
_CONTAINER = {"type": "object", "required": ["name"], "additionalProperties": False, "properties": {
    k: {"type": "string"} for k in ("name", "image", "workingDir", "imagePullPolicy")} | {
    "command": _STRINGS, "args": _STRINGS, "env": _ENV, "resources": _RESOURCES, "volumeMounts": {"type": "array"},
    "lifecycle": {"type": "object"}, "ports": {"type": "array"}, "securityContext": {"type": "object"}}}
_POD_SPEC = {"type": "object", "required": ["containers"], "additionalProperties": False, "properties": {
    "containers": {"type": "array", "items": _CONTAINER}, "initContainers": {"type": "array", "items": _CONTAINER},
    "volumes": {"type": "array"}, "terminationGracePeriodSeconds": {"type": "integer", "minimum": 0},
    "nodeSelector": {"type": "object"}, "tolerations": {"type": "array"}, "affinity": {"type": "object"},
    "serviceAccountName": {"type": "string"}, "restartPolicy": {"enum": ["Always", "OnFailure", "Never"]},
    "imagePullSecrets": {"type": "array"}}}
_JOB_TEMPLATE = {"type": "object", "properties": {
    "metadata": {"type": "object"}, "spec": {"type": "object", "properties": {
        "template": {"type": "object", "required": ["spec"], "properties": {
            "metadata": {"type": "object"}, "spec": _POD_SPEC}}}}}}
#: The fields our examples use, written here from the CRD's Go types (kubeflow/trainer
#: pkg/apis/trainer/v1alpha1/trainjob_types.go and trainingruntime_types.go, API trainer.kubeflow.org/v1alpha1,
#: read at the repository's main branch in 2026-12; the JobSet template is sigs.k8s.io/jobset v1alpha2
#: JobSetSpec): TrainJob (runtimeRef required; trainer: image, command, args, env, numNodes,
#: resourcesPerNode, numProcPerNode an int) and ClusterTrainingRuntime (mlPolicy numNodes and torch
#: numProcPerNode: an int > 0 or auto/cpu/gpu; template: a JobSet whose replicatedJobs hold Job templates).
#: Unknown fields are refused where the CRD has a closed structure.
TRAINER_V1ALPHA1 = {
    "TrainJob": {
        "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"], "additionalProperties": False,
        "properties": {
            "apiVersion": {"enum": ["trainer.kubeflow.org/v1alpha1"]}, "kind": {"enum": ["TrainJob"]},
            "metadata": _META,
            "spec": {"type": "object", "required": ["runtimeRef"], "additionalProperties": False, "properties": {
                "runtimeRef": {"type": "object", "required": ["name"], "additionalProperties": False, "properties": {
                    "name": {"type": "string", "minLength": 1, "maxLength": 253},
                    "apiGroup": {"enum": ["trainer.kubeflow.org"]},
                    "kind": {"enum": ["ClusterTrainingRuntime", "TrainingRuntime"]}}},
                "trainer": {"type": "object", "additionalProperties": False, "properties": {
                    "image": {"type": "string", "maxLength": 500}, "command": _STRINGS, "args": _STRINGS,
                    "env": _ENV, "numNodes": {"type": "integer", "minimum": 1},
                    "numProcPerNode": {"type": "integer", "minimum": 1}, "resourcesPerNode": _RESOURCES}},
                "initializer": {"type": "object"}, "suspend": {"type": "boolean"},
                "activeDeadlineSeconds": {"type": "integer", "minimum": 1}, "managedBy": {"type": "string"},
                "runtimePatches": {"type": "array"}}}}},
    "ClusterTrainingRuntime": {
        "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"], "additionalProperties": False,
        "properties": {
            "apiVersion": {"enum": ["trainer.kubeflow.org/v1alpha1"]}, "kind": {"enum": ["ClusterTrainingRuntime"]},
            "metadata": _META,
            "spec": {"type": "object", "required": ["template"], "additionalProperties": False, "properties": {
                "mlPolicy": {"type": "object", "additionalProperties": False, "properties": {
                    "numNodes": {"type": "integer", "minimum": 1},
                    "torch": {"type": "object", "additionalProperties": False, "properties": {
                        "numProcPerNode": {"anyOf": [{"type": "integer", "minimum": 1},
                                                     {"enum": ["auto", "cpu", "gpu"]}]},
                        "elasticPolicy": {"type": "object"}}},
                    "mpi": {"type": "object"}, "flux": {"type": "object"}}},
                "podGroupPolicy": {"type": "object"},
                "template": {"type": "object", "properties": {
                    "metadata": {"type": "object"},
                    "spec": {"type": "object", "required": ["replicatedJobs"], "properties": {
                        "replicatedJobs": {"type": "array", "items": {
                            "type": "object", "required": ["name", "template"], "properties": {
                                "name": _NAME, "replicas": {"type": "integer", "minimum": 1},
                                "template": _JOB_TEMPLATE}}}}}}}}}}},
}


def _checked(doc, schema, where="") -> list[str]:
    """The JSON Schema keywords the schemas above use, checked recursively (what jsonschema would say,
    where it is not installed): type, enum, anyOf, required, properties, additionalProperties, items,
    minimum, minLength, maxLength, maxItems, pattern."""
    kinds = {"object": dict, "array": list, "string": str, "boolean": bool, "integer": int}
    out = []
    if "type" in schema and not (isinstance(doc, kinds[schema["type"]])
                                 and not (schema["type"] == "integer" and isinstance(doc, bool))):
        return [f"{where or '/'}: {doc!r} is not of type {schema['type']!r}"]
    if "enum" in schema and doc not in schema["enum"]:
        out.append(f"{where or '/'}: {doc!r} is not one of {schema['enum']}")
    if "anyOf" in schema and all(_checked(doc, s, where) for s in schema["anyOf"]):
        out.append(f"{where or '/'}: {doc!r} is not valid under any of the given schemas")
    if isinstance(doc, dict):
        out += [f"{where or '/'}: {k!r} is a required property" for k in schema.get("required", []) if k not in doc]
        props = schema.get("properties", {})
        for k, v in doc.items():
            if k in props:
                out += _checked(v, props[k], f"{where}/{k}")
            elif schema.get("additionalProperties") is False:
                out.append(f"{where or '/'}: additional property {k!r} is not allowed")
    if isinstance(doc, list):
        if len(doc) > schema.get("maxItems", len(doc)):
            out.append(f"{where}: more than {schema['maxItems']} items")
        for i, item in enumerate(doc):
            out += _checked(item, schema.get("items", {}), f"{where}/{i}")
    if isinstance(doc, (int, float)) and not isinstance(doc, bool) and doc < schema.get("minimum", doc):
        out.append(f"{where}: {doc} is less than the minimum of {schema['minimum']}")
    if isinstance(doc, str):
        if not schema.get("minLength", 0) <= len(doc) <= schema.get("maxLength", len(doc)):
            out.append(f"{where}: {doc!r} has a length outside the bounds")
        if "pattern" in schema and not re.search(schema["pattern"], doc):
            out.append(f"{where}: {doc!r} does not match {schema['pattern']!r}")
    return out


def _schema_problems(doc: dict, with_jsonschema: bool = True) -> list[str]:
    """What in a Trainer v2 document breaks :data:`TRAINER_V1ALPHA1`: jsonschema's messages when it is
    installed (ray[train] brings it), else :func:`_checked`'s."""
    schema = TRAINER_V1ALPHA1.get(doc.get("kind"))
    if schema is None:
        return [f"kind {doc.get('kind')!r} is not TrainJob or ClusterTrainingRuntime"]
    if with_jsonschema:
        try:
            import jsonschema
        except ImportError:
            with_jsonschema = False
        else:
            return [f"/{'/'.join(map(str, e.absolute_path))}: {e.message}"
                    for e in jsonschema.Draft202012Validator(schema).iter_errors(doc)]
    return _checked(doc, schema)


def _trainjob_docs() -> dict[str, dict]:
    return {d["kind"]: d for d in yaml.safe_load_all(TRAINJOB.read_text())}


@pytest.mark.parametrize("with_jsonschema", [True, False])
def test_the_trainjob_example_and_its_runtime_follow_the_crd(with_jsonschema):
    docs = _trainjob_docs()
    assert set(docs) == {"TrainJob", "ClusterTrainingRuntime"}
    assert {k: _schema_problems(d, with_jsonschema) for k, d in docs.items()} == {"TrainJob": [],
                                                                                 "ClusterTrainingRuntime": []}
    job, runtime = docs["TrainJob"], docs["ClusterTrainingRuntime"]
    assert job["spec"]["runtimeRef"]["name"] == runtime["metadata"]["name"]  # the runtime it refers to is here
    node = runtime["spec"]["template"]["spec"]["replicatedJobs"][0]
    pod = node["template"]["spec"]["template"]["spec"]
    # the Trainer's Torch plugin sets PET_* on the container named "node" of the trainer step
    assert node["template"]["metadata"]["labels"]["trainer.kubeflow.org/trainjob-ancestor-step"] == "trainer"
    assert [c["name"] for c in pod["containers"]] == ["node"]
    argv = job["spec"]["trainer"]["command"] + job["spec"]["trainer"]["args"]
    assert argv[:2] == ["llmeff", "train"] and not [o for o in LAYOUT_OPTIONS if o in argv]
    ck = argv[argv.index("--checkpoint-dir") + 1]
    mounts = [m["mountPath"] for m in pod["containers"][0]["volumeMounts"]]
    assert any(ck.startswith(m.rstrip("/") + "/") for m in mounts)


@pytest.mark.parametrize("with_jsonschema", [True, False])
@pytest.mark.parametrize("kind, edit, problem", [
    ("TrainJob", lambda d: d["spec"]["trainer"].update(numNode=2), "numNode"),
    ("TrainJob", lambda d: d["spec"].pop("runtimeRef"), "'runtimeRef' is a required property"),
    ("TrainJob", lambda d: d["spec"]["trainer"].update(numNodes="2"), "is not of type 'integer'"),
    ("TrainJob", lambda d: d["metadata"].update(name="LLMeff_train"), "does not match"),
    ("ClusterTrainingRuntime", lambda d: d["spec"]["mlPolicy"]["torch"].update(numProcPerNode="many"),
     "is not valid under any of the given schemas"),
    ("ClusterTrainingRuntime", lambda d: d.update(apiVersion="kubeflow.org/v1"), "apiVersion"),
])
def test_a_wrong_field_in_the_trainjob_or_its_runtime_fails_the_schema(kind, edit, problem, with_jsonschema):
    import copy

    doc = copy.deepcopy(_trainjob_docs()[kind])
    edit(doc)
    found = _schema_problems(doc, with_jsonschema)
    assert any(problem in p for p in found), found


def test_the_trainjobs_command_takes_its_layout_from_the_trainers_variables():
    from mlflow_llmeff.cli import train_cmd
    from mlflow_llmeff.meters.schedulers import KubeflowTrainer
    from mlflow_llmeff.train.config import TrainConfig
    from mlflow_llmeff.train.placement import from_scheduler

    job, runtime = _trainjob_docs()["TrainJob"], _trainjob_docs()["ClusterTrainingRuntime"]
    name, nodes = job["metadata"]["name"], job["spec"]["trainer"]["numNodes"]
    # what the Torch plugin sets on node 1 (torch.go): numProcPerNode auto, master node-0-0 of the JobSet
    trainer = {"PET_NNODES": str(nodes), "PET_NPROC_PER_NODE": runtime["spec"]["mlPolicy"]["torch"]["numProcPerNode"],
               "PET_NODE_RANK": "1", "JOB_COMPLETION_INDEX": "1", "PET_MASTER_ADDR": f"{name}-node-0-0.{name}",
               "PET_MASTER_PORT": "29400", "KUBERNETES_SERVICE_HOST": "10.96.0.1"}
    p = KubeflowTrainer(accelerators=lambda: 8, cpus=lambda: 64).read(trainer)  # 8 GPUs per node: auto is 8
    ctx = train_cmd.make_context("train", job["spec"]["trainer"]["args"])
    cfg = from_scheduler(TrainConfig(**{k: v for k, v in ctx.params.items() if k in ("num_processes",)}), p, say=False)
    assert (p.scheduler, p.job_id, cfg.num_machines, cfg.machine_rank, cfg.main_process_ip, cfg.main_process_port,
            cfg.num_processes) == ("kubeflow-trainer", "llmeff-train", 2, 1, "llmeff-train-node-0-0.llmeff-train",
                                   29400, 8)
