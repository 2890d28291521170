"""Property tests: random models x chunk sizes x budgets x prefetch settings. The verifier accepts every schedule (it
pass), the device bytes measured after every node equal the plan (debug=True checks it), the measured peak stays
within the budget, and training equals eager PyTorch."""

import pytest
import torch
from hypothesis import given, strategies as st

import pstar_fx as px

from harness import DEVICE, compiled_run, eager_run, host_params, rel_err
from models import GPT, MLP, Case, assert_state_close, gpt_loss, mlp_loss

pytestmark = pytest.mark.cuda

STEPS = 2


def _mlp_case(d_in, hidden, d_out, layers, batch):
    def make(step, gen):
        return torch.randn(batch, d_in, generator=gen), torch.randn(batch, d_out, generator=gen)
    return Case(f"mlp{d_in}-{hidden}x{layers}-{d_out}", lambda: MLP(d_in, hidden, d_out, n_layers=layers,
                                                                     act="gelu"), mlp_loss, make)


def _gpt_case(vocab, n_layer, n_head, head_dim, T, batch):
    def make(step, gen):
        idx = torch.randint(0, vocab, (batch, T + 1), generator=gen)
        return idx[:, :-1].contiguous(), idx[:, 1:].contiguous()
    return Case(f"gpt-v{vocab}-l{n_layer}-h{n_head}x{head_dim}-t{T}",
                lambda: GPT(vocab=vocab, block_size=T, n_layer=n_layer, n_head=n_head, n_embd=n_head * head_dim),
                gpt_loss, make)


mlp_cases = st.builds(_mlp_case, st.integers(1, 24), st.integers(1, 48), st.integers(1, 8), st.integers(1, 4),
                      st.integers(1, 6))
gpt_cases = st.builds(_gpt_case, st.integers(4, 40), st.integers(1, 2), st.integers(1, 2), st.sampled_from([4, 8]),
                      st.integers(2, 8), st.integers(1, 3))
chunk_sizes = st.one_of(st.none(), st.sampled_from([32, 64, 256, 1000, 4096]))
# None: unlimited; a float: that fraction of the way from the least feasible budget to twice it
budget_points = st.one_of(st.none(), st.floats(0.0, 1.0))
prefetches = st.sampled_from([None, 0, 4])      # None: as early as the budget allows


def _check(case, chunk_size, point, prefetch):
    budget = None
    if point is not None:
        probe = px.compile(case.build_model(), optimizer=px.AdamW(), chunk_size=chunk_size or 256,
                           device=DEVICE, precision="fp32")(case.loss_fn)
        least = probe.min_device_memory(*case.batch(0))
        budget = int(least * (1 + point))
        chunk_size = chunk_size or 256   # keep the layout min_device_memory planned for
    losses, sd, step = compiled_run(case, STEPS, budget=budget, chunk_size=chunk_size, prefetch=prefetch)   # debug
    g = step.graphs["scheduled"]
    stats = step.last_step
    assert stats.measured_peak == g.plan.predicted_peak
    if budget is not None:
        assert stats.measured_peak <= budget
    ref_losses, ref_sd = eager_run(case, STEPS, host_params=host_params(step))
    assert rel_err(losses, ref_losses) <= 1e-6
    assert_state_close(sd, ref_sd, rtol=1e-6)


@given(mlp_cases, chunk_sizes, budget_points, prefetches)
def test_random_mlps(case, chunk_size, point, prefetch):
    _check(case, chunk_size, point, prefetch)


@pytest.mark.slow
@given(gpt_cases, chunk_sizes, budget_points, prefetches)
def test_random_transformers(case, chunk_size, point, prefetch):
    _check(case, chunk_size, point, prefetch)
