"""Comm: the collectives a sharded step issues, over one torch.distributed process group (NCCL on GPUs, gloo on CPU).

Every rank owns the same 1/world slice of every chunk buffer: elements [rank * s, (rank + 1) * s) for a chunk of
world * s elements (`shard`). Collectives work in place on a whole chunk slot, so they need no memory beyond it:
- `all_gather(slot)`: the rank's shard is in place; the ranks fill in the rest. Asynchronous: returns the work
  handle, which the slot's first use waits for (on CUDA the compute stream waits for NCCL's stream; nothing waits
  on the CPU). On CUDA it is issued inside the host->device stream, so NCCL starts after the shard's copy.
- `reduce_scatter(slot)`: the sum over ranks lands in the rank's shard, divided by world (data parallel: the
  gradient of the mean loss over the global batch). Also asynchronous.
- `all_reduce(t, op)`: small tensors at the commit point (fp16 overflow, the squared gradient norm) and the loss.
A rank that fails stops calling collectives; the others would wait for ever, so the process group is created (by
the user, or by `px.distributed.init`) with a timeout and the step turns a collective that times out into a
`px.DistributedError` naming the operation and chunk (see api).
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from ..errors import DistributedError


class Comm:
    def __init__(self, group=None):
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.world = dist.get_world_size(self.group)
        self.backend = dist.get_backend(self.group)

    def shard(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a flat chunk buffer."""
        s = t.numel() // self.world
        return t[self.rank * s:(self.rank + 1) * s]

    def span(self, numel: int) -> tuple[int, int]:
        """This rank's element range [lo, hi) of a chunk of numel elements."""
        s = numel // self.world
        return self.rank * s, (self.rank + 1) * s

    def all_gather(self, slot: torch.Tensor) -> "Work":
        with self._failing("all_gather"):
            return Work(dist.all_gather_into_tensor(slot, self.shard(slot), group=self.group, async_op=True), self)

    def reduce_scatter(self, slot: torch.Tensor) -> "Work":
        with self._failing("reduce_scatter"):
            return Work(dist.reduce_scatter_tensor(self.shard(slot), slot, op=dist.ReduceOp.SUM, group=self.group,
                                                   async_op=True), self)

    def all_reduce(self, t: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        with self._failing("all_reduce"):
            dist.all_reduce(t, op=op, group=self.group)
        return t

    @contextlib.contextmanager
    def _failing(self, what: str):
        """A collective that fails (gloo: the peer closed its connection; NCCL: a timeout or an aborted
        communicator) means another rank failed or exited: say so."""
        try:
            yield
        except RuntimeError as e:
            raise DistributedError(
                f"pstar-fx: a collective ({what}) failed on rank {self.rank} of {self.world}: another rank probably "
                f"failed or exited (its own error says why). The step's values are as they were before this step "
                f"unless it had committed. ({type(e).__name__}: {e})") from e

    def gather_full(self, shard: torch.Tensor, device: torch.device) -> torch.Tensor:
        """Every rank's shard of a flat buffer, concatenated in rank order, on the host (collective)."""
        dev = shard.device if self.backend != "nccl" else device
        full = torch.empty(shard.numel() * self.world, dtype=shard.dtype, device=dev)
        self.shard(full).copy_(shard)
        dist.all_gather_into_tensor(full, self.shard(full), group=self.group)
        return full.cpu()

    def check_same(self, value, what: str) -> None:
        """Raise DistributedError unless every rank holds the same value (a collective)."""
        mine = repr(value)
        every: list = [None] * self.world
        dist.all_gather_object(every, mine, group=self.group)
        differ = [r for r, v in enumerate(every) if v != mine]
        if differ:
            raise DistributedError(
                f"pstar-fx: rank {self.rank} and ranks {differ} disagree on {what}: every rank must call the step "
                "with batches of the same shapes and dtypes, and compile it with the same settings")


class Work:
    """A collective in flight; `wait()` orders what follows after it (CUDA: on the current stream)."""

    def __init__(self, work, comm: Comm):
        self.work = work
        self.comm = comm

    def wait(self) -> None:
        with self.comm._failing("waiting for a collective"):
            self.work.wait()


def default_comm(device: torch.device) -> Comm | None:
    """The default process group as a Comm when one of two or more ranks is initialised, else None. Its backend
    must suit the device: NCCL for CUDA, gloo for the CPU."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None
    comm = Comm()
    want = "nccl" if device.type == "cuda" else "gloo"
    if comm.backend != want:
        raise ValueError(f"pstar-fx: the default process group uses {comm.backend!r}, but the step runs on "
                         f"{device.type}: initialise it with backend={want!r} (torch.distributed.init_process_group)")
    return comm
