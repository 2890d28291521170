"""shard: multi-GPU, ZeRO-style. Each of `world` ranks owns 1/world of every chunk: that shard's host home, its
optimizer states (fp32 master included) and its update. Parameter buffers are gathered before use and gradients
reduce-scattered after their last write, as graph nodes like the fetches and releases they extend.

Invariant after (world > 1): every `fetch` of a parameter buffer is an `all_gather(chunk, buf)` (the rank's shard
goes host -> device into its place in the slot, then the ranks gather the rest); every trainable chunk has exactly
one `reduce_scatter(chunk)`, right after the last write of any of its gradients and before anything else touches
the gradient buffer (its release, or its optimizer step); after it, each rank's shard of the buffer holds the mean
over ranks, and only that shard is written home or stepped. A device-side `optimizer_step` updates the rank's shard;
if the schedule keeps the parameter buffer resident into the next step (it is carried), the step all-gathers it
again (`gather=True`), so a buffer resident on the device is always the whole current chunk and the schedule's
residency means what it means on one rank; a buffer released after its update only writes its shard home. The memory plan is the
schedule's: a gathered buffer is a full chunk slot, counted from its all_gather; the optimizer states and the step
workspace on the device are per shard. The plan also counts, per step, the chunk bytes gathered and reduced, and
host <-> device bytes per rank (shards, except gradients written back before they are reduced: accumulation).

The graph is the same on every rank (same trace, same plan), so every rank issues the same collectives in the same
order; `collectives(g)` lists them and the step checks across ranks, at compile time, that they agree.
"""
from __future__ import annotations

import dataclasses

from ..ir import ops
from ..ir.graph import BufKind, ChunkGroup, NodeAnn, Phase, Role, StateHome, TrainGraph, copy_graph, to_module
from ..ir.needs import BufKey, from_master, shard_numel
from .schedule import annotate


def shard(g: TrainGraph) -> TrainGraph:
    world = g.settings.world
    assert world > 1, "the shard pass runs for more than one rank"
    assert g.plan is not None, "shard runs on a scheduled graph"
    graph, _ = copy_graph(g)
    ann = dict(g.ann)
    nodes = list(graph.nodes)
    carried = {k for k, _ in g.plan.carried}
    last_write: dict[int, object] = {}
    for n in nodes:
        a = ann[n.name]
        if a.role is Role.WRITE_GRAD:
            last_write[g.param(a.param).chunk] = n
        elif a.role is Role.FETCH and n.target is ops.fetch and a.buf is BufKind.PARAM:
            n.target = ops.all_gather
        elif a.role is Role.OPTIMIZER_STEP and g.chunks[a.chunk].state_home is StateHome.DEVICE \
                and BufKey(a.chunk, BufKind.PARAM) in carried:
            n.kwargs = {**n.kwargs, "gather": True}
    for cid, w in sorted(last_write.items()):
        assert g.chunks[cid].group is ChunkGroup.TRAINABLE
        with graph.inserting_after(w):
            rs = graph.call_function(ops.reduce_scatter, (), {"chunk": cid})
        ann[rs.name] = NodeAnn(role=Role.REDUCE_SCATTER, phase=Phase.BACKWARD, chunk=cid)
    graph.lint()
    # a reduce-scatter is in place: the memory plan is the schedule's, replayed over the new nodes
    out = annotate(g.evolve(gm=to_module(graph, g.gm), ann=ann), g.plan.carried)
    return out.evolve(plan=_traffic(out), stage="sharded", made_by="shard")


def _traffic(g: TrainGraph):
    """The plan's byte counts per rank: host <-> device moves shards (a gradient written back before its
    reduce-scatter, under accumulation, moves whole); collectives count whole chunks."""
    world = g.settings.world
    reduced: set[int] = set()
    h2d = d2h = gathered = scattered = 0
    for n in g.nodes:
        a = g.ann[n.name]
        if a.role is Role.REDUCE_SCATTER:
            reduced.add(a.chunk)
            scattered += g.chunks[a.chunk].nbytes
            continue
        if a.chunk is None or a.role not in (Role.FETCH, Role.RELEASE, Role.OPTIMIZER_STEP):
            continue
        c = g.chunks[a.chunk]
        part = shard_numel(c, world) * c.dtype.itemsize
        if n.target is ops.all_gather:
            h2d += 0 if from_master(g, a) else part
            gathered += c.nbytes
        elif n.target is ops.fetch:
            h2d += 0 if from_master(g, a) else part if a.chunk in reduced else c.nbytes
        elif n.target is ops.release and n.kwargs["writeback"]:
            whole = a.buf is BufKind.GRAD and a.chunk not in reduced
            d2h += c.nbytes if whole else part
        elif a.role is Role.OPTIMIZER_STEP and n.kwargs.get("gather", False):
            gathered += c.nbytes      # a device-side step gathers the updated chunk it keeps
    return dataclasses.replace(g.plan, h2d_bytes=h2d, d2h_bytes=d2h, gathered_bytes=gathered,
                               reduced_bytes=scattered)


def collectives(g: TrainGraph) -> tuple[tuple[str, int], ...]:
    """The collectives one step issues, in order: (operation, chunk). Identical on every rank by construction;
    the step compares it across ranks before its first run."""
    out = []
    for n in g.nodes:
        a = g.ann[n.name]
        if n.target is ops.all_gather:
            out.append(("all_gather", a.chunk))
        elif a.role is Role.REDUCE_SCATTER:
            out.append(("reduce_scatter", a.chunk))
        elif a.role is Role.COMMIT:
            out.append(("all_reduce", -1))
        elif a.role is Role.OPTIMIZER_STEP and n.kwargs.get("gather", False):
            out.append(("all_gather", a.chunk))
    return tuple(out)
