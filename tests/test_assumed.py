"""A guess the program makes for the user is recorded where the figures are, not only on stderr
(issue 28): ``llmeff.assumed`` on the run (a list price, the default grid country, PUE 1, a precision
read off the parameters), the plan's ``assumed`` field and its run's tag (an accelerator alias, auto
precision on another machine, a list price), and a footnote of the comparison naming the
configurations each assumption holds for."""

from __future__ import annotations

import json

import mlflow
import pytest

from mlflow_llmeff import names
from mlflow_llmeff.meters import hardware as hw
from mlflow_llmeff.meters.carbon import CarbonTracker, FakeCarbonTracker
from mlflow_llmeff.monitor.meter import EfficiencyMonitor

from conftest import empty_store, use_store

H100 = hw.AcceleratorInfo("NVIDIA H100 80GB HBM3", "H100-SXM", 1, 79.2, "Hopper", None, None, "cuda")
LAMBDA_SRC = ("default table: Lambda on-demand 8x NVIDIA H100 SXM, per GPU, https://lambda.ai/instances "
              "(listed 2026-09-20, read 2026-11-30)")
LAMBDA_H100 = f"3.99 USD per device-hour ({LAMBDA_SRC}: pass device_hour_usd for yours)"
PUE = "1 (carbon/* is the devices' energy x grid intensity: no data-centre cooling or power delivery overhead)"


@pytest.fixture(scope="module")
def module_store(tmp_path_factory):
    return empty_store(tmp_path_factory.mktemp("mlflow") / "mlflow.db")


@pytest.fixture
def tracking_uri(module_store, monkeypatch):
    yield from use_store(module_store, monkeypatch)


def _run(model=None, **kw):
    t = [0.0]
    mon = EfficiencyMonitor(clock=lambda: t[0], log_every_n_steps=10, warmup_steps=1, measure_energy="none",
                            measure_peak=False, report=False, model=model, **kw)
    for _ in range(3):
        t[0] += 0.01
        mon.step(tokens=100)
    mon.finish()
    return mlflow.MlflowClient().get_run(mon.run_id).data.tags


def test_a_list_price_pue_and_a_precision_nobody_gave_are_in_the_run_tags(tracking_uri, monkeypatch):
    monkeypatch.setattr(hw, "detect_accelerator", lambda count=1, device_type=None: H100)
    tags = _run(carbon_tracker=FakeCarbonTracker(400.0))
    assert tags[names.COST_DEVICE_HOUR_USD] == "3.99"
    assert tags[names.ASSUMED] == ("precision: fp32 (no model to read a dtype from: pass precision=); "
                                   f"device_hour_usd: {LAMBDA_H100}; pue: {PUE}")


def test_what_the_user_gave_is_not_an_assumption(tracking_uri, monkeypatch):
    import torch

    monkeypatch.setattr(hw, "detect_accelerator", lambda count=1, device_type=None: H100)
    tags = _run(device_hour_usd=2.0, precision="bf16")  # no carbon (measure_energy=none): no grid assumed
    assert names.ASSUMED not in tags and tags[names.COST_SOURCE] == "user (device_hour_usd)"
    tags = _run(model=torch.nn.Linear(4, 4), device_hour_usd=2.0)  # a loop that may run under autocast
    assert tags[names.ASSUMED] == ("precision: fp32 (read off the model parameters' dtype; matmuls under "
                                   "torch.autocast run in the autocast dtype instead: then pass precision=)")


def test_the_grid_country_is_assumed_only_when_no_place_is_given():
    from mlflow_llmeff.meters.carbon import resolve_location

    assert resolve_location(None) == ("USA", "USA (no country_iso_code or cloud region given, so carbon uses "
                                              "codecarbon's USA grid intensity: pass country_iso_code)")
    assert resolve_location("FRA") == ("FRA", None)
    assert resolve_location(None, "gcp", "us-central1") == (None, None)  # codecarbon's cloud table decides
    ct = CarbonTracker(env={})  # not started: no intensity yet, so no PUE applied yet
    assert ct.country_iso_code == "USA" and ct.assumptions() == {"country_iso_code": resolve_location(None)[1]}
    ct.intensity_g_per_kwh = 369.5  # as start() sets it
    assert ct.assumptions()["pue"] == PUE
    assert CarbonTracker(country_iso_code="FRA", env={}).assumptions() == {}
    assert CarbonTracker(enabled=False, env={}).assumptions() == {}  # no carbon figures, nothing assumed
    ct._disable("codecarbon is not installed (No module named 'codecarbon')")  # as start() does without it
    assert ct.assumptions() == {}


def _plan(capsys, accelerator, **cfg):
    from mlflow_llmeff.train.config import TrainConfig
    from mlflow_llmeff.train.launch import dry_run

    assert dry_run(TrainConfig(model="llama-tiny", **cfg), accelerator_short=accelerator, as_json=True) == 0
    return json.loads(capsys.readouterr().out)


def test_the_plan_json_names_every_assumption_and_the_price_it_used(tracking_uri, capsys):
    plan = _plan(capsys, "H100")
    assert plan["assumed"] == {
        "accelerator": "'H100' taken as H100-SXM (also: H100-NVL, H100-PCIe)",
        "precision": "auto taken as bf16 (H100-SXM datasheet lists bf16 matrix units, not probed: llmeff train "
                     "resolves auto on the machine itself)",
        "device_hour_usd": LAMBDA_H100}
    assert (plan["device_hour_usd"], plan["device_hour_usd_source"]) == (3.99, LAMBDA_SRC)
    # Volta has no bf16 matrix units: auto is fp32 there (it was taken as bf16 on every accelerator)
    plan = _plan(capsys, "V100-SXM2", device_hour_usd=1.5)
    assert plan["precision"] == "fp32" and set(plan["assumed"]) == {"precision"}
    assert plan["assumed"]["precision"].startswith("auto taken as fp32 (V100-SXM2 datasheet lists no bf16")
    assert (plan["device_hour_usd"], plan["device_hour_usd_source"]) == (1.5, "user (device_hour_usd)")
    plan = _plan(capsys, "H100-SXM", precision="bf16", device_hour_usd=1.5)
    assert plan["assumed"] == {}


def test_the_plan_run_carries_the_assumptions_as_a_tag(tracking_uri, capsys, monkeypatch):
    client = mlflow.MlflowClient()
    run_id = client.create_run("0").info.run_id
    monkeypatch.setenv("MLFLOW_RUN_ID", run_id)
    plan = _plan(capsys, "H100", precision="bf16")
    tags = client.get_run(run_id).data.tags
    assert tags[names.ASSUMED] == ("accelerator: 'H100' taken as H100-SXM (also: H100-NVL, H100-PCIe); "
                                   f"device_hour_usd: {LAMBDA_H100}")
    assert set(plan["assumed"]) == {"accelerator", "device_hour_usd"}


def test_the_comparison_footnotes_name_each_assumption_and_whom_it_holds_for():
    from mlflow_llmeff.report.calc import RunRecord
    from mlflow_llmeff.report.headline import headline
    from mlflow_llmeff.report.repeats import configurations

    country = "country_iso_code: USA (no country_iso_code or cloud region given, ...)"
    price = "device_hour_usd: 3.99 USD per device-hour (default table: ...)"

    def run(i, count, assumed):
        return RunRecord(f"{i:032d}", f"run-{i}", metrics={names.SUM_DEVICE_TOKENS_PER_SEC: 100.0 + i}, tags={
            names.ACCEL_SHORT: "H100-SXM", names.ACCEL_COUNT: count, names.STABILITY: "stable",
            names.ASSUMED: assumed})

    runs = [run(1, "1", f"{country}; {price}"), run(2, "1", f"{country}; {price}"), run(3, "2", country)]
    h = headline(configurations(runs))
    assert h.footnotes[-2:] == [f"assumed (llmeff.assumed) for every configuration: {country}",
                                f"assumed (llmeff.assumed) for run-1 (+1 repeat): {price}"]


def test_the_terminal_says_what_was_assumed_not_only_the_tag():
    from mlflow_llmeff.monitor.assembly import assumed_line

    ct = CarbonTracker(env={})  # no country, no cloud region: the USA's grid
    ct.intensity_g_per_kwh = 369.5  # as start() sets it: PUE 1 is then assumed too
    found = {"precision": "fp32 (no model to read a dtype from: pass precision=)",
             "device_hour_usd": LAMBDA_H100, **ct.assumptions()}
    assert assumed_line(found) == ("assumed for you: precision fp32, device_hour_usd 3.99 USD per device-hour, "
                                   "country_iso_code USA, pue 1 (why and how to give yours: tag llmeff.assumed)")
    assert assumed_line({}) is None  # nothing assumed: no line
