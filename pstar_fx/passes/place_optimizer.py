"""place_optimizer: one `commit()` after backward, then one `optimizer_step` per trainable chunk; states placed.

Invariant after: the graph has exactly one `commit()` node, placed after every node of the user's program and every
gradient write (the last node that can fail with the user's code or data), and every trainable chunk has exactly one
`optimizer_step(chunk=c)`, after the commit. Before the commit nothing writes a parameter value or an optimizer
state, so a step that fails there leaves every value as it was (the step is atomic); clipping by global norm and
fp16 overflow checks, which need every gradient, are decided at the commit. The one exception, asked for with
`atomic=False` (Settings.atomic) on one rank where the commit decides nothing: host-side steps come right after the
last node that uses their chunk, before the commit, so the CPU updates during backward; a step that fails after
the first of them cannot be undone (the executor raises CommitError).
Every trainable chunk has a `state_home`: DEVICE for as many chunks as the budget allows while every node's minimum
need still fits with room for two more chunk buffers, HOST for the rest. Device steps come first, in chunk order
(the order the next forward needs them). Host steps, which the store's CPU worker runs one after another in graph
order while the device goes on, come in the order `update_order` chooses from the cost model: each chunk's update
can start once its gradient is final and written home and the executor has issued its step (after the commit
unless atomic=False; at the commit anyway when clipping or an fp16 overflow check must see every gradient) and
should end before the next forward reads the chunk; the order is the earliest-deadline-first list schedule of those
windows.
"""
from __future__ import annotations

import dataclasses

import torch.fx as fx

from .. import ops
from ..cost import H200, Machine, node_seconds
from ..ir import BufKind, ChunkGroup, NodeAnn, Phase, Role, StateHome, TrainGraph, copy_graph, to_module
from .liveness import analyze
from ..memory import NO_NEEDS, all_needs, buf_bytes, needs, shard_numel, state_bytes, static_bytes


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
    chunks = tuple(dataclasses.replace(c, state_home=StateHome.HOST) if c.group is ChunkGroup.TRAINABLE else c
                   for c in g.chunks)
    trainable = [c.id for c in chunks if c.group is ChunkGroup.TRAINABLE]
    placed = _choose_homes(with_steps(g, trainable).evolve(chunks=chunks))
    homes = placed.chunks
    device = [cid for cid in trainable if homes[cid].state_home is StateHome.DEVICE]
    ordered = with_steps(g, device, update_order(placed), early=g.settings.early_updates).evolve(chunks=homes)
    return ordered.evolve(stage="optimizer_placed", made_by="place_optimizer")


def with_steps(g: TrainGraph, order: list[int], host: list[int] = (), early: bool = False) -> TrainGraph:
    """g with a commit after its program and one optimizer_step per chunk: those of `order` after the commit, then
    those of `host`, in that order; with `early`, each of `host` instead right after the last node that uses its
    chunk and after the previous one of `host` (so the CPU worker, which takes them in graph order, gets each as
    soon as the step is done with its chunk)."""
    graph, _ = copy_graph(g)
    ann = dict(g.ann)
    nodes = list(graph.nodes)
    program = [n for n in nodes if ann[n.name].role in (Role.COMPUTE, Role.WRITE_GRAD)]
    assert program, "a training graph has at least the loss"
    with graph.inserting_after(program[-1]):
        commit = graph.call_function(ops.commit, (), {})
    ann[commit.name] = NodeAnn(role=Role.COMMIT, phase=Phase.OPTIMIZER)

    def step_after(after: fx.Node, cid: int) -> fx.Node:
        with graph.inserting_after(after):
            node = graph.call_function(ops.optimizer_step, (), {"chunk": cid})
        ann[node.name] = NodeAnn(role=Role.OPTIMIZER_STEP, phase=Phase.OPTIMIZER, chunk=cid)
        return node

    after = commit
    for cid in order + ([] if early else list(host)):
        after = step_after(after, cid)
    if early and host:
        last_use = _last_use(all_needs(g))
        at: dict[int, fx.Node] = {}       # original position -> the last step inserted after it
        pos = 0
        for cid in host:
            pos = max(pos, last_use[cid])
            at[pos] = step_after(at.get(pos, nodes[pos]), cid)
    return g.evolve(gm=to_module(graph, g.gm), ann=ann)


def _last_use(nd) -> dict[int, int]:
    """Each chunk's last node position that has one of its buffers resident, from all_needs."""
    return {k.chunk: i for i, x in enumerate(nd) for k in x.resident}


def update_order(g: TrainGraph, machine: Machine = H200) -> list[int]:
    """The host-stepped chunks of g (states placed) in the order the CPU should update them: non-preemptive
    earliest-deadline-first over each update's window, from the cost model's node times. A chunk's update is
    released when its gradient is final and the executor has issued its step: with atomic steps at the commit,
    which the executor reaches once the device is within `machine.launch_queue` kernels of the end of backward
    (or at the end, when the commit decides something every update needs: a clip coefficient, an fp16 overflow);
    with early updates after the chunk's last use. Its deadline is the next step's first read of the chunk; it takes
    its elements at the CPU Adam rate. With every release at one moment this is first-use order."""
    host = [c.id for c in g.chunks if c.group is ChunkGroup.TRAINABLE and c.state_home is StateHome.HOST]
    if len(host) < 2:
        return host
    nodes = g.nodes
    nd = all_needs(g)
    at, kernels, t = [], [], 0.0
    for n in nodes:
        if g.ann[n.name].role is Role.COMPUTE:
            s = node_seconds(n, machine)
            t += s
            if s > 0:
                kernels.append(t)
        at.append(t)
    step_s = t
    last_grad: dict[int, float] = {}
    first_read: dict[int, float] = {}
    for i, n in enumerate(nodes):
        a = g.ann[n.name]
        if a.role is Role.WRITE_GRAD:
            last_grad[g.chunk_of(a.param).id] = at[i]
        if a.role in (Role.COMPUTE, Role.PARAM_VIEW):
            for k in nd[i].reads:
                if k.buf is BufKind.PARAM:
                    first_read.setdefault(k.chunk, at[i])
    if g.settings.commit_decides:
        release = dict.fromkeys(host, step_s)
    elif g.settings.early_updates:
        last_use = _last_use(nd)
        release = {cid: at[last_use[cid]] if cid in last_use else step_s for cid in host}
    else:
        commit = kernels[-machine.launch_queue - 1] if len(kernels) > machine.launch_queue else 0.0
        release = {cid: max(last_grad.get(cid, step_s), commit) for cid in host}
    rate = machine.cpu_adam_mixed if g.settings.precision.mixed else machine.cpu_adam
    world = g.settings.world
    todo = {cid: (release[cid], step_s + first_read.get(cid, step_s), cid) for cid in host}
    order, clock = [], 0.0
    while todo:
        ready = [cid for cid, (r, _, _) in todo.items() if r <= clock]
        if not ready:
            clock = min(r for r, _, _ in todo.values())
            continue
        cid = min(ready, key=lambda c: todo[c][1:])          # earliest deadline, then chunk order
        del todo[cid]
        order.append(cid)
        clock += shard_numel(g.chunks[cid], world) / rate
    return order


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
