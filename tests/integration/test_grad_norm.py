"""`step.last_step.grad_norm` is the global L2 norm of every step's gradient, with or without max_grad_norm: equal to
eager `torch.nn.utils.clip_grad_norm_(params, inf)` (which returns the norm and changes nothing) within 1e-6 on CPU
fp32, under budgets that evict chunks, with accumulation and with host-side updates before the commit."""
import pytest
import torch

import pstar_fx as px

from harness import HYPER, fetch_counts, rel_err
from models import CASES_BY_NAME

CHUNK = 512


def _eager_norms(case, steps, accumulate=1):
    model = case.build_model()
    opt = torch.optim.AdamW(model.parameters(), **HYPER, fused=True)
    norms = []
    for i in range(steps):
        for part in zip(*[x.chunk(accumulate) for x in case.batch(i)]):
            (case.loss_fn(model, *part) / accumulate).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))))
        opt.step()
        opt.zero_grad()
    return norms


@pytest.mark.parametrize("name, tight, accumulate, atomic", [
    ("gpt_tied", False, 1, True), ("gpt_tied", True, 1, True), ("gpt_tied", True, 1, False),
    ("cnn_bn", True, 2, True), ("mlp_mse", False, 2, False),
])
def test_grad_norm_of_every_step_equals_eager(name, tight, accumulate, atomic):
    case = CASES_BY_NAME[name]
    model = case.build_model()
    kw = dict(optimizer=px.AdamW(**HYPER), chunk_size=CHUNK, device="cpu", debug=True, accumulate=accumulate,
              atomic=atomic)
    budget = int(px.compile(model, **kw)(case.loss_fn).min_device_memory(*case.batch(0)) * 1.05) if tight else None
    step = px.compile(model, device_memory=budget, **kw)(case.loss_fn)
    norms = []
    for i in range(3):
        step(*case.batch(i))
        norms.append(step.last_step.grad_norm)
    assert rel_err(norms, _eager_norms(case, 3, accumulate)) <= 1e-6
    if tight:
        assert max(fetch_counts(step.graphs["scheduled"]).values()) >= 2, "no chunk was evicted and fetched again"


def test_grad_norm_is_the_same_with_and_without_clipping():
    """Clipping reads the norm the step reports anyway: the same value, bit for bit, before it clips."""
    case = CASES_BY_NAME["mlp_ce"]
    got = []
    for clip in (None, 1e9):
        step = px.compile(case.build_model(), optimizer=px.AdamW(**HYPER), chunk_size=CHUNK, device="cpu",
                          max_grad_norm=clip)(case.loss_fn)
        step(*case.batch(0))
        got.append(step.last_step.grad_norm)
    assert got[0] == got[1] and got[0] > 0


def test_an_evaluation_has_no_grad_norm():
    case = CASES_BY_NAME["mlp_ce"]
    evaluate = px.compile(case.build_model(), optimizer=None, device="cpu")(case.loss_fn)
    evaluate(*case.batch(0))
    assert evaluate.last_step.grad_norm is None
