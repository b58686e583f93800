"""The house's rules, read from the code itself: layers, pure calculators, no import circles, file sizes.

Every module of ``mlflow_llmeff`` is parsed with :mod:`ast` (nothing of it runs); every import
counts, function-local ones too, since a lazy import is still a dependency. The layers and their
reasons are ``docs/architecture.md``.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

import mlflow_llmeff

PKG = "mlflow_llmeff"
ROOT = Path(mlflow_llmeff.__file__).parent

#: Lowest first: a module may import its own layer and the ones before it, never one after it.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("names", (f"{PKG}.names",)),
    ("calc", (f"{PKG}.calc",)),
    ("models", (f"{PKG}.models",)),
    ("meters", (f"{PKG}.meters",)),
    ("parallel", (f"{PKG}.parallel",)),
    ("planning", (f"{PKG}.planning",)),
    ("tracking", (f"{PKG}.tracking",)),
    ("evals", (f"{PKG}.evals",)),
    ("monitor", (f"{PKG}.monitor",)),
    ("report", (f"{PKG}.report",)),
    ("train", (f"{PKG}.train",)),
    ("entry points", (f"{PKG}.cli", f"{PKG}.autologging", f"{PKG}.testing", f"{PKG}.__main__", PKG)),
)

#: Third-party packages a layer may not import at all (not even inside a function).
FORBIDDEN = {
    "calc": ("torch", "mlflow", "psutil", "pynvml", "transformers", "accelerate", "deepspeed", "codecarbon"),
    "names": ("torch", "mlflow", "psutil", "pynvml", "transformers", "accelerate", "deepspeed", "codecarbon"),
    "meters": ("mlflow",),
}

#: At most this many modules at the top of the package besides its subpackages (issue 27).
MAX_TOP_MODULES = 6
#: No file longer than this (STYLE.md: a file that needs more than ~600 lines holds two concerns).
MAX_LINES = 700


def module_sources(root: Path = ROOT) -> dict[str, str]:
    """``{dotted module name: source}`` of every ``.py`` file under ``root`` (a package directory)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path.read_text()
    return out


def imports_of(module: str, source: str, known: set[str], is_package: bool = False) -> list[tuple[int, str]]:
    """``(line, imported name)`` for every import in ``source``: package modules resolved to the
    module they name (``from mlflow_llmeff.calc import flops`` is ``mlflow_llmeff.calc.flops``), other
    packages by their top-level name."""
    package = module if is_package else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for a in node.names:
                sub = f"{target}.{a.name}"
                found.append((node.lineno, sub if sub in known else target))
    return found


def layer_of(module: str) -> int | None:
    """Index in :data:`LAYERS` of the layer holding ``module`` (the longest matching prefix), or None."""
    best, best_len = None, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best_len and not (p == PKG and module != PKG):
                best, best_len = i, len(p)
    return best


def violations(sources: dict[str, str], packages: set[str] = frozenset()) -> list[str]:
    """Every broken rule in ``sources`` (``{module: source}``), one line each: an import of a higher
    layer, a forbidden third-party import, a module in no layer. ``packages``: the names that are
    packages (their relative imports resolve inside them)."""
    known = set(sources)
    out = []
    for mod, src in sorted(sources.items()):
        here = layer_of(mod)
        if here is None:
            out.append(f"{mod}: in no layer of tests/test_architecture.py LAYERS (docs/architecture.md says where it goes)")
            continue
        name = LAYERS[here][0]
        for line, target in imports_of(mod, src, known, mod in packages):
            if target == PKG or target == f"{PKG}.__version__":
                continue  # the package's door: __version__ and lazy attributes, nothing imported eagerly
            if target.startswith(PKG + "."):
                there = layer_of(target)
                if there is not None and there > here:
                    out.append(f"{mod}:{line} ({name}) imports {target} ({LAYERS[there][0]}), a higher layer")
            elif target.split(".")[0] in FORBIDDEN.get(name, ()):
                out.append(f"{mod}:{line} ({name}) imports {target.split('.')[0]}, which {name} may not import")
    return out


def circles(sources: dict[str, str], packages: set[str] = frozenset()) -> list[list[str]]:
    """Import circles between modules (strongly connected components of more than one module, or a
    module importing itself), by Tarjan's algorithm (1972)."""
    known = set(sources)
    graph = {m: sorted({t for _, t in imports_of(m, s, known, m in packages) if t in known and t != PKG})
             for m, s in sources.items()}
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph[v]:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _packages() -> set[str]:
    return {".".join(p.relative_to(ROOT.parent).parts[:-1]) for p in ROOT.rglob("__init__.py")}


def test_no_module_imports_a_higher_layer_or_a_forbidden_package():
    assert violations(module_sources(), _packages()) == []


def test_an_injected_violation_is_found():
    sources = module_sources()
    sources[f"{PKG}.calc.injected"] = "import math\n\ndef f():\n    import torch\n    from mlflow_llmeff.monitor import meter\n"
    sources[f"{PKG}.meters.injected"] = "from mlflow_llmeff.calc import flops\nimport mlflow.entities\n"
    sources[f"{PKG}.loose"] = "x = 1\n"
    found = [v for v in violations(sources, _packages()) if "injected" in v or "loose" in v]
    assert found == [
        f"{PKG}.calc.injected:4 (calc) imports torch, which calc may not import",
        f"{PKG}.calc.injected:5 (calc) imports {PKG}.monitor.meter (monitor), a higher layer",
        f"{PKG}.loose: in no layer of tests/test_architecture.py LAYERS (docs/architecture.md says where it goes)",
        f"{PKG}.meters.injected:2 (meters) imports mlflow, which meters may not import",
    ]


def test_no_import_circle_between_files():
    assert circles(module_sources(), _packages()) == []


def test_an_injected_circle_is_found():
    sources = {f"{PKG}.calc.a": "from mlflow_llmeff.calc import b\n", f"{PKG}.calc.b": "from . import c\n",
               f"{PKG}.calc.c": "def f():\n    from mlflow_llmeff.calc.a import g\n", f"{PKG}.calc": ""}
    assert circles(sources, {f"{PKG}.calc"}) == [[f"{PKG}.calc.a", f"{PKG}.calc.b", f"{PKG}.calc.c"]]


def test_no_file_is_longer_than_the_limit():
    long = {str(p.relative_to(ROOT.parent)): n for p in ROOT.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def test_the_top_of_the_package_holds_at_most_six_modules():
    top = sorted(p.name for p in ROOT.glob("*.py"))
    assert len(top) <= MAX_TOP_MODULES, top


def test_flops_and_the_throughput_interval_live_in_the_pure_calculators():
    from mlflow_llmeff.calc import flops, stability, throughput

    assert flops.__name__ == f"{PKG}.calc.flops" and hasattr(flops, "flops_per_token")
    assert stability.__name__ == f"{PKG}.calc.stability" and hasattr(stability, "throughput_interval")
    assert throughput.__name__ == f"{PKG}.calc.throughput"
    calc = {m: s for m, s in module_sources().items() if m.startswith(f"{PKG}.calc")}
    heavy = {(m, t) for m, s in calc.items() for _, t in imports_of(m, s, set(calc))
             if t.split(".")[0] in ("torch", "mlflow", "psutil", "pynvml")}
    assert heavy == set()


@pytest.mark.parametrize("old", sorted(mlflow_llmeff.MOVED))
def test_the_first_layouts_module_paths_still_import_the_same_module(old):
    assert importlib.import_module(f"{PKG}.{old}") is importlib.import_module(f"{PKG}.{mlflow_llmeff.MOVED[old]}")


def test_documented_import_paths_work():
    from mlflow_llmeff import EfficiencyMonitor, autolog  # noqa: F401
    from mlflow_llmeff.monitor import EfficiencyMonitor as from_monitor
    from mlflow_llmeff.monitor.meter import EfficiencyMonitor as from_meter
    from mlflow_llmeff.plan import make_plan
    from mlflow_llmeff.planning.plan import make_plan as planned

    assert EfficiencyMonitor is from_monitor is from_meter and make_plan is planned


def test_the_architecture_page_names_every_layer():
    page = (ROOT.parent / "docs" / "architecture.md").read_text()
    missing = [name for name, prefixes in LAYERS[:-1] if f"`{prefixes[0].removeprefix(PKG + '.')}" not in page]
    assert missing == []
