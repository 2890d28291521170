"""`px.compile`: the one decorator users apply, and the CompiledStep it returns."""
from __future__ import annotations

import dataclasses
import functools
import math
import os
import threading
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn

from . import checkpoint, timeline
from .agreement import check_same_step, check_same_values
from .cache import TraceCache
from .checks import warn_chunk_padding, warn_host_threads
from .errors import CommitError, PstarError
from .ir.fx_utils import bounded_live, cycle_collection_paused, one_intra_op_thread
from .frontend.init_empty import fill_chunks, is_empty
from .ir.graph import ChunkGroup, Precision, Role, Settings, StateHome, TrainGraph
from .optim import OptimizerSpec
from .optimizer import build as build_optimizer
from .ownership import ModelHold, current_values, hold, holder, holders, model_tensors
from .passes import assign_chunks, canonicalize, collectives, liveness, pipeline, run_passes
from .ir.needs import early_host_bytes, state_bytes
from .passes.place_optimizer import min_need, place_optimizer
from .passes.remat import least_need_graph
from .runtime.chunk_store import ChunkStore, host_buffer_specs
from .runtime.host_memory import HostMemory, spare_host_bytes
from .runtime.comm import Comm, default_comm
from .runtime.executor import Executor, LossScaler, Runtime, StepStats
from .interrupts import DeferredInterrupt
from .frontend.trace import FlatBatch, flatten_batch, model_tables, trace_step
from .units import format_bytes, parse_bytes

STAGE_NAMES = ("traced", "canonical", "chunked", "liveness", "remat", "optimizer_placed", "scheduled")  # + "sharded"


def _resolve_device(device) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    d = torch.device(device)
    if d.type not in ("cuda", "cpu"):
        raise ValueError(f"device must be 'cuda' or 'cpu', got {device!r}")
    if d.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but torch sees no CUDA device; use device='cpu' or None")
    if d.type == "cuda" and d.index is None:
        d = torch.device("cuda", torch.cuda.current_device())
    return d


def _resolve_precision(precision, device: torch.device) -> Precision:
    if precision is None:
        return Precision.BF16 if device.type == "cuda" else Precision.FP32
    try:
        return Precision(precision)
    except ValueError:
        raise ValueError(f"precision must be one of 'fp32', 'bf16', 'fp16', got {precision!r}") from None


def _resolve_budget(device_memory, device: torch.device) -> int:
    if device_memory is not None:
        return parse_bytes(device_memory)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _locked(method):
    """The step's lock held over a method: another thread's step, save or load waits for it."""
    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)
    return locked


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

    def __str__(self) -> str:
        rows = [
            ("chunks", f"{self.chunks}: {self.chunks - self.own_chunks} of {self.chunk_size} elements "
                       f"({format_bytes(self.chunk_bytes)} each), {self.own_chunks} sized to one larger tensor"),
            ("model data", format_bytes(self.model_data_bytes) + " (params + grads + optimizer states)"),
            ("budget", "unlimited" if self.budget is None else format_bytes(self.budget)),
            ("optimizer states", f"{self.states_on_device} of {self.trainable_chunks} chunks on the device"),
            ("predicted peak", format_bytes(self.predicted_peak)),
            ("measured peak", "-" if self.measured_peak is None else format_bytes(self.measured_peak)),
            ("moved per step", f"{format_bytes(self.h2d_bytes)} host->device, "
                               f"{format_bytes(self.d2h_bytes)} device->host"),
            ("graph", f"{self.nodes} nodes"),
            ("compiled in", "{:.1f} s trace + {:.1f} s passes + {:.1f} s set-up".format(*self.compile_seconds)),
        ]
        return "\n".join(f"{k:>17s}: {v}" for k, v in rows)


@dataclass
class _Compiled:
    stages: dict[str, TrainGraph]
    executor: Executor
    setup_seconds: float = 0.0       # the store (on the first compile), the executor, the garbage collection
    set_up_until: float = 0.0        # perf_counter() when the executor was made


class CompiledStep:
    """A training step compiled for a model: call it with a batch to run forward, backward and the update."""

    def __init__(self, fn: Callable, model: nn.Module, optimizer: OptimizerSpec, *, device_memory=None,
                 precision: str | None = None, chunk_size: int | None = None, device=None, debug: bool = False,
                 prefetch: int | None = None, max_grad_norm: float | None = None, accumulate: int = 1, remat="auto",
                 atomic: bool = True):
        if not isinstance(model, nn.Module):
            raise TypeError(f"px.compile: model must be a torch.nn.Module, got {type(model).__name__}")
        if optimizer is not None and not isinstance(optimizer, OptimizerSpec):
            raise TypeError("px.compile: optimizer must be px.Adam(...) or px.AdamW(...) (or None for a "
                            f"forward-only evaluation function), got {type(optimizer).__name__}")
        if chunk_size is not None and (not isinstance(chunk_size, int) or isinstance(chunk_size, bool)
                                       or chunk_size <= 0):
            raise ValueError(f"chunk_size must be a positive int number of elements, got {chunk_size!r}"
                             + (f" (a float: write {int(chunk_size)} or int({chunk_size!r}))"
                                if isinstance(chunk_size, float) and chunk_size.is_integer() and chunk_size > 0
                                else ""))
        if prefetch is not None and (not isinstance(prefetch, int) or isinstance(prefetch, bool) or prefetch < 0):
            raise ValueError(f"prefetch must be a number of nodes >= 0 (or None: as early as the budget allows), got "
                             f"{prefetch!r}")
        if max_grad_norm is not None and (not isinstance(max_grad_norm, (int, float)) or isinstance(max_grad_norm, bool)
                                          or not math.isfinite(max_grad_norm) or max_grad_norm <= 0):
            raise ValueError(f"max_grad_norm must be a positive finite number (or None), got {max_grad_norm!r}")
        if not isinstance(accumulate, int) or isinstance(accumulate, bool) or accumulate < 1:
            raise ValueError(f"accumulate must be a number of micro-batches >= 1, got {accumulate!r}")
        if remat not in ("auto", True, False):
            raise ValueError(f"remat must be 'auto' (recompute activations where the budget needs it) or False, "
                             f"got {remat!r}")
        if not isinstance(atomic, bool):
            raise ValueError(f"atomic must be True or False, got {atomic!r}")
        self._remat = remat is not False
        self._fn = fn
        self._model = model
        dev = _resolve_device(device)
        prec = _resolve_precision(precision, dev)
        self._optimizer = build_optimizer(optimizer, model) if optimizer is not None else None
        self._comm: Comm | None = default_comm(dev)   # the default process group, when one of 2+ ranks exists
        self.settings = Settings(precision=prec, device=dev, budget=_resolve_budget(device_memory, dev),
                                 chunk_size=chunk_size,
                                 optimizer=self._optimizer.layout if self._optimizer is not None else None,
                                 max_grad_norm=None if max_grad_norm is None else float(max_grad_norm),
                                 accumulate=accumulate, world=1 if self._comm is None else self._comm.world,
                                 atomic=atomic)
        if not atomic and self.settings.world > 1:
            raise ValueError(f"atomic=False is not supported with more than one rank (this process group has "
                             f"{self.settings.world}): leave atomic=True")
        self.debug = debug
        self.prefetch = prefetch
        self._cache: TraceCache[_Compiled] = TraceCache()
        self._latest: _Compiled | None = None
        self._store: ChunkStore | None = None
        self._hold: ModelHold | None = None  # this step's claim on the model's values, once its chunks took them
        self._layout = None
        self._scaler = LossScaler() if prec is Precision.FP16 else None
        self._last_stats: StepStats | None = None
        self._measured: tuple[TrainGraph, list[int]] | None = None   # debug: device bytes after every node
        self._broken: str | None = None      # set when a step failed after its commit point
        self._before_node = None             # tests: called before every node (fault injection)
        self._lock = threading.RLock()       # held by a step, save and load: another thread never sees half a step
        self._tables = model_tables(model)
        # every state_dict name (tied aliases too) -> (PARAM or BUFFER, the name the store keeps it under)
        self._state_names: dict[str, tuple[Role, str]] = {
            **{n: (Role.PARAM, p.name) for p in self._tables.params for n in (p.name,) + p.aliases},
            **{n: (Role.BUFFER, b.name) for b in self._tables.buffers for n in (b.name,) + b.aliases}}
        self.__wrapped__ = fn

    # -- compiling --------------------------------------------------------------------------------------------
    def _compile(self, batch, interrupts: DeferredInterrupt) -> _Compiled:
        """Trace, plan and set up for this batch's signature. `interrupts` is held by the caller: a Ctrl-C is
        delivered after the trace and after each pass (nothing is set up yet), and otherwise waits for the caller's
        next safe point."""
        with cycle_collection_paused() as collect_now:   # counted in the set-up time (the collection at the end)
            compiled = self._compile_collected(batch, collect_now, interrupts)
        compiled.setup_seconds += time.perf_counter() - compiled.set_up_until
        return compiled

    def _compile_collected(self, batch, collect_now, interrupts: DeferredInterrupt) -> _Compiled:
        st = self.settings
        first = self._store is None and self._optimizer is not None      # the first compile makes the store
        hostmem = HostMemory(pin=st.device.type == "cuda") if first else None
        if first:
            # where the budget cannot hold every optimizer state, host memory is faulted in while the step is
            # traced; the buffers are laid out in it once the optimizer is placed
            early = early_host_bytes(self._tables.params, st.precision, st.world, st.budget)
            if early:
                hostmem.prefault(min(early, spare_host_bytes(int(os.environ.get("LOCAL_WORLD_SIZE", st.world)))))

        def set_up_early(stage: TrainGraph) -> None:
            interrupts.deliver()        # a safe point between passes
            # the first compile's host buffers are known once the optimizer is placed: make them while the
            # schedule pass runs
            if stage.stage == "optimizer_placed" and first:
                hostmem.reserve(host_buffer_specs(stage.chunks, st.precision, st.world))
        try:
            with one_intra_op_thread():
                traced = trace_step(self._fn, self._model, batch, st)
                interrupts.deliver()    # a safe point after the trace
                passes = pipeline(chunk_size=st.chunk_size, layout=self._layout, prefetch=self.prefetch,
                                  remat=self._remat, world=st.world)
                stages = run_passes(traced, passes, after=set_up_early)
        except BaseException:
            if hostmem is not None:
                hostmem.cancel()
            raise
        final = stages[-1]
        if self._comm is not None:
            self._comm.check_same(collectives(final), "the collectives of the compiled step")
        t0 = time.perf_counter()
        if self._store is None:
            warn_chunk_padding(final)
            warn_host_threads(final)
            self._layout = (final.params, final.chunks, final.chunk_size)
            # the passes' garbage now: on a first compile the store below waits for host memory still being
            # faulted in, and the collection (0.36 s at 17B) runs beside that instead of after it
            collect_now()
            self._store = ChunkStore(final.chunks, final.params, self.settings.precision, self.settings.device,
                                     self.settings.budget, comm=self._comm, hostmem=hostmem)
            if self._optimizer is not None:
                self._optimizer.attach(self._store)
        executor = Executor(final, self._store)
        now = time.perf_counter()
        return _Compiled(stages={s.stage: s for s in stages}, executor=executor, setup_seconds=now - t0,
                         set_up_until=now)

    def holds_model(self) -> bool:
        """Whether this step's chunks hold every tensor of the model now (it has run, and no sync_model() or other
        step took the model since)."""
        return self._hold is not None and all(holder(t) is self._hold for t in model_tensors(self._model).values())

    def _holders(self) -> list[ModelHold]:
        """Whatever holds any of the model's tensors now (this step's hold among them, or other steps')."""
        return holders(self._model)

    def _take_model(self) -> None:
        """Make the chunks hold the model's current values. If this step holds the model already, nothing to do;
        otherwise (first step, after sync_model(), or held by another step, whole or in part) every holder gives its
        values back first, then they are copied in and held."""
        if self.holds_model():
            return
        for h in self._holders():
            h.give_back()                  # then the values are the model's
        tensors = model_tensors(self._model)
        on_meta = [n for n, t in tensors.items() if t.is_meta]
        if on_meta:
            raise ValueError(f"the model's tensors {on_meta[:3]}{'...' if len(on_meta) > 3 else ''} are on the "
                             "meta device: pstar-fx copies the model's values into its chunks at the first "
                             "step, so give it a model with real values, or build it under px.init_empty()")
        if self._comm is not None:         # every rank starts from the same values (a collective)
            check_same_values(self._comm, tensors)
        named = dict(self._model.named_parameters())
        # a model built under px.init_empty() is initialised in the chunks themselves (see pstar_fx.frontend.init_empty)
        params, buffers = fill_chunks(self._store, {p.name: named[p.name] for p in self._layout[0]},
                                      {b.name: tensors[b.name] for b in self._tables.buffers})
        self._store.values.load_params(params)
        self._store.values.load_buffers(buffers)
        if self._hold is None or self._hold.store is not self._store:
            self._hold = ModelHold(self, self._model, self._store, self._state_names, self._lock)
        hold(self._model, self._hold)

    def _fill_if_empty(self) -> None:
        """A model built under px.init_empty() gets its values in this step's chunks once the step has them."""
        if self._store is not None and any(is_empty(t) for t in model_tensors(self._model).values()):
            self._take_model()

    @_locked
    def sync_model(self) -> nn.Module:
        """Write the current values (parameters at full precision, and buffers) back into the model and give it back
        to the user: it can be used, saved or edited eagerly. The values come from whichever step holds each of the
        model's tensors (this one, or another step compiled on the model, on a part of it, or on a model sharing
        tensors with it). The next step copies the model into the chunks again, so edits made in between are
        trained on. Returns the model. With several ranks, a collective."""
        self._fill_if_empty()
        for h in self._holders():
            h.give_back()
        return self._model

    @property
    def graphs(self) -> dict[str, TrainGraph]:
        """Every stage of the latest compiled signature, in pipeline order ("traced" first, "scheduled" last)."""
        if self._latest is None:
            raise RuntimeError("nothing is compiled yet: call the step once (or step.lower(*batch))")
        return dict(self._latest.stages)

    @property
    def final_graph(self) -> TrainGraph:
        """The graph the step runs: the last stage ("scheduled"; "sharded" with more than one rank)."""
        return list(self.graphs.values())[-1]

    def lower(self, *batch) -> dict[str, TrainGraph]:
        """Compile for this batch's shapes without running a step; returns the stages."""
        with DeferredInterrupt() as interrupts:        # Ctrl-C: between compile phases only (see _compile)
            self._latest, _ = self._get(batch, interrupts)
        return self.graphs

    def min_device_memory(self, *batch) -> int:
        """The smallest device_memory (bytes) under which this step compiles for this batch's shapes, with this
        chunk layout: every optimizer state on the host and only what each node itself needs on the device, with the
        activations recomputed that lower it most (unless remat=False)."""
        with DeferredInterrupt() as interrupts, cycle_collection_paused():   # Ctrl-C: after the trace, or at the end
            traced = trace_step(self._fn, self._model, batch, self.settings)
            interrupts.deliver()
            passes = [p for p in pipeline(chunk_size=self.settings.chunk_size, layout=self._layout, prefetch=0,
                                          world=self.settings.world)
                      if getattr(p, "func", p) in (canonicalize, assign_chunks, liveness)]
            before = run_passes(traced, passes)[-1]
            if self._remat:
                before = least_need_graph(before)
            host_only = before.evolve(settings=dataclasses.replace(before.settings, budget=0))
            return min_need(place_optimizer(host_only))

    def _get(self, batch, interrupts: DeferredInterrupt) -> tuple[_Compiled, FlatBatch]:
        """The compiled step for this batch's signature (compiling it on first sight), and the flattened batch."""
        flat = flatten_batch(batch)
        key = (flat.signature, self._model_key())
        compiled = self._cache.get(key)
        if compiled is None:
            compiled = self._compile(batch, interrupts)
            self._cache.put(key, compiled)
        return compiled, flat

    def _model_key(self) -> tuple:
        """What of the model a trace depends on besides the batch: each module's train/eval mode and each
        parameter's requires_grad (a change of either retraces)."""
        return (tuple(m.training for m in self._model.modules()),
                tuple(p.requires_grad for p in self._model.parameters()))

    # -- running ----------------------------------------------------------------------------------------------
    def __call__(self, *batch) -> torch.Tensor:
        """One training step on this batch; returns the loss. Atomic (see Executor.run): a failure before the commit
        point leaves every value as it was. Another thread's save() or load() waits for the step (a lock). Ctrl-C is
        held over the whole call and taken only at safe points: after the trace, between the passes, and between
        nodes before the commit point, where it raises KeyboardInterrupt and the step changes nothing (a compile
        that finished is kept: the next call does not trace again); from the commit point on the step completes,
        then raises it (it counts as done). A hang inside one operation is ended by the process group's timeout
        (px.DistributedError); see pstar_fx/interrupts.py."""
        # the lock and Ctrl-C held here, not in a helper: warnings' stack levels count from here
        with self._lock, DeferredInterrupt() as interrupts:
            if self._broken is not None:
                raise CommitError(self._broken)
            if torch.is_inference_mode_enabled() or not torch.is_grad_enabled():
                ctx = "torch.inference_mode()" if torch.is_inference_mode_enabled() else "torch.no_grad()"
                raise PstarError(f"pstar-fx step called under {ctx}; a training step needs grad mode; use "
                                 "px.compile(model, optimizer=None) for forward-only evaluation")
            t0 = time.perf_counter()
            if self._comm is not None:     # before this step's first collective (a compile's own included)
                check_same_step(self._comm, batch, self._model, self._model_key())
            compiled, flat = self._get(batch, interrupts)
            self._latest = compiled
            interrupts.deliver()          # a safe point: compiled, nothing else done yet
            g = compiled.executor.g
            store = self._store
            self._take_model()
            store.set_homes(g.chunks)
            rt = Runtime(g, store, self._scaler)
            inputs = [self._prepare_input(x, info.dtype) for x, info in zip(flat.tensors, g.inputs)]
            scale = None
            if self._scaler is not None:
                scale = torch.tensor(self._scaler.scale, dtype=torch.float32, device=self.settings.device)
                rt.found_inf = torch.zeros((), dtype=torch.bool, device=self.settings.device)
            per_node: list[int] | None = [] if self.debug else None
            try:
                outputs, peak = compiled.executor.run(inputs, scale, rt, interrupts, trace_peaks=per_node,
                                                      before_node=self._before_node)
                loss = outputs[0]
                if self._comm is not None:        # the loss reported is the mean over every rank's batch
                    loss = self._comm.all_reduce(loss.detach().float().clone()) / self._comm.world
            except CommitError as e:
                self._broken = str(e)
                raise

            if self._scaler is not None:
                self._scaler.update(rt.skip)
            self._last_stats = StepStats(measured_peak=peak, h2d_bytes=rt.h2d, d2h_bytes=rt.d2h, skipped=rt.skip,
                                         seconds=time.perf_counter() - t0, lr=tuple(c.lr for c in rt.cfg),
                                         _grad_norm=rt.grad_norm)
            if per_node is not None:
                self._measured = (g, per_node)
                _check_measured(g, per_node)
            return loss.detach().float()

    def _prepare_input(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        t = x.detach().to(self.settings.device, dtype)
        # the executor accounts storages: a batch that is a view of a larger tensor gets its own storage
        if t.untyped_storage().nbytes() != t.numel() * t.element_size() or not t.is_contiguous():
            t = t.clone(memory_format=torch.contiguous_format)
        return t

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The live optimizer: torch.optim.AdamW's (or Adam's) param_groups, read at every step (set lr between
        steps, or drive it with a torch.optim.lr_scheduler), and its state_dict() / load_state_dict() in torch's
        format. The compiled step runs its update: do not call step.optimizer.step()."""
        return self._optimizer

    @property
    def last_step(self) -> StepStats | None:
        """Measurements of the most recent step: peak device bytes, bytes moved, whether it was skipped."""
        return self._last_stats

    @property
    def loss_scale(self) -> float | None:
        return None if self._scaler is None else self._scaler.scale

    def summary(self) -> Summary:
        g = self.final_graph
        prec = self.settings.precision
        trainable = [c for c in g.chunks if c.group is ChunkGroup.TRAINABLE]
        model_data = (sum(c.nbytes for c in g.chunks) + sum(c.nbytes for c in trainable if not c.grad_inplace)
                      + sum(state_bytes(c, prec) for c in trainable))
        own = sum(c.capacity > g.chunk_size for c in g.chunks)
        return Summary(
            chunks=len(g.chunks), chunk_size=g.chunk_size, chunk_bytes=g.chunk_size * prec.dtype.itemsize,
            own_chunks=own, model_data_bytes=model_data, budget=g.settings.budget,
            states_on_device=sum(c.state_home is StateHome.DEVICE for c in trainable), trainable_chunks=len(trainable),
            predicted_peak=g.plan.predicted_peak,
            measured_peak=None if self._last_stats is None else self._last_stats.measured_peak,
            h2d_bytes=g.plan.h2d_bytes, d2h_bytes=g.plan.d2h_bytes, nodes=len(g.nodes),
            compile_seconds=(self._latest.stages["traced"].seconds,
                             sum(st.seconds for name, st in self._latest.stages.items() if name != "traced"),
                             self._latest.setup_seconds))

    def memory_timeline(self) -> list[timeline.Row]:
        """Per node of the latest compiled step: predicted device bytes by kind, chunk moves, and the bytes measured
        after it by the latest debug=True call if that call ran this signature (else None). See pstar_fx.timeline."""
        return timeline.memory_timeline(self.final_graph, self._measured)

    # -- state ------------------------------------------------------------------------------------------------
    @_locked
    def save(self, path) -> None:
        """Write a checkpoint directory that resumes exactly (see pstar_fx.checkpoint)."""
        checkpoint.save(self, path)

    @_locked
    def load(self, path) -> None:
        """Restore a checkpoint written by save(), before the first step or after a failed one too."""
        checkpoint.load(self, path)

    @_locked
    def state_dict(self, *, rank0_only: bool = False) -> dict[str, torch.Tensor]:
        """Keys and shapes of model.state_dict(), full-precision values (fp32 masters in mixed precision): the
        current values wherever they are (this step's chunks, another step's, or the model). With several ranks a
        collective (every rank calls it) that gathers every value on every rank; rank0_only: on rank 0 only (the
        others return {}), see pstar_fx.checkpoint.gather_state_dict."""
        self._fill_if_empty()
        if rank0_only and self._comm is not None:
            return checkpoint.gather_state_dict(self)
        tensors = model_tensors(self._model)
        first = {id(t): n for n, t in tensors.items()}
        values = current_values(self._model)
        return {key: values[first[id(like)]].to(device=like.device, dtype=like.dtype, copy=True)
                for key, like in self._model.state_dict(keep_vars=True).items()}

    @_locked
    def load_state_dict(self, state_dict: dict[str, torch.Tensor], strict: bool = True) -> None:
        """Restore parameter and buffer values (optimizer states are left as they are). When this step does not
        hold the model (before the first step, after sync_model(), or while another step holds it), the values go
        into the model itself, from which the next step takes them."""
        self._fill_if_empty()
        ref = self._model.state_dict()
        missing = [k for k in ref if k not in state_dict]
        unexpected = [k for k in state_dict if k not in ref]
        if strict and (missing or unexpected):
            raise KeyError(f"load_state_dict: missing keys {missing}, unexpected keys {unexpected}")
        for k, v in state_dict.items():
            if k in ref and tuple(v.shape) != tuple(ref[k].shape):
                raise ValueError(f"load_state_dict: {k} has shape {tuple(v.shape)}, the model has "
                                 f"{tuple(ref[k].shape)}")
        if not self.holds_model():
            for h in self._holders():
                h.give_back()               # the model's values must be real before they are overwritten
            self._model.load_state_dict(state_dict, strict=strict)
            return
        pv, bv = {}, {}
        for k, v in state_dict.items():
            if k in self._state_names:
                kind, name = self._state_names[k]
                (pv if kind is Role.PARAM else bv)[name] = v
        with DeferredInterrupt():            # a Ctrl-C waits until every value is in: never half loaded
            self._store.values.load_params(pv)
            self._store.values.load_buffers(bv)


def _check_measured(g: TrainGraph, per_node: list[int]) -> None:
    """debug=True: the device bytes measured after every node equal the plan's prediction for it; where a storage of
    data-dependent size is alive, planned at its upper bound, they are at most the prediction (ir/fx_utils)."""
    bounded = bounded_live(g.nodes)
    for n, measured, loose in zip(g.nodes, per_node, bounded):
        a = g.ann[n.name]
        predicted = g.plan.static_bytes + a.resident_bytes + a.live_bytes + a.workspace_bytes
        if measured != predicted and not (loose and measured <= predicted):
            raise AssertionError(f"pstar-fx plan mismatch at node {n.name}: measured {measured} device bytes, "
                                 f"the plan predicted {predicted}")


def compile(model: nn.Module, *, optimizer: OptimizerSpec | None, device_memory: int | str | None = None,
            precision: str | None = None, chunk_size: int | None = None, device=None, debug: bool = False,
            prefetch: int | None = None, max_grad_norm: float | None = None,
            accumulate: int = 1, remat="auto", atomic: bool = True) -> Callable[[Callable], CompiledStep]:
    """Compile `step(model, *batch) -> loss` into one training step that fits `device_memory`.

    Use as a decorator: `@px.compile(model, optimizer=px.AdamW(lr=3e-4))` over `def step(model, x, y): ...`;
    then `loss = step(x, y)` runs forward, backward and the optimizer update. With `optimizer=None` the function
    is compiled forward only (evaluation: no backward, no update) and returns what it returns; it reads the chunks
    of a training step compiled on the same model. See DESIGN.md for the contract.
    `remat="auto"` recomputes forward activations in backward where the budget needs it (see passes/remat.py);
    `remat=False` never does.
    `prefetch=None` issues each fetch as early as the budget allows (N: at most N nodes before its use; 0: at it).
    `atomic=False` lets the CPU start updating a chunk whose optimizer states live on the host as soon as the step
    has finished with the chunk, during backward, instead of after the last gradient (the commit): faster when the
    CPU's updates would otherwise delay the next forward. The cost: a step that fails after its first such update
    raises px.CommitError and leaves the values half-updated (load a checkpoint to continue). Only where the commit
    decides nothing the updates need (no max_grad_norm, not fp16; otherwise it changes nothing); one rank only.
    """
    def wrap(fn: Callable) -> CompiledStep:
        if optimizer is None:
            if max_grad_norm is not None or accumulate != 1 or not atomic:
                raise ValueError("max_grad_norm, accumulate and atomic belong to training steps; a forward-only "
                                 "function (optimizer=None) takes none of them")
            from .evaluate import CompiledEval   # evaluate builds on this module
            return CompiledEval(fn, model, device_memory=device_memory, precision=precision, chunk_size=chunk_size,
                                device=device, debug=debug, prefetch=prefetch)
        return CompiledStep(fn, model, optimizer, device_memory=device_memory, precision=precision,
                            chunk_size=chunk_size, device=device, debug=debug, prefetch=prefetch,
                            max_grad_norm=max_grad_norm, accumulate=accumulate, remat=remat, atomic=atomic)
    return wrap
