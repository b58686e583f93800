"""MLflow run context provider: condition tags on runs created while llmeff autolog is enabled."""

from __future__ import annotations

import logging
import os
import sys

log = logging.getLogger(__name__)

# (world size, strategy) -> tags; the accelerator and versions do not change within a process.
_CACHE: dict[tuple[int, str], dict[str, str]] = {}


def _autolog_enabled() -> bool:
    mod = sys.modules.get("mlflow_llmeff.autologging")  # never imported: autolog was never enabled
    return bool(mod is not None and mod.is_enabled())


def _world() -> int:
    torch = sys.modules.get("torch")
    try:
        if torch is not None and torch.distributed.is_available() and torch.distributed.is_initialized():
            return torch.distributed.get_world_size()
    except Exception:  # noqa: BLE001
        pass
    return int(os.environ.get("WORLD_SIZE", "1") or 1)


def _strategy(world: int) -> str:
    """The strategy Accelerate's launch environment names, else ddp or single (:func:`mlflow_llmeff.parallel.detect`)."""
    from mlflow_llmeff.parallel import detect

    return detect(None, world)


def condition_tags() -> dict[str, str]:
    """Accelerator, count, versions and parallelism tags of this process (cached)."""
    from mlflow_llmeff import names

    world = _world()
    strategy = _strategy(world)
    key = (world, strategy)
    if key not in _CACHE:
        from mlflow_llmeff.meters.hardware import detect_accelerator
        from mlflow_llmeff.meters.probes import software_versions

        local = int(os.environ.get("LOCAL_WORLD_SIZE", world) or world)
        tags = {**detect_accelerator(count=world).tags(), **software_versions()}
        tags.update({names.NODES: str(max(1, world // max(1, local))), names.PAR_STRATEGY: strategy,
                     names.PAR_DP: str(world), names.PAR_TP: "1", names.PAR_PP: "1", names.PAR_CP: "1"})
        _CACHE[key] = tags
    return dict(_CACHE[key])


class LlmeffRunContextProvider:
    """Tags runs with measurement conditions, only while ``mlflow_llmeff.autolog()`` is enabled.

    Cheap to construct and never raises into user code (MLflow calls it on every ``start_run``):
    when autolog was never enabled it only looks up ``sys.modules``; look-ups are cached.
    """

    def in_context(self) -> bool:
        try:
            return _autolog_enabled()
        except Exception:  # noqa: BLE001
            return False

    def tags(self) -> dict[str, str]:
        try:
            return condition_tags() if _autolog_enabled() else {}
        except Exception as e:  # noqa: BLE001 - never fail a user's start_run
            log.debug("llmeff context tags failed", exc_info=e)
            return {}
