"""What a checkpoint reads and writes of a compiled step: `StepState`, which the step hands to `save` and `load`.

A checkpoint needs a step's model, settings, chunk store, process group, optimizer and loss scaler, and a few of its
operations (take the model into the chunks, fill a model built under px.init_empty(), read and load the model's
values, refuse or allow the next step). This is that view, and all of it: the checkpoint modules never reach into a
step's own fields, so the step can change how it keeps them without touching the file formats, and a reader sees in
one place everything a checkpoint can change.

The view is made afresh for each save or load (CompiledStep._step_state), under the step's lock, so `store` is the
step's chunk store at that moment (None before its first compile).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch
import torch.nn as nn

from ..frontend.init_empty import is_empty
from ..ir.graph import Role, Settings
from ..runtime.chunk_store import ChunkStore
from ..runtime.comm import Comm
from ..runtime.step_runtime import LossScaler


@dataclass(frozen=True)
class StepState:
    model: nn.Module
    settings: Settings
    names: Mapping[str, tuple[Role, str]]    # every state_dict name (tied aliases too) -> (PARAM or BUFFER, the
    #                                          name the store keeps it under)
    comm: Comm | None                        # the process group of a sharded step; None with one rank
    store: ChunkStore | None                 # None until the step's first compile has made it
    optimizer: Any                           # the live optimizer: torch.optim's param_groups, state_dict()
    #                                          and load_state_dict(), and `entries()` in torch's index order
    scaler: LossScaler | None                # fp16's loss scaler, restored in place
    holds_model: Callable[[], bool]          # the chunks hold every tensor of the model now
    take_model: Callable[[], None]           # the chunks take the model's current values and hold it
    fill_if_empty: Callable[[], None]        # a model built under px.init_empty() gets its values in the chunks,
    #                                          once they exist
    model_values: Callable[[], dict[str, torch.Tensor]]   # step.state_dict(): what the next step trains on
    # step.load_state_dict(values, strict) and step.optimizer.load_state_dict(state), for a checkpoint whose files the
    # ranks compared already (they check only that each is in the call)
    load_model_values: Callable[[dict[str, torch.Tensor], bool], None]
    load_optimizer: Callable[[dict], None]
    mark_broken: Callable[[str], None]       # the step refuses to run (CommitError with this message) until ...
    clear_broken: Callable[[], None]         # ... a load has written every value

    @property
    def rank(self) -> int:
        return 0 if self.comm is None else self.comm.rank

    def frozen_names(self) -> list[str]:
        """The state_dict names (tied aliases too) of the parameters this step does not train (as compiled; before
        the first compile, those without requires_grad)."""
        if self.store is not None:
            trained = {name for name, p in self.store.params.items() if p.trainable}
        else:
            trained = {name for name, p in self.model.named_parameters() if p.requires_grad}
        return sorted(n for n, (role, kept) in self.names.items() if role is Role.PARAM and kept not in trained)

    def model_is_empty(self) -> bool:
        """Some tensor of the model was built under px.init_empty() and has no values yet."""
        return any(is_empty(t) for t in itertools.chain(self.model.parameters(), self.model.buffers()))
