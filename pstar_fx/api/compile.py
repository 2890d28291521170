"""`px.compile`: the one decorator users apply."""
from __future__ import annotations

from typing import Callable

import torch.nn as nn

from ..optim import OptimizerSpec
from .evaluate import CompiledEval
from .step import CompiledStep


def compile(model: nn.Module, *, optimizer: OptimizerSpec | None, device_memory: int | str | None = None,
            precision: str | None = None, chunk_size: int | None = None, device=None, debug: bool = False,
            prefetch: int | None = None, max_grad_norm: float | None = None,
            accumulate: int = 1, remat="auto", atomic: bool = True,
            _device_updates: int | None = None, cache_size: int = 8, fuse: bool | None = None,
            _undo_updates: int | None = None, _loss_rows=None, _loss_block_bytes: int | None = None,
            host_memory: int | str | None = None, offload_dir=None,
            disk_memory: int | str | None = None) -> Callable[[Callable], CompiledStep]:
    """Compile `step(model, *batch) -> loss` into one training step that fits `device_memory`.

    Use as a decorator: `@px.compile(model, optimizer=px.AdamW(lr=3e-4))` over `def step(model, x, y): ...`;
    then `loss = step(x, y)` runs forward, backward and the optimizer update. With `optimizer=None` the function
    is compiled forward only (evaluation: no backward, no update) and returns what it returns; it reads the chunks
    of a training step compiled on the same model. See docs/api.md for every argument and docs/design.md for the
    contract.
    `remat="auto"` recomputes forward activations in backward where the budget needs it (see passes/remat);
    `remat=False` never does.
    `prefetch=None` issues each fetch as early as the budget allows (N: at most N nodes before its use; 0: at it).
    `atomic=False` lets the CPU start updating a chunk whose optimizer states live on the host as soon as the step
    has finished with the chunk, during backward, instead of after the last gradient (the commit): faster when the
    CPU's updates would otherwise delay the next forward. The cost: a step that fails after its first such update
    raises px.CommitError and leaves the values half-updated (load a checkpoint to continue). Only where the commit
    decides nothing the updates need (no max_grad_norm, not fp16; otherwise it changes nothing). With several
    ranks each rank's shard updates right after its chunk's reduce-scatter.
    `_device_updates` (private, for tests): stream this many chunks the CPU would update to the device and update
    them there (the first in the CPU's order, with atomic=False every other one first; more than there are: all)
    instead of the cost model's choice. `_undo_updates` (private, for tests): in an atomic step, update this many of
    the chunks the CPU would update (the last in its order) before the commit, their previous values kept in undo
    buffers (0: none) instead of the cost model's choice. `_loss_rows` (private, for tests): when large
    cross-entropy losses are computed in blocks of rows, a `LossRows` (passes/loss_rows), and `_loss_block_bytes` the
    fp32 bytes of a block, instead of the defaults (where the step would not fit otherwise; 256 MiB).
    `cache_size` compiled batch signatures are kept (least recently used dropped); `step.reserve(*batch)` compiles
    one up front and keeps it.
    `fuse=True` compiles the compute between chunk operations: each maximal run of compute nodes between two chunk
    moves becomes one region, compiled by Inductor (passes/regions.py; random ops such as dropout and in-place
    writes stay eager). Compiling takes seconds per distinct region on a first run and is cached across processes;
    `fuse=None` takes the default for the device type and precision (api/options.py DEFAULT_FUSE: for bf16 and fp16
    on CUDA with one rank where Triton is installed, fused where the cost model estimates the step no slower so,
    passes/regions.py fuse_if_faster; unfused otherwise). Training steps only.
    `host_memory` bounds what pstar-fx keeps in host memory (None: the host's memory less a margin, or with a disk
    tier what it has available at compile time less that margin), per node: each of several ranks gets its
    share; `offload_dir`, a directory on a local disk, gives a third home to the optimizer states that do not fit
    it, up to `disk_memory` bytes per rank (None: the free space there), each rank in files of its own. See
    docs/memory.md, "The disk tier".
    """
    for name, value in (("_device_updates", _device_updates), ("_undo_updates", _undo_updates)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            raise ValueError(f"{name} must be a number of chunks >= 0 (or None), got {value!r}")
    def wrap(fn: Callable) -> CompiledStep:
        if optimizer is None:
            if (max_grad_norm is not None or accumulate != 1 or not atomic or _device_updates is not None or fuse
                    or _undo_updates is not None):
                raise ValueError("max_grad_norm, accumulate, atomic and fuse belong to training steps; a "
                                 "forward-only function (optimizer=None) takes none of them")
            if host_memory is not None or offload_dir is not None or disk_memory is not None:
                raise ValueError("host_memory, offload_dir and disk_memory place optimizer states; a forward-only "
                                 "function (optimizer=None) has none: leave them None")
            return CompiledEval(fn, model, device_memory=device_memory, precision=precision, chunk_size=chunk_size,
                                device=device, debug=debug, prefetch=prefetch, cache_size=cache_size)
        return CompiledStep(fn, model, optimizer, device_memory=device_memory, precision=precision,
                            chunk_size=chunk_size, device=device, debug=debug, prefetch=prefetch,
                            max_grad_norm=max_grad_norm, accumulate=accumulate, remat=remat, atomic=atomic,
                            device_updates=_device_updates, undo_updates=_undo_updates, cache_size=cache_size,
                            fuse=fuse, loss_rows=_loss_rows, loss_block_bytes=_loss_block_bytes,
                            host_memory=host_memory, offload_dir=offload_dir, disk_memory=disk_memory)
    return wrap
