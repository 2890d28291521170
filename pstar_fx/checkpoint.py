"""Checkpoints that resume exactly: `step.save(path)` / `step.load(path)`.

Two formats, one `load` for both, from any world size into any world size:

Plain files (one process: the default). A directory of three ordinary files, each loadable with
`torch.load(path, weights_only=True)`, and their manifest:
- model.pt: the model's state dict, `step.state_dict()` (parameters at full precision, fp32 masters in mixed
  precision, and buffers), keyed as `model.state_dict()`: `model.load_state_dict(torch.load(...))` works in eager
  PyTorch too;
- optimizer.pt: `step.optimizer.state_dict()`, torch.optim.AdamW's (or Adam's) format, options and moments;
- meta.pt: the format version, the precision, the fp16 loss scaler (scale, good steps, growth settings) and the RNG
  states the step draws from: torch's CPU generator, and the device's CUDA generator when the step runs on CUDA;
- manifest.json: written last; says "plain" and gives each file's size and checksums (pstar_fx.checkpoint_files).

Sharded (several ranks: the default; `save(step, path, sharded=True)` with one): a torch.distributed.checkpoint
directory (one `.distcp` file per rank, and `.metadata`, which here is pstar-fx's JSON manifest holding DCP's
metadata and the files' checksums, not DCP's pickle) in which each rank wrote only the pieces of parameters and
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

What `load` reads, and how. It takes the format from the manifest alone (manifest.json: plain; else `.metadata`:
sharded; a stray `.metadata` beside a manifest.json changes nothing), checks the manifest's own checksum, then every
file it lists: there, of its size, and matching its checksums (with several ranks each rank checks a share of the
files and they agree before any goes on), before reading anything out of them. Then it reads: JSON (the manifest),
and `torch.load(weights_only=True)` for the plain files, for DCP's tensor pieces and for its byte entries ("pstar_fx",
"rng.<r>"): nothing else is unpickled, so a checkpoint cannot run code, whoever wrote it. Then it checks everything
before applying anything (this model's keys, shapes and dtypes; the optimizer state's structure and options; the
meta's format and precision; a finite, positive loss scale; RNG states the generator accepts; see
pstar_fx.checkpoint_checks): a refused checkpoint raises CheckpointError (FileNotFoundError for a missing file),
naming the file and the cause, and leaves the step, the model, the optimizer, the scaler and the RNG states as they
were. The checksums catch corruption (flipped bits, truncation, a torn copy), not a deliberate forger, who can
rewrite the manifest too. Directories without a manifest (written by pstar-fx before manifests, or by anything
else) are refused: nothing would verify them, and this 0.x library has no archives of them to honour.

A save is atomic, and safe beside training: the step's lock (CompiledStep._lock, held by every step, save and load)
makes it read the state between two whole steps, never during one. The files are written into a fresh sibling
directory (each fsynced, the manifest last), which then takes the checkpoint's name by rename (by rank 0, after
every rank has written its part); an existing checkpoint there is renamed aside first and removed after. A save
that is interrupted leaves either the old checkpoint or the new one under `path`, or, between the two renames,
nothing under `path` and both beside it (the load error names them): never a half-written checkpoint that `load`
accepts. `save` replaces only a pstar-fx checkpoint (a directory with a manifest and nothing it does not list) or
an empty directory; anything else (the user's own model.pt) is refused and left as it is. After publishing, it
removes what killed saves to the same path left beside it (`<path>.tmp-*`, `<path>.old-*` holding only checkpoint
files). File system errors name the file and the cause (disk full, read-only, permission denied).
"""
from __future__ import annotations

import dataclasses
import os
import shutil

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from . import checkpoint_checks as checks
from . import checkpoint_files as files
from . import dcp
from . import dcp_storage
from .errors import CheckpointError
from .frontend.init_empty import is_empty
from .ownership import model_tensors

FORMAT = 1
FILES = files.DATA_FILES + (files.PLAIN_MANIFEST,)     # the manifest last: a directory without it is not one
META_KEYS = {"format", "precision", "device", "loss_scaler", "rng"}


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
    other ranks {} (StoreValues.gather_to_rank0)."""
    if not dcp.holds(step):
        sd = step.state_dict()       # the model's own values (whole on every rank), or another step's (gathered)
        return sd if step._comm.rank == 0 else {}
    return step._store.values.gather_to_rank0(step._state_names, step._model.state_dict())


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


def _gather(comm, value: dict) -> dict:
    """Every rank's dict merged (a collective); the dict itself with one rank."""
    if comm is None:
        return value
    every: list = [None] * comm.world
    dist.all_gather_object(every, value, group=comm.group)
    return {k: v for d in every for k, v in d.items()}


def _save_error(e: BaseException, path: str, tmp: str, rank: int) -> BaseException:
    """What to raise for a failed part of a save: DCP's wrapper (around any rank's exception, Ctrl-C too) undone, a
    file system error in it naming the file (this rank's data files, where DCP does not say which) and the cause.
    Errors of pstar-fx's own writes name their file already."""
    if not isinstance(e, CheckpointException):
        return e
    inner = (e.failures.get(rank) or next(iter(e.failures.values()), (e, None)))[0]
    if isinstance(inner, OSError):
        return files.described(inner, inner.filename or os.path.join(tmp, f"__{rank}_*.distcp"),
                               f"step.save({path!r}): writing")
    return inner


def _every_rank(comm, path: str, tmp: str, fn):
    """fn() on every rank; if it fails on any, rank 0 removes the temporary directory and every rank raises (the
    rank that failed its own error, with the previous checkpoint at `path` untouched)."""
    rank = 0 if comm is None else comm.rank
    failed, out = None, None
    try:
        out = fn()
    except BaseException as e:   # noqa: BLE001 - every rank must learn of it, Ctrl-C included
        failed = e
    if _any(comm, failed is not None):
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        if failed is not None:
            error = _save_error(failed, path, tmp, rank)
            if error is failed:
                raise failed
            raise error from failed
        raise RuntimeError(f"step.save({path!r}) failed on another rank (its own error says why); nothing was "
                           "written under that name")
    return out


def _described(fn, file: str, doing: str):
    try:
        return fn()
    except OSError as e:
        raise files.described(e, file, doing) from e


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
    rank = 0 if comm is None else comm.rank
    contents = None
    if not sharded:
        # read everything before writing anything (collectives with several ranks: every rank gathers it)
        contents = {"model.pt": _to_cpu(_model_values(step)),
                    "optimizer.pt": _to_cpu(step.optimizer.state_dict()),
                    "meta.pt": _meta(step)}
    where, refused = None, None
    if rank == 0:
        try:
            where = files.prepare(path)
        except (OSError, ValueError) as e:
            refused, where = e, f"{type(e).__name__}: {e}"
    where = _agree(comm, where)
    if refused is not None:
        raise refused
    if isinstance(where, str):
        raise ValueError(f"step.save({path!r}) refused on rank 0: {where}")
    tmp, old = where

    def write():
        if sharded:
            return dcp.save(step, tmp, lambda: _model_values(step))      # DCP's metadata on rank 0
        if rank == 0:
            for name in files.DATA_FILES:
                file = os.path.join(tmp, name)
                _described(lambda: _write(contents[name], file), file, f"step.save({path!r}): writing")
        return None
    md = _every_rank(comm, path, tmp, write)
    names = sorted({i.relative_path for i in md.storage_data.values()}) if md is not None else list(files.DATA_FILES)
    names = _agree(comm, names)
    # the files read back and checksummed: every rank its share of the sharded files, rank 0 the plain ones
    share = names[rank::comm.world] if sharded and comm is not None else names if rank == 0 else []
    sums = _every_rank(comm, path, tmp, lambda: {
        n: _described(lambda: files.checksum(os.path.join(tmp, n)), os.path.join(tmp, n),
                      f"step.save({path!r}): reading back") for n in share})
    sums = _gather(comm, sums)

    def finish():
        if rank == 0:
            manifest = files.Manifest(files.Kind.SHARDED if sharded else files.Kind.PLAIN, sums,
                                      dcp_storage.metadata_to_json(md) if sharded else None)
            file = os.path.join(tmp, files.MANIFEST_OF[manifest.kind])
            _described(lambda: files.write_manifest(tmp, manifest), file, f"step.save({path!r}): writing")
    _every_rank(comm, path, tmp, finish)
    error = None
    if rank == 0:
        try:
            files.publish(path, tmp, old)
        except OSError as e:
            error = files.described(e, e.filename or path, f"step.save({path!r}): publishing")
    text = _agree(comm, None if error is None else str(error))
    if error is not None:
        raise error
    if text is not None:
        raise OSError(f"step.save({path!r}) failed on rank 0: {text}")


def _read(path: str, name: str, mmap: bool = False):
    """A verified file of a plain checkpoint, read with weights_only=True."""
    file = os.path.join(path, name)
    try:
        return torch.load(file, map_location="cpu", weights_only=True, mmap=mmap)
    except OSError as e:
        raise files.described(e, file, "step.load: reading") from e
    except Exception as e:   # noqa: BLE001 - whatever torch.load refused, named with its file
        raise CheckpointError(f"step.load: {file} is not what a save writes (torch.load(weights_only=True) refused "
                              f"it: {type(e).__name__}: {e})") from None


def _open(step, path: str) -> files.Manifest:
    """The checkpoint's manifest, with every file it lists verified (with several ranks, each rank checks a share
    and all agree: every rank raises if any file is bad, the error of the rank that found it)."""
    comm = step._comm
    failed, manifest = None, None
    try:
        manifest = files.locate(path)
        files.verify_files(path, manifest, (0, 1) if comm is None else (comm.rank, comm.world))
    except (OSError, CheckpointError) as e:
        failed = e
    if comm is None:
        if failed is not None:
            raise failed
        return manifest
    every: list = [None] * comm.world
    dist.all_gather_object(every, None if failed is None else (type(failed), failed.args), group=comm.group)
    first = next((e for e in every if e is not None), None)
    if failed is not None:
        raise failed
    if first is not None:
        kind, args = first
        raise kind(*args)
    return manifest


def load(step, path) -> None:
    """Restore everything `save` wrote: model values, optimizer state, loss scaler, RNG states, from a checkpoint
    of either format saved at any world size. Works before the first step (values wait in the model and the
    optimizer until the chunks exist) and after a failed step (CommitError): every value is replaced, and the step
    may be called again. Verifies and checks everything first (module docstring): a refused checkpoint raises
    CheckpointError or FileNotFoundError naming the file and changes nothing. With several ranks, every rank calls
    it with the same path."""
    path = _norm(path)
    if step._store is None and any(is_empty(t) for t in model_tensors(step._model).values()):
        raise ValueError("step.load: the model was built under px.init_empty(), so its values will live in the "
                         "step's chunks, which do not exist yet: call step.lower(*batch) (or run a step) first, "
                         "then step.load")
    manifest = _open(step, path)
    if manifest.kind is files.Kind.SHARDED:
        whole = dcp.read(step, path, manifest)
        if whole is not None:
            model_sd, opt_sd, meta = whole
            checks.optimizer_state(step, opt_sd, f"{path}/{dcp.META}")
            _apply(step, model_sd, opt_sd, meta, path)
        return
    meta = checks.meta(step, _read(path, "meta.pt"), os.path.join(path, "meta.pt"), fmt=FORMAT, keys=META_KEYS)
    # several ranks: each maps the files and copies only its pieces out of them
    mmap = step._comm is not None
    model_sd, opt_sd = _read(path, "model.pt", mmap), _read(path, "optimizer.pt", mmap)
    checks.model_state(step, model_sd, os.path.join(path, "model.pt"))
    checks.optimizer_state(step, opt_sd, os.path.join(path, "optimizer.pt"))
    _apply(step, model_sd, opt_sd, meta, path)


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
