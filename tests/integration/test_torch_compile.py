"""torch.compile meets pstar-fx, which compiles the whole step itself: a torch.compile'd model, submodule or step
function is traced through the code it wraps (one warning per px.compile), trains as eager does and keeps the
parameter names the model reports; torch.compile(step) and backward inside the step raise clear errors.
"""
import warnings

import pytest
import torch

import pstar_fx as px
from pstar_fx.api.warnings import TorchCompileWarning

from harness import HYPER, eager_run
from models import CASES_BY_NAME

CASE = CASES_BY_NAME["mlp_mse"]
STEPS = 3


def _compile(model, fn=CASE.loss_fn):
    return px.compile(model, optimizer=px.AdamW(**HYPER), device="cpu")(fn)


def _assert_state_equal(got: dict, want: dict):
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k


@pytest.mark.parametrize("where", ["model", "submodule"])
def test_a_torch_compiled_module_is_traced_through_and_trains_as_eager(where):
    model = CASE.build_model()
    if where == "model":
        model = torch.compile(model)
        prefix = lambda k: "_orig_mod." + k                                         # noqa: E731
    else:
        model.layers[1] = torch.compile(model.layers[1])
        prefix = lambda k: k.replace("layers.1.", "layers.1._orig_mod.")            # noqa: E731
    with pytest.warns(TorchCompileWarning, match="compiles the whole training step itself") as record:
        step = _compile(model)
        losses = [step(*CASE.batch(i)).item() for i in range(STEPS)]
        step(*CASE.batch(STEPS))                             # the same signature again: no retrace, no warning
    assert sum(issubclass(w.category, TorchCompileWarning) for w in record) == 1     # one per px.compile
    want_losses, _ = eager_run(CASE, STEPS)
    assert losses == want_losses
    sd = step.state_dict()
    assert list(sd) == list(model.state_dict(keep_vars=True))                     # the names the model reports
    # the model's own names: a fresh model built the same way loads what the step trained
    _, want = eager_run(CASE, STEPS + 1)
    _assert_state_equal(sd, {prefix(k): v for k, v in want.items()})
    fresh = CASE.build_model()
    fresh = torch.compile(fresh) if where == "model" else fresh
    if where == "submodule":
        fresh.layers[1] = torch.compile(fresh.layers[1])
    fresh.load_state_dict(sd)
    _assert_state_equal(fresh.state_dict(), sd)


def test_a_torch_compiled_step_function_is_traced_through():
    with pytest.warns(TorchCompileWarning, match="the step function"):
        step = _compile(CASE.build_model(), torch.compile(CASE.loss_fn))
    losses = [step(*CASE.batch(i)).item() for i in range(STEPS)]
    want_losses, want = eager_run(CASE, STEPS)
    assert losses == want_losses
    _assert_state_equal(step.state_dict(), want)


def test_no_warning_without_torch_compile():
    with warnings.catch_warnings():
        warnings.simplefilter("error", TorchCompileWarning)
        step = _compile(CASE.build_model())
        step(*CASE.batch(0))


def test_torch_compile_of_a_step_raises_a_clear_error_and_changes_nothing():
    step = _compile(CASE.build_model())
    step(*CASE.batch(0))
    with pytest.raises(px.PstarError, match=r"Call the step directly: loss = step\(\*batch\)"):
        torch.compile(step)(*CASE.batch(1))
    evaluate = px.compile(step._model, optimizer=None)(CASE.loss_fn)
    with pytest.raises(px.PstarError, match="Call the step directly"):
        torch.compile(evaluate)(*CASE.batch(1))
    losses = [step(*CASE.batch(i)).item() for i in range(1, STEPS)]     # trains on, exactly
    want_losses, want = eager_run(CASE, STEPS)
    assert losses == want_losses[1:]
    _assert_state_equal(step.state_dict(), want)


def _backward(m, x, y):
    loss = CASE.loss_fn(m, x, y)
    loss.backward()
    return loss


def _autograd_backward(m, x, y):
    loss = CASE.loss_fn(m, x, y)
    torch.autograd.backward(loss)
    return loss


def _autograd_grad(m, x, y):
    loss = CASE.loss_fn(m, x, y)
    torch.autograd.grad(loss, list(m.parameters()))
    return loss


@pytest.mark.parametrize("fn, call", [(_backward, r"loss\.backward\(\)"),
                                      (_autograd_backward, "torch.autograd.backward"),
                                      (_autograd_grad, "torch.autograd.grad")])
def test_backward_inside_the_step_raises_untraceable_error(fn, call):
    model = CASE.build_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    step = _compile(model, fn)
    with pytest.raises(px.UntraceableError, match=f"calls {call} at .*test_torch_compile.py.*return the loss"):
        step(*CASE.batch(0))
    _assert_state_equal(model.state_dict(), before)      # nothing ran


def _gradient_penalty(m, x, y):
    x = x.detach().requires_grad_(True)
    loss = CASE.loss_fn(m, x, y)
    g, = torch.autograd.grad(loss, x, create_graph=True)
    return loss + g.pow(2).sum()


def test_a_gradient_used_in_the_loss_still_traces():
    """torch.autograd.grad(create_graph=True) is differentiated through, as in eager code: not refused."""
    step = _compile(CASE.build_model(), _gradient_penalty)
    ref = CASE.build_model()
    opt = torch.optim.AdamW(ref.parameters(), **HYPER, fused=True)
    for i in range(2):
        loss = step(*CASE.batch(i))
        want = _gradient_penalty(ref, *CASE.batch(i))
        want.backward()
        opt.step()
        opt.zero_grad()
        assert torch.allclose(loss, want.detach(), rtol=1e-6, atol=0)
    for k, v in ref.state_dict().items():
        assert torch.allclose(step.state_dict()[k], v, rtol=1e-5, atol=1e-7), k
