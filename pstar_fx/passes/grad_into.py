"""Gradients computed straight into their chunks, a step of assign_chunks.

A first gradient write (`write_grad`, accumulate=False) copies a transient gradient into its chunk. Where that
gradient is the whole output of an operation with an `out=` form (a Linear weight's `mm`, a tied weight's `add`, a
bias's `sum`), `compute_grad` runs the operation with its output in the chunk instead: the same kernel on the same
inputs writes the same bits, and the transient and its copy go. On the CPU only (`fold_grad_producers` says why).

Invariant: a write is folded only if it copies (later micro-batches add, which the out= form would round otherwise);
between the operation and the write there are only views, each the sole user of the one before, the operation's
output is contiguous, and the gradient is a contiguous view of it at offset 0 with as many elements (so element i of
the gradient is element i of the output, and the output viewed as its own shape is the chunk range); the output's
dtype is the chunk's; and no input aliases a parameter (a chunk whose gradients overwrite its parameters in place
must not be read while written). The folded node keeps the write's place, role and keywords, so every pass treats it
as the write it replaces.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from ..ir import ops
from ..ir.fx_utils import storage_key

aten = torch.ops.aten
_VIEWS = frozenset({aten.t.default, aten.view.default, aten._unsafe_view.default, aten.transpose.int,
                    aten.permute.default, aten.squeeze.dim, aten.unsqueeze.default, aten.alias.default})


def _val(n: fx.Node):
    v = n.meta.get("val")
    return v if isinstance(v, torch.Tensor) else None


def _producer(grad: fx.Node, dtype: torch.dtype, param_alias) -> tuple[fx.Node, list[fx.Node]] | None:
    """(the operation, the views between it and `grad`) when the write of `grad` can fold it, else None."""
    chain = []
    n = grad
    while n.op == "call_function" and n.target in _VIEWS:
        chain.append(n)
        n = n.args[0]
    if n.op != "call_function" or n.target not in ops.OUT_FORMS or n.kwargs.get("out") is not None:
        return None
    out, g = _val(n), _val(grad)
    if out is None or g is None or out.dtype != dtype or g.dtype != dtype:
        return None
    if not all(type(d) is int for d in out.shape):     # a dynamic size: the shape keyword must be concrete
        return None
    if not (out.is_contiguous() and g.is_contiguous() and g.storage_offset() == 0 and out.storage_offset() == 0
            and g.numel() == out.numel() and storage_key(g) == storage_key(out)):
        return None
    if any(len(m.users) != 1 for m in [n] + chain):
        return None
    if any(a in param_alias for a in n.all_input_nodes):
        return None
    return n, chain


def fold_grad_producers(graph: fx.Graph, ann: dict, dtype: torch.dtype, param_alias, device: torch.device) -> int:
    """Fold each eligible first gradient write with the operation that makes its gradient (module docstring), in
    place on `graph` and `ann`; `param_alias`: the nodes whose values alias a parameter. Returns how many.
    On the CPU only: there a kernel writes the same bits into a chunk range as into a new tensor (the tests compare
    them bit for bit). On CUDA a bf16 `mm` into a chunk range (64-byte aligned) gave other bits than into a fresh
    allocation (cuBLASLt picks its algorithm by the pointers' alignment), so the step would no longer be eager's bit
    for bit; there the writes stay copies."""
    if device.type != "cpu":
        return 0
    folded = 0
    for w in list(graph.nodes):
        if w.op != "call_function" or w.target is not ops.write_grad or w.kwargs.get("accumulate", False):
            continue
        found = _producer(w.args[0], dtype, param_alias)
        if found is None:
            continue
        op, chain = found
        with graph.inserting_before(w):
            c = graph.call_function(ops.compute_grad, op.args, {
                **op.kwargs, "op": ops.OUT_FORMS[op.target], "shape": tuple(_val(op).shape),
                "param": w.kwargs["param"], "accumulate": False, "final": w.kwargs.get("final", True)})
        c.meta["stack_trace"] = op.meta.get("stack_trace")
        ann[c.name] = ann.pop(w.name)
        graph.erase_node(w)
        for n in chain + [op]:
            graph.erase_node(n)
            ann.pop(n.name, None)
        folded += 1
    return folded
