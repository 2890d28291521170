"""benchmarks/alloc_sim.py's model of torch's caching allocator with expandable segments: best fit, splitting,
merging, mapping by pages within a cap, and the retry that unmaps every free block's whole pages. The device pool's
policy on CUDA (docs/memory.md) rests on its counts."""
import os
import sys

import pytest
from hypothesis import given, strategies as st

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import alloc_sim  # noqa: E402
from alloc_sim import MiB, OutOfMemory, Torch  # noqa: E402

PAGE = 20 * MiB          # the large pool's page


def _mapped(t: Torch) -> int:
    return t.small.check() + t.large.check()


def test_best_fit_splits_and_merges():
    t = Torch(cap=1000 * MiB)
    a, b, c = (t.malloc(n * MiB) for n in (30, 50, 30))
    assert [h[1].addr for h in (a, b, c)] == [0, 30 * MiB, 80 * MiB]       # one run, mapped page by page
    assert t.dev.mapped == 120 * MiB == _mapped(t)                          # 110 MiB asked: 6 pages
    t.free(b)
    d = t.malloc(20 * MiB)                         # the 50 MiB hole is the smallest that holds it: split there
    assert d[1].addr == 30 * MiB and d[1].size == 20 * MiB and d[1].next.state == alloc_sim.FREE
    t.free(a)
    t.free(d)                                      # a, d and the rest of b's hole merge into one free block
    e = t.malloc(80 * MiB)
    assert e[1].addr == 0 and t.dev.mapped == 120 * MiB and t.dev.retries == 0


def test_fragments_that_hold_no_request_make_a_retry_that_unmaps_whole_pages():
    t = Torch(cap=120 * MiB)
    kept, holes = [], []
    for _ in range(3):                             # kept 10 MiB, then a 30 MiB hole: 120 MiB mapped, 90 free
        kept.append(t.malloc(10 * MiB))
        holes.append(t.malloc(30 * MiB))
    for h in holes:
        t.free(h)
    assert t.dev.mapped == 120 * MiB and t.dev.retries == 0
    with pytest.raises(OutOfMemory):
        t.large._malloc(40 * MiB)                  # no free block of 40 MiB, no page left under the cap
    big = t.malloc(40 * MiB)                       # the retry unmaps the holes' whole pages (20-40, 60-80, 100-120)
    assert t.dev.retries == 1
    assert big[1].addr == 90 * MiB and t.dev.mapped == 100 * MiB == _mapped(t)   # 90-100 free, 100-140 mapped anew
    for h in kept:
        assert h[1].state == alloc_sim.ALLOC


def test_small_requests_use_the_small_pool():
    t = Torch(cap=100 * MiB)
    h = t.malloc(4096)
    assert h[0] is t.small and t.dev.mapped == 2 * MiB


def test_slots_in_a_pool_of_their_own_share_the_cap_and_not_the_free_pages():
    t = Torch(cap=100 * MiB)
    t.own_slot_pool()
    slot = t.malloc_slot(60 * MiB)
    assert slot[0] is t.slots and t.dev.mapped == 60 * MiB
    t.free(slot)                                   # 60 MiB free in the slots' segment, still mapped
    act = t.malloc(60 * MiB)                       # the activations' segment cannot use them: a retry unmaps them
    assert act[0] is t.large and t.dev.retries == 1 and t.dev.mapped == 60 * MiB
    assert sum(p.check() for p in t.dev.pools) == t.dev.mapped


@given(st.lists(st.tuples(st.booleans(), st.integers(1, 64 * MiB)), min_size=1, max_size=60))
def test_the_model_keeps_its_invariants(ops):
    """Any sequence of allocations and frees: blocks tile the range, the free list is the free blocks, unmapped
    blocks are whole pages, mapped bytes stay within the cap; a request fails only where the cap cannot hold it."""
    t = Torch(cap=256 * MiB)
    live = []
    for alloc, n in ops:
        if alloc or not live:
            try:
                live.append((t.malloc(n), n))
            except OutOfMemory:
                assert sum(m for _, m in live) + n > 256 * MiB - 4 * PAGE   # (pages and rounding aside)
        else:
            t.free(live.pop(n % len(live))[0])
        assert _mapped(t) == t.dev.mapped <= t.dev.cap
    ends = sorted((h[1].addr, h[1].addr + h[1].size, h[0] is t.small) for h, _ in live)
    for (lo, hi, small), (lo2, _, small2) in zip(ends, ends[1:]):
        assert small != small2 or hi <= lo2                 # no two live blocks of one pool overlap


def test_the_replay_runs_a_planned_step_under_both_pool_policies():
    """simulate() on a small GPT planned with no room for the allocator beyond its budget: three steps under each
    pool policy (and with the cache emptied at each step's start), every retry at a node of the graph, the same count
    in the steady steps, and the model's invariants checked after each step (inside simulate)."""
    import argparse
    ap = argparse.ArgumentParser()
    alloc_sim.plan_args(ap)
    args = ap.parse_args(["--layers", "2", "--d-model", "256", "--heads", "4", "--batch", "2", "--seq", "256",
                          "--device-memory", "400MiB"])
    g = alloc_sim.planned(args)
    counts = {}
    for keep, empty in (("room", False), ("none", False), ("none", True)):    # and torch's cache emptied at each
        per_step = alloc_sim.simulate(g, g.settings.budget, 3, keep=keep, empty=empty)    # step's start
        assert len(per_step) == 3
        for retries in per_step:
            assert all(0 <= i < len(g.nodes) and g.nodes[i].name == name and asked > 0 for i, name, asked in retries)
        counts[keep, empty] = [len(r) for r in per_step]
        assert counts[keep, empty][1] == counts[keep, empty][2], counts       # the steady state repeats
    # the free list kept to each node's room retries where keeping none does not (as at 10-17B, replayed)
    assert counts["room", False][1] > counts["none", False][1], counts


@pytest.mark.parametrize("divisions, asked, served", [
    (4, 1200 * MiB, 1280 * MiB),       # between 1024 and 2048 MiB in steps of 256
    (4, 1024 * MiB, 1024 * MiB),       # a power of two stays
    (8, 600 * MiB, 640 * MiB),         # between 512 and 1024 in steps of 64
    (8, 3000, 3072),                   # at most 512 x 8 bytes: only to 512
    (0, 1200 * MiB + 1, 1200 * MiB + 512),
])
def test_roundup_follows_torchs_power2_divisions(divisions, asked, served):
    t = Torch(cap=4096 * MiB)
    t.divisions = divisions
    assert t.malloc(asked)[1].size == served
