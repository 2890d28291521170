"""pstar-fx's own path on a CPU device: the host is the device (api/options.py CPU_DEVICE_IS_HOST).

A parameter or gradient slot is its host home itself, lent to the device pool (nothing is copied, every slot still
counted as the plan counts it), host-side updates run inline on the step's thread, and the planner streams none. Every other test takes a
GPU's paths on the CPU (copies, the worker thread; tests/conftest.py); these run the CPU's own, under budgets that
evict chunks: slots are host homes at every node, the step equals the copying step bit for bit and eager at the
suite's tolerance, the measured peak is the plan's, a failure before the commit changes nothing, checkpoints resume
exactly, and streamed states (copied as on a GPU) mix with lent slots.
"""
import pytest
import torch

import pstar_fx as px
from pstar_fx.ir.graph import BufKind, StateHome, UpdateSite
from pstar_fx.api import options

from harness import (HYPER, assert_values_equal, check_failures_before_the_commit, check_tight_budget_matches_eager,
                     fetch_counts, small_batches, step_values)
from models import CASES_BY_NAME

pytestmark = pytest.mark.host_is_device

CNN = small_batches(CASES_BY_NAME["cnn_bn"])       # BatchNorm buffers, fp32
GPT = small_batches(CASES_BY_NAME["gpt_tied"])     # tied weights; gradients overwrite half-precision params in place


def _step(case, precision="fp32", budget=None, debug=True, **kw):
    return px.compile(case.build_model(), optimizer=px.AdamW(**HYPER), device_memory=budget, chunk_size=256,
                      precision=precision, device="cpu", debug=debug, **kw)(case.loss_fn)


def _budget(case, precision, **kw):
    """Just above the least budget of this step: chunks are evicted and fetched again."""
    return int(_step(case, precision, **kw).min_device_memory(*case.batch(0)) * 1.05)


def _slots_are_homes(step) -> dict[BufKind, int]:
    """A before-node hook checking that every resident parameter slot is its host home (streamed states and slots
    rounded from a master excepted), and every gradient slot of a chunk the CPU updates (whose gradient goes home
    every step); returns the most lent slots of each kind seen at one node."""
    store = step._compiler.store
    cpu = {c.id for c in step.final_graph.chunks if c.update_site is UpdateSite.CPU}
    most = {BufKind.PARAM: 0, BufKind.GRAD: 0}

    def hook(i, node):
        lent = {BufKind.PARAM: 0, BufKind.GRAD: 0}
        for key, slot in store.slots.items():
            home = (key.buf is BufKind.PARAM and not store.from_master(key)) or (
                key.buf is BufKind.GRAD and key.chunk in cpu)
            if home:
                assert slot.data_ptr() == store.host(key).data_ptr(), f"{key} at node {i} ({node.name}) is a copy"
            if key in store.lent:
                assert slot.data_ptr() == store.host(key).data_ptr(), key
                lent[key.buf] += 1
            else:
                assert not home, key
        for buf, n in lent.items():
            most[buf] = max(most[buf], n)
    step._before_node = hook
    return most


def _nothing_lent_or_held(step) -> None:
    """After a failed step: no slot resident, none lent, the pool counting what stays on the device only."""
    store = step._compiler.store
    assert not store.slots and not store.lent and not store.pool.lent
    assert store.pool.in_use == sum(b.numel() * b.element_size() for b in store.buffers.values()) + sum(
        s.numel() * 4 for s, h in zip(store.states, store.state_home) if h is StateHome.DEVICE)


@pytest.mark.parametrize("name", ["gpt_tied", "mlp_ce"])
def test_tight_budget_matches_eager_with_host_homes_as_slots(name):
    check_tight_budget_matches_eager(CASES_BY_NAME[name], steps=3)


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_equals_the_copying_step_bit_for_bit(precision, monkeypatch):
    """The same plan run with copies and the worker thread (a GPU's paths) and with host homes as slots and inline
    updates: equal losses and values after every step, with two micro-batches and clipping; no slot is a copy."""
    case = CASES_BY_NAME["cnn_bn" if precision == "fp32" else "gpt_tied"]     # batches of 4 or more: two halves
    budget = _budget(case, precision, accumulate=2, max_grad_norm=0.5)
    lent = _step(case, precision, budget, accumulate=2, max_grad_norm=0.5)
    x, y = case.batch(0)
    lent(x, y)
    assert lent._compiler.store.host_is_device and lent._compiler.store.updates is None
    monkeypatch.setattr(options, "CPU_DEVICE_IS_HOST", False)
    copying = _step(case, precision, budget, accumulate=2, max_grad_norm=0.5)
    copying(x, y)
    assert not copying._compiler.store.host_is_device and copying._compiler.store.updates is not None
    assert_values_equal(step_values(lent), step_values(copying), f"{precision}, after the first step")
    seen = _slots_are_homes(lent)
    for i in range(1, 5):
        x, y = case.batch(i)
        assert torch.equal(lent(x, y), copying(x, y)), f"step {i}"
        assert_values_equal(step_values(lent), step_values(copying), f"{precision}, after step {i}")
    assert seen[BufKind.PARAM] > 0 and (seen[BufKind.GRAD] > 0 or precision != "fp32"), seen
    assert max(fetch_counts(lent.final_graph).values()) >= 2, "no chunk was evicted and fetched again"
    assert lent.last_step.measured_peak == lent.final_graph.plan.predicted_peak
    assert "nothing copied" in str(lent.summary()) and "nothing copied" not in str(copying.summary())


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_failure_at_every_node_before_the_commit_changes_nothing(precision):
    """In bf16 the gradients overwrite the parameters in their slots, here their host homes: a rollback rebuilds
    them from the masters."""
    case = CNN if precision == "fp32" else GPT
    budget = _budget(case, precision)
    check_failures_before_the_commit(lambda: _step(case, precision, budget, debug=False), case, precision,
                                     after_each=_nothing_lent_or_held)


def test_a_checkpoint_resumes_exactly(tmp_path):
    case = GPT
    budget = _budget(case, "bf16")
    step = _step(case, "bf16", budget, debug=False)
    for i in range(2):
        step(*case.batch(i))
    step.save(tmp_path / "ckpt")
    want = [step(*case.batch(i)).item() for i in range(2, 4)]
    resumed = _step(case, "bf16", budget, debug=False)
    resumed.load(tmp_path / "ckpt")
    assert [resumed(*case.batch(i)).item() for i in range(2, 4)] == want
    assert_values_equal(step_values(resumed), step_values(step), "resumed")


def test_streamed_states_mix_with_host_homes_as_slots():
    """The planner streams nothing on a CPU device (a streamed update would run on the same cores after two copies);
    forced to, the states are copied into slots of their own beside lent parameter and gradient slots, and the step
    equals the unstreamed one bit for bit."""
    case = CNN
    budget = _budget(case, "fp32")
    chosen = _step(case, budget=budget)
    chosen(*case.batch(0))
    assert not any(c.streamed for c in chosen.final_graph.chunks)
    assert any("a CPU device is the host" in str(c) for c in chosen.final_graph.choices)
    forced = _step(case, budget=budget, _device_updates=1000)
    forced(*case.batch(0))
    assert any(c.streamed for c in forced.final_graph.chunks)
    seen = _slots_are_homes(forced)
    for i in range(1, 4):
        assert torch.equal(forced(*case.batch(i)), chosen(*case.batch(i)))
    assert_values_equal(step_values(forced), step_values(chosen), "streamed")
    assert seen[BufKind.PARAM] > 0, seen
    assert "only streamed states copied" in str(forced.summary()) and "nothing copied" in str(chosen.summary())
