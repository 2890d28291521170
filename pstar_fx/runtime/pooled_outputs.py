"""Large activations written into the device pool's buffers through the ops' `out=` overloads.

Near a full GPU, torch's caching allocator fails to find a free block for a large activation whenever the blocks of
released chunk slots and of smaller activations are scattered through its segments: it then frees its whole cache
and retries, a device synchronisation that drains the queue of launched kernels (tens per step at a 17B model,
mostly at the MLP's activations). The activations that cost this are few and of few sizes (one per layer and
kind), so the executor gives each of them a buffer from the device pool, which hands the same buffer to the next
activation of that size (an exact fit, nothing split) and keeps chunk slots and large activations out of torch's
cache. Small activations stay with torch's allocator.

A node's output goes to the pool when it is one fresh tensor (no view of an input) of at least the pool's threshold,
its op has an `out=` overload taking the same arguments, and the value does not leave the step (a graph output, or
a view of one, is returned to the caller and must outlive the step's buffers). The out overload runs the same kernel
into the given buffer, laid out with the shape and strides the trace recorded.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from ..ir.fx_utils import storage_bytes, storage_key, tensors_of


@dataclass(frozen=True)
class PooledOutput:
    """How node writes its output into a pool buffer: `op(*args, **kwargs, **{arg: buffer})`."""
    op: torch._ops.OpOverload
    arg: str                         # the name of the out argument ("out", "grad_input", ...)
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    numel: int                       # elements of the buffer (the storage the trace recorded)
    dtype: torch.dtype

    @property
    def key(self) -> tuple[int, torch.dtype]:
        return self.numel, self.dtype


def out_overload(op) -> tuple[torch._ops.OpOverload, str] | None:
    """The overload of op's packet that takes op's arguments plus one tensor to write its output into, and that
    argument's name; None where there is none."""
    if not isinstance(op, torch._ops.OpOverload):
        return None
    schema = op._schema
    if len(schema.returns) != 1 or schema.returns[0].alias_info is not None or schema.is_mutable:
        return None
    args = [(a.name, str(a.type)) for a in schema.arguments]
    packet = op.overloadpacket
    for overload in packet.overloads():
        candidate = getattr(packet, overload)
        s = candidate._schema
        outs = [a for a in s.arguments if a.is_out]
        if (len(outs) == 1 and len(s.returns) == 1
                and [(a.name, str(a.type)) for a in s.arguments if not a.is_out] == args):
            return candidate, outs[0].name
    return None


def _aliases_an_input(n: fx.Node) -> bool:
    schema = getattr(n.target, "_schema", None)
    return schema is not None and any(r.alias_info is not None for r in schema.returns)


def escaping(nodes: list[fx.Node]) -> set[fx.Node]:
    """The nodes whose value the graph's output holds, directly or through views."""
    out: set[fx.Node] = set()
    stack = [a for n in nodes if n.op == "output" for a in n.all_input_nodes]
    while stack:
        n = stack.pop()
        if n in out:
            continue
        out.add(n)
        if _aliases_an_input(n) or n.op != "call_function":
            stack.extend(n.all_input_nodes)
    return out


def pooled_output(n: fx.Node, threshold: int, escapes: set[fx.Node]) -> PooledOutput | None:
    """How n's output goes to the pool, or None where it stays with torch's allocator."""
    if n.op != "call_function" or n in escapes:
        return None
    vals = tensors_of(n)
    if len(vals) != 1 or not isinstance(n.meta.get("val"), torch.Tensor):
        return None
    v = vals[0]
    if v.storage_offset() != 0 or not isinstance(v.untyped_storage().nbytes(), int):
        return None
    nbytes = storage_bytes(v)
    if nbytes < threshold:
        return None
    key = storage_key(v)
    if any(storage_key(t) == key for a in n.all_input_nodes for t in tensors_of(a)):
        return None       # the op returns (a view of) an input's memory though its schema says not (_unsafe_view)
    found = out_overload(n.target)
    if found is None:
        return None
    op, arg = found
    if arg in n.kwargs:
        return None
    return PooledOutput(op, arg, tuple(v.shape), tuple(v.stride()), nbytes // v.element_size(), v.dtype)
