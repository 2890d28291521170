"""The model and the step never disagree silently.

While a compiled step holds a model, its parameters and buffers (the same Python objects the user has) carry no data
and raise ModelHeldError when used; `step.sync_model()` writes the trained values back; edits made then are trained
on; a second compiled step on the same model starts from the trained values; train/eval mode and requires_grad
changes are seen at the next step.
"""
import pytest
import torch
import torch.nn as nn

import pstar_fx as px

from harness import HYPER, eager_run
from models import CASES_BY_NAME, assert_state_close

CASE = CASES_BY_NAME["cnn_bn"]


def _compile(model, **kw):
    return px.compile(model, optimizer=px.AdamW(**HYPER), device="cpu", **kw)(CASE.loss_fn)


def test_model_is_held_while_training_and_synced_on_request():
    model = CASE.build_model()
    weight = model.conv1.weight                           # a reference the user kept
    step = _compile(model)
    for i in range(3):
        step(*CASE.batch(i))
    with pytest.raises(px.ModelHeldError, match="sync_model"):
        model(CASE.batch(0)[0])                           # using the model: a clear error, not stale values
    with pytest.raises(px.ModelHeldError):
        weight.sum()
    assert weight.shape == (8, 3, 3, 3) and weight.requires_grad   # metadata stays readable

    assert step.sync_model() is model
    _, want = eager_run(CASE, 3)
    assert_state_close(model.state_dict(), want, rtol=1e-6)          # trained parameters and BatchNorm statistics
    assert model.conv1.weight is weight and isinstance(weight, nn.Parameter)
    assert torch.equal(weight.detach(), want["conv1.weight"].to(weight.dtype)) or \
        (weight.detach() - want["conv1.weight"]).abs().max() < 1e-6
    model(CASE.batch(0)[0])                               # usable eagerly again


def test_edits_after_sync_are_trained_on():
    model = CASE.build_model()
    step = _compile(model)
    step(*CASE.batch(0))
    step.sync_model()
    with torch.no_grad():
        model.fc.weight.mul_(0.5)                         # an edit between steps
    edited = model.fc.weight.detach().clone()
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    loss = step(*CASE.batch(1))

    ref = CASE.build_model()
    ref.load_state_dict(sd)
    ref_loss = CASE.loss_fn(ref, *CASE.batch(1))
    assert abs(loss.item() - ref_loss.item()) <= 1e-6 * abs(ref_loss.item())
    assert torch.equal(sd["fc.weight"], edited)


def test_second_compile_starts_from_the_trained_values():
    model = CASE.build_model()
    first = _compile(model)
    for i in range(2):
        first(*CASE.batch(i))
    trained = first.state_dict()
    second = _compile(model)
    second.lower(*CASE.batch(2))
    second(*CASE.batch(2))                                # takes the model from the first step
    with pytest.raises(px.ModelHeldError):
        model(CASE.batch(0)[0])
    ref = CASE.build_model()
    ref.load_state_dict(trained)
    opt = torch.optim.AdamW(ref.parameters(), **HYPER, fused=True)
    CASE.loss_fn(ref, *CASE.batch(2)).backward()
    opt.step()
    assert_state_close(second.state_dict(), ref.state_dict(), rtol=1e-6)
    first(*CASE.batch(3))                                 # and the first takes it back, with the second's values
    assert first.state_dict().keys() == trained.keys()


def test_eval_mode_after_the_first_step_is_seen():
    """Dropout off in eval mode, on in train mode, for shapes already compiled."""
    model = nn.Sequential(nn.Linear(8, 64), nn.Dropout(0.5), nn.Linear(64, 1))
    step = px.compile(model, optimizer=px.AdamW(lr=0.0, weight_decay=0.0), device="cpu")(
        lambda m, x: m(x).pow(2).mean())
    x = torch.randn(32, 8)
    step(x)
    model.eval()
    a, b = step(x).item(), step(x).item()
    assert a == b                                         # lr=0, no dropout: the same loss twice
    step.sync_model()
    with torch.no_grad():
        assert abs(model(x).pow(2).mean().item() - a) <= 1e-6 * abs(a)
    model.train()
    c, d = step(x).item(), step(x).item()
    assert c != d                                         # dropout is back


def test_requires_grad_change_after_the_first_step_raises_clearly():
    model = CASE.build_model()
    step = _compile(model)
    step(*CASE.batch(0))
    before = step.state_dict()
    model.fc.weight.requires_grad_(False)                 # on the held tensor: seen at the next call
    with pytest.raises(ValueError, match="'fc.weight' gets no gradient in this trace but got one in the first"):
        step(*CASE.batch(1))
    after = step.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)   # nothing changed


def test_load_state_dict_after_sync_is_what_the_next_step_trains_on():
    model = CASE.build_model()
    step = _compile(model)
    step(*CASE.batch(0))
    step.sync_model()
    new = {k: (v + 0.01 if v.is_floating_point() else v) for k, v in step.state_dict().items()}
    step.load_state_dict(new)
    step.lower(*CASE.batch(1))
    got = step.state_dict()
    assert all(torch.equal(got[k], new[k]) for k in new)
    loss = step(*CASE.batch(1))
    ref = CASE.build_model()
    ref.load_state_dict(new)
    want = CASE.loss_fn(ref, *CASE.batch(1))
    assert abs(loss.item() - want.item()) <= 1e-6 * abs(want.item())


@pytest.mark.parametrize("held", [True, False], ids=["held", "given_back"])
def test_load_state_dict_reports_and_refuses_keys_as_torch_does(held):
    """As nn.Module.load_state_dict: with strict, missing or unexpected keys and a wrong shape raise RuntimeError
    (code that catches torch's error catches this one) and load nothing; without, the rest loads and the missing
    and unexpected keys come back."""
    model = CASE.build_model()
    step = _compile(model)
    step(*CASE.batch(0))
    if not held:
        step.sync_model()
    before = step.state_dict()
    new = {k: v + 0.5 if v.is_floating_point() else v for k, v in before.items()}
    first = next(iter(new))
    partial = {k: v for k, v in new.items() if k != first}
    for bad, match in ((partial, f'Missing key\\(s\\) in state_dict: "{first}"'),
                       ({**new, "extra.weight": torch.zeros(2)}, 'Unexpected key\\(s\\) in state_dict: "extra.weight"'),
                       ({**new, first: torch.zeros(7, 3)}, f"size mismatch for {first}")):
        with pytest.raises(RuntimeError, match=match):
            step.load_state_dict(bad)
        assert all(torch.equal(step.state_dict()[k], before[k]) for k in before)      # nothing loaded
    missing, unexpected = step.load_state_dict({**partial, "extra.weight": torch.zeros(2)}, strict=False)
    assert missing == [first] and unexpected == ["extra.weight"]
    got = step.state_dict()
    assert torch.equal(got[first], before[first]) and all(torch.equal(got[k], partial[k]) for k in partial)
