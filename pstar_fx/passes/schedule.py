"""schedule: fetch / alloc / release (and prefetch) of chunk buffers so that every node fits the device budget, as a
steady-state cycle over the step boundary.

Invariant after: a set of parameter buffers (`plan.carried`, each with whether its host copy is stale) is resident
when a step starts and again when it ends, so consecutive steps chain (the store brings the set in once, before the
first step: a prologue). Before every node, each chunk buffer it reads or writes is resident on the device
(fetched, or for a gradient buffer never written back, allocated zeroed), and static + resident chunk bytes + live
activation bytes + workspace <= budget at every node. A buffer that is not carried is released right after its last
use in the step (written back to its host home if it was written on the device and its contents are still needed);
a carried buffer stays until room is needed. The buffer evicted first is the resident one whose next use, counted
around the cycle, is furthest away (Belady; exact, since the whole step is in the graph). Which buffers are carried:
parameters of frozen chunks and of chunks stepped on the device that a pass from an empty device still holds at the
end, plus host-stepped chunks' parameters (fetched back after their update) while they fit, minus any the step would
evict before their first use (churn). At an unlimited budget every parameter buffer is carried and nothing moves.
Then, unless prefetch is 0, each release moves up to the gap right after its buffer's last use (a victim leaves as
soon as nothing needs it before its eviction, not when its room is wanted), and each fetch is hoisted up to
`prefetch` nodes earlier (None: no limit) through the gaps where its bytes fit, greedily, an earlier need first:
prefetching never adds evictions or bytes moved. A fetch after a host-side update of its chunk stays after it; with
more than one rank, a copy into a chunk stepped on the host is not hoisted at all (the executor's thread issues it
and waits there for the chunk's pending update).
A streamed update's states (BufKind.STATES, state_bytes of the chunk) are a buffer like the others: fetched from
their host home before the chunk's step and released, written back, right after it (never carried); its gradient
and parameters stay on the device for the step, as a device-state chunk's do.
A budget that some node cannot fit raises BudgetError before anything runs.

Parameter homes (`ChunkInfo.param_home`, set here for training graphs): in mixed precision a chunk whose optimizer
states live on the device keeps no host copy of its half-precision parameters (ParamHome.MASTER) unless the step
writes its PARAM buffer home while that buffer holds gradients (in place, between the chunk's first gradient write
and its optimizer step). Otherwise those parameters are always the fp32 master rounded, so a fetch casts the master
on the device, and releases of the chunk's PARAM buffer write nothing back. A forward-only graph keeps the homes its
chunks came with (those of the store it runs on).
"""
from __future__ import annotations

import bisect
import dataclasses
from dataclasses import dataclass

import torch
import torch.fx as fx

from ..errors import BudgetError
from ..ir import ops
from ..ir.fx_utils import output_node
from ..ir.graph import (BufKind, ChunkGroup, MemoryPlan, NodeAnn, ParamHome, Phase, Role, StateHome, TrainGraph,
                        UpdateSite, copy_graph, to_module)
from ..ir.needs import BufKey, all_needs, buf_bytes, from_master, static_bytes
from ..units import format_bytes
from .liveness import analyze

INF = float("inf")
_SHRINK_ROUNDS = 6          # rounds that drop carried buffers the step would evict before using them


@dataclass(frozen=True)
class Move:
    """One inserted operation, placed in the gap before node position `before`."""
    role: Role                      # FETCH (fetch or alloc) or RELEASE
    key: BufKey
    before: int
    copy: bool = True               # FETCH: copy from host (False: allocate zeroed); RELEASE: write back


@dataclass
class _Pass:
    """One Belady pass over the step from a given start state."""
    moves: list[Move]
    profile: list[int]              # resident chunk bytes while each node runs
    end: dict[BufKey, bool]         # resident at the end of the step -> dirty (host copy stale)
    churned: set[BufKey]            # carried buffers evicted before their first use in the step


def _describe(n: fx.Node) -> str:
    return f"'{n.name}' ({n.target.__name__ if callable(n.target) and hasattr(n.target, '__name__') else n.target})"


class _Planner:
    def __init__(self, g: TrainGraph, budget: int | None):
        self.g = g
        self.nodes = g.nodes
        self.lv = analyze(self.nodes, g.ann)
        self.nd = all_needs(g)
        self.uses: dict[BufKey, list[int]] = {}
        for i, x in enumerate(self.nd):
            for k in x.resident:
                self.uses.setdefault(k, []).append(i)
        self.cap = INF if budget is None else budget
        self.static = static_bytes(g)
        self.written = {k for x in self.nd for k in x.writes}
        self.first = next(i for i, n in enumerate(self.nodes) if n.op != "placeholder")

    def carryable(self, k: BufKey) -> bool:
        """A parameter buffer whose device copy stays valid across the boundary: no host-side step rewrites it."""
        c = self.g.chunks[k.chunk]
        return k.buf is BufKind.PARAM and (c.group is not ChunkGroup.TRAINABLE or c.update_site is UpdateSite.DEVICE)

    def fits_at_ends(self, keys) -> bool:
        """A carried set must fit where the step starts (placeholders) and where it ends (the output node)."""
        size = sum(buf_bytes(self.g, k) for k in keys)
        ends = list(range(self.first)) + [len(self.nodes) - 1]
        return all(self.static + size + self.lv.live[i] + self.nd[i].workspace <= self.cap for i in ends)

    def run(self, start: dict[BufKey, bool], carry: frozenset[BufKey], top_up: bool) -> _Pass:
        """Belady from `start`; buffers in `carry` are kept past their last use (their next use is the next step's
        first), the others released at their last use. With top_up, the carried buffers missing at the end are
        fetched back before the output node, so the step ends where it started."""
        g, nodes, nd, uses = self.g, self.nodes, self.nd, self.uses
        n_nodes = len(nodes)
        cursor = {k: 0 for k in uses}
        resident = dict(start)
        # host homes holding data: parameters, and the states a streamed update fetches
        on_host: set[BufKey] = {k for k in uses if k.buf is not BufKind.GRAD}
        moves: list[Move] = []
        used = sum(buf_bytes(g, k) for k in resident)
        profile = [0] * n_nodes
        churned: set[BufKey] = set()
        cyclic = {k for k in carry if self.carryable(k)}   # a host-stepped chunk's buffers leave before its update

        def next_use(k: BufKey, i: int) -> float:
            lst, c = uses[k], cursor[k]
            while c < len(lst) and lst[c] <= i:
                c += 1
            cursor[k] = c
            if c < len(lst):
                return lst[c]
            return n_nodes + lst[0] if k in cyclic else INF

        for i, n in enumerate(nodes):
            x = nd[i]
            missing = sorted(x.resident - resident.keys(), key=BufKey.order)
            want = self.static + used + sum(buf_bytes(g, k) for k in missing) + self.lv.live[i] + x.workspace
            while want > self.cap:
                victims = [k for k in resident if k not in x.resident]
                if not victims:
                    raise _budget_error(g, self.lv, self.cap, first=n)
                victim = max(victims, key=lambda k: (next_use(k, i), k.order()))
                if victim in start and uses[victim][0] >= i:
                    churned.add(victim)
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
                    # a gradient is kept only for a CPU update; parameters and streamed states always go home
                    keep = k.buf is not BufKind.GRAD or g.chunks[k.chunk].update_site is UpdateSite.CPU
                    moves.append(Move(Role.RELEASE, k, i + 1, copy=dirty and keep))
                    if dirty and keep:
                        on_host.add(k)
                    used -= buf_bytes(g, k)
        if top_up:
            last = n_nodes - 1
            for k in sorted(resident.keys() - carry, key=BufKey.order):
                dirty = resident.pop(k)
                moves.append(Move(Role.RELEASE, k, last, copy=dirty))
                used -= buf_bytes(g, k)
            for k in sorted(carry - resident.keys(), key=lambda k: (uses[k][0], k.order())):
                assert k in on_host, k
                moves.append(Move(Role.FETCH, k, last, copy=True))
                resident[k] = False
                used += buf_bytes(g, k)
            profile[last] = used
            assert self.static + used + self.lv.live[last] <= self.cap, "the carried set does not fit at the end"
        return _Pass(moves, profile, resident, churned)

    def cycle(self) -> tuple[_Pass, tuple]:
        """The steady-state cycle: choose the carried set, then plan the step from and back to it."""
        keys = sorted(self.uses, key=BufKey.order)
        first = self.run({}, frozenset(k for k in keys if self.carryable(k)), top_up=False)
        carry = [k for k in keys if k in first.end]
        host_stepped = sorted((k for k in keys if k.buf is BufKind.PARAM and not self.carryable(k)),
                              key=lambda k: (self.uses[k][0], k.order()))
        for k in host_stepped:
            if self.fits_at_ends(carry + [k]):
                carry.append(k)
        carry_set = frozenset(carry)
        while not self.fits_at_ends(carry_set):     # the start holds only inputs, but be safe
            carry_set = carry_set - {max(carry_set, key=lambda k: (self.uses[k][0], k.order()))}
        for _ in range(_SHRINK_ROUNDS):
            p = self._closed(carry_set)
            if not p.churned:
                break
            carry_set = carry_set - p.churned
        else:
            p = self._closed(carry_set)
        return p, tuple(sorted(((k, d) for k, d in p.end.items()), key=lambda kd: kd[0].order()))

    def _closed(self, carry: frozenset[BufKey]) -> _Pass:
        """A pass that ends in the state it starts from: dirty flags at the start are those at the end (a buffer
        written in the step is first assumed stale; then the flags the step actually ends with)."""
        dirty = {k: k in self.written for k in carry}
        for _ in range(3):
            p = self.run(dirty, carry, top_up=True)
            if p.end == dirty:
                return p
            dirty = dict(p.end)
        raise AssertionError(f"the schedule's cycle does not close: start {dirty}, end {p.end}")


def plan_moves(g: TrainGraph, budget: int | None, prefetch: int | None) -> tuple[list[Move], tuple]:
    """The moves of one step of the steady-state cycle, and the carried set ((BufKey, dirty), ...)."""
    planner = _Planner(g, budget)
    p, carried = planner.cycle()
    moves = p.moves
    if prefetch is None or prefetch > 0:
        # bytes free while each node runs (a tensor: a fetch may look back over the whole step); None: no budget
        room = None if planner.cap == INF else torch.tensor(
            [int(planner.cap) - planner.static - p.profile[t] - planner.lv.live[t] - planner.nd[t].workspace
             for t in range(len(planner.nodes))], dtype=torch.int64)
        moves = _release_early(g, moves, room, planner.uses, planner.first)
        moves = _hoist(g, moves, room, planner.first, prefetch)
    return moves, carried


def _budget_error(g: TrainGraph, lv, cap: float, first: fx.Node) -> BudgetError:
    """What the whole step needs, not just the first node that does not fit: the least budget under which it runs
    (every optimizer state on the host, only each node's own needs on the device: step.min_device_memory) and the
    node that needs it."""
    host = g.evolve(chunks=tuple(dataclasses.replace(c, state_home=StateHome.HOST, streamed=False) if c.state_home
                                 else c for c in g.chunks))
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
        "Raise device_memory, or lower chunk_size or the batch size (with remat=False: allow recomputing "
        "activations, remat='auto').",
        node=g.nodes[i].name, needed=need, available=int(cap))


def _release_early(g, moves, room, uses, first) -> list[Move]:
    """Move each release up to the gap right after its buffer's last use before it (for a buffer carried in and not
    used before, to the first gap after the placeholders), and add its bytes to `room` (updated in place) between.
    Belady evicts a victim in the gap of the fetch that needs its room; released at once instead, the room is free
    from the victim's last use on, and `_hoist` can move that fetch (and others) into it. Nothing else changes: the
    same buffers move the same bytes, and a buffer not used in between holds what it held (the same write-back)."""
    out: list[Move] = []
    for m in moves:
        if m.role is Role.RELEASE:
            lst = uses.get(m.key, [])
            j = bisect.bisect_left(lst, m.before)      # uses are in node order
            at = lst[j - 1] + 1 if j else first
            if at < m.before:
                if room is not None:
                    room[at:m.before] += buf_bytes(g, m.key)
                m = dataclasses.replace(m, before=at)
        out.append(m)
    return out


def _hoist(g, moves, room, first, prefetch) -> list[Move]:
    """Move each fetch up to `prefetch` nodes earlier (None: no limit), through gaps where its bytes fit (`room`,
    updated in place; None: no budget) and it is not resident, in the order the step needs them (an earlier need
    claims room first). Placeholders stay first."""
    last_gone: dict[BufKey, int] = {}
    nodes = g.nodes
    n_nodes = len(nodes)
    host_step = {g.ann[n.name].chunk: i for i, n in enumerate(nodes)
                 if g.ann[n.name].role is Role.OPTIMIZER_STEP
                 and g.chunks[g.ann[n.name].chunk].update_site is UpdateSite.CPU}
    out: list[Move] = []
    for m in sorted(moves, key=lambda m: m.before):
        if m.role is Role.RELEASE:
            last_gone[m.key] = m.before
            out.append(m)
            continue
        stepped = host_step.get(m.key.chunk, n_nodes)
        if stepped < n_nodes and m.copy and g.settings.world > 1:
            # with ranks the executor's thread issues the copy (and gather) itself, in graph order, and first waits
            # for the chunk's pending host-side update: hoisted, it would hold up every node after it meanwhile
            after_update = m.before
        elif stepped < m.before:
            after_update = stepped + 1      # a fetch after a host-side update of its chunk stays after it
        else:
            after_update = first            # one rank: the CPU worker issues the copy once the update is done
        floor = max(last_gone.get(m.key, first), first, after_update,
                    first if prefetch is None else m.before - prefetch)
        j = m.before
        if floor < m.before:
            if room is None:
                j = floor
            else:
                size = buf_bytes(g, m.key)
                short = (room[floor:m.before] < size).nonzero()     # gaps its bytes do not fit
                j = floor + int(short[-1]) + 1 if len(short) else floor
                room[j:m.before] -= size
        out.append(dataclasses.replace(m, before=j))
    # within a gap: releases first, then fetches, each in a stable order
    return sorted(out, key=lambda m: (m.before, m.role is Role.FETCH, m.key.order()))


def param_homes(g: TrainGraph, moves: list[Move]) -> dict[int, ParamHome]:
    """Each chunk's parameter home under these moves (see the module docstring)."""
    nodes = g.nodes
    first_grad: dict[int, int] = {}
    step_at: dict[int, int] = {}
    for i, n in enumerate(nodes):
        a = g.ann[n.name]
        if a.role is Role.WRITE_GRAD:
            first_grad.setdefault(g.chunk_of(a.param).id, i)
        elif a.role is Role.OPTIMIZER_STEP:
            step_at[a.chunk] = i
    if not step_at:                    # forward only: the store's homes
        return {c.id: c.param_home for c in g.chunks}
    homes = {c.id: ParamHome.HOST for c in g.chunks}
    if not g.settings.precision.mixed:
        return homes
    for c in g.chunks:
        if c.group is not ChunkGroup.TRAINABLE or c.state_home is not StateHome.DEVICE:
            continue
        if c.grad_inplace and c.id in first_grad:
            lo, hi = first_grad[c.id], step_at.get(c.id, len(nodes))
            if any(m.role is Role.RELEASE and m.copy and m.key == BufKey(c.id, BufKind.PARAM) and lo < m.before <= hi
                   for m in moves):
                continue               # its gradients go home in its PARAM buffer: it keeps a host home
        homes[c.id] = ParamHome.MASTER
    return homes


def schedule(g: TrainGraph, *, prefetch: int | None = None) -> TrainGraph:
    done = g.scheduled.of(g) if g.scheduled is not None and prefetch is None else None
    if done is not None:          # place_optimizer scheduled this very graph already
        return done
    budget = g.settings.budget
    moves, carried = plan_moves(g, budget, prefetch)
    homes = param_homes(g, moves)
    moves = [dataclasses.replace(m, copy=False)
             if m.role is Role.RELEASE and m.key.buf is BufKind.PARAM and homes[m.key.chunk] is ParamHome.MASTER else m
             for m in moves]
    g = g.evolve(chunks=tuple(dataclasses.replace(c, param_home=homes[c.id]) for c in g.chunks))
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
    return annotate(sched, carried).evolve(stage="scheduled", made_by="schedule")


def annotate(g: TrainGraph, carried: tuple = ()) -> TrainGraph:
    """Replay the scheduled graph from the carried set: resident bytes, live bytes and workspace at every node, and
    the MemoryPlan."""
    nodes = g.nodes
    lv = analyze(nodes, g.ann)
    static = static_bytes(g)
    resident = sum(buf_bytes(g, k) for k, _ in carried)
    peak = h2d = d2h = fetches = releases = 0
    ann = {}
    nd = all_needs(g)
    for i, n in enumerate(nodes):
        a = g.ann[n.name]
        x = nd[i]
        if a.role is Role.FETCH:
            size = buf_bytes(g, BufKey(a.chunk, a.buf))
            resident += size
            fetches += 1
            if n.target is ops.fetch and not from_master(g, a):
                h2d += size
        shown = resident
        if a.role is Role.RELEASE:
            size = buf_bytes(g, BufKey(a.chunk, a.buf))
            resident -= size
            releases += 1
            if n.kwargs["writeback"]:
                d2h += size
        peak = max(peak, static + shown + lv.live[i] + x.workspace)
        ann[n.name] = dataclasses.replace(a, resident_bytes=shown, live_bytes=lv.live[i], bytes=lv.created[i],
                                          workspace_bytes=x.workspace)
    plan = MemoryPlan(budget=g.settings.budget, static_bytes=static, predicted_peak=peak, h2d_bytes=h2d,
                      d2h_bytes=d2h, fetches=fetches, releases=releases, carried=carried)
    return g.evolve(ann=ann, plan=plan)
