"""canonicalize: drop dead nodes and split forward from backward by data flow from the loss seed.

Invariant after: every call_function node either has a user, writes to one of its arguments, or is the loss; each
node's phase is BACKWARD iff it depends on the loss seed (`ones_like(loss)`, the start of backward), FORWARD otherwise;
`grad_outputs[i]` names the parameter whose gradient is output i + 1, and every named gradient depends on the seed.
A trainable parameter whose gradient does not depend on the seed gets none (eager PyTorch leaves its `.grad` None and
the optimizer skips it): it is marked not trainable and its gradient output is dropped.
"""
from __future__ import annotations

import dataclasses

import torch.fx as fx

from ..ir import Phase, TrainGraph, copy_graph, to_module
from .graph_utils import loss_seed, mutated_args, output_node


def canonicalize(g: TrainGraph) -> TrainGraph:
    graph, _ = copy_graph(g)
    out_node = output_node(graph)
    outputs = list(out_node.args[0])
    loss, grads = outputs[0], outputs[1:]
    trainable = [p for p in g.params if p.trainable]
    assert len(grads) == len(trainable), (len(grads), len(trainable))

    seed = loss_seed(graph, loss)
    backward: set[fx.Node] = set()
    if seed is not None:
        frontier = [seed]
        backward.add(seed)
        while frontier:
            n = frontier.pop()
            for u in n.users:
                if u not in backward and u.op != "output":
                    backward.add(u)
                    frontier.append(u)

    kept_grads, grad_names, no_grad = [], [], set()
    for p, gnode in zip(trainable, grads):
        if isinstance(gnode, fx.Node) and gnode in backward:
            kept_grads.append(gnode)
            grad_names.append(p.name)
        else:
            no_grad.add(p.name)
    out_node.args = ([loss] + kept_grads,)

    # Dead-code elimination, last to first, keeping ops that write to an argument (buffer updates).
    for node in reversed(list(graph.nodes)):
        if node.op == "call_function" and not node.users and not mutated_args(node):
            graph.erase_node(node)

    ann = {}
    for node in graph.nodes:
        a = g.ann[node.name]
        if node.op == "call_function":
            a = dataclasses.replace(a, phase=Phase.BACKWARD if node in backward else Phase.FORWARD)
        ann[node.name] = a
    params = tuple(dataclasses.replace(p, trainable=False) if p.name in no_grad else p for p in g.params)
    return g.evolve(gm=to_module(graph, g.gm), stage="canonical", made_by="canonicalize", ann=ann, params=params,
                    grad_outputs=tuple(grad_names))
