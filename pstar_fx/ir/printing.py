"""Printing a TrainGraph: a header naming the stage and the pass that made it, then one line per node with its
phase, shape, dtype, new bytes, live activation bytes and resident chunk bytes. Deterministic: no addresses, no
timings, so tests can compare the text."""
from __future__ import annotations

import torch
import torch.fx as fx

from ..units import format_bytes
from .fx_utils import data_dependent_sizes, tensors_of
from .graph import REMAT, ParamHome, Role, TrainGraph


def _arg(a) -> str:
    if isinstance(a, fx.Node):
        return a.name
    if isinstance(a, (list, tuple)):
        inner = ", ".join(_arg(x) for x in a)
        return f"[{inner}]"
    if hasattr(a, "value") and a.__class__.__module__.startswith("pstar_fx"):
        return a.value   # enums print as their value: buf=param
    if isinstance(a, torch.dtype):
        return str(a).replace("torch.", "")
    if isinstance(a, torch._ops.OpOverload):    # compute_grad's op=aten.mm.out
        return _op_name(a)
    return repr(a)


def _op_name(t: torch._ops.OpOverload) -> str:
    return f"aten.{t.overloadpacket.__name__}" + ("" if t._overloadname == "default" else f".{t._overloadname}")


def _target(n: fx.Node) -> str:
    t = n.target
    if n.op == "placeholder":
        return "placeholder"
    if isinstance(t, torch._ops.OpOverload):
        return _op_name(t)
    return getattr(t, "__name__", str(t))


def _call(g: TrainGraph, n: fx.Node) -> str:
    a = g.ann[n.name]
    if n.op == "placeholder":
        if a.role is Role.INPUT:
            return "input"
        if a.role is Role.SCALE:
            return "loss_scale"
        return f"{a.role.value}({a.param or n.meta.get('buffer', '')})"
    if n.op == "output":
        return f"return {_arg(n.args[0])}"
    if n.op == "get_attr":
        return f"constant({n.target})"
    args = [_arg(x) for x in n.args] + [f"{k}={_arg(v)}" for k, v in n.kwargs.items()]
    return f"{_target(n)}({', '.join(args)})"


def _shape(n: fx.Node) -> tuple[str, str]:
    ts = tensors_of(n)
    if not ts:
        return "-", "-"
    if len(ts) == 1:
        return str(tuple(ts[0].shape)), str(ts[0].dtype).replace("torch.", "")
    return f"{len(ts)} tensors", str(ts[0].dtype).replace("torch.", "")


def format_lines(g: TrainGraph) -> list[str]:
    lines = []
    for i, n in enumerate(g.nodes):
        a = g.ann[n.name]
        shape, dtype = _shape(n)
        live = "-" if a.live_bytes is None else format_bytes(a.live_bytes)
        res = "-" if a.resident_bytes is None else format_bytes(a.resident_bytes)
        call = _call(g, n)
        phase = "recompute" if REMAT in n.meta else a.phase.value     # a forward value computed again in backward
        lines.append(f"{i:5d} {phase:9s} {n.name:24s} = {call:60s} {shape:18s} {dtype:9s} "
                     f"{format_bytes(a.bytes):>11s} {live:>11s} {res:>11s}")
    return lines


def header(g: TrainGraph) -> str:
    s = g.settings
    parts = [f'stage "{g.stage}" made by {g.made_by}', f"{len(g.nodes)} nodes", f"precision {s.precision.value}",
             f"device {s.device.type}", "budget " + ("unlimited" if s.budget is None else format_bytes(s.budget))]
    if g.chunks:
        parts.append(f"{len(g.chunks)} chunks")
    if g.plan is not None:
        parts.append(f"predicted peak {format_bytes(g.plan.predicted_peak)}")
    return "# " + ", ".join(parts)


def format_graph(g: TrainGraph) -> str:
    cols = (f"{'#':>5s} {'phase':9s} {'node':24s}   {'op':60s} {'shape':18s} {'dtype':9s} "
            f"{'new bytes':>11s} {'live':>11s} {'resident':>11s}")
    body = [header(g), cols] + format_lines(g)
    sizes = data_dependent_sizes(g.nodes)
    if sizes:   # the shapes name them u0, u1, ...; bytes count them at their bound
        body.append("# data-dependent sizes, planned at their upper bound (debug=True: measured <= predicted where "
                    "one is alive):")
        body += [f"#   {d.symbol} <= {d.bound}: {_target(d.node)} at node {d.node.name}" for d in sizes]
    if g.chunks:
        body.append("# chunks:")
        for c in g.chunks:
            home = f", states on {c.state_home.value}" if c.state_home else ""
            home += " (updated on the device, streamed)" if c.streamed else ""
            inplace = ", grads in place" if c.grad_inplace else ""
            cast = ", params cast from the master" if c.param_home is ParamHome.MASTER else ""
            body.append(f"#   chunk {c.id}: {c.group.value}, {c.capacity} x {str(c.dtype).replace('torch.', '')} "
                        f"({format_bytes(c.nbytes)}, {c.used} used){home}{inplace}{cast}: {', '.join(c.params)}")
    return "\n".join(body)
