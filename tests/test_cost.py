"""Cost: device-hour arithmetic pinned by hand, the dated default table, the assumptions as tags."""

from __future__ import annotations

import re

import pytest

from mlflow_llmeff import names
from mlflow_llmeff.calc.cost import (
    DEFAULT_DEVICE_HOUR_USD,
    cost_tags,
    device_hour_price,
    total_cost_usd,
    usd_per_billion_tokens,
)


def test_eight_devices_at_2_50_for_1_5_hours_over_10_billion_tokens_is_3_usd_per_billion():
    usd = total_cost_usd(device_hour_usd=2.50, devices=8, wall_s=1.5 * 3600)
    assert usd == 30.0  # 8 x 2.50 x 1.5
    assert usd_per_billion_tokens(usd, 10_000_000_000) == 3.0


def test_energy_price_adds_kwh_times_price():
    # 1 device x $2/h x 1 h + 10 kWh x $0.15 = 2 + 1.5
    assert total_cost_usd(device_hour_usd=2.0, devices=1, wall_s=3600, kwh=10.0, usd_per_kwh=0.15) == 3.5
    # kWh without a price is not priced
    assert total_cost_usd(device_hour_usd=2.0, devices=1, wall_s=3600, kwh=10.0) == 2.0


def test_user_price_wins_over_the_table():
    assert device_hour_price("H100-SXM", 1.75) == (1.75, "user (device_hour_usd)")


@pytest.mark.parametrize("short, usd", [("H100-SXM", 3.99), ("h100 pcie", 3.29), ("A100_80GB", 2.79), ("B200", 6.69), ("H200", 3.99)])
def test_default_table_by_exact_normalised_name(short, usd):
    price, source = device_hour_price(short, None)
    assert price == usd
    assert source.startswith("default table: ") and "https://" in source and "read 2026-11-30" in source


@pytest.mark.parametrize("short", ["H20", "cpu", "A100", "H100", "", "MI300X"])
def test_unknown_device_gets_no_invented_price(short):
    price, source = device_hour_price(short, None)
    assert price is None
    assert source == f"unknown: no default price for {short!r}; pass device_hour_usd"


def test_every_table_row_is_dated_and_sourced():
    for name, row in DEFAULT_DEVICE_HOUR_USD.items():
        assert row.usd > 0, name
        assert row.source.startswith("https://"), name
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", row.listed_on) and re.fullmatch(r"\d{4}-\d{2}-\d{2}", row.read_on), name


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(device_hour_usd=-1.0, devices=1, wall_s=1.0), r"device_hour_usd=-1.0 is not accepted"),
        (dict(device_hour_usd=1.0, devices=0, wall_s=1.0), r"devices=0 must be a positive count"),
        (dict(device_hour_usd=1.0, devices=1, wall_s=float("nan")), r"wall_s=nan must be"),
        (dict(device_hour_usd=1.0, devices=1, wall_s=1.0, usd_per_kwh=-0.1), r"usd_per_kwh=-0.1 is not accepted"),
    ],
)
def test_bad_inputs_are_rejected_by_name(kwargs, match):
    with pytest.raises(ValueError, match=match):
        total_cost_usd(**kwargs)


def test_tokens_must_be_positive():
    with pytest.raises(ValueError, match="tokens=0 must be a positive count"):
        usd_per_billion_tokens(1.0, 0)


def test_tags_carry_the_assumptions():
    price, source = device_hour_price("H100-SXM", None)
    assert cost_tags(price, source, 0.12) == {
        names.COST_DEVICE_HOUR_USD: "3.99",
        names.COST_SOURCE: source,
        names.COST_USD_PER_KWH: "0.12",
    }
    assert cost_tags(None, "unknown: x")[names.COST_USD_PER_KWH] == "none"


def test_table_keys_are_short_names_that_hardware_detection_produces():
    from mlflow_llmeff.meters.hardware import PEAK_TABLE

    shorts = {row.short for row in PEAK_TABLE}
    assert set(DEFAULT_DEVICE_HOUR_USD) <= shorts


def test_prices_command_lists_every_default_with_its_source():
    from click.testing import CliRunner

    from mlflow_llmeff.cli import main
    from mlflow_llmeff.calc.cost import DEFAULT_DEVICE_HOUR_USD

    out = CliRunner().invoke(main, ["prices"]).output
    for short, price in DEFAULT_DEVICE_HOUR_USD.items():
        line = next(line for line in out.splitlines() if line.startswith(short + " "))
        assert f"${price.usd:5.2f}" in line and price.source in line
