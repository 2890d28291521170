"""Who holds a model's values: the model itself, or a compiled step's chunks. Never both, so never a stale copy, and
never neither, so never a lost one.

Once a compiled step has copied a model's parameters and buffers into its chunks, it *holds* the model: each of the
model's parameter and buffer objects is turned, in place (`torch.utils.swap_tensors`, so every reference the user
kept sees it too), into a `HeldTensor` with the same shape, dtype, device and requires_grad but no data. Using one
raises `ModelHeldError`, which says how to get the values; the model's own copy of the data is freed (pstar-fx keeps
one copy of the model, in its chunks). `ModelHold.give_back()` turns the same objects back into real tensors with
the current values: the model is the user's again, and the next step copies it into the chunks anew, so edits made
in between are seen.

The values outlive whichever of the two is dropped first. A `ModelHold` (the step's chunk store and how to read a
model tensor's value out of it) is referenced strongly by the step and by each HeldTensor of the model:
- the step dropped (a training function that returns the model without `sync_model()`, a notebook cell that compiles
  again, a throwaway evaluation step, an exception unwinding the training loop): its finalizer gives the model its
  values back at once, and the chunk memory is freed. With several ranks, giving back is a collective, which a
  finalizer (run whenever each rank's garbage collector gets to it) cannot issue; nor can pstar-fx's own worker
  threads, which a finalizer may find itself running on. The hold then stays with the model, the values with it,
  and the next eager use of one of its tensors gives the model back first (one rank), or raises ModelHeldError saying
  to call `sync_model()` of a step compiled on the model on every rank (several);
- the model dropped: the step keeps training on its chunks, and `step.state_dict()` / `save` read them.
Swapping the model's tensors in or out holds Ctrl-C until every tensor is swapped, so a model is never half held.

What stays readable on a held model: shapes, dtypes, `requires_grad` (and `requires_grad_()`, which the next step
sees), module structure, `model.train()` / `model.eval()`. What reads a held model to save or copy it sees the current
values, copied out of the chunks, without giving the model back (the step's next call is undisturbed):
`model.state_dict()` (a state_dict post-hook on each module with held tensors, so `torch.save(model.state_dict())`,
safetensors and `save_pretrained` write the trained values; `keep_vars=True` keeps the held objects themselves),
`copy.deepcopy(model)` and pickling (`torch.save(model)`), through HeldTensor's `__deepcopy__` and `__reduce_ex__`.
Reading a held tensor's storage directly (`data_ptr()`, `untyped_storage()`, `numpy()`, `share_memory_()`,
`__dlpack__()`) raises ModelHeldError; `torch.utils.dlpack.to_dlpack`, a C function that no subclass sees, exports no
value (its capsule points at nothing). With several ranks reading a value is a collective, which these per-tensor
paths cannot issue: they raise ModelHeldError saying to use `step.state_dict()` or `sync_model()`.

`ModelState` (api/step_model.py) is a compiled step's side of this: it takes the model into the step's chunks,
gives it back, and reads and loads the model's values by state_dict name, wherever they are.
"""
from __future__ import annotations

import os
import threading
import weakref
from typing import NamedTuple

import torch
import torch.nn as nn
from torch.multiprocessing.reductions import StorageWeakRef

from ..errors import CommitError, ModelHeldError, PstarError, warn
from ..interrupts import DeferredInterrupt
from ..ir.graph import Role
from ..runtime.comm import Comm, collective_call
from ..runtime.store_values import full_dtype
from ..units import format_bytes


class IncompatibleKeys(NamedTuple):
    """What load_state_dict returns, as nn.Module.load_state_dict does: the keys the state dict lacked, and those
    the model does not have."""
    missing_keys: list[str]
    unexpected_keys: list[str]


_METADATA_OPS = {torch.ops.aten.detach.default, torch.ops.aten.alias.default}
# the function the ranks agree they call (Comm.agree_on): step.sync_model() and px.sync_model(model) alike
SYNC_MODEL = "sync_model()"
AFTER_SYNC = ("What was not given back stays in the steps' chunks (the model's tensors still held): call sync_model() "
              "again, on every rank.")
LOAD_STATE_DICT = "step.load_state_dict()"
AFTER_LOAD = ("Nothing was loaded (where other steps held the model, some of them may have given it back): load the "
              "state dict again, on every rank.")
_WORKER_THREADS = "pstar-fx"      # the name prefix of pstar-fx's own threads (runtime/host_updates, host_memory)


class Mark:
    """A model tensor as it is now: its storage (weakly) and its version counter. `still(t)`: t is that tensor with
    the same storage, not changed in place since (a write through `.data`, which keeps the version, is caught by the
    values themselves: see full_where_rounded). A step that takes the model and gives it back makes new storages."""

    def __init__(self, t: torch.Tensor):
        self.storage = StorageWeakRef(t.untyped_storage())
        self.version = t._version

    def still(self, t: torch.Tensor) -> bool:
        return (not self.storage.expired() and t._version == self.version
                and StorageWeakRef(t.untyped_storage()).cdata == self.storage.cdata)


class ModelHold:
    """A compiled step's claim on a model's values: its chunk store, and where each of the model's tensors lives in
    it. Shared by the step and by the model's HeldTensors (see the module docstring)."""

    def __init__(self, step, model: nn.Module, store, names: dict[str, tuple[Role, str]], lock: threading.RLock):
        self._step = weakref.ref(step)
        self._model = weakref.ref(model)
        self.store = store
        self.names = names           # every state name of the model's tensors -> (PARAM or BUFFER, the store's name)
        self.lock = lock             # the step's: giving back waits for a step running on another thread
        self.giving_back = False     # inside give_back, which reads the held tensors' metadata
        # the model's half-precision parameters as this hold gave them back (their rounding of the store's
        # full-precision values), by model_tensors' name: while one is still that very tensor, unchanged (`Mark`),
        # the store's values are its full-precision ones (ModelState.take, _current)
        self.given_back: dict[str, Mark] = {}
        self.hooks: list = []         # the state_dict post-hooks on the model's modules while it is held
        self.broken: str | None = None   # the step failed after its commit point: its values are not one step's
        # per state dict being made (by id, while it lives): the copy of each held value, so tied tensors share one
        self._copies: dict[int, tuple[weakref.ref, dict[str, torch.Tensor]]] = {}
        finalizer = weakref.finalize(step, _step_dropped, self)
        finalizer.atexit = False     # at interpreter exit nothing needs the values any more

    @property
    def step(self):
        """The step that holds the model, or None once it was dropped."""
        return self._step()

    def refuse_if_broken(self, what: str) -> None:
        """CommitError where the step failed after its commit point: its values mix updated and unchanged chunks,
        and handing them out (to a state dict, a save, the model) could replace a good checkpoint."""
        if self.broken is not None:
            raise CommitError(f"{what} refused: the model's values are not consistent since a step failed after its "
                              f"commit point (some chunks updated, others not); load a checkpoint first "
                              f"(step.load(path)): {self.broken}")

    def values(self, names: list[str]) -> dict[str, torch.Tensor]:
        """The current values of the model tensors named (parameters at full precision: fp32 masters in mixed
        precision), as views of the store's memory. Sharded: a collective (every rank calls it with the same names)."""
        wanted = sorted({self.names[n][1] for n in names if self.names[n][0] is Role.PARAM})
        params = self.store.values.param_values(wanted)
        out = {}
        for n in names:
            kind, key = self.names[n]
            out[n] = params[key] if kind is Role.PARAM else self.store.buffers[key]
        return out

    def give_back(self) -> None:
        """The model's tensors held here become real tensors with their current values (the same Python objects).
        Nothing is given back twice: a second call, or one after another step took the model, does nothing."""
        with self.lock:
            model = self._model()
            if model is None:
                return
            held = {n: t for n, t in model_tensors(model).items() if holder(t) is self}
            if not held:
                return
            self.giving_back = True
            try:
                values = self.values(list(held))
                copies = {n: values[n].detach().to(device=t.device, dtype=t.dtype, copy=True)
                          for n, t in held.items()}
                drop_weight_refs(model)
                release(held, copies)
                self.given_back = {n: Mark(t) for n, t in held.items() if self.names[n][0] is Role.PARAM
                                   and full_dtype(values[n], t) is not t.dtype}
            finally:
                self.giving_back = False
            if not any(holder(t) is self for t in model_tensors(model).values()):
                self.remove_hooks()

    def remove_hooks(self) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks = []

    def copy_of(self, t: "HeldTensor") -> torch.Tensor:
        """A real tensor with the current value of one of the model's held tensors (its shape, dtype and device),
        copied out of the chunks. One rank only: with several, reading a value is a collective."""
        return self.copies([t])[0]

    def copies(self, tensors: list["HeldTensor"], memo: dict[str, torch.Tensor] | None = None) -> list[torch.Tensor]:
        """copy_of for several tensors at once; `memo` (store name -> copy) makes tied tensors share one copy."""
        if self.store.world > 1:
            raise ModelHeldError(
                f"'{tensors[0]._pstar_name}' is held by a pstar-fx compiled step on one of several ranks, where "
                "reading its value is a collective: call step.state_dict() (on every rank) for the values, or "
                "px.sync_model(model) (on every rank) to give the model back before saving or copying it")
        memo = {} if memo is None else memo
        with self.lock:
            wanted = [t._pstar_name for t in tensors if self.names[t._pstar_name][1] not in memo]
            values = self.values(wanted) if wanted else {}
            out = []
            for t in tensors:
                key = self.names[t._pstar_name][1]
                if key not in memo:
                    memo[key] = values[t._pstar_name].detach().to(device=t.device, dtype=t.dtype, copy=True)
                out.append(memo[key])
        return out

    def memo_for(self, state_dict: dict) -> dict[str, torch.Tensor]:
        """The copies made so far for this state dict (while it is being made and as long as it lives)."""
        entry = self._copies.get(id(state_dict))
        if entry is None or entry[0]() is not state_dict:
            key = id(state_dict)
            entry = (weakref.ref(state_dict, lambda _: self._copies.pop(key, None)), {})
            self._copies[key] = entry
        return entry[1]


def _step_dropped(hold: ModelHold) -> None:
    """The finalizer of a step that holds (or held) a model: give the model back, where that is safe now."""
    if hold.store.world > 1 or threading.current_thread().name.startswith(_WORKER_THREADS):
        return                   # given back at the model's next use (see the module docstring)
    short = _room_short(hold)
    if short is not None:
        warn(f"pstar-fx: a dropped step holds its model's values, and giving them back now needs {short}; they stay "
             "with the model (its chunk memory too) and are given back at its next use, or dropped with it",
             RuntimeWarning)
        return
    if hold.broken is not None:
        warn("pstar-fx: a dropped step that failed after its commit point gives its model values that mix updated "
             "and unchanged chunks (not one step's); load a checkpoint into the model before using it",
             RuntimeWarning)
    try:
        hold.give_back()
    except Exception as e:  # noqa: BLE001 - a finalizer cannot raise; the values stay with the model
        warn(f"pstar-fx: a dropped step could not give its model the values back ({type(e).__name__}: {e}); they "
             "stay with the model and are given back at its next use", RuntimeWarning)


def _room_short(hold: ModelHold) -> str | None:
    """What giving the model back would need beyond the memory free now (the copies are made before the chunks are
    freed), or None when it fits: a finalizer that runs out of host memory ends the process."""
    model = hold._model()
    if model is None:
        return None
    need: dict[torch.device, int] = {}
    hold.giving_back = True          # reading the held tensors' sizes must not give them back (see _orphans)
    try:
        for t in model_tensors(model).values():
            if holder(t) is hold:
                need[t.device] = need.get(t.device, 0) + t.numel() * t.element_size()
    finally:
        hold.giving_back = False
    for device, nbytes in need.items():
        free = _free_bytes(device)
        if free is not None and nbytes > free * 0.9:
            return f"{format_bytes(nbytes)} on {device} where {format_bytes(free)} is free"
    return None


def _free_bytes(device: torch.device) -> int | None:
    if device.type == "cpu":
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return None


class HeldTensor(torch.Tensor):
    """A model tensor whose value lives in a compiled step's chunks (see the module docstring)."""

    @staticmethod
    def __new__(cls, like: torch.Tensor, name: str, owner: ModelHold):
        t = torch.Tensor._make_wrapper_subclass(cls, like.shape, dtype=like.dtype, device=like.device,
                                                requires_grad=like.requires_grad)
        t._pstar_name = name
        t._pstar_owner = owner
        return t

    def __repr__(self, *, tensor_contents=None) -> str:
        return (f"HeldTensor({self._pstar_name}, shape={tuple(self.shape)}, dtype={self.dtype}: held by a "
                "pstar-fx step; step.sync_model() gives it back)")

    def __reduce_ex__(self, protocol):
        # pickling (torch.save(model), torch.save(list(model.parameters()))) writes the current value
        return self._value_copy().__reduce_ex__(protocol)

    def __deepcopy__(self, memo):
        # copy.deepcopy(model): the copy holds the current values, as real tensors of its own
        if id(self) not in memo:
            memo[id(self)] = self._value_copy()
        return memo[id(self)]

    def _value_copy(self) -> torch.Tensor:
        """A real tensor (a Parameter for a parameter) holding this tensor's current value."""
        value = self._pstar_owner.copy_of(self)
        if isinstance(self, nn.Parameter):
            return nn.Parameter(value, requires_grad=self.requires_grad)
        return value.requires_grad_(self.requires_grad) if value.is_floating_point() else value

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        held = [a for a in args if isinstance(a, HeldTensor)]
        if func in _METADATA_OPS and held:
            return HeldTensor(held[0], held[0]._pstar_name, held[0]._pstar_owner)
        name = held[0]._pstar_name if held else "?"
        raise _error(name, f"used by {func}")

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in _STORAGE_READS:
            raise _error(args[0]._pstar_name, f"read directly ({func.__name__}())")
        # a model whose step was dropped without giving it back (see the module docstring): given back now, before
        # the call reaches the dispatcher (which holds references that swapping a tensor cannot have)
        for h in _orphans(args):
            if h.store.world > 1:
                raise ModelHeldError(
                    "this model was held by a pstar-fx step that has been dropped; with several ranks its values "
                    "are given back collectively: call sync_model() of a step compiled on this model (on every "
                    "rank), or run such a step")
            h.give_back()
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))


# a held tensor has no storage: these would fail with torch's own error, crash the process (share_memory_) or hand
# out memory that is not the value (__dlpack__, which numpy's and others' from_dlpack call)
_STORAGE_READS = {torch.Tensor.data_ptr, torch.Tensor.untyped_storage, torch.Tensor.storage, torch.Tensor.numpy,
                  torch.Tensor.tolist, torch.Tensor.share_memory_, torch.Tensor.is_shared, torch.Tensor.__dlpack__,
                  torch.Tensor._typed_storage}


def _state_dict_values(module: nn.Module, state_dict: dict, prefix: str, local_metadata) -> None:
    """state_dict post-hook of a module with held tensors: its entries hold the current values (copies) instead of
    placeholders, so whatever saves the state dict (torch.save, safetensors, save_pretrained) writes the trained
    values. keep_vars=True puts the module's own tensor objects in the state dict: those are left as they are."""
    by_hold: dict[int, tuple[ModelHold, list[str], list[HeldTensor]]] = {}
    for slots in (module._parameters, module._buffers):
        for name, t in slots.items():
            key = prefix + name
            entry = state_dict.get(key)
            if isinstance(entry, HeldTensor) and entry is not t and isinstance(t, HeldTensor):
                h = t._pstar_owner
                by_hold.setdefault(id(h), (h, [], []))
                by_hold[id(h)][1].append(key)
                by_hold[id(h)][2].append(t)
    for h, keys, tensors in by_hold.values():
        h.refuse_if_broken("the model's state_dict()")
        for key, value in zip(keys, h.copies(tensors, h.memo_for(state_dict))):
            state_dict[key] = value


def _orphans(args) -> list[ModelHold]:
    """The holds of HeldTensors among the arguments (and in lists of them) whose step was dropped: a cheap scan,
    since every use of a held tensor comes here, `.shape` and `.requires_grad` included."""
    out: list[ModelHold] = []
    for a in args:
        for t in (a if isinstance(a, (list, tuple)) else (a,)):
            if (isinstance(t, HeldTensor) and t._pstar_owner.step is None and not t._pstar_owner.giving_back
                    and t._pstar_owner not in out):
                out.append(t._pstar_owner)
    return out


def _error(name: str, how: str) -> ModelHeldError:
    return ModelHeldError(
        f"'{name}' is held by a pstar-fx compiled step and was {how}: its current value lives in the step's chunks, "
        "not in the model. Call step.sync_model() to write the trained values back into the model (the next step "
        "takes them again, with any edits you made; pstar_fx.sync_model(model) does the same without the step), "
        "read step.state_dict(), or load values with step.load_state_dict(state_dict).")


def holder(t: torch.Tensor) -> ModelHold | None:
    """What holds a model tensor's value, or None when the tensor holds its own value."""
    if not isinstance(t, HeldTensor):
        return None
    return t._pstar_owner


def holders(model: nn.Module) -> list[ModelHold]:
    """Whatever holds any of the model's tensors now, in the order of the model's tensors."""
    out: list[ModelHold] = []
    for t in model_tensors(model).values():
        h = holder(t)
        if h is not None and h not in out:
            out.append(h)
    return out


def model_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every distinct parameter and buffer of the model, by its first name (tied tensors once)."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, t in list(model.named_parameters(remove_duplicate=False)) + list(
            model.named_buffers(remove_duplicate=False)):
        if t is not None and id(t) not in seen:
            seen.add(id(t))
            out[name] = t
    return out


def current_values(model: nn.Module) -> dict[str, torch.Tensor]:
    """The current value of every tensor of the model (model_tensors' names): each from whichever holds it now (a
    step's chunks, at full precision, or the tensor itself), not copied. With several holders (steps compiled on the
    model and on a part of it, or on two models sharing a tensor), each value comes from its own. Sharded: a
    collective."""
    tensors = model_tensors(model)
    out: dict[str, torch.Tensor] = {}
    by_hold: dict[int, tuple[ModelHold, list[str]]] = {}
    for name, t in tensors.items():
        h = holder(t)
        if h is None:
            out[name] = t.detach()
        else:
            by_hold.setdefault(id(h), (h, []))[1].append(name)
    for h, names in by_hold.values():
        with h.lock:
            values = h.values([tensors[n]._pstar_name for n in names])
        for n in names:
            out[n] = values[tensors[n]._pstar_name]
    return out


def sync_model(model: nn.Module) -> nn.Module:
    """Give the model its values back from whatever holds its tensors (one step or several, live or dropped): the
    same as `step.sync_model()` of a step compiled on it, for when that step is out of reach (a training function
    that was interrupted keeps its step alive in the traceback). Returns the model. With several ranks, a collective
    where a step holds any of the model's tensors: every rank first checks that every rank calls it (see
    `sync_comm`)."""
    with collective_call(sync_comm(model), SYNC_MODEL, AFTER_SYNC):
        for h in holders(model):
            h.give_back()
    return model


def sync_comm(model: nn.Module, comm: Comm | None = None, taking: bool = False) -> Comm | None:
    """The Comm over which the ranks check that each calls sync_model() (Comm.agree_on, before its first
    collective), where it runs collectives: a step of several ranks holds some of the model's tensors (giving them
    back gathers their chunks), or (`taking`) the step, of `comm`, takes a model built under px.init_empty() into
    its chunks first. None where it runs none (nothing held, or one rank): nothing to check."""
    for h in holders(model):
        if h.store.comm is not None:
            return comm if comm is not None else h.store.comm
    return comm if taking else None


def hold(model: nn.Module, owner: ModelHold) -> None:
    """Turn the model's parameters and buffers into HeldTensors held by `owner` (their data is dropped). Each must hold
    its own value (none held by another step). Ctrl-C waits until every tensor is swapped."""
    stand_ins = []
    for name, t in model_tensors(model).items():
        assert not isinstance(t, HeldTensor), f"{name} is held already"
        stand_in = HeldTensor(t, name, owner)
        if isinstance(t, nn.Parameter):
            stand_in = nn.Parameter(stand_in, requires_grad=t.requires_grad)
        stand_ins.append((name, t, stand_in))
    drop_weight_refs(model)
    _swap_all(stand_ins)
    if not owner.hooks:
        owner.hooks = [m.register_state_dict_post_hook(_state_dict_values) for m in model.modules()
                       if any(isinstance(t, HeldTensor) for t in (*m._parameters.values(), *m._buffers.values()))]


def release(held: dict[str, torch.Tensor], values: dict[str, torch.Tensor]) -> None:
    """Give held tensors their values back: each HeldTensor in `held` becomes a real tensor (the same Python object)
    holding its value from `values` (which it keeps, not copies). Ctrl-C waits until every tensor is swapped."""
    pairs = []
    for name, t in held.items():
        v = values[name]
        pairs.append((name, t, nn.Parameter(v, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else v))
    _swap_all(pairs)


class _Gone:
    pass


def _dead_ref() -> weakref.ref:
    return weakref.ref(_Gone())          # (its object is freed at once: the reference is dead)


def drop_weight_refs(model: nn.Module) -> None:
    """Replace the weak references nn.LSTM, nn.GRU and nn.RNN keep to their weights (to notice a weight replaced
    under them; an eager forward, copy.deepcopy or torch.save makes them again) by dead ones: torch.utils.swap_tensors
    refuses a tensor that has a weak reference, and a dead one tells the module's next forward that its weights
    changed, so it takes them anew (a trace leaves fake tensors in its list of them)."""
    for m in model.modules():
        refs = m.__dict__.get("_flat_weight_refs")
        if isinstance(m, nn.RNNBase) and refs:
            m._flat_weight_refs = [None if r is None else _dead_ref() for r in refs]


def _swap_all(pairs: list[tuple[str, torch.Tensor, torch.Tensor]]) -> None:
    """Swap each (name, tensor, new) pair's tensors, all or none: where one cannot be swapped, those swapped before
    it are swapped back (so a model is never half held) and the error names the tensor."""
    with DeferredInterrupt():                # a Ctrl-C waits until every tensor is swapped
        for i, (name, t, new) in enumerate(pairs):
            try:
                torch.utils.swap_tensors(t, new)
            except RuntimeError as e:
                for _, t_done, new_done in reversed(pairs[:i]):
                    torch.utils.swap_tensors(t_done, new_done)
                if "use_count" not in str(e):
                    raise
                raise PstarError(
                    f"the model's tensor {name!r} is still referenced by an autograd graph (the output of an eager "
                    "forward, or a loss computed with the model, kept in a variable), so pstar-fx cannot move it "
                    "into its chunks or back: drop those outputs (del out), or compute them under torch.no_grad(); "
                    "nothing was changed") from e


def holds_own_values(model: nn.Module) -> bool:
    """Some tensor of the model holds its own value (no step holds it): a step called now takes the model."""
    return any(holder(t) is None for t in model_tensors(model).values())
