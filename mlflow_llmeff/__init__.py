"""mlflow_llmeff: standard efficiency metrics and condition tags for LLM training runs in MLflow.

Cheap to import: heavy modules (torch, mlflow, transformers) load only when a function needs them.
``autolog``, ``EfficiencyMonitor``, ``active_monitor`` and ``pause`` are loaded on first access.
"""

__version__ = "0.1.0"

__all__ = ["__version__", "autolog", "EfficiencyMonitor", "active_monitor", "pause"]
_LAZY = {"autolog": "autologging", "active_monitor": "autologging", "pause": "autologging",
         "EfficiencyMonitor": "monitor.meter"}

#: Where the modules of the first, flat layout live now (docs/architecture.md): ``import
#: mlflow_llmeff.flops`` and ``from mlflow_llmeff.plan import make_plan`` in users' scripts keep working,
#: served by the module at its new path (the same module object, so patching it patches the real one).
MOVED = {
    "flops": "calc.flops", "throughput": "calc.throughput", "stability": "calc.stability",
    "goodput": "calc.goodput", "comm": "calc.comm", "cost": "calc.cost",
    "energy": "meters.energy", "hardware": "meters.hardware", "carbon": "meters.carbon",
    "contention": "meters.contention", "commprobe": "meters.commprobe", "collectives": "meters.collectives",
    "probes": "meters.probes", "flopcount": "meters.flopcount",
    "counting": "monitor.counting", "steptimes": "monitor.steptimes", "consumption": "monitor.consumption",
    "conditions": "monitor.conditions", "contention_meter": "monitor.contention", "lifecycle": "monitor.lifecycle",
    "plan": "planning.plan", "fit": "planning.fit", "report.predict": "planning.predict",
    "presets": "models.presets", "bytetok": "models.bytetok", "train.models": "models.build",
    "naming": "tracking.naming", "nvml_fake": "testing",
}


class _MovedFinder:
    """A ``sys.meta_path`` finder that serves an old module path with the module at its new one."""

    @staticmethod
    def find_spec(fullname, path=None, target=None):  # noqa: ARG004 - the finder protocol
        new = MOVED.get(fullname[len(__name__) + 1:]) if fullname.startswith(__name__ + ".") else None
        if new is None:
            return None
        import importlib.util

        return importlib.util.spec_from_loader(fullname, _MovedLoader(f"{__name__}.{new}"))


class _MovedLoader:
    def __init__(self, target: str):
        self.target = target

    def create_module(self, spec):  # noqa: ARG002
        import importlib

        return importlib.import_module(self.target)

    def exec_module(self, module):  # the module ran at its new path already
        pass


def _install_finder():
    import sys

    if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _MovedFinder())


_install_finder()


def _plain_warning(message, category, filename, lineno, line=None, *, _base=None):
    """One line for this package's own warnings (text starting ``mlflow_llmeff``): the message and its
    category, without Python's ``file:line:`` prefix and the echoed source line, which name our
    code, not the user's; every other warning is formatted as before (``_base``)."""
    text = str(message)
    if text.startswith("mlflow_llmeff"):
        return f"{text} ({category.__name__})\n"
    return _base(message, category, filename, lineno, line)


def _install_warning_format():
    import functools
    import warnings

    if getattr(warnings.formatwarning, "func", None) is not _plain_warning:
        warnings.formatwarning = functools.partial(_plain_warning, _base=warnings.formatwarning)


_install_warning_format()


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
