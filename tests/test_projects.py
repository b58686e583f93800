"""The ready-made projects/ MLprojects call llmeff with options it accepts (checked by planning them)."""

import pathlib
import shlex
import subprocess
import sys

import pytest

from conftest import REPO


@pytest.mark.parametrize("folder, accelerator", [("cpu-ddp-demo", "cpu"), ("gpu-llama-7b-fsdp", "H100-SXM")])
def test_project_command_is_a_valid_llmeff_train_call(folder, accelerator, tracking_uri):
    from mlflow.projects import _project_spec

    project = _project_spec.load_project(str(REPO / "projects" / folder))
    entry = project.get_entry_point("main")
    defaults = {name: p.default for name, p in entry.parameters.items()}
    cmd = entry.compute_command(defaults, storage_dir=None)
    argv = shlex.split(cmd)
    assert argv[:4] == ["python", "-m", "mlflow_llmeff", "train"]
    r = subprocess.run([sys.executable, "-m", "mlflow_llmeff", "plan", "--accelerator", accelerator, "--json",
                        *argv[4:]], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-1500:]
    assert '"params_total"' in r.stdout
