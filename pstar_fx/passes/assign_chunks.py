"""assign_chunks: parameters into fixed-size chunks in first-use order; reads and gradients go through the chunks.

Invariant after: every parameter has a chunk and an offset, chunks of one group never overlap; a trainable chunk
holds parameters of one optimizer parameter group only (`opt_group`; first-use order within each group), and a
parameter the loss reaches but no optimizer group holds is frozen (torch.optim never updates it); no placeholder of a
parameter remains: each use of a parameter (or of a view of one) is fed by its own `param_view(param=...)` node,
placed, with the chain of views it needs, right before that use, so no value aliasing a chunk lives across two uses
(the chunk may move in between); every gradient output became `write_grad(grad, param=...)` right after the node
that made it (a first write whose gradient an operation with an out= form makes whole: `compute_grad(...)` in that
operation's place, passes/grad_into.py), and the graph returns the loss and the aux outputs only (ir/outputs.py).
In mixed precision a chunk's gradients overwrite its parameters (`grad_inplace`) iff no parameter of the chunk is
read after its own gradient is written. With `world` ranks every chunk's capacity is a multiple of ALIGN * world,
so each rank's shard is a whole, aligned 1/world of it.
"""
from __future__ import annotations

import dataclasses
import math

import torch.fx as fx

from ..ir import ops
from ..ir.fx_utils import mutated_args, node_copy, output_node, storage_key, tensors_of
from ..ir.outputs import split_outputs
from ..ir.graph import ChunkGroup, ChunkInfo, NodeAnn, ParamInfo, Phase, Role, TrainGraph, copy_graph, to_module
from .grad_into import fold_grad_producers

ALIGN = 32                  # element alignment of every parameter inside a chunk (vectorised kernels like it)
MAX_AUTO_CHUNK = 1 << 26    # largest chunk chosen automatically (elements)
MIN_CHUNKS_IN_BUDGET = 8    # an automatic chunk is at most 1/8 of the budget, so several fit at once
EXHAUSTIVE = 2048           # chunk sizes tried when choosing one


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def pack(numels: list[int], chunk_size: int, quantum: int = 1) -> list[tuple[int, list[tuple[int, int]]]]:
    """Greedy first-fit in the given order. Returns chunks as (capacity, [(index, offset)]). A tensor larger than
    chunk_size gets a chunk of its own, its size rounded up to a multiple of `quantum`."""
    chunks: list[tuple[int, list[tuple[int, int]]]] = []
    current: list[tuple[int, int]] | None = None
    fill = 0
    for i, n in enumerate(numels):
        if n > chunk_size:
            chunks.append(((n + quantum - 1) // quantum * quantum, [(i, 0)]))
            continue
        if current is None or fill + n > chunk_size:
            current, fill = [], 0
            chunks.append((chunk_size, current))
        current.append((i, fill))
        fill = _align(fill + n)
    return chunks


def waste(numels: list[int], chunk_size: int) -> int:
    used = sum(numels)
    return sum(cap for cap, _ in pack(numels, chunk_size)) - used


def choose_chunk_size(numels: list[int], itemsize: int, budget: int | None,
                      parts: list[list[int]] | None = None) -> int:
    """The chunk size (elements) that wastes least, among sizes small enough that MIN_CHUNKS_IN_BUDGET chunks fit in
    the budget and large enough that there are at most a few hundred chunks and, where the budget allows, that every
    tensor fits in one (a tensor's own chunk wastes nothing, but gives the pool slots of another size); ties go to
    the larger size. parts: the lists packed separately (optimizer groups, frozen parameters); None: one list."""
    total = sum(numels)
    if total == 0:
        return ALIGN
    hi = min(MAX_AUTO_CHUNK, sum(_align(n) for n in numels))   # one chunk holding everything
    if budget is not None:
        hi = min(hi, max(ALIGN, budget // (MIN_CHUNKS_IN_BUDGET * itemsize)))
    lo = min(hi, max(ALIGN, _align(total // 256)))
    if _align(max(numels)) <= hi:
        lo = max(lo, _align(max(numels)))
    if (hi - lo) // ALIGN <= EXHAUSTIVE:
        candidates = set(range(lo, hi + 1, ALIGN)) | {hi}
    else:   # a geometric grid: the waste of nearby sizes differs little once chunks hold many tensors
        candidates = {hi, lo} | {_align(int(lo * (hi / lo) ** (k / EXHAUSTIVE))) for k in range(EXHAUSTIVE + 1)}
    candidates |= {_align(n) for n in numels if lo <= _align(n) <= hi}
    parts = [numels] if parts is None else [p for p in parts if p]
    return min(sorted(candidates), key=lambda s: (sum(waste(p, s) for p in parts), -s))


def _alias_roots(graph: fx.Graph, param_of: dict[fx.Node, str]) -> dict[fx.Node, fx.Node]:
    """node -> the parameter placeholder whose storage its value shares (views of parameters)."""
    root: dict[fx.Node, fx.Node] = {p: p for p in param_of}
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        keys = {storage_key(t) for t in tensors_of(node)}
        for a in node.all_input_nodes:
            if a in root and keys & {storage_key(t) for t in tensors_of(a)}:
                root[node] = root[a]
                break
    return root


def assign_chunks(g: TrainGraph, *, chunk_size: int | None = None,
                  layout: tuple[tuple[ParamInfo, ...], tuple[ChunkInfo, ...], int] | None = None) -> TrainGraph:
    graph, _ = copy_graph(g)
    ann = dict(g.ann)
    grouping = g.settings.optimizer

    def group_of(name: str) -> int | None:
        return 0 if grouping is None else grouping.group_of(name)

    # 0. A trainable parameter in no optimizer group is never updated (as in torch.optim): frozen, gradient dropped.
    ungrouped = {p.name for p in g.params if p.trainable and group_of(p.name) is None}
    all_params = tuple(dataclasses.replace(p, trainable=False) if p.name in ungrouped else p for p in g.params)
    grad_outputs = tuple(n for n in g.grad_outputs if n not in ungrouped)
    if ungrouped:
        out = output_node(graph)
        parts = split_outputs(out.args[0], 1, g.aux)
        out.args = ([parts.loss] + parts.aux
                    + [gn for n, gn in zip(g.grad_outputs, parts.grads) if n not in ungrouped],)
        for node in reversed(list(graph.nodes)):   # the dropped gradients' computations (canonicalize's rule)
            if node.op == "call_function" and not node.users and not mutated_args(node):
                graph.erase_node(node)
                ann.pop(node.name, None)
    nodes = list(graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    param_of = {n: ann[n.name].param for n in nodes if ann[n.name].role is Role.PARAM}
    placeholder = {name: n for n, name in param_of.items()}

    # 1. Layout: first-use order; trainable parameters by optimizer group, and frozen ones, in separate chunks.
    if layout is None:
        first_use = {name: min((index[u] for u in n.users), default=len(nodes)) for name, n in placeholder.items()}
        order = sorted(all_params, key=lambda p: (first_use[p.name], p.name))
        opt_groups = sorted({group_of(p.name) for p in order if p.trainable})
        parts = [(ChunkGroup.TRAINABLE, k, [p for p in order if p.trainable and group_of(p.name) == k])
                 for k in opt_groups] + [(ChunkGroup.FROZEN, None, [p for p in order if not p.trainable])]
        dtype = g.settings.precision.dtype
        size = chunk_size or choose_chunk_size([p.numel for p in order], dtype.itemsize, g.settings.budget,
                                               parts=[[p.numel for p in m] for _, _, m in parts])
        quantum = ALIGN * g.settings.world if g.settings.world > 1 else 1   # whole, aligned shards per rank
        size = (size + quantum - 1) // quantum * quantum
        params: dict[str, ParamInfo] = {}
        chunks: list[ChunkInfo] = []
        for group, opt_group, members in parts:
            for cap, slots in pack([p.numel for p in members], size, quantum):
                cid = len(chunks)
                names = tuple(members[i].name for i, _ in slots)
                for i, off in slots:
                    params[members[i].name] = dataclasses.replace(members[i], chunk=cid, offset=off)
                chunks.append(ChunkInfo(id=cid, group=group, capacity=cap, dtype=dtype, params=names,
                                        used=sum(members[i].numel for i, _ in slots), opt_group=opt_group))
        param_table = tuple(params[p.name] for p in all_params)
    else:
        param_table, chunk_table, size = layout
        old = {p.name: p for p in param_table}
        forward_only = g.settings.optimizer is None   # an evaluation graph reads a training step's chunks
        for p in all_params:
            q = old.get(p.name)
            if q is None or (q.trainable != p.trainable and not forward_only):
                now, then = ("gets a gradient", "got none") if p.trainable else ("gets no gradient", "got one")
                raise ValueError(
                    f"parameter '{p.name}' {now} in this trace but {then} in the first one: pstar-fx fixes which "
                    "parameters train when it lays out the chunks at the first compile. Either its requires_grad "
                    "changed (set it before the first step; to change it later, call step.sync_model(), change it "
                    "and compile a new step, whose optimizer state starts empty: torch's state dicts key the "
                    "states by position, so an old one loads only into a step that trains the same parameters), "
                    "or this trace leaves it unused (an input shape, a Python flag or a branch on a tensor value "
                    "skips it): use every trainable parameter in every step, e.g. add its branch's output times 0, "
                    "or set requires_grad=False on those that never train.")
        param_table = tuple(old[p.name] for p in all_params)
        # where each chunk updates is the placement's to decide for this graph (an evaluation graph updates none):
        # a chunk the first step streamed, or updated before its commit, is not here until place_optimizer says so
        chunks = [dataclasses.replace(c, grad_inplace=False, streamed=False, undo=False) for c in chunk_table]

    # 2. Gradients: write_grad right after the node that makes each one; the graph returns the loss and the aux.
    out = output_node(graph)
    if g.settings.optimizer is None:          # forward only: no gradients; the outputs stay as they are
        returned, grads = out.args[0], ()
    else:
        parts = split_outputs(out.args[0], 1, g.aux)
        returned, grads = [parts.loss] + parts.aux, parts.grads
    # with accumulation each parameter's gradient comes once per micro-batch: the first write copies, later ones add,
    # and the last one completes it
    remaining = {n: grad_outputs.count(n) for n in set(grad_outputs)}
    seen: set[str] = set()
    for name, gnode in zip(grad_outputs, grads):
        remaining[name] -= 1
        kwargs = {"param": name, "accumulate": name in seen, "final": remaining[name] == 0}
        seen.add(name)
        with graph.inserting_after(gnode):
            w = graph.call_function(ops.write_grad, (gnode,), kwargs)
        ann[w.name] = NodeAnn(role=Role.WRITE_GRAD, phase=Phase.BACKWARD, param=name)
    out.args = (returned,)
    root = _alias_roots(graph, param_of)
    # a first write of a gradient that an operation with an out= form makes whole computes it in the chunk
    fold_grad_producers(graph, ann, g.settings.precision.dtype, root, g.settings.device)

    # 3. Parameter reads: a fresh param_view (plus the view chain) right before every use.
    for user in list(graph.nodes):
        if user in root or user.op == "placeholder":
            continue
        if not any(a in root for a in user.all_input_nodes):
            continue
        assert user.op != "output", "a parameter (or a view of one) is returned by the graph"
        phase = ann[user.name].phase
        clones: dict[fx.Node, fx.Node] = {}

        def clone(n: fx.Node) -> fx.Node:
            if n in clones:
                return clones[n]
            if n.op == "placeholder":
                c = graph.call_function(ops.param_view, (), {"param": param_of[n]})
                c.meta["val"] = n.meta["val"]
                ann[c.name] = NodeAnn(role=Role.PARAM_VIEW, phase=phase, param=param_of[n])
            else:
                c = node_copy(graph, n, lambda a: clone(a) if a in root else a)
                ann[c.name] = dataclasses.replace(ann[n.name], phase=phase)
            clones[n] = c
            return c

        with graph.inserting_before(user):
            user.args = fx.node.map_arg(user.args, lambda a: clone(a) if a in root else a)
            user.kwargs = fx.node.map_arg(user.kwargs, lambda a: clone(a) if a in root else a)
    for n in reversed(list(graph.nodes)):
        if n in root:
            assert not n.users, n
            graph.erase_node(n)
            ann.pop(n.name, None)

    # 4. In place gradients (mixed precision): no parameter of the chunk is read after its gradient is written.
    if g.settings.precision.mixed:
        position = {n: i for i, n in enumerate(graph.nodes)}
        last_read: dict[str, int] = {}
        written: dict[str, int] = {}
        for n in graph.nodes:
            a = ann[n.name]
            if a.role is Role.PARAM_VIEW:
                last_read[a.param] = position[n]
            elif a.role is Role.WRITE_GRAD:
                written.setdefault(a.param, position[n])   # the first write (accumulation writes again)
        chunks = [dataclasses.replace(c, grad_inplace=all(
            last_read.get(p, -1) < written.get(p, math.inf) for p in c.params))
            if c.group is ChunkGroup.TRAINABLE else c for c in chunks]

    graph.lint()
    kept = {n.name for n in graph.nodes}
    return g.evolve(gm=to_module(graph, g.gm), stage="chunked", made_by="assign_chunks",
                    ann={k: v for k, v in ann.items() if k in kept}, params=param_table, chunks=tuple(chunks),
                    chunk_size=size, grad_outputs=grad_outputs)
