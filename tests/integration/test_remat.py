"""The remat pass: forward activations recomputed in backward where the budget needs it, a block at a time.

Under a budget no plan without recomputation fits (the compile fails with remat=False), the compiled step recomputes,
fits the budget as planned and measured, and trains exactly as eager PyTorch (fp32, random data, several steps,
dropout included: random ops are never recomputed). At a budget the step fits without, the graph is unchanged.
CPU tests (exact fp32 comparisons); the light variants' bit-for-bit test is marked cuda too (PSTAR_TEST_DEVICE).
"""
import dataclasses
import functools
import re

import pytest
import torch
from hypothesis import given, settings, strategies as st

import pstar_fx as px
from pstar_fx.ir import Phase
from pstar_fx.passes import pipeline, run_passes
from pstar_fx.passes.liveness import analyze
from pstar_fx.ir import REMAT, USER_CHECKPOINT
from pstar_fx.ir.fx_utils import draws_random
from pstar_fx.passes.remat import GraphFacts, Replay, apply, block_paths, find_segments, light_segments, remat
from pstar_fx.passes.remat.rewrite import keep_forward_values
from pstar_fx.frontend.trace import trace_step
from harness import DEVICE, HYPER, compiled_step, eager_run, rel_err
from models import CASES_BY_NAME, CHECKPOINT_CASES, GPT, Case, _gpt_batch, assert_state_close, gpt_loss


STEPS = 4
CHUNK = 1024
GPT_DROPOUT = Case("gpt_dropout", lambda: GPT(vocab=64, block_size=16, n_layer=2, n_head=2, n_embd=32, dropout=0.1),
                   gpt_loss, _gpt_batch)
GPT_DEEP = Case("gpt_deep", lambda: GPT(vocab=64, block_size=16, n_layer=4, n_head=2, n_embd=32),
                gpt_loss, functools.partial(_gpt_batch, B=8))


def _step(case, budget, remat="auto", device="cpu", **kw):
    return px.compile(case.build_model(), optimizer=px.AdamW(**HYPER), device_memory=budget, chunk_size=CHUNK,
                      device=device, debug=True, remat=remat, **kw)(case.loss_fn)


def _least(case, remat):
    return _step(case, None, remat).min_device_memory(*case.batch(0))


def _random_ops(g):
    return [n for n in g.nodes if n.op == "call_function" and draws_random(n)]


@pytest.mark.parametrize("case", [CASES_BY_NAME["gpt_tied"], GPT_DROPOUT, GPT_DEEP, CASES_BY_NAME["hf_gpt2"],
                                  CASES_BY_NAME["hf_llama"]], ids=lambda c: c.name)
def test_budget_only_remat_fits_matches_eager(case):
    without, with_remat = _least(case, False), _least(case, "auto")
    assert with_remat < 0.8 * without, (with_remat, without)
    budget = (without + with_remat) // 2
    with pytest.raises(px.BudgetError, match="remat"):
        _step(case, budget, remat=False).lower(*case.batch(0))
    step = _step(case, budget)
    torch.manual_seed(5)                     # dropout draws from the global generator, in eager as compiled
    losses = [step(*case.batch(i)).item() for i in range(STEPS)]
    torch.manual_seed(5)
    ref_losses, ref_sd = eager_run(case, STEPS)
    assert rel_err(losses, ref_losses) <= 1e-6, (losses, ref_losses)
    assert_state_close(step.state_dict(), ref_sd, rtol=1e-6)
    g = step.graphs["scheduled"]
    assert any(REMAT in n.meta for n in g.nodes)
    assert g.plan.predicted_peak <= budget
    assert step.last_step.measured_peak == g.plan.predicted_peak      # debug=True also checked every node
    assert len(_random_ops(g)) == len(_random_ops(step.graphs["liveness"])) == (7 if case is GPT_DROPOUT else 0)
    assert not any(REMAT in n.meta for n in _random_ops(g)), "a random op was recomputed"


def test_remat_leaves_the_graph_unchanged_when_it_fits():
    case = CASES_BY_NAME["gpt_tied"]
    stages = _step(case, "1TiB").lower(*case.batch(0))
    assert stages["remat"].gm is stages["liveness"].gm
    assert not any(REMAT in n.meta for n in stages["scheduled"].nodes)
    unlimited = stages["liveness"].evolve(settings=dataclasses.replace(stages["liveness"].settings, budget=None))
    assert px.passes.remat(unlimited).gm is unlimited.gm
    tight = _step(case, int(_least(case, "auto") * 1.05)).lower(*case.batch(0))
    assert tight["remat"].gm is not tight["liveness"].gm
    assert "recompute" in str(tight["remat"])          # recomputed nodes print with their own phase
    # why, recorded for step.summary(): nothing recomputed at 1 TiB; at the tight budget, the segments taken and
    # the least budgets without and with them
    assert [c.why for c in stages["remat"].choices] == [
        "nothing recomputed: at the budget 1024.00 GiB every activation fits beside every chunk on the device"]
    (why,) = [c.why for c in tight["remat"].choices]
    recomputed = sum(REMAT in n.meta for n in tight["remat"].nodes)
    assert re.match(rf"recomputes \d+ of \d+ candidate segments \({recomputed} nodes, ", why), why
    assert "without them the step needs at least" in why or "less to move" in why, why
    assert tight["scheduled"].choices[:1] == tight["remat"].choices        # carried to the final graph


def test_min_device_memory_is_the_least_budget_with_remat():
    case = CASES_BY_NAME["gpt_tied"]
    need = _least(case, "auto")
    with pytest.raises(px.BudgetError) as e:
        _step(case, need - 1).lower(*case.batch(0))
    assert e.value.needed == need and e.value.available == need - 1
    assert "remat" in str(e.value) and e.value.node in str(e.value)
    _step(case, need)(*case.batch(0))


@pytest.mark.parametrize("precision,accumulate", [("fp32", 2), ("bf16", 1)])
def test_remat_changes_no_value(precision, accumulate):
    """Recomputed values are the same ops on the same inputs: a tight budget with remat trains bit for bit as an
    unlimited one, in half precision too (where a recompute may read a parameter after its gradient is written:
    that chunk keeps a separate gradient buffer), and with gradient accumulation (one recompute per micro-batch)."""
    case = dataclasses.replace(GPT_DEEP, make_batch=functools.partial(_gpt_batch, B=4))
    probe = _step(case, None, precision=precision, accumulate=accumulate)
    budget = int(probe.min_device_memory(*case.batch(0)) * 1.05)
    runs = []
    for b in (budget, None):
        step = _step(case, b, precision=precision, accumulate=accumulate)
        runs.append(([step(*case.batch(i)).item() for i in range(STEPS)], step.state_dict(), step))
    (tight, tight_sd, step), (free, free_sd, _) = runs
    g = step.graphs["scheduled"]
    seeds = sum(n.target is torch.ops.aten.ones_like.default for n in g.nodes)
    assert seeds == accumulate
    assert len({n.meta[REMAT].segment for n in g.nodes if REMAT in n.meta}) >= accumulate
    assert tight == free, (tight, free)
    for k in free_sd:
        assert torch.equal(tight_sd[k], free_sd[k]), k


def _liveness_graph(case):
    step = compiled_step(case, chunk_size=CHUNK)
    traced = trace_step(step._fn, step._model, case.batch(0), step.settings)
    return run_passes(traced, pipeline(chunk_size=CHUNK)[:4])[-1]


@pytest.mark.parametrize("name", ["gpt_tied", "hf_llama"])
def test_replay_is_liveness_of_the_rewritten_graph(name):
    """The choice is made on a replay of liveness; it equals liveness over the graph the pass builds, for each
    segment alone and for all of them."""
    g = _liveness_graph(CASES_BY_NAME[name])
    G = GraphFacts(g)
    segments = find_segments(g, G)
    light = light_segments(g, G, segments)
    assert light
    replay = Replay(g, G, None)
    replay.add(segments + light)
    for chosen in [[s] for s in segments + light] + [list(segments), list(light)]:
        out = apply(g, chosen)
        assert replay.live([s.id for s in chosen]) == list(analyze(out.nodes, out.ann).live)
        px.passes.verify(out)


def test_segments_are_blocks_cut_after_the_residual_add():
    g = _liveness_graph(GPT_DEEP)
    segments = find_segments(g)
    blocks = [s.block for s in segments]
    assert [b for b in blocks if b is not None] == ["h.0", "h.1", "h.2", "h.3"]
    nodes = g.nodes
    mm = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default}
    for s in segments:
        if s.block is None:
            continue
        assert sum(nodes[i].target in mm for i in s.recompute) == 3     # all but the last one's (its output is not saved)
        assert nodes[s.end - 1].target is torch.ops.aten.add.Tensor          # the block's last residual add
        assert all(g.ann[nodes[i].name].phase is Phase.FORWARD for i in s.recompute)
        assert g.ann[nodes[s.at].name].phase is Phase.BACKWARD
    # later blocks' backward runs first: their recompute comes earlier in the graph
    ats = [s.at for s in segments if s.block is not None]
    assert ats == sorted(ats, reverse=True)


# the test models' compute-bound ops (their CPU trace): what a light variant keeps and never recomputes
_HEAVY = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
          torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default}


def test_light_segments_keep_the_matrix_products_and_attention():
    """A segment's light variant has its nodes and recomputes only the cheap operations between its compute-bound
    values (which it keeps): no matrix product or attention, fewer nodes and less compute than the whole segment,
    and it frees less."""
    g = _liveness_graph(CASES_BY_NAME["hf_llama"])
    G = GraphFacts(g)
    segments = find_segments(g, G)
    light = light_segments(g, G, segments)
    whole = {s.start: s for s in segments}
    assert {v.block for v in light} >= {"model.layers.0", "model.layers.1"}
    for v in light:
        s = whole[v.start]
        assert v.light and not s.light and (v.end, v.block, v.seed) == (s.end, s.block, s.seed)
        assert v.id > max(x.id for x in segments)
        assert not [g.nodes[i].target for i in v.recompute if g.nodes[i].target in _HEAVY]
        assert set(v.recompute) < set(s.recompute) and v.seconds < s.seconds and v.freed <= s.freed
        assert v.freed > 0


@pytest.mark.cuda
def test_light_segments_where_they_suffice_train_bit_for_bit(monkeypatch):
    """At a budget where recomputing only the cheap operations lets everything fit on the device, remat recomputes
    no matrix product or attention, says so, and the step trains bit for bit as at an unlimited budget, on the
    tests' device (both steps unfused: the same kernels). (The tiny model's recomputes are worth their compute only
    at rates without a kernel's fixed overhead: the machine the passes weigh at is given those.)"""
    import pstar_fx.api.step as step_module
    fast = dataclasses.replace(px.cost.H200, kernel_s=1e-9)
    monkeypatch.setattr(step_module, "resolve_machine", lambda *a, **k: fast)
    case = CASES_BY_NAME["hf_llama"]
    g = _liveness_graph(case)
    G = GraphFacts(g)
    segments = find_segments(g, G)
    light = light_segments(g, G, segments)
    replay = Replay(g, G, 0)                   # budget 0: comfort's peak is the comfort itself
    replay.add(segments + light)
    budget = replay.figures([v.id for v in light]).peak + (1 << 10)
    assert budget < replay.figures(()).peak
    runs = []
    for b in (budget, None):
        step = _step(case, b, device=DEVICE, fuse=False)
        runs.append(([step(*case.batch(i)).item() for i in range(STEPS)], step.state_dict(), step))
    (tight, tight_sd, step), (free, free_sd, _) = runs
    stages = step.lower(*case.batch(0))
    copies = [n for n in stages["remat"].nodes if REMAT in n.meta]
    assert copies and not [n for n in copies if n.target in _HEAVY]
    (why,) = [c.why for c in stages["remat"].choices]
    assert re.search(r"recomputes (\d+) of 3 candidate segments, \1 of them only their cheap operations", why), why
    assert tight == free, (tight, free)
    for k in free_sd:
        assert torch.equal(tight_sd[k], free_sd[k]), k


@functools.lru_cache(maxsize=None)
def _cached_liveness_graph(name: str):
    return _liveness_graph(GPT_DEEP if name == "gpt_deep" else CASES_BY_NAME[name])


@settings(max_examples=30, deadline=None)
@given(name=st.sampled_from(["gpt_deep", "hf_llama"]), where=st.floats(0, 1), cheap=st.booleans())
def test_any_budget_chooses_one_variant_a_segment_and_nothing_to_spare(name, where, cheap):
    """Property: at any budget between the least need and everything fitting, the chosen segments hold at most one
    variant of each segment, meet the need, and none of them can be dropped or made light without raising one of
    the figures the choice is made by; the rewritten graph verifies. With a kernel's fixed overhead (the H200's
    rates) the tiny models' light variants are not worth their compute; without it they are, and the light-then-
    whole path runs."""
    g = _cached_liveness_graph(name)
    G = GraphFacts(g)
    segments = find_segments(g, G)
    light = light_segments(g, G, segments)
    by_id = {s.id: s for s in segments + light}
    twin = {v.start: v for v in light}
    probe = Replay(g, G, 0)
    probe.add(segments + light)
    least = probe.figures([s.id for s in segments]).need
    top = probe.figures(()).peak
    budget = least + int(where * (top - least))
    machine = dataclasses.replace(px.cost.H200, kernel_s=1e-9) if cheap else px.cost.H200
    out = remat(g.evolve(settings=dataclasses.replace(g.settings, budget=budget)), machine=machine)
    px.passes.verify(out)
    chosen = sorted({n.meta[REMAT].segment for n in out.nodes if REMAT in n.meta})
    starts = [by_id[c].start for c in chosen]
    assert len(starts) == len(set(starts)), chosen
    replay = Replay(g, G, budget)
    replay.add(segments + light)

    def key(ids):
        f = replay.figures(ids)
        return (max(0, f.need - budget), f.peak, f.excess)
    best = key(chosen)
    assert best[0] == 0
    for c in chosen:
        rest = [x for x in chosen if x != c]
        assert key(rest) > best, (c, chosen)
        v = twin.get(by_id[c].start)
        if v is not None and v.id != c:
            assert key(rest + [v.id]) > best, (c, chosen)


def test_block_paths():
    names = ["wte.weight", "h.0.ln_1.weight", "h.0.mlp.0.weight", "h.0.mlp.2.weight", "h.1.mlp.0.weight", "ln_f.bias"]
    assert block_paths(names) == {"wte.weight": None, "h.0.ln_1.weight": "h.0", "h.0.mlp.0.weight": "h.0",
                                  "h.0.mlp.2.weight": "h.0", "h.1.mlp.0.weight": "h.1", "ln_f.bias": None}
    t5 = ["encoder.block.0.layer.0.q.weight", "encoder.block.0.layer.1.wi.weight", "encoder.block.1.layer.0.q.weight",
          "decoder.block.0.layer.0.q.weight", "decoder.block.1.layer.0.q.weight", "shared.weight"]
    assert [block_paths(t5)[n] for n in t5] == ["encoder.block.0", "encoder.block.0", "encoder.block.1",
                                                "decoder.block.0", "decoder.block.1", None]
    assert block_paths(["conv1.weight", "bn1.weight", "fc.bias", "scale"]) == {
        "conv1.weight": "conv1", "bn1.weight": "bn1", "fc.bias": "fc", "scale": None}


def test_remat_option_is_checked():
    with pytest.raises(ValueError, match="remat"):
        px.compile(torch.nn.Linear(2, 2), optimizer=px.AdamW(lr=1e-3), device="cpu", remat="always")(
            lambda m, x: m(x).sum())


def test_remat_lowers_the_peak_the_optimizer_states_share():
    """Where the optimizer states cannot all stay on the device (no choice makes comfort fit), they share it with
    the activations at the peak, where backward starts and every block's forward values are live: every block whose
    recompute lowers that peak is recomputed (all but the last at least; the last too here, since the loss's
    gradient, not a block's, is the peak's largest value and the last block's recompute comes after it), not only
    the first ones, which lowered the sum over nodes most (the choice before the peak was a figure: h.0 and h.1 here,
    as at 17B, where it left 16 of 54 blocks' activations and 37 fewer chunks' states on the device), and more
    chunks' states fit on the device than with those two."""
    import pstar_fx.api.plan as planning
    from pstar_fx.ir import ChunkGroup, Precision, Settings, StateHome
    from pstar_fx.passes import place_optimizer, remat
    from pstar_fx.api.plan_cli import GPT as PlanGPT, GPTConfig, gpt_loss as plan_loss
    cfg = GPTConfig(vocab=1024, seq=512, layers=6, hidden=1024, heads=4)
    with torch.device("meta"):
        model = PlanGPT(cfg)
    tokens = torch.empty(4, 512, dtype=torch.long, device="meta")
    settings = Settings(precision=Precision("bf16"), device=torch.device("cpu"), budget=500 << 20,
                        chunk_size=None, optimizer=planning._layout(model, None))
    g = run_passes(trace_step(plan_loss, model, (tokens, tokens), settings), pipeline()[:4])[-1]
    G = GraphFacts(g)
    segments = find_segments(g, G)
    by_id = {s.id: s for s in segments + light_segments(g, G, segments)}
    out = remat(g)
    recomputed = {by_id[n.meta[REMAT].segment].block for n in out.nodes if REMAT in n.meta}
    assert recomputed >= {f"h.{i}" for i in range(5)}
    if "h.5" in recomputed:        # the last block too only where that lowers the activation peak further
        without_last = apply(g, [s for s in segments if s.block != "h.5"])
        assert max(analyze(out.nodes, out.ann).live) < max(analyze(without_last.nodes, without_last.ann).live)

    def on_device(x):
        return sum(c.state_home is StateHome.DEVICE for c in place_optimizer(x).chunks
                   if c.group is ChunkGroup.TRAINABLE)
    first_two = [s for s in segments if s.block in ("h.0", "h.1")]
    assert on_device(out) > on_device(apply(g, first_two))


def test_why_says_the_users_checkpoints_stay_where_the_activations_fit_only_with_them():
    """At a budget where everything fits on the device with the user's checkpoints and not without them, remat keeps
    them, and its recorded why says so (not that every activation fits)."""
    case = CHECKPOINT_CASES[0]
    step = px.compile(case.build_model(), optimizer=px.AdamW(**HYPER), device="cpu", chunk_size=1024,
                      remat=False)(case.loss_fn)
    g = step.lower(*case.batch(0))["liveness"]
    comfort = lambda gr: Replay(gr, GraphFacts(gr), 0).figures(()).peak     # noqa: E731 - budget 0: the peak itself
    with_them, without = comfort(g), comfort(keep_forward_values(g))
    assert with_them < without
    out = remat(g.evolve(settings=dataclasses.replace(g.settings, budget=with_them)))
    assert any(USER_CHECKPOINT in n.meta and n.meta[USER_CHECKPOINT].recompute_of is not None for n in out.nodes)
    (why,) = [c.why for c in out.choices]
    assert why.startswith("the user's checkpoints kept and nothing more recomputed"), why
