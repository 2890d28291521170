"""schedule: fetch / alloc / release (and prefetch) of chunk buffers so that every node fits the device budget.

Invariant after: before every node, each chunk buffer it reads or writes is resident on the device (fetched, or for a
gradient buffer never written back, allocated zeroed), and static + resident chunk bytes + live activation bytes +
workspace <= budget at every node. A buffer is released right after its last use in the step (written back to its
host home if it was written on the device and its contents are still needed) and, when room is needed, the resident
buffer whose next use is furthest away is evicted first (Belady; exact, since the whole step is in the graph).
Nothing is resident at the end. Fetches are then hoisted up to `prefetch` nodes earlier into free room only, so
prefetching never adds evictions. A budget that some node cannot fit raises BudgetError before anything runs.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch.fx as fx

from .. import ops
from ..errors import BudgetError
from ..ir import BufKind, NodeAnn, Phase, Plan, Role, StateHome, TrainGraph, copy_graph, to_module
from ..units import format_bytes
from .liveness import analyze
from .graph_utils import output_node
from .memory import BufKey, all_needs, buf_bytes, static_bytes

INF = float("inf")


@dataclass(frozen=True)
class Move:
    """One inserted operation, placed in the gap before node position `before`."""
    role: Role                      # FETCH (fetch or alloc) or RELEASE
    key: BufKey
    before: int
    copy: bool = True               # FETCH: copy from host (False: allocate zeroed); RELEASE: write back


def _describe(n: fx.Node) -> str:
    return f"'{n.name}' ({n.target.__name__ if callable(n.target) and hasattr(n.target, '__name__') else n.target})"


def plan_moves(g: TrainGraph, budget: int | None, prefetch: int) -> list[Move]:
    nodes = g.nodes
    lv = analyze(nodes, g.ann)
    nd = all_needs(g)
    uses: dict[BufKey, list[int]] = {}
    for i, x in enumerate(nd):
        for k in x.resident:
            uses.setdefault(k, []).append(i)
    cursor = {k: 0 for k in uses}
    cap = INF if budget is None else budget
    static = static_bytes(g)
    resident: dict[BufKey, bool] = {}       # key -> dirty
    on_host: set[BufKey] = {k for k in uses if k.buf is BufKind.PARAM}   # buffers whose host home holds data
    moves: list[Move] = []
    used = 0
    profile = [0] * len(nodes)              # resident chunk bytes while each node runs

    def next_use(k: BufKey, i: int) -> float:
        lst, c = uses[k], cursor[k]
        while c < len(lst) and lst[c] <= i:
            c += 1
        cursor[k] = c
        return lst[c] if c < len(lst) else INF

    for i, n in enumerate(nodes):
        x = nd[i]
        missing = sorted(x.resident - resident.keys(), key=BufKey.order)
        want = static + used + sum(buf_bytes(g, k) for k in missing) + lv.live[i] + x.workspace
        while want > cap:
            victims = [k for k in resident if k not in x.resident]
            if not victims:
                raise _budget_error(g, lv, cap, first=n)
            victim = max(victims, key=lambda k: (next_use(k, i), k.order()))
            dirty = resident.pop(victim)
            moves.append(Move(Role.RELEASE, victim, i, copy=dirty))
            if dirty:
                on_host.add(victim)
            used -= buf_bytes(g, victim)
            want -= buf_bytes(g, victim)
        for k in missing:
            moves.append(Move(Role.FETCH, k, i, copy=k in on_host))
            resident[k] = False
            used += buf_bytes(g, k)
        for k in x.writes:
            resident[k] = True
        profile[i] = used
        for k in sorted(x.resident, key=BufKey.order):
            if next_use(k, i) == INF:
                dirty = resident.pop(k)
                keep = k.buf is BufKind.PARAM or g.chunks[k.chunk].state_home is StateHome.HOST
                moves.append(Move(Role.RELEASE, k, i + 1, copy=dirty and keep))
                used -= buf_bytes(g, k)
    assert not resident, resident
    return _hoist(g, moves, profile, lv.live, nd, static, cap, prefetch) if prefetch else moves


def _budget_error(g: TrainGraph, lv, cap: float, first: fx.Node) -> BudgetError:
    """What the whole step needs, not just the first node that does not fit: the least budget under which it runs
    (every optimizer state on the host, only each node's own needs on the device: step.min_device_memory) and the
    node that needs it."""
    host = g.evolve(chunks=tuple(dataclasses.replace(c, state_home=StateHome.HOST) if c.state_home else c
                                 for c in g.chunks))
    static = static_bytes(host)
    own = [lv.live[i] + x.workspace + sum(buf_bytes(g, k) for k in x.resident) for i, x in enumerate(all_needs(host))]
    i = max(range(len(own)), key=own.__getitem__)
    x = all_needs(host)[i]
    need = static + own[i]
    return BudgetError(
        f"device_memory budget {format_bytes(int(cap))} ({int(cap)} bytes) is too small: this step needs at least "
        f"{format_bytes(need)} ({need} bytes), at node {_describe(g.nodes[i])}: live activations "
        f"{format_bytes(lv.live[i])} + its chunk buffers {format_bytes(sum(buf_bytes(g, k) for k in x.resident))} + "
        f"workspace {format_bytes(x.workspace)} + always-resident {format_bytes(static)} (module buffers and "
        f"constants; every optimizer state on the host). The first node that does not fit is {_describe(first)}. "
        "Raise device_memory, or lower chunk_size or the batch size.",
        node=g.nodes[i].name, needed=need, available=int(cap))


def _hoist(g, moves, profile, live, nd, static, cap, prefetch) -> list[Move]:
    """Move each fetch up to `prefetch` nodes earlier, through gaps where its bytes fit and it is not resident."""
    last_gone: dict[BufKey, int] = {}
    first = next(i for i, n in enumerate(g.nodes) if n.op != "placeholder")   # placeholders stay first
    out: list[Move] = []
    for m in sorted(moves, key=lambda m: m.before):
        if m.role is Role.RELEASE:
            last_gone[m.key] = m.before
            out.append(m)
            continue
        size = buf_bytes(g, m.key)
        j = m.before
        floor = max(last_gone.get(m.key, first), first, m.before - prefetch)
        while j - 1 >= floor and static + profile[j - 1] + size + live[j - 1] + nd[j - 1].workspace <= cap:
            j -= 1
        for t in range(j, m.before):
            profile[t] += size
        out.append(dataclasses.replace(m, before=j))
    # within a gap: releases first, then fetches, each in a stable order
    return sorted(out, key=lambda m: (m.before, m.role is Role.FETCH, m.key.order()))


def schedule(g: TrainGraph, *, prefetch: int = 4) -> TrainGraph:
    budget = g.settings.budget
    moves = plan_moves(g, budget, prefetch)
    graph, env = copy_graph(g)
    old_nodes = g.nodes
    ann = dict(g.ann)
    gaps: dict[int, list[Move]] = {}
    for m in moves:
        gaps.setdefault(m.before, []).append(m)
    for pos in sorted(gaps):
        old = old_nodes[pos]
        anchor = output_node(graph) if old.op == "output" else env[old]
        phase = ann[old_nodes[min(pos, len(old_nodes) - 1)].name].phase
        if phase in (Phase.INPUT, Phase.OUTPUT):
            phase = Phase.OPTIMIZER if pos >= len(old_nodes) - 1 else Phase.FORWARD
        for m in gaps[pos]:
            with graph.inserting_before(anchor):
                if m.role is Role.RELEASE:
                    node = graph.call_function(ops.release, (), {"chunk": m.key.chunk, "buf": m.key.buf,
                                                                 "writeback": m.copy})
                else:
                    fn = ops.fetch if m.copy else ops.alloc
                    node = graph.call_function(fn, (), {"chunk": m.key.chunk, "buf": m.key.buf})
            ann[node.name] = NodeAnn(role=m.role, phase=phase, chunk=m.key.chunk, buf=m.key.buf)
    sched = g.evolve(gm=to_module(graph, g.gm), ann=ann)
    return annotate(sched).evolve(stage="scheduled", made_by="schedule")


def annotate(g: TrainGraph) -> TrainGraph:
    """Replay the scheduled graph: resident bytes, live bytes and workspace at every node, and the Plan."""
    nodes = g.nodes
    lv = analyze(nodes, g.ann)
    static = static_bytes(g)
    resident = 0
    peak = h2d = d2h = fetches = releases = 0
    ann = {}
    nd = all_needs(g)
    for i, n in enumerate(nodes):
        a = g.ann[n.name]
        x = nd[i]
        if a.role is Role.FETCH:
            resident += g.chunks[a.chunk].nbytes
            fetches += 1
            if n.target is ops.fetch:
                h2d += g.chunks[a.chunk].nbytes
        shown = resident
        if a.role is Role.RELEASE:
            resident -= g.chunks[a.chunk].nbytes
            releases += 1
            if n.kwargs["writeback"]:
                d2h += g.chunks[a.chunk].nbytes
        peak = max(peak, static + shown + lv.live[i] + x.workspace)
        ann[n.name] = dataclasses.replace(a, resident_bytes=shown, live_bytes=lv.live[i], bytes=lv.created[i],
                                          workspace_bytes=x.workspace)
    plan = Plan(budget=g.settings.budget, static_bytes=static, predicted_peak=peak, h2d_bytes=h2d, d2h_bytes=d2h,
                fetches=fetches, releases=releases)
    return g.evolve(ann=ann, plan=plan)
