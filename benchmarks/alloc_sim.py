"""A step's device allocations replayed on the CPU through a model of torch's caching allocator with expandable
segments, to count its retries (each frees the whole cache, a device synchronisation) without a GPU.

    python benchmarks/alloc_sim.py --layers 32 --machine h100 --device-memory 75.98GiB [--no-atomic]
    python benchmarks/alloc_sim.py --layers 54 --device-memory 136.6GiB --steps 3

The step is pstar-fx-plan's GPT planned unfused on one GPU (benchmarks/arena_fit.py's plan, traced for the CPU: its
graph differs from a CUDA trace in some ops, so node names and counts differ from a GPU run's). Its allocations, in
the executor's order: the static bytes at set-up; before each node slots written back given back as far as the
node's room needs (one of the size the node takes first; --drain done: each at its release), then the device pool's
free list trimmed (--keep none, the runtime's on CUDA: to the slot the node takes; --keep room, the runtime's
before: to the node's room under the plan's peak); a fetch takes a slot of its buffer's size (the free list first,
by exact size), a release gives it back, a node's workspace is taken and given back at the node; every activation
storage is allocated at the node that makes it and freed after its last use (the liveness rule the executor frees
by).

The allocator model, after torch's CUDACachingAllocator with `expandable_segments:True`: allocations of at most
1 MiB in a small pool (2 MiB pages), larger ones in a large pool (20 MiB pages), sizes rounded up to 512 bytes
(with --roundup N, as torch's roundup_power2_divisions:N rounds them, all but the set-up's); the
smallest free block that holds a request serves it, passing over blocks that could grow into unmapped space for the
next one that reaches less far, as torch does, and split where 512 bytes or more are left; otherwise unmapped address
space (with the free block before it) is mapped page by page while the mapped pages of both pools stay within the
cap (the budget plus --over-budget: what the device has beside the plan); where that fails, every free block's whole
pages are unmapped and the request tried again: a retry. Not modelled: memory operators allocate inside themselves
(cuBLAS workspaces, attention's temporaries), the compiled regions of a fused step, copy streams' reuse rules, and
for --max-split torch's release of oversize blocks before a retry.
"""
from __future__ import annotations

import argparse
import bisect
import collections
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from arena_fit import GiB, activations, plan_args, planned  # noqa: E402  (benchmarks/, beside this file)
from pstar_fx.ir.graph import Role  # noqa: E402
from pstar_fx.ir.needs import BufKey, all_needs, buf_bytes, static_bytes  # noqa: E402
from pstar_fx.units import parse_bytes  # noqa: E402

MiB = 2 ** 20
SMALL = 1 * MiB           # torch's kSmallSize: the small pool's largest request
ALLOC, FREE, UNMAPPED = "alloc", "free", "unmapped"


class OutOfMemory(Exception):
    pass


class Block:
    __slots__ = ("addr", "size", "state", "prev", "next")

    def __init__(self, addr, size, state, prev=None, nxt=None):
        self.addr, self.size, self.state, self.prev, self.next = addr, size, state, prev, nxt


class Device:
    """Physical memory: the pages both pools have mapped, within a cap."""

    def __init__(self, cap: int):
        self.cap, self.mapped, self.retries = cap, 0, 0

    def release(self) -> None:
        """Every pool's free blocks' whole pages unmapped (torch.cuda.empty_cache(), and a retry's first half)."""
        for pool in self.pools:
            pool.release()


class Pool:
    """One expandable segment: blocks over an address range, each allocated, free (mapped) or unmapped."""

    def __init__(self, dev: Device, page: int, split_min: int, span: int):
        self.dev, self.page, self.split_min = dev, page, split_min
        self.head = Block(0, span, UNMAPPED)
        self.free: list[tuple[int, int, Block]] = []      # (size, addr, block) of the free blocks, sorted
        self.max_split = 0           # PYTORCH_CUDA_ALLOC_CONF's max_split_size_mb in bytes (0: unset)

    def _free_add(self, b: Block) -> None:
        bisect.insort(self.free, (b.size, b.addr, b), key=lambda t: (t[0], t[1]))

    def _free_remove(self, b: Block) -> None:
        i = bisect.bisect_left(self.free, (b.size, b.addr), key=lambda t: (t[0], t[1]))
        assert self.free[i][2] is b
        del self.free[i]

    def _split(self, b: Block, size: int, state: str) -> Block:
        """Cut b to `size`; the rest becomes a block of its own in `state`."""
        rest = Block(b.addr + size, b.size - size, state, b, b.next)
        if b.next:
            b.next.prev = rest
        b.next, b.size = rest, size
        return rest

    @staticmethod
    def _absorb(lo: Block, hi: Block) -> Block:
        """hi (lo's next) made part of lo."""
        lo.size += hi.size
        lo.next = hi.next
        if hi.next:
            hi.next.prev = lo
        return lo

    def _merge_free(self, b: Block) -> Block:
        """b (free, not in the free list) merged with its free neighbours; the result goes in the free list."""
        for nb in (b.prev, b.next):
            if nb is not None and nb.state == FREE:
                self._free_remove(nb)
                b = self._absorb(*((nb, b) if nb is b.prev else (b, nb)))
        self._free_add(b)
        return b

    def malloc(self, size: int) -> Block:
        try:
            return self._malloc(size)
        except OutOfMemory:
            self.dev.retries += 1
            self.dev.release()
            return self._malloc(size)

    @staticmethod
    def _reach(b: Block) -> int:
        """A free block's size with the unmapped range after it (torch's "expandable size")."""
        return b.size + (b.next.size if b.next is not None and b.next.state == UNMAPPED else 0)

    def _malloc(self, size: int) -> Block:
        i = bisect.bisect_left(self.free, (size, -1), key=lambda t: (t[0], t[1]))
        # torch's best fit in an expandable segment: past blocks that could grow into unmapped space, to the next
        # one whose reach is smaller
        while i + 1 < len(self.free) and self._reach(self.free[i + 1][2]) < self._reach(self.free[i][2]):
            i += 1
        b = self.free[i][2] if i < len(self.free) else None
        cut = self.max_split
        if b is not None and cut and (size < cut <= b.size or size >= cut and b.size >= size + 20 * MiB):
            b = None                 # max_split_size_mb: an oversize block serves only a request near its size
        if b is not None:
            self._free_remove(b)
            if b.size - size >= self.split_min and not (cut and size >= cut):
                self._free_add(self._split(b, size, FREE))
            b.state = ALLOC
            return b
        return self._expand(size)

    def _expand(self, size: int) -> Block:
        """The lowest unmapped range (with a free block before it) that holds `size`, mapped as far as needed."""
        b = self.head
        while b is not None:
            if b.state == UNMAPPED:
                start = b.prev if b.prev is not None and b.prev.state == FREE else b
                total, c = 0, start
                while c is not None and c.state != ALLOC and total < size:
                    total += c.size
                    c = c.next
                if total >= size:
                    return self._map_from(start, size)
            b = b.next
        raise AssertionError("the address range is exhausted")

    def _map_from(self, start: Block, size: int) -> Block:
        # walk the run, mapping whole pages of its unmapped blocks until it holds `size` (a failure maps nothing)
        run, c, to_map = 0, start, []
        while run < size:
            if c.state == FREE:
                run += c.size
            else:
                take = min(c.size, -(-(size - run) // self.page) * self.page)
                to_map.append((c, take))
                run += take
            c = c.next
        nbytes = sum(t for _, t in to_map)
        if self.dev.mapped + nbytes > self.dev.cap:
            raise OutOfMemory
        self.dev.mapped += nbytes
        if start.state == FREE:
            self._free_remove(start)
        for c, take in to_map:
            if take < c.size:
                self._split(c, take, UNMAPPED)
            c.state = FREE
        mapped_now = {id(c) for c, _ in to_map}
        b = start                    # merge the run into one block, then cut the request from its front
        while b.size < size:
            nb = b.next
            if nb.state == FREE and id(nb) not in mapped_now:      # a free block the run passed through
                self._free_remove(nb)
            self._absorb(b, nb)
        b.state = ALLOC
        if b.size - size >= self.split_min:
            self._merge_free(self._split(b, size, FREE))      # (with a free block after it, as torch merges)
        return b

    def release(self) -> None:
        """Unmap every free block's whole pages (torch's release of its cached blocks)."""
        for _, _, b in list(self.free):
            lo = -(-b.addr // self.page) * self.page
            hi = (b.addr + b.size) // self.page * self.page
            if hi <= lo:
                continue
            self._free_remove(b)
            if hi < b.addr + b.size:
                self._split(b, hi - b.addr, FREE)
                self._free_add(b.next)
            if lo > b.addr:
                self._split(b, lo - b.addr, UNMAPPED)
                self._free_add(b)
                b = b.next
            b.state = UNMAPPED
            self.dev.mapped -= b.size
            for nb in (b.next, b.prev):                    # merge unmapped neighbours
                if nb is not None and nb.state == UNMAPPED:
                    b = self._absorb(*((nb, b) if nb is b.prev else (b, nb)))

    def check(self) -> int:
        """The model's invariants (blocks tile the range in order, the free list is the free blocks, unmapped blocks
        are whole pages); returns the bytes mapped."""
        b, at, mapped, free = self.head, 0, 0, set()
        while b is not None:
            assert b.addr == at and b.size > 0 and (b.next is None or b.next.prev is b), (b.addr, at)
            if b.state == UNMAPPED:
                assert b.addr % self.page == 0 and (b.next is None or b.size % self.page == 0)
            else:
                mapped += b.size
            if b.state == FREE:
                free.add(id(b))
                assert b.next is None or b.next.state != FREE, f"two free blocks side by side at {b.next.addr}"
            at += b.size
            b = b.next
        assert free == {id(t[2]) for t in self.free}
        return mapped

    def free_block(self, b: Block) -> None:
        b.state = FREE
        self._merge_free(b)


class Torch:
    """The caching allocator: the small and the large pool over one device."""

    def __init__(self, cap: int):
        self.dev = Device(cap)
        span = 1 << 50
        self.small = Pool(self.dev, 2 * MiB, 512, span)     # expandable segments split wherever 512 bytes are
        self.large = Pool(self.dev, 20 * MiB, 512, span)    # left, in both pools
        self.slots = self.large      # --slot-pool: the device pool's slots in a segment of their own
        self.dev.pools = (self.small, self.large)
        self.divisions = 0           # PYTORCH_CUDA_ALLOC_CONF's roundup_power2_divisions (0: unset)

    def own_slot_pool(self) -> None:
        self.slots = Pool(self.dev, 20 * MiB, 512, 1 << 50)
        self.dev.pools = (self.small, self.large, self.slots)

    def malloc_slot(self, nbytes: int) -> tuple[Pool, Block]:
        if self.slots is self.large:
            return self.malloc(nbytes)
        size = max(512, -(-nbytes // 512) * 512)
        return self.slots, self.slots.malloc(size)

    def malloc(self, nbytes: int) -> tuple[Pool, Block]:
        size = max(512, -(-nbytes // 512) * 512)
        d = self.divisions
        if d > 1 and size > 512 * d and size & (size - 1):       # torch's roundup_power2_next_division
            step = (1 << (size.bit_length() - 1)) >> (d.bit_length() - 1)
            size = -(-size // step) * step
        pool = self.small if size <= SMALL else self.large
        return pool, pool.malloc(size)

    def free(self, handle: tuple[Pool, Block]) -> None:
        handle[0].free_block(handle[1])


class DevicePool:
    """runtime/device_pool.py's free list: given-back buffers kept by exact size, trimmed to a room."""

    def __init__(self, torch_: Torch, order: str = "bytes", keep: str = "none"):
        self.torch, self.free, self.cached = torch_, collections.defaultdict(list), 0
        self.order, self.keep = order, keep

    def take(self, nbytes: int):
        if self.free[nbytes]:
            self.cached -= nbytes
            return self.free[nbytes].pop()
        return self.torch.malloc_slot(nbytes)

    def give(self, nbytes: int, handle) -> None:
        self.free[nbytes].append(handle)
        self.cached += nbytes

    def trim(self, keep: int, spare: int | None) -> None:
        """Give free-listed buffers back until at most `keep` bytes stay (--keep none: only the spare stays), in
        --trim-order: `bytes` the size with the most bytes cached first (the runtime's), `high` / `low` the highest /
        lowest address first."""
        keep = 0 if self.keep == "none" else keep if self.keep == "room" else min(keep, parse_bytes(self.keep))
        while self.cached > max(keep, 0):
            sizes = [k for k, v in self.free.items() if v and (k != spare or len(v) > 1)]
            if not sizes:
                return
            if self.order == "bytes":
                k = max(sizes, key=lambda k: len(self.free[k]) * k)
                handle = self.free[k].pop()
            else:
                pick = max if self.order == "high" else min
                k, j = pick(((k, j) for k in sizes for j in range(len(self.free[k]))),
                            key=lambda kj: self.free[kj[0]][kj[1]][1].addr)
                handle = self.free[k].pop(j)
            self.torch.free(handle)
            self.cached -= k


def simulate(g, cap: int, steps: int, order: str = "bytes", keep: str = "none", max_split: int = 0,
             drain: str = "room", divisions: int = 0, empty: bool = False,
             slot_pool: bool = False) -> list[list[tuple[int, str, int]]]:
    """Each step's retries: (node position, node name, bytes asked) for every retry. drain: `room` a slot written
    back stays counted (draining) until a node's room needs it, as the runtime does (ChunkStore.reclaim; one of the
    size a node takes, where the free list has none, first, its copy taken as done); `done` every write-back done at
    its release (the slot given back there). empty: torch's cache emptied at each step's start (every free block's
    whole pages unmapped, as torch.cuda.empty_cache() does)."""
    nodes = g.nodes
    starts, ends = activations(g)            # per node: the activation storages it makes / frees after it
    needs = all_needs(g)
    plan = g.plan
    room = [plan.predicted_peak - (plan.static_bytes + g.ann[n.name].resident_bytes + g.ann[n.name].live_bytes
                                   + g.ann[n.name].workspace_bytes) for n in nodes]
    torch_ = Torch(cap)
    torch_.large.max_split = max_split
    if slot_pool:
        torch_.own_slot_pool()
    pool = DevicePool(torch_, order, keep)
    torch_.malloc(static_bytes(g))           # set-up: module buffers, constants, device-placed states (kept)
    torch_.divisions = divisions             # (the set-up not rounded, as if sized to the rounding's steps)
    slots = {k: pool.take(buf_bytes(g, k)) for k, _ in plan.carried}
    draining: collections.deque = collections.deque()        # (bytes, handle), oldest first
    held = 0                                                  # their bytes
    out = []
    for _ in range(steps):
        if empty:
            torch_.dev.release()
        retries = []
        live = {}
        for i, n in enumerate(nodes):
            a = g.ann[n.name]
            key = BufKey(a.chunk, a.buf) if a.role in (Role.FETCH, Role.RELEASE) else None
            takes = buf_bytes(g, key) if a.role is Role.FETCH else None
            if draining:
                if takes and not pool.free[takes]:
                    j = next((j for j, (nb, _) in enumerate(draining) if nb == takes), None)
                    if j is not None:
                        held -= takes
                        pool.give(*draining[j])
                        del draining[j]
                while draining and held > (0 if i == len(nodes) - 1 else room[i]):
                    held -= draining[0][0]
                    pool.give(*draining.popleft())
            if pool.cached:
                pool.trim(room[i] + (takes if takes and pool.free[takes] else 0) - held, takes)
            before = torch_.dev.retries
            try:
                if a.role is Role.FETCH:
                    slots[key] = pool.take(takes)
                elif a.role is Role.RELEASE and drain == "room" and n.kwargs.get("writeback"):
                    draining.append((buf_bytes(g, key), slots.pop(key)))
                    held += draining[-1][0]
                elif a.role is Role.RELEASE:
                    pool.give(buf_bytes(g, key), slots.pop(key))
                if needs[i].workspace:
                    pool.give(needs[i].workspace, pool.take(needs[i].workspace))
                for k, nbytes in starts[i]:
                    live[k] = torch_.malloc(nbytes)
            except OutOfMemory:
                raise SystemExit(f"out of memory at node {i} ({n.name}) even after a retry: the cap "
                                 f"{cap / GiB:.2f} GiB cannot hold the step as replayed") from None
            if torch_.dev.retries > before:
                asked = takes or max((b for _, b in starts[i]), default=needs[i].workspace)
                retries.extend([(i, n.name, asked)] * (torch_.dev.retries - before))
            for k in ends[i]:
                torch_.free(live.pop(k))
        out.append(retries)
        assert sum(p.check() for p in torch_.dev.pools) == torch_.dev.mapped <= cap
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    plan_args(ap)
    ap.add_argument("--over-budget", default="2.4GiB", help="what the device has for torch beyond the budget "
                    "(default 2.4 GiB: an H100's and an H200's peak reserved bytes at the default budget)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--trim-order", default="bytes", choices=["bytes", "high", "low"])
    ap.add_argument("--keep", default="none",
                    help="what the pool keeps free-listed before a node: none beside the slot it takes (the "
                    "runtime's on CUDA), up to its room (`room`: the runtime's before), or that and at most this many "
                    "bytes (e.g. 1GiB)")
    ap.add_argument("--quiet", action="store_true", help="counts only")
    ap.add_argument("--drain", default="room", choices=["room", "done"],
                    help="slots written back: counted until a node's room needs them (`room`, the runtime's), or "
                    "given back at their release (`done`)")
    ap.add_argument("--max-split", default=None, help="PYTORCH_CUDA_ALLOC_CONF's max_split_size_mb, as bytes (e.g. "
                    "512MiB; default: unset)")
    ap.add_argument("--roundup", type=int, default=0, help="PYTORCH_CUDA_ALLOC_CONF's roundup_power2_divisions "
                    "(a power of two: sizes rounded up to that many steps between powers of two; default: unset)")
    ap.add_argument("--empty-cache", action="store_true", help="empty torch's cache at each step's start")
    ap.add_argument("--slot-pool", action="store_true", help="the device pool's chunk slots in an expandable "
                    "segment of their own (a torch.cuda.MemPool), apart from the activations'")
    args = ap.parse_args()
    g = planned(args)
    cap = g.settings.budget + parse_bytes(args.over_budget)
    per_step = simulate(g, cap, args.steps, args.trim_order, args.keep,
                        parse_bytes(args.max_split) if args.max_split else 0, args.drain, args.roundup,
                        args.empty_cache, args.slot_pool)
    print(f"{len(g.nodes)} nodes; budget {g.settings.budget / GiB:.2f} GiB, cap {cap / GiB:.2f} GiB; chunks' states "
          f"on the device {sum(c.state_home.name == 'DEVICE' for c in g.chunks)}, streamed "
          f"{sum(c.streamed for c in g.chunks)}, undo {sum(c.undo for c in g.chunks)}; moved "
          f"{g.plan.h2d_bytes / GiB:.2f} / {g.plan.d2h_bytes / GiB:.2f} GiB")
    for k, retries in enumerate(per_step):
        print(f"step {k}: {len(retries)} retries")
        for i, name, asked in ([] if args.quiet else retries):
            print(f"   node {i:6d} {name:40s} asked {asked / MiB:9.1f} MiB")


if __name__ == "__main__":
    main()
