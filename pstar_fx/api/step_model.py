"""A compiled step's side of holding its model (api/model_state.py says what holding is): `ModelState` takes the
model's values into the step's chunks and holds the model, gives them back, and reads and loads the model's values
by state_dict name, wherever they are (this step's chunks, another step's, or the model)."""
from __future__ import annotations

import threading
import weakref
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from ..errors import DistributedError
from ..frontend.init_empty import fill_chunks, is_empty
from ..ir.graph import Role
from ..runtime.comm import Comm, collective_call
from ..runtime.store_values import full_dtype, full_where_rounded, half_precision
from .agreement import check_same_values, compare_contents
from ..interrupts import DeferredInterrupt
from .model_state import (AFTER_LOAD, AFTER_SYNC, LOAD_STATE_DICT, SYNC_MODEL, IncompatibleKeys, Mark, ModelHold,
                          current_values, hold, holder, holders, model_tensors, sync_comm)

if TYPE_CHECKING:
    from .compiler import Compiler


class ModelState:
    """A compiled step's side of holding its model: taking the model's values into the step's chunks (and holding
    it), giving them back, and reading and loading them by state_dict name. The chunk store and layout are the
    compiler's, once its first compile has made them."""

    def __init__(self, step, model: nn.Module, compiler: "Compiler", comm: Comm | None, lock: threading.RLock):
        self._step = weakref.ref(step)   # the step owns this object: a strong reference would keep it alive
        self.model = model
        self.compiler = compiler
        self.comm = comm
        self.lock = lock
        tables = compiler.tables
        # every state_dict name (tied aliases too) -> (PARAM or BUFFER, the name the store keeps it under)
        self.names: dict[str, tuple[Role, str]] = {
            **{n: (Role.PARAM, p.name) for p in tables.params for n in (p.name,) + p.aliases},
            **{n: (Role.BUFFER, b.name) for b in tables.buffers for n in (b.name,) + b.aliases}}
        self.hold: ModelHold | None = None     # this step's claim on the model's values, once its chunks took them
        # full-precision values loaded while the model holds its own values (load_state_dict, a checkpoint's load)
        # for parameters of a narrower dtype, with the Mark of the model's tensor they were loaded into, by
        # model_tensors' name: while it is still that tensor, unchanged, they are its full-precision values
        self.loaded_full: dict[str, tuple[torch.Tensor, Mark]] = {}
        self._broken: str | None = None      # the step failed after its commit point (CompiledStep._mark_broken)

    @property
    def broken(self) -> str | None:
        return self._broken

    @broken.setter
    def broken(self, why: str | None) -> None:
        self._broken = why
        if self.hold is not None:
            self.hold.broken = why

    def holds(self) -> bool:
        """Whether this step's chunks hold every tensor of the model now (it has run, and no sync_model() or other
        step took the model since)."""
        if self.hold is None:
            return False
        hold = self.hold
        for m in self.model.modules():      # (before every step: no names made, as model_tensors makes them)
            for slots in (m._parameters, m._buffers):
                for t in slots.values():
                    if t is not None and holder(t) is not hold:
                        return False
        return True

    def take(self) -> None:
        """Make the chunks hold the model's current values. If this step holds the model already, nothing to do;
        otherwise (first step, after sync_model(), or held by another step, whole or in part) every holder gives its
        values back first, then they are copied in and held."""
        if self.holds():
            return
        for h in holders(self.model):
            h.give_back()                  # then the values are the model's
        tensors = model_tensors(self.model)
        on_meta = [n for n, t in tensors.items() if t.is_meta]
        if on_meta:
            raise ValueError(f"the model's tensors {on_meta[:3]}{'...' if len(on_meta) > 3 else ''} are on the "
                             "meta device: pstar-fx copies the model's values into its chunks at the first "
                             "step, so give it a model with real values, or build it under px.init_empty()")
        if self.comm is not None:         # every rank starts from the same values (a collective)
            check_same_values(self.comm, tensors)
        store = self.compiler.store
        named = dict(self.model.named_parameters())
        # a model built under px.init_empty() is initialised in the chunks themselves (see pstar_fx.frontend.init_empty)
        params, buffers = fill_chunks(store, {p.name: named[p.name] for p in self.compiler.layout[0]},
                                      {b.name: tensors[b.name] for b in self.compiler.tables.buffers})
        # a half-precision parameter that is still the tensor this step gave back (or loaded full-precision values
        # into), unchanged, keeps its full-precision values where it holds their rounding
        for n, (full, mark) in self.loaded_full.items():
            if mark.still(tensors[n]):
                params[self.names[n][1]] = full_where_rounded(full, tensors[n].detach())
        given = self.hold.given_back if self.hold is not None and self.hold.store is store else {}
        keep = {self.names[n][1] for n, mark in given.items() if n not in self.loaded_full and mark.still(tensors[n])}
        store.values.load_params(params, keep_full=keep)
        store.values.load_buffers(buffers)
        self.loaded_full = {}
        if self.hold is None or self.hold.store is not store:
            self.hold = ModelHold(self._step(), self.model, store, self.names, self.lock)
            self.hold.broken = self._broken
        self.hold.given_back = {}
        hold(self.model, self.hold)

    def fill_if_empty(self) -> None:
        """A model built under px.init_empty() gets its values in this step's chunks once the step has them."""
        if self.compiler.store is not None and any(is_empty(t) for t in model_tensors(self.model).values()):
            self.take()

    def give_back(self) -> nn.Module:
        """sync_model(): the model gets its current values back from whichever step holds each of its tensors. With
        several ranks, where that runs collectives, every rank first checks that every rank calls it (`sync_comm`)."""
        self._refuse_if_broken("step.sync_model()")
        with collective_call(self._sync_comm(), SYNC_MODEL, AFTER_SYNC):
            self.fill_if_empty()
            for h in holders(self.model):
                h.give_back()
        return self.model

    def _refuse_if_broken(self, what: str) -> None:
        if self.hold is not None and self.holds():
            self.hold.refuse_if_broken(what)

    def _sync_comm(self) -> Comm | None:
        """The Comm where giving the model back (or filling a model built under px.init_empty() first) runs
        collectives, else None (`sync_comm`)."""
        taking = self.compiler.store is not None and any(is_empty(t) for t in model_tensors(self.model).values())
        return sync_comm(self.model, self.comm, taking)

    def state_dict(self, rank0_only: bool = False) -> dict[str, torch.Tensor]:
        """The model's state dict at full precision, from wherever each value is now (see CompiledStep.state_dict).
        rank0_only with several ranks: rank 0 gathers it, chunk by chunk (StoreValues.gather_to_rank0)."""
        self._refuse_if_broken("step.state_dict()")
        self.fill_if_empty()
        if rank0_only and self.comm is not None:
            if self.holds():
                return self.compiler.store.values.gather_to_rank0(self.names, self.model.state_dict(keep_vars=True))
            sd = self._current()     # the model's own values (whole on every rank), or another step's (gathered)
            return sd if self.comm.rank == 0 else {}
        return self._current()

    def _current(self) -> dict[str, torch.Tensor]:
        """state_dict's values: what this step would train from next. A parameter this step holds, at the full
        precision it holds it at (wider than a half-precision model's own dtype); one the model holds as the
        rounding of full-precision values this step gave back or was loaded with, those (`_full_of_own`); any
        other (the model's own, or another step's, which this step would take as the model holds it) in the
        model's dtype."""
        tensors = model_tensors(self.model)
        first = {id(t): n for n, t in tensors.items()}
        values = current_values(self.model)
        full = self._full_of_own(tensors)
        values.update(full)
        mine = {n for n, t in tensors.items() if self.hold is not None and holder(t) is self.hold} | set(full)

        def dtype(n: str, like: torch.Tensor) -> torch.dtype:
            return full_dtype(values[n], like) if n in mine else like.dtype
        return {key: values[first[id(like)]].to(device=like.device, dtype=dtype(first[id(like)], like), copy=True)
                for key, like in self.model.state_dict(keep_vars=True).items()}

    def _full_of_own(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """For the model's half-precision parameters that hold their own values (no step holds them) and are still
        the tensors this step gave back or loaded full-precision values into, unchanged: those full-precision
        values wherever the tensor holds their rounding (the tensor's own elsewhere: writes through `.data`), as
        the next step would take them; by model_tensors' name. Sharded: a collective where this step's store is
        read (the same names on every rank)."""
        own = {n: t for n, t in tensors.items() if holder(t) is None and n in self.names
               and self.names[n][0] is Role.PARAM and half_precision(t.dtype)}
        out = {n: full_where_rounded(full, own[n].detach()) for n, (full, mark) in self.loaded_full.items()
               if n in own and mark.still(own[n])}
        hold = self.hold
        if hold is not None and hold.given_back and hold.store is self.compiler.store:
            stored = hold.values(sorted(n for n in own if n in hold.given_back))
            out.update({n: full_where_rounded(v, own[n].detach()) for n, v in stored.items()
                        if n not in out and hold.given_back[n].still(own[n])})
        return out

    def load_state_dict(self, state_dict: dict[str, torch.Tensor], strict: bool = True,
                        compared: bool = False) -> IncompatibleKeys:
        """Parameter and buffer values into the chunks when this step holds the model, else into the model itself
        (see CompiledStep.load_state_dict). As nn.Module's: missing or unexpected keys (with strict) and wrong shapes
        raise RuntimeError before anything is written; returns the missing and unexpected keys.

        With several ranks, where it runs collectives (giving the model back from the steps that hold it, taking a
        model built under px.init_empty() into the chunks first) or writes into this step's chunks (each rank its
        own shard, from the dict it was given), every rank first checks that every rank calls it with the same
        state dict and `strict` (`_check_same`), before anything else. Where the model holds its own values it
        involves no other rank: they go into each rank's model, and the next step compares the values it takes.
        `compared`: the ranks compared what it comes from already (step.load, the checkpoint's files): nothing more is
        checked."""
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"load_state_dict takes a state dict (a mapping of names to tensors, as "
                            f"model.state_dict() returns), not {type(state_dict).__name__}")
        comm = None if compared else self._sync_comm()
        if comm is not None:
            self._check_same(comm, state_dict, strict)
        with collective_call(comm, LOAD_STATE_DICT, AFTER_LOAD, check=False):
            return self._load(state_dict, strict)

    def _check_same(self, comm: Comm, state_dict: dict[str, torch.Tensor], strict: bool) -> None:
        """DistributedError on every rank unless every rank is in load_state_dict (Comm.agree_on) with the same
        `strict` and the same state dict: its keys, and a digest of each value (agreement.compare_contents)."""
        values = dict(state_dict.items()) if hasattr(state_dict, "items") else {"the state dict": state_dict}
        differ = compare_contents(comm, LOAD_STATE_DICT, {"strict": strict}, {str(k): v for k, v in values.items()},
                                  "state dict entries", AFTER_LOAD)
        if differ is not None:
            raise DistributedError(
                f"pstar-fx: the ranks called {LOAD_STATE_DICT} with different state dicts ({differ}). A sharded step "
                "keeps each rank's shard of every chunk, written from the state dict that rank was given, so it "
                "would hold a mix of the ranks' values, with no error. Give every rank the same state dict (read "
                "from the same file on every rank, or broadcast from one rank). Nothing was loaded: the step's "
                "values and the model are as they were.")

    def _load(self, state_dict: dict[str, torch.Tensor], strict: bool) -> IncompatibleKeys:
        self.fill_if_empty()
        ref = self.model.state_dict(keep_vars=True)      # keys and shapes (no values copied out of the chunks)
        missing = [k for k in ref if k not in state_dict]
        unexpected = [k for k in state_dict if k not in ref]
        errors = []
        if strict and unexpected:
            errors.append("Unexpected key(s) in state_dict: " + ", ".join(f'"{k}"' for k in unexpected) + ".")
        if strict and missing:
            errors.append("Missing key(s) in state_dict: " + ", ".join(f'"{k}"' for k in missing) + ".")
        errors.extend(f"size mismatch for {k}: copying a param with shape {tuple(v.shape)} from checkpoint, the shape "
                      f"in current model is {tuple(ref[k].shape)}." for k, v in state_dict.items()
                      if k in ref and tuple(v.shape) != tuple(ref[k].shape))
        if errors:
            raise RuntimeError(f"Error(s) in loading state_dict for {type(self.model).__name__} (nothing was loaded):"
                               "\n\t" + "\n\t".join(errors))
        if not self.holds():
            if any(is_empty(t) for t in model_tensors(self.model).values()):
                raise ValueError("step.load_state_dict: the model was built under px.init_empty(), so its values "
                                 "will live in the step's chunks, which do not exist yet: call step.lower(*batch) "
                                 "(or run a step) first, then step.load_state_dict")
            for h in holders(self.model):
                h.give_back()               # the model's values must be real before they are overwritten
            self.model.load_state_dict(state_dict, strict=strict)
            tensors = model_tensors(self.model)
            first = {id(t): n for n, t in tensors.items()}
            for k, v in state_dict.items():     # values the model's half-precision parameters hold only rounded
                if k in self.names and self.names[k][0] is Role.PARAM and torch.is_tensor(v) \
                        and half_precision(ref[k].dtype) \
                        and full_dtype(v, ref[k]) is not ref[k].dtype:
                    n = first[id(ref[k])]      # (held in fp32, as the step would hold them: a float64 value rounded)
                    self.loaded_full[n] = (v.detach().to(torch.float32, copy=True), Mark(tensors[n]))
            return IncompatibleKeys(missing, unexpected)
        pv, bv = {}, {}
        for k, v in state_dict.items():
            if k in self.names:
                kind, name = self.names[k]
                (pv if kind is Role.PARAM else bv)[name] = v
        with DeferredInterrupt():            # a Ctrl-C waits until every value is in: never half loaded
            self.compiler.store.values.load_params(pv)
            self.compiler.store.values.load_buffers(bv)
        return IncompatibleKeys(missing, unexpected)
