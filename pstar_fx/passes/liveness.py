"""liveness: live activation bytes at every node, at the level of storages (views and in-place results share one).

Invariant after: every node's `live_bytes` is the total size of the activation storages alive while it runs: a
storage is alive from the node that creates it to the last user of any value sharing it (a value with no user dies
at the node that made it). Batch inputs are activations; module buffers, tensor constants and chunk memory
(parameter views) are not: the schedule accounts for them. The executor frees values by the same rule, so its
measured bytes equal these.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch.fx as fx

from ..ir.fx_utils import last_uses, storage_bytes, storage_key, tensors_of
from ..ir.graph import Role, TrainGraph

_NOT_ACTIVATION = (Role.PARAM, Role.PARAM_VIEW, Role.BUFFER, Role.CONSTANT)


@dataclass(frozen=True)
class Liveness:
    live: tuple[int, ...]            # per node position: activation bytes alive while it runs
    created: tuple[int, ...]         # per node position: bytes of activation storage it creates
    last_use: tuple[int, ...]        # per node position: position after which its value is freed


def storages(nodes: list[fx.Node], ann, last: list[int] | None = None) -> list[tuple[int, int, int]]:
    """Every activation storage by the module docstring's rule: (the node position that makes it, the last one it
    is alive at, its bytes). last: last_uses(nodes), where the caller has it."""
    last = last_uses(nodes) if last is None else last
    excluded: set[int] = set()
    start: dict[int, int] = {}
    end: dict[int, int] = {}
    size: dict[int, int] = {}
    for i, n in enumerate(nodes):
        role = ann[n.name].role
        for t in tensors_of(n):
            k = storage_key(t)
            if role in _NOT_ACTIVATION:
                excluded.add(k)
            if k in excluded:
                continue
            if k not in start:
                start[k], size[k] = i, storage_bytes(t)
            end[k] = max(end.get(k, i), last[i])
    return [(start[k], end[k], size[k]) for k in start if k not in excluded]


def analyze(nodes: list[fx.Node], ann) -> Liveness:
    """Live activation bytes per node position (see the module docstring for the rule)."""
    last = last_uses(nodes)
    delta = [0] * (len(nodes) + 1)
    created = [0] * len(nodes)
    for s, e, nbytes in storages(nodes, ann, last):
        delta[s] += nbytes
        delta[e + 1] -= nbytes
        created[s] += nbytes
    live, acc = [], 0
    for i in range(len(nodes)):
        acc += delta[i]
        live.append(acc)
    return Liveness(tuple(live), tuple(created), tuple(last))


def liveness(g: TrainGraph) -> TrainGraph:
    nodes = g.nodes
    lv = analyze(nodes, g.ann)
    ann = {n.name: dataclasses.replace(g.ann[n.name], live_bytes=lv.live[i], bytes=lv.created[i])
           for i, n in enumerate(nodes)}
    return g.evolve(stage="liveness", made_by="liveness", ann=ann)


