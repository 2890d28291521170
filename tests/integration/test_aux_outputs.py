"""A step function may return (loss, aux): the step returns the same structure, aux detached and equal bit for bit
(fp32, CPU) to eager PyTorch run from the parameters the step started from (before its update), under tight budgets
too (the aux tensors are in the memory plan: debug=True checks the measured bytes at every node)."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import pstar_fx as px

from harness import HYPER, fetch_counts
from models import CASES_BY_NAME

CHUNK = 512


def gpt_with_aux(model, idx, targets):
    logits = model(idx)
    per_token = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), reduction="none")
    loss = per_token.mean()
    acc = (logits.argmax(-1) == targets).float().mean()
    return loss, {"logits": logits, "per_token": per_token, "metrics": (acc, loss.detach() * 2), "tokens": 64,
                  "note": None}


def _step(fn, *, budget=None, accumulate=1, atomic=True, case="gpt_tied"):
    model = CASES_BY_NAME[case].build_model()
    return px.compile(model, optimizer=px.AdamW(**HYPER), device_memory=budget, chunk_size=CHUNK, device="cpu",
                      debug=True, accumulate=accumulate, atomic=atomic)(fn)


def _eager_from(step, fn, batch, case="gpt_tied"):
    """fn run eagerly on a fresh model holding the step's current values (those its next update starts from)."""
    model = CASES_BY_NAME[case].build_model()
    model.load_state_dict(step.state_dict())
    return fn(model, *batch)


def _assert_same(got, want):
    assert type(got) is type(want)
    if isinstance(want, dict):
        assert got.keys() == want.keys()
        for k in want:
            _assert_same(got[k], want[k])
    elif isinstance(want, (tuple, list)):
        assert len(got) == len(want)
        for a, b in zip(got, want):
            _assert_same(a, b)
    elif isinstance(want, torch.Tensor):
        assert not got.requires_grad and got.shape == want.shape and got.dtype == want.dtype
        assert torch.equal(got, want.detach()), (got, want)
    else:
        assert got == want


@pytest.mark.parametrize("tight, atomic", [(False, True), (True, True), (True, False)],
                         ids=["unlimited", "tight", "tight_early_updates"])
def test_aux_equals_eager_before_the_update(tight, atomic):
    case = CASES_BY_NAME["gpt_tied"]
    budget = int(_step(gpt_with_aux).min_device_memory(*case.batch(0)) * 1.05) if tight else None
    step = _step(gpt_with_aux, budget=budget, atomic=atomic)
    plain = _step(lambda m, x, y: gpt_with_aux(m, x, y)[0], budget=budget, atomic=atomic)
    for i in range(2):
        batch = case.batch(i)
        want_loss, want_aux = _eager_from(step, gpt_with_aux, batch)
        loss, aux = step(*batch)
        assert torch.equal(loss, want_loss.detach())
        _assert_same(aux, want_aux)
        assert torch.equal(plain(*batch), loss), "returning aux changes nothing of the training"
    g = step.graphs["scheduled"]
    assert step.last_step.measured_peak == g.plan.predicted_peak
    assert torch.equal(torch.cat([v.flatten() for v in step.state_dict().values()]),
                       torch.cat([v.flatten() for v in plain.state_dict().values()]))
    if tight:
        assert g.plan.predicted_peak <= budget
        assert max(fetch_counts(g).values()) >= 2, "no chunk was evicted and fetched again"


def test_aux_tensors_count_in_the_plan():
    """The logits returned live from the node that makes them to the end of the step: the planned live bytes at
    the last node grow by their size."""
    case = CASES_BY_NAME["gpt_tied"]
    batch = case.batch(0)
    with_logits = _step(lambda m, x, y: (case.loss_fn(m, x, y), m(x))).lower(*batch)["scheduled"]
    without = _step(case.loss_fn).lower(*batch)["scheduled"]
    logits_bytes = 4 * 16 * 64 * 4                                   # (B, T, vocab) float32
    last = [g.ann[g.nodes[-1].name].live_bytes for g in (with_logits, without)]
    assert last[0] - last[1] == logits_bytes


@pytest.mark.parametrize("accumulate", [2, 4])
def test_accumulate_stacks_each_micro_batch_aux(accumulate):
    case = CASES_BY_NAME["gpt_tied"]
    step = _step(gpt_with_aux, accumulate=accumulate)
    for i in range(2):
        batch = case.batch(i)
        parts = [_eager_from(step, gpt_with_aux, [x.chunk(accumulate)[k] for x in batch]) for k in range(accumulate)]
        loss, aux = step(*batch)
        want_loss = sum(p[0].detach() for p in parts[1:]) if accumulate > 1 else 0
        want_loss = (parts[0][0].detach() + want_loss) / accumulate
        assert abs(loss.item() - want_loss.item()) <= 1e-6 * abs(want_loss.item())
        assert aux["tokens"] == 64 and aux["note"] is None
        assert aux["logits"].shape == (accumulate, 4 // accumulate, 16, 64)
        for key in ("logits", "per_token"):
            assert torch.equal(aux[key], torch.stack([p[1][key].detach() for p in parts]))
        for j in range(2):
            assert torch.equal(aux["metrics"][j], torch.stack([p[1]["metrics"][j].detach() for p in parts]))
    assert step.last_step.measured_peak == step.graphs["scheduled"].plan.predicted_peak


class BNNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 8)
        self.bn = nn.BatchNorm1d(8)
        self.out = nn.Linear(8, 3)

    def forward(self, x):
        return self.out(torch.relu(self.bn(self.fc(x))))


def bn_with_aliases(model, x, y):
    """aux holds a parameter, a view of one, a module buffer written in place, and a batch input."""
    loss = F.cross_entropy(model(x), y)
    return loss, (model.fc.weight, model.out.bias.detach()[1:], model.bn.running_mean, x)


def test_aux_aliasing_parameters_and_buffers_holds_the_forward_values():
    torch.manual_seed(0)
    model = BNNet()
    eager = BNNet()
    eager.load_state_dict(model.state_dict())
    opt = torch.optim.AdamW(eager.parameters(), **HYPER, fused=True)
    step = px.compile(model, optimizer=px.AdamW(**HYPER), device="cpu", debug=True, chunk_size=64,
                      device_memory=4096)(bn_with_aliases)
    for i in range(3):
        x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
        want_loss, want = bn_with_aliases(eager, x, y)
        want = [t.detach().clone() for t in want]            # eager's tensors are live: the values now
        want_loss.backward()
        opt.step()
        opt.zero_grad()
        loss, got = step(x, y)
        assert abs(loss.item() - want_loss.item()) <= 1e-6 * abs(want_loss.item())
        for a, b in zip(got, want):
            assert not a.requires_grad
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    before = got[0].clone()
    step(x, y)
    assert torch.equal(got[0], before), "a returned parameter is a copy, not a view of the chunk"


@pytest.mark.parametrize("returned, match", [
    (lambda loss, logits: (loss, logits, logits), "tuple of 3 elements"),
    (lambda loss, logits: (logits, loss), "must return the loss as a 0-d tensor"),
    (lambda loss, logits: ("loss", loss), "pair whose first element is str"),
    (lambda loss, logits: {"loss": loss}, "returned dict"),
    (lambda loss, logits: (loss, {"x": object()}), r"aux\['x'\] of type object"),
    (lambda loss, logits: (loss.long(), logits), "dtype torch.int64"),
    (lambda loss, logits: (loss, {"acc": (logits.argmax(1) == 0).float().mean().item()}),
     r"aux\['acc'\], a float read from a tensor's value \(.item\(\).*return the tensor itself"),
])
def test_wrong_returns_name_what_to_return(returned, match):
    case = CASES_BY_NAME["mlp_ce"]

    def fn(model, x, y):
        logits = model(x)
        return returned(F.cross_entropy(logits, y), logits)

    step = _step(fn, case="mlp_ce")
    with pytest.raises(px.UntraceableError, match=match):
        step(*case.batch(0))


def test_aux_must_keep_its_structure_over_micro_batches():
    case = CASES_BY_NAME["mlp_ce"]
    calls = []

    def fn(model, x, y):
        calls.append(1)
        return F.cross_entropy(model(x), y), {"call": len(calls)}

    with pytest.raises(px.UntraceableError, match="micro-batch 1"):
        _step(fn, accumulate=2, case="mlp_ce")(*case.batch(0))


def test_the_evaluation_of_a_training_function_returns_loss_and_aux():
    """px.compile(optimizer=None) of the same function returns (loss, aux) too, aux from the trained values."""
    case = CASES_BY_NAME["gpt_tied"]
    model = case.build_model()
    step = px.compile(model, optimizer=px.AdamW(**HYPER), device="cpu", chunk_size=CHUNK)(gpt_with_aux)
    evaluate = px.compile(model, optimizer=None, device="cpu", debug=True)(gpt_with_aux)
    step(*case.batch(0))
    batch = case.batch(1)
    want_loss, want_aux = _eager_from(step, gpt_with_aux, batch)
    loss, aux = evaluate(*batch)
    assert torch.equal(loss, want_loss.detach())
    _assert_same(aux, want_aux)


def test_mapping_classes_come_back_as_themselves():
    """aux of a mapping class optree does not know (transformers' ModelOutput is an OrderedDict subclass) is
    returned as that class, its tensors equal to eager's; a model's key-value cache in it is refused, saying
    use_cache=False."""
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_outputs import CausalLMOutput

    case = CASES_BY_NAME["gpt_tied"]

    def fn(model, idx, targets):
        logits = model(idx)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return loss, {"out": CausalLMOutput(loss=loss.detach(), logits=logits), "n": 2}

    step = _step(fn)
    batch = case.batch(0)
    want_loss, want_aux = _eager_from(step, fn, batch)
    loss, aux = step(*batch)
    assert type(aux["out"]) is CausalLMOutput and aux["out"].logits is aux["out"]["logits"]
    assert torch.equal(loss, want_loss.detach()) and aux["n"] == 2
    for k in ("loss", "logits"):
        assert torch.equal(aux["out"][k], want_aux["out"][k].detach()), k
    cache = transformers.DynamicCache()

    def with_cache(model, idx, targets):
        loss, aux = fn(model, idx, targets)
        return loss, {"past_key_values": cache, **aux}
    with pytest.raises(px.UntraceableError, match=r"aux\['past_key_values'\] of type DynamicCache.*use_cache=False"):
        _step(with_cache)(*batch)


class _Frozen(dict):
    """A mapping whose constructor takes neither its keys by name nor a dict."""

    def __init__(self, source, *, tag):
        super().__init__(tag=tag)
        self.source = source


def test_model_outputs_from_evaluation_and_accumulation_and_mappings_that_cannot_be_rebuilt():
    """A ModelOutput comes back as itself from an evaluation and stacked over micro-batches too; a mapping that
    cannot be rebuilt from its items is refused while tracing, before any update, and so is aux that holds itself."""
    pytest.importorskip("transformers")
    from transformers.modeling_outputs import CausalLMOutput

    case = CASES_BY_NAME["gpt_tied"]

    def fn(model, idx, targets):
        logits = model(idx)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return loss, CausalLMOutput(logits=logits)

    step = _step(fn, accumulate=2)
    batch = case.batch(0)
    _, aux = step(*batch)
    assert type(aux) is CausalLMOutput and aux.logits.shape[0] == 2          # (K, *shape) stacked
    evaluate = px.compile(step._model, optimizer=None, device="cpu")(fn)
    _, out = evaluate(*batch)
    want = _eager_from(step, fn, batch)[1]
    assert type(out) is CausalLMOutput and torch.equal(out.logits, want.logits.detach())
    before = step.state_dict()
    for returned, match in ((lambda loss, logits: (loss, _Frozen("model", tag=logits)), "cannot be rebuilt"),
                            (lambda loss, logits: (loss, _holding_itself(logits)), "")):
        def bad(model, idx, targets):
            logits = model(idx)
            return returned(F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1)), logits)
        with pytest.raises((px.UntraceableError, RecursionError), match=match):
            px.compile(step._model, optimizer=px.AdamW(**HYPER), device="cpu")(bad)(*batch)
    assert all(torch.equal(v, before[k]) for k, v in step.state_dict().items())


def _holding_itself(logits):
    aux = {"logits": logits}
    aux["self"] = aux
    return aux
