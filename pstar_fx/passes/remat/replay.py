"""Liveness of a graph with a choice of segments recomputed, replayed without building that graph: exact (the same
rule as liveness.analyze over the graph `rewrite.apply` builds), and fast enough to try every choice the remat pass
considers (index arithmetic over the input graph's storages). It yields the figures the choice is made by (see
pstar_fx.passes.remat.choice)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ...ir.graph import ChunkGroup, Role, StateHome, TrainGraph
from ...ir.needs import all_needs, buf_bytes, state_bytes, state_layout, static_bytes, step_workspace
from .segments import GraphFacts, Segment


@dataclass(frozen=True)
class Copies:
    """What a segment's copies do to liveness, as index arrays over the replay's storages. A position is relative to
    the segment's block of copies (`*_rel`) or one of the input graph (`*_orig`), the other one -1."""
    size: int                        # number of copies
    own: torch.Tensor                # chunk-buffer bytes each copy needs
    ov_idx: torch.Tensor             # storages of the saved values: now last read in forward,
    ov_pos: torch.Tensor             # at this position
    ex_idx: torch.Tensor             # original storages the copies read or view: alive at least
    ex_rel: torch.Tensor             # until this position
    ex_orig: torch.Tensor
    new_first: torch.Tensor          # the copies' own storages: made by this copy,
    new_rel: torch.Tensor            # last read here,
    new_orig: torch.Tensor
    new_size: torch.Tensor           # of this many bytes


def _tensor(xs) -> torch.Tensor:
    return torch.tensor(list(xs), dtype=torch.int64)


def _split(p) -> tuple[int, int]:
    """A position as (relative, original), the other one -1."""
    return (-1, p[1]) if isinstance(p, tuple) else (p, -1)


def _later(a, b):
    """The later of two positions; an ("orig", i) position comes after every copy."""
    if isinstance(a, tuple) != isinstance(b, tuple):
        return a if isinstance(a, tuple) else b
    return max(a, b)


def _copies(G: GraphFacts, s: Segment, own: list[int], index: dict[int, int]) -> Copies:
    nodes, pos = G.nodes, G.pos
    rpos = {i: j for j, i in enumerate(s.recompute)}
    values = set(s.values)
    override = []
    for k in sorted({k for i in values for k in G.keys[i]}):
        reads = [pos[u] for i in G.sharers[k] for u in nodes[i].users if pos[u] < s.seed]
        override.append((k, max([G.sharers[k][0]] + reads)))
    # each copy's last use: a later copy reading it, or (a saved value) its original's backward users, and the users
    # of backward views of it (they will view the copy)
    last: list[object] = []
    for j, i in enumerate(s.recompute):
        if i in values:
            ends = [pos[u] for u in nodes[i].users if pos[u] > s.seed and u.op != "output"]
            ends += [G.last[m] for k in G.keys[i] for m in G.sharers[k] if m > s.seed]
            last.append(("orig", max(ends)))
        else:
            last.append(max((rpos[pos[u]] for u in nodes[i].users if pos[u] in rpos), default=j))
    ckey: dict[tuple[int, int], object] = {}    # (copy, original storage) -> storage in the copy world
    extend: dict[int, object] = {}
    new: dict[object, list] = {}
    for j, i in enumerate(s.recompute):
        ins = nodes[i].all_input_nodes
        for a in ins:                          # original values read: alive until this copy
            if pos[a] not in rpos:
                for k in G.keys[pos[a]]:
                    extend[k] = _later(extend.get(k, j), j)
        for k in G.keys[i]:
            src = next((ckey[(rpos[pos[a]], k)] for a in ins if pos[a] in rpos and (rpos[pos[a]], k) in ckey), None)
            if src is None and any(pos[a] not in rpos and k in G.keys[pos[a]] for a in ins):
                src = k                        # a view of an original value: that storage lives on
            if src is None:
                src = ("new", j, k)
                new[src] = [j, last[j], G.size[k]]
            ckey[(j, k)] = src
            if isinstance(src, tuple):
                new[src][1] = _later(new[src][1], last[j])
            else:
                extend[k] = _later(extend.get(k, j), last[j])
    ex = sorted(extend.items())
    return Copies(
        size=len(s.recompute), own=_tensor(own[i] for i in s.recompute),
        ov_idx=_tensor(index[k] for k, _ in override), ov_pos=_tensor(p for _, p in override),
        ex_idx=_tensor(index[k] for k, _ in ex), ex_rel=_tensor(_split(p)[0] for _, p in ex),
        ex_orig=_tensor(_split(p)[1] for _, p in ex),
        new_first=_tensor(f for f, _, _ in new.values()), new_rel=_tensor(_split(p)[0] for _, p, _ in new.values()),
        new_orig=_tensor(_split(p)[1] for _, p, _ in new.values()), new_size=_tensor(b for _, _, b in new.values()))


@dataclass(frozen=True)
class Figures:
    need: int                        # least budget any schedule of the graph fits
    peak: int                        # comfort bytes above the budget at the node where comfort is highest
    excess: int                      # comfort bytes above the budget, summed over nodes


class Replay:
    """Liveness of the graph with a choice of segments recomputed, without building it (exact: the same rule as
    liveness.analyze over the graph `apply` builds), and the figures the choice is made by."""

    def __init__(self, g: TrainGraph, G: GraphFacts, budget: int | None):
        self.g, self.G = g, G
        self.segments: dict[int, Segment] = {}
        self.copies: dict[int, Copies] = {}
        nodes = G.nodes
        n = self.n = len(nodes)
        keys = list(G.sharers)
        self.index = {k: j for j, k in enumerate(keys)}
        self.start = _tensor(G.sharers[k][0] for k in keys)
        self.end = _tensor(max(G.last[i] for i in G.sharers[k]) for k in keys)
        self.size = _tensor(G.size[k] for k in keys)
        needs = all_needs(g)
        self.own_list = [x.workspace + sum(buf_bytes(g, k) for k in x.resident) for x in needs]
        self.own = _tensor(self.own_list)
        # comfort: everything on the device; a gradient buffer from its chunk's first gradient write
        grads = [0] * n
        seen: set[int] = set()
        for i, nd in enumerate(nodes):
            a = g.ann[nd.name]
            if a.role is Role.WRITE_GRAD:
                c = g.chunk_of(a.param)
                if c.id not in seen and not c.grad_inplace:
                    seen.add(c.id)
                    grads[i] += c.nbytes
        self.grads = _tensor(grads).cumsum(0)
        trainable = [c for c in g.chunks if c.group is ChunkGroup.TRAINABLE]
        prec = g.settings.precision
        host = g.evolve(chunks=tuple(dataclasses.replace(c, state_home=StateHome.HOST) if c in trainable else c
                                     for c in g.chunks))
        self.static_host = static_bytes(host)
        states = sum(state_bytes(c, prec, 1, state_layout(g.settings)) for c in trainable)
        base = self.static_host + states + sum(c.nbytes for c in g.chunks)
        self.comfort_base = base
        self.comfort_end = base + sum(c.nbytes for c in trainable if not c.grad_inplace) + max(
            (step_workspace(c, prec, 1, state_layout(g.settings)) for c in trainable), default=0)
        self.budget = budget
        assert self.live(()) == [g.ann[nd.name].live_bytes for nd in nodes], \
            "remat's replay disagrees with liveness on the input graph"

    def add(self, segments) -> None:
        for s in segments:
            self.segments[s.id] = s
            self.copies[s.id] = _copies(self.G, s, self.own_list, self.index)

    def figures(self, chosen) -> Figures:
        live, own, grads = self._profile(chosen)
        need = self.static_host + int((live + own).max())
        peak = excess = 0
        if self.budget is not None:
            comfort = self.comfort_base + grads + live
            over = (comfort - self.budget).clamp(min=0)
            end = max(0, self.comfort_end - self.budget)
            peak, excess = max(int(over.max()), end), int(over.sum()) + end
        return Figures(need=need, peak=peak, excess=excess)

    def live(self, chosen) -> list[int]:
        """Live activation bytes per node of the graph `apply` builds for the chosen segments."""
        return self._profile(chosen)[0].tolist()

    def _profile(self, chosen):
        """Per node of the rewritten graph: live activation bytes, chunk-buffer bytes and (for comfort) gradient
        bytes."""
        chosen = sorted(chosen, key=lambda sid: (self.segments[sid].at, sid))
        n = self.n
        ins = torch.zeros(n, dtype=torch.int64)
        for sid in chosen:
            ins[self.segments[sid].at] += self.copies[sid].size
        E = torch.arange(n, dtype=torch.int64) + ins.cumsum(0)
        total = n + int(ins.sum())
        behind: dict[int, int] = {}
        base: dict[int, int] = {}
        for sid in reversed(chosen):          # blocks at one position: in id order, right before it
            at = self.segments[sid].at
            behind[at] = behind.get(at, 0) + self.copies[sid].size
            base[sid] = int(E[at]) - behind[at]
        start, end = E[self.start], E[self.end]
        own = torch.zeros(total, dtype=torch.int64)
        own[E] = self.own
        grads = torch.zeros(total, dtype=torch.int64)
        grads[E] = self.grads
        starts, ends, sizes = [start], [], [self.size]
        ov_idx, ov_pos, ex_idx, ex_pos = [], [], [], []

        def at_(rel, orig, b):
            return torch.where(orig >= 0, E[orig.clamp(min=0)], rel + b)

        for sid in chosen:
            c, b = self.copies[sid], base[sid]
            ov_idx.append(c.ov_idx)
            ov_pos.append(c.ov_pos)
            ex_idx.append(c.ex_idx)
            ex_pos.append(at_(c.ex_rel, c.ex_orig, b))
            starts.append(c.new_first + b)
            ends.append(at_(c.new_rel, c.new_orig, b))
            sizes.append(c.new_size)
            own[b:b + c.size] = c.own
            grads[b:b + c.size] = self.grads[self.segments[sid].at - 1]
        if chosen:
            end = end.clone()
            end[torch.cat(ov_idx)] = E[torch.cat(ov_pos)]
            end.scatter_reduce_(0, torch.cat(ex_idx), torch.cat(ex_pos), "amax")
        starts, ends, sizes = torch.cat(starts), torch.cat([end] + ends), torch.cat(sizes)
        delta = torch.zeros(total + 1, dtype=torch.int64)
        delta.index_add_(0, starts, sizes)
        delta.index_add_(0, ends + 1, -sizes)
        return delta.cumsum(0)[:total], own, grads
