"""kg-CO2e from the energy we measured, with codecarbon's grid intensity, offline and quiet.

Two figures, kept apart:

* **Carbon of the measured energy**: ``kg_co2e = kWh x I / 1000``, where ``kWh`` is the energy
  our meters measured (``energy/total_kwh``: NVML or RAPL, see :mod:`mlflow_llmeff.meters.energy`) and
  ``I`` (g CO2e/kWh) is the grid intensity codecarbon would use for the configured country or
  cloud region (asked of codecarbon's own emissions engine for 1 kWh, so the two agree exactly).
  Logged as ``carbon/total_kg_co2e``.
* **codecarbon's own CPU/RAM energy estimate**: the ``OfflineEmissionsTracker`` runs beside
  training (one per node, local rank 0) and estimates CPU energy (RAPL where it can read it,
  otherwise a TDP x load model) and RAM energy (a watts-per-GB constant). That is an estimate;
  it is logged under ``energy/estimate/*`` and ``carbon/estimate_kg_co2e`` and never mixed into
  ``energy/total_kwh`` or ``carbon/total_kg_co2e``. Its GPU figure is ignored (NVML measures the
  GPUs without double counting).

The tracker never touches the network (offline tracker, no output method, no API endpoint, no
Electricity Maps token), writes no file (no CSV output), bypasses codecarbon's ``/tmp`` lock
(``allow_multiple_runs=True``: a lock left by a crashed run cannot stop it, and codecarbon does
not take over SIGINT/SIGTERM), and logs at ``error`` level unless ``CODECARBON_LOG_LEVEL`` says
otherwise. Nothing here raises: when codecarbon is missing or fails, the carbon figures are
absent and ``llmeff.carbon.source`` says why.
"""

from __future__ import annotations

import logging
import os
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Mapping

from mlflow_llmeff import names

__all__ = ["CodecarbonEstimate", "CarbonTracker", "FakeCarbonTracker", "check_location", "grid_intensity_g_per_kwh",
           "DEFAULT_COUNTRY", "resolve_location", "PUE", "ram_power_basis",
           "SAMPLE_S", "ESTIMATE_AGE_S"]

#: The grid country taken when the user gives neither a country nor a cloud region (recorded in
#: ``llmeff.assumed``: it sets the carbon figures, and the user's grid may differ by a factor of 10).
DEFAULT_COUNTRY = "USA"

#: Power usage effectiveness applied: 1, the devices' energy alone (no data-centre cooling or power
#: delivery), for our measured energy and for codecarbon's estimate alike (``pue=1.0``).
PUE = 1.0

#: codecarbon's sampling period here, s (its ``measure_power_secs``; codecarbon's default is 15 s). Its own
#: background timer samples this often, so the running estimate read at a window edge
#: (:meth:`CarbonTracker.running_estimate`) is already younger than :data:`ESTIMATE_AGE_S` and the
#: training thread only reads two totals; it samples itself only when codecarbon's timer fell behind.
SAMPLE_S = 1.0

#: The most a running estimate read at a window edge lags codecarbon's power model, s.
ESTIMATE_AGE_S = 2.0

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CodecarbonEstimate:
    """codecarbon's own estimate of this node's CPU and RAM energy over the run (not measured).

    Attributes:
        cpu_kwh: CPU energy, kWh (method in ``cpu_method``).
        ram_kwh: RAM energy, kWh (codecarbon's RAM power model: about 5 W per estimated DIMM).
        cpu_method: codecarbon's CPU mode, e.g. ``cpu_load`` (TDP x load), ``constant``, ``intel_rapl``.
        tracking_mode: ``machine`` (whole node, other users' load included) or ``process``.
        duration_s: the window codecarbon covered, s.
        ram_basis: the memory size RAM power was estimated from (:func:`ram_power_basis`).
    """

    cpu_kwh: float
    ram_kwh: float
    cpu_method: str
    tracking_mode: str
    duration_s: float
    ram_basis: str = "RAM power from codecarbon's model of the host's memory"

    @property
    def kwh(self) -> float:
        """CPU + RAM estimate, kWh."""
        return self.cpu_kwh + self.ram_kwh

    def describe(self) -> str:
        return f"codecarbon estimate, tracking_mode={self.tracking_mode}: CPU by {self.cpu_method}; {self.ram_basis}"


def _codecarbon_ram_watts(memory_bytes: int) -> float:
    """codecarbon's RAM power model (``RAM._calculate_ram_power``, watts) at ``memory_bytes``.

    A subclass of codecarbon's ``RAM`` uses the model it inherits (a ``_`` method is codecarbon's to
    its subclasses), so the container is charged exactly as codecarbon charges a host of that size.
    """
    from codecarbon.external.ram import B_TO_GB, RAM

    class _SizedRAM(RAM):
        def watts_at(self, gb: float) -> float:
            return float(self._calculate_ram_power(gb))

    return _SizedRAM(tracking_mode="machine").watts_at(memory_bytes / B_TO_GB)


def ram_power_basis(tracking_mode: str, env: Mapping[str, str], *, cgroup_root: str = "/",
                    host_bytes: int | None = None) -> tuple[float | None, str]:
    """The RAM power to force on codecarbon for this container, and the basis the estimate tag states.

    codecarbon (3.x, ``codecarbon.external.ram.RAM``) sizes RAM power from the host's total memory in
    ``machine`` mode (``psutil.virtual_memory().total``; the SLURM job's memory under SLURM): a job in a
    100 GiB container on a 1.5 TiB host would be charged for 1.5 TiB. Where the container has a memory
    limit (:func:`mlflow_llmeff.meters.cgroup.memory_limit`), the power is codecarbon's own model
    (``RAM._calculate_ram_power``, about 5 W per estimated DIMM) at the limit's size, passed through the
    tracker's documented ``force_ram_power`` argument (watts); codecarbon is otherwise left as it is.

    Args:
        tracking_mode: codecarbon's ``machine`` or ``process`` (process memory needs no limit).
        env: the environment (``SLURM_JOB_ID``: codecarbon sizes by the job's memory itself).
        cgroup_root: file-system root of ``proc/self/cgroup`` and ``sys/fs/cgroup`` (tests: a fake tree).
        host_bytes: the host's memory, bytes; None reads it (:func:`~mlflow_llmeff.meters.cgroup.host_memory_bytes`).

    Returns:
        ``(watts or None, basis)``: watts to pass as ``force_ram_power`` (None: leave codecarbon's own
        sizing) and one line for ``llmeff.carbon.estimate_method``, e.g. ``RAM power 40 W from the
        container's memory limit 100 GiB (cgroup v2 memory.max), not the host's 1.5 TiB``. Never raises.
    """
    from mlflow_llmeff.meters import cgroup

    if tracking_mode != "machine":
        return None, f"RAM power from this process's memory (tracking_mode={tracking_mode})"
    if env.get("SLURM_JOB_ID"):
        return None, "RAM power from the SLURM job's memory (codecarbon reads it under SLURM_JOB_ID)"
    host = host_bytes if host_bytes is not None else cgroup.host_memory_bytes()
    host_text = cgroup.format_bytes(host) if host else "size unknown"
    limit = cgroup.memory_limit(cgroup_root, host)
    if limit is None:
        return None, f"RAM power from the host's memory {host_text} (no container memory limit below it)"
    try:
        watts = _codecarbon_ram_watts(limit.bytes)
    except Exception as e:  # noqa: BLE001 - another codecarbon: keep its host sizing and say so
        return None, (f"RAM power from the host's memory {host_text}: the container's limit "
                      f"{cgroup.format_bytes(limit.bytes)} ({limit.source}) could not be applied ({type(e).__name__})")
    return watts, (f"RAM power {watts:g} W from the container's memory limit {cgroup.format_bytes(limit.bytes)} "
                   f"({limit.source}), not the host's {host_text}")


def cpu_model_from_proc(path: str = "/proc/cpuinfo") -> str | None:
    """The CPU's model as the first ``model name`` line of ``path`` gives it (Linux x86, proc(5)), else None
    (no such file or line: ARM's /proc/cpuinfo has none): :func:`~mlflow_llmeff.meters.hardware.cpuinfo_value`."""
    from mlflow_llmeff.meters.hardware import cpuinfo_value

    return cpuinfo_value(("model name",), path)


@contextmanager
def cpu_model_known(path: str = "/proc/cpuinfo"):
    """While codecarbon's tracker starts, py-cpuinfo's ``get_cpu_info`` answers the CPU's brand from ``path``.

    codecarbon reads only ``brand_raw`` of it (``codecarbon.core.util.detect_cpu_model``, cached for the
    process), and py-cpuinfo gets it by running itself in a Python subprocess (``cpuinfo.py --json``): 1.2-1.4 s
    and 0.9 s of CPU at every monitored run's start here (measured 2026-12-07), part of its ``init`` badput.
    Where ``path`` names no model, or py-cpuinfo is not installed, nothing changes; the function is put back
    after the block."""
    model = cpu_model_from_proc(path)
    try:
        import cpuinfo
    except ImportError:
        cpuinfo = None
    if model is None or cpuinfo is None:
        yield
        return
    asked = cpuinfo.get_cpu_info
    cpuinfo.get_cpu_info = lambda: {"brand_raw": model}
    try:
        yield
    finally:
        cpuinfo.get_cpu_info = asked


def _quiet_codecarbon(env: Mapping[str, str]) -> str:
    try:  # codecarbon sets its logger's level when first imported: import first, then set ours
        import codecarbon.external.logger  # noqa: F401
    except Exception:  # noqa: BLE001 - absent or different layout: the level below still applies
        pass
    level = env.get("CODECARBON_LOG_LEVEL", "error")
    try:
        logging.getLogger("codecarbon").setLevel(level.upper())
    except (ValueError, TypeError):
        level = "error"
        logging.getLogger("codecarbon").setLevel(logging.ERROR)
    return level


def grid_intensity_g_per_kwh(
    *, country_iso_code: str | None = "USA", cloud_provider: str | None = None, cloud_region: str | None = None
) -> tuple[float, str]:
    """The grid carbon intensity codecarbon's offline engine applies, and where it comes from.

    Computed as codecarbon's emissions for exactly 1 kWh (kg) x 1000, so that our
    ``kWh x intensity`` equals what codecarbon itself would report for the same energy.
    Private infrastructure: the country's carbon intensity from codecarbon's
    ``global_energy_mix.json`` (Our World in Data / Ember figures, with the data year). Cloud:
    the provider's per-region figure from codecarbon's ``cloud/impact.csv``, falling back to the
    country (codecarbon's own rule).

    Args:
        country_iso_code: ISO 3166-1 alpha-3 code, e.g. ``USA``, ``FRA``.
        cloud_provider: e.g. ``gcp``, ``aws``, ``azure`` (as in codecarbon's ``impact.csv``).
        cloud_region: e.g. ``us-central1``.

    Returns:
        ``(g CO2e per kWh, description of the source)``.

    Raises:
        ImportError: codecarbon is not installed.
    """
    import codecarbon
    from codecarbon.core.emissions import Emissions
    from codecarbon.core.units import Energy
    from codecarbon.external.geography import CloudMetadata, GeoMetadata
    from codecarbon.input import DataSource

    data = DataSource()
    engine = Emissions(data)
    one_kwh = Energy.from_energy(kWh=1.0)
    iso = country_iso_code.upper() if country_iso_code else None
    geo = GeoMetadata(country_iso_code=iso)
    mix = data.get_global_energy_mix_data()
    if iso in mix:
        country = f"country={iso} (global_energy_mix.json, {mix[iso].get('year', 'year unknown')})"
    else:
        country = f"world average (country {iso!r} not in codecarbon's global_energy_mix.json)"
    head = f"codecarbon {codecarbon.__version__} offline"
    if cloud_provider or cloud_region:
        df = data.get_cloud_emissions_data()
        rows = df.loc[(df["provider"] == cloud_provider) & (df["region"] == cloud_region)]
        kg = engine.get_cloud_emissions(one_kwh, CloudMetadata(provider=cloud_provider, region=cloud_region), geo)
        if len(rows):
            where = f"cloud={cloud_provider}/{cloud_region} (cloud/impact.csv, {rows['source'].iloc[0]})"
        else:
            where = f"cloud={cloud_provider}/{cloud_region} not in cloud/impact.csv, so {country}"
    else:
        kg = engine.get_private_infra_emissions(one_kwh, geo)
        where = country
    return kg * 1000.0, f"{head}, {where}"


def resolve_location(country_iso_code: str | None, cloud_provider: str | None = None,
                     cloud_region: str | None = None) -> tuple[str | None, str | None]:
    """The country whose grid intensity applies, and the note of an assumption when none was given.

    A given country (any case) is kept; with a cloud provider or region, codecarbon's cloud table
    decides and no country is needed; with neither, :data:`DEFAULT_COUNTRY` is taken and the note
    says so (for ``llmeff.assumed``), since carbon figures then rest on a grid the user never named.

    Returns:
        ``(country or None, note or None)``.
    """
    if country_iso_code:
        return country_iso_code, None
    if cloud_provider or cloud_region:
        return None, None
    return DEFAULT_COUNTRY, (f"{DEFAULT_COUNTRY} (no country_iso_code or cloud region given, so carbon uses "
                             f"codecarbon's {DEFAULT_COUNTRY} grid intensity: pass country_iso_code)")


def check_location(*, country_iso_code: str | None, cloud_provider: str | None = None,
                   cloud_region: str | None = None) -> None:
    """Refuse a country or cloud region codecarbon does not know, before any work.

    codecarbon itself would log an error at the end of the run and fall back to the world
    average; a typo (``US`` for ``USA``) must not silently change the carbon figures.

    Raises:
        ValueError: one line naming the bad value and where the accepted ones are listed.
    """
    try:
        from codecarbon.input import DataSource
    except ImportError:  # no codecarbon: no carbon figures, nothing to check
        return
    data = DataSource()
    if country_iso_code:
        mix = data.get_global_energy_mix_data()
        code = country_iso_code.upper()
        if code not in mix:
            near = sorted(k for k in mix if k.startswith(code[:2]))[:6] or ["USA", "FRA", "DEU", "GBR", "CAN", "IND"]
            raise ValueError(f"country_iso_code={country_iso_code!r} is not in codecarbon's table of {len(mix)} "
                             f"countries (ISO 3166-1 alpha-3 codes, e.g. {', '.join(near)}); see "
                             "codecarbon/data/private_infra/global_energy_mix.json")
    if cloud_provider or cloud_region:
        df = data.get_cloud_emissions_data()
        providers = sorted(set(df["provider"]))
        if cloud_provider not in providers:
            raise ValueError(f"cloud_provider={cloud_provider!r} is not in codecarbon's cloud table (it has "
                             f"{', '.join(providers)}); elsewhere leave cloud_provider empty and give the region's "
                             "country as country_iso_code (e.g. USA for us-east-1)")
        regions = sorted(set(df.loc[df["provider"] == cloud_provider, "region"]))
        if cloud_region and cloud_region not in regions:
            raise ValueError(f"cloud_region={cloud_region!r} is not a {cloud_provider} region codecarbon knows; "
                             f"use one of: {', '.join(regions)}")


class CarbonTracker:
    """codecarbon in offline mode, for kg-CO2e of our measured energy and a CPU/RAM estimate.

    Start it on the main process of each node (local rank 0): on any other local rank it does
    not start codecarbon's tracker (one per node) but still knows the grid intensity.

    Args:
        country_iso_code: ISO alpha-3 country of the machines (param ``country_iso_code``); None with
            no cloud region: :data:`DEFAULT_COUNTRY`, an assumption :meth:`assumptions` names.
        cloud_provider: cloud provider code as in codecarbon's ``impact.csv`` (param ``cloud_provider``).
        cloud_region: cloud region (param ``cloud_region``).
        enabled: False turns everything off (``measure_energy=none``).
        tracking_mode: codecarbon's ``machine`` (whole node) or ``process``.
        measure_power_secs: codecarbon's sampling period, s (default :data:`SAMPLE_S`, which keeps the running
            estimate younger than :data:`ESTIMATE_AGE_S` without sampling on the caller's thread).
        env: environment (default ``os.environ``): ``LOCAL_RANK``, ``CODECARBON_LOG_LEVEL``, ``SLURM_JOB_ID``.
        cgroup_root: root of ``proc/self/cgroup`` and ``sys/fs/cgroup`` for the container's memory limit
            (:func:`ram_power_basis`); tests pass a fake tree.
        host_memory_bytes: the host's memory, bytes; None reads it.

    Attributes:
        intensity_g_per_kwh: grid intensity used, g CO2e/kWh, or None when unavailable.
        source: ``llmeff.carbon.source``: codecarbon version, mode and data, or ``none: <why>``.
        why: why the tracker's own estimate (or everything) is unavailable, else None.
        estimate: codecarbon's CPU/RAM estimate after :meth:`stop`, else None.
    """

    def __init__(
        self,
        *,
        country_iso_code: str | None = None,
        cloud_provider: str | None = None,
        cloud_region: str | None = None,
        enabled: bool = True,
        tracking_mode: str = "machine",
        measure_power_secs: float = SAMPLE_S,
        env: Mapping[str, str] | None = None,
        cgroup_root: str = "/",
        host_memory_bytes: int | None = None,
    ):
        self.country_iso_code, self.assumed_country = resolve_location(country_iso_code, cloud_provider, cloud_region)
        self.cloud_provider = cloud_provider
        self.cloud_region = cloud_region
        self.enabled = enabled
        self.tracking_mode = tracking_mode
        self.measure_power_secs = measure_power_secs
        self._env = os.environ if env is None else env
        self._cgroup_root, self._host_bytes = cgroup_root, host_memory_bytes
        self.ram_basis = "RAM power from codecarbon's model of the host's memory"
        self.intensity_g_per_kwh: float | None = None
        self.source = "none: not started"
        self.why: str | None = None
        self.estimate: CodecarbonEstimate | None = None
        self._tracker: Any = None

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Find the grid intensity and start codecarbon's tracker. Never raises; a second call does nothing."""
        if self._tracker is not None or self.estimate is not None:
            return
        if not self.enabled:
            self._disable("carbon tracking disabled (measure_energy=none)")
            return
        try:
            level = _quiet_codecarbon(self._env)
            self.intensity_g_per_kwh, self.source = grid_intensity_g_per_kwh(
                country_iso_code=self.country_iso_code, cloud_provider=self.cloud_provider, cloud_region=self.cloud_region
            )
        except ImportError as e:
            self._disable(f"codecarbon is not installed ({e})")
            return
        except Exception as e:
            self._disable(f"codecarbon could not give a grid intensity ({type(e).__name__}: {e})")
            return
        local_rank = self._env.get("LOCAL_RANK", "0") or "0"
        if local_rank != "0":
            self.why = f"codecarbon tracker runs on local rank 0 only (one per node); this is local rank {local_rank}"
            return
        try:
            from codecarbon import OfflineEmissionsTracker

            kwargs: dict[str, Any] = dict(
                country_iso_code=self.country_iso_code.upper() if self.country_iso_code else None,
                output_methods=[],  # no CSV (or any other output): nothing written anywhere
                emissions_endpoint=None,  # no HTTP output, whatever a config file says
                electricitymaps_api_token=None,  # no Electricity Maps API call
                allow_multiple_runs=True,  # no /tmp/.codecarbon.lock, no SIGINT/SIGTERM handlers
                force_carbon_intensity_g_co2e_kwh=None,  # same intensity as grid_intensity_g_per_kwh
                pue=PUE,
                log_level=level,
                tracking_mode=self.tracking_mode,
                measure_power_secs=self.measure_power_secs,
                project_name="mlflow_llmeff",
            )
            if self.cloud_provider or self.cloud_region:
                kwargs.update(cloud_provider=self.cloud_provider, cloud_region=self.cloud_region)
            watts, self.ram_basis = ram_power_basis(self.tracking_mode, self._env, cgroup_root=self._cgroup_root,
                                                    host_bytes=self._host_bytes)
            if watts is not None:  # the container's limit, not the host's memory
                kwargs["force_ram_power"] = watts
            with cpu_model_known():  # not py-cpuinfo's subprocess at every start
                tracker = OfflineEmissionsTracker(**kwargs)
                tracker.start()  # codecarbon swallows its own exceptions: check that it really started
            if getattr(tracker, "_start_time", None) is None:
                raise RuntimeError("codecarbon's tracker did not start (its log says why)")
            self._tracker = tracker
        except Exception as e:
            self.why = f"codecarbon tracker failed to start ({type(e).__name__}: {e}); no CPU/RAM estimate"
            self._tracker = None

    def stop(self) -> None:
        """Stop codecarbon's tracker and keep its CPU/RAM estimate. Idempotent; never raises."""
        tracker, self._tracker = self._tracker, None
        if tracker is None:
            return
        try:
            tracker.stop()
            data = getattr(tracker, "final_emissions_data", None)
            if data is None:
                raise RuntimeError("codecarbon returned no data")
            cpu_method = "unknown"
            for hw in getattr(tracker, "_hardware", []):
                if type(hw).__name__ == "CPU":
                    cpu_method = str(getattr(hw, "_mode", "unknown"))
            self.estimate = CodecarbonEstimate(
                cpu_kwh=float(data.cpu_energy),
                ram_kwh=float(data.ram_energy),
                cpu_method=cpu_method,
                tracking_mode=str(data.tracking_mode),
                duration_s=float(data.duration),
                ram_basis=self.ram_basis,
            )
        except Exception as e:
            self.why = f"codecarbon tracker failed to stop ({type(e).__name__}: {e}); no CPU/RAM estimate"

    def running_estimate(self, min_age_s: float = ESTIMATE_AGE_S) -> tuple[float, float] | None:
        """codecarbon's CPU and RAM energy estimate so far, kWh (after :meth:`stop`: the final one); else None.

        codecarbon samples every ``measure_power_secs`` (:data:`SAMPLE_S`, 1 s) on its own background
        timer, so a reading here is two totals read, younger than ``min_age_s``: logged running totals
        lag codecarbon's power model by at most ``min_age_s``, and the run's totals are the final
        estimate. Only a sample older than ``min_age_s`` (codecarbon's timer fell behind, e.g. on a
        loaded host, or a longer ``measure_power_secs``) is refreshed here first, on the caller's
        thread: 0.3-0.4 ms on a quiet 2-core host and several ms on a loaded one (psutil reading
        ``/proc/meminfo``); with codecarbon's 15 s period that refresh ran at every 2 s of window edges,
        ~12% of a llama-tiny run's logged steps (``bench/overhead.py``). Uses the tracker's running totals
        (``_total_cpu_energy``, ``_total_ram_energy``; codecarbon has no public reading short of
        ``flush()``, which also writes its outputs). Never raises.
        """
        tracker = self._tracker
        if tracker is None:
            est = self.estimate  # after stop(): the final figures
            return (est.cpu_kwh, est.ram_kwh) if est is not None else None
        try:
            refresh = getattr(tracker, "_measure_power_and_energy_if_stale", None)
            if refresh is not None:
                refresh(min_interval_s=min_age_s)
            return float(tracker._total_cpu_energy.kWh), float(tracker._total_ram_energy.kWh)
        except Exception:  # noqa: BLE001 - a different codecarbon layout: no running figure
            return None

    def __enter__(self) -> "CarbonTracker":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _disable(self, why: str) -> None:
        self.why = why
        self.intensity_g_per_kwh = None
        self.source = f"none: {why}"

    # ------------------------------------------------------------------ figures
    def kg_co2e(self, kwh: float) -> float | None:
        """Emissions of ``kwh`` of energy at the grid intensity in use, kg CO2e (None if unknown).

        ``kg = kWh x (g/kWh) / 1000``. Pass the energy we measured (``energy/total_kwh``).
        """
        if self.intensity_g_per_kwh is None:
            return None
        return kwh * self.intensity_g_per_kwh / 1000.0

    def metrics(self, *, measured_kwh: float | None, tokens: int | None = None) -> dict[str, float]:
        """Carbon metrics for the end of a run (after :meth:`stop`).

        Args:
            measured_kwh: ``energy/total_kwh`` when energy was measured, else None.
            tokens: non-padding tokens trained on, for the per-billion-token summary.

        Returns:
            ``carbon/total_kg_co2e`` (and ``summary/kg_co2e_per_billion_tokens``) from the
            measured energy only; codecarbon's estimate under ``energy/estimate/*`` and
            ``carbon/estimate_kg_co2e``, apart. Empty when the intensity is unknown.
        """
        out: dict[str, float] = {}
        if self.intensity_g_per_kwh is None:
            return out
        if measured_kwh is not None:
            kg = self.kg_co2e(measured_kwh)
            out[names.CARBON_TOTAL_KG] = kg
            if tokens:
                out[names.SUM_KG_CO2E_PER_BTOK] = kg * 1e9 / tokens
        if self.estimate is not None:
            out[names.ENERGY_ESTIMATE_CPU_KWH] = self.estimate.cpu_kwh
            out[names.ENERGY_ESTIMATE_RAM_KWH] = self.estimate.ram_kwh
            out[names.CARBON_ESTIMATE_KG] = self.kg_co2e(self.estimate.kwh)
        return out

    def assumptions(self) -> dict[str, str]:
        """What the carbon figures assume that the user did not give, for ``llmeff.assumed``: the
        default grid country, and (once a grid intensity is known) PUE 1; ``{}`` when disabled."""
        out: dict[str, str] = {}
        if not self.enabled or (self.source.startswith("none: ") and self.source != "none: not started"):
            return out  # no carbon figures (disabled, codecarbon missing or failing): nothing rests on a grid
        if self.assumed_country:
            out["country_iso_code"] = self.assumed_country
        if self.intensity_g_per_kwh is not None:
            out["pue"] = (f"{PUE:g} (carbon/* is the devices' energy x grid intensity: no data-centre cooling or "
                          "power delivery overhead)")
        return out

    def tags(self, *, energy_source: str | None = None) -> dict[str, str]:
        """``llmeff.carbon.*`` tags.

        Args:
            energy_source: the ``llmeff.energy.source`` of the energy passed to :meth:`kg_co2e`,
                so the tag says which energy the kg figure covers.
        """
        t = {names.CARBON_SOURCE: self.source}
        if self.intensity_g_per_kwh is not None:
            t[names.CARBON_INTENSITY] = f"{self.intensity_g_per_kwh:g}"
            if energy_source and energy_source != "none":
                t[names.CARBON_ENERGY_BASIS] = (
                    f"carbon/total_kg_co2e = energy/total_kwh (measured, {energy_source}) x carbon.intensity_g_per_kwh / 1000"
                )
            else:
                t[names.CARBON_ENERGY_BASIS] = "no measured energy: carbon/total_kg_co2e not logged"
        if self.estimate is not None:
            t[names.CARBON_ESTIMATE_METHOD] = self.estimate.describe()
        elif self.why:
            t[names.CARBON_ESTIMATE_METHOD] = f"none: {self.why}"
        return t


class FakeCarbonTracker(CarbonTracker):
    """A tracker for tests, shipped with the package: a fixed grid intensity and an estimate you set.

    Nothing is imported from codecarbon and nothing runs in the background. :meth:`set_estimate`
    sets the running CPU and RAM estimate (kWh since :meth:`start`); :meth:`stop` freezes it.

    Args:
        intensity_g_per_kwh: the grid intensity it reports, g CO2e/kWh.
    """

    def __init__(self, intensity_g_per_kwh: float = 400.0) -> None:
        super().__init__(enabled=True)
        self.assumed_country = None  # its intensity is fixed, not any country's
        self._fixed = float(intensity_g_per_kwh)
        self._running: tuple[float, float] | None = None
        self.started = False

    def start(self) -> None:
        self.intensity_g_per_kwh = self._fixed
        self.source = "fake"
        self.started = True
        self._running = (0.0, 0.0)

    def set_estimate(self, cpu_kwh: float, ram_kwh: float) -> None:
        """Set the running estimate since :meth:`start`, kWh."""
        self._running = (float(cpu_kwh), float(ram_kwh))

    def running_estimate(self, min_age_s: float = ESTIMATE_AGE_S) -> tuple[float, float] | None:
        if self.estimate is not None:
            return self.estimate.cpu_kwh, self.estimate.ram_kwh
        return self._running

    def stop(self) -> None:
        if self._running is not None and self.estimate is None:
            self.estimate = CodecarbonEstimate(self._running[0], self._running[1], "fake", "machine", 0.0)
