"""Host memory: mapped zero buffers, and buffers reserved on a set-up thread while the schedule pass runs."""
import pytest
import torch

import pstar_fx as px
from pstar_fx.ir import StateHome
from pstar_fx.optim import ADAM_STATE
from pstar_fx.runtime.host_buffers import host_buffer_specs
from pstar_fx.runtime.host_memory import MAPPED_MIN_BYTES, BufferSpec, HostMemory, zeroed

from harness import HYPER, tight_budget
from models import CASES_BY_NAME

pytestmark = pytest.mark.cuda


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
    store = step._compiler.store
    placed = step.graphs["optimizer_placed"]
    specs = host_buffer_specs(placed.chunks, step.settings.precision, 1, ADAM_STATE)
    assert any(c.state_home is StateHome.HOST for c in placed.chunks)
    assert store.hostmem._reserving is not None and not store.hostmem._reserved
    assert store.hostmem.taken == len(specs)
    for spec in specs:
        kind, cid = spec.key
        held = {"param": store.host_param, "states": store.states, "grad": store.host_grad}[kind][cid]
        assert held is not None and held.numel() == spec.numel and held.dtype is spec.dtype


def _wait_touched(mem, timeout=30.0):
    import time
    t0 = time.monotonic()
    while mem._pool_touched < mem._pool_target and time.monotonic() - t0 < timeout:
        time.sleep(0.01)
    assert mem._pool_touched == mem._pool_target


def _inside(t, pool):
    lo = pool.data_ptr()
    return lo <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size() <= lo + pool.numel()


def test_a_prefaulted_pool_holds_the_reserved_buffers_and_gives_back_what_they_do_not_need():
    mem = HostMemory(pin=False)
    mem.prefault(64 << 20)
    _wait_touched(mem)                    # faulted in ahead of the plan, as at the end of a long trace
    specs = [BufferSpec(("states", 0), 1 << 20, torch.float32, False),
             BufferSpec(("param", 0), 3000, torch.bfloat16, True),
             BufferSpec(("grad", 0), 3000, torch.bfloat16, True),
             BufferSpec(("states", 1), 5000, torch.float32, False)]
    mem.reserve(specs)
    bufs = [mem.zeros(sp.numel, sp.dtype, copied=sp.copied, key=sp.key) for sp in specs]
    pool = mem._pool
    assert mem.taken == len(specs) and all(_inside(b, pool) for b in bufs) and not mem.arena_seconds
    for i, b in enumerate(bufs):
        assert not b.any()
        b.fill_(i + 1)
    for i, b in enumerate(bufs):
        assert (b == i + 1).all()
    # the copied buffers come first (so that one range of the pool is pinned), each on pages of its own
    assert bufs[1].data_ptr() == pool.data_ptr() and bufs[2].data_ptr() == pool.data_ptr() + 4096 * 2
    used = 4096 * 2 * 2 + (4 << 20) + 4096 * 5
    assert mem.pool_given_back == (64 << 20) - used
    mem.release_unclaimed()


def test_buffers_that_do_not_fit_the_pool_get_arenas_and_the_pool_keeps_what_the_plan_needs():
    mem = HostMemory(pin=False)
    mem.prefault(3 << 20)
    specs = [BufferSpec(("states", i), 1 << 19, torch.float32, False) for i in range(3)]     # 2 MiB each
    specs.append(BufferSpec(("param", 9), 100, torch.float32, True))
    mem.reserve(specs)
    bufs = {sp.key: mem.zeros(sp.numel, sp.dtype, copied=sp.copied, key=sp.key) for sp in specs}
    in_pool = {k for k, b in bufs.items() if _inside(b, mem._pool)}
    assert in_pool == {("param", 9), ("states", 0)}
    assert [kind for kind, _ in mem.arena_seconds] == [2 * (2 << 20)]     # the two states that did not fit
    # whatever the thread had faulted in by then, what it keeps is what the buffers in it need
    assert mem._pool_touched - mem.pool_given_back == 4096 + (2 << 20)
    for i, b in enumerate(bufs.values()):
        b.fill_(i + 1)
    assert [int(b[0]) for b in bufs.values()] == [1, 2, 3, 4]


def test_a_prefault_that_no_reservation_uses_stops_and_is_given_back():
    mem = HostMemory(pin=False)
    mem.prefault(256 << 20)
    mem.release_unclaimed()               # what the store does: no layout came, so the thread stops
    assert not mem._reserving.is_alive() and mem._pool is None
    mem = HostMemory(pin=False)
    mem.prefault(256 << 20)
    mem.cancel()                          # compiling failed
    assert not mem._reserving.is_alive() and mem._pool is None


def test_early_host_bytes_is_zero_where_the_budget_holds_every_state():
    from pstar_fx.ir import ParamInfo, Precision
    from pstar_fx.ir.needs import early_host_bytes
    params = [ParamInfo("w", (1000, 100), torch.float32, True), ParamInfo("b", (7,), torch.float32, True),
              ParamInfo("frozen", (50, 50), torch.float32, False)]
    n = 100_007
    assert early_host_bytes(params, Precision.FP32, 1, None, ADAM_STATE) == 0
    assert early_host_bytes(params, Precision.FP32, 1, 8 * n, ADAM_STATE) == 0
    assert early_host_bytes(params, Precision.FP32, 1, 8 * n - 1, ADAM_STATE) == 8 * n + 2 * 4 * n
    assert early_host_bytes(params, Precision.BF16, 1, 10, ADAM_STATE) == 12 * n + 2 * 2 * n
    per_rank = 50_000 + 4            # each parameter's shard, rounded up
    assert early_host_bytes(params, Precision.BF16, 2, 10, ADAM_STATE) == 12 * per_rank + 2 * 2 * per_rank


def _mlp_case():
    from models import Case
    import torch.nn as nn

    def batch(step, gen):
        x = torch.randn(8, 256, generator=gen)
        return x, torch.randn(8, 256, generator=gen)
    return Case("mlp_prefault", lambda: nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256)),
                lambda m, x, y: torch.nn.functional.mse_loss(m(x), y), batch)


def test_a_first_compile_lays_its_host_buffers_out_in_memory_faulted_in_while_it_traced():
    """A budget below the optimizer states: the compile prefaults host memory before tracing, the store's host
    buffers are views of it, and training equals eager AdamW (host-stepped chunks on fp32 copies) on random data."""
    from harness import compiled_run, eager_run, host_params, rel_err
    from models import assert_state_close
    case = _mlp_case()
    budget = tight_budget(case, 1 << 16, 1.3)
    losses, sd, step = compiled_run(case, 3, budget=budget, chunk_size=1 << 16)
    mem = step._compiler.store.hostmem
    assert budget < 8 * sum(p.numel() for p in case.build_model().parameters())
    assert mem._pool is not None and mem.pool_seconds > 0
    specs = host_buffer_specs(step.graphs["optimizer_placed"].chunks, step.settings.precision, 1,
                              ADAM_STATE)
    assert specs and mem.taken == len(specs)
    store = step._compiler.store
    host_states = [t for t, home in zip(store.states, store.state_home) if home is StateHome.HOST]
    # the estimate counts parameters, not the chunks' padding: what did not fit the pool got an arena
    assert sum(_inside(t, mem._pool) for t in host_states) >= 2
    ref_losses, ref_sd = eager_run(case, 3, host_params=host_params(step))
    assert rel_err(losses, ref_losses) <= 1e-6, (losses, ref_losses)
    assert_state_close(sd, ref_sd, rtol=1e-6)


def _resident_fraction(t: torch.Tensor) -> float:
    """Of the pages under t, the fraction present in memory (mincore)."""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    page = 4096
    lo = t.data_ptr() // page * page
    hi = t.data_ptr() + t.numel() * t.element_size()
    n = -(-(hi - lo) // page)
    vec = (ctypes.c_ubyte * n)()
    assert libc.mincore(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), vec) == 0, ctypes.get_errno()
    return sum(v & 1 for v in vec) / n


@pytest.mark.parametrize("threads", [None, 1, 3])
def test_touch_faults_every_page_of_a_fresh_mapping_in_and_leaves_it_zero(threads):
    from pstar_fx.runtime.host_memory import _mapping, touch
    n = (24 << 20) + 12345
    t = torch.frombuffer(_mapping(n), dtype=torch.uint8, count=n)
    assert _resident_fraction(t) < 0.5
    touch(t, threads)
    assert _resident_fraction(t) == 1.0 and not t.any()
    touch(t[:0])                                  # nothing to do


def test_compiling_runs_on_one_intra_op_thread_and_set_up_keeps_its_threads():
    """While a step is traced and planned the compiling thread's torch ops run on one intra-op thread (its setting
    restored after, also on an error), and the host set-up thread faults memory in on the threads counted before."""
    import threading
    from pstar_fx.api.compiler import one_intra_op_thread
    from pstar_fx.runtime.host_memory import HostMemory
    n = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        hm = HostMemory(pin=False)
        seen = {}
        with one_intra_op_thread():
            seen["inside"] = torch.get_num_threads()
            t = threading.Thread(target=lambda: seen.setdefault("new thread", torch.get_num_threads()))
            t.start()
            t.join()
        assert seen == {"inside": 1, "new thread": 1} and torch.get_num_threads() == 4
        assert hm._threads == 2            # four less two, counted before, whichever thread touches
        with pytest.raises(ValueError), one_intra_op_thread():
            raise ValueError
        assert torch.get_num_threads() == 4
    finally:
        torch.set_num_threads(n)


def test_the_pools_copied_buffers_are_pinned_while_the_rest_of_it_is_faulted_in(monkeypatch):
    """Once the plan's layout is known and the pool's copied buffers (its first bytes) are faulted in, they are
    pinned on a thread of their own while the set-up thread faults in the rest, not after it."""
    import threading
    from pstar_fx.runtime import host_memory
    pinned = []

    class Recording(HostMemory):
        def _pin(self, t):
            pinned.append((threading.current_thread().name, t.data_ptr(), t.numel(), self._pool_touched))
            return t
    reserved, real_touch = threading.Event(), host_memory.touch
    monkeypatch.setattr(host_memory, "POOL_PIECE", 1 << 20)
    monkeypatch.setattr(host_memory, "touch", lambda t, threads=None: (reserved.wait(30), real_touch(t, threads)))
    mem = Recording(pin=True)
    mem.prefault(16 << 20)
    specs = [BufferSpec(("param", 0), 2000, torch.bfloat16, True),
             BufferSpec(("grad", 0), 2000, torch.bfloat16, True),
             BufferSpec(("states", 0), 2 << 20, torch.float32, False)]
    mem.reserve(specs)
    reserved.set()
    bufs = [mem.zeros(sp.numel, sp.dtype, copied=sp.copied, key=sp.key) for sp in specs]
    assert mem.taken == 3 and not any(b.any() for b in bufs)
    pool_end = 2 * 4096 + (8 << 20)
    (thread, ptr, n, touched), = pinned
    assert thread == "pstar-fx host pinning" and ptr == mem._pool.data_ptr() and n == 2 * 4096
    assert touched < pool_end == mem.pool_touched       # pinned before the pool was faulted in to its end


def test_a_pinning_failure_raises_where_the_buffers_are_asked_for(monkeypatch):
    class Failing(HostMemory):
        def _pin(self, t):
            raise RuntimeError("cudaHostRegister exploded")
    from pstar_fx.runtime import host_memory
    monkeypatch.setattr(host_memory, "POOL_PIECE", 1 << 20)
    mem = Failing(pin=True)
    mem.prefault(8 << 20)
    mem.reserve([BufferSpec(("param", 0), 2000, torch.bfloat16, True),
                 BufferSpec(("states", 0), 1 << 20, torch.float32, False)])
    with pytest.raises(RuntimeError, match="exploded"):
        mem.zeros(2000, torch.bfloat16, key=("param", 0))


@pytest.mark.parametrize("stage_elems, skip", [(300, 1), (1, 0), (1000, 0), (2, 1)])
def test_staged_copy_copies_through_a_small_stage_of_another_dtype(stage_elems, skip):
    """StoreValues.load_params copies a device's value into a pageable host master through the chunk's pinned home
    (bf16: half an fp32 element per element), piece by piece; here on host tensors, with a stage too small for the
    value, misaligned for fp32 (skip), or too small for one element (a direct copy)."""
    from pstar_fx.runtime.store_values import staged_copy
    src = torch.randn(1001, generator=torch.Generator().manual_seed(0))
    dst = torch.full((1001,), float("nan"))
    stage = torch.zeros(stage_elems + skip, dtype=torch.bfloat16)[skip:]
    staged_copy(dst, src, stage)
    assert torch.equal(dst, src)
