"""A step that rebinds a buffer (`self.count = self.count + 1`, a new tensor rather than an in-place write) trains
what eager PyTorch trains: the new value is the buffer's from then on (state_dict, sync_model, the next step), with
gradient accumulation and in evaluation too. A rebinding pstar-fx cannot hold (a parameter, or a buffer rebound to
another shape or dtype) is refused with the name, never dropped."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import pstar_fx as px


class Counting(nn.Module):
    """A step counter and a running mean of the input, both rebound every forward."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 3)
        self.register_buffer("count", torch.zeros(()))
        self.register_buffer("mean", torch.zeros(6))

    def forward(self, x):
        self.count = self.count + 1
        self.mean = 0.9 * self.mean + 0.1 * x.mean(0)
        return self.lin(x - self.mean)


def _loss(model, x, y):
    return F.mse_loss(model(x), y)


def _batches(n, rows=4):
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(rows, 6, generator=g), torch.randn(rows, 3, generator=g)) for _ in range(n)]


@pytest.mark.parametrize("accumulate", [1, 2])
def test_rebound_buffers_train_as_in_eager(accumulate):
    torch.manual_seed(0)
    eager = Counting()
    model = copy.deepcopy(eager)
    opt = torch.optim.AdamW(eager.parameters(), lr=1e-2)
    step = px.compile(model, optimizer=px.AdamW(lr=1e-2), device="cpu", accumulate=accumulate)(_loss)
    for x, y in _batches(3):
        for xs, ys in zip(x.chunk(accumulate), y.chunk(accumulate)):
            (_loss(eager, xs, ys) / accumulate).backward()
        opt.step()
        opt.zero_grad()
        step(x, y)
    sd = step.state_dict()
    assert sd["count"].item() == 3 * accumulate == eager.count.item()
    for k, v in eager.state_dict().items():
        torch.testing.assert_close(sd[k], v, rtol=1e-6, atol=1e-7, msg=k)
    step.sync_model()
    assert torch.equal(model.count, eager.count) and torch.equal(model.mean, sd["mean"])


def test_an_evaluation_rebinding_a_buffer_keeps_the_new_value():
    torch.manual_seed(0)
    eager = Counting()
    model = copy.deepcopy(eager)
    evaluate = px.compile(model, optimizer=None, device="cpu")(lambda m, x: m(x))
    for x, _ in _batches(2):
        torch.testing.assert_close(evaluate(x), eager(x).detach(), rtol=1e-6, atol=1e-7)
    assert evaluate.state_dict()["count"].item() == 2
    torch.testing.assert_close(evaluate.state_dict()["mean"], eager.mean)


class Reshaping(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 3)
        self.register_buffer("seen", torch.zeros(0))

    def forward(self, x):
        self.seen = torch.cat([self.seen, x.sum(1)])     # grows every step: no fixed shape to plan
        return self.lin(x)


class RebindingParameter(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 3)

    def forward(self, x):
        self.lin.bias = nn.Parameter(self.lin.bias.detach() * 0.5)
        return self.lin(x)


@pytest.mark.parametrize("module, match", [(Reshaping, r"rebinds buffer 'seen' to a tensor of shape \(4,\)"),
                                           (RebindingParameter, r"rebinds parameter 'lin.bias'")])
def test_a_rebinding_pstar_fx_cannot_hold_is_refused_by_name(module, match):
    torch.manual_seed(0)
    model = module()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    step = px.compile(model, optimizer=px.AdamW(lr=1e-2), device="cpu")(_loss)
    x, y = _batches(1)[0]
    with pytest.raises(px.UntraceableError, match=match):
        step(x, y)
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], v) for k, v in before.items())
