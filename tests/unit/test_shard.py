"""The shard pass and the verifier's collective checks, on CPU without a process group: the passes need only
Settings.world, so a plan for any world size is made and checked in one process."""
from __future__ import annotations

import dataclasses

import pytest
import torch.fx as fx

import pstar_fx as px
from pstar_fx.ir import BufKind, ChunkGroup, Role, StateHome, ops
from pstar_fx.ir.needs import state_bytes, static_bytes
from pstar_fx.optim import ADAM_STATE
from pstar_fx.passes import VerificationError, collectives, pipeline, run_passes, verify
from pstar_fx.passes.assign_chunks import ALIGN

from harness import HYPER
from models import CASES_BY_NAME


def stages_for(case_name: str, world: int, budget=None, chunk_size=1000, accumulate=1):
    case = CASES_BY_NAME[case_name]
    step = px.compile(case.build_model(), optimizer=px.AdamW(**HYPER), device="cpu", chunk_size=chunk_size,
                      device_memory=budget, accumulate=accumulate)(case.loss_fn)
    traced = step.lower(*case.batch(0))["traced"]
    traced = traced.evolve(settings=dataclasses.replace(traced.settings, world=world))
    return run_passes(traced, pipeline(chunk_size=chunk_size, world=world))


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("accumulate", [1, 2])
def test_sharded_plan_gathers_every_fetch_and_reduces_every_chunk_once(world, accumulate):
    stages = stages_for("gpt_tied", world, accumulate=accumulate)
    g = stages[-1]
    assert [s.stage for s in stages][-2:] == ["scheduled", "sharded"]
    for c in g.chunks:
        assert c.capacity % (ALIGN * world) == 0
    nodes = g.nodes
    assert not any(n.target is ops.fetch and g.ann[n.name].buf is BufKind.PARAM for n in nodes)
    trainable = {c.id for c in g.chunks if c.group is ChunkGroup.TRAINABLE}
    rs = [g.ann[n.name].chunk for n in nodes if g.ann[n.name].role is Role.REDUCE_SCATTER]
    assert sorted(rs) == sorted(trainable)
    # each reduce-scatter directly follows its chunk's last gradient write, and precedes its optimizer step
    pos = {n.name: i for i, n in enumerate(nodes)}
    for n in nodes:
        a = g.ann[n.name]
        if a.role is Role.REDUCE_SCATTER:
            prev = g.ann[n.prev.name]
            assert prev.role is Role.WRITE_GRAD and g.param(prev.param).chunk == a.chunk
            later = [m for m in nodes[pos[n.name] + 1:] if g.ann[m.name].role is Role.WRITE_GRAD
                     and g.param(g.ann[m.name].param).chunk == a.chunk]
            assert not later
    order = collectives(g)
    assert order == collectives(stages_for("gpt_tied", world, accumulate=accumulate)[-1]), "deterministic"
    assert g.plan.reduced_bytes == sum(g.chunks[c].nbytes for c in trainable)
    assert g.plan.gathered_bytes > 0


def test_per_rank_memory_is_a_shard_of_the_states():
    one = stages_for("gpt_tied", 1, chunk_size=1024)[-1]
    two = stages_for("gpt_tied", 2, chunk_size=1024)[-1]
    assert all(c.state_home is StateHome.DEVICE for c in one.chunks if c.group is ChunkGroup.TRAINABLE)
    states = lambda g, w: sum(state_bytes(c, g.settings.precision, w, ADAM_STATE) for c in g.chunks  # noqa: E731
                              if c.state_home is StateHome.DEVICE)
    assert states(two, 2) < states(one, 1) / 2 + len(two.chunks) * 4 + 1
    assert static_bytes(two) < static_bytes(one)
    assert two.plan.predicted_peak < one.plan.predicted_peak


def test_a_tight_budget_plan_for_two_ranks_fits_and_verifies():
    budget = 400_000
    g = stages_for("gpt_tied", 2, budget=budget, chunk_size=1024)[-1]
    assert g.plan.predicted_peak <= budget
    assert any(c.state_home is StateHome.HOST for c in g.chunks if c.group is ChunkGroup.TRAINABLE)
    assert any(n.target is ops.all_gather for n in g.nodes)


def _without(g, node_name: str):
    graph = fx.Graph()
    env: dict = {}
    for n in g.gm.graph.nodes:
        if n.name == node_name:
            continue
        env[n] = graph.node_copy(n, lambda a: env[a])
    return g.evolve(gm=fx.GraphModule(g.gm, graph))


def test_the_verifier_rejects_a_missing_reduce_scatter():
    g = stages_for("mlp_ce", 2)[-1]
    rs = next(n for n in g.nodes if g.ann[n.name].role is Role.REDUCE_SCATTER)
    with pytest.raises(VerificationError, match="reduce-scatter"):
        verify(_without(g, rs.name))


def test_the_verifier_rejects_a_plain_fetch_in_a_sharded_graph():
    g = stages_for("mlp_ce", 2, budget=50_000, chunk_size=256)[-1]
    gather = next(n for n in g.nodes if n.target is ops.all_gather)
    gather.target = ops.fetch
    with pytest.raises(VerificationError, match="without gathering"):
        verify(g)


def test_the_verifier_rejects_collectives_in_an_unsharded_graph():
    g = stages_for("mlp_ce", 1, budget=60_000, chunk_size=256)[-1]
    fetch = next(n for n in g.nodes if n.target is ops.fetch and g.ann[n.name].buf is BufKind.PARAM)
    fetch.target = ops.all_gather
    with pytest.raises(VerificationError, match="collective"):
        verify(g)


def test_with_ranks_a_host_stepped_chunk_is_gathered_where_it_is_needed():
    """The executor's thread issues a rank's copies and gathers itself, after the chunk's pending host-side update:
    a copy into a host-stepped chunk is not hoisted (only other moves between it and its use), while one rank's
    schedule hoists some (its CPU worker issues the copy once the update is done)."""
    from pstar_fx.ir.needs import BufKey, all_needs
    budget = 400_000

    def lead_of_host_fetches(g):
        nodes, needs = g.nodes, all_needs(g)
        host = {c.id for c in g.chunks if c.state_home is StateHome.HOST}
        moves = (Role.FETCH, Role.RELEASE)
        leads = []
        for i, n in enumerate(nodes):
            a = g.ann[n.name]
            if a.role is not Role.FETCH or a.chunk not in host or n.target is ops.alloc:
                continue
            key = BufKey(a.chunk, a.buf)
            use = next((j for j in range(i + 1, len(nodes)) if key in needs[j].resident
                        and g.ann[nodes[j].name].role not in moves), len(nodes) - 1)   # none: fetched back at the end
            leads.append(sum(g.ann[nodes[j].name].role not in moves for j in range(i + 1, use)))
        return leads

    two = lead_of_host_fetches(stages_for("gpt_tied", 2, budget=budget, chunk_size=1024)[-1])
    one = lead_of_host_fetches(stages_for("gpt_tied", 1, budget=budget, chunk_size=1024)[-1])
    assert two and all(lead == 0 for lead in two), two
    assert any(lead > 0 for lead in one), one
