"""What a discarded trace's Python wrote to the model, put back before the step is traced again in the same call.

A trace runs the step's Python as an eager call does (frontend/trace.py). Where a trace fails after deciding a
condition on a value by default and is tried the other way (frontend/guards.tried_both_ways), or where a fresh
trace's guard fails on the batch it was traced for and the step is traced again for the outcome observed
(api/guarded.run_guarded), the step's Python runs again within the same call: a counter in `forward` would count
two, a hook added at every call would be added twice, setup done once would be done twice, and the graph of the
second trace would be that of eager code's second call.

Invariant: after `ModelUndo(model).restore()`, what the compiler's key reads of the model (api/compiler.model_key:
each module's plain attributes and the fields of the configuration objects it holds, frontend/python_state.py; its
train/eval mode; the hooks of modules and parameters and torch's global module hooks, frontend/hook_keys.py) and
the module tree are as they were when the ModelUndo was made: every attribute of a module other than torch's own
fields holds the object it held (an attribute the trace added is deleted), every module's submodules are the ones it
had (a module a trace appended to a ModuleList is gone), a dict's, list's, set's or deque's items, and a
configuration object's fields, are the objects they were, to a depth of `DEPTH` containers (a container of weak
references aside: an RNN's, left as the trace left it), and every hook dict holds the hooks it held. The model's
tensors are not its concern (a trace never changes them: trace_step). Nor are objects of other kinds that the step
changes in place, or the values the step function reads from its closure and globals: a step that writes those
writes them once per trace (docs/tracing.md).
"""
from __future__ import annotations

import collections
import weakref

import torch
import torch.nn as nn

from .python_state import _MODULE_FIELDS, _is_config

DEPTH = 4        # containers inside containers whose items are put back (a dict of lists of dicts: 3)
_HOOK_DICTS = tuple(k for k, v in nn.Module().__dict__.items() if "hook" in k and isinstance(v, dict))
_GLOBAL_HOOK_DICTS = tuple(d for k, d in vars(torch.nn.modules.module).items()
                           if k.startswith("_global") and "hook" in k and isinstance(d, dict))
_SEQUENCES = (list, set, collections.deque)
_WEAK = object()    # _items of a container of weak references: neither it nor what it holds is held here


def _items(v) -> dict | list | None:
    """What a container (a dict, list, set or deque, subclasses included) or a configuration object holds, as a dict
    (its fields for a configuration object) or a list; None for anything else (its identity is put back, not what
    it holds), and for a container of weak references: holding them would keep them alive, and a tensor with a live
    weak reference cannot be swapped (an RNN's `_flat_weight_refs`, which pstar-fx empties to hold its weights). A
    module is none of these: its tree is put back through `_modules`."""
    if isinstance(v, dict):
        items = dict(v)
        values = items.values()
    elif isinstance(v, _SEQUENCES):
        items = values = list(v)
    elif _is_config(v):
        items = dict(vars(v))
        values = items.values()
    else:
        return None
    return _WEAK if any(isinstance(x, weakref.ref) for x in values) else items



def _snap(v, depth: int = DEPTH):
    """(what v holds, the snapshots of those of its items that hold things themselves), or None (or _WEAK)."""
    items = _items(v) if depth else None
    if items is None or items is _WEAK:
        return items
    values = items.values() if isinstance(items, dict) else items
    return items, [(x, s) for x in values if (s := _snap(x, depth - 1)) is not None and s is not _WEAK]


def _put_back(v, snap) -> None:
    items, inner = snap
    if isinstance(items, dict):
        _refill(v if isinstance(v, dict) else vars(v), items)
    elif len(v) != len(items) or any(a is not b for a, b in zip(v, items)):
        if isinstance(v, list):
            v[:] = items
        else:                           # a set or a deque
            v.clear()
            (v.update if isinstance(v, set) else v.extend)(items)
    for x, s in inner:
        _put_back(x, s)


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
        self.names = []                 # per module: its attributes' names (one added by a trace is deleted)
        self.attrs = []                 # per module: {name: (object, its snapshot or None)}, weak references aside
        self.hooks = []                 # per module: {hook dict name: its entries}
        for m in self.modules:
            self.names.append(set(m.__dict__))
            snaps = {k: (v, _snap(v)) for k, v in m.__dict__.items() if k not in _MODULE_FIELDS}
            self.attrs.append({k: vs for k, vs in snaps.items() if vs[1] is not _WEAK})
            self.hooks.append({k: dict(getattr(m, k)) for k in _HOOK_DICTS if getattr(m, k, None) is not None})
        self.submodules = tuple(dict(m._modules) for m in self.modules)
        self.training = tuple(m.training for m in self.modules)
        seen = {}
        for m in self.modules:
            for p in m._parameters.values():
                if p is not None and id(p) not in seen:
                    seen[id(p)] = (p, None if p._backward_hooks is None else dict(p._backward_hooks))
        self.params = tuple(seen.values())
        self.global_hooks = tuple((d, dict(d)) for d in _GLOBAL_HOOK_DICTS)

    def restore(self) -> None:
        for m, names, attrs, hooks, submodules, training in zip(self.modules, self.names, self.attrs, self.hooks,
                                                                self.submodules, self.training):
            d = m.__dict__
            for k in [k for k in d if k not in names]:
                del d[k]                                     # added by the trace
            for k, (obj, snap) in attrs.items():
                d[k] = obj
                if snap is not None:
                    _put_back(obj, snap)
            for k, entries in hooks.items():
                _refill(getattr(m, k), entries)
            _refill(m._modules, submodules)
            m.training = training
        for p, entries in self.params:
            if p._backward_hooks is not None:
                _refill(p._backward_hooks, entries or {})
        for d, entries in self.global_hooks:
            _refill(d, entries)
