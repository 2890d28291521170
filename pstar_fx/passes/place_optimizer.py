"""place_optimizer: one `commit()` after backward, then one `optimizer_step` per trainable chunk; states placed.

Invariant after: the graph has exactly one `commit()` node, placed after every node of the user's program and every
gradient write (the last node that can fail with the user's code or data), and every trainable chunk has exactly one
`optimizer_step(chunk=c)`, after the commit. Before the commit nothing writes a parameter value or an optimizer
state, so a step that fails there leaves every value as it was (the step is atomic); clipping by global norm and
fp16 overflow checks, which need every gradient, are decided at the commit. Steps come in the order the next
forward needs the chunks (first-use order, which is chunk order), so host-side updates can overlap the next step.
Every trainable chunk has a `state_home`: DEVICE for as many chunks as the budget allows while every node's minimum
need still fits with room for two more chunk buffers, HOST for the rest.
"""
from __future__ import annotations

import dataclasses

from .. import ops
from ..ir import ChunkGroup, NodeAnn, Phase, Role, StateHome, TrainGraph, copy_graph, to_module
from .liveness import analyze
from ..memory import NO_NEEDS, all_needs, buf_bytes, needs, state_bytes, static_bytes


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
    program = [n for n in graph.nodes if ann[n.name].role in (Role.COMPUTE, Role.WRITE_GRAD)]
    assert program, "a training graph has at least the loss"
    with graph.inserting_after(program[-1]):
        commit = graph.call_function(ops.commit, (), {})
    ann[commit.name] = NodeAnn(role=Role.COMMIT, phase=Phase.OPTIMIZER)
    after = commit
    for c in g.chunks:
        if c.group is not ChunkGroup.TRAINABLE:
            continue
        with graph.inserting_after(after):
            after = graph.call_function(ops.optimizer_step, (), {"chunk": c.id})
        ann[after.name] = NodeAnn(role=Role.OPTIMIZER_STEP, phase=Phase.OPTIMIZER, chunk=c.id)

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
        extra = state_bytes(trial[cid], g.settings.precision, g.settings.world)
        if static + extra + max(others, need, *step_need.values()) + reserve <= budget:
            chunks, static, step_need[cid] = trial, static + extra, need
    return g.evolve(chunks=tuple(chunks))
