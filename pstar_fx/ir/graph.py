"""The IR: an aten-level fx graph wrapped in a `TrainGraph` with typed tables.

Every table is a tuple of frozen dataclasses and every per-node fact is a `NodeAnn` keyed by the node's name (fx keeps
names unique within a graph). Roles, phases and chunk states are enums; nothing is parsed back out of strings.
A `TrainGraph` is immutable: passes build a new one with `TrainGraph.evolve`.

Facts about single nodes that a pass or the tracer records for later stages live in `node.meta` under the tag keys
defined here (`USER_CHECKPOINT`, `REMAT`), each holding a frozen dataclass: the printer, the planner and the passes
read them without importing whoever wrote them.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import enum
from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping

import torch
import torch.fx as fx

from ..optim import OptimizerLayout, StateLayout
from .outputs import AuxOutputs


class _Enum(enum.Enum):
    """An enum hashed by identity, as it is compared: its members are singletons. Enum's own __hash__ is a Python
    call (it hashes the name); buffer keys of these are hashed millions of times in planning a largest model."""
    __hash__ = object.__hash__


class Precision(_Enum):
    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"

    @property
    def dtype(self) -> torch.dtype:
        return {Precision.FP32: torch.float32, Precision.BF16: torch.bfloat16, Precision.FP16: torch.float16}[self]

    @property
    def mixed(self) -> bool:
        """Half-precision compute with fp32 master weights."""
        return self is not Precision.FP32


class Phase(_Enum):
    INPUT = "input"          # placeholders
    FORWARD = "forward"
    BACKWARD = "backward"    # data-dependent on the loss seed (ones_like(loss))
    OPTIMIZER = "optimizer"
    OUTPUT = "output"


class LossRows(_Enum):
    """When a large cross-entropy loss is computed in blocks of rows (passes/loss_rows)."""
    NEVER = "never"
    WHERE_NEEDED = "where needed"    # by the remat pass, only where the step would not fit the budget otherwise
    ALWAYS = "always"                # by the loss_rows stage, every loss of at least two blocks


LOSS_BLOCK_BYTES = 256 * 2 ** 20     # fp32 bytes of a block of rows of a loss's tokens x vocabulary tensors


class Role(_Enum):
    PARAM = "param"                  # placeholder of a parameter (before assign_chunks)
    BUFFER = "buffer"                # placeholder of a module buffer (always resident, mutated in place)
    CONSTANT = "constant"            # get_attr: a tensor constant made while tracing (torch.tensor(...) in forward)
    INPUT = "input"                  # placeholder of a batch tensor
    SCALE = "scale"                  # placeholder of the fp16 loss scale
    COMPUTE = "compute"              # an aten op of the user's program
    REGION = "region"                # compute nodes fused into one compiled call (passes/regions.py, fuse=True)
    GUARD = "guard"                  # checks a value the trace assumed (ir/guards.py); before the commit
    OUTPUT = "output"
    PARAM_VIEW = "param_view"        # a parameter read out of its (resident) chunk
    WRITE_GRAD = "write_grad"        # a final gradient copied into its chunk
    FETCH = "fetch"                  # host -> device copy of a chunk buffer
    RELEASE = "release"              # a chunk buffer leaves the device (written back if dirty)
    OPTIMIZER_STEP = "optimizer_step"
    COMMIT = "commit"                # the commit point: every gradient final; overflow / norm decided; updates follow
    REDUCE_SCATTER = "reduce_scatter"  # multi-GPU: a chunk's final gradient summed over ranks, each keeping its shard
    DISK_READ = "disk_read"          # a disk-homed chunk's optimizer states read into a host staging buffer
    DISK_WRITE = "disk_write"        # ... and written back to their file after its update


class ChunkGroup(_Enum):
    TRAINABLE = "trainable"          # parameters with gradients: grad buffer and optimizer states
    FROZEN = "frozen"                # parameters without gradients: no grad, no optimizer state


class BufKind(_Enum):
    PARAM = "param"                  # the parameter values (compute dtype)
    GRAD = "grad"                    # the gradient (compute dtype); absent when the chunk's grads are in place
    STATES = "states"                # a streamed chunk's optimizer states (fp32), on the device for its update only


class StateHome(_Enum):
    DEVICE = "device"
    HOST = "host"
    DISK = "disk"        # a file in offload_dir: read into a host staging buffer for its update, written back after


class UpdateSite(_Enum):
    """Where a trainable chunk's optimizer update runs."""
    DEVICE = "device"    # the device's Adam: states on the device, or streamed there from the host and back
    CPU = "cpu"          # the store's CPU worker, on the host states


class ParamHome(_Enum):
    """Where a chunk's parameters are kept while its PARAM buffer is not on the device."""
    HOST = "host"        # a host buffer (this rank's shard of it): fetched host -> device, written back
    MASTER = "master"    # mixed precision, states on the device: the fp32 master there; a fetch casts it (no copy)


@dataclass(frozen=True)
class ParamInfo:
    name: str                        # as in model.state_dict()
    shape: tuple[int, ...]
    dtype: torch.dtype               # the model's own dtype (state_dict() returns this)
    trainable: bool                  # requires_grad and reached by the loss
    aliases: tuple[str, ...] = ()    # other state_dict names of the same (tied) tensor
    chunk: int | None = None
    offset: int | None = None        # element offset inside the chunk

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


@dataclass(frozen=True)
class BufferInfo:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    aliases: tuple[str, ...] = ()
    persistent: bool = True          # part of state_dict()

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for s in self.shape:
            n *= s
        return n


@dataclass(frozen=True)
class InputInfo:
    index: int                       # position in step(*batch)
    shape: tuple[int, ...]
    dtype: torch.dtype               # dtype as traced (floating inputs are cast to the compute dtype)


@dataclass(frozen=True)
class ChunkInfo:
    id: int
    group: ChunkGroup
    capacity: int                    # elements
    dtype: torch.dtype               # dtype of the device-side buffers (the compute dtype)
    params: tuple[str, ...]          # in offset order
    used: int                        # elements holding parameters (capacity - used is padding)
    grad_inplace: bool = False       # the gradient overwrites the parameter in the PARAM buffer
    state_home: StateHome | None = None   # where the optimizer states live (TRAINABLE only)
    opt_group: int | None = None     # TRAINABLE: the optimizer parameter group of every parameter in the chunk
    param_home: ParamHome = ParamHome.HOST   # set by the schedule
    # TRAINABLE, states on the host (set by place_optimizer): updated on the device, its states fetched into a device
    # slot (BufKind.STATES) before its step and written back to their host home after it
    streamed: bool = False
    # TRAINABLE, states on the host, updated by the CPU in an atomic step (set by place_optimizer): its update runs
    # before the commit, right after the chunk's last use, its previous states (and fp32 parameters) first copied
    # into an undo buffer of its own in host memory, which puts them back if the step fails before its commit
    undo: bool = False

    @property
    def nbytes(self) -> int:
        return self.capacity * self.dtype.itemsize

    @property
    def update_site(self) -> UpdateSite | None:
        """Where its update runs (None: not trainable, or states not placed yet). The state home says where the
        states live between steps; a streamed chunk's live on the host and are updated on the device."""
        if self.group is not ChunkGroup.TRAINABLE or self.state_home is None:
            return None
        return UpdateSite.DEVICE if self.state_home is StateHome.DEVICE or self.streamed else UpdateSite.CPU

    def buffers(self) -> tuple[BufKind, ...]:
        if self.group is ChunkGroup.TRAINABLE and not self.grad_inplace:
            return (BufKind.PARAM, BufKind.GRAD)
        return (BufKind.PARAM,)

    def grad_buf(self) -> BufKind:
        assert self.group is ChunkGroup.TRAINABLE
        return BufKind.PARAM if self.grad_inplace else BufKind.GRAD


@dataclass(frozen=True)
class NodeAnn:
    role: Role
    phase: Phase
    bytes: int = 0                   # bytes of new storage the node's output occupies (0 for views)
    live_bytes: int | None = None    # activation bytes live while the node runs (liveness)
    resident_bytes: int | None = None  # chunk buffer bytes on the device while the node runs (schedule)
    workspace_bytes: int = 0         # temporary device bytes the node itself needs (optimizer step)
    param: str | None = None         # PARAM / PARAM_VIEW / WRITE_GRAD: the parameter
    chunk: int | None = None         # FETCH / RELEASE / OPTIMIZER_STEP: the chunk
    buf: BufKind | None = None       # FETCH / RELEASE: which buffer of the chunk


@dataclass(frozen=True)
class Settings:
    precision: Precision
    device: torch.device
    budget: int | None               # device bytes for everything pstar-fx places there; None: unlimited
    chunk_size: int | None           # elements; None: chosen by assign_chunks
    optimizer: OptimizerLayout | None   # which parameters form each optimizer group; None: forward only (evaluation)
    max_grad_norm: float | None = None   # clip gradients by their global L2 norm before the update
    accumulate: int = 1              # micro-batches per step (the batch is split along dim 0)
    world: int = 1                   # ranks sharing the chunks (data parallel; each owns 1/world of every chunk)
    atomic: bool = True              # False: host-side updates may start before the commit (place_optimizer)
    # tests (px.compile's private `_device_updates`): this many chunks the CPU would update, the first in its order,
    # are streamed to the device and updated there instead (more than there are: all); None: the cost model chooses
    device_updates: int | None = None
    # tests (px.compile's private `_undo_updates`): this many chunks the CPU would update, the last in its order, update
    # before the commit with an undo buffer (more than there are: all; 0: none); None: the cost model chooses
    undo_updates: int | None = None
    # large cross-entropy losses in blocks of rows (passes/loss_rows): when, and the fp32 bytes of a block
    # (px.compile's private `_loss_rows` and `_loss_block_bytes`, for tests)
    loss_rows: LossRows = LossRows.WHERE_NEEDED
    loss_block_bytes: int = LOSS_BLOCK_BYTES
    # forward only over a trainer's chunks (optimizer None): the trainer's chunk state layout, whose device-placed
    # states the plan counts (ir.needs.state_layout)
    states: StateLayout | None = None
    host_budget: int | None = None   # host bytes for what pstar-fx keeps in host memory (ir.needs.host_bytes); None:
    #                                  not checked
    host_default: bool = False       # host_budget is what the machine could give (px.compile's host_memory=None)
    # with host_default on one rank: the host memory the system could give at px.compile less a margin
    # (runtime/host_memory.spare_host_bytes); undo buffers, a speed-up, stay within it as well (update_sites.undo_room)
    host_spare: int | None = None
    disk_budget: int | None = None   # bytes of the disk tier (offload_dir) for optimizer states; None: no disk tier
    # a CPU device of one rank, whose memory is the host's (api/options.py host_is_device): slots are host homes
    # (runtime/chunk_store.py), and no update is streamed to the device, which is the host's cores
    host_is_device: bool = False
    # the compute between chunk operations runs as compiled regions (fuse=True; with fuse=None the step's settings say
    # False, as the optimizer is placed for the unfused step, and fuse_if_faster marks its graph True where it keeps
    # the regions): the cost model's CPU worker updates slower beside such a step's backward (cpu_adam_beside_fused)
    fused: bool = False

    @property
    def commit_decides(self) -> bool:
        """Every update needs something only the commit knows: the clip coefficient, the fp16 overflow flag."""
        return self.max_grad_norm is not None or self.precision.dtype is torch.float16

    @property
    def undo_possible(self) -> bool:
        """An atomic step may update host-placed chunks before its commit, keeping their previous values to put back
        (ChunkInfo.undo): `no_undo` is None."""
        return self.no_undo is None

    @property
    def no_undo(self) -> str | None:
        """Why no chunk may update before the commit with an undo buffer (None: they may): updates before the commit
        need an atomic step, nothing decided at the commit, and the updates on the store's worker thread
        (not a CPU device that is the host, whose updates run inline on the executor's cores)."""
        if not self.atomic:
            return "atomic=False updates every host-placed chunk during backward already"
        if self.commit_decides:
            return "its updates need what the commit decides (the clip coefficient or fp16's overflow flag)"
        if self.host_is_device:
            return "a CPU device is the host, whose updates run inline on the executor's cores"
        return None

    @property
    def early_updates(self) -> bool:
        """Host-side steps come right after their chunk's last use, before the commit (atomic=False; with several
        ranks after the chunk's reduce-scatter, which comes right after its last gradient write: passes/shard.py)."""
        return not self.atomic and not self.commit_decides


@dataclass(frozen=True)
class MemoryPlan:
    """What the schedule predicts for one step: device bytes, chunk traffic, and what stays resident across steps."""
    budget: int | None
    static_bytes: int                # always on the device: model buffers + device optimizer states
    predicted_peak: int              # max over nodes of static + resident + live + workspace bytes
    h2d_bytes: int                   # host -> device chunk traffic per step
    d2h_bytes: int                   # device -> host chunk traffic per step (write-backs, host-side steps)
    fetches: int
    releases: int
    carried: tuple = ()              # ((BufKey, dirty), ...): resident at the start and at the end of every step
    gathered_bytes: int = 0          # multi-GPU: chunk bytes all-gathered per step (each rank receives (w-1)/w)
    reduced_bytes: int = 0           # multi-GPU: chunk bytes reduce-scattered per step (each rank sends (w-1)/w)


# -- node tags (node.meta keys and their values) ------------------------------------------------------------------
USER_CHECKPOINT = "pstar_checkpoint"     # node.meta key of a UserCheckpointTag (frontend/user_checkpoint.py)


@dataclass(frozen=True)
class UserCheckpointTag:
    """A node of a region the user's step wraps in activation checkpointing (torch.utils.checkpoint)."""
    region: int                      # checkpointed region id, in order of the region's first recompute node
    recompute_of: str | None = None  # recompute node: its forward twin's name; None on the forward twin itself.
    # A twin only backward needed (a layer norm's saved mean) has no user once backward reads the recompute's copy,
    # so canonicalize drops it: then the name is of no node and there is nothing to reuse.


REMAT = "pstar_remat"                    # node.meta key of a RematTag (passes/remat)


@dataclass(frozen=True)
class RematTag:
    """A forward node's copy that the remat pass placed in backward, to compute the value again there."""
    segment: int                     # the remat Segment it belongs to (LOSS_ROWS_SEGMENT: a loss's blocks of rows)
    recompute_of: str                # the forward node whose value it computes again


LOSS_ROWS_SEGMENT = -1               # RematTag.segment of passes/loss_rows' log-softmax blocks computed again in backward


@dataclass(frozen=True)
class Scheduled:
    """The schedule pass's result (default prefetch) for one graph, computed by place_optimizer, which schedules the
    placement it keeps to compare it with others: the schedule pass returns it instead of scheduling the same graph
    again (about 2 s for the 17.26B GPT). Valid only for the graph it was made from: the same module, annotations,
    chunks and settings."""
    gm: fx.GraphModule
    ann: Mapping
    chunks: tuple
    settings: "Settings"
    result: "TrainGraph"

    def of(self, g: "TrainGraph") -> "TrainGraph | None":
        same = g.gm is self.gm and g.ann is self.ann and g.chunks == self.chunks and g.settings == self.settings
        return self.result if same else None


@dataclass(frozen=True)
class Choice:
    """Why a pass planned what it did, in a sentence with its figures (step.summary() and px.plan print them)."""
    made_by: str                     # the pass
    why: str

    def __str__(self) -> str:
        return f"{self.made_by}: {self.why}"


@dataclass(frozen=True)
class TrainGraph:
    gm: fx.GraphModule
    stage: str                       # "traced", "canonical", ..., "scheduled"
    made_by: str                     # the function that produced this stage
    settings: Settings
    params: tuple[ParamInfo, ...]
    buffers: tuple[BufferInfo, ...]
    inputs: tuple[InputInfo, ...]
    ann: Mapping[str, NodeAnn]
    grad_outputs: tuple[str, ...] = ()   # canonical+: the parameter of each gradient output (after the loss)
    chunks: tuple[ChunkInfo, ...] = ()
    chunk_size: int | None = None    # chunked+: elements per regular chunk (larger tensors get their own chunk)
    plan: MemoryPlan | None = None
    output_spec: AuxOutputs | None = None   # forward only (optimizer=None): what rebuilds the function's output
    aux: AuxOutputs | None = None    # training: what the step function returned beside the loss (ir/outputs.py)
    seconds: float = 0.0             # how long the pass took (kept out of the printed text)
    choices: tuple[Choice, ...] = ()  # why the passes so far planned what they did, in pass order
    scheduled: Scheduled | None = dataclasses.field(default=None, repr=False, compare=False)  # optimizer_placed

    def evolve(self, **changes) -> "TrainGraph":
        if "ann" in changes:
            changes["ann"] = MappingProxyType(dict(changes["ann"]))
        return dataclasses.replace(self, **changes)

    @property
    def nodes(self) -> list[fx.Node]:
        return list(self.gm.graph.nodes)

    @functools.cached_property
    def _param_index(self) -> dict[str, ParamInfo]:
        return {p.name: p for p in self.params}

    def param(self, name: str) -> ParamInfo:
        return self._param_index[name]

    def chunk_of(self, param: str) -> ChunkInfo:
        return self.chunks[self.param(param).chunk]

    def __str__(self) -> str:
        from .printing import format_graph
        return format_graph(self)

    __repr__ = __str__


def copy_graph(g: TrainGraph) -> tuple[fx.Graph, dict[fx.Node, fx.Node]]:
    """A fresh fx.Graph with the same nodes (names and meta kept); the map old node -> new node."""
    new = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    out = new.graph_copy(g.gm.graph, env)
    new.output(out)
    return new, env


def to_module(graph: fx.Graph, root: torch.nn.Module) -> fx.GraphModule:
    """A GraphModule for graph; tensor constants that get_attr nodes name are taken from root. Its Python code is
    generated only when something asks for it (torch's lazy GraphModule, where this torch has one): the executor
    walks the nodes, and generating code for a largest model's graph (16k nodes) took about a second per pass."""
    return _GraphModule(root, graph)


def lazy_modules():
    """A context in which torch makes its GraphModules lazy too (make_fx's result: its code, which nothing here
    runs, is not generated; about 0.9 s for a 17B GPT's 12.5k-node trace on the CI machine)."""
    return _use_lazy() if _use_lazy is not None else contextlib.nullcontext()


try:      # torch >= 2.3; private names, so fall back to the eager class if they ever move
    from torch.fx._lazy_graph_module import _LazyGraphModule as _GraphModule
    from torch.fx._lazy_graph_module import _use_lazy_graph_module

    def _use_lazy():
        return _use_lazy_graph_module(True)
except ImportError:                     # pragma: no cover
    _GraphModule = fx.GraphModule
    _use_lazy = None
