"""Recording a model's construction under `px.init_empty()` (see pstar_fx.frontend.init_empty for the whole).

Recording (inside the block). Tensor constructors called without a device (`torch.empty`, `zeros`, `ones`, `full`,
`arange`, `randn`, ...; not `torch.tensor` and `as_tensor`, whose data is given) make meta tensors (a
TorchFunctionMode, like `torch.device("meta")`, which would also make `torch.tensor([])` a meta tensor, and then
transformers skips its weight initialisation). A TorchDispatchMode records, in order, every aten op that involves a
meta tensor: the creations, `nn.init`'s `normal_` / `uniform_` / `zero_` / `fill_`, `copy_`, `mul_`, out-of-place
ops that compute buffers (rotary `inv_freq`), with each tensor argument as a view (shape, stride, offset, dtype) of a
recorded storage, so `.data`, slices and `Parameter(...)` need no bookkeeping of their own. Some torch.nn.init
functions skip meta tensors (torch 2.13: `trunc_normal_`, `orthogonal_`, `sparse_`, `dirac_`; their real paths depend
on values: rejection sampling, QR): a torch.nn.init function that asks `tensor.is_meta` of a recorded tensor (seen by
the same TorchFunctionMode) is recorded as one call, with its arguments, and called as it is at replay. Random ops
remember the CPU RNG state they would draw from: the global state at the first one, and again wherever it was set in
between (`torch.manual_seed` inside the block). When the block ends, every parameter and buffer
of the modules that registered one in it, if it is such a meta tensor, is swapped in place
(`torch.utils.swap_tensors`) for an `EmptyTensor`: shape, dtype, requires_grad, device cpu, no data, and its view of
the recording. Using one eagerly raises `EmptyModelError`.

What cannot be recorded raises `EmptyModelError` naming the op and what to change: an op that needs a tensor's
value (`.item()`, `nonzero`), a random op given an explicit `generator`, random numbers drawn on a real CPU tensor
inside the block (on a real CUDA tensor with device="cuda": they would move the global RNG the replay emulates), an
in-place op on a real tensor with a meta operand, `set_` / `resize_`; at replay, a real tensor read while recording
that was modified since, or a meta tensor made outside the block. A plain tensor attribute (not a parameter or
buffer) made inside the block stays a meta tensor.
"""
from __future__ import annotations

import functools
import sys
import threading
import traceback
import weakref
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode
from torch.utils._device import _device_constructors
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack
from torch.utils._pytree import tree_leaves, tree_map

from ...errors import EmptyModelError
from ...ir.fx_utils import is_user_file

_aten = torch.ops.aten
_META = torch.device("meta")
_CPU = torch.device("cpu")


# -- what the recording holds -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Ref:
    """A tensor argument: a view of a recorded storage."""
    storage: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype


@dataclass(frozen=True)
class Const:
    """A real tensor read by a recorded op (kept, and checked unchanged at replay)."""
    index: int


@dataclass(frozen=True)
class Foreign:
    """A meta tensor that was not made inside the block: its values are unknown."""
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Storage:
    nbytes: int
    dtype: torch.dtype          # of the tensor that created it (the replay's flat view of it)


@dataclass(frozen=True)
class RecordedOp:
    func: object                           # the aten overload to run (its generator overload for random ops)
    args: tuple
    kwargs: dict
    creates: tuple[tuple[int, int], ...]   # (output leaf index, storage) for every storage the op creates
    reads: frozenset[int]                  # storages among the tensor arguments (written ones too)
    writes: frozenset[int]
    random: bool
    rng_state: torch.Tensor | None         # random ops: the CPU RNG state, where it differs from the previous one's
    undefined: bool                        # torch.empty & co: the values made are undefined (nothing to compute)
    where: str
    call: bool = False                     # a torch.nn.init function recorded whole (func is that function)


@dataclass(eq=False)
class Recording:
    """What a `px.init_empty()` block built: its ops in order, the storages they made, the real tensors they read."""
    steps: list[RecordedOp] = field(default_factory=list)
    storages: list[Storage] = field(default_factory=list)
    consts: list[tuple[torch.Tensor, int]] = field(default_factory=list)   # (tensor, its _version when read)
    device: torch.device | None = None   # None: replayed on the CPU in place; else streamed through this device


# -- the stand-in the model holds after the block ------------------------------------------------------------------
_METADATA_OPS = {_aten.detach.default, _aten.alias.default}


class EmptyTensor(torch.Tensor):
    """A parameter or buffer of a model built under `px.init_empty()`: no data until a compiled step makes it."""

    @staticmethod
    def __new__(cls, like: torch.Tensor, label: str, recording: Recording, ref: Ref):
        t = torch.Tensor._make_wrapper_subclass(cls, like.shape, dtype=like.dtype, device=_CPU,
                                                requires_grad=like.requires_grad)
        t._pstar_label = label
        t._pstar_recording = recording
        t._pstar_ref = ref
        return t

    def __repr__(self, *, tensor_contents=None) -> str:
        return (f"EmptyTensor({self._pstar_label}, shape={tuple(self.shape)}, dtype={self.dtype}: built under "
                "px.init_empty(); its values are made by the compiled step)")

    def __reduce_ex__(self, protocol):
        raise _unfilled(self._pstar_label, "saved")

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        empty = [a for a in tree_leaves((args, kwargs)) if isinstance(a, EmptyTensor)]
        if func in _METADATA_OPS and empty:
            e = empty[0]
            return EmptyTensor(e, e._pstar_label, e._pstar_recording, e._pstar_ref)
        raise _unfilled(empty[0]._pstar_label if empty else "?", f"used by {func}")

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))


def _unfilled(label: str, how: str) -> EmptyModelError:
    return EmptyModelError(
        f"'{label}' belongs to a model built under px.init_empty() and was {how}: it has no values yet. Compile the "
        "model (px.compile) and run the step (or step.lower(*batch) and then step.state_dict()): the first use "
        "initialises it in the step's chunks; step.sync_model() then gives the model real tensors.")


def is_empty(t: torch.Tensor) -> bool:
    return isinstance(t, EmptyTensor)


# -- recording ----------------------------------------------------------------------------------------------------
# constructors given their data: stay real (transformers tests `torch.tensor([]).device` to skip initialisation)
_DATA_CONSTRUCTORS = {torch.tensor, torch.as_tensor, torch.asarray}
_UNDEFINED = {_aten.empty.memory_format, _aten.empty_strided.default, _aten.empty_like.default,
              _aten.new_empty.default, _aten.new_empty_strided.default, _aten.empty_permuted.default}
_UNSUPPORTED = {_aten.set_, _aten.resize_, _aten.resize_as_, _aten._local_scalar_dense}


_IS_META = torch._C.TensorBase.__dict__["is_meta"]
_INIT_FILE = torch.nn.init.__file__


class _Construction(TorchFunctionMode):
    """Tensor constructors called without a device make meta tensors (as under `torch.device("meta")`), except the
    ones given their data. A torch.nn.init function that asks whether its tensor is on meta is about to skip it
    (torch does so for trunc_normal_, orthogonal_, sparse_, dirac_, whose real paths depend on values: rejection
    sampling, QR): the recorder records that call whole, to run it as it is at replay."""

    def __init__(self, recorder: "_Recorder"):
        super().__init__()
        self.constructors = _device_constructors() - _DATA_CONSTRUCTORS
        self.recorder = recorder

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.constructors and kwargs.get("device") is None:
            kwargs = {**kwargs, "device": _META}
        elif func in _DATA_CONSTRUCTORS and kwargs.get("device") is None and self.recorder.device is not None:
            kwargs = {**kwargs, "device": self.recorder.device}     # as under torch.device(device)
        elif getattr(func, "__self__", None) is _IS_META and args and self.recorder.ref(args[0]) is not None:
            caller = sys._getframe(1)
            if caller.f_code.co_filename == _INIT_FILE:
                self.recorder.record_call(caller)
        return func(*args, **kwargs)


def _where() -> str:
    """The innermost frame of the caller's code (outside torch and pstar-fx), for messages."""
    user = None
    for fr in traceback.extract_stack()[:-1]:
        if is_user_file(fr.filename):
            user = fr
    return "at an unknown source line" if user is None else f"at {user.filename}:{user.lineno} ({user.line})"


def _arg(func, args, kwargs, name: str):
    """The value of the named argument of an aten call (None where absent)."""
    for i, a in enumerate(func._schema.arguments):
        if a.name == name:
            return args[i] if i < len(args) and not a.kwarg_only else kwargs.get(name)
    return None


def _written(func, args, kwargs) -> list[torch.Tensor]:
    out = []
    for i, a in enumerate(func._schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            v = args[i] if i < len(args) and not a.kwarg_only else kwargs.get(a.name)
            out += [t for t in tree_leaves(v) if isinstance(t, torch.Tensor)]
    return out


@functools.cache
def _generator_overload(func):
    """The overload of a random op that takes a generator (randn.default -> randn.generator), or None."""
    names = [a.name for a in func._schema.arguments]
    if "generator" in names:
        return func
    for name in func.overloadpacket.overloads():
        cand = getattr(func.overloadpacket, name)
        cnames = [a.name for a in cand._schema.arguments]
        if "generator" in cnames and [n for n in cnames if n != "generator"] == names:
            return cand
    return None


def _is_random(func) -> bool:
    return torch.Tag.nondeterministic_seeded in getattr(func, "tags", ())


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _draws_from(leaves) -> str:
    """The device type whose default generator a random op without a generator argument draws from."""
    for x in leaves:
        if isinstance(x, torch.Tensor) and x.device.type != "cpu":
            return x.device.type
        if isinstance(x, torch.device) and x.type != "cpu":
            return x.type
    return "cpu"


def device_rng_state(device: torch.device | None) -> torch.Tensor:
    """The state of the default generator random ops draw from on `device` (None: the CPU)."""
    if device is None or device.type == "cpu":
        return torch.random.default_generator.get_state()
    return torch.cuda.get_rng_state(device)


def set_device_rng_state(device: torch.device | None, state: torch.Tensor) -> None:
    if device is None or device.type == "cpu":
        torch.random.default_generator.set_state(state)
    else:
        torch.cuda.set_rng_state(state, device)


def _on_meta(leaves) -> bool:
    return any((isinstance(x, torch.Tensor) and x.is_meta) or (isinstance(x, torch.device) and x.type == "meta")
               for x in leaves)


class _Recorder(TorchDispatchMode):
    """Records every aten op on meta tensors into a Recording (see the module docstring)."""

    def __init__(self, device: torch.device | None = None):
        super().__init__()
        self.device = device                     # whose generator random ops draw from (None: the CPU's)
        self.rec = Recording(device=device)
        self.sid: dict[int, int] = {}            # storage key -> storage index
        self.keep: list = []                     # the meta storages, so that no key is reused while recording
        self.rng: torch.Tensor | None = None     # the RNG state the last random op drew from
        self.last_call = None                    # the frame of the last call recorded whole

    def ref(self, t) -> Ref | None:
        """The recorded storage view a tensor is, or None (not a tensor, not meta, or made outside the block)."""
        if not isinstance(t, torch.Tensor) or isinstance(t, EmptyTensor) or not t.is_meta:
            return None
        sid = self.sid.get(_storage_key(t))
        if sid is None:
            return None
        return Ref(sid, tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.dtype)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        leaves = tree_leaves((args, kwargs))
        if not _on_meta(leaves):
            kind = "cpu" if self.device is None else self.device.type
            if _is_random(func) and _arg(func, args, kwargs, "generator") is None and _draws_from(leaves) == kind:
                raise EmptyModelError(
                    f"px.init_empty(): {func} draws random numbers for a real {kind.upper()} tensor {_where()}; inside "
                    "the block that would move the global RNG, so the model's initialisation would no longer equal "
                    "eager's. Create the tensor without a device argument (it is then recorded), or outside the "
                    "block.")
            return func(*args, **kwargs)
        return self.record(func, args, kwargs)

    def record_call(self, frame) -> None:
        """Record the call of the torch.nn.init function running in `frame` (its arguments as bound there)."""
        if frame is self.last_call:
            return
        self.last_call = frame
        code = frame.f_code
        fn = frame.f_globals[code.co_name]
        local = frame.f_locals
        if local.get("generator") is not None:
            raise EmptyModelError(
                f"px.init_empty(): torch.nn.init.{code.co_name} {_where()} is given an explicit generator; the "
                "recording replays random ops from the global RNG only. Drop the generator argument (seed with "
                "torch.manual_seed), or build the model outside px.init_empty().")
        names = code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]
        values = {n: self.ref(local[n]) or local[n] for n in names}
        if any(isinstance(v, torch.Tensor) for v in values.values()):
            raise EmptyModelError(f"px.init_empty(): torch.nn.init.{code.co_name} {_where()} takes a tensor that "
                                  "is not one of the model being built; call it outside px.init_empty()")
        args = tuple(values[n] for n in names[:code.co_argcount])
        kwargs = {n: values[n] for n in names[code.co_argcount:]}
        touched = frozenset(v.storage for v in values.values() if isinstance(v, Ref))
        self.rec.steps.append(RecordedOp(fn, args, kwargs, (), touched, touched, True, self.rng_state(), False,
                                         _where(), call=True))

    def rng_state(self) -> torch.Tensor | None:
        """A random op is recorded: the RNG state it draws from (the CPU's, or the replay device's), if it differs
        from the previous one's."""
        state = device_rng_state(self.device)
        if self.rng is None or not torch.equal(state, self.rng):
            self.rng = state
            return state
        return None

    def record(self, func, args, kwargs):
        tags = getattr(func, "tags", ())
        if (func.overloadpacket in _UNSUPPORTED or torch.Tag.data_dependent_output in tags
                or torch.Tag.dynamic_output_shape in tags):
            raise EmptyModelError(
                f"px.init_empty(): {func} {_where()} needs the values of a tensor of the model being built (or changes "
                "a tensor's storage), and under px.init_empty() nothing has values yet. Compute it from Python "
                "numbers, or make that tensor with an explicit device='cpu' (it is then real), or build the model "
                "outside px.init_empty().")
        random = _is_random(func)
        replay = func
        if random:
            if _arg(func, args, kwargs, "generator") is not None:
                raise EmptyModelError(
                    f"px.init_empty(): {func} {_where()} is given an explicit generator; the recording replays random "
                    "ops from the global RNG only. Drop the generator argument (seed with torch.manual_seed), or "
                    "build the model outside px.init_empty().")
            replay = _generator_overload(func)
            if replay is None:
                raise EmptyModelError(f"px.init_empty(): the random op {func} {_where()} has no overload that takes "
                                      "a generator, so it cannot be replayed; build the model outside "
                                      "px.init_empty() (and report the op to pstar-fx)")
        for t in _written(func, args, kwargs):
            if not t.is_meta:
                raise EmptyModelError(
                    f"px.init_empty(): {func} {_where()} writes a real tensor from a tensor of the model being built, "
                    "which has no values yet; make that tensor inside the block without a device argument.")
        rec = self.rec
        reads, writes = set(), set()
        written = {id(t) for t in _written(func, args, kwargs)}

        def to_ref(x):
            if not isinstance(x, torch.Tensor):
                return x
            if not x.is_meta:
                rec.consts.append((x, x._version))
                return Const(len(rec.consts) - 1)
            r = self.ref(x)
            if r is None:
                return Foreign(tuple(x.shape))
            reads.add(r.storage)
            if id(x) in written:
                writes.add(r.storage)
            return r

        def to_meta(x):
            if isinstance(x, torch.Tensor) and not x.is_meta:
                return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=_META)
            return x

        rargs, rkwargs = tree_map(to_ref, (tuple(args), dict(kwargs)))
        margs, mkwargs = tree_map(to_meta, (tuple(args), dict(kwargs)))
        out = func(*margs, **mkwargs)
        creates = []
        for j, o in enumerate(tree_leaves(out)):
            if isinstance(o, torch.Tensor) and o.is_meta and _storage_key(o) not in self.sid:
                storage = o.untyped_storage()
                self.keep.append(storage)
                self.sid[_storage_key(o)] = len(rec.storages)
                creates.append((j, len(rec.storages)))
                rec.storages.append(Storage(storage.nbytes(), o.dtype))
        rng_state = self.rng_state() if random else None
        if creates or writes or random:
            where = _where() if any(isinstance(x, (Const, Foreign)) for x in tree_leaves((rargs, rkwargs))) else ""
            rec.steps.append(RecordedOp(replay, rargs, rkwargs, tuple(creates), frozenset(reads), frozenset(writes),
                                   random, rng_state, func in _UNDEFINED, where))
        return out


class init_empty:
    """`with px.init_empty(): model = Model(...)` builds the model without allocating its parameters and buffers;
    `px.compile(model, ...)` initialises them in its chunks at the first step, equal to an eager build on the CPU with
    the same RNG state. `px.init_empty(device="cuda")`: the same, made on that GPU tensor by tensor at the first step
    (fast), equal to an eager build under `with torch.device("cuda"):` with the same CUDA RNG state. See the module
    docstring of pstar_fx.frontend.init_empty for how, and for the global RNG afterwards."""

    def __init__(self, device: torch.device | str | None = None):
        self._device = None if device is None else torch.device(device)
        if self._device is not None and self._device.type not in ("cpu", "cuda"):
            raise ValueError(f"px.init_empty(device={str(device)!r}): the initialisation runs on the CPU "
                             "(device=None) or on a CUDA device (device='cuda'); build on the CPU or a CUDA GPU")
        if self._device is not None and self._device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"px.init_empty(device={str(device)!r}): CUDA is not available here; use "
                             "px.init_empty() (the CPU)")
        self._recorder: _Recorder | None = None

    def __enter__(self) -> "init_empty":
        if any(isinstance(m, _Recorder) for m in _get_current_dispatch_mode_stack()):
            raise EmptyModelError("px.init_empty() blocks do not nest: build the whole model in one block")
        device = None                         # the CPU: replayed in place, into the chunks' host memory
        if self._device is not None and self._device.type == "cuda":
            index = self._device.index
            device = torch.device("cuda", torch.cuda.current_device() if index is None else index)
        self._recorder = _Recorder(device)
        self._modules: weakref.WeakSet = weakref.WeakSet()
        thread = threading.get_ident()

        def registered(module, name, value):
            if threading.get_ident() == thread:
                self._modules.add(module)
                if isinstance(value, nn.Module):
                    self._modules.add(value)

        reg = torch.nn.modules.module
        self._hooks = [reg.register_module_parameter_registration_hook(registered),
                       reg.register_module_buffer_registration_hook(registered),
                       reg.register_module_module_registration_hook(registered)]
        self._constructors = _Construction(self._recorder)
        self._constructors.__enter__()
        self._recorder.__enter__()
        return self

    def __exit__(self, exc_type, exc, tb):
        try:
            self._recorder.__exit__(exc_type, exc, tb)
        finally:
            self._constructors.__exit__(exc_type, exc, tb)
            for h in self._hooks:
                h.remove()
        if exc_type is None:
            _stand_in(list(self._modules), self._recorder)
        self._recorder.keep.clear()            # storage keys may be reused from here on: forget them
        self._recorder.sid.clear()
        self._recorder.last_call = None
        self._modules = weakref.WeakSet()
        return False


def _stand_in(modules: list[nn.Module], recorder: _Recorder) -> None:
    """Swap every recorded meta parameter and buffer of these modules for an EmptyTensor, in place."""
    slots: dict[int, list[tuple[nn.Module, str, str]]] = {}
    tensors: dict[int, torch.Tensor] = {}
    for mod in modules:
        for kind in ("_parameters", "_buffers"):
            for name, t in getattr(mod, kind).items():
                if recorder.ref(t) is None:
                    continue
                slots.setdefault(id(t), []).append((mod, kind, name))
                tensors[id(t)] = t
    labels = _labels(modules)
    for key, t in tensors.items():
        mod, kind, name = slots[key][0]
        stand_in = EmptyTensor(t, labels.get(key, f"{type(mod).__name__}.{name}"), recorder.rec, recorder.ref(t))
        if isinstance(t, nn.Parameter):
            stand_in = nn.Parameter(stand_in, requires_grad=t.requires_grad)
        try:
            torch.utils.swap_tensors(t, stand_in)
        except RuntimeError:       # something else still refers to the meta tensor: replace it in its slots
            for mod, kind, name in slots[key]:
                getattr(mod, kind)[name] = stand_in


def _labels(modules: list[nn.Module]) -> dict[int, str]:
    """A name for each tensor of these modules, for messages: `GPT.h.0.attn.c_attn.weight`, from the outermost
    module (one that no other of them contains)."""
    inner = {id(c) for m in modules for c in m.children()}
    labels: dict[int, str] = {}
    for root in modules:
        if id(root) not in inner:
            for name, t in [*root.named_parameters(remove_duplicate=False),
                            *root.named_buffers(remove_duplicate=False)]:
                labels.setdefault(id(t), f"{type(root).__name__}.{name}")
    return labels
