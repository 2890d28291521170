"""Activation checkpointing in user code (torch.utils.checkpoint, both modes; transformers'
gradient_checkpointing_enable): traced as eager autograd runs it, trained equal to eager, planned exactly.
CPU tests (exact fp32 comparisons), not marked cuda."""
import dataclasses
import functools

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import pstar_fx as px
from pstar_fx.frontend.user_checkpoint import checkpoint_regions
from pstar_fx.ir import USER_CHECKPOINT
from pstar_fx.ir.flops import op_of
from harness import HYPER, check_tight_budget_matches_eager, compiled_run, compiled_step, eager_run, rel_err
from models import (CASES, CASES_BY_NAME, CHECKPOINT_CASES, GPT, MODEL_SEED, CheckpointedGPT, assert_state_close,
                    gpt_loss)


STEPS = 4


def _small(case):
    kw = dict(B=1, T=8) if case.name.startswith("hf_") else dict(B=2)
    return dataclasses.replace(case, make_batch=functools.partial(case.make_batch, **kw))


@pytest.mark.parametrize("case", CHECKPOINT_CASES, ids=lambda c: c.name)
def test_checkpointed_model_matches_eager_unlimited(case):
    ref_losses, ref_sd = eager_run(case, STEPS)
    losses, sd, step = compiled_run(case, STEPS)
    assert rel_err(losses, ref_losses) <= 1e-6, (losses, ref_losses)
    assert_state_close(sd, ref_sd, rtol=1e-6)
    assert step.last_step.measured_peak == step.graphs["scheduled"].plan.predicted_peak
    assert len(checkpoint_regions(step.graphs["scheduled"])) == 2      # one per layer, through every pass


@pytest.mark.parametrize("case", [_small(c) for c in CHECKPOINT_CASES], ids=lambda c: c.name)
def test_checkpointed_model_matches_eager_tight(case):
    check_tight_budget_matches_eager(case, STEPS)


@pytest.mark.parametrize("case", CHECKPOINT_CASES, ids=lambda c: c.name)
def test_graph_holds_the_recompute_and_plans_less_memory(case):
    """The traced backward recomputes each region (both modes): more compute ops than the uncheckpointed model, less
    planned peak (with remat=False, which keeps the user's checkpoints as they are); every recompute node names a
    forward twin with the same op. With remat (the default) at a budget where the activations fit, the checkpoints
    are undone: the remat stage computes what the uncheckpointed model does, and plans its peak."""
    plain = CASES_BY_NAME[{"gpt": "gpt_tied", "hf_gpt2": "hf_gpt2", "hf_llama": "hf_llama"}[
        case.name.split("_gc")[0].split("_ckpt")[0]]]
    steps = {}
    for c in (plain, case):
        s = px.compile(c.build_model(), optimizer=px.AdamW(lr=1e-3), device="cpu", remat=False)(c.loss_fn)
        s(*c.batch(0))
        steps[c.name] = s
    auto = compiled_step(case)
    auto(*case.batch(0))
    g, g0 = steps[case.name].graphs["canonical"], steps[plain.name].graphs["canonical"]
    mm = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}
    count = lambda gr: sum(op_of(n) in mm for n in gr.nodes)     # a gradient write's folded mm too (grad_into)
    assert count(g) > count(g0)
    assert (steps[case.name].graphs["scheduled"].plan.predicted_peak
            < steps[plain.name].graphs["scheduled"].plan.predicted_peak)
    assert count(auto.graphs["remat"]) == count(g0) < count(auto.graphs["canonical"])
    assert "user checkpoints undone" in auto.graphs["remat"].made_by
    by_name = {n.name: n for n in g.nodes}
    regions = checkpoint_regions(g)
    assert len(regions) == 2
    for r in regions:
        assert any(by_name[x].target in mm for x in r.recompute), r
        for x in r.recompute:
            tag = by_name[x].meta[USER_CHECKPOINT]
            assert tag.region == r.id
            twin = by_name.get(tag.recompute_of)     # None: forward never used it, canonicalize dropped it
            assert twin is not None or by_name[x].target not in mm
            if twin is not None:
                assert twin.target == by_name[x].target and twin.meta[USER_CHECKPOINT].recompute_of is None


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_no_regions_without_checkpointing(case):
    step = compiled_step(case)
    step(*case.batch(0))
    assert checkpoint_regions(step.graphs["traced"]) == ()


@pytest.mark.parametrize("reentrant", [False, True])
def test_dropout_in_checkpointed_region_reuses_forward_masks(reentrant):
    """Eager checkpointing restores the RNG before recomputing, so dropout repeats the forward's mask. The compiled
    step gives recomputed random ops the forward's values: with the same seed it trains exactly as eager, and as the
    same model without checkpointing."""
    def build(ckpt):
        if ckpt:
            return CheckpointedGPT(vocab=64, block_size=16, n_layer=2, n_head=2, n_embd=32, dropout=0.1,
                                   reentrant=reentrant)
        return GPT(vocab=64, block_size=16, n_layer=2, n_head=2, n_embd=32, dropout=0.1)

    batches = [CASES_BY_NAME["gpt_tied"].batch(i) for i in range(STEPS)]
    results = {}
    for ckpt in (False, True):
        torch.manual_seed(MODEL_SEED)
        model = build(ckpt)
        step = px.compile(model, optimizer=px.AdamW(**HYPER), device="cpu", debug=True)(gpt_loss)
        torch.manual_seed(5)
        results[("compiled", ckpt)] = ([step(*b).item() for b in batches], step.state_dict())
        torch.manual_seed(MODEL_SEED)
        model = build(ckpt)
        opt = torch.optim.AdamW(model.parameters(), **HYPER, fused=True)
        torch.manual_seed(5)
        losses = []
        for b in batches:
            loss = gpt_loss(model, *b)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
        results[("eager", ckpt)] = (losses, {k: v.detach().clone() for k, v in model.state_dict().items()})
    ref_losses, ref_sd = results[("eager", True)]
    assert rel_err(results[("eager", False)][0], ref_losses) == 0     # eager: checkpointing changes nothing
    for key in (("compiled", True), ("compiled", False)):
        losses, sd = results[key]
        assert rel_err(losses, ref_losses) <= 1e-6, (key, losses, ref_losses)
        assert_state_close(sd, ref_sd, rtol=1e-6)


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointed_model_with_gradient_accumulation_matches_eager(reentrant):
    """Two micro-batches a step, each through checkpointed blocks: a reentrant checkpoint's backward accumulates
    into the leaves' `.grad`, which the trace of the second micro-batch finds holding the first one's gradients; the
    step trains as eager `(loss_k / 2).backward()` per micro-batch."""
    def build():
        torch.manual_seed(MODEL_SEED)
        return CheckpointedGPT(vocab=64, block_size=16, n_layer=2, n_head=2, n_embd=32, reentrant=reentrant)

    batches = [CASES_BY_NAME["gpt_tied"].batch(i) for i in range(STEPS)]
    step = px.compile(build(), optimizer=px.AdamW(**HYPER), device="cpu", accumulate=2, debug=True)(gpt_loss)
    losses = [step(*b).item() for b in batches]
    model = build()
    opt = torch.optim.AdamW(model.parameters(), **HYPER, fused=True)
    ref_losses = []
    for idx, targets in batches:
        parts = [gpt_loss(model, idx.chunk(2)[k], targets.chunk(2)[k]) for k in range(2)]
        for part in parts:
            (part / 2).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        ref_losses.append(sum(p.item() for p in parts) / 2)
    assert rel_err(losses, ref_losses) <= 1e-6, (losses, ref_losses)
    assert_state_close(step.state_dict(), {k: v.detach() for k, v in model.state_dict().items()}, rtol=1e-6)
    assert len(checkpoint_regions(step.graphs["traced"])) == 4          # two blocks, two micro-batches


class _NoisyBlock(torch.nn.Module):
    """Draws noise in place into a tensor it also views: a random write pstar-fx cannot pair with its recompute."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        noise = torch.empty(8, 8)
        noise.uniform_()
        return self.lin(x) * noise.t()


def test_unpairable_random_recompute_is_rejected_with_a_clear_error():
    block = _NoisyBlock()
    model = torch.nn.Sequential(block)
    step = px.compile(model, optimizer=px.AdamW(lr=1e-3), device="cpu")(
        lambda m, x: checkpoint(m, x, use_reentrant=False).square().mean())
    with pytest.raises(px.UntraceableError, match="random operation .* runs again in backward"):
        step(torch.randn(8, 8))


def test_attention_without_dropout_is_not_random():
    """CUDA traces attention as torch's efficient-attention op, tagged random although dropout_p=0 draws nothing: a
    reentrant checkpoint's recompute of it needs no forward twin (before, tracing such a model on a GPU raised
    "random operation ... runs again in backward"); with dropout it is random."""
    from pstar_fx.ir.fx_utils import draws_random
    op = torch.ops.aten._scaled_dot_product_efficient_attention.default
    assert torch.Tag.nondeterministic_seeded in op.tags
    g = torch.fx.Graph()
    q, k, v = (g.placeholder(x) for x in "qkv")
    assert not draws_random(g.call_function(op, (q, k, v, None, True)))              # dropout_p defaults to 0
    assert not draws_random(g.call_function(op, (q, k, v, None, True, 0.0)))
    assert draws_random(g.call_function(op, (q, k, v, None, True, 0.1)))
    assert draws_random(g.call_function(torch.ops.aten.bernoulli.p, (q, 0.5)))
