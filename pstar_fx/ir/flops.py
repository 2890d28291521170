"""FLOPs of one aten node: matmuls, convolutions and attention (the compute-bound ops the cost model times by their
FLOPs), and the helpers that read a node's traced values. The cost model (pstar_fx/cost.py) times nodes with these;
the planner's report counts the attention FLOPs of the forward (api/plan.py)."""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.fx as fx

from . import ops


def val(a):
    return a.meta.get("val") if isinstance(a, fx.Node) else None


def _arg(n: fx.Node, name: str, position: int):
    """An argument by schema name (or position when the op has no schema)."""
    schema = getattr(n.target, "_schema", None)
    if schema is not None:
        for i, a in enumerate(schema.arguments):
            if a.name == name:
                if i < len(n.args):
                    return n.args[i]
                return n.kwargs.get(name, a.default_value)
    return n.args[position] if position < len(n.args) else n.kwargs.get(name)


def numel(shape) -> int:
    return math.prod(int(s) for s in shape)


def _mm(n):          # (M, K) @ (K, N)
    a, b = val(n.args[0]), val(n.args[1])
    return 2.0 * a.shape[0] * a.shape[1] * b.shape[1]


def _addmm(n):       # bias + (M, K) @ (K, N)
    a, b = val(n.args[1]), val(n.args[2])
    return 2.0 * a.shape[0] * a.shape[1] * b.shape[1]


def _bmm(n):         # (b, M, K) @ (b, K, N)
    a, b = val(n.args[0]), val(n.args[1])
    return 2.0 * a.shape[0] * a.shape[1] * a.shape[2] * b.shape[2]


def _baddbmm(n):
    a, b = val(n.args[1]), val(n.args[2])
    return 2.0 * a.shape[0] * a.shape[1] * a.shape[2] * b.shape[2]


def _conv(n):        # 2 x output elements x (input channels / groups) x kernel elements
    out, w = val(n), val(n.args[1])
    return 2.0 * out.numel() * w.shape[1] * numel(w.shape[2:])


def _conv_backward(n):   # grad_input and grad_weight each cost a forward, as output_mask asks
    grad_out, w = val(n.args[0]), val(n.args[2])
    mask = _arg(n, "output_mask", 10) or (True, True, False)
    return 2.0 * grad_out.numel() * w.shape[1] * numel(w.shape[2:]) * (int(mask[0]) + int(mask[1]))


def _attention(n, factor: float = 1.0):
    """Q K^T and P V: 4 B H Tq Tk D FLOPs forward, half of it with a causal mask (the kernels skip masked blocks)."""
    q, k = val(_arg(n, "query", 0)), val(_arg(n, "key", 1))
    flops = 4.0 * numel(q.shape[:-1]) * k.shape[-2] * q.shape[-1]
    return flops * factor * (0.5 if _arg(n, "is_causal", -1) else 1.0)


def _attention_backward(n):   # flash backward: five matmuls of the forward's two (recomputes Q K^T)
    return _attention(n, 2.5)


def aten_ops(*names: str) -> list:
    """The aten overloads that exist in this torch (names vary across versions and builds)."""
    out = []
    for name in names:
        packet, _, overload = name.partition(".")
        op = getattr(getattr(torch.ops.aten, packet, None), overload or "default", None)
        if op is not None:
            out.append(op)
    return out


# FLOPs of the compute-bound ops, keyed by op; attention ops are charged at attention_efficiency
MATMUL_FLOPS: dict[object, Callable[[fx.Node], float]] = {
    **{op: _mm for op in aten_ops("mm")},
    **{op: _addmm for op in aten_ops("addmm")},
    **{op: _bmm for op in aten_ops("bmm")},
    **{op: _baddbmm for op in aten_ops("baddbmm")},
    **{op: _conv for op in aten_ops("convolution", "_convolution")},
    **{op: _conv_backward for op in aten_ops("convolution_backward")},
}
ATTENTION_FLOPS: dict[object, Callable[[fx.Node], float]] = {
    **{op: _attention for op in aten_ops(
        "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
        "_flash_attention_forward", "_efficient_attention_forward")},
    **{op: _attention_backward for op in aten_ops(
        "_scaled_dot_product_flash_attention_backward", "_scaled_dot_product_flash_attention_for_cpu_backward",
        "_scaled_dot_product_efficient_attention_backward", "_scaled_dot_product_cudnn_attention_backward",
        "_flash_attention_backward", "_efficient_attention_backward")},
}
FORWARD_ATTENTION = frozenset(op for op, rule in ATTENTION_FLOPS.items() if rule is _attention)

def bounded(x) -> float:
    """A number; a data-dependent one (a SymInt or SymFloat of a size only known when the step runs): its upper
    bound, as the memory plan takes it (0 when unbounded: the tracer refuses those)."""
    if isinstance(x, (torch.SymInt, torch.SymFloat)):
        up = x.node.shape_env.bound_sympy(x.node.expr).upper
        return float(up) if up.is_finite else 0.0
    return float(x)


def op_of(n: fx.Node):
    """The aten operation a node runs: a gradient write with its operation folded in (`compute_grad`) runs that
    operation, into its chunk."""
    return ops.FUNCTIONAL_OF[n.kwargs["op"]] if n.target is ops.compute_grad else n.target


def flops(n: fx.Node) -> float:
    """FLOPs of a matmul, convolution or attention node (0 for any other)."""
    op = op_of(n)
    rule = MATMUL_FLOPS.get(op) or ATTENTION_FLOPS.get(op)
    return bounded(rule(n)) if rule is not None else 0.0
