"""Running totals of what a run consumes: measured energy, codecarbon's estimate, carbon and cost.

Consumption never rolls back. Progress counters (steps, tokens) restart from the checkpoint a
resumed run loads, because the work after it is redone; resources spent after that checkpoint were
spent all the same, so after a resume every consumption total continues from the newest figure the
run recorded: the crashed attempt's last logged point, or its checkpoint, whichever is later
(:meth:`Consumption.resume`). Cost follows the wall time, which already holds the crashed
attempt's lost progress (:mod:`mlflow_llmeff.calc.goodput`).

Formulas (``docs/energy_carbon_cost.md``):

* ``energy/total_kwh = J / 3.6e6`` of the measured devices of every rank (NVML, RAPL);
* ``carbon/total_kg_co2e = kWh x intensity / 1000`` with codecarbon's grid intensity;
* codecarbon's CPU/RAM *estimate* is kept apart (``energy/estimate/*``, ``carbon/estimate_kg_co2e``);
* ``cost/total_usd = device_hour_usd x device-hours (+ measured kWh x usd_per_kwh)``; with
  ``usd_per_kwh`` and energy not measured on every device, no cost (never the energy priced at 0 kWh).
* device-hours (``summary/device_hours``) = sum over attempts of devices x attempt hours: the seconds
  earlier attempts put in the run's clock (a checkpoint's ledger, a crashed attempt's lost tail, attempts
  no checkpoint holds) at the devices each held (:meth:`Consumption.add_earlier`), the rest at this
  attempt's ``devices``; one device count throughout gives ``devices x wall_s / 3600``.

Partial measurement is a state of its own: ``summary/energy_coverage`` = measured devices / devices
of the run (each physical device once, however many ranks own it). Below 1, every run total and
per-token figure of measured energy and carbon is omitted, not scaled (it would cover only the
measured devices), and ``llmeff.energy.coverage`` names the unmeasured devices and why; the
per-device figures (average power, TFLOP/s per W) stay, as averages over the measured devices.
Energy covers the wall time from the meter's start to its last reading (``summary/energy_span_s``,
``llmeff.energy.span``), cost all of ``summary/wall_s``.

Pure: readings come in from the caller (already summed over ranks); no I/O, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mlflow_llmeff.meters import energy as en
from mlflow_llmeff import names
from mlflow_llmeff.calc.cost import device_hours_cost_usd, usd_per_billion_tokens

__all__ = ["Consumption", "EnergyShare"]


@dataclass
class Consumption:
    """Energy, estimate, carbon and cost totals of a run (all attempts).

    Args:
        devices: devices taking part (for cost and average power per device).
        device_hour_usd: price per device-hour, USD, or None (no cost figures).
        usd_per_kwh: energy price, USD/kWh, or None (energy not priced).
        intensity_g_per_kwh: grid intensity codecarbon uses, g CO2e/kWh, or None (no carbon).
    """

    devices: int
    device_hour_usd: float | None = None
    usd_per_kwh: float | None = None
    intensity_g_per_kwh: float | None = None
    prior_j: float = 0.0  # measured energy of earlier attempts, J
    prior_cpu_kwh: float = 0.0  # codecarbon estimate of earlier attempts, kWh
    prior_ram_kwh: float = 0.0
    joules: float = 0.0  # measured energy of this attempt, all ranks, J
    energy_devices: int = 0  # devices measured (0: nothing measured)
    cpu_kwh: float | None = None  # codecarbon estimate of this attempt, all nodes (None: no estimate)
    ram_kwh: float | None = None
    domains: int = 0  # distinct devices of the run the energy meters own, measured or not (0: none known)
    measured_domains: int = 0  # of those, measured (each physical device once)
    unmeasured: dict[str, str] = field(default_factory=dict)  # device id -> why it is not measured
    shared: dict[str, list[int]] = field(default_factory=dict)  # device id -> the ranks that own it (> 1)
    head_gap_s: float = 0.0  # wall seconds (all attempts) before the energy meter started: not in the energy
    read_wall_s: float | None = None  # wall time (all attempts) of the newest reading in the totals
    prior_partial: bool = False  # an earlier attempt measured only some of its devices
    prior_wall_s: float = 0.0  # clock seconds of earlier attempts in the run's wall time (add_earlier)
    prior_device_s: float = 0.0  # their device-seconds, each at the devices its attempt held
    prior_init_s: float = 0.0  # of prior_wall_s, set-up (init)
    prior_init_device_s: float = 0.0  # its device-seconds
    prior_devices: tuple[int, ...] = ()  # device counts of earlier attempts seen (for the tags)
    _mark: tuple[float, int, float] | None = None  # (J, tokens, wall s) at the last interval that moved the counter
    interval_why: dict[str, str] = field(default_factory=dict)  # interval key -> why the last interval left it out

    # ------------------------------------------------------------------------------ updates
    def update(self, *, joules: float, energy_devices: int, estimate: tuple[float, float] | None = None,
               measured_domains: int | None = None, wall_s: float | None = None) -> None:
        """Set this attempt's readings (cumulative since its start, summed over ranks, each device once).

        Args:
            joules: measured energy of this attempt, J.
            energy_devices: devices measured (for average power per device).
            estimate: codecarbon's (CPU, RAM) kWh of this attempt.
            measured_domains: energy domains measured (for the coverage; default ``energy_devices``).
            wall_s: the run's wall time (all attempts) at this reading (for the energy's span).
        """
        self.joules, self.energy_devices = float(joules), int(energy_devices)
        self.measured_domains = int(energy_devices if measured_domains is None else measured_domains)
        if wall_s is not None:
            self.read_wall_s = float(wall_s)
        if estimate is not None:
            self.cpu_kwh, self.ram_kwh = float(estimate[0]), float(estimate[1])

    def set_devices(self, devices: int, unmeasured: dict[str, str] | None = None,
                    shared: dict[str, list[int]] | None = None) -> None:
        """The run's energy domains: how many distinct devices, which are not measured and why, which are shared."""
        self.domains = int(devices)
        self.unmeasured = dict(unmeasured or {})
        self.shared = dict(shared or {})

    def price_carbon(self, intensity_g_per_kwh: float | None) -> None:
        """The grid intensity the carbon tracker found (g CO2e/kWh; None: no carbon figures)."""
        self.intensity_g_per_kwh = intensity_g_per_kwh

    def add_head_gap(self, seconds: float) -> None:
        """``seconds`` of set-up ran before the energy meter started (in the wall time, not in the energy)."""
        self.head_gap_s += seconds

    def earlier_devices(self, counts: tuple[int, ...]) -> None:
        """The device counts the earlier attempts held (a checkpoint's), for the tags."""
        self.prior_devices = counts

    def add_earlier(self, seconds: float, devices: int | None = None, *, device_s: float | None = None,
                    init_s: float = 0.0, init_device_s: float | None = None) -> None:
        """Seconds of earlier attempts added to the run's clock, with the devices they held.

        Args:
            seconds: clock seconds added (may be negative: a correction of an earlier addition).
            devices: devices held during them (default: this attempt's); or give ``device_s``.
            device_s: their device-seconds, when the seconds span attempts with different devices.
            init_s: of ``seconds``, set-up (``init``), for the time-to-quality figures that leave it out.
            init_device_s: its device-seconds (default: ``init_s`` x ``devices``).
        """
        n = self.devices if devices is None else int(devices)
        self.prior_wall_s += float(seconds)
        self.prior_device_s += float(seconds) * n if device_s is None else float(device_s)
        self.prior_init_s += float(init_s)
        self.prior_init_device_s += float(init_s) * n if init_device_s is None else float(init_device_s)
        if devices is not None and n not in self.prior_devices:
            self.prior_devices += (n,)

    def device_s(self, wall_s: float, init_s: float | None = None) -> float:
        """Device-seconds of ``wall_s`` seconds of the run's clock (all attempts): the earlier attempts'
        at their devices, the rest at :attr:`devices`; with ``init_s`` (the clock's set-up seconds, all
        attempts) the set-up's device-seconds are left out."""
        total = self.prior_device_s + self.devices * max(0.0, float(wall_s) - self.prior_wall_s)
        if init_s is not None:
            total -= self.prior_init_device_s + self.devices * max(0.0, float(init_s) - self.prior_init_s)
        return max(0.0, total)

    @property
    def devices_changed(self) -> bool:
        """True when an earlier attempt held another number of devices than this one."""
        return any(n != self.devices for n in self.prior_devices)

    def resume(self, state: dict, last_logged: dict[str, float]) -> None:
        """Continue from a checkpoint's :meth:`state_dict` and the run's newest logged totals.

        Args:
            state: what :meth:`state_dict` returned when the checkpoint was written.
            last_logged: newest logged value of each cumulative key of the run (all attempts),
                e.g. ``{"energy/total_kwh": 0.3}``; missing keys fall back to the checkpoint.
        """
        self.prior_j = max(float(state.get("energy_j", 0.0)),
                           last_logged.get(names.ENERGY_TOTAL_KWH, 0.0) * en.J_PER_KWH)
        self.prior_cpu_kwh = max(float(state.get("estimate_cpu_kwh", 0.0)),
                                 last_logged.get(names.ENERGY_ESTIMATE_CPU_KWH, 0.0))
        self.prior_ram_kwh = max(float(state.get("estimate_ram_kwh", 0.0)),
                                 last_logged.get(names.ENERGY_ESTIMATE_RAM_KWH, 0.0))
        self.head_gap_s = float(state.get("energy_head_gap_s", 0.0))
        self.prior_partial = bool(state.get("energy_partial", False))

    def state_dict(self, wall_s: float | None = None, init_s: float | None = None) -> dict:
        """Totals of all attempts so far, for a checkpoint; with the clock's ``wall_s`` (and its ``init_s``)
        also the device-seconds up to then and this attempt's devices (:meth:`device_s`)."""
        out = {"energy_j": self.total_j, "estimate_cpu_kwh": self.prior_cpu_kwh + (self.cpu_kwh or 0.0),
               "estimate_ram_kwh": self.prior_ram_kwh + (self.ram_kwh or 0.0),
               "energy_head_gap_s": self.head_gap_s, "energy_partial": self.measured and not self.complete}
        if wall_s is not None:
            out.update(devices=self.devices, device_s=self.device_s(wall_s),
                       device_counts=sorted(set(self.prior_devices) | {self.devices}))
            if init_s is not None:
                out["init_device_s"] = self.prior_init_device_s + self.devices * max(0.0, init_s - self.prior_init_s)
        return out

    # ------------------------------------------------------------------------------ totals
    @property
    def measured(self) -> bool:
        """True when some device's energy is measured (NVML, RAPL)."""
        return self.energy_devices > 0

    @property
    def coverage(self) -> float | None:
        """Measured devices / devices of the run (each physical device once); None when no device is known."""
        if self.domains <= 0:
            return None
        return min(self.measured_domains, self.domains) / self.domains

    @property
    def complete(self) -> bool:
        """True when every device of the run (and of every earlier attempt) is measured."""
        cov = self.coverage
        return self.measured and not self.prior_partial and (cov is None or cov >= 1.0)

    @property
    def span_s(self) -> float | None:
        """Wall seconds (all attempts) the measured energy covers: up to its newest reading, less the head gap."""
        return None if self.read_wall_s is None else max(0.0, self.read_wall_s - self.head_gap_s)

    @property
    def total_j(self) -> float:
        """Measured energy of all attempts, J (of the measured devices only when not :attr:`complete`)."""
        return self.prior_j + self.joules

    @property
    def total_kwh(self) -> float | None:
        """Measured energy of all attempts, kWh; None when nothing is measured or only part of the devices."""
        return en.joules_to_kwh(self.total_j) if self.complete else None

    @property
    def estimate(self) -> tuple[float, float] | None:
        """codecarbon's (CPU, RAM) estimate of all attempts, kWh; None without one."""
        if self.cpu_kwh is None:
            return None
        return self.prior_cpu_kwh + self.cpu_kwh, self.prior_ram_kwh + (self.ram_kwh or 0.0)

    def kg_co2e(self, kwh: float | None) -> float | None:
        """``kWh x intensity / 1000``; None without energy or intensity."""
        if kwh is None or self.intensity_g_per_kwh is None:
            return None
        return kwh * self.intensity_g_per_kwh / 1000.0

    def cost_usd(self, wall_s: float, device_s: float | None = None) -> float | None:
        """Cost of ``wall_s`` seconds (all attempts) on every device each attempt held (:meth:`device_s`;
        or of ``device_s`` device-seconds when given), plus priced measured energy."""
        if self.device_hour_usd is None:
            return None
        if self.usd_per_kwh and not self.complete:
            return None  # the energy part would price only the measured devices, or none (never 0 kWh)
        held = self.device_s(wall_s) if device_s is None else device_s
        return device_hours_cost_usd(device_hour_usd=self.device_hour_usd, device_hours=held / 3600.0,
                                     kwh=self.total_kwh if self.usd_per_kwh else 0.0, usd_per_kwh=self.usd_per_kwh)

    def absent(self) -> dict[str, str]:
        """``summary/*`` cost figures undefined for this run, with why (``llmeff.summary.absent``): with an
        energy price, a cost needs every device's energy; ``{}`` when the cost is given or unpriced."""
        if self.device_hour_usd is None or not self.usd_per_kwh or self.complete:
            return {}
        why = ("usd_per_kwh given but no energy is measured to price" if not self.measured else
               "usd_per_kwh given but only some devices' energy is measured (llmeff.energy.coverage)")
        return {names.SUM_COST_USD: why, names.SUM_USD_PER_BTOK: why}

    # ------------------------------------------------------------------------------ figures
    def totals(self, wall_s: float) -> dict[str, float]:
        """The cumulative interval keys at wall time ``wall_s``: energy, estimate, carbon, cost."""
        out: dict[str, float] = {}
        kwh = self.total_kwh
        if kwh is not None:
            out[names.ENERGY_TOTAL_KWH] = kwh
            kg = self.kg_co2e(kwh)
            if kg is not None:
                out[names.CARBON_TOTAL_KG] = kg
        est = self.estimate
        if est is not None:
            out[names.ENERGY_ESTIMATE_CPU_KWH], out[names.ENERGY_ESTIMATE_RAM_KWH] = est
            kg = self.kg_co2e(est[0] + est[1])
            if kg is not None:
                out[names.CARBON_ESTIMATE_KG] = kg
        usd = self.cost_usd(wall_s)
        if usd is not None:
            out[names.COST_TOTAL_USD] = usd
        return out

    def interval(self, wall_s: float, tokens: int) -> dict[str, float]:
        """Totals plus the average power per device and J per token since the energy counter last moved.

        An energy counter may update less often than the logging interval (NVML's total-energy counter
        on some boards): an interval in which it did not move read 0 W and the next one double. So the
        interval that moves the counter closes a span that starts where it last moved: its energy over
        the span's whole wall time (and tokens), ``W = (J - J_moved) / (t - t_moved) / devices``; an
        interval in which it has not moved (yet) leaves both keys out, with why in :attr:`interval_why`
        (``llmeff.interval.absent``), never 0 W. Totals are the counter's, untouched. Example
        (``tests/test_consumption.py``): a counter moving by 300 J every third 1 s interval on one device
        logs nothing at the first two intervals and 100 W at the third.
        """
        out = self.totals(wall_s)
        j = self.total_j
        self.interval_why = {}
        if self.measured and self._mark is not None:
            j0, tok0, t0 = self._mark
            if j == j0 and wall_s > t0:  # the counter has not moved: borrow from the interval that moves it
                self.interval_why = dict.fromkeys(
                    (names.ENERGY_DEVICE_AVG_POWER_W,) + ((names.ENERGY_J_PER_TOKEN,) if self.complete else ()),
                    "the energy counter did not move over the interval (it updates less often than the logging "
                    "interval on some boards): the power is given by the interval that next moves it, over the "
                    "whole span since it last moved")
                return out
            if wall_s > t0:  # per measured device: an average over the devices measured
                out[names.ENERGY_DEVICE_AVG_POWER_W] = en.average_power_w(j - j0, wall_s - t0, self.energy_devices)
            if tokens > tok0 and self.complete:
                out[names.ENERGY_J_PER_TOKEN] = en.j_per_token(j - j0, tokens - tok0)
        self._mark = (j, tokens, wall_s)
        return out

    def start_interval(self, wall_s: float, tokens: int) -> None:
        """Open the first interval (energy and tokens so far, at wall time ``wall_s``)."""
        self._mark = (self.total_j, tokens, wall_s)

    def summary(self, wall_s: float, tokens: int, device_tflops: float | None) -> dict[str, float]:
        """End-of-run ``summary/*`` consumption figures (keys of ``docs/metrics.md``).

        Args:
            wall_s: the run's wall time, all attempts, s.
            tokens: non-padding tokens trained on, all attempts.
            device_tflops: steady-state achieved model TFLOP/s per device (for TFLOP/s per W).
        """
        out: dict[str, float] = {}
        if self.coverage is not None:
            out[names.SUM_ENERGY_COVERAGE] = self.coverage
        if self.measured and self.span_s is not None:
            out[names.SUM_ENERGY_SPAN_S] = self.span_s
        kwh = self.total_kwh
        out[names.SUM_DEVICE_HOURS] = self.device_s(wall_s) / 3600.0
        usd = self.cost_usd(wall_s)
        if usd is not None:
            out[names.SUM_COST_USD] = usd
            if tokens:
                out[names.SUM_USD_PER_BTOK] = usd_per_billion_tokens(usd, tokens)
        if kwh is not None:
            out[names.SUM_ENERGY_KWH] = kwh
            if tokens:
                out[names.SUM_J_PER_TOKEN] = en.j_per_token(self.total_j, tokens)
                out[names.SUM_KWH_PER_BTOK] = en.kwh_per_billion_tokens(kwh, tokens)
            kg = self.kg_co2e(kwh)
            if kg is not None:
                out[names.SUM_KG_CO2E] = kg
                if tokens:
                    out[names.SUM_KG_CO2E_PER_BTOK] = kg * 1e9 / tokens
        if self.measured:  # per measured device, over the span the energy covers
            span = self.span_s if self.span_s else wall_s
            power = en.average_power_w(self.total_j, span, self.energy_devices) if span > 0 else 0.0
            if device_tflops is not None and power > 0:
                out[names.SUM_TFLOPS_PER_W] = en.tflops_per_w(device_tflops, power)
        elif self.estimate is not None:
            kg = self.kg_co2e(sum(self.estimate))
            if kg is not None:
                out[names.SUM_ESTIMATE_KG_CO2E] = kg
                if tokens:
                    out[names.SUM_ESTIMATE_KG_CO2E_PER_BTOK] = kg * 1e9 / tokens
        return out

    # ------------------------------------------------------------------------------ tags
    def tags(self, wall_s: float) -> dict[str, str]:
        """``llmeff.energy.coverage`` and ``llmeff.energy.span``: how many devices, and which wall span, the energy covers.

        Args:
            wall_s: ``summary/wall_s``, s.
        """
        out: dict[str, str] = {}
        if self.usd_per_kwh and not self.measured and self.device_hour_usd is not None:
            out[names.COST_USD_PER_KWH] = f"{self.usd_per_kwh:g} (cost/* omitted: no energy is measured to price)"
        if self.domains > 0:
            text = f"{min(self.measured_domains, self.domains)}/{self.domains} devices measured"
            if self.unmeasured:
                text += "; not measured: " + ", ".join(f"{d} ({why})" for d, why in self.unmeasured.items())
            if self.prior_partial:
                text += "; an earlier attempt of this run measured only some of its devices"
            if self.measured and not self.complete:
                text += ("; energy/total_kwh, energy/j_per_token, carbon/total_kg_co2e and summary/energy_kwh, "
                         "j_per_token, kwh_per_billion_tokens, kg_co2e, kg_co2e_per_billion_tokens are omitted, not "
                         "scaled: they would cover only the measured devices; energy/device/avg_power_w and "
                         "summary/tflops_per_w are per measured device")
                if self.usd_per_kwh:
                    text += "; cost/* omitted: its energy part (usd_per_kwh) would price only the measured devices"
                out[names.CARBON_ENERGY_BASIS] = ("partial measured energy (llmeff.energy.coverage): "
                                                  "carbon/total_kg_co2e not logged")
            for dev, ranks in self.shared.items():
                text += (f"; {dev} is owned by ranks {', '.join(map(str, ranks))} and counted once "
                         f"(read by rank {ranks[0]})")
            out[names.ENERGY_COVERAGE] = text
        if self.measured and self.span_s is not None:
            gap, end = self.head_gap_s, max(0.0, wall_s - (self.read_wall_s or 0.0))
            cost = "; cost/* covers all of summary/wall_s (devices x wall hours)"
            if gap + end <= 0.01:
                out[names.ENERGY_SPAN] = (f"energy/*, carbon/* and cost/* cover summary/wall_s ({wall_s:.3f} s; the "
                                          f"energy meter started {gap:.3f} s after the run's clock)")
            else:
                text = f"energy/* and carbon/* cover {self.span_s:.3f} s of the {wall_s:.3f} s of summary/wall_s"
                if gap > 0.0:
                    text += f": the first {gap:.3f} s (set-up before the energy meter started) are not measured"
                if end > 0.0:
                    text += (f"; the last {end:.3f} s (after the last reading every rank took part in) are "
                             "not measured")
                out[names.ENERGY_SPAN] = text + cost
        return out


class EnergyShare:
    """The energy devices this rank reports (each physical device is summed once over ranks,
    :func:`~mlflow_llmeff.meters.energy.device_owners`), gathered once per run and again when a device
    leaves the measurement.

    Attributes (read them; :meth:`gathered` and :meth:`check` change them):
        ids: the device ids this rank reports (None: not gathered yet).
    """

    __slots__ = ("ids", "_unmeasured")

    def __init__(self) -> None:
        self.ids: set[str] | None = None
        self._unmeasured: float | None = None  # devices left out over every rank, when last gathered

    def gathered(self, ids: set[str], unmeasured: float) -> None:
        """Every rank's devices were gathered: this rank reports ``ids``; ``unmeasured`` devices were left out."""
        self.ids, self._unmeasured = ids, unmeasured

    def check(self, unmeasured: float) -> bool:
        """``unmeasured`` devices are left out now (the sum over ranks); True, and the ids forgotten, when
        that is not the number gathered (a device left the measurement: gather again, on every rank)."""
        if unmeasured != self._unmeasured:
            self.ids = None
            return True
        return False

