"""What each node needs on the device: the chunk buffers it reads and writes and its workspace, as a table keyed by
role. The place_optimizer and schedule passes plan with it and the verifier checks with it, so all three agree."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, NamedTuple

import torch
import torch.fx as fx

from .fx_utils import storage_key, tensors_of
from ..optim import NO_STATE, StateLayout
from ..optim.state_dtype import scratch_bytes
from .graph import BufKind, ChunkInfo, NodeAnn, ParamHome, Precision, Role, StateHome, TrainGraph, UpdateSite


class BufKey(NamedTuple):
    chunk: int
    buf: BufKind

    def order(self) -> tuple[int, str]:
        """A total order for deterministic iteration (enums do not compare)."""
        return (self.chunk, self.buf.value)


@dataclass(frozen=True)
class Needs:
    reads: frozenset[BufKey] = frozenset()
    writes: frozenset[BufKey] = frozenset()
    workspace: int = 0
    resident: frozenset[BufKey] = field(init=False, repr=False, compare=False)   # reads | writes

    def __post_init__(self):
        object.__setattr__(self, "resident", self.reads | self.writes)   # read for every node by every planner


NO_NEEDS = Needs()


def shard_numel(chunk: ChunkInfo, world: int) -> int:
    """Elements of a chunk each of `world` ranks owns (assign_chunks makes capacities multiples of world)."""
    assert chunk.capacity % world == 0, (chunk.id, chunk.capacity, world)
    return chunk.capacity // world


def state_layout(settings) -> StateLayout:
    """The optimizer's chunk state layout (Adam's: m, v, step); forward only, the trainer's whose chunks it runs
    over (Settings.states), or NO_STATE."""
    if settings.optimizer is not None:
        return settings.optimizer.state
    return settings.states if settings.states is not None else NO_STATE


def state_floats(chunk: ChunkInfo, precision: Precision, world: int, state: StateLayout) -> int:
    """Optimizer-state fp32 elements of a chunk's shard (the whole chunk on one rank), in one buffer: the
    optimizer's per-element states (Adam's m and v, SGD's momentum buffer, none for SGD without momentum), the
    master copy in mixed precision, and its 0-d states and step counter (StateLayout)."""
    return state.floats(shard_numel(chunk, world), precision.mixed)


def state_bytes(chunk: ChunkInfo, precision: Precision, world: int, state: StateLayout) -> int:
    """Bytes of a chunk's (shard's) state buffer: smaller with compressed moments (state_dtype bf16 / int8)."""
    return state_floats(chunk, precision, world, state) * 4


def undo_bytes(chunk: ChunkInfo, precision: Precision, world: int, state: StateLayout) -> int:
    """Bytes of a chunk's undo buffers (ChunkInfo.undo): a copy of its state buffer, and in full precision of its
    parameters too (in mixed precision they are the master rounded, made again from it)."""
    params = 0 if precision.mixed else shard_numel(chunk, world) * chunk.dtype.itemsize
    return state_bytes(chunk, precision, world, state) + params


def early_host_bytes(params, precision: Precision, world: int, budget: int | None, state: StateLayout) -> int:
    """Before tracing, from the parameters alone: the most host memory a first compile's buffers could take, or 0
    when the device budget could hold every optimizer state (the plan may then keep all of them there). When it
    cannot, the states that do not fit live on the host, with their chunks' parameter and gradient homes, and how
    many more join them only the plan knows: this is every trainable parameter's states and both homes, per rank
    (the chunks' padding aside).
    The compiler faults that much in while it traces (capped by the host's free memory) and gives back what the
    plan does not use (HostMemory.prefault)."""
    trainable = sum(-(-p.numel // world) for p in params if p.trainable)
    states = int(trainable * state.bytes_per_element(precision.mixed))
    if budget is None or states <= budget:
        return 0
    return states + 2 * trainable * precision.dtype.itemsize


def step_workspace(chunk: ChunkInfo, precision: Precision, world: int = 1, state: StateLayout = NO_STATE) -> int:
    """A device-side step in mixed precision converts the gradient (of its shard) to fp32 first; with compressed
    moments it also dequantises them into a scratch, block by block (optim.state_dtype.scratch_bytes)."""
    n = shard_numel(chunk, world)
    return (n * 4 if precision.mixed else 0) + scratch_bytes(n, state.dtype)


def _param_view(g: TrainGraph, a: NodeAnn) -> Needs:
    return Needs(reads=frozenset({BufKey(g.param(a.param).chunk, BufKind.PARAM)}))


def _write_grad(g: TrainGraph, a: NodeAnn) -> Needs:
    c = g.chunk_of(a.param)
    return Needs(writes=frozenset({BufKey(c.id, c.grad_buf())}))


def _optimizer_step(g: TrainGraph, a: NodeAnn) -> Needs:
    c = g.chunks[a.chunk]
    if c.update_site is UpdateSite.CPU:
        return NO_NEEDS   # runs on the host; the schedule releases the chunk's buffers first
    keys = frozenset(BufKey(c.id, b) for b in c.buffers())
    writes = {BufKey(c.id, BufKind.PARAM)}
    if c.streamed:        # its states, fetched into a slot of their own, are read and written there
        keys |= {BufKey(c.id, BufKind.STATES)}
        writes.add(BufKey(c.id, BufKind.STATES))
    return Needs(reads=keys, writes=frozenset(writes),
                 workspace=step_workspace(c, g.settings.precision, g.settings.world, state_layout(g.settings)))


def _reduce_scatter(g: TrainGraph, a: NodeAnn) -> Needs:
    key = BufKey(a.chunk, g.chunks[a.chunk].grad_buf())
    return Needs(reads=frozenset({key}), writes=frozenset({key}))


def _region(g: TrainGraph, a: NodeAnn) -> Needs:
    """A fused region holds the storages made and freed inside it as workspace (passes/regions.py sets it); the
    chunk buffers its parameter-view inputs read are added by all_needs, as for any compute node."""
    return Needs(workspace=a.workspace_bytes)


NEEDS_BY_ROLE: dict[Role, Callable[[TrainGraph, NodeAnn], Needs]] = {
    Role.REGION: _region,
    Role.PARAM_VIEW: _param_view,
    Role.WRITE_GRAD: _write_grad,
    Role.OPTIMIZER_STEP: _optimizer_step,
    Role.REDUCE_SCATTER: _reduce_scatter,
}


def needs(g: TrainGraph, a: NodeAnn) -> Needs:
    """A node's own needs, from its role alone."""
    rule = NEEDS_BY_ROLE.get(a.role)
    return rule(g, a) if rule else NO_NEEDS


def all_needs(g: TrainGraph) -> list[Needs]:
    """Every node's needs, in graph order: its role's own, plus the chunk buffer behind every input that is a
    parameter view (or a view of one), since a view is only valid while its chunk stays where it was."""
    alias: dict[fx.Node, BufKey] = {}
    out = []
    for n in g.gm.graph.nodes:
        a = g.ann[n.name]
        x = needs(g, a)
        held = {alias[i] for i in n.all_input_nodes if i in alias}
        if a.role is Role.PARAM_VIEW:
            alias[n] = BufKey(g.param(a.param).chunk, BufKind.PARAM)
        elif held and n.op == "call_function":
            keys = {storage_key(t) for t in tensors_of(n)}
            for i in n.all_input_nodes:
                if i in alias and keys & {storage_key(t) for t in tensors_of(i)}:
                    alias[n] = alias[i]
                    break
        if held:
            x = Needs(reads=x.reads | held, writes=x.writes, workspace=x.workspace)
        out.append(x)
    return out


def from_master(g: TrainGraph, a: NodeAnn) -> bool:
    """A fetch (or all-gather) that casts the chunk's fp32 master on the device instead of copying a host home."""
    return a.buf is BufKind.PARAM and g.chunks[a.chunk].param_home is ParamHome.MASTER


def buf_bytes(g: TrainGraph, key: BufKey) -> int:
    """Device bytes of a chunk buffer's slot (the states of a whole chunk, or of this rank's shard, for STATES)."""
    if key.buf is BufKind.STATES:
        return state_bytes(g.chunks[key.chunk], g.settings.precision, g.settings.world, state_layout(g.settings))
    return g.chunks[key.chunk].nbytes


# staging buffers for disk-homed states: a chunk's states are read into one, updated there and written back from it;
# two let the read of the next chunk overlap the update and write-back of the one before
STAGING_SLOTS = 2
DISK_ALIGN = 4096        # file sizes and staging buffers are multiples of it (direct I/O's alignment)


def aligned(n: int) -> int:
    return -(-n // DISK_ALIGN) * DISK_ALIGN


def disk_chunks(g: TrainGraph) -> list[ChunkInfo]:
    return [c for c in g.chunks if c.state_home is StateHome.DISK]


def staging(g: TrainGraph) -> tuple[int, int]:
    """The staging buffers a plan's disk-homed chunks need: (how many, bytes each: the largest disk chunk's states,
    aligned), (0, 0) without any."""
    disk = disk_chunks(g)
    if not disk:
        return 0, 0
    layout = state_layout(g.settings)
    size = max(state_bytes(c, g.settings.precision, g.settings.world, layout) for c in disk)
    return min(STAGING_SLOTS, len(disk)), aligned(size)


def disk_bytes(g: TrainGraph) -> int:
    """Bytes of the files holding the disk-homed chunks' states (each aligned)."""
    layout = state_layout(g.settings)
    return sum(aligned(state_bytes(c, g.settings.precision, g.settings.world, layout)) for c in disk_chunks(g))


def host_bytes(g: TrainGraph) -> int:
    """One rank's host memory for g's chunks, as the ChunkStore holds it during a step: what it holds from set-up on
    (`host_setup_bytes`) and the gradient homes: of the chunks the CPU updates and of the gradient buffers the
    schedule writes back: a shard, or with several ranks the whole chunk where it is written back before its last
    gradient write and so before its reduce-scatter (accumulation; the shard pass puts the reduce-scatter right after
    that write, so the count is the same before and after it). A store may hold both."""
    w = g.settings.world
    last_write: dict[int, int] = {}
    if w > 1:
        for i, n in enumerate(g.nodes):
            if g.ann[n.name].role is Role.WRITE_GRAD:
                last_write[g.param(g.ann[n.name].param).chunk] = i
    grads = {(c.id, False) for c in g.chunks if c.update_site is UpdateSite.CPU and c.grad_buf() is BufKind.GRAD}
    for i, n in enumerate(g.nodes):
        a = g.ann[n.name]
        if a.role is Role.RELEASE and a.buf is BufKind.GRAD and n.kwargs.get("writeback"):
            grads.add((a.chunk, i < last_write.get(a.chunk, -1)))     # (chunk, whole)
    grad = sum(g.chunks[c].nbytes if whole else shard_numel(g.chunks[c], w) * g.chunks[c].dtype.itemsize
               for c, whole in grads)
    return host_setup_bytes(g) + grad


def host_setup_bytes(g: TrainGraph) -> int:
    """One rank's host memory for g's chunks from set-up on: parameter homes (its shard of each chunk whose home is
    the host), the optimizer states placed on the host (each starts where the plan puts it), the undo buffers of
    chunks updated before the commit, the staging buffers of disk-homed states (made at set-up and kept, so counted
    at every node), and in mixed precision the frozen parameters at full precision. Gradient homes come later, at
    the first write-back (`host_bytes`)."""
    w, prec = g.settings.world, g.settings.precision
    params = sum(shard_numel(c, w) * c.dtype.itemsize for c in g.chunks if c.param_home is ParamHome.HOST)
    layout = state_layout(g.settings)
    on_host = sum(state_bytes(c, prec, w, layout) for c in g.chunks if c.state_home is StateHome.HOST)
    undo = sum(undo_bytes(c, prec, w, layout) for c in g.chunks if c.undo)
    slots, size = staging(g)
    frozen = sum(p.numel * p.dtype.itemsize for p in g.params if not p.trainable) if prec.mixed else 0
    return params + on_host + undo + slots * size + frozen


def constants(g: TrainGraph) -> dict[str, torch.Tensor]:
    """The tensor constants the graph's get_attr nodes read (made while tracing, e.g. torch.tensor(...))."""
    return {n.target: getattr(g.gm, n.target) for n in g.gm.graph.nodes if n.op == "get_attr"}


def static_bytes(g: TrainGraph) -> int:
    """Bytes always on the device during a step: module buffers, tensor constants, the optimizer states there."""
    layout = state_layout(g.settings)
    states = sum(state_bytes(c, g.settings.precision, g.settings.world, layout) for c in g.chunks
                 if c.state_home is StateHome.DEVICE)
    consts = sum(t.numel() * t.element_size() for t in constants(g).values())
    return sum(b.nbytes for b in g.buffers) + states + consts
