"""What a traced step's graph may not hold, each refused with an UntraceableError that names the op and the user's
line: a sparse tensor (chunks and the plan hold dense ones), and a torch.Generator object (a compiled step draws from
torch's global generator as it runs); and a loss that reaches no trainable parameter."""
from __future__ import annotations

import torch
import torch.fx as fx

from ..errors import UntraceableError
from ..ir.fx_utils import user_frame


def reject_sparse(gm: fx.GraphModule) -> None:
    """Chunks and the plan hold dense (strided) tensors: a sparse one (nn.Embedding(sparse=True)'s gradient) is
    refused, naming the op that made it and the line of a sparse embedding where there is one."""
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) and val.layout != torch.strided:
            sparse_embedding = next((n for n in gm.graph.nodes if n.target is torch.ops.aten.embedding.default
                                     and len(n.args) > 4 and n.args[4]), None)
            where = user_frame(sparse_embedding) if sparse_embedding is not None else None
            line = " ".join(where) if where else "source unknown"
            hint = ("" if sparse_embedding is None else
                    f": a sparse embedding (nn.Embedding(sparse=True), {line}); use sparse=False, which trains the "
                    "same values")
            raise UntraceableError(f"cannot trace the training step: operation {node.target} makes a {val.layout} "
                                   f"tensor, and pstar-fx holds dense tensors only{hint}")


def reject_generators(gm: fx.GraphModule) -> None:
    """A torch.Generator object in the graph (randn(..., generator=g)) would be the trace's object, its state
    advanced by every step as one stream, not seeded again as the function's code does: refused, naming the op and
    the user's line. The global generator serves: a compiled step's random operations draw from it as they run."""
    for node in gm.graph.nodes:
        if node.op != "get_attr" or not isinstance(getattr(gm, node.target, None), torch.Generator):
            continue
        user = next(iter(node.users), node)
        where = user_frame(user)
        raise UntraceableError(f"cannot trace the training step: operation {user.target} draws from a "
                               f"torch.Generator object ({' '.join(where) if where else 'source unknown'}), which a "
                               "compiled step cannot replay as eager code does: draw from torch's global generator "
                               "(drop generator=; seed it with torch.manual_seed in the training loop)")


def check_reached(grads: list) -> None:
    """A loss that reaches no trainable parameter (a branch returning a constant that requires grad, such as
    `torch.zeros((), requires_grad=True)` for an empty batch) would train nothing, and the trace would lay the chunks
    out with every parameter frozen: refused, so that a condition the trace took by default is taken the other way
    (frontend/guards.py tried_both_ways) and the step's chunks come from the branch that trains."""
    if all(g is None for g in grads):
        raise UntraceableError(
            "the loss does not depend on any trainable parameter (it is a constant, or a branch returns one), so a "
            "step would train nothing; skip such batches in the training loop, or make the loss depend on the model "
            "(e.g. add model_output.sum() * 0)")
