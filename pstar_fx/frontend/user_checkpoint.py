"""Activation checkpointing in the user's step: traced as eager autograd runs it, with its recompute marked.

Why a plain trace fails. `torch.func.functional_call` substitutes the model's tensors only while the forward runs,
and backward would be recorded with `torch.autograd.grad`. Checkpointing re-runs the region's function during
backward: by then functional_call has put the module's real Parameters back, so the recompute would read real tensors
inside the fake-tensor trace ("convert all Tensors to FakeTensors first", blamed on the first line of the region).
`use_reentrant=True` fails one step earlier: its backward refuses `torch.autograd.grad` ("incompatible with .grad()")
and needs `.backward()` without `inputs`.

What is traced. The substitution stays in place through backward (`substituted`), and when the autograd graph
holds a reentrant checkpoint the gradients come from `.backward()` and the leaves' `.grad` (`gradients`), as eager
does it. The traced graph then contains exactly what eager autograd executes, in both modes and for transformers'
`gradient_checkpointing_enable()`:
- the region's forward, whose intermediates have no backward user, so liveness frees them when forward ends;
- the region's recompute, recorded inside backward where autograd ran it (non-reentrant checkpointing stops the
  recompute early once it has what backward needs; dead recompute nodes are dropped by canonicalize).
Liveness and the plan are computed from this graph, so the memory a checkpoint saves is planned exactly and the
executor's per-node measurement matches it. A checkpoint is therefore kept, not ignored: the user asked for the memory.

What is recorded for the planner. `mark_recompute` tags every recomputed node with a `UserCheckpointTag` (pstar_fx.ir)
in `node.meta[USER_CHECKPOINT]`: its region (the connected group of recompute nodes it belongs to) and the name of its
forward twin, the node that computed the same value in forward; the twin is tagged with the same region and no
`recompute_of`.
A remat pass may undo a recompute (give the recompute node's users its twin, keeping the forward value alive) where
memory allows, or recompute more; `checkpoint_regions(g)` lists the regions as a table.

Randomness. In eager, checkpoint restores the RNG state before the recompute, so dropout draws the forward's mask
again. In the graph the random ops run from the live generator, so a recomputed dropout would draw a different mask
and the gradients would not belong to the forward. `mark_recompute` therefore gives each recomputed random op's users
its forward twin (matched by op, inputs and order): the forward value stays alive until backward, the masks agree, and
the graph consumes random numbers as an uncheckpointed one does.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.nn as nn
from torch.nn.utils import stateless

from ..errors import UntraceableError
from ..ir.fx_utils import draws_random, loss_seed, mutated_args, output_node, private_chains, storages_of, tensors_of
from ..ir.graph import USER_CHECKPOINT, UserCheckpointTag

# detach / alias produce the same values as their input (reentrant checkpointing detaches the region's inputs)
_SAME_VALUE = (torch.ops.aten.detach.default, torch.ops.aten.alias.default)


@dataclass(frozen=True)
class Region:
    id: int
    forward: tuple[str, ...]         # the forward nodes whose values the region's recompute computes again
    recompute: tuple[str, ...]       # the recompute nodes in backward, in graph order


@contextlib.contextmanager
def substituted(module: nn.Module, tensors: dict[str, torch.Tensor]):
    """Keep `tensors` in place of the module's parameters and buffers (as functional_call does for the forward)
    until the block ends, so that a checkpoint's recompute during backward reads the traced tensors. `tensors` names
    every (module, attribute) slot itself (a module reachable under two names has two keys), so no tying is done."""
    with stateless._reparametrize_module(module, tensors, tie_weights=False, strict=False):
        yield


def _has_reentrant_checkpoint(fn) -> bool:
    seen, todo = set(), [fn]
    while todo:
        f = todo.pop()
        if f is None or f in seen:
            continue
        seen.add(f)
        if type(f).__name__ == "CheckpointFunctionBackward":   # torch.utils.checkpoint.CheckpointFunction
            return True
        todo.extend(n for n, _ in f.next_functions)
    return False


def gradients(loss: torch.Tensor, leaves: list[torch.Tensor]) -> list[torch.Tensor | None]:
    """d loss / d leaves (None where the loss does not reach a leaf). A reentrant checkpoint refuses
    torch.autograd.grad, so then the gradients are accumulated into the leaves by `.backward()`, as eager training
    does, each leaf's `.grad` cleared first: with gradient accumulation the same leaves serve every micro-batch, and
    autograd would add this micro-batch's gradients into the previous one's tensors in place (which the caller holds
    as that micro-batch's gradients)."""
    if not _has_reentrant_checkpoint(loss.grad_fn):
        return list(torch.autograd.grad(loss, leaves, allow_unused=True))
    for leaf in leaves:
        leaf.grad = None
    torch.autograd.backward(loss)
    return [leaf.grad for leaf in leaves]


def mark_recompute(gm: fx.GraphModule, seeds: list[fx.Node] | None = None) -> None:
    """Tag recomputed nodes with their forward twins and make recomputed random ops reuse the forward's values
    (see the module docstring). Edits `gm`'s graph in place (its code is not generated again: the caller makes a
    module of the graph): it runs on the fresh trace, before any TrainGraph exists.

    A node is a recompute when it comes after the loss seed, does not depend on it, and applies the same op to the
    same values (twins of its inputs, the same constants) as a node before the seed; random ops are paired in order.
    Nodes that read a storage some node writes are matched only when that storage is a private chain of writes
    (`private_chains`), where each node's value is well defined. A region is kept only if it computes something
    (a group of views alone, such as the `t(weight)` every backward takes again, is not a checkpoint).

    `seeds`: with gradient accumulation the graph holds one forward + backward per micro-batch, each started by its
    own seed; each micro-batch is matched on its own (from the end of the previous one's backward to the end of its
    own), so a micro-batch's forward is never taken for a recompute of the previous one's. None: the one seed of the
    loss (output 0)."""
    graph = gm.graph
    nodes = list(graph.nodes)
    if seeds is None:
        seed = loss_seed(graph, output_node(graph).args[0][0])
        seeds = [] if seed is None else [seed]
    if not seeds:
        return
    pos = {n: i for i, n in enumerate(nodes)}
    twin: dict[fx.Node, fx.Node] = {}          # recompute node -> forward twin
    start = 0
    for k, seed in enumerate(seeds):
        backward = {seed}
        for n in nodes[pos[seed] + 1:]:
            if any(a in backward for a in n.all_input_nodes):
                backward.add(n)
        # this micro-batch's window ends where the next micro-batch's seed's ancestry begins: at its own last
        # backward node before the next seed
        end = len(nodes) if k + 1 == len(seeds) else max(
            (pos[n] for n in backward if pos[n] < pos[seeds[k + 1]]), default=pos[seed]) + 1
        _match_window(nodes[start:end], seed, backward, twin)
        start = end
    _tag_regions(nodes, twin)
    _reuse_forward_randomness(graph, nodes, twin)


def _match_window(nodes: list[fx.Node], seed: fx.Node, backward: set[fx.Node],
                  twin: dict[fx.Node, fx.Node]) -> None:
    """mark_recompute's matching over one micro-batch's nodes (forward, seed, backward); fills `twin`."""
    pos = {n: i for i, n in enumerate(nodes)}
    private = private_chains(nodes)
    written = {k for n in nodes for m in mutated_args(n) for k in storages_of(m)}

    rep: dict[fx.Node, fx.Node] = {}           # node -> the first node known to hold the same value

    def canon(a):
        if isinstance(a, fx.Node):
            return ("node", rep.get(a, a).name)
        if isinstance(a, (list, tuple)):
            return tuple(canon(x) for x in a)
        if isinstance(a, dict):
            return tuple(sorted((k, canon(v)) for k, v in a.items()))
        return (type(a).__name__, a)

    def key(n: fx.Node):
        try:
            k = (n.target, canon(n.args), canon(n.kwargs))
            hash(k)
            return k
        except TypeError:
            return None

    def matchable(n: fx.Node) -> bool:
        return n.op == "call_function" and not any(
            k in written and k not in private for a in [n, *n.all_input_nodes] for k in storages_of(a))

    first: dict = {}                           # key -> first forward node (deterministic ops)
    random_fwd: dict = {}                      # key -> forward random nodes, in order
    random_used: dict = {}                     # key -> how many of them recompute nodes have taken
    for n in nodes:
        if n.op == "call_function" and n.target in _SAME_VALUE and n.args and isinstance(n.args[0], fx.Node):
            rep[n] = rep.get(n.args[0], n.args[0])
        if not matchable(n) or n in backward:
            continue
        k = key(n)
        if k is None:
            continue
        if pos[n] < pos[seed]:
            if draws_random(n):
                random_fwd.setdefault(k, []).append(n)
            elif k in first:
                rep[n] = first[k]          # forward computes the same value twice (a causal mask per layer)
            else:
                first[k] = n
            continue
        if draws_random(n):
            used = random_used.get(k, 0)
            fwd = random_fwd.get(k, [])
            if used >= len(fwd):
                continue
            random_used[k] = used + 1
            twin[n] = fwd[used]
        elif k in first:
            twin[n] = first[k]
        else:
            continue
        rep[n] = twin[n]

    for n in nodes[pos[seed] + 1:]:
        if draws_random(n) and n not in backward and n not in twin:
            raise UntraceableError(
                f"cannot trace the training step: random operation {n.target} runs again in backward (activation "
                "checkpointing recomputes it) but pstar-fx cannot tell which forward call it repeats, so it cannot "
                "give it the forward's random values; keep random ops (dropout) out of checkpointed regions or set "
                "their probability to 0")


def _reuse_forward_randomness(graph: fx.Graph, nodes: list[fx.Node], twin: dict[fx.Node, fx.Node]) -> None:
    """Each recomputed random op, with the in-place writes that follow it on the same storage (dropout's div_ on the
    CPU), hands its users its forward twin and is erased; the rest of the recompute stays, now computing from the
    forward's random values."""
    tainted: list[fx.Node] = []
    seen: set[fx.Node] = set()
    for n in nodes:
        if n in twin and (draws_random(n) or any(m in seen for m in mutated_args(n))):
            tainted.append(n)
            seen.add(n)
    for n in tainted:
        for u in n.users:
            if u not in seen and n in mutated_args(u):
                raise UntraceableError(
                    f"cannot trace the training step: {u.target} writes in place into a value that activation "
                    "checkpointing recomputes from random numbers (dropout); pstar-fx cannot keep it equal to the "
                    "forward's; make the op out of place")
    # users that returned a view of a tainted value now view its twin: their fake values must say so (liveness
    # identifies storages by the fake values), so they are evaluated again, in graph order
    aliasing = {u for n in tainted for u in n.users if u not in seen and storages_of(u) & storages_of(n)}
    for n in tainted:
        n.replace_all_uses_with(twin[n], delete_user_cb=lambda u: u not in seen)
    for n in reversed(tainted):
        assert not n.users, n
        graph.erase_node(n)
    for u in graph.nodes:
        if u in aliasing:
            old = storages_of(u)
            vals = fx.node.map_arg((u.args, u.kwargs), lambda a: a.meta["val"])
            mode = next(t.fake_mode for t in tensors_of(u))
            with mode:
                u.meta["val"] = u.target(*vals[0], **vals[1])
            aliasing |= {w for w in u.users if storages_of(w) & old}


def _tag_regions(nodes: list[fx.Node], twin: dict[fx.Node, fx.Node]) -> None:
    """Regions: connected groups of recompute nodes (joined by data edges), numbered in graph order."""
    parent: dict[fx.Node, fx.Node] = {n: n for n in twin}

    def find(n):
        while parent[n] is not n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    for n in twin:
        for a in n.all_input_nodes:
            if a in twin:
                parent[find(a)] = find(n)
    computes = {find(n) for n in twin if storages_of(n) - {k for a in n.all_input_nodes for k in storages_of(a)}}
    region: dict[fx.Node, int] = {}
    for n in nodes:
        if n in twin and find(n) in computes:
            r = region.setdefault(find(n), len(region))
            n.meta[USER_CHECKPOINT] = UserCheckpointTag(r, twin[n].name)
            twin[n].meta.setdefault(USER_CHECKPOINT, UserCheckpointTag(r))


def checkpoint_regions(g) -> tuple[Region, ...]:
    """The checkpointed regions of a TrainGraph (any stage), from the nodes' UserCheckpointTags."""
    fwd: dict[int, list[str]] = {}
    rec: dict[int, list[str]] = {}
    for n in g.gm.graph.nodes:
        tag = n.meta.get(USER_CHECKPOINT)
        if tag is not None:
            (fwd if tag.recompute_of is None else rec).setdefault(tag.region, []).append(n.name)
    return tuple(Region(r, tuple(fwd.get(r, ())), tuple(rec[r])) for r in sorted(rec))
