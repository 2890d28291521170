"""What running a node costs, estimated from its op and its fake values, in seconds on the measured H200 (FACTS.md).

FLOPs come from a table keyed by op: torch's own formulas (`torch.utils.flop_counter`'s registry: matmuls,
convolutions, attention) plus the few ops it lacks; every other op counts no FLOPs. Memory traffic is the bytes the
node reads and writes. A node's time is its FLOPs at the matmul rate plus its bytes at the device's copy rate: a
roofline sum, pessimistic for matmuls and right for the memory-bound rest. The passes compare such times with the
time a host <-> device copy of the same bytes would take (`copy_seconds`).
"""
from __future__ import annotations

import torch
import torch.fx as fx
from torch.utils.flop_counter import flop_registry

from .graph_utils import storage_key, tensors_of

DEVICE_FLOPS = 750e12        # bf16 matmul 8192^3 on the H200: 752 TFLOP/s
DEVICE_BYTES = 4.2e12        # device-to-device copy, read + write
LINK_BYTES = 55e9            # pinned host <-> device copy, each way

aten = torch.ops.aten


def _sdpa_flops(q, k, v, *args, out_val=None, **kwargs) -> int:
    """QK^T and PV: 2 matmuls of (B, H, L, E) x (B, H, E, S)."""
    b, h, lq, e = q.shape
    s, ev = k.shape[-2], v.shape[-1]
    return 2 * b * h * lq * s * (e + ev)


# ops torch's registry does not cover (packet -> f(*args, out_val=..., **kwargs) over fake values)
_EXTRA_FLOPS = {
    aten._scaled_dot_product_flash_attention_for_cpu: _sdpa_flops,
}


def flops(n: fx.Node) -> int:
    if n.op != "call_function" or not isinstance(n.target, torch._ops.OpOverload):
        return 0
    packet = n.target.overloadpacket
    rule = flop_registry.get(packet) or _EXTRA_FLOPS.get(packet)
    if rule is None:
        return 0
    args, kwargs = fx.node.map_arg((n.args, n.kwargs), lambda a: a.meta.get("val"))
    try:
        return int(rule(*args, **kwargs, out_val=n.meta.get("val")))
    except Exception:  # noqa: BLE001 - a formula that does not take this overload's arguments: count none
        return 0


def bytes_touched(n: fx.Node) -> int:
    """Bytes the node reads (its tensor inputs) and writes (its outputs); none for a view of an input."""
    if n.op != "call_function" or not isinstance(n.target, torch._ops.OpOverload):
        return 0
    outs = tensors_of(n)
    ins = [t for a in n.all_input_nodes for t in tensors_of(a)]
    if outs and {storage_key(t) for t in outs} <= {storage_key(t) for t in ins}:
        return 0
    return sum(t.numel() * t.element_size() for t in outs + ins)


def seconds(n: fx.Node) -> float:
    """Estimated time to run the node on the device."""
    return flops(n) / DEVICE_FLOPS + bytes_touched(n) / DEVICE_BYTES


def copy_seconds(nbytes: int) -> float:
    """Time to copy nbytes between host and device, one way."""
    return nbytes / LINK_BYTES
