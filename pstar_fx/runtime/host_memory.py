"""HostMemory: the host buffers of one ChunkStore (parameter and gradient homes, host-side optimizer states).

Three measured facts (BENCHMARKS.md, "Setting up host memory") shape how a buffer is made:
- Copies need page-locked memory (pageable copies run at 6-7 GB/s instead of 55). torch's pinned allocator (2.11)
  rounds every allocation up to a power of two, wasting up to half of the host memory offloading lives on, so an
  ordinary allocation of the exact size is pinned with cudaHostRegister (left pageable, with a warning, if that
  fails) and unregistered when the buffer is given back. Only buffers that copies read or write are pinned: the
  optimizer states on the host are read and written by the CPU only.
- Most of setting up is the kernel faulting pages in (zeroing them) and pinning them. A buffer is an anonymous
  mapping (zero by definition, so nothing is written to zero it) advised to use transparent huge pages, then touched
  on torch's intra-op threads, so that set-up faults 2 MiB pages in parallel and the first step faults nothing.
- Small buffers come from torch's allocator (a mapping per buffer would cost more than it saves).
Most host bytes are known once the optimizer is placed (the host-stepped chunks' states, gradient and parameter
homes), before the schedule pass runs: `reserve` makes those buffers on a thread of its own meanwhile (touching and
pinning release the GIL), and `zeros(..., key=)` takes a reserved buffer instead of making one. Faulting them in can
take longer than tracing and planning together (a fresh H200 machine faulted in 97 GiB in 19.7 s the first time:
BENCHMARKS.md, session 9), so a first compile that will need much host memory starts faulting in a pool before it
traces (`prefault`), and `reserve` lays the buffers out in that pool.
Buffers that start as zeros and that only a step writes (the Adam moments: two thirds of the host states in mixed
precision) are `deferred`: they are handed out before their pages are present, and `populate_deferred` (called once
compiling is done) faults them in on a thread of its own, behind the first step, with MADV_POPULATE_WRITE, which makes
pages present without writing them, so it cannot race the step's own writes (a page it has not reached is faulted in
by the first write, as any page).
"""
from __future__ import annotations

import ctypes
import errno
import mmap
import os
import threading
import time
import warnings
from dataclasses import dataclass

import torch

# below this size a buffer comes from torch's allocator
MAPPED_MIN_BYTES = 1 << 21
POOL_PIECE = 1 << 30  # the set-up thread faults a prefaulted pool in this many bytes at a time
_PAGE = 4096         # reserved buffers start on a page of their own
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)   # Linux 5.14; Python names it from 3.13 on


def zeroed(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A zero host tensor whose pages are all present: an anonymous mapping (transparent huge pages where the
    kernel allows them) touched on torch's intra-op threads, or torch.zeros below MAPPED_MIN_BYTES. The mapping is
    unmapped when the tensor (which holds it) is freed."""
    nbytes = numel * dtype.itemsize
    if nbytes < MAPPED_MIN_BYTES:
        return torch.zeros(numel, dtype=dtype)
    t = torch.frombuffer(_mapping(nbytes), dtype=dtype, count=numel)
    t.zero_()        # already zero: this faults every page in, on torch's threads, here rather than in a step
    return t


def spare_host_bytes(ranks: int = 1) -> int:
    """This process's share of the host memory the system could give now, less a margin (a tenth of the host, at
    least 2 GiB) for everything else: what a prefault may take. 0 where /proc/meminfo is not there to say."""
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f if line.split()[1:]}
    except (OSError, ValueError, IndexError):
        return 0
    if "MemAvailable" not in info or "MemTotal" not in info:
        return 0
    return max(0, info["MemAvailable"] - max(2 << 30, info["MemTotal"] // 10)) // max(1, ranks)


def _mapping(nbytes: int) -> mmap.mmap:
    """An anonymous private mapping (zero, no page present yet) advised to use transparent huge pages: the CPU
    worker's Adam update ran 22% slower on 4 KiB pages on the H200 machine (benchmarks/host_touch.py)."""
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            m.madvise(mmap.MADV_HUGEPAGE)
        except OSError:      # a kernel without transparent huge pages: 4 KiB pages, same values
            pass
    return m


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _PAGE) * _PAGE


@dataclass(frozen=True)
class BufferSpec:
    """A host buffer to make: its key (what the ChunkStore asks for it by), size, dtype, whether copies use it, and
    whether it may be handed out before its pages are present (deferred: zeros that only a step writes; never
    copied, so never pinned)."""
    key: tuple
    numel: int
    dtype: torch.dtype
    copied: bool
    deferred: bool = False

    def __post_init__(self):
        assert not (self.copied and self.deferred), f"{self.key}: a copied buffer is pinned, so faulted in at once"


# the kinds of buffer, in the order they are laid out: (copied, deferred)
_KINDS = ((True, False), (False, False), (False, True))


@dataclass(frozen=True)
class _Layout:
    """Where reserve() puts each buffer, as (spec, byte offset) pairs: in the prefaulted pool, up to pool_end (its
    first pool_pinned_end bytes pinned, its deferred buffers from pool_eager_end on), and, for the buffers that did
    not fit, in a new arena per kind ((copied, deferred), placed, arena bytes)."""
    in_pool: tuple[tuple[BufferSpec, int], ...]
    pool_end: int
    pool_pinned_end: int
    pool_eager_end: int
    arenas: tuple[tuple[tuple[bool, bool], tuple[tuple[BufferSpec, int], ...], int], ...]


def _lay_out(specs: list[BufferSpec], pool_bytes: int) -> _Layout:
    """The copied buffers first, then the others that are not deferred, then the deferred ones, each kind in spec
    order and each buffer page-aligned, in the pool while they fit (a buffer that does not fit goes to its own kind's
    arena, and the next ones are still tried)."""
    in_pool, end, pinned_end, eager_end, arenas = [], 0, 0, 0, []
    for kind in _KINDS:
        rest, rest_end = [], 0
        for sp in specs:
            if (sp.copied, sp.deferred) != kind:
                continue
            size = _aligned(sp.numel * sp.dtype.itemsize)
            if 0 <= size and end + size <= pool_bytes:
                in_pool.append((sp, end))
                end += size
            else:
                rest.append((sp, rest_end))
                rest_end += size
        if kind == (True, False):
            pinned_end = end
        if not kind[1]:
            eager_end = end
        if rest:
            arenas.append((kind, tuple(rest), rest_end))
    return _Layout(tuple(in_pool), end, pinned_end, eager_end, tuple(arenas))


def _views(base: torch.Tensor, placed) -> dict[tuple, tuple[BufferSpec, torch.Tensor]]:
    """Each placed buffer as a view of `base` (bytes) at its offset, by key."""
    return {sp.key: (sp, base[o:o + sp.numel * sp.dtype.itemsize].view(sp.dtype)) for sp, o in placed}


def _madvise():
    """libc's madvise, called without the GIL (ctypes releases it), or None where there is no libc to call."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        f = libc.madvise
    except (OSError, AttributeError):
        return None
    f.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    f.restype = ctypes.c_int
    return f


_MADVISE = _madvise()


def _populate_write(addr: int, nbytes: int, threads: int) -> int:
    """Make the pages of [addr, addr + nbytes) present for writing (MADV_POPULATE_WRITE), on `threads` threads at
    once, each a page-aligned part (the first from the page addr is on: madvise refuses an unaligned start with
    EINVAL, and populating a page already present writes nothing); 0, or the errno that refused it (EINVAL on
    kernels before Linux 5.14)."""
    if _MADVISE is None:
        return errno.ENOSYS
    start = addr // _PAGE * _PAGE
    nbytes += addr - start
    cut = [start + (nbytes * i // threads) // _PAGE * _PAGE for i in range(threads)] + [start + nbytes]
    errs = [0] * threads

    def one(i: int) -> None:
        if cut[i + 1] > cut[i] and _MADVISE(cut[i], cut[i + 1] - cut[i], MADV_POPULATE_WRITE) != 0:
            errs[i] = ctypes.get_errno() or errno.EINVAL

    workers = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(1, threads)]
    for w in workers:
        w.start()
    one(0)
    for w in workers:
        w.join()
    return next((e for e in errs if e), 0)


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


class Populating:
    """Faults deferred buffers in (module docstring) on a thread of its own, range by range in the order given and
    a piece at a time, each piece on every core but two at once (the executor's thread and the copies keep those
    busy while a first step runs), until done, refused (`error`: the pages then fault on first write) or stopped.
    It holds the ranges' memory, not the HostMemory, so dropping that stops it (after the piece under way)."""

    def __init__(self, ranges: tuple[tuple[torch.Tensor, int, int], ...]):
        self.total = sum(hi - lo for _, lo, hi in ranges)   # bytes to fault in
        self.done = 0                                       # of them, faulted in so far
        self.seconds = 0.0
        self.error = 0                                      # the errno that stopped it, or 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(ranges,), name="pstar-fx host populate",
                                        daemon=True)

    def start(self) -> None:
        """Start (once; again: nothing)."""
        if self._thread.ident is None and not self._stop.is_set():
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.ident is not None and self._thread is not threading.current_thread():
            self._thread.join()

    def wait(self) -> None:
        """Wait until it has ended (it must have been started)."""
        self._thread.join()

    def _run(self, ranges) -> None:
        threads = max(1, _cores() - 2)
        t0 = time.perf_counter()
        for base, lo, hi in ranges:
            addr = base.data_ptr()
            for start in range(lo, hi, POOL_PIECE):
                if self._stop.is_set():
                    return
                end = min(hi, start + POOL_PIECE)
                err = _populate_write(addr + start, end - start, threads)
                if err:
                    self.error = err
                    warnings.warn(f"pstar-fx: faulting in {(self.total - self.done) / 2**30:.1f} GiB of host buffers "
                                  f"(the Adam moments) after compiling was refused ({errno.errorcode.get(err, err)}: "
                                  f"MADV_POPULATE_WRITE needs Linux 5.14); their pages fault in on the first "
                                  f"steps' writes instead, which makes those steps slower", RuntimeWarning)
                    return
                self.done += end - start
                self.seconds = time.perf_counter() - t0


class HostMemory:
    """Host buffers for one ChunkStore; `pin`: page-lock the buffers copies use (CUDA machines)."""

    def __init__(self, pin: bool):
        self.pin = pin
        self._registered: list[torch.Tensor] = []
        self.fallbacks: list[tuple[int, int]] = []   # (bytes, cudaError) of buffers cudaHostRegister refused
        self._reserved: dict[tuple, tuple[BufferSpec, torch.Tensor]] = {}
        self._reserving: threading.Thread | None = None   # the set-up thread
        self._reserve_error: BaseException | None = None
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._ready = threading.Event()    # the reserved buffers are made (or the set-up thread ended without them)
        self._cancelled = False
        self._pool_map: mmap.mmap | None = None    # prefault(): one mapping faulted in before the buffers are known
        self._pool: torch.Tensor | None = None      # its bytes
        self._pool_target = 0                       # bytes of it to fault in before the buffers are handed out
        self._pool_touched = 0                      # bytes of it faulted in so far
        self._layout: _Layout | None = None         # reserve(): where each buffer goes
        self._deferred: list[tuple[torch.Tensor, int, int]] = []   # (bytes, lo, hi): deferred, not yet present
        self.populating: Populating | None = None   # faulting the deferred buffers in, once they are handed out
        self.taken = 0          # reserved buffers handed out by zeros(key=)
        self.arena_seconds: list[tuple[int, float]] = []   # (bytes, seconds) of each arena the set-up thread made
        self.pool_seconds = 0.0  # seconds the set-up thread spent faulting the prefaulted pool in
        self.pool_given_back = 0  # bytes of the pool faulted in but not needed (given back)
        self.waited = 0.0       # seconds callers spent waiting for the set-up thread

    def prefault(self, nbytes: int, ahead: int | None = None) -> None:
        """Start faulting in host memory on the set-up thread now, before the plan says which buffers there will be:
        a pool of `nbytes`, of which the first `ahead` (all by default) are faulted in while the layout is not
        known. `reserve` lays its buffers out in it (from its start: the ones faulted in at once first, deferred
        ones last), the thread faults in as far as the buffers handed out at once reach, gives back any part
        already faulted in beyond the buffers, and populates the deferred ones afterwards. A first compile calls
        this before tracing when the device budget cannot hold every optimizer state (see
        pstar_fx.memory.early_host_bytes), with `ahead` what the first step needs present (the deferred Adam
        moments left out): on the H200 machine a fresh machine's first 97 GiB took 19.7 s to fault in, longer than
        tracing and planning together, so it starts where they start. The thread holds this object: follow a
        prefault with reserve(), release_unclaimed() or cancel()."""
        assert self._reserving is None and self._pool is None, "prefault() before reserve(), once"
        if nbytes < MAPPED_MIN_BYTES:
            return
        self._pool_map = _mapping(nbytes)
        self._pool = torch.frombuffer(self._pool_map, dtype=torch.uint8, count=nbytes)
        self._pool_target = nbytes if ahead is None else max(0, min(nbytes, ahead)) // _PAGE * _PAGE
        self._start()

    @property
    def pool_bytes(self) -> int:
        """Bytes of the prefaulted pool (0 without one), and of it faulted in so far: `pool_touched`."""
        return 0 if self._pool_map is None else len(self._pool_map)

    @property
    def pool_touched(self) -> int:
        return self._pool_touched

    def reserve(self, specs: list[BufferSpec]) -> None:
        """Start making these buffers on the set-up thread; zeros(key=) takes them (waiting for the thread).

        The buffers copies use come first, then the rest, then the deferred ones, each on a page of its own. As many
        as fit go into the prefaulted pool, if there is one (the part of it holding copied buffers is pinned as a
        whole); the others go into new arenas, one per kind, each one mapping (faulted in by one call, except the
        deferred arena). Deferred buffers are handed out before their pages are present; populate_deferred()
        then faults them in, in spec order (module docstring). The thread needs the GIL only a few times, so the passes (pure
        Python) and it do not take turns (a buffer at a time, that cost more than the overlap saved). A view given
        back (free) returns no memory until the last view of its arena goes; the reservation is what the store
        takes, so nothing is left over in practice."""
        assert self._layout is None, "one reservation per HostMemory"
        layout = _lay_out(specs, 0 if self._pool is None else self._pool.numel())
        with self._wake:
            self._layout = layout
            self._pool_target = min(0 if self._pool is None else self._pool.numel(), layout.pool_eager_end)
            self._wake.notify()
        if self._reserving is None:
            self._start()

    def _start(self) -> None:
        self._reserving = threading.Thread(target=self._run, name="pstar-fx host set-up", daemon=True)
        self._reserving.start()

    def _run(self) -> None:
        """The set-up thread: fault the pool in piece by piece (looking for the layout between pieces), make the
        buffers of the layout, and make a Populating for the deferred ones (started by populate_deferred)."""
        try:
            while True:
                with self._wake:
                    while (self._pool_touched >= self._pool_target and self._layout is None
                           and not self._cancelled):
                        self._wake.wait()
                    if self._cancelled:
                        return
                    lo, hi = self._pool_touched, min(self._pool_target, self._pool_touched + POOL_PIECE)
                    layout = self._layout
                if lo < hi:
                    t0 = time.perf_counter()
                    self._pool[lo:hi].zero_()        # already zero: faults the pages in, on torch's threads
                    self.pool_seconds += time.perf_counter() - t0
                    with self._wake:
                        self._pool_touched = hi
                    continue
                self._make_layout(layout)
                break
        except BaseException as e:  # noqa: BLE001 - re-raised by the caller's next zeros()
            self._reserve_error = e
        finally:
            self._ready.set()

    def _make_layout(self, layout: "_Layout") -> None:
        if self._pool is not None:
            touched = self._pool_touched
            if touched > layout.pool_end:    # faulted in ahead of the plan: give those pages back
                self._pool_map.madvise(mmap.MADV_DONTNEED, layout.pool_end, touched - layout.pool_end)
                self.pool_given_back = touched - layout.pool_end
            if self.pin and layout.pool_pinned_end:
                self._pin(self._pool[:layout.pool_pinned_end])
            assert touched >= layout.pool_eager_end, (touched, layout.pool_eager_end)
            if layout.pool_end > touched:      # deferred buffers only (they come last)
                self._deferred.append((self._pool, touched, layout.pool_end))
            with self._lock:
                self._reserved.update(_views(self._pool, layout.in_pool))
        for (copied, deferred), placed, total in layout.arenas:
            if self._cancelled:
                continue
            t0 = time.perf_counter()
            if deferred and total >= MAPPED_MIN_BYTES:
                arena = torch.frombuffer(_mapping(total), dtype=torch.uint8, count=total)   # zero, not present
                self._deferred.append((arena, 0, total))
            else:
                arena = self._make(total, torch.uint8, copied)
            self.arena_seconds.append((total, time.perf_counter() - t0))
            with self._lock:
                self._reserved.update(_views(arena, placed))
        if self._deferred and not self._cancelled:
            self.populating = Populating(tuple(self._deferred))     # started by populate_deferred()
        self._deferred = []

    def populate_deferred(self) -> None:
        """Start faulting the deferred buffers in (once; nothing to do where there are none). px.compile calls this
        when compiling is done, not as soon as the buffers are laid out: on the H200 machine, faulting 57 GiB in
        while the store was set up slowed that set-up from 1.1 s to 28.7 s (each contends for the kernel's page
        allocator), so the populating runs behind the first step instead."""
        self._wait_ready()
        if self.populating is not None and not self._cancelled:
            self.populating.start()

    def _wait_ready(self) -> None:
        """Wait until the reserved buffers are made (re-raising the set-up thread's error), not for the populating
        after it."""
        if self._reserving is not None:
            t0 = time.perf_counter()
            self._ready.wait()
            self.waited += time.perf_counter() - t0
            if self._reserve_error is not None:
                e, self._reserve_error = self._reserve_error, None
                raise e

    def _stop_waiting(self) -> None:
        """A set-up thread with no layout to make stops (it would wait for one forever)."""
        with self._wake:
            if self._layout is None:
                self._cancelled = True
                self._wake.notify()

    def cancel(self) -> None:
        """Stop the set-up thread (compiling failed): it makes no more arenas and populates nothing more; those made
        are given back."""
        with self._wake:
            self._cancelled = True
            self._wake.notify()
        self.release_unclaimed()
        if self.populating is not None:
            self.populating.stop()

    def release_unclaimed(self) -> None:
        """Give back the reserved buffers nobody took (the schedule kept fewer host homes than reserved), and a
        prefaulted pool no reservation used. A set-up thread with nothing (more) to do has ended on return; one
        populating deferred buffers goes on."""
        self._stop_waiting()
        self._wait_ready()
        with self._lock:
            left, self._reserved = list(self._reserved.values()), {}
        for _, t in left:
            self.free(t)
        if self._layout is None or self._cancelled:
            if self._reserving is not None:
                self._reserving.join()
            self._pool = self._pool_map = None      # unmapped once no view holds it

    def zeros(self, numel: int, dtype: torch.dtype, copied: bool = True, key: tuple | None = None) -> torch.Tensor:
        """A zero host buffer; page-locked when this memory pins and `copied` (host<->device copies use it). With a
        key that was reserved (and matches), the reserved buffer."""
        if key is not None and self._layout is not None:
            self._wait_ready()
            with self._lock:
                spec, t = self._reserved.pop(key, (None, None))
            if spec is not None:
                if (spec.numel, spec.dtype, spec.copied) == (numel, dtype, copied):
                    self.taken += 1
                    return t
                self.free(t)
        return self._make(numel, dtype, copied)

    def _make(self, numel: int, dtype: torch.dtype, copied: bool) -> torch.Tensor:
        t = zeroed(numel, dtype)
        if not self.pin or not copied or numel == 0:
            return t
        return self._pin(t)

    def _pin(self, t: torch.Tensor) -> torch.Tensor:
        """Page-lock t (cudaHostRegister); left pageable, with a warning the first time, if that is refused."""
        nbytes = t.numel() * t.element_size()
        err = int(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), nbytes, 0))
        if err != 0:
            # left pageable: its copies are slower, but torch's pinned allocator would round it up to a power of two
            # (up to twice the host memory the plan counted)
            if not self.fallbacks:
                warnings.warn(f"cudaHostRegister refused a {nbytes} B host buffer (cudaError {err}): "
                              "it and any others refused stay pageable, so their copies are slower",
                              ResourceWarning, stacklevel=2)
            with self._lock:
                self.fallbacks.append((nbytes, err))
            return t
        with self._lock:
            self._registered.append(t)
        return t

    def free(self, t: torch.Tensor) -> None:
        """Give back a buffer made by zeros() (unpinned first, if pinned), so its memory is freed once
        unreferenced."""
        with self._lock:
            for i, r in enumerate(self._registered):
                if r is t:
                    torch.cuda.cudart().cudaHostUnregister(t.data_ptr())
                    del self._registered[i]
                    return

    def __del__(self):
        if getattr(self, "_reserving", None) is not None:
            self._stop_waiting()
            self._reserving.join()
        if getattr(self, "populating", None) is not None:
            self.populating.stop()
        for t in getattr(self, "_registered", ()):
            torch.cuda.cudart().cudaHostUnregister(t.data_ptr())
