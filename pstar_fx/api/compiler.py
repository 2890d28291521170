"""Compiling a step for a batch's signature: trace, the passes, and the set-up that runs the result (the chunk store on
the first compile, an executor per signature), each signature compiled once and kept in a TraceCache.

The first compile of a training step also makes the ChunkStore, which every later signature shares: where the budget
cannot hold every optimizer state, host memory is faulted in while the step is traced, and the host buffers are laid
out in it as soon as the optimizer is placed, while the schedule pass runs (HostMemory).
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn

from ..cost import H200, Machine, StepCost
from ..errors import warn
from ..frontend.batch import check_has_data
from ..frontend.hook_keys import global_hooks_key, hook_changes, hooks_snapshot, module_key, params_key
from ..frontend.model_tensors import model_tables
from ..frontend.python_state import ModuleScalars, changes, closure_key, snapshot
from ..frontend.python_undo import ModelUndo
from ..frontend.trace import FlatBatch, flatten_batch, trace_step
from ..interrupts import DeferredInterrupt
from ..ir.graph import Settings, TrainGraph
from ..ir.needs import early_host_bytes, state_layout
from ..passes import assign_chunks, canonicalize, liveness, loss_rows, pipeline, run_passes
from ..passes.place_optimizer import min_need, place_optimizer
from ..passes.remat import least_need_graph
from ..runtime.chunk_store import ChunkStore
from ..runtime.host_buffers import host_buffer_specs
from ..runtime.comm import Comm
from ..runtime.compiled_regions import RegionCompiler
from ..runtime.executor import Executor
from ..runtime.host_memory import HostMemory, local_ranks, spare_host_bytes
from .agreement import check_same_compile
from .guarded import GuardVariants, traced_outcomes
from .plan_reuse import reusable
from .trace_cache import DEFAULT_MAX_SIZE, TraceCache
from .warnings import warn_chunk_padding, warn_host_threads

VALUE_RETRACES_WARN = 4   # compiles caused by changed plain Python values, then a warning

STAGE_NAMES = ("traced", "canonical", "loss_rows", "chunked", "liveness", "remat", "optimizer_placed", "scheduled")
# + "sharded" (2+ ranks), + "fused" (fuse=True)


@contextlib.contextmanager
def cycle_collection_paused():
    """Python's cyclic garbage collector off while a step is traced and planned, and one collection at the end.

    Tracing and the passes make millions of objects that stay alive (fake tensors, fx nodes), so every automatic
    full collection walks them all: planning the 17B GPT of BENCHMARKS.md on this project's CPU machine ran 8 of
    them, 2.4-2.7 s, and took 18.4 s without them against 20.3-23.7 s with. The one collection at the end frees the
    cycles the passes dropped (discarded fx graphs); without it the first automatic collection of the training loop
    would pay the same in a step. It collects the youngest generation only: everything made while the collector was
    off is there, and the caller's older objects are not walked again. A collector the caller had turned off stays
    off, uncollected.

    Yields `collect_now()`: that collection at once (where the caller has a better moment for it, such as while
    host memory is still being faulted in); the one at the end then walks only what was made after it."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield (lambda: gc.collect(0)) if was else (lambda: 0)
    finally:
        if was:
            gc.enable()
            gc.collect(0)


@contextlib.contextmanager
def one_intra_op_thread():
    """The calling thread's torch ops on one intra-op thread while a step is traced and planned, its own setting
    restored after. The passes compute on tensors of one element per node (remat's replay of liveness, the
    schedule's free bytes): an OpenMP team of every core is slower at that size than one thread, and stalls while
    threads beside it fault host memory in (`HostMemory.prefault`): on this project's 2-core CI machine, ops on 24k
    elements took 3.5 times as long beside one faulting thread with two intra-op threads, unchanged with one; on the
    H200 machine the remat pass took 6.4 s beside the faulting against 2.05 s alone (BENCHMARKS.md).
    torch's setting is per thread, but a thread that first uses torch meanwhile starts with one intra-op thread:
    HostMemory counts its threads before."""
    n = torch.get_num_threads()
    if n == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


@dataclass
class Compiled:
    """One compiled signature: every stage of its pipeline, and the executor that runs the last one."""
    stages: dict[str, TrainGraph]
    executor: Executor
    setup_seconds: float = 0.0       # the store (on the first compile), the executor, the garbage collection
    set_up_until: float = 0.0        # perf_counter() when the executor was made
    estimated: StepCost | None = None   # the cost model's step, once step.summary() has asked (CUDA)
    machine: Machine = H200          # the rates the passes planned at and the estimate is made with
    outcomes: tuple = ()             # what its trace decided at each guard, in order (ir/guards.py)
    writes_state: bool = False       # its trace changed the model's key: never run again from the cache
                                     # (api/plan_reuse.py)
    plan_reused: bool = False        # its trace equal to an earlier one's, whose plan and executor it took


Layout = tuple   # (params, chunks, chunk_size) of the first compile: every later signature keeps the same chunks


class Compiler:
    """Compiles `fn(model, *batch)` for each batch signature it is called with, and keeps the results.

    `optimizer` (the live optimizer, None for a forward-only function) is attached to the chunk store once the
    first compile makes it. A model's train/eval modes and requires_grad flags are part of the signature."""

    def __init__(self, fn: Callable, model: nn.Module, settings: Settings, comm: Comm | None, optimizer, *,
                 remat: bool, prefetch: int | None, cache_size: int = DEFAULT_MAX_SIZE, fuse: bool = False,
                 fuse_auto: bool = False, offload_dir: str | None = None, machine: Machine = H200):
        self.fn = fn
        self.machine = machine           # the rates the passes weigh their choices at (api/options.resolve_machine)
        self.fuse = fuse
        self.fuse_auto = fuse_auto       # fuse=None: the regions kept only where the cost model estimates them faster
        self.regions = RegionCompiler()  # fused regions compiled for any signature, shared by the next
        self.model = model
        self.settings = settings
        self.comm = comm
        self.optimizer = optimizer
        self.remat = remat
        self.prefetch = prefetch
        self.offload_dir = offload_dir   # the disk tier's directory (the store makes its files there)
        self.tables = model_tables(model)
        self.scalars = ModuleScalars(model)   # the modules' plain attributes, part of the signature
        self.cache: TraceCache[Compiled] = TraceCache(max_size=cache_size)
        self.variants = GuardVariants()  # per signature: the guard outcomes compiled for it (api/guarded.py)
        self.compiles = 0                # traces compiled so far
        self.plans = 0                   # of them, those planned (the others took the plan of an equal trace)
        self.latest: Compiled | None = None
        self.undo: ModelUndo | None = None   # the model's Python state before the latest trace (take_undo)
        self.warned_input_grad = False   # a batch tensor with requires_grad was seen (warned once)
        self._values: tuple | None = None  # python_state.snapshot and hook_keys.hooks_snapshot at the last compile
        self._value_retraces = 0           # compiles after which plain values or hooks had changed
        self.store: ChunkStore | None = None
        self.layout: Layout | None = None

    def model_key(self, portable: bool = False) -> tuple:
        """What of the model a trace depends on besides the batch: each module's train/eval mode, plain attributes
        and hooks, each parameter's requires_grad and gradient hooks, and the plain values the step function reads
        from its closure and globals (frontend/python_state.py; a change of any retraces). `portable`: hooks by
        number, not identity, and no plain values (what the ranks compare: the same on every rank running the same
        code, whose rank number a value may hold without changing the graph)."""
        modules = tuple(self.model.modules())
        return (tuple(module_key(m, portable) for m in modules), params_key(modules, portable),
                global_hooks_key(portable),
                () if portable else (self.scalars.read(modules), closure_key(self.fn)))

    def get(self, batch, interrupts: DeferredInterrupt, prefix: tuple = ()) -> tuple[Compiled, FlatBatch]:
        """The compiled step for this batch's signature (compiling it on first sight), and the flattened batch.
        A signature may have several, one per outcome of its guards: the one run last is taken, or with `prefix`
        (guard outcomes a run observed, in order) the latest whose outcomes start so, else a new trace that takes
        them. `interrupts` is held by the caller: a Ctrl-C is delivered after the trace and after each pass (nothing
        is set up yet), and otherwise waits for the caller's next safe point."""
        flat = flatten_batch(batch)
        check_has_data(flat, "step(*batch)")
        if not self.warned_input_grad and any(t.requires_grad for t in flat.tensors):
            self.warned_input_grad = True
            warn("a batch tensor requires grad: pstar-fx differentiates the loss with respect to the model's "
                 "trainable parameters only, so the tensor gets no .grad (nor do the parameters: the step updates "
                 "them itself); detach it, or compute what needs its gradient outside the step")
        base = (flat.signature, self.model_key())
        compiled = self.cached(base, prefix)
        if compiled is None:
            self._note_value_changes()
            with cycle_collection_paused() as collect_now:   # counted in the set-up time (the collection at the end)
                compiled = self._compile(batch, collect_now, interrupts, prefix, base)
            compiled.setup_seconds += time.perf_counter() - compiled.set_up_until
            self.cache.put(base + (compiled.outcomes,), compiled)
        self.variants.note(base, compiled.outcomes)
        self.latest = compiled
        return compiled, flat

    def cached(self, base: tuple, prefix: tuple = (), look: bool = True) -> Compiled | None:
        """The compiled step get() runs for the key `base` (guard outcomes starting with `prefix`: the latest run),
        if one is cached; never one whose trace changed the key (api/plan_reuse.py). `look`: as a cache hit (the
        least recently used order, cache.last), else leaving the cache as it is."""
        for outcomes in self.variants.candidates(base, prefix):
            compiled = (self.cache.get if look else self.cache.peek)(base + (outcomes,))
            if compiled is not None and not compiled.writes_state:
                return compiled
        return None

    def take_undo(self) -> ModelUndo | None:
        """The model's Python state before the latest trace, for a call that may trace again (api/guarded.py), and
        forgotten here: it holds what the model held (an RNN's weak references to its weights, which a later swap of
        the tensors refuses while they live), so it lives no longer than that call."""
        undo, self.undo = self.undo, None
        return undo

    def will_trace(self, batch) -> bool:
        """Whether get(batch) would trace. The ranks compare it before a step (api/agreement.check_same_step)."""
        return self.cached((flatten_batch(batch).signature, self.model_key()), look=False) is None

    def _note_value_changes(self) -> None:
        """Before a compile: warn once when plain Python values the step reads (python_state) or the model's hooks
        have changed before VALUE_RETRACES_WARN compiles, naming them (a value that changes every step, or a hook
        added at every call, compiles every step). Keeps the snapshots for the next compile."""
        now = (snapshot(self.model, self.fn), hooks_snapshot(self.model))
        if self._values is not None:
            values, hooks = changes(self._values[0], now[0]), hook_changes(self._values[1], now[1])
            if values or hooks:
                self._value_retraces += 1
                if self._value_retraces == VALUE_RETRACES_WARN:
                    what = " and ".join(w for w, c in (("plain Python values it reads", values),
                                                       ("the model's hooks", hooks)) if c)
                    warn((f"pstar-fx: the step was compiled again {self._value_retraces} times because {what} "
                         f"changed ({'; '.join((values + hooks)[:4])}): each new value or hook traces the step "
                         "again (and plans it again, unless its graph is one planned before). "
                         + ("Pass a value that changes every step as a tensor (a 0-d tensor argument, or a buffer), "
                            "which one graph serves for every value; keep state the step itself updates (a counter "
                            "in forward) in a buffer or outside the step. " if values else "")
                         + ("Register hooks once, before the first step, not in forward or in the step function."
                            if hooks else "")).rstrip())
        self._values = now

    def reserve(self, batch, interrupts: DeferredInterrupt) -> None:
        """Compile for this batch's signature now (raising BudgetError now if it does not fit) and keep it compiled
        for good: no entry of this batch signature is evicted from the cache (TraceCache.pin), so a batch of it never
        plans again."""
        self.cache.check_room_to_pin()
        self.get(batch, interrupts)
        self.take_undo()                    # (no call of the step to trace again in)
        self.cache.pin(self.cache.last)

    def _compile(self, batch, collect_now, interrupts: DeferredInterrupt, assume: tuple = (),
                 base: tuple = ()) -> Compiled:
        """Trace and plan the step for `batch` (whose cache key is `base` + the trace's guard outcomes). A trace equal
        to a step's planned before for the same signature takes its plan (api/plan_reuse.py)."""
        st = self.settings
        first = self.store is None and self.optimizer is not None      # the first compile makes the store
        hostmem = HostMemory(pin=st.device.type == "cuda") if first else None
        if first:
            # where the budget cannot hold every optimizer state, host memory is faulted in while the step is
            # traced; the buffers are laid out in it once the optimizer is placed
            early = early_host_bytes(self.tables.params, st.precision, st.world, st.budget,
                                     state_layout(st))
            if early:
                spare = spare_host_bytes(local_ranks(st.world))
                hostmem.prefault(min(early, spare, st.host_budget or spare))   # (host_memory bounds it too)

        def set_up_early(stage: TrainGraph) -> None:
            interrupts.deliver()        # a safe point between passes
            # the first compile's host buffers are known once the optimizer is placed: make them while the
            # schedule pass runs
            if stage.stage == "optimizer_placed" and first:
                hostmem.reserve(host_buffer_specs(stage.chunks, st.precision, st.world, state_layout(st)))
        try:
            with one_intra_op_thread():
                self.undo = ModelUndo(self.model)
                traced = trace_step(self.fn, self.model, batch, st, assume, self.undo)
                writes = self.model_key() != base[1]
                self.compiles += 1
                outcomes = traced_outcomes(traced)
                interrupts.deliver()    # a safe point after the trace
                same = None if first else reusable(self.cache.items(), base + (outcomes,), traced)
                if same is not None:
                    if self.comm is not None:   # (the collective every rank's compile makes, planned or not)
                        check_same_compile(self.comm, same.executor.g, self.optimizer,
                                           prefetch=self.prefetch, remat=self.remat, fuse=self.fuse)
                    now = time.perf_counter()
                    return dataclasses.replace(same, stages={**same.stages, "traced": traced}, setup_seconds=0.0,
                                               set_up_until=now, writes_state=writes, plan_reused=True)
                self.plans += 1
                passes = pipeline(chunk_size=st.chunk_size, layout=self.layout, prefetch=self.prefetch,
                                  remat=self.remat, world=st.world, fuse=self.fuse, fuse_auto=self.fuse_auto,
                                  machine=self.machine)
                stages = run_passes(traced, passes, after=set_up_early)
                if self.comm is not None:     # the settings and the plan's collectives, alike on every rank
                    check_same_compile(self.comm, stages[-1], self.optimizer, prefetch=self.prefetch,
                                       remat=self.remat, fuse=self.fuse)
        except BaseException:
            if hostmem is not None:
                hostmem.cancel()
            raise
        final = stages[-1]
        t0 = time.perf_counter()
        if self.store is None:
            warn_chunk_padding(final)
            warn_host_threads(final)
            self.layout = (final.params, final.chunks, final.chunk_size)
            # the passes' garbage now: on a first compile the store below waits for host memory still being
            # faulted in, and the collection (0.36 s at 17B) runs beside that instead of after it
            collect_now()
            self.store = ChunkStore(final.chunks, final.params, st.precision, st.device, st.budget, comm=self.comm,
                                    hostmem=hostmem, state=state_layout(st), offload_dir=self.offload_dir,
                                    host_is_device=st.host_is_device)
            if self.optimizer is not None:
                try:
                    self.optimizer.attach(self.store)
                except BaseException:
                    # refused (an optimizer state loaded before the first step that this step cannot take): the
                    # compile keeps nothing, so the next call lays the chunks out from its own trace
                    self.store = self.layout = None
                    raise
        executor = Executor(final, self.store, self.regions, between=interrupts.deliver)   # (Ctrl-C: between regions)
        now = time.perf_counter()
        return Compiled(stages={s.stage: s for s in stages}, executor=executor, setup_seconds=now - t0,
                        set_up_until=now, outcomes=outcomes, machine=self.machine, writes_state=writes)

    def min_device_memory(self, batch) -> int:
        """The smallest device_memory (bytes) under which the step compiles for this batch's shapes, with this
        chunk layout: every optimizer state on the host and only what each node itself needs on the device, with
        the activations recomputed that lower it most (unless remat=False)."""
        with DeferredInterrupt() as interrupts, cycle_collection_paused():   # Ctrl-C: after the trace, or at the end
            traced = trace_step(self.fn, self.model, batch, self.settings)
            interrupts.deliver()
            passes = [p for p in pipeline(chunk_size=self.settings.chunk_size, layout=self.layout, prefetch=0,
                                          world=self.settings.world)
                      if getattr(p, "func", p) in (canonicalize, loss_rows, assign_chunks, liveness)]
            before = run_passes(traced, passes)[-1]
            if self.remat:
                before = least_need_graph(before)
            # (undo buffers are host memory, beside the point here: a forced count of them is not asked for)
            host_only = before.evolve(settings=dataclasses.replace(before.settings, budget=0, host_budget=None,
                                                                   undo_updates=None))
            return min_need(place_optimizer(host_only))

