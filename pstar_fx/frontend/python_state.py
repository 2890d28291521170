"""The Python values a trace depends on besides its tensors and arguments, so that a change retraces.

A compiled step runs no Python: whatever plain Python value the step read while it was traced is fixed in the graph.
Eager code reads it anew at every call, so a value the user changes between steps (a loss weight in a closure or a
global, a module's `temperature`, `nn.Dropout.p`, a step counter a branch reads) must retrace, as a changed argument
does. Two keys cover what a trace can be seen to read:

- `module_scalars(m)`: a module's public attributes holding a bool, int, float, str or None (or a tuple of them):
  `Dropout.p`, `LayerNorm.eps`, a user's `temperature`. Part of `Compiler.model_key`.
- `closure_key(fn)`: the step function's closure cells and the globals its code names, where they hold such a value,
  or a dict, list or tuple of at most `CONTAINER_ITEMS` of them (`state["step"]`). Values read only by other
  functions the step calls are not seen (docs/tracing.md says so).

NaN keys equal themselves here (a NaN weight would otherwise retrace at every call). `python_draws()` tells whether a
trace drew from Python's or NumPy's global random generators: a compiled step would replay the trace's draw at every
call (LayerDrop by `random.random()`), so the trace refuses it.
"""
from __future__ import annotations

import contextlib
import functools
import math
import random
import sys
from typing import Callable, Iterator

import torch.nn as nn

CONTAINER_ITEMS = 64    # a closure's or global's dict, list or tuple is keyed by value up to this many items

_SCALARS = (bool, int, float, str, type(None))
_PLAIN = frozenset(_SCALARS)


def _scalar(v):
    """v as a key, if it is a plain scalar (or a tuple of them); None otherwise. NaN becomes a string (NaN != NaN)."""
    t = type(v)
    if t is float:
        return "nan" if math.isnan(v) else v
    if t in _SCALARS:
        return (t.__name__, v) if t is bool else v
    if t is tuple and len(v) <= CONTAINER_ITEMS and all(type(x) in _SCALARS for x in v):
        return tuple(_scalar(x) for x in v)
    return None


_NOT_SCALAR = object()


def _value_key(v):
    """A closure or global value as a key: a scalar, or a small container of scalars (by value); _NOT_SCALAR else."""
    k = _scalar(v)
    if k is not None or v is None:
        return k
    if type(v) in (list, tuple) and len(v) <= CONTAINER_ITEMS:
        keys = [_scalar(x) for x in v]
        if all(k is not None or x is None for k, x in zip(keys, v)):
            return (type(v).__name__, tuple(keys))
    if type(v) is dict and len(v) <= CONTAINER_ITEMS:
        items = []
        for key, x in v.items():
            kx = _scalar(x)
            if (kx is None and x is not None) or _scalar(key) is None:
                return _NOT_SCALAR
            items.append((_scalar(key), kx))
        return ("dict", tuple(items))
    return _NOT_SCALAR


def module_scalars(m: nn.Module) -> tuple:
    """The module's public plain attributes (name, value), in definition order: what its forward may read. (Called
    for every module at every step: kept to one pass over the module's __dict__.)"""
    out = []
    for name, v in m.__dict__.items():
        t = type(v)
        if t in _PLAIN:
            if name[0] != "_" and name != "training":
                out.append((name, v if v == v else "nan"))     # (NaN != NaN)
        elif t is tuple and name[0] != "_":
            k = _scalar(v)
            if k is not None:
                out.append((name, k))
    return tuple(out)


def _code_of(fn) -> tuple:
    """(function, extra values) for what `fn` is: a function, a bound method, a functools.partial, or a callable
    object (its __call__; the object's own attributes come in as values)."""
    extra = ()
    while True:
        if isinstance(fn, functools.partial):
            extra += tuple(fn.args) + tuple(fn.keywords.values())
            fn = fn.func
        elif hasattr(fn, "__func__"):          # a bound method: its object's plain attributes too
            extra += tuple(getattr(fn.__self__, "__dict__", {}).values())
            fn = fn.__func__
        else:
            break
    if not hasattr(fn, "__code__") and callable(fn) and hasattr(type(fn), "__call__"):
        extra += tuple(getattr(fn, "__dict__", {}).values())
        fn = type(fn).__call__
    return fn, extra


def closure_key(fn: Callable) -> tuple:
    """The plain values `fn` can be seen to read: its closure cells and the globals its code names (and nested
    code objects' names), by value where they are scalars or small containers of scalars."""
    fn, extra = _code_of(fn)
    code = getattr(fn, "__code__", None)
    if code is None:
        return ()
    keys = []
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            v = cell.cell_contents
        except ValueError:                       # an empty cell (a name bound later)
            continue
        keys.append(_value_key(v))
    g = getattr(fn, "__globals__", {})
    for name in _global_names(code):
        if name in g:
            keys.append((name, _value_key(g[name])))
    keys.extend(_value_key(v) for v in extra)
    return tuple(k for k in keys if k is not _NOT_SCALAR and not (type(k) is tuple and _NOT_SCALAR in k))


@functools.lru_cache(maxsize=256)
def _global_names(code) -> tuple[str, ...]:
    """The names a code object (and the code objects nested in it: comprehensions, inner functions) may load as
    globals."""
    names = list(code.co_names)
    for const in code.co_consts:
        if hasattr(const, "co_names"):
            names.extend(_global_names(const))
    return tuple(dict.fromkeys(names))


def _generators() -> list[tuple[str, Callable]]:
    """(name, state getter) of the global random generators a step may draw from in Python."""
    out = [("random (Python's random module)", random.getstate)]
    np = sys.modules.get("numpy")
    if np is not None:
        def numpy_state():
            name, keys, pos, has_gauss, gauss = np.random.get_state()
            return name, keys.tobytes(), pos, has_gauss, gauss
        out.append(("numpy.random", numpy_state))
    return out


@contextlib.contextmanager
def python_draws() -> Iterator[list[str]]:
    """Yields a list that, once the block ends, names the global Python random generators the block drew from."""
    gens = _generators()
    before = [get() for _, get in gens]
    drawn: list[str] = []
    try:
        yield drawn
    finally:
        drawn.extend(name for (name, get), old in zip(gens, before) if get() != old)


def snapshot(model: nn.Module, fn: Callable) -> dict[str, tuple]:
    """Every plain value the two keys cover, by where it lives: each module's scalars (by module name) and the
    step function's closure and globals."""
    out = {name or "model": module_scalars(m) for name, m in model.named_modules()}
    out["the step function's closure and globals"] = closure_key(fn)
    return out


def changes(before: dict[str, tuple], after: dict[str, tuple]) -> list[str]:
    """What differs between two snapshots, as text (a module attribute: 'h.0.calls: 0 -> 1')."""
    out = []
    for where, old in before.items():
        new = after.get(where, old)
        if new == old:
            continue
        if where in after and where.startswith("the step"):
            out.append(where)
            continue
        old_d, new_d = dict(old), dict(new)
        out.extend(f"{where}.{k}: {old_d.get(k)!r} -> {new_d.get(k)!r}" for k in dict.fromkeys([*old_d, *new_d])
                   if old_d.get(k) != new_d.get(k))
    return out
