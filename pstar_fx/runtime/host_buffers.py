"""The host buffers a ChunkStore makes for a plan, known once the optimizer is placed: what the compiler reserves
(HostMemory.reserve) while the schedule is still being made, for the store to take by key."""
from __future__ import annotations

import torch

from ..ir.graph import BufKind, ChunkGroup, ChunkInfo, Precision, StateHome
from ..ir.needs import shard_numel, state_floats
from ..optim import StateLayout
from .host_memory import BufferSpec


def host_buffer_specs(chunks: tuple[ChunkInfo, ...], precision: Precision, world: int, state: StateLayout
                      ) -> list[BufferSpec]:
    """The host buffers a ChunkStore over these (optimizer-placed) chunks will make whatever the schedule decides:
    every chunk's parameter home except those of chunks whose states live on the device (whose home the schedule
    chooses), the optimizer states placed on the host, the gradient homes of chunks the CPU updates (a streamed
    chunk's gradient stays on the device for its update), and the undo buffers of chunks updated before the commit.
    The compiler reserves them as soon as the optimizer is placed (HostMemory.reserve), for the store to take."""
    specs = []
    for c in chunks:
        host_stepped = c.group is ChunkGroup.TRAINABLE and c.state_home is not StateHome.DEVICE
        if c.group is not ChunkGroup.TRAINABLE or host_stepped:
            specs.append(BufferSpec(("param", c.id), shard_numel(c, world), c.dtype, True))
        if host_stepped and c.state_home is StateHome.DISK:      # its states are in a file (runtime/disk.py)
            if c.grad_buf() is BufKind.GRAD:
                specs.append(BufferSpec(("grad", c.id), shard_numel(c, world), c.dtype, True))
        elif host_stepped:
            # pinned only for a streamed update, whose states the device copies (pageable copies are much slower)
            specs.append(BufferSpec(("states", c.id), state_floats(c, precision, world, state), torch.float32,
                                    c.streamed))
            if c.grad_buf() is BufKind.GRAD and not c.streamed:
                specs.append(BufferSpec(("grad", c.id), shard_numel(c, world), c.dtype, True))
        if c.undo:
            specs.extend(undo_specs(c, precision, world, state))
    return specs


def undo_specs(c: ChunkInfo, precision: Precision, world: int, state: StateLayout) -> list[BufferSpec]:
    """A chunk's undo buffers (runtime/undo.py; never copied to the device, so not pinned): its states', and in full
    precision its parameters' (ir.needs.undo_bytes counts them)."""
    specs = [BufferSpec(("undo", c.id), state_floats(c, precision, world, state), torch.float32, False)]
    if not precision.mixed:
        specs.append(BufferSpec(("undo param", c.id), shard_numel(c, world), c.dtype, False))
    return specs
