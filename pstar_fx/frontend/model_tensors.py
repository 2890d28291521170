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
