"""Each pass: its output's structure, its invariant, and that it leaves its input untouched."""
import dataclasses

import pytest
import torch

import pstar_fx as px
from pstar_fx.ir import ops
from pstar_fx.ir import ChunkGroup, Phase, Role, StateHome
from pstar_fx.passes import VerificationError, verify
from pstar_fx.passes.assign_chunks import choose_chunk_size, pack, waste
from pstar_fx.ir.fx_utils import mutated_args

from harness import compiled_run, compiled_step, eager_run, host_params, rel_err, small_batches, tight_budget
from models import CASES_BY_NAME, assert_state_close


def _stages(case_name="gpt_tied", **kw):
    case = CASES_BY_NAME[case_name]
    step = compiled_step(case, **kw)
    return step.lower(*case.batch(0)), step, case


def test_stages_in_order_each_stamped():
    stages, _, _ = _stages()
    assert list(stages) == ["traced", "canonical", "loss_rows", "chunked", "liveness", "remat", "optimizer_placed",
                            "scheduled"]
    made_by = [g.made_by for g in stages.values()]
    assert made_by == ["trace_step", "canonicalize", "loss_rows (nothing split)", "assign_chunks", "liveness", "remat", "place_optimizer",
                       "schedule"]
    for name, g in stages.items():
        assert str(g).startswith(f'# stage "{g.stage}" made by {g.made_by}')
        assert g.seconds >= 0


def test_passes_are_pure():
    stages, _, _ = _stages()
    texts = {k: str(g) for k, g in stages.items()}
    from pstar_fx.passes import pipeline
    for fn, src in zip(pipeline(chunk_size=None), list(stages.values())[:-1]):
        fn(src)
    assert {k: str(g) for k, g in stages.items()} == texts


def test_canonicalize_phases_follow_the_seed_and_no_dead_code():
    stages, _, _ = _stages()
    g = stages["canonical"]
    nodes = g.nodes
    seed = next(n for n in nodes if n.target is torch.ops.aten.ones_like.default)
    reach = {seed}
    for n in nodes:
        if any(a in reach for a in n.all_input_nodes):
            reach.add(n)
    for n in nodes:
        if n.op == "call_function":
            assert (g.ann[n.name].phase is Phase.BACKWARD) == (n in reach), n.name
            assert n.users or mutated_args(n), f"dead node {n.name} survived"
    assert len(g.grad_outputs) == sum(p.trainable for p in g.params)


def test_assign_chunks_first_use_order_and_views_per_use():
    stages, _, _ = _stages(chunk_size=2048)
    g = stages["chunked"]
    assert not any(g.ann[n.name].role is Role.PARAM for n in g.nodes)
    first_view = {}   # parameter -> position of the first node that consumes a view of it
    pos = {n: i for i, n in enumerate(g.nodes)}
    for n in g.nodes:
        a = g.ann[n.name]
        if a.role is Role.PARAM_VIEW:
            assert len(n.users) == 1, "each param_view feeds exactly one use"
            user = next(iter(n.users))
            while user.op == "call_function" and g.ann[user.name].role is Role.COMPUTE and len(user.users) == 1 \
                    and user.meta["val"].untyped_storage()._cdata == n.meta["val"].untyped_storage()._cdata:
                user = next(iter(user.users))   # follow the view chain to the real consumer
            first_view.setdefault(a.param, pos[user])
    # regular chunks fill in first-use order (a tensor larger than a chunk gets its own, made when it comes up)
    regular = [c for c in g.chunks if c.group is ChunkGroup.TRAINABLE and c.capacity == 2048]
    firsts = [min(first_view[p] for p in c.params) for c in regular]
    assert firsts == sorted(firsts), "chunks are numbered in first-use order"
    for c in regular:
        by_offset = sorted(c.params, key=lambda p: g.param(p).offset)
        assert [first_view[p] for p in by_offset] == sorted(first_view[p] for p in by_offset)
    writes = [g.ann[n.name].param for n in g.nodes if g.ann[n.name].role is Role.WRITE_GRAD]
    assert sorted(writes) == sorted(p.name for p in g.params if p.trainable)
    out = [n for n in g.nodes if n.op == "output"][0]
    assert len(out.args[0]) == 1, "only the loss is returned"


def test_oversized_tensor_gets_its_own_chunk():
    stages, _, _ = _stages(chunk_size=256)
    g = stages["chunked"]
    big = [p for p in g.params if p.numel > 256]
    assert big
    for p in big:
        c = g.chunks[p.chunk]
        assert c.params == (p.name,) and c.capacity == p.numel


def test_pack_and_choose_chunk_size():
    numels = [100, 300, 50, 1000, 20]
    chunks = pack(numels, 512)
    assert [c for c, _ in chunks] == [512, 1000, 512] or [c for c, _ in chunks] == [512, 512, 1000]
    placed = sorted(i for _, slots in chunks for i, _ in slots)
    assert placed == list(range(5))
    size = choose_chunk_size(numels, 4, budget=None)
    assert size >= 1000, "every tensor fits a chunk when the budget allows"
    assert waste(numels, size) == min(waste(numels, s) for s in range(1024, 4096, 32))
    # a budget too small for the largest tensor's chunk: that tensor gets its own, the rest pack tightly
    small = choose_chunk_size(numels, 4, budget=8 * 4 * 512)
    assert small <= 512
    assert waste(numels, small) == min(waste(numels, s) for s in range(32, small + 1, 32))


def test_auto_chunk_size_leaves_room_for_several_chunks():
    numels = [4096] * 64
    size = choose_chunk_size(numels, 4, budget=64 * 4096)
    assert size * 4 * 8 <= 64 * 4096


def test_liveness_counts_storages_once():
    """x (2x8 fp32 = 64 B), y = x * 2 (64 B), v = y.view(16) (a view: 0 B), s = v.sum() (4 B)."""
    from pstar_fx.passes.liveness import analyze
    from torch.fx.experimental.proxy_tensor import make_fx
    from pstar_fx.ir import NodeAnn
    gm = make_fx(lambda x: (x * 2).view(16).sum(), tracing_mode="fake")(torch.randn(2, 8))
    nodes = list(gm.graph.nodes)
    ann = {n.name: NodeAnn(role=Role.INPUT if n.op == "placeholder" else Role.COMPUTE, phase=Phase.FORWARD)
           for n in nodes}
    lv = analyze(nodes, ann)
    # x is live until mul; y until view's user (sum); the sum lives to the output
    assert list(lv.live) == [64, 128, 64, 68, 4]
    assert list(lv.created) == [64, 64, 0, 4, 0]


def test_place_optimizer_commit_then_one_step_per_chunk():
    stages, _, _ = _stages(chunk_size=1024)
    g = stages["optimizer_placed"]
    steps = [g.ann[n.name].chunk for n in g.nodes if g.ann[n.name].role is Role.OPTIMIZER_STEP]
    trainable = [c.id for c in g.chunks if c.group is ChunkGroup.TRAINABLE]
    assert steps == trainable            # in the order the next forward needs them
    assert all(c.state_home is not None for c in g.chunks if c.group is ChunkGroup.TRAINABLE)
    # one commit, after every node of the program and every gradient write; every step after it
    idx = {n.name: i for i, n in enumerate(g.nodes)}
    roles = [g.ann[n.name].role for n in g.nodes]
    assert roles.count(Role.COMMIT) == 1
    commit = roles.index(Role.COMMIT)
    last_program = max(i for i, r in enumerate(roles) if r in (Role.COMPUTE, Role.WRITE_GRAD))
    first_step = min(idx[n.name] for n in g.nodes if g.ann[n.name].role is Role.OPTIMIZER_STEP)
    assert last_program < commit < first_step


def test_state_homes_follow_budget():
    stages, _, _ = _stages(chunk_size=1024)
    assert all(c.state_home is StateHome.DEVICE for c in stages["scheduled"].chunks
               if c.group is ChunkGroup.TRAINABLE)
    case = small_batches(CASES_BY_NAME["gpt_tied"])
    budget = tight_budget(case, 1024)
    step = compiled_step(case, budget=budget, chunk_size=1024)
    g = step.lower(*case.batch(0))["scheduled"]
    assert any(c.state_home is StateHome.HOST for c in g.chunks if c.group is ChunkGroup.TRAINABLE)


def test_infeasible_budget_raises_before_anything_runs():
    case = CASES_BY_NAME["gpt_tied"]
    model = case.build_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    step = px.compile(model, optimizer=px.AdamW(lr=1e-3), device_memory=10_000, chunk_size=1024,
                      device="cpu")(case.loss_fn)
    with pytest.raises(px.BudgetError) as e:
        step(*case.batch(0))
    err = e.value
    assert err.available == 10_000 and err.needed > 10_000
    assert err.node in str(err) and str(err.needed) in str(err) and "10000" in str(err)
    assert "Raise device_memory" in str(err)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert step.last_step is None


def _scheduled(**kw):
    case = small_batches(CASES_BY_NAME["gpt_tied"])
    budget = tight_budget(case, 1024)
    step = compiled_step(case, budget=budget, chunk_size=1024, **kw)
    return step.lower(*case.batch(0))["scheduled"]


def _without(g, pred):
    """A copy of g with the first node matching pred erased, re-annotated so that only the fault remains."""
    from pstar_fx.ir import copy_graph, to_module
    from pstar_fx.passes.schedule import annotate
    graph, env = copy_graph(g)
    victim = next(env[n] for n in g.nodes if pred(n))
    graph.erase_node(victim)
    return annotate(g.evolve(gm=to_module(graph, g.gm)), g.plan.carried)


def _retarget(g, pred, target):
    """A copy of g with the first node matching pred calling target instead."""
    from pstar_fx.ir import copy_graph, to_module
    graph, env = copy_graph(g)
    next(env[n] for n in g.nodes if pred(n)).target = target
    return g.evolve(gm=to_module(graph, g.gm))


def test_verifier_accepts_the_schedule_and_rejects_broken_ones():
    g = _scheduled()
    verify(g)
    with pytest.raises(VerificationError, match="not resident"):
        verify(_without(g, lambda n: n.target is ops.fetch))
    with pytest.raises(VerificationError, match="never stepped"):
        verify(_without(g, lambda n: n.target is ops.optimizer_step))
    with pytest.raises(VerificationError):   # the budget or the end-state check catches it
        verify(_without(g, lambda n: n.target is ops.release))
    with pytest.raises(VerificationError, match="allocated zeroed"):
        verify(_retarget(g, lambda n: n.target is ops.fetch, ops.alloc))
    tighter = g.evolve(settings=dataclasses.replace(g.settings, budget=g.plan.predicted_peak - 1))
    with pytest.raises(VerificationError, match="exceed the budget"):
        verify(tighter)


def test_verifier_failure_shows_nodes_around_the_fault():
    g = _scheduled()
    with pytest.raises(VerificationError) as e:
        verify(_without(g, lambda n: n.target is ops.fetch))
    assert ">> " in str(e.value)


def test_schedule_keeps_budget_and_fetches_before_use():
    g = _scheduled()
    budget = g.settings.budget
    for n in g.nodes:
        a = g.ann[n.name]
        assert g.plan.static_bytes + a.resident_bytes + a.live_bytes + a.workspace_bytes <= budget
    assert g.plan.predicted_peak <= budget


def test_printing_is_deterministic_and_complete():
    # an explicit budget: device_memory=None means the memory free at compile time, which varies run to run
    a, _, _ = _stages(budget=2**30)
    b, _, _ = _stages(budget=2**30)
    assert str(a["scheduled"]) == str(b["scheduled"])
    text = str(a["scheduled"]).splitlines()
    # everything fits: the parameters stay on the device across steps (no fetch); the gradient buffer is per step
    assert "alloc(chunk=0, buf=grad)" in "\n".join(text) and "fetch(" not in "\n".join(text)
    assert any("optimizer_step(chunk=" in t for t in text)
    node_lines = [t for t in text if t[:5].strip().isdigit()]
    assert len(node_lines) == len(a["scheduled"].nodes)
    assert any("float32" in t and "(4, 16, 64)" in t for t in node_lines)   # shape and dtype columns


def test_schedule_evicts_the_buffer_used_furthest_in_the_future():
    """Belady: at every eviction, no other resident buffer that the next node does not need is used later."""
    from pstar_fx.ir.needs import BufKey, all_needs
    case = small_batches(CASES_BY_NAME["gpt_tied"])
    step = compiled_step(case, budget=tight_budget(case, 1024), chunk_size=1024, prefetch=0)
    g = step.lower(*case.batch(0))["scheduled"]
    nodes, needs = g.nodes, all_needs(g)
    uses: dict = {}
    for i, x in enumerate(needs):
        for k in x.resident:
            uses.setdefault(k, []).append(i)

    def next_use(k, i):
        return next((u for u in uses[k] if u > i), float("inf"))

    resident, evictions = set(), 0
    for i, n in enumerate(nodes):
        a = g.ann[n.name]
        if a.role is Role.FETCH:
            resident.add(BufKey(a.chunk, a.buf))
        elif a.role is Role.RELEASE:
            key = BufKey(a.chunk, a.buf)
            resident.discard(key)
            if next_use(key, i) != float("inf"):      # an eviction, not a release after the last use
                evictions += 1
                following = next(j for j in range(i, len(nodes)) if g.ann[nodes[j].name].role not in
                                 (Role.FETCH, Role.RELEASE))
                others = [k for k in resident if k not in needs[following].resident]
                assert all(next_use(k, i) <= next_use(key, i) for k in others), (n.name, key, others)
    assert evictions > 0, "the tight budget should force evictions"


def test_node_copy_names_copies_as_torch_does_without_its_quadratic_search():
    """fx_utils.node_copy names a copy within the same graph as torch 2.13's Graph.node_copy does (the next free
    "base_N"), by handing torch the base name: torch 2.11 would try every "base_1", "base_2", ... for a taken name
    ending in a number. Same target, arguments and meta."""
    import torch.fx as fx
    from pstar_fx.ir.fx_utils import node_copy

    def build():
        g = fx.Graph()
        x = g.placeholder("x")
        ts = [g.call_function(torch.t, (x,)) for _ in range(40)]
        for t in ts:
            t.meta["tag"] = t.name
        g.output(ts[-1])
        return g, ts

    ours, theirs = build(), build()
    for k in (7, 0, 39, 7):
        a = node_copy(ours[0], ours[1][k], lambda n: n)
        b = theirs[0].node_copy(theirs[1][k], lambda n: n)
        assert a.name == b.name and a.target is b.target and a.meta == b.meta
        assert [x.name for x in a.args] == [x.name for x in b.args]
    assert [n.name for n in ours[0].nodes] == [n.name for n in theirs[0].nodes]


def _moves(g):
    """(position, role, key) of the scheduled graph's fetches and releases, and each key's users' positions."""
    from pstar_fx.ir.needs import BufKey, all_needs
    moves, users = [], {}
    for i, (n, x) in enumerate(zip(g.nodes, all_needs(g))):
        a = g.ann[n.name]
        if a.role in (Role.FETCH, Role.RELEASE):
            moves.append((i, a.role, BufKey(a.chunk, a.buf)))
        else:
            for k in x.resident:
                users.setdefault(k, []).append(i)
    return moves, users


@pytest.mark.parametrize("case_name", ["gpt_tied", "hf_llama"])
def test_releases_follow_last_use_and_fetches_go_as_early_as_the_budget_allows(case_name):
    """With prefetch: each release comes right after its buffer's last use before it (only other fetches and
    releases between), so a victim's room is free before the fetch that wanted it; prefetch=None hoists fetches
    further than prefetch=4, which hoists further than 0, all moving the same bytes, and every plan stays within the
    budget."""
    case = small_batches(CASES_BY_NAME[case_name])
    budget = tight_budget(case, 1024, slack=1.3)
    graphs = {pf: compiled_step(case, budget=budget, chunk_size=1024, prefetch=pf).lower(*case.batch(0))["scheduled"]
              for pf in (0, 4, None)}
    lead = {}
    for pf, g in graphs.items():
        assert g.plan.predicted_peak <= budget
        moves, users = _moves(g)
        first_op = next(i for i, n in enumerate(g.nodes) if n.op != "placeholder")
        lead[pf] = 0
        for i, role, key in moves:
            later = [u for u in users.get(key, []) if u > i]
            if role is Role.FETCH:
                lead[pf] += later[0] - i if later else 0     # none later: fetched back for the next step
                continue
            if pf == 0:
                continue
            earlier = [u for u in users.get(key, []) if u < i]
            start = earlier[-1] + 1 if earlier else first_op
            between = [j for j in range(start, i) if g.ann[g.nodes[j].name].role not in (Role.FETCH, Role.RELEASE)]
            assert not between, (pf, key, i, between)
    assert graphs[None].plan.h2d_bytes == graphs[4].plan.h2d_bytes == graphs[0].plan.h2d_bytes
    assert graphs[None].plan.d2h_bytes == graphs[4].plan.d2h_bytes == graphs[0].plan.d2h_bytes
    assert lead[None] > lead[4] > lead[0], lead


def test_prefetch_none_trains_equal_to_eager_under_a_tight_budget():
    case = small_batches(CASES_BY_NAME["gpt_tied"])
    losses, sd, step = compiled_run(case, 3, budget=tight_budget(case, 1024), chunk_size=1024, prefetch=None)
    assert step.last_step.measured_peak == step.graphs["scheduled"].plan.predicted_peak   # debug=True checks each node
    ref_losses, ref_sd = eager_run(case, 3, host_params=host_params(step))
    assert rel_err(losses, ref_losses) <= 1e-6
    assert_state_close(sd, ref_sd, rtol=1e-6)


def test_schedule_returns_place_optimizers_schedule_only_for_the_graph_it_was_made_from():
    """place_optimizer may hand the schedule pass the schedule it made of the placement it keeps (ir.Scheduled): the
    pass returns it for that very graph at the default prefetch, and schedules anything else itself."""
    from pstar_fx.ir import Scheduled
    from pstar_fx.passes import schedule
    stages, _, _ = _stages()
    placed = stages["optimizer_placed"]
    fresh = schedule(placed)
    assert str(fresh) == str(stages["scheduled"])
    marker = fresh.evolve(made_by="a schedule made before")
    handed = placed.evolve(scheduled=Scheduled(placed.gm, placed.ann, placed.chunks, placed.settings, marker))
    assert schedule(handed) is marker
    assert schedule(handed, prefetch=2) is not marker
    other = handed.evolve(chunks=tuple(dataclasses.replace(c, state_home=StateHome.HOST)
                                       if c.group is ChunkGroup.TRAINABLE else c for c in handed.chunks))
    assert schedule(other) is not marker
    assert str(schedule(other)) != str(fresh)
