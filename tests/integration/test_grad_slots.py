"""Gradient slots are zeroed lazily (ChunkStore.alloc): what gradient writes copy into is never zeroed, the rest is
zeroed at the slot's first other use, and a range added to before any copy is zeroed first. Whatever the slot held
before (a reused block) never reaches a gradient."""
import torch

from pstar_fx.ir import BufKind
from pstar_fx.ir.needs import BufKey

from harness import compiled_step, small_batches, tight_budget, two_layer_store
from models import CASES_BY_NAME


def _store():
    store = two_layer_store()
    store.evict_all()
    return store


def test_an_allocated_gradient_slot_is_zero_wherever_no_write_copied_into_it():
    store = _store()
    key = BufKey(0, BufKind.GRAD)
    numel, dtype = store.slot_spec(key)
    junk = store.pool.take(numel, dtype)
    junk.fill_(float("nan"))                 # what a reused block may hold
    store.pool.give(junk)
    store.alloc(key)
    assert store.slots[key].data_ptr() == junk.data_ptr(), "the allocation should reuse the listed block"
    store.grad_part(key, 10, 5, accumulate=False).copy_(torch.arange(5.0))
    store.grad_part(key, 100, 4, accumulate=True).add_(torch.ones(4))     # added to before any copy
    store.grad_part(key, 10, 5, accumulate=True).add_(1.0)                # a second write of the same range
    expect = torch.zeros(numel, dtype=dtype)
    expect[10:15] = torch.arange(5.0) + 1
    expect[100:104] = 1.0
    assert torch.equal(store.slot(key), expect)
    assert not store._unzeroed, "the first other use zeroes the rest once"
    store.release(key, writeback=False)


def test_a_gradient_slot_dropped_before_any_use_leaves_nothing_pending():
    store = _store()
    key = BufKey(0, BufKind.GRAD)
    store.alloc(key)
    store.grad_part(key, 0, 3, accumulate=False).copy_(torch.ones(3))
    store.drop_slots()
    assert not store._unzeroed and key not in store.slots


def test_training_on_slots_full_of_nans_equals_training_on_clean_ones():
    """Under a budget that allocates gradient slots every micro-batch, with every slot the pool hands out filled
    with NaN first (what a reused block may hold), training equals the same training on clean slots, bit for bit."""
    case = small_batches(CASES_BY_NAME["gpt_tied"])
    budget = tight_budget(case, 1024, 1.3)
    clean, dirty = (compiled_step(case, budget=budget, chunk_size=1024) for _ in range(2))
    losses = {"clean": [clean(*case.batch(0)).item()], "dirty": [dirty(*case.batch(0)).item()]}
    pool = dirty._compiler.store.pool
    take, handed = pool.take, []

    def dirty_take(numel, dtype, what="slot"):
        t = take(numel, dtype, what)
        handed.append(t.fill_(float("nan")))
        return t

    pool.take = dirty_take             # an instance attribute of the test's own pool object
    for i in range(1, 4):
        losses["clean"].append(clean(*case.batch(i)).item())
        losses["dirty"].append(dirty(*case.batch(i)).item())
    assert handed, "the budget should allocate slots every step"
    assert losses["clean"] == losses["dirty"], losses
    assert all(torch.equal(a, b) for a, b in zip(clean.state_dict().values(), dirty.state_dict().values()))
