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
    import logging

    import torch

    for noisy in ("mlflow.store.db.utils", "alembic"):  # table-creation chatter of a new sqlite store
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if cfg.dry_run:
        return dry_run(cfg)
    validate(cfg)
    if cfg.num_processes == 1:
        from ..probes import process_start_perf_counter
        from .loop import run_training

        run_training(cfg, started_at=process_start_perf_counter())
        return 0
    cmd, env = accelerate_command(cfg, cuda=torch.cuda.is_available())
    return subprocess.run(cmd, env=env).returncode


def dry_run(cfg: TrainConfig, *, accelerator_short: str | None = None, as_json: bool = False) -> int:
    """Print the plan (no training, no weights): parameters, FLOPs, memory, predictions.

    Works on a CPU machine for any preset (the model is built on the meta device). Planning for
    an accelerator other than this machine's (``accelerator_short``, e.g. ``H100-SXM``) resolves
    ``precision=auto`` as bf16 there. Under ``mlflow run`` the plan is logged to the run as
    ``plan/*`` metrics and the tag ``llmeff.dry_run=true``.
    """
    import json as _json

    import mlflow

    from .. import hardware as hw
    from .. import names
    from ..cost import device_hour_price
    from ..plan import format_plan, make_plan
    from .config import resolve_precision, resolve_strategy

    if accelerator_short is None:
        import torch

        cuda = torch.cuda.is_available()
        accelerator_short = hw.detect_accelerator(count=cfg.num_processes).short
        bf16 = torch.cuda.is_bf16_supported() if cuda else True
    else:
        known = sorted({row.short for row in hw.PEAK_TABLE} | {"cpu"})
        if accelerator_short not in known:
            raise ValueError(f"accelerator {accelerator_short!r} is not known; use one of: {', '.join(known)}")
        cuda, bf16 = accelerator_short.lower() != "cpu", True
    validate(cfg, cuda_available=cuda, bf16_supported=bf16)
    precision = resolve_precision(cfg, cuda_available=cuda, bf16_supported=bf16)
    strategy = resolve_strategy(cfg, cfg.num_processes)
    price, _ = device_hour_price(accelerator_short, cfg.device_hour_usd or None)
    plan = make_plan(cfg, accelerator_short=accelerator_short, precision=precision, strategy=strategy,
                     client=mlflow.MlflowClient(), device_hour_usd=price)
    print(_json.dumps(plan, indent=1) if as_json else format_plan(plan))
    run_id = os.environ.get("MLFLOW_RUN_ID")
    if run_id:
        client = mlflow.MlflowClient()
        client.set_tag(run_id, names.DRY_RUN, "true")
        from ..tracking.logger import default_run_name

        for k, v in {"mlflow.runName": "plan-" + default_run_name(cfg.model, accelerator_short, cfg.num_processes,
                                                                  strategy, precision),
                     names.MODEL_NAME: cfg.model, names.ACCEL_SHORT: accelerator_short,
                     names.ACCEL_COUNT: str(cfg.num_processes), names.PAR_STRATEGY: strategy,
                     names.PRECISION: precision, names.SEQ_LEN: str(cfg.seq_len)}.items():
            client.set_tag(run_id, k, v)
        for k, v in plan.items():
            if isinstance(v, (int, float)):
                client.log_metric(run_id, f"plan/{k}", float(v))
    return 0
