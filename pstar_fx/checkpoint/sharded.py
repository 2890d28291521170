"""Sharded checkpoints through torch.distributed.checkpoint (DCP): with several ranks, each rank writes and reads only
the pieces of parameters and optimizer states it owns, and a checkpoint saved at any world size loads at any other
(DCP reshards). `pstar_fx.checkpoint` calls this; see its docstring for when.

What is stored (DCP keys; values at their full precision, shapes as in the model):
- "model.<name>": every parameter (the fp32 master in mixed precision) and persistent buffer, under its
  `model.state_dict()` name (a tied parameter once, under its first name; a 0-d parameter as shape (1,));
- "optim.<name>.<key>": the optimizer's state of each parameter that has one (its chunk has stepped), under
  torch's keys for the parameter's group (`state_keys`): each per-element state at the parameter's shape (Adam's
  "exp_avg" and "exp_avg_sq", SGD's "momentum_buffer"), each 0-d one as a 0-d tensor (Adam's "step", NAdam's
  "mu_product"), all fp32. A parameter with no entry has no state. Optimizers other than Adam count a chunk's steps
  in a counter of pstar-fx's own ("pstar_fx_steps"), not saved where the group keeps a state of torch's (a loaded
  chunk with state counts one step, as `step.optimizer.load_state_dict` sets it), and saved alone for a group that
  keeps none while others do (SGD without momentum beside a group with it): the mark that it has stepped;
- "pstar_fx": an object: the format, the world size, the precision, the fp16 loss scaler and the optimizer's
  param_groups in torch's format (options, and parameter indices as in `optimizer.state_dict()`);
- "rng.<r>": rank r's RNG states (torch's CPU generator, and the CUDA one on CUDA).
The last two are byte entries: `torch.save` of the object, stored by DCP as one opaque entry.

The files and how they are read. The data files are DCP's (`__<rank>_<i>.distcp`, one per rank). `.metadata` is not
DCP's pickle: rank 0 writes it after every rank has written its data file and checksummed a share of them, as
pstar-fx's JSON manifest (pstar_fx.checkpoint.files), which holds DCP's metadata as JSON and each data file's size
and checksums. Loading (pstar_fx.checkpoint.load) verifies the manifest and the data files first (each rank a share;
the ranks agree), rebuilds DCP's metadata from the JSON, checking every value (pstar_fx.checkpoint.dcp_storage),
checks it against this model (`_check`: every entry's key, kind, shape and dtype), reads the byte entries with
`torch.load(weights_only=True)` (DCP's own planner would use weights_only=False) and checks them (format, loss
scaler, optimizer groups, RNG states, step counts: pstar_fx.checkpoint.checks), and only then writes a value into
the step. DCP reads the tensor pieces with `torch.load(weights_only=True)`. Nothing is unpickled otherwise: a
checkpoint cannot run code. The price: torch's own DCP tools (`dcp.load` with its FileSystemReader,
`dcp_to_torch_save`) do not read pstar-fx's `.metadata`; `read_metadata` here does.

A parameter's piece. ZeRO sharding gives each rank an even slice of every chunk's elements, so a rank owns an element
range [start, stop) of a flattened parameter (often empty, sometimes all of it), which DTensor's Shard(dim) cannot
express. The range is stored as a ShardedTensor of the parameter's shape whose local shards are the boxes that
tile that range (a contiguous range of a row-major tensor is at most 2 * ndim - 1 boxes: a partial row, whole rows,
a partial row, recursively), each a view into the rank's chunk shard: saving copies nothing first, and loading
writes straight into the chunk store. A rank that owns none of a parameter holds no shard of it. One rank (no
process group) stores and loads plain tensors, the whole parameter. Replicated values (buffers, step counts) are
plain tensors, which DCP writes once. Loading asks for this rank's boxes under the current layout (world size, chunk
size); DCP reads the overlapping parts of the boxes that were saved, whatever world size saved them.

ShardedTensor: `torch.distributed._shard.sharded_tensor.init_from_local_shards` (public, present from torch 2.0
through 2.14) builds each one; torch marks the ShardedTensor class as deprecated in favour of DTensor (its
`__torch_function__` and `reshard` warn) but DCP still saves and loads it, and DTensor has no uneven element-range
sharding. It is a collective: every rank builds the same entries in the same order.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import math
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, init_from_local_shards
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata

from ..errors import CheckpointError
from ..ir.graph import ChunkGroup, Role, StateHome
from ..runtime.store_values import half_precision
from . import checks, files
from . import dcp_storage as storage
from .step_state import StepState

FORMAT = 2
META = "pstar_fx"
MARKER = files.SHARDED_MANIFEST  # DCP's metadata file name; here pstar-fx's JSON manifest with DCP's metadata
META_KEYS = {"format", "world", "precision", "device", "loss_scaler", "param_groups", "state_dtype"}


# -- the geometry of a piece ------------------------------------------------------------------------------------------
def boxes(shape: tuple[int, ...], start: int, stop: int) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
    """Elements [start, stop) of a row-major tensor of `shape` as boxes (offsets, sizes, first element), in order.
    Each box is a contiguous run of those elements."""
    if start >= stop:
        return []
    if len(shape) == 1:
        return [((start,), (stop - start,), start)]
    inner = math.prod(shape[1:])
    first, last = -(-start // inner), stop // inner          # whole rows [first, last)

    def in_row(row: int, a: int, b: int):
        return [((row, *o), (1, *s), row * inner + f) for o, s, f in boxes(shape[1:], a, b)]

    if first > last:                                         # inside one row
        row = start // inner
        return in_row(row, start - row * inner, stop - row * inner)
    out = in_row(first - 1, start - (first - 1) * inner, inner) if start < first * inner else []
    if first < last:
        out.append(((first,) + (0,) * (len(shape) - 1), (last - first, *shape[1:]), first * inner))
    if last * inner < stop:
        out += in_row(last, 0, stop - last * inner)
    return out


def _shape(shape) -> tuple[int, ...]:
    return tuple(shape) or (1,)      # a ShardedTensor has at least one dimension


def _entry(comm, flat: torch.Tensor, start: int, stop: int, shape: tuple[int, ...]):
    """The DCP value of elements [start, stop) of a parameter of `shape`, held by `flat` (its piece, in order):
    views, no copies. One rank: the whole tensor. Sharded: a ShardedTensor (a collective)."""
    shape = _shape(shape)
    if comm is None:
        assert (start, stop) == (0, math.prod(shape)), (start, stop, shape)
        return flat.view(shape)
    place = f"rank:{dist.get_rank()}/{flat.device}"
    shards = [Shard(flat[f - start:f - start + math.prod(s)].view(s), ShardMetadata(list(o), list(s), place))
              for o, s, f in boxes(shape, start, stop)]
    return init_from_local_shards(shards, *shape, process_group=comm.group)


# -- what a step holds, as DCP entries ---------------------------------------------------------------------------------
def _canonical(state: StepState) -> tuple[list[str], list[str]]:
    """Parameter and persistent-buffer names of the model's state dict, each tensor once (tied: the first name)."""
    params, buffers = [], []
    for key in state.model.state_dict(keep_vars=True):
        kind, name = state.names[key]
        names = params if kind is Role.PARAM else buffers
        if name not in names:
            names.append(name)
    return params, buffers


def _trainable(st) -> list[str]:
    return [n for n, p in st.params.items() if st.chunks[p.chunk].group is ChunkGroup.TRAINABLE]


def _param_groups(opt) -> list[dict]:
    """torch.optim's param_groups as its state_dict() packs them (indices in group order), without reading state."""
    out, index = [], {}
    for g in opt.param_groups:
        packed = {k: v for k, v in g.items() if k != "params"}
        packed["params"] = [index.setdefault(id(t), len(index)) for t in g["params"]]
        out.append(packed)
    return out


def _pack(obj) -> bytes:
    """An object DCP stores as one opaque entry (it would flatten a dict into entries of its own); read back with
    weights_only=True."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _unpack(data, path: str, key: str):
    """An entry `_pack` wrote, read with weights_only=True; a CheckpointError naming it if it is anything else."""
    if not isinstance(data, bytes):
        raise CheckpointError(f"step.load: {path!r}: the entry {key!r} is not the bytes a save writes")
    try:
        return torch.load(io.BytesIO(data), weights_only=True)
    except Exception as e:   # noqa: BLE001 - whatever the unpickler refused, named with its entry
        raise CheckpointError(f"step.load: {path!r}: the entry {key!r} holds something other than tensors and plain "
                              f"values (torch.load(weights_only=True) refused it: {type(e).__name__}: {e})") from None


def rng_state(device: torch.device) -> dict:
    out = {"torch_cpu": torch.get_rng_state()}
    if device.type == "cuda":
        out["torch_cuda"] = torch.cuda.get_rng_state(device)
    return out


def _meta(state: StepState) -> dict:
    scaler = state.scaler
    comm = state.comm
    return {"format": FORMAT, "world": 1 if comm is None else comm.world,
            "precision": state.settings.precision.value, "device": state.settings.device.type,
            "loss_scaler": None if scaler is None else dataclasses.asdict(scaler),
            "param_groups": _param_groups(state.optimizer), "state_dtype": checks.state_dtype_of(state)}


Keys = dict[str, tuple[tuple[str, ...], tuple[str, ...]]]


def _state_keys(opt, groups: list[dict] | None = None) -> Keys:
    """Each parameter's optimizer state keys as the format stores them, (per-element, 0-d), by its group's options:
    the optimizer's own, or `groups` (a checkpoint's param_groups, already checked against the optimizer's). torch's
    keys; for a group that keeps none while others do (SGD without momentum beside a group with it), the chunks' own
    step counter alone, the mark that its parameters have stepped (the plain format's empty state)."""
    counter = opt.layout.state.counter
    index = {id(g): gi for gi, g in enumerate(opt.param_groups)}
    per_group = [opt.state_keys(gi, None if groups is None else groups[gi]) for gi in range(len(opt.param_groups))]
    per_group = [(v, s) if v or s or counter is None else ((), (counter,)) for v, s in per_group]
    return {name: per_group[index[id(g)]] for _, name, g in opt.entries()}


def _layout(state: StepState):
    """The optimizer's state layout (optim/spec.StateLayout): every key any group keeps, and the step counter."""
    return state.optimizer.layout.state


class Entries(dict):
    """The state dict DCP writes for this rank, and `lazy`: the entries that are placeholders (meta tensors), each
    with the function that makes its value when DCP's writer asks for it (dcp_storage.LazySavePlanner)."""
    lazy: dict


class _DiskPieces:
    """A save's view of one rank's disk-homed chunks (one rank only): each chunk's entries are placeholders whose
    values are read from its file when the writer asks for them, one chunk in host memory at a time (a chunk read in
    is let go, unchanged, when the writer asks for another's; its tensors already handed out keep their memory until
    written)."""

    def __init__(self, st):
        self.st = st
        self.chunks = sorted(c for c, home in enumerate(st.state_home) if home is StateHome.DISK and not st.is_open(c))
        self.cid: int | None = None
        self.parts: dict | None = None

    def _use(self, cid: int) -> dict:
        if self.cid != cid:
            self.let_go()
            self.cid, self.parts = cid, self.st.values.moments(cid)      # (read in from its file)
        return self.parts

    def let_go(self) -> None:
        if self.cid is not None:
            self.st.close_state(self.cid)
        self.cid = self.parts = None

    def master(self, name: str) -> torch.Tensor:
        p = self.st.params[name]
        self._use(p.chunk)
        start, stop, at = self.st.values.piece(name)
        return self.st.values.value_source(name)[at:at + stop - start].view(_shape(p.shape))

    def moment(self, name: str, key: str) -> torch.Tensor:
        p = self.st.params[name]
        start, stop, at = self.st.values.piece(name)
        return self._use(p.chunk)[key][at:at + stop - start].view(_shape(p.shape))

    def add(self, out: Entries, params: list[str], trainable: list[str], keys: Keys, counter: str | None) -> None:
        """Each disk chunk's entries, grouped by chunk (the writer then reads each file once more): placeholders
        for its parameters' masters and per-element states, its 0-d states read now (the file read in and let go,
        its compressed moments not dequantised)."""
        for cid in self.chunks:
            names = set(self.st.chunks[cid].params)
            parts = self.st.parts(cid)
            scalars = {k: float(v) for k, v in parts.items() if v.dim() == 0}
            self.st.close_state(cid)
            for name in (n for n in params if n in names):
                out[f"model.{name}"] = _placeholder(self.st.params[name].shape)
                out.lazy[f"model.{name}"] = functools.partial(self.master, name)
            if counter is None or scalars[counter] == 0:
                continue
            for name in (n for n in trainable if n in names):
                vectors, zero_d = keys[name]
                for key in zero_d:
                    out[f"optim.{name}.{key}"] = torch.tensor(scalars[key], dtype=torch.float32)
                for key in vectors:
                    out[f"optim.{name}.{key}"] = _placeholder(self.st.params[name].shape)
                    out.lazy[f"optim.{name}.{key}"] = functools.partial(self.moment, name, key)


def _placeholder(shape) -> torch.Tensor:
    return torch.empty(_shape(shape), dtype=torch.float32, device="meta")


def save_entries(state: StepState, model_values) -> Entries:
    """The state dict DCP writes for this rank. `model_values()`: the model's full values (state_dict keys), read
    only when this step does not hold the model (its values are then whole on every rank anyway). With one rank, a
    disk-homed chunk's entries are placeholders read from its file as they are written (Entries.lazy)."""
    comm, st = state.comm, state.store
    params, buffers = _canonical(state)
    keys = _state_keys(state.optimizer)
    out = Entries({META: _pack(_meta(state)),
                   f"rng.{0 if comm is None else comm.rank}": _pack(rng_state(state.settings.device))})
    out.lazy = {}
    if st is not None:
        st.flush()           # host homes current, pending host-side updates done
    disk = _DiskPieces(st) if comm is None and st is not None and st.disk is not None else None
    streamed = set() if disk is None else set(disk.chunks)
    if state.holds_model():
        for name in params:
            p = st.params[name]
            if p.chunk in streamed:
                continue
            src = st.values.value_source(name)
            if src is None:
                out[f"model.{name}"] = st.values.frozen_full[name].detach().reshape(_shape(p.shape))
                continue
            start, stop, at = st.values.piece(name)
            out[f"model.{name}"] = _entry(comm, src[at:at + stop - start], start, stop, p.shape)
        for name in buffers:
            out[f"model.{name}"] = st.buffers[name]
    else:
        values = model_values()
        for name in params + buffers:
            out[f"model.{name}"] = values[name].reshape(_shape(values[name].shape)) if name in params else values[name]
    if st is not None:
        counter = _layout(state).counter
        moments: dict[int, dict] = {}      # chunk -> its fp32 states (compressed moments dequantised, once)
        for name in _trainable(st):
            p = st.params[name]
            if p.chunk in streamed or counter is None:
                continue
            if p.chunk not in moments:
                moments[p.chunk] = st.values.moments(p.chunk)
            parts = moments[p.chunk]
            if float(parts[counter]) == 0:
                continue
            start, stop, at = st.values.piece(name)
            vectors, scalars = keys[name]
            for key in scalars:
                out[f"optim.{name}.{key}"] = parts[key].detach().to("cpu", dtype=torch.float32, copy=True).reshape(())
            for key in vectors:
                out[f"optim.{name}.{key}"] = _entry(comm, parts[key][at:at + stop - start], start, stop, p.shape)
        if disk is not None:
            disk.add(out, params if state.holds_model() else [], _trainable(st), keys, counter)
    else:
        sd = state.optimizer.state_dict()         # no store yet: the states loaded before it, whole
        names = [n for _, n, _ in state.optimizer.entries()]
        counter = _layout(state).counter
        for i, s in sd["state"].items():
            vectors, scalars = keys[names[i]]
            for key in scalars:           # (the counter as a mark: torch's state has no count, one step at least)
                value = 1.0 if key == counter and key not in s else s[key]
                out[f"optim.{names[i]}.{key}"] = torch.as_tensor(value, dtype=torch.float32).reshape(())
            for key in vectors:
                out[f"optim.{names[i]}.{key}"] = s[key].detach().float().reshape(_shape(s[key].shape))
    return out


def save(state: StepState, directory: str, model_values) -> Metadata | None:
    """Write this rank's entries into `directory` (every rank calls it; the directory is shared by all ranks).
    `model_values()`: see save_entries. Returns DCP's metadata on rank 0 (None on the others), which the caller
    writes into the manifest once it has the files' checksums: nothing here writes `.metadata`."""
    entries = save_entries(state, model_values)
    writer = storage.Writer(directory, sync_files=True)
    with _one_process(state):
        dcp.save(entries, storage_writer=writer, planner=storage.LazySavePlanner(getattr(entries, "lazy", {})),
                 process_group=None if state.comm is None else state.comm.group)
    return writer.metadata


@contextlib.contextmanager
def _one_process(state: StepState):
    """One rank without a process group: DCP runs in this process only and says so in a warning, which is how
    pstar-fx uses it then; hide that one."""
    with warnings.catch_warnings():
        if state.comm is None:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


# -- loading ---------------------------------------------------------------------------------------------------------
def metadata(manifest: files.Manifest, path: str) -> Metadata:
    """DCP's metadata out of a sharded checkpoint's manifest, checked against the files it lists."""
    try:
        return storage.metadata_from_json(manifest.dcp, {n: s.size for n, s in manifest.files.items()})
    except ValueError as e:
        raise CheckpointError(f"step.load: {path}/{MARKER}: {e}") from None


def read_metadata(path: str) -> Metadata:
    """DCP's metadata of the sharded checkpoint at `path` (its manifest checked; its data files are not read)."""
    return metadata(files.read_manifest(path, MARKER), path)


def _failure(e: CheckpointException, path: str, rank: int) -> BaseException:
    """What made DCP fail (it wraps every rank's exception, Ctrl-C too): this rank's if it failed, else another's;
    file system errors and refusals with the checkpoint's name."""
    failures = e.failures
    exc = (failures.get(rank) or next(iter(failures.values()), (None, None)))[0]
    if exc is None or isinstance(exc, (KeyboardInterrupt, SystemExit)):
        return exc or e
    if isinstance(exc, CheckpointError):
        return CheckpointError(f"step.load: {path!r}: {exc}")
    if isinstance(exc, OSError):
        return files.described(exc, getattr(exc, "filename", None) or path, "step.load: reading")
    return CheckpointError(f"step.load: reading {path!r} failed: {type(exc).__name__}: {exc}")


def _load(state: StepState, entries: dict, path: str, md: Metadata) -> dict:
    """DCP reads `entries` (tensors in place) through the checked metadata; returns the byte entries read."""
    planner = storage.SafeLoadPlanner()
    try:
        with _one_process(state):
            dcp.load(entries, storage_reader=storage.Reader(path, md), planner=planner,
                     process_group=None if state.comm is None else state.comm.group)
    except CheckpointException as e:
        raise _failure(e, path, state.rank) from None
    return planner.loaded


def _tensor(saved, key: str, shape, dtypes, path: str) -> None:
    m = saved.get(key)
    if not isinstance(m, TensorStorageMetadata) or tuple(m.size) != tuple(shape) or m.properties.dtype not in dtypes:
        got = "missing" if m is None else ("bytes" if not isinstance(m, TensorStorageMetadata)
                                           else f"{m.properties.dtype} of shape {tuple(m.size)}")
        raise CheckpointError(f"step.load: {path!r}: the entry '{key}' is {got}, not "
                              f"{' or '.join(map(str, dtypes))} of shape {tuple(shape)}")


def _check(state: StepState, md, path: str) -> tuple[list[str], list[str], list[str]]:
    """The checkpoint's entries against this model: every key, type, shape and dtype, before anything is read
    (optimizer states: keys any of the optimizer's groups keeps; `_check_keys` then holds each parameter's to its
    group's). Returns (params, buffers, params with optimizer state)."""
    params, buffers = _canonical(state)
    saved = md.state_dict_metadata
    if not isinstance(saved.get(META), BytesStorageMetadata):
        raise CheckpointError(f"step.load: {path!r} is a torch.distributed.checkpoint directory but not a pstar-fx "
                              "checkpoint (no 'pstar_fx' entry)")
    ref = state.model.state_dict(keep_vars=True)
    shapes = {n: _shape(t.shape) for n, t in ref.items()}
    want = {f"model.{n}": shapes[n] for n in params + buffers}
    param_names = set(params)
    have = {k: tuple(v.size) if isinstance(v, TensorStorageMetadata) else None
            for k, v in saved.items() if k.startswith("model.")}
    checks.same_model(path, *({k.removeprefix("model."): v for k, v in d.items()} for d in (have, want)))
    # a parameter is saved at full precision: fp32 when its chunks hold it, the model's dtype when the model does
    for n in params + buffers:
        like = ref[n].dtype
        dtypes = (like, torch.float32) if half_precision(like) and n in param_names \
            else (like,)
        try:
            _tensor(saved, f"model.{n}", shapes[n], dtypes, path)
        except CheckpointError as e:
            raise CheckpointError(f"{e} (saved from another model)") from None
    layout = _layout(state)
    states = {}         # optimizer entries: key -> (parameter, state key)
    for n in params:
        for k in layout.vectors + layout.scalar_parts:
            if f"optim.{n}.{k}" in saved:
                states[f"optim.{n}.{k}"] = (n, k)
    stray = sorted(k for k in saved if k not in want and k not in states and k != META
                   and not (k.startswith("rng.") and k[4:].isdigit()))
    kind = state.optimizer.torch_class.__name__
    unknown = sorted({k.rsplit(".", 1)[1] for k in stray if k.startswith("optim.") and k.rsplit(".", 1)[0][6:] in
                      shapes})
    if unknown:
        raise CheckpointError(f"step.load: {path!r} holds optimizer states {unknown} that this step's {kind} has no "
                              f"room for (it keeps {sorted(layout.vectors + layout.scalars)} with the options given "
                              "to px.compile): saved with options that keep more (for SGD: a momentum > 0; compile "
                              "the step with them) or by another optimizer")
    if stray:
        raise CheckpointError(f"step.load: {path!r} has entries that are not this model's ({stray[:3]}): saved from "
                              f"another model, or with another optimizer than this step's ({kind})")
    for key, (n, k) in states.items():
        _tensor(saved, key, shapes[n] if k in layout.vectors else (), (torch.float32,), path)
    stepped = {n for n, _ in states.values()}
    return params, buffers, [n for n in params if n in stepped]


def _check_keys(state: StepState, md, path: str, stepped: list[str], keys: Keys) -> None:
    """Each parameter with state has exactly the keys its group keeps (`keys`: by the checkpoint's options)."""
    saved = md.state_dict_metadata
    layout = _layout(state)
    for n in stepped:
        have = sorted(k for k in layout.vectors + layout.scalar_parts if f"optim.{n}.{k}" in saved)
        vectors, scalars = keys[n]
        if have != sorted(vectors + scalars):
            raise CheckpointError(f"step.load: {path!r}: the optimizer state of '{n}' has {have}, not "
                                  f"{state.optimizer.torch_class.__name__}'s {sorted(vectors + scalars)} under the "
                                  "checkpoint's options (an entry lost, or saved with another optimizer)")


def _small(state: StepState, md, stepped: list[str], keys: Keys, buffers: list[str], saved_world: int) -> dict:
    """The small entries (this rank's RNG, the 0-d optimizer states, buffers) as fresh values to load into. Rank r
    takes the RNG states rank r % saved_world saved (the same rank's, at the same world size)."""
    saved = md.state_dict_metadata
    rank = state.rank
    out: dict = {f"rng.{rank % saved_world}": None}
    for n in stepped:
        for k in keys[n][1]:
            out[f"optim.{n}.{k}"] = torch.zeros((), dtype=torch.float32)
    for n in buffers:
        t = saved[f"model.{n}"]
        out[f"model.{n}"] = torch.empty(tuple(t.size), dtype=t.properties.dtype)
    return out


def read(state: StepState, path: str, manifest: files.Manifest) -> tuple[dict, dict, dict] | None:
    """Load the checkpoint into this step's chunk store, each rank its own pieces, when the store exists (after a
    step or `step.lower(*batch)`); returns None then. Before that, read it whole (plain tensors) and return
    (model state dict, optimizer state dict in torch's format, meta as the plain format's) for the single-process
    path to apply. Everything is checked (entries, meta, RNG states, step counts, optimizer groups) before the
    first value is written into the step: a refused checkpoint changes nothing. The files were verified against
    the manifest before (pstar_fx.checkpoint.load)."""
    md = metadata(manifest, path)
    params, buffers, stepped = _check(state, md, path)
    where = f"{path}/{META}"
    meta = _unpack(_load(state, {META: None}, path, md).get(META), path, META)
    meta = checks.meta(state, meta, where, fmt=FORMAT, keys=META_KEYS)
    rank = state.rank
    rng_key = f"rng.{rank % meta['world']}"
    if not isinstance(md.state_dict_metadata.get(rng_key), BytesStorageMetadata):
        raise CheckpointError(f"step.load: {path!r} has no entry {rng_key!r} (the RNG states of a rank of the "
                              f"{meta['world']} that saved it)")
    keys = _state_keys(state.optimizer, meta["param_groups"])
    _check_keys(state, md, path, stepped, keys)
    small = _small(state, md, stepped, keys, buffers, meta["world"])
    rng = _unpack(_load(state, small, path, md).get(rng_key), path, rng_key)
    meta = dict(meta, rng=checks.rng(rng, state.settings.device, f"{path}/{rng_key}"))
    for n in stepped:
        for k in keys[n][1]:
            value = float(small[f"optim.{n}.{k}"])
            if not math.isfinite(value):
                raise CheckpointError(f"step.load: {path!r}: '{k}' of '{n}' is {value}, not a finite number")
        count = float(small.get(f"optim.{n}.step", 1)) if state.optimizer.is_adam else 1
        if not (count >= 1 and count == int(count)):
            raise CheckpointError(f"step.load: {path!r}: the step count of '{n}' is {count}, not a whole number >= 1")
    if state.store is None:
        return _read_whole(state, md, path, params, small, stepped, keys, meta)
    _read_pieces(state, path, params, buffers, stepped, keys, small, meta, md)
    return None


def _read_whole(state: StepState, md, path, params, small, stepped, keys: Keys, meta):
    saved = md.state_dict_metadata
    layout = _layout(state)
    whole = {f"model.{n}": torch.empty(tuple(saved[f"model.{n}"].size), dtype=saved[f"model.{n}"].properties.dtype)
             for n in params}
    for n in stepped:
        for key in keys[n][0]:
            whole[f"optim.{n}.{key}"] = torch.empty(tuple(saved[f"optim.{n}.{key}"].size), dtype=torch.float32)
    _load(state, whole, path, md)
    ref = state.model.state_dict(keep_vars=True)
    model_sd = {}
    for key, like in ref.items():
        _, name = state.names[key]
        src = whole.get(f"model.{name}", small.get(f"model.{name}"))
        model_sd[key] = src.view(like.shape)
    opt_state = {}
    for i, (t, n, _) in enumerate(state.optimizer.entries()):
        if n in stepped:
            vectors, scalars = keys[n]          # (torch's keys: not the chunks' counter, a mark)
            opt_state[i] = {**{k: small[f"optim.{n}.{k}"].clone() for k in scalars if k in layout.scalars},
                            **{k: whole[f"optim.{n}.{k}"].view(t.shape) for k in vectors}}
    opt_sd = {"state": opt_state, "param_groups": meta["param_groups"]}
    return model_sd, opt_sd, meta


def _plan_states(st, stepped: list[str], keys: Keys, small: dict) -> dict[int, dict[str, float] | None]:
    """Each trainable chunk's 0-d states under this layout ({} for a chunk with only per-element ones; None: no
    state), checked as the optimizer checks a loaded state: a chunk's parameters all have state with one value of
    each 0-d state (one step count), or none has."""
    trainable = set(_trainable(st))
    foreign = [n for n in stepped if n not in trainable]
    if foreign:
        raise CheckpointError(f"step.load: the checkpoint has optimizer state for {foreign[:3]}, which this compiled "
                              "step does not train (frozen, not reached by the loss, or in no group)")
    plan = {}
    for c in st.chunks:
        if c.group is not ChunkGroup.TRAINABLE:
            continue
        have = [n for n in c.params if n in stepped]
        if have and len(have) != len(c.params):
            raise CheckpointError(f"step.load: parameters {have[:3]} have optimizer state but "
                                  f"{[n for n in c.params if n not in stepped][:3]} of the same pstar-fx chunk have "
                                  "none; pstar-fx steps all parameters of a chunk together")
        if not have:
            plan[c.id] = None
            continue
        plan[c.id] = values = {}
        for k in dict.fromkeys(k for n in have for k in keys[n][1]):
            seen = {float(small[f"optim.{n}.{k}"]) for n in have}
            if len(seen) > 1:
                what = "step counts" if k == "step" else f"{k!r} values"
                raise CheckpointError(f"step.load: parameters of one pstar-fx chunk have different {what} {seen}; "
                                      f"pstar-fx steps all parameters of a chunk together (one {k!r} per chunk)")
            values[k] = seen.pop()
    return plan


def _set_options(opt, groups: list[dict]) -> None:
    """The saved options into the live optimizer's param_groups, checked (as its load_state_dict does) before
    anything else changes; restored if they are refused."""
    old = opt.param_groups
    try:
        torch.optim.Optimizer.load_state_dict(opt, {"state": {}, "param_groups": groups})
        opt.state.clear()
        opt.configs()
    except BaseException:
        opt.param_groups = old
        raise


def _read_pieces(state: StepState, path, params, buffers, stepped, keys: Keys, small, meta, md) -> None:
    st = state.store
    comm = state.comm
    plan = _plan_states(st, stepped, keys, small)
    if not state.holds_model():
        state.take_model()       # the chunks take the model (whole on every rank until now), then the values below
    _set_options(state.optimizer, meta["param_groups"])
    st.evict_all()
    state.mark_broken(f"step.load({path!r}) failed while it was writing values into the step: load a checkpoint "
                      "again before the next step")
    # one read for the chunks in memory, then one per disk-homed chunk (collectives: every rank plans the same
    # chunks on disk), each disk chunk read in, loaded into and written back before the next: host memory holds one
    chunks = {st.params[n].chunk for n in params} | set(plan)
    on_disk = sorted(c for c in chunks if st.state_home[c] is StateHome.DISK)
    whole: dict[str, torch.Tensor] = {}
    for group in [chunks - set(on_disk), *({c} for c in on_disk)]:
        entries, moments = _load_targets(st, comm, group, params, stepped, keys, _layout(state), plan, whole)
        if entries:
            _load(state, entries, path, md)
        for cid in sorted(group):
            st.states_written(cid)     # (written in place: a disk-homed chunk's states go back to its file)
        for cid, parts in moments.items():
            st.values.set_moments(cid, parts)
        for cid in group:
            st.close_state(cid)
    # mixed precision: the half-precision parameters are the masters rounded; frozen ones come from their whole value
    st.values.restore_params_from_masters()
    for name, v in whole.items():
        p = st.params[name]
        st.values.frozen_full[name] = v.view(p.shape)
        start, stop, at = st.values.piece(name)
        st.host_param[p.chunk][at:at + stop - start].copy_(v.reshape(-1)[start:stop])
    st.values.load_buffers({n: small[f"model.{n}"] for n in buffers})
    apply_meta(state, meta)
    state.clear_broken()


def _load_targets(st, comm, group: set[int], params, stepped, keys: Keys, layout, plan: dict, whole: dict
                  ) -> tuple[dict, dict[int, dict]]:
    """The DCP entries to load the parameters and optimizer states of the chunks in `group` into (views of the
    chunks' buffers; a frozen parameter's whole value goes into `whole`), and those chunks' fp32 states (compressed
    moments: fp32 copies, quantised after the load by set_moments): zeroed, their 0-d states set from `plan` (a
    chunk with state counts at least one step), the per-element ones then read by the load."""
    entries: dict = {}
    for name in params:
        p = st.params[name]
        if p.chunk not in group:
            continue
        src = st.values.value_source(name)
        if src is None:
            whole[name] = entries[f"model.{name}"] = torch.empty(_shape(p.shape), dtype=torch.float32)
            continue
        start, stop, at = st.values.piece(name)
        entries[f"model.{name}"] = _entry(comm, src[at:at + stop - start], start, stop, p.shape)
    # fp32 states to load into: views of the buffers, or (compressed moments) fp32 shards quantised after the load
    moments = {cid: st.values.moments(cid) for cid in plan if cid in group}
    for name in stepped:
        p = st.params[name]
        if p.chunk not in group:
            continue
        parts = moments[p.chunk]
        start, stop, at = st.values.piece(name)
        for key in keys[name][0]:
            entries[f"optim.{name}.{key}"] = _entry(comm, parts[key][at:at + stop - start], start, stop, p.shape)
    for cid, parts in moments.items():
        for k in layout.vectors + layout.scalar_parts:     # (a group may keep fewer than the layout has room for)
            parts[k].zero_()
        if plan[cid] is not None:
            for k, v in plan[cid].items():
                parts[k].fill_(v)
            if layout.counter not in plan[cid]:
                parts[layout.counter].fill_(1)
    return entries, moments


def apply_meta(state: StepState, meta: dict) -> None:
    """The loss scaler and this rank's RNG states. A checkpoint of another precision than the step's (fp16 against
    bf16 or fp32) has no scaler to restore, or one this step has no use for: a warning says which."""
    if state.scaler is not None and meta["loss_scaler"] is not None:
        for k, v in meta["loss_scaler"].items():
            setattr(state.scaler, k, v)
    elif (state.scaler is None) != (meta["loss_scaler"] is None):
        ours = state.settings.precision.value
        warnings.warn(
            f"step.load: the checkpoint was saved in {meta['precision']} and this step trains in {ours}: "
            + (f"its fp16 loss scale ({meta['loss_scaler']['scale']:g}) is not used" if state.scaler is None else
               f"it has no loss scale, so this step keeps its own ({state.scaler.scale:g})"),
            stacklevel=3)
    rng = meta["rng"]
    torch.set_rng_state(rng["torch_cpu"])
    if "torch_cuda" in rng and state.settings.device.type == "cuda":
        torch.cuda.set_rng_state(rng["torch_cuda"], state.settings.device)
