"""Host memory: mapped zero buffers, and buffers reserved on a set-up thread while the schedule pass runs."""
import pytest
import torch

import pstar_fx as px
from pstar_fx.ir import StateHome
from pstar_fx.runtime.chunk_store import host_buffer_specs
from pstar_fx.runtime.host_memory import MAPPED_MIN_BYTES, BufferSpec, HostMemory, zeroed

from harness import HYPER, tight_budget
from models import CASES_BY_NAME


@pytest.mark.parametrize("numel", [7, MAPPED_MIN_BYTES // 4 + 3])
def test_zeroed_buffers_are_zero_and_writable(numel):
    t = zeroed(numel, torch.float32)
    assert t.shape == (numel,) and t.dtype is torch.float32 and not t.any()
    t.fill_(2.5)
    assert t.sum().item() == 2.5 * numel


def test_reserved_buffers_are_taken_by_key_and_the_rest_given_back():
    mem = HostMemory(pin=False)
    specs = [BufferSpec(("states", 0), MAPPED_MIN_BYTES, torch.float32, False),
             BufferSpec(("param", 1), 1000, torch.bfloat16, True),
             BufferSpec(("grad", 2), 10, torch.bfloat16, True)]
    mem.reserve(specs)
    a = mem.zeros(MAPPED_MIN_BYTES, torch.float32, copied=False, key=("states", 0))
    assert a.numel() == MAPPED_MIN_BYTES and not a.any()
    b = mem.zeros(999, torch.bfloat16, key=("param", 1))         # not what was reserved: a fresh buffer
    assert b.numel() == 999 and not b.any()
    c = mem.zeros(5, torch.float32, key=("param", 7))            # never reserved
    assert c.numel() == 5
    assert set(mem._reserved) == {("grad", 2)}
    mem.release_unclaimed()
    assert not mem._reserved


def test_reserved_buffers_do_not_overlap():
    mem = HostMemory(pin=False)
    specs = [BufferSpec(("param", i), 1000 + 37 * i, torch.bfloat16 if i % 2 else torch.float32, i % 3 > 0)
             for i in range(12)]
    mem.reserve(specs)
    bufs = [mem.zeros(sp.numel, sp.dtype, copied=sp.copied, key=sp.key) for sp in specs]
    assert mem.taken == len(specs)
    for i, b in enumerate(bufs):
        b.fill_(i + 1)
    for i, b in enumerate(bufs):
        assert (b == i + 1).all() and b.numel() == specs[i].numel and b.dtype is specs[i].dtype
        assert b.data_ptr() % 64 == 0          # (a page of its own within its arena)


def test_a_failed_reservation_raises_where_its_buffers_are_asked_for():
    mem = HostMemory(pin=False)
    mem.reserve([BufferSpec(("param", 0), -(1 << 40), torch.float32, True)])   # a negative size fails on the thread
    with pytest.raises((RuntimeError, ValueError, OverflowError)):
        mem.zeros(4, torch.float32, key=("param", 0))


def test_a_cancelled_reservation_gives_its_buffers_back():
    mem = HostMemory(pin=False)
    mem.reserve([BufferSpec(("param", i), 100, torch.float32, True) for i in range(50)])
    mem.cancel()
    assert not mem._reserved and not mem._reserving.is_alive()


def test_the_store_takes_the_buffers_reserved_during_the_schedule_pass():
    """A first compile reserves the host-stepped chunks' buffers once the optimizer is placed; the store takes each
    (nothing is left unclaimed) and training is unchanged (the equivalence tests cover values)."""
    case = CASES_BY_NAME["gpt_tied"]
    step = px.compile(case.build_model(), optimizer=px.AdamW(**HYPER), device="cpu", precision="bf16",
                      chunk_size=1024, device_memory=tight_budget(case, 1024, 1.3))(case.loss_fn)
    step(*case.batch(0))
    store = step._store
    placed = step.graphs["optimizer_placed"]
    specs = host_buffer_specs(placed.chunks, step.settings.precision, 1)
    assert any(c.state_home is StateHome.HOST for c in placed.chunks)
    assert store.hostmem._reserving is not None and not store.hostmem._reserved
    assert store.hostmem.taken == len(specs)
    for spec in specs:
        kind, cid = spec.key
        held = {"param": store.host_param, "states": store.states, "grad": store.host_grad}[kind][cid]
        assert held is not None and held.numel() == spec.numel and held.dtype is spec.dtype
