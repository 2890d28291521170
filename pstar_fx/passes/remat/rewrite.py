"""Rewriting a graph: chosen segments recomputed in backward (`apply`), or the user's activation checkpoints undone
(`keep_forward_values`); both keep fake values true to the storages each node now reads, as liveness needs."""
from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._pytree import tree_map

from ...ir import ops
from ...ir.fx_utils import mutated_args, storage_key, tensors_of
from ...ir.graph import REMAT, USER_CHECKPOINT, RematTag, Role, TrainGraph, copy_graph, to_module
from ..liveness import liveness


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
                    redirected.setdefault(env[u], {}).update(storage_pairs(n, copy[n]))
    refresh_views(graph, redirected)
    out = g.evolve(gm=to_module(graph, g.gm), ann=ann)
    out = grads_not_in_place_after_reads(out)
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
            moved.update(storage_pairs(a, b))
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


def storage_pairs(a: fx.Node, b: fx.Node) -> dict[int, torch.UntypedStorage]:
    """Storage of each tensor of a's value -> the storage of the corresponding tensor of b's (same structure)."""
    return {storage_key(x): y.untyped_storage() for x, y in zip(tensors_of(a), tensors_of(b))}


def _on_storage(storage: torch.UntypedStorage, like: FakeTensor) -> FakeTensor:
    """A fake tensor with like's metadata (shape, strides, offset, dtype, device) on the given meta storage."""
    meta = torch.empty(0, dtype=like.dtype, device="meta")
    meta.set_(storage, like.storage_offset(), like.shape, like.stride())
    return FakeTensor(like.fake_mode, meta, like.device)


def refresh_views(graph: fx.Graph, redirected: dict[fx.Node, dict[int, torch.UntypedStorage]]) -> None:
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


def grads_not_in_place_after_reads(g: TrainGraph) -> TrainGraph:
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


def keep_forward_values(g: TrainGraph) -> TrainGraph:
    """g with the user's activation checkpoints undone: each recompute node's users read its forward twin (the same op
    on the same values, tagged by frontend/user_checkpoint) wherever the twin's storage is not written between the
    two, and the recompute nodes left without users are dropped; liveness annotated. g itself when nothing changes."""
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
                redirected.setdefault(u, {}).update(storage_pairs(n, twin))
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
    refresh_views(graph, {u: gone for u, gone in redirected.items() if u in alive})
    out = g.evolve(gm=to_module(graph, g.gm), ann=ann)
    return liveness(grads_not_in_place_after_reads(out))
