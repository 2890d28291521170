"""Saving and loading a checkpoint directory, either format (see pstar_fx.checkpoint for the contract): the save's
atomic write (a fresh sibling directory, each file fsynced, checksummed and listed in the manifest written last,
then published by rename) with every rank agreeing at each stage, and the load's verification before anything is
read, then applied."""

from __future__ import annotations

import errno
import os
import shutil
import time

from torch.distributed.checkpoint.api import CheckpointException

from ..errors import CheckpointError, DistributedError
from ..interrupts import DeferredInterrupt
from ..ir.graph import StateHome
from ..runtime.comm import collective_call, digest64, raised_by_collective
from ..runtime.host_memory import local_ranks, spare_host_bytes
from ..units import format_bytes
from . import checks, dcp_storage, files, plain
from . import sharded as sharded_format
from .step_state import StepState


def _norm(path) -> str:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"step.save/load: the checkpoint directory must be a str or os.PathLike, not "
                        f"{type(path).__name__}")
    p = os.path.normpath(os.fspath(path))
    if p in (".", "/", ""):
        raise ValueError(f"step.save/load: give a checkpoint directory name (e.g. 'ckpt'), got {path!r}")
    return p


# what a collective that fails inside a save or a load leaves (Comm.failure says it after what failed)
AFTER_SAVE = ("The checkpoint under that path is as it was (or the new one, where rank 0 had published it): never "
              "a half-written one.")
AFTER_LOAD = ("The step's values are as they were, unless the load had begun writing the checkpoint's into it: the "
              "step then refuses to run until a load succeeds.")


def _agree(comm, value):
    """Rank 0's value on every rank (a collective on the control group); the value itself with one rank."""
    if comm is None:
        return value
    return comm.broadcast_object(value, "step.save: taking rank 0's decision", AFTER_SAVE)


def _any(comm, flag: bool) -> bool:
    """Whether any rank passed True (a collective on the control group)."""
    if comm is None:
        return flag
    return any(comm.gather_objects(flag, "step.save: learning whether any rank failed", AFTER_SAVE))


def disk_states_fit(state: StepState, doing: str) -> None:
    """Before a save in the plain format, or by several ranks: it reads every disk-tier chunk's optimizer states
    into host memory at once (one rank's sharded save and every load stream them, a chunk at a time). Where the host
    has less to spare than that (MemAvailable less a margin, runtime/host_memory.spare_host_bytes), CheckpointError
    says so on every rank, before anything is read or written, instead of the process running out of memory."""
    st = state.store
    short = None
    if st is not None and st.disk is not None:
        shut = [c for c, home in enumerate(st.state_home) if home is StateHome.DISK and not st.is_open(c)]
        need = sum(st.disk.sizes[c] for c in shut)
        spare = spare_host_bytes(1 if state.comm is None else local_ranks(state.comm.world))
        if shut and spare and need > spare:
            short = (len(shut), need, spare)
    if _any(state.comm, short is not None):
        what = ("another rank's" if short is None else
                f"the optimizer states of the {short[0]} chunks in the disk tier ({format_bytes(short[1])}), and this "
                f"host has {format_bytes(short[2])} to spare")
        raise CheckpointError(f"{doing} reads every disk-tier chunk's optimizer states into host memory at once: "
                              f"{what}; this save does not stream the disk tier's states (one rank's sharded save "
                              "does). Nothing was read or "
                              "written. Free host memory (or give this model more host memory) to checkpoint it.")


def _gather(comm, value: dict) -> dict:
    """Every rank's dict merged (a collective on the control group); the dict itself with one rank."""
    if comm is None:
        return value
    every = comm.gather_objects(value, "step.save: gathering the files' checksums", AFTER_SAVE)
    return {k: v for d in every for k, v in d.items()}


def _save_error(e: BaseException, path: str, tmp: str, rank: int) -> BaseException:
    """What to raise for a failed part of a save: DCP's wrapper (around any rank's exception, Ctrl-C too) undone, a
    file system error in it naming the file (this rank's data files, where DCP does not say which) and the cause.
    Errors of pstar-fx's own writes name their file already."""
    interrupt = _interrupt_in(e)
    if interrupt is not None:                  # Ctrl-C inside torch's file writer comes out as its RuntimeError
        return interrupt
    if isinstance(e, RuntimeError) and "inline_container" in str(e):   # torch's zip writer: a write failed
        if shutil.disk_usage(os.path.dirname(tmp) or ".").free < 1 << 20:
            return files.described(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), tmp, f"step.save({path!r}): "
                                   "writing")
        return OSError(errno.EIO, f"step.save({path!r}): writing under {tmp}: torch's file writer failed ({e})")
    if not isinstance(e, CheckpointException):
        return e
    inner = (e.failures.get(rank) or next(iter(e.failures.values()), (e, None)))[0]
    if isinstance(inner, OSError):
        return files.described(inner, inner.filename or os.path.join(tmp, f"__{rank}_*.distcp"),
                               f"step.save({path!r}): writing")
    return inner


def _interrupt_in(e: BaseException) -> KeyboardInterrupt | None:
    """A KeyboardInterrupt e is, or was raised while handling (torch's writer wraps one in its RuntimeError)."""
    for _ in range(8):
        if e is None or isinstance(e, KeyboardInterrupt):
            return e
        e = e.__cause__ or e.__context__
    return None


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
        error = None if failed is None else _save_error(failed, path, tmp, rank)   # (before the files go)
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        if failed is not None:
            if error is failed:
                raise failed
            raise error from failed
        raise DistributedError(f"step.save({path!r}) failed on another rank (its own error says why); nothing was "
                               "written under that name")
    return out


def _described(fn, file: str, doing: str):
    try:
        return fn()
    except OSError as e:
        raise files.described(e, file, doing) from e


def save(state: StepState, path, *, sharded: bool | None = None, frozen: bool = True) -> None:
    """Write model values, optimizer state, loss scaler and RNG states to the directory `path` (see the module
    docstring). sharded: None picks the sharded format with several ranks or a disk tier, plain files otherwise.
    frozen=False leaves out the parameters the step does not train (plain files only): a load keeps the model's own
    values for them (a fine-tune's base weights, which the base checkpoint holds). Reads values only; the step's state
    is not changed (a model built under px.init_empty() is first taken into the chunks, as step.state_dict() does).
    A `path` that is a symbolic link: the checkpoint replaces the link's target, and the link is kept
    (files.save_target). With several ranks, every rank calls it with the same path and arguments: DistributedError
    on every rank where the ranks are in different calls (one saves, another steps), or call it with other
    arguments, before anything is written; and where a collective fails (another rank failed or exited), with the
    previous checkpoint in place."""
    path = _norm(path)
    with collective_call(state.comm, "step.save", AFTER_SAVE, {"sharded": sharded, "frozen": frozen}):
        _save(state, path, sharded, frozen)


def _save(state: StepState, path: str, sharded: bool | None, frozen: bool) -> None:
    state.fill_if_empty()        # a model built under px.init_empty() gets its values in the chunks, if they exist
    if state.model_is_empty():
        raise ValueError("step.save: the model was built under px.init_empty() and has no values until the step's "
                         "chunks exist: call step.lower(*batch) (or run a step) first")
    comm = state.comm
    on_disk = state.store is not None and state.store.disk is not None
    as_sharded = (comm is not None or on_disk) if sharded is None else bool(sharded)
    if not frozen and as_sharded:
        raise ValueError("step.save(frozen=False) leaves frozen parameters out of plain files; the sharded format "
                         "(several ranks, a disk tier, sharded=True) holds every value: save with sharded=False")
    rank = state.rank
    if not as_sharded or comm is not None:     # (one rank's sharded save streams its disk chunks)
        disk_states_fit(state, f"step.save({path!r})")
    contents = None
    if not as_sharded:
        # read everything before writing anything (collectives with several ranks: every rank gathers it)
        contents = plain.contents(state, () if frozen else state.frozen_names())
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
    target, tmp, old = where
    try:
        _write(state, path, target, tmp, old, as_sharded, contents)
    except BaseException as e:
        if rank == 0 and raised_by_collective(e):     # another rank failed or exited: its part is not there
            shutil.rmtree(tmp, ignore_errors=True)
        raise


def _write(state: StepState, path: str, target: str, tmp: str, old: str, as_sharded: bool, contents) -> None:
    """The files written into `tmp`, checksummed, listed in the manifest, and published at `target` by rank 0
    (`path`, or the target of the symbolic link `path` is: files.save_target)."""
    comm, rank = state.comm, state.rank

    def write():
        if as_sharded:
            return sharded_format.save(state, tmp, state.model_values)      # DCP's metadata on rank 0
        if rank == 0:
            for name in files.DATA_FILES:
                file = os.path.join(tmp, name)
                _described(lambda: plain.write(contents[name], file), file, f"step.save({path!r}): writing")
        return None
    md = _every_rank(comm, path, tmp, write)
    names = sorted({i.relative_path for i in md.storage_data.values()}) if md is not None else list(files.DATA_FILES)
    names = _agree(comm, names)
    # the files read back and checksummed: every rank its share of the sharded files, rank 0 the plain ones
    share = names[rank::comm.world] if as_sharded and comm is not None else names if rank == 0 else []
    sums = _every_rank(comm, path, tmp, lambda: {
        n: _described(lambda: files.checksum(os.path.join(tmp, n)), os.path.join(tmp, n),
                      f"step.save({path!r}): reading back") for n in share})
    sums = _gather(comm, sums)

    def finish():
        if rank == 0:
            manifest = files.Manifest(files.Kind.SHARDED if as_sharded else files.Kind.PLAIN, sums,
                                      dcp_storage.metadata_to_json(md) if as_sharded else None)
            file = os.path.join(tmp, files.MANIFEST_OF[manifest.kind])
            _described(lambda: files.write_manifest(tmp, manifest), file, f"step.save({path!r}): writing")
    _every_rank(comm, path, tmp, finish)
    error = None
    if rank == 0:
        try:
            files.publish(target, tmp, old)
        except OSError as e:
            error = files.described(e, e.filename or target, f"step.save({path!r}): publishing")
    text = _agree(comm, None if error is None else str(error))
    if error is not None:
        raise error
    if text is not None:
        raise OSError(f"step.save({path!r}) failed on rank 0: {text}")


def _open(comm, path: str) -> files.Manifest:
    """The checkpoint's manifest, with every file it lists verified (with several ranks, each rank checks a share
    and all agree: every rank raises if any file is bad, the error of the rank that found it), and, with several
    ranks, the same checkpoint on every rank: DistributedError on every rank where they opened different ones
    (different paths, or copies that differ on disks of their own), before anything is read out of them. The
    ranks' agreement is the load's first control message (Comm.agree_on), so a rank in another call (a step) is
    told too."""
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
    which = None if manifest is None else _identity(manifest)
    every = comm.agree_on("step.load", (failed is None, which), lambda: {
        "failed": None if failed is None else (type(failed), failed.args),
        "checkpoint": None if manifest is None else _checkpoint_name(path, manifest)}, after=AFTER_LOAD)
    if failed is not None:
        raise failed
    if every is None:
        return manifest
    first = next((d["failed"] for d in every if d["failed"] is not None), None)
    if first is not None:
        kind, args = first
        raise kind(*args)
    by: dict[str, list[int]] = {}
    for r, d in enumerate(every):
        by.setdefault(d["checkpoint"], []).append(r)
    shown = "; ".join(f"{'rank' if len(rs) == 1 else 'ranks'} {', '.join(map(str, rs))}: {c}" for c, rs in by.items())
    raise DistributedError(
        f"pstar-fx: step.load: the ranks opened different checkpoints ({shown}): each rank would restore its own "
        "shards from its own, and the step would train a mix of them. Load the same checkpoint on every rank (the "
        "same path on a file system they share, or identical copies). Nothing was loaded: the step's values are as "
        "they were.")


def _identity(manifest: files.Manifest) -> tuple:
    """What tells checkpoints apart: the format and every file's size and checksums (identical copies agree)."""
    return manifest.kind.value, sorted((n, s.size, s.crc32) for n, s in manifest.files.items())


def _checkpoint_name(path: str, manifest: files.Manifest) -> str:
    """A checkpoint as the ranks' disagreement names it: its path, a digest of its identity and its manifest's
    modification time (an older copy shows as older)."""
    try:
        written = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(
            os.path.getmtime(os.path.join(path, files.MANIFEST_OF[manifest.kind]))))
    except OSError:
        written = "?"
    digest = digest64(_identity(manifest)) & 0xFFFFFFFF
    return f"{path!r}, {manifest.kind.value} checkpoint {digest:08x} written {written}"


def load(state: StepState, path) -> None:
    """Restore everything `save` wrote: model values, optimizer state, loss scaler, RNG states, from a checkpoint
    of either format saved at any world size. Works before the first step (values wait in the model and the
    optimizer until the chunks exist) and after a failed step (CommitError): every value is replaced, and the step
    may be called again. Verifies and checks everything first (module docstring): a refused checkpoint raises
    CheckpointError or FileNotFoundError naming the file and changes nothing. With several ranks, every rank calls
    it with the same checkpoint: DistributedError on every rank where they opened different ones (see `_open`), or
    are in different calls (one loads, another steps), before anything is applied; and where a collective fails
    (another rank failed or exited)."""
    path = _norm(path)
    with collective_call(state.comm, "step.load", AFTER_LOAD, check=False):     # (_open checks the call)
        _load(state, path)


def _load(state: StepState, path: str) -> None:
    if state.store is None and state.model_is_empty():
        raise ValueError("step.load: the model was built under px.init_empty(), so its values will live in the "
                         "step's chunks, which do not exist yet: call step.lower(*batch) (or run a step) first, "
                         "then step.load")
    manifest = _open(state.comm, path)
    if manifest.kind is files.Kind.SHARDED:
        whole = sharded_format.read(state, path, manifest)
        if whole is not None:
            model_sd, opt_sd, meta = whole
            checks.optimizer_state(state, opt_sd, f"{path}/{sharded_format.META}")
            _apply(state, model_sd, opt_sd, meta, path)
        return
    model_sd, opt_sd, meta = plain.read_checked(state, path)
    _apply(state, model_sd, opt_sd, meta, path)


def _apply(state: StepState, model_sd: dict, opt_sd: dict, meta: dict, path: str) -> None:
    """Whole values into the step: through its chunks when it holds the model, else into the model and the
    optimizer (the next step takes them)."""
    left_out = set(meta.get("left_out", ()))          # frozen parameters the model keeps its own values for
    ref = {k: v for k, v in state.model.state_dict(keep_vars=True).items() if k not in left_out}   # keys, shapes
    checks.same_model(path, {k: tuple(v.shape) for k, v in model_sd.items()},
                      {k: tuple(v.shape) for k, v in ref.items()})
    # Ctrl-C waits until every value is in (then comes as a KeyboardInterrupt after a whole load): a load cut short
    # would leave the checkpoint's optimizer states beside the old parameters
    with DeferredInterrupt():
        # optimizer first: it checks everything before it changes anything, so a refused checkpoint changes nothing
        try:
            state.load_optimizer(opt_sd)
        except (ValueError, KeyError) as e:     # (a CheckpointError is a ValueError too)
            raise CheckpointError(f"step.load: {path!r}: its optimizer state does not fit this step: {e}") from e
        # model values: into the chunks when this step holds the model, else into the model, which the next step
        # takes (another step holding the model gives it back first); a model built under px.init_empty() has
        # values only in the chunks, so the step takes it first
        state.fill_if_empty()
        state.load_model_values(model_sd, not left_out)   # into the chunks when the step holds them, else the model
        sharded_format.apply_meta(state, meta)
        state.clear_broken()
