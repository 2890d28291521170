"""A step whose first call sets up state it only reads afterwards (transformers installs its output-capturing hooks
and sets `_output_capturing_hooks_installed` the first time hidden states or attentions are asked for) compiles once:
the trace that set it up is traced again under it and keyed by it (api/settled_trace.py). The step still trains and
returns what eager PyTorch does, under a budget that forces eviction."""
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import pstar_fx as px
from pstar_fx.api.settled_trace import same_trace

from harness import HYPER, fetch_counts
from models import CASES_BY_NAME, HF_VOCAB, assert_state_close, tiny_llama

CHUNK = 512
pytest.importorskip("transformers")


def with_hidden_states(model, input_ids, labels):
    out = model(input_ids=input_ids, labels=labels, output_hidden_states=True, output_attentions=True)
    return out.loss, {"hidden": out.hidden_states[1], "attention": out.attentions[-1]}


def _batch(i):
    g = torch.Generator().manual_seed(100 + i)
    ids = torch.randint(0, HF_VOCAB, (2, 16), generator=g)
    return ids, ids.clone()


def _no_retrace_warnings(seen):
    said = [str(w.message) for w in seen if "changed plain Python values" in str(w.message)
            or "compiled again" in str(w.message)]
    assert not said, said


def test_hidden_states_and_attentions_compile_once_and_equal_eager_under_a_tight_budget():
    """Each step's loss and aux equal eager's bit for bit, run from the values the step started from (fp32, CPU);
    the trained values stay close to eager AdamW's (its update rounds otherwise in the last bits)."""
    torch.manual_seed(0)
    model = tiny_llama()
    probe = px.compile(tiny_llama(), optimizer=px.AdamW(**HYPER), chunk_size=CHUNK, device="cpu")(with_hidden_states)
    budget = int(probe.min_device_memory(*_batch(0)) * 1.05)
    step = px.compile(model, optimizer=px.AdamW(**HYPER), device_memory=budget, chunk_size=CHUNK, device="cpu",
                      debug=True)(with_hidden_states)
    trained = tiny_llama()
    trained.load_state_dict(model.state_dict())
    opt = torch.optim.AdamW(trained.parameters(), **HYPER)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for i in range(3):
            before = tiny_llama()
            before.load_state_dict(step.state_dict())
            want_loss, want = with_hidden_states(before, *_batch(i))
            with_hidden_states(trained, *_batch(i))[0].backward()
            opt.step()
            opt.zero_grad()
            loss, aux = step(*_batch(i))
            assert torch.equal(loss, want_loss.detach()), i
            for k in want:
                assert torch.equal(aux[k], want[k].detach()), (i, k)
    _no_retrace_warnings(seen)
    assert step._compiler.compiles == 1
    assert model.model._output_capturing_hooks_installed is True     # set by the trace on the LlamaModel inside
    g = step.graphs["scheduled"]
    assert g.plan.predicted_peak <= budget and max(fetch_counts(g).values()) >= 2, "nothing was evicted"
    assert step.last_step.measured_peak == g.plan.predicted_peak
    assert_state_close(step.state_dict(), trained.state_dict(), rtol=1e-5)


def test_an_evaluation_asking_for_hidden_states_compiles_once():
    model = tiny_llama()
    evaluate = px.compile(model, optimizer=None, device="cpu")(
        lambda m, ids: m(input_ids=ids, output_hidden_states=True).hidden_states[-1])
    eager = tiny_llama()
    eager.load_state_dict(model.state_dict())
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for i in range(2):
            got = evaluate(_batch(i)[0])
            with torch.no_grad():
                want = eager(input_ids=_batch(i)[0], output_hidden_states=True).hidden_states[-1]
            assert torch.equal(got, want), i
    _no_retrace_warnings(seen)
    assert evaluate._compiler.compiles == 1


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


class HookedOnce(Net):
    """Installs, on its first forward, a hook that doubles its first layer's output, and notes that it did: the
    graph of the first call and of every later one is the same (the hook runs in both)."""

    def forward(self, x):
        if not getattr(self, "hooked", False):
            self.fc1.register_forward_hook(lambda m, args, out: out * 2)
            self.hooked = True
        return super().forward(x)


class HookedEachCall(Net):
    """Adds another doubling hook at every call (in eager code too): every call is another graph."""

    def forward(self, x):
        self.fc1.register_forward_hook(lambda m, args, out: out * 2)
        return super().forward(x)


def _net_batch(i):
    g = torch.Generator().manual_seed(i)
    return torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)


def _ce(model, x, y):
    return F.cross_entropy(model(x), y)


@pytest.mark.parametrize("cls, compiles", [(HookedOnce, 1), (HookedEachCall, 3)])
def test_state_set_up_once_compiles_once_and_state_added_at_every_call_compiles_at_every_call(cls, compiles):
    torch.manual_seed(0)
    model = cls()
    eager = cls()
    eager.load_state_dict(model.state_dict())
    step = px.compile(model, optimizer=px.AdamW(**HYPER), device="cpu")(_ce)
    opt = torch.optim.AdamW(eager.parameters(), **HYPER)
    for i in range(3):
        want = _ce(eager, *_net_batch(i))
        want.backward()
        opt.step()
        opt.zero_grad()
        got = step(*_net_batch(i))
        if cls is HookedOnce:      # the graph of a call with several hooks is not the eager call's: not compared
            assert torch.equal(got, want.detach()), i
    assert step._compiler.compiles == compiles
    if cls is HookedOnce:
        assert len(model.fc1._forward_hooks) == 1


def _traced(fn, model, *batch):
    return px.compile(model, optimizer=px.AdamW(**HYPER), device="cpu")(fn).lower(*batch)["traced"]


def test_same_trace_tells_equal_graphs_from_different_ones():
    case = CASES_BY_NAME["gpt_tied"]
    model = case.build_model()
    a = _traced(case.loss_fn, model, *case.batch(0))
    assert same_trace(a, _traced(case.loss_fn, model, *case.batch(1))), "other values, the same graph"
    assert not same_trace(a, _traced(lambda m, x, y: case.loss_fn(m, x, y) * 2.0, model, *case.batch(0)))
    assert not same_trace(_traced(lambda m, x, y: case.loss_fn(m, x, y) * 3.0, model, *case.batch(0)),
                          _traced(lambda m, x, y: case.loss_fn(m, x, y) * 2.0, model, *case.batch(0))), "a scalar"
    x, y = case.batch(0)
    assert not same_trace(a, _traced(case.loss_fn, model, x[:1], y[:1])), "another shape"
    m2 = nn.Linear(4, 4)
    consts = [_traced(lambda m, x, c=c: (m(x) + torch.tensor([c, 0.0, 0.0, 0.0])).square().sum(), m2,
                      torch.randn(2, 4)) for c in (1.0, 1.0, 2.0)]
    assert same_trace(consts[0], consts[1]) and not same_trace(consts[0], consts[2]), "a constant's value"
