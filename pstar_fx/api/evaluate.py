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

import torch
import torch.nn as nn

from ..frontend.batch import check_has_data
from ..frontend.model_tensors import check_unchanged
from ..frontend.python_undo import ModelUndo
from ..frontend.trace import FlatBatch, flatten_batch, trace_step
from ..interrupts import DeferredInterrupt
from ..ir.graph import Precision
from ..ir.needs import state_layout
from ..passes import pipeline, run_passes
from ..runtime.chunk_store import ChunkStore
from ..runtime.executor import Executor
from ..runtime.run import run_forward
from .agreement import check_same_compile, check_same_step
from .compiler import Compiled, Compiler, cycle_collection_paused
from .guarded import run_guarded, traced_outcomes
from .plan_reuse import reusable
from .model_state import holder, holds_own_values, model_tensors
from .step import CompiledStep, refuse_inside_trace, refuse_keywords, refuse_torch_compile
from .warnings import warn_chunk_padding


class EvalCompiler(Compiler):
    """Compiles the forward-only function over the chunks it reads (see the module docstring)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.own: tuple | None = None        # (store, layout) of chunks of its own, once made
        self.asked_precision: Precision | None = None   # px.compile's precision, where the user gave one

    def trainer(self) -> CompiledStep | None:
        """The training step holding the model now, whose chunks this function reads; None if none does."""
        for t in model_tensors(self.model).values():
            h = holder(t)
            step = None if h is None else h.step
            if step is not None and step._optimizer is not None:
                return step
        return None

    def get(self, batch, interrupts: DeferredInterrupt, prefix: tuple = ()) -> tuple[Compiled, FlatBatch]:
        trainer = self.trainer()
        flat = flatten_batch(batch)
        check_has_data(flat, "step(*batch)")
        base = self._base(flat, trainer)
        compiled = self.cached(base, prefix)
        if compiled is None:
            compiled = self._compile_for(batch, trainer, interrupts, prefix, base)
            self.cache.put(base + (compiled.outcomes,), compiled)
        self.variants.note(base, compiled.outcomes)
        self.latest = compiled
        return compiled, flat

    def _base(self, flat, trainer) -> tuple:
        return flat.signature, self.model_key(), None if trainer is None else _homes_key(trainer._compiler.store)

    def will_trace(self, batch) -> bool:
        return self.cached(self._base(flatten_batch(batch), self.trainer()), look=False) is None

    def _compile_for(self, batch, trainer: CompiledStep | None, interrupts: DeferredInterrupt,
                     assume: tuple = (), base: tuple = ()) -> Compiled:
        if trainer is not None:
            if self.asked_precision not in (None, trainer.settings.precision):
                raise ValueError(
                    f"this evaluation was compiled with precision={self.asked_precision.value!r}, but the training "
                    f"step holding the model runs in {trainer.settings.precision.value!r}, and an evaluation reads "
                    "that step's chunks as they are: leave precision=None (or give the training step's)")
            # plan over the trainer's chunks as they are now: its layout, precision, budget and state homes
            params, chunks, size = trainer._compiler.layout
            store = trainer._compiler.store
            chunks = tuple(dataclasses.replace(c, state_home=store.state_home[c.id],
                                               param_home=store.chunks[c.id].param_home) for c in chunks)
            settings = dataclasses.replace(trainer.settings, optimizer=None, max_grad_norm=None, accumulate=1,
                                           states=state_layout(trainer.settings))
            layout = (params, chunks, size)
        else:
            settings = self.settings
            store, layout = self.own if self.own is not None else (None, None)
        with cycle_collection_paused():
            self.undo = ModelUndo(self.model)
            traced = trace_step(self.fn, self.model, batch, settings, assume, self.undo)
            writes = self.model_key() != base[1]
            self.compiles += 1
            outcomes = traced_outcomes(traced)
            interrupts.deliver()        # safe points: after the trace and after each pass
            same = reusable(self.cache.items(), base + (outcomes,), traced)
            if same is not None:        # an equal trace's plan (api/plan_reuse.py)
                if self.comm is not None:
                    check_same_compile(self.comm, same.executor.g, prefetch=self.prefetch)
                return dataclasses.replace(same, writes_state=writes)
            self.plans += 1
            passes = pipeline(chunk_size=settings.chunk_size, layout=layout, prefetch=self.prefetch, train=False,
                              world=settings.world, machine=self.machine)
            stages = run_passes(traced, passes, after=lambda stage: interrupts.deliver())
        final = stages[-1]
        if self.comm is not None:     # the settings and the plan's collectives, alike on every rank
            check_same_compile(self.comm, final, prefetch=self.prefetch)
        if store is None:
            warn_chunk_padding(final)
            store = ChunkStore(final.chunks, final.params, settings.precision, settings.device, settings.budget,
                               comm=self.comm, host_is_device=settings.host_is_device)
            self.own = (store, (final.params, final.chunks, final.chunk_size))
        return Compiled(stages={s.stage: s for s in stages}, executor=Executor(final, store), outcomes=outcomes,
                        machine=self.machine, writes_state=writes)


def _homes_key(store) -> tuple:
    """What an evaluation's plan reads of the training step's store: the store, and where each chunk's states and
    parameters live now (a training step's plans may move them: ChunkStore.set_homes)."""
    return id(store), tuple(store.state_home), tuple(c.param_home for c in store.chunks)


class CompiledEval(CompiledStep):
    """A forward-only function compiled for a model (see the module docstring)."""

    _compiler_class = EvalCompiler

    def __init__(self, fn: Callable, model: nn.Module, **kw):
        super().__init__(fn, model, None, fuse=False, **kw)   # fused regions are for training steps
        if kw.get("precision") is not None:
            self._compiler.asked_precision = self.settings.precision

    def __call__(self, *batch, **kwargs):
        """Run the function on this batch; returns what it returns, detached. Ctrl-C is held over the call and
        taken at safe points (after the trace, between passes, between nodes), as in CompiledStep.__call__: one
        taken there rolls the evaluation back like a failed step (module buffers it writes in train mode too)."""
        refuse_keywords(kwargs)
        refuse_torch_compile()
        refuse_inside_trace(batch)
        # under torch.inference_mode() too, what the call makes and keeps (chunk slots, host homes, the values a
        # training step takes in again) must stay normal tensors, which a later training step writes in place: the
        # call runs outside inference mode, without autograd (run_forward's no_grad)
        with torch.inference_mode(False), DeferredInterrupt() as interrupts:
            check_unchanged(self._model, self._compiler.tables)
            if self._comm is not None:     # before its first collective (a compile's own included)
                check_same_step(self._comm, batch, self._model, self._compiler.model_key(portable=True),
                                holds_own_values(self._model), tracing=self._compiler.will_trace(batch))

            def attempt(compiled, flat):
                interrupts.deliver()
                trainer = self._compiler.trainer()
                if trainer is None:
                    self._compiler.store, self._compiler.layout = self._compiler.own
                    self._model_state.take()
                elif not trainer._model_state.holds():
                    # a tensor of the model changed hands since the trainer's last step (a parameter replaced, a
                    # value loaded into the model): the trainer takes the model's values now, as its next step would,
                    # so that its chunks, which this function reads, hold them
                    with trainer._lock:
                        trainer._model_state.take()
                return run_forward(compiled.executor, flat.tensors, interrupts, debug=self.debug)
            # again on another trace where a guard sees another outcome than its trace took (guarded.py)
            compiled, flat, run = run_guarded(self._compiler, batch, interrupts, attempt)
            self._last_stats = run.stats
            return compiled.executor.g.output_spec.rebuild([o.detach() for o in run.outputs])

    def save(self, path, *, sharded: bool | None = None, frozen: bool = True) -> None:
        raise TypeError("an evaluation function (px.compile(model, optimizer=None)) has no training state to "
                        "checkpoint: save the training step (step.save(path)), or the model's values "
                        "(torch.save(evaluate.state_dict(), path))")

    def load(self, path) -> None:
        raise TypeError("an evaluation function (px.compile(model, optimizer=None)) loads no checkpoint: load it "
                        "into the training step (step.load(path)), or the model's values with "
                        "evaluate.load_state_dict(...)")


__all__ = ["CompiledEval"]
