"""CUDA-only runtime checks, run on the GPU machine with PSTAR_TEST_DEVICE=cuda by `pytest -m cuda`
(skipped, and reported as skipped, on a machine without CUDA)."""
import time

import pytest
import torch
import torch.nn as nn

import pstar_fx as px
from pstar_fx.ir import BufKind
from pstar_fx.ir.needs import BufKey

from harness import eager_run, fetch_counts, host_params, rel_err
from models import Case, Stack, assert_state_close

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


class _DetachedReuse(nn.Module):
    """W is read again (detached) in backward after its gradient is final, so under a tight budget its chunk is
    fetched again right before a host-side optimizer step of that chunk."""

    def __init__(self, d):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.W0 = nn.Parameter(torch.randn(d, d, generator=g) / d ** 0.5)
        self.W = nn.Parameter(torch.randn(d, d, generator=g) / d ** 0.5)

    def forward(self, x):
        return torch.relu(torch.relu(x @ self.W0) @ self.W.detach()) @ self.W


def test_host_step_waits_for_copies_still_reading_its_host_buffer():
    """A host-side step must not write a host buffer that an async host->device copy is still reading."""
    d = 4096
    x = torch.randn(64, d, generator=torch.Generator().manual_seed(1))
    fn = lambda m, x: m(x).pow(2).mean()   # noqa: E731
    make = lambda budget: px.compile(_DetachedReuse(d), optimizer=px.AdamW(lr=1e-2), device="cuda",  # noqa: E731
                                     precision="fp32", chunk_size=d * d, device_memory=budget)(fn)
    step = make(int(make(None).min_device_memory(x)))
    losses = [step(x).item() for _ in range(3)]
    assert host_params(step), "the budget should put some optimizer states on the host"

    case = Case("detached_reuse", lambda: _DetachedReuse(d), fn, lambda i, gen: (x,))
    ref_losses, ref_sd = eager_run(case, 3, hyper=dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8,
                                                                             weight_decay=1e-2),
                                   host_params=host_params(step))
    assert losses == pytest.approx(ref_losses, rel=1e-6)
    assert_state_close(step.state_dict(), ref_sd, rtol=1e-6)


def test_large_model_at_least_budget_matches_eager_over_steps():
    """Copies on their own streams, each ordered by events only: a missing wait (compute reading a slot before its
    fetch lands, a write-back copied before compute's last write, the CPU stepping on a gradient still in flight, a
    slot reused while a copy reads it) shows up as a wrong value here. 8 chunks of 16 MiB (~0.3 ms per copy) under
    the least budget, 4 steps, fp32, against eager to 1e-6."""
    d, n, steps = 2048, 8, 4
    gen = torch.Generator().manual_seed(3)
    batches = [(torch.randn(512, d, generator=gen),) for _ in range(steps)]
    fn = lambda m, x: m(x).pow(2).mean()   # noqa: E731
    make = lambda budget: px.compile(Stack(d, n, seed=2), optimizer=px.AdamW(lr=1e-3), device="cuda",  # noqa: E731
                                     precision="fp32", chunk_size=d * d, device_memory=budget)(fn)
    step = make(int(make(None).min_device_memory(*batches[0])))
    losses = [step(*b).item() for b in batches]
    g = step.graphs["scheduled"]
    assert host_params(step), "the least budget should put optimizer states on the host"
    assert max(fetch_counts(g).values()) >= 2, "no chunk was evicted and fetched again"
    case = Case("stack", lambda: Stack(d, n, seed=2), fn, lambda i, gen: batches[i])
    ref_losses, ref_sd = eager_run(case, steps, hyper=dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                                                           weight_decay=1e-2), host_params=host_params(step))
    assert rel_err(losses, ref_losses) <= 1e-6, (losses, ref_losses)
    assert_state_close(step.state_dict(), ref_sd, rtol=1e-6)
    assert step.last_step.measured_peak == g.plan.predicted_peak


def test_copies_run_on_their_own_streams_without_blocking_the_cpu():
    """With the compute stream busy, fetch and a write-back release return at once (the CPU does not wait), the
    write-back still copies what compute wrote last, and the fetched slot holds the host values when compute uses
    it. Only before_host_write makes the CPU wait."""
    d = 1024
    step = px.compile(Stack(d, 2, seed=2), optimizer=px.AdamW(lr=1e-3), device="cuda", precision="fp32",
                      chunk_size=d * d)(lambda m, x: m(x).sum())
    step(torch.randn(8, d))
    store = step._compiler.store
    store.evict_all()                                       # the step left its chunks resident (carried)
    torch.cuda.synchronize()
    key = BufKey(0, BufKind.PARAM)
    expect = store.host(key).clone()
    assert store.h2d_stream is not None and store.d2h_stream is not None
    torch.cuda._sleep(200_000_000)                         # ~0.1 s or more of compute-stream work
    t0 = time.perf_counter()
    store.pool.budget = None
    store.fetch(key)
    fetched = time.perf_counter() - t0
    slot = store.slot(key)
    slot.add_(1.0)                                          # compute writes the slot after the sleep
    t0 = time.perf_counter()
    store.release(key, writeback=True)
    released = time.perf_counter() - t0
    assert fetched < 0.02 and released < 0.02, (fetched, released)
    assert torch.cuda.current_stream().query() is False, "the sleep should still be running"
    store.before_host_write(0)                              # waits for the write-back only
    assert torch.equal(store.host(key), expect + 1.0)
