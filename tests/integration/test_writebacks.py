"""Released slots whose write-back is still in flight ("draining"): the compute stream does not wait for the copy at
the release; the slot stays counted by the pool until reclaim gives it back, where the executor needs its room."""
import time

import pytest
import torch
import torch.nn as nn

import pstar_fx as px
from pstar_fx.ir import BufKind
from pstar_fx.ir.needs import BufKey

from harness import eager_run, host_params, rel_err, two_layer_store
from models import Case, Stack, assert_state_close

pytestmark = pytest.mark.cuda


class _Done:
    """An event whose copy has finished (query() is True): reclaim gives its slot back without a CUDA call."""

    def query(self):
        return True


def test_reclaim_gives_back_oldest_first_until_the_room_is_left():
    store = two_layer_store()
    pool = store.pool
    base = pool.in_use
    slots = [pool.take(1000 * (i + 1), torch.float32) for i in range(3)]     # 4, 8 and 12 kB
    for s in slots:
        store.draining.append((_Done(), s))
        store.draining_bytes += s.numel() * 4
    assert pool.in_use == base + 24_000
    store.reclaim(keep=20_000)             # the oldest (4 kB) goes: 20 kB left
    assert [s.numel() for _, s in store.draining] == [2000, 3000] and store.draining_bytes == 20_000
    assert pool.in_use == base + 20_000
    store.reclaim(keep=12_000)             # 8 kB more
    assert store.draining_bytes == 12_000 and pool.in_use == base + 12_000
    store.reclaim()                        # the end of a step: all of them
    assert not store.draining and store.draining_bytes == 0 and pool.in_use == base


class _InFlight:
    """An event whose copy has not finished."""

    def query(self):
        return False


def test_a_finished_draining_slot_of_the_size_taken_next_is_reused_without_waiting():
    """Where the free list has no slot of the size the next node takes, reclaim first gives back a draining slot of
    that size whose write-back is done (the take then reuses it rather than allocating from torch); one whose copy
    is in flight stays draining (nothing waits for it), and so does every slot the room lets stay."""
    store = two_layer_store()
    pool = store.pool
    size = (3000, torch.float32)
    old, busy, done = pool.take(1000, torch.float32), pool.take(*size), pool.take(*size)
    for event, s in ((_Done(), old), (_InFlight(), busy), (_Done(), done)):
        store.draining.append((event, s))
        store.draining_bytes += s.numel() * 4
    before = pool.in_use
    store.reclaim(keep=store.draining_bytes, want=size)     # the room lets every slot stay
    assert [s for _, s in store.draining] == [old, busy] and store.draining_bytes == 16_000
    assert pool.in_use == before - 12_000
    taken = pool.take(*size)
    assert taken.data_ptr() == done.data_ptr(), "the take should reuse the finished slot"
    assert not pool.free.get(size)
    store.reclaim(keep=store.draining_bytes, want=size)     # only the in-flight one is of that size: it stays
    assert [s for _, s in store.draining] == [old, busy]
    store.draining[1] = (_Done(), busy)                     # its copy finishes: the end of the step takes all
    store.reclaim()
    assert not store.draining and store.draining_bytes == 0


def test_without_pinned_memory_a_write_back_is_done_at_its_release():
    """On the CPU the copy is synchronous: nothing drains, the slot goes back at once."""
    store = two_layer_store()
    store.evict_all()                      # the step left its chunks resident (carried)
    key = BufKey(0, BufKind.PARAM)
    store.fetch(key)
    before = store.pool.in_use
    store.slot(key).add_(1.0)
    expect = store.slot(key).clone()
    store.release(key, writeback=True, defer=True)
    assert not store.draining and store.pool.in_use < before
    assert torch.equal(store.host(key), expect)


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
def test_a_deferred_release_lets_compute_run_past_its_write_back():
    """With the D2H stream held up, a deferred release returns at once, the compute stream runs on (an event
    recorded after the release completes while the copy has not), the slot stays counted until reclaim, and the
    host gets what compute wrote last."""
    d = 1024
    W = nn.Sequential(nn.Linear(d, d, bias=False), nn.Linear(d, d, bias=False))
    step = px.compile(W, optimizer=px.AdamW(lr=1e-3), device="cuda", precision="fp32",
                      chunk_size=d * d)(lambda m, x: m(x).sum())
    step(torch.randn(8, d))
    store = step._compiler.store
    store.evict_all()
    torch.cuda.synchronize()
    key = BufKey(0, BufKind.PARAM)
    store.pool.budget = None
    store.fetch(key)
    store.slot(key).add_(1.0)
    expect = store.slot(key).cpu()
    in_use = store.pool.in_use
    with torch.cuda.stream(store.d2h_stream):
        torch.cuda._sleep(400_000_000)                     # the D2H stream is busy for a while
    t0 = time.perf_counter()
    store.release(key, writeback=True, defer=True)
    assert time.perf_counter() - t0 < 0.02
    after = torch.cuda.Event()
    after.record()
    after.synchronize()                                    # compute did not wait for the copy
    assert store.d2h_stream.query() is False, "the write-back should still be queued behind the sleep"
    assert store.pool.in_use == in_use and store.draining_bytes == d * d * 4
    store.reclaim()
    assert not store.draining and store.pool.in_use == in_use - d * d * 4
    store.before_host_write(0)
    assert torch.equal(store.host(key), expect)


@cuda
@pytest.mark.parametrize("slack", [1.0, 1.5])
def test_deferred_write_backs_keep_the_plan_and_eager_values(slack):
    """Under the least budget (and a looser one, where slots can drain longer) with debug=True: the bytes the plan
    counts equal the measured ones at every node, the device never holds more than the plan's peak, and training
    equals eager to 1e-6 over 4 steps."""
    d, n, steps = 2048, 8, 4
    gen = torch.Generator().manual_seed(6)
    batches = [(torch.randn(512, d, generator=gen),) for _ in range(steps)]
    fn = lambda m, x: m(x).pow(2).mean()   # noqa: E731
    make = lambda budget: px.compile(Stack(d, n, seed=5), optimizer=px.AdamW(lr=1e-3), device="cuda",  # noqa: E731
                                     precision="fp32", chunk_size=d * d, device_memory=budget, debug=True)(fn)
    step = make(int(make(None).min_device_memory(*batches[0]) * slack))
    losses = [step(*b).item() for b in batches]
    g = step.graphs["scheduled"]
    assert g.plan.d2h_bytes > 0, "the budget should make the step write chunks back"
    assert step.last_step.measured_peak <= g.plan.predicted_peak
    case = Case("stack_wb", lambda: Stack(d, n, seed=5), fn, lambda i, gen: batches[i])
    ref_losses, ref_sd = eager_run(case, steps, hyper=dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                                                           weight_decay=1e-2), host_params=host_params(step))
    assert rel_err(losses, ref_losses) <= 1e-6, (losses, ref_losses)
    assert_state_close(step.state_dict(), ref_sd, rtol=1e-6)
