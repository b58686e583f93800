"""A monitor's memory component: where every byte of a device goes, its peak and capacity, the
optimizer's provenance, and torch's memory snapshot on a CUDA out-of-memory failure (docs/metrics.md).

Read at three moments: the monitor's start (:meth:`MemoryWatch.start`: the CPU peak's baseline, the
CUDA allocator's history), the first logged point after the optimizer allocated its states
(:meth:`MemoryWatch.optimizer_tags`: ``llmeff.optimizer``, which needs them) and the end
(:meth:`MemoryWatch.figures`, :meth:`MemoryWatch.on_failure`). The readers (``torch.cuda``, NVML,
``/proc``) are injectable, so the CUDA-only parts are tested with fakes.
"""

from __future__ import annotations

import os
import sys
import tempfile
from typing import Any

from mlflow_llmeff import names
from mlflow_llmeff.meters import memory as mem

__all__ = ["MemoryWatch", "HeldPeak", "HISTORY_MAX_ENTRIES", "SNAPSHOT_ARTIFACT"]

#: Allocation events the CUDA allocator's history keeps (torch.cuda.memory._record_memory_history);
#: the oldest are dropped past it.
HISTORY_MAX_ENTRIES = 100_000
#: The artifact path of the snapshot in the run.
SNAPSHOT_ARTIFACT = "memory/oom_snapshot.pickle"
GIB = 2 ** 30


def _is_oom(exc: BaseException | None) -> bool:
    if exc is None:
        return False
    torch = sys.modules.get("torch")
    oom = getattr(torch, "OutOfMemoryError", None) if torch is not None else None
    return (oom is not None and isinstance(exc, oom)) or type(exc).__name__ == "OutOfMemoryError"


class MemoryWatch:
    """What a monitor knows of its memory from its start to its end.

    The CUDA allocator's history is recorded from :meth:`start` unless ``LLMEFF_MEMORY_HISTORY=0``: by
    default without stack traces (``context=None``: every allocation and free is kept in a ring of
    :data:`HISTORY_MAX_ENTRIES` at a few hundred nanoseconds each, so the measured step times stay the
    ones without it); ``LLMEFF_MEMORY_HISTORY=stacks`` adds the Python stack of each allocation (the
    snapshot then says which line allocated each block, at microseconds per allocation).

    Args:
        device: the torch device the model lives on (None: not known yet, read as CPU).
        origin: where the optimizer came from (``llmeff.optimizer``); None: ``the user's loop``.
        cuda: ``torch.cuda`` or a stand-in (tests); default: torch's, imported when needed.
        nvml: ``pynvml`` or a stand-in with an NVML handle in ``nvml_handle`` (tests); default: none
            read unless pynvml imports and the device resolves.
        nvml_handle: the NVML handle of ``device`` (tests); default: resolved from its UUID.
        cpu: a :class:`~mlflow_llmeff.meters.memory.CpuPeak` (tests pass one over fake ``/proc`` files).
        root: where the ``/proc`` and ``/sys`` trees of the capacity are read (tests pass a fake one).
        env: the environment (default ``os.environ``).
    """

    def __init__(self, device=None, *, origin: str | None = None, cuda=None, nvml=None, nvml_handle=None,
                 cpu: mem.CpuPeak | None = None, root: str = "/", env: dict | None = None) -> None:
        self.device = device
        self.origin = origin
        self._cuda, self._nvml, self._handle = cuda, nvml, nvml_handle
        self.cpu = cpu or mem.CpuPeak()
        self._root = root
        self._env = os.environ if env is None else env
        self.history = "off"  # what the CUDA allocator's history records: off, events, stacks
        self.optimizer_tagged = False
        self.last_split: mem.StateBytes | None = None
        self.given: dict[str, str] = {}  # the tags the caller set on the run (its llmeff.error is kept)
        self.end_tags: dict[str, str] = {}  # the tags of the last figures(), for the summary's end tags

    @property
    def on_cuda(self) -> bool:
        """True when the device is a CUDA device."""
        return getattr(self.device, "type", None) == "cuda"

    def _torch_cuda(self):
        if self._cuda is None:
            import torch

            self._cuda = torch.cuda
        return self._cuda

    # ------------------------------------------------------------------ the start
    def start(self, model, optimizer) -> None:
        """At the monitor's start: on CPU reset the peak RSS and remember the model state held now
        (:class:`~mlflow_llmeff.meters.memory.CpuPeak`); on CUDA record the allocator's history (see the
        class). Never raises."""
        try:
            if self.on_cuda:
                self._record_history()
            else:
                held = mem.state_split(model, optimizer).total if model is not None else 0
                self.cpu.start(held - self._absent_grads(model))
        except Exception:  # noqa: BLE001 - memory figures never stop training
            pass

    @staticmethod
    def _absent_grads(model) -> int:
        """Bytes :func:`state_split` counts for gradients not yet allocated (not held at the start)."""
        if model is None:
            return 0
        return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad and p.grad is None)

    def _record_history(self) -> None:
        want = self._env.get("LLMEFF_MEMORY_HISTORY", "1")
        if want == "0":
            return
        stacks = want == "stacks"
        cuda = self._torch_cuda()
        cuda.memory._record_memory_history(
            enabled="all", context="all" if stacks else None, stacks="python" if stacks else "all",
            max_entries=HISTORY_MAX_ENTRIES)
        self.history = "stacks" if stacks else "events"

    # ------------------------------------------------------------------ tags
    def learn_device(self, device) -> None:
        """The device the model lives on, once known (a model-less monitor learns it from the first batch;
        None keeps the one known)."""
        if device is not None:
            self.device = device

    def note_given(self, tags: dict[str, str]) -> None:
        """Tags the caller set on the run (an ``llmeff.error`` given is kept: an OOM adds its largest term)."""
        self.given.update(tags)

    def keep_end_tags(self, tags: dict[str, str]) -> None:
        """The tags of the last :meth:`figures`, for the summary's end tags."""
        self.end_tags = tags

    def optimizer_tags(self, optimizer) -> dict[str, str]:
        """``{llmeff.optimizer: ...}`` once the optimizer holds states (first call that finds them), else
        ``{}``: called at every logged point (:func:`~mlflow_llmeff.monitor.points.log_interval`);
        :meth:`final_optimizer_tags` covers a run that never stepped."""
        if self.optimizer_tagged or optimizer is None:
            return {}
        try:
            if not mem.inner_optimizer(optimizer).state:
                return {}
            self.optimizer_tagged = True
            return {names.OPTIMIZER: mem.optimizer_tag(optimizer, self.origin)}
        except Exception:  # noqa: BLE001
            return {}

    def final_optimizer_tags(self, optimizer) -> dict[str, str]:
        """At the end: the tag if not set yet, ``states not yet allocated`` where the run never stepped."""
        if self.optimizer_tagged or optimizer is None:
            return {}
        self.optimizer_tagged = True
        try:
            return {names.OPTIMIZER: mem.optimizer_tag(optimizer, self.origin)}
        except Exception as e:  # noqa: BLE001
            return {names.OPTIMIZER: f"unknown: {type(e).__name__}"}

    # ------------------------------------------------------------------ the end
    def figures(self, model, optimizer) -> tuple[dict[str, float], dict[str, str]]:
        """This device's memory figures (not reduced over ranks) and their tags.

        Returns:
            ``({key: value}, {tag: value})``: weights, gradients and optimizer state in GiB, the
            optimizer state per parameter, the peak (GiB) and its share of the capacity, on CUDA the
            allocator's retries and out-of-memory errors and NVML's process memory; the tags
            ``llmeff.memory.capacity`` and, on CPU, ``llmeff.memory.source``. A figure that cannot be
            read is left out.
        """
        split = mem.state_split(model, optimizer)
        self.last_split = split
        out: dict[str, float] = {names.SUM_MEM_WEIGHTS_GIB: split.weights / GIB,
                                 names.SUM_MEM_GRADIENTS_GIB: split.gradients / GIB}
        if optimizer is not None:
            out[names.SUM_MEM_OPT_STATE_GIB] = split.optimizer_state / GIB
            if split.params > 0:
                out[names.SUM_OPT_STATE_BYTES_PER_PARAM] = split.optimizer_state / split.params
        tags: dict[str, str] = {}
        if self.on_cuda:
            peak = self._cuda_figures(out, tags)
        else:
            peak = self._cpu_figures(out, tags)
        if peak is not None:
            out[names.SUM_MEM_PEAK_GIB] = peak / GIB
            out[names.SUM_MEM_OTHER_GIB] = (peak - split.total) / GIB  # < 0: a peak before the state existed
        return out, tags

    def _cuda_figures(self, out: dict, tags: dict) -> int | None:
        cuda = self._torch_cuda()
        c = mem.cuda_memory(cuda, self.device)
        out.update({names.SUM_MEM_ALLOC_RETRIES: float(c.retries), names.SUM_MEM_OOMS: float(c.ooms)})
        if c.fraction is not None:
            out[names.SUM_MEM_PEAK_FRACTION] = c.fraction
            tags[names.MEMORY_CAPACITY] = (f"CUDA total memory (torch.cuda.get_device_properties().total_memory): "
                                           f"{c.total / GIB:.2f} GiB; the fraction is max_memory_reserved / it")
        used = self._nvml_bytes()
        if used is not None:
            out[names.SUM_MEM_NVML_PROCESS_GIB] = used / GIB
        return c.peak

    def _nvml_bytes(self) -> int | None:
        try:
            nvml, handle = self._nvml, self._handle
            if nvml is None:
                import pynvml as nvml  # noqa: PLC0415 - the nvidia-ml-py distribution

                nvml.nvmlInit()
            if handle is None:
                from mlflow_llmeff.meters.energy.nvml import resolve_nvml_devices

                cuda = self._torch_cuda()
                index = self.device.index if self.device.index is not None else cuda.current_device()
                uuid = str(getattr(cuda.get_device_properties(index), "uuid", "") or "")
                ids = [{} for _ in range(index)] + [{"uuid": uuid}]  # by UUID, else CUDA_VISIBLE_DEVICES' entry
                handle = resolve_nvml_devices(nvml, [index], visible_devices=self._env.get("CUDA_VISIBLE_DEVICES"),
                                              torch_ids=ids)[0][1]
            return mem.nvml_process_bytes(nvml, handle)
        except Exception:  # noqa: BLE001 - no NVML: the figure is left out
            return None

    def _cpu_figures(self, out: dict, tags: dict) -> int | None:
        got = self.cpu.peak()
        tags[names.MEMORY_SOURCE] = self.cpu.source
        if got is None:
            return None
        tensors, process = got
        capacity, where = mem.memory_capacity(self._root)
        if capacity:
            out[names.SUM_MEM_PEAK_FRACTION] = process / capacity
            tags[names.MEMORY_CAPACITY] = f"{where}; the fraction is the process's peak RSS (VmHWM) / it"
        return tensors

    def on_failure(self, exc: BaseException | None, logger: Any, folder: str | None = None) -> dict[str, str]:
        """On a CUDA out-of-memory failure (``exc``, else the exception being handled): dump torch's
        memory snapshot (``torch.cuda.memory._dump_snapshot``; open it at pytorch.org/memory_viz), log it
        as the artifact :data:`SNAPSHOT_ARTIFACT` where the run logger can (``logger.log_file``), and
        return the tags: ``llmeff.memory.snapshot`` (where it is, or why none was written) and
        ``llmeff.error`` naming the largest of weights, gradients, optimizer state and the rest of the
        peak (:func:`~mlflow_llmeff.meters.memory.largest_term`). ``{}`` for any other ending.

        Args:
            exc: the exception the run ended with (None: ``sys.exc_info()``).
            logger: the run logger (rank 0) or None.
            folder: where the snapshot file is written (default: a new temporary folder).
        """
        if exc is None:
            exc = sys.exc_info()[1]
        if not self.on_cuda or not _is_oom(exc):
            return {}
        tags: dict[str, str] = {}
        if self.history == "off":
            tags[names.MEMORY_SNAPSHOT] = "none: the allocator's history was not recorded (LLMEFF_MEMORY_HISTORY=0)"
        else:
            try:
                folder = folder or tempfile.mkdtemp(prefix="llmeff-memory-")
                path = os.path.join(folder, os.path.basename(SNAPSHOT_ARTIFACT))
                cuda = self._torch_cuda()
                cuda.memory._dump_snapshot(path)
                log_file = getattr(logger, "log_file", None)
                if callable(log_file):
                    log_file(path, os.path.dirname(SNAPSHOT_ARTIFACT))
                    tags[names.MEMORY_SNAPSHOT] = f"{SNAPSHOT_ARTIFACT} (open at pytorch.org/memory_viz)"
                else:  # the run logger cannot upload files: the snapshot stays on this machine
                    tags[names.MEMORY_SNAPSHOT] = (f"{path} on {os.uname().nodename} (not uploaded: the run logger "
                                                   "logs no files; open at pytorch.org/memory_viz)")
            except Exception as e:  # noqa: BLE001
                tags[names.MEMORY_SNAPSHOT] = f"none: {type(e).__name__}: {names.shorten(str(e), 200)}"
        split, peak = self.last_split, None
        try:
            peak = int(self._torch_cuda().max_memory_allocated(self.device))
        except Exception:  # noqa: BLE001
            pass
        if split is not None:
            largest = f"largest term: {mem.largest_term(split, peak)}"
            tags[names.MEMORY_SNAPSHOT] += f"; {largest}"
            first = (str(exc).strip().splitlines() or [""])[0]
            given = self.given.get(names.ERROR)  # llmeff train's line (with what to try) stays first
            tags[names.ERROR] = names.shorten(f"{given}; {largest}" if given else
                                              f"CUDA out of memory ({names.shorten(first, 200)}); {largest}", 1000)
        return tags


class HeldPeak:
    """The peak memory a monitor last read for its interval keys, and where it was read
    (:func:`~mlflow_llmeff.monitor.points.memory`: a CPU process's peak RSS is a system call, read
    again at most every ``refresh_s``).

    Attributes (read them; :meth:`read` changes them):
        source: where the peak was last read (``llmeff.memory.source``; None: never read).
    """

    __slots__ = ("source", "_held")

    def __init__(self) -> None:
        self.source: str | None = None
        self._held: tuple[float, float, float] | None = None  # (clock s, allocated GiB, reserved GiB)

    def reuse(self, now: float, refresh_s: float) -> tuple[float, float, str] | None:
        """``(allocated GiB, reserved GiB, source)`` held from a reading less than ``refresh_s`` before
        ``now`` (seconds on the monitor's clock), else None (read again)."""
        held = self._held
        if held is None or now - held[0] >= refresh_s:
            return None
        return held[1], held[2], self.source

    def read(self, now: float, alloc: float, reserved: float, source: str, hold: bool) -> None:
        """A reading at ``now`` from ``source`` (GiB); ``hold``: keep it for :meth:`reuse` (a CPU peak)."""
        self.source = source
        if hold:
            self._held = (now, alloc, reserved)

