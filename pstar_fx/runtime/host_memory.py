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
pinning release the GIL), and `zeros(..., key=)` takes a reserved buffer instead of making one.
"""
from __future__ import annotations

import mmap
import threading
import time
import warnings
from dataclasses import dataclass

import torch

# below this size a buffer comes from torch's allocator
MAPPED_MIN_BYTES = 1 << 21
_PAGE = 4096         # reserved buffers start on a page of their own


def zeroed(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A zero host tensor whose pages are all present: an anonymous mapping (transparent huge pages where the
    kernel allows them) touched on torch's intra-op threads, or torch.zeros below MAPPED_MIN_BYTES. The mapping is
    unmapped when the tensor (which holds it) is freed."""
    nbytes = numel * dtype.itemsize
    if nbytes < MAPPED_MIN_BYTES:
        return torch.zeros(numel, dtype=dtype)
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            m.madvise(mmap.MADV_HUGEPAGE)
        except OSError:      # a kernel without transparent huge pages: 4 KiB pages, same values
            pass
    t = torch.frombuffer(m, dtype=dtype, count=numel)
    t.zero_()        # already zero: this faults every page in, on torch's threads, here rather than in a step
    return t


@dataclass(frozen=True)
class BufferSpec:
    """A host buffer to make: its key (what the ChunkStore asks for it by), size, dtype, and whether copies use it."""
    key: tuple
    numel: int
    dtype: torch.dtype
    copied: bool


class HostMemory:
    """Host buffers for one ChunkStore; `pin`: page-lock the buffers copies use (CUDA machines)."""

    def __init__(self, pin: bool):
        self.pin = pin
        self._registered: list[torch.Tensor] = []
        self.fallbacks: list[tuple[int, int]] = []   # (bytes, cudaError) of buffers cudaHostRegister refused
        self._reserved: dict[tuple, tuple[BufferSpec, torch.Tensor]] = {}
        self._reserving: threading.Thread | None = None
        self._reserve_error: BaseException | None = None
        self._lock = threading.Lock()
        self._cancelled = False
        self.taken = 0          # reserved buffers handed out by zeros(key=)
        self.arena_seconds: list[tuple[int, float]] = []   # (bytes, seconds) of each arena the reservation made
        self.waited = 0.0       # seconds callers spent waiting for the reservation

    def reserve(self, specs: list[BufferSpec]) -> None:
        """Start making these buffers on a thread of their own; zeros(key=) takes them (waiting for the thread).

        The thread makes two arenas, one for the buffers copies use (pinned once, as a whole) and one for the rest,
        each one mapping touched in one call, and hands out page-aligned views of them: it needs the GIL only a few
        times, so the schedule pass (pure Python) and it do not take turns (a buffer at a time, that cost more than
        the overlap saved). A view given back (free) returns no memory until its arena's last view goes; the
        reservation is what the store takes, so nothing is left over in practice."""
        assert self._reserving is None, "one reservation per HostMemory"

        def make():
            try:
                for copied in (True, False):
                    group = [sp for sp in specs if sp.copied == copied]
                    offsets, total = [], 0
                    for sp in group:
                        offsets.append(total)
                        total += -(-sp.numel * sp.dtype.itemsize // _PAGE) * _PAGE
                    if self._cancelled or not group:
                        continue
                    t0 = time.perf_counter()
                    arena = self._make(total, torch.uint8, copied)
                    self.arena_seconds.append((total, time.perf_counter() - t0))
                    views = {sp.key: (sp, arena[o:o + sp.numel * sp.dtype.itemsize].view(sp.dtype))
                             for sp, o in zip(group, offsets)}
                    with self._lock:
                        self._reserved.update(views)
            except BaseException as e:  # noqa: BLE001 - re-raised by the caller's next zeros()
                self._reserve_error = e

        self._reserving = threading.Thread(target=make, name="pstar-fx host set-up", daemon=True)
        self._reserving.start()

    def _join(self) -> None:
        if self._reserving is not None:
            t0 = time.perf_counter()
            self._reserving.join()
            self.waited += time.perf_counter() - t0
            if self._reserve_error is not None:
                e, self._reserve_error = self._reserve_error, None
                raise e

    def cancel(self) -> None:
        """Stop a reservation (compiling failed): the thread makes no more arenas; those made are given back."""
        self._cancelled = True
        self.release_unclaimed()

    def release_unclaimed(self) -> None:
        """Give back the reserved buffers nobody took (the schedule kept fewer host homes than reserved)."""
        self._join()
        with self._lock:
            left, self._reserved = list(self._reserved.values()), {}
        for _, t in left:
            self.free(t)

    def zeros(self, numel: int, dtype: torch.dtype, copied: bool = True, key: tuple | None = None) -> torch.Tensor:
        """A zero host buffer; page-locked when this memory pins and `copied` (host<->device copies use it). With a
        key that was reserved (and matches), the reserved buffer."""
        if key is not None and self._reserving is not None:
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
        t = zeroed(numel, dtype)
        if not self.pin or not copied or numel == 0:
            return t
        err = int(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), numel * dtype.itemsize, 0))
        if err != 0:
            # left pageable: its copies are slower, but torch's pinned allocator would round it up to a power of two
            # (up to twice the host memory the plan counted)
            if not self.fallbacks:
                warnings.warn(f"cudaHostRegister refused a {numel * dtype.itemsize} B host buffer (cudaError {err}): "
                              "it and any others refused stay pageable, so their copies are slower",
                              ResourceWarning, stacklevel=2)
            with self._lock:
                self.fallbacks.append((numel * dtype.itemsize, err))
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
            self._reserving.join()
        for t in getattr(self, "_registered", ()):
            torch.cuda.cudart().cudaHostUnregister(t.data_ptr())
