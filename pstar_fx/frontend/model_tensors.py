"""The model's tensors as a trace sees them: their tables (names as in `model.state_dict()`, tied tensors once, the
dtypes a chunk can hold), their slots (module, attribute), the guarantee that tracing leaves every slot as it was,
and what a step that rebinds a buffer means (its new value written into the buffer, as eager code would leave it)."""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn

from ..errors import UntraceableError
from ..ir.graph import BufferInfo, ParamInfo


@dataclass(frozen=True)
class ModelTables:
    """The model's parameters and buffers, named as in model.state_dict(), shared (tied) tensors once."""
    params: tuple[ParamInfo, ...]
    buffers: tuple[BufferInfo, ...]

    @functools.cached_property
    def by_name(self) -> dict[str, dict[str, ParamInfo | BufferInfo]]:
        """"parameter" and "buffer": each tensor's info by every state_dict name of it (tied aliases too)."""
        return {kind: {name: info for info in infos for name in (info.name, *info.aliases)}
                for kind, infos in (("parameter", self.params), ("buffer", self.buffers))}


def model_tables(model: nn.Module) -> ModelTables:
    def collect(items):
        seen: dict[int, str] = {}
        names: dict[str, list[str]] = {}
        tensors: dict[str, torch.Tensor] = {}
        for name, t in items:
            if t is None:
                continue
            first = seen.setdefault(id(t), name)
            if first == name:
                names[name], tensors[name] = [], t
            else:
                names[first].append(name)
        return names, tensors

    pnames, ptensors = collect(model.named_parameters(remove_duplicate=False))
    for name, t in ptensors.items():
        _check_param_dtype(name, t.dtype)
    bnames, btensors = collect(model.named_buffers(remove_duplicate=False))
    persistent = set(model.state_dict(keep_vars=True).keys())   # names only: a held model's values stay put
    params = tuple(ParamInfo(n, tuple(t.shape), t.dtype, t.requires_grad and t.is_floating_point(),
                             tuple(pnames[n])) for n, t in ptensors.items())
    # Non-persistent buffers (e.g. rotary inv_freq) are graph inputs too, but not part of state_dict().
    buffers = tuple(BufferInfo(n, tuple(t.shape), t.dtype, tuple(bnames[n]), n in persistent)
                    for n, t in btensors.items())
    return ModelTables(params, buffers)


def changes_since(model: nn.Module, tables: ModelTables) -> list[str]:
    """What of the model's parameters and buffers differs from `tables` (model_tables when the step was made): a
    tensor added or removed (by any of its state_dict names), or one of another shape or dtype. Empty where nothing
    did. Read past the tensors' __torch_function__ (a held tensor's shape and dtype are its own)."""
    with torch._C.DisableTorchFunctionSubclass():
        now = {"parameter": {n: t for n, t in model.named_parameters(remove_duplicate=False)},
               "buffer": {n: t for n, t in model.named_buffers(remove_duplicate=False) if t is not None}}
        out = []
        for kind, known in tables.by_name.items():
            out += [f"{kind} '{n}' was added" for n in now[kind] if n not in known]
            out += [f"{kind} '{n}' was removed" for n in known if n not in now[kind]]
            for n, info in known.items():
                t = now[kind].get(n)
                if t is not None and (tuple(t.shape), t.dtype) != (info.shape, info.dtype):
                    out.append(f"{kind} '{n}' is now {tuple(t.shape)} {t.dtype}, was {info.shape} {info.dtype}")
    return out


def check_unchanged(model: nn.Module, tables: ModelTables) -> None:
    """Refuse a model whose parameters or buffers changed since px.compile (changes_since): its chunks were laid out
    for the tensors it had then."""
    changes = changes_since(model, tables)
    if changes:
        more = f" (and {len(changes) - 3} more)" if len(changes) > 3 else ""
        raise ValueError(
            f"the model changed since px.compile: {'; '.join(changes[:3])}{more}. pstar-fx lays out a model's "
            "chunks for the parameters and buffers it has when compiled, and holds their values there. Change the "
            "model before px.compile; to change it later, call step.sync_model() (the model gets its values back), "
            "undo or make the change, and compile a new step for the changed model")


HELD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)   # what a chunk (or its fp32 master) holds exactly


def _check_param_dtype(name: str, dtype: torch.dtype) -> None:
    """Parameters live in chunks of the precision's dtype, with fp32 masters in mixed precision: a parameter of
    another dtype would be rounded or converted there, and so in the model after sync_model(). Refused instead."""
    if dtype in HELD_DTYPES or dtype.is_floating_point and dtype.itemsize < 2:   # (float8: fp32 holds it too)
        return
    if dtype.is_floating_point:
        fix = "convert it to float32 (model.float() converts every parameter)"
    elif dtype.is_complex:
        fix = "hold it as two real parameters (torch.view_as_real), or as a buffer if it is not trained"
    else:
        fix = "register it as a buffer (module.register_buffer), which keeps its dtype"
    raise TypeError(f"parameter {name!r} is {dtype}: pstar-fx keeps parameters in fp32 chunks (fp32 masters under "
                    f"bf16 and fp16), where it would not keep its values; {fix}")


def slots(model: nn.Module) -> list[tuple[str, str, nn.Module, str, torch.Tensor]]:
    """Every distinct parameter / buffer slot (module, attribute) once, with one of its full names. A module reachable
    under two names (`self.c = nn.Sequential(self.a, ...)`) has its slots once; a tensor tied into two modules
    (wte / lm_head) has two slots."""
    seen: set[tuple[int, str]] = set()
    out = []
    for prefix, mod in model.named_modules(remove_duplicate=False):
        for kind in ("_parameters", "_buffers"):
            for name, t in getattr(mod, kind).items():
                if t is None or (id(mod), name) in seen:
                    continue
                seen.add((id(mod), name))
                out.append((f"{prefix}.{name}" if prefix else name, kind, mod, name, t))
    return out


@contextlib.contextmanager
def model_restored(model: nn.Module):
    """Whatever happens inside, every parameter and buffer slot of the model holds its original tensor afterwards,
    and a slot made inside (a parameter or buffer the step function registered on the model) is removed again; where
    nothing else failed, that is refused (UntraceableError): the step's chunks hold the tensors the model had."""
    saved = [(kind, mod, name, t) for _, kind, mod, name, t in slots(model)]
    known = {(id(mod), kind, name) for kind, mod, name, _ in saved}
    try:
        yield
    finally:
        for kind, mod, name, t in saved:
            if getattr(mod, kind).get(name) is not t:
                getattr(mod, kind)[name] = t
        added = [(full, kind, mod, name) for full, kind, mod, name, _ in slots(model)
                 if (id(mod), kind, name) not in known]
        for _, kind, mod, name in added:
            del getattr(mod, kind)[name]
    if added:
        what = ", ".join(f"{'parameter' if kind == '_parameters' else 'buffer'} {full!r}"
                         for full, kind, _, _ in added[:3]) + (" ..." if len(added) > 3 else "")
        raise UntraceableError(f"the step function adds {what} to the model (register_buffer, a new nn.Parameter "
                               "or module assigned to it): pstar-fx holds the tensors the model had when compiled, "
                               "so add it before px.compile, or keep the tensor in a local variable")


_PARAM_ADVICE = (", and only its optimizer changes them; compute with the new value without assigning it to the "
                 "module, or change the parameter outside the step (step.sync_model(), change it, compile a new step)")


def storage_ids(given: dict) -> dict:
    """Each substituted tensor's storage, by functional_call key: `check_data_kept` compares them after the step."""
    return {key: t.untyped_storage()._cdata for key, t in given.items() if isinstance(t, torch.Tensor)}


def check_data_kept(given: dict, before: dict, buffer_slots: dict[str, str]) -> None:
    """Refuse a step that assigned `.data` of a parameter or buffer (`module.bias.data = t`): the assignment swaps
    the tensor's storage behind the trace's back (no operation records it), so the graph would go on reading the old
    value, silently unlike eager code."""
    for key, was in before.items():
        if given[key].untyped_storage()._cdata != was:
            where = key[2:]
            if key in buffer_slots:
                raise UntraceableError(f"the step assigns buffer {where!r}.data, which a trace cannot record: write "
                                       "the new value in place instead (buffer.copy_(value) under torch.no_grad())")
            raise UntraceableError(f"the step assigns parameter {where!r}.data, which a trace cannot record: pstar-fx "
                                   "holds parameters in chunks" + _PARAM_ADVICE)


def write_rebound(given: dict, after: dict, buffer_slots: dict[str, str], bufs: dict) -> None:
    """Inside a trace, after the step ran with the model's slots substituted (`given`: functional_call key ->
    tensor; `after`: the same dict once torch's reparametrization has handed back the tensors the step rebound):
    a buffer the step rebound (`self.count = self.count + 1`, not in place) gets its new value written into its
    placeholder in `bufs` (by table name; `buffer_slots` maps keys to them), where eager code would read it next; a
    rebound parameter, or a buffer rebound to another shape or dtype, is refused."""
    for key, old in given.items():
        new = after.get(key, old)
        if new is old:
            continue
        name = buffer_slots.get(key)
        where = key[2:]
        if name is None:
            raise UntraceableError(f"the step rebinds parameter {where!r} (assigns it a new tensor): pstar-fx "
                                   "holds parameters in chunks" + _PARAM_ADVICE)
        if not isinstance(new, torch.Tensor) or new.shape != bufs[name].shape or new.dtype != bufs[name].dtype:
            got = (f"a tensor of shape {tuple(new.shape)} and dtype {new.dtype}" if isinstance(new, torch.Tensor)
                   else type(new).__name__)
            raise UntraceableError(
                f"the step rebinds buffer {where!r} to {got}; it was {tuple(bufs[name].shape)}, "
                f"{bufs[name].dtype}: pstar-fx keeps a buffer's shape and dtype (write it in place instead)")
        with torch.no_grad():
            bufs[name].copy_(new)


def gradient_hooks(model: nn.Module, trainable: list[str]) -> dict[str, list[Callable]]:
    """The hooks `Tensor.register_hook` put on each trainable parameter (by table name), in order: the trace puts
    them on the parameter's leaf, so a gradient is the hooked one, as eager `backward()` leaves it in `.grad`. A
    post-accumulate-grad hook (an optimizer step in backward, reading `.grad`) has no place in a compiled step: refused
    by name."""
    params = dict(model.named_parameters())
    hooks = {}
    for name in trainable:
        p = params[name]
        if getattr(p, "_post_accumulate_grad_hooks", None):
            raise UntraceableError(
                f"parameter {name!r} has a post-accumulate-grad hook (register_post_accumulate_grad_hook): pstar-fx "
                "updates parameters in its own optimizer step and never fills .grad; remove the hook (a gradient "
                "hook, register_hook, is applied)")
        if p._backward_hooks:
            hooks[name] = list(p._backward_hooks.values())
    return hooks


def _which(hooks: dict, portable: bool):
    """Which hooks, or with `portable` how many (the same on every rank running the same code). A hook is known by
    its handle's number (the dict's key), which torch never gives twice, not by its function's id(): a hook removed
    and another registered could get the freed function's address, and the old graph would serve the new hook."""
    return len(hooks) if portable else tuple(hooks)


def hook_key(p: torch.Tensor, portable: bool = False):
    """What of a parameter's gradient hooks a trace depends on: which hooks (a change retraces)."""
    return _which(p._backward_hooks, portable) if p._backward_hooks else ()


_HOOK_KINDS = {"_forward_hooks": "forward hooks", "_forward_pre_hooks": "forward pre-hooks",
               "_backward_hooks": "backward hooks", "_backward_pre_hooks": "backward pre-hooks"}
MODULE_HOOKS = tuple(_HOOK_KINDS)
# torch's hooks for every module, by kind (those this torch has)
_GLOBAL_HOOKS = {kind: getattr(torch.nn.modules.module, "_global" + name) for name, kind in _HOOK_KINDS.items()
                 if hasattr(torch.nn.modules.module, "_global" + name)}


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


def module_key(m: nn.Module, portable: bool = False):
    """What of a module a trace depends on besides its tensors and plain attributes (python_state.ModuleScalars):
    its train/eval mode, which hooks it has (a forward hook registered after a trace changes what the step
    computes: it retraces), and a `forward` set on the instance (a wrapper replacing the class's: by identity, or
    with `portable` that there is one)."""
    own = m.__dict__.get("forward")
    if not (m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks or own):
        return m.training
    return (m.training, *(_which(getattr(m, name), portable) for name in MODULE_HOOKS),
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
