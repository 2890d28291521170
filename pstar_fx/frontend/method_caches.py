"""Caches that a model's methods keep across calls, emptied around a trace.

A method decorated with `functools.lru_cache` keeps what it returned, for every instance, for the life of the
process. transformers' BEiT, DINOv3 and the DETR family cache tensors so (relative position indices, through
`compile_compatible_method_lru_cache`, which bypasses its cache under torch.compile only). A trace meets such a
cache in two wrong states: filled by an eager forward, it hands the trace a real tensor that is neither a parameter,
a buffer nor an input; empty, the trace fills it with a fake tensor, which every later eager forward in the process
then fails on. So the caches of the model's methods are emptied before a trace (the trace computes the value, as
eager code does on a miss, and records how) and after it (nothing of the trace stays; eager code refills them).

A cache is found on the classes of the model's modules and among the functions of the Python modules that define
them (DINOv3 caches a module-level function): a function that is itself an lru_cache wrapper, or whose closure
holds one (a decorator wrapping the cached function), following `functools.wraps`' `__wrapped__`.
"""
from __future__ import annotations

import contextlib
import sys
from typing import Iterator

import torch.nn as nn


def _is_cache(obj) -> bool:
    return callable(getattr(obj, "cache_clear", None)) and callable(getattr(obj, "cache_info", None))


def _caches_of(fn) -> list:
    found, seen = [], set()
    while fn is not None and id(fn) not in seen:
        seen.add(id(fn))
        fn = getattr(fn, "__func__", fn)             # a classmethod's or staticmethod's function
        if _is_cache(fn):
            found.append(fn)
        for cell in getattr(fn, "__closure__", None) or ():
            try:
                value = cell.cell_contents
            except ValueError:                       # an empty cell
                continue
            if _is_cache(value):
                found.append(value)
        fn = getattr(fn, "__wrapped__", None)
    return found


def method_caches(model: nn.Module) -> list:
    """The lru caches of the methods of the model's module classes (and their bases below nn.Module) and of the
    functions of the Python modules defining them, each once."""
    out: dict[int, object] = {}
    classes = {cls for m in model.modules() for cls in type(m).__mro__
               if isinstance(cls, type) and issubclass(cls, nn.Module) and cls.__module__.split(".")[0] != "torch"}
    spaces = [vars(cls) for cls in classes]
    spaces += [vars(sys.modules[name]) for name in {cls.__module__ for cls in classes} if name in sys.modules]
    for space in spaces:
        for value in list(space.values()):
            if isinstance(value, (classmethod, staticmethod)) or (callable(value) and not isinstance(value, type)):
                for cache in _caches_of(value):      # (_caches_of follows a classmethod's __func__)
                    out.setdefault(id(cache), cache)
    return list(out.values())


@contextlib.contextmanager
def emptied(model: nn.Module) -> Iterator[None]:
    """The model's method caches empty while the block runs a trace, and emptied again after it."""
    caches = method_caches(model)
    for cache in caches:
        cache.cache_clear()
    try:
        yield
    finally:
        for cache in caches:
            cache.cache_clear()
