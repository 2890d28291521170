"""Finding the segments the remat pass may recompute (see pstar_fx.passes.remat for the pass).

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

Light variants (`light_segments`): the same segment with its compute-bound values (matrix products, attention) kept
as well, so that its recompute stops at them and runs only the cheap operations between them.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from ... import cost
from ...ir import ops
from ...ir.flops import FORWARD_ATTENTION, MATMUL_FLOPS
from ...ir.fx_utils import draws_random, last_uses, mutated_args, private_chains, storage_bytes, storage_key, tensors_of
from ...ir.graph import USER_CHECKPOINT, Phase, Role, TrainGraph
from ..liveness import _NOT_ACTIVATION


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
    copy_s: float                    # the time to copy `freed` bytes once between host and device
    light: bool = False              # its compute-bound values kept: only the cheap operations recomputed

    @property
    def worthwhile(self) -> bool:
        return self.seconds <= self.copy_s


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


class GraphFacts:
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
            n.op == "call_function" and bool(tensors_of(n))
            and all(storage_key(t) in param_keys for t in tensors_of(n))) for n in self.nodes]
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


def _window_node(g: TrainGraph, n: fx.Node) -> bool:
    """Whether a node between a micro-batch's start and its loss seed may belong to a segment: a forward operation,
    not the user's checkpoint recomputing one."""
    return (n.op == "call_function" and g.ann[n.name].phase is Phase.FORWARD
            and getattr(n.meta.get(USER_CHECKPOINT), "recompute_of", None) is None)


def find_segments(g: TrainGraph, G: GraphFacts | None = None, machine: cost.Machine = cost.H200
                  ) -> tuple[Segment, ...]:
    """The candidate segments of a liveness-stage graph (see the module docstring); those with nothing to free are
    left out. Their recompute and copy times are at `machine`'s rates."""
    G = G or GraphFacts(g)
    nodes = G.nodes
    blocks = block_paths(p.name for p in g.params)
    out: list[Segment] = []
    for lo, seed in _windows(g, nodes):
        window = [i for i in range(lo, seed) if _window_node(g, nodes[i])]
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
            seg = _segment(G, len(out), labels[k], a, b, [i for i in window if a <= i < b], seed, machine)
            if seg is not None:
                out.append(seg)
    return tuple(out)


def light_segments(g: TrainGraph, G: GraphFacts, segments: tuple[Segment, ...],
                   machine: cost.Machine = cost.H200) -> tuple[Segment, ...]:
    """The light variant of each segment (ids after the last segment's): the same nodes, its compute-bound values
    (matrix products and attention: `HEAVY`) kept from forward, so that it recomputes only the cheap operations
    (norms, activations, rotary embeddings, casts) that sit between them. It frees less than the whole segment for
    far less compute. Left out where it recomputes nothing or all that the segment does."""
    out: list[Segment] = []
    next_id = max((s.id for s in segments), default=-1) + 1
    for s in segments:
        members = [i for i in range(s.start, s.end) if _window_node(g, G.nodes[i])]
        v = _segment(G, next_id, s.block, s.start, s.end, members, s.seed, machine, light=True)
        if v is not None and len(v.recompute) < len(s.recompute):
            out.append(v)
            next_id += 1
    return tuple(out)


HEAVY = frozenset(MATMUL_FLOPS) | frozenset(FORWARD_ATTENTION)   # values a light segment keeps


def _frontier(G: GraphFacts, seed: int) -> list[int]:
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


def _segment(G: GraphFacts, sid: int, block, start: int, end: int, members: list[int], seed: int,
             machine: cost.Machine, light: bool = False) -> Segment | None:
    nodes, pos = G.nodes, G.pos
    inside = set(members)
    late = {i: [pos[u] for u in nodes[i].users if pos[u] > seed and u.op != "output"] for i in members}

    def read_after(i: int) -> bool:     # a forward node outside the segment (or the graph's output) reads it
        return any((pos[u] not in inside and pos[u] <= seed) or u.op == "output" for u in nodes[i].users)

    kept = {i for i in members if not G.param_alias[i]
            and ((late[i] and not G.recomputable(i)) or read_after(i) or (light and nodes[i].target in HEAVY))}
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
                   seconds=sum(cost.seconds(nodes[i], machine) for i in recompute),
                   copy_s=cost.copy_seconds(freed, machine), light=light)
