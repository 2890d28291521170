"""Which hooks a trace depends on: the part of a compiled step's key that a hook registered, removed or replaced
between calls changes (module, parameter-gradient and torch's global module hooks), and what changed, for a warning.

A trace runs every hook the model has and fixes what it computed in the graph, so the key must tell hooks apart as
what they compute, never by an address another object could take (a hook removed and another registered could get
the freed function's id, and the old graph would serve the new hook). A hook is known by its function where what
the function reads can be keyed:

- a Python function by its code, and by what it reads: its defaults, its closure's values and the globals its code
  loads (`fn_key`);
- a bound method by its function's key and its object, a functools.partial by its function's key and bound values.

A value read is keyed by value where it is plain (a scalar or a small container of them, `python_state._value_key`);
a Python module, class, function or nn.Module by identity (a module of the model has its plain attributes keyed
where the model's are); another object with a `__dict__` (a bound method's `self`, a namespace) by identity and its
attributes' values by these rules, one level deep. Anything else (a large container, an object of another kind) is
not keyed by value, and the hook is then known by its handle's number, which torch never gives twice: registering
it again retraces. So hooks a loop registers before each step and removes after it, made afresh by the same
factory from the same plain values, trace once, and one whose values changed retraces; what a hook's callees read
is not seen (as for the step function's callees, docs/tracing.md).

Every object a key names by identity is held by the key (`_Same`), so no other object takes its id while the key
lives. With each hook, the flags torch keeps beside it: with kwargs, always called (and for backward hooks whether
they are full ones). On several ranks (`portable`) a key counts hooks only: the ranks run the same code, and their
hooks' objects differ.
"""
from __future__ import annotations

import functools
import types

import torch
import torch.nn as nn

from .python_state import _NOT_SCALAR, _global_names, _value_key

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


_BY_IDENTITY = (types.ModuleType, type, types.FunctionType, types.BuiltinFunctionType, nn.Module)
_UNKNOWN = object()     # a value not keyed: the hook is then known by its handle
OBJECT_ATTRS = 64       # an object's attributes keyed by value up to this many


def _read(v, depth: int = 0):
    """A value a hook reads, as a key: by value where plain, by identity where it is a module, class, function or
    nn.Module, by identity and attributes where it is another object with a `__dict__` (one level); _UNKNOWN else."""
    k = _value_key(v)
    if k is not _NOT_SCALAR:
        return k
    if isinstance(v, _BY_IDENTITY):
        return _Same(v)
    d = getattr(v, "__dict__", None)
    if depth == 0 and type(d) is dict and len(d) <= OBJECT_ATTRS and not isinstance(v, torch.Tensor):
        items = []
        for name, x in d.items():
            kx = _read(x, 1)
            if kx is _UNKNOWN:
                return _UNKNOWN
            items.append((name, kx))
        return (_Same(v), tuple(items))
    return _UNKNOWN


def _reads(values) -> tuple | None:
    keys = tuple(map(_read, values))
    return None if _UNKNOWN in keys else keys


def _cells(fn) -> list:
    out = []
    for c in fn.__closure__ or ():
        try:
            out.append(c.cell_contents)
        except ValueError:          # an empty cell
            out.append(None)
    return out


def fn_key(fn, depth: int = 0):
    """A hook's function as a key (the module docstring); None where something it reads is not keyed."""
    t = type(fn)
    if t is types.FunctionType:
        g = fn.__globals__
        kw = fn.__kwdefaults__
        values = [g[name] for name in _global_names(fn.__code__) if name in g]
        if fn.__closure__:
            values += _cells(fn)
        if fn.__defaults__:
            values += fn.__defaults__
        if kw:
            values += kw.values()
        reads = _reads(values)
        if reads is None:
            return None
        return ("fn", _Same(fn.__code__), _Same(g), tuple(kw or ()), reads)
    if depth >= 4:
        return None
    if t is types.MethodType:
        inner, self_key = fn_key(fn.__func__, depth + 1), _read(fn.__self__)
        return None if inner is None or self_key is _UNKNOWN else ("method", inner, self_key)
    if t is functools.partial:
        inner, bound = fn_key(fn.func, depth + 1), _reads([*fn.args, *fn.keywords.values()])
        return None if inner is None or bound is None else ("partial", inner, tuple(fn.keywords), bound)
    return None


def _hook(h: int, fn):
    """One hook as a key: its function's (fn_key), else its handle's number."""
    k = fn_key(fn)
    return ("handle", h) if k is None else k


def _which(hooks: dict, portable: bool, flags: tuple = ()):
    """Which hooks, in order, each with its flags (`flags`: torch's dicts of hook ids); with `portable` how many."""
    if portable or not hooks:
        return len(hooks) if portable else ()
    if not flags:
        return tuple(_hook(h, fn) for h, fn in hooks.items())
    return tuple((_hook(h, fn), *[h in f for f in flags]) for h, fn in hooks.items())


def _module_hooks(m: nn.Module, name: str, portable: bool):
    d = m.__dict__
    hooks = d[name]
    if not hooks or portable:
        return len(hooks) if portable else ()
    return _which(hooks, False, tuple(d.get(f, {}) for f in _FLAGS.get(name, ())))


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
    out = tuple(_which(d, portable, flags) for d, flags in _GLOBAL_HOOKS.values())
    if getattr(_module, "_global_backward_hooks", None):    # (whether they are full ones: one flag for them all)
        out += (getattr(_module, "_global_is_full_backward_hook", None),)
    return out


def hooks_snapshot(model: nn.Module) -> dict[str, tuple]:
    """Which hooks the key covers (module_key, params_key, global_hooks_key), by where they are ("fc1's forward
    hooks", "parameter fc1.weight's gradient hooks", "every module's forward hooks"): what hook_changes compares."""
    out = {}
    for name, m in model.named_modules():
        for attr, kind in _HOOK_KINDS.items():
            if getattr(m, attr):
                keys = _module_hooks(m, attr, False)
                if attr == "_backward_hooks":       # (each with whether it is a full one: a change is another hook)
                    keys = tuple((k, getattr(m, "_is_full_backward_hook", None)) for k in keys)
                out[f"{name or 'the model'}'s {kind}"] = keys
    with torch._C.DisableTorchFunctionSubclass():
        for name, p in model.named_parameters():
            if p._backward_hooks:
                out[f"parameter {name}'s gradient hooks"] = hook_key(p)
    for kind, (every, flags) in _GLOBAL_HOOKS.items():
        if every:
            keys = _which(every, False, flags)
            if every is getattr(_module, "_global_backward_hooks", None):
                keys = tuple((k, getattr(_module, "_global_is_full_backward_hook", None)) for k in keys)
            out[f"every module's {kind}"] = keys
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
