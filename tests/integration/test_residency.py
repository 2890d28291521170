"""Residency across steps: the plan is a steady-state cycle (what is resident when a step ends is what the next
starts with), and everything that reads or replaces host homes first brings the device values home.

fp32 on the CPU, against eager PyTorch (1e-6) or against a compiled step that never had chunks resident (bitwise)."""
import dataclasses
import functools

import pytest
import torch

from pstar_fx.ir import BufKind
from pstar_fx.passes import VerificationError, verify
from pstar_fx.ir.needs import BufKey
from pstar_fx.passes.schedule import annotate

from harness import DEVICE, compiled_step, eager_run, host_params, rel_err, small_batches, tight_budget
from models import CASES_BY_NAME, assert_state_close

pytestmark = pytest.mark.cuda

GPT = CASES_BY_NAME["gpt_tied"]
SMALL = small_batches(GPT)


def _carried(step):
    return dict(step.graphs["scheduled"].plan.carried)


def test_unlimited_budget_nothing_moves_after_the_first_step():
    step = compiled_step(GPT)
    losses = [step(*GPT.batch(i)).item() for i in range(4)]
    g = step.graphs["scheduled"]
    params = {BufKey(c.id, BufKind.PARAM) for c in g.chunks}
    assert set(_carried(step)) == params, "every parameter buffer stays on the device"
    assert g.plan.h2d_bytes == 0 and g.plan.d2h_bytes == 0
    assert step.last_step.h2d_bytes == 0 and step.last_step.d2h_bytes == 0
    ref_losses, ref_sd = eager_run(GPT, 4)
    assert rel_err(losses, ref_losses) <= 1e-6
    assert_state_close(step.state_dict(), ref_sd, rtol=1e-6)


def test_first_step_is_a_prologue_that_brings_the_carried_set_in():
    step = compiled_step(GPT)
    step(*GPT.batch(0))
    total = sum(c.nbytes for c in step.graphs["scheduled"].chunks)
    assert step.last_step.h2d_bytes == total          # the prologue fetched every parameter buffer once
    assert set(step._compiler.store.slots) == set(_carried(step))


@pytest.mark.parametrize("chunk_size,slack", [(1024, 1.05), (256, 1.3), (1024, 2.0)])
def test_tight_budgets_close_the_cycle_and_match_eager(chunk_size, slack):
    """Budgets where some parameter buffers are carried across steps and others move every step (fetched back after
    their host-side update, evicted and written back): 4 steps equal eager, the measured bytes equal the plan's at
    every node (debug=True), and between steps exactly the carried set is resident."""
    budget = tight_budget(SMALL, chunk_size, slack)
    step = compiled_step(SMALL, budget=budget, chunk_size=chunk_size)
    losses = []
    for i in range(4):
        losses.append(step(*SMALL.batch(i)).item())
        assert set(step._compiler.store.slots) == set(_carried(step))
        assert step._compiler.store.stale <= {k for k, d in _carried(step).items() if d}
    g = step.graphs["scheduled"]
    carried = _carried(step)
    assert 0 < len(carried), "something stays resident"
    assert g.plan.h2d_bytes > 0, "and something still moves every step"
    assert step.last_step.h2d_bytes == g.plan.h2d_bytes and step.last_step.d2h_bytes == g.plan.d2h_bytes
    ref_losses, ref_sd = eager_run(SMALL, 4, host_params=host_params(step))
    assert rel_err(losses, ref_losses) <= 1e-6, (losses, ref_losses)
    assert_state_close(step.state_dict(), ref_sd, rtol=1e-6)


def test_verifier_checks_that_the_cycle_closes():
    step = compiled_step(SMALL, budget=tight_budget(SMALL, 1024, 3.0), chunk_size=1024)
    g = step.lower(*SMALL.batch(0))["scheduled"]
    verify(g)
    carried = g.plan.carried
    assert carried and any(d for _, d in carried) and not all(d for _, d in carried)
    # the last fetch brings back a carried buffer after its host-side update: without it the step ends short
    from pstar_fx.ir import ops
    from pstar_fx.ir import copy_graph, to_module
    graph, env = copy_graph(g)
    last_fetch = [n for n in g.nodes if n.target is ops.fetch][-1]
    assert BufKey(g.ann[last_fetch.name].chunk, g.ann[last_fetch.name].buf) in dict(carried)
    graph.erase_node(env[last_fetch])
    with pytest.raises(VerificationError, match="cycle does not close"):
        verify(annotate(g.evolve(gm=to_module(graph, g.gm)), carried))
    fresh = tuple((k, False) for k, _ in carried)
    with pytest.raises(VerificationError, match="end stale on the host"):
        verify(annotate(g, fresh))                                # a buffer the step writes assumed fresh on the host


def test_host_readers_see_device_values():
    """After steps, parameter slots are resident and their host homes stale: state_dict(), sync_model() and the
    optimizer's state_dict() still read the trained values."""
    step = compiled_step(GPT)
    for i in range(2):
        step(*GPT.batch(i))
    store = step._compiler.store
    assert any(k.buf is BufKind.PARAM for k in store.stale), "the test needs stale host homes"
    opt_sd = step.optimizer.state_dict()
    ref_losses, ref_sd = eager_run(GPT, 2)
    assert_state_close(step.state_dict(), ref_sd, rtol=1e-6)
    assert opt_sd["state"] and all(s["step"].item() == 2 for s in opt_sd["state"].values())
    model = step.sync_model()
    assert_state_close({k: v.detach() for k, v in model.state_dict().items()}, ref_sd, rtol=1e-6)
    # training goes on from the synced model (taken back into the chunks): equal to eager's 4 steps
    losses = [step(*GPT.batch(i)).item() for i in (2, 3)]
    ref_losses, ref_sd = eager_run(GPT, 4)
    assert rel_err(losses, ref_losses[2:]) <= 1e-6
    assert_state_close(step.state_dict(), ref_sd, rtol=1e-6)


@pytest.mark.parametrize("budget", ["unlimited", "tight"])
def test_load_state_dict_replaces_resident_values(budget):
    """Loading values into a step whose chunks are resident (and stale on the host) replaces them: the next step
    equals, bit for bit, a step that was loaded the same values with nothing resident."""
    b = None if budget == "unlimited" else tight_budget(SMALL, 1024, 3.0)
    a = compiled_step(SMALL, budget=b, chunk_size=1024)
    for i in range(2):
        a(*SMALL.batch(i))
    sd, opt_sd = a.state_dict(), a.optimizer.state_dict()
    other = compiled_step(SMALL, budget=b, chunk_size=1024)
    other(*SMALL.batch(7))                                        # its own values, resident and stale
    assert other._compiler.store.stale
    other.load_state_dict(sd)
    other.optimizer.load_state_dict(opt_sd)
    la, lo = a(*SMALL.batch(2)).item(), other(*SMALL.batch(2)).item()
    assert la == lo
    for k, v in a.state_dict().items():
        assert torch.equal(v, other.state_dict()[k]), k


@pytest.mark.skipif(DEVICE != "cpu", reason="exact only on the CPU: on a GPU the CPU and GPU AdamW kernels round "
                                            "differently, visibly so on the key bias")
def test_the_reference_moves_optimizer_states_with_the_placement():
    """The eager reference of the retrace test below: moving parameters and their AdamW states between the device
    and the host optimizer each step loses nothing (on the CPU both kernels are one, so the results are bitwise those
    of one optimizer; the point of the placement is the GPU, where they differ)."""
    names = [n for n, _ in SMALL.build_model().named_parameters()]
    whole = eager_run(SMALL, 4)
    moved = eager_run(SMALL, 4, host_params=[set(names[::2]), set(names[1::2]), set(), set(names)])
    assert whole[0] == moved[0]
    for k, v in whole[1].items():
        assert torch.equal(v, moved[1][k]), k


def test_retrace_with_a_different_plan_enters_its_carried_set():
    """Two batch shapes, two plans with different carried sets under one budget, alternated: the store leaves one
    cycle and enters the other at every switch; the result equals eager on the same batches."""
    short = dataclasses.replace(SMALL, make_batch=functools.partial(GPT.make_batch, B=1, T=8))
    long = dataclasses.replace(SMALL, make_batch=functools.partial(GPT.make_batch, B=4, T=16))
    budget = tight_budget(long, 1024, 1.3)
    step = compiled_step(SMALL, budget=budget, chunk_size=1024)
    batches = [(short if i % 2 else long).batch(i) for i in range(6)]
    losses, carried, placed = [], [], []
    for b in batches:
        losses.append(step(*b).item())
        carried.append(_carried(step))
        placed.append(host_params(step))        # this step's plan's placement of optimizer states
    assert carried[0] != carried[1], "the two plans should carry different sets"
    case = dataclasses.replace(SMALL, make_batch=lambda i, gen: batches[i])
    ref_losses, ref_sd = eager_run(case, 6, host_params=placed)
    assert rel_err(losses, ref_losses) <= 1e-6, (losses, ref_losses)
    assert_state_close(step.state_dict(), ref_sd, rtol=1e-6)


def test_evict_all_then_step_equals_staying_resident():
    """Sending every slot home between steps (what readers may do) changes nothing: bitwise the same training."""
    a = compiled_step(GPT)
    b = compiled_step(GPT)
    for i in range(4):
        la, lb = a(*GPT.batch(i)).item(), b(*GPT.batch(i)).item()
        assert la == lb
        b._compiler.store.evict_all()
        assert not b._compiler.store.slots
    for k, v in a.state_dict().items():
        assert torch.equal(v, b.state_dict()[k]), k


@pytest.mark.parametrize("caches", [None, False], ids=["the-devices-rule", "keeps-none"])
def test_freed_slots_stay_within_each_nodes_room_and_are_reused_where_the_pool_caches(caches):
    """The device pool free-lists given-back slots and the executor trims that list before every node: the pool's
    count (slots being written back included) and its free list never pass the plan's peak. On the CPU it keeps up
    to the node's room under the plan's peak, and a steady-state step reuses slots rather than allocating new ones;
    on CUDA (DevicePool.caches False; forced here on any device, both loops) it keeps nothing but a slot of the
    size the node takes, so the room stays torch's caching allocator's. Either way the step trains as eager does."""
    budget = tight_budget(SMALL, 256, 2.0)
    step = compiled_step(SMALL, budget=budget, chunk_size=256, debug=False)   # steps after the first: generated
    step.lower(*SMALL.batch(0))
    store = step._compiler.store
    pool = store.pool
    if caches is not None:
        pool.caches = caches            # before the first step: the generated loop is made with it
    step(*SMALL.batch(0))
    peak = step.graphs["scheduled"].plan.predicted_peak
    seen, fresh, at_take = [], [], []
    take = pool.take

    def counting_take(numel, dtype, what="slot"):
        hit = bool(pool.free.get((numel, dtype)))
        fresh.append(not hit)
        at_take.append((pool.cached, numel * dtype.itemsize if hit else 0, pool.in_use + pool.cached))
        return take(numel, dtype, what)

    pool.take = counting_take          # an instance attribute of the test's own pool object
    if pool.caches:                    # (a before_node hook sends the generated loop to `before` at every node)
        step._before_node = lambda i, n: seen.append(pool.in_use + pool.cached)   # (in_use counts draining slots)
    losses = [step(*SMALL.batch(i)).item() for i in range(1, 4)]
    assert step.last_step.h2d_bytes > 0, "the budget moves chunks every step"
    (compiled,) = step._compiler.cache._entries.values()
    assert fresh and compiled.executor._generated, "the later steps ran the generated loop"
    if pool.caches:
        assert max(seen) <= peak and max(seen) > 0
        # (this model's chunks come in three sizes, and activations take the room of some released slots: a quarter
        # or more are reused; a model of equal chunks reuses more)
        reused = len(fresh) - sum(fresh)
        assert reused >= len(fresh) / 4, f"{reused} of {len(fresh)} takes reused a free-listed slot"
    else:
        assert all(cached <= kept for cached, kept, _ in at_take), "the free list kept more than the node takes"
        assert any(kept for _, kept, _ in at_take), "no released slot was ever handed to the next node"
        assert max(total for _, _, total in at_take) <= peak
    ref_losses, _ = eager_run(SMALL, 4)
    assert rel_err(losses, ref_losses[1:]) <= 1e-6
