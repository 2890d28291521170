"""The package shows its pipeline: each folder imports only the folders before it, and no module imports itself back.

Read from the source with `ast` (nothing is imported), so the rules hold for code paths no test runs.

    leaves (errors, units, optim, interrupts, models)  <-  ir, machines  <-  frontend, cost  <-  passes  <-  runtime
        <-  checkpoint  <-  api  <-  integrations (optional libraries: transformers)  <-  pstar_fx/__init__.py

A module may import a module of its own folder or of a lower layer, never one of its layer or above (a leaf imports
nothing of pstar-fx); the runtime imports neither the frontend nor the passes. There is no import cycle between
modules, counting imports for type checking and inside functions too, but for one import inside a function within a
folder (TrainGraph.__str__ reaching the printer), the only such import there is.
"""
from __future__ import annotations

import ast
import os

import pytest

import pstar_fx

PACKAGE = os.path.dirname(pstar_fx.__file__)
LAYERS = {"errors": 0, "units": 0, "optim": 0, "interrupts": 0, "models": 0, "ir": 1, "machines": 1, "frontend": 2,
          "cost": 2,
          "passes": 3, "runtime": 4, "checkpoint": 5, "api": 6, "integrations": 7,
          "": 8}      # "": pstar_fx/__init__.py, which imports no integration (they import optional libraries)
FORBIDDEN = {"runtime": {"frontend", "passes"}}


def _modules() -> dict[str, str]:
    """Dotted module name -> file, for every module of the package."""
    out = {}
    for folder, _, files in os.walk(PACKAGE):
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(folder, f), os.path.dirname(PACKAGE))[:-3].replace(os.sep, ".")
                out[rel.removesuffix(".__init__")] = os.path.join(folder, f)
    return out


MODULES = _modules()


def _group(module: str) -> str:
    """The folder (or top-level module) a module belongs to: its layer's name."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _target(module: str, node: ast.ImportFrom, name: str) -> str | None:
    """The pstar_fx module an import of `name` from `node` reaches, or None outside the package."""
    if node.level:
        base = module.split(".")
        if not MODULES[module].endswith("__init__.py"):
            base = base[:-1]
        base = base[:len(base) - node.level + 1]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module or ""
    if source != "pstar_fx" and not source.startswith("pstar_fx."):
        return None
    whole = f"{source}.{name}"
    return whole if whole in MODULES else source


def _imports(module: str) -> list[tuple[str, bool]]:
    """(module imported, whether only inside a function) for each pstar_fx import of `module`."""
    tree = ast.parse(open(MODULES[module]).read())
    nested = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
              for n in ast.walk(f) if isinstance(n, (ast.Import, ast.ImportFrom))}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            targets = [_target(module, node, a.name) for a in node.names]
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names if a.name == "pstar_fx" or a.name.startswith("pstar_fx.")]
        else:
            continue
        out += [(t, id(node) in nested) for t in targets if t is not None and t != module]
    return out


EDGES = {m: _imports(m) for m in MODULES}


def test_the_layout_is_the_pipeline():
    """Every folder named in the layers exists and every module of the package belongs to one."""
    groups = {_group(m) for m in MODULES}
    assert groups == set(LAYERS), f"folders or top-level modules not in the layers: {sorted(groups ^ set(LAYERS))}"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_a_module_imports_only_lower_layers(module):
    mine = _group(module)
    wrong = []
    for target, _ in EDGES[module]:
        theirs = _group(target)
        if target == "pstar_fx" or (theirs != mine and (LAYERS[theirs] >= LAYERS[mine]
                                                         or theirs in FORBIDDEN.get(mine, ()))):
            wrong.append(target)
    assert not wrong, f"{module} (layer {mine or 'pstar_fx'}) imports {wrong}"


def test_no_import_cycles():
    """Tarjan's strongly connected components over every import (type-checking ones and those inside functions
    too), but for an import inside a function within one folder, which the next test allows once."""
    graph = {m: sorted({t for t, lazy in EDGES[m] if not (lazy and _group(t) == _group(m))}) for m in MODULES}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for m in sorted(graph):
        if m not in index:
            visit(m)
    assert not cycles, f"import cycles: {cycles}"


# modules that need an optional dependency, imported inside a function where it is there (runtime/device_adam.py)
NEEDS_OPTIONAL = {"pstar_fx.runtime.triton_adam"}      # Triton (torch's CUDA wheels bring it)


def test_imports_inside_functions_stay_in_their_folder():
    lazy = [(m, t) for m in MODULES for t, nested in EDGES[m] if nested and t not in NEEDS_OPTIONAL]
    assert all(_group(m) == _group(t) for m, t in lazy), f"imports inside functions across folders: {lazy}"
    assert len(lazy) <= 1, f"imports inside functions: {lazy}"
