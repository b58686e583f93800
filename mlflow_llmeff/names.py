"""Every metric key, tag key and param name mlflow_llmeff logs, as constants.

This module is the single source of truth for the metric and tag keys (counting rules and formulas:
``docs/formulas.md``); ``docs/metrics.md`` is generated from it by ``python -m mlflow_llmeff.names`` (a test keeps the
two in sync). Keys obey MLflow's rule (letters, digits, ``_ . - /`` and spaces) and carry units.

Each constant is declared with :func:`_metric` or :func:`_tag` so that the docs generator can list
its unit and meaning; the constant itself is the plain string key.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

__all__ = ["KeyDoc", "METRICS", "TAGS", "target_key", "render_docs"]


@dataclass(frozen=True)
class KeyDoc:
    """Documentation of one key: the key, its unit (or ``-``) and what it means."""

    key: str
    unit: str
    meaning: str
    group: str


METRICS: list[KeyDoc] = []
TAGS: list[KeyDoc] = []

_KEY_RE = re.compile(r"^[A-Za-z0-9_\-./ ]+$")


def _metric(key: str, unit: str, meaning: str, group: str) -> str:
    if not _KEY_RE.match(key):  # pragma: no cover - guards edits to this file
        raise ValueError(f"metric key {key!r} has characters MLflow rejects")
    METRICS.append(KeyDoc(key, unit, meaning, group))
    return key


def _tag(key: str, meaning: str, group: str = "conditions") -> str:
    key = "llmeff." + key
    TAGS.append(KeyDoc(key, "-", meaning, group))
    return key


# --------------------------------------------------------------------------- interval metrics
I = "interval (every log_every_n_steps, MLflow step = optimizer step)"
TRAIN_LOSS = _metric("train/loss", "nats/token", "mean training loss over the interval's optimizer steps", I)
TRAIN_LR = _metric("train/learning_rate", "-", "learning rate at the logged step", I)
TRAIN_TOKENS = _metric("train/tokens", "tokens", "cumulative non-padding input tokens (attention_mask.sum()), all micro-batches, all data-parallel ranks", I)
TRAIN_PADDED_TOKENS = _metric("train/padded_tokens", "tokens", "cumulative input positions including padding; absent once a micro-batch was counted as tokens= without padded_tokens= (llmeff.interval.absent)", I)
TRAIN_LOSS_TOKENS = _metric("train/loss_tokens", "tokens", "cumulative loss-bearing (label != -100, after the causal shift) tokens; absent once a micro-batch's were unknown: tokens= without loss_tokens= or samples=, a flat 1-D batch without labels (llmeff.interval.absent)", I)
TRAIN_SKIPPED_STEPS = _metric("train/skipped_steps", "steps", "cumulative optimizer steps skipped because a micro-batch's loss was not finite (llmeff train with nan_policy=skip_step)", I)
TRAIN_STEP_TIME_S = _metric("train/step_time_s", "s", "mean optimizer-step wall time over the interval's post-warm-up steps", I)
TPUT_TOKENS = _metric("throughput/tokens_per_sec", "tokens/s", "global non-padding tokens per second over the interval (warm-up excluded)", I)
TPUT_SAMPLES = _metric("throughput/samples_per_sec", "samples/s", "global sequences per second over the interval (warm-up excluded); absent, never 0, when a micro-batch's sequences are unknown: tokens= without samples=, a flat 1-D batch without position_ids, cu_seqlens or seq_idx (llmeff.interval.absent)", I)
TPUT_DEVICE_TOKENS = _metric("throughput/device/tokens_per_sec", "tokens/s", "global tokens/s divided by the number of devices", I)
TPUT_DEVICE_TFLOPS = _metric("throughput/device/model_tflops_per_sec", "TFLOP/s", "achieved model TFLOP/s per device (model FLOPs, megatron convention); absent with MFU and HFU when a micro-batch's sequence lengths are unknown (tokens= without samples= or sum_len_sq=, a flat 1-D batch): attention FLOPs grow with them (llmeff.interval.absent, docs/formulas.md)", I)
TPUT_DEVICE_MFU = _metric("throughput/device/mfu", "fraction", "model FLOPs utilization against the dense datasheet peak", I)
TPUT_DEVICE_HFU = _metric("throughput/device/hfu", "fraction", "hardware FLOPs utilization (recomputation included) against the dense peak", I)
MEM_MAX_ALLOC = _metric("memory/device/max_allocated_gib", "GiB", "peak allocated memory, max over devices (CPU: peak RSS since the monitor started, whose start resets the process's peak through /proc/self/clear_refs; read at most once a second, see llmeff.memory.source)", I)
MEM_MAX_RESERVED = _metric("memory/device/max_reserved_gib", "GiB", "peak reserved memory, max over devices (CPU: peak RSS, read at most once a second, see llmeff.memory.source)", I)
ENERGY_TOTAL_KWH = _metric("energy/total_kwh", "kWh", "cumulative measured energy of every device of the run, each physical device once (and CPU/RAM where measured); omitted when only some devices are measured (llmeff.energy.coverage)", I)
ENERGY_DEVICE_AVG_POWER_W = _metric("energy/device/avg_power_w", "W", "average power per measured device over the interval", I)
ENERGY_J_PER_TOKEN = _metric("energy/j_per_token", "J/token", "measured energy per non-padding token over the interval; omitted when only some devices are measured", I)
CARBON_TOTAL_KG = _metric("carbon/total_kg_co2e", "kg CO2e", "cumulative emissions of energy/total_kwh (codecarbon's grid intensity); omitted when energy/total_kwh is", I)
COST_TOTAL_USD = _metric("cost/total_usd", "USD", "device_hour_usd * device-hours (devices * wall hours, each attempt at its own devices) (+ kWh * usd_per_kwh)", I)
ENERGY_ESTIMATE_CPU_KWH = _metric("energy/estimate/cpu_kwh", "kWh", "cumulative codecarbon CPU energy ESTIMATE for the node(s) (TDP x load or its RAPL read; see llmeff.carbon.estimate_method), all attempts; not in energy/total_kwh", I)
ENERGY_ESTIMATE_RAM_KWH = _metric("energy/estimate/ram_kwh", "kWh", "cumulative codecarbon RAM energy ESTIMATE (W per GB constant), all attempts; not in energy/total_kwh", I)
CARBON_ESTIMATE_KG = _metric("carbon/estimate_kg_co2e", "kg CO2e", "cumulative emissions of codecarbon's CPU+RAM estimate, all attempts; not in carbon/total_kg_co2e", I)
EVAL_VAL_LOSS = _metric("eval/val_loss", "nats/token", "mean loss on the held-out split", I)
EVAL_VAL_PPL = _metric("eval/val_perplexity", "-", "exp(eval/val_loss)", I)
EVAL_MMLU_ACC = _metric("eval/mmlu/acc", "fraction", "MMLU accuracy (lm-eval-harness definition)", I)
EVAL_HELLASWAG_ACC = _metric("eval/hellaswag/acc", "fraction", "HellaSwag accuracy by summed log-likelihood", I)
EVAL_HELLASWAG_ACC_NORM = _metric("eval/hellaswag/acc_norm", "fraction", "HellaSwag accuracy by log-likelihood divided by the ending's length in characters (lm-eval-harness acc_norm; its per-byte acc_bytes is not reported)", I)

# interval: what else used the machine (docs/stability.md); MLflow's own system metrics share this section
SYS_HOST_OTHER_CPU = _metric("system/host_other_cpu_fraction", "fraction", "share of the hosts' CPU time used by processes other than this run's over the interval (/proc/stat minus the run's process trees), all hosts together; given over intervals of at least 100 CPU ticks (1% resolution) read at most once a second (and the system/device/* keys with them), so at fewer logged steps than the others where steps are short; absent when the run's own CPU time could not be read (llmeff.interval.absent)", I)
SYS_HOST_STEAL = _metric("system/host_steal_fraction", "fraction", "share of the hosts' CPU time stolen by the hypervisor over the interval (/proc/stat steal), given over intervals of at least 100 CPU ticks as system/host_other_cpu_fraction", I)
SYS_DEV_SM_CLOCK = _metric("system/device/sm_clock_mhz", "MHz", "lowest SM clock sampled on any of the run's CUDA devices over the interval (NVML)", I)
SYS_DEV_SM_CLOCK_FRAC = _metric("system/device/sm_clock_fraction", "fraction", "lowest SM clock / its maximum sampled over the interval (NVML)", I)
SYS_DEV_TEMP = _metric("system/device/temperature_c", "degrees C", "highest GPU temperature sampled over the interval (NVML)", I)
SYS_DEV_OTHER_PROCS = _metric("system/device/other_processes", "processes", "compute processes not of this run seen on the run's CUDA devices over the interval (NVML), all devices; absent, not 0, when none was seen and some device's processes could not be listed (llmeff.interval.absent)", I)
SYS_DEV_THROTTLED = _metric("system/device/throttled", "0/1", "1 when NVML reported a slowdown clocks-event reason (power cap, thermal, hardware slowdown) on any device over the interval, 0 when every device's reasons were read and none was a slowdown; absent, not 0, when none read was a slowdown and some device's reasons could not be read (llmeff.interval.absent; llmeff.contention names the devices)", I)

# --------------------------------------------------------------------------- run summary
S = "summary (logged once at the end, steady state = after warm-up)"
SUM_TOKENS_PER_SEC = _metric("summary/tokens_per_sec", "tokens/s", "steady-state global non-padding tokens/s", S)
SUM_DEVICE_TOKENS_PER_SEC = _metric("summary/device_tokens_per_sec", "tokens/s", "steady-state tokens/s per device", S)
SUM_DEVICE_TFLOPS = _metric("summary/device_tflops_per_sec", "TFLOP/s", "steady-state achieved model TFLOP/s per device", S)
SUM_MFU = _metric("summary/mfu", "fraction", "steady-state MFU (megatron FLOPs / dense peak)", S)
SUM_MFU_PALM = _metric("summary/mfu_palm", "fraction", "steady-state MFU with PaLM-convention FLOPs (no causal discount)", S)
SUM_HFU = _metric("summary/hfu", "fraction", "steady-state HFU (measured hardware FLOPs / dense peak)", S)
SUM_MFU_MEASURED_PEAK = _metric("summary/mfu_measured_peak", "fraction", "MFU against the measured achievable matmul peak (MAMF)", S)
SUM_STEP_TIME_S = _metric("summary/step_time_s", "s", "steady-state mean optimizer-step wall time", S)
SUM_BYTES_PER_PARAM = _metric("summary/bytes_per_param", "bytes", "peak allocated memory per device / parameters per device (devices with allocator statistics only: never from CPU process RSS)", S)
SUM_MODEL_STATE_BYTES_PER_PARAM = _metric("summary/model_state_bytes_per_param", "bytes", "(weights + gradients + optimizer state) bytes held by one device, as stored (max over devices) / the model's parameters: fp32 AdamW 16 replicated, 16/n fully sharded over n ranks; the optimizer's 0-d step counters (bytes per tensor, not per parameter) left out", S)
# where every byte goes (docs/memory.md): per device, max over devices, bytes as stored (a tensor subclass by its
# inner tensors, a table shared by an optimizer's tensors once)
SUM_OPT_STATE_BYTES_PER_PARAM = _metric("summary/optimizer_state_bytes_per_param", "bytes", "optimizer state bytes held by one device (max over devices) / the model's parameters, counted as stored (the 0-d step counters included: 4 B a parameter tensor): torch AdamW fp32 8, 8-bit AdamW about 2.03, 4-bit about 1.06 at large tensors (docs/memory.md)", S)
SUM_MEM_WEIGHTS_GIB = _metric("summary/memory/weights_gib", "GiB", "weights held by one device (local shards, tied weights once), as stored; max over devices", S)
SUM_MEM_GRADIENTS_GIB = _metric("summary/memory/gradients_gib", "GiB", "gradients of the trainable weights held by one device during a step, as stored; max over devices", S)
SUM_MEM_OPT_STATE_GIB = _metric("summary/memory/optimizer_state_gib", "GiB", "optimizer state held by one device, as stored (inner tensors, scales and codes of tensor subclasses; tables shared by the optimizer's tensors once); max over devices", S)
SUM_MEM_PEAK_GIB = _metric("summary/memory/peak_gib", "GiB", "peak memory of one device: CUDA torch.cuda.max_memory_allocated; CPU the process's peak RSS (VmHWM, reset at the monitor's start) above its RSS at the monitor's start, plus the model state held then: the interpreter and libraries left out (llmeff.memory.source); max over devices", S)
SUM_MEM_OTHER_GIB = _metric("summary/memory/other_gib", "GiB", "the rest of the peak: summary/memory/peak_gib less weights, gradients and optimizer state (activations, workspace, the optimizer step's temporaries, the loss path); absent where the peak is below the model state (a peak read before the state existed)", S)
SUM_MEM_PEAK_FRACTION = _metric("summary/memory/peak_fraction", "fraction", "the peak's share of what the device (CUDA: reserved memory / total memory) or the process (CPU: peak RSS / the cgroup's memory limit, else the host's memory) may use; llmeff.memory.capacity says which", S)
SUM_MEM_ALLOC_RETRIES = _metric("summary/memory/alloc_retries", "count", "CUDA caching allocator retries (cudaMalloc failed, cache flushed, retried: torch.cuda.memory_stats num_alloc_retries), summed over devices; CUDA only", S)
SUM_MEM_OOMS = _metric("summary/memory/ooms", "count", "CUDA out-of-memory errors the allocator raised (torch.cuda.memory_stats num_ooms), summed over devices; CUDA only", S)
SUM_MEM_NVML_PROCESS_GIB = _metric("summary/memory/nvml_process_gib", "GiB", "device memory NVML says this process uses (allocator's reserved memory plus what lies outside it: CUDA context, NCCL buffers, paged optimizer buffers), at the end; max over devices; CUDA with NVML only", S)
SUM_COMM_EXPOSED = _metric("summary/comm_exposed_fraction", "fraction", "share of a profiled step's wall time spent in collectives not overlapped with compute (torch.profiler on sampled warm-up steps; mean over ranks; llmeff.comm.sampled says which)", S)
SUM_COMM_BYTES = _metric("summary/comm_bytes_per_step", "bytes", "bus bytes per device per optimizer step: each collective's size x its nccl-tests bus factor (all-reduce 2(n-1)/n, all-gather and reduce-scatter (n-1)/n, broadcast 1), counted on a sampled step, mean over ranks", S)
SUM_J_PER_TOKEN = _metric("summary/j_per_token", "J/token", "measured energy / non-padding tokens (every device measured; else omitted)", S)
SUM_TFLOPS_PER_W = _metric("summary/tflops_per_w", "TFLOP/s/W", "achieved model TFLOP/s per device / average power per measured device over summary/energy_span_s", S)
SUM_KWH_PER_BTOK = _metric("summary/kwh_per_billion_tokens", "kWh/1e9 tokens", "measured energy per 1e9 non-padding tokens", S)
SUM_KG_CO2E_PER_BTOK = _metric("summary/kg_co2e_per_billion_tokens", "kg CO2e/1e9 tokens", "emissions per 1e9 non-padding tokens", S)
SUM_USD_PER_BTOK = _metric("summary/usd_per_billion_tokens", "USD/1e9 tokens", "cost per 1e9 non-padding tokens", S)
SUM_COST_USD = _metric("summary/cost_usd", "USD", "run total cost (all attempts, lost progress included): device_hour_usd x summary/device_hours (+ kWh x usd_per_kwh)", S)
SUM_DEVICE_HOURS = _metric("summary/device_hours", "device-h", "sum over attempts of devices x attempt hours (summary/wall_s less summary/badput_down_s, each attempt at the devices it held; an elastic restart on fewer machines counts fewer)", S)
SUM_ENERGY_KWH = _metric("summary/energy_kwh", "kWh", "run total measured energy (all attempts, every device; omitted when only some devices are measured), over summary/energy_span_s", S)
SUM_ENERGY_COVERAGE = _metric("summary/energy_coverage", "fraction", "measured devices / devices of the run, each physical device (GPU UUID, RAPL zone) once however many ranks own it; below 1 the run totals and per-token energy and carbon figures are omitted, and llmeff.energy.coverage names the unmeasured devices", S)
SUM_ENERGY_SPAN_S = _metric("summary/energy_span_s", "s", "wall seconds the measured energy covers: summary/wall_s less the set-up before the energy meter started (and any tail after the last reading all ranks took); llmeff.energy.span says which", S)
SUM_KG_CO2E = _metric("summary/kg_co2e", "kg CO2e", "run total emissions of the measured energy", S)
SUM_ESTIMATE_KG_CO2E = _metric("summary/estimate_kg_co2e", "kg CO2e", "run total emissions of codecarbon's CPU+RAM estimate (when nothing is measured)", S)
SUM_ESTIMATE_KG_CO2E_PER_BTOK = _metric("summary/estimate_kg_co2e_per_billion_tokens", "kg CO2e/1e9 tokens", "codecarbon-estimate emissions per 1e9 non-padding tokens (when nothing is measured)", S)
SUM_GOODPUT = _metric("summary/goodput", "fraction", "productive step time / wall time (docs/time.md)", S)
BADPUT_CATEGORIES = ("init", "warmup", "compile", "data_wait", "eval", "checkpoint_save", "checkpoint_load",
                     "lost_progress", "other", "down")
_BADPUT_MEANING = {
    "init": "set-up before the first step (process start, model build, run creation, peak measurement)",
    "warmup": "the warm-up steps' excess over steady-state step time (allocator, kernels, FlopCounterMode step); not logged when compiling",
    "compile": "torch.compile's compilations inside steps, timed by torch's compile callbacks (a recompilation after the warm-up included: summary/recompiles counts them), plus the warm-up steps' excess over steady-state step time under torch.compile and the strategy's op builds (DeepSpeed's JIT-compiled C++ ops); logged only when compiling or building",
    "data_wait": "host time blocked on the next batch inside steps",
    "eval": "evaluations (declared pauses)",
    "checkpoint_save": "checkpoint writes (declared pauses)",
    "checkpoint_load": "checkpoint loads (declared pauses)",
    "lost_progress": "time a crashed attempt ran after its last checkpoint (work redone)",
    "other": "time outside steps and declared pauses (after the last step, undeclared pauses)",
    "down": "time no attempt ran: sum over restarts of the next attempt's process start minus the failed attempt's last sign of life (last completed step, heartbeat or exit record); logged with summary/attempts",
}
SUM_BADPUT = {c: _metric(f"summary/badput_{c}_s", "s", _BADPUT_MEANING[c], S) for c in BADPUT_CATEGORIES}
SUM_WALL_S = _metric("summary/wall_s", "s", "wall time of the run, all attempts, init to end: productive time plus every summary/badput_*_s, exactly (docs/time.md)", S)
SUM_TOKENS = _metric("summary/tokens", "tokens", "total non-padding tokens trained on", S)
SUM_STEPS = _metric("summary/steps", "steps", "optimizer steps completed", S)
# how sure the steady-state figures are (docs/stability.md)
SUM_STEP_TIME_P50_S = _metric("summary/step_time_p50_s", "s", "median post-warm-up optimizer-step time", S)
SUM_STEP_TIME_P90_S = _metric("summary/step_time_p90_s", "s", "90th percentile post-warm-up optimizer-step time (linear interpolation)", S)
SUM_STEP_TIME_CV = _metric("summary/step_time_cv", "fraction", "sample standard deviation / mean of the post-warm-up step time", S)
SUM_TPS_CI95_LOW = _metric("summary/tokens_per_sec_ci95_low", "tokens/s", "low end of the 95% interval of summary/tokens_per_sec (delta method with the long-run variance over Geyer's window and Student's t, widened near the minimum of 20 effective steps and absent below it, docs/stability.md)", S)
SUM_TPS_CI95_HIGH = _metric("summary/tokens_per_sec_ci95_high", "tokens/s", "high end of the 95% interval of summary/tokens_per_sec", S)
SUM_STALL_S = _metric("summary/stall_s", "s", "seconds in steps longer than 5x the median step (stalls; kept in the means)", S)
SUM_STALLS = _metric("summary/stalls", "steps", "steps longer than 5x the median step", S)
SUM_RECOMPILES = _metric("summary/recompiles", "count", "torch.compile (re)compilations after the warm-up (dynamo compilations of a frame that started inside a steady step: a new shape, a guard that failed): their time is summary/badput_compile_s, not steady steps; logged when compiling", S)
SUM_HOST_OTHER_CPU = _metric("summary/host_other_cpu_fraction", "fraction", "share of the host's CPU time used by other processes during the steady window (/proc/stat minus the run's processes); the most contended host", S)
SUM_HOST_STEAL = _metric("summary/host_steal_fraction", "fraction", "share of the host's CPU time stolen by the hypervisor during the steady window; the highest host", S)
SUM_STRAGGLER_RATIO = _metric("summary/straggler_ratio", "ratio", "slowest rank's mean compute time per steady step (forward + backward + optimizer, before the collective waits) / the median rank's (>= 1; 2+ ranks); llmeff.straggler.rank names it, its host and phase", S)
SUM_PHASE_STRAGGLER = {p: _metric(f"summary/{p}_straggler_ratio", "ratio", f"slowest rank's mean {p} time per steady step / the median rank's (>= 1; 2+ ranks)", S)
                       for p in ("forward", "backward", "optimizer")}

# ---- reliability across a job's life (attempts of one run; docs/time.md, calc/reliability.py)
SUM_BADPUT_DOWN_S = SUM_BADPUT["down"]  # in BADPUT_CATEGORIES: productive + every badput = wall
SUM_ATTEMPTS = _metric("summary/attempts", "attempts", "process starts of the job (1 = never restarted); logged only where there is a job ledger (llmeff train with checkpoint_dir), else absent with llmeff.reliability.why", S)
SUM_FAILURES = _metric("summary/failures", "failures", "attempts that ended without finishing (exit code, signal, NaN, OOM, lost rank, tracking server, unknown); llmeff.reliability.failures lists them", S)
SUM_PREEMPTIONS = _metric("summary/preemptions", "attempts", "attempts the scheduler preempted with a warning signal (SLURM --signal=USR1@N): each wrote a checkpoint of its last step and ended; not failures (no MTBF, no work redone), their wait until the next attempt is in summary/badput_down_s", S)
SUM_MTBF_S = _metric("summary/mtbf_s", "s", "mean time between failures: operating time (summary/wall_s - summary/badput_down_s) / summary/failures; logged when failures >= 1", S)
SUM_MTBF_CI95_LOW_S = _metric("summary/mtbf_ci95_low_s", "s", "low end of the 95% interval of the MTBF, 2T/chi2(0.975, 2r+2) (time-truncated Poisson; NIST/SEMATECH e-Handbook ch. 8, MIL-HDBK-781A); with 0 failures the only bound logged", S)
SUM_MTBF_CI95_HIGH_S = _metric("summary/mtbf_ci95_high_s", "s", "high end of the 95% interval of the MTBF, 2T/chi2(0.025, 2r); logged when failures >= 1", S)
SUM_RECOVERY_S = _metric("summary/recovery_s", "s", "mean over failures of the time from the failed attempt's last sign of life to the next attempt's first productive step: down + set-up + checkpoint load + re-warm-up", S)
SUM_RECOVERY_DOWN_S = _metric("summary/recovery_down_s", "s", "part of summary/recovery_s: down time (mean over failures)", S)
SUM_RECOVERY_SETUP_S = _metric("summary/recovery_setup_s", "s", "part of summary/recovery_s: the next attempt's set-up before its first step, checkpoint load excluded (mean over failures)", S)
SUM_RECOVERY_LOAD_S = _metric("summary/recovery_load_s", "s", "part of summary/recovery_s: the next attempt's checkpoint load (mean over failures)", S)
SUM_RECOVERY_REWARM_S = _metric("summary/recovery_rewarm_s", "s", "part of summary/recovery_s: the next attempt's warm-up excess (mean over failures)", S)
SUM_FAILURE_COST_S = _metric("summary/failure_cost_s", "s", "sum over failures of recovery time plus lost progress (work redone from the last checkpoint to the last completed step)", S)
SUM_TOR = _metric("summary/tor", "fraction", "training overhead ratio (arXiv 2408.07482): (summary/wall_s - summary/failure_cost_s) / summary/wall_s, optimal over observed time", S)
SUM_SUCCESSFUL_INTERVAL_RATIO = _metric("summary/successful_interval_ratio", "fraction", "checkpoint intervals completed without a retry / checkpoint intervals completed (the successful-epoch ratio over checkpoint intervals)", S)
RELIABILITY_FAILURES = _tag("reliability.failures", "each failure of the job: attempt, cause, step reached, time into the job, checkpoint, steps redone, down, recovery and lost seconds; or 'none in N attempts'")
RELIABILITY = _tag("reliability", "one line of what happened across the job's attempts, e.g. '2 attempts, 1 failure (SIGKILL at step 31), recovery 43 s'; also in the run's description")
RELIABILITY_WHY = _tag("reliability.why", "why a reliability figure is absent (e.g. no failure: no MTBF, only its lower bound)")
# ---- end of reliability block

# --------------------------------------------------------------------------- communication
C = "communication (measured once at start over the run's process group, cached per machine, world size and backend; MLflow step 0)"
COMM_ALLREDUCE_BUSBW = _metric("comm/allreduce_busbw_gbps", "GB/s", "all-reduce bus bandwidth: size / time x 2(n-1)/n (nccl-tests PERFORMANCE.md), 1e9 bytes/s", C)
COMM_ALLGATHER_BUSBW = _metric("comm/allgather_busbw_gbps", "GB/s", "all-gather bus bandwidth: total output size / time x (n-1)/n (nccl-tests), 1e9 bytes/s", C)
COMM_REDUCESCATTER_BUSBW = _metric("comm/reducescatter_busbw_gbps", "GB/s", "reduce-scatter bus bandwidth: total input size / time x (n-1)/n (nccl-tests), 1e9 bytes/s", C)
COMM_BUSBW_UTIL = _metric("comm/busbw_utilization", "fraction", "all-reduce bus bandwidth / the link's peak (llmeff.comm.peak_gbps; across machines the node's aggregate network rate, docs/parallelism.md); never clipped: above 1 llmeff.comm.peak.exceeded says why; absent when the peak is unknown", C)

# --------------------------------------------------------------------------- time to quality
TTQ_SUFFIXES = {
    "wall_s": "wall seconds from training start, eval included (MLPerf timing)",
    "train_s": "training seconds, eval and checkpoint time excluded",
    "tokens": "non-padding tokens trained on",
    "device_hours": "devices x wall hours (each attempt at the devices it held)",
    "kwh": "measured energy",
    "usd": "cost",
    "kg_co2e": "emissions",
}


def target_key(metric: str, op: str, value: str, safe_key: Callable[[str], str]) -> str:
    """Return the key stem of a time-to-quality target, e.g. ``hellaswag_acc_norm_ge_0.30``.

    The stem is ``<metric with / as _>_<ge|le>_<value>`` passed through ``safe_key``
    (:func:`mlflow_llmeff.tracking.keys.safe_key`, given by the caller: this module imports nothing
    of the package), so it is always a key MLflow accepts; for a value
    :func:`mlflow_llmeff.evals.targets.parse_targets` accepted (``0.30``, ``-1.5``, ``1e-3``) it is
    unchanged by that. A value text outside that form is mapped, never dropped (``+9.5`` gives
    ``..._plus_9.5``; ``parse_targets`` writes it ``9.5`` first).

    Args:
        metric: eval key without the ``eval/`` prefix, e.g. ``hellaswag/acc_norm``.
        op: ``">="`` or ``"<="``.
        value: the threshold text, canonical as ``parse_targets`` keeps it in ``Target.text``
            (verbatim but for a dropped ``+``, so ``0.30`` stays ``0.30``).
        safe_key: maps text to a key MLflow accepts, unchanged when MLflow accepts it
            (:func:`mlflow_llmeff.tracking.keys.safe_key`).

    Raises:
        ValueError: for an operator other than ``>=`` / ``<=``.
    """
    ops = {">=": "ge", "<=": "le"}
    if op not in ops:
        raise ValueError(f"target operator {op!r} is not accepted; use '>=' or '<='")
    return safe_key(f"{metric.replace('/', '_')}_{ops[op]}_{value}")


# --------------------------------------------------------------------------- tags
ACCEL_NAME = _tag("accelerator.name", "device name as the driver reports it, e.g. 'NVIDIA H200'; the CPU model on CPU")
ACCEL_SHORT = _tag("accelerator.short", "short name, e.g. 'H200', 'cpu'")
ACCEL_COUNT = _tag("accelerator.count", "devices taking part (world size); on CPU a device is a process")
ACCEL_MEMORY_GIB = _tag("accelerator.memory_gib", "memory per device in GiB (unknown on CPU: 'unknown')")
ACCEL_GENERATION = _tag("accelerator.generation", "Ampere, Hopper, Blackwell, CDNA3, cpu, ...")
NODES = _tag("nodes", "machines taking part")
PROCS_PER_NODE = _tag("processes_per_node", "processes (devices) on each machine")
DRIVER_VERSION = _tag("driver.version", "accelerator driver version ('none' on CPU)")
CUDA_VERSION = _tag("cuda.version", "CUDA runtime torch was built with ('none' on CPU)")
PAR_STRATEGY = _tag("parallelism.strategy", "single, ddp, fsdp, hsdp, tp, fsdp_tp, deepspeed_zero1/2/3 (docs/parallelism.md); megatron from other launchers")
PAR_DP = _tag("parallelism.dp", "data-parallel degree: ranks that see different data (dp_replicate x dp_shard); tokens count over these ranks only; dp x tp x pp x cp = world size")
PAR_DP_SHARD = _tag("parallelism.dp_shard", "data-parallel ranks the model state is sharded over (FSDP, HSDP shard group, ZeRO); 1 = nothing sharded")
PAR_DP_REPLICATE = _tag("parallelism.dp_replicate", "data-parallel replicas whose gradients are all-reduced (DDP ranks, HSDP replicas); dp / dp_shard")
PAR_TP = _tag("parallelism.tp", "tensor-parallel degree")
PAR_PP = _tag("parallelism.pp", "pipeline-parallel degree")
PAR_CP = _tag("parallelism.cp", "context-parallel degree")
COMM_PEAK_GBPS = _tag("comm.peak_gbps", "busbw peak per rank and direction of the link the collectives cross, GB/s (one device's NVLink/PCIe link in a node; across machines the node's aggregate network rate); 'unknown' with the reason in llmeff.comm.peak.source")
COMM_PEAK_SOURCE = _tag("comm.peak.source", "the link and where its rate comes from: NVLink generation, PCIe generation x16, InfiniBand/RoCE adapters (datasheets), the interface toward the head (its tc shaper's rate or sysfs line speed), or the link_peak_gbps option; or 'unknown: <why>'")
COMM_PEAK_EXCEEDED = _tag("comm.peak.exceeded", "set only when comm/busbw_utilization is above 1 (logged as measured, never clipped): the busbw, the peak, and why a peak can be exceeded (a wrong peak or shaper burst; traffic that did not cross the link)")
COMM_PROBE = _tag("comm.probe", "how the collective probe ran (backend, ranks, message size, iterations, measured or cached), or why it did not")
COMM_SAMPLED = _tag("comm.sampled", "which steps were profiled for summary/comm_exposed_fraction and counted for summary/comm_bytes_per_step, or why none")
PRECISION = _tag("precision", "fp32, bf16, fp16, fp8, fp4 (NVFP4/MXFP4 matmuls: MFU against the FP4 peak, llmeff.peak.precision)")
MODEL_NAME = _tag("model.name", "preset name, hub id or local path")
MODEL_PARAMS = _tag("model.params", "total parameters")
MODEL_NON_EMB_PARAMS = _tag("model.non_embedding_params", "parameters minus the input embedding (and learned positions)")
MODEL_LAYERS = _tag("model.layers", "decoder layers")
MODEL_HIDDEN = _tag("model.hidden", "hidden size")
SEQ_LEN = _tag("seq_len", "tokens per sequence: the padded length of a micro-batch (positions); 'dynamic' when it was not the same in every micro-batch (a collator padding each batch to its longest row, packing into rows of varying length), the lengths seen then in llmeff.seq_len.range")
SEQ_LEN_RANGE = _tag("seq_len.range", "'<shortest>-<longest>' padded length of the micro-batches (positions, e.g. '23-25'), set only when llmeff.seq_len is 'dynamic'; a measured condition, not part of a configuration (llmeff compare groups runs by the 'dynamic' alone)")
MICRO_BATCH_SIZE = _tag("micro_batch_size", "sequences (rows) per micro-batch per device; 'dynamic' when it was not the same in every micro-batch (a smaller last micro-batch, a data loader's partial batch, does not count), the sizes seen then in llmeff.micro_batch_size.range")
MICRO_BATCH_SIZE_RANGE = _tag("micro_batch_size.range", "'<smallest>-<largest>' rows per micro-batch (e.g. '4-8'), set only when llmeff.micro_batch_size is 'dynamic'; a measured condition, not part of a configuration")
GRAD_ACCUM = _tag("grad_accum", "micro-batches per optimizer step")
GLOBAL_BATCH_TOKENS = _tag("global_batch_tokens", "seq_len x micro_batch_size x grad_accum x data-parallel degree (positions, padding included); 'dynamic' when seq_len or micro_batch_size is: a run name then has no gbt (nor, for seq_len, s) part")
#: The value of llmeff.seq_len, llmeff.micro_batch_size and llmeff.global_batch_tokens when the batch
#: shape varied between micro-batches (docs/autolog.md, "Batch shape and run name: dynamic padding and packing").
SHAPE_DYNAMIC = "dynamic"
OPTIMIZER = _tag("optimizer", "the optimizer: its class and module, the dtype its states are stored in (read from the states, e.g. 'int8 codes + fp32 scales'), and where it came from (llmeff train --optimizer NAME, transformers Trainer optim=NAME, the user's loop); set at the first logged point after the states exist, else at the end ('states not yet allocated'); part of a configuration")
ATTENTION = _tag("attention", "the attention kernel the model runs, read back from the built model (config._attn_implementation): sdpa, eager, flash_attention_2, flash_attention_3, flex_attention; 'unknown: <why>' where the model does not say; part of a configuration")
WEIGHTS = _tag("weights", "how the trained weights are held: 'fp32' (fp32 weights; with bf16/fp16 precision they are the master copy of mixed precision) or 'bf16' (pure bf16 weights, no fp32 master copy); part of a configuration")
MEMORY_CAPACITY = _tag("memory.capacity", "what summary/memory/peak_fraction divides by and where it comes from: CUDA total memory, the cgroup v2/v1 memory limit, or the host's memory")
MEMORY_SNAPSHOT = _tag("memory.snapshot", "on a CUDA out-of-memory failure: the artifact path of torch's memory snapshot (torch.cuda.memory._dump_snapshot, open it at pytorch.org/memory_viz; the allocator's history is recorded from the monitor's start without stacks, LLMEFF_MEMORY_HISTORY=stacks adds Python stacks, =0 records none) and the largest term of the peak, or why none was written")
LOSS_WEIGHTING = _tag("loss.weighting", "how a step's loss weighs its micro-batches: 'token-weighted: ...' (llmeff train; transformers' Trainer where it passes num_items_in_batch: a model whose forward takes loss kwargs, and across devices with average_tokens_across_devices), 'mean of micro-batch means: ...' (a Trainer whose model takes no loss kwargs), or 'unknown: ...' (a user's loop computes its own loss); docs/formulas.md, 'Gradient accumulation: one token-weighted loss'")
THREADS = _tag("threads", "torch's CPU threads in each process: 'intra-op N, inter-op M' (torch.get_num_threads, torch.get_num_interop_threads, as OMP_NUM_THREADS / MKL_NUM_THREADS set them); part of a configuration: a CPU process's speed moves with it, so llmeff compare computes no scaling efficiency between configurations that differ in it")
CPU_AFFINITY = _tag("cpu.affinity", "CPUs this process may run on (os.sched_getaffinity) out of the host's (os.cpu_count), e.g. '2 of 2'; part of a configuration")
ACT_CKPT = _tag("activation_checkpointing", "true / false")
COMPILE = _tag("compile", "torch.compile used: true / false")
FLOPS_FORMULA = _tag("flops.formula", "FLOPs-per-token convention and its source")
FLOPS_TRAINABLE = _tag("flops.trainable", "what the FLOPs per token count as trained: the trainable share of parameters (requires_grad, adapters included), the LoRA rank and targets if any, frozen embedding / LM head, and the formula's source (forward 2 FLOPs per weight, input gradient 2 above the lowest trainable weight, weight gradient 2 per trainable weight, adapter matmuls added: docs/formulas.md, NeMo Automodel PR #786, VeOmni PR #983, Hu et al. 2021); llmeff.flops.method carries it too")
FLOPS_METHOD = _tag("flops.method", "how FLOPs per token were obtained: 'formula: ...' (the config's own fields, docs/formulas.md), 'meta_count: ...' (FlopCounterMode over one forward+backward of the model built on the meta device, for a model type the formula does not know), or 'none: <why>' (no model FLOPs, TFLOP/s, MFU or HFU logged)")
PEAK_TFLOPS = _tag("peak.tflops", "dense peak TFLOP/s per device for the compute dtype")
PEAK_SOURCE = _tag("peak.source", "datasheet of the peak, 'user' or 'unknown' with the reason")
PEAK_MEASURED_TFLOPS = _tag("peak.measured_tflops", "measured achievable matmul TFLOP/s (MAMF) on this device")
PEAK_MEASURED_AT = _tag("peak.measured_at", "when and on what that peak was measured: `<local ISO time> (measured in this run: <key>)` or `(read from the cache: <key>)`, the key naming the device, the CPU's threads (a CPU figure moves with `OMP_NUM_THREADS`), the dtype and torch; `llmeff peak --json` gives `from_cache`, `measured_at`, `measured_on`; absent when no peak was measured")
HFU_METHOD = _tag("hfu.method", "how hardware FLOPs per step were counted (FlopCounterMode step, analytic attention), or why not")
MFU_WARNING = _tag("mfu.warning", "set when MFU came out above 1 (an error in the inputs)")
ENERGY_SOURCE = _tag("energy.source", "nvml_counter, nvml_power, rapl, codecarbon_estimate, none")
ENERGY_WHY = _tag("energy.why", "why energy is absent or only estimated")
ENERGY_COVERAGE = _tag("energy.coverage", "'<measured>/<devices> devices measured', the unmeasured devices and why, what is omitted because of them, and GPUs several ranks own (counted once)")
ENERGY_SPAN = _tag("energy.span", "which part of summary/wall_s energy/* and carbon/* cover (set-up before the energy meter started is not measured) and that cost/* covers all of it; the job's summary/badput_down_s (time between attempts) is neither measured nor priced")
CARBON_INTENSITY = _tag("carbon.intensity_g_per_kwh", "grid carbon intensity codecarbon used")
CARBON_SOURCE = _tag("carbon.source", "where the carbon figure comes from, or why it is absent")
COST_DEVICE_HOUR_USD = _tag("cost.device_hour_usd", "price per device-hour assumed")
COST_SOURCE = _tag("cost.source", "where the price comes from (user, or the dated default table)")
COST_USD_PER_KWH = _tag("cost.usd_per_kwh", "energy price assumed, USD/kWh ('none': energy not priced)")
CARBON_ENERGY_BASIS = _tag("carbon.energy_basis", "which energy carbon/total_kg_co2e covers (measured energy and its source)")
CARBON_ESTIMATE_METHOD = _tag("carbon.estimate_method", "how codecarbon estimated CPU/RAM energy (energy/estimate/*), or why not")
WARMUP_STEPS = _tag("warmup_steps", "optimizer steps excluded from steady-state figures")
WARMUP_NOTE = _tag("warmup.excluded", "what the warm-up exclusion covers (compile, allocator, first steps)")
MEMORY_SOURCE = _tag("memory.source", "torch.cuda allocator statistics, or process RSS on CPU")
DATASET = _tag("dataset", "the training data: a local file or directory by its absolute path with links resolved (one file given by two relative paths is one condition), else the hub id, 'python-docs' or 'synthetic'")
DATASET_KIND = _tag("dataset.kind", "text_file, text_dir, jsonl, hub, synthetic (random tokens, not text)")
TOKENIZER = _tag("tokenizer", "tokenizer used")
V_TORCH = _tag("version.torch", "torch version")
V_TRANSFORMERS = _tag("version.transformers", "transformers version")
V_ACCELERATE = _tag("version.accelerate", "accelerate version")
V_MLFLOW = _tag("version.mlflow", "mlflow version")
V_LLMEFF = _tag("version.mlflow_llmeff", "mlflow_llmeff version")
V_PYTHON = _tag("version.python", "Python version")
GIT_COMMIT = _tag("git.commit", "git commit of the training code, where known")
RESUMED_FROM = _tag("resume.from_step", "optimizer step the last attempt resumed from")
RESUME_ATTEMPTS = _tag("resume.attempts", "number of attempts (1 = never resumed)")
RESUME_CONTINUED_IN = _tag("resume.continued_in_run", "on a launcher's run that a resume redirected: the run the training continued in")
DRY_RUN = _tag("dry_run", "'true' on a run that only planned (plan/* metrics), no training")
PLAN_FIT = _tag("plan.fit", "the dry run's memory verdict: fits / does not fit, the need, the room, what would fit")
ERROR = _tag("error", "one line: why the run failed (bad input, the memory fit check, or the error that stopped it); also the run's description")
SCHEDULER_NAME = _tag("scheduler.name", "the scheduler the run's processes started under: slurm, ray (a Ray Train worker), kubeflow-trainer (a Kubeflow Trainer v2 TrainJob's node), kubernetes (a PyTorchJob's PET_* variables) or torchrun (the same outside Kubernetes); absent outside one (meters/schedulers/)")
SCHEDULER_JOB_ID = _tag("scheduler.job_id", "the scheduler's job id (SLURM_JOB_ID; a TrainJob's name; Ray Train's run name, RunConfig(name=...)); the same across requeues and restarts of the job")
SCHEDULER_WORLD_SIZE = _tag("scheduler.world_size", "processes the scheduler started and joined in one process group itself (Ray Train's world size); absent where llmeff or torchrun starts them")
SCHEDULER_NODES = _tag("scheduler.nodes", "nodes of the scheduler's job (SLURM_JOB_NUM_NODES; PET_NNODES)")
SCHEDULER_NODE_LIST = _tag("scheduler.node_list", "the job's nodes as the scheduler writes them (SLURM_JOB_NODELIST, e.g. 'gpu-[01-04]')")
SCHEDULER_RESTART_COUNT = _tag("scheduler.restart_count", "how often the scheduler requeued the job before this attempt (SLURM_RESTART_COUNT; 0: never)")
SCHEDULER_PARTITION = _tag("scheduler.partition", "the SLURM partition (SLURM_JOB_PARTITION)")
SCHEDULER_QUEUE_WAIT_S = _tag("scheduler.queue_wait_s", "seconds this attempt's job waited in the queue, StartTime - SubmitTime of scontrol show job (whole seconds; after a requeue the requeued wait, which is also inside summary/badput_down_s: down time runs from the previous attempt's last sign of life to this attempt's process start)")
RESUME_DEVICES = _tag("resume.devices", "set when the job's attempts held different numbers of devices (an elastic restart on fewer machines): the counts, e.g. '2, 1', and that summary/device_hours, cost and every per-device figure count each attempt's time at its own devices (llmeff.accelerator.count is the last attempt's)")
RESUME_CHANGED = _tag("resume.changed_params", "params passed with new values on resume (not re-logged)")
AUTOLOG_INTEGRATION = _tag("autolog.integration", "what produced the metrics: trainer, accelerate, pytorch (mlflow_llmeff.autolog) or monitor (EfficiencyMonitor)")
AUTOLOG_NOTE = _tag("autolog.note", "set when autolog/EfficiencyMonitor left something out of the totals, and why")
LOGGING_WARNINGS = _tag("logging.warnings", "what the logger changed to get entries past MLflow's rules (keys renamed, values shortened or dropped) and entries MLflow still rejected; '; '-separated, de-duplicated, at most 8000 characters")
EVAL_BATCH_SIZE = _tag("eval.batch_size", "sequences per forward pass of in-training evals (validation loss, benchmarks); set when the run evaluates")
EVAL_NUM_FEWSHOT = _tag("eval.num_fewshot", "MMLU few-shot examples of in-training benchmark evals; set when the run scores benchmarks")
EVAL_LAST = _tag("eval.last", "set by llmeff eval --run-id: what the run's last eval points are (tasks, documents, few-shot) and their step; they are the eval columns of comparisons")
EVAL_DOCUMENTS = _tag("eval.documents", "documents each in-training benchmark eval scores per task: 'all', or 'N drawn with seed S' (llmeff eval --limit N --subset-seed S scores the same); set when the run scores benchmarks")
REPORT_WARNING = _tag("report.warning", "why the end-of-run efficiency report (efficiency_report.json, figures) is missing or incomplete")
OUTBOX_LOCAL_ID = _tag("outbox.local_run_id", "on a run created through a tracking server: the id (local-<32 hex>) the training process gave it before the server answered; a run created late from the outbox (the server did not answer when training started) had only this id until then, printed by the training process and named in its outbox file; a creation that outlived its wait is found by it, not made twice")
COMPARE_RUN_IDS = _tag("compare.run_ids", "on a comparison run (llmeff compare --log-to-mlflow): the compared run ids, comma-separated, "
                       "whole ids only; past MLflow's 8,000-character tag value it begins '<k> of <n> run ids (all in "
                       "artifact run_ids.txt): '")
COMPARE_EXPERIMENT = _tag("compare.experiment", "on a comparison run: the compared experiment's name")
COMPARE_FILTER = _tag("compare.filter", "on a comparison run: the MLflow search filter used ('' = all runs)")
STUDY = _tag("study", "on a study's parent run (llmeff study, train/study.py): '<k> configurations x <n> repeats, "
             "round-robin' ('seeds' with --seeds; ', each to <target> or its step cap' with --target); its children (mlflow.parentRunId) are the training runs, it has no summary figures "
             "itself, and comparisons (llmeff compare, the efficiency page) leave it out")
STUDY_CONFIG = _tag("study.config", "on a study's child run: which of the study's configurations it is, 1..k in the "
                    "order of --config (the parent's params config_<i> hold each one's options)")
STUDY_REPEAT = _tag("study.repeat", "on a study's child run: its repeat of its configuration, 1..n (the study ran "
                    "every configuration's repeat i before any repeat i+1)")
STUDY_TARGET = _tag("study.target", "on a study's parent and children run to a quality target (llmeff study --target): the "
                    "target, e.g. 'val_loss<=3.0'; each child ran to it or to its step cap (max_steps, stop_at_targets "
                    "true), and comparisons score the configuration's runs as MLPerf Training does (docs/compare.md)")
MLLOG = _tag("mllog", "on a run trained to a target in a study: 'mllog/result_<seed>.txt: ...', its MLPerf-style result "
             "log (mlperf-logging; checked against the rules every MLPerf Training 6.0.0 benchmark shares, not an "
             "MLPerf submission) and its run_stop status (success: reached; aborted: not), or 'not written: <why>'")
WALL_VS_DURATION = _tag("wall.vs_duration", "why MLflow's Duration and summary/wall_s differ: where each starts and ends (set-up before the run's creation, the end-of-run report, attempts of a resumed run)")
STABILITY = _tag("stability", "'stable', or 'unstable: <why>' naming each figure past its threshold (p90/p50 step time, stalls, interval width, too few steps); docs/stability.md")
SUMMARY_ABSENT = _tag("summary.absent", "summary/* figures that are undefined for this run and so not logged (never as 0 or 1), each '<key>: <why>' (keys with one why named together, comma-separated), joined by '; ' (e.g. summary/step_time_cv of a single steady step; the FLOPs figures when sequence lengths are unknown); comparisons name a repeat left out of a figure with this why")
COUNTING_REFILLED = _tag("counting.refilled", "set when some CPU micro-batches, kept to be counted at their window's edge (the meter's cheaper path), had their tensors written in place before that edge: how many, counted as the tensors then were; the meter then counts every batch at once (a loop refilling the first batch's own tensors is counted at once from its second micro-batch); absent when none was")
INTERVAL_ABSENT = _tag("interval.absent", "interval metrics left out because a count they rest on was not given (never logged as 0 or as a default), in the form of llmeff.summary.absent: train/padded_tokens ('padded positions unknown'), train/loss_tokens ('loss-bearing tokens unknown'), throughput/samples_per_sec ('sequences unknown'), throughput/device/model_tflops_per_sec, mfu and hfu ('sequence lengths unknown'), each with what was missing; system/device/throttled and other_processes when NVML could not read some device's clocks-event reasons or processes, system/host_other_cpu_fraction when the run's own CPU time could not be read; set when first left out, absent when every input was known")
ASSUMED = _tag("assumed", "what the program assumed for the user where an input was not given or is ambiguous, each '<input>: <value> (<why>)', joined by '; ': a price from the dated default table, the default grid country (USA), PUE 1, a precision read off the parameters' dtype; llmeff plan: an accelerator alias taken, auto precision on another machine (also the plan's --json field 'assumed'); absent when nothing was assumed")
STABILITY_METHOD = _tag("stability.method", "the stall and instability thresholds and the interval method behind llmeff.stability and summary/tokens_per_sec_ci95_*")
CONTENTION = _tag("contention", "what else used the machine during the steady window: 'quiet: ...' or 'contended: ...' with the other processes' share of host CPU (the top ones named), steal, and on CUDA other processes on the run's devices, slowdown reasons, lowest SM clock, temperature, power limit; 'throttle: unknown (NVML could not read the clocks-event reasons of <devices>)' where none could be read, 'throttle: <reasons or none> on <devices>; unknown on the others (...)' where some could not, and likewise 'other processes unknown (...)'")
STRAGGLER_RANK = _tag("straggler.rank", "the rank with the largest mean compute time per steady step, its host and the phase (forward, backward, optimizer) with the most time above that phase's median rank, e.g. 'rank 1 on host node-1: backward 2.3x the median rank (...)', and its collective wait beside the median rank's")
MACHINE_JOB_RUN = _tag("machine.job_run", "on a run a launcher made on machine_rank > 0 of a multi-machine job (mlflow run on each machine): the job's run, where rank 0 logs every figure; such a run logs nothing, is nested under the job's run (mlflow.parentRunId) and left out of llmeff compare")
MACHINE_RUNS = _tag("machine_runs", "on a multi-machine job's run: the runs the other machines' launchers made (mlflow run on each machine), marked as parts of this run, each 'machine R (host): run ID'")
DATA_WAIT_RANKS = _tag("data_wait.ranks", "each rank's data wait (host time blocked on the next batch, inside steps) as a share of its step seconds and in seconds, and the rank that waited most when they differ, e.g. 'rank 1 waited most: 0.31 of its step time; rank 0 0.05 (1 s), rank 1 0.31 (6.2 s)'; summary/badput_data_wait_s is rank 0's (2+ ranks)")
HOSTS = _tag("hosts", "each host of the run: its ranks, their mean compute time per steady step with its phases (forward, backward, optimizer) and their collective wait (step time minus compute), ms/step")
# --------------------------------------------------------------------------- setups that change the counting
# (docs/formulas.md, "Setups that change the counting": FP8 and other precisions whose peak differs)
SUM_MFU_BF16_PEAK = _metric("summary/mfu_bf16_peak", "fraction", "steady-state MFU against the device's dense BF16 peak whatever the compute dtype (beside summary/mfu, whose denominator llmeff.peak.precision names), so FP8 and BF16 runs compare on one scale", S)
FLOPS_COUNTER_GAP = _tag("flops.counter_gap", "set when FlopCounterMode's count of a real step came out below the formula's hardware FLOPs: the share it counted and the modules it could not see (custom ops, fused expert kernels); HFU then uses the analytic ratio, never the lower count")
PRECISION_SOURCE = _tag("precision.source", "where llmeff.precision comes from: 'option' (given), 'parameters' (read off the "
                        "weights' dtype), or 'modules: <n> of <m> Linear layers are <class>' when FP8 layers were found "
                        "in the model (torchao Float8Linear; TransformerEngine Linear, LayerNormLinear, "
                        "LayerNormMLP or TransformerLayer running FP8), which win over the option")
PEAK_PRECISION = _tag("peak.precision", "the dtype whose dense peak is MFU's denominator (the dtype the matmuls ran in: fp8, bf16, fp16, tf32, fp32); set where a peak is known")

TTQ_TAG_PREFIX = "llmeff.ttq."

EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
EXPERIMENT_KIND_VALUE = "custom_model_development"


def shorten(text: str, limit: int) -> str:
    """``text`` whole when it fits in ``limit`` characters; else cut at a word boundary and marked.

    The cut text ends ``... <last whole word> … (<N> more characters)``, ``N`` the characters left
    out, and is at most ``limit`` characters long. It is cut at the last space within the room left,
    or mid-word only when the room holds no space in its second half (a path, a hash). Used wherever
    an error or a tag is cut to fit a line or MLflow's limits, so a reader sees that it was cut and
    by how much.

    Args:
        text: any text.
        limit: the most characters to return, >= 1.

    Raises:
        ValueError: for a ``limit`` below 1.
    """
    if limit < 1:
        raise ValueError(f"limit={limit!r} is not accepted; give at least 1 character")
    if len(text) <= limit:
        return text
    room = limit - len(f" \u2026 ({len(text):,} more characters)")
    if room < 1:
        return text[:limit]
    space = text.rfind(" ", 0, room + 1)
    cut = space if space >= room // 2 else room
    head = text[:cut].rstrip()
    return f"{head} \u2026 ({len(text) - len(head):,} more characters)"


def render_docs() -> str:
    """Return ``docs/metrics.md`` as Markdown generated from the constants above."""
    out = [
        "# Metric and tag keys",
        "",
        "Generated from `mlflow_llmeff/names.py` by `python -m mlflow_llmeff.names > docs/metrics.md`;",
        "do not edit by hand. Counting rules, formulas and their sources: `docs/formulas.md`; how sure",
        "a figure is: `docs/stability.md`; how time is accounted: `docs/time.md`.",
        "",
    ]
    groups: dict[str, list[KeyDoc]] = {}
    for d in METRICS:
        groups.setdefault(d.group, []).append(d)
    for group, docs in groups.items():
        out += [f"## Metrics: {group}", "", "| key | unit | meaning |", "| --- | --- | --- |"]
        out += [f"| `{d.key}` | {d.unit} | {d.meaning} |" for d in docs]
        out.append("")
    out += ["## Time-to-quality metrics", "",
            "For each target `metric>=value` / `metric<=value` the stem is `<metric with / as _>_<ge|le>_<value>`,",
            "e.g. `hellaswag_acc_norm_ge_0.30`; a target never reached is the tag `llmeff.ttq.<stem>=not_reached`.", "",
            "| key | meaning |", "| --- | --- |"]
    out += [f"| `ttq/<stem>_{s}` | {m} |" for s, m in TTQ_SUFFIXES.items()]
    out += ["", "## Tags (strings)", "", "| key | meaning |", "| --- | --- |"]
    out += [f"| `{d.key}` | {d.meaning} |" for d in TAGS]
    out += ["", f"Experiments the plugin creates get `{EXPERIMENT_KIND_TAG}={EXPERIMENT_KIND_VALUE}`.", ""]
    return "\n".join(out)


if __name__ == "__main__":  # pragma: no cover
    print(render_docs(), end="")
