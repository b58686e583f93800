"""What each process of an ``llmeff train`` job imports before it hands off (issue 52: launches dominate the
suite's time; each heavy import is seconds of CPU in every such process).

One fresh interpreter (``python -c``) takes the roles one after another and lists, after each, the heavy
packages in ``sys.modules``: importing the package, the elastic launcher's wrapper (train/elastic.py, before
``accelerate launch`` runs in it), ``llmeff train``'s own work up to the launch command for two processes
(its settings checked and resolved, the fit checked, the command built), and a rank's synthetic training data.
"""

import json
import subprocess
import sys

import pytest

#: Packages of seconds each (CPU, this machine: torch 1.8, transformers' Llama config 2.8 with torch, mlflow 2.0,
#: accelerate, datasets 1.2 ...), and the ones they bring.
HEAVY = ("torch", "transformers", "mlflow", "accelerate", "datasets", "pandas", "pyarrow", "scipy", "matplotlib",
         "deepspeed", "codecarbon", "numpy", "psutil", "pynvml", "sqlalchemy", "alembic", "git", "safetensors",
         "huggingface_hub", "tokenizers", "peft", "torchao", "ray", "click")

ROLES = r"""
import json, sys
HEAVY = %r
seen = {}
def note(role):
    seen[role] = sorted(m for m in HEAVY if m in sys.modules)
import mlflow_llmeff
note("package")
import mlflow_llmeff.train.elastic
note("launcher wrapper")
import mlflow_llmeff.cli
from mlflow_llmeff.meters.probes import torch_built_without_gpu
from mlflow_llmeff.train.config import TrainConfig
from mlflow_llmeff.train.launch import accelerate_command, fit_here, settle
cpu_build = torch_built_without_gpu()
spec = settle(TrainConfig(model="llama-tiny", dataset="synthetic", max_steps=2, measure_energy="none",
                          num_processes=2))
verdict = fit_here(spec)
cmd, env = accelerate_command(spec)
note("llmeff train before the launch")
from mlflow_llmeff.train.data import prepare_data
class ByteTokenizer:  # what prepare_data reads of the presets' ByT5 tokenizer: pad 0, EOS 1, 259 ids
    pad_token_id, eos_token_id = 0, 1
    def __len__(self):
        return 259
o = spec.options  # a rank's data as train/setup.build asks for it (2 data-parallel ranks of 8 blocks)
data = prepare_data(o.dataset, ByteTokenizer(), o.seq_len, packing=o.packing, val_fraction=o.val_fraction, seed=o.seed,
                    synthetic_blocks=max(64, 2 * o.micro_batch_size * 2 * o.grad_accum), vocab_size=259)
note("a rank's synthetic data")
print(json.dumps({"seen": seen, "cpu_build": cpu_build, "world": spec.world, "fits": verdict.fits,
                  "launcher": cmd[1:3], "blocks": [len(data.train), len(data.val), list(data.train.table.ids.shape)]}))
""" % (HEAVY,)


@pytest.fixture(scope="module")
def roles():
    out = subprocess.run([sys.executable, "-c", ROLES], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_importing_the_package_imports_nothing_heavy(roles):
    assert roles["seen"]["package"] == []


def test_the_launchers_wrapper_adds_nothing_heavy_to_accelerate_launch(roles):
    assert roles["seen"]["launcher wrapper"] == []


def test_llmeff_train_hands_off_without_torch_transformers_or_mlflow(roles):
    # the same launch as before: 2 processes through accelerate launch, the fit checked (llama-tiny fits)
    assert (roles["world"], roles["fits"], roles["launcher"]) == (2, True, ["-m", "accelerate.commands.launch"])
    # its settings read a preset's shape without transformers (models/preset_shapes.py) and the optimizer's
    # name without torch; the CUDA probe needs torch only where torch was built with CUDA or ROCm
    seen = roles["seen"]["llmeff train before the launch"]
    if roles["cpu_build"]:
        assert seen == ["click"]
    else:  # torch built with CUDA or ROCm: asked whether a GPU is there, as before; nothing else heavy
        assert "torch" in seen and not set(seen) & {"transformers", "mlflow", "accelerate", "datasets", "pandas",
                                                  "scipy", "matplotlib", "deepspeed", "codecarbon"}


def test_a_ranks_synthetic_data_is_built_without_datasets_pandas_or_pyarrow(roles):
    # train/synthetic.py: numpy ids read by TokenBlocks (their batches equal the datasets.Dataset's:
    # tests/test_synthetic.py); importing datasets cost ~1.2 s of CPU in each rank (pandas and pyarrow with it)
    before, seen = roles["seen"]["llmeff train before the launch"], roles["seen"]["a rank's synthetic data"]
    assert not {"datasets", "pandas", "pyarrow", "torch", "transformers"} & (set(seen) - set(before))
    if roles["cpu_build"]:
        assert seen == ["click", "numpy"]
    # llama-tiny x2's 64 blocks of 128 ids: 3 held out (5 %), 61 train
    assert roles["blocks"] == [61, 3, [64, 128]]


def test_torchs_source_constants_are_what_torch_says_once_imported():
    """What the hand-off reads of torch without importing it (the optimizer names torch.optim exports, whether
    the build has CUDA or ROCm) equals what the imported torch answers; a file torch lacks gives None."""
    import torch

    from mlflow_llmeff.meters.probes import torch_source_constants

    assert torch_source_constants("optim/__init__.py")["__all__"] == tuple(torch.optim.__all__)
    assert "AdamW" in torch.optim.__all__ and "Adafactor" in torch.optim.__all__
    version = torch_source_constants("version.py")
    assert (version["cuda"], version["hip"], version["__version__"]) == (torch.version.cuda, torch.version.hip,
                                                                          torch.__version__)
    assert torch_source_constants("no_such_file.py") is None
