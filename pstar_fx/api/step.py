"""CompiledStep: what `px.compile` returns, a training step compiled for a model.

It ties the jobs together, each done elsewhere: its options (options.py), compiling each batch signature
(compiler.py), holding the model's values (model_state.py), running a step (pstar_fx.runtime.run), checkpoints
(pstar_fx.checkpoint, through a StepState), the summary and the memory timeline.
"""
from __future__ import annotations

import contextlib
import functools
import threading
import time
from typing import Callable

import optree
import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensor

from .. import checkpoint
from ..checkpoint import StepState
from ..errors import CommitError, PstarError
from ..frontend import torch_compile
from ..frontend.model_tensors import check_unchanged
from ..interrupts import DeferredInterrupt
from ..ir.graph import Precision, Settings, TrainGraph
from ..optim import OptimizerSpec
from ..runtime.comm import collective_call, default_comm
from ..runtime.run import returned, run_training_step
from ..runtime.step_runtime import LossScaler, StepStats
from . import timeline
from .agreement import check_same_step
from .compiler import Compiler
from .guarded import run_guarded
from .live_optimizer import build as build_optimizer
from .model_state import holds_own_values
from .step_model import ModelState
from .options import (check_options, fuse_by_estimate, host_is_device, host_spare, loss_rows_settings,
                      resolve_budget, resolve_device, resolve_fuse, resolve_machine, resolve_precision, resolve_tiers)
from .summary import Summary, summarize
from .trace_cache import DEFAULT_MAX_SIZE
from .warnings import warn_torch_compiled


def _refuse_torch_compile() -> None:
    raise PstarError("torch.compile(step): a pstar-fx compiled step is compiled already (forward, backward and the "
                     "update in one planned graph), and torch.compile cannot trace it. Call the step directly: "
                     "loss = step(*batch)")


def refuse_keywords(kwargs: dict) -> None:
    """A step takes its batch positionally (`step(x, y)` calls `fn(model, x, y)`): say so, and how to pass others."""
    if kwargs:
        names = ", ".join(kwargs)
        raise TypeError(f"a compiled step takes its batch positionally, got keyword arguments ({names}): call "
                        f"step(x, y, ...) as fn(model, x, y, ...) is defined, or pack them in a dict: step(batch) "
                        f"with batch = {{{', '.join(repr(k) + ': ...' for k in kwargs)}}}")


def refuse_torch_compile() -> None:
    """Raise when a step is called from code torch.compile is tracing. Dynamo treats a `raise` in the code it traces
    as a graph break and runs the frame eagerly, under its frame hook (which compiles what the step calls, and
    fails on it); a function it is told not to trace is called for real, so the error raised there reaches the
    caller."""
    if torch.compiler.is_compiling():
        torch.compiler.disable(_refuse_torch_compile)()


def refuse_inside_trace(batch: tuple) -> None:
    """Raise when a step is called from code another trace is running: another compiled step's function (its batch
    then arrives as fake tensors), make_fx or torch.export. The step would run its real graph on the trace's fake
    values."""
    fake = any(isinstance(x, FakeTensor) for x in optree.tree_leaves(batch, none_is_leaf=True))
    if fake or torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None:
        raise PstarError("a compiled step was called while a trace runs (from inside another px.compile step's "
                         "function, or under make_fx / torch.export): a step cannot run inside another step; call "
                         "the model there (`model(x)`), and call each step from the training loop")


def _locked(method):
    """The step's lock held over a method: another thread's step, save or load waits for it."""
    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)
    return locked


class Stages(dict):
    """step.graphs: the stages by name; a name it has not says which it has."""

    def __missing__(self, key):
        raise KeyError(f"no stage {key!r}: this step's stages are {', '.join(map(repr, self))}")


class CompiledStep:
    """A training step compiled for a model: call it with a batch to run forward, backward and the update."""

    _compiler_class = Compiler

    def __init__(self, fn: Callable, model: nn.Module, optimizer: OptimizerSpec, *, device_memory=None,
                 precision: str | None = None, chunk_size: int | None = None, device=None, debug: bool = False,
                 prefetch: int | None = None, max_grad_norm: float | None = None, accumulate: int = 1, remat="auto",
                 atomic: bool = True, device_updates: int | None = None, undo_updates: int | None = None,
                 cache_size: int = DEFAULT_MAX_SIZE,
                 fuse: bool | None = None, host_memory=None, offload_dir=None, disk_memory=None,
                 loss_rows=None, loss_block_bytes: int | None = None):
        check_options(model, optimizer, chunk_size=chunk_size, prefetch=prefetch, max_grad_norm=max_grad_norm,
                      accumulate=accumulate, remat=remat, atomic=atomic, cache_size=cache_size, debug=debug)
        if not callable(fn):
            raise TypeError(f"px.compile(...) decorates the step function, fn(model, *batch); got "
                            f"{type(fn).__name__} {fn!r}")
        # torch.compile wrappers are traced through (pstar_fx.frontend.torch_compile)
        traced_fn = torch_compile.original_function(fn)
        warn_torch_compiled([n for n, _ in torch_compile.compiled_modules(model)], traced_fn is not fn)
        self._fn = fn
        self._model = model
        dev = resolve_device(device)
        prec = resolve_precision(precision, dev)
        self._optimizer = build_optimizer(optimizer, model) if optimizer is not None else None
        self._comm = default_comm(dev)       # the default process group, when one of 2+ ranks exists
        world = 1 if self._comm is None else self._comm.world
        budget, self._default_budget = resolve_budget(device_memory, dev, world)
        if self._comm is not None:           # (resolve_tiers' agreement is a collective: every rank must be here)
            self._comm.agree_on("px.compile")
        host_budget, offload, disk_budget = resolve_tiers(host_memory, offload_dir, disk_memory, self._comm)
        asked, fuse = fuse, resolve_fuse(fuse, dev, prec, world)
        # fused by default: kept where the cost model estimates it faster, the optimizer placed for an unfused step
        fuse_auto = fuse_by_estimate(asked, fuse)
        default_host = host_memory is None and offload is None and host_budget is not None
        self.settings = Settings(precision=prec, device=dev, budget=budget,
                                 chunk_size=chunk_size,
                                 optimizer=self._optimizer.layout if self._optimizer is not None else None,
                                 max_grad_norm=None if max_grad_norm is None else float(max_grad_norm),
                                 accumulate=accumulate, world=world,
                                 atomic=atomic, device_updates=device_updates, undo_updates=undo_updates,
                                 **loss_rows_settings(loss_rows, loss_block_bytes), host_budget=host_budget,
                                 disk_budget=disk_budget, host_is_device=host_is_device(dev, world),
                                 host_default=default_host,
                                 host_spare=host_spare(default_host, world),
                                 fused=fuse and not fuse_auto)
        configs = self._optimizer.layout.configs() if self._optimizer is not None else ()
        self.debug = debug
        self._lock = threading.RLock()       # held by a step, save and load: another thread never sees half a step
        self._compiler = self._compiler_class(traced_fn, model, self.settings, self._comm, self._optimizer,
                                              remat=remat is not False, prefetch=prefetch, cache_size=cache_size,
                                              fuse=fuse, fuse_auto=fuse_auto, offload_dir=offload,
                                              machine=resolve_machine(dev, prec, configs))
        self._model_state = ModelState(self, model, self._compiler, self._comm, self._lock)
        self._scaler = LossScaler() if prec is Precision.FP16 else None
        self._last_stats: StepStats | None = None
        self._measured: tuple[TrainGraph, list[int]] | None = None   # debug: device bytes after every node
        self._broken: str | None = None      # set when a step failed after its commit point
        self._before_node = None             # tests: called before every node (fault injection)
        self._inside = False                 # a call is running (the lock is reentrant: the same thread may enter)
        self.__wrapped__ = fn

    # -- running ----------------------------------------------------------------------------------------------
    def __call__(self, *batch, **kwargs):
        """One training step on this batch (positional arguments, as `fn(model, *batch)` takes them); returns the
        loss, or (loss, aux) as the function does. Atomic (see Executor.run): a failure before the commit point
        leaves every value as it was. Another thread's save() or load() waits for the step (a lock). Ctrl-C is
        held over the whole call and taken only at safe points: after the trace, between the passes, and between
        nodes before the commit point, where it raises KeyboardInterrupt and the step changes nothing (a compile
        that finished is kept: the next call does not trace again); from the commit point on the step completes,
        then raises it (it counts as done). A hang inside one operation is ended by the process group's timeout
        (px.DistributedError); see pstar_fx/interrupts.py. A guard that finds a Python decision on a tensor's value
        coming out otherwise than traced fails before the commit point: the step, rolled back, runs again on the
        graph traced for that outcome (pstar_fx/api/guarded.py)."""
        refuse_keywords(kwargs)
        refuse_torch_compile()
        with self._lock, DeferredInterrupt() as interrupts, self._one_call():
            refuse_inside_trace(batch)
            started = time.perf_counter()
            self._check_callable(batch)

            def attempt(compiled, flat):
                interrupts.deliver()          # a safe point: compiled, nothing else done yet
                self._model_state.take()
                return run_training_step(compiled.executor, flat.tensors, interrupts, scaler=self._scaler,
                                         started=started, debug=self.debug, before_node=self._before_node)
            try:    # again on another trace where a guard sees another outcome than its trace took (guarded.py)
                compiled, flat, run = run_guarded(self._compiler, batch, interrupts, attempt)
            except CommitError as e:
                self._mark_broken(str(e))
                raise
            self._last_stats = run.stats
            if run.per_node is not None:
                self._measured = (compiled.executor.g, run.per_node)
            return returned(compiled.executor.g, run.outputs)

    @contextlib.contextmanager
    def _one_call(self):
        """Marks a call as running; a call from inside it (the step function calling its own step) is refused."""
        if self._inside:
            raise PstarError("the step was called from inside a call of itself (its step function, or code it "
                             "runs, calls the compiled step): call the step from the training loop only")
        self._inside = True
        try:
            yield
        finally:
            self._inside = False

    def _check_callable(self, batch) -> None:
        """The step may run: not broken by a failed update, in grad mode, and (several ranks) called alike on every
        rank, before this step's first collective (a compile's own included)."""
        if self._broken is not None:
            raise CommitError(self._broken)
        check_unchanged(self._model, self._compiler.tables)
        if torch.is_inference_mode_enabled() or not torch.is_grad_enabled():
            ctx = "torch.inference_mode()" if torch.is_inference_mode_enabled() else "torch.no_grad()"
            raise PstarError(f"pstar-fx step called under {ctx}; a training step needs grad mode; use "
                             "px.compile(model, optimizer=None) for forward-only evaluation")
        if self._comm is not None:
            check_same_step(self._comm, batch, self._model, self._compiler.model_key(portable=True),
                            holds_own_values(self._model), self._optimizer, self._compiler.will_trace(batch))

    def lower(self, *batch) -> dict[str, TrainGraph]:
        """Compile for this batch's shapes without running a step; returns the stages."""
        with DeferredInterrupt() as interrupts:        # Ctrl-C: between compile phases only (see Compiler.get)
            self._compiler.get(batch, interrupts)
            self._compiler.take_undo()                  # (no call of the step to trace again in)
        return self.graphs

    def reserve(self, *batch) -> dict[str, TrainGraph]:
        """Compile for this batch's shapes now and keep that compile for the step's life; returns the stages.

        Give it the largest batch the training will see (the longest sequence length, or each bucket's): a batch
        that does not fit the budget raises BudgetError here, before training starts, instead of when it first
        comes, and a batch of a reserved signature never traces again (but once, taking the reserved plan, where
        the step's trace changes its own signature: api/plan_reuse.py; the cache never drops it: cache_size counts
        it). Other signatures compile when they first come, as always."""
        with self._lock, DeferredInterrupt() as interrupts:      # Ctrl-C: between compile phases only
            self._compiler.reserve(batch, interrupts)
        return self.graphs

    def min_device_memory(self, *batch) -> int:
        """The smallest device_memory (bytes) under which this step compiles for this batch's shapes, with this
        chunk layout: every optimizer state on the host and only what each node itself needs on the device, with the
        activations recomputed that lower it most (unless remat=False)."""
        return self._compiler.min_device_memory(batch)

    # -- what it compiled and measured ------------------------------------------------------------------------
    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The live optimizer: a torch.optim object of the optimizer's class (AdamW, SGD, ...), its param_groups
        read at every step (set lr between steps, or drive it with a torch.optim.lr_scheduler), and its
        state_dict() / load_state_dict() in torch's format. The compiled step runs its update: do not call
        step.optimizer.step()."""
        return self._optimizer

    @property
    def last_step(self) -> StepStats | None:
        """Measurements of the most recent step: peak device bytes, bytes moved, whether it was skipped."""
        return self._last_stats

    @property
    def loss_scale(self) -> float | None:
        return None if self._scaler is None else self._scaler.scale

    @property
    def graphs(self) -> dict[str, TrainGraph]:
        """Every stage of the latest compiled signature, in pipeline order ("traced" first, "scheduled" last)."""
        if self._compiler.latest is None:
            raise RuntimeError("nothing is compiled yet: call the step once (or step.lower(*batch))")
        return Stages(self._compiler.latest.stages)

    @property
    def final_graph(self) -> TrainGraph:
        """The graph the step runs: the last stage ("scheduled"; "sharded" with more than one rank; "fused" with
        fuse=True)."""
        return list(self.graphs.values())[-1]

    def summary(self) -> Summary:
        return summarize(self.final_graph, self._compiler.latest, self._last_stats, self.settings.precision,
                         self._default_budget)

    def memory_timeline(self) -> list[timeline.Row]:
        """Per node of the latest compiled step: predicted device bytes by kind, chunk moves, and the bytes measured
        after it by the latest debug=True call if that call ran this signature (else None). See
        pstar_fx.api.timeline."""
        return timeline.memory_timeline(self.final_graph, self._measured)

    # -- the model and its values -----------------------------------------------------------------------------
    def holds_model(self) -> bool:
        """Whether this step's chunks hold every tensor of the model now (it has run, and no sync_model() or other
        step took the model since)."""
        return self._model_state.holds()

    @_locked
    def sync_model(self) -> nn.Module:
        """Write the current values (parameters at full precision, and buffers) back into the model and give it back
        to the user: it can be used, saved or edited eagerly. The values come from whichever step holds each of the
        model's tensors (this one, or another step compiled on the model, on a part of it, or on a model sharing
        tensors with it). The next step copies the model into the chunks again, so edits made in between are
        trained on. Returns the model. With several ranks, a collective."""
        return self._model_state.give_back()

    @_locked
    def state_dict(self, *, rank0_only: bool = False) -> dict[str, torch.Tensor]:
        """Keys and shapes of model.state_dict(), full-precision values (fp32 masters in mixed precision; fp32 for a
        half-precision parameter): the current values wherever they are (this step's chunks, another step's, or the
        model), as this step would train from them next (another step's in the model's dtype). With several ranks a
        collective (every rank calls it) that gathers every value on every rank; rank0_only: on rank 0 only (the
        others return {}), chunk by chunk (pstar_fx.runtime.store_values.StoreValues.gather_to_rank0)."""
        with collective_call(self._comm, "step.state_dict()", "The step's values are as they were."):
            return self._model_state.state_dict(rank0_only)

    @_locked
    def load_state_dict(self, state_dict: dict[str, torch.Tensor], strict: bool = True):
        """Restore parameter and buffer values (optimizer states are left as they are). When this step does not
        hold the model (before the first step, after sync_model(), or while another step holds it), the values go
        into the model itself, from which the next step takes them. As nn.Module's: missing or unexpected keys
        (with strict) and wrong shapes raise RuntimeError, and it returns (missing_keys, unexpected_keys)."""
        return self._model_state.load_state_dict(state_dict, strict)

    # -- checkpoints ------------------------------------------------------------------------------------------
    @_locked
    def save(self, path, *, sharded: bool | None = None, frozen: bool = True) -> None:
        """Write a checkpoint directory that resumes exactly (see pstar_fx.checkpoint). sharded: None writes the
        sharded format with several ranks or a disk tier, plain files otherwise; True or False chooses. frozen=False
        leaves out the parameters the step does not train (plain files): a load keeps the model's own values for
        them, so load it into a model built with the same frozen values (a fine-tune's base weights). Refused
        (CommitError) after a step failed past its commit point: its values are not one step's."""
        if sharded is not None and not isinstance(sharded, bool) or not isinstance(frozen, bool):
            raise TypeError(f"step.save: sharded must be None, True or False and frozen True or False; got "
                            f"sharded={sharded!r}, frozen={frozen!r}")
        if self._broken is not None:
            raise CommitError(f"step.save({str(path)!r}) refused: the values are not consistent since a step failed "
                              f"after its commit point (saving them could replace a good checkpoint): "
                              f"{self._broken}")
        checkpoint.save(self._step_state(), path, sharded=sharded, frozen=frozen)

    @_locked
    def load(self, path) -> None:
        """Restore a checkpoint written by save(), before the first step or after a failed one too."""
        checkpoint.load(self._step_state(), path)

    def _step_state(self) -> StepState:
        """What a checkpoint reads and writes of this step (see pstar_fx.checkpoint.step_state)."""
        ms = self._model_state
        return StepState(model=self._model, settings=self.settings, names=ms.names, comm=self._comm,
                         store=self._compiler.store, optimizer=self._optimizer, scaler=self._scaler,
                         holds_model=ms.holds, take_model=ms.take, fill_if_empty=ms.fill_if_empty,
                         model_values=self.state_dict,
                         load_model_values=lambda values, strict: ms.load_state_dict(values, strict, compared=True),
                         load_optimizer=lambda state: self._optimizer.load_compared(state, compared=True),
                         mark_broken=self._mark_broken, clear_broken=self._clear_broken)

    def _mark_broken(self, why: str) -> None:
        """The step failed after its commit point: it refuses to run, save or hand its values out (CommitError)
        until a checkpoint's load has written every value."""
        self._broken = why
        self._model_state.broken = why

    def _clear_broken(self) -> None:
        self._broken = None
        self._model_state.broken = None
