"""Would one device arena, every buffer at an offset planned ahead, hold a step within its budget? (CPU only)

    python benchmarks/arena_fit.py --layers 54 --d-model 5120 --heads 40 --batch 8 --device-memory 136.6GiB
    python benchmarks/arena_fit.py --layers 32 --machine h100 --device-memory 75.98GiB [--prefetch 0]

torch's caching allocator serves the activations beside the device pool's chunk buffers, and near a full device it
fragments: it then frees its whole cache and retries (a device synchronisation; 10-29 a step at 10-17B). An arena
whose offsets are planned ahead would not fragment at run time, but packing buffers of many sizes and lifetimes into
one address range costs room of its own. This plans pstar-fx-plan's GPT (the same model, trace and passes;
unfused; one GPU), takes from the final graph every buffer the plan counts with its lifetime in node positions
(activation storages by the liveness rule, chunk buffers from fetch to release, a buffer carried across steps in
two pieces that keep one offset, each node's workspace, the static bytes), places them greedily (largest first, each
at the lowest offset that overlaps no placed buffer alive at the same time; buffers below --min-bytes left to torch's
allocator) and prints the arena's size beside the plan's peak.
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import pstar_fx as px  # noqa: E402
from pstar_fx.models.gpt import GPT, GPTConfig, gpt_loss  # noqa: E402
from pstar_fx.ir.graph import Role  # noqa: E402
from pstar_fx.ir.needs import BufKey, all_needs, buf_bytes, static_bytes  # noqa: E402
from pstar_fx.passes.liveness import storages  # noqa: E402

GiB = 2 ** 30
ALIGN = 512          # torch's caching allocator rounds blocks to 512 bytes


@dataclass
class Buffer:
    what: str
    size: int
    spans: list[tuple[int, int]]    # node positions [first, last], inclusive; two for a buffer carried across steps
    offset: int = -1


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def activations(g) -> tuple[list[list[tuple[int, int]]], list[list[int]]]:
    """Per node position: the activation storages it makes, (id, bytes), and those freed after it (ids), by the
    liveness pass's rule (passes/liveness.py: from the node that makes a storage to the last use of any value
    sharing it)."""
    makes: list[list[tuple[int, int]]] = [[] for _ in g.nodes]
    frees: list[list[int]] = [[] for _ in g.nodes]
    for k, (first, last, nbytes) in enumerate(storages(g.nodes, g.ann)):
        if nbytes:
            makes[first].append((k, nbytes))
            frees[last].append(k)
    return makes, frees


def buffers_of(g) -> tuple[list[Buffer], int]:
    """Every buffer the plan counts, with its lifetime, and the plan's replayed peak (as the verifier replays it)."""
    nodes = g.nodes
    end = len(nodes) - 1
    out: list[Buffer] = []
    makes, frees = activations(g)
    stop = {k: i for i, ks in enumerate(frees) for k in ks}
    out += [Buffer("activation", nbytes, [(i, stop[k])]) for i, made in enumerate(makes) for k, nbytes in made]
    # chunk buffers: fetched (or allocated) at one node, released at another; the carried ones are resident at the
    # step's start until their release, and again from their fetch to the end (the same buffer in the next step)
    opened: dict[BufKey, int] = {k: -1 for k, _ in g.plan.carried}
    carried_release: dict[BufKey, int] = {}
    needs = all_needs(g)
    for i, n in enumerate(nodes):
        a = g.ann[n.name]
        if a.role is Role.FETCH:
            opened[BufKey(a.chunk, a.buf)] = i
        elif a.role is Role.RELEASE:
            key = BufKey(a.chunk, a.buf)
            first = opened.pop(key)
            if first < 0:
                carried_release[key] = i
            else:
                out.append(Buffer(f"chunk {key.chunk} {key.buf.name}", buf_bytes(g, key), [(first, i)]))
        if needs[i].workspace:
            out.append(Buffer("workspace", needs[i].workspace, [(i, i)]))
    for key, first in opened.items():        # resident at the end: carried into the next step
        spans = [(first, end)] if first >= 0 else [(0, end)]
        if key in carried_release:
            spans.insert(0, (0, carried_release.pop(key)))
        out.append(Buffer(f"chunk {key.chunk} {key.buf.name} (carried)", buf_bytes(g, key), spans))
    assert not carried_release, carried_release
    static = static_bytes(g)
    if static:
        out.append(Buffer("static", static, [(0, end)]))
    return out, g.plan.predicted_peak


def ordered(buffers: list[Buffer], how: str, n_nodes: int) -> list[Buffer]:
    """The order the greedy placement takes the buffers in: `size` largest first (then longest-lived); `start` by
    the node that makes them (an allocator that knows every lifetime); `breadth` the buffers alive at the node with
    the most bytes alive first, largest first, then those of the next such node among the rest, and so on."""
    life = {id(b): sum(e - s + 1 for s, e in b.spans) for b in buffers}
    if how == "size":
        return sorted(buffers, key=lambda b: (-b.size, -life[id(b)]))
    if how == "start":
        return sorted(buffers, key=lambda b: (b.spans[0][0], -b.size))
    alive = np.zeros(n_nodes + 1, np.int64)
    for b in buffers:
        for s, e in b.spans:
            alive[s] += b.size
            alive[e + 1] -= b.size
    alive = np.cumsum(alive)[:-1]
    out, taken = [], set()
    for i in np.argsort(-alive, kind="stable").tolist():
        here = [b for b in buffers if id(b) not in taken and any(s <= i <= e for s, e in b.spans)]
        for b in sorted(here, key=lambda b: (-b.size, -life[id(b)])):
            taken.add(id(b))
            out.append(b)
        if len(taken) == len(buffers):
            break
    return out


def place(buffers: list[Buffer], n_nodes: int, how: str = "size") -> int:
    """Greedy offsets in the order `ordered` gives, each at the lowest free gap among the placed buffers alive at
    the same time. Returns the arena's size. Checked: no two buffers alive together overlap, and the arena is at
    least the most bytes alive at once."""
    order = ordered(buffers, how, n_nodes)
    cap = sum(len(b.spans) for b in buffers)
    lo_at, hi_at = np.zeros(cap, np.int64), np.zeros(cap, np.int64)        # placed spans: node positions
    off, end = np.zeros(cap, np.int64), np.zeros(cap, np.int64)            # and their address ranges
    n = top = 0
    for b in order:
        hit = np.zeros(n, bool)
        for s, e in b.spans:
            hit |= (lo_at[:n] <= e) & (hi_at[:n] >= s)
        ranges = sorted(zip(off[:n][hit].tolist(), end[:n][hit].tolist()))
        need, at, offset, best = _aligned(b.size), 0, None, None
        for lo, hi in ranges:           # the smallest gap that holds it (best fit), else above them all
            if lo - at >= need and (best is None or lo - at < best):
                offset, best = at, lo - at
            at = max(at, hi)
        b.offset = at if offset is None else offset
        offset = b.offset
        top = max(top, offset + need)
        for s, e in b.spans:
            lo_at[n], hi_at[n], off[n], end[n] = s, e, offset, offset + need
            n += 1
    # the invariant, checked: a span that starts while another is alive (another buffer's) shares no address with it
    owner = np.repeat(np.arange(len(order)), [len(b.spans) for b in order])
    for j in range(n):
        live = (lo_at[:n] <= lo_at[j]) & (hi_at[:n] >= lo_at[j]) & (owner[:n] != owner[j])
        assert not np.any(live & (off[:n] < end[j]) & (end[:n] > off[j])), f"overlap at node {lo_at[j]}"
    return top


def plan_args(ap: argparse.ArgumentParser) -> None:
    """The GPT and plan flags (pstar-fx-plan's names) that `planned` reads."""
    ap.add_argument("--layers", type=int, default=54)
    ap.add_argument("--d-model", type=int, default=5120)
    ap.add_argument("--heads", type=int, default=40)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--machine", default="h200", choices=["h200", "h100"])
    ap.add_argument("--device-memory", default="136.6GiB")
    ap.add_argument("--prefetch", type=int, default=None,
                    help="px.compile's prefetch: nodes a fetch may move earlier (default: as far as the room allows)")
    ap.add_argument("--no-atomic", action="store_true")
    ap.add_argument("--host-memory", default=None, help="px.plan's host_memory (sizes the undo buffers; default: none)")


def planned(args):
    """pstar-fx-plan's GPT planned unfused for one GPU (`plan_args`' flags): the final graph (SystemExit where it
    does not fit)."""
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab=50304, seq=args.seq, layers=args.layers, hidden=args.d_model, heads=args.heads))
    tokens = ((args.batch, args.seq), torch.long)
    report = px.plan(model, gpt_loss, tokens, tokens, device_memory=args.device_memory, gpus_per_node=1,
                     machine=args.machine, atomic=not args.no_atomic, prefetch=args.prefetch, fuse=False,
                     host_memory=args.host_memory)
    if report.graph is None:
        raise SystemExit(f"the model does not fit the budget\n{report}")
    return report.graph


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    plan_args(ap)
    ap.add_argument("--order", default="size,start,breadth", help="the placement orders to try (see `ordered`)")
    ap.add_argument("--min-bytes", type=float, default=0, help="place only buffers of at least this many bytes")
    args = ap.parse_args()
    min_bytes, orders = int(args.min_bytes), args.order.split(",")
    t0 = time.perf_counter()
    g = planned(args)
    plan_s = time.perf_counter() - t0
    buffers, peak = buffers_of(g)
    big = [b for b in buffers if b.size >= min_bytes]
    small_peak = 0
    if min_bytes:
        delta = [0] * (len(g.nodes) + 1)
        for b in buffers:
            if b.size < min_bytes:
                for s, e in b.spans:
                    delta[s] += _aligned(b.size)
                    delta[e + 1] -= _aligned(b.size)
        acc = 0
        for d in delta:
            acc += d
            small_peak = max(small_peak, acc)
    alive = [0] * (len(g.nodes) + 1)
    for b in buffers:
        for s, e in b.spans:
            alive[s] += b.size
            alive[e + 1] -= b.size
    most = max(itertools.accumulate(alive))
    assert most == peak, (most, peak)          # the buffers are what the plan counts
    print(f"planned in {plan_s:.1f} s; {len(g.nodes)} nodes; {len(buffers)} buffers, {len(big)} placed "
          f"(at least {min_bytes} bytes)")
    print(f"the plan's peak:        {peak / GiB:9.3f} GiB (budget {g.settings.budget / GiB:.3f} GiB)")
    for how in orders:
        t1 = time.perf_counter()
        arena = place(big, len(g.nodes), how)
        print(f"the arena, {how + ' first:':13s} {arena / GiB:9.3f} GiB ({(arena - peak) / GiB:+.3f} GiB against the "
              f"peak; placed in {time.perf_counter() - t1:.1f} s)")
    if min_bytes:
        print(f"left to torch (smaller): at most {small_peak / GiB:.3f} GiB alive at once")
    by_kind: dict[str, list[int]] = {}
    for b in buffers:
        kind = b.what.split(" ")[0]
        by_kind.setdefault(kind, []).append(b.size)
    for kind, sizes in sorted(by_kind.items()):
        print(f"  {kind:10s} {len(sizes):6d} buffers, largest {max(sizes) / 2**20:9.1f} MiB, "
              f"{sum(s >= 2**20 for s in sizes)} of at least 1 MiB")


if __name__ == "__main__":
    main()
