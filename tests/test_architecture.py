"""The house's rules, read from the code itself: layers, pure calculators, no import circles, file sizes,
no reach into another object's private attributes.

Every module of ``mlflow_llmeff`` is parsed with :mod:`ast` (nothing of it runs); every import
counts, function-local ones too, since a lazy import is still a dependency. The layers and their
reasons are ``docs/architecture.md``.
"""

from __future__ import annotations

import ast
import functools
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

#: MLflow's fluent writes (``mlflow.log_metrics(...)``, ...): a call of one on the ``mlflow`` module is a write too.
FLUENT_WRITES = CLIENT_WRITES | frozenset({
    "log_metrics", "log_params", "set_tags", "log_table", "log_input", "log_inputs", "set_experiment_tags",
    "set_terminated"})
#: The one door (STYLE.md, "One door per outside system"): the only modules that call an MLflow write.
#: Every other module hands its writes to a writer (``RunLogger``, ``RunWriter``), which checks keys, masks
#: secrets, batches, and waits a bounded time; the background worker makes the calls.
WRITERS = {
    f"{PKG}.tracking.writer": "the writer: RunWriter, and the fluent run of a local store",
    f"{PKG}.tracking.worker": "the background worker: its thread delivers every call of a run in order",
    f"{PKG}.tracking.outbox": "the records the background worker delivers (and llmeff sync, from the outbox file)",
}

#: At most this many modules at the top of the package besides its subpackages (issue 27).
MAX_TOP_MODULES = 6
#: No file longer than this (STYLE.md: a file that needs more than ~600 lines holds two concerns).
MAX_LINES = 700


@functools.lru_cache(maxsize=None)
def _nodes(source: str) -> tuple[ast.AST, ...]:
    """Every node of ``source``'s syntax tree, in :func:`ast.walk`'s order: parsed once per distinct text.
    The tests read the package's ~160 files about twenty times each (0.75 s of CPU a pass, parsing and
    walking); a source with an injected line is another text, parsed anew. Nothing here changes a node.
    Emptied at the end of the module (:func:`_forget_trees`)."""
    return tuple(ast.walk(ast.parse(source)))


@pytest.fixture(scope="module", autouse=True)
def _forget_trees():
    """The trees :func:`_nodes` keeps (~60 MB) go with the module, not with the worker."""
    yield
    _nodes.cache_clear()


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
    for node in _nodes(source):
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
    """``(line, method)`` of every call of an MLflow client write (:data:`CLIENT_WRITES`) in ``source``, and
    of a fluent write on the ``mlflow`` module (:data:`FLUENT_WRITES`: ``mlflow.log_metrics(...)``), in line order."""
    found = []
    for n in _nodes(source):
        if not (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)):
            continue
        on_mlflow = isinstance(n.func.value, ast.Name) and n.func.value.id == "mlflow"
        if n.func.attr in CLIENT_WRITES or (on_mlflow and n.func.attr in FLUENT_WRITES):
            found.append((n.lineno, n.func.attr))
    return sorted(found)


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
        if mod not in WRITERS and mod not in apps:
            out += [f"{mod}:{line} ({name}) calls .{call}(), an MLflow write, outside the writer (tracking/writer.py "
                    "and the background worker: worker.py, outbox.py)" for line, call in client_writes(src)]
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
    door = "outside the writer (tracking/writer.py and the background worker: worker.py, outbox.py)"
    assert found == [
        f"{PKG}.report.injected:1 (report) imports mlflow; only tracking/ and the entry points may (every MLflow "
        "read and write goes through tracking/)",
        f"{PKG}.report.injected:5 (report) calls .log_metric(), an MLflow write, {door}",
        f"{PKG}.tracking.injected:5 (tracking) calls .set_tag(), an MLflow write, {door}",
        f"{PKG}.train.injected:5 (train) imports mlflow; only tracking/ and the entry points may (every MLflow "
        "read and write goes through tracking/)",
        f"{PKG}.train.injected:6 (train) calls .set_tag(), an MLflow write, {door}",
    ]
    assert server_apps() == {f"{PKG}.report.server", f"{PKG}.report.auth"}  # pyproject's mlflow.app factories
    assert "import mlflow" in "".join(sources[m] for m in server_apps()).replace("from mlflow", "import mlflow")


@pytest.mark.parametrize("module", ["train.launch", "tracking.runs", "tracking.logger", "cli", "autologging",
                                    "train.study"])
def test_an_injected_client_write_outside_the_writer_and_the_worker_fails(module):
    """One door to MLflow (issue 52): ``MlflowClient().set_tag`` (or a fluent ``mlflow.log_metrics``) added to
    any module but the writer and the background worker is a violation, even in tracking/ and the entry
    points, which may import mlflow; the same call in the writer is not."""
    sources = module_sources()
    name = f"{PKG}.{module}"
    lines = len(sources[name].splitlines())
    sources[name] += ("\n\ndef _injected(run_id):\n    from mlflow import MlflowClient\n\n"
                      "    MlflowClient().set_tag(run_id, 'k', 'v')\n    mlflow.log_metrics({'x': 1.0})\n")
    found = [v for v in violations(sources, _packages(), server_apps()) if v.startswith(f"{name}:")]
    assert [v.split(" calls ")[1].split(",")[0] for v in found if f":{lines + 6} " in v or f":{lines + 7} " in v] == [
        ".set_tag()", ".log_metrics()"]
    sources = module_sources()
    sources[f"{PKG}.tracking.writer"] += "\n\ndef _allowed(client, run_id):\n    client.set_tag(run_id, 'k', 'v')\n"
    assert violations(sources, _packages(), server_apps()) == []


def test_only_the_writer_and_the_worker_call_mlflow_writes():
    """Every module's MLflow writes, read from the code: none outside :data:`WRITERS`, and each of those
    still makes some (the list stays the truth)."""
    writes = {m: client_writes(s) for m, s in module_sources().items() if client_writes(s)}
    assert set(writes) - set(WRITERS) - server_apps() == set()
    assert set(WRITERS) - set(writes) == set()


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


#: The only places the package reaches into an object's private attributes (:func:`private_reaches`):
#: a third-party library's, where it offers no public way, each with why. ``(module under the
#: package, "<object>._<name>")``. Nothing of ours is here: the monitor's helpers work through the
#: public fields of :class:`~mlflow_llmeff.monitor.parts.Parts` and its components' methods (issue 40).
_COMPILED = "torch.compile's OptimizedModule keeps the compiled model as _orig_mod (no public accessor)"
_MLFLOW_VALIDATION = ("MLflow's key rules (mlflow.utils.validation) have no public per-kind validator; "
                      "keys.py checks they exist and falls back to MLflow 3.x rules without them")
_CODECARBON = "codecarbon gives no public running reading short of flush(), which also writes its outputs"
_ACTIVE_RUN = "MLflow's fluent active-run stack: a run made active (or released) without another request"
_PLOT_TEXTS = "matplotlib gives these Text artists (their extents, to keep labels inside the figure) no public getter"
_CPYTHON_EXIT = "interpreter exit's own order (threading's shutdown, then atexit), run by exit_now before os._exit"
PRIVATE_REACHES: dict[tuple[str, str], str] = {
    ("tracking.logger", "self.client.get_run(self.run_id).data._metric_objs"):
        "MLflow's RunData keeps the latest Metric entities of runs/get (step, timestamp) only here",
    ("autologging", "c._auto_end_run"): "transformers' MLflowCallback: whether it ends the run it opened",
    ("autologging.ray", "runner._monitor_thread"):
        "Ray Train V2's ThreadRunner joins it last in the thread running train_loop_per_worker: the only hook "
        "between the function's return and Ray's controller seeing it (then killing the process)",
    ("evals.scoring", "self.model._orig_mod"): _COMPILED,
    ("parallel", "m._orig_mod"): _COMPILED,
    ("monitor.conditions", "model._orig_mod"): _COMPILED,
    ("monitor.conditions", "m._orig_mod"): _COMPILED,
    ("monitor.conditions", "layers[marked[0]]._gradient_checkpointing_func"):
        "transformers keeps a layer's checkpointing function (and its use_reentrant) only here",
    ("models.build", "config._attn_implementation"): "transformers reads the attention kernel from this config field",
    ("monitor.account", "self.config._attn_implementation"): "transformers' attention kernel, as the model runs it",
    ("meters.memory", "config._attn_implementation"): "transformers' attention kernel, for llmeff.attention",
    ("monitor.memwatch", "cuda.memory._record_memory_history"):
        "torch's allocator history for an OOM snapshot (pytorch.org/docs torch_cuda_memory) has no public call",
    ("monitor.memwatch", "cuda.memory._dump_snapshot"): "torch's memory snapshot file (pytorch.org/memory_viz) has no public writer",
    ("monitor.counting", "x._version"): "torch's count of in-place writes to a tensor has no public accessor",
    ("monitor.steptimes", "Variable._execution_engine"):
        "torch's autograd engine: the end-of-backward callback (queue_callback, as DDP and FSDP use) has no public call",
    ("monitor.compiles", "torch._dynamo"):
        "torch's compile start and end callbacks (callback_handler, torch/_dynamo/callback.py) have no public "
        "torch.compiler call in torch 2.13; counters['recompiles'] would count without a time",
    ("monitor.steptimes", "optimizer._optimizer_step_pre_hooks"):
        "torch.optim: an optimizer that supports step hooks (a wrapper may not)",
    ("meters.commprobe", "func._opname"): "torch's OpOverload: the collective's bare name inside a dispatch mode",
    ("meters.flopcount", "count._get_raw"): "torch's FlopCounterMode protocol: a formula marked as taking tensors",
    ("meters.hardware", "torch._scaled_mm"): "torch's FP8 matmul (the measured FP8 peak) has no public op",
    ("meters.carbon", "tracker._start_time"): "codecarbon swallows its start's exceptions: a start time says it started",
    ("meters.carbon", "tracker._hardware"): "codecarbon's CPU reader, for the method it estimated with",
    ("meters.carbon", "hw._mode"): "codecarbon's CPU reader, for the method it estimated with",
    ("meters.carbon", "tracker._measure_power_and_energy_if_stale"): _CODECARBON,
    ("meters.carbon", "tracker._total_cpu_energy"): _CODECARBON,
    ("meters.carbon", "tracker._total_ram_energy"): _CODECARBON,
    ("monitor.lifecycle", "threading._register_atexit"): _CPYTHON_EXIT,
    ("monitor.lifecycle", "threading._shutdown"): _CPYTHON_EXIT,
    ("monitor.lifecycle", "atexit._run_exitfuncs"): _CPYTHON_EXIT,
    ("monitor.lifecycle", "os._exit"): "the standard library's documented exit without cleanup",
    ("report.plots", "ax._left_title"): _PLOT_TEXTS,
    ("report.plots", "ax._right_title"): _PLOT_TEXTS,
    ("report.plots", "fig._suptitle"): _PLOT_TEXTS,
    ("report.plots", "axis._update_ticks"): "matplotlib: the ticks inside the view (the ones drawn), no public call",
    ("tracking.keys", "v._validate_metric_name"): _MLFLOW_VALIDATION,
    ("tracking.keys", "v._validate_param_name"): _MLFLOW_VALIDATION,
    ("tracking.keys", "v._validate_tag_name"): _MLFLOW_VALIDATION,
    ("tracking.keys", "v._validate_length_limit"): _MLFLOW_VALIDATION,
    ("tracking.outbox", "d._to_mlflow_entity"): "mlflow.data's dataset has no public conversion to its entity",
    ("tracking.runs", "client._tracking_client"): "MlflowClient keeps its tracking URI only on its inner client",
    ("tracking.worker", "client._tracking_client"): "MlflowClient keeps its tracking URI only on its inner client",
    ("tracking.runs", "fluent._active_experiment_id"): "MLflow's fluent experiment set by mlflow.set_experiment",
    ("tracking.runs", "fluent._active_run_stack"): _ACTIVE_RUN,
    ("tracking.runs", "fluent._last_active_run_id"): _ACTIVE_RUN,
    ("train.data", "raw._fingerprint"): "Hugging Face datasets' content fingerprint has no public accessor",
    ("train.setup", "AcceleratorState._reset_state"):
        "accelerate's process-wide state keeps a first run's settings; its own tests reset it this way",
}

#: ``getattr(x, "_name")`` and its kin reach as far as ``x._name`` does.
_REFLECTION = ("getattr", "hasattr", "setattr", "delattr")


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _own_privates(nodes) -> set[str]:
    """The private attribute names a module gives its own classes (``nodes``: every node of its tree):
    methods and class attributes defined in a class body, and ``self._x`` / ``cls._x`` it assigns anywhere."""
    own = set()
    for node in nodes:
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    own.add(item.name)
                targets = (item.targets if isinstance(item, ast.Assign) else
                           [item.target] if isinstance(item, ast.AnnAssign) else [])
                own |= {t.id for t in targets if isinstance(t, ast.Name)}
        elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
              and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
            own.add(node.attr)
    return {name for name in own if _private(name)}


def private_reaches(source: str) -> list[tuple[int, str]]:
    """``(line, "<object>._<name>")`` of every reach into another object's private attribute in ``source``,
    in line order: ``x._name`` (read, written or called, and ``getattr(x, "_name")``, ``hasattr``,
    ``setattr``, ``delattr`` with a constant name) where ``x`` is not ``self`` or ``cls`` and ``_name``
    is not an attribute of a class the module itself defines (a module may touch its own classes'
    privates on any of their instances, as Python's convention has it). Dunder names are public."""
    nodes = _nodes(source)
    own = _own_privates(nodes)
    found = []
    for node in nodes:
        if isinstance(node, ast.Attribute):
            base, name = node.value, node.attr
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _REFLECTION
              and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
            base, name = node.args[0], node.args[1].value
        else:
            continue
        if not _private(name) or name in own or (isinstance(base, ast.Name) and base.id in ("self", "cls")):
            continue
        found.append((node.lineno, f"{ast.unparse(base)}.{name}"))
    return sorted(found)


def test_no_module_reaches_into_another_objects_private_attributes():
    """Components talk through public fields and methods (the monitor's helpers through
    :class:`~mlflow_llmeff.monitor.parts.Parts`); only a third-party library that offers no public way
    is reached into, each place named in :data:`PRIVATE_REACHES` with why."""
    found = [f"{module}:{line}: {reach}" for module, source in module_sources().items()
             for line, reach in private_reaches(source) if (module.removeprefix(PKG + "."), reach) not in PRIVATE_REACHES]
    assert found == []


def test_every_allowed_private_reach_is_still_made():
    """An entry of :data:`PRIVATE_REACHES` whose reach is gone is removed, so the list stays the truth."""
    made = {(module.removeprefix(PKG + "."), reach) for module, source in module_sources().items()
            for _, reach in private_reaches(source)}
    assert set(PRIVATE_REACHES) - made == set()


def test_an_injected_private_reach_is_found():
    source = (
        "class Meter:\n"
        "    def __init__(self):\n"
        "        self._count = 0\n"
        "\n"
        "    def merge(self, other):\n"
        "        self._count += other._count  # the module's own class: allowed\n"
        "        return type(self).__name__, self.__dict__\n"
        "\n"
        "\n"
        "def log(mon, p):\n"
        "    tokens = mon._tally.tokens  # another object's private\n"
        "    p.tally.take()  # a public field's public method: allowed\n"
        "    return getattr(mon, '_ledger', None), mon.parts._logger\n"
    )
    assert private_reaches(source) == [(11, "mon._tally"), (13, "mon._ledger"), (13, "mon.parts._logger")]


#: The monitor's Parts as its helper modules name it (``p``) and as the monitor holds it (``self._p``).
def _is_parts(node: ast.AST) -> bool:
    return ((isinstance(node, ast.Name) and node.id == "p")
            or (isinstance(node, ast.Attribute) and node.attr == "_p" and isinstance(node.value, ast.Name)
                and node.value.id == "self"))


#: Writes of a component's field from outside it, each with why it stays: ``(module, write)``.
COMPONENT_WRITES = {
    ("monitor.meter", "tally.micro"): "count() runs per micro-batch: a method call there is overhead issue 53 removes",
}


def component_writes(source: str) -> list[tuple[int, str]]:
    """``(line, target)`` of every write of a monitor component's field in ``source`` (issue 52: a component
    owns its fields, the others call its methods): ``p.<component>.<field> = ...`` (and ``+=``,
    ``p.<component>.<field>[k] = ...``), with ``self._p`` for ``p``, and the same through a local name bound
    to ``p.<component>`` in the function. A field of :class:`~mlflow_llmeff.monitor.parts.Parts` itself
    (``p.device = ...``) is no component's; a mutating call (``p.x.y.update(...)``) or a component
    handed in as an argument is not seen."""
    found = set()
    for fn in _nodes(source):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        aliases = set()
        for node in ast.walk(fn):
            if isinstance(node, ast.Assign):
                pairs = []
                for t in node.targets:
                    pairs += (zip(t.elts, node.value.elts) if isinstance(t, ast.Tuple) and isinstance(node.value, ast.Tuple)
                              else [(t, node.value)])
                aliases |= {t.id for t, v in pairs if isinstance(t, ast.Name) and isinstance(v, ast.Attribute)
                            and _is_parts(v.value)}
        for node in ast.walk(fn):
            if isinstance(node, (ast.Attribute, ast.Subscript)) and isinstance(node.ctx, ast.Store):
                base = node.value  # x.y = ... writes x's field; x.y[k] = ... writes into x's field
                if isinstance(node, ast.Subscript):
                    base = base.value if isinstance(base, ast.Attribute) else None
                if (isinstance(base, ast.Attribute) and _is_parts(base.value)) or (
                        isinstance(base, ast.Name) and base.id in aliases):
                    found.add((node.lineno, ast.unparse(node)))
    return sorted(found)


def _monitor_sources() -> dict[str, str]:
    return {m.removeprefix(PKG + "."): s for m, s in module_sources().items()
            if m.startswith((f"{PKG}.monitor.", f"{PKG}.autologging"))}


def test_no_monitor_module_writes_another_components_fields():
    """The monitor's run record is gone (issue 52): each of its concerns is a component of
    :class:`~mlflow_llmeff.monitor.parts.Parts` that owns its fields, and the helpers call its methods."""
    found = [f"{module}:{line}: {target}" for module, source in _monitor_sources().items()
             for line, target in component_writes(source) if (module, target) not in COMPONENT_WRITES]
    assert found == []
    made = {(module, target) for module, source in _monitor_sources().items() for _, target in component_writes(source)}
    assert set(COMPONENT_WRITES) - made == set()  # an allowed write that is gone leaves the list


def test_the_monitor_has_no_shared_run_record():
    """No ``RunRecord`` class and no ``p.record`` / ``self._p.record`` read in the monitor or autologging."""
    found = [f"{module}:{node.lineno}" for module, source in _monitor_sources().items()
             for node in _nodes(source)
             if (isinstance(node, ast.ClassDef) and node.name == "RunRecord")
             or (isinstance(node, ast.Attribute) and node.attr == "record" and _is_parts(node.value))]
    assert found == []


def test_an_injected_component_write_is_found():
    source = (
        "def edge(p, x):\n"
        "    p.device = x  # a field of Parts itself: allowed\n"
        "    p.window.steps = 0\n"
        "    p.last.metrics['a'] += 1\n"
        "    tally, n = p.tally, 3\n"
        "    tally.micro += n\n"
        "    p.reached.reach('k', 1)  # a method: allowed\n"
        "\n"
        "class M:\n"
        "    def step(self):\n"
        "        self._p.job.attempts = 2\n"
    )
    assert component_writes(source) == [(3, "p.window.steps"), (4, "p.last.metrics['a']"), (6, "tally.micro"),
                                        (11, "self._p.job.attempts")]


def test_the_architecture_page_names_every_layer():
    page = (ROOT.parent / "docs" / "architecture.md").read_text()
    missing = [name for name, prefixes in LAYERS[:-1] if f"`{prefixes[0].removeprefix(PKG + '.')}" not in page]
    assert missing == []
