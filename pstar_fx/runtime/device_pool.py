"""The device pool: every byte pstar-fx places on the compute device, counted against the budget.

It hands out chunk-sized slots and permanent allocations (module buffers, device optimizer states, constants,
workspaces) and counts each byte: an allocation past the budget raises.

A given-back buffer is kept in a free list by size (`cached`) and handed out again to the next request of that size.
The free list holds memory the plan does not count, so its holder bounds it (`trim`), and it is emptied whenever the
chunks leave the device. Off CUDA (the CPU) the executor keeps up to each node's room under the plan's peak there,
so host buffers are not faulted in anew at every fetch. On CUDA it keeps only the buffer the next node takes (`caches`
False): every other given-back slot goes back to torch's caching allocator before the next node. The plan's room at
a node is then torch's to use beside the 2 GiB left for it (slots still being written back stay counted until the
room needs them, ChunkStore.reclaim): near a full device, whenever no free block holds a request and no page can be
mapped, torch frees its whole cache and retries (a device synchronisation), and slots held in the free list made that
more frequent. benchmarks/alloc_sim.py replays a step's allocations through a model of torch's allocator: with them
9-12 retries a step at a 10.34B GPT's atomic step on an H100 (10-13 measured), 8-11 at its `atomic=False` step (9-11
measured), 18-20 at the 17.26B GPT's on an H200; without them 5-6, 3-5 and 14-15 (7-8, 4-7 and 15-16 measured).
`in_use` is what the plan counts: the buffers handed out and not given back.

On a CPU device with one rank the device's memory is the host's, and a chunk's slot can be its host home itself
(ChunkStore): such a buffer is lent to the pool (`lend`, `unlend`): counted like a slot, never allocated, freed or
free-listed.
"""
from __future__ import annotations

from typing import Callable

import torch

from ..units import format_bytes

What = str | Callable[[], str]   # what a buffer is for, in an error's text (a callable: formatted only then)


def _text(what: What) -> str:
    return what if isinstance(what, str) else what()


class PoolExhausted(RuntimeError):
    """An allocation would exceed the device budget: the plan and the run disagree (a bug in pstar-fx)."""


class DevicePool:
    def __init__(self, device: torch.device, budget: int | None):
        self.device = device
        self.budget = budget
        self.in_use = 0
        self.window_peak = 0           # highest in_use since the executor last sampled it
        # data_ptrs of the storages of the buffers handed out or lent and not taken back (a lent host home's storage
        # may be an arena that holds other host buffers too: `owns` is then true of all of them)
        self.storages: set[int] = set()
        self.free: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}   # given back, by (numel, dtype)
        self.cached = 0                # bytes in `free`
        self.lent: dict[int, int] = {}   # storage data_ptr -> buffers lent on it (host homes share a storage)
        # whether given-back buffers stay free-listed beyond the next node (up to its room): not on CUDA, where the
        # room is the caching allocator's to use (see the module docstring)
        self.caches = device.type != "cuda"

    def take(self, numel: int, dtype: torch.dtype, what: What = "slot") -> torch.Tensor:
        """A new buffer, counted. It is allocated before it is counted: an allocation that fails (out of memory)
        leaves the count as it was."""
        nbytes = numel * dtype.itemsize
        self._check(nbytes, what)
        free = self.free.get((numel, dtype))
        if free:
            t = free.pop()
            if not free:
                del self.free[(numel, dtype)]
            self.cached -= nbytes
        else:
            if self.budget is not None and self.in_use + self.cached + nbytes > self.budget:
                self.trim(self.budget - self.in_use - nbytes)   # what the pool holds stays within the budget
            with torch.profiler.record_function(f"pstar-fx pool allocates {_text(what)}"):   # for a profiler's trace
                t = torch.empty(numel, dtype=dtype, device=self.device)
        self._count(nbytes)
        self.storages.add(t.untyped_storage().data_ptr())
        return t

    def _check(self, nbytes: int, what: What) -> None:
        if self.budget is not None and self.in_use + nbytes > self.budget:
            raise PoolExhausted(f"device pool: {_text(what)} of {format_bytes(nbytes)} would bring chunk memory to "
                                f"{format_bytes(self.in_use + nbytes)}, past the budget {format_bytes(self.budget)}")

    def _count(self, nbytes: int) -> None:
        self.in_use += nbytes
        self.window_peak = max(self.window_peak, self.in_use)

    def lend(self, t: torch.Tensor, what: What = "slot") -> None:
        """Count a buffer the pool did not allocate (a chunk's host home standing in for its slot) as a slot taken:
        against the budget, and as the pool's storage (so the executor does not count views of it as activations)."""
        nbytes = t.numel() * t.element_size()
        self._check(nbytes, what)
        self._count(nbytes)
        self._hold_lent(t)

    def _hold_lent(self, t: torch.Tensor) -> None:
        """One more lent buffer on t's storage, which the pool then owns."""
        ptr = t.untyped_storage().data_ptr()
        self.lent[ptr] = self.lent.get(ptr, 0) + 1
        self.storages.add(ptr)

    def unlend(self, t: torch.Tensor) -> None:
        """Stop counting a buffer `lend` counted (nothing is freed)."""
        self.in_use -= t.numel() * t.element_size()
        ptr = t.untyped_storage().data_ptr()
        self.lent[ptr] -= 1
        if not self.lent[ptr]:
            del self.lent[ptr]
            self.storages.discard(ptr)

    def give(self, t: torch.Tensor) -> None:
        """Take a buffer back (a whole buffer `take` returned) into the free list. On CUDA it is reused in the
        order of the stream that takes it next, as torch's allocator would reuse it: the store's copies into a slot
        wait for the compute stream first, and slots still being written back come here only once the compute stream
        has waited for their copies."""
        nbytes = t.numel() * t.dtype.itemsize
        self.in_use -= nbytes
        self.storages.discard(t.untyped_storage().data_ptr())
        self.free.setdefault((t.numel(), t.dtype), []).append(t if t.dim() == 1 else t.view(-1))
        self.cached += nbytes

    def trim(self, keep: int = 0, spare: tuple[int, torch.dtype] | None = None) -> None:
        """Give free-listed buffers back to torch until at most `keep` bytes stay cached, the sizes with the most
        bytes cached first; one buffer of size `spare` (numel, dtype), the one about to be taken, stays."""
        while self.cached > max(keep, 0):
            sizes = [k for k, ts in self.free.items() if k != spare or len(ts) > 1]
            if not sizes:
                return
            key = max(sizes, key=lambda k: len(self.free[k]) * k[0] * k[1].itemsize)
            t = self.free[key].pop()
            if not self.free[key]:
                del self.free[key]
            self.cached -= t.numel() * t.dtype.itemsize

    def sample(self) -> int:
        """The highest in_use since the last sample (then starts a new window)."""
        peak, self.window_peak = self.window_peak, self.in_use
        return peak

    def owns(self, t: torch.Tensor) -> bool:
        return t.untyped_storage().data_ptr() in self.storages

    def recount(self, held, lent=()) -> None:
        """Make the count exactly the buffers `held` (every buffer taken and not given back) and `lent` (every one
        lent and not taken back), in place (the executor keeps a reference to `storages` during a step)."""
        held, lent = list(held), list(lent)
        self.in_use = sum(t.numel() * t.element_size() for t in held + lent)
        self.window_peak = self.in_use
        self.storages.clear()
        self.storages.update(t.untyped_storage().data_ptr() for t in held)
        self.lent.clear()
        for t in lent:
            self._hold_lent(t)
