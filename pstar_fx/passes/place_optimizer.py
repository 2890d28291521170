"""place_optimizer: one `optimizer_step` per trainable chunk, right after the chunk's last use; states placed.

Invariant after: every trainable chunk has exactly one `optimizer_step(chunk=c)`, after the last write of any of its
gradients and after the last read of any of its parameters (so the update overlaps the rest of backward), and a
`state_home`: DEVICE for as many chunks as the budget allows while every node's minimum need still fits with room
for two more chunk buffers, HOST for the rest. With fp16 loss scaling every step follows one `unscale()` node placed
after the last gradient write, since an overflow anywhere must skip every chunk's update.
"""
from __future__ import annotations

import dataclasses

import torch.fx as fx

from .. import ops
from ..ir import ChunkGroup, NodeAnn, Phase, Precision, Role, StateHome, TrainGraph, copy_graph, to_module
from .liveness import analyze
from .memory import NO_NEEDS, all_needs, buf_bytes, needs, state_bytes, static_bytes


def min_need(g: TrainGraph) -> int:
    """The least device bytes any schedule of g needs: static + max over nodes of live + workspace + the node's own
    chunk buffers."""
    nodes = g.nodes
    lv = analyze(nodes, g.ann)
    worst = 0
    for i, nd in enumerate(all_needs(g)):
        worst = max(worst, lv.live[i] + nd.workspace + sum(buf_bytes(g, k) for k in nd.resident))
    return static_bytes(g) + worst


def place_optimizer(g: TrainGraph) -> TrainGraph:
    graph, _ = copy_graph(g)
    ann = dict(g.ann)
    nodes = list(graph.nodes)
    last_use: dict[int, fx.Node] = {}
    last_write: fx.Node | None = None
    for n, x in zip(nodes, all_needs(g)):
        for k in x.resident:
            last_use[k.chunk] = n
        if ann[n.name].role is Role.WRITE_GRAD:
            last_write = n
    trainable = [c for c in g.chunks if c.group is ChunkGroup.TRAINABLE]
    anchor: fx.Node | None = None
    if g.settings.precision is Precision.FP16 and last_write is not None:
        with graph.inserting_after(last_write):
            anchor = graph.call_function(ops.unscale, (), {})
        ann[anchor.name] = NodeAnn(role=Role.UNSCALE, phase=Phase.OPTIMIZER)
    position = {n: i for i, n in enumerate(graph.nodes)}
    for c in reversed(trainable):   # inserted last-first so equal anchors keep chunk order
        after = last_use.get(c.id)
        if after is None:
            continue   # a chunk whose parameters are never used: impossible for trainable ones (they have grads)
        if anchor is not None and position[anchor] > position[after]:
            after = anchor
        with graph.inserting_after(after):
            s = graph.call_function(ops.optimizer_step, (), {"chunk": c.id})
        ann[s.name] = NodeAnn(role=Role.OPTIMIZER_STEP, phase=Phase.OPTIMIZER, chunk=c.id)

    placed = g.evolve(gm=to_module(graph, g.gm), ann=ann,
                      chunks=tuple(dataclasses.replace(c, state_home=StateHome.HOST)
                                   if c.group is ChunkGroup.TRAINABLE else c for c in g.chunks))
    placed = _choose_homes(placed)
    return placed.evolve(stage="optimizer_placed", made_by="place_optimizer")


def _choose_homes(g: TrainGraph) -> TrainGraph:
    """Greedy in chunk order: a chunk's states go to the device while min_need + two chunk buffers fit the budget.
    Only a chunk's own step node changes need with its home, so the other nodes' needs are computed once."""
    budget = g.settings.budget
    chunks = list(g.chunks)
    trainable = [c.id for c in chunks if c.group is ChunkGroup.TRAINABLE]
    if budget is None:
        for cid in trainable:
            chunks[cid] = dataclasses.replace(chunks[cid], state_home=StateHome.DEVICE)
        return g.evolve(chunks=tuple(chunks))
    nodes = g.nodes
    lv = analyze(nodes, g.ann)
    base = all_needs(g)

    def node_need(graph: TrainGraph, i: int) -> int:
        own = needs(graph, graph.ann[nodes[i].name])   # only a step's own needs change with its home
        nd = base[i] if own is NO_NEEDS or graph is g else own
        return lv.live[i] + nd.workspace + sum(buf_bytes(graph, k) for k in nd.resident)

    step_at = {g.ann[n.name].chunk: i for i, n in enumerate(nodes) if g.ann[n.name].role is Role.OPTIMIZER_STEP}
    others = max((node_need(g, i) for i in range(len(nodes)) if i not in step_at.values()), default=0)
    step_need = {cid: node_need(g, i) for cid, i in step_at.items()}
    static = static_bytes(g)
    reserve = 2 * max((c.nbytes for c in chunks), default=0)
    for cid in trainable:
        trial = list(chunks)
        trial[cid] = dataclasses.replace(chunks[cid], state_home=StateHome.DEVICE)
        candidate = g.evolve(chunks=tuple(trial))
        need = node_need(candidate, step_at[cid]) if cid in step_at else 0
        extra = state_bytes(trial[cid], g.settings.precision)
        if static + extra + max(others, need, *step_need.values()) + reserve <= budget:
            chunks, static, step_need[cid] = trial, static + extra, need
    return g.evolve(chunks=tuple(chunks))
