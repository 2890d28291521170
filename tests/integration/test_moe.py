"""Mixture of experts and data-dependent shapes.

transformers' Mixtral trains equal to eager with both of its expert implementations: the default (grouped_mm, fixed
shapes) and "eager" (nonzero, then a Python loop over the experts hit), which is traced as the same loop over every
expert (pstar_fx/frontend/moe_rewrites.py), each expert's token selection a data-dependent size planned at its upper
bound, tokens x top-k, as the printed plan states. A boolean mask in a step compiles the same way. A Python loop over
a data-dependent size, and a data-dependent size without a bound, are refused naming the op and the line (an `if` on
such a size is traced per outcome and guarded: tests/integration/test_guards.py)."""
import dataclasses
import functools
import re

import pytest
import torch
import torch.nn as nn

import pstar_fx as px
from pstar_fx.runtime.run import check_measured
from pstar_fx.frontend import fake_fixes
from pstar_fx.frontend.fake_fixes import grouped_mm, grouped_mm_backward
from pstar_fx.ir.fx_utils import bounded_live, data_dependent_sizes
from pstar_fx.frontend import moe_rewrites
from harness import (DEVICE, HYPER, EagerAdamW, check_tight_budget_matches_eager, compiled_run, eager_run, line_of,
                     rel_err)
from models import MOE_CASES, Case, assert_state_close, tiny_mixtral

STEPS = 4
CASE = MOE_CASES[0]
EAGER = dataclasses.replace(CASE, name="hf_mixtral_eager_experts", build=functools.partial(tiny_mixtral, "eager"))
SMALL = dict(B=1, T=8)                     # the tight-budget batch: 8 tokens, top-2
TOP_K = 2


def _small(case: Case) -> Case:
    return dataclasses.replace(case, make_batch=functools.partial(case.make_batch, **SMALL))


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
    check_tight_budget_matches_eager(_small(CASE), STEPS)


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


# ------------------------------------------------------------------------------------------------------------------
# experts_implementation="eager": nonzero and a data-dependent Python loop


def test_eager_experts_loop_is_recognised_and_only_it():
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts
    # moe_rewrites._EAGER_LOOP is transformers' code: if transformers changes it, this fails (and nothing is rewritten)
    assert (moe_rewrites.fingerprint(MixtralExperts.forward.__wrapped__)
            == moe_rewrites.fingerprint(moe_rewrites._EAGER_LOOP))
    eager, default = tiny_mixtral("eager"), tiny_mixtral()
    assert eager.config._experts_implementation == "eager"
    assert moe_rewrites.rewrite_for(eager.model.layers[0].mlp.experts) is moe_rewrites._all_experts
    assert moe_rewrites.rewrite_for(default.model.layers[0].mlp.experts) is None
    assert all(moe_rewrites.rewrite_for(m) is None for m in eager.modules() if not isinstance(m, MixtralExperts))
    with moe_rewrites.rewritten(eager):
        assert "forward" in vars(eager.model.layers[1].mlp.experts)
    assert not any("forward" in vars(m) for m in eager.modules())


def test_eager_experts_all_experts_loop_equals_transformers_bitwise():
    """The loop over every expert gives transformers' eager result and gradients bit for bit, also when some experts
    receive no token (routing forced onto experts 0 and 2)."""
    experts = tiny_mixtral("eager").model.layers[0].mlp.experts
    gen = torch.Generator().manual_seed(3)
    h = torch.randn(10, 32, generator=gen)
    for idx in (torch.randint(0, 4, (10, TOP_K), generator=gen), torch.tensor([[0, 2], [2, 0]] * 5)):
        w = torch.rand(10, TOP_K, generator=gen)
        results = []
        for fn in (type(experts).forward, moe_rewrites._all_experts):
            hh = h.clone().requires_grad_(True)
            out = fn(experts, hh, idx, w)
            grads = torch.autograd.grad(out, (hh, experts.gate_up_proj, experts.down_proj), torch.ones_like(out))
            results.append((out, *grads))
        assert all(torch.equal(a, b) for a, b in zip(*results))


@pytest.mark.slow
def test_eager_experts_match_eager_unlimited():
    ref_losses, ref_sd = eager_run(EAGER, STEPS)
    losses, sd, step = compiled_run(EAGER, STEPS)     # debug=True: every node's measured bytes checked too
    assert rel_err(losses, ref_losses) <= 1e-6, (losses, ref_losses)
    assert_state_close(sd, ref_sd, rtol=1e-6)
    g = step.graphs["scheduled"]
    nonzeros = [n for n in g.nodes if n.target is torch.ops.aten.nonzero.default]
    assert len(nonzeros) == 2 * 4                      # layers x experts: every expert traced
    assert step.last_step.measured_peak <= g.plan.predicted_peak


def test_eager_experts_match_eager_tight():
    """Tight budget against eager; the measured peak is at most the plan's (sizes planned at their bound)."""
    check_tight_budget_matches_eager(_small(EAGER), STEPS, bounded_sizes=True)


@pytest.mark.slow
def test_eager_experts_accumulate_matches_eager():
    """accumulate=2: each micro-batch's selections are sizes of their own."""
    case = EAGER
    model = case.build_model().to(DEVICE)
    opt = EagerAdamW(model, **HYPER, fused=True)
    ref = []
    for i in range(3):
        halves = [x.to(DEVICE).chunk(2) for x in case.batch(i)]
        total = 0.0
        for k in range(2):
            loss = case.loss_fn(model, *[h[k] for h in halves])
            (loss / 2).backward()
            total += loss.item()
        opt.step()
        ref.append(total / 2)
    step = px.compile(case.build_model(), optimizer=px.AdamW(**HYPER), device=DEVICE, debug=True,
                      accumulate=2)(case.loss_fn)
    losses = [step(*case.batch(i)).item() for i in range(3)]
    assert rel_err(losses, ref) <= 1e-6, (losses, ref)
    assert_state_close(step.state_dict(), model.state_dict(), rtol=1e-6)
    assert len(data_dependent_sizes(step.graphs["scheduled"].nodes)) == 2 * 2 * 4    # micro-batches x layers x experts


@pytest.fixture(scope="module")
def small_eager_step():
    return compiled_run(_small(EAGER), 1)[2]


def test_bound_is_tokens_times_top_k_as_the_plan_states(small_eager_step):
    g = small_eager_step.graphs["scheduled"]
    bound = SMALL["B"] * SMALL["T"] * TOP_K
    sizes = data_dependent_sizes(g.nodes)
    assert len(sizes) == 8 and all(d.bound == bound for d in sizes)
    assert all(d.node.target is torch.ops.aten.nonzero.default for d in sizes)
    text = str(g)
    assert "# data-dependent sizes, planned at their upper bound" in text
    for d in sizes:
        assert f"#   {d.symbol} <= {bound}: aten.nonzero at node {d.node.name}" in text
    # each expert's gathered hidden states (n, 32) and its gate/up projection (n, 96) are planned at n = bound
    hidden, gate_up = 32, 2 * 48
    planned = {}
    for n in g.nodes:
        v = n.meta.get("val")
        if n.target in (torch.ops.aten.index.Tensor, torch.ops.aten.mm.default) and isinstance(v, torch.Tensor) \
                and not isinstance(v.shape[0], int):
            planned.setdefault((n.target, v.shape[1]), set()).add(g.ann[n.name].bytes)
            assert re.search(rf"\(u\d+, {v.shape[1]}\)", text)
    assert planned[(torch.ops.aten.index.Tensor, hidden)] == {bound * hidden * 4}
    assert planned[(torch.ops.aten.mm.default, gate_up)] == {bound * gate_up * 4}


def test_debug_check_is_exact_except_where_a_bounded_size_is_alive(small_eager_step):
    """debug=True compares measured with predicted bytes per node: equal, or at most the prediction while a storage of
    data-dependent size is alive. Checked here on made-up measurements, so that it can be seen to fail."""
    g = small_eager_step.graphs["scheduled"]
    a = [g.ann[n.name] for n in g.nodes]
    predicted = [g.plan.static_bytes + x.resident_bytes + x.live_bytes + x.workspace_bytes for x in a]
    loose = bounded_live(g.nodes)
    i, j = loose.index(True), loose.index(False)
    assert sum(loose) > 0 and not all(loose)
    assert [n.target for n in g.nodes].index(torch.ops.aten.nonzero.default) == i
    check_measured(g, predicted)
    check_measured(g, [p - 1 if k == i else p for k, p in enumerate(predicted)])
    with pytest.raises(AssertionError, match="plan mismatch"):
        check_measured(g, [p + 1 if k == i else p for k, p in enumerate(predicted)])
    with pytest.raises(AssertionError, match="plan mismatch"):
        check_measured(g, [p - 1 if k == j else p for k, p in enumerate(predicted)])


# ------------------------------------------------------------------------------------------------------------------
# data-dependent shapes in the user's own step


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(6, 16), nn.Linear(16, 3)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def _masked_loss(model, x, y):
    keep = x[:, 0] > 0.3                 # rows chosen by the data: a different count every batch (none in batch 2)
    return ((model(x[keep]) - y[keep]) ** 2).sum() / x.shape[0]


def _masked_batch(step, gen):
    x, y = torch.randn(12, 6, generator=gen), torch.randn(12, 3, generator=gen)
    if step == 2:
        x[:, 0] = -1.0
    return x, y


MASKED = Case("masked_rows", _Net, _masked_loss, _masked_batch)


def test_boolean_mask_in_the_step_matches_eager():
    counts = [int((MASKED.batch(i)[0][:, 0] > 0.3).sum()) for i in range(STEPS)]
    assert len(set(counts)) > 1 and counts[2] == 0
    ref_losses, ref_sd = eager_run(MASKED, STEPS)
    losses, sd, step = compiled_run(MASKED, STEPS)
    assert rel_err(losses, ref_losses) <= 1e-6, (losses, ref_losses)
    assert_state_close(sd, ref_sd, rtol=1e-6)
    sizes = data_dependent_sizes(step.graphs["scheduled"].nodes)
    assert [d.bound for d in sizes] == [12]


class _HitLoop(nn.Module):
    """An experts-style loop over the hit rows that is not transformers' code, so not rewritten."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 6))

    def forward(self, x):
        hit = (x[:, 0] > 0).nonzero()  # MARK-hit
        out = x @ self.w.t()
        for i in hit:  # MARK-loop
            out = out + self.w[i[0] % 4]
        return out.sum()


def test_data_dependent_loop_is_refused_naming_op_and_lines():
    step = px.compile(_HitLoop(), optimizer=px.AdamW(lr=1e-3), device="cpu")(lambda m, x: m(x))
    with pytest.raises(px.UntraceableError) as e:
        step(torch.randn(5, 6))
    msg = str(e.value)
    assert "aten.nonzero" in msg and "control flow" in msg
    assert f"test_moe.py:{line_of(__file__, 'MARK-hit')}" in msg
    assert f"test_moe.py:{line_of(__file__, 'MARK-loop')}" in msg


def test_size_without_a_bound_is_refused_naming_op_and_line():
    def loss(model, x):
        reps = torch.repeat_interleave((x[:, 0] > 0).long())  # MARK-repeat
        return model(x).sum() * reps.numel()
    step = px.compile(_Net(), optimizer=px.AdamW(lr=1e-3), device="cpu")(loss)
    with pytest.raises(px.UntraceableError, match="repeat_interleave.*no known upper bound") as e:
        step(torch.randn(5, 6))
    assert f"test_moe.py:{line_of(__file__, 'MARK-repeat')}" in str(e.value)


@pytest.mark.skipif(fake_fixes.IN_BACKWARD, reason="this torch lets the routing reach the backward: they train "
                                                   "(tests/unit/test_checkpoint_layout.py)")
def test_grouped_mm_experts_under_activation_checkpoints_say_what_to_change():
    """Recomputed inside an activation checkpoint, the default experts meet torch's own kernel check (bf16 only) in
    the backward, where pstar-fx's routing around it does not reach (a torch without redispatch_function): refused,
    saying what trains instead (the eager experts under checkpoints: tests/integration/test_checkpointing.py trains
    checkpointed models)."""
    case = MOE_CASES[0]
    model = case.build_model()
    model.gradient_checkpointing_enable()
    step = px.compile(model, optimizer=px.AdamW(**HYPER), device=DEVICE, precision="fp32")(case.loss_fn)
    with pytest.raises(px.UntraceableError, match=r"grouped_mm experts in float32, recomputed by an activation "
                                                  r"checkpoint.*experts_implementation=\"eager\""):
        step(*case.batch(0))
    eager_experts = dataclasses.replace(case, build=functools.partial(tiny_mixtral, "eager"))
    model = eager_experts.build_model()
    model.gradient_checkpointing_enable()
    step = px.compile(model, optimizer=px.AdamW(**HYPER), device=DEVICE, precision="fp32")(case.loss_fn)
    assert torch.isfinite(step(*case.batch(0)))
