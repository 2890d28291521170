"""fuse_regions: the compute between chunk operations grouped into regions, each one node that calls compiled code.

Invariant after: every `region` node (Role.REGION) stands for a maximal run of two or more fusible compute nodes of
the scheduled graph between the same two chunk operations (fetch, release, alloc, collectives, commit,
optimizer_step, guards); its inputs and outputs are values of the plan and nothing outside it reads a value made
inside it; each output is read back by an `operator.getitem` node right after it. The graph computes what it
computed before, node for node, and the plan still holds: resident bytes are those of the schedule, live bytes are
replayed on the new graph (values inside a region are never materialised, so their liveness disappears), and each
region's internal storages are its workspace, their peak under liveness's rule, a bound on what the compiled code
holds beside its inputs and outputs. static + resident + live + workspace <= budget at every node: a region that
would exceed it is split in two until it fits (a single node is never fused).

Parameter views (`param_view`, a view of resident chunk memory) and gradient writes (`write_grad`) do not end a
run: within a run no chunk moves, so a run's parameter views are taken before its regions and its gradient writes
made after them (the order the schedule checked is kept otherwise).

What stays out of a region, run eagerly as traced: random ops (dropout: Inductor draws different numbers from
eager, so results would differ), ops that add into positions the data chooses (an embedding's gradient: Inductor adds
with atomics, so runs would differ from one another), ops that write in place (module buffers, chunk views), ops
whose output size depends on data, ops with non-tensor inputs or outputs read outside the region, views of a region's
inputs read outside it, and anything not a compute node.
"""
from __future__ import annotations

import dataclasses
import operator
from typing import NamedTuple

import torch
import torch.fx as fx

from ..cost import H200, Machine, estimate
from ..ir import ops
from ..ir.fx_utils import draws_random, mutated_args, storage_bytes, storage_key, tensors_in, tensors_of
from ..ir.graph import Choice, NodeAnn, Role, TrainGraph, to_module
from .schedule import annotate

_IN_RUN = (Role.COMPUTE, Role.PARAM_VIEW, Role.WRITE_GRAD)   # roles that do not end a run (no chunk moves)


def fuse_regions(g: TrainGraph) -> TrainGraph:
    assert g.plan is not None, "fuse_regions runs on a scheduled graph"
    nodes = g.nodes
    runs = _runs(g, nodes)
    fusible = [_fusible(g, n) for n in nodes]
    made = _Made()            # segments and regions of the runs not halved, kept for the next build
    while True:
        fused, region_run = _build(g, nodes, runs, fusible, made)
        over = _over_budget(fused, region_run)
        if not over:
            return fused
        runs = [half for r in runs for half in (_halve(r) if r in over else (r,))]


@dataclasses.dataclass
class _Made:
    """What fuse_regions' builds share: each run's segments and each segment's region, by span (a run split in two
    for the budget gets new ones; the others' are the same in every build)."""
    segments: dict = dataclasses.field(default_factory=dict)     # run -> _segments(run)
    regions: dict = dataclasses.field(default_factory=dict)      # segment (a tuple of positions) -> _Region


def fuse_if_faster(g: TrainGraph, machine: Machine = H200) -> TrainGraph:
    """fuse=None where fusing is the default: fuse_regions' graph where the cost model estimates its step no slower
    than g's unfused (g: the scheduled graph, its optimizer placed for an unfused step), else g itself. Fused regions
    make the device's compute shorter, but the CPU worker's host-side updates run slower beside them
    (cost.Machine.cpu_adam_beside_fused), so a step those updates bound is faster unfused. (The fused step is
    estimated on g's placement, made for the CPU's unslowed rate: where the choice is close it leans unfused.)

    Invariant after: either fuse_regions' graph (its settings marked fused) or g's nodes and plan unchanged, stage
    "fused" with no region and its settings marked unfused; a Choice says which and the two estimates."""
    fused = fuse_regions(g.evolve(settings=dataclasses.replace(g.settings, fused=True)))
    plain = g.evolve(settings=dataclasses.replace(g.settings, fused=False))
    with_regions, without = estimate(fused, machine).seconds, estimate(plain, machine).seconds
    if with_regions <= without:
        why = f"fused: the step estimated {with_regions:.5f} s with its regions, {without:.5f} s without"
        return fused.evolve(choices=fused.choices + (Choice("fuse_if_faster", why),))
    why = (f"not fused (fuse=None): the step estimated {without:.5f} s unfused against {with_regions:.5f} s fused, "
           "whose CPU updates run slower beside the regions; fuse=True fuses it anyway")
    return plain.evolve(stage="fused", made_by="fuse_if_faster",
                        choices=plain.choices + (Choice("fuse_if_faster", why),))


# -- which nodes may join a region --------------------------------------------------------------------------------

def _static_tensor(v) -> bool:
    return isinstance(v, torch.Tensor) and all(isinstance(s, int) for s in v.shape) and \
        isinstance(v.untyped_storage().nbytes(), int)


def _fusible(g: TrainGraph, n: fx.Node) -> bool:
    if g.ann[n.name].role is not Role.COMPUTE or n.op != "call_function":
        return False
    if not (isinstance(n.target, torch._ops.OpOverload) or n.target is operator.getitem):
        return False
    if draws_random(n) or mutated_args(n) or _sums_at_data_positions(n):
        return False
    v = n.meta.get("val")
    leaves = tensors_in(v)
    if not leaves or not all(_static_tensor(t) for t in leaves):
        return False
    if not isinstance(v, torch.Tensor) and not (isinstance(v, (tuple, list)) and len(leaves) == len(v)):
        return False
    return all(_static_tensor(a.meta.get("val")) or a.meta.get("val") is not None and
               isinstance(a.meta.get("val"), (tuple, list)) for a in n.all_input_nodes)


# Ops that add into positions the data chooses (an embedding's gradient, scatter and index adds): Inductor's kernels
# for them add with atomics, in whatever order the threads arrive, so two runs of one step would differ in the last
# bits. They stay eager: torch's embedding gradient sorts its indices (repeatable), and its scatter and index adds
# are as repeatable as torch.use_deterministic_algorithms makes them.
_DATA_POSITION_SUMS = {torch.ops.aten.embedding_dense_backward, torch.ops.aten.embedding_backward,
                       torch.ops.aten._embedding_bag_backward, torch.ops.aten.index_add, torch.ops.aten.scatter_add,
                       torch.ops.aten.scatter_reduce, torch.ops.aten.index_reduce}
_INDEX_PUTS = {torch.ops.aten.index_put, torch.ops.aten._unsafe_index_put}


def _sums_at_data_positions(n: fx.Node) -> bool:
    packet = getattr(n.target, "overloadpacket", None)
    if packet in _DATA_POSITION_SUMS:
        return True
    if packet in _INDEX_PUTS:
        return bool(n.kwargs.get("accumulate", n.args[3] if len(n.args) > 3 else False))
    return False


def _runs(g: TrainGraph, nodes: list[fx.Node]) -> list[tuple[int, int]]:
    """Spans [lo, hi) of node positions holding only compute nodes, parameter views and gradient writes."""
    out, lo = [], None
    for i, n in enumerate(nodes):
        inside = g.ann[n.name].role in _IN_RUN and n.op == "call_function"
        if inside and lo is None:
            lo = i
        elif not inside and lo is not None:
            out.append((lo, i))
            lo = None
    if lo is not None:
        out.append((lo, len(nodes)))
    return out


def _halve(run: tuple[int, int]) -> tuple[tuple[int, int], ...]:
    lo, hi = run
    if hi - lo < 2:
        return (run,)
    mid = (lo + hi) // 2
    return ((lo, mid), (mid, hi))


def _segments(g: TrainGraph, nodes: list[fx.Node], run: tuple[int, int], fusible: list[bool]) -> list[list[int]]:
    """The run's regions: maximal sequences of fusible compute nodes (parameter views and gradient writes skipped
    over), adjusted until no member's non-tensor value (a tuple) is read outside it and every input is a tensor.
    fusible: _fusible of each node, by position."""
    lo, hi = run
    bad: set[int] = set()
    while True:
        segs, cur = [], []
        for i in range(lo, hi):
            role = g.ann[nodes[i].name].role
            if role is not Role.COMPUTE:
                continue
            if i in bad or not fusible[i]:
                if cur:
                    segs.append(cur)
                cur = []
            else:
                cur.append(i)
        if cur:
            segs.append(cur)
        more = set()
        for seg in segs:
            members = {nodes[i] for i in seg}
            outside = {storage_key(t) for i in seg for a in nodes[i].all_input_nodes if a not in members
                       for t in tensors_of(a)}
            for i in seg:
                n = nodes[i]
                read_after = any(u not in members for u in n.users)
                if read_after and not isinstance(n.meta["val"], torch.Tensor):
                    more.add(i)
                # an output sharing an input's storage (a view of a parameter view, say) stays eager: a region's
                # outputs are storages of its own, so the chunks its outputs keep in use are its inputs' alone
                if read_after and any(storage_key(t) in outside for t in tensors_of(n)):
                    more.add(i)
                if any(not isinstance(a.meta.get("val"), torch.Tensor) and a not in members
                       for a in n.all_input_nodes):
                    more.add(i)
        if not more:
            return [s for s in segs if _worth(nodes, s)]
        bad |= more


def _worth(nodes: list[fx.Node], seg: list[int]) -> bool:
    """Two or more nodes that make storage of their own (views and getitems alone gain nothing from compiling)."""
    made = 0
    for i in seg:
        n = nodes[i]
        ins = {storage_key(t) for a in n.all_input_nodes for t in tensors_of(a)}
        made += any(storage_key(t) not in ins for t in tensors_of(n))
    return made >= 2


# -- building the fused graph -------------------------------------------------------------------------------------

def _build(g: TrainGraph, nodes: list[fx.Node], runs: list[tuple[int, int]], fusible: list[bool], made: _Made
           ) -> tuple[TrainGraph, dict]:
    """The fused graph, and the run each region node (and each view and write moved around one) came from. Between a
    region's first and last member there are only parameter views and gradient writes (a region is a maximal sequence
    of fusible nodes skipping only those): the views are taken before the region, the writes made after it. `made`
    holds the segments and regions of earlier builds, reused where their run is unchanged, and gains this build's."""
    starts: dict[int, tuple[list[int], tuple[int, int]]] = {}
    for run in runs:
        if run not in made.segments:
            made.segments[run] = _segments(g, nodes, run, fusible)
        for seg in made.segments[run]:
            starts[seg[0]] = (seg, run)
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    ann: dict[str, NodeAnn] = {}
    region_run: dict[str, tuple[int, int]] = {}

    def copy(j: int) -> None:
        n = nodes[j]
        new = graph.node_copy(n, lambda a: env[a])
        env[n] = new
        ann[new.name] = g.ann[n.name]

    i = regions = 0
    while i < len(nodes):
        if i not in starts:
            copy(i)
            i += 1
            continue
        seg, run = starts[i]
        span = range(seg[0], seg[-1] + 1)
        for j in span:
            if g.ann[nodes[j].name].role is Role.PARAM_VIEW:
                copy(j)
                region_run[env[nodes[j]].name] = run
        key = tuple(seg)
        if key not in made.regions:
            made.regions[key] = _region([nodes[j] for j in seg])
        for name in _add_region(g, graph, env, ann, made.regions[key], regions):
            region_run[name] = run
        regions += 1
        for j in span:        # (a write moved after the region keeps its gradient alive longer: the run's too)
            if g.ann[nodes[j].name].role is Role.WRITE_GRAD:
                copy(j)
                region_run[env[nodes[j]].name] = run
        i = seg[-1] + 1
    fused = g.evolve(gm=to_module(graph, g.gm), ann=ann)
    sched = annotate(fused, g.plan.carried)
    plan = dataclasses.replace(g.plan, predicted_peak=sched.plan.predicted_peak)
    return sched.evolve(plan=plan, stage="fused", made_by="fuse_regions"), region_run


class _Region(NamedTuple):
    """A region's members (graph order), the nodes outside it they read (its inputs, in order), the members read
    outside it (its outputs), its fx graph as a module, and its workspace bytes."""
    members: list[fx.Node]
    inputs: list[fx.Node]
    outputs: list[fx.Node]
    gm: fx.GraphModule
    workspace: int


def _region(members: list[fx.Node]) -> _Region:
    """The region of these compute nodes: its inputs and outputs, and a graph of its own that computes them. Its
    module's Python code is generated only when asked for (the runtime compiles it; a plan never does): a
    millisecond or two a region, and a 17B GPT's step has 500."""
    inside = set(members)
    inputs: list[fx.Node] = []
    for m in members:
        for a in m.all_input_nodes:
            if a not in inside and a not in inputs:
                inputs.append(a)
    outputs = [m for m in members if any(u not in inside for u in m.users)]
    # canonical names and no source locations: identical regions (a model's layers) have identical code, which the
    # runtime compiles once (runtime/compiled_regions.py)
    sub = fx.Graph()
    sub_env: dict[fx.Node, fx.Node] = {}
    for k, a in enumerate(inputs):
        p = sub.placeholder(f"in{k}")
        p.meta["val"] = a.meta["val"]
        sub_env[a] = p
    for k, m in enumerate(members):
        new = sub.create_node("call_function", m.target, fx.node.map_arg(m.args, lambda a: sub_env[a]),
                              fx.node.map_arg(m.kwargs, lambda a: sub_env[a]), name=f"n{k}")
        new.meta["val"] = m.meta["val"]
        sub_env[m] = new
    sub.output(tuple(sub_env[o] for o in outputs))
    return _Region(members, inputs, outputs, to_module(sub, torch.nn.Module()),
                   _workspace(members, outputs, inputs))


def _add_region(g: TrainGraph, graph: fx.Graph, env, ann, r: _Region, index: int) -> list[str]:
    """Add the region node of `r` and a getitem per output; their names."""
    spec = ops.RegionSpec(index=index, gm=r.gm, nodes=len(r.members), workspace=r.workspace)
    phase = g.ann[r.members[-1].name].phase
    node = graph.call_function(ops.region, tuple(env[a] for a in r.inputs), {"spec": spec}, name=f"region_{index}")
    node.meta["val"] = tuple(o.meta["val"] for o in r.outputs)
    ann[node.name] = NodeAnn(role=Role.REGION, phase=phase, workspace_bytes=spec.workspace)
    names = [node.name]
    for k, o in enumerate(r.outputs):
        get = graph.call_function(operator.getitem, (node, k), name=o.name)
        get.meta = dict(o.meta)
        env[o] = get
        ann[get.name] = dataclasses.replace(g.ann[o.name], workspace_bytes=0)
        names.append(get.name)
    return names


def _workspace(members: list[fx.Node], outputs: list[fx.Node], inputs: list[fx.Node]) -> int:
    """The most bytes of storages made and freed inside the region that are alive at once, by liveness's rule
    (alive from the node that makes it to the last member reading any value that shares it)."""
    outside = {storage_key(t) for n in outputs + inputs for t in tensors_of(n)}
    inside = set(members)
    at = {m: k for k, m in enumerate(members)}
    start: dict[int, int] = {}
    end: dict[int, int] = {}
    size: dict[int, int] = {}
    for k, m in enumerate(members):
        last = max((at[u] for u in m.users if u in inside), default=k)
        for t in tensors_of(m):
            key = storage_key(t)
            if key in outside:
                continue
            if key not in start:
                start[key], size[key] = k, storage_bytes(t)
            end[key] = max(end.get(key, k), last)
    return max((sum(size[s] for s in start if start[s] <= k <= end[s]) for k in range(len(members))), default=0)


def _over_budget(fused: TrainGraph, region_run: dict) -> set[tuple[int, int]]:
    """The runs holding a region node whose device bytes exceed the budget (each is then split in two)."""
    budget = fused.settings.budget
    if budget is None:
        return set()
    static = fused.plan.static_bytes
    over = set()
    for n in fused.nodes:
        a = fused.ann[n.name]
        if static + a.resident_bytes + a.live_bytes + a.workspace_bytes > budget:
            assert n.name in region_run, f"{n.name} over budget outside any region: the schedule promised it fits"
            over.add(region_run[n.name])
    return over
