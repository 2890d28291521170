"""Checkpoints that resume exactly: `step.save(path)` / `step.load(path)`.

Two formats, one `load` for both, from any world size into any world size:

Plain files (one process: the default). A directory of three ordinary files, each loadable with
`torch.load(path, weights_only=True)`:
- model.pt: the model's state dict, `step.state_dict()` (parameters at full precision, fp32 masters in mixed
  precision, and buffers), keyed as `model.state_dict()`: `model.load_state_dict(torch.load(...))` works in eager
  PyTorch too;
- optimizer.pt: `step.optimizer.state_dict()`, torch.optim.AdamW's (or Adam's) format, options and moments;
- meta.pt: the format version, the precision, the fp16 loss scaler (scale, good steps, growth settings) and the RNG
  states the step draws from: torch's CPU generator, and the device's CUDA generator when the step runs on CUDA.

Sharded (several ranks: the default; `save(step, path, sharded=True)` with one): a torch.distributed.checkpoint
directory (`.metadata` and one `.distcp` file per rank) in which each rank wrote only the pieces of parameters and
optimizer states it owns, with the same contents (see pstar_fx.dcp). No rank gathers the model. Loading reads each
rank's pieces under the current world size and chunk layout, whatever saved it: a run saved at world size 2
resumes at world size 1 and the reverse. Load after the chunk store exists (after a step, or `step.lower(*batch)`)
to read only this rank's pieces; a load before it reads the values whole into the model and the optimizer (as the
model is whole on every rank until the first step), and the first step takes them. With several ranks every
rank calls `save` and `load`, with the same path, on a file system they share.

Across world sizes. Values, moments and step counts continue exactly (bit for bit in fp32 and mixed precision: a
run at world size W on a global batch equals, on this machine, a run at world size 1 with W micro-batches, which
computes the same sums). Rank r restores the RNG states that rank r % W_saved saved (its own at the same world
size); buffers, identical on every rank in data parallel, are written by one rank. A plain-files checkpoint loads at
any world size too (each rank memory-maps the files and copies its pieces); saving one with several ranks
(`sharded=False`) gathers every value on every rank and rank 0 writes.

Not in it: Python's `random` and NumPy's generators, a data loader's position and an lr scheduler's state (save
`sched.state_dict()` yourself) are the user's business; the compiled graphs are not saved (the first step after a
load traces again). Values are per parameter, not per chunk, so a checkpoint loads into a step compiled with another
chunk_size, budget or world size (or, plain files, into eager PyTorch).

A save is atomic: the files are written into a fresh sibling directory (each fsynced), which then takes the
checkpoint's name by rename (by rank 0, after every rank has written its part); an existing checkpoint there is
renamed aside first and removed after. A save that is interrupted leaves either the old checkpoint or the new one
under `path`, or, between the two renames, nothing under `path` and both beside it (the load error names them):
never a half-written checkpoint that `load` accepts.
"""
from __future__ import annotations

import dataclasses
import os
import shutil
import uuid

import torch
import torch.distributed as dist

from . import dcp
from .init_empty import is_empty
from .ir import Role
from .ownership import model_tensors

FORMAT = 1
FILES = ("model.pt", "optimizer.pt", "meta.pt")     # meta.pt last: a directory without it is not a checkpoint


def _norm(path) -> str:
    p = os.path.normpath(os.fspath(path))
    if p in (".", "/", ""):
        raise ValueError(f"step.save/load: give a checkpoint directory name (e.g. 'ckpt'), got {path!r}")
    return p


def _to_cpu(x):
    if isinstance(x, torch.Tensor):
        return x.detach().to("cpu", copy=True)
    if isinstance(x, dict):
        return {k: _to_cpu(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_to_cpu(v) for v in x)
    return x


def _model_values(step) -> dict[str, torch.Tensor]:
    """The values the next step would train on, keyed as the model's state dict: each tensor's from whichever holds
    it (this step's chunks, another step's, or the model itself), as step.state_dict() reads them."""
    return step.state_dict()


def gather_state_dict(step) -> dict[str, torch.Tensor]:
    """`step.state_dict(rank0_only=True)` with several ranks (a collective): rank 0 gets the whole state dict, the
    other ranks {}. Chunk by chunk, each rank's shard of the full-precision values goes to rank 0 only
    (torch.distributed.gather), so the other ranks never hold more than their own shards."""
    comm, st = step._comm, step._store
    rank0 = comm.rank == 0
    if not dcp.holds(step):
        sd = step.state_dict()       # the model's own values (whole on every rank), or another step's (gathered)
        return sd if rank0 else {}
    st.flush()
    ref = step._model.state_dict()
    by_chunk: dict[int, list[str]] = {}
    for key in ref:
        kind, name = step._state_names[key]
        if kind is Role.PARAM and name not in st.frozen_full and name not in by_chunk.get(st.params[name].chunk, []):
            by_chunk.setdefault(st.params[name].chunk, []).append(name)
    values = dict(st.frozen_full)
    dst = dist.get_global_rank(comm.group, 0)
    for cid in sorted(by_chunk):
        shard = dcp.value_source(st, by_chunk[cid][0])
        if comm.backend == "nccl":
            shard = shard.to(step.settings.device)
        parts = [torch.empty_like(shard) for _ in range(comm.world)] if rank0 else None
        dist.gather(shard, parts, dst=dst, group=comm.group)
        if rank0:
            full = torch.cat(parts).cpu()
            for name in by_chunk[cid]:
                p = st.params[name]
                values[name] = full[p.offset:p.offset + p.numel].view(p.shape)
    if not rank0:
        return {}
    out = {}
    for key, like in ref.items():
        kind, name = step._state_names[key]
        src = values[name] if kind is Role.PARAM else st.buffers[name]
        out[key] = src.detach().to(device=like.device, dtype=like.dtype, copy=True)
    return out


def _meta(step) -> dict:
    scaler = step._scaler
    return {"format": FORMAT, "precision": step.settings.precision.value, "device": step.settings.device.type,
            "loss_scaler": None if scaler is None else dataclasses.asdict(scaler),
            "rng": dcp.rng_state(step.settings.device)}


def _write(obj, path: str) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _agree(comm, value):
    """Rank 0's value on every rank (a collective); the value itself with one rank."""
    if comm is None:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=dist.get_global_rank(comm.group, 0), group=comm.group)
    return box[0]


def _any(comm, flag: bool) -> bool:
    """Whether any rank passed True (a collective)."""
    if comm is None:
        return flag
    every: list = [None] * comm.world
    dist.all_gather_object(every, flag, group=comm.group)
    return any(every)


def _prepare(path: str) -> tuple[str, str]:
    """Rank 0, before writing: check what is at `path`, make the temporary directory; returns (tmp, old)."""
    if os.path.exists(path):
        if not os.path.isdir(path):
            raise ValueError(f"step.save: {path!r} exists and is not a directory; pass a directory name")
        foreign = sorted(n for n in os.listdir(path)
                         if n not in FILES and n != dcp.MARKER and not n.endswith(".distcp"))
        if foreign:
            raise ValueError(f"step.save: {path!r} holds files that are not a pstar-fx checkpoint's "
                             f"({foreign[:3]}); save into a new or an old checkpoint directory, which is replaced "
                             "as a whole")
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    tag = uuid.uuid4().hex[:8]
    tmp, old = f"{path}.tmp-{tag}", f"{path}.old-{tag}"
    os.mkdir(tmp)
    return tmp, old


def _publish(path: str, tmp: str, old: str) -> None:
    """Rank 0, after every rank has written: the temporary directory takes the checkpoint's name."""
    parent = os.path.dirname(os.path.abspath(path))
    _fsync_dir(tmp)
    if os.path.exists(path):
        os.replace(path, old)
    os.replace(tmp, path)
    _fsync_dir(parent)
    shutil.rmtree(old, ignore_errors=True)


def save(step, path, *, sharded: bool | None = None) -> None:
    """Write model values, optimizer state, loss scaler and RNG states to the directory `path` (see the module
    docstring). sharded: None picks the sharded format with several ranks and plain files with one. Reads values
    only; the step's state is not changed (a model built under px.init_empty() is first taken into the chunks, as
    step.state_dict() does). With several ranks, every rank calls it with the same path."""
    path = _norm(path)
    step._fill_if_empty()        # a model built under px.init_empty() gets its values in the chunks, if they exist
    if any(is_empty(t) for t in model_tensors(step._model).values()):
        raise ValueError("step.save: the model was built under px.init_empty() and has no values until the step's "
                         "chunks exist: call step.lower(*batch) (or run a step) first")
    comm = step._comm
    sharded = comm is not None if sharded is None else bool(sharded)
    rank0 = comm is None or comm.rank == 0
    contents = None
    if not sharded:
        # read everything before writing anything (collectives with several ranks: every rank gathers it)
        contents = {"model.pt": _to_cpu(_model_values(step)),
                    "optimizer.pt": _to_cpu(step.optimizer.state_dict()),
                    "meta.pt": _meta(step)}
    where, refused = None, None
    if rank0:
        try:
            where = _prepare(path)
        except (OSError, ValueError) as e:
            refused, where = e, f"{type(e).__name__}: {e}"
    where = _agree(comm, where)
    if refused is not None:
        raise refused
    if isinstance(where, str):
        raise ValueError(f"step.save({path!r}) refused on rank 0: {where}")
    tmp, old = where
    failed = None
    try:
        if sharded:
            dcp.save(step, tmp, lambda: _model_values(step))
        elif rank0:
            for name in FILES:
                _write(contents[name], os.path.join(tmp, name))
    except BaseException as e:
        failed = e
    if _any(comm, failed is not None):
        if rank0:
            shutil.rmtree(tmp, ignore_errors=True)
        if failed is not None:
            raise failed
        raise RuntimeError(f"step.save({path!r}) failed on another rank (its own error says why); nothing was "
                           "written under that name")
    error = None
    if rank0:
        try:
            _publish(path, tmp, old)
        except OSError as e:
            error = e
    error = _agree(comm, None if error is None else f"{type(error).__name__}: {error}")
    if error is not None:
        raise OSError(f"step.save({path!r}): {error}")


def _read(path: str, name: str, mmap: bool = False):
    return torch.load(os.path.join(path, name), map_location="cpu", weights_only=True, mmap=mmap)


def _missing(path: str) -> list[str] | None:
    """What keeps `path` from being a complete checkpoint of either format (None: it is one)."""
    if os.path.isfile(os.path.join(path, dcp.MARKER)):
        return None
    missing = [n for n in FILES if not os.path.isfile(os.path.join(path, n))]
    return missing or None


def load(step, path) -> None:
    """Restore everything `save` wrote: model values, optimizer state, loss scaler, RNG states, from a checkpoint
    of either format saved at any world size. Works before the first step (values wait in the model and the
    optimizer until the chunks exist) and after a failed step (CommitError): every value is replaced, and the step
    may be called again. With several ranks, every rank calls it with the same path."""
    path = _norm(path)
    if step._store is None and any(is_empty(t) for t in model_tensors(step._model).values()):
        raise ValueError("step.load: the model was built under px.init_empty(), so its values will live in the "
                         "step's chunks, which do not exist yet: call step.lower(*batch) (or run a step) first, "
                         "then step.load")
    missing = _missing(path)
    if missing:
        parent = os.path.dirname(os.path.abspath(path))
        base = os.path.basename(path)
        aside = sorted(n for n in os.listdir(parent) if n.startswith(base + ".old-") or n.startswith(base + ".tmp-")) \
            if os.path.isdir(parent) else []
        hint = (f"; an interrupted save left {aside} beside it: '.old-*' is the previous checkpoint, a complete "
                "'.tmp-*' the new one; rename the one you want to " + repr(base)) if aside else ""
        raise FileNotFoundError(f"step.load: {path!r} is not a complete pstar-fx checkpoint (missing {missing}, or "
                                f"a sharded checkpoint's {dcp.MARKER})" + hint)
    if os.path.isfile(os.path.join(path, dcp.MARKER)):
        whole = dcp.read(step, path)
        if whole is not None:
            _apply(step, *whole, path)
        return
    meta = _read(path, "meta.pt")
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ValueError(f"step.load: {path!r}/meta.pt is not a pstar-fx checkpoint of format {FORMAT}")
    # several ranks: each maps the files and copies only its pieces out of them
    mmap = step._comm is not None
    _apply(step, _read(path, "model.pt", mmap), _read(path, "optimizer.pt", mmap), meta, path)


def _apply(step, model_sd: dict, opt_sd: dict, meta: dict, path: str) -> None:
    """Whole values into the step: through its chunks when it holds the model, else into the model and the
    optimizer (the next step takes them)."""
    ref = step._model.state_dict()
    if set(model_sd) != set(ref) or any(tuple(v.shape) != tuple(ref[k].shape) for k, v in model_sd.items()):
        wrong = sorted(set(model_sd) ^ set(ref)) or [k for k, v in model_sd.items() if v.shape != ref[k].shape]
        raise ValueError(f"step.load: {path!r} was saved from another model: keys or shapes differ ({wrong[:3]})")
    # optimizer first: it checks everything before it changes anything, so a refused checkpoint changes nothing
    step.optimizer.load_state_dict(opt_sd)
    # model values: into the chunks when this step holds the model, else into the model, which the next step takes
    # (another step holding the model gives it back first); a model built under px.init_empty() has values only in
    # the chunks, so the step takes it first
    step._fill_if_empty()
    step.load_state_dict(model_sd)     # into the chunks when this step holds the model, else into the model
    dcp.apply_meta(step, meta)
    step._broken = None
