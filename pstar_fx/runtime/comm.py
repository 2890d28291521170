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
the user, torch.distributed.init_process_group) with a timeout and the step turns a collective that times out into a
`px.DistributedError` naming the operation and chunk (see api).

Control messages (what the ranks must agree on before a step's collectives, see pstar_fx.api.agreement) go over a
CPU-side gloo group of the same ranks (`control`), made once per process group, collectively, with its first Comm
and shared by the later ones: on NCCL, reading a GPU
collective's result on the CPU would wait for everything queued on the GPU before it, at the start of every step.
`agree(digest)` compares a 64-bit digest across the ranks in one all-reduce of 16 bytes; `gather_objects` (a
second round, only where they disagree) collects what each rank has, to name the difference. `agree_on(call, ...)`
is that pair of rounds for a collective function of the API (a training step, an evaluation, step.save, step.load,
step.state_dict(), px.compile, and, where they run collectives, step.load_state_dict(), sync_model() and
step.optimizer's state_dict() and load_state_dict(), the two loads with a digest of what they load): the function's
name is in the digest and in what is gathered, so ranks in different functions, whose first control messages pair
with each other, all raise the same DistributedError naming the functions, before any collective of either could
pair with the other's. A collective that fails (another rank failed, exited, or never came) raises DistributedError
naming what this rank was doing, with what that means for the step or checkpoint.

A Comm holds its process groups by weak reference, so `torch.distributed.destroy_process_group()` ends them, and
gloo's threads, where the user calls it, even while a compiled step is alive (a step is often kept alive by
reference cycles until the interpreter shuts down). A gloo group kept alive past it is torn down during interpreter
shutdown instead, which at times aborts the process after its work is done ("terminate called without an active
exception", SIGABRT: 9 of 40 two-rank launches on a loaded 2-core machine, none with the group ended at
destroy_process_group). A collective after the group was destroyed raises DistributedError.
"""
from __future__ import annotations

import contextlib
import datetime
import hashlib
import os
import re
import weakref
from typing import Callable

import torch
import torch.distributed as dist

from ..errors import DistributedError

CALLED = "the function called"     # the key of the collective function a rank is in, in what `agree_on` gathers
# what a failed collective leaves, said after what failed
AFTER_STEP = ("The step's values are as they were before this step unless it had committed (or, with atomic=False, "
              "begun its updates: then a CommitError says so).")


class Comm:
    def __init__(self, group=None):
        group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.backend = dist.get_backend(group)
        control = _control_group(group, self.backend)
        self._group = weakref.ref(group)
        self._control = weakref.ref(control)

    @property
    def group(self):
        """The process group the step's collectives run on (NCCL on GPUs, gloo on the CPU)."""
        return self._live(self._group)

    @property
    def control(self):
        """The CPU-side gloo group of the same ranks, for control messages (see the module docstring)."""
        return self._live(self._control)

    def _live(self, ref):
        group = ref()
        if group is None:
            raise DistributedError(f"pstar-fx: rank {self.rank}: the process group this step was compiled with was "
                                   "destroyed (torch.distributed.destroy_process_group): compile the step again "
                                   "after init_process_group")
        return group

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

    def broadcast(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        """t, in place, becomes rank `src`'s t on every rank."""
        with self._failing("broadcast"):
            group = self.group
            dist.broadcast(t, src=dist.get_global_rank(group, src), group=group)
        return t

    def all_reduce(self, t: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        with self._failing("all_reduce"):
            dist.all_reduce(t, op=op, group=self.group)
        return t

    def wait(self, t: torch.Tensor, what: str) -> None:
        """Wait until the collective that wrote `t` has ended (NCCL returns from one once it is queued on the
        device; gloo's have ended on return)."""
        if t.device.type == "cuda":
            with self._failing(what):
                t.cpu()

    @contextlib.contextmanager
    def _failing(self, what: str, after: str = AFTER_STEP):
        """A collective that fails (gloo: the peer closed its connection; NCCL: a timeout or an aborted
        communicator) means another rank failed or exited: say so, and (`after`) what that leaves."""
        try:
            yield
        except RuntimeError as e:
            raise self.failure(what, e, after) from e

    def failure(self, what: str, e: BaseException, after: str = AFTER_STEP) -> DistributedError:
        """The DistributedError for a collective that failed with `e` while this rank was doing `what`."""
        return DistributedError(
            f"pstar-fx: a collective ({what}) failed on rank {self.rank} of {self.world}: another rank probably "
            f"failed or exited (its own error says why). {after} ({type(e).__name__}: {e})")

    def gather_full(self, shard: torch.Tensor, device: torch.device) -> torch.Tensor:
        """Every rank's shard of a flat buffer, concatenated in rank order, on the host (collective)."""
        dev = shard.device if self.backend != "nccl" else device
        full = torch.empty(shard.numel() * self.world, dtype=shard.dtype, device=dev)
        self.shard(full).copy_(shard)
        with self._failing("gathering a chunk's shards"):
            dist.all_gather_into_tensor(full, self.shard(full), group=self.group)
        return full.cpu()

    def agree(self, digest: int, what: str = "comparing what the ranks must agree on", after: str = AFTER_STEP
              ) -> bool:
        """Whether every rank passed the same 64-bit digest (a collective on the control group: one all-reduce of
        two int64, the largest digest and the largest complement, which equal the smallest's complement)."""
        t = torch.tensor([digest, ~digest], dtype=torch.int64)
        with self._failing(what, after):
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.control)
        return int(t[0]) == ~int(t[1])

    def smallest(self, values: list[int]) -> list[int]:
        """Each of `values` (int64s) at its smallest over the ranks (a collective on the control group: one
        all-reduce), for settings every rank must take the same where each rank measured its own."""
        t = torch.tensor(values, dtype=torch.int64)
        with self._failing("agreeing on the smallest of each rank's settings"):
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control)
        return [int(v) for v in t]

    def gather_objects(self, obj, what: str = "gathering what the ranks disagree on", after: str = AFTER_STEP
                       ) -> list:
        """Every rank's `obj` (picklable), in rank order (a collective on the control group)."""
        every: list = [None] * self.world
        with self._failing(what, after):
            dist.all_gather_object(every, obj, group=self.control)
        return every

    def broadcast_object(self, obj, what: str, after: str = AFTER_STEP):
        """Rank 0's `obj` (picklable) on every rank (a collective on the control group)."""
        box = [obj]
        with self._failing(what, after):
            dist.broadcast_object_list(box, src=dist.get_global_rank(self.control, 0), group=self.control)
        return box[0]

    def agree_on(self, call: str, parts=(), describe: Callable[[], dict] | None = None, after: str = AFTER_STEP
                 ) -> list[dict] | None:
        """Whether every rank is in the same collective function of the API (`call`: "the training step",
        "step.save", ...) with the same `parts` (anything `digest64` takes): one `agree` on the control group. None
        where they agree; else every rank's description (a second round: `describe()`, a dict of what the rank
        has, with its `call` under CALLED), in rank order, for the caller to name what differs. Where the ranks are
        in different functions, raises DistributedError on every rank naming them instead: every function of the
        API that is a collective comes to the control group first through here, so the first control messages of
        two ranks in different functions pair with each other, and each finds out. `after`: what a failed
        collective leaves (see `failure`)."""
        if self.agree(digest64(call, parts), f"{call}: comparing what the ranks must agree on", after):
            return None
        every = self.gather_objects({CALLED: call, **(describe() if describe is not None else {})},
                                    f"{call}: gathering what the ranks disagree on", after)
        calls: dict[str, list[int]] = {}
        for r, d in enumerate(every):
            calls.setdefault(d.get(CALLED, "?"), []).append(r)
        if len(calls) > 1:
            called = "; ".join(f"{'rank' if len(rs) == 1 else 'ranks'} {', '.join(map(str, rs))}: {c}"
                               for c, rs in calls.items())
            raise DistributedError(
                f"pstar-fx: the ranks called different functions ({called}), so their collectives would pair "
                "with each other's. Every rank must call the same compiled functions (training steps and "
                "evaluations alike) and step.save, step.load, step.state_dict(), step.load_state_dict(), "
                "sync_model(), step.optimizer.state_dict() and step.optimizer.load_state_dict() in the same order: "
                "each is a collective. None of these calls ran: the step's values, the model and the checkpoints "
                "are as they were.")
        return every


@contextlib.contextmanager
def collective_call(comm: Comm | None, call: str, after: str, arguments: dict | None = None, check: bool = True):
    """A collective function of the API (`call`: "step.save", ...) run inside: with several ranks, first (`check`)
    every rank is checked to be in it too, with the same `arguments` (name -> value; `Comm.agree_on`), then a
    collective that fails inside it, a torch.distributed one included, raises DistributedError naming the call and
    (`after`) what that leaves. Nothing with one rank (comm None)."""
    if comm is None:
        yield
        return
    args = {k: repr(v) for k, v in (arguments or {}).items()}
    every = comm.agree_on(call, sorted(args.items()), lambda: args, after=after) if check else None
    if every is not None:
        differ = ", ".join(f"{k} ({'; '.join(f'rank {r}: {d.get(k)}' for r, d in enumerate(every))})"
                           for k in args if len({d.get(k) for d in every}) > 1)
        raise DistributedError(f"pstar-fx: the ranks called {call} with different arguments: {differ}. Call it "
                               "alike on every rank. Nothing ran.")
    try:
        yield
    except RuntimeError as e:
        if not raised_by_collective(e):
            raise
        raise comm.failure(call, e, after) from e


def raised_by_collective(e: BaseException) -> bool:
    """A DistributedError, or an exception raised by a torch.distributed collective (its innermost Python frame is
    in torch's distributed_c10d.py: gloo reports a peer that closed its connection, or a timeout, as a plain
    RuntimeError)."""
    if isinstance(e, DistributedError):
        return True
    tb = e.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and os.path.basename(tb.tb_frame.f_code.co_filename) == "distributed_c10d.py"


# a process group -> its control group, made by the first Comm over it and shared by every later one (each group
# keeps threads and sockets until destroy_process_group): keyed weakly, so destroying the group ends the entry
_CONTROL_GROUPS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _control_group(group, backend: str):
    """The CPU-side gloo group of `group`'s ranks (see the module docstring). Making one is a collective: every rank
    makes its Comms in the same order (every rank compiles its steps), so every rank makes it at the same one."""
    ref = _CONTROL_GROUPS.get(group)
    control = None if ref is None else ref()
    if control is None:
        control = dist.new_group(ranks=None if group is dist.group.WORLD else dist.get_process_group_ranks(group),
                                 backend="gloo", timeout=_timeout(group, backend))
        _CONTROL_GROUPS[group] = weakref.ref(control)
    return control


def digest64(*parts) -> int:
    """A 64-bit digest (a signed int64) of the parts' reprs, the same in every process: object addresses
    ("<Foo object at 0x7f...>") are left out, and nothing depends on Python's per-process hash seed."""
    text = re.sub(r" at 0x[0-9a-fA-F]+", "", repr(parts))
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little", signed=True)


def _timeout(group, backend: str) -> datetime.timedelta | None:
    """The collective timeout the group was made with, for the control group to share (torch keeps it on the
    backend's options; None, torch's default, where this torch version keeps it elsewhere)."""
    try:
        return group._get_backend(torch.device("cuda" if backend == "nccl" else "cpu")).options._timeout
    except (AttributeError, RuntimeError, TypeError):
        return None


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
