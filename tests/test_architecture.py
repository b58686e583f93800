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

#: Third-party packages only these layers may import: every MLflow read and write goes through tracking/
#: (the entry points too may; docs/architecture.md). The MLflow server app factories pyproject.toml
#: registers (:func:`server_apps`) extend MLflow's own server and import it as well.
ONLY_IN = {"mlflow": ("tracking", "entry points")}
#: ``MlflowClient`` writes no object of ours shares a name with (our logger's and meter's are plural:
#: ``set_tags``, ``log_metrics``): a call of one outside tracking/ writes to MLflow past it, whatever the
#: client came from.
CLIENT_WRITES = frozenset({
    "set_tag", "log_param", "log_metric", "log_batch", "create_run", "set_terminated", "update_run", "delete_run",
    "delete_tag", "log_text", "log_artifact", "log_artifacts", "log_dict", "log_figure", "log_image",
    "create_experiment", "set_experiment_tag", "start_run", "end_run"})

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


def _string_import(node: ast.Call, package: str) -> str | None:
    """The module an ``importlib.import_module(...)`` / ``import_module(...)`` / ``__import__(...)`` call
    names: its constant argument (a relative one against ``package`` when given ``__name__``); ``""``
    for a name made relative to the module's own (``f"{__name__}.{sub}"``: a package finding its own
    modules); :data:`DYNAMIC` for any other argument; None for another call."""
    f = node.func
    called = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
    if called not in ("import_module", "__import__") or not node.args:
        return None
    if isinstance(f, ast.Attribute) and not (isinstance(f.value, ast.Name) and f.value.id == "importlib"):
        return None
    arg = node.args[0]
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        if arg.value.startswith("."):
            return package + arg.value if len(node.args) > 1 else DYNAMIC
        return arg.value
    if isinstance(arg, ast.JoinedStr) and arg.values and isinstance(arg.values[0], ast.FormattedValue) \
            and isinstance(arg.values[0].value, ast.Name) and arg.values[0].value.id == "__name__":
        return ""
    return DYNAMIC


#: What :func:`imports_of` gives for an import whose module is computed at run time.
DYNAMIC = "<a module computed at run time>"


def imports_of(module: str, source: str, known: set[str], is_package: bool = False) -> list[tuple[int, str]]:
    """``(line, imported name)`` for every import in ``source``: package modules resolved to the
    module they name (``from mlflow_llmeff.calc import flops`` is ``mlflow_llmeff.calc.flops``; a name
    taken from the package itself, ``from mlflow_llmeff import X``, is ``mlflow_llmeff.X``), other
    packages by their top-level name; string imports (``importlib.import_module("x")``,
    ``__import__("x")``) as the module they name, :data:`DYNAMIC` where it is computed."""
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
                found.append((node.lineno, sub if sub in known or target == PKG else target))
        elif isinstance(node, ast.Call):
            named = _string_import(node, module)
            if named:
                found.append((node.lineno, named))
    return found


def client_writes(source: str) -> list[tuple[int, str]]:
    """``(line, method)`` of every call of an MLflow client write (:data:`CLIENT_WRITES`) in ``source``."""
    return [(n.lineno, n.func.attr) for n in ast.walk(ast.parse(source))
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in CLIENT_WRITES]


def server_apps() -> set[str]:
    """The modules of the MLflow server app factories pyproject.toml registers (``mlflow.app`` entry points)."""
    import tomllib

    project = tomllib.loads((ROOT.parent / "pyproject.toml").read_text())["project"]
    return {v.split(":")[0] for v in project.get("entry-points", {}).get("mlflow.app", {}).values()}


def layer_of(module: str) -> int | None:
    """Index in :data:`LAYERS` of the layer holding ``module`` (the longest matching prefix), or None."""
    best, best_len = None, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best_len and not (p == PKG and module != PKG):
                best, best_len = i, len(p)
    return best


def violations(sources: dict[str, str], packages: set[str] = frozenset(), apps: set[str] = frozenset()) -> list[str]:
    """Every broken rule in ``sources`` (``{module: source}``), one line each: an import of a higher
    layer, a forbidden third-party import, ``mlflow`` outside tracking/ and the entry points (``apps``:
    the MLflow server app factories, which may) or an MLflow client write there, a name taken from the
    package's door, a module that is not there (a path of the first layout, ``mlflow_llmeff.MOVED``), an
    import computed at run time, a module in no layer. ``packages``: the names that are packages (their
    relative imports resolve inside them)."""
    import mlflow_llmeff

    known = set(sources)
    out = []
    for mod, src in sorted(sources.items()):
        here = layer_of(mod)
        if here is None:
            out.append(f"{mod}: in no layer of tests/test_architecture.py LAYERS (docs/architecture.md says where it goes)")
            continue
        name = LAYERS[here][0]
        for line, target in imports_of(mod, src, known, mod in packages):
            if target in (PKG, f"{PKG}.__version__") or mod == PKG:
                continue  # the package's version; the door itself serves its lazy names and old paths
            if target == DYNAMIC:
                out.append(f"{mod}:{line} ({name}) imports a module computed at run time; import it by name")
            elif target.startswith(PKG + ".") and target not in known:
                old = target[len(PKG) + 1:]
                if old in mlflow_llmeff.MOVED:
                    out.append(f"{mod}:{line} ({name}) imports {target}, the first layout's path of "
                               f"{PKG}.{mlflow_llmeff.MOVED[old]}; import the module where it is")
                elif target.rpartition(".")[0] == PKG:
                    out.append(f"{mod}:{line} ({name}) imports {old} from the package's door ({PKG}/__init__.py); "
                               "import it from its module")
                else:
                    out.append(f"{mod}:{line} ({name}) imports {target}, which is no module of the package")
            elif target.startswith(PKG + "."):
                there = layer_of(target)
                if there is not None and there > here:
                    out.append(f"{mod}:{line} ({name}) imports {target} ({LAYERS[there][0]}), a higher layer")
            elif target.split(".")[0] in FORBIDDEN.get(name, ()):
                out.append(f"{mod}:{line} ({name}) imports {target.split('.')[0]}, which {name} may not import")
            elif name not in ONLY_IN.get(target.split(".")[0], (name,)) and mod not in apps:
                out.append(f"{mod}:{line} ({name}) imports {target.split('.')[0]}; only tracking/ and the entry "
                           "points may (every MLflow read and write goes through tracking/)")
        if name not in ONLY_IN["mlflow"] and mod not in apps:
            out += [f"{mod}:{line} ({name}) calls .{call}(), an MLflow client write, outside tracking/"
                    for line, call in client_writes(src)]
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
    assert violations(module_sources(), _packages(), server_apps()) == []


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


def test_only_tracking_and_the_entry_points_talk_to_mlflow():
    """An injected ``import mlflow; mlflow.log_metric(...)`` in report/ or train/ fails, however it is
    imported (a string import too), and so does a client write there; the server apps may import it."""
    sources = module_sources()
    sources[f"{PKG}.report.injected"] = "import mlflow\n\n\ndef f():\n    mlflow.log_metric('x', 1.0)\n"
    sources[f"{PKG}.train.injected"] = ("import importlib\n\n\ndef f(client, run_id):\n"
                                        "    importlib.import_module('mlflow.tracking').MlflowClient()\n"
                                        "    client.set_tag(run_id, 'k', 'v')\n")
    sources[f"{PKG}.tracking.injected"] = "import mlflow\n\n\ndef f(client):\n    client.set_tag('r', 'k', 'v')\n"
    found = [v for v in violations(sources, _packages(), server_apps()) if "injected" in v]
    assert found == [
        f"{PKG}.report.injected:1 (report) imports mlflow; only tracking/ and the entry points may (every MLflow "
        "read and write goes through tracking/)",
        f"{PKG}.report.injected:5 (report) calls .log_metric(), an MLflow client write, outside tracking/",
        f"{PKG}.train.injected:5 (train) imports mlflow; only tracking/ and the entry points may (every MLflow "
        "read and write goes through tracking/)",
        f"{PKG}.train.injected:6 (train) calls .set_tag(), an MLflow client write, outside tracking/",
    ]
    assert server_apps() == {f"{PKG}.report.server", f"{PKG}.report.auth"}  # pyproject's mlflow.app factories
    assert "import mlflow" in "".join(sources[m] for m in server_apps()).replace("from mlflow", "import mlflow")


def test_imports_that_bypass_the_layers_are_found():
    """The package's door, a first-layout path (mlflow_llmeff.MOVED) and string imports hide the layer
    a module comes from; each is a violation, the layer rule applying to string imports by name."""
    sources = module_sources()
    sources[f"{PKG}.meters.injected"] = "from mlflow_llmeff import EfficiencyMonitor\nimport mlflow_llmeff.flops\n"
    sources[f"{PKG}.calc.injected"] = ("import importlib\n\n\ndef f(name):\n"
                                       "    importlib.import_module('mlflow_llmeff.monitor.meter')\n"
                                       "    __import__('torch')\n    return __import__(name)\n")
    sources[f"{PKG}.parallel.injected"] = "from mlflow_llmeff.report.predict import x\nimport mlflow_llmeff.calc.nope\n"
    found = [v for v in violations(sources, _packages(), server_apps()) if "injected" in v]
    assert found == [
        f"{PKG}.calc.injected:5 (calc) imports {PKG}.monitor.meter (monitor), a higher layer",
        f"{PKG}.calc.injected:6 (calc) imports torch, which calc may not import",
        f"{PKG}.calc.injected:7 (calc) imports a module computed at run time; import it by name",
        f"{PKG}.meters.injected:1 (meters) imports EfficiencyMonitor from the package's door "
        f"({PKG}/__init__.py); import it from its module",
        f"{PKG}.meters.injected:2 (meters) imports {PKG}.flops, the first layout's path of {PKG}.calc.flops; "
        "import the module where it is",
        f"{PKG}.parallel.injected:1 (parallel) imports {PKG}.report.predict, the first layout's path of "
        f"{PKG}.planning.predict; import the module where it is",
        f"{PKG}.parallel.injected:2 (parallel) imports {PKG}.calc.nope, which is no module of the package",
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
