"""`px.plan`: will a model train on a cluster, and how fast? Answered on any machine, without GPUs or a process group.

The step is traced and planned exactly as `px.compile` would on each rank (the same trace, the same passes with
`Settings(world=world_size, budget=device_memory)`, the shard pass for more than one rank), but nothing runs: the
answer comes from the plan and from the cost model (`pstar_fx.cost`).

- Device: the plan compiles under `device_memory` (every rank's plan is the same), or the BudgetError says how many
  bytes the step needs at least. The peak and the bytes moved and communicated are the plan's, per rank.
- Host: what the ChunkStore of one rank keeps in host memory (its shard of every chunk's parameter home, the gradient
  homes the plan writes back, the optimizer states placed on the host; at set-up the same but gradient homes),
  times the ranks of a node, against `host_memory` per node. With `disk_memory` (a disk tier per GPU, px.compile's
  offload_dir) the optimizer states that do not fit a GPU's share of host_memory are planned on disk, as each rank
  of px.compile would plan them: its shard of those chunks' states in files of its own.
- Speed: `cost.estimate` on the final graph: one steady-state step, and TFLOP/s per GPU counted as
  6 x parameters x tokens + attention (12 x B x heads x Tq x Tk x head_dim per attention layer: nanoGPT's count,
  the causal mask not discounted, recompute not counted), over the estimated step time.

The model may live on the meta device (`with torch.device("meta"): model = GPT(cfg)`): only shapes and dtypes are
read. The batch is what one rank passes to the step: tensors (meta ones allocate nothing) or `(shape, dtype)` pairs.
"""
from __future__ import annotations

import dataclasses
import enum
import time
from dataclasses import dataclass, field

import optree
import torch
import torch.nn as nn

from ..cost import GPU, H200, Bound, Machine, StepCost, estimate, preset
from ..errors import BudgetError
from ..frontend.model_tensors import model_tables
from ..frontend.trace import trace_step
from ..ir.flops import FORWARD_ATTENTION
from ..ir.graph import REMAT, USER_CHECKPOINT, ChunkGroup, Precision, Role, Settings, StateHome, TrainGraph
from ..ir.needs import disk_bytes, host_bytes, host_setup_bytes
from ..optim import ADAM_STATE, OptimizerLayout, OptimizerSpec
from ..passes import pipeline, run_passes
from ..units import format_bytes, parse_bytes
from .compiler import cycle_collection_paused, one_intra_op_thread
from .device_budget import ALLOCATOR_EXPANDABLE, KERNELS, NCCL
from .live_optimizer import build
from .options import check_options, default_fuse

# What the process holds on the device outside torch's allocator (the CUDA context, cuBLAS workspaces): 0.70 GiB on
# the H200 (docs/memory.md). With the allowances of px.compile's default budget (device_budget.py) it is what a
# machine's device memory loses before pstar-fx's plan gets the rest.
CONTEXT = int(0.7 * (1 << 30))


def device_headroom(world_size: int) -> int:
    """Bytes of a GPU's memory that px.compile's default budget leaves beside the plan: the CUDA context, lazily loaded
    kernels, the allocator under expandable segments, and NCCL's buffers with several ranks."""
    return CONTEXT + KERNELS + ALLOCATOR_EXPANDABLE + (NCCL if world_size > 1 else 0)


class Tier(enum.Enum):
    """Where a plan keeps bytes."""
    DEVICE = "device memory"       # per GPU
    HOST = "host memory"           # per node
    DISK = "disk"                  # per node


@dataclass(frozen=True)
class TierUse:
    """One tier's bytes against its capacity (per GPU for the device, per node for host and disk)."""
    tier: Tier
    used: int                      # for the device: the plan's peak, or the least budget the step needs
    capacity: int | None           # None: not given, not checked

    @property
    def fits(self) -> bool | None:
        return None if self.capacity is None else self.used <= self.capacity

    @property
    def short_by(self) -> int:
        """Bytes the tier lacks (0 when it fits or is not checked)."""
        return 0 if self.capacity is None else max(0, self.used - self.capacity)


@dataclass(frozen=True)
class PlanReport:
    """What `px.plan` answers. Bytes per rank unless the name says otherwise; None where the step does not fit."""
    world_size: int
    ranks_per_node: int
    precision: Precision
    params: int                      # parameters (a tied tensor once)
    tokens: int                      # tokens (or samples) one rank processes per step
    device_memory: int | None        # the budget of each rank's device (None: unlimited)
    host_memory: int | None          # host memory of a node (None: not checked)
    device_needed: int | None        # the step does not fit: the least budget it needs (BudgetError.needed)
    peak_device: int | None          # the plan's predicted peak
    host_bytes: int                  # one rank's host memory in the steady state
    host_setup_bytes: int            # one rank's host memory while its store is set up (no gradient homes yet)
    model_bytes: int                 # the model's own values, which each rank holds at its first step today
    h2d_bytes: int
    d2h_bytes: int
    gathered_bytes: int              # chunk bytes all-gathered per step (a rank receives (w-1)/w of them)
    reduced_bytes: int               # chunk bytes reduce-scattered per step (a rank sends (w-1)/w of them)
    chunks: int
    states_on_device: int
    trainable_chunks: int
    model_flops: float               # 6 x params x tokens + attention, per rank per step
    cost: StepCost | None
    trace_seconds: float
    passes_seconds: float
    traced_on: str                   # the device type the step was traced for ("cpu" where torch has no CUDA)
    graph: TrainGraph | None = field(default=None, repr=False, compare=False)   # the final stage
    states_streamed: int = 0         # chunks whose states live on the host, updated on the GPU (streamed over and back)
    states_undo: int = 0             # chunks the CPU updates before the commit, their previous values in undo buffers
    machine: Machine = H200          # the rates the step time is estimated at, the sizes checked
    disk_bytes: int = 0              # one rank's bytes on disk: the disk tier's files of its shards (disk_memory)
    disk_per_node: int = 0           # bytes a node keeps on disk: disk_bytes times the ranks of a node
    states_on_disk: int = 0          # trainable chunks whose optimizer states live on disk
    device_headroom: int = 0         # device memory left beside the plan when the budget is the machine's
    fused: tuple[int, int] | None = None   # fuse=True: (regions, the compute nodes they replace)
    disk_memory: int | None = None   # the disk tier's capacity per GPU (disk_memory; None: no disk tier)

    @property
    def device_per_gpu(self) -> int:
        """The device tier's bytes: the plan's peak, or where it does not fit the least budget it needs."""
        return self.peak_device if self.device_needed is None else self.device_needed

    @property
    def tiers(self) -> tuple[TierUse, ...]:
        """Each tier's bytes against its capacity: the device per GPU, host memory and disk per node."""
        return (TierUse(Tier.DEVICE, self.device_per_gpu, self.device_memory),
                TierUse(Tier.HOST, self.host_per_node, self.host_memory),
                TierUse(Tier.DISK, self.disk_per_node,
                        None if self.disk_memory is None else self.disk_memory * self.ranks_per_node))

    @property
    def shortfalls(self) -> tuple[TierUse, ...]:
        """The tiers that run out (each with `short_by`, its missing bytes); empty when the step fits."""
        return tuple(t for t in self.tiers if t.fits is False)

    @property
    def bounded_by(self) -> Bound | None:
        """What bounds the estimated step: compute, PCIe copies, CPU updates, the network, disk I/O or issuing (None:
        no plan, so no estimate)."""
        return None if self.cost is None else self.cost.bounded_by

    @property
    def fits_device(self) -> bool:
        return self.device_needed is None

    @property
    def host_per_node(self) -> int:
        return max(self.host_bytes, self.host_setup_bytes) * self.ranks_per_node

    @property
    def fits_host(self) -> bool | None:
        return None if self.host_memory is None else self.host_per_node <= self.host_memory

    @property
    def fits(self) -> bool:
        return self.fits_device and self.fits_host is not False

    @property
    def communicated_bytes(self) -> int:
        """Bytes a rank sends (and receives) per step in collectives: (w-1)/w of every gathered and reduced chunk."""
        w = self.world_size
        return (self.gathered_bytes + self.reduced_bytes) * (w - 1) // w

    @property
    def step_seconds(self) -> float | None:
        return None if self.cost is None else self.cost.seconds

    @property
    def tflops(self) -> float | None:
        """Model TFLOP/s per GPU: model_flops over the estimated step time."""
        return None if self.cost is None else self.model_flops / self.cost.seconds / 1e12

    def __str__(self) -> str:
        def fit(ok):
            return "unknown" if ok is None else ("fits" if ok else "DOES NOT FIT")
        w, r = self.world_size, self.ranks_per_node
        budget = "unlimited" if self.device_memory is None else format_bytes(self.device_memory)
        if self.fits_device:
            device = f"{fit(True)}: peak {format_bytes(self.peak_device)} of {budget} per GPU"
        else:
            device = f"{fit(False)}: needs at least {format_bytes(self.device_needed)} per GPU, has {budget}"
        if self.device_headroom:
            device += (f" (the GPU's {format_bytes(self.device_memory + self.device_headroom)} less "
                       f"{format_bytes(self.device_headroom)} for the process)")
        host_mem = "not given" if self.host_memory is None else format_bytes(self.host_memory)
        short = "; ".join(f"{t.tier.value} short by {format_bytes(t.short_by)} "
                          f"{'per GPU' if t.tier is Tier.DEVICE else 'per node'}" for t in self.shortfalls)
        rows = [
            ("machine", self.machine.describe()),
            ("model", f"{_count(self.params)} parameters, {self.precision.value}; {w} GPU{'s' * (w > 1)}, "
                      f"{r} per node; {self.tokens} tokens per GPU per step"),
            ("device memory", device),
            ("host memory", f"{fit(self.fits_host)}: {format_bytes(self.host_per_node)} per node of {host_mem} "
                            f"({format_bytes(self.host_bytes)} per GPU, "
                            f"{format_bytes(self.host_setup_bytes)} while setting up)"),
            ("disk", f"{format_bytes(self.disk_per_node)} per node" + (
                f" ({format_bytes(self.disk_bytes)} per GPU: {'its shard of ' if w > 1 else ''}the optimizer states "
                f"of {self.states_on_disk} chunks)" if self.states_on_disk else "")),
            ("verdict", "FITS" if self.fits else f"DOES NOT FIT: {short}" if short else "DOES NOT FIT"),
            ("not counted", f"the model's own values: {format_bytes(self.model_bytes)} in each process if "
                            "materialised (px.compile copies them in)"),
        ]
        if self.fits_device:
            rows += [
                ("chunks", f"{self.chunks}, optimizer states of {self.states_on_device} of {self.trainable_chunks} "
                           f"on the GPU, {self.states_streamed} of the others updated on the GPU (states streamed)"
                           + (f", {self.states_undo} before the commit (undo buffers)" if self.states_undo else "")),
                ("moved per step", f"{format_bytes(self.h2d_bytes)} host->device, {format_bytes(self.d2h_bytes)} "
                                   "device->host, per GPU"),
                ("communicated", f"{format_bytes(self.communicated_bytes)} sent per GPU per step "
                                 f"(all-gather {format_bytes(self.gathered_bytes)}, reduce-scatter "
                                 f"{format_bytes(self.reduced_bytes)} of chunks)" if w > 1 else "- (one GPU)"),
            ]
        if self.cost is not None:
            busy = ", ".join(f"{k.value} {v:.3f}" for k, v in self.cost.busy.items() if v > 0)
            rows += [
                ("step time", f"{self.cost.seconds:.3f} s estimated (first step {self.cost.first_seconds:.3f} s); "
                              f"bound by {self.bounded_by.value} (busiest lane: {self.cost.bound.value}, "
                              f"{self.cost.busy[self.cost.bound]:.3f} s)"),
                ("lanes busy (s)", busy),
                ("compute idle", self.cost.waits_line()),
                ("speed", f"{self.tflops:.4g} TFLOP/s per GPU (6 x params x tokens + attention: "
                          f"{self.model_flops / 1e12:.4g} TFLOP per GPU per step), "
                          f"{self.tokens * w / self.cost.seconds:,.0f} tokens/s in all"),
            ]
        if self.fused is not None:
            rows.append(("fused", f"{self.fused[0]} regions of {self.fused[1]} nodes, timed as compiled "
                                  "(cost.region_seconds; a plan compiles nothing)"))
        rows.append(("planned in", f"{self.trace_seconds:.1f} s trace + {self.passes_seconds:.1f} s passes "
                                   f"(traced for {self.traced_on})"))
        choices = () if self.graph is None else self.graph.choices
        rows += [("why" if i == 0 else "", str(c)) for i, c in enumerate(choices)]
        return "\n".join(f"{k:>15s}: {v}" if k else f"{'':>17s}{v}" for k, v in rows)


def _count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


def _batch_leaf(x):
    """A batch leaf as a meta tensor: a tensor (any device) keeps its shape and dtype; a (shape, dtype) pair."""
    if isinstance(x, torch.Tensor):
        return torch.empty(x.shape, dtype=x.dtype, device="meta")
    return x


def _as_batch(batch) -> tuple:
    out = []
    for x in batch:
        if (isinstance(x, tuple) and len(x) == 2 and isinstance(x[1], torch.dtype)
                and isinstance(x[0], (tuple, list, torch.Size)) and all(isinstance(s, int) for s in x[0])):
            out.append(torch.empty(tuple(x[0]), dtype=x[1], device="meta"))
        else:
            out.append(optree.tree_map(_batch_leaf, x, none_is_leaf=True))
    return tuple(out)


def _tokens(batch: tuple) -> int:
    """Tokens per step: the elements of the first integer batch tensor (token ids); without one, the first tensor's
    first dimension (samples)."""
    leaves = [t for t in optree.tree_leaves(batch, none_is_leaf=True) if isinstance(t, torch.Tensor)]
    for t in leaves:
        if not t.is_floating_point() and not t.is_complex() and t.dim() > 0:
            return t.numel()
    return leaves[0].shape[0] if leaves and leaves[0].dim() > 0 else 1


def model_flops(g: TrainGraph, tokens: int) -> float:
    """6 x parameters x tokens + 12 x B x H x Tq x Tk x D per attention layer of the forward (recompute excluded:
    the user's checkpoints' and the remat pass's). Of a graph before fuse_regions: an attention a region holds is
    not a node of its own."""
    attention = 0.0
    for n in g.nodes:
        tag = n.meta.get(USER_CHECKPOINT)
        if n.target in FORWARD_ATTENTION and (tag is None or tag.recompute_of is None) and REMAT not in n.meta:
            q, k = n.args[0].meta["val"], n.args[1].meta["val"]
            attention += 12.0 * q.numel() * k.shape[-2]
    return 6.0 * sum(p.numel for p in g.params) * tokens + attention


def _layout(model: nn.Module, optimizer: OptimizerSpec | None) -> OptimizerLayout:
    if optimizer is not None:
        return build(optimizer, model).layout
    names = tuple(p.name for p in model_tables(model).params if p.trainable)
    return OptimizerLayout(groups=(names,), state=ADAM_STATE)     # AdamW's states, as px.plan documents


def resolve_machine(machine: Machine | str | GPU | None, gpus_per_node: int | None = None,
                    host_memory: int | str | None = None) -> Machine:
    """The machine px.plan plans for: a Machine as given, a preset's name ("h200", "h100"), or None for the H200's
    rates without sizes; `gpus_per_node` and `host_memory`, where given, replace the machine's."""
    if gpus_per_node is not None and (not isinstance(gpus_per_node, int) or isinstance(gpus_per_node, bool)
                                      or gpus_per_node < 1):
        raise ValueError(f"gpus_per_node must be an integer >= 1, got {gpus_per_node!r}")
    if machine is None:
        machine = H200
    elif isinstance(machine, (str, GPU)):
        machine = preset(machine)
    elif not isinstance(machine, Machine):
        raise ValueError(f"machine must be a pstar_fx.cost.Machine or a preset's name ('h200', 'h100'), got "
                         f"{type(machine).__name__}")
    changes = {}
    if gpus_per_node is not None:
        changes["gpus_per_node"] = gpus_per_node
    if host_memory is not None:
        changes["host_memory"] = parse_bytes(host_memory, "host_memory")
    return dataclasses.replace(machine, **changes) if changes else machine


def plan(model: nn.Module, loss_fn, *batch, world_size: int = 1, device_memory=None, host_memory=None,
         precision: str = "bf16", chunk_size: int | None = None, accumulate: int = 1,
         max_grad_norm: float | None = None, optimizer: OptimizerSpec | None = None,
         gpus_per_node: int | None = None, machine: Machine | str | None = None, tokens: int | None = None,
         device=None, prefetch: int | None = None, atomic: bool = True, disk_memory=None,
         fuse: bool | None = False) -> PlanReport:
    """Plan `loss_fn(model, *batch)` for `world_size` GPUs without running it (see the module docstring).

    batch: what ONE rank passes to the step (tensors, meta tensors, or (shape, dtype) pairs). machine: a
    `pstar_fx.cost.Machine` (rates and sizes), a preset's name ("h200", "h100": `pstar_fx.cost.preset`), or None
    (the H200's rates, no sizes). precision: "bf16" by default, px.compile's default on a GPU (on the CPU px.compile
    defaults to "fp32": pass it to plan a CPU run). device_memory: bytes or a string ("80GB") per GPU (default: the
    machine's GPU less what px.compile's default budget leaves beside the plan, `device_headroom`; unlimited when
    the machine gives no size); host_memory: per node (default: the machine's; None: not checked), which also bounds
    the undo buffers of an atomic step's updates ahead of its commit, as px.compile(..., host_memory=...)'s does;
    gpus_per_node: ranks sharing a node's host memory and NVLink (default: the machine's, at most world_size).
    optimizer: px.AdamW(...) (or any px optimizer) when its parameter groups or its states' bytes matter (default:
    AdamW's states, one group of every parameter). tokens: per rank per step (default: the first integer batch
    tensor's elements). device: the device type the step is traced for (default: "cuda" when torch sees one, else
    "cpu": a CPU-only torch cannot trace for CUDA, and the CPU trace differs only in the attention kernel's name and
    in autocast's op lists, which keep the same memory for transformers; not for `F.cross_entropy` of bf16 logits
    without `.float()`, which CUDA's autocast computes as a bf16 log-softmax and its fp32 copy, 1.5x the bytes the
    CPU's fp32 log-softmax keeps from forward to backward). atomic: as px.compile's. disk_memory:
    bytes of a disk tier per GPU (px.compile's offload_dir): with host_memory, the optimizer states that do not fit
    a GPU's share of it (host_memory over the GPUs of a node) are planned on disk, each GPU's shard of them in its
    own files; the report gives the disk bytes per GPU and per node. fuse: as px.compile's fuse=True, the compute
    between chunk operations grouped into regions (the fuse pass; nothing is compiled) and the step estimated with
    them (cost.region_seconds); None, as px.compile's default on a GPU: for bf16 and fp16 on one GPU the regions
    kept only where the step is estimated no slower with them (passes.fuse_if_faster; the report's `why` says
    which), else unfused."""
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be a number of GPUs >= 1, got {world_size!r}")
    if fuse is not None and not isinstance(fuse, bool):
        raise ValueError(f"fuse must be True, False or None, got {fuse!r}")
    fuse_auto = fuse is None
    check_options(model, optimizer, chunk_size=chunk_size, prefetch=prefetch, max_grad_norm=max_grad_norm,
                  accumulate=accumulate, remat="auto", atomic=atomic)      # px.compile's checks of the same
    if not isinstance(atomic, bool):
        raise ValueError(f"atomic must be True or False, got {atomic!r}")
    try:
        prec = Precision(precision)
    except ValueError:
        raise ValueError(f"precision must be one of 'fp32', 'bf16', 'fp16', got {precision!r}") from None
    if fuse_auto:     # px.compile's default on a GPU: DEFAULT_FUSE for CUDA and the precision, with one rank
        fuse = fuse_auto = default_fuse("cuda", prec, world_size)
    machine = resolve_machine(machine, gpus_per_node, host_memory)
    headroom = 0
    if device_memory is not None:
        budget = parse_bytes(device_memory)
    elif machine.device_memory is not None:
        headroom = device_headroom(world_size)
        if machine.device_memory <= headroom:
            raise ValueError(f"the machine's GPU has {format_bytes(machine.device_memory)}, no more than the "
                             f"{format_bytes(headroom)} the process needs beside the plan: give device_memory")
        budget = machine.device_memory - headroom
    else:
        budget = None
    host = machine.host_memory
    disk = None if disk_memory is None else parse_bytes(disk_memory, "disk_memory")
    if disk is not None and host is None:
        raise ValueError("disk_memory plans a disk tier for the optimizer states that do not fit host_memory: give "
                         "host_memory too (per node; each GPU's share of it is host_memory over the GPUs of a "
                         "node)")
    per_node = min(world_size, machine.gpus_per_node)
    machine = dataclasses.replace(machine, gpus_per_node=per_node)
    dev = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("px.plan(device='cuda'): this torch sees no CUDA device, and fake CUDA tensors need one to "
                         "trace under autocast; leave device=None (or 'cpu') to trace for the CPU, whose plan is the "
                         "same for transformers (see px.plan's docstring)")
    if dev.type not in ("cuda", "cpu"):
        raise ValueError(f"device must be 'cuda' or 'cpu' (or None), got {device!r}")
    meta_batch = _as_batch(batch)
    settings = Settings(precision=prec, device=dev, budget=budget, chunk_size=chunk_size,
                        optimizer=_layout(model, optimizer),
                        max_grad_norm=None if max_grad_norm is None else float(max_grad_norm),
                        accumulate=accumulate, world=world_size, atomic=atomic,
                        host_budget=None if host is None else host // per_node, disk_budget=disk,
                        host_is_device=False,    # (the plan is for the preset GPU, whatever device traces it)
                        fused=fuse and not fuse_auto)
    with cycle_collection_paused(), one_intra_op_thread():
        traced = trace_step(loss_fn, model, meta_batch, settings)
        t0 = time.perf_counter()
        needed = None
        passes = pipeline(chunk_size=chunk_size, prefetch=prefetch, world=world_size, machine=machine, fuse=fuse,
                          fuse_auto=fuse_auto)
        try:
            try:
                final = run_passes(traced, passes)[-1]
            except BudgetError as e:
                if e.tier is not StateHome.HOST or disk is not None:
                    raise
                # no disk tier: the plan that does not fit host_memory is reported as such (host_memory then
                # bounds nothing else: it sizes the undo buffers of a plan that fits)
                traced = traced.evolve(settings=dataclasses.replace(settings, host_budget=None))
                final = run_passes(traced, passes)[-1]
        except BudgetError as e:
            if e.tier is not None:      # the disk tier, not the device, is too small
                raise
            needed, final = e.needed, None
        passes_s = time.perf_counter() - t0      # the collection at the end is not counted
    n_params = sum(p.numel for p in traced.params)
    n_tokens = tokens if tokens is not None else _tokens(meta_batch)
    model_bytes = sum(p.numel * p.dtype.itemsize for p in traced.params)
    flops = model_flops(traced, n_tokens)       # the traced graph's: no recompute yet, no attention inside a region
    common = dict(world_size=world_size, ranks_per_node=per_node, precision=prec, params=n_params, tokens=n_tokens,
                  device_memory=budget, host_memory=host, model_bytes=model_bytes, trace_seconds=traced.seconds,
                  passes_seconds=passes_s, traced_on=dev.type, machine=machine, device_headroom=headroom,
                  disk_memory=disk)
    if final is None:
        # no plan: the host figure is an estimate, every state on the host and every gradient written back
        params = sum(p.numel for p in traced.params if p.trainable)
        per = params / world_size
        state = (3 if prec.mixed else 2) * 4
        setup = int(per * (2 * prec.dtype.itemsize + state))
        return PlanReport(device_needed=needed, peak_device=None, host_bytes=setup, host_setup_bytes=setup,
                          h2d_bytes=0, d2h_bytes=0, gathered_bytes=0, reduced_bytes=0, chunks=0, states_on_device=0,
                          trainable_chunks=0, model_flops=flops, cost=None, graph=None, **common)
    steady, setup = host_bytes(final), host_setup_bytes(final)
    trainable = [c for c in final.chunks if c.group is ChunkGroup.TRAINABLE]
    p = final.plan
    return PlanReport(device_needed=None, peak_device=p.predicted_peak, host_bytes=steady, host_setup_bytes=setup,
                      h2d_bytes=p.h2d_bytes, d2h_bytes=p.d2h_bytes, gathered_bytes=p.gathered_bytes,
                      reduced_bytes=p.reduced_bytes, chunks=len(final.chunks),
                      states_on_device=sum(c.state_home is StateHome.DEVICE for c in trainable),
                      states_streamed=sum(c.streamed for c in trainable), states_undo=sum(c.undo for c in trainable),
                      trainable_chunks=len(trainable), model_flops=flops,
                      cost=estimate(final, machine), graph=final, disk_bytes=disk_bytes(final),
                      disk_per_node=disk_bytes(final) * per_node,
                      states_on_disk=sum(c.state_home is StateHome.DISK for c in trainable),
                      fused=_fused(final) if final.settings.fused else None, **common)


def _fused(g: TrainGraph) -> tuple[int, int]:
    """A fused plan's regions and the compute nodes they replace."""
    specs = [n.kwargs["spec"] for n in g.nodes if g.ann[n.name].role is Role.REGION]
    return len(specs), sum(s.nodes for s in specs)
