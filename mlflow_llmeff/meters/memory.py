"""Where every byte of a device goes: model state counted as stored, the peak, the capacity, and the levers' tags.

Bytes are counted as stored (docs/metrics.md "Memory"): a tensor by its storage, once per storage (tied
weights, views and a table every optimizer state shares count once); a DTensor by its local shard; any
other tensor subclass (torchao's low-bit optimizer states, quantized weights) by the inner tensors its
``__tensor_flatten__`` names, never by the ``numel * element_size()`` of the dtype it shows. The CPU peak
is read from ``/proc`` (proc(5) ``VmRSS``, ``VmHWM``, ``clear_refs``), the CPU capacity from the cgroup
(cgroup v2 ``memory.max``, v1 ``memory.limit_in_bytes``) or the host; CUDA figures from the caching
allocator and NVML through readers passed in, so they are tested with fakes. torch is imported inside
the functions; nothing here imports mlflow.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

__all__ = ["StateBytes", "stored_bytes", "state_split", "inner_optimizer", "optimizer_tag", "attention_tag",
           "weights_tag", "rss_bytes", "reset_peak_rss", "memory_capacity", "CpuPeak",
           "CudaMemory", "cuda_memory", "deepspeed_state_split", "is_deepspeed_zero", "nvml_process_bytes", "largest_term", "history_wanted", "state_dtypes",
           "DTYPE_NAMES"]

#: Short dtype names in tags (torch dtype's ``str`` without ``torch.`` where not listed).
DTYPE_NAMES = {"torch.float32": "fp32", "torch.bfloat16": "bf16", "torch.float16": "fp16", "torch.float64": "fp64",
               "torch.float8_e4m3fn": "fp8_e4m3", "torch.float8_e5m2": "fp8_e5m2"}



def _dtype_name(dtype) -> str:
    return DTYPE_NAMES.get(str(dtype), str(dtype).replace("torch.", ""))


def stored_bytes(x: Any, seen: set[int]) -> int:
    """Bytes ``x`` holds as stored, each storage counted once per ``seen``.

    * a plain tensor: the bytes of its whole storage (``untyped_storage().nbytes()``), once per storage
      (keyed on its ``data_ptr()``): tied weights, a view and its base, and a table shared by every
      optimizer state count once; a 0-d tensor (an optimizer's step) counts its 4 or 8 bytes;
    * a ``DTensor`` (FSDP2, tensor parallelism): its local shard (``to_local()``);
    * any other tensor subclass with ``__tensor_flatten__`` (torch's traceable-subclass protocol,
      ``torch/utils/_python_dispatch.py``; torchao's ``OptimState8bit`` / ``OptimState4bit`` /
      ``OptimStateFp8`` in ``torchao/optim/subclass_8bit.py``, quantized weights): the inner tensors
      the protocol names (codes, scale, qmap), recursively; the dtype such a wrapper shows (float32)
      is never used;
    * a list, tuple or dict: its items (values), recursively; anything else, and a meta tensor: 0.

    Args:
        x: a tensor, a (nested) list, tuple or dict of them, or anything else.
        seen: the storages counted so far (their data pointers); updated in place. One set per
            accounting, so what is shared counts once in it.

    Returns:
        Bytes (>= 0).
    """
    import torch

    if isinstance(x, dict):
        return sum(stored_bytes(v, seen) for v in x.values())
    if isinstance(x, (list, tuple)):
        return sum(stored_bytes(v, seen) for v in x)
    if not torch.is_tensor(x) or x.is_meta:
        return 0
    if hasattr(x, "to_local") and callable(x.to_local):  # DTensor: this rank's shard
        return stored_bytes(x.to_local(), seen)
    if hasattr(type(x), "__tensor_flatten__"):
        attrs, _ = x.__tensor_flatten__()
        return sum(stored_bytes(getattr(x, a), seen) for a in attrs)
    try:
        storage = x.untyped_storage()
        key, nbytes = storage.data_ptr(), storage.nbytes()
    except (RuntimeError, NotImplementedError, TypeError):  # sparse and other storage-less layouts
        return x.numel() * x.element_size()
    if nbytes == 0 or key in seen:
        return 0
    seen.add(key)
    return int(nbytes)


def _local(t):
    return t.to_local() if hasattr(t, "to_local") and callable(t.to_local) else t


def inner_optimizer(optimizer):
    """The optimizer holding the states: Accelerate's ``AcceleratedOptimizer``, DeepSpeed's wrappers and
    ZeRO optimizers are looked through (each keeps the one it wraps in ``.optimizer``)."""
    opt, depth = optimizer, 0
    while depth < 6:
        inner = getattr(opt, "optimizer", None)
        if inner is None or inner is opt or not hasattr(inner, "param_groups"):
            break
        opt, depth = inner, depth + 1
    return opt


@dataclass(frozen=True)
class StateBytes:
    """A device's model state as stored, by term.

    Attributes:
        weights: bytes of the model's parameters (local shards, tied weights once; buffers are not
            model state: they are in the peak's rest).
        gradients: bytes of the trainable parameters' gradients during a step (``p.grad`` as stored;
            a parameter without one, freed between steps, at its own size in its dtype).
        optimizer_state: bytes of the optimizer's states as stored (tables shared by its states once).
        params: the model's parameters, whole (global shapes; tied weights once; ZeRO-3: ``ds_numel``).
        counters: bytes of the 0-d tensors among the optimizer's states (torch's and torchao's ``step``,
            4 B a parameter tensor): in ``optimizer_state``; bytes per tensor, not per parameter, so
            ``summary/model_state_bytes_per_param`` leaves them out (fp32 AdamW: exactly 16).
    """

    weights: int
    gradients: int
    optimizer_state: int
    params: int
    counters: int = 0

    def __post_init__(self) -> None:
        if self.counters > self.optimizer_state:
            raise ValueError(f"StateBytes.counters ({self.counters}) must be within optimizer_state "
                             f"({self.optimizer_state})")
        for name in ("weights", "gradients", "optimizer_state", "params", "counters"):
            if getattr(self, name) < 0:
                raise ValueError(f"StateBytes.{name} must be >= 0, got {getattr(self, name)}")

    @property
    def total(self) -> int:
        """Weights + gradients + optimizer state, bytes."""
        return self.weights + self.gradients + self.optimizer_state

    @property
    def per_param_total(self) -> int:
        """Weights + gradients + optimizer state without the step counters, bytes (the numerator of
        ``summary/model_state_bytes_per_param``)."""
        return self.total - self.counters


def state_split(model, optimizer=None) -> StateBytes:
    """Weights, gradients and optimizer state this device holds, as stored (:func:`stored_bytes`).

    One ``seen`` set for the whole call: a storage counts once in it, whichever term meets it first
    (weights, then gradients, then the optimizer's states). A DeepSpeed ZeRO optimizer is accounted by
    DeepSpeed's own partitions (:func:`~mlflow_llmeff.meters.probes.deepspeed_state_split`).

    Args:
        model: the module (wrappers looked through by the caller or not: ``parameters()`` is the same).
        optimizer: a torch optimizer, or a wrapper of one (:func:`inner_optimizer`); None: no state.

    Returns:
        A :class:`StateBytes`.
    """
    import torch

    if optimizer is not None:
        for zero in (optimizer, getattr(optimizer, "optimizer", None)):  # bare, or in Accelerate's wrapper
            if zero is not None and hasattr(zero, "optimizer") and is_deepspeed_zero(zero):
                return deepspeed_state_split(model, zero)
    seen: set[int] = set()
    params = list(model.parameters())  # tied weights once (parameters() removes duplicates)
    weights = sum(stored_bytes(p, seen) for p in params)
    grads = 0
    for p in params:
        if p.requires_grad:  # gradients live through every step (freed only between steps)
            if p.grad is not None:
                grads += stored_bytes(p.grad, seen)
            else:
                lp = _local(p)
                grads += lp.numel() * lp.element_size()
    state = counters = 0
    if optimizer is not None:
        for st in inner_optimizer(optimizer).state.values():
            state += stored_bytes(st, seen) if isinstance(st, dict) else 0
            counters += sum(v.numel() * v.element_size() for v in (st.values() if isinstance(st, dict) else ())
                            if torch.is_tensor(v) and v.dim() == 0 and not v.is_meta)
    nparams = sum(int(getattr(p, "ds_numel", 0)) or p.numel() for p in params)
    return StateBytes(weights=weights, gradients=grads, optimizer_state=state, params=nparams, counters=counters)


def _numel_bytes(x) -> int:
    """``numel * element_size`` of a tensor, summed over a (nested) list or tuple; 0 for anything else
    (DeepSpeed's flat partitions are whole tensors of their own)."""
    import torch

    if torch.is_tensor(x):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_numel_bytes(y) for y in x)
    return 0


def is_deepspeed_zero(opt) -> bool:
    """True for DeepSpeed's ZeRO optimizer of stage 1-2 or 3 (by class name: DeepSpeed is not imported)."""
    return type(opt).__name__ in ("DeepSpeedZeroOptimizer", "DeepSpeedZeroOptimizer_Stage3")


def deepspeed_state_split(model, zero):
    """The :class:`~mlflow_llmeff.meters.memory.StateBytes` of a DeepSpeed ZeRO run (DeepSpeed 0.19's
    optimizer attributes), the most held at one moment of a step (``planning/plan.py`` ``model_state_bytes``
    predicts the same).

    Weights: the module's parameters (ZeRO-3: each one's ``ds_tensor`` partition). Optimizer: the
    torch optimizer's state on the flat partitions plus the fp32 master partitions
    (``single_partition_of_fp32_groups``, ZeRO-3 ``fp32_partitioned_groups_flat``). Gradients:
    ZeRO-1 keeps whole gradients (reduced at the step), ZeRO-2 and 3 a partition of the master
    partition's size in the weights' dtype; in 16-bit runs the step adds the fp32 copy of that
    partition (``stage_1_and_2.py`` ``single_grad_partition = flat_grad_partition.to(fp32)``), counted
    as gradients. ZeRO-3 holds two states in turn (``stage3.py`` ``step``): in forward and backward the
    parameters of at most ``stage3_param_persistence_threshold`` elements (``ds_persist``) are whole on
    every rank besides their partitions (counted whole even where ``empty_partition_cache`` released
    them since), with any other parameter still gathered (both counted as weights); at the step those
    are partitioned and the step holds an fp32 copy of the gradient partition (``_prepare_fp32_grad_for_sub_group``:
    ``flatten`` copies, in fp32 too). The larger of the two is returned. The optimizer's 0-d step
    counters are not counted here (DeepSpeed's own accounting).
    """
    import torch

    tensor_bytes = _numel_bytes
    params = list(model.parameters())
    stage3 = type(zero).__name__.endswith("Stage3")
    nparams = sum(int(getattr(p, "ds_numel", 0)) or p.numel() for p in params)
    master = zero.fp32_partitioned_groups_flat if stage3 else zero.single_partition_of_fp32_groups
    master_bytes, master_numel = tensor_bytes(master), sum(t.numel() for t in master)
    moments = sum(tensor_bytes(v) for st in zero.optimizer.state.values() for v in st.values()
                  if torch.is_tensor(v) and v.dim() > 0)
    elem = params[0].element_size() if params else 4
    master_elem = master[0].element_size() if len(master) else 4
    optimizer_state = master_bytes + moments
    if not stage3:
        stage = int(getattr(zero, "partition_gradients", False)) + 1
        grads = sum(p.numel() for p in params) * elem if stage == 1 else master_numel * elem
        step_copy = master_numel * master_elem if elem != master_elem else 0  # fp32 runs step on the partition
        return StateBytes(weights=sum(tensor_bytes(p.data) for p in params), gradients=grads + step_copy,
                          optimizer_state=optimizer_state, params=nparams)
    partitions = sum(tensor_bytes(p.ds_tensor) if hasattr(p, "ds_tensor") else tensor_bytes(p.data) for p in params)
    whole = 0
    for p in params:
        if not hasattr(p, "ds_tensor"):
            continue
        if getattr(p, "ds_persist", False):
            # on one rank the partition is the whole tensor (DeepSpeed gathers into its storage)
            whole += p.ds_numel * elem if p.ds_tensor.numel() < p.ds_numel else 0
        else:
            whole += tensor_bytes(p.data)  # still gathered when read (normally released: empty)
    buffer = getattr(zero, "grad_partitions_flat_buffer", None)
    grads = tensor_bytes(buffer) if torch.is_tensor(buffer) else master_numel * elem
    forward = StateBytes(weights=partitions + whole, gradients=grads, optimizer_state=optimizer_state, params=nparams)
    step = StateBytes(weights=partitions, gradients=grads + master_numel * master_elem,
                      optimizer_state=optimizer_state, params=nparams)
    return forward if forward.total >= step.total else step


# ---------------------------------------------------------------------------------------------- tags
def _leaves(x, name: str):
    """(name, tensor) of every stored tensor inside ``x`` (a state value), as :func:`stored_bytes` walks it."""
    import torch

    if isinstance(x, dict):
        for k, v in x.items():
            yield from _leaves(v, str(k))
    elif isinstance(x, (list, tuple)):
        for v in x:
            yield from _leaves(v, name)
    elif torch.is_tensor(x):
        if hasattr(x, "to_local") and callable(x.to_local):
            yield from _leaves(x.to_local(), name)
        elif hasattr(type(x), "__tensor_flatten__"):
            for a in x.__tensor_flatten__()[0]:
                yield from _leaves(getattr(x, a), a)
        else:
            yield name, x


def _storage_key(t) -> int | None:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def state_dtypes(optimizer) -> str | None:
    """How the optimizer's states are stored, read from them: ``fp32``, ``bf16``, ``uint8 codes + fp32
    scales + fp32 tables``, ``4-bit codes (uint8) + fp32 scales + fp32 tables``; None before any state.

    A state tensor is a table when its name says ``qmap`` or the states of several parameters share
    its storage (bitsandbytes' ``qmap1``/``qmap2``, ``bitsandbytes/optim/optimizer.py`` ``name2qmap``);
    codes or values when it holds at least 1/8 of its parameter's elements in bytes; else scales. The
    0-d step counters are left out."""
    import torch

    opt = inner_optimizer(optimizer)
    owners: dict[int, set[int]] = {}
    found: list[tuple[str, Any, int]] = []  # (name, tensor, parameter elements)
    for p, st in list(opt.state.items()):
        n = _local(p).numel() if torch.is_tensor(p) else 0
        for name, t in _leaves(st, "state"):
            if t.dim() == 0 or t.is_meta:
                continue
            key = _storage_key(t)
            if key is not None:
                owners.setdefault(key, set()).add(id(p))
            found.append((name, t, n))
    if not found:
        return None
    kinds: dict[str, None] = {}
    for name, t, n in found:
        key = _storage_key(t)
        nbytes = t.numel() * t.element_size()
        dt = _dtype_name(t.dtype)
        if "qmap" in name or (key is not None and len(owners.get(key, ())) > 1):
            kinds[f"{dt} tables"] = None
        elif n and nbytes * 8 >= n:
            if t.is_floating_point():
                kinds[dt] = None
            else:
                bits = nbytes * 8 / n
                kinds[f"{dt} codes" if abs(bits - 8 * t.element_size()) < 0.5 else f"{bits:g}-bit codes ({dt})"] = None
        else:
            kinds[f"{dt} scales"] = None
    order = sorted(kinds, key=lambda k: ("codes" not in k and k.split()[-1] in ("scales", "tables"), "tables" in k))
    return " + ".join(order)


def optimizer_tag(optimizer, origin: str | None = None) -> str:
    """``llmeff.optimizer``: the optimizer's class and package, the dtypes its states are stored in, and
    where it came from, e.g. ``AdamW8bit (torchao.optim); states uint8 codes + fp32 scales + fp32 tables;
    from llmeff train --optimizer adamw8bit``.

    A wrapper (Accelerate, a DeepSpeed ZeRO optimizer) is named by the optimizer it wraps, with the
    wrapper beside it (``AdamW (torch.optim) in DeepSpeedZeroOptimizer``). Before the first step there is
    no state to read: ``states not yet allocated``.

    Args:
        optimizer: any optimizer, or a wrapper of one.
        origin: where it came from (``llmeff train --optimizer adamw8bit``, ``transformers Trainer
            optim=adamw_torch``); None: ``the user's loop``.
    """
    opt = inner_optimizer(optimizer)
    cls = type(opt)
    package = ".".join(cls.__module__.split(".")[:2])
    head = f"{cls.__name__} ({package})"
    outer = getattr(optimizer, "optimizer", None)
    if outer is not None and outer is not opt and type(outer).__name__ != cls.__name__:
        head += f" in {type(outer).__name__}"  # a ZeRO optimizer inside Accelerate's wrapper
    try:
        states = state_dtypes(optimizer)
    except Exception as e:  # noqa: BLE001 - a tag never stops the run
        states = None
        head += f"; states unreadable ({type(e).__name__})"
    what = f"states {states}" if states else "states not yet allocated"
    where = origin or "the user's loop"
    return f"{head}; {what}; from {where}"


def attention_tag(model) -> str:
    """``llmeff.attention``: the attention kernel the built model runs (Hugging Face's
    ``config._attn_implementation``: sdpa, eager, flash_attention_2, ...; transformers has no public
    reader of it); ``unknown: the model has no config._attn_implementation`` otherwise.

    Args:
        model: the user's module, wrappers already looked through
            (:func:`~mlflow_llmeff.monitor.conditions.unwrap_model`).
    """
    config = getattr(model, "config", None)
    impl = getattr(config, "_attn_implementation", None)
    return str(impl) if impl else "unknown: the model has no config._attn_implementation"


def weights_tag(model) -> str:
    """``llmeff.weights``: ``fp32``, ``bf16`` or ``fp16``, the dtype the trainable parameters are stored
    in (a DTensor's local shard), the most elements' where they differ (the others named). Mixed
    precision (autocast) keeps fp32 weights: ``fp32``. ``unknown: no floating parameters`` without any.

    Args:
        model: the user's module (wrappers looked through or not: the parameters are the same).
    """
    inner = model
    counts: dict[str, int] = {}
    params = [p for p in inner.parameters() if p.is_floating_point()] if inner is not None else []
    trainable = [p for p in params if p.requires_grad] or params
    for p in trainable:
        lp = _local(p)
        counts[_dtype_name(lp.dtype)] = counts.get(_dtype_name(lp.dtype), 0) + p.numel()
    if not counts:
        return "unknown: no floating parameters"
    ranked = sorted(counts, key=lambda k: -counts[k])
    total = sum(counts.values())
    if len(ranked) == 1:
        return ranked[0]
    rest = ", ".join(f"{k} {counts[k] / total:.0%}" for k in ranked[1:])
    return f"{ranked[0]} (of the trainable weights also {rest})"


# ---------------------------------------------------------------------------------------------- the CPU
def rss_bytes(status_path: str = "/proc/self/status") -> tuple[int, int] | None:
    """(``VmRSS``, ``VmHWM``) of this process in bytes: its resident set now and its peak since the
    process started or the peak was last reset (proc(5) ``/proc/[pid]/status``); None where unreadable."""
    try:
        with open(status_path) as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        return int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024
    except (OSError, KeyError, ValueError, IndexError):
        return None


def reset_peak_rss(clear_refs_path: str = "/proc/self/clear_refs") -> str | None:
    """Reset this process's peak resident set to its size now: ``5`` written to ``clear_refs`` (proc(5),
    Linux >= 4.0) resets ``VmHWM`` and with it getrusage's ``ru_maxrss``. Process-wide: every later
    peak-RSS reading of the process counts from here. Returns None when reset, else why not."""
    try:
        with open(clear_refs_path, "w") as f:
            f.write("5")
        return None
    except OSError as e:
        return f"{clear_refs_path} not writable ({e.strerror or type(e).__name__})"


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def memory_capacity(root: str = "/") -> tuple[int | None, str]:
    """The memory this process may use, bytes, and where it was read (``llmeff.memory.capacity``).

    The container's limit as :func:`mlflow_llmeff.meters.cgroup.memory_limit` reads it (cgroup v2
    ``memory.max``, then v1 ``memory.limit_in_bytes``, the smallest from this process's cgroup up to the
    root) when below the host's ``MemTotal`` (``/proc/meminfo``); else the host's memory.

    Args:
        root: the file-system root the ``proc`` and ``sys`` trees are read under (tests pass a fake one).

    Returns:
        ``(bytes or None where nothing could be read, the source in words)``.
    """
    from mlflow_llmeff.meters.cgroup import memory_limit

    host = None
    meminfo = _read(os.path.join(root, "proc/meminfo"))
    for line in (meminfo or "").splitlines():
        if line.startswith("MemTotal:"):
            host = int(line.split()[1]) * 1024
    limit = memory_limit(root, host)
    if limit is not None:
        where = limit.path[len(str(root).rstrip("/")):]
        return limit.bytes, f"{limit.source} ({where}): {limit.bytes / 2**30:.2f} GiB"
    if host is not None:
        return host, f"host memory (/proc/meminfo MemTotal): {host / 2**30:.2f} GiB; no lower cgroup memory limit"
    return None, "unknown: neither a cgroup memory limit nor /proc/meminfo could be read"


class CpuPeak:
    """The peak of a CPU process's tensors over a span, from its resident set (no allocator statistics on CPU).

    At :meth:`start` the process's peak RSS is reset (:func:`reset_peak_rss`) and its RSS read; at the
    end the tensor peak is ``(VmHWM now - VmRSS at start) + the bytes of the model state that existed at
    start`` (weights and whatever gradients and optimizer state were already there): what the
    interpreter and its libraries held before the span is left out, the tensors it began with are in.
    Where the reset fails the peak since the process started is used instead (``source`` says so).

    Args:
        status_path, clear_refs_path: the ``/proc`` files (tests pass fakes).
    """

    def __init__(self, status_path: str = "/proc/self/status", clear_refs_path: str = "/proc/self/clear_refs") -> None:
        self._status, self._clear = status_path, clear_refs_path
        self.start_rss: int | None = None
        self.start_state = 0
        self.source = "cpu: not started"

    def start(self, state_bytes: int) -> None:
        """Reset the peak and remember the RSS now and ``state_bytes`` (bytes of the model state held now)."""
        why = reset_peak_rss(self._clear)
        got = rss_bytes(self._status)
        self.start_state = int(state_bytes)
        if got is None:
            self.source = f"cpu: {self._status} unreadable: no peak"
            return
        self.start_rss = got[0] if why is None else 0
        self.start_state = self.start_state if why is None else 0
        self.source = ("cpu: peak RSS (VmHWM, reset by clear_refs at the monitor's start) above the RSS then, plus "
                       "the model state held then" if why is None else
                       f"cpu: peak RSS since the process started (VmHWM; the reset failed: {why}): interpreter and "
                       "libraries included")

    def peak(self) -> tuple[int, int] | None:
        """(the tensors' peak, the process's peak RSS), bytes; None where ``/proc`` could not be read."""
        got = rss_bytes(self._status)
        if got is None or self.start_rss is None:
            return None
        hwm = got[1]
        return max(0, hwm - self.start_rss) + self.start_state, hwm


# ---------------------------------------------------------------------------------------------- CUDA
@dataclass(frozen=True)
class CudaMemory:
    """A CUDA device's allocator figures, bytes and counts.

    Attributes:
        peak: ``max_memory_allocated`` (bytes the tensors held at most).
        reserved: ``max_memory_reserved`` (bytes the caching allocator held at most).
        total: the device's memory (``get_device_properties().total_memory``).
        retries: ``num_alloc_retries`` (a cudaMalloc failed, the cache was flushed and the call retried).
        ooms: ``num_ooms`` (out-of-memory errors the allocator raised).
    """

    peak: int
    reserved: int
    total: int
    retries: int
    ooms: int

    @property
    def fraction(self) -> float | None:
        """Peak reserved memory / the device's memory, in [0, 1]; None without a total."""
        return self.reserved / self.total if self.total > 0 else None


def cuda_memory(cuda, device) -> CudaMemory:
    """The allocator's figures of ``device`` from ``cuda`` (``torch.cuda`` or a stand-in with
    ``max_memory_allocated``, ``max_memory_reserved``, ``get_device_properties`` and ``memory_stats``)."""
    stats = cuda.memory_stats(device) or {}
    return CudaMemory(peak=int(cuda.max_memory_allocated(device)), reserved=int(cuda.max_memory_reserved(device)),
                      total=int(cuda.get_device_properties(device).total_memory),
                      retries=int(stats.get("num_alloc_retries", 0)), ooms=int(stats.get("num_ooms", 0)))


def nvml_process_bytes(nvml, handle, pid: int | None = None) -> int | None:
    """Device memory NVML says process ``pid`` (default: this one) uses on the device of ``handle``, bytes
    (``nvmlDeviceGetComputeRunningProcesses``' ``usedGpuMemory``: the allocator's reserved memory plus the
    CUDA context, NCCL buffers and anything else outside it); None where NVML does not say."""
    pid = os.getpid() if pid is None else pid
    try:
        procs = nvml.nvmlDeviceGetComputeRunningProcesses(handle)
    except Exception:  # noqa: BLE001 - Not Supported (e.g. in a container without the PID namespace)
        return None
    used = [getattr(q, "usedGpuMemory", None) for q in procs if getattr(q, "pid", None) == pid]
    used = [u for u in used if u is not None]
    return int(sum(used)) if used else None


def largest_term(split: StateBytes, peak: int | None) -> str:
    """The largest of weights, gradients, optimizer state and the rest of ``peak`` (bytes), in words:
    ``optimizer state 4.00 GiB of a 9.50 GiB peak (weights 2.00, gradients 2.00, other 1.50 GiB)``."""
    other = max(0, peak - split.total) if peak is not None else None
    terms = {"weights": split.weights, "gradients": split.gradients, "optimizer state": split.optimizer_state}
    if other is not None:
        terms["other (activations, workspace, temporaries)"] = other
    name = max(terms, key=lambda k: terms[k])
    rest = ", ".join(f"{k.split(' (')[0]} {v / 2**30:.2f}" for k, v in terms.items() if k != name)
    of = f" of a {peak / 2**30:.2f} GiB peak" if peak is not None else ""
    return f"{name} {terms[name] / 2**30:.2f} GiB{of} ({rest} GiB)"


def history_wanted(env: dict | None = None) -> bool:
    """True unless ``LLMEFF_MEMORY_HISTORY=0``: record the CUDA allocator's history for a snapshot on OOM."""
    return (env if env is not None else os.environ).get("LLMEFF_MEMORY_HISTORY", "1") != "0"

