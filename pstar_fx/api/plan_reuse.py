"""Steps whose trace changes their own key: never served from the cache for that key, and a trace equal to one
compiled before takes its plan.

A compiled step is cached under its batch's signature and the model's key (`Compiler.model_key`: modes, plain
attributes, hooks, the step function's closure values). A trace runs the step's Python once, as an eager call does,
and that Python may change the key: a counter in `forward`, a flag it toggles, a hook it adds at every call, or
state set up on the first call and only read after it (transformers installs its output-capturing hooks and sets
`_output_capturing_hooks_installed` the first time `output_hidden_states` or `output_attentions` is asked for).

Invariants:
- A compiled step whose trace changed the key (`Compiled.writes_state`) is never run again from the cache: running
  it would not make the change that the step's Python makes at every eager call, so a later call with the same key
  traces again, and its Python runs as eager code's does. (A toggle served from the cache would stop toggling.)
- Every call's graph is the trace of that call's Python under the state it finds (where a call traces again, a
  failed guard or a check tried the other way, what the earlier trace's Python wrote is put back first:
  frontend/python_undo.py). `reusable` only
  saves the passes: where a new trace equals (`same_trace`) the traced graph of a step compiled before for the same
  batch signature (and everything else in its key but the model's part) and guard outcomes, that step's plan,
  executor and fused regions serve the new key, since every pass is a function of the traced graph and of what the
  compiler holds fixed (settings, chunk layout, machine). State set up once (the hooks above) thus costs one more
  trace and no second plan; a value the step changes (or a hook it adds) at every call costs a trace at every call,
  which the compiler warns of after a few (`VALUE_RETRACES_WARN`).
"""
from __future__ import annotations

import math
import numbers
from typing import Iterable

import torch
import torch.fx as fx

from ..ir.graph import TrainGraph


def reusable(entries: Iterable[tuple[tuple, object]], key: tuple, traced: TrainGraph, model_part: int = 1):
    """A compiled step among the cache's `entries` ((key, Compiled) pairs) whose key equals `key` but for its model
    part (index `model_part`) and whose traced graph is `traced`'s; None if there is none."""
    for k, compiled in entries:
        if len(k) == len(key) and k[:model_part] == key[:model_part] and k[model_part + 1:] == key[model_part + 1:] \
                and same_trace(compiled.stages["traced"], traced):
            return compiled
    return None


def same_trace(a: TrainGraph, b: TrainGraph) -> bool:
    """Whether two traces of a step (by one compiler: under the same settings) are the same graph: the same model
    tensors, inputs and outputs, and node for node the same operators on the same arguments, with values of the
    same shapes, dtypes and strides and the same constants. Conservative: what cannot be compared, or compares
    unequal by its type or sign (1 and 1.0, 0.0 and -0.0, a NaN), counts as different."""
    try:
        if (a.params, a.buffers, a.inputs, a.grad_outputs, dict(a.ann)) != \
                (b.params, b.buffers, b.inputs, b.grad_outputs, dict(b.ann)):
            return False
        if not (_same_outputs(a.aux, b.aux) and _same_outputs(a.output_spec, b.output_spec)):
            return False
        na, nb = a.nodes, b.nodes
        if len(na) != len(nb):
            return False
        for x, y in zip(na, nb):
            if (x.op, x.name, x.target) != (y.op, y.name, y.target) or _plain(x.args) != _plain(y.args) \
                    or _plain(x.kwargs) != _plain(y.kwargs) or _plain(x.meta.get("val")) != _plain(y.meta.get("val")):
                return False
            if x.op == "get_attr" and not _same_constant(getattr(a.gm, x.target), getattr(b.gm, y.target)):
                return False
        return True
    except Exception:       # a value whose == is not a bool, or raises
        return False


def _same_constant(a, b) -> bool:
    if not (type(a) is torch.Tensor and type(b) is torch.Tensor):
        return False        # a subclass or a module: not compared, so not the same
    if (a.dtype, a.shape, a.stride(), a.device) != (b.dtype, b.shape, b.stride(), b.device):
        return False
    return torch.equal(_bytes(a), _bytes(b))    # by their bytes: torch.equal takes 0.0 for -0.0


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _same_outputs(a, b) -> bool:
    if a is None or b is None:
        return a is b
    return a.spec == b.spec and _plain(a.leaves) == _plain(b.leaves)


class _Unequal:
    """Stands for a value that is not compared: equal to nothing, itself included."""

    def __eq__(self, other):
        return False

    __hash__ = None


def _plain(v):
    """v with fx nodes as their names, tensors (the trace's fake values) as their shape, dtype, stride and device,
    and scalars with their type (and a float's sign, a NaN unequal to all)."""
    def one(x):
        if isinstance(x, fx.Node):
            return ("node", x.name)
        if isinstance(x, torch.Tensor):
            if type(x) is torch.Tensor or isinstance(x, torch.nn.Parameter):
                return _Unequal()       # a real tensor's values are not compared here (constants are get_attr's)
            return ("tensor", tuple(x.shape), x.dtype, x.stride(), x.device.type)
        if isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            return ("sym", str(x))
        if isinstance(x, (float, complex)) or isinstance(x, numbers.Number) and not isinstance(x, int):
            parts = (x.real, x.imag) if isinstance(x, numbers.Complex) else (float(x),)
            if any(math.isnan(p) for p in parts):
                return _Unequal()
            return (type(x),) + tuple((p, math.copysign(1.0, p)) for p in parts)
        if isinstance(x, (bool, int, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)):
            return (type(x), x)
        return x
    return fx.node.map_aggregate(v, one)
