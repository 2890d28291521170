"""canonicalize: drop dead nodes and split forward from backward by data flow from the loss seed.

Invariant after: no `aten.detach` is left (each one's users use its input: no autograd runs in the step, so it is the
identity on values, and an alias of the same storage either way); every call_function node either has a user, writes
to one of its arguments, is a guard, or is the loss; each
node's phase is BACKWARD iff it depends on the loss seed (`ones_like(loss)`, the start of backward), FORWARD otherwise;
the outputs are `[loss, aux..., grads...]` (ir/outputs.py: the micro-batch losses are dropped), `grad_outputs[i]` names
the parameter of gradient output i, and every named gradient depends on the seed.
With accumulate=K there is one seed per micro-batch and each parameter's gradient is output K times, in micro-batch
order (the runtime accumulates them into its chunk).
A trainable parameter whose gradient does not depend on the seed gets none (eager PyTorch leaves its `.grad` None and
the optimizer skips it): it is marked not trainable and its gradient output is dropped.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx

from ..ir import ops
from ..ir.fx_utils import loss_seed, mutated_args, output_node
from ..ir.graph import Phase, TrainGraph, copy_graph, to_module
from ..ir.outputs import split_outputs


def canonicalize(g: TrainGraph) -> TrainGraph:
    graph, _ = copy_graph(g)
    _drop_detaches(graph)
    out_node = output_node(graph)
    outputs = list(out_node.args[0])
    if g.settings.optimizer is None:          # forward only: every output is the function's, all forward
        _eliminate_dead_code(graph)
        ann = {n.name: g.ann[n.name] for n in graph.nodes}
        return g.evolve(gm=to_module(graph, g.gm), stage="canonical", made_by="canonicalize", ann=ann)
    micro = g.settings.accumulate
    trainable = [p for p in g.params if p.trainable]
    parts = split_outputs(outputs, micro, g.aux)
    loss, micro_losses, aux, grads = parts.loss, parts.micro_losses, parts.aux, parts.grads
    assert len(grads) == micro * len(trainable), (len(grads), micro, len(trainable))

    backward: set[fx.Node] = set()
    for seed in (loss_seed(graph, m) for m in micro_losses):
        if seed is None:
            continue
        frontier = [seed]
        backward.add(seed)
        while frontier:
            n = frontier.pop()
            for u in n.users:
                if u not in backward and u.op != "output":
                    backward.add(u)
                    frontier.append(u)

    # a parameter gets a gradient iff it does in the first micro-batch (the same program runs for each)
    reached = [isinstance(gn, fx.Node) and gn in backward for gn in grads[:len(trainable)]]
    no_grad = {p.name for p, r in zip(trainable, reached) if not r}
    kept_grads, grad_names = [], []
    for k in range(micro):
        for p, r, gnode in zip(trainable, reached, grads[k * len(trainable):(k + 1) * len(trainable)]):
            if r:
                assert isinstance(gnode, fx.Node) and gnode in backward, (p.name, k)
                kept_grads.append(gnode)
                grad_names.append(p.name)
    out_node.args = ([loss] + aux + kept_grads,)

    _eliminate_dead_code(graph)

    ann = {}
    for node in graph.nodes:
        a = g.ann[node.name]
        if node.op == "call_function":
            a = dataclasses.replace(a, phase=Phase.BACKWARD if node in backward else Phase.FORWARD)
        ann[node.name] = a
    params = tuple(dataclasses.replace(p, trainable=False) if p.name in no_grad else p for p in g.params)
    return g.evolve(gm=to_module(graph, g.gm), stage="canonical", made_by="canonicalize", ann=ann, params=params,
                    grad_outputs=tuple(grad_names))


def _drop_detaches(graph: fx.Graph) -> None:
    """Each aten.detach's users use its input, and the detach goes (autograd's saved tensors, traced)."""
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is torch.ops.aten.detach.default:
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)


def _eliminate_dead_code(graph: fx.Graph) -> None:
    """Last to first, drop ops whose value nobody uses, keeping ops that write to an argument (buffer updates) and
    guards (they check what the trace assumed, ir/guards.py)."""
    for node in reversed(list(graph.nodes)):
        if node.op == "call_function" and not node.users and not mutated_args(node) and node.target is not ops.guard:
            graph.erase_node(node)
