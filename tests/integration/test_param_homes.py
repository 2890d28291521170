"""Parameter homes: in mixed precision a chunk whose optimizer states live on the device keeps no host copy of its
half-precision parameters (ParamHome.MASTER); a fetch casts the fp32 master on the device. Bf16 on the CPU, under
budgets that put some states on the device and still evict those chunks' parameters: bitwise equal to the same
plan with host homes, with fewer bytes moved and less host memory."""
import dataclasses
import functools
import importlib

import pytest
import torch

import pstar_fx as px
from pstar_fx.ir import ops
from pstar_fx.ir import ParamHome, Role, StateHome
from pstar_fx.ir.needs import host_bytes
from pstar_fx.passes import VerificationError, verify

from harness import HYPER, compiled_step, small_batches
from models import CASES_BY_NAME

pytestmark = pytest.mark.cuda

GPT = small_batches(CASES_BY_NAME["gpt_tied"])
STEPS = 4
schedule_mod = importlib.import_module("pstar_fx.passes.schedule")


def _budget(slack: float) -> int:
    return int(compiled_step(GPT, chunk_size=1024, precision="bf16").min_device_memory(*GPT.batch(0)) * slack)


@functools.cache
def _cast_budgets() -> tuple[int, ...]:
    """Budgets (multiples of the least) whose plans evict a master-homed chunk's parameters and cast them again from
    the master within the step; which multiples do depends on the plan (the device, what each node holds)."""
    found = []
    for slack in (2.5, 3.0, 3.5, 4.0, 4.5):
        step = compiled_step(GPT, budget=_budget(slack), chunk_size=1024, precision="bf16")
        step.lower(*GPT.batch(0))
        g = step.final_graph
        master = {c.id for c in g.chunks if c.param_home is ParamHome.MASTER}
        if any(n.target is ops.fetch and g.ann[n.name].chunk in master for n in g.nodes):
            found.append(_budget(slack))
    assert len(found) >= 2, "no two budgets evict a master-homed chunk within the step"
    return tuple(found[:2])


def _run(budget: int):
    step = compiled_step(GPT, budget=budget, chunk_size=1024, precision="bf16")
    losses = [step(*GPT.batch(i)).item() for i in range(STEPS)]
    return losses, step.state_dict(), step


def _host_homes(g, moves):
    return {c.id: ParamHome.HOST for c in g.chunks}


@pytest.mark.parametrize("which", [0, 1])
def test_master_homes_equal_host_homes_bitwise(which, monkeypatch):
    budget = _cast_budgets()[which]
    losses, sd, step = _run(budget)
    g = step.final_graph
    master = {c.id for c in g.chunks if c.param_home is ParamHome.MASTER}
    assert master and all(g.chunks[i].state_home is StateHome.DEVICE for i in master)
    cast = [n for n in g.nodes if n.target is ops.fetch and g.ann[n.name].chunk in master]
    assert cast, "a device-state chunk's parameters are evicted and cast again from the master within the step"
    assert all(step._compiler.store.host_param[i] is None for i in master)
    assert step.last_step.h2d_bytes == g.plan.h2d_bytes and step.last_step.d2h_bytes == g.plan.d2h_bytes

    monkeypatch.setattr(schedule_mod, "param_homes", _host_homes)
    ref_losses, ref_sd, ref = _run(budget)
    rg = ref.final_graph
    assert [c.state_home for c in rg.chunks] == [c.state_home for c in g.chunks], "the same placement of states"
    assert losses == ref_losses
    for k in ref_sd:
        assert torch.equal(sd[k], ref_sd[k]), k
    # what the master homes save: host bytes of those chunks' parameters, and their copies each way
    saved = sum(c.nbytes for c in g.chunks if c.id in master)
    assert host_bytes(rg) - host_bytes(g) == saved
    assert g.plan.h2d_bytes < rg.plan.h2d_bytes
    assert g.plan.d2h_bytes <= rg.plan.d2h_bytes


def test_fp32_keeps_host_homes():
    step = compiled_step(GPT, budget=_budget(3.0), chunk_size=1024)
    step(*GPT.batch(0))
    assert all(c.param_home is ParamHome.HOST for c in step.final_graph.chunks)


def test_verifier_rejects_a_master_home_written_back_or_without_a_device_master():
    step = compiled_step(GPT, budget=_cast_budgets()[0], chunk_size=1024, precision="bf16")
    step.lower(*GPT.batch(0))
    g = step.final_graph
    verify(g)
    master = next(c for c in g.chunks if c.param_home is ParamHome.MASTER
                  and any(g.ann[n.name].role is Role.RELEASE and g.ann[n.name].chunk == c.id for n in g.nodes))
    host_states = g.evolve(chunks=tuple(dataclasses.replace(c, state_home=StateHome.HOST) if c is master else c
                                        for c in g.chunks))
    with pytest.raises(VerificationError, match="cast from a device master, but it has none"):
        verify(host_states)
    release = next(n for n in g.nodes if g.ann[n.name].role is Role.RELEASE and g.ann[n.name].chunk == master.id)
    release.kwargs = {**release.kwargs, "writeback": True}
    with pytest.raises(VerificationError, match="written back, but its parameters have no host home"):
        verify(g)


def _train_then_evaluate(budget: int):
    model = GPT.build_model()
    train = px.compile(model, optimizer=px.AdamW(**HYPER), device="cpu", chunk_size=1024, device_memory=budget,
                       precision="bf16", debug=True)(GPT.loss_fn)
    evaluate = px.compile(model, optimizer=None, device="cpu", chunk_size=1024, debug=True)(GPT.loss_fn)
    for i in range(STEPS):
        train(*GPT.batch(i))
    return evaluate(*GPT.batch(STEPS)), evaluate, train


def test_evaluation_over_the_trainers_chunks_casts_the_masters(monkeypatch):
    """A forward-only step over the training step's chunks uses the store's homes: it casts the masters too, and
    computes what it computes over host homes, bitwise."""
    budget = _budget(3.0)
    loss, evaluate, train = _train_then_evaluate(budget)
    g = evaluate.final_graph
    master = {c.id for c in train.final_graph.chunks if c.param_home is ParamHome.MASTER}
    assert master and {c.id for c in g.chunks if c.param_home is ParamHome.MASTER} == master
    assert evaluate.last_step.h2d_bytes == g.plan.h2d_bytes
    monkeypatch.setattr(schedule_mod, "param_homes", lambda g, moves: (
        {c.id: c.param_home for c in g.chunks} if not any(g.ann[n.name].role is Role.OPTIMIZER_STEP for n in g.nodes)
        else _host_homes(g, moves)))
    ref_loss, _, _ = _train_then_evaluate(budget)
    assert torch.equal(loss, ref_loss)
