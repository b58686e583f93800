"""Readers of the process (meters/probes.py): the software versions, read without importing anything."""

from __future__ import annotations

import subprocess
import sys


def test_software_versions_are_the_installed_ones_and_import_nothing():
    code = ("import importlib.metadata as md, json, sys\n"
            "from mlflow_llmeff.meters.probes import software_versions\n"
            "v = software_versions()\n"
            "print(json.dumps([v, sorted(m for m in ('mlflow', 'torch', 'transformers', 'accelerate') if m in sys.modules),"
            " {m: md.version(m) for m in ('mlflow', 'torch', 'transformers', 'accelerate')}]))\n")
    import json

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    versions, imported, installed = json.loads(out.strip().splitlines()[-1])
    assert imported == []  # a reader of the process never imports mlflow (nor torch) to tag its version
    assert {k: versions[f"llmeff.version.{k}"] for k in installed} == installed
    import mlflow
    import torch

    from mlflow_llmeff.meters.probes import software_versions

    here = software_versions()  # imported here: the modules' own __version__
    assert (here["llmeff.version.mlflow"], here["llmeff.version.torch"]) == (mlflow.__version__, torch.__version__)
