"""Python control flow on data-dependent values: each decision is traced for one outcome and guarded at run time.

A step that branches on a tensor's value (`if (y > 0).sum() > k:`, `.item()`), on a data-dependent size (`if
sel.size(0) > 0:` after boolean-mask indexing, transformers' DeBERTa-v2 loss), or that uses such a size as a number,
trains exactly as eager PyTorch: a guard that sees another outcome fails before the commit point, the step (which
changed nothing) is traced for what it saw and runs again, and each outcome's graph is cached and reused. Also
under a budget that evicts chunks, with atomic=False (guards before every update), and in evaluation.
"""
import copy
import warnings

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

import pstar_fx as px
from pstar_fx.ir import Role
from pstar_fx.ir.graph import to_module
from pstar_fx.passes.verify import VerificationError, verify

from harness import fetch_counts, line_of
from models import assert_state_close

LR = 1e-2


def _guards(g):
    return [n.kwargs["spec"] for n in g.nodes if g.ann[n.name].role is Role.GUARD]


def _train_both(model, loss_fn, batches, debug=True, **kw):
    """The compiled step and eager torch.optim.AdamW (fused, as pstar-fx's default) on the same batches: losses and
    final state_dicts of both, and the step."""
    ref = copy.deepcopy(model)
    step = px.compile(model, optimizer=px.AdamW(lr=LR), device="cpu", debug=debug, **kw)(loss_fn)
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, fused=True)
    losses, ref_losses = [], []
    for b in batches:
        losses.append(step(*b).item())
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(ref, *b)
        loss.backward()
        opt.step()
        ref_losses.append(loss.item())
    return losses, ref_losses, step.state_dict(), ref.state_dict(), step


def _mlp(d_in=6, d_out=1, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d_in, 16), nn.ReLU(), nn.Linear(16, d_out))


def _shifted(n, shift, seed=1, rows=8, cols=6):
    """n batches whose sign alternates with the step: every other one takes the other branch."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(rows, cols, generator=g) + (shift if i % 2 else -shift),) for i in range(n)]


def sum_branch(model, x):
    y = model(x)
    if (y > 0).sum() > 2:
        return (y * 2).square().mean()
    return (y - 1).abs().mean()


def test_branch_on_a_sum_trains_like_eager_and_reuses_both_graphs():
    losses, ref_losses, sd, ref_sd, step = _train_both(_mlp(), sum_branch, _shifted(6, 3.0))
    assert losses == ref_losses
    assert_state_close(sd, ref_sd, rtol=1e-6)
    assert step._compiler.compiles == 2                 # one trace per outcome, each reused twice more
    outcomes = {s.expected for c in step._compiler.cache._entries.values()
                for s in _guards(c.stages["traced"])}
    assert outcomes == {True, False}


def item_branch(model, x):
    y = model(x)
    if y.mean().item() > 0:                 # a Python float decides
        return torch.relu(y).sum()
    return (y * y.detach().abs().max().item()).mean()      # .item() as a number in the loss too


def test_item_driven_branch_and_item_as_a_number_train_like_eager():
    losses, ref_losses, sd, ref_sd, step = _train_both(_mlp(), item_branch, _shifted(6, 3.0))
    assert losses == ref_losses
    assert_state_close(sd, ref_sd, rtol=1e-6)
    assert step._compiler.compiles == 2


def checked_loss(model, x):
    y = model(x)
    if torch.isnan(x).any():                # a sanity check: False on real data, and its branch raises
        raise ValueError("a NaN in the batch")
    assert not torch.isinf(y).any(), "an inf in the output"
    return y.square().mean()


def test_a_check_whose_branch_raises_traces_its_passing_branch_and_raises_as_eager_on_bad_data():
    """The tracer cannot know the condition: it takes True first, the user's code raises, and the trace takes the
    condition False instead (guarded). A batch that makes it true raises the user's own error, changing nothing."""
    losses, ref_losses, sd, ref_sd, step = _train_both(_mlp(), checked_loss, _shifted(3, 0.5))
    assert losses == ref_losses
    assert_state_close(sd, ref_sd, rtol=1e-6)
    assert step._compiler.compiles == 1
    bad = _shifted(1, 0.5, seed=9)[0][0]
    bad[2, 3] = float("nan")
    with pytest.raises(ValueError, match="a NaN in the batch"):
        step(bad)
    assert_state_close(step.state_dict(), sd, rtol=0)
    step(*_shifted(1, 0.5, seed=4)[0])      # and training goes on


class Warming(nn.Module):
    """Python state its forward writes at every call, as eager code runs it: a call counter a warm-up reads, a list
    it appends to, a config field, and a hook added at every call."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 1)
        self.seen = []
        self.cfg = _Config()

    def forward(self, x):
        self.calls = getattr(self, "calls", 0) + 1
        self.seen.append(self.calls)
        self.cfg.last = self.calls
        self.lin.register_forward_hook(lambda m, args, out: out + 0.5)
        return self.lin(x) * (2.0 if self.calls == 1 else 1.0)


class _Config:
    def __init__(self):
        self.last = 0

    def to_dict(self):
        return dict(vars(self))


def _beside_eager(model, loss_fn, batches):
    """The compiled step and eager torch.optim.AdamW (fused) on a copy of `model`, one batch after another: yields
    (i, the copy, the step) after each batch, once the step's loss was found equal to eager's."""
    ref = copy.deepcopy(model)
    step = px.compile(model, optimizer=px.AdamW(lr=LR), device="cpu")(loss_fn)
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, fused=True)
    for i, batch in enumerate(batches):
        got = step(*batch)
        want = loss_fn(ref, *batch)
        want.backward()
        opt.step()
        opt.zero_grad()
        assert torch.equal(got, want.detach()), i
        yield i, ref, step


def test_a_trace_tried_the_other_way_runs_the_step_python_once():
    """The sanity check makes the first call's trace fail and run again the other way: what the failed trace's
    Python wrote (the counter, the list, the config field, the hook) is put back first, so every call computes and
    leaves what eager code does (the warm-up scale of the first call included)."""
    torch.manual_seed(0)
    model = Warming()
    for i, ref, step in _beside_eager(model, checked_loss, _shifted(3, 0.5)):
        assert (model.calls, model.seen, model.cfg.last) == (ref.calls, ref.seen, ref.cfg.last), i
        assert len(model.lin._forward_hooks) == len(ref.lin._forward_hooks) == i + 1, i
    assert_state_close(step.state_dict(), ref.state_dict(), rtol=1e-6)


class _Double(nn.Module):
    def forward(self, x):
        return 2 * x


class SetUpOnce(nn.Module):
    """Sets itself up at its first call, as eager code runs it: a flag, and a layer appended to a ModuleList; counts
    its calls (which the graph reads) and logs them in a list in a dict (which no key reads: a compiled step served
    from the cache does not log); and branches on the data (never true here, taken true first by the tracer)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 1)
        self.extra = nn.ModuleList()
        self.warm = True
        self.calls = 0
        self.log = {"calls": []}

    def forward(self, x):
        if self.warm:
            self.warm = False
            self.extra.append(_Double())
        self.calls += 1
        self.log["calls"].append(self.calls)
        y = self.lin(x)
        for m in self.extra:
            y = m(y)
        if x.sum() > 1e6:
            y = y * 3
        return y * (2.0 if self.calls == 1 else 1.0)


@pytest.mark.parametrize("loss_fn", [checked_loss, lambda m, x: m(x).square().mean()], ids=["check", "guard"])
def test_setup_and_a_counter_run_once_when_the_first_call_traces_again(loss_fn):
    """The first call traces again: its sanity check fails the first trace (tried the other way), or its branch's
    guard fails on the data the graph was traced for (traced again for the outcome observed). Either way what the
    first trace's Python set up (the layer, in the module tree), counted and logged (a list in a dict) is put back
    first, so the call computes and leaves what eager's first call does; and so do the calls after it."""
    torch.manual_seed(0)
    model = SetUpOnce()
    for i, ref, step in _beside_eager(model, loss_fn, _shifted(3, 0.5)):
        assert (len(model.extra), model.calls) == (len(ref.extra), ref.calls) == (1, i + 1), i
        if i == 0:
            assert model.log == ref.log == {"calls": [1]}
    assert step._compiler.compiles >= 2, "the first call did not trace again"


def skips_unlabelled(model, x, y):
    valid = y >= 0
    if valid.sum() == 0:                               # no labelled row: nothing to learn from this batch
        return torch.zeros((), requires_grad=True)
    return nn.functional.cross_entropy(model(x)[valid], y[valid])


def test_a_branch_that_returns_a_constant_loss_traces_the_branch_that_trains():
    """The tracer takes the condition True first, whose loss reaches no parameter: a step that trains nothing is
    refused there, so the trace takes it False (guarded) and lays the chunks out for the parameters that train
    (it once laid them out with every parameter frozen, and no batch could run). Labelled batches train as eager; a
    batch without labels raises that the loss reaches no parameter (eager's step changes nothing either), changing
    nothing, and training goes on as eager's."""
    g = torch.Generator().manual_seed(5)
    batches = [(torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(3)]
    losses, ref_losses, sd, ref_sd, step = _train_both(_mlp(d_out=3), skips_unlabelled, batches)
    assert losses == ref_losses
    assert_state_close(sd, ref_sd, rtol=0)
    with pytest.raises(px.UntraceableError, match="the loss does not depend on any trainable parameter"):
        step(batches[0][0], torch.full((8,), -1))
    assert_state_close(step.state_dict(), sd, rtol=0)
    step(*batches[1])                                 # and training goes on


def test_torchs_own_checks_on_values_trace_their_passing_branch_and_raise_on_bad_data():
    """F.gaussian_nll_loss checks `if torch.any(var < 0): raise ValueError` inside torch."""
    def loss_fn(model, x, shift=0.1):
        out = model(x)
        return nn.functional.gaussian_nll_loss(out[:, 0], x[:, 1], nn.functional.softplus(out[:, 1]) + shift)
    losses, ref_losses, sd, ref_sd, step = _train_both(_mlp(d_out=2), loss_fn, _shifted(3, 0.5))
    assert losses == ref_losses
    assert_state_close(sd, ref_sd, rtol=1e-6)
    with pytest.raises(ValueError, match="var has negative entry"):       # as eager raises it
        step(_shifted(1, 0.5)[0][0], -100.0)


class _CheckedLayers(nn.Module):
    def __init__(self, n=12):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(6, 6) for _ in range(n))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
            if torch.isnan(x).any():              # MARK-layer-check: one line, asked once per layer
                raise FloatingPointError("a NaN after a layer")
        return x.square().mean()


def test_a_check_in_every_layer_traces_in_two_attempts():
    """After the line's first condition failed the trace, every later condition asked at that line is taken False."""
    losses, ref_losses, sd, ref_sd, step = _train_both(_CheckedLayers(), lambda m, x: m(x), _shifted(2, 0.5))
    assert losses == ref_losses
    assert_state_close(sd, ref_sd, rtol=1e-6)
    assert len(_guards(step.graphs["traced"])) == 12


def masked_loss(model, x):
    y = model(x).squeeze(-1)
    sel = y[x[:, 0] > 1.0]                  # boolean-mask indexing of the loss: a data-dependent size
    if sel.size(0) > 0:                     # MARK-size-branch
        return sel.square().mean()
    return y.abs().mean()


def test_boolean_mask_whose_size_feeds_an_if_trains_like_eager():
    g = torch.Generator().manual_seed(3)
    batches = []
    for i in range(6):
        x = torch.randn(8, 6, generator=g)
        x[:, 0] = torch.rand(8, generator=g) * 3 if i % 2 else -torch.rand(8, generator=g)   # none selected
        x[0, 0] = 2.0 if i % 2 else x[0, 0]
        batches.append((x,))
    losses, ref_losses, sd, ref_sd, step = _train_both(_mlp(), masked_loss, batches)
    assert losses == ref_losses
    assert_state_close(sd, ref_sd, rtol=1e-6)
    assert step._compiler.compiles == 2
    (spec,) = _guards(step.graphs["traced"])
    assert spec.op == "aten.index" and f"test_guards.py:{line_of(__file__, 'MARK-size-branch')}" in spec.where


def rel_close(a, b, rtol=1e-6):
    return all(abs(x - y) <= rtol * max(abs(y), 1e-12) for x, y in zip(a, b))


def test_tiny_budget_evicts_and_both_branches_train_like_eager():
    model = _mlp(d_in=32, d_out=1)
    model = nn.Sequential(*model, nn.ReLU(), nn.Linear(1, 32), nn.ReLU(), nn.Linear(32, 1))
    probe = px.compile(copy.deepcopy(model), optimizer=px.AdamW(lr=LR), device="cpu", chunk_size=256)(sum_branch)
    budget = int(probe.min_device_memory(*_shifted(1, 3.0, cols=32)[0]) * 1.05)
    losses, ref_losses, sd, ref_sd, step = _train_both(model, sum_branch, _shifted(6, 3.0, cols=32),
                                                       device_memory=budget, chunk_size=256)
    assert rel_close(losses, ref_losses)
    assert_state_close(sd, ref_sd, rtol=1e-6)
    assert step._compiler.compiles == 2
    assert max(fetch_counts(step.graphs["scheduled"]).values()) >= 2, "no chunk was evicted and fetched again"
    assert budget < step.summary().model_data_bytes


class _Dropped(nn.Module):
    """Dropout before the decision: the rerun after a failed guard must draw the same numbers again."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(6, 16), nn.Linear(16, 1)
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        h = self.drop(x)
        y = self.b(torch.relu(self.a(h)))
        if h.sum() > 0:
            return (y * 2).square().mean()
        return (y - 1).abs().mean()


def test_a_failed_guard_leaves_model_and_optimizer_untouched_before_the_rerun():
    model = _Dropped()
    batches = _shifted(4, 3.0)
    ref = copy.deepcopy(model)
    step = px.compile(model, optimizer=px.AdamW(lr=LR), device="cpu")(lambda m, x: m(x))
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, fused=True)
    compiler = step._compiler
    get = compiler.get
    seen = []          # (values before the call, values when the rerun asks for another graph)

    def spy(batch, interrupts, prefix=()):
        if prefix:
            seen.append((before, _everything(step)))
        return get(batch, interrupts, prefix)

    compiler.get = spy
    for i, (x,) in enumerate(batches):
        before = _everything(step) if i else None
        torch.manual_seed(100 + i)
        loss = step(x)
        torch.manual_seed(100 + i)
        opt.zero_grad(set_to_none=True)
        ref_loss = ref(x)
        ref_loss.backward()
        opt.step()
        assert loss.item() == ref_loss.item()
    assert compiler.compiles == 2
    assert len([s for s in seen if s[0] is not None]) == 3       # steps 2-4 each failed one guard first
    for old, at_rerun in seen:
        if old is None:
            continue
        assert old.keys() == at_rerun.keys()
        for k in old:
            assert torch.equal(old[k], at_rerun[k]), k
    assert_state_close(step.state_dict(), ref.state_dict(), rtol=1e-6)


def _everything(step) -> dict:
    out = {f"sd.{k}": v.clone() for k, v in step.state_dict().items()}
    for i, s in step.optimizer.state_dict()["state"].items():
        out.update({f"opt.{i}.{k}": v.clone() for k, v in s.items()})
    return out


class _Recomputed(nn.Module):
    """A checkpointed block that decides on a value: backward's recompute decides again, in backward, after the
    last layer's chunk is done with."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 1)

    def block(self, x):
        h = self.a(x)
        h = torch.relu(h) if h.mean().item() > 0 else torch.tanh(h)
        return self.b(h)

    def forward(self, x):
        return self.c(checkpoint(self.block, x, use_reentrant=False)).square().mean()


def test_with_atomic_false_every_guard_comes_before_every_update():
    losses, ref_losses, sd, ref_sd, step = _train_both(
        _Recomputed(), lambda m, x: m(x), _shifted(4, 1.0, cols=16), device_memory=9000, chunk_size=320,
        atomic=False)
    assert losses == ref_losses
    assert_state_close(sd, ref_sd, rtol=1e-6)
    g = step.final_graph
    roles = [g.ann[n.name].role for n in g.nodes]
    commit = roles.index(Role.COMMIT)
    steps = [i for i, r in enumerate(roles) if r is Role.OPTIMIZER_STEP]
    guards = [i for i, r in enumerate(roles) if r is Role.GUARD]
    assert len(guards) == 2 and any(i < commit for i in steps), "expected early host-side updates"
    assert max(guards) < min(steps)


def test_the_verifier_refuses_a_guard_after_an_update():
    step = px.compile(_mlp(), optimizer=px.AdamW(lr=LR), device="cpu")(sum_branch)
    g = step.lower(*_shifted(1, 3.0)[0])["scheduled"]
    verify(g)
    graph = copy.deepcopy(g.gm.graph)
    guard = next(n for n in graph.nodes if n.name == "guard")
    first_step = next(n for n in graph.nodes if n.name == "optimizer_step")
    first_step.append(guard)
    with pytest.raises(VerificationError, match="guard .* comes after"):
        verify(g.evolve(gm=to_module(graph, g.gm)))


def counted(model, x):
    n = int((x[:, 0] > 0).sum())            # MARK-count
    return model(x[:n + 1]).square().mean()


def test_retracing_again_and_again_for_a_guard_warns_once_naming_op_and_line():
    g = torch.Generator().manual_seed(5)
    batches = []
    for count in (0, 2, 3, 4, 5, 6, 7, 2):
        x = torch.randn(8, 6, generator=g)
        x[:, 0] = -1.0
        x[:count, 0] = 1.0
        batches.append((x,))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses, ref_losses, sd, ref_sd, step = _train_both(_mlp(), counted, batches)
    assert rel_close(losses, ref_losses)
    assert_state_close(sd, ref_sd, rtol=1e-6)
    mine = [w for w in caught if "traced and compiled again" in str(w.message)]
    assert len(mine) == 1
    msg = str(mine[0].message)
    assert "aten._local_scalar_dense" in msg and f"test_guards.py:{line_of(__file__, 'MARK-count')}" in msg


def test_evaluation_branches_like_eager():
    model = _mlp()
    ref = copy.deepcopy(model)

    def f(m, x):
        y = m(x)
        return y * 2 if y.mean().item() > 0 else y - 1

    evaluate = px.compile(model, optimizer=None, device="cpu")(f)
    for (x,) in _shifted(4, 3.0):
        assert torch.equal(evaluate(x), f(ref, x))
    assert evaluate._compiler.compiles == 2


def _tiny_deberta():
    from transformers import DebertaV2Config, DebertaV2ForSequenceClassification
    torch.manual_seed(0)
    cfg = DebertaV2Config(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                          intermediate_size=64, max_position_embeddings=32, hidden_dropout_prob=0.0,
                          attention_probs_dropout_prob=0.0, pooler_dropout=0.0, num_labels=3, type_vocab_size=0,
                          relative_attention=True, position_buckets=8, pos_att_type=["p2c", "c2p"],
                          max_relative_positions=16)
    return DebertaV2ForSequenceClassification(cfg)


def deberta_loss(model, input_ids, labels):
    out = model(input_ids=input_ids, labels=labels)
    # with no labelled row DeBERTa's loss is a constant: the logits' penalty keeps the step trainable (eager too)
    return out.loss + 1e-2 * out.logits.square().mean()


def test_deberta_v2_label_index_branch_trains_like_eager():
    """transformers' DebertaV2ForSequenceClassification with num_labels > 1, problem_type None and 1-d labels
    computes `label_index = (labels >= 0).nonzero()` and branches on `if label_index.size(0) > 0:` (the loss of
    the labelled rows, else a constant; modeling_deberta_v2.py, DebertaV2ForSequenceClassification.forward).
    Batches alternate between some labelled rows and none: both outcomes are traced once and reused."""
    g = torch.Generator().manual_seed(6)
    batches = []
    for i in range(4):
        labels = torch.randint(0, 3, (4,), generator=g)
        labels[0] = -1
        if i % 2:
            labels[:] = -1
        batches.append((torch.randint(0, 64, (4, 8), generator=g), labels))
    losses, ref_losses, sd, ref_sd, step = _train_both(_tiny_deberta(), deberta_loss, batches, debug=False)
    assert rel_close(losses, ref_losses)
    assert_state_close(sd, ref_sd, rtol=1e-6)
    assert step._compiler.compiles == 2
    specs = [s for c in step._compiler.cache._entries.values() for s in _guards(c.stages["traced"])]
    assert sorted(s.expected for s in specs) == [False, True]
    assert all("modeling_deberta_v2.py" in s.where and "label_index.size(0) > 0" in s.where for s in specs)


def test_a_check_that_sees_a_traced_value_is_untraceable_not_raised_as_eagers():
    """transformers' Longformer (no global attention in the batch) asserts a size against a 0-d tensor's value,
    which the trace holds as a FakeTensor: the assertion fails under the trace only. It is reported as
    UntraceableError naming the line and why, not re-raised bare as the check eager code would have raised."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.LongformerForMaskedLM(transformers.LongformerConfig(
        vocab_size=300, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64,
        attention_window=4, max_position_embeddings=64, pad_token_id=1))
    ids = torch.randint(5, 300, (2, 16), generator=torch.Generator().manual_seed(1))
    labels = torch.full_like(ids, -100)
    labels[:, 2:6] = ids[:, 2:6]

    def loss(m, ids, labels):
        return m(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels).loss
    assert torch.isfinite(loss(copy.deepcopy(model), ids, labels))             # eager trains it
    step = px.compile(model, optimizer=px.AdamW(lr=1e-3), device="cpu")(loss)
    with pytest.raises(px.UntraceableError, match="a FakeTensor stands in") as e:
        step(ids, labels)
    assert "a FakeTensor stands in" in str(e.value) and "modeling_longformer.py" in str(e.value)


def test_a_check_whose_message_prints_the_tensor_raises_its_own_error_on_bad_data():
    """The message of the user's check formats the tensor (a FakeTensor while tracing): on data that makes it true
    it is still the user's ValueError, as in eager code, not UntraceableError."""
    torch.manual_seed(0)
    model = nn.Linear(4, 5)

    def loss(m, x, y):
        if (y >= 5).any():
            raise ValueError(f"labels out of range: {y}")
        return nn.functional.cross_entropy(m(x), y)
    step = px.compile(model, optimizer=px.AdamW(lr=1e-3), device="cpu")(loss)
    step(torch.randn(3, 4), torch.tensor([1, 2, 3]))
    before = step.state_dict()
    with pytest.raises(ValueError, match="labels out of range"):
        step(torch.randn(3, 4), torch.tensor([1, 7, 2]))
    assert_state_close(step.state_dict(), before, rtol=0)
