"""What a discarded trace's Python wrote to the model, put back before the step is traced again in the same call.

A trace runs the step's Python as an eager call does (frontend/trace.py). Where a trace fails after deciding a
condition on a value by default and is tried the other way (frontend/guards.tried_both_ways), the step's Python
runs again within the same call: a counter in `forward` would count two, a hook added at every call would be added
twice, and the graph of the second trace would be that of eager code's second call.

Invariant: after `ModelUndo(model).restore()`, what the compiler's key reads of the model (api/compiler.model_key:
each module's plain attributes and the fields of the configuration objects it holds, frontend/python_state.py; its
train/eval mode; the hooks of modules and parameters and torch's global module hooks, frontend/model_tensors.py)
is as it was when the ModelUndo was made: every attribute of a module other than torch's own fields holds the object
it held (an attribute the trace added is deleted), a list's or dict's items are the ones it had, a configuration
object's fields are the values they had, and every hook dict holds the hooks it held. The model's tensors are not
its concern (a trace never changes them: trace_step). Nor are the values the step function reads from its closure
and globals: a step that writes a global of its own writes it once per trace (docs/tracing.md).
"""
from __future__ import annotations

import torch
import torch.nn as nn

from .python_state import _MODULE_FIELDS, _is_config

_HOOK_DICTS = tuple(k for k, v in nn.Module().__dict__.items() if "hook" in k and isinstance(v, dict))
_GLOBAL_HOOK_DICTS = tuple(d for k, d in vars(torch.nn.modules.module).items()
                           if k.startswith("_global") and "hook" in k and isinstance(d, dict))


def _contents(v):
    """A shallow copy of what a container or configuration object holds, to put back in the same object; None for
    anything else (its identity is put back, not its contents)."""
    t = type(v)
    if t is list:
        return list(v)
    if t is dict:
        return dict(v)
    if _is_config(v):
        return dict(vars(v))
    return None


def _put_back(obj, contents) -> None:
    if type(obj) is list:
        if len(obj) != len(contents) or any(a is not b for a, b in zip(obj, contents)):
            obj[:] = contents
    else:
        _refill(obj if type(obj) is dict else vars(obj), contents)


def _refill(d: dict, contents: dict) -> None:
    """Make `d` hold `contents` (the same keys, the same objects), leaving it alone where it does (compared by
    identity: a tensor's == is elementwise)."""
    if d.keys() != contents.keys() or any(d[k] is not v for k, v in contents.items()):
        d.clear()
        d.update(contents)


class ModelUndo:
    """The model's Python state as the module docstring names it, taken when made; `restore()` puts it back."""

    def __init__(self, model: nn.Module):
        self.modules = tuple(model.modules())
        self.attrs = []                 # per module: {name: (object, its contents or None)}
        self.hooks = []                 # per module: {hook dict name: its entries}
        for m in self.modules:
            self.attrs.append({k: (v, _contents(v)) for k, v in m.__dict__.items() if k not in _MODULE_FIELDS})
            self.hooks.append({k: dict(getattr(m, k)) for k in _HOOK_DICTS if getattr(m, k, None) is not None})
        self.training = tuple(m.training for m in self.modules)
        seen = {}
        for m in self.modules:
            for p in m._parameters.values():
                if p is not None and id(p) not in seen:
                    seen[id(p)] = (p, None if p._backward_hooks is None else dict(p._backward_hooks))
        self.params = tuple(seen.values())
        self.global_hooks = tuple((d, dict(d)) for d in _GLOBAL_HOOK_DICTS)

    def restore(self) -> None:
        for m, attrs, hooks, training in zip(self.modules, self.attrs, self.hooks, self.training):
            d = m.__dict__
            for k in [k for k in d if k not in _MODULE_FIELDS and k not in attrs]:
                del d[k]                                     # added by the trace
            for k, (obj, contents) in attrs.items():
                d[k] = obj
                if contents is not None:
                    _put_back(obj, contents)
            for k, entries in hooks.items():
                _refill(getattr(m, k), entries)
            m.training = training
        for p, entries in self.params:
            if p._backward_hooks is not None:
                _refill(p._backward_hooks, entries or {})
        for d, entries in self.global_hooks:
            _refill(d, entries)
