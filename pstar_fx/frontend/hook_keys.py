"""Which hooks a trace depends on: the part of a compiled step's key that a hook registered, removed or replaced
between calls changes (module, parameter-gradient and torch's global module hooks), and what changed, for a warning.

A trace runs every hook the model has and fixes what it computed in the graph, so the key must tell hooks apart as
what they compute, never by an address another object could take (a hook removed and another registered could get
the freed function's id, and the old graph would serve the new hook). A hook is known by its function:

- a Python function by its code, its globals, its defaults and its closure's values (plain scalars and small
  containers of them by value, other objects by identity), so that a hook made afresh at each registration by the
  same factory with the same values (`register_forward_hook(make_hook(name))` before a step, removed after it) keys
  as the one before, and a value it closes over changed keys apart;
- a bound method by its function's key and its object, a functools.partial by its function's key and bound values;
- any other callable by its identity.

Every object a key names by identity is held by the key (`_Same`), so no other object takes its id while the key
lives. With each hook, the flags torch keeps beside it: with kwargs, always called. On several ranks (`portable`) a
key counts hooks only: the ranks run the same code, and their hooks' objects differ.
"""
from __future__ import annotations

import functools
import types

import torch
import torch.nn as nn

from .python_state import _NOT_SCALAR, _value_key

_HOOK_KINDS = {"_forward_hooks": "forward hooks", "_forward_pre_hooks": "forward pre-hooks",
               "_backward_hooks": "backward hooks", "_backward_pre_hooks": "backward pre-hooks"}
MODULE_HOOKS = tuple(_HOOK_KINDS)
# the flags torch keeps beside a module's hooks of a kind, by hook id
_FLAGS = {"_forward_hooks": ("_forward_hooks_with_kwargs", "_forward_hooks_always_called"),
          "_forward_pre_hooks": ("_forward_pre_hooks_with_kwargs",)}
_module = torch.nn.modules.module
# torch's hooks for every module, by kind (those this torch has), with their flags
_GLOBAL_HOOKS = {kind: (getattr(_module, "_global" + name),
                        tuple(getattr(_module, "_global" + f, {}) for f in _FLAGS.get(name, ())))
                 for name, kind in _HOOK_KINDS.items() if hasattr(_module, "_global" + name)}


class _Same:
    """An object in a key by its identity, held there, so that no other object takes its id while the key lives
    (and compared by `is`: a callable object's own == may be anything, or unhashable)."""
    __slots__ = ("obj",)

    def __init__(self, obj):
        self.obj = obj

    def __eq__(self, other) -> bool:
        return type(other) is _Same and other.obj is self.obj

    def __hash__(self) -> int:
        return id(self.obj)


def _value(v):
    """A value a hook closes over or binds: by value where plain, else by identity."""
    k = _value_key(v)
    return _Same(v) if k is _NOT_SCALAR else ("value", k)


def _cell(c):
    try:
        return _value(c.cell_contents)
    except ValueError:                  # an empty cell
        return "empty"


def fn_key(fn, depth: int = 0):
    """A hook's function as a key (the module docstring)."""
    t = type(fn)
    if t is types.FunctionType:
        return ("fn", _Same(fn.__code__), _Same(fn.__globals__),
                tuple(map(_value, fn.__defaults__ or ())),
                tuple((k, _value(v)) for k, v in (fn.__kwdefaults__ or {}).items()),
                tuple(map(_cell, fn.__closure__ or ())))
    if t is types.MethodType and depth < 4:
        return ("method", fn_key(fn.__func__, depth + 1), _Same(fn.__self__))
    if t is functools.partial and depth < 4:
        return ("partial", fn_key(fn.func, depth + 1), tuple(map(_value, fn.args)),
                tuple((k, _value(v)) for k, v in fn.keywords.items()))
    return _Same(fn)


def _which(hooks: dict, portable: bool, flags: tuple = ()):
    """Which hooks, in order, each with its flags (`flags`: torch's dicts of hook ids); with `portable` how many."""
    if portable:
        return len(hooks)
    if not flags:
        return tuple(map(fn_key, hooks.values()))
    return tuple((fn_key(fn), *(h in f for f in flags)) for h, fn in hooks.items())


def _module_hooks(m: nn.Module, name: str, portable: bool):
    return _which(getattr(m, name), portable, tuple(getattr(m, f, {}) for f in _FLAGS.get(name, ())))


def hook_key(p: torch.Tensor, portable: bool = False):
    """What of a parameter's gradient hooks a trace depends on: which hooks (a change retraces)."""
    return _which(p._backward_hooks, portable) if p._backward_hooks else ()


def module_key(m: nn.Module, portable: bool = False):
    """What of a module a trace depends on besides its tensors and plain attributes (python_state.ModuleScalars):
    its train/eval mode, which hooks it has (a forward hook registered after a trace changes what the step
    computes: it retraces), and a `forward` set on the instance (a wrapper replacing the class's: by identity, or
    with `portable` that there is one)."""
    own = m.__dict__.get("forward")
    if not (m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks or own):
        return m.training
    return (m.training, *(_module_hooks(m, name, portable) for name in MODULE_HOOKS),
            getattr(m, "_is_full_backward_hook", None) if m._backward_hooks else None,
            None if own is None else True if portable else _Same(own))


def params_key(modules: tuple[nn.Module, ...], portable: bool = False) -> tuple:
    """What of the parameters of `modules` (a model's, in modules() order) a trace depends on: each distinct
    parameter's requires_grad, with its gradient hooks where it has any (hook_key), in model.parameters() order. Read
    past the tensors' __torch_function__ (a held parameter's is for the user's code; here it would cost more than the
    read), and without parameters()'s second walk of the modules: this runs before every step."""
    out, seen = [], set()
    with torch._C.DisableTorchFunctionSubclass():
        for m in modules:
            for p in m._parameters.values():
                if p is None or id(p) in seen:
                    continue
                seen.add(id(p))
                post = getattr(p, "_post_accumulate_grad_hooks", None)
                if p._backward_hooks or post:
                    # (a post-accumulate-grad hook is refused by the trace: added after one, it retraces to say so)
                    out.append((p.requires_grad, hook_key(p, portable), bool(post)))
                else:
                    out.append(p.requires_grad)
    return tuple(out)


def hook_count(model: nn.Module) -> int:
    """How many module and gradient hooks the model has (what a message says of them)."""
    return (sum(len(getattr(m, name)) for m in model.modules() for name in MODULE_HOOKS)
            + sum(len(p._backward_hooks or ()) for p in model.parameters()))


def global_hooks_key(portable: bool = False) -> tuple:
    """Which hooks torch.nn.modules.module.register_module_forward_hook (and the like) registered for every module."""
    return tuple(_which(d, portable, flags) for d, flags in _GLOBAL_HOOKS.values())


def hooks_snapshot(model: nn.Module) -> dict[str, tuple]:
    """Which hooks the key covers (module_key, params_key, global_hooks_key), by where they are ("fc1's forward
    hooks", "parameter fc1.weight's gradient hooks", "every module's forward hooks"): what hook_changes compares."""
    out = {}
    for name, m in model.named_modules():
        for attr, kind in _HOOK_KINDS.items():
            if getattr(m, attr):
                out[f"{name or 'the model'}'s {kind}"] = _module_hooks(m, attr, False)
    with torch._C.DisableTorchFunctionSubclass():
        for name, p in model.named_parameters():
            if p._backward_hooks:
                out[f"parameter {name}'s gradient hooks"] = hook_key(p)
    for kind, (every, flags) in _GLOBAL_HOOKS.items():
        if every:
            out[f"every module's {kind}"] = _which(every, False, flags)
    return out


def hook_changes(before: dict[str, tuple], after: dict[str, tuple]) -> list[str]:
    """What differs between two hooks_snapshot()s, as text ("fc1's forward hooks: 1 -> 2", "...: 1 -> 1, another
    hook")."""
    out = []
    for where in dict.fromkeys([*before, *after]):
        old, new = before.get(where, ()), after.get(where, ())
        if old != new:
            out.append(f"{where}: {len(old)} -> {len(new)}" + (", another hook" if len(old) == len(new) else ""))
    return out
