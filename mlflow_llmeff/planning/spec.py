"""A run's settings resolved once: strategy and degrees, precision, world, batch, in one frozen object.

``llmeff train`` (``mlflow_llmeff.train.config.resolve_run``) checks the options and calls
:func:`resolve` once, on the facts of the machine (:class:`Machine`); every later step reads the
:class:`RunSpec` it returns and resolves nothing again: the fit check and the plan
(:mod:`mlflow_llmeff.planning`), the launcher, the processes it starts (they read the resolved values
from ``--resolved-json``: :meth:`RunSpec.resolved` / :meth:`RunSpec.read`), the training set-up, the
run's tags and the tags of a run that failed before training. ``auto`` strategy and precision, the
degrees, the world over all machines and the global batch have one definition each, here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from mlflow_llmeff import names
from mlflow_llmeff.calc.throughput import global_batch_tokens
from mlflow_llmeff.parallel import Degrees, Strategy, get

__all__ = ["Machine", "RunSpec", "resolve", "UNRESOLVED"]

#: Options nothing in :func:`resolve` reads: a copy of a spec may change them without resolving again
#: (``llmeff study`` gives each repeat its own folders and run name).
UNRESOLVED = ("run_name", "checkpoint_dir", "save_model", "experiment_name", "seed")


@dataclass(frozen=True)
class Machine:
    """What the machine offers the run, probed once (``llmeff train``: torch on this machine) or
    taken from a datasheet (``llmeff plan --accelerator``).

    Attributes:
        cuda: CUDA devices are there.
        bf16: the device computes in bf16 (every CPU does, as torch's CPU kernels).
        accelerator: the accelerator's short name (``H100-SXM``, ``cpu``) where it was looked up
            (a plan), else None (the meter detects it when training starts).
    """

    cuda: bool
    bf16: bool
    accelerator: str | None = None


@dataclass(frozen=True)
class RunSpec:
    """The resolved run (see the module docstring). Build it with :func:`resolve`, never by hand.

    Attributes:
        options: the settings as given (a :class:`~mlflow_llmeff.train.config.TrainConfig`, a copy
            nothing changes: ``auto`` stays ``auto`` there; the resolved values are the fields below).
        machine: the :class:`Machine` it was resolved on.
        strategy: the :class:`~mlflow_llmeff.parallel.base.Strategy` (``auto``: single for one
            process in all, else ddp).
        degrees: how the world splits (:meth:`Strategy.degrees`).
        precision: ``fp32``, ``bf16`` or ``fp16`` (``auto``: bf16 with ``weights=bf16`` or on CUDA devices
            that support it, else fp32).
        nodes: machines of the job (``num_machines``).
        processes_per_node: processes on each machine (``num_processes``).
    """

    options: Any
    machine: Machine
    strategy: Strategy
    degrees: Degrees
    precision: str
    nodes: int
    processes_per_node: int

    @property
    def strategy_name(self) -> str:
        """The ``llmeff.parallelism.strategy`` tag."""
        return self.strategy.name

    @property
    def weights(self) -> str:
        """How the trained weights are held: ``fp32`` (the master copy under mixed precision) or ``bf16``
        (pure bf16 weights and gradients, no master copy). Given, never ``auto``: read from the options."""
        return self.options.weights

    @property
    def mixed_precision(self) -> str:
        """Accelerate's ``mixed_precision``: ``no`` for fp32, and for bf16 weights (they are already bf16:
        autocast over them adds nothing, and an fp32 master copy is what ``weights=bf16`` leaves out);
        else the precision (``bf16``, ``fp16``: fp32 weights, matmuls under autocast)."""
        return "no" if self.precision == "fp32" or self.weights == "bf16" else self.precision

    @property
    def world(self) -> int:
        """Processes (devices) over every machine: ``processes_per_node x nodes``."""
        return self.processes_per_node * self.nodes

    @property
    def global_batch_tokens(self) -> int:
        """Positions of one optimizer step over the data-parallel ranks
        (:func:`mlflow_llmeff.calc.throughput.global_batch_tokens` with ``degrees.dp``)."""
        o = self.options
        return global_batch_tokens(o.seq_len, o.micro_batch_size, o.grad_accum, self.degrees.dp)

    @property
    def data_workers(self) -> int:
        """``DataLoader`` workers per rank: ``data_workers`` when >= 0, else 2 on CUDA (reading memory-mapped
        blocks is cheap; two keep the next batches ready), 0 on CPU (workers would compete with training)."""
        n = self.options.data_workers
        return n if n >= 0 else (2 if self.machine.cuda else 0)

    @property
    def lr_warmup_steps(self) -> int:
        """Linear learning-rate warm-up steps: ``lr_warmup_steps`` when >= 0, else 5% of ``max_steps`` (at least 1)."""
        o = self.options
        return o.lr_warmup_steps if o.lr_warmup_steps >= 0 else max(1, round(0.05 * o.max_steps))

    @property
    def in_this_process(self) -> bool:
        """True when one process trains in the calling one (no launcher: one process in all and a
        strategy that needs no process group)."""
        return self.world == 1 and not self.strategy.needs_launcher

    def tags(self) -> dict[str, str]:
        """The tags of what was resolved: ``llmeff.parallelism.strategy``, ``llmeff.precision`` and
        ``llmeff.global_batch_tokens`` (``llmeff train``'s run, a plan run and a run that failed
        before training carry these values)."""
        return {names.PAR_STRATEGY: self.strategy_name, names.PRECISION: self.precision,
                names.GLOBAL_BATCH_TOKENS: str(self.global_batch_tokens)}

    def resolved(self) -> dict:
        """The resolved values as JSON-ready data, for the processes a launcher starts (:meth:`read`)."""
        return {"strategy": self.strategy_name, "degrees": dataclasses.asdict(self.degrees),
                "precision": self.precision, "machine": dataclasses.asdict(self.machine)}

    @classmethod
    def read(cls, options, resolved: dict) -> "RunSpec":
        """The spec a launcher resolved (:meth:`resolved`) for ``options``, read back without resolving
        or checking anything again (a launched process's view of its launcher's resolution).

        Raises:
            ValueError: a strategy name this package does not know, or degrees that do not multiply
                to the options' processes (the options are not the ones resolved).
        """
        spec = cls(dataclasses.replace(options), Machine(**resolved["machine"]), get(resolved["strategy"]),
                   Degrees(**resolved["degrees"]), resolved["precision"], options.num_machines, options.num_processes)
        if spec.degrees.world != spec.world:
            raise ValueError(f"the resolved degrees {spec.degrees.describe()} do not fit num_processes="
                             f"{options.num_processes} x num_machines={options.num_machines}")
        return spec

    def with_options(self, **changes) -> "RunSpec":
        """A copy with options that nothing resolved reads changed (:data:`UNRESOLVED`: folders, names).

        Raises:
            ValueError: for an option the resolution reads (resolve the new options instead).
        """
        bad = sorted(set(changes) - set(UNRESOLVED))
        if bad:
            raise ValueError(f"{', '.join(bad)} changes what was resolved; only {', '.join(UNRESOLVED)} may change")
        return dataclasses.replace(self, options=dataclasses.replace(self.options, **changes))


def resolve(options, machine: Machine) -> RunSpec:
    """The run of ``options`` on ``machine``: the one place ``auto`` strategy and precision, the
    degrees and the world over every machine are decided.

    Args:
        options: the settings (``parallelism``, ``precision``, ``weights``, ``num_processes``, ``num_machines``,
            ``tp_size``, ``dp_shard``, ``seq_len``, ``micro_batch_size``, ``grad_accum`` are read).
        machine: what the machine offers.

    Raises:
        ValueError: an unknown strategy, or degrees that do not fit the processes (one line).
    """
    world = options.num_processes * options.num_machines
    name = options.parallelism if options.parallelism != "auto" else ("single" if world == 1 else "ddp")
    strategy = get(name)
    precision = options.precision if options.precision != "auto" else (
        "bf16" if machine.bf16 and (options.weights == "bf16" or machine.cuda) else "fp32")
    degrees = strategy.degrees(world, tp_size=options.tp_size, dp_shard=options.dp_shard,
                               processes_per_node=options.num_processes)
    return RunSpec(dataclasses.replace(options), machine, strategy, degrees, precision, options.num_machines,
                   options.num_processes)
