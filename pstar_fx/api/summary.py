"""`step.summary()`: the plan of the latest compiled signature and what the last step measured, as one table."""
from __future__ import annotations

from dataclasses import dataclass

from ..cost import StepCost, estimate
from ..ir.graph import ChunkGroup, Precision, StateHome, TrainGraph
from ..ir.needs import aligned, disk_bytes, disk_chunks, host_bytes, state_bytes, state_layout
from ..runtime.step_runtime import StepStats
from ..units import format_bytes
from .compiler import Compiled
from .device_budget import DefaultBudget


@dataclass(frozen=True)
class Summary:
    """The plan of the latest compiled signature and what the last step measured."""
    chunks: int
    chunk_size: int                  # elements per regular chunk
    chunk_bytes: int                 # bytes of a regular chunk's buffer
    own_chunks: int                  # chunks of tensors larger than chunk_size, each exactly its tensor's size
    model_data_bytes: int            # parameters + gradients + optimizer states, all chunks
    budget: int | None
    states_on_device: int            # trainable chunks whose optimizer states live on the device
    trainable_chunks: int
    predicted_peak: int
    measured_peak: int | None
    h2d_bytes: int
    d2h_bytes: int
    nodes: int
    compile_seconds: tuple[float, float, float] = (0.0, 0.0, 0.0)   # trace, passes, set-up (store and executor)
    plan_reused: bool = False               # the last compile's trace equal to an earlier one's: its plan taken
    default_budget: str | None = None       # device_memory=None on a GPU: how the budget was chosen
    estimated_seconds: float | None = None  # the cost model's steady-state step (None off CUDA)
    estimated_idle: str | None = None       # its compute stream's idle time and what it waits for (StepCost.waits)
    rates: str = "H200"                     # the GPU whose rates the cost model estimated with (Machine.name;
    #                                         where the host updates exact moments by torch's route, that too)
    measured_seconds: float | None = None   # the last step's time: on CUDA on the device, first operation to
    #                                         last (StepStats.device_seconds); elsewhere call to return
    alloc_retries: int | None = None        # the last step's caching-allocator retries (CUDA)
    states_streamed: int = 0                # of the chunks whose states live on the host: updated on the device
    states_undo: int = 0                    # of them: updated by the CPU before the commit, with undo buffers
    fused: str | None = None                # a "fused" stage: its regions, the nodes they replace, the seconds
    #                                         compiling ("none: ..." where fuse=None's choice left the step unfused)
    states_on_disk: int = 0                 # trainable chunks whose optimizer states live in offload_dir
    host_bytes: int = 0                     # host memory the plan keeps (ir.needs.host_bytes)
    host_budget: int | None = None
    disk_bytes: int = 0                     # the disk tier's files
    disk_budget: int | None = None
    disk_moved: tuple[int, int] = (0, 0)    # bytes read from and written to disk per step (the plan's)
    disk_io: str | None = None              # "direct (O_DIRECT)" or "buffered": how the disk tier's I/O ran
    choices: tuple[str, ...] = ()           # why the passes planned what they did ("pass: why"), in pass order
    host_is_device: bool = False            # a CPU device of one rank: slots are host homes, nothing is copied

    def __str__(self) -> str:
        rows = [
            ("chunks", f"{self.chunks}: {self.chunks - self.own_chunks} of {self.chunk_size} elements "
                       f"({format_bytes(self.chunk_bytes)} each), {self.own_chunks} sized to one larger tensor"),
            ("model data", format_bytes(self.model_data_bytes) + " (params + grads + optimizer states)"),
            ("budget", "unlimited" if self.budget is None else
                       self.default_budget if self.default_budget is not None else format_bytes(self.budget)),
            ("optimizer states", f"{self.states_on_device} of {self.trainable_chunks} chunks on the device; of the "
                                 f"others {self.states_streamed} updated on the device (states streamed)"
                                 + (f", {self.states_undo} before the commit (undo buffers)" if self.states_undo
                                    else "")
                                 + (f", {self.states_on_disk} on disk" if self.states_on_disk else "")),
            ("tiers", f"device {format_bytes(self.predicted_peak)} peak, host {format_bytes(self.host_bytes)}"
                      + ("" if self.host_budget is None else f" of {format_bytes(self.host_budget)}")
                      + f", disk {format_bytes(self.disk_bytes)}"
                      + ("" if self.disk_budget is None else f" of {format_bytes(self.disk_budget)}")),
            ("predicted peak", format_bytes(self.predicted_peak)),
            ("measured peak", "-" if self.measured_peak is None else format_bytes(self.measured_peak)),
            ("moved per step", (("nothing copied" if not self.states_streamed else "only streamed states copied")
                                + " (the CPU device is the host: a slot is its host home); planned "
                                if self.host_is_device else "")
                               + f"{format_bytes(self.h2d_bytes)} host->device, "
                               f"{format_bytes(self.d2h_bytes)} device->host"
                               + (f", {format_bytes(self.disk_moved[0])} read from disk, "
                                  f"{format_bytes(self.disk_moved[1])} written ({self.disk_io} I/O)"
                                  if self.states_on_disk else "")),
            ("step time", ("-" if self.estimated_seconds is None else
                           f"{self.estimated_seconds:.3f} s estimated (the cost model's {self.rates} rates)") + ", "
                          + ("-" if self.measured_seconds is None else f"{self.measured_seconds:.3f} s measured")
                          + ("" if self.alloc_retries is None else f", {self.alloc_retries} allocator retries")),
        ] + ([("compute idle", self.estimated_idle + " (estimated)")] if self.estimated_idle is not None else []) + [
            ("graph", f"{self.nodes} nodes"),
            ("compiled in", "{:.1f} s trace + {:.1f} s passes + {:.1f} s set-up".format(*self.compile_seconds)
             + (" (the plan of an equal earlier trace reused)" if self.plan_reused else "")),
        ] + ([("fused", self.fused)] if self.fused is not None else [])
        rows += [("why" if i == 0 else "", c) for i, c in enumerate(self.choices)]
        return "\n".join(f"{k:>17s}: {v}" if k else f"{'':>19s}{v}" for k, v in rows)


def summarize(g: TrainGraph, compiled: Compiled, last: StepStats | None, prec: Precision,
              default_budget: DefaultBudget | None = None) -> Summary:
    """The summary of the final graph `g` of the compiled signature `compiled`, with the last step's measurement,
    in the step's precision `prec`. On CUDA it estimates the step with the cost model, at the rates the passes
    planned with (`compiled.machine`: the preset of the GPU's kind, the H200's on a GPU the cost model has none of)."""
    trainable = [c for c in g.chunks if c.group is ChunkGroup.TRAINABLE]
    model_data = (sum(c.nbytes for c in g.chunks) + sum(c.nbytes for c in trainable if not c.grad_inplace)
                  + sum(state_bytes(c, prec, 1, state_layout(g.settings)) for c in trainable))
    own = sum(c.capacity > g.chunk_size for c in g.chunks)
    disk = disk_chunks(g)
    moved = sum(aligned(state_bytes(c, prec, 1, state_layout(g.settings))) for c in disk)   # whole 4 KiB blocks
    store = compiled.executor.store
    on_device = None if last is None else last.device_seconds
    cost = _estimated(g, compiled)
    return Summary(
        chunks=len(g.chunks), chunk_size=g.chunk_size, chunk_bytes=g.chunk_size * prec.dtype.itemsize,
        own_chunks=own, model_data_bytes=model_data, budget=g.settings.budget,
        states_on_device=sum(c.state_home is StateHome.DEVICE for c in trainable), trainable_chunks=len(trainable),
        states_streamed=sum(c.streamed for c in trainable), states_undo=sum(c.undo for c in trainable),
        predicted_peak=g.plan.predicted_peak, measured_peak=None if last is None else last.measured_peak,
        h2d_bytes=g.plan.h2d_bytes, d2h_bytes=g.plan.d2h_bytes, nodes=len(g.nodes),
        compile_seconds=(compiled.stages["traced"].seconds,
                         0.0 if compiled.plan_reused else
                         sum(st.seconds for name, st in compiled.stages.items() if name != "traced"),
                         compiled.setup_seconds),
        plan_reused=compiled.plan_reused,
        default_budget=None if default_budget is None else str(default_budget),
        estimated_seconds=None if cost is None else cost.seconds,
        estimated_idle=None if cost is None else cost.waits_line(),
        rates=compiled.machine.name + (compiled.machine.host_route if prec.mixed else ""),
        measured_seconds=on_device if on_device is not None else None if last is None else last.seconds,
        alloc_retries=None if last is None else last.alloc_retries,
        fused=_fused(compiled),
        states_on_disk=len(disk), host_bytes=host_bytes(g), host_budget=g.settings.host_budget,
        disk_bytes=disk_bytes(g), disk_budget=g.settings.disk_budget, disk_moved=(moved, moved),
        disk_io=None if store.disk is None else store.disk.mode,
        choices=tuple(map(str, g.choices)), host_is_device=g.settings.host_is_device)


def _fused(compiled: Compiled) -> str | None:
    """The fused line: the regions and their compile; "none" where fuse=None's choice left the step unfused."""
    stage = compiled.stages.get("fused")
    if stage is None:
        return None
    if stage.made_by == "fuse_if_faster":
        return "none: the cost model estimates the step faster unfused (see why)"
    return str(compiled.executor.region_stats)


def _estimated(g: TrainGraph, compiled: Compiled) -> StepCost | None:
    """The cost model's steady-state step of g on CUDA, computed once per compiled signature (seconds of CPU for a
    large graph); None on the CPU, where a GPU's rates mean nothing."""
    if g.settings.device.type != "cuda" or g.plan is None:
        return None
    if compiled.estimated is None:
        compiled.estimated = estimate(g, compiled.machine)
    return compiled.estimated
