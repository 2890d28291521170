"""The device pool: every byte pstar-fx places on the compute device, counted against the budget.

It hands out chunk-sized slots and permanent allocations (module buffers, device optimizer states, constants,
workspaces) and counts each byte: an allocation past the budget raises. It keeps no free list: a given-back buffer's
memory returns to torch's allocator at once, so what the pool counts is what it holds.
"""
from __future__ import annotations

import torch

from ..units import format_bytes


class PoolExhausted(RuntimeError):
    """An allocation would exceed the device budget: the plan and the run disagree (a bug in pstar-fx)."""


class DevicePool:
    def __init__(self, device: torch.device, budget: int | None):
        self.device = device
        self.budget = budget
        self.in_use = 0
        self.window_peak = 0           # highest in_use since the executor last sampled it
        self.storages: set[int] = set()   # data_ptrs of the buffers the pool has handed out and not taken back

    def take(self, numel: int, dtype: torch.dtype, what: str = "slot") -> torch.Tensor:
        """A new buffer, counted. It is allocated before it is counted: an allocation that fails (out of memory)
        leaves the count as it was."""
        nbytes = numel * dtype.itemsize
        if self.budget is not None and self.in_use + nbytes > self.budget:
            raise PoolExhausted(f"device pool: {what} of {format_bytes(nbytes)} would bring chunk memory to "
                                f"{format_bytes(self.in_use + nbytes)}, past the budget {format_bytes(self.budget)}")
        t = torch.empty(numel, dtype=dtype, device=self.device)
        self.in_use += nbytes
        self.window_peak = max(self.window_peak, self.in_use)
        self.storages.add(t.untyped_storage().data_ptr())
        return t

    def give(self, t: torch.Tensor) -> None:
        """Take a buffer back. The pool keeps no free list of its own: a cached slot would hold memory the budget no
        longer counts. The memory goes back to torch's allocator, whose CUDA cache hands the same block to the
        next slot of that size (no fragmentation while slots share a size)."""
        self.in_use -= t.numel() * t.dtype.itemsize
        self.storages.discard(t.untyped_storage().data_ptr())

    def sample(self) -> int:
        """The highest in_use since the last sample (then starts a new window)."""
        peak, self.window_peak = self.window_peak, self.in_use
        return peak

    def owns(self, t: torch.Tensor) -> bool:
        return t.untyped_storage().data_ptr() in self.storages

    def recount(self, held) -> None:
        """Make the count exactly the buffers `held` (every buffer taken and not given back), in place (the
        executor keeps a reference to `storages` during a step)."""
        held = list(held)
        self.in_use = sum(t.numel() * t.element_size() for t in held)
        self.window_peak = self.in_use
        self.storages.clear()
        self.storages.update(t.untyped_storage().data_ptr() for t in held)
