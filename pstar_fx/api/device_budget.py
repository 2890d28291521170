"""The default device budget (`device_memory=None`): what the device can give pstar-fx's own tensors, with room left
for what the process needs beside them.

A compiled step's plan counts every tensor it places (chunk buffers, optimizer states, activations, workspace), but
the process needs device memory the plan does not see:
- the CUDA context and the cuBLAS / cuBLASLt workspaces: made before the free memory is read (a small matmul in each
  compute dtype), so the free memory already excludes them;
- the kernels loaded lazily the first time each one runs (CUDA's lazy module loading): hundreds of MiB for a
  transformer's step, outside torch's allocator (`KERNELS`);
- the caching allocator's rounding and fragmentation: with `expandable_segments:True` a segment grows in 2 MiB pages
  and the waste is small (`ALLOCATOR_EXPANDABLE`); with the default segments, a freed block serves only requests that
  fit in it, and a plan that fills the device leaves blocks too small to reuse (`ALLOCATOR_SEGMENTS`, a share of the
  device);
- NCCL's buffers, made at a communicator's first collective, with two or more ranks (`NCCL`).
The figures behind these allowances are in docs/memory.md ("The default budget"). An explicit `device_memory` is taken
as given: the user then owns the headroom.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ..units import format_bytes

MiB, GiB = 1 << 20, 1 << 30

# Measured on one H200 (docs/memory.md): the process held 0.70 GiB outside torch's allocator when the budget was read
# and 0.78-0.83 GiB after 17B GPT and 13B Llama steps. Under expandable segments, plans of 137.6 GiB trained both,
# with the allocator reserving up to 1.4 GiB beyond its live tensors, but it retried (freeing its cache, the device
# idle) 52 times a step on the GPT, which then took 7.76 s against 6.25 s at 137 GiB (17-27 retries): 2 GiB keeps
# the retries down. Under fixed segments the fragments grew with the room: plans of 135.3, 133.0 and 125.8 GiB ran
# out of memory with 3.7, 5.9 and 14 GiB reserved beyond the live tensors, so no share is safe there (a warning).
KERNELS = 512 * MiB               # lazily loaded kernel images of a large transformer step
ALLOCATOR_EXPANDABLE = 2 * GiB    # rounding to 2 MiB pages and blocks freed but not yet given back
ALLOCATOR_SEGMENTS = 0.10         # of the device's total memory, with fixed-size segments (not enough: see above)
NCCL = 1 * GiB                    # communicator buffers, several ranks


@dataclass(frozen=True)
class DefaultBudget:
    """How `device_memory=None` was resolved on a GPU: the budget and what was left beside it."""
    free: int                # bytes torch could still allocate: the driver's free memory and torch's cached blocks
    kernels: int
    allocator: int
    nccl: int

    @property
    def budget(self) -> int:
        return max(0, self.free - self.kernels - self.allocator - self.nccl)

    def __str__(self) -> str:
        parts = [f"{format_bytes(self.kernels)} for kernels", f"{format_bytes(self.allocator)} for the allocator"]
        if self.nccl:
            parts.append(f"{format_bytes(self.nccl)} for NCCL")
        text = f"{format_bytes(self.budget)} = {format_bytes(self.free)} free - " + " - ".join(parts)
        if self.allocator > ALLOCATOR_EXPANDABLE:
            text += (f" (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, set before the process starts, would "
                     f"leave {format_bytes(self.allocator - ALLOCATOR_EXPANDABLE)} more)")
        return text


def expandable_segments() -> bool:
    """Whether torch's CUDA allocator was configured with expandable segments (PYTORCH_CUDA_ALLOC_CONF)."""
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") or os.environ.get("PYTORCH_ALLOC_CONF", "")
    return any(item.strip().replace(" ", "") == "expandable_segments:True" for item in conf.split(","))


def _warm_up(device: torch.device) -> None:
    """Create the cuBLAS and cuBLASLt handles and workspaces of the current stream, as the step's first matmuls
    would: they stay allocated for the life of the process."""
    with torch.cuda.device(device):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            a = torch.ones(64, 64, device=device, dtype=dtype)
            (a @ a).sum().item()
            torch.addmm(a, a, a).sum().item()
        torch.cuda.synchronize(device)


def default_cuda_budget(device: torch.device, world: int) -> DefaultBudget:
    """The default budget on a CUDA device (see the module's docstring)."""
    _warm_up(device)
    free_driver, total = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    allocator = ALLOCATOR_EXPANDABLE if expandable_segments() else int(ALLOCATOR_SEGMENTS * total)
    return DefaultBudget(free=free_driver + cached, kernels=KERNELS, allocator=allocator,
                         nccl=NCCL if world > 1 else 0)


def default_cpu_budget() -> int:
    """On the CPU the device is the host: its available physical memory."""
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
