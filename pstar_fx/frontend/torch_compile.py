"""Modules and step functions wrapped by `torch.compile`: traced through the code they wrap.

pstar-fx compiles the whole training step itself (forward, backward and update, one planned aten graph), so
torch.compile's own compilation has nothing to add inside it, and make_fx refuses to trace a dynamo-optimized
function. A module wrapped by torch.compile (an `OptimizedModule`: the model itself or any submodule) keeps the module
it wraps as its `_orig_mod` child, so its parameters are the original's, named with the `_orig_mod.` prefix the model
reports; while the step is traced, its `forward` (an attribute torch sets on each OptimizedModule instance) is the
original module's call, for the length of the trace only, and the original is put back whether the trace succeeds
or fails. A step function wrapped by torch.compile is traced as the function it wraps.

Only a process that has imported torch._dynamo (torch.compile does) can hold such wrappers, so nothing here imports it.
"""
from __future__ import annotations

import contextlib
import sys
from typing import Callable

import torch.nn as nn


def _optimized_module_class() -> type | None:
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    return getattr(eval_frame, "OptimizedModule", None)


def compiled_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every module of the model wrapped by torch.compile ("" for the model itself)."""
    cls = _optimized_module_class()
    if cls is None:
        return []
    return [(name, m) for name, m in model.named_modules() if isinstance(m, cls)]


def original_function(fn: Callable) -> Callable:
    """The function a torch.compile'd function wraps (itself when it is not one)."""
    while callable(getattr(fn, "_torchdynamo_orig_callable", None)):
        fn = fn._torchdynamo_orig_callable
    return fn


@contextlib.contextmanager
def traced_as_original(model: nn.Module):
    """While inside, every OptimizedModule of the model calls the module it wraps directly."""
    wrapped = compiled_modules(model)
    saved = [(m, m.__dict__.get("forward")) for _, m in wrapped]
    try:
        for _, m in wrapped:
            m.forward = m._orig_mod.__call__
        yield
    finally:
        for m, forward in saved:
            if forward is None:
                m.__dict__.pop("forward", None)
            else:
                m.forward = forward
