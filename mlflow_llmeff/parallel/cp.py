"""``cp``: context parallelism (the sequence split over ranks, ring attention) with torch's
``context_parallel``: refused where torch cannot run it.

On CPU torch 2.13 has no sharding rule for its CPU attention kernel: a Llama forward under
``context_parallel`` over gloo fails with "Operator aten._scaled_dot_product_flash_attention_for_cpu.default
does not have a sharding strategy registered" (measured). Torch's ring attention covers the CUDA
flash, memory-efficient and cuDNN kernels only. On CUDA the strategy is not built yet either: the
loss must be computed on labels shifted before the sequence is split (Accelerate's CP guide), and
no GPU has checked that path; the refusal says so rather than run an unchecked number.
"""

from __future__ import annotations

from mlflow_llmeff.parallel.base import Strategy
from mlflow_llmeff.parallel.degrees import Degrees

CPU_REASON = ("torch 2.13's context_parallel has no sharding rule for the CPU attention kernel "
              "(aten._scaled_dot_product_flash_attention_for_cpu), measured over gloo; it covers the CUDA "
              "flash/efficient/cuDNN kernels only")


class CP(Strategy):
    name = "cp"
    summary = "context parallel (sequence split, ring attention): refused on CPU (torch has no CPU rule), not built for CUDA yet"

    def degrees(self, world: int, *, tp_size: int = 0, dp_shard: int = 0, processes_per_node: int = 0) -> Degrees:
        return Degrees(cp=world)

    def check(self, *, cuda: bool, precision: str) -> None:
        if not cuda:
            raise ValueError(f"parallelism='cp' cannot run on CPU: {CPU_REASON}; accepted on CPU: single, ddp, fsdp, "
                             "hsdp, tp, fsdp_tp, deepspeed_zero1/2/3")
        raise ValueError("parallelism='cp' is not built yet: the loss needs labels shifted before the sequence is "
                         "split, and no GPU run has checked that path; use fsdp or fsdp_tp")


STRATEGIES = (CP(),)
