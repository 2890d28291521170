"""Forward-only functions: px.compile(model, optimizer=None)."""
import pytest
import torch
import torch.nn.functional as F

import pstar_fx as px
from pstar_fx.ir import Role

from harness import HYPER, eager_run, tight_budget
from models import CASES_BY_NAME

pytestmark = pytest.mark.cuda

CASE = CASES_BY_NAME["gpt_tied"]


def _eval_loss(m, idx, targets):
    logits = m(idx)
    logits = logits[0] if isinstance(logits, tuple) else logits
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten()), logits


def _trained(budget, **kw):
    """The model, a training step over it after 3 steps, and an evaluation compiled over the same model."""
    model = CASE.build_model()
    train = px.compile(model, optimizer=px.AdamW(**HYPER), device="cpu", chunk_size=512, device_memory=budget,
                       debug=True, **kw)(CASE.loss_fn)
    evaluate = px.compile(model, optimizer=None, device="cpu", chunk_size=512, debug=True)(_eval_loss)
    for i in range(3):
        train(*CASE.batch(i))
    return model, train, evaluate


def _eager_eval(x, y):
    """Eager PyTorch's evaluation (loss, logits) of the model after the same 3 training steps."""
    _, want_sd = eager_run(CASE, 3)
    ref = CASE.build_model()
    ref.load_state_dict(want_sd)
    ref.eval()
    with torch.no_grad():
        return _eval_loss(ref, x, y)


@pytest.mark.parametrize("tight", [False, True], ids=["unlimited", "tight"])
def test_evaluation_reads_the_training_steps_chunks(tight):
    model, train, evaluate = _trained(tight_budget(CASE, chunk_size=512) if tight else None)
    x, y = CASE.batch(10)
    model.eval()
    loss, logits = evaluate(x, y)                   # a tuple, as the function returns it
    model.train()
    want_loss, want_logits = _eager_eval(x, y)
    assert abs(loss.item() - want_loss.item()) <= 1e-6 * abs(want_loss.item())
    torch.testing.assert_close(logits, want_logits, rtol=1e-5, atol=1e-6)
    assert not logits.requires_grad
    g = evaluate.graphs["scheduled"]
    roles = {g.ann[n.name].role for n in g.nodes}
    assert Role.WRITE_GRAD not in roles and Role.OPTIMIZER_STEP not in roles and Role.COMMIT not in roles
    assert g.plan.budget == train.settings.budget      # planned over the training step's pool
    with pytest.raises(px.ModelHeldError):           # the training step still holds the model
        model(x)
    train(*CASE.batch(3))                            # training goes on, undisturbed


def test_an_evaluation_over_an_fp16_steps_chunks_takes_no_loss_scale():
    """An fp16 training step's graph takes the loss scale as an input; an evaluation over its chunks has no backward
    to scale and takes none, so debug=True finds its plan exact (it counted the scale's 4 bytes, which no call
    passes)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    loss_fn = lambda m, x, y: F.mse_loss(m(x), y)
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(16, 8, generator=gen), torch.randn(16, 4, generator=gen)
    train = px.compile(model, optimizer=px.Adam(lr=1e-2), device="cpu", precision="fp16", debug=True)(loss_fn)
    evaluate = px.compile(model, optimizer=None, device="cpu", debug=True)(loss_fn)
    train(x, y)
    with torch.no_grad():
        evaluate(x, y)
    roles = [train.final_graph.ann[n.name].role for n in train.final_graph.nodes]
    assert Role.SCALE in roles
    g = evaluate.graphs["scheduled"]
    assert Role.SCALE not in {g.ann[n.name].role for n in g.nodes}
    assert evaluate.last_step.measured_peak == g.plan.predicted_peak


def test_evaluation_after_a_step_that_streams_its_updates():
    """A training step whose plan updates host-state chunks on the device (states streamed): an evaluation over its
    chunks updates none, so none streams there; it runs, matches eager, and training goes on streaming."""
    model, train, evaluate = _trained(tight_budget(CASE, chunk_size=512), _device_updates=1000)
    assert any(c.streamed for c in train.graphs["scheduled"].chunks)
    x, y = CASE.batch(10)
    model.eval()
    loss, _ = evaluate(x, y)
    model.train()
    assert not any(c.streamed for c in evaluate.graphs["scheduled"].chunks)
    want_loss, _ = _eager_eval(x, y)
    assert abs(loss.item() - want_loss.item()) <= 1e-6 * abs(want_loss.item())
    train(*CASE.batch(3))
    assert any(c.streamed for c in train.graphs["scheduled"].chunks)


def test_evaluation_streams_a_model_larger_than_its_budget():
    """No training step: the function copies the model into chunks of its own and streams them under a budget
    below the model's parameter bytes."""
    model = CASE.build_model()
    param_bytes = sum(p.numel() * 4 for p in model.parameters())
    x, y = CASE.batch(0)
    with torch.no_grad():
        want, _ = _eval_loss(model, x, y)
    probe = px.compile(model, optimizer=None, device="cpu", chunk_size=512)(_eval_loss)
    probe.lower(x, y)
    budget = int(probe.min_device_memory(x, y) * 1.05)
    evaluate = px.compile(model, optimizer=None, device="cpu", chunk_size=512, device_memory=budget,
                          debug=True)(_eval_loss)
    loss, _ = evaluate(x, y)
    g = evaluate.graphs["scheduled"]
    assert budget < param_bytes
    assert g.plan.h2d_bytes >= param_bytes          # every chunk streamed in
    assert abs(loss.item() - want.item()) <= 1e-6 * abs(want.item())


def test_evaluation_respects_eval_mode_and_runs_under_no_grad():
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Dropout(0.5), torch.nn.Linear(32, 2))
    evaluate = px.compile(model, optimizer=None, device="cpu")(lambda m, x: m(x))
    x = torch.randn(16, 8)
    model.eval()
    with torch.no_grad():
        a, b = evaluate(x), evaluate(x)
    assert torch.equal(a, b)
    model.train()
    assert not torch.equal(evaluate(x), evaluate(x))


def test_forward_only_rejects_training_options():
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="forward-only"):
        px.compile(model, optimizer=None, accumulate=2)(lambda m, x: m(x))


def test_an_evaluation_refuses_checkpoints_and_names_what_to_save_instead(tmp_path):
    model = torch.nn.Linear(4, 2)
    weight = model.weight.detach().clone()
    evaluate = px.compile(model, optimizer=None, device="cpu")(lambda m, x: m(x))
    evaluate(torch.randn(3, 4))
    with pytest.raises(TypeError, match=r"save the training step \(step.save\(path\)\)"):
        evaluate.save(tmp_path / "c")
    with pytest.raises(TypeError, match=r"step.load\(path\)"):
        evaluate.load(tmp_path / "c")
    assert not (tmp_path / "c").exists()
    assert torch.equal(evaluate.state_dict()["weight"], weight)


def test_an_evaluation_returning_a_parameter_or_a_view_of_one_returns_a_copy():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    want = {k: v.detach().clone() for k, v in model.state_dict().items()}
    evaluate = px.compile(model, optimizer=None, device="cpu")(
        lambda m, x: (m(x).sum(), m[0].weight, {"t": m[0].weight.t(), "b": m[2].bias[:1]}))
    x = torch.randn(5, 4)
    out, w, d = evaluate(x)
    assert torch.equal(w, want["0.weight"]) and torch.equal(d["t"], want["0.weight"].t())
    assert torch.equal(d["b"], want["2.bias"][:1])
    w.zero_()
    d["b"].fill_(7.0)      # the copies are the caller's: the held values stay
    assert torch.equal(evaluate.state_dict()["0.weight"], want["0.weight"])
    assert torch.equal(evaluate.state_dict()["2.bias"], want["2.bias"])


def test_an_evaluation_asked_for_another_precision_than_the_holding_step_is_refused():
    model = torch.nn.Linear(4, 2)
    step = px.compile(model, optimizer=px.AdamW(lr=1e-3), device="cpu")(lambda m, x: m(x).sum())
    step(torch.randn(3, 4))
    evaluate = px.compile(model, optimizer=None, device="cpu", precision="bf16")(lambda m, x: m(x))
    with pytest.raises(ValueError, match=r"precision='bf16'.*holding the model runs in 'fp32'"):
        evaluate(torch.randn(3, 4))
    same = px.compile(model, optimizer=None, device="cpu", precision="fp32")(lambda m, x: m(x))
    assert same(torch.randn(3, 4)).shape == (3, 2)


@pytest.mark.parametrize("tight", [False, True], ids=["unlimited", "tight"])
def test_an_evaluation_after_a_parameter_is_replaced_reads_the_new_value(tight):
    """A parameter replaced on the model between steps (model.x.weight = nn.Parameter(...)): the evaluation over the
    training step's chunks computes with the new value, as the next training step would, not the chunks' old one."""
    model, train, evaluate = _trained(tight_budget(CASE, chunk_size=512) if tight else None)
    name, old = next((n, p) for n, p in model.named_parameters() if p.dim() == 2 and "wte" not in n)
    owner, attr = model.get_submodule(name.rpartition(".")[0]), name.rpartition(".")[2]
    torch.manual_seed(5)
    new = torch.randn(old.shape) * 0.05
    setattr(owner, attr, torch.nn.Parameter(new.clone()))
    ref = CASE.build_model()
    ref.load_state_dict({**train.state_dict(), name: new})      # the trained values, the replaced one new
    x, y = CASE.batch(10)
    model.eval()
    ref.eval()
    loss, logits = evaluate(x, y)
    with torch.no_grad():
        want_loss, want_logits = _eval_loss(ref, x, y)
    model.train()
    torch.testing.assert_close(logits, want_logits, rtol=1e-5, atol=1e-6)
    assert abs(loss.item() - want_loss.item()) <= 1e-6 * abs(want_loss.item())
    assert train._model_state.holds()                # the training step took the model, the new value with it
    train(*CASE.batch(3))


@pytest.mark.parametrize("order", ["evaluate_first", "between_steps"])
def test_an_evaluation_under_inference_mode_leaves_the_steps_trainable(order):
    """torch.inference_mode() around an evaluation: what it makes and keeps (its own chunks, slots from the training
    step's pool) stays writable, so training goes on after it, equal to eager."""
    def build():
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16),
                                torch.nn.Linear(16, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
        m[0].requires_grad_(False)
        m[2].requires_grad_(False)
        return m
    model, ref = build(), build()
    fn = lambda m, x, y: F.mse_loss(m(x), y)      # noqa: E731
    kw = dict(device="cpu", chunk_size=512, device_memory=9141)
    step = px.compile(model, optimizer=px.SGD(lr=0.1), **kw)(fn)
    evaluate = px.compile(model, optimizer=None, **kw)(lambda m, x: m(x))
    opt = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.1)
    torch.manual_seed(1)
    data = [(torch.randn(8, 8), torch.randn(8, 4)) for _ in range(3)]

    def eager_step(x, y):
        opt.zero_grad()
        fn(ref, x, y).backward()
        opt.step()
    if order == "evaluate_first":
        with torch.inference_mode():
            evaluate(data[0][0])      # the model in the evaluation's own chunks, made inside inference mode
    for x, y in data[:2]:
        step(x, y)
        eager_step(x, y)
        with torch.inference_mode():
            got = evaluate(x)         # slots from the training step's pool, taken inside inference mode
        with torch.no_grad():
            torch.testing.assert_close(got, ref(x), rtol=1e-5, atol=1e-6)
    step.sync_model()
    with torch.no_grad():
        evaluate(data[2][0])          # takes the model back into its own chunks
    loss = step(*data[2])
    with torch.no_grad():
        want = fn(ref, *data[2])
    eager_step(*data[2])
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
    for (n, p), q in zip(step.sync_model().named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6, msg=n)
