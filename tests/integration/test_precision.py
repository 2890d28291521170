"""bf16 and fp16 (mixed precision: half-precision chunks, fp32 master weights and Adam states).

Tolerances: bf16 keeps 8 significant bits (relative rounding 2**-9 per op), fp16 keeps 11 (2**-12). The runs below are
deliberately harsh (lr 1e-2, the same batch 20 times), which amplifies rounding differences step after step: eager
torch.autocast itself ends 0.88% (bf16) and 1.44% (fp16) away from fp32 on this run. Mixed precision follows
autocast, with half-precision parameter and gradient storage on top, which measured 3.2% (bf16) and 1.5% (fp16) from
fp32 (this machine, torch 2.13; bit-equal to eager autocast with parameters and gradients rounded to bf16). The
bounds, 6% and 3%, leave room for another BLAS, yet fail if half precision corrupted training: a wrong cast or a lost
update moves the loss by tens of percent. tests/integration/test_inputs.py checks, tightly, that the losses track
eager autocast under ordinary hyperparameters.
"""
import dataclasses

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import pstar_fx as px
from pstar_fx.ir import ChunkGroup, Role

from harness import compiled_run, compiled_step, small_batches, tight_budget
from models import CASES_BY_NAME

pytestmark = pytest.mark.cuda

FAST = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
STEPS = 20


def _same_batch(case):
    """One fixed batch every step, so the loss must fall when training works."""
    return dataclasses.replace(
        case, make_batch=lambda step, gen, f=case.make_batch: f(0, torch.Generator().manual_seed(0)))


@pytest.mark.parametrize("precision,tol", [("bf16", 0.06), ("fp16", 0.03)])
@pytest.mark.parametrize("budget", ["unlimited", "tight"])
def test_half_precision_trains_close_to_fp32(precision, tol, budget):
    case = _same_batch(small_batches(CASES_BY_NAME["gpt_tied"]))
    kw = {}
    if budget == "tight":
        kw = dict(budget=int(tight_budget(case, 1024) * 1.2), chunk_size=1024)
    ref, _, _ = compiled_run(case, STEPS, hyper=FAST, **kw)
    step = compiled_step(case, hyper=FAST, precision=precision, **kw)
    # fp16 skips a step when its gradients overflow (the first ones do at the initial scale 2**16): step i then
    # sees the parameters fp32 had after `updates` updates, so that is the loss to compare with.
    pairs, updates = [], 0
    for i in range(STEPS):
        pairs.append((step(*case.batch(i)).item(), ref[updates]))
        updates += not step.last_step.skipped
    losses = [a for a, _ in pairs]
    sd = step.state_dict()
    assert updates >= STEPS - 3, f"{STEPS - updates} of {STEPS} steps skipped"
    assert losses[-1] < 0.7 * losses[0], f"{precision} did not train: {losses}"
    worst = max(abs(a - b) / b for a, b in pairs)
    assert worst <= tol, f"{precision} loss differs from fp32 by {worst:.3%} (> {tol:.0%})"
    assert all(v.dtype == torch.float32 for k, v in sd.items() if "weight" in k)   # full-precision state_dict
    g = step.graphs["scheduled"]
    assert all(c.dtype == (torch.bfloat16 if precision == "bf16" else torch.float16) for c in g.chunks)


def test_mixed_precision_gradients_overwrite_parameters_where_safe():
    """14 bytes per parameter: no separate gradient buffer when every read of a parameter precedes its gradient."""
    case = CASES_BY_NAME["gpt_tied"]
    step = compiled_step(case, precision="bf16", chunk_size=1024)
    g = step.lower(*case.batch(0))["scheduled"]
    trainable = [c for c in g.chunks if c.group is ChunkGroup.TRAINABLE]
    assert all(c.grad_inplace for c in trainable)
    per_param = step.summary().model_data_bytes / sum(c.capacity for c in trainable)
    assert 14 <= per_param < 14.01


class _ReadAfterGrad(nn.Module):
    """`mix.detach()` is read by the backward of a matmul that runs after mix's gradient is final. (A matmul: under
    autocast it reads the half-precision parameter itself; an elementwise op would read an fp32 copy saved in
    forward, and the chunk would not be read again.)"""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.mix = nn.Parameter(torch.randn(8, 8) / 3)
        self.out = nn.Linear(8, 2)

    def forward(self, x):
        return self.out((self.lin(x) @ self.mix.detach()) @ self.mix)


def test_gradient_not_in_place_where_a_parameter_is_read_after_it():
    torch.manual_seed(0)
    model = _ReadAfterGrad()
    ref_model = _ReadAfterGrad()
    ref_model.load_state_dict(model.state_dict())
    fn = lambda m, x, y: F.mse_loss(m(x), y)   # noqa: E731
    step = px.compile(model, optimizer=px.AdamW(**FAST), precision="bf16", chunk_size=64, device="cpu",
                      debug=True)(fn)
    ref = px.compile(ref_model, optimizer=px.AdamW(**FAST), precision="fp32", chunk_size=64, device="cpu")(fn)
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(16, 8, generator=gen), torch.randn(16, 2, generator=gen)
    losses = [step(x, y).item() for _ in range(STEPS)]
    ref_losses = [ref(x, y).item() for _ in range(STEPS)]
    g = step.graphs["scheduled"]
    chunk = g.chunk_of("mix")
    assert not chunk.grad_inplace
    assert all(c.grad_inplace for c in g.chunks if "mix" not in c.params)
    assert losses[-1] < 0.7 * losses[0]
    assert max(abs(a - b) / b for a, b in zip(losses, ref_losses)) <= 0.03


def test_fp16_overflow_skips_the_step_and_halves_the_scale():
    case = _same_batch(CASES_BY_NAME["mlp_mse"])
    huge = dataclasses.replace(case, loss_fn=lambda m, x, y: 1e4 * F.mse_loss(m(x), y))
    step = compiled_step(huge, precision="fp16", hyper=FAST)
    before = step.state_dict()
    assert step.loss_scale == 2.0 ** 16
    first = step(*huge.batch(0)).item()
    assert step.last_step.skipped
    assert step.loss_scale == 2.0 ** 15
    after = step.state_dict()
    assert all(torch.equal(after[k], before[k]) for k in before), "a skipped step must not change parameters"
    # the half-precision parameters were restored from the masters: the same batch gives the same loss
    assert step(*huge.batch(0)).item() == first
    skipped = 2
    while step.last_step.skipped:
        step(*huge.batch(0))
        skipped += 1
        assert skipped < 40
    assert step.loss_scale == 2.0 ** 16 / 2 ** (skipped - 1)
    assert any(not torch.equal(step.state_dict()[k], before[k]) for k in before), "a good step updates"


def test_fp16_graph_decides_overflow_at_the_commit_before_any_step():
    case = CASES_BY_NAME["mlp_ce"]
    g = compiled_step(case, precision="fp16").lower(*case.batch(0))["scheduled"]
    roles = [g.ann[n.name].role for n in g.nodes]
    assert roles.count(Role.COMMIT) == 1
    first_step = roles.index(Role.OPTIMIZER_STEP)
    last_write = max(i for i, r in enumerate(roles) if r is Role.WRITE_GRAD)
    assert roles.index(Role.COMMIT) > last_write and roles.index(Role.COMMIT) < first_step


def test_state_dict_round_trip_keeps_full_precision_in_bf16():
    """Trainable parameters come back from the fp32 masters, frozen ones as they were given: no bf16 rounding."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    model[0].weight.requires_grad_(False)
    step = px.compile(model, optimizer=px.AdamW(lr=0.0, weight_decay=0.0), precision="bf16", device="cpu")(
        lambda m, x: m(x).pow(2).sum())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    step(torch.randn(4, 8))
    sd = step.state_dict()
    for k, v in before.items():
        assert torch.equal(sd[k], v), k          # lr=0: nothing moved, and nothing was rounded to bf16
    new = {k: v + 0.123456789 for k, v in sd.items()}
    step.load_state_dict(new)
    assert all(torch.equal(step.state_dict()[k], new[k]) for k in new)
