"""The operations pstar-fx inserts into a graph. Each is a real, named callable of the runtime, so the scheduled graph
prints (and runs) as the program it is: `fetch(chunk=3, buf=param)`, `optimizer_step(chunk=3)`.

Every one takes the runtime (`runtime.executor.Runtime`) as its first argument; the executor passes it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx as fx

from . import guards
from .graph import BufKind


def param_view(rt, *, param: str) -> torch.Tensor:
    """The parameter as a view into its chunk's device buffer (the chunk must be resident)."""
    return rt.param_view(param)


def write_grad(rt, grad: torch.Tensor, *, param: str, accumulate: bool = False, final: bool = True) -> None:
    """Copy a gradient into its chunk (the grad buffer, or the parameter's own slot when in place); `accumulate`
    adds it to what earlier micro-batches wrote; `final` marks the write after which the gradient is complete."""
    rt.write_grad(param, grad, accumulate, final)


_aten = torch.ops.aten
# a functional aten operation -> its out= overload (structured kernels: one implementation writes either output)
OUT_FORMS = {_aten.mm.default: _aten.mm.out, _aten.add.Tensor: _aten.add.out,
             _aten.sum.dim_IntList: _aten.sum.IntList_out}
FUNCTIONAL_OF = {out: op for op, out in OUT_FORMS.items()}


def compute_grad(rt, *args, op, shape: tuple[int, ...], param: str, accumulate: bool = False, final: bool = True,
                 **kwargs) -> None:
    """A first gradient write (`accumulate` is always False) with the operation that makes the gradient folded in
    (passes/grad_into.py): `op`, an aten out= overload, writes the gradient straight into its chunk range viewed as
    `shape` (its output's shape), where `write_grad` would copy a transient; `args` and `kwargs` are the
    operation's own."""
    assert not accumulate, "compute_grad writes a first micro-batch's gradient"
    rt.compute_grad(param, op, shape, args, kwargs, final)


def fetch(rt, *, chunk: int, buf: BufKind) -> None:
    """Bring a chunk buffer onto the device: host -> device copy into a free slot (buf=states: a streamed update's
    optimizer states, from their host home)."""
    rt.fetch(chunk, buf)


def all_gather(rt, *, chunk: int, buf: BufKind) -> None:
    """Multi-GPU fetch: this rank's shard of the chunk buffer goes host -> device into its place in a free slot,
    and the ranks gather the other shards into it (asynchronously; the slot's first use waits for it)."""
    rt.fetch(chunk, buf)


def reduce_scatter(rt, *, chunk: int) -> None:
    """Multi-GPU: the chunk's final gradient, summed over ranks and divided by their number, lands in this rank's
    shard of the gradient buffer (in place); only that shard is written home and stepped."""
    rt.reduce_scatter(chunk)


def alloc(rt, *, chunk: int, buf: BufKind) -> None:
    """Give a chunk buffer a zeroed device slot without copying (a gradient buffer before its first write)."""
    rt.alloc(chunk, buf)


def release(rt, *, chunk: int, buf: BufKind, writeback: bool) -> None:
    """Free a chunk buffer's device slot, first copying it to its host home when it was written on the device."""
    rt.release(chunk, buf, writeback)


def commit(rt) -> None:
    """The commit point. Every gradient is final: decide whether the step is skipped (fp16 overflow) and the clip
    coefficient (global norm). Nothing before it changes parameters or optimizer states; what follows applies the
    update and runs to the end (a KeyboardInterrupt is held until the step is complete)."""
    rt.commit()


def optimizer_step(rt, *, chunk: int, gather: bool = False) -> None:
    """Adam/AdamW on one whole flat chunk (with several ranks: this rank's shard of it), where the chunk's update site
    is: the device (its states there, or streamed into a resident slot) or the CPU worker; `gather` (several ranks, device-side states): all-gather the updated chunk, which stays resident."""
    rt.optimizer_step(chunk, gather)


def disk_read(rt, *, chunk: int, slot: int) -> None:
    """Issue the read of a disk-homed chunk's optimizer states from their file into host staging buffer `slot`
    (asynchronous: the chunk's update waits for it; the read waits for the slot's previous write to finish)."""
    rt.disk_read(chunk, slot)


def disk_write(rt, *, chunk: int, slot: int) -> None:
    """Write a disk-homed chunk's updated states from staging buffer `slot` back to their file, once its update is
    done (asynchronous: the slot's next read and the end of the step wait for it)."""
    rt.disk_write(chunk, slot)


def guard(rt, *values, spec: guards.GuardSpec) -> None:
    """Check a value the trace assumed (ir/guards.py): raise GuardFailed, before the commit point, when the real
    values decide otherwise; the step is then traced for what they decided and run again."""
    guards.check(spec, values)


@dataclass(frozen=True, eq=False)
class RegionSpec:
    """A fused region (passes/regions.py): the fx graph of the compute nodes it replaces, whose placeholders are the
    region's inputs in order and whose output is the tuple of its outputs; `workspace`: device bytes of the storages
    made and freed inside it (the plan's bound on what its compiled code holds beside its inputs and outputs)."""
    index: int                       # regions numbered in graph order
    gm: fx.GraphModule = field(repr=False)
    nodes: int                       # compute nodes it replaces
    workspace: int

    def __repr__(self) -> str:      # printed in the graph: region(..., spec=region 3 of 12 nodes)
        return f"region {self.index} of {self.nodes} nodes"


def region(rt, *inputs, spec: RegionSpec) -> tuple:
    """Run a fused region's compute nodes eagerly, as the graph it replaced ran them; the executor calls the
    region's compiled code instead (runtime/compiled_regions.py) and falls back to this where it could not compile."""
    return tuple(spec.gm(*inputs))


RUNTIME_OPS = (guard, param_view, write_grad, compute_grad, fetch, all_gather, alloc, release, reduce_scatter, commit,
               optimizer_step, disk_read, disk_write)
