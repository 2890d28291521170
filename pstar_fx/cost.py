"""cost: one training step's time on a machine, estimated from a scheduled (or sharded) TrainGraph.

The model, in three parts.

1. What each node costs on its own (`node_seconds`; the FLOP rules per op are in ir/flops.py). Matmuls, convolutions
   and attention by their FLOPs, from the fake shapes in `node.meta["val"]`, at the machine's matmul rate (attention
   at a fraction of it); every other op by the bytes it reads and writes at the device's memory rate; views cost
   nothing. Each kernel adds a fixed overhead. Inserted operations: a fetch is the chunk's bytes (a rank's shard,
   when sharded) at the host->device rate, a write-back the same at device->host (a streamed update's states: their
   fp32 bytes each way), an all-gather / reduce-scatter (w-1)/w of the chunk at the collective bus rate plus a
   latency, a device-side Adam update the shard's elements at the GPU Adam rate, a host-side one at the CPU Adam
   rate; a disk-homed chunk's states are read and written at the disk's rates.

2. Where it runs: seven lanes, each doing one thing at a time: the compute stream, the host->device and device->host
   copy streams, the NCCL stream, the CPU thread that runs host-side updates, the disk of the disk tier, and the
   executor's own thread, which issues everything (a fixed Python cost per node; no GPU work starts before it is
   issued, and it cannot issue a kernel more than `launch_queue` kernels ahead of the compute stream). Nodes are placed in graph
   order; each starts when its lane is free and what it waits for is done, as the runtime orders them (`runtime/`):
   - a node that reads a chunk buffer waits for the buffer's fetch or collective (its first use waits, not the fetch);
   - a copy into the device waits for the compute stream to reach the fetch (its slot may still hold an activation),
     for the write-back into the same host buffer, and for the chunk's pending host-side update;
   - a write-back waits for the compute stream, and the compute stream then waits for the write-back (the runtime
     keeps the plan's peak exact that way: ChunkStore.release);
   - a reduce-scatter follows the last gradient write; with clipping the compute stream waits for it (the norm);
   - a disk read waits for the previous write out of its staging buffer, a disk-homed chunk's update for its read,
     its write for its update, and the step's end for every write (the disk lane: one drive, reads and writes in
     turn);
   - a host-side update waits for its gradient's write-back and for the copies reading its host buffers, and, unless
     it comes before the commit (atomic=False, or a chunk keeping an undo buffer, whose update first copies its
     states there at `host_copy_bytes`, and which the executor's thread waits for at the commit), for the compute
     stream to reach the commit: with clipping or fp16
     the commit decides something it needs (the clip coefficient, the overflow flag); in an atomic step the executor
     issues it only after the commit, and the model has the executor's thread, which in principle runs up to
     `launch_queue` kernels ahead, reach the commit when the device does. Measured on the H200: a profiled 17.26B
     step at the default budget had 2-3 ms between them (the caching allocator's synchronisation in the last layers
     of backward holds the executor back); the 4.24B GPT at 40 GiB, without such retries, 148 ms (its CPU starting
     82 ms before the device's commit), and the plan the launch-queue rule chose for it ran 0.99 s against an
     estimate of 0.71 s. The fetch that needs its result waits for it (sharded: the executor's thread waits, since
     collectives are issued in graph order by that thread).
   Steps repeat: what one step leaves pending (host-side updates, the fetches that follow them) delays the next, so
   three steps are simulated and the step time is the last one's (the steady state; `first_seconds` is the first).

3. Contention: copies and the CPU update share host memory (docs/measurements.md). A copy runs at its rate alone, at
   half the both-ways rate while the other direction copies, and slower again while the CPU updates; a CPU update runs
   slower while any copy runs, and slower throughout where it runs during backward (atomic=False, no clipping,
   not fp16; an undo chunk's: `cpu_adam_beside_backward`).
   A rate depends on what the other lanes do at that moment, so the simulation runs twice: the first pass charges
   overlap with what is already placed, the second with the whole first pass.

Constants (`Machine`; `H200` is the default): measured on one H200 (docs/measurements.md, 2026-11-30) except those
marked ASSUMED below, which wait for a measurement. Four were fitted to measured steps: the per-kernel overhead
(`Machine.kernel_s`), the fused regions' share of their unfused bytes (`fused_fraction`), the CPU's rate beside
backward (`cpu_adam_beside_backward`) and beside a fused step's backward (`cpu_adam_beside_fused`, fitted on two
H100 machines); nothing else was. A Machine also holds the sizes `px.plan` checks a plan
against (device memory per GPU, host memory per node, GPUs per node): `preset("h200" or "h100", ...)`
(docs/planning.md).
"""
from __future__ import annotations

import bisect
import enum
import functools
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Callable, Mapping

import torch
import torch.fx as fx

from .ir import ops
from .ir.flops import ATTENTION_FLOPS, MATMUL_FLOPS, aten_ops, bounded, flops, numel, op_of, val
from .ir.fx_utils import mutated_args, storage_key, tensors_of
from .ir.graph import BufKind, Role, Settings, TrainGraph, UpdateSite
from .ir.needs import (BufKey, all_needs, buf_bytes, from_master, shard_numel, state_bytes, state_layout,
                       undo_bytes)
from .optim import ADAM_STATE
from .machines import GPU, H200, Machine, gpu_named, preset  # noqa: F401 (re-exported: pstar_fx.cost.Machine, ...)

INF = float("inf")


class Lane(enum.Enum):
    COMPUTE = "compute"      # the compute stream
    H2D = "h2d"              # host -> device copies
    D2H = "d2h"              # device -> host copies
    COMM = "comm"            # collectives (NCCL's stream)
    CPU = "cpu"              # host-side optimizer updates (the store's worker thread)
    HOST = "host"            # the executor's thread: issues every node
    DISK = "disk"            # reads and writes of disk-homed optimizer states (the disk tier's I/O threads)


class Bound(enum.Enum):
    """What bounds a step: the resource whose lane is busiest."""
    COMPUTE = "compute"                      # the GPU's kernels
    PCIE = "PCIe"                            # host <-> device copies
    CPU_UPDATES = "CPU updates"              # optimizer updates on the host
    NETWORK = "network"                      # collectives
    ISSUING = "issuing"                      # the executor's thread, a fixed cost per node
    DISK = "disk I/O"                        # reads and writes of the disk tier


LANE_BOUND: Mapping[Lane, Bound] = MappingProxyType({
    Lane.COMPUTE: Bound.COMPUTE, Lane.H2D: Bound.PCIE, Lane.D2H: Bound.PCIE, Lane.CPU: Bound.CPU_UPDATES,
    Lane.COMM: Bound.NETWORK, Lane.HOST: Bound.ISSUING, Lane.DISK: Bound.DISK})


@dataclass(frozen=True)
class StepCost:
    """The estimate for one steady-state step (and the first one)."""
    seconds: float                        # one step, in the steady state
    first_seconds: float                  # the first step: chunks carried in, nothing pending from before
    busy: Mapping[Lane, float]            # seconds each lane works during one steady-state step
    flops: float                          # FLOPs of the matmul, convolution and attention nodes (recompute too)
    machine: Machine = field(repr=False, default=H200)
    # seconds the compute stream idles during a steady-state step, by the lane it waits for: a copy bringing a chunk
    # in (h2d) or a write-back freeing its slot (d2h), a collective (comm), the CPU's updates (cpu, also where the
    # executor's thread waited for one and issued late), the disk, or the executor's thread issuing nodes (host);
    # the step is the compute lane's busy time plus these
    waits: Mapping[Lane, float] = field(default_factory=lambda: MappingProxyType(dict.fromkeys(Lane, 0.0)))

    def waits_line(self) -> str:
        """The compute stream's idle time in a steady-state step, and what it waits for, largest first."""
        idle = sum(self.waits.values())
        parts = ", ".join(f"{k.value} {v:.3f}" for k, v in sorted(self.waits.items(), key=lambda kv: -kv[1])
                          if v >= 0.0005)
        return f"{idle:.3f} s of the {self.seconds:.3f} s step" + (f", waiting for {parts}" if parts else "")

    @property
    def bound(self) -> Lane:
        """The busiest lane: what a faster step would have to speed up first."""
        return max(self.busy, key=lambda k: (self.busy[k], k.value))

    @property
    def bounded_by(self) -> Bound:
        """The resource of the busiest lane (each copy direction is a lane of its own: PCIe is full duplex)."""
        return LANE_BOUND[self.bound]


# -- 1. per node -------------------------------------------------------------------------------------------------------

# attention kernels timed at a rate of their own (cost.Machine); the rest at attention_efficiency
_ATTENTION_RATE = {
    **{op: "flash_attention_efficiency" for op in aten_ops(
        "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward",
        "_flash_attention_forward", "_flash_attention_backward")},
    **{op: "efficient_attention_efficiency" for op in aten_ops(
        "_scaled_dot_product_efficient_attention", "_scaled_dot_product_efficient_attention_backward",
        "_efficient_attention_forward", "_efficient_attention_backward")}}


def _attention_efficiency(n: fx.Node, m: "Machine") -> float:
    return getattr(m, _ATTENTION_RATE.get(n.target, "attention_efficiency"))


def _tensor_bytes(t) -> int:
    return int(bounded(t.numel())) * t.element_size() if isinstance(t, torch.Tensor) else 0


def _moved_bytes(n: fx.Node) -> int:
    """Bytes an op reads and writes; 0 for a view (every output shares an input's storage and nothing is written)."""
    ins = [t for a in n.all_input_nodes for t in tensors_of(a)]
    if n.target is ops.compute_grad:       # its output is the gradient, written into the chunk
        dtype = n.kwargs.get("dtype") or functools.reduce(torch.promote_types, (t.dtype for t in ins))
        return sum(map(_tensor_bytes, ins)) + numel(n.kwargs["shape"]) * dtype.itemsize
    outs = tensors_of(n)
    if not mutated_args(n) and outs and {storage_key(t) for t in outs} <= {storage_key(t) for t in ins}:
        return 0
    return sum(map(_tensor_bytes, ins)) + sum(map(_tensor_bytes, outs))


def node_seconds(n: fx.Node, m: Machine = H200) -> float:
    """Compute-stream time of one aten node of the user's program: FLOPs at the matmul rate (attention at a fraction
    of it), or bytes at the memory rate, whichever is longer, plus a kernel's overhead; 0 for views."""
    if n.op != "call_function":
        return 0.0
    moved = _moved_bytes(n)
    memory = moved / m.hbm_bytes
    op = op_of(n)
    if op in MATMUL_FLOPS:
        half = any(getattr(val(a), "dtype", None) in (torch.bfloat16, torch.float16) for a in n.all_input_nodes)
        rate = m.matmul_flops if half else m.fp32_matmul_flops
        return max(flops(n) / rate, memory) + m.kernel_s
    if op in ATTENTION_FLOPS:
        return max(flops(n) / (m.matmul_flops * _attention_efficiency(n, m)), memory) + m.kernel_s
    return memory + m.kernel_s if moved else 0.0


def region_seconds(n: fx.Node, m: Machine = H200) -> float:
    """Compute-stream time of a fused region (passes/regions.py, fuse=True): its matmul and attention nodes as
    node_seconds has them (Inductor calls the same library kernels), everything else in it at `m.fused_fraction` of
    the memory time node_seconds gives its nodes unfused (their launches left out), no less than one pass over the
    region's inputs and outputs at the memory rate (the bound if every intermediate stayed on chip) and no more than
    unfused, and one kernel's overhead. Measured on the H200, fusion saved the launches and about a tenth of the
    elementwise bytes, not all but the one pass: Inductor splits a region into several kernels."""
    inner = [x for x in n.kwargs["spec"].gm.graph.nodes if x.op == "call_function"]
    heavy = sum(node_seconds(x, m) for x in inner if x.target in MATMUL_FLOPS or x.target in ATTENTION_FLOPS)
    # the other nodes' memory time unfused, without their launches (the region is one launch)
    light = sum(max(0.0, node_seconds(x, m) - m.kernel_s) for x in inner
                if x.target not in MATMUL_FLOPS and x.target not in ATTENTION_FLOPS)
    io = (sum(_tensor_bytes(t) for a in n.all_input_nodes for t in tensors_of(a))
          + sum(_tensor_bytes(t) for t in tensors_of(n)))
    return heavy + min(light, max(io / m.hbm_bytes, m.fused_fraction * light)) + m.kernel_s


def region_flops(n: fx.Node) -> float:
    """FLOPs of a fused region's matmul, convolution and attention nodes."""
    return sum(flops(x) for x in n.kwargs["spec"].gm.graph.nodes if x.op == "call_function")


# -- 2. the lanes ------------------------------------------------------------------------------------------------------

class _Timeline:
    """One lane's busy intervals, in time order (a lane does one thing at a time, so they never overlap)."""

    def __init__(self):
        self.starts: list[float] = []
        self.ends: list[float] = []
        self.step: list[int] = []

    def add(self, start: float, end: float, step: int) -> None:
        if end > start:
            self.starts.append(start)
            self.ends.append(end)
            self.step.append(step)

    def at(self, t: float) -> tuple[bool, float]:
        """Whether the lane is busy at t, and when that next changes."""
        i = bisect.bisect_right(self.starts, t) - 1
        if i >= 0 and self.ends[i] > t:
            return True, self.ends[i]
        return False, self.starts[i + 1] if i + 1 < len(self.starts) else INF

    def busy(self, step: int) -> float:
        return sum(e - s for s, e, k in zip(self.starts, self.ends, self.step) if k == step)


class _Sim:
    """One simulation of `steps` consecutive steps of g. `background`: the lanes of an earlier pass, used for the
    contention rates (None: the lanes of this pass, as far as they are placed)."""

    def __init__(self, g: TrainGraph, m: Machine, background: dict[Lane, _Timeline] | None):
        self.g, self.m = g, m
        self.world = g.settings.world
        self.lanes = {lane: _Timeline() for lane in Lane}
        self.bg = background if background is not None else self.lanes
        self.free = {lane: 0.0 for lane in Lane}
        self.step = 0
        self.waits: dict[int, dict[Lane, float]] = {}   # per step: the compute stream's idle time, by its cause
        self.host_cause = Lane.HOST      # what the executor's thread last waited for (it issues late because of it)

    def wait_compute(self, until: float, cause: Lane) -> None:
        """The compute stream idles until `until`, waiting for `cause` (HOST: the executor's thread issuing)."""
        idle = until - self.free[Lane.COMPUTE]
        if idle > 0:
            if cause is Lane.HOST:
                cause = self.host_cause
            waits = self.waits.setdefault(self.step, dict.fromkeys(Lane, 0.0))
            waits[cause] += idle
            self.free[Lane.COMPUTE] = until
        elif cause is Lane.HOST:
            self.host_cause = Lane.HOST      # the thread is ahead of the device again

    def wait_host(self, until: float, cause: Lane) -> None:
        """The executor's thread waits until `until` for `cause` before it issues the next node."""
        if until > self.free[Lane.HOST]:
            self.free[Lane.HOST] = until
            self.host_cause = cause

    # a piece of work whose rate depends on which other lanes are busy
    def _run(self, lane: Lane, start: float, work: float, rate: Callable[[dict[Lane, bool]], float],
             others: tuple[Lane, ...]) -> float:
        t = max(start, self.free[lane])
        begin = t
        while work > 0:
            states, change = {}, INF
            for o in others:
                busy, nxt = self.bg[o].at(t)
                states[o] = busy
                change = min(change, nxt)
            r = rate(states)
            if t + work / r <= change:
                t += work / r
                break
            work -= r * (change - t)
            t = change
        self.lanes[lane].add(begin, t, self.step)
        self.free[lane] = t
        return t

    def _fixed(self, lane: Lane, start: float, seconds: float) -> float:
        t = max(start, self.free[lane])
        self.lanes[lane].add(t, t + seconds, self.step)
        self.free[lane] = t + seconds
        return t + seconds

    def copy(self, lane: Lane, start: float, nbytes: int) -> float:
        m = self.m
        alone, other = (m.h2d_bytes, Lane.D2H) if lane is Lane.H2D else (m.d2h_bytes, Lane.H2D)

        def rate(busy):
            r = min(alone, m.duplex_bytes / 2) if busy[other] else alone
            return r * (m.duplex_cpu_bytes / m.duplex_bytes) if busy[Lane.CPU] else r
        return self._run(lane, start, nbytes, rate, (other, Lane.CPU))

    def cpu_update(self, start: float, params: int, copied: int = 0) -> float:
        """A host-side update of `params` elements from `start`; with `copied`, the bytes it first copies into its
        undo buffer (a chunk updated before the commit, during backward). Its end."""
        m = self.m
        alone = cpu_update_rate(self.g.settings, m, beside_backward=True if copied else None)
        # the copy, counted in elements of update at the update's rate: both slow alike under copies
        work = params + copied / m.host_copy_bytes * alone

        def rate(busy):
            return alone * (m.cpu_adam_under_copies if busy[Lane.H2D] or busy[Lane.D2H] else 1.0)
        return self._run(Lane.CPU, start, work, rate, (Lane.H2D, Lane.D2H))

    def collective(self, start: float, nbytes: int) -> float:
        m = self.m
        seconds = m.collective_latency_s + (self.world - 1) / self.world * nbytes / m.bus_bytes(self.world)
        return self._fixed(Lane.COMM, start, seconds)


def cpu_update_rate(settings: Settings, m: Machine, beside_backward: bool | None = None) -> float:
    """Elements per second the CPU worker updates while no copy runs: torch's fused CPU Adam's rate in the step's
    precision (exact Adam moments in mixed precision: the native kernel's, where the host runs it), over the
    optimizer's relative cost, beside backward (slower still beside a fused step's backward).
    beside_backward: whether the update runs during backward (None: where atomic=False updates there)."""
    layout = state_layout(settings)
    rate = m.cpu_adam_mixed if settings.precision.mixed else m.cpu_adam
    if settings.precision.mixed and m.native_update and layout == ADAM_STATE:
        rate *= m.native_exact_speedup
    if settings.early_updates if beside_backward is None else beside_backward:
        rate *= m.cpu_adam_beside_backward
        if settings.fused:
            rate *= m.cpu_adam_beside_fused
    return rate / layout.update_cost


def _latest(deps: list[tuple[float, Lane]]) -> tuple[float, Lane]:
    """The latest of (time, the lane it waits for) dependencies: when all are met, and what was met last (the first
    listed where two tie)."""
    return max(deps, key=lambda d: d[0])


def _shard_bytes(c, world: int) -> int:
    return shard_numel(c, world) * c.dtype.itemsize


def _simulate(g: TrainGraph, m: Machine, node_s: list[float], background, steps: int):
    sim = _Sim(g, m, background)
    nodes = g.nodes
    needs = all_needs(g)
    world = g.settings.world
    waits_commit = g.settings.commit_decides
    early = g.settings.early_updates
    undo = [c.id for c in g.chunks if c.undo]      # updates ahead of the commit, which the executor waits for there
    ready: dict[BufKey, float] = {k: 0.0 for k, _ in (g.plan.carried if g.plan else ())}   # device contents
    home: dict[BufKey, float] = {}       # host home written (a write-back done)
    reading: dict[int, float] = {}       # the last copy that reads a chunk's host buffers done
    updated: dict[int, float] = {}       # a chunk's host-side update done
    reduced: set[int] = set()
    states_read: dict[int, float] = {}   # a disk chunk's states in their staging buffer
    slot_free: dict[int, float] = {}     # a staging buffer's last write to disk done
    free = sim.free
    ends = []
    launched: list[float] = []           # end times of the compute stream's kernels, in launch order
    by: dict[BufKey, Lane] = {}          # the lane that brings each buffer's device contents (its ready time)

    def arrives(k: BufKey) -> tuple[float, Lane]:
        return ready.get(k, 0.0), by.get(k, Lane.COMPUTE)

    def on_compute(deps: list[tuple[float, Lane]], seconds: float) -> float:
        """A kernel on the compute stream once every dependency (time, the lane it waits for) is met. Its end."""
        t, cause = _latest(deps)
        sim.wait_compute(t, cause)
        return sim._fixed(Lane.COMPUTE, t, seconds)

    for step in range(steps):
        sim.step = step
        reduced.clear()
        commit_at = waited = 0.0
        for i, n in enumerate(nodes):
            a = g.ann[n.name]
            program = a.role in _PROGRAM
            launches = (node_s[i] > 0 or a.role is Role.WRITE_GRAD) if program else True
            if launches and len(launched) >= m.launch_queue:
                sim.wait_host(launched[-m.launch_queue], Lane.HOST)   # the launch queue is full
            issue = sim._fixed(Lane.HOST, free[Lane.HOST], m.host_node_s)
            if program:
                # a chunk buffer's first use waits for what brings it (fetch, gather, reduce)
                deps = [(issue, Lane.HOST)] + [arrives(k) for k in needs[i].resident]
                seconds = node_s[i]
                if a.role is Role.WRITE_GRAD and n.target is not ops.compute_grad:   # a copy, or an addition
                    grad = val(n.args[0])
                    seconds = _tensor_bytes(grad) * (3 if n.kwargs.get("accumulate") else 2) / m.hbm_bytes + m.kernel_s
                if seconds > 0:
                    launched.append(on_compute(deps, seconds))
                continue
            c = g.chunks[a.chunk] if a.chunk is not None else None
            key = BufKey(a.chunk, a.buf) if a.buf is not None else None
            compute_at = max(issue, free[Lane.COMPUTE])           # the compute stream reaches this point
            if a.role is Role.FETCH and n.target is ops.alloc:
                ready[key] = on_compute([(issue, Lane.HOST)], c.nbytes / m.hbm_bytes + m.kernel_s)
                by[key] = Lane.COMPUTE
            elif a.role is Role.FETCH:
                gather = n.target is ops.all_gather
                after_update = updated.get(a.chunk, 0.0) if a.buf is BufKind.PARAM else 0.0
                if world > 1:                 # the executor's thread waits for the update, then issues the gather
                    sim.wait_host(after_update, Lane.CPU)
                    compute_at = max(compute_at, after_update)
                part = _shard_bytes(c, world) if gather or (world > 1 and a.chunk in reduced) else buf_bytes(g, key)
                if from_master(g, a):         # cast from the fp32 master on the device (4 bytes read per element)
                    deps = [(issue, Lane.HOST)] + ([(after_update, Lane.CPU)] if world > 1 else [])
                    done = on_compute(deps, part * 3 / m.hbm_bytes + m.kernel_s)
                    by[key] = Lane.COMPUTE
                else:
                    # (what the copy waited for to start, where it did not wait for the copies before it)
                    start, cause = _latest([(compute_at, Lane.H2D), (home.get(key, 0.0), Lane.D2H),
                                            (after_update, Lane.CPU)])
                    by[key] = cause if start > free[Lane.H2D] else Lane.H2D
                    done = sim.copy(Lane.H2D, start, part)
                    reading[a.chunk] = done
                if gather:                    # (it waits for the copy, or for the collectives before it)
                    by[key] = by[key] if done > free[Lane.COMM] else Lane.COMM
                ready[key] = sim.collective(done, c.nbytes) if gather else done
            elif a.role is Role.RELEASE:
                t = max(compute_at, ready.get(key, 0.0))          # a collective still writing it finishes first
                if n.kwargs["writeback"]:
                    whole = world == 1 or (a.buf is BufKind.GRAD and a.chunk not in reduced)
                    sim.wait_host(updated.get(a.chunk, 0.0), Lane.CPU)
                    late = free[Lane.HOST] > max(t, free[Lane.D2H]) and sim.host_cause is Lane.CPU
                    done = sim.copy(Lane.D2H, max(t, free[Lane.HOST]),
                                    buf_bytes(g, key) if whole else _shard_bytes(c, world))
                    home[key] = done
                    # the compute stream waits for it: the runtime waits only where the slot's room is needed
                    # before the copy is done (ChunkStore.reclaim), which this model, keeping no device bytes,
                    # cannot tell, so it takes the longest wait; except for a streamed update's states, whose
                    # write-backs the next chunk's copy and update overlap
                    if a.buf is not BufKind.STATES:
                        sim.wait_compute(done, Lane.CPU if late else Lane.D2H)
                else:
                    sim.wait_compute(*_latest([(issue, Lane.HOST), arrives(key)]))
                ready.pop(key, None)
            elif a.role is Role.REDUCE_SCATTER:
                gkey = BufKey(a.chunk, c.grad_buf())
                divided = on_compute([(issue, Lane.HOST), arrives(gkey)], 2 * c.nbytes / m.hbm_bytes + m.kernel_s)
                ready[gkey] = sim.collective(divided, c.nbytes)
                by[gkey] = Lane.COMM
                reduced.add(a.chunk)
                if g.settings.max_grad_norm is not None:   # the shard's norm: the compute stream waits for it
                    sim.wait_compute(ready[gkey], Lane.COMM)
            elif a.role is Role.COMMIT:
                if undo:       # the executor's thread waits there, and the step returns after it (the commit's wait)
                    waited = max(updated.get(c, 0.0) for c in undo)
                    sim.wait_host(waited, Lane.CPU)
                t = on_compute([(issue, Lane.HOST)], m.kernel_s)
                if world > 1:
                    t = sim.collective(t, 8)
                    sim.wait_compute(t, Lane.COMM)
                if g.settings.precision.dtype is torch.float16:
                    sim.wait_host(t, Lane.HOST)          # the overflow flag is read on the host
                commit_at = t
            elif a.role is Role.OPTIMIZER_STEP and c.update_site is UpdateSite.DEVICE:
                # (a streamed chunk's too: it waits for its states' fetch, their write-back is a release)
                keys = [BufKey(c.id, b) for b in c.buffers()] + ([BufKey(c.id, BufKind.STATES)] if c.streamed else [])
                numel = shard_numel(c, world)
                convert = numel * 12 / m.hbm_bytes if g.settings.precision.mixed else 0.0
                rate = m.gpu_adam / state_layout(g.settings).device_update_cost
                done = on_compute([(issue, Lane.HOST)] + [arrives(k) for k in keys],
                                  numel / rate + convert + m.kernel_s)
                if n.kwargs.get("gather", False):               # the updated chunk is gathered again
                    ready[BufKey(c.id, BufKind.PARAM)] = sim.collective(done, c.nbytes)
                    by[BufKey(c.id, BufKind.PARAM)] = Lane.COMM
            elif a.role is Role.OPTIMIZER_STEP:
                t = max(issue, reading.get(c.id, 0.0), states_read.get(c.id, 0.0),
                        *(home.get(BufKey(c.id, b), 0.0) for b in BufKind))
                if waits_commit or not early:      # (atomic: from the device's commit on, see the docstring)
                    t = max(t, commit_at)          # (an undo chunk's step, before the commit: 0, no wait)
                copied = undo_bytes(c, g.settings.precision, world, state_layout(g.settings)) if c.undo else 0
                updated[c.id] = sim.cpu_update(t, shard_numel(c, world), copied)
            elif a.role is Role.DISK_READ:
                nbytes = state_bytes(c, g.settings.precision, world, state_layout(g.settings))
                start = max(issue, slot_free.get(n.kwargs["slot"], 0.0))
                states_read[c.id] = sim._fixed(Lane.DISK, start, nbytes / m.disk_read_bytes)
            elif a.role is Role.DISK_WRITE:
                nbytes = state_bytes(c, g.settings.precision, world, state_layout(g.settings))
                slot_free[n.kwargs["slot"]] = sim._fixed(Lane.DISK, max(issue, updated.get(c.id, 0.0)),
                                                         nbytes / m.disk_write_bytes)
            elif a.role is Role.OUTPUT:
                # the step waits for its disk writes, and for its updates ahead of the commit
                end, cause = _latest([(free[Lane.COMPUTE], Lane.COMPUTE), (waited, Lane.CPU)]
                                     + [(t, Lane.DISK) for t in slot_free.values()])
                if world > 1:                                   # the loss, averaged over the ranks
                    end, cause = sim.collective(end, 4), Lane.COMM
                sim.wait_compute(end, cause)                    # (the next step's kernels come after it)
                sim.wait_host(end, Lane.HOST)                   # the caller reads the loss
                ends.append(end)
    return sim, ends


# nodes of the user's program: they run on the compute stream in graph order, after the chunk buffers they read arrive
_PROGRAM = (Role.COMPUTE, Role.REGION, Role.PARAM_VIEW, Role.WRITE_GRAD)


def _computes(n: fx.Node, role: Role) -> bool:
    """An aten operation of the program: a compute node, or a gradient write that runs its folded operation."""
    return role is Role.COMPUTE or n.target is ops.compute_grad


def _program_seconds(n: fx.Node, role: Role, machine: Machine) -> float:
    return (node_seconds(n, machine) if _computes(n, role) else
            region_seconds(n, machine) if role is Role.REGION else 0.0)


def _program_flops(n: fx.Node, role: Role) -> float:
    return flops(n) if _computes(n, role) else region_flops(n) if role is Role.REGION else 0.0


def compute_seconds(g: TrainGraph, machine: Machine = H200) -> list[float]:
    """The compute time of every node of the user's program in g (node_seconds; region_seconds for a fused
    region), 0 for the others, in graph order."""
    return [_program_seconds(n, g.ann[n.name].role, machine) for n in g.nodes]


def estimate(g: TrainGraph, machine: Machine = H200, *, steps: int = 3,
             program_s: Mapping[str, float] | None = None) -> StepCost:
    """The estimated time of one training step of a scheduled (or sharded) graph on `machine` (one rank's view:
    every rank runs the same graph). program_s: the compute time of each node of the user's program by name, where
    already known (compute_seconds of a graph with the same program: place_optimizer estimates several schedules of
    one)."""
    assert g.plan is not None, "the cost model reads a scheduled graph"
    assert steps >= 2
    if program_s is None:
        node_s = compute_seconds(g, machine)
    else:
        node_s = [program_s[n.name] if g.ann[n.name].role is Role.COMPUTE else
                  _program_seconds(n, g.ann[n.name].role, machine) for n in g.nodes]
    first, _ = _simulate(g, machine, node_s, None, steps)
    sim, ends = _simulate(g, machine, node_s, first.lanes, steps)
    last = steps - 1
    busy = {lane: sim.lanes[lane].busy(last) for lane in Lane}
    total = sum(_program_flops(n, g.ann[n.name].role) for n in g.nodes)
    waits = sim.waits.get(last, dict.fromkeys(Lane, 0.0))
    return StepCost(seconds=ends[-1] - ends[-2], first_seconds=ends[0], busy=MappingProxyType(busy), flops=total,
                    machine=machine, waits=MappingProxyType(waits))


def seconds(n: fx.Node, m: Machine = H200) -> float:
    """One node's estimated time on the compute device (the remat pass weighs recomputing with it)."""
    return node_seconds(n, m)


def copy_seconds(nbytes: int, m: Machine = H200) -> float:
    """A host <-> device copy of nbytes, one way, alone on the link."""
    return nbytes / m.h2d_bytes
