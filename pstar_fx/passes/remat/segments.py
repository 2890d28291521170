"""remat: recompute forward activations in backward where the budget needs it, a transformer block at a time.

Invariant after: the input graph's nodes are all present, in the same order, computing the same values; for every
chosen segment, copies of some of its forward nodes (tagged `node.meta[REMAT]`, a `RematTag`) run right before the
first backward node that reads one of the segment's saved values, applying the same ops to the same inputs, and every
backward use of such a value reads its copy, so the forward value dies in forward. Nothing random is recomputed.
Liveness annotations are those of the output graph. At an unlimited budget, or one the step fits without
recomputation (`comfort` below), the graph is the input's.

Segments. A segment is a run of forward nodes between two cuts, found per micro-batch (the forward nodes between the
previous loss seed and this one). Blocks come from the model's structure: the outermost module containers whose
children are numbered (`h.0`, `h.1`, ... of an nn.ModuleList or nn.Sequential; `model.layers.<i>` in transformers)
each make a block per child; a parameter outside them belongs to no block (None); a model without numbered children
has its top-level submodules as blocks. In forward order, the parameter reads (`param_view` nodes) form runs of one
block each; between two consecutive runs the cut goes where the forward's frontier (bytes of activation storages
made before the cut that a forward node after it still reads) is smallest, earliest on ties: in a transformer, right
after the residual add that ends a block, where only the residual stream (and values every block reads, such as a
mask) crosses. So a segment is a block plus the glue before the next one; regions outside blocks (embeddings, the
head) are segments too.

What a segment recomputes. Its saved values: nodes of the segment that backward reads, that only the segment reads in
forward (a value a later forward node reads, such as the block's output, is kept) and that can be recomputed: an aten
op that is not random (`nondeterministic_seeded`, except attention with dropout_p=0), not bitwise nondeterministic,
writes nothing, and reads no storage that any node writes (except the final value of a private chain of in-place
writes, such as dropout's mask: the chain itself is never recomputed, its final value is kept alive instead), or a
getitem of such a node; and whose storage no kept value shares. The recompute is the saved values with their
ancestors inside the segment, stopping at kept values and at values from outside the segment, which are read as they
are (kept alive until the recompute); parameter reads are copied with their view chains (a chunk may move between
forward and backward). A value the recompute needs that cannot be recomputed is kept, and the segment re-examined.

Choice (cost model, `pstar_fx.cost`). Two figures of a candidate graph, both exact replays of liveness over it:
`need`, the least budget any schedule fits (every optimizer state on the host, each node's own chunk buffers: what
`step.min_device_memory` reports), and `comfort`, the device bytes at each node when nothing moves (every optimizer
state and parameter on the device, gradient buffers from their first write). A segment is worth recomputing when its
estimated recompute time is below the time to copy the bytes it frees once between host and device: memory the step
lacks must otherwise be moved every step (chunks evicted and fetched again, optimizer states updated on the host).
Segments are taken in forward order (the earliest blocks free memory for the longest time, and their recompute runs
when little else is live): a worthwhile segment is taken if it lowers (the need above the budget, then comfort's
highest excess over the budget, then the comfort bytes above the budget summed over nodes); one that is not
worthwhile only if it lowers the need above the budget; until comfort fits the budget. The peak comes before the
sum because optimizer states stay on the device all step: the room they have is the budget less the highest
everything else reaches, where backward starts with every block's forward values live (by the sum alone, the
17.26B GPT recomputed 38 of its 54 blocks, and kept 37 fewer chunks' states on the device than with all). Then
segments whose removal changes none of them are dropped, last first. If the need still exceeds the budget, the
segments that give the least need are used; if even that does not fit, BudgetError.
"""
from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._pytree import tree_map

from .. import cost
from ..errors import BudgetError
from ..ir import ops
from ..ir.fx_utils import draws_random, last_uses, mutated_args, private_chains, storage_bytes, storage_key, tensors_of
from ..ir.graph import (REMAT, USER_CHECKPOINT, ChunkGroup, Phase, RematTag, Role, StateHome, TrainGraph, copy_graph,
                        to_module)
from ..ir.needs import all_needs, buf_bytes, state_bytes, static_bytes, step_workspace
from ..units import format_bytes
from .liveness import _NOT_ACTIVATION, analyze, liveness

@dataclass(frozen=True)
class Segment:
    """A candidate for recomputation. Positions index the nodes of the graph the segment was found in."""
    id: int
    block: str | None                # module path of its block ("h.3"), None outside any block
    start: int                       # forward positions [start, end)
    end: int
    recompute: tuple[int, ...]       # the nodes copied into backward, in graph order
    values: tuple[int, ...]          # saved values whose backward users read the copies instead
    inputs: tuple[int, ...]          # original values the copies read (alive until the recompute)
    at: int                          # the first backward user of a saved value: the copies run right before it
    seed: int                        # the loss seed of its micro-batch: users after it are backward users
    freed: int                       # bytes of storages no longer kept from forward into backward
    seconds: float                   # estimated recompute time

    @property
    def worthwhile(self) -> bool:
        return self.seconds <= cost.copy_seconds(self.freed)


# -- finding segments ---------------------------------------------------------------------------------------------

def block_paths(names) -> dict[str, str | None]:
    """Parameter name -> the module path of its block (see the module docstring), None outside any block."""
    split = {n: n.split(".") for n in names}
    numbered: dict[str, set[str]] = {}
    for parts in split.values():
        for i in range(1, len(parts) - 1):
            if parts[i].isdigit():
                numbered.setdefault(".".join(parts[:i]), set()).add(parts[i])
    containers = {c for c, kids in numbered.items() if len(kids) >= 2}
    outer = {c for c in containers if not any(c.startswith(o + ".") for o in containers if o != c)}
    out: dict[str, str | None] = {}
    for n, parts in split.items():
        if not containers:
            out[n] = parts[0] if len(parts) > 1 else None
            continue
        out[n] = None
        for i in range(1, len(parts) - 1):
            if ".".join(parts[:i]) in outer and parts[i].isdigit():
                out[n] = ".".join(parts[:i + 1])
                break
    return out


class _Graph:
    """Facts about the input graph that segment finding and the memory replay share."""

    def __init__(self, g: TrainGraph):
        self.g = g
        self.nodes = g.nodes
        self.pos = {n: i for i, n in enumerate(self.nodes)}
        self.excluded: set[int] = set()
        self.keys: list[tuple[int, ...]] = []            # activation storages per node
        self.size: dict[int, int] = {}
        self.sharers: dict[int, list[int]] = {}
        param_keys: set[int] = set()
        for n in self.nodes:
            role = g.ann[n.name].role
            for t in tensors_of(n):
                if role in _NOT_ACTIVATION:
                    self.excluded.add(storage_key(t))
                if role is Role.PARAM_VIEW:
                    param_keys.add(storage_key(t))
        for i, n in enumerate(self.nodes):
            ks = []
            for t in tensors_of(n):
                k = storage_key(t)
                if k in self.excluded:
                    continue
                if k not in ks:
                    ks.append(k)
                self.size.setdefault(k, storage_bytes(t))
                self.sharers.setdefault(k, []).append(i)
            self.keys.append(tuple(ks))
        self.param_alias = [g.ann[n.name].role is Role.PARAM_VIEW or (
            n.op == "call_function" and bool(tensors_of(n)) and all(storage_key(t) in param_keys for t in tensors_of(n)))
            for n in self.nodes]
        self.last = last_uses(self.nodes)
        self.written = {storage_key(t) for n in self.nodes for m in mutated_args(n) for t in tensors_of(m)}
        self.private = private_chains(self.nodes)
        self._recomputable: dict[int, bool] = {}

    def recomputable(self, i: int) -> bool:
        r = self._recomputable.get(i)
        if r is None:
            r = self._recomputable[i] = self._check(i)
        return r

    def _check(self, i: int) -> bool:
        n = self.nodes[i]
        if n.op != "call_function" or self.g.ann[n.name].role not in (Role.COMPUTE, Role.PARAM_VIEW):
            return False
        if n.target is ops.param_view:
            return True
        if n.target is operator.getitem:
            src = n.args[0]
            return isinstance(src, fx.Node) and self.recomputable(self.pos[src])
        if not isinstance(n.target, torch._ops.OpOverload) or mutated_args(n) or draws_random(n):
            return False
        if torch.Tag.nondeterministic_bitwise in n.target.tags:
            return False
        if any(storage_key(t) in self.written for t in tensors_of(n)):
            return False
        return not any(storage_key(t) in self.written and storage_key(t) not in self.private
                       for a in n.all_input_nodes for t in tensors_of(a))


def _windows(g: TrainGraph, nodes: list[fx.Node]) -> list[tuple[int, int]]:
    """Per micro-batch: (first position, position of its loss seed); its forward nodes lie in between. A seed is a
    backward node computed from forward values only (parameter reads placed in backward have no inputs)."""
    backward = {n for n in nodes if g.ann[n.name].phase is Phase.BACKWARD}
    seeds = [i for i, n in enumerate(nodes) if n in backward and n.all_input_nodes
             and not any(a in backward for a in n.all_input_nodes)]
    return [(0 if k == 0 else seeds[k - 1] + 1, s) for k, s in enumerate(seeds)]


def find_segments(g: TrainGraph, G: _Graph | None = None) -> tuple[Segment, ...]:
    """The candidate segments of a liveness-stage graph (see the module docstring); those with nothing to free are
    left out."""
    G = G or _Graph(g)
    nodes = G.nodes
    blocks = block_paths(p.name for p in g.params)
    out: list[Segment] = []
    for lo, seed in _windows(g, nodes):
        window = [i for i in range(lo, seed) if nodes[i].op == "call_function"
                  and g.ann[nodes[i].name].phase is Phase.FORWARD
                  and getattr(nodes[i].meta.get(USER_CHECKPOINT), "recompute_of", None) is None]
        runs: list[list] = []                 # [block, first, last]
        for i in window:
            a = g.ann[nodes[i].name]
            if a.role is Role.PARAM_VIEW:
                b = blocks.get(a.param)
                if runs and runs[-1][0] == b:
                    runs[-1][2] = i
                else:
                    runs.append([b, i, i])
        frontier = _frontier(G, seed)
        cuts = [lo]
        for (_, _, last), (_, first, _) in zip(runs, runs[1:]):
            cuts.append(min(range(last + 1, first + 1), key=lambda p: (frontier[p], p)))
        cuts.append(seed)
        labels = [r[0] for r in runs] or [None]
        for k, (a, b) in enumerate(zip(cuts, cuts[1:])):
            seg = _segment(G, len(out), labels[k], a, b, [i for i in window if a <= i < b], seed)
            if seg is not None:
                out.append(seg)
    return tuple(out)


def _frontier(G: _Graph, seed: int) -> list[int]:
    """Per position p <= seed: bytes of activation storages made before p that a node before the seed, at or after p,
    still reads."""
    delta = [0] * (seed + 2)
    for k, sharers in G.sharers.items():
        first = sharers[0]
        if first >= seed:
            continue
        end = max([first] + [G.pos[u] for i in sharers for u in G.nodes[i].users if G.pos[u] < seed])
        if end > first:
            delta[first + 1] += G.size[k]
            delta[end + 1] -= G.size[k]
    acc, out = 0, []
    for p in range(seed + 1):
        acc += delta[p]
        out.append(acc)
    return out


def _segment(G: _Graph, sid: int, block, start: int, end: int, members: list[int], seed: int) -> Segment | None:
    nodes, pos = G.nodes, G.pos
    inside = set(members)
    late = {i: [pos[u] for u in nodes[i].users if pos[u] > seed and u.op != "output"] for i in members}

    def read_after(i: int) -> bool:     # a forward node outside the segment (or the graph's output) reads it
        return any((pos[u] not in inside and pos[u] <= seed) or u.op == "output" for u in nodes[i].users)

    kept = {i for i in members if not G.param_alias[i]
            and ((late[i] and not G.recomputable(i)) or read_after(i))}
    outside = {k for i in members for k in G.keys[i] if G.sharers[k][0] not in inside}   # views of outer values
    while True:
        kept_keys = {k for i in kept for k in G.keys[i]} | outside
        values = [i for i in members if late[i] and i not in kept and not G.param_alias[i] and G.keys[i]
                  and G.recomputable(i) and not set(G.keys[i]) & kept_keys]
        recompute: set[int] = set()
        inputs: set[int] = set()
        grew = False
        stack = list(values)
        while stack and not grew:
            i = stack.pop()
            if i in recompute:
                continue
            recompute.add(i)
            for a in nodes[i].all_input_nodes:
                j = pos[a]
                if G.param_alias[j]:
                    if not G.recomputable(j):
                        return None            # a chunk view that cannot be read again: keep the segment as is
                    stack.append(j)
                elif j not in inside or j in kept or not set(G.keys[j]) - kept_keys:
                    inputs.add(j)
                elif G.recomputable(j):
                    stack.append(j)
                else:
                    kept.add(j)
                    grew = True
                    break
        if not grew:
            break
    if not values:
        return None
    freed = sum(G.size[k] for k in {k for i in values for k in G.keys[i]})
    return Segment(id=sid, block=block, start=start, end=end, recompute=tuple(sorted(recompute)),
                   values=tuple(sorted(values)), inputs=tuple(sorted(inputs)),
                   at=min(p for i in values for p in late[i]), seed=seed, freed=freed,
                   seconds=sum(cost.seconds(nodes[i]) for i in recompute))


# -- replaying memory for a choice of segments --------------------------------------------------------------------

@dataclass(frozen=True)
class _Copies:
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


def _copies(G: _Graph, s: Segment, own: list[int], index: dict[int, int]) -> _Copies:
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
    return _Copies(
        size=len(s.recompute), own=_tensor(own[i] for i in s.recompute),
        ov_idx=_tensor(index[k] for k, _ in override), ov_pos=_tensor(p for _, p in override),
        ex_idx=_tensor(index[k] for k, _ in ex), ex_rel=_tensor(_split(p)[0] for _, p in ex),
        ex_orig=_tensor(_split(p)[1] for _, p in ex),
        new_first=_tensor(f for f, _, _ in new.values()), new_rel=_tensor(_split(p)[0] for _, p, _ in new.values()),
        new_orig=_tensor(_split(p)[1] for _, p, _ in new.values()), new_size=_tensor(b for _, _, b in new.values()))


@dataclass(frozen=True)
class _Figures:
    need: int                        # least budget any schedule of the graph fits
    peak: int                        # comfort bytes above the budget at the node where comfort is highest
    excess: int                      # comfort bytes above the budget, summed over nodes


class _Replay:
    """Liveness of the graph with a choice of segments recomputed, without building it (exact: the same rule as
    liveness.analyze over the graph `apply` builds), and the figures the choice is made by."""

    def __init__(self, g: TrainGraph, G: _Graph, budget: int | None):
        self.g, self.G = g, G
        self.segments: dict[int, Segment] = {}
        self.copies: dict[int, _Copies] = {}
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
        base = self.static_host + sum(state_bytes(c, prec) for c in trainable) + sum(c.nbytes for c in g.chunks)
        self.comfort_base = base
        self.comfort_end = base + sum(c.nbytes for c in trainable if not c.grad_inplace) + max(
            (step_workspace(c, prec) for c in trainable), default=0)
        self.budget = budget
        assert self.live(()) == [g.ann[nd.name].live_bytes for nd in nodes], \
            "remat's replay disagrees with liveness on the input graph"

    def add(self, segments) -> None:
        for s in segments:
            self.segments[s.id] = s
            self.copies[s.id] = _copies(self.G, s, self.own_list, self.index)

    def figures(self, chosen) -> _Figures:
        live, own, grads = self._profile(chosen)
        need = self.static_host + int((live + own).max())
        peak = excess = 0
        if self.budget is not None:
            comfort = self.comfort_base + grads + live
            over = (comfort - self.budget).clamp(min=0)
            end = max(0, self.comfort_end - self.budget)
            peak, excess = max(int(over.max()), end), int(over.sum()) + end
        return _Figures(need=need, peak=peak, excess=excess)

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


# -- choosing -----------------------------------------------------------------------------------------------------

def choose(replay: _Replay, segments: tuple[Segment, ...], budget: int) -> tuple[int, ...]:
    """The segments to recompute under `budget` (see the module docstring); () when comfort fits without."""
    def key(chosen):
        f = replay.figures(chosen)
        return (max(0, f.need - budget), f.peak, f.excess)

    chosen: list[int] = []
    best = key(chosen)
    if best == (0, 0, 0):
        return ()
    for s in segments:
        trial = key(chosen + [s.id])
        better = trial < best if s.worthwhile else trial[0] < best[0]
        if better:
            chosen.append(s.id)
            best = trial
            if best == (0, 0, 0):
                break
    for sid in reversed(list(chosen)):
        trial = key([c for c in chosen if c != sid])
        if trial <= best:
            chosen.remove(sid)
            best = trial
    return tuple(chosen)


def least_need(replay: _Replay, segments: tuple[Segment, ...]) -> tuple[int, ...]:
    """The segments that give the least need: taken in forward order while each lowers it, then those whose removal
    does not raise it dropped, last first."""
    chosen: list[int] = []
    best = replay.figures(chosen).need
    for s in segments:
        trial = replay.figures(chosen + [s.id]).need
        if trial < best:
            chosen.append(s.id)
            best = trial
    for sid in reversed(list(chosen)):
        trial = replay.figures([c for c in chosen if c != sid]).need
        if trial <= best:
            chosen.remove(sid)
            best = trial
    return tuple(chosen)


# -- rewriting ----------------------------------------------------------------------------------------------------

def apply(g: TrainGraph, segments) -> TrainGraph:
    """g with the given segments recomputed (see the invariant), liveness annotated."""
    if not segments:
        return g
    graph, env = copy_graph(g)
    old = g.nodes
    pos = {n: i for i, n in enumerate(old)}
    ann = dict(g.ann)
    redirected: dict[fx.Node, dict[int, torch.UntypedStorage]] = {}   # a backward node -> storages it reads now
    for s in sorted(segments, key=lambda s: (s.at, s.id)):
        copy: dict[fx.Node, fx.Node] = {}
        anchor = env[old[s.at]]
        for i in s.recompute:
            n = old[i]
            args, kwargs = fx.node.map_arg((n.args, n.kwargs), lambda a, copy=copy: copy.get(a) or env[a])
            with graph.inserting_before(anchor):
                c = graph.create_node("call_function", n.target, args, kwargs, name=f"rc_{n.name}")
            if "stack_trace" in n.meta:
                c.meta["stack_trace"] = n.meta["stack_trace"]
            c.meta["val"] = _fake_value(n, c)
            c.meta[REMAT] = RematTag(segment=s.id, recompute_of=n.name)
            ann[c.name] = dataclasses.replace(g.ann[n.name], live_bytes=None, resident_bytes=None)
            copy[n] = c
        for i in s.values:
            n = old[i]
            for u in list(n.users):
                if pos[u] > s.seed and u.op != "output":
                    env[u].replace_input_with(env[n], copy[n])
                    redirected.setdefault(env[u], {}).update(_storage_pairs(n, copy[n]))
    _refresh_views(graph, redirected)
    out = g.evolve(gm=to_module(graph, g.gm), ann=ann)
    out = _grads_not_in_place_after_reads(out)
    return liveness(out)


def _fake_value(n: fx.Node, c: fx.Node):
    """The copy's fake value, so that liveness sees its storages as new ones (or as the storages of the copied values
    it views): n's value, each tensor with the same metadata, on the storage of c's input where n's was on the
    storage of n's corresponding input (a view of a copied value), on n's own where n's input is read as it is, and
    on a new storage of the same size otherwise (a new tensor). What running the op on the copy's fake inputs
    gives, made directly: running them cost planning the 17.26B GPT seconds."""
    if n.target is ops.param_view:
        return n.meta["val"]
    moved: dict[int, torch.UntypedStorage] = {}
    for a, b in zip(_input_nodes(n), _input_nodes(c)):
        if a is not b:
            moved.update(_storage_pairs(a, b))
    ins = {storage_key(t) for a in n.all_input_nodes for t in tensors_of(a)}
    made: dict[int, torch.UntypedStorage] = {}

    def place(t):
        if not isinstance(t, FakeTensor):
            return t
        k = storage_key(t)
        if k in moved:
            return _on_storage(moved[k], t)
        if k in ins:
            return t
        if k not in made:
            made[k] = torch.empty(t.untyped_storage().nbytes(), dtype=torch.uint8, device="meta").untyped_storage()
        return _on_storage(made[k], t)
    return tree_map(place, n.meta["val"])


def _input_nodes(n: fx.Node) -> list[fx.Node]:
    """n's input nodes in argument order, repeats included (a copy's arguments map one to one onto n's)."""
    out: list[fx.Node] = []
    fx.node.map_arg((n.args, n.kwargs), out.append)
    return out


def _storage_pairs(a: fx.Node, b: fx.Node) -> dict[int, torch.UntypedStorage]:
    """Storage of each tensor of a's value -> the storage of the corresponding tensor of b's (same structure)."""
    return {storage_key(x): y.untyped_storage() for x, y in zip(tensors_of(a), tensors_of(b))}


def _on_storage(storage: torch.UntypedStorage, like: FakeTensor) -> FakeTensor:
    """A fake tensor with like's metadata (shape, strides, offset, dtype, device) on the given meta storage."""
    meta = torch.empty(0, dtype=like.dtype, device="meta")
    meta.set_(storage, like.storage_offset(), like.shape, like.stride())
    return FakeTensor(like.fake_mode, meta, like.device)


def _refresh_views(graph: fx.Graph, redirected: dict[fx.Node, dict[int, torch.UntypedStorage]]) -> None:
    """Nodes that read a value now read another (a saved value's copy, or a recompute's forward twin), and one that
    returned a view of the value read now views the other: fake values must say so (liveness identifies storages by
    them), so those nodes, and views of them, get their tensors moved to the new storages, in graph order.
    `redirected` maps each node whose input was replaced to the storages it read -> the storages it reads now."""
    moved: dict[fx.Node, dict[int, torch.UntypedStorage]] = dict(redirected)
    for u in graph.nodes:
        if u not in moved and not any(a in moved for a in u.all_input_nodes):
            continue
        pairs = moved.pop(u, {})
        for a in u.all_input_nodes:
            pairs = {**pairs, **moved[a]} if a in moved else pairs
        outs = {storage_key(t): t for t in tensors_of(u)}
        now = {k: pairs[k] for k in outs if k in pairs}
        if u.op == "call_function" and now:
            u.meta["val"] = tree_map(
                lambda t: _on_storage(now[storage_key(t)], t)
                if isinstance(t, FakeTensor) and storage_key(t) in now else t, u.meta["val"])
            moved[u] = now


def _grads_not_in_place_after_reads(g: TrainGraph) -> TrainGraph:
    """A chunk whose gradients overwrite its parameters (mixed precision) must not have a parameter read after its
    gradient is written; a recompute can read one late: such chunks get a separate gradient buffer."""
    if not any(c.grad_inplace for c in g.chunks):
        return g
    last_read: dict[str, int] = {}
    written: dict[str, int] = {}
    for i, n in enumerate(g.nodes):
        a = g.ann[n.name]
        if a.role is Role.PARAM_VIEW:
            last_read[a.param] = i
        elif a.role is Role.WRITE_GRAD:
            written.setdefault(a.param, i)
    chunks = tuple(dataclasses.replace(c, grad_inplace=False)
                   if c.grad_inplace and any(last_read.get(p, -1) > written.get(p, len(g.nodes)) for p in c.params)
                   else c for c in g.chunks)
    return g.evolve(chunks=chunks)


# -- the pass -----------------------------------------------------------------------------------------------------

def keep_forward_values(g: TrainGraph) -> TrainGraph:
    """g with the user's activation checkpoints undone: each recompute node's users read its forward twin (the same op
    on the same values, tagged by frontend/user_checkpoint) wherever the twin's storage is not written between the two, and the
    recompute nodes left without users are dropped; liveness annotated. g itself when nothing changes."""
    nodes = g.nodes
    by_name = {n.name: n for n in nodes}
    pos = {n: i for i, n in enumerate(nodes)}
    writes: dict[object, list[int]] = {}
    for i, n in enumerate(nodes):
        for m in mutated_args(n):
            for t in tensors_of(m):
                writes.setdefault(storage_key(t), []).append(i)
    graph, env = copy_graph(g)
    changed = False
    redirected: dict[fx.Node, dict[int, torch.UntypedStorage]] = {}   # a node -> storages it reads now
    for n in nodes:
        tag = n.meta.get(USER_CHECKPOINT)
        twin = by_name.get(tag.recompute_of) if tag is not None and tag.recompute_of is not None else None
        if twin is None or not n.users:
            continue
        same = [(tuple(a.shape), a.dtype) for a in tensors_of(twin)] == [(tuple(b.shape), b.dtype)
                                                                       for b in tensors_of(n)]
        written = any(pos[twin] < w < pos[n] for t in tensors_of(twin) for w in writes.get(storage_key(t), ()))
        if same and not written:
            for u in env[n].users:
                redirected.setdefault(u, {}).update(_storage_pairs(n, twin))
            env[n].replace_all_uses_with(env[twin])
            changed = True
    if not changed:
        return g
    ann = dict(g.ann)
    for node in reversed(list(graph.nodes)):
        droppable = node.target is ops.param_view or node.target not in ops.RUNTIME_OPS
        if node.op == "call_function" and droppable and not node.users and not mutated_args(node):
            graph.erase_node(node)
            ann.pop(node.name, None)
    alive = set(graph.nodes)
    _refresh_views(graph, {u: gone for u, gone in redirected.items() if u in alive})
    out = g.evolve(gm=to_module(graph, g.gm), ann=ann)
    return liveness(_grads_not_in_place_after_reads(out))


def remat(g: TrainGraph, *, enabled: bool = True) -> TrainGraph:
    budget = g.settings.budget
    unchanged = g.evolve(stage="remat", made_by="remat")
    if not enabled or g.settings.optimizer is None:
        return unchanged      # remat=False: nothing recomputed beyond the user's own checkpoints, which stay
    # the user's checkpoints are hints: where the step fits with their activations kept and nothing moving, keeping
    # them is faster than recomputing; otherwise they stay and more may be recomputed below
    undone = "remat (user checkpoints undone: the activations fit)"
    if budget is None:
        kept = keep_forward_values(g)
        return unchanged if kept is g else kept.evolve(stage="remat", made_by=undone)
    G = _Graph(g)
    replay = _Replay(g, G, budget)
    if replay.figures(()).excess == 0:         # comfort fits: nothing would move
        # keeping the forward values holds at every node at least what recomputing them does, so only a step that
        # fits with its checkpoints can fit without them: the graph without them is made only then
        kept = keep_forward_values(g)
        if kept is not g and _Replay(kept, _Graph(kept), budget).figures(()).excess == 0:
            return kept.evolve(stage="remat", made_by=undone)
        return unchanged
    segments = find_segments(g, G)
    replay.add(segments)
    chosen = choose(replay, segments, budget)
    if replay.figures(chosen).need > budget:
        chosen = least_need(replay, segments)
        if replay.figures(chosen).need > budget:
            raise _budget_error(apply(g, [s for s in segments if s.id in chosen]), budget)
    out = apply(g, [s for s in segments if s.id in chosen])
    assert replay.live(chosen) == [out.ann[n.name].live_bytes for n in out.nodes], \
        "remat's replay of liveness disagrees with liveness on the rewritten graph"
    return out.evolve(stage="remat", made_by="remat")


def least_need_graph(g: TrainGraph) -> TrainGraph:
    """g with the segments recomputed that give the least need (step.min_device_memory): the smallest budget the
    step compiles under with recomputation."""
    if g.settings.optimizer is None:
        return g
    G = _Graph(g)
    segments = find_segments(g, G)
    replay = _Replay(g, G, None)
    replay.add(segments)
    chosen = least_need(replay, segments)
    return apply(g, [s for s in segments if s.id in chosen])


def _budget_error(g: TrainGraph, budget: int) -> BudgetError:
    """The least budget with recomputation (what step.min_device_memory reports) and the node that needs it."""
    from .place_optimizer import min_need, place_optimizer
    host = place_optimizer(g.evolve(settings=dataclasses.replace(g.settings, budget=0)))
    need = min_need(host)
    nodes = host.nodes
    lv = analyze(nodes, host.ann)
    nd = all_needs(host)
    own = [lv.live[i] + x.workspace + sum(buf_bytes(host, k) for k in x.resident) for i, x in enumerate(nd)]
    i = max(range(len(own)), key=own.__getitem__)
    chunks = sum(buf_bytes(host, k) for k in nd[i].resident)
    n = nodes[i]
    what = n.target.__name__ if callable(n.target) and hasattr(n.target, "__name__") else n.target
    return BudgetError(
        f"device_memory budget {format_bytes(budget)} ({budget} bytes) is too small: even recomputing activations "
        f"in backward (remat), this step needs at least {format_bytes(need)} ({need} bytes), at node '{n.name}' "
        f"({what}): live activations {format_bytes(lv.live[i])} + its chunk buffers {format_bytes(chunks)} + "
        f"workspace {format_bytes(nd[i].workspace)} + always-resident {format_bytes(static_bytes(host))} (module "
        "buffers and constants; every optimizer state on the host). Raise device_memory, or lower chunk_size or the "
        "batch size.", node=n.name, needed=need, available=budget)
