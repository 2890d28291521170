"""One compiled step through the runtime: the batch onto the device, the store set up for the graph's plan, the
executor run, the loss scaler updated, and what the step measured.

A step's call comes here once its graph is compiled and the chunks hold the model (pstar_fx.api.step), and goes no
higher again: everything a step does to run is below this line.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..interrupts import DeferredInterrupt
from ..ir.fx_utils import bounded_live
from ..ir.graph import TrainGraph
from .executor import Executor
from .step_runtime import LossScaler, Runtime, StepStats


@dataclass(frozen=True)
class StepRun:
    """What one run of a compiled graph returned and measured."""
    outputs: list[torch.Tensor]      # the graph's outputs (a training step's: [loss, aux...], the loss the mean over
                                     # the ranks', each rank's aux its own)
    stats: StepStats
    per_node: list[int] | None       # debug=True: the device bytes measured after every node


def run_training_step(executor: Executor, tensors: list[torch.Tensor], interrupts: DeferredInterrupt, *,
                      scaler: LossScaler | None, started: float, debug: bool = False, before_node=None) -> StepRun:
    """Forward, backward and the update, atomically (see Executor.run). The optimizer states first move where this
    graph's plan keeps them; with several ranks the loss returned is the mean over the ranks' batches; the fp16 loss
    scaler is updated. `started`: time.perf_counter() at the start of the step's call (the stats' seconds count
    from it, compile included). `before_node(i, node)`: called before every node (fault injection in tests)."""
    g, store = executor.g, executor.store
    store.set_homes(g.chunks)
    rt = Runtime(g, store, scaler, executor.sites)
    inputs = [prepare_input(x, info.dtype, store.device) for x, info in zip(tensors, g.inputs)]
    scale = None
    if scaler is not None:
        scale = torch.tensor(scaler.scale, dtype=torch.float32, device=store.device)
        rt.found_inf = torch.zeros((), dtype=torch.bool, device=store.device)
    per_node: list[int] | None = [] if debug else None
    retries = alloc_retries(store.device)
    disk = (store.disk.read_bytes, store.disk.written_bytes) if store.disk is not None else (0, 0)
    events = _timing_events(store.device)
    outputs, peak = executor.run(inputs, scale, rt, interrupts, trace_peaks=per_node, before_node=before_node)
    if events is not None:
        events[1].record()
    if store.disk is not None:
        disk = (store.disk.read_bytes - disk[0], store.disk.written_bytes - disk[1])
    if retries is not None:
        retries = alloc_retries(store.device) - retries
    if store.comm is not None:        # the loss reported is the mean over every rank's batch
        outputs = [rt.mean_over_ranks(outputs[0])] + outputs[1:]
        # buffers the step wrote from each rank's own rows (BatchNorm's running statistics) become rank 0's on
        # every rank, as DDP's broadcast_buffers makes them: the ranks keep one model
        for name in executor.mutated_buffers:
            store.comm.broadcast(store.buffers[name], src=0)
    if scaler is not None:
        scaler.update(rt.skip)
    stats = StepStats(measured_peak=peak, h2d_bytes=rt.h2d, d2h_bytes=rt.d2h, skipped=rt.skip,
                      seconds=time.perf_counter() - started, lr=tuple(c.lr for c in rt.cfg), _grad_norm=rt.grad_norm,
                      alloc_retries=retries, disk_read_bytes=disk[0], disk_write_bytes=disk[1], _events=events)
    if per_node is not None:
        check_measured(g, per_node)
    return StepRun(outputs, stats, per_node)


def _timing_events(device: torch.device) -> tuple | None:
    """CUDA: a start event, recorded now on the current stream (it completes when the device reaches the step's
    work, after whatever it was still running), and an end event to record after the step (StepStats.device_seconds);
    None elsewhere."""
    if device.type != "cuda":
        return None
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    return start, end


def returned(g: TrainGraph, outputs: list[torch.Tensor]):
    """What a training step returns from its graph's outputs: the loss (detached, fp32), or (loss, aux) with aux
    rebuilt as the step function returned it, its tensors detached (ir/outputs.py)."""
    loss = outputs[0].detach().float()
    if g.aux is None:
        return loss
    return loss, g.aux.rebuild([t.detach() for t in outputs[1:]])


def run_forward(executor: Executor, tensors: list[torch.Tensor], interrupts: DeferredInterrupt, *,
                debug: bool = False) -> StepRun:
    """A forward-only graph (evaluation) over the chunks as they are: nothing is updated; a failure or a Ctrl-C
    before the end rolls back what it wrote (module buffers in train mode) like a failed step."""
    g, store = executor.g, executor.store
    rt = Runtime(g, store, None, executor.sites)
    inputs = [prepare_input(x, info.dtype, store.device) for x, info in zip(tensors, g.inputs)]
    per_node: list[int] | None = [] if debug else None
    with torch.no_grad():
        outputs, peak = executor.run(inputs, None, rt, interrupts, trace_peaks=per_node)
    stats = StepStats(measured_peak=peak, h2d_bytes=rt.h2d, d2h_bytes=rt.d2h, skipped=False)
    if per_node is not None:
        check_measured(g, per_node)
    return StepRun(outputs, stats, per_node)


def alloc_retries(device: torch.device) -> int | None:
    """How many times torch's CUDA caching allocator has retried an allocation after freeing its cache (each retry
    synchronizes the device and returns every cached block to the driver: idle GPU), so far in this process; None
    off CUDA."""
    if device.type != "cuda":
        return None
    return torch.cuda.memory_stats(device).get("num_alloc_retries", 0)


def prepare_input(x: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A batch tensor on the compute device, in the dtype it was traced with, with a storage of its own: the
    executor accounts storages, so a batch that is a view of a larger tensor is copied."""
    t = x.detach().to(device, dtype)
    if t.untyped_storage().nbytes() != t.numel() * t.element_size() or not t.is_contiguous():
        t = t.clone(memory_format=torch.contiguous_format)
    return t


def check_measured(g: TrainGraph, per_node: list[int]) -> None:
    """debug=True: the device bytes measured after every node equal the plan's prediction for it; where a storage of
    data-dependent size is alive, planned at its upper bound, they are at most the prediction (ir/fx_utils)."""
    bounded = bounded_live(g.nodes)
    for n, measured, loose in zip(g.nodes, per_node, bounded):
        a = g.ann[n.name]
        predicted = g.plan.static_bytes + a.resident_bytes + a.live_bytes + a.workspace_bytes
        if measured != predicted and not (loose and measured <= predicted):
            raise AssertionError(f"pstar-fx plan mismatch at node {n.name}: measured {measured} device bytes, "
                                 f"the plan predicted {predicted}")
