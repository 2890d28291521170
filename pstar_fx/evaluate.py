"""Forward-only functions: `px.compile(model, optimizer=None)(fn)` for evaluation, sampling, inference.

The function is traced without backward (no gradients, no update) and planned like a training step: its chunks are
fetched and released under the memory budget, so a model larger than the device runs streamed. It returns what the
function returns (a loss, logits, a tuple or dict of tensors), detached. It respects `model.eval()` / `model.train()`
(the mode is part of the signature).

Which chunks it reads: when a training step compiled on the same model holds it (it has run), the evaluation reads
that step's chunks in place, planned over that step's layout, precision and budget: no copy of the model is made and
the values are the trained ones. Otherwise it copies the model into chunks of its own and holds the model itself
(a training step called later takes the model back, as between two training steps).
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import optree
import torch
import torch.nn as nn

from .agreement import check_same_step
from .api import CompiledStep, _check_measured, _Compiled
from .checks import warn_chunk_padding
from .ir.fx_utils import cycle_collection_paused
from .ownership import holder, model_tensors
from .passes import pipeline, run_passes
from .runtime.chunk_store import ChunkStore
from .runtime.executor import Executor, Runtime, StepStats
from .interrupts import DeferredInterrupt
from .frontend.trace import flatten_batch, trace_step


class CompiledEval(CompiledStep):
    """A forward-only function compiled for a model (see the module docstring)."""

    def __init__(self, fn: Callable, model: nn.Module, **kw):
        super().__init__(fn, model, None, **kw)
        self._own: tuple | None = None        # (store, layout) of chunks of its own, once made

    def _trainer(self) -> CompiledStep | None:
        """The training step holding the model now, whose chunks this function reads; None if none does."""
        for t in model_tensors(self._model).values():
            h = holder(t)
            step = None if h is None else h.step
            if step is not None and step is not self and step._optimizer is not None:
                return step
        return None

    def _get(self, batch, interrupts: DeferredInterrupt):
        trainer = self._trainer()
        flat = flatten_batch(batch)
        key = (flat.signature, self._model_key(), None if trainer is None else id(trainer._store))
        compiled = self._cache.get(key)
        if compiled is None:
            compiled = self._compile_for(batch, trainer, interrupts)
            self._cache.put(key, compiled)
        return compiled, flat

    def _compile_for(self, batch, trainer: CompiledStep | None, interrupts: DeferredInterrupt) -> _Compiled:
        if trainer is not None:
            # plan over the trainer's chunks as they are now: its layout, precision, budget and state homes
            params, chunks, size = trainer._layout
            store = trainer._store
            chunks = tuple(dataclasses.replace(c, state_home=store.state_home[c.id], param_home=store.chunks[c.id].param_home)
                           for c in chunks)
            settings = dataclasses.replace(trainer.settings, optimizer=None, max_grad_norm=None, accumulate=1)
            layout = (params, chunks, size)
        else:
            settings = self.settings
            store, layout = self._own if self._own is not None else (None, None)
        with cycle_collection_paused():
            traced = trace_step(self._fn, self._model, batch, settings)
            interrupts.deliver()        # safe points: after the trace and after each pass
            passes = pipeline(chunk_size=settings.chunk_size, layout=layout, prefetch=self.prefetch, train=False,
                              world=settings.world)
            stages = run_passes(traced, passes, after=lambda stage: interrupts.deliver())
        final = stages[-1]
        if store is None:
            warn_chunk_padding(final)
            store = ChunkStore(final.chunks, final.params, settings.precision, settings.device, settings.budget,
                               comm=self._comm)
            self._own = (store, (final.params, final.chunks, final.chunk_size))
        return _Compiled(stages={s.stage: s for s in stages}, executor=Executor(final, store))

    def __call__(self, *batch):
        """Run the function on this batch; returns what it returns, detached. Ctrl-C is held over the call and
        taken at safe points (after the trace, between passes, between nodes), as in CompiledStep.__call__: one
        taken there rolls the evaluation back like a failed step (module buffers it writes in train mode too)."""
        with DeferredInterrupt() as interrupts:   # here, not in a helper: warnings' stack levels count from here
            if self._comm is not None:     # before its first collective (a compile's own included)
                check_same_step(self._comm, batch, self._model, self._model_key())
            compiled, flat = self._get(batch, interrupts)
            self._latest = compiled
            interrupts.deliver()
            g = compiled.executor.g
            if self._trainer() is None:
                self._store, self._layout = self._own
                self._take_model()
            store = compiled.executor.store
            rt = Runtime(g, store, None)
            inputs = [self._prepare_input(x, info.dtype) for x, info in zip(flat.tensors, g.inputs)]
            per_node: list[int] | None = [] if self.debug else None
            with torch.no_grad():
                outputs, peak = compiled.executor.run(inputs, None, rt, interrupts, trace_peaks=per_node)
            self._last_stats = StepStats(measured_peak=peak, h2d_bytes=rt.h2d, d2h_bytes=rt.d2h, skipped=False)
            if per_node is not None:
                _check_measured(g, per_node)
            return optree.tree_unflatten(g.output_spec, [o.detach() for o in outputs])

__all__ = ["CompiledEval"]
