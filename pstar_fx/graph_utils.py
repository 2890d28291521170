"""Small graph helpers shared by the passes: op schema facts and storage identity of fake values."""
from __future__ import annotations

import torch
import torch.fx as fx
from torch.utils._pytree import tree_leaves


# Ops that write to arguments their schema does not annotate as written: the positions they write.
_UNANNOTATED_WRITES = {
    torch.ops.aten.native_batch_norm.default: (3, 4),     # running_mean, running_var (in training)
    torch.ops.aten.cudnn_batch_norm.default: (3, 4),
    torch.ops.aten.miopen_batch_norm.default: (3, 4),
}


def mutated_args(node: fx.Node) -> list[fx.Node]:
    """The node's arguments that its op writes to, from the op schema's alias annotations (and, for ops whose
    schema leaves a write unannotated, from the table above)."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return []
    out = [node.args[i] for i in _UNANNOTATED_WRITES.get(node.target, ())
           if i < len(node.args) and isinstance(node.args[i], fx.Node)]
    for i, a in enumerate(schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            v = node.args[i] if i < len(node.args) else node.kwargs.get(a.name)
            if isinstance(v, fx.Node):
                out.append(v)
    return out


_SEED_SCALING = (torch.ops.aten.mul.Tensor, torch.ops.aten.div.Tensor)


def loss_seed(graph: fx.Graph, loss: fx.Node) -> fx.Node | None:
    """The `ones_like` that starts backward: applied to the loss, or to the loss scaled first (divided by the
    number of micro-batches with accumulation, multiplied by the fp16 loss scale, or both)."""
    candidates = [loss]
    for _ in range(2):
        candidates += [u for c in candidates for u in c.users if u.target in _SEED_SCALING and u not in candidates]
    for c in candidates:
        for u in c.users:
            if u.target is torch.ops.aten.ones_like.default:
                return u
    return None


def tensors_of(node: fx.Node) -> list[torch.Tensor]:
    """The (fake) tensors a node produces, from node.meta["val"]."""
    return [t for t in tree_leaves(node.meta.get("val")) if isinstance(t, torch.Tensor)]


def storage_key(t: torch.Tensor) -> int:
    """Identity of a tensor's storage: views and in-place results share it."""
    return t.untyped_storage()._cdata


def storage_bytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


def output_node(graph: fx.Graph) -> fx.Node:
    for n in reversed(graph.nodes):
        if n.op == "output":
            return n
    raise AssertionError("graph has no output node")


def last_uses(nodes: list[fx.Node]) -> list[int]:
    """Per node position: the position of its last user (itself when it has none); a value is freed after it."""
    index = {n: i for i, n in enumerate(nodes)}
    return [max((index[u] for u in n.users), default=i) for i, n in enumerate(nodes)]
