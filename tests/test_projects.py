"""The ready-made projects/ MLprojects call llmeff with options it accepts (checked by planning them)."""

import pathlib
import shlex

import pytest
from click.testing import CliRunner

from mlflow_llmeff.cli import main

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
    # the options checked by planning them, in this process (the command line's parsing and checks are
    # the ones `python -m mlflow_llmeff` runs; a process of its own cost a launch and proved no more)
    r = CliRunner().invoke(main, ["plan", "--accelerator", accelerator, "--json", *argv[4:]])
    assert r.exit_code == 0, (r.output[-1500:], r.exception)
    assert '"params_total"' in r.stdout
