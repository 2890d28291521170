"""`px.init_empty()`: build a model without allocating it; its first compiled step initialises it in its chunks.

    torch.manual_seed(0)
    with px.init_empty():
        model = GPT(cfg)                 # no parameter memory is allocated
    step = px.compile(model, optimizer=px.AdamW(lr=3e-4))(loss_fn)
    step(x, y)                           # first: the initial values are made in the chunks, then the step runs

The values equal, bit for bit, those `torch.manual_seed(0); model = GPT(cfg)` makes on the CPU (the default device),
and at no time does a second copy of the model exist in host memory: each initialisation op writes straight into the
chunk memory that holds the parameter for training.

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

Replay (`fill_chunks`, at the compiled step's first use of the model). The recorded ops run again on the CPU, in
order, skipping those whose results nothing needs: every random op runs (it consumes the generator as in eager,
also for a tensor that was later replaced, such as a tied `lm_head.weight`); other ops run when what they write or
create is read later by an op that runs or ends up in a parameter or buffer. A parameter whose storage is exactly
that parameter, in the dtype of its chunk's full-precision home (the chunk's host buffer in fp32, the fp32 master in
mixed precision), is that home: its ops write in place there. Anything else (a buffer, an intermediate, a dead
tensor, a parameter of another dtype) lives in a temporary freed after its last use; parameters in one are copied
into their chunk then. So at most a few tensors exist beyond the chunks at a time, never the model. Random ops draw
from a `torch.Generator` set to the recorded state; a torch.nn.init call recorded whole runs with the global CPU RNG
set to that generator's state and restored right after (such a function may draw from the global generator whatever
its arguments: `sparse_`'s `randperm` does).

The global RNG: building on meta draws nothing, so after the block the global CPU RNG is where it was when the block
began (or where a `torch.manual_seed` inside the block set it), not advanced as an eager build advances it; the replay
uses its own generator and leaves the global RNG untouched. Code that draws after building the model (dropout, data
order) draws different numbers than after an eager build: seed again after building to make both agree.

On a GPU: `px.init_empty(device="cuda")`. The CPU replay above runs every random op on the CPU's serial generator
(19 s for a 1.3B GPT in bf16 on the H200 machine's host: minutes at 16B). With a device, the recording takes the
RNG state of that GPU's generator instead (at the first random op, and again wherever `torch.manual_seed` or
`torch.cuda.manual_seed` set it), data constructors called without a device (`torch.tensor`) make real tensors on
that GPU, and the replay (`_replay_streamed`) runs there with a CUDA `torch.Generator` set to the recorded states,
storage by storage: a storage gets device memory at the first step that needs its memory and loses it after its
last, when each parameter in it is converted on the device and copied into its chunk's host homes (the fp32 master
and the half-precision chunk). Between two of its steps it keeps its memory only if the second is the very next step
run; otherwise its value is dropped if that step replaces it whole without reading it (per-op table
`_OVERWRITING_OPS`: Linear's kaiming_uniform_ overwritten by the model's own normal_), or else parked on the host (in
its chunk home if it is exactly one parameter) and brought back. So the GPU holds one tensor (and its bf16 copy) at a
time, not the model; the values equal an eager build under `with torch.device("cuda"):` from the same seed, bit for
bit (same kernels, same Philox offsets, on the same GPU), and a torch.nn.init call recorded whole runs with that GPU's
global generator set to the replay's state, under `torch.device(device)`. Measured on an H200: a 1.3B GPT in 0.3 s,
4.2B in 0.7 s (6 Gparam/s). After the block the GPU's RNG is where it was (or where a manual_seed in the block set
it), not advanced as an eager CUDA build advances it; the CPU's is untouched, as by an eager CUDA build. The model's
stand-ins still report device cpu (pstar-fx keeps the model on the host).

What cannot be recorded raises `EmptyModelError` naming the op and what to change: an op that needs a tensor's
value (`.item()`, `nonzero`), a random op given an explicit `generator`, random numbers drawn on a real CPU tensor
inside the block (on a real CUDA tensor with device="cuda": they would move the global RNG the replay emulates), an
in-place op on a real tensor with a meta operand, `set_` / `resize_`; at replay, a real tensor read while recording
that was modified since, or a meta tensor made outside the block. A plain tensor attribute (not a parameter or
buffer) made inside the block stays a meta tensor.
"""
from __future__ import annotations

import functools
import hashlib
import itertools
import re
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

from .errors import PstarError
from .graph_utils import is_user_file

_aten = torch.ops.aten
_META = torch.device("meta")
_CPU = torch.device("cpu")


class EmptyModelError(PstarError):
    """A model built under `px.init_empty()` was used before pstar-fx gave it values, or its construction did
    something the recording cannot replay exactly. The message names the tensor or op and what to change."""


# -- what the recording holds -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Ref:
    """A tensor argument: a view of a recorded storage."""
    storage: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype


@dataclass(frozen=True)
class _Const:
    """A real tensor read by a recorded op (kept, and checked unchanged at replay)."""
    index: int


@dataclass(frozen=True)
class _Foreign:
    """A meta tensor that was not made inside the block: its values are unknown."""
    shape: tuple[int, ...]


@dataclass(frozen=True)
class _Storage:
    nbytes: int
    dtype: torch.dtype          # of the tensor that created it (the replay's flat view of it)


@dataclass(frozen=True)
class _Step:
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
    steps: list[_Step] = field(default_factory=list)
    storages: list[_Storage] = field(default_factory=list)
    consts: list[tuple[torch.Tensor, int]] = field(default_factory=list)   # (tensor, its _version when read)
    device: torch.device | None = None   # None: replayed on the CPU in place; else streamed through this device


# -- the stand-in the model holds after the block ------------------------------------------------------------------
_METADATA_OPS = {_aten.detach.default, _aten.alias.default}


class EmptyTensor(torch.Tensor):
    """A parameter or buffer of a model built under `px.init_empty()`: no data until a compiled step makes it."""

    @staticmethod
    def __new__(cls, like: torch.Tensor, label: str, recording: Recording, ref: _Ref):
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


def _rng_state(device: torch.device | None) -> torch.Tensor:
    """The state of the default generator random ops draw from on `device` (None: the CPU)."""
    if device is None or device.type == "cpu":
        return torch.random.default_generator.get_state()
    return torch.cuda.get_rng_state(device)


def _set_rng_state(device: torch.device | None, state: torch.Tensor) -> None:
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

    def ref(self, t) -> _Ref | None:
        """The recorded storage view a tensor is, or None (not a tensor, not meta, or made outside the block)."""
        if not isinstance(t, torch.Tensor) or isinstance(t, EmptyTensor) or not t.is_meta:
            return None
        sid = self.sid.get(_storage_key(t))
        if sid is None:
            return None
        return _Ref(sid, tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.dtype)

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
        touched = frozenset(v.storage for v in values.values() if isinstance(v, _Ref))
        self.rec.steps.append(_Step(fn, args, kwargs, (), touched, touched, True, self.rng_state(), False, _where(),
                                    call=True))

    def rng_state(self) -> torch.Tensor | None:
        """A random op is recorded: the RNG state it draws from (the CPU's, or the replay device's), if it differs
        from the previous one's."""
        state = _rng_state(self.device)
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
                return _Const(len(rec.consts) - 1)
            r = self.ref(x)
            if r is None:
                return _Foreign(tuple(x.shape))
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
                rec.storages.append(_Storage(storage.nbytes(), o.dtype))
        rng_state = self.rng_state() if random else None
        if creates or writes or random:
            where = _where() if any(isinstance(x, (_Const, _Foreign)) for x in tree_leaves((rargs, rkwargs))) else ""
            rec.steps.append(_Step(replay, rargs, rkwargs, tuple(creates), frozenset(reads), frozenset(writes),
                                   random, rng_state, func in _UNDEFINED, where))
        return out


class init_empty:
    """`with px.init_empty(): model = Model(...)` builds the model without allocating its parameters and buffers;
    `px.compile(model, ...)` initialises them in its chunks at the first step, equal to an eager build on the CPU with
    the same RNG state. `px.init_empty(device="cuda")`: the same, made on that GPU tensor by tensor at the first step
    (fast), equal to an eager build under `with torch.device("cuda"):` with the same CUDA RNG state. See the module
    docstring of pstar_fx.init_empty for how, and for the global RNG afterwards."""

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


# -- replay -------------------------------------------------------------------------------------------------------
def fill_chunks(store, params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor]
                ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Initialise the EmptyTensors among `params` in the store's chunks (in place, see the module docstring) and
    compute those among `buffers`. Returns the parameters left to load (the real ones) and every buffer's value."""
    empty_params = {n: t for n, t in params.items() if is_empty(t)}
    empty_buffers = {n: t for n, t in buffers.items() if is_empty(t)}
    if not empty_params and not empty_buffers:
        return params, buffers
    store.evict_all()             # nothing of the chunks on the device: their host homes are written below
    recordings: dict[int, Recording] = {}
    for t in [*empty_params.values(), *empty_buffers.values()]:
        recordings[id(t._pstar_recording)] = t._pstar_recording
    values = {}
    in_place = False
    for rec in recordings.values():
        replay = _replay if rec.device is None else _replay_streamed
        in_place |= rec.device is None
        values.update(replay(rec, store,
                             {n: t._pstar_ref for n, t in empty_params.items() if t._pstar_recording is rec},
                             {n: t._pstar_ref for n, t in empty_buffers.items() if t._pstar_recording is rec}))
    if store.precision.mixed and in_place:
        store.restore_params_from_masters()    # the half-precision chunks: the fp32 masters written above, rounded
    return ({n: t for n, t in params.items() if n not in empty_params},
            {n: values.get(n, t) for n, t in buffers.items()})


def origin_digests(tensors: dict[str, torch.Tensor]) -> dict[str, bytes]:
    """For each EmptyTensor among `tensors`, a digest of everything its value is made from at replay: the recorded
    ops its storage depends on (their arguments and the real tensors they read), the RNG state each random one draws
    from (the state recorded at or before it, advanced by every random op in between) and the device the recording
    replays on. The replay is deterministic, so equal digests mean equal values: the ranks of a sharded step, each of
    which replays the whole recording and keeps its shard, compare them (pstar_fx.agreement). One pass over each
    recording's ops."""
    out: dict[str, bytes] = {}
    recordings: dict[int, tuple[Recording, list[tuple[str, _Ref]]]] = {}
    for name, t in tensors.items():
        if is_empty(t):
            recordings.setdefault(id(t._pstar_recording), (t._pstar_recording, []))[1].append((name, t._pstar_ref))
    for rec, refs in recordings.values():
        storages = _storage_digests(rec)
        for name, ref in refs:
            out[name] = _sha(_text((rec.device, ref)), storages.get(ref.storage, b""))
    return out


def _storage_digests(rec: Recording) -> dict[int, bytes]:
    """Each recorded storage's value after the last op writing it, as a digest (see origin_digests)."""
    digests: dict[int, bytes] = {}
    consts: dict[int, bytes] = {}

    def const(i: int) -> bytes:
        if i not in consts:
            t = rec.consts[i][0].detach().cpu().contiguous()
            consts[i] = _sha(_text((tuple(t.shape), t.dtype)), t.reshape(-1).view(torch.uint8).numpy().tobytes())
        return consts[i]

    def shape_of(x):          # an argument as the op sees its shape (what a random op's draws depend on)
        return ("const", const(x.index).hex()) if isinstance(x, _Const) else x

    def value_of(x):          # an argument with the value it holds
        if isinstance(x, _Ref):
            return (x, digests.get(x.storage, b"").hex())
        return shape_of(x)

    generator = b""
    for step in rec.steps:
        func = f"{step.func.__module__}.{step.func.__qualname__}" if step.call else str(step.func)
        d = _sha(_text((func, tree_map(value_of, (step.args, step.kwargs)), step.creates, step.undefined)))
        if step.random:
            if step.rng_state is not None:
                generator = _sha(step.rng_state.cpu().numpy().tobytes())
            d = _sha(d, generator)
            generator = _sha(generator, _text((func, tree_map(shape_of, (step.args, step.kwargs)))))
        for sid in step.writes:
            digests[sid] = _sha(d, b"writes %d" % sid)
        for j, sid in step.creates:
            digests[sid] = _sha(d, b"creates %d" % j)
    return digests


def _text(x) -> bytes:
    """repr as bytes, without object addresses (the same in every process)."""
    return re.sub(r" at 0x[0-9a-fA-F]+", "", repr(x)).encode()


def _sha(*parts: bytes) -> bytes:
    h = hashlib.sha256()
    for part in parts:
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.digest()[:16]


def _contiguous_whole(ref: _Ref, storage: _Storage) -> bool:
    numel = 1
    for s in ref.shape:
        numel *= s
    expect, stride = [], 1
    for s in reversed(ref.shape):
        expect.append(stride)
        stride *= s
    return (ref.offset == 0 and ref.dtype == storage.dtype and numel * ref.dtype.itemsize == storage.nbytes
            and all(st == e or sz == 1 for st, e, sz in zip(ref.stride, reversed(expect), ref.shape)))


def _touched(step: _Step) -> frozenset[int]:
    return step.reads | step.writes | {sid for _, sid in step.creates}


def _plan(rec: Recording, targets: set[int]) -> tuple[list[int], dict[int, int]]:
    """The steps to run (every random one, and those whose writes or creations something run later, or a target,
    reads), and for each storage the last of them that touches it."""
    want = set(targets)
    needed = []
    for i in range(len(rec.steps) - 1, -1, -1):
        s = rec.steps[i]
        made = {sid for _, sid in s.creates}
        if s.random or (s.writes | made) & want:
            needed.append(i)
            want |= s.reads | s.writes
    needed.reverse()
    last = {}
    for i in needed:
        for sid in _touched(rec.steps[i]):
            last[sid] = i
    return needed, last


def _view(root: torch.Tensor, shape, stride, offset, dtype) -> torch.Tensor:
    base = root if root.dtype == dtype else root.view(dtype)
    return base.as_strided(shape, stride, base.storage_offset() + offset)   # as_strided's offset is absolute


def _targets(params: dict[str, _Ref], buffers: dict[str, _Ref]) -> dict[int, list[tuple[bool, str, _Ref]]]:
    """For each recorded storage, the parameters and buffers that are views of it: (is a parameter, name, view)."""
    targets: dict[int, list[tuple[bool, str, _Ref]]] = {}
    for name, ref in params.items():
        targets.setdefault(ref.storage, []).append((True, name, ref))
    for name, ref in buffers.items():
        targets.setdefault(ref.storage, []).append((False, name, ref))
    return targets


def _homes(rec: Recording, store, targets, *, cpu_only: bool) -> dict[int, torch.Tensor]:
    """The storages that are exactly one parameter, in the dtype of its chunk's full-precision home (the host chunk
    in fp32, the fp32 master in mixed precision, which is on the device where the plan put its chunk's optimizer
    states there): that home, flat; with cpu_only, only homes on the CPU. One rank only (sharded, a home is a part)."""
    homes = {}
    for sid, ts in targets.items():
        is_param, name, ref = ts[0]
        if store.world == 1 and len(ts) == 1 and is_param and _contiguous_whole(ref, rec.storages[sid]):
            home = store.param_value(name)
            if (home.dtype == ref.dtype and tuple(home.shape) == ref.shape
                    and (home.device.type == "cpu" or not cpu_only)):
                homes[sid] = home.reshape(-1)
    return homes


def _resolve(x, step: _Step, rec: Recording, roots: dict[int, torch.Tensor], device: torch.device):
    """A recorded argument as a real value: a view of its storage's root, a real tensor read while building (checked
    unchanged), and the meta device as the replay's device."""
    if isinstance(x, _Ref):
        return _view(roots[x.storage], x.shape, x.stride, x.offset, x.dtype)
    if isinstance(x, _Const):
        t, version = rec.consts[x.index]
        if t._version != version:
            raise EmptyModelError(
                f"px.init_empty(): the real tensor of shape {tuple(t.shape)} that {step.func} read {step.where} "
                "while the model was built has been modified since, so the model cannot be initialised as it "
                "was built; do not modify it until the first step has run (or clone it when building).")
        return t
    if isinstance(x, _Foreign):
        raise EmptyModelError(
            f"px.init_empty(): {step.func} {step.where} reads a meta tensor of shape {x.shape} that was not made "
            "inside the px.init_empty() block, so its values are unknown; make it inside the block.")
    if isinstance(x, torch.device) and x.type == "meta":
        return device
    return x


def _replay(rec: Recording, store, params: dict[str, _Ref], buffers: dict[str, _Ref]) -> dict[str, torch.Tensor]:
    """Run the recording on the CPU: parameters into the store's chunks, buffers returned."""
    targets = _targets(params, buffers)
    # (one rank: the chunk's home is the parameter's whole value; sharded, load_params keeps this rank's part; a home
    # on the device, an fp32 master where the plan put the states there, is written through a temporary too)
    roots: dict[int, torch.Tensor] = _homes(rec, store, targets, cpu_only=True)
    direct: set[int] = set(roots)    # storages that are a parameter's chunk home itself
    needed, last = _plan(rec, set(targets))
    gen = torch.Generator()
    out: dict[str, torch.Tensor] = {}

    with torch.no_grad():
        for i in needed:
            step = rec.steps[i]
            if step.rng_state is not None:
                gen.set_state(step.rng_state)
            if not (step.undefined and all(sid in direct for _, sid in step.creates)):
                args, kwargs = tree_map(functools.partial(_resolve, step=step, rec=rec, roots=roots, device=_CPU),
                                        (step.args, step.kwargs))
                _run(step, args, kwargs, gen, rec, roots, direct)
            for sid in _touched(step):
                if last.get(sid) != i:
                    continue
                root = roots.pop(sid)          # its last use: a temporary is freed once its targets have it
                if sid in direct:
                    continue
                for is_param, name, ref in targets.get(sid, ()):
                    value = _view(root, ref.shape, ref.stride, ref.offset, ref.dtype)
                    if is_param:
                        store.load_params({name: value})
                    else:
                        out[name] = value.clone()
    return out


def _run(step: _Step, args, kwargs, gen: torch.Generator, rec: Recording, roots: dict[int, torch.Tensor],
         direct: set[int], device: torch.device | None = None) -> None:
    """Run one recorded step on real tensors; the storages it creates become roots (or go into their chunk home)."""
    if step.call:
        _call_with_rng(step.func, args, kwargs, gen, device)
        return
    if step.random:
        args, kwargs = _with_generator(step.func, list(args), dict(kwargs), gen)
    result = tree_leaves(step.func(*args, **kwargs))
    for j, sid in step.creates:
        o = result[j]
        if sid in direct:
            if not step.undefined:
                _view(roots[sid], o.shape, o.stride(), o.storage_offset(), o.dtype).copy_(o)
            continue
        info = rec.storages[sid]
        assert o.untyped_storage().nbytes() == info.nbytes and o.dtype == info.dtype, (step.func, sid)
        roots[sid] = o.as_strided((info.nbytes // info.dtype.itemsize,), (1,), 0)


# ops that write every element of their first argument without reading it (per-op knowledge: a value they replace
# is dead, so the streamed replay drops it instead of keeping or parking it)
_OVERWRITING_OPS = {_aten.normal_, _aten.uniform_, _aten.fill_, _aten.zero_, _aten.random_, _aten.exponential_,
                    _aten.geometric_, _aten.log_normal_, _aten.cauchy_, _aten.bernoulli_, _aten.copy_}
# torch.nn.init functions recorded whole (the one that asks is_meta: trunc_normal_'s helper in torch 2.13) that write
# every element of their tensor, reading only its shape
_OVERWRITING_CALLS = {getattr(nn.init, name) for name in ("_no_grad_trunc_normal_", "trunc_normal_", "orthogonal_",
                                                          "sparse_", "dirac_") if hasattr(nn.init, name)}


def _overwrites(step: _Step, sid: int, rec: Recording) -> bool:
    """Whether the step replaces every byte of storage `sid` without reading what was there."""
    if step.call:
        refs = [x for x in tree_leaves((step.args, step.kwargs)) if isinstance(x, _Ref)]
        if step.func not in _OVERWRITING_CALLS or not refs:
            return False
        target, others = refs[0], refs[1:]
    else:
        if (step.func.overloadpacket not in _OVERWRITING_OPS or not step.args
                or not isinstance(step.args[0], _Ref)):
            return False
        target = step.args[0]
        others = [x for x in tree_leaves((step.args[1:], step.kwargs)) if isinstance(x, _Ref)]
    return (target.storage == sid and _contiguous_whole(target, rec.storages[sid])
            and all(r.storage != sid for r in others))


def _replay_streamed(rec: Recording, store, params: dict[str, _Ref], buffers: dict[str, _Ref]
                     ) -> dict[str, torch.Tensor]:
    """Run the recording on rec.device, storage by storage: parameters into the store's chunks, buffers returned
    (on the CPU). Invariant: a storage has device memory only from the step that first needs its memory to the end
    of its last step, and between two of its steps only if the second is the very next step run; otherwise its value
    is dropped (the next step touching it replaces it whole, without reading it) or parked on the host (in its
    parameter's chunk home where it is exactly one parameter, else in a host temporary) and brought back."""
    device = rec.device
    targets = _targets(params, buffers)
    homes = _homes(rec, store, targets, cpu_only=False)
    needed, last = _plan(rec, set(targets))
    following = dict(itertools.pairwise(needed))   # step -> the next step run
    later: dict[tuple[int, int], int] = {}        # (step, storage) -> the next step run that touches the storage
    seen: dict[int, int] = {}
    for i in reversed(needed):
        for sid in _touched(rec.steps[i]):
            if sid in seen:
                later[(i, sid)] = seen[sid]
            seen[sid] = i
    resident: dict[int, torch.Tensor] = {}        # storage -> its flat memory on the device
    parked: dict[int, torch.Tensor] = {}          # storage -> its value on the host, while it has no device memory
    gen = torch.Generator(device)
    out: dict[str, torch.Tensor] = {}

    def bring(sid: int, replaced: bool) -> None:
        value = parked.pop(sid, None)
        if value is not None and not replaced:
            resident[sid] = value.to(device, copy=True)
            return
        info = rec.storages[sid]
        # never written yet (made by torch.empty & co): undefined in eager; zeros, as the in-place replay's homes
        make = torch.empty if replaced else torch.zeros
        resident[sid] = make(info.nbytes // info.dtype.itemsize, dtype=info.dtype, device=device)

    def park(sid: int) -> None:
        value = resident.pop(sid)
        if sid in homes:
            homes[sid].copy_(value)
            parked[sid] = homes[sid]
        else:
            parked[sid] = value.to(_CPU, copy=True)

    def finish(sid: int) -> None:
        if targets.get(sid) and sid not in resident:
            bring(sid, replaced=False)
        root = resident.pop(sid, None)
        parked.pop(sid, None)
        for is_param, name, ref in targets.get(sid, ()):
            value = _view(root, ref.shape, ref.stride, ref.offset, ref.dtype)
            if is_param:
                store.load_params({name: value})       # converted on the device, then copied into the chunk
            else:
                out[name] = value.to(_CPU, copy=True)

    with torch.no_grad():
        for i in needed:
            step = rec.steps[i]
            if step.rng_state is not None:
                gen.set_state(step.rng_state)
            if not step.undefined:                      # torch.empty & co: memory comes with the first use
                for sid in sorted(step.reads):
                    if sid not in resident:
                        bring(sid, replaced=_overwrites(step, sid, rec))
                args, kwargs = tree_map(functools.partial(_resolve, step=step, rec=rec, roots=resident,
                                                          device=device), (step.args, step.kwargs))
                _run(step, args, kwargs, gen, rec, resident, set(), device)
                del args, kwargs                        # (views: they would keep a dropped storage alive)
            for sid in sorted(_touched(step)):
                if last[sid] == i:
                    finish(sid)
                elif sid not in resident:
                    continue
                elif _overwrites(rec.steps[later[(i, sid)]], sid, rec):
                    del resident[sid]                   # dead: the next step touching it replaces it whole
                elif later[(i, sid)] != following[i]:
                    park(sid)
    assert not resident and not parked, (sorted(resident), sorted(parked))
    return out


def _call_with_rng(fn, args, kwargs, gen: torch.Generator, device: torch.device | None = None) -> None:
    """Run a recorded torch.nn.init call drawing from `gen`. Such a function may draw from the global generator
    whatever its generator argument (sparse_'s randperm does), so the global RNG (the CPU's, or the replay device's)
    is set to gen's state for the call and restored after it. On a device, the call runs under torch.device(device),
    as the eager build it equals does: a tensor it makes without a device (sparse_'s randperm) is made there."""
    saved = _rng_state(device)
    _set_rng_state(device, gen.get_state())
    try:
        if device is None:
            fn(*args, **kwargs)
        else:
            with torch.device(device):
                fn(*args, **kwargs)
    finally:
        gen.set_state(_rng_state(device))
        _set_rng_state(device, saved)


def _with_generator(func, args: list, kwargs: dict, gen: torch.Generator) -> tuple[list, dict]:
    for i, a in enumerate(func._schema.arguments):
        if a.name == "generator":
            if i < len(args) and not a.kwarg_only:
                args[i] = gen
            else:
                kwargs["generator"] = gen
    return args, kwargs


__all__ = ["init_empty", "EmptyModelError", "EmptyTensor", "fill_chunks", "is_empty", "origin_digests"]
