"""A step's trace may change the step's own key (plain values, hooks: a counter or a flag in `forward`, state set up
on the first call). A step compiled under a key its trace changed is never run from the cache again, so every call
computes what eager PyTorch computes for the state it finds; a trace equal to one planned before takes that plan
(api/plan_reuse.py). transformers installs its output-capturing hooks and sets `_output_capturing_hooks_installed` the
first time hidden states or attentions are asked for: such a step traces twice and plans once, and trains as eager
PyTorch does under a budget that forces eviction."""
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import pstar_fx as px
from pstar_fx.api.plan_reuse import same_trace

from harness import HYPER, fetch_counts
from models import CASES_BY_NAME, HF_VOCAB, assert_state_close, tiny_llama

CHUNK = 512


def with_hidden_states(model, input_ids, labels):
    out = model(input_ids=input_ids, labels=labels, output_hidden_states=True, output_attentions=True)
    return out.loss, {"hidden": out.hidden_states[1], "attention": out.attentions[-1]}


def _batch(i):
    g = torch.Generator().manual_seed(100 + i)
    ids = torch.randint(0, HF_VOCAB, (2, 16), generator=g)
    return ids, ids.clone()


def _no_retrace_warnings(seen):
    said = [str(w.message) for w in seen if "compiled again" in str(w.message)]
    assert not said, said


def test_hidden_states_and_attentions_plan_once_and_equal_eager_under_a_tight_budget():
    """Each step's loss and aux equal eager's bit for bit, run from the values the step started from (fp32, CPU);
    the trained values stay close to eager AdamW's (its update rounds otherwise in the last bits)."""
    pytest.importorskip("transformers")
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
        for i in range(4):
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
    # the first trace installed the hooks (on the LlamaModel inside): traced again under them, planned once
    assert model.model._output_capturing_hooks_installed is True
    assert (step._compiler.compiles, step._compiler.plans) == (2, 1)
    g = step.graphs["scheduled"]
    assert g.plan.predicted_peak <= budget and max(fetch_counts(g).values()) >= 2, "nothing was evicted"
    assert step.last_step.measured_peak == g.plan.predicted_peak
    assert_state_close(step.state_dict(), trained.state_dict(), rtol=1e-5)


def test_an_evaluation_asking_for_hidden_states_plans_once():
    pytest.importorskip("transformers")
    model = tiny_llama()
    evaluate = px.compile(model, optimizer=None, device="cpu")(
        lambda m, ids: m(input_ids=ids, output_hidden_states=True).hidden_states[-1])
    eager = tiny_llama()
    eager.load_state_dict(model.state_dict())
    for i in range(3):
        got = evaluate(_batch(i)[0])
        with torch.no_grad():
            want = eager(input_ids=_batch(i)[0], output_hidden_states=True).hidden_states[-1]
        assert torch.equal(got, want), i
    assert (evaluate._compiler.compiles, evaluate._compiler.plans) == (2, 1)


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


class TwoStages(Net):
    """Sets up in two calls, after computing (a call's graph is the state it found): x1, x2, then x4 for good."""

    def forward(self, x):
        out = super().forward(x)
        if len(self.fc1._forward_hooks) < 2:
            self.fc1.register_forward_hook(lambda m, args, out: out * 2)
        return out


class Toggle(Net):
    """Flips a flag at every call, which the next call's graph reads: two graphs, taken in turn."""

    def __init__(self):
        super().__init__()
        self.flip = False

    def forward(self, x):
        out = super().forward(x) * (2.0 if self.flip else 1.0)
        self.flip = not self.flip
        return out


class Counting(Net):
    """Counts its calls in a plain attribute that no graph reads."""

    def forward(self, x):
        self.calls = getattr(self, "calls", 0) + 1
        return super().forward(x)


def _net_batch(i):
    g = torch.Generator().manual_seed(i)
    return torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)


def _ce(model, x, y):
    return F.cross_entropy(model(x), y)


@pytest.mark.parametrize("cls, compiles, plans", [(HookedOnce, 2, 1), (HookedEachCall, 5, 5), (TwoStages, 3, 3),
                                                  (Toggle, 5, 2), (Counting, 5, 1)])
def test_a_step_that_changes_its_own_state_trains_as_eager_at_every_call(cls, compiles, plans):
    """Five calls beside eager PyTorch (AdamW both, fp32, CPU): the same loss bit for bit at every call, the same
    Python state after each; the step traces where its state is new or was changed by its last trace, and plans
    only graphs it has not planned before."""
    torch.manual_seed(0)
    model, eager = cls(), cls()
    eager.load_state_dict(model.state_dict())
    step = px.compile(model, optimizer=px.AdamW(**HYPER), device="cpu")(_ce)
    opt = torch.optim.AdamW(eager.parameters(), **HYPER)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for i in range(5):
            want = _ce(eager, *_net_batch(i))
            want.backward()
            opt.step()
            opt.zero_grad()
            assert torch.equal(step(*_net_batch(i)), want.detach()), i
            assert len(model.fc1._forward_hooks) == len(eager.fc1._forward_hooks), i
            assert getattr(model, "calls", None) == getattr(eager, "calls", None), i
            assert getattr(model, "flip", None) == getattr(eager, "flip", None), i
    assert (step._compiler.compiles, step._compiler.plans) == (compiles, plans)
    summary = step.summary()        # the last call's compile: a plan taken from an earlier trace shows no passes
    reused = plans < compiles        # (in each case here the last compile too)
    assert summary.plan_reused is reused and (summary.compile_seconds[1] == 0) is reused, summary
    assert ("plan of an equal earlier trace reused" in str(summary)) is reused
    said = [str(w.message) for w in seen if "compiled again" in str(w.message)]
    if cls is Counting:     # a trace at every call: named once it has happened VALUE_RETRACES_WARN times
        assert len(said) == 1 and "model.calls" in said[0] and "counter in forward" in said[0], said
    elif cls is HookedEachCall:     # and a hook added at every call, by where and how many
        assert len(said) == 1 and "the model's hooks" in said[0] and "fc1's forward hooks: 3 -> 4" in said[0] \
            and "Register hooks once" in said[0] and "counter" not in said[0], said
    elif cls is not Toggle:
        assert not said, said


def test_a_trace_that_changes_its_state_keeps_the_guard_outcomes_it_was_given():
    """A data-dependent decision on the first call and another one on the next: each call's trace decides on its
    own data, as eager code does (a set-up step whose later calls check their activations)."""
    class Checked(Net):
        def __init__(self):
            super().__init__()
            self.ready = False

        def forward(self, x):
            h = super().forward(x)
            if not self.ready:
                self.ready = True
                if h.sum() > -1e9:
                    h = h + 1
            elif torch.isnan(h).any():
                raise ValueError("NaN in activations")
            return h

    torch.manual_seed(0)
    model, eager = Checked(), Checked()
    eager.load_state_dict(model.state_dict())
    step = px.compile(model, optimizer=px.AdamW(lr=0.0), device="cpu")(_ce)
    for i in range(3):
        assert torch.equal(step(*_net_batch(i)), _ce(eager, *_net_batch(i)).detach()), i


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
    signed = [_traced(lambda m, x, c=c: (m(x) * c).sum(), m2, torch.randn(2, 4)) for c in (0.0, -0.0, 0.0)]
    assert same_trace(signed[0], signed[2]) and not same_trace(signed[0], signed[1]), "a zero's sign"
    signed = [_traced(lambda m, x, c=c: torch.atan2(torch.tensor([c, 0.0, 0.0, 0.0]), m(x)).sum(), m2,
                      torch.randn(2, 4)) for c in (0.0, -0.0)]
    assert not same_trace(signed[0], signed[1]), "the sign of a zero in a constant tensor (atan2 tells them apart)"


def test_a_reserved_signature_stays_planned_for_a_step_that_sets_state_up():
    """step.reserve traces once (the hook is set up then); the first call traces again and takes the reserved
    plan, and the entry it makes is kept however many other shapes come (cache_size=2)."""
    torch.manual_seed(0)
    step = px.compile(HookedOnce(), optimizer=px.AdamW(**HYPER), device="cpu", cache_size=2)(_ce)
    step.reserve(*_net_batch(0))
    step(*_net_batch(0))
    assert (step._compiler.compiles, step._compiler.plans) == (2, 1)
    for n in (2, 3, 5):
        x, y = _net_batch(n)
        step(x[:n], y[:n])
    traces = step._compiler.compiles
    step(*_net_batch(1))
    assert step._compiler.compiles == traces, "the reserved signature traced again"
