"""Mixture of experts: transformers' Mixtral trains equal to eager with its default experts implementation
(grouped_mm); the "eager" implementation (nonzero, a Python loop over the experts hit) is refused with a clear error."""
import dataclasses
import functools

import pytest
import torch

import pstar_fx as px
from pstar_fx.fake_fixes import grouped_mm, grouped_mm_backward
from harness import check_tight_budget_matches_eager, compiled_run, eager_run, rel_err
from models import MOE_CASES, assert_state_close, hf_loss, tiny_mixtral

STEPS = 4
CASE = MOE_CASES[0]


def test_default_experts_use_grouped_mm():
    assert tiny_mixtral().config._experts_implementation == "grouped_mm"


def test_mixtral_matches_eager_unlimited():
    ref_losses, ref_sd = eager_run(CASE, STEPS)
    losses, sd, step = compiled_run(CASE, STEPS)
    assert rel_err(losses, ref_losses) <= 1e-6, (losses, ref_losses)
    assert_state_close(sd, ref_sd, rtol=1e-6)
    assert step.last_step.measured_peak == step.graphs["scheduled"].plan.predicted_peak
    targets = {n.target for n in step.graphs["scheduled"].nodes}
    assert torch.ops.pstar.grouped_mm.default in targets and torch.ops.pstar.grouped_mm_backward.default in targets


def test_mixtral_matches_eager_tight():
    case = dataclasses.replace(CASE, make_batch=functools.partial(CASE.make_batch, B=1, T=8))
    check_tight_budget_matches_eager(case, STEPS)


def test_grouped_mm_op_and_its_backward_equal_torch_bitwise():
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(12, 8, generator=gen, requires_grad=True)
    b = torch.randn(3, 8, 16, generator=gen, requires_grad=True)
    offs = torch.tensor([3, 7, 12], dtype=torch.int32)
    grad = torch.randn(12, 16, generator=gen)
    out = torch._grouped_mm(a, b, offs=offs)
    ref = torch.autograd.grad(out, (a, b), grad)
    assert torch.equal(grouped_mm(a.detach(), b.detach(), offs), out.detach())
    ga, gb = grouped_mm_backward(a.detach(), b.detach(), offs, grad)
    assert torch.equal(ga, ref[0]) and torch.equal(gb, ref[1])
    a2, b2 = a.detach().requires_grad_(True), b.detach().requires_grad_(True)
    assert all(torch.equal(x, y) for x, y in zip(torch.autograd.grad(grouped_mm(a2, b2, offs), (a2, b2), grad), ref))


def test_eager_experts_are_refused_naming_nonzero_and_the_line():
    model = tiny_mixtral("eager").train()
    step = px.compile(model, optimizer=px.AdamW(lr=1e-3), device="cpu")(hf_loss)
    with pytest.raises(px.UntraceableError, match=r"nonzero.*modeling_mixtral\.py"):
        step(*CASE.batch(0))
