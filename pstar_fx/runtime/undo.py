"""Undo buffers: what lets an atomic step update some chunks on the CPU before its commit.

A chunk marked `ChunkInfo.undo` (chosen by place_optimizer where the host budget has room and the cost model finds
the step faster so) has its host-side update queued right after backward is done with it, not at the commit. Just
before that update the CPU worker copies the chunk's state buffer (m, v, the step counter and in mixed precision the
fp32 master), and in full precision its parameters, into buffers of its own here. If the step then fails before its
commit (an error, an injected fault, Ctrl-C, or one of these updates failing: the commit waits for them all and
fails the step if one did), the executor waits for those updates, and the fetches hanging on them, to end, and
copies the values back (of the chunks whose copy was made): the step changed nothing, as with every update after the
commit. In mixed precision the half-precision parameters are the masters rounded, and are made again from them as
after any failed step. After the commit the copies are simply overwritten by the next step's.
"""
from __future__ import annotations

import torch

from ..ir.graph import ChunkInfo, Precision
from ..optim import StateLayout
from .host_buffers import undo_specs
from .host_memory import HostMemory


class UndoBuffers:
    """The undo buffers of the chunks a plan marks, in host memory (HostMemory: reserved with the store's other
    buffers where the compiler reserved them)."""

    def __init__(self, hostmem: HostMemory, precision: Precision, world: int, state: StateLayout):
        self.hostmem = hostmem
        self.precision = precision
        self.world = world
        self.state = state
        self.of: dict[int, list[torch.Tensor]] = {}      # chunk -> [states, parameters (full precision only)]
        # buffers of chunks a later plan no longer marks, by their sizes: the next chunk of those sizes a plan marks
        # takes them (plans of several batch signatures alternate; their undo sets differ)
        self.spare: dict[tuple, list[list[torch.Tensor]]] = {}
        self.kept: set[int] = set()     # chunks whose buffers hold this step's copy (`keep`), until its commit

    def mark(self, chunks: tuple[ChunkInfo, ...]) -> None:
        """Buffers for the chunks these mark (the plan a step runs, ChunkStore.set_homes): a chunk that has them
        keeps them, one that has none takes a spare set of its sizes, or a new one; those of chunks no longer marked
        become spare. None is freed: the store's undo memory is the most any of its plans marked, made once, never
        allocated and zeroed again as signatures alternate."""
        marked = {c.id for c in chunks if c.undo}
        for cid in [c for c in self.of if c not in marked]:
            bufs = self.of.pop(cid)
            self.spare.setdefault(_sizes(bufs), []).append(bufs)
        for c in chunks:
            if c.undo and c.id not in self.of:
                specs = undo_specs(c, self.precision, self.world, self.state)
                spare = self.spare.get(tuple((s.numel, s.dtype) for s in specs))
                self.of[c.id] = spare.pop() if spare else [
                    self.hostmem.zeros(s.numel, s.dtype, copied=False, key=s.key) for s in specs]

    def keep(self, cid: int, states: torch.Tensor, params: torch.Tensor) -> None:
        """Before chunk cid's update ahead of the commit: its states (and full-precision parameters) copied here."""
        bufs = self.of[cid]
        bufs[0].copy_(states)
        if len(bufs) > 1:
            bufs[1].copy_(params)
        self.kept.add(cid)

    def committed(self, chunks) -> None:
        """The step these chunks were updated in committed: their copies are nothing to put back any more."""
        self.kept.difference_update(chunks)

    def put_back(self, chunks, states: list, params: list) -> None:
        """After a step failed before its commit, once these chunks' updates are over (HostUpdates.settle): their
        values as `keep` found them (those whose copy `keep` made: an update that failed before it changed
        nothing). states, params: the store's state buffers and parameter homes, by chunk."""
        for cid in chunks:
            if cid not in self.kept:
                continue
            self.kept.discard(cid)
            bufs = self.of[cid]
            states[cid].copy_(bufs[0])
            if len(bufs) > 1:
                params[cid].copy_(bufs[1])


def _sizes(bufs: list[torch.Tensor]) -> tuple:
    return tuple((t.numel(), t.dtype) for t in bufs)
