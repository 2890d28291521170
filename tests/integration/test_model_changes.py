"""A model changed where a compiled step cannot follow is refused by name, and nothing is lost or half done.

Between steps: a parameter or buffer added, removed, reshaped or retyped since px.compile is refused before the step
runs (the chunks were laid out for the tensors the model had), and the model's trained values stay readable. Inside
the step function: a tensor registered on the model, or a parameter's `.data` assigned, is refused at the trace (a
trace cannot record either; the model is left as it was). An eager result that still references the model's tensors
(an autograd graph) is refused before anything is swapped, and once dropped the step trains as eager does. After a
step failed past its commit point (CommitError), its values are not one step's: every way of handing them out (the
step's state dict, sync_model, the model's own state_dict) is refused until a checkpoint is loaded."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import pstar_fx as px
from pstar_fx.errors import CommitError, PstarError, UntraceableError
from pstar_fx.ir import Role


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _loss(model, x, y):
    return F.cross_entropy(model(x), y)


def _batch(seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(6, 8, generator=g), torch.randint(0, 4, (6,), generator=g)


def _eager(model, batches, lr=1e-2):
    opt = torch.optim.AdamW(model.parameters(), lr=lr, fused=True)   # (pstar-fx's update, bit for bit)
    for x, y in batches:
        opt.zero_grad()
        _loss(model, x, y).backward()
        opt.step()
    return model


def _step(model, fn=_loss, **kw):
    return px.compile(model, optimizer=px.AdamW(lr=1e-2), device="cpu", **kw)(fn)


CHANGES = {
    "buffer added": (lambda m: m.register_buffer("scale", torch.ones(4)), "buffer 'scale' was added"),
    "parameter removed": (lambda m: setattr(m[0], "bias", None), "parameter '0.bias' was removed"),
    "parameter reshaped": (lambda m: setattr(m[0], "weight", nn.Parameter(torch.randn(8, 8))),
                           r"parameter '0.weight' is now \(8, 8\) torch.float32, was \(16, 8\) torch.float32"),
    "parameter retyped": (lambda m: setattr(m[0], "weight", nn.Parameter(torch.randn(16, 8, dtype=torch.float64))),
                          r"parameter '0.weight' is now \(16, 8\) torch.float64"),
    "module added": (lambda m: m.add_module("head2", nn.Linear(4, 4)), "parameter 'head2.weight' was added"),
}


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_a_model_changed_between_steps_is_refused_by_name_and_keeps_its_values(change):
    """The change is named before the step runs (not a KeyError or a shape error deep inside, not a silent
    broadcast), the step's values are the one trained step's (as eager), and sync_model() gives them back."""
    x, y = _batch()
    model = _model()
    reference = _eager(copy.deepcopy(model), [(x, y)])
    step = _step(model)
    step(x, y)
    apply, named = CHANGES[change]
    apply(model)
    with pytest.raises(ValueError, match=f"the model changed since px.compile: {named}"):
        step(x, y)
    kept = [n for n in reference.state_dict() if f"'{n}'" not in named]     # (the changed tensor is the user's)
    values = step.state_dict()
    assert kept and all(torch.equal(values[n], reference.state_dict()[n]) for n in kept)
    synced = dict(step.sync_model().named_parameters())
    assert all(torch.equal(synced[n].detach(), reference.state_dict()[n]) for n in kept)


def test_an_evaluation_refuses_a_changed_model_too():
    model = _model()
    x, y = _batch()
    evaluate = px.compile(model, optimizer=None, device="cpu")(lambda m, x: m(x))
    evaluate(x)
    model.register_buffer("scale", torch.ones(4))
    with pytest.raises(ValueError, match="buffer 'scale' was added"):
        evaluate(x)


def _registers(model, x, y):
    model.register_buffer("tmp", torch.zeros(3))
    return _loss(model, x, y)


def _assigns_data(model, x, y):
    model[2].bias.data = torch.zeros(4)        # eager: the bias reset before every forward
    return _loss(model, x, y)


def _assigns_buffer_data(model, x, y):
    model.count.data = model.count + 1
    return _loss(model, x, y)


@pytest.mark.parametrize("fn, match", [
    (_registers, "the step function adds buffer 'tmp' to the model"),
    (_assigns_data, r"the step assigns parameter '2.bias'.data, which a trace cannot record"),
    (_assigns_buffer_data, r"the step assigns buffer 'count'.data, which a trace cannot record: write the new value "
                           r"in place"),
])
def test_what_a_trace_cannot_record_is_refused_and_the_model_left_as_it_was(fn, match):
    """Registering a tensor on the model, or assigning a parameter's or buffer's .data, inside the step would be lost
    by the trace (the graph reads the old value; the registered tensor is not in the chunks): refused, with the model
    unchanged and still usable eagerly."""
    model = _model()
    model.register_buffer("count", torch.zeros(()))
    before = copy.deepcopy(model.state_dict())
    x, y = _batch()
    step = _step(model, fn)
    with pytest.raises(UntraceableError, match=match):
        step(x, y)
    assert sorted(model.state_dict()) == sorted(before)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    model(x)                                   # eager use: the model holds its own values


def test_an_eager_graph_over_the_model_is_refused_before_anything_is_swapped():
    """`out = model(x)` kept after sync_model() references the parameters in an autograd graph, which swapping them
    into the chunks cannot do: the error names a tensor, no tensor of the model is left held, and once the output is
    dropped the step trains on, as eager does."""
    model = _model()
    reference = _eager(copy.deepcopy(model), [_batch(1), _batch(2)])
    step = _step(model)
    step(*_batch(1))
    step.sync_model()
    out = model(_batch(1)[0])
    with pytest.raises(PstarError, match="is still referenced by an autograd graph .* nothing was changed"):
        step(*_batch(2))
    assert not step.holds_model()
    for p in model.parameters():
        p.sum()                                 # every parameter usable eagerly (none half held)
    del out
    step(*_batch(2))
    for k, v in reference.state_dict().items():
        assert torch.equal(step.state_dict()[k], v), k


def test_a_step_broken_past_its_commit_hands_out_no_values_until_a_checkpoint_is_loaded(tmp_path):
    """A failure after the first chunk's update (CommitError) leaves some chunks updated and others not:
    step.state_dict(), step.sync_model() and the model's own state_dict() (what torch.save and save_pretrained read)
    are refused like step.save(); step.load() of a good checkpoint gives the checkpoint's values and a working
    step again."""
    model = _model()
    step = _step(model, chunk_size=64)
    step(*_batch(1))
    good = step.state_dict()
    step.save(tmp_path / "good")
    g = step.final_graph
    updates = [i for i, n in enumerate(g.nodes) if g.ann[n.name].role is Role.OPTIMIZER_STEP]
    assert len(updates) >= 2

    def fail(i, node):
        if i == updates[1]:
            raise RuntimeError("injected device fault")
    step._before_node = fail
    with pytest.raises(CommitError):
        step(*_batch(2))
    step._before_node = None
    for what, call in [(r"step.state_dict\(\)", step.state_dict), (r"step.sync_model\(\)", step.sync_model),
                       (r"the model's state_dict\(\)", model.state_dict)]:
        with pytest.raises(CommitError, match=f"{what} refused: the model's values are not consistent"):
            call()
    step.load(tmp_path / "good")
    for k, v in good.items():
        assert torch.equal(step.state_dict()[k], v), k
    step(*_batch(2))
    model = step.sync_model()
    assert sorted(model.state_dict()) == sorted(good)
