"""The mlflow.run_context_provider plugin: condition tags only while autolog is enabled, cached, never raising."""

from __future__ import annotations

import importlib

import mlflow
import pytest

import mlflow_llmeff
from mlflow_llmeff import names
from mlflow_llmeff.tracking import context
from mlflow_llmeff.tracking.context import LlmeffRunContextProvider


@pytest.fixture
def tracking(tracking_uri):
    yield tracking_uri
    if "mlflow_llmeff.autologging" in importlib.sys.modules:
        mlflow_llmeff.autolog(disable=True)


def test_the_entry_point_names_the_provider():
    from importlib.metadata import entry_points

    eps = {e.value for e in entry_points(group="mlflow.run_context_provider")}
    assert "mlflow_llmeff.tracking.context:LlmeffRunContextProvider" in eps


def test_runs_get_condition_tags_only_while_autolog_is_enabled(tracking):
    with mlflow.start_run() as before:
        pass
    mlflow_llmeff.autolog(measure_energy="none")
    with mlflow.start_run() as during:
        pass
    mlflow_llmeff.autolog(disable=True)
    with mlflow.start_run() as after:
        pass
    client = mlflow.MlflowClient()
    tags = {r.info.run_id: client.get_run(r.info.run_id).data.tags for r in (before, during, after)}
    assert not any(k.startswith("llmeff.") for k in tags[before.info.run_id])
    assert not any(k.startswith("llmeff.") for k in tags[after.info.run_id])
    t = tags[during.info.run_id]
    assert (t[names.ACCEL_SHORT], t[names.ACCEL_COUNT], t[names.PAR_STRATEGY], t[names.PAR_DP]) == ("cpu", "1", "single", "1")
    assert t[names.V_MLFLOW] == mlflow.__version__


def test_in_context_is_false_without_autolog(monkeypatch):
    import types

    p = LlmeffRunContextProvider()
    # never imported (whatever other tests of this process did), then imported but not enabled
    monkeypatch.delitem(importlib.sys.modules, "mlflow_llmeff.autologging", raising=False)
    assert p.in_context() is False and p.tags() == {}
    off = types.SimpleNamespace(is_enabled=lambda: False)
    monkeypatch.setitem(importlib.sys.modules, "mlflow_llmeff.autologging", off)
    assert p.in_context() is False and p.tags() == {}


def test_lookups_are_cached_and_failures_give_no_tags(monkeypatch):
    calls = []
    import mlflow_llmeff.meters.hardware as hw

    real = hw.detect_accelerator
    monkeypatch.setattr(hw, "detect_accelerator", lambda **kw: calls.append(kw) or real(**kw))
    monkeypatch.setattr(context, "_CACHE", {})
    monkeypatch.setattr(context, "_autolog_enabled", lambda: True)
    p = LlmeffRunContextProvider()
    first, second = p.tags(), p.tags()
    assert first == second and len(calls) == 1
    monkeypatch.setattr(context, "condition_tags", lambda: 1 / 0)
    assert p.tags() == {}


def test_ddp_world_size_and_accelerate_fsdp_environment_set_the_parallelism(monkeypatch):
    monkeypatch.setattr(context, "_CACHE", {})
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    t = context.condition_tags()
    assert (t[names.ACCEL_COUNT], t[names.PAR_STRATEGY], t[names.NODES]) == ("4", "ddp", "2")
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    assert context.condition_tags()[names.PAR_STRATEGY] == "fsdp"
