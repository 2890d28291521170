"""A trace that sets up state its step reads: traced once more under that state, so that the next call finds it.

A compiled step is cached under its batch's signature and the model's key (`Compiler.model_key`: modes, plain
attributes, hooks, the step function's closure values). Some code sets part of that key up on its first call and
only reads it after: transformers' models install their output-capturing hooks and set
`_output_capturing_hooks_installed` the first time `output_hidden_states` or `output_attentions` is asked for. The
trace runs the step's Python once, so it changes the key as a first eager call does; the next call then saw another
key and compiled the step again (at 13B, a trace, the plan and the fused regions a second time).

`trace_keyed` traces, and where the trace changed the model's key it traces once more under the changed state,
taking the same guard outcomes. Invariant: it returns a graph with the key it was traced under. Where the second trace
leaves the key as it found it and its graph is the first's (`same_trace`), the state was set up once and is now
read: the second graph is returned with the key as it now is, which the next call presents, and nothing is warned.
Otherwise (a counter the step increments, a hook it adds at every call) the first graph is returned with the key
before it, as without the second trace, and the changed plain values are warned of
(python_state.warn_value_changes). The second trace runs the step's Python a second time: a value the step changes
at every call has then changed twice at this compile (the warning says so), and the next call compiles again, as it
did without the second trace.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.fx as fx
import torch.nn as nn

from ..frontend.python_state import changes, snapshot, warn_value_changes
from ..frontend.trace import trace_step
from ..ir.graph import Settings, TrainGraph
from .guarded import traced_outcomes


@dataclass(frozen=True)
class KeyedTrace:
    graph: TrainGraph
    key: tuple              # the model's key the graph was traced under
    settled: bool           # traced twice: the first trace set up state the second read unchanged


def trace_keyed(fn: Callable, model: nn.Module, batch: tuple, settings: Settings, assume: tuple,
                values: dict | None, key: Callable[[], tuple], between: Callable[[], None]) -> KeyedTrace:
    """`trace_step(fn, model, *batch)`, traced once more where it changed `key()` (see the module docstring).
    `values`: python_state.snapshot(model, fn) taken just before, where the caller has one. `between`: called
    before a second trace (the caller's safe point: a Ctrl-C held over the first trace is delivered there)."""
    before_key = key()
    before = snapshot(model, fn) if values is None else values
    graph = trace_step(fn, model, batch, settings, assume, values=before, warn_changes=False)
    after_key = key()
    if after_key == before_key:
        return KeyedTrace(graph, before_key, settled=False)
    between()
    after = snapshot(model, fn)
    again = trace_step(fn, model, batch, settings, traced_outcomes(graph), values=after, warn_changes=False)
    if key() == after_key and same_trace(graph, again):
        return KeyedTrace(again, after_key, settled=True)
    warn_value_changes(changes(before, after), again=changes(after, snapshot(model, fn)) != [])
    return KeyedTrace(graph, before_key, settled=False)


def same_trace(a: TrainGraph, b: TrainGraph) -> bool:
    """Whether two traces of a step are the same graph: the same model tensors, inputs and outputs, and node for
    node the same operators on the same arguments, with values of the same shapes, dtypes and strides and the same
    constants. Conservative: what cannot be compared counts as different."""
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
            if x.op == "get_attr" and _plain(getattr(a.gm, x.target)) != _plain(getattr(b.gm, y.target)):
                return False
        return True
    except Exception:       # a value whose == is not a bool, or raises
        return False


def _same_outputs(a, b) -> bool:
    if a is None or b is None:
        return a is b
    return a.spec == b.spec and _plain(a.leaves) == _plain(b.leaves)


def _plain(v):
    """v with fx nodes as their names and tensors as their shape, dtype, stride and (real tensors) values."""
    def one(x):
        if isinstance(x, fx.Node):
            return ("node", x.name)
        if isinstance(x, torch.Tensor):
            described = (tuple(x.shape), x.dtype, x.stride(), x.device.type)
            if x.device.type == "meta" or type(x) is not torch.Tensor and not isinstance(x, nn.Parameter):
                return ("tensor",) + described          # a fake or subclass value: its metadata
            return ("tensor",) + described + (tuple(x.detach().cpu().reshape(-1).tolist()),)
        if isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            return ("sym", str(x))
        return x
    return fx.node.map_aggregate(v, one)
