"""Functions compiled by `torch.jit.script` that the model's code calls: traced as the Python they were compiled from.

A scripted function runs in the TorchScript interpreter, whose `torch.tensor(...)` makes a real tensor without the
lift (`aten.lift_fresh`) through which eager code's constants become fake tensors; so over fake tensors the first op
that meets such a constant fails ("The following operation failed in the TorchScript interpreter", with an empty
message). transformers' DeBERTa-v2 scripts one (`make_log_bucket_position`, in releases before 5.24). torch.compile
traces the Python function instead (`_torchdynamo_inline`, which torch.jit.script sets on every scripted function),
and so does pstar-fx: while the step is traced, every module-level name bound to a scripted function, in the modules
that define the model's classes and the step function, is bound to the Python function it was compiled from, and put
back when the trace ends, whether it succeeds or fails. The Python function runs the same aten ops as the script,
so the graph computes what eager PyTorch computes. torch's own modules are left alone.
"""
from __future__ import annotations

import contextlib
import sys
from typing import Callable

import torch
import torch.nn as nn


def _python_function(value) -> Callable | None:
    """The Python function a scripted function was compiled from (None for anything else)."""
    if isinstance(value, torch.jit.ScriptFunction):
        original = getattr(value, "_torchdynamo_inline", None)
        return original if callable(original) else None
    return None


def scripted_functions(model: nn.Module, fn: Callable) -> list[tuple[dict, str, Callable, Callable]]:
    """(module namespace, name, scripted function, its Python function) for each module-level name bound to a scripted
    function in the modules that define the model's classes and `fn`."""
    names = {type(m).__module__ for m in model.modules()} | {getattr(fn, "__module__", None)}
    found = []
    for name in sorted(n for n in names if n):
        module = sys.modules.get(name)
        if module is None or name == "torch" or name.startswith("torch."):
            continue
        namespace = vars(module)
        for attr, value in list(namespace.items()):
            original = _python_function(value)
            if original is not None:
                found.append((namespace, attr, value, original))
    return found


@contextlib.contextmanager
def scripted_as_python(model: nn.Module, fn: Callable):
    """While inside, the scripted functions of `scripted_functions(model, fn)` are their Python functions."""
    found = scripted_functions(model, fn)
    try:
        for namespace, attr, _, original in found:
            namespace[attr] = original
        yield
    finally:
        for namespace, attr, scripted, _ in found:
            namespace[attr] = scripted
