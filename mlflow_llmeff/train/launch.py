"""Start training: in this process for one device, through ``accelerate launch`` for several.

On a machine without CUDA, several processes run CPU DDP over gloo; Accelerate's multi-process
launcher needs ``ACCELERATE_USE_CPU=1`` for that (with ``--cpu`` alone it silently starts one
process), so we set it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

from .config import TrainConfig, validate


def accelerate_command(cfg: TrainConfig, *, cuda: bool) -> tuple[list[str], dict[str, str]]:
    """The ``accelerate launch`` command line and environment for ``cfg.num_processes`` processes."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(cfg.num_processes),
           "--num_machines", "1", "--dynamo_backend", "no", "--mixed_precision", "no"]
    if cfg.parallelism not in ("fsdp",) and not cfg.parallelism.startswith("deepspeed"):
        cmd.append("--multi_gpu")
    cmd += ["-m", "mlflow_llmeff.train.loop", "--config-json", json.dumps(dataclasses.asdict(cfg))]
    env = dict(os.environ)
    if not cuda:
        env["ACCELERATE_USE_CPU"] = "1"
    return cmd, env


def launch(cfg: TrainConfig) -> int:
    """Validate ``cfg`` (cheap, before heavy work), then train. Returns the exit code.

    Raises:
        ValueError: bad settings, as one line naming the value and the accepted ones.
    """
    import torch

    validate(cfg)
    if cfg.num_processes == 1:
        from .loop import run_training

        run_training(cfg)
        return 0
    cmd, env = accelerate_command(cfg, cuda=torch.cuda.is_available())
    return subprocess.run(cmd, env=env).returncode
