"""HostMemory: the host buffers of one ChunkStore (parameter and gradient homes, host-side optimizer states).

Three measured facts (docs/measurements.md, "Host memory set-up") shape how a buffer is made:
- Copies need page-locked memory (pageable copies run at 6-7 GB/s instead of 55). torch's pinned allocator (2.11)
  rounds every allocation up to a power of two, wasting up to half of the host memory offloading lives on, so an
  ordinary allocation of the exact size is pinned with cudaHostRegister (left pageable, with a warning, if that
  fails) and unregistered when the buffer is given back. Only buffers that copies read or write are pinned: the
  optimizer states on the host are read and written by the CPU only.
- Most of setting up is the kernel faulting pages in (zeroing them) and pinning them. A buffer is an anonymous
  mapping (zero by definition: writing zeros over it only faults it in) advised to use transparent huge pages, then
  touched on threads of its own (`touch`: every core but two, leaving one to the thread that traces), so that set-up
  faults 2 MiB pages in parallel and the first step faults nothing.
- Small buffers come from torch's allocator (a mapping per buffer would cost more than it saves).
Most host bytes are known once the optimizer is placed (the host-stepped chunks' states, gradient and parameter
homes), before the schedule pass runs: `reserve` makes those buffers on a thread of its own meanwhile (touching and
pinning release the GIL), and `zeros(..., key=)` takes a reserved buffer instead of making one. Faulting them in can
take longer than tracing and planning together (a fresh H200 machine faulted in 97 GiB in 19.7 s the first time:
BENCHMARKS.md), so a first compile that will need much host memory starts faulting in a pool before it
traces (`prefault`), and `reserve` lays the buffers out in that pool.
"""
from __future__ import annotations

import ctypes
import os
import mmap
import threading
import time
from dataclasses import dataclass

import torch

from ..errors import warn

# below this size a buffer comes from torch's allocator
MAPPED_MIN_BYTES = 1 << 21
POOL_PIECE = 1 << 30  # the set-up thread faults a prefaulted pool in this many bytes at a time
_PAGE = 4096         # reserved buffers start on a page of their own


def zeroed(numel: int, dtype: torch.dtype, threads: int | None = None) -> torch.Tensor:
    """A zero host tensor whose pages are all present: an anonymous mapping (transparent huge pages where the
    kernel allows them) faulted in by `touch` (on `threads`), or torch.zeros below MAPPED_MIN_BYTES. The mapping is
    unmapped when the tensor (which holds it) is freed."""
    nbytes = numel * dtype.itemsize
    if nbytes < MAPPED_MIN_BYTES:
        return torch.zeros(numel, dtype=dtype)
    t = torch.frombuffer(_mapping(nbytes), dtype=dtype, count=numel)
    touch(t, threads)   # already zero: this faults every page in, here rather than in a step
    return t


def spare_threads() -> int:
    """torch's intra-op thread count in the calling thread less two (at least one): the threads faulting memory in and
    the CPU worker's updates leave two cores to the thread that traces or launches kernels and to the driver."""
    return max(1, torch.get_num_threads() - 2)


def touch(t: torch.Tensor, threads: int | None = None) -> None:
    """Fault every page under t in by writing zeros over it (t must be zero already, and nobody else writing it: a
    fresh mapping), on `threads` threads of its own: by default torch's intra-op thread count less two (every core
    but two; one under torchrun, which sets OMP_NUM_THREADS=1, as torch's own threads). ctypes.memset releases the
    GIL.
    Not torch's zero_(), whose intra-op threads take every core: a first compile faults its pool in while the step is
    traced, and the thread that traces should keep a core. On the H200 machine (a virtual machine whose fresh memory
    faults slowly) the 17.26B GPT's trace took about as long as the faulting beside it in first processes (13.6-16.5
    s beside 8.8-16.1 s with zero_(); 12.6 s beside 12.3 s in the one run with touch), 7.3 s beside 2.1 s in a second
    process: a lost core is not all of that slowdown (BENCHMARKS.md)."""
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return
    threads = max(1, min(threads or spare_threads(), nbytes // MAPPED_MIN_BYTES or 1))
    addr = t.data_ptr()
    cut = [addr + nbytes * i // threads for i in range(threads)] + [addr + nbytes]
    workers = [threading.Thread(target=ctypes.memset, args=(cut[i], 0, cut[i + 1] - cut[i]), daemon=True)
               for i in range(1, threads)]
    for w in workers:
        w.start()
    ctypes.memset(cut[0], 0, cut[1] - cut[0])
    for w in workers:
        w.join()


def local_ranks(world: int) -> int:
    """The ranks of this process's node, which share its host memory: torchrun's LOCAL_WORLD_SIZE, else (launched
    otherwise) all `world` of them."""
    return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", world)))


def _meminfo() -> dict[str, int]:
    """/proc/meminfo in bytes; empty where it is not there to say."""
    try:
        with open("/proc/meminfo") as f:
            return {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f if line.split()[1:]}
    except (OSError, ValueError, IndexError):
        return {}


def _margin(total: int) -> int:
    """Host memory left for everything besides pstar-fx's buffers: a tenth of the host, at least 2 GiB."""
    return max(2 << 30, total // 10)


def spare_host_bytes(ranks: int = 1) -> int:
    """This process's share of the host memory the system could give now, less a margin (a tenth of the host, at
    least 2 GiB) for everything else: what a prefault may take. 0 where /proc/meminfo is not there to say."""
    info = _meminfo()
    if "MemAvailable" not in info or "MemTotal" not in info:
        return 0
    return max(0, info["MemAvailable"] - _margin(info["MemTotal"])) // max(1, ranks)


def host_limit_bytes(ranks: int = 1) -> int | None:
    """This process's share of the host's memory less the same margin: more than this a plan can never get, whatever
    else runs (px.compile's default host_memory). None where /proc/meminfo is not there to say."""
    total = _meminfo().get("MemTotal")
    return None if not total else max(0, total - _margin(total)) // max(1, ranks)


def _mapping(nbytes: int) -> mmap.mmap:
    """An anonymous private mapping (zero, no page present yet) advised to use transparent huge pages: the CPU
    worker's Adam update ran 22% slower on 4 KiB pages on the H200 machine (benchmarks/host_page_faults.py)."""
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
    """A host buffer to make: its key (what the ChunkStore asks for it by), size, dtype, and whether copies use it."""
    key: tuple
    numel: int
    dtype: torch.dtype
    copied: bool


@dataclass(frozen=True)
class _Layout:
    """Where reserve() puts each buffer, as (spec, byte offset) pairs: in the prefaulted pool, up to pool_end (its
    first pool_pinned_end bytes pinned), and, for the buffers that did not fit, in a new arena per kind (whether
    copies use them: (copied, placed, arena bytes))."""
    in_pool: tuple[tuple[BufferSpec, int], ...]
    pool_end: int
    pool_pinned_end: int
    arenas: tuple[tuple[bool, tuple[tuple[BufferSpec, int], ...], int], ...]


def _lay_out(specs: list[BufferSpec], pool_bytes: int) -> _Layout:
    """The copied buffers first, then the others, each page-aligned, in the pool while they fit (a buffer that does
    not fit goes to its own kind's arena, and the next ones are still tried)."""
    in_pool, end, pinned_end, arenas = [], 0, 0, []
    for copied in (True, False):
        rest, rest_end = [], 0
        for sp in specs:
            if sp.copied != copied:
                continue
            size = _aligned(sp.numel * sp.dtype.itemsize)
            if 0 <= size and end + size <= pool_bytes:
                in_pool.append((sp, end))
                end += size
                if copied:
                    pinned_end = end
            else:
                rest.append((sp, rest_end))
                rest_end += size
        if rest:
            arenas.append((copied, tuple(rest), rest_end))
    return _Layout(tuple(in_pool), end, pinned_end, tuple(arenas))


def _views(base: torch.Tensor, placed) -> dict[tuple, tuple[BufferSpec, torch.Tensor]]:
    """Each placed buffer as a view of `base` (bytes) at its offset, by key."""
    return {sp.key: (sp, base[o:o + sp.numel * sp.dtype.itemsize].view(sp.dtype)) for sp, o in placed}


class HostMemory:
    """Host buffers for one ChunkStore; `pin`: page-lock the buffers copies use (CUDA machines)."""

    def __init__(self, pin: bool):
        self.pin = pin
        # touch's threads, counted here in the caller's thread: the set-up thread may first ask torch while the
        # compiling thread runs on one intra-op thread (one_intra_op_thread), and would be told one
        self._threads = spare_threads()
        self._registered: list[torch.Tensor] = []
        self.fallbacks: list[tuple[int, int]] = []   # (bytes, cudaError) of buffers cudaHostRegister refused
        self._reserved: dict[tuple, tuple[BufferSpec, torch.Tensor]] = {}
        self._reserving: threading.Thread | None = None   # the set-up thread
        self._reserve_error: BaseException | None = None
        self._pin_error: BaseException | None = None
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._cancelled = False
        self._pool_map: mmap.mmap | None = None    # prefault(): one mapping faulted in before the buffers are known
        self._pool: torch.Tensor | None = None      # its bytes
        self._pool_target = 0                       # bytes of it to fault in
        self._pool_touched = 0                      # bytes of it faulted in so far
        self._layout: _Layout | None = None         # reserve(): where each buffer goes
        self.taken = 0          # reserved buffers handed out by zeros(key=)
        self.arena_seconds: list[tuple[int, float]] = []   # (bytes, seconds) of each arena the set-up thread made
        self.pool_seconds = 0.0  # seconds the set-up thread spent faulting the prefaulted pool in
        self.pool_given_back = 0  # bytes of the pool faulted in but not needed (given back)
        self.waited = 0.0       # seconds callers spent waiting for the set-up thread

    def prefault(self, nbytes: int) -> None:
        """Start faulting in `nbytes` of host memory on the set-up thread now, before the plan says which buffers
        there will be: `reserve` lays its buffers out in it (from its start), the thread goes on only as far as
        they need, and any part already faulted in beyond them is given back to the system. A first compile
        calls this before tracing when the device budget cannot hold every optimizer state (see
        pstar_fx.ir.needs.early_host_bytes): on the H200 machine a fresh machine's first 97 GiB took 19.7 s to fault
        in, longer than tracing and planning together, so it starts where they start. The thread holds this
        object: follow a prefault with reserve(), release_unclaimed() or cancel()."""
        assert self._reserving is None and self._pool is None, "prefault() before reserve(), once"
        if nbytes < MAPPED_MIN_BYTES:
            return
        self._pool_map = _mapping(nbytes)
        self._pool = torch.frombuffer(self._pool_map, dtype=torch.uint8, count=nbytes)
        self._pool_target = nbytes
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

        The buffers copies use come first, then the rest, each on a page of its own. As many as fit go into the
        prefaulted pool, if there is one (the part of it holding copied buffers is pinned as a whole); the others go
        into two new arenas, one for the copied buffers (pinned as a whole) and one for the rest, each one mapping
        faulted in by one call. The thread needs the GIL only a few times, so the passes (pure Python) and it do not
        take turns (a buffer at a time, that cost more than the overlap saved). A view given back (free) returns no
        memory until the last view of its arena goes; the reservation is what the store takes, so nothing is left
        over in practice."""
        assert self._layout is None, "one reservation per HostMemory"
        layout = _lay_out(specs, 0 if self._pool is None else self._pool.numel())
        with self._wake:
            self._layout = layout
            self._pool_target = min(self._pool_target, layout.pool_end)
            self._wake.notify()
        if self._reserving is None:
            self._start()

    def _start(self) -> None:
        self._reserving = threading.Thread(target=self._run, name="pstar-fx host set-up", daemon=True)
        self._reserving.start()

    def _run(self) -> None:
        """The set-up thread: fault the pool in piece by piece (looking for the layout between pieces), then make
        the buffers of the layout. Once the layout is known and the pool's copied buffers are faulted in, they are
        pinned on a thread of their own while the rest of the pool is faulted in (cudaHostRegister of 20 GiB took
        0.4-1.6 s on the H200 machine, after the faulting, before this)."""
        pinning: threading.Thread | None = None
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
                if (pinning is None and layout is not None and self.pin and layout.pool_pinned_end
                        and lo >= layout.pool_pinned_end):
                    pinning = threading.Thread(target=self._pin_pool, args=(layout.pool_pinned_end,),
                                               name="pstar-fx host pinning", daemon=True)
                    pinning.start()
                if lo < hi:
                    t0 = time.perf_counter()
                    touch(self._pool[lo:hi], self._threads)      # already zero: faults the pages in
                    self.pool_seconds += time.perf_counter() - t0
                    with self._wake:
                        self._pool_touched = hi
                    continue
                pinned = pinning is not None
                if pinned:
                    pinning.join()
                    pinning = None
                    if self._pin_error is not None:
                        raise self._pin_error
                self._make_layout(layout, pinned)
                return
        except BaseException as e:  # noqa: BLE001 - re-raised by the caller's next zeros()
            self._reserve_error = e
        finally:
            if pinning is not None:     # cancelled or failed: the pinning thread ends before this one
                pinning.join()

    def _pin_pool(self, nbytes: int) -> None:
        """Pin the pool's first nbytes (its copied buffers): the pinning thread."""
        try:
            self._pin(self._pool[:nbytes])
        except BaseException as e:  # noqa: BLE001 - re-raised by the set-up thread
            self._pin_error = e

    def _make_layout(self, layout: "_Layout", pinned: bool) -> None:
        """Make the layout's buffers and hand them out; `pinned`: the pinning thread pinned (or tried to pin) the
        pool's copied buffers already."""
        if self._pool is not None:
            if self._pool_touched > layout.pool_end:    # faulted in ahead of the plan: give those pages back
                self._pool_map.madvise(mmap.MADV_DONTNEED, layout.pool_end, self._pool_touched - layout.pool_end)
                self.pool_given_back = self._pool_touched - layout.pool_end
            if self.pin and layout.pool_pinned_end and not pinned:
                self._pin(self._pool[:layout.pool_pinned_end])
            with self._lock:
                self._reserved.update(_views(self._pool, layout.in_pool))
        for copied, placed, total in layout.arenas:
            if self._cancelled:
                continue
            t0 = time.perf_counter()
            arena = self._make(total, torch.uint8, copied)
            self.arena_seconds.append((total, time.perf_counter() - t0))
            with self._lock:
                self._reserved.update(_views(arena, placed))

    def _join(self) -> None:
        if self._reserving is not None:
            t0 = time.perf_counter()
            self._reserving.join()
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
        """Stop the set-up thread (compiling failed): it makes no more arenas; those made are given back."""
        with self._wake:
            self._cancelled = True
            self._wake.notify()
        self.release_unclaimed()

    def release_unclaimed(self) -> None:
        """Give back the reserved buffers nobody took (the schedule kept fewer host homes than reserved), and a
        prefaulted pool no reservation used."""
        self._stop_waiting()
        self._join()
        with self._lock:
            left, self._reserved = list(self._reserved.values()), {}
        for _, t in left:
            self.free(t)
        if self._layout is None or self._cancelled:
            self._pool = self._pool_map = None      # unmapped once no view holds it

    def zeros(self, numel: int, dtype: torch.dtype, copied: bool = True, key: tuple | None = None) -> torch.Tensor:
        """A zero host buffer; page-locked when this memory pins and `copied` (host<->device copies use it). With a
        key that was reserved (and matches), the reserved buffer."""
        if key is not None and self._layout is not None:
            self._join()
            with self._lock:
                spec, t = self._reserved.pop(key, (None, None))
            if spec is not None:
                if (spec.numel, spec.dtype, spec.copied) == (numel, dtype, copied):
                    self.taken += 1
                    return t
                self.free(t)
        return self._make(numel, dtype, copied)

    def _make(self, numel: int, dtype: torch.dtype, copied: bool) -> torch.Tensor:
        t = zeroed(numel, dtype, self._threads)
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
                warn(f"cudaHostRegister refused a {nbytes} B host buffer (cudaError {err}): it and any others "
                     "refused stay pageable, so their copies are slower", ResourceWarning)
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
        for t in getattr(self, "_registered", ()):
            torch.cuda.cudart().cudaHostUnregister(t.data_ptr())
