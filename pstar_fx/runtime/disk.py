"""The disk tier's files and I/O: one file per disk-homed chunk holding its optimizer state buffer, in a directory of
the store's own under `offload_dir`, read and written asynchronously on a small thread pool.

- **Scratch, not a checkpoint.** `DiskStates` makes `offload_dir/pstar-fx-<random>/` at set-up (with several ranks
  `pstar-fx-rank<r>-<random>/`: ranks sharing one offload_dir never share a directory, and a listing says whose each
  is), one file per chunk (`states-<chunk>.bin`, its size aligned to 4 KiB, made with ftruncate: zeros, like fresh
  host states), and removes the directory when it is garbage-collected or the process exits normally (a weakref
  finalizer, which Python also runs at exit). With several ranks each file holds this rank's shard of the chunk's
  states only, and only this rank reads and writes it. `step.save` reads the states out of these files into the
  checkpoint as it reads host states.
- **Direct I/O where it works.** Each file is opened with O_DIRECT where the OS has it; a first aligned write at
  set-up tells whether the file system takes it (tmpfs and some others refuse: EINVAL). If not, the files are opened
  for buffered I/O. `direct` says which ran (step.summary() prints it). Transfers go through buffers aligned to 4 KiB
  of a whole number of 4 KiB blocks, so either mode takes them.
- **Asynchronous.** `read(chunk, slot)` and `write(chunk, slot, gate)` return Futures at once. The operations on one
  staging buffer (slot) run in the order they were issued: a read into a slot starts after the slot's previous
  write is done (so the buffer is never overwritten before its states reached the disk), and a write starts once
  `gate` (the chunk's update) is done; a failed gate fails the write without writing. Nothing here blocks the
  calling thread; the store waits on the Futures (a failure is its step's to raise), `settle` for all of them.
"""
from __future__ import annotations

import errno
import os
import shutil
import tempfile
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from ..ir.needs import DISK_ALIGN, aligned

IO_THREADS = 4


def aligned_buffer(nbytes: int) -> torch.Tensor:
    """A uint8 CPU tensor of `nbytes` (a multiple of DISK_ALIGN) whose address is a multiple of DISK_ALIGN."""
    raw = torch.empty(nbytes + DISK_ALIGN, dtype=torch.uint8)
    skip = (-raw.data_ptr()) % DISK_ALIGN
    return raw[skip:skip + nbytes]


def _view(t: torch.Tensor) -> memoryview:
    return memoryview(t.numpy()).cast("B")


def check_dir(path) -> str:
    """offload_dir as an absolute path; ValueError when it is not an existing directory pstar-fx can write into."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"offload_dir must be a path to a directory (a str or os.PathLike), got {type(path).__name__}")
    p = os.path.abspath(os.fspath(path))
    if not os.path.isdir(p):
        raise ValueError(f"offload_dir {p!r} is not an existing directory: create it (on a local disk, ideally "
                         "NVMe) or pass another")
    try:
        fd, probe = tempfile.mkstemp(prefix=".pstar-fx-probe-", dir=p)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ValueError(f"offload_dir {p!r} is not writable ({e.strerror}): pass a directory pstar-fx may create "
                         "files in") from None
    return p


def scratch_prefix(rank: int | None) -> str:
    """The name a store's scratch directory starts with: the rank's number in it where there are several ranks
    (rank None: one process)."""
    return "pstar-fx-" if rank is None else f"pstar-fx-rank{rank}-"


def _cleanup(root: str, fds: dict, pool: ThreadPoolExecutor) -> None:
    # (collected in one of the pool's own threads, which cannot wait for itself, nothing is in flight: every
    # operation holds the object alive)
    pool.shutdown(wait=not threading.current_thread().name.startswith("pstar-fx disk"))
    for fd in fds.values():
        try:
            os.close(fd)
        except OSError:
            pass
    shutil.rmtree(root, ignore_errors=True)


class _Moved(dict):
    """Bytes read and written so far, under a lock of its own."""

    def __init__(self):
        super().__init__(read=0, written=0)
        self.lock = threading.Lock()


def _transfer(call, fd: int, buf: torch.Tensor, path: str, moved: _Moved, what: str) -> None:
    """One whole-file read (os.preadv) or write (os.pwritev) of buf at offset 0."""
    n = call(fd, [_view(buf)], 0)
    if n != buf.numel():
        raise OSError(f"pstar-fx disk tier: short {'read' if what == 'read' else 'write'} of {path}: {n} of "
                      f"{buf.numel()} bytes" + ("" if what == "read" else " (disk full?)"))
    with moved.lock:
        moved[what] += buf.numel()


class DiskStates:
    """The files of one ChunkStore's disk-homed states (with several ranks: of this rank's shards) and the staging
    buffers they are read into. rank: this process's rank where there are several (None: one process)."""

    def __init__(self, offload_dir: str, rank: int | None = None):
        self.root = tempfile.mkdtemp(prefix=scratch_prefix(rank), dir=offload_dir)
        self._fds: dict[int, int] = {}
        self.sizes: dict[int, int] = {}          # chunk -> bytes of its state buffer (unaligned)
        self._pool = ThreadPoolExecutor(max_workers=IO_THREADS, thread_name_prefix="pstar-fx disk")
        self._finalizer = weakref.finalize(self, _cleanup, self.root, self._fds, self._pool)
        self.direct = hasattr(os, "O_DIRECT") and self._direct_works()
        self.staging: list[torch.Tensor] = []
        self._last: dict[int, Future] = {}       # slot -> its latest operation
        self._lock = threading.Lock()
        self.moved = _Moved()                     # bytes read and written so far (a step reports differences)

    def _direct_works(self) -> bool:
        probe = os.path.join(self.root, "probe")
        try:
            fd = os.open(probe, os.O_CREAT | os.O_RDWR | os.O_DIRECT, 0o600)
        except OSError:
            return False
        try:
            os.pwritev(fd, [_view(aligned_buffer(DISK_ALIGN))], 0)
            return True
        except OSError as e:
            if e.errno in (errno.EINVAL, errno.EOPNOTSUPP):
                return False
            raise
        finally:
            os.close(fd)
            os.unlink(probe)

    @property
    def mode(self) -> str:
        return "direct (O_DIRECT)" if self.direct else "buffered"

    def add(self, chunk: int, nbytes: int) -> None:
        """A file for chunk's state buffer of nbytes, all zeros."""
        assert chunk not in self._fds, chunk
        flags = os.O_CREAT | os.O_RDWR | (os.O_DIRECT if self.direct else 0)
        fd = os.open(os.path.join(self.root, f"states-{chunk}.bin"), flags, 0o600)
        os.ftruncate(fd, aligned(nbytes))
        self._fds[chunk] = fd
        self.sizes[chunk] = nbytes

    def has(self, chunk: int) -> bool:
        return chunk in self._fds

    def path(self, chunk: int) -> str:
        return os.path.join(self.root, f"states-{chunk}.bin")

    def set_staging(self, slots: int, nbytes: int) -> None:
        """At least `slots` staging buffers of at least nbytes (aligned) each; made once, grown where a plan needs
        more. Before a step: what is still in flight finishes first (a failure was the step's to raise)."""
        self.settle()
        if len(self.staging) >= slots and all(s.numel() >= nbytes for s in self.staging[:slots]):
            return
        size = max([aligned(nbytes)] + [s.numel() for s in self.staging])
        self.staging = [aligned_buffer(size) for _ in range(max(slots, len(self.staging)))]

    def states(self, chunk: int, slot: int) -> torch.Tensor:
        """Staging buffer `slot` as chunk's fp32 state buffer (the store gives its size in bytes)."""
        return self.staging[slot][:self.sizes[chunk]].view(torch.float32)

    # -- synchronous, outside a step -------------------------------------------------------------------------------
    def read_into(self, chunk: int, out: torch.Tensor) -> None:
        """The file's states into `out` (a fresh fp32 tensor of the state buffer's size)."""
        buf = aligned_buffer(aligned(self.sizes[chunk]))
        self._read(chunk, buf)
        out.view(torch.uint8).copy_(buf[:self.sizes[chunk]])

    def write_from(self, chunk: int, src: torch.Tensor) -> None:
        buf = aligned_buffer(aligned(self.sizes[chunk]))
        buf[:self.sizes[chunk]].copy_(src.reshape(-1).view(torch.uint8))
        self._write(chunk, buf)

    def file_bytes(self, chunk: int) -> bytes:
        """The file's bytes, read without direct I/O (tests compare them)."""
        with open(self.path(chunk), "rb") as f:
            return f.read()

    # -- asynchronous, in a step -----------------------------------------------------------------------------------
    # (the closures handed to the pool and to Futures hold no reference to self: the object is collected, and its
    # files removed, once its store lets go of it, whatever Futures the threads still hold)
    def read(self, chunk: int, slot: int) -> Future:
        fd, buf, path, moved = self._fds[chunk], self.staging[slot][:aligned(self.sizes[chunk])], self.path(chunk), \
            self.moved
        return self._chain(slot, None, lambda: _transfer(os.preadv, fd, buf, path, moved, "read"))

    def write(self, chunk: int, slot: int, gate: Future | None) -> Future:
        fd, buf, path, moved = self._fds[chunk], self.staging[slot][:aligned(self.sizes[chunk])], self.path(chunk), \
            self.moved
        return self._chain(slot, gate, lambda: _transfer(os.pwritev, fd, buf, path, moved, "written"))

    @property
    def read_bytes(self) -> int:
        return self.moved["read"]

    @property
    def written_bytes(self) -> int:
        return self.moved["written"]

    def settle(self) -> None:
        """Wait for every operation issued so far, ignoring failures (after a failed step)."""
        with self._lock:
            futs = list(self._last.values())
        for f in futs:
            f.exception()

    def _chain(self, slot: int, gate: Future | None, fn) -> Future:
        """fn on the pool after the slot's previous operation (whatever its outcome) and after gate (which must
        succeed); the returned Future becomes the slot's latest operation."""
        out: Future = Future()
        with self._lock:
            before = [f for f in (self._last.get(slot), gate) if f is not None]
            self._last[slot] = out
        pool = self._pool
        left = [len(before)]
        lock = threading.Lock()

        def run() -> None:
            if gate is not None and gate.exception() is not None:
                out.set_exception(gate.exception())
                return
            try:
                fut = pool.submit(fn)
            except RuntimeError as e:      # the pool is shut down (interpreter exit)
                out.set_exception(e)
                return
            fut.add_done_callback(lambda f: out.set_exception(f.exception()) if f.exception() is not None
                                  else out.set_result(None))

        def one_done(_f) -> None:
            with lock:
                left[0] -= 1
                last = left[0] == 0
            if last:
                run()

        if not before:
            run()
        for f in before:
            f.add_done_callback(one_done)
        return out

    def _read(self, chunk: int, buf: torch.Tensor) -> None:
        _transfer(os.preadv, self._fds[chunk], buf, self.path(chunk), self.moved, "read")

    def _write(self, chunk: int, buf: torch.Tensor) -> None:
        _transfer(os.pwritev, self._fds[chunk], buf, self.path(chunk), self.moved, "written")

    def close(self) -> None:
        """Remove the files now (the finalizer does it otherwise)."""
        self._finalizer()
