"""Which hooks a trace depends on: the part of a compiled step's key that a hook registered, removed or replaced
between calls changes (module, parameter-gradient and torch's global module hooks), and what changed, for a warning.

A trace runs every hook the model has and fixes what it computed in the graph, including every value the hook
read. A hook is known by its handle's number (the hooks dict's key), which torch never gives twice: never by its
function's id(), which a hook removed and another registered could get (the old graph would serve the new hook),
nor by its function's code and values alone, which cannot show everything a function reads (a class attribute, a
callee's global, a container subclass changed in place). So registering a hook again, even the same function,
retraces: a loop that registers its hooks before each step traces at each step, and the compiler warns after a few
(`VALUE_RETRACES_WARN`), naming where the hooks changed. Beside its handle, a hook is keyed by the plain values its
function can be seen to read, as the step function is (`python_state.closure_key`: its closure's and those of the
globals its code loads), so a hook registered once that reads a loss weight from a global or its closure retraces
when the weight changes; what it reads otherwise is fixed at the trace. (Whether a backward hook is a full one is
fixed at its registration, so its handle tells that too.) On several ranks (`portable`) a key counts hooks only: the
ranks run the same code, and their handles' numbers may differ.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from .python_state import closure_key

_HOOK_KINDS = {"_forward_hooks": "forward hooks", "_forward_pre_hooks": "forward pre-hooks",
               "_backward_hooks": "backward hooks", "_backward_pre_hooks": "backward pre-hooks"}
MODULE_HOOKS = tuple(_HOOK_KINDS)
_module = torch.nn.modules.module
# torch's hooks for every module, by kind (those this torch has)
_GLOBAL_HOOKS = {kind: getattr(_module, "_global" + name) for name, kind in _HOOK_KINDS.items()
                 if hasattr(_module, "_global" + name)}


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


def _which(hooks: dict, portable: bool):
    """Which hooks, by handle number in order, each with the plain values its function can be seen to read
    (`closure_key`: its closure and the globals its code loads), or with `portable` how many (the module
    docstring)."""
    if portable or not hooks:
        return len(hooks) if portable else ()
    return tuple((h, _reads(fn)) for h, fn in hooks.items())


def _reads(fn) -> tuple:
    """closure_key(fn); () where it cannot be read (a callable object whose __getattr__ raises other than
    AttributeError): the hook is then known by its handle only."""
    try:
        return closure_key(fn)
    except Exception:
        return ()


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
    return (m.training, *(_which(m.__dict__[name], portable) for name in MODULE_HOOKS),
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
    return tuple(_which(d, portable) for d in _GLOBAL_HOOKS.values())


def hooks_snapshot(model: nn.Module) -> dict[str, tuple]:
    """Which hooks the key covers (module_key, params_key, global_hooks_key), by where they are ("fc1's forward
    hooks", "parameter fc1.weight's gradient hooks", "every module's forward hooks"): what hook_changes compares."""
    out = {}
    for name, m in model.named_modules():
        for attr, kind in _HOOK_KINDS.items():
            if getattr(m, attr):
                out[f"{name or 'the model'}'s {kind}"] = _which(getattr(m, attr), False)
    with torch._C.DisableTorchFunctionSubclass():
        for name, p in model.named_parameters():
            if p._backward_hooks:
                out[f"parameter {name}'s gradient hooks"] = hook_key(p)
    for kind, every in _GLOBAL_HOOKS.items():
        if every:
            out[f"every module's {kind}"] = _which(every, False)
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
