"""The monitor's view of what else used the machine: samples of :mod:`mlflow_llmeff.meters.contention` taken
at the monitor's window edges and reduced over ranks.

The steady window starts at the end of warm-up (:meth:`ContentionMeter.begin`) and ends at the
run's end (:meth:`ContentionMeter.finish`); :meth:`ContentionMeter.interval` gives the
``system/*`` interval metrics between logged steps. Every rank samples its own process tree (and
its own CUDA devices); the host's ``/proc/stat`` and the list of every process on it are read by
local rank 0 only; the calls with ``collective=True`` are collectives (every rank, same order).
Nothing here raises into training: a source that cannot be read leaves its figure out and the tag
says why.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import time
from typing import Any, Callable, Mapping

from mlflow_llmeff.meters import collectives
from mlflow_llmeff.meters import contention as ct

#: Seconds between scans for our process tree's members (DataLoader workers, compile workers).
TREE_REFRESH_S = 10.0
#: The least time between two interval readings, s (besides their :data:`~mlflow_llmeff.meters.contention.MIN_WINDOW_TICKS`:
#: a 96-core host counts 100 ticks in ~10 ms, so ticks alone would read at every logged step). The GPU
#: conditions are sampled once a second (``gpu_period_s``), so a reading a second gives every sample.
MIN_INTERVAL_S = 1.0
#: Why ``system/device/throttled`` is absent from an interval (``llmeff.interval.absent``): no slowdown
#: was read, and some device's reasons could not be (a 0 would say "not throttled"; ``llmeff.contention``
#: names the devices).
THROTTLE_UNKNOWN = ("NVML could not read some device's clocks-event reasons and none it read was a slowdown "
                    "(llmeff.contention names the devices)")
#: Why the host's other share is absent: psutil could not read the CPU time of this run's processes, so the
#: busy time that is not theirs is unknown (taking it as 0 s would call the run's own CPU time others').
OWN_UNKNOWN = "the CPU time of the run's own processes could not be read (psutil)"
#: Why ``system/device/other_processes`` is absent: none seen, and some device's processes could not be listed.
OTHERS_UNKNOWN = ("NVML could not list some device's processes (or listed pids of another PID namespace) and "
                  "none it listed was another's (llmeff.contention names the devices)")

__all__ = ["ContentionMeter"]

log = logging.getLogger(__name__)


class ContentionMeter:
    """Host CPU and CUDA-device conditions over a run's steady window.

    Args:
        device: the run's torch device (CUDA devices are read through NVML), or None.
        env: environment (``LOCAL_RANK``); default ``os.environ``.
        nvml: a ``pynvml`` module to use (tests pass :func:`mlflow_llmeff.testing.fake_nvml`);
            default: imported when the device is CUDA.
        gpu_devices: ``(uuid, handle)`` of this process's devices (default: resolved like the
            energy meter: by UUID / PCI bus id through ``CUDA_VISIBLE_DEVICES``).
        proc_stat: path of ``/proc/stat``.
        clock: monotonic seconds (window lengths for the top-process shares).
        gpu_period_s: seconds between background NVML samples (None: at edges only).
        pid: the process whose tree is ours (default: this one).
        host: host name (default ``socket.gethostname()``).
    """

    def __init__(self, *, device=None, env: Mapping[str, str] | None = None, nvml: Any = None,
                 gpu_devices: list[tuple[str, Any]] | None = None, proc_stat: str = "/proc/stat",
                 clock: Callable[[], float] = time.monotonic, gpu_period_s: float | None = 1.0,
                 pid: int | None = None, host: str | None = None) -> None:
        env = os.environ if env is None else env
        self._lr0 = (env.get("LOCAL_RANK", "0") or "0") == "0"
        self._host = host or socket.gethostname()
        self._proc_stat, self._clock, self._pid = proc_stat, clock, pid
        self._begun = False
        self._procs: list = []
        self._tree_at: float | None = None
        self._gpu: ct.GpuConditions | None = None
        self.gpu_why: str | None = None
        self.absent_why: str | None = None  # why the host shares are absent (llmeff.summary.absent)
        self.interval_why: dict[str, str] = {}  # system/* keys the last interval left out, and why
        # the interval readings' schedule (:meth:`interval`): calls since the host shares were last given,
        # and calls still to skip before the next reading; the same on every rank (set from reduced figures)
        self._calls, self._skip, self._last_skip = 0, 0, 0
        if nvml is not None or (device is not None and getattr(device, "type", None) == "cuda"):
            self._gpu = self._open_gpu(device, env, nvml, gpu_devices, gpu_period_s)

    def _open_gpu(self, device, env, nvml, gpu_devices, period) -> ct.GpuConditions | None:
        try:
            if nvml is None:
                import pynvml as nvml  # nvidia-ml-py

                nvml.nvmlInit()
            if gpu_devices is None:
                from mlflow_llmeff.meters.energy import _torch_cuda_ids, resolve_nvml_devices

                idx = [device.index or 0] if device is not None and device.index is not None else [0]
                _, ids = _torch_cuda_ids(env)
                gpu_devices = resolve_nvml_devices(nvml, idx, visible_devices=env.get("CUDA_VISIBLE_DEVICES"),
                                                   torch_ids=ids)
            return ct.GpuConditions(nvml, gpu_devices, period_s=period)
        except Exception as e:  # noqa: BLE001 - no NVML: the tag says so, training goes on
            self.gpu_why = f"device conditions not read: {type(e).__name__}: {e}"
            return None

    # ------------------------------------------------------------------------------ readings
    def _host_reading(self) -> ct.HostCpu | None:
        return ct.read_host_cpu(self._proc_stat) if self._lr0 else None

    def _own_s(self, fresh: bool = False) -> float | None:
        """CPU seconds of our process tree (None when psutil cannot read it: the host's other share is
        then unknown, not all of the busy time). The tree itself (a scan of every process on the host,
        ~7 ms on a busy one: a third of a small model's step) is found again at most every
        :data:`TREE_REFRESH_S` and at the window's start and end (``fresh``); in between, the known
        processes are read. A worker started meanwhile joins at the next scan with all its CPU
        time, so the window's figures are whole and only an interval's split can lag."""
        try:
            now = self._clock()
            if fresh or self._tree_at is None or now - self._tree_at >= TREE_REFRESH_S:
                self._procs, self._tree_at = ct.own_tree(self._pid), now
            return ct.own_tree_cpu_s(procs=self._procs)
        except Exception:  # noqa: BLE001
            return None

    def _pids(self) -> list[int]:
        try:
            return ct.own_tree_pids(self._pid)
        except Exception:  # noqa: BLE001
            return [self._pid or os.getpid()]

    def begin(self, collective: bool = True) -> None:
        """The steady window starts now (a collective with ``collective``)."""
        try:
            self._t0 = self._last_t = self._clock()
            self._host0 = self._last_host = self._host_reading()
            self._own0 = self._last_own = self._own_s(fresh=True)
            self._procs0 = ct.process_cpu_snapshot() if self._lr0 else {}
            mine = (self._host, self._pids())
            everyone = collectives.all_gather_object(mine) if collective else [mine]
            self._pids0 = {p for h, pids in everyone if h == self._host for p in pids}
            if self._gpu is not None:
                self._gpu.own_pids = set(self._pids0)
                self._gpu.begin()
            self._begun = True
        except Exception as e:  # noqa: BLE001
            log.debug("contention window not started: %s", e)

    def interval(self, collective: bool = True) -> dict[str, float]:
        """The ``system/*`` metrics since the last reading (a collective with ``collective``, on the calls
        that read).

        A host share is given over an interval of at least :data:`~mlflow_llmeff.meters.contention.MIN_WINDOW_TICKS`
        ``/proc/stat`` ticks (all hosts together), the summary's rule for 1% resolution: a share of fewer
        ticks is not given, and its ticks are carried into the next reading. Calls that could not reach
        that many ticks, or :data:`MIN_INTERVAL_S` after the last given reading, are not read at all:
        after each reading the next is set ``max(ceil(ticks left / ticks per call), ceil(seconds left /
        seconds per call))`` calls later (at most twice the last skip plus one, so that a short first
        interval cannot misplace it), from the reduced tick count and the longest rank's seconds, so
        every rank skips the same calls (no collective there) and the reading's own cost
        (``/proc/stat``, the process tree's CPU time, NVML, a collective: ~150-400 us on a 2-core host
        right after a step, ``bench/overhead.py``) is paid at most once a second and once per 100
        ticks, not at every logged step. A skipped call returns ``{}``."""
        from mlflow_llmeff import names

        if not self._begun:
            return {}
        self.interval_why = {}
        self._calls += 1
        if self._skip > 0:  # too soon after the last reading (ticks or seconds): not read
            self._skip -= 1
            return {}
        now = self._clock()
        host, own = self._host_reading(), self._own_s()
        own_unknown = own is None or self._last_own is None
        d_own = 0.0 if own_unknown else own - self._last_own
        h0 = self._last_host
        d = [host.busy - h0.busy, host.total - h0.total, host.steal - h0.steal] if host and h0 else [0, 0, 0]
        gpu = self._gpu_interval()
        local = [d_own, *map(float, d), *gpu, float(own_unknown), now - self._last_t]
        if collective:
            sums = collectives.all_reduce(local[:4])
            maxes = collectives.all_reduce(local[4:], op="max")
            local = sums + maxes
        out: dict[str, float] = {}
        d_own, busy, total, steal = local[:4]
        elapsed = local[-1]  # seconds since the baselines (the longest rank's: the same schedule everywhere)
        given = total >= ct.MIN_WINDOW_TICKS
        if given:  # the baselines move on; a shorter interval's ticks are carried into the next reading
            self._last_host, self._last_own, self._last_t = host, own, now
            hz = float(os.sysconf("SC_CLK_TCK"))
            out[names.SYS_HOST_STEAL] = min(1.0, max(0.0, steal / total))
            if local[-2]:  # some rank's own CPU time unread: the rest of the busy time is not all others'
                self.interval_why[names.SYS_HOST_OTHER_CPU] = OWN_UNKNOWN
            else:
                out[names.SYS_HOST_OTHER_CPU] = min(1.0, max(0.0, (busy - d_own * hz) / total))
        if total > 0:  # the next reading: the first call where both the ticks and the seconds should be reached
            calls = self._calls  # since the baselines
            ticks_left = ct.MIN_WINDOW_TICKS - (0.0 if given else total)
            s_left = MIN_INTERVAL_S - (0.0 if given else elapsed)
            need = max(math.ceil(ticks_left / (total / calls)),
                       math.ceil(s_left / (elapsed / calls)) if elapsed > 0 else 1)
            # at most twice the last skip plus one: an estimate from a short first interval (1 tick in one
            # call) cannot put the next reading far off; the skips grow 1, 3, 7, ... to what is needed
            self._skip = self._last_skip = max(0, min(need - 1, 2 * self._last_skip + 1))
            if given:
                self._calls = 0
        if self._gpu is not None or collective:
            samples, neg_clock, neg_frac, temp, others, throttled, others_unknown, throttle_unknown = local[4:-2]
            if samples > 0:
                if neg_clock > -1e17:
                    out[names.SYS_DEV_SM_CLOCK] = -neg_clock
                if neg_frac > -1e17:
                    out[names.SYS_DEV_SM_CLOCK_FRAC] = -neg_frac
                if temp > -1e17:
                    out[names.SYS_DEV_TEMP] = temp
                # a count or a 0 is only what NVML could read: an unread device may hold the rest
                if others or not others_unknown:
                    out[names.SYS_DEV_OTHER_PROCS] = others
                else:
                    self.interval_why[names.SYS_DEV_OTHER_PROCS] = OTHERS_UNKNOWN
                if throttled or not throttle_unknown:
                    out[names.SYS_DEV_THROTTLED] = throttled
                else:
                    self.interval_why[names.SYS_DEV_THROTTLED] = THROTTLE_UNKNOWN
        return out

    def _gpu_interval(self) -> list[float]:
        """``[samples, -min clock, -min clock fraction, max temperature, other processes, throttled,
        other processes unknown, throttle unknown]`` (negated minima so that one max-reduction serves
        all; -1e18 = unknown; the last two 1 when some device's processes / clocks-event reasons
        could not be read)."""
        none = -1e18
        if self._gpu is None:
            return [0.0, none, none, none, 0.0, 0.0, 0.0, 0.0]
        try:
            self._gpu.sample()
            a = self._gpu.take_interval()
        except Exception:  # noqa: BLE001
            return [0.0, none, none, none, 0.0, 0.0, 0.0, 0.0]
        return [float(a["samples"]), -a["min_clock_mhz"] if a["min_clock_mhz"] is not None else none,
                -a["min_clock_frac"] if a["min_clock_frac"] is not None else none,
                a["max_temp_c"] if a["max_temp_c"] is not None else none, float(len(a["others"])),
                1.0 if a["throttle"] & ~ct.BENIGN_THROTTLE else 0.0,
                1.0 if a["procs_unread"] or not a["pids_visible"] else 0.0, 1.0 if a["throttle_unread"] else 0.0]

    # ------------------------------------------------------------------------------ the end
    def finish(self, collective: bool = True) -> tuple[dict[str, float], dict[str, str]]:
        """``(summary metrics, tags)`` of the steady window (a collective with ``collective``).

        Rank 0's return is the run's; other ranks get ``({}, {})``.
        """
        from mlflow_llmeff import names

        if not self._begun:
            return {}, {names.CONTENTION: "unknown: no steady-state window (all steps were warm-up)"}
        own = self._own_s(fresh=True)
        rec = {"host": self._host, "lr0": self._lr0,
               "own_s": own - self._own0 if own is not None and self._own0 is not None else None,
               "pids": self._pids(), "window_s": self._clock() - self._t0}
        if self._lr0:
            rec["h0"], rec["h1"] = self._host0, self._host_reading()
            try:
                rec["procs0"], rec["procs1"] = self._procs0, ct.process_cpu_snapshot()
            except Exception:  # noqa: BLE001
                rec["procs0"] = rec["procs1"] = {}
        if self._gpu is not None:
            try:
                self._gpu.sample()
                rec["gpu"] = self._gpu.window()
            except Exception:  # noqa: BLE001
                rec["gpu"] = None
            self._gpu.close()
        everyone = collectives.all_gather_object(rec) if collective else [rec]
        if collectives.world_and_rank()[1] != 0:
            return {}, {}
        return self._combine(everyone, alone=not collective and collectives.world_and_rank()[0] > 1)

    def _combine(self, recs: list[dict], alone: bool) -> tuple[dict[str, float], dict[str, str]]:
        from mlflow_llmeff import names

        hosts: dict[str, list[dict]] = {}
        for r in recs:
            hosts.setdefault(r["host"], []).append(r)
        texts, other_max, steal_max, contended = [], None, None, False
        for host, rs in hosts.items():
            lead = next((r for r in rs if r.get("lr0") and r.get("h0") and r.get("h1")), None)
            if lead is None:
                texts.append(f"{host}: host CPU not read (/proc/stat unreadable)")
                continue
            ticks = lead["h1"].total - lead["h0"].total
            if ticks >= ct.MIN_WINDOW_TICKS and any(r["own_s"] is None for r in rs):  # others' busy time unknown
                steal = ct.host_fractions(lead["h0"], lead["h1"], 0.0)[1]
                texts.append(f"{host + ': ' if len(hosts) > 1 else ''}other processes' share of host CPU not "
                             f"measured: {OWN_UNKNOWN}; steal {steal:.1%}")
                self.absent_why = OWN_UNKNOWN
                steal_max = steal if steal_max is None else max(steal_max, steal)
                contended |= steal > ct.CONTENDED_STEAL_FRACTION
                continue
            if ticks < ct.MIN_WINDOW_TICKS:  # a share of a few ticks (or none): no 1% resolution
                why = (f"{ticks} CPU ticks in the steady window (a host share needs at least "
                       f"{ct.MIN_WINDOW_TICKS}, 1% resolution)")
                texts.append(f"{host + ': ' if len(hosts) > 1 else ''}host CPU share not measured: {why}")
                self.absent_why = why
                continue
            own = sum(r["own_s"] for r in rs)
            other, steal = ct.host_fractions(lead["h0"], lead["h1"], own)  # ticks > 0 here: never None
            ours = {p for r in rs for p in r["pids"]} | self._pids0
            cpus = os.cpu_count() or 1
            top = ct.top_others(lead.get("procs0", {}), lead.get("procs1", {}), lead["window_s"], cpus,
                                exclude=ours)
            texts.append(ct.host_text(other, steal, top, host if len(hosts) > 1 else None))
            other_max = other if other_max is None else max(other_max, other)
            steal_max = steal if steal_max is None else max(steal_max, steal)
            contended |= other > ct.CONTENDED_CPU_FRACTION or steal > ct.CONTENDED_STEAL_FRACTION
        gpus = [r["gpu"] for r in recs if r.get("gpu")]
        if gpus:
            merged = _merge_gpu(gpus)
            texts.append(ct.gpu_text(merged))
            contended |= ct.gpu_contended(merged)
        elif self.gpu_why:
            texts.append(self.gpu_why)
        if alone:
            texts.append("rank 0 alone at the end: the other ranks' CPU counts as other")
        summary = {}
        if other_max is not None:
            summary[names.SUM_HOST_OTHER_CPU] = other_max
        if steal_max is not None:
            summary[names.SUM_HOST_STEAL] = steal_max
        word = "contended" if contended else ("quiet" if other_max is not None or gpus else "unknown")
        return summary, {names.CONTENTION: f"{word}: " + "; ".join(texts)}

    def close(self) -> None:
        if self._gpu is not None:
            self._gpu.close()


def _merge_gpu(windows: list[dict]) -> dict:
    """One aggregate from every rank's :meth:`GpuConditions.window` (minima, maxima, unions)."""
    def pick(key, fn):
        vals = [w[key] for w in windows if w.get(key) is not None]
        return fn(vals) if vals else None

    others: dict[int, int | None] = {}
    for w in windows:
        for pid, mem in (w.get("others") or {}).items():
            others[pid] = ct.larger_memory(mem, others.get(pid))
    throttle = 0
    for w in windows:
        throttle |= int(w.get("throttle", 0))
    union = {k: set().union(*(w.get(k, ()) for w in windows)) for k in ("throttle_read", "throttle_unread",
                                                                        "procs_unread")}
    return {"samples": sum(w.get("samples", 0) for w in windows), "min_clock_mhz": pick("min_clock_mhz", min),
            "min_clock_frac": pick("min_clock_frac", min), "max_temp_c": pick("max_temp_c", max),
            "min_power_limit_w": pick("min_power_limit_w", min), "throttle": throttle, "others": others,
            "pids_visible": all(w.get("pids_visible", True) for w in windows), **union}
