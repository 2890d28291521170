"""ChunkStore: where every chunk buffer and optimizer state lives, and how chunk buffers move between host and device.

Its jobs, one module each: the device pool counts every device byte against the budget (device_pool.py); host memory
is made and pinned ahead of time (host_memory.py); host-side optimizer updates run on a worker thread
(host_updates.py); values go in and out by name (store_values.py, `store.values`). This module keeps the buffers
themselves, their residency and the copies between host and device, ordered with events.

The host side holds each chunk's home copy of its parameters (pinned on CUDA machines: pageable copies are much
slower), gradient homes made at set-up for host-stepped chunks and on first write-back for the others, and the
optimizer states placed on the host (pageable where only the CPU touches them, pinned where the plan streams them to
the device for their update); see host_memory.py for how they are made.

On CUDA, copies run on two streams of their own, host->device (H2D) and device->host (D2H), ordered with events only
(no device-wide synchronize; the CPU waits only before it touches a host buffer a copy still reads or writes):
- fetch: the slot is allocated in the compute stream's order, so the H2D stream first waits for the compute stream
  to reach the fetch (the block may have been an activation until then), copies, and records an event; the compute
  stream waits for that event just before the slot's first use (`slot(key)`), not at the fetch.
- release with write-back: the D2H stream waits for an event recorded on the compute stream at the release (the
  buffer's last write), copies, and records an event that the CPU waits for before it reads or writes that host
  buffer (`before_host_write`), and the H2D stream waits for before it fetches that buffer again.

Residency across steps: the plan is a cycle, so parameter buffers stay in their slots from one step to the next
(`enter` brings in the set a plan starts from: the prologue before the first step, or after a retrace). A slot
written on the device (`mark_written`) makes its host home stale until it is written back. Everything that reads or
replaces host homes goes through one place: `flush` (write stale parameter slots home, wait for every copy; the
slots stay resident) and `evict_all` (flush, then give every slot back); `set_homes` and every reader and writer of
values (store_values.py) call them, so readers never see a stale host value.

Multi-GPU (`comm`, see comm.py): each rank's host homes, optimizer states and fp32 masters hold its shard of every
chunk only; a device slot holds the whole chunk. A parameter fetch copies the shard into its place in the slot and
all-gathers the rest (the collective's work handle is what the slot's first use waits for); a write-back writes the
shard home. A gradient is written home whole before its reduce-scatter (accumulation evicting it mid-step) and as a
shard after it (`reduced`). Collectives are issued in graph order by the executor's thread only, never by the host
worker, so every rank issues them in the same order: a fetch that hangs on a pending host-side update waits for it.

On a CPU device of one rank (`host_is_device`, Settings.host_is_device) device memory is host memory: a parameter or
gradient slot is its host home itself, lent to the pool (`DevicePool.lend`: counted as the plan counts it), so
fetches and write-backs copy nothing. That is safe by the plan's invariants: before the commit no parameter slot is
written but by in-place gradients (rebuilt from the masters on a rollback), and only a chunk's host-side update
touches its host buffers, which runs inline there (a worker thread would only take the step's own cores), so none is
pending at a fetch. Streamed states and parameters rounded from a master are copied.

Host-side optimizer updates run on a worker thread (`updates`, see host_updates.py) while the executor goes on. A
fetch of a chunk whose update is pending is issued by the worker right after that update (`then`), and the slot's
first use waits for exactly it; a CPU access to host buffers (`before_host_write`, hence flush) first waits for the
pending updates of the chunks it touches.
"""
from __future__ import annotations

from collections import deque
from concurrent.futures import Future

import torch

from ..ir.graph import BufKind, ChunkGroup, ChunkInfo, ParamHome, ParamInfo, Precision, StateHome
from ..ir.needs import STAGING_SLOTS, BufKey, shard_numel, state_floats
from ..optim import NO_STATE, StateLayout
from .comm import Comm
from .device_pool import DevicePool
from .disk import DiskStates
from .host_memory import HostMemory
from .host_updates import HostUpdates, worker_threads
from .store_values import StoreValues
from .undo import UndoBuffers


class ChunkStore:
    """Chunk buffers on host and device, optimizer states, and module buffers, for one compiled model."""

    def __init__(self, chunks: tuple[ChunkInfo, ...], params: tuple[ParamInfo, ...], precision: Precision,
                 device: torch.device, budget: int | None, comm: Comm | None = None,
                 hostmem: HostMemory | None = None, state: StateLayout = NO_STATE, offload_dir: str | None = None,
                 host_is_device: bool = False):
        """hostmem: host memory with buffers already reserved (host_buffers.host_buffer_specs), or None to make them
        here. state: the optimizer's chunk state layout (NO_STATE without an optimizer: no trainable chunk).
        offload_dir: where the disk tier's files go (a directory of the store's own is made there when a plan
        first puts states on disk). host_is_device: a CPU device of one rank, whose slots are host homes."""
        self.comm = comm
        self.offload_dir = offload_dir
        self.disk: DiskStates | None = None
        self._opened: dict[int, bool] = {}     # disk chunks whose states are read into memory outside a step -> dirty
        self._transient: int | None = None     # an opened disk chunk no one holds views of: closed when another opens
        self._staged: dict[int, int] = {}      # disk chunk -> staging buffer, from its read to its write (a step)
        self._disk_reads: dict[int, Future] = {}
        self._disk_writes: list[Future] = []
        self._update_done: dict[int, Future] = {}   # a disk chunk's update submitted to the worker
        self.world = 1 if comm is None else comm.world
        self.chunks = chunks
        self.params = {p.name: p for p in params}
        self.precision = precision
        self.state_layout = state
        self.device = device
        self.pool = DevicePool(device, budget)
        self.pin = device.type == "cuda"
        self.host_is_device = host_is_device
        assert not host_is_device or (device.type == "cpu" and self.world == 1), (device, self.world)
        self.lent: set[BufKey] = set()    # resident slots that are their host homes (alias)
        # parameter views of resident slots (param_view): per buffer, (its slot, {start: view}); dropped when the slot
        # leaves (no view keeps a slot's memory), except a lent host home's, kept across steps (dropped where set_homes
        # replaces the home)
        self._views: dict[BufKey, tuple[torch.Tensor, dict[int, torch.Tensor]]] = {}
        self.hostmem = hostmem if hostmem is not None else HostMemory(self.pin)
        # a chunk whose parameters are cast from its device master (ParamHome.MASTER) has no host home
        self.host_param: list[torch.Tensor | None] = [
            self.hostmem.zeros(shard_numel(c, self.world), c.dtype, key=("param", c.id))
            if c.param_home is ParamHome.HOST else None for c in chunks]
        self.host_grad: list[torch.Tensor | None] = [None] * len(chunks)        # the (reduced) shard
        self.host_grad_full: list[torch.Tensor | None] = [None] * len(chunks)   # sharded: before its reduction
        self.reduced: set[int] = set()     # sharded: chunks whose gradient is reduce-scattered in this step
        self.slots: dict[BufKey, torch.Tensor] = {}
        # gradient slots allocated and not zeroed yet: each maps the ranges (start: elements) that gradient writes
        # have covered so far; the rest is zeroed at the slot's first other use (see alloc)
        self._unzeroed: dict[BufKey, dict[int, int]] = {}
        self.state_home: list[StateHome | None] = [None] * len(chunks)
        self.states: list[torch.Tensor | None] = [None] * len(chunks)
        for c in chunks:
            # each chunk's states start where the first plan puts them: host memory holds only the host ones
            if c.group is ChunkGroup.TRAINABLE:
                floats = state_floats(c, precision, self.world, state)
                if c.state_home is StateHome.DEVICE:
                    self.states[c.id] = self.pool.take(floats, torch.float32, what=f"optimizer states of chunk {c.id}")
                    self.states[c.id].zero_()
                elif c.state_home is StateHome.DISK:
                    self._disk_files().add(c.id, floats * 4)     # zeros, like fresh states
                    if c.grad_buf() is BufKind.GRAD:
                        self.host_grad[c.id] = self.hostmem.zeros(shard_numel(c, self.world), c.dtype,
                                                                  key=("grad", c.id))
                else:
                    self.states[c.id] = self.hostmem.zeros(floats, torch.float32, copied=c.streamed,
                                                           key=("states", c.id))
                    if c.grad_buf() is BufKind.GRAD and not c.streamed:
                        # a host-stepped chunk's gradient goes home every step: its home is set up now, not in
                        # the first step's backward (where making it would hold up the write-backs)
                        self.host_grad[c.id] = self.hostmem.zeros(shard_numel(c, self.world), c.dtype,
                                                                  key=("grad", c.id))
                self.state_home[c.id] = c.state_home or StateHome.HOST
        self.undo = UndoBuffers(self.hostmem, precision, self.world, state)    # of chunks updated before the commit
        self.undo.mark(chunks)
        self.buffers: dict[str, torch.Tensor] = {}       # module buffers (always on the device)
        self._reading: dict[int, "torch.cuda.Event"] = {}  # chunk -> event after the last copy from its host buffers
        self._writing: dict[BufKey, "torch.cuda.Event"] = {}  # host buffer -> event after the write-back into it
        self._arriving: dict[BufKey, "torch.cuda.Event"] = {}  # slot -> its fetch's event, until compute waits on it
        self.stale: set[BufKey] = set()   # resident slots written on the device since their host home was current
        # released slots whose write-back may still be reading them, oldest first (see release and reclaim)
        self.draining: deque[tuple["torch.cuda.Event", torch.Tensor]] = deque()
        self.draining_bytes = 0
        # None: host-side updates run inline (tests compare)
        self.updates: HostUpdates | None = None if host_is_device else HostUpdates(threads=worker_threads(device))
        self.hostmem.release_unclaimed()
        self.h2d_stream = torch.cuda.Stream(device) if self.pin else None
        self.d2h_stream = torch.cuda.Stream(device) if self.pin else None
        self.values = StoreValues(self)

    # -- optimizer states --------------------------------------------------------------------------------------
    def parts(self, cid: int, states: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """Views into the state buffer (of this rank's shard), without waiting: for the step, which orders its own
        work. states: a buffer of the same layout to view instead (a streamed update's device slot, a disk chunk's
        staging buffer). A disk-homed chunk's states, outside a step, are first read into memory (`open_states`)."""
        if states is None and self.states[cid] is None:
            self.open_states(cid)
        s = self.states[cid] if states is None else states
        return self.state_layout.parts(s, shard_numel(self.chunks[cid], self.world), self.precision.mixed)

    # -- the disk tier (runtime/disk.py) -------------------------------------------------------------------------
    def _disk_files(self) -> DiskStates:
        if self.disk is None:
            assert self.offload_dir is not None, "a plan put optimizer states on disk without an offload_dir"
            self.disk = DiskStates(self.offload_dir, rank=None if self.comm is None else self.comm.rank)
        return self.disk

    def open_states(self, cid: int) -> None:
        """Outside a step (state dicts, checkpoints, loads): a disk-homed chunk's states read from their file into
        host memory, where readers and writers use them as host states; `close_states` writes back those marked
        written (`states_written`) and lets go of them, before the next step."""
        assert self.state_home[cid] is StateHome.DISK and self.states[cid] is None, cid
        if self._transient is not None and self._transient != cid:
            self.close_state(self._transient)
        self._transient = None
        self.disk.settle()          # writes still in flight land first (one that failed raised in its step)
        buf = torch.empty(self.disk.sizes[cid] // 4, dtype=torch.float32)
        self.disk.read_into(cid, buf)
        self.states[cid] = buf
        self._opened[cid] = False

    def states_written(self, cid: int) -> None:
        """A writer outside a step changed chunk cid's states (or master): an opened disk chunk's go back to disk."""
        if cid in self._opened:
            self._opened[cid] = True

    def let_go_when_another_opens(self, cid: int) -> None:
        """A writer outside a step is done with chunk cid's states for now and holds no views of them (load_params):
        if they are an opened disk chunk's, they go back to their file when another disk chunk is read in, so a
        pass over every chunk holds one in host memory at a time."""
        if cid in self._opened:
            self._transient = cid

    def is_open(self, cid: int) -> bool:
        """A disk-homed chunk's states are read into memory (outside a step)."""
        return cid in self._opened

    def close_state(self, cid: int) -> None:
        """Write an opened disk chunk's states back to its file if they were changed, and drop them (nothing for a
        chunk that is not an opened disk chunk)."""
        if cid not in self._opened:
            return
        if self._opened.pop(cid):
            self.disk.write_from(cid, self.states[cid])
        self.states[cid] = None

    def close_states(self) -> None:
        """Write the opened disk chunks' states that were changed back to their files, and drop every opened one."""
        for cid in sorted(self._opened):
            self.close_state(cid)

    def disk_read(self, cid: int, slot: int) -> None:
        """Issue the read of a disk chunk's states into staging buffer `slot` (after the slot's previous write)."""
        self._staged[cid] = slot
        self._disk_reads[cid] = self.disk.read(cid, slot)

    def staged_parts(self, cid: int) -> tuple[dict[str, torch.Tensor], Future]:
        """A disk chunk's states in its staging buffer, and the read that fills it (its update waits for it)."""
        slot = self._staged[cid]
        return self.parts(cid, self.disk.states(cid, slot)), self._disk_reads.pop(cid)

    def gate_disk_write(self, cid: int, update: Future) -> None:
        """The worker's Future of a disk chunk's update: its disk write waits for it."""
        self._update_done[cid] = update

    def disk_write(self, cid: int, slot: int) -> None:
        """Issue the write of a disk chunk's updated states from its staging buffer, once its update is done."""
        assert self._staged.pop(cid) == slot, (cid, slot)
        self._disk_writes.append(self.disk.write(cid, slot, self._update_done.pop(cid, None)))

    def finish_disk(self) -> None:
        """At the end of a step: wait for its disk writes (a failure raises, as CommitError from the executor)."""
        writes, self._disk_writes = self._disk_writes, []
        for f in writes:
            f.result()

    def abandon_disk(self) -> None:
        """After a failed step: wait for the disk I/O in flight, whatever its outcome, and forget it."""
        self._staged.clear()
        self._disk_reads.clear()
        self._update_done.clear()
        self._disk_writes = []
        if self.disk is not None:
            self.disk.settle()

    def master(self, cid: int) -> torch.Tensor:
        return self.parts(cid)["master"]

    def set_homes(self, chunks: tuple[ChunkInfo, ...]) -> None:
        """Move optimizer states to where this graph's plan put them. If any moves, every slot goes home first, so
        the new device states fit the budget next to what the new plan starts from (`enter` brings that in).
        Disk-homed states read into memory outside a step go back to their files first; the staging buffers take
        this plan's size."""
        self.close_states()
        if any(c.group is ChunkGroup.TRAINABLE and c.state_home is not self.state_home[c.id]
               or c.param_home is not self.chunks[c.id].param_home for c in chunks):
            self.evict_all()
        for c in chunks:
            if c.group is not ChunkGroup.TRAINABLE or c.state_home is self.state_home[c.id]:
                continue
            if self.state_home[c.id] is StateHome.DISK:       # read in, then moved on like host states
                self.open_states(c.id)
                self._opened.pop(c.id)
                self.state_home[c.id] = StateHome.HOST
                if c.state_home is StateHome.HOST and c.streamed:     # copied to the device: pinned
                    pinned = self.hostmem.zeros(self.states[c.id].numel(), torch.float32, copied=True)
                    self.states[c.id] = pinned.copy_(self.states[c.id])
                if c.state_home is StateHome.HOST:
                    continue
            old = self.states[c.id]
            if c.state_home is StateHome.DISK:
                disk = self._disk_files()
                if not disk.has(c.id):
                    disk.add(c.id, old.numel() * 4)
                disk.write_from(c.id, old)
                if self.state_home[c.id] is StateHome.DEVICE:
                    self.pool.give(old)
                else:
                    self.hostmem.free(old)
                if self.host_grad[c.id] is None and c.grad_buf() is BufKind.GRAD:
                    self.host_grad[c.id] = self.hostmem.zeros(shard_numel(c, self.world), c.dtype)
                self.states[c.id] = None
                self.state_home[c.id] = c.state_home
                continue
            if c.state_home is StateHome.DEVICE:
                new = self.pool.take(old.numel(), torch.float32, what=f"optimizer states of chunk {c.id}")
                new.copy_(old)
                self.hostmem.free(old)      # host memory holds only the states placed there
            else:
                new = self.hostmem.zeros(old.numel(), torch.float32, copied=False)
                new.copy_(old)
                self.pool.give(old)
            self.states[c.id] = new
            self.state_home[c.id] = c.state_home
        for c in chunks:      # after the states: a host home made again is filled from the master, where it is now
            if c.param_home is self.chunks[c.id].param_home:
                continue
            self._views.pop(BufKey(c.id, BufKind.PARAM), None)    # views of the home it replaces
            if c.param_home is ParamHome.MASTER:
                self.hostmem.free(self.host_param[c.id])
                self.host_param[c.id] = None
            else:
                home = self.hostmem.zeros(shard_numel(c, self.world), c.dtype)
                home.copy_(self.master(c.id))
                self.host_param[c.id] = home
        self.undo.mark(chunks)
        self.chunks = chunks
        disk = [c for c in chunks if c.state_home is StateHome.DISK]
        if disk:
            size = max(state_floats(c, self.precision, self.world, self.state_layout) * 4 for c in disk)
            self._disk_files().set_staging(min(STAGING_SLOTS, len(disk)), size)

    # -- chunk buffers ----------------------------------------------------------------------------------------
    def from_master(self, key: BufKey) -> bool:
        """The buffer is the chunk's half-precision parameters, kept as its fp32 master on the device."""
        return key.buf is BufKind.PARAM and self.chunks[key.chunk].param_home is ParamHome.MASTER

    def host(self, key: BufKey) -> torch.Tensor:
        if key.buf is BufKind.STATES:
            assert self.state_home[key.chunk] is StateHome.HOST, f"{key}: streamed states live on the host"
            return self.states[key.chunk]
        if key.buf is BufKind.PARAM:
            assert self.host_param[key.chunk] is not None, f"{key}: no host home (cast from the master)"
            return self.host_param[key.chunk]
        c = self.chunks[key.chunk]
        if self.world > 1 and key.chunk not in self.reduced:
            if self.host_grad_full[key.chunk] is None:
                self.host_grad_full[key.chunk] = self.hostmem.zeros(c.capacity, c.dtype)
            return self.host_grad_full[key.chunk]
        if self.host_grad[key.chunk] is None:
            self.host_grad[key.chunk] = self.hostmem.zeros(shard_numel(c, self.world), c.dtype)
        return self.host_grad[key.chunk]

    def home_bytes(self, key: BufKey) -> int:
        """Bytes a fetch or write-back of this buffer moves between host and device (this rank's part)."""
        c = self.chunks[key.chunk]
        if self.from_master(key):
            return 0
        if key.buf is BufKind.STATES:
            return state_floats(c, self.precision, self.world, self.state_layout) * 4
        whole = self.world == 1 or (key.buf is BufKind.GRAD and key.chunk not in self.reduced)
        return c.nbytes if whole else shard_numel(c, self.world) * c.dtype.itemsize

    def _home_part(self, key: BufKey, slot: torch.Tensor) -> torch.Tensor:
        """The part of a slot its host home holds: the whole slot, or (sharded) this rank's shard, except a
        gradient not yet reduced, which goes home whole."""
        if self.world == 1 or key.buf is BufKind.STATES or (key.buf is BufKind.GRAD and key.chunk not in self.reduced):
            return slot
        return self.comm.shard(slot)

    def slot(self, key: BufKey) -> torch.Tensor:
        """A resident chunk buffer, for use on the current (compute) stream. The first use after a fetch makes the
        compute stream wait for that fetch's copy (on the device; the CPU does not wait); the first use of an
        allocated gradient slot other than a gradient write zeroes what no write covered (see alloc)."""
        if self._unzeroed:
            written = self._unzeroed.pop(key, None)
            if written is not None:
                _zero_except(self.slots[key], written)
        if self._arriving:
            event = self._arriving.pop(key, None)
            if isinstance(event, Future):
                event = event.result()   # the fetch hangs on a host-side update: wait for exactly that one
            if isinstance(event, torch.cuda.Event):
                torch.cuda.current_stream(self.device).wait_event(event)
            elif event is not None:
                event.wait()             # a collective's work handle (CUDA: the compute stream waits for NCCL's)
        return self.slots[key]

    def param_view(self, key: BufKey, start: int, end: int, shape: tuple[int, ...]) -> torch.Tensor:
        """A parameter as a view of its resident chunk buffer `key`: elements [start, end) in `shape`. A host home
        lent as the slot is the same tensor at every step, so its views are made once and kept; another slot's are
        kept while it is resident."""
        slot = self.slot(key)
        made = self._views.get(key)
        if made is None or made[0] is not slot:
            made = self._views[key] = (slot, {})
        view = made[1].get(start)
        if view is None:
            view = made[1][start] = slot[start:end].view(shape)
        return view

    def arriving(self, key: BufKey, work) -> None:
        """A collective still writes into a resident slot: its first use waits for `work`."""
        assert key not in self._arriving, key
        self._arriving[key] = work

    def slot_spec(self, key: BufKey) -> tuple[int, torch.dtype]:
        """(numel, dtype) of a chunk buffer's device slot: the chunk's capacity in its dtype, or for a streamed
        update's states (STATES) their fp32 elements, laid out as the host buffer they are copied from."""
        c = self.chunks[key.chunk]
        if key.buf is BufKind.STATES:
            return state_floats(c, self.precision, self.world, self.state_layout), torch.float32
        return c.capacity, c.dtype

    def _take_slot(self, key: BufKey) -> torch.Tensor:
        numel, dtype = self.slot_spec(key)
        return self.pool.take(numel, dtype, what=lambda: f"chunk {key.chunk} " + (
            "optimizer states (streamed)" if key.buf is BufKind.STATES else f"{key.buf.value} buffer"))

    def _lends(self, key: BufKey) -> bool:
        """The slot is the host home (alias): a parameter buffer not rounded from its master, a gradient whose
        home exists (made at set-up or at its first write-back: a gradient that never goes home keeps a slot)."""
        if not self.host_is_device or key.buf is BufKind.STATES:
            return False
        return not self.from_master(key) if key.buf is BufKind.PARAM else self.host_grad[key.chunk] is not None

    def _lend(self, key: BufKey) -> torch.Tensor:
        home = self.host(key)
        self.pool.lend(home, what=lambda: f"chunk {key.chunk} {key.buf.value} buffer (its host home)")
        self.slots[key] = home
        self.lent.add(key)
        return home

    def fetch(self, key: BufKey) -> None:
        assert key not in self.slots, key
        if self._lends(key):      # (host-side updates run inline there: none is pending)
            self._lend(key)
            return
        slot = self._take_slot(key)
        self.slots[key] = slot
        part = self._home_part(key, slot)
        gather = self.world > 1 and key.buf is BufKind.PARAM
        if self.from_master(key):
            # the master rounded, on the compute stream (which orders it after the master's last update); sharded,
            # then gathered: collectives are issued by this thread in graph order
            part.copy_(self.master(key.chunk))
            if gather:
                self._arriving[key] = self.comm.all_gather(slot)
            return
        host = self.host(key)
        if not self.pin:
            def copy():
                part.copy_(host)
                return self.comm.all_gather(slot) if gather else None
        else:
            # the slot's block comes from the compute stream's allocator pool: until the compute stream reaches
            # this point it may still be an activation, so the copy waits for it (and for a write-back into the
            # same host buffer, which it reads)
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
            writing = self._writing.pop(key, None)

            def copy():
                with torch.cuda.device(self.device), torch.cuda.stream(self.h2d_stream):
                    self.h2d_stream.wait_event(ready)
                    if writing is not None:
                        self.h2d_stream.wait_event(writing)
                    part.copy_(host, non_blocking=True)
                    event = torch.cuda.Event()
                    event.record(self.h2d_stream)
                    # NCCL's stream waits for the H2D stream, so the gather starts after the shard's copy
                    work = self.comm.all_gather(slot) if gather else None
                # the copy reads the host buffer asynchronously: the CPU must not write it until the copy is done
                self._reading[key.chunk] = event
                return event if work is None else work
        if self.updates is None:
            arriving = copy()
        elif self.world > 1:
            # collectives are issued in graph order by this thread only: wait for the chunk's pending update
            self.updates.wait(key.chunk)
            arriving = copy()
        else:
            # after the chunk's pending host-side update (issued by the worker when it is done), else now
            arriving = self.updates.then(key.chunk, copy)
        if arriving is not None:
            self._arriving[key] = arriving

    def settle(self, chunks) -> None:
        """After a step failed before its commit: these chunks' updates ahead of it end, and so do the fetches that
        hang on them (a copy issued is waited for, so its slot can be given back); their failures are the step's,
        and nothing of them is left to raise."""
        if self.updates is not None:
            self.updates.settle(chunks)
        for key in [k for k in self._arriving if k.chunk in chunks]:
            arriving = self._arriving.pop(key)
            if isinstance(arriving, Future):
                try:
                    arriving = arriving.result()
                except BaseException:  # noqa: BLE001 - the update it hung on failed: no copy was issued
                    continue
            if isinstance(arriving, torch.cuda.Event):
                arriving.synchronize()

    def before_host_write(self, chunk: int | None = None) -> None:
        """Before the CPU reads or writes chunk's host buffers (all chunks' when None): wait for the host->device
        copies still reading them and the device->host write-backs still writing them, and for nothing else."""
        if self.updates is not None:
            if chunk is None:
                self.updates.wait_all()
            else:
                self.updates.wait(chunk)
        chunks = list(self._reading) + [k.chunk for k in self._writing] if chunk is None else [chunk]
        for c in chunks:
            event = self._reading.pop(c, None)
            if event is not None:
                event.synchronize()
            for buf in BufKind:
                event = self._writing.pop(BufKey(c, buf), None)
                if event is not None:
                    event.synchronize()

    def mark_written(self, key: BufKey) -> None:
        """The step wrote a resident slot: its host home is stale until the slot is written back."""
        self.stale.add(key)

    def flush(self, chunk: int | None = None) -> None:
        """Make host homes current (of one chunk, or all): write back every stale parameter slot (it stays resident,
        now clean) and wait for every copy that reads or writes those host buffers. A stale gradient slot is not
        written back: only the step reads gradients."""
        for key in sorted(self.stale, key=BufKey.order):
            if key.buf is BufKind.PARAM and (chunk is None or key.chunk == chunk):
                self._write_back(key, self.slot(key))
                self.stale.discard(key)
        self.before_host_write(chunk)

    def evict_all(self) -> None:
        """flush, then give every slot back: nothing of the chunks is on the device, the host homes hold it all."""
        self.flush()
        self.drop_slots()

    def drop_slots(self) -> None:
        """Give every slot back without writing anything to the host (what a stale slot held is lost)."""
        self._unzeroed.clear()
        for key in list(self.slots):
            self.slot(key)   # a copy still arriving into the slot must finish before its memory is reused
            if key not in self.lent:
                self._views.pop(key, None)
            self._give(key, self.slots.pop(key))
        self.stale.clear()
        self.pool.trim(0)    # nothing of the chunks stays on the device, cached slots included

    def enter(self, carried: tuple) -> tuple[int, int]:
        """Before a step: make the resident slots exactly the plan's carried set ((BufKey, stale allowed), ...).
        Slots outside it go home (written back if stale), missing ones are fetched, and stale slots the plan does not
        allow stale are written home. Returns the bytes moved (host to device, device to host): nothing in the steady
        state of one graph."""
        want = dict(carried)
        self.reduced.clear()
        self.reclaim()        # (a step reclaims its draining slots at its end; a failed one in its error path)
        self.recount()        # (bookkeeping outside a step, cut short by Ctrl-C, may have left the count behind)
        h2d = d2h = 0
        for key in sorted(self.slots.keys() - want.keys(), key=BufKey.order):
            stale = key in self.stale and key.buf is BufKind.PARAM
            self.release(key, writeback=stale)
            d2h += self.home_bytes(key) if stale else 0
        for key in sorted(want.keys() - self.slots.keys(), key=BufKey.order):
            self.fetch(key)
            h2d += self.home_bytes(key)
        # a slot stale on the host that this plan assumes current (another graph on the same chunks left it so:
        # a training step's resident parameters when an evaluation runs) is written home and stays resident
        for key in sorted((k for k in self.stale if not want.get(k, False)), key=BufKey.order):
            assert key.buf is BufKind.PARAM, f"{key}: a stale gradient slot outlived its step"
            self._write_back(key, self.slot(key))
            self.stale.discard(key)
            d2h += self.home_bytes(key)
        return h2d, d2h

    def alloc(self, key: BufKey) -> None:
        """A zeroed slot for a buffer whose host copy holds nothing (a gradient before its first write). A gradient
        slot is zeroed lazily: the ranges its gradient writes copy into (see grad_part) are never zeroed, the rest
        (padding, and parameters no write reached) at the slot's first other use (slot), before anything reads it."""
        assert key not in self.slots, key
        slot = self._lend(key) if key.buf is BufKind.GRAD and self._lends(key) else self._take_slot(key)
        if key.buf is BufKind.GRAD:
            self._unzeroed[key] = {}
        else:
            slot.zero_()
        self.slots[key] = slot

    def grad_part(self, key: BufKey, start: int, numel: int, accumulate: bool) -> torch.Tensor:
        """The elements [start, start + numel) of a resident gradient slot, for a gradient write: copied into
        (accumulate False) or added to. In a slot not zeroed yet (alloc) a copy's range needs no zeroing, and a
        range added to before any copy is zeroed first."""
        written = self._unzeroed.get(key)
        if written is None:
            return self.slot(key)[start:start + numel]
        part = self.slots[key][start:start + numel]
        if start not in written:     # (parameters never overlap in a chunk: a range is known by its start)
            if accumulate:
                part.zero_()
            written[start] = numel
        return part

    def release(self, key: BufKey, writeback: bool, defer: bool = False) -> None:
        """The buffer leaves the device. Without a write-back its memory is reusable, in the compute stream's order,
        right here (once the compute stream has waited for the slot's fetch: a slot fetched and never read).

        With one, the D2H stream copies the slot after the compute stream's last write. Then either the compute
        stream waits (on the device) for that copy before anything after the release may reuse the block, or, with
        `defer` (the scheduled graph's releases), nothing waits: the slot joins `draining`, still counted by the
        pool, and `reclaim` gives it back later, where the executor needs its room or at the end of the step, so
        the compute stream overlaps the copy. The plan frees a buffer at its release; the executor reclaims
        draining slots before any node whose planned bytes plus theirs would pass the plan's predicted peak, so the
        peak holds. The CPU never waits here."""
        slot = self.slot(key)
        # written back while still among the slots: a write-back that fails leaves the slot where rollback finds it
        event = self._write_back(key, slot, wait=not defer) if writeback else None
        del self.slots[key]
        if key not in self.lent:
            self._views.pop(key, None)
        self.stale.discard(key)
        if event is not None and defer:
            self.draining.append((event, slot))
            self.draining_bytes += slot.numel() * slot.element_size()
            return
        self._give(key, slot)

    def _give(self, key: BufKey, slot: torch.Tensor) -> None:
        """A slot that left `slots` back to the pool: a lent host home is only uncounted."""
        if key in self.lent:
            self.lent.discard(key)
            self.pool.unlend(slot)
        else:
            self.pool.give(slot)

    def reclaim(self, keep: int = 0, want: tuple[int, torch.dtype] | None = None) -> None:
        """Give draining slots (see release) back to the pool, oldest first, until at most `keep` bytes of them are
        left. The compute stream waits for the write-back of each one not yet done, so nothing after this point
        reuses its block before the copy has read it; a finished copy costs no wait.

        `want`: the (numel, dtype) of the slot the next node takes. Where the pool's free list has none of that size,
        the oldest draining slot of that size whose write-back has finished is given back first, so the take reuses
        it instead of allocating a new block from torch (no wait: an unfinished one is left draining)."""
        if want is not None and not self.pool.free.get(want):
            for j, (event, slot) in enumerate(self.draining):
                if slot.numel() == want[0] and slot.dtype == want[1] and event.query():
                    del self.draining[j]
                    self.draining_bytes -= slot.numel() * slot.element_size()
                    self.pool.give(slot)
                    break
        compute = None
        while self.draining and self.draining_bytes > keep:
            event, slot = self.draining.popleft()
            if not event.query():
                compute = compute or torch.cuda.current_stream(self.device)
                compute.wait_event(event)
            self.draining_bytes -= slot.numel() * slot.element_size()
            self.pool.give(slot)

    def recount(self) -> None:
        """Rebuild the device pool's count (and the draining bytes) from the buffers the store holds: resident and
        draining slots, optimizer states on the device, module buffers. An exception that cut an allocation or a
        give-back short (an out-of-memory error, a Ctrl-C outside a step) then leaves no byte counted that nothing
        owns. Between steps (the executor's constants and workspaces are given back by then)."""
        self.draining_bytes = sum(slot.numel() * slot.element_size() for _, slot in self.draining)
        device_states = [s for s, home in zip(self.states, self.state_home) if home is StateHome.DEVICE]
        self.lent &= self.slots.keys()
        self.pool.recount([*(s for k, s in self.slots.items() if k not in self.lent),
                           *(slot for _, slot in self.draining), *device_states, *self.buffers.values()],
                          lent=[self.slots[k] for k in self.lent])

    def take_host_events(self, chunk: int) -> list:
        """The events a host-side update of chunk must wait for before it touches the chunk's host buffers (copies
        reading or writing them), handed over to whoever waits (the update's worker): the store forgets them."""
        events = [self._reading.pop(chunk, None)] + [self._writing.pop(BufKey(chunk, b), None) for b in BufKind]
        return [e for e in events if e is not None]

    def _write_back(self, key: BufKey, slot: torch.Tensor, wait: bool = True) -> "torch.cuda.Event | None":
        """Copy the slot to its host home: on the D2H stream (returning the copy's event; the compute stream waits
        for it unless `wait` is False), or on the CPU without pinned memory (None). None, too, where nothing is
        copied (a slot that holds the master rounded)."""
        if self.from_master(key):
            return None   # the slot holds the master rounded (the schedule never evicts gradients held in it)
        if key in self.lent:
            return None   # the slot is the host home
        if self.updates is not None:
            self.updates.wait(key.chunk)   # the chunk's host buffers are the pending update's until it is done
        part = self._home_part(key, slot)
        if not self.pin:
            self.host(key).copy_(part)
            return None
        compute = torch.cuda.current_stream(self.device)
        self.d2h_stream.wait_stream(compute)
        with torch.cuda.stream(self.d2h_stream):
            self.host(key).copy_(part, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.d2h_stream)
        if wait:
            compute.wait_event(event)
        self._writing[key] = event
        return event


def _zero_except(slot: torch.Tensor, written: dict[int, int]) -> None:
    """Zero the elements of a 1-d slot outside the ranges (start: elements) in `written`."""
    at = 0
    for start in sorted(written):
        if start > at:
            slot[at:start].zero_()
        at = max(at, start + written[start])
    if at < slot.numel():
        slot[at:].zero_()
