"""The Python values a trace depends on besides its tensors and arguments, so that a change retraces.

A compiled step runs no Python: whatever plain Python value the step read while it was traced is fixed in the graph.
Eager code reads it anew at every call, so a value the user changes between steps (a loss weight in a closure or a
global, a module's `temperature`, `nn.Dropout.p`, a step counter a branch reads) must retrace, as a changed argument
does. Two keys cover what a trace can be seen to read:

- `ModuleScalars(model).read()`: every module's attributes (torch's own `nn.Module` fields aside; private ones only
  in modules with parameters, so not a metric's bookkeeping) holding a bool, int, float, str or None, or a
  non-empty dict, list or tuple of them (by value, of any length: `_attribute_key`): `Dropout.p`, `LayerNorm.eps`,
  a user's `temperature`, peft's `scaling` and `_disable_adapters`; and the fields of the configuration objects a
  module holds (a dataclass, or an object with `to_dict`: transformers' `model.config`, whose `use_cache` or
  `_attn_implementation_internal` the forward reads), each object once. Part of `Compiler.model_key`. Which
  attributes are plain is found once per module and again only when its attributes change in number, and a
  scalar that is the same object as at the last call keeps its key, so a call costs little per module.
- `closure_key(fn)`: the step function's closure cells and the globals its code loads (LOAD_GLOBAL, not attribute
  names), where they hold such a value, or a dict, list or tuple of at most `CONTAINER_ITEMS` of them
  (`state["step"]`), following `functools.wraps` and `functools.partial`. Values read only by other functions the
  step calls (or through `self` of a method) are not seen (docs/tracing.md says so).

A bool keys apart from an equal int (`True` from `1`), a float too (`2.0` from `2`; -0.0 from 0.0); NaN keys equal
themselves (a NaN weight would otherwise retrace at every call). `python_draws()` tells whether the global random
generators of Python or NumPy moved while tracing: a compiled step would replay the trace's draw at every call
(LayerDrop by `random.random()`), which the trace warns of (not refused: transformers' MusicGen draws in every
forward, also with its layer drop off, and another thread's draws move the same generator).
"""
from __future__ import annotations

import contextlib
import dataclasses
import dis
import functools
import math
import operator
import random
import sys
import types
import weakref
from typing import Callable, Iterator

import torch
import torch.nn as nn

CONTAINER_ITEMS = 64    # a closure's or global's dict, list or tuple is keyed by value up to this many items

_SCALARS = (bool, int, float, str, type(None))
_PLAIN = frozenset(_SCALARS)


def float_key(v: float):
    """A float as a key that tells apart what computes apart: from an equal int (2.0 == 2, but `torch.full(s, k)`
    takes its dtype from k), NaN equal to itself (NaN != NaN would make every call a new key) and apart from the
    string "nan", -0.0 apart from 0.0 (`atan2(k, -1)`)."""
    if v != v or (v == 0.0 and math.copysign(1.0, v) < 0):
        return ("float", repr(v))
    return ("float", v)


def _scalar(v):
    """v as a key, if it is a plain scalar (or a tuple of them); None otherwise. A float a pair (`float_key`), a bool
    a pair (True == 1)."""
    t = type(v)
    if t is float:
        return float_key(v)
    if t is bool:
        return ("bool", v)
    if t in _PLAIN:
        return v
    if t is tuple and len(v) <= CONTAINER_ITEMS and all(type(x) in _PLAIN for x in v):
        return tuple(_scalar(x) for x in v)
    return None


_NOT_SCALAR = object()


def _value_key(v):
    """A closure or global value as a key: a scalar, or a small container of scalars (by value); _NOT_SCALAR else."""
    k = _scalar(v)
    if k is not None or v is None:
        return k
    if type(v) in (list, tuple) and len(v) <= CONTAINER_ITEMS:
        keys = [_scalar(x) for x in v]
        if all(k is not None or x is None for k, x in zip(keys, v)):
            return (type(v).__name__, tuple(keys))
    if type(v) is dict and len(v) <= CONTAINER_ITEMS:
        items = []
        for key, x in v.items():
            kx = _scalar(x)
            if (kx is None and x is not None) or _scalar(key) is None:
                return _NOT_SCALAR
            items.append((_scalar(key), kx))
        return ("dict", tuple(items))
    return _NOT_SCALAR


_MODULE_FIELDS = frozenset(nn.Module().__dict__)    # torch's own (training, _parameters, the hook dicts, ...)


def _is_config(v) -> bool:
    """A configuration object whose fields a forward may read: a dataclass instance or an object with `to_dict`
    (transformers' PreTrainedConfig), not a module, tensor, class or function."""
    if isinstance(v, (nn.Module, torch.Tensor, type)) or callable(v) or not hasattr(v, "__dict__"):
        return False
    return dataclasses.is_dataclass(v) or callable(getattr(type(v), "to_dict", None))


def _attribute_key(v):
    """A module attribute (or configuration field) as a key: `_value_key`, but a list, tuple or dict of more than
    CONTAINER_ITEMS plain scalars by its items as they are and their types (a copy, keyed again at a call where one of
    them is another object); _NOT_SCALAR where it is not plain."""
    if type(v) not in (list, tuple, dict) or len(v) <= CONTAINER_ITEMS:
        return _value_key(v)
    items = tuple(v.items()) if type(v) is dict else tuple(v)
    types = tuple(map(type, (*v.keys(), *v.values()) if type(v) is dict else items))
    if not all(t in _PLAIN for t in types):
        return _NOT_SCALAR
    return (type(v).__name__, len(v), items, types)    # (the types: 2 and 2.0, True and 1 apart)


def _names(m: nn.Module) -> tuple[tuple[str, ...], ...]:
    """The module's attributes holding a plain scalar, a non-empty small container of them, and a configuration
    object, by name, and the lists and dicts it watches: torch's own nn.Module fields aside, and private ones (a
    leading underscore) only where the module or a submodule has parameters, so where a forward reads them (peft's
    `_disable_adapters`), not a metric's bookkeeping (torchmetrics' `_update_count`, updated between steps). A list
    or dict that is not keyed (empty, or holding other objects: a metric appends tensors to one) is watched, so that
    one filled in place with scalars later (a list of layers to skip, emptied and refilled) is found then
    (`_Entry.changed`)."""
    private = next(m.parameters(), None) is not None
    scalars, containers, configs, watched = [], [], [], []
    for name, v in m.__dict__.items():
        if name in _MODULE_FIELDS or (name[0] == "_" and not private):
            continue
        if v is None or _scalar(v) is not None:
            scalars.append(name)
        elif type(v) in (list, tuple, dict) and v and _attribute_key(v) is not _NOT_SCALAR:
            containers.append(name)
        elif type(v) in (list, dict) and not any(isinstance(x, weakref.ref) for x in (v.values() if
                                                                                    type(v) is dict else v)):
            watched.append(name)            # (not a list of weak references: an RNN's, which holding would keep)
        elif _is_config(v):
            configs.append(name)
    return tuple(scalars), tuple(containers), tuple(configs), tuple(watched)


def _fields(cfg) -> tuple:
    """A configuration object's plain fields, (name, value key) in definition order."""
    return tuple((k, key) for k, v in vars(cfg).items() if (key := _attribute_key(v)) is not _NOT_SCALAR)


def _same_items(a: tuple, b: tuple) -> bool:
    """Whether two tuples of containers' items hold the same objects: by identity, not `==` (2 == 2.0 and
    True == 1, which key apart; a NaN is itself)."""
    return len(a) == len(b) and all(len(x) == len(y) and all(map(operator.is_, x, y)) for x, y in zip(a, b))


class _Entry:
    """One module's names (`_names`) and, for its scalars, the values last read (held, so that their ids stay
    theirs) and their key: a call whose values are the same objects reuses the key."""
    __slots__ = ("d", "n", "scalars", "containers", "configs", "watched", "seen", "get", "raw", "key", "items", "ckey")

    def __init__(self, m: nn.Module):
        self.d, self.n = m.__dict__, len(m.__dict__)
        self.scalars, self.containers, self.configs, self.watched = _names(m)
        # the watched containers (held: compared by `is`) and their lengths when the names were found
        self.seen = tuple((self.d[k], len(self.d[k])) for k in self.watched)
        self.get = operator.itemgetter(*self.scalars) if self.scalars else None
        self.raw: tuple = ()
        self.key: tuple = ()
        self.items: tuple = ()       # the containers' items at the last call, and their key
        self.ckey: tuple = ()

    def changed(self) -> bool:
        """Whether a watched attribute (a list or dict not keyed) holds another object now or its length changed: the
        names to find again (it may hold scalars now). A metric's list of tensors, appended to at every step, costs
        this module's names found again at every call, and no new key."""
        d = self.d
        for k, (v, n) in zip(self.watched, self.seen):
            if d.get(k) is not v or len(v) != n:
                return True
        return False

    def read(self) -> tuple:
        raw = self.get(self.d) if self.get is not None else ()
        if len(self.scalars) == 1:
            raw = (raw,)
        if len(raw) != len(self.raw) or not all(map(operator.is_, raw, self.raw)):
            self.raw, self.key = raw, tuple(map(_value_key, raw))
        if not self.containers:
            return self.key
        values = [self.d[k] for k in self.containers]
        items = tuple((type(v), *v.keys(), *v.values()) if type(v) is dict else (type(v), *v) for v in values)
        if not _same_items(items, self.items):      # (copies, compared by identity: in-place changes, 2 -> 2.0)
            self.items, self.ckey = items, tuple(map(_attribute_key, values))
            if _NOT_SCALAR in self.ckey:     # (one holds other objects now: to be watched, the names found again)
                self.n = -1
        return self.key + self.ckey


class ModuleScalars:
    """Reads every module's plain attributes and its configuration objects' fields (`module_scalars`) at each call,
    cheaply: the names are found once per module and again only when the module's attributes change in number or
    one of them is gone; scalars that are the same objects as at the last call keep their key; a configuration
    object several modules hold (transformers' `config`) is read once."""

    def __init__(self, model: nn.Module):
        self.model = model
        self._entries: list[_Entry] = []
        self._modules: tuple = ()

    def read(self, modules: tuple | None = None) -> tuple:
        """The values; `modules`: the model's modules() as a tuple, where the caller has walked them already."""
        modules = tuple(self.model.modules()) if modules is None else modules
        if modules != self._modules:        # (a module added or replaced)
            self._modules = modules
            self._entries = [_Entry(m) for m in modules]
        out, configs = [], {}
        for i, (entry, m) in enumerate(zip(self._entries, modules)):
            if len(entry.d) != entry.n or (entry.watched and entry.changed()):
                entry = self._entries[i] = _Entry(m)
            try:
                out.append(entry.read())
            except KeyError:                # an attribute deleted and another added
                entry = self._entries[i] = _Entry(m)
                out.append(entry.read())
            for k in entry.configs:
                cfg = entry.d.get(k)
                if cfg is not None and id(cfg) not in configs:
                    configs[id(cfg)] = (k, cfg)
        out.extend((k, _fields(cfg)) for k, cfg in configs.values())
        return tuple(out)


def module_scalars(m: nn.Module) -> tuple:
    """The module's plain attributes and its configuration objects' fields (`config.use_cache`), as (name, value
    key): what its forward may read."""
    scalars, containers, configs, _ = _names(m)
    d = m.__dict__
    return (tuple((name, _attribute_key(d[name])) for name in scalars + containers)
            + tuple((f"{name}.{k}", key) for name in configs for k, key in _fields(d[name])))


def _functions(fn) -> tuple[list, tuple]:
    """The Python functions whose closures and globals the step reads (a functools.wraps chain: the wrapper and what
    it wraps), and the values a functools.partial binds."""
    extra = ()
    while isinstance(fn, functools.partial):
        extra += tuple(fn.args) + tuple(fn.keywords.values())
        fn = fn.func
    fns = []
    seen = set()
    while fn is not None and id(fn) not in seen:
        seen.add(id(fn))
        fn = getattr(fn, "__func__", fn)           # a bound method: its function (its self is not keyed)
        if hasattr(fn, "__code__"):
            fns.append(fn)
        fn = getattr(fn, "__wrapped__", None)
    return fns, extra


def read_values(fn: Callable) -> Iterator[tuple[str, str, object]]:
    """(kind, name, value) of what `fn` can be seen to read: its closure cells ("closure"), the globals its code (and
    the code nested in it) loads ("global"), and the values a functools.partial binds ("partial")."""
    fns, extra = _functions(fn)
    for f in fns:
        for name, cell in zip(f.__code__.co_freevars, getattr(f, "__closure__", None) or ()):
            try:
                yield "closure", name, cell.cell_contents
            except ValueError:                       # an empty cell (a name bound later)
                continue
        g = getattr(f, "__globals__", {})
        yield from (("global", name, g[name]) for name in _global_names(f.__code__) if name in g)
    yield from (("partial", "partial", v) for v in extra)


def closure_key(fn: Callable) -> tuple:
    """The plain values `fn` can be seen to read, by name (`read_values`), where they are scalars or small containers
    of scalars; at once () for a plain function that reads no closure and loads no global (`lambda g: g * 0.5`: a
    hook's key, read for every hook at every call)."""
    if type(fn) is types.FunctionType and not fn.__closure__ and "__wrapped__" not in fn.__dict__ \
            and not _global_names(fn.__code__):
        return ()
    keys = [(name, _value_key(v)) for _, name, v in read_values(fn)]
    return tuple(k for k in keys if k[1] is not _NOT_SCALAR and not (type(k[1]) is tuple and _NOT_SCALAR in k[1]))


@functools.lru_cache(maxsize=256)
def _global_names(code) -> tuple[str, ...]:
    """The names a code object (and the code objects nested in it: comprehensions, inner functions) loads as
    globals: LOAD_GLOBAL and LOAD_NAME, not the attribute names co_names also holds (`.loss`, `F.mse_loss`)."""
    names = [i.argval for i in dis.get_instructions(code) if i.opname in ("LOAD_GLOBAL", "LOAD_NAME")]
    for const in code.co_consts:
        if hasattr(const, "co_code"):
            names.extend(_global_names(const))
    return tuple(dict.fromkeys(names))


def _generators() -> list[tuple[str, Callable]]:
    """(name, state getter) of the global random generators a step may draw from in Python."""
    out = [("random (Python's random module)", random.getstate)]
    np = sys.modules.get("numpy")
    if np is not None:
        def numpy_state():
            name, keys, pos, has_gauss, gauss = np.random.get_state()
            return name, keys.tobytes(), pos, has_gauss, gauss
        out.append(("numpy.random", numpy_state))
    return out


@contextlib.contextmanager
def python_draws() -> Iterator[list[str]]:
    """Yields a list that, once the block ends, names the global Python random generators that moved during it."""
    gens = _generators()
    before = [get() for _, get in gens]
    drawn: list[str] = []
    try:
        yield drawn
    finally:
        drawn.extend(name for (name, get), old in zip(gens, before) if get() != old)


@contextlib.contextmanager
def torch_generators_set() -> Iterator[list[str]]:
    """Yields a list that, once the block ends, names torch's global generators (the CPU's, each initialised CUDA
    device's) whose state changed during it. A trace draws nothing from them (its random operations are recorded,
    and draw when the graph runs), so one that changed was seeded or set by the step function (torch.manual_seed
    inside it), which a compiled step would not do again, or drawn from by another thread meanwhile."""
    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else []
    moved: list[str] = []
    try:
        yield moved
    finally:
        if not torch.equal(torch.get_rng_state(), cpu):
            moved.append("torch's CPU generator")
        moved.extend(f"torch's generator of cuda:{i}" for i, state in enumerate(cuda)
                     if not torch.equal(torch.cuda.get_rng_state(i), state))


def snapshot(model: nn.Module, fn: Callable) -> dict[str, tuple]:
    """Every plain value the two keys cover, by where it lives: each module's scalars (by module name) and the
    step function's closure and globals (by name)."""
    out = {name or "model": module_scalars(m) for name, m in model.named_modules()}
    out["the step function"] = closure_key(fn)
    return out


def changes(before: dict[str, tuple], after: dict[str, tuple]) -> list[str]:
    """What differs between two snapshots, as text ('h.0.calls: 0 -> 1', 'the step function's weight: ...')."""
    out = []
    for where, old in before.items():
        new = after.get(where, old)
        if new == old:
            continue
        old_d, new_d = dict(old), dict(new)
        prefix = "the step function's " if where == "the step function" else f"{where}."
        out.extend(f"{prefix}{k}: {_shown(old_d.get(k))} -> {_shown(new_d.get(k))}"
                   for k in dict.fromkeys([*old_d, *new_d]) if old_d.get(k) != new_d.get(k))
    return out


def _shown(key) -> str:
    if type(key) is tuple and len(key) == 2 and key[0] in ("bool", "float"):
        return key[1] if type(key[1]) is str else repr(key[1])
    return repr(key)
