"""The house rules the package keeps about itself: public names that no import rebinds, files of a readable size,
and no development history in the product's words."""
from __future__ import annotations

import importlib
import inspect
import os
import pkgutil
import re

import pytest

import pstar_fx as px

ROOT = os.path.dirname(os.path.dirname(px.__file__))
MAX_LINES = 700
HISTORY = re.compile(r"\b(session|issue)s? #?[0-9]", re.IGNORECASE)
PUBLIC = {"compile", "CompiledStep", "Adam", "AdamW", "SGD", "Lion", "LionOptimizer", "optim_from_torch",
          "BudgetError", "DeviceMemoryError", "UntraceableError", "PstarError", "CommitError", "ModelHeldError",
          "CheckpointError", "DistributedError", "TrainGraph", "plot_memory", "init_empty", "EmptyModelError", "plan",
          "PlanReport", "sync_model"}


def _python_files(*folders: str) -> list[str]:
    out = []
    for folder in folders:
        for d, _, files in os.walk(os.path.join(ROOT, folder)):
            out += [os.path.join(d, f) for f in files if f.endswith(".py")]
    return sorted(out)


def test_importing_any_module_rebinds_no_public_name():
    """`import pstar_fx.api.plan` (or any module) leaves px.plan the function, px.compile the decorator, and every
    other public name what it was."""
    assert set(px.__all__) == PUBLIC
    before = {name: getattr(px, name) for name in px.__all__}
    for m in pkgutil.walk_packages(px.__path__, "pstar_fx."):
        try:
            importlib.import_module(m.name)
        except ModuleNotFoundError as e:      # an optional dependency's module (Triton's kernels) without it
            assert m.name == "pstar_fx.runtime.triton_adam" and e.name == "triton", (m.name, e)
    changed = [name for name in px.__all__ if getattr(px, name) is not before[name]]
    assert not changed, f"importing the package's modules rebound {changed}"
    assert inspect.isfunction(px.plan) and inspect.isfunction(px.compile)


@pytest.mark.parametrize("folder", ["pstar_fx", "tests", "examples"])
def test_no_module_is_over_700_lines(folder):
    long = {os.path.relpath(f, ROOT): n for f in _python_files(folder)
            if (n := sum(1 for _ in open(f, encoding="utf-8"))) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines (split them by concern): {long}"


@pytest.mark.parametrize("folder", ["pstar_fx", "tests", "examples"])
def test_no_development_history_in_the_code(folder):
    """Docstrings and comments state the contract and the why; where a run figure explains a constant it cites
    BENCHMARKS.md, not the work session that measured it."""
    hits = [f"{os.path.relpath(f, ROOT)}:{i}: {line.strip()}" for f in _python_files(folder)
            for i, line in enumerate(open(f, encoding="utf-8"), 1) if HISTORY.search(line)]
    assert not hits, "development history:\n" + "\n".join(hits)


def test_the_packaging_finds_every_package_and_the_command():
    """pyproject.toml finds the packages (every folder of pstar_fx is one) and `pstar-fx-plan` names a function."""
    text = open(os.path.join(ROOT, "pyproject.toml"), encoding="utf-8").read()
    assert re.search(r'^include = \["pstar_fx\*"\]$', text, re.M), "pyproject.toml must find pstar_fx's packages"
    folders = {d for d, _, files in os.walk(os.path.dirname(px.__file__))
               if any(f.endswith(".py") for f in files)}
    assert all(os.path.exists(os.path.join(d, "__init__.py")) for d in folders), "a folder that is no package"
    module, func = re.search(r'^pstar-fx-plan = "([\w.]+):(\w+)"$', text, re.M).groups()
    assert inspect.isfunction(getattr(importlib.import_module(module), func))


# the package's layers, lowest first: a module imports only from its own folder and those before it. The first five
# import nothing of pstar-fx's but each other's (units and errors); models is the reference GPT, torch only.
LAYERS = ["units", "errors", "interrupts", "optim", "models", "ir", "machines", "cost", "frontend", "passes", "runtime",
          "checkpoint", "api", "integrations"]
NEVER = {"runtime": {"frontend", "passes", "cost", "machines"}}   # the runtime runs a planned graph: it needs no planner


def _imported_parts(path: str, package: str) -> set[str]:
    """The top-level parts of pstar_fx (folders or modules) that the module at `path` imports."""
    import ast
    parts = set()
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")
            full = ".".join((base[:len(base) - node.level + 1] if node.level else []) +
                            ([node.module] if node.module else []))
            names = full.split(".")
            if names[0] == "pstar_fx":
                parts.update([names[1]] if len(names) > 1 else [a.name for a in node.names])
        elif isinstance(node, ast.Import):
            parts.update(a.name.split(".")[1] for a in node.names if a.name.startswith("pstar_fx."))
    return parts


def test_each_layer_imports_only_the_layers_below_it():
    """docs/design.md "The package": what both the planner and the runtime use lives below both, and the runtime never
    imports a pass."""
    package_dir = os.path.dirname(px.__file__)
    wrong = []
    for path in _python_files("pstar_fx"):
        rel = os.path.relpath(path, package_dir).split(os.sep)
        if rel == ["__init__.py"]:
            continue
        layer = rel[0] if len(rel) > 1 else rel[0][:-3]
        assert layer in LAYERS, f"{layer} is in no layer of the package: add it to LAYERS (and docs/design.md)"
        package = ".".join(["pstar_fx", *rel[:-1]])
        for part in _imported_parts(path, package) - {layer}:
            if part not in LAYERS or LAYERS.index(part) > LAYERS.index(layer) or part in NEVER.get(layer, ()):
                wrong.append(f"{os.path.relpath(path, ROOT)} imports {part}")
    assert not wrong, "imports against the layering:\n" + "\n".join(wrong)
