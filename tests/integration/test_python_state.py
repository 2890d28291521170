"""Plain Python values the step reads are part of its signature, as its arguments are.

A compiled step runs no Python, so a value read while tracing is fixed in the graph: a loss weight in a closure or a
global, a module's float attribute (private or in a small dict), `nn.Dropout.p`, a field of a config the model holds
changed between steps retrace and train as eager; a draw from Python's `random` is warned of (every step would
replay it); a value the step itself writes is named in a warning.
"""
import copy
import dataclasses
import functools
import random
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import pstar_fx as px
from pstar_fx.frontend.python_state import _attribute_key, _value_key, closure_key, module_scalars

from harness import HYPER, rel_err
from models import assert_state_close


@dataclasses.dataclass
class Config:
    shift: float = 0.0


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(12, 24)
        self.drop = nn.Dropout(0.3)
        self.fc2 = nn.Linear(24, 5)
        self.temperature = 1.0
        self._bias = 0.0                  # private attributes, containers and a held config are read too
        self.gains = {"fc1": 1.0}
        self.config = Config()

    def forward(self, x):
        h = torch.tanh(self.fc1(x) * self.gains["fc1"] + self._bias + self.config.shift)
        return self.fc2(self.drop(h)) / self.temperature


def _model():
    torch.manual_seed(0)
    return Net()


def _batch(i):
    g = torch.Generator().manual_seed(100 + i)
    return torch.randn(16, 12, generator=g), torch.randint(0, 5, (16,), generator=g)


WEIGHT = {"w": 1.0}
SCALE = 1.0


def _run_both(loss_fn, change, steps=5, make=None):
    """`change(i, model)` before step i, on the compiled step's model and on the eager one (each `make()`, by default
    `_model()`); same seeds."""
    model, ref = (make or _model)(), (make or _model)()
    step = px.compile(model, optimizer=px.AdamW(**HYPER), device="cpu")(loss_fn)
    opt = torch.optim.AdamW(ref.parameters(), **HYPER, fused=True)
    losses, ref_losses = [], []
    for i in range(steps):
        change(i, model)
        torch.manual_seed(i)
        losses.append(step(*_batch(i)).item())
        change(i, ref)
        torch.manual_seed(i)
        loss = loss_fn(ref, *_batch(i))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        ref_losses.append(loss.item())
    return step, losses, ref_losses, ref


def _ce(model, x, y):
    return F.cross_entropy(model(x), y)


@pytest.mark.parametrize("where", ["closure_dict", "global", "module_attribute", "dropout_p", "private_attribute",
                                   "dict_attribute", "config_field"])
def test_a_plain_value_changed_between_steps_retraces_and_trains_as_eager(where):
    state = {"w": 1.0}

    def closure_loss(model, x, y):
        return _ce(model, x, y) * state["w"]

    def global_loss(model, x, y):
        return _ce(model, x, y) * SCALE

    def change(i, model):
        global SCALE
        value = [1.0, 0.5, 0.5, 2.0, 0.0][i]
        if where == "closure_dict":
            state["w"] = value
        elif where == "global":
            SCALE = value
        elif where == "module_attribute":
            model.temperature = value + 0.5
        elif where == "private_attribute":
            model._bias = value
        elif where == "dict_attribute":
            model.gains["fc1"] = value
        elif where == "config_field":
            model.config.shift = value
        else:
            model.drop.p = value / 2
    loss_fn = {"closure_dict": closure_loss, "global": global_loss}.get(where, _ce)
    try:
        step, losses, ref_losses, ref = _run_both(loss_fn, change)
    finally:
        globals()["SCALE"] = 1.0
    assert rel_err(losses, ref_losses) <= 1e-6, (losses, ref_losses)
    assert_state_close(step.state_dict(), ref.state_dict(), rtol=1e-6)
    assert step._compiler.compiles == 4          # one per distinct value (0.5 seen twice in a row)


def test_keys_see_scalars_and_small_containers_and_nan_equals_itself():
    nan_weight = float("nan")
    big = list(range(1000))

    def fn(model, x):
        return model(x).sum() * nan_weight * len(big)
    assert closure_key(fn) == closure_key(fn)                # a NaN does not make every call a new signature
    assert ("p", ("float", 0.3)) in module_scalars(_model().drop)
    assert ("temperature", ("float", 1.0)) in module_scalars(_model())
    keys = dict(module_scalars(_model()))
    assert keys["_bias"] == ("float", 0.0) and keys["gains"] == ("dict", (("fc1", ("float", 1.0)),))
    assert keys["config.shift"] == ("float", 0.0)
    # what computes apart keys apart: 2.0 and 2 (a dtype), -0.0 and 0.0 (atan2(k, -1)), NaN and "nan"
    for a, b in ((2.0, 2), (-0.0, 0.0), (float("nan"), "nan"), (True, 1)):
        assert _value_key(a) != _value_key(b), (a, b)
    assert _value_key(float("nan")) == _value_key(float("nan")) and _value_key(-0.0) == _value_key(-0.0)
    for a, b in (([2.0] * 100, [2] * 100), ([True] * 100, [1] * 100), (dict.fromkeys(range(99), 1),
                                                                       dict.fromkeys(range(99), True))):
        assert _attribute_key(a) != _attribute_key(b), type(a)           # long containers too
    assert not {"training", "_parameters", "_buffers", "_forward_hooks"} & set(keys)      # torch's own fields
    key = closure_key(fn)
    big.append(1)                                            # past CONTAINER_ITEMS: not keyed by value
    assert closure_key(fn) == key


def test_a_draw_from_pythons_random_while_tracing_is_warned_of():
    """A compiled step replays the trace's draw; refusing it would refuse models that draw without deciding anything
    (transformers' MusicGen, with its layer drop off), and another thread's draws move the same generator."""
    def layer_drop(model, x, y):
        h = torch.tanh(model.fc1(x))
        if random.random() < 2.0:                            # always true, but eager draws anew at every step
            h = model.drop(h)
        return F.cross_entropy(model.fc2(h), y)
    step = px.compile(_model(), optimizer=px.AdamW(**HYPER), device="cpu")(layer_drop)
    with pytest.warns(UserWarning, match=r"generator of random \(Python's random module\) moved.*torch\.rand"):
        step(*_batch(0))


def test_seeding_torchs_generator_inside_the_step_is_refused():
    """torch.manual_seed inside the step runs once, at the trace; every compiled step would then draw on from the
    generator where eager code draws the same numbers again: refused, never a silently different run. Random draws
    without a seed inside train as eager (test_fuse.py::test_gpt_dropout_under_remat_budget_matches_eager)."""
    def seeded_noise(model, x, y):
        torch.manual_seed(0)
        return F.cross_entropy(model(x + torch.randn_like(x)), y)
    step = px.compile(_model(), optimizer=px.AdamW(**HYPER), device="cpu")(seeded_noise)
    with pytest.raises(px.UntraceableError, match=r"set the state of torch's CPU generator .* Seed in the training "
                                                  r"loop"):
        step(*_batch(0))


@pytest.mark.parametrize("where", ["made in the step", "passed in"])
def test_a_generator_object_is_refused_with_its_op_and_line(where):
    """randn(..., generator=g): the trace would keep its own copy of the object, drawing one stream over every
    step, not what eager code draws: refused, naming the op and the user's line (it crashed the planner before)."""
    def own(model, x, y):
        g = torch.Generator().manual_seed(1)
        return F.cross_entropy(model(x + torch.randn(x.shape, generator=g)), y)

    def given(model, x, y, g):
        return F.cross_entropy(model(x + torch.randn(x.shape, generator=g)), y)
    fn, extra = (own, ()) if where == "made in the step" else (given, (torch.Generator().manual_seed(1),))
    step = px.compile(_model(), optimizer=px.AdamW(**HYPER), device="cpu")(fn)
    with pytest.raises(px.UntraceableError, match=r"aten.randn.generator draws from a torch.Generator object "
                                                  r"\(File .*test_python_state.py\", line \d+"):
        step(*_batch(0), *extra)


def test_a_value_that_changes_every_step_is_named_after_four_compiles():
    state = {"weight": 1.0}

    def weighted(model, x, y):
        return _ce(model, x, y) * state["weight"]
    step = px.compile(_model(), optimizer=px.AdamW(**HYPER), device="cpu")(weighted)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for i in range(6):
            state["weight"] = 1.0 + i
            step(*_batch(i))
    named = [str(w.message) for w in seen if "compiled again" in str(w.message)]
    assert len(named) == 1 and "the step function's state" in named[0] and "as a tensor" in named[0], named


def test_names_that_are_attributes_are_not_keyed_as_globals():
    """`loss` in `model(x).loss` and `mse_loss` in `F.mse_loss` are attribute names, not globals the step reads."""
    def fn(model, x, y):
        return F.mse_loss(model(x), y)
    globals()["mse_loss"] = 0.5
    try:
        key = closure_key(fn)
        globals()["mse_loss"] = 0.7
        assert closure_key(fn) == key and "mse_loss" not in dict(key)
    finally:
        del globals()["mse_loss"]


def test_a_value_the_step_writes_is_written_at_every_call_as_in_eager_code():
    """The step's key changed by its own trace: not run from the cache for that key again, so each call traces and
    its Python counts as eager code's does; the graph is the same, so it is planned once (api/plan_reuse.py)."""
    class Counting(Net):
        def forward(self, x):
            self.calls = getattr(self, "calls", 0) + 1
            return super().forward(x)
    model = Counting()
    step = px.compile(model, optimizer=px.AdamW(**HYPER), device="cpu")(_ce)
    step(*_batch(0))
    assert step._compiler.compiles == 1 and model.calls == 1
    step(*_batch(1))
    assert (step._compiler.compiles, step._compiler.plans, model.calls) == (2, 1, 2)


LOGGED = []


class Logs:
    """A step function that is a bound method (as PstarTrainer's is): its object's attributes are looked at."""

    def __init__(self):
        self.values = []

    def step(self, model, x, y):
        loss = F.cross_entropy(model(x), y)
        self.values = self.values + [loss.item()]
        return loss


@pytest.mark.parametrize("where", ["closure_list", "global_list", "method_self", "module_attribute", "closure_tensor"])
def test_a_value_made_inside_the_step_and_kept_outside_it_is_refused_naming_where(where):
    """Eager code reading it after the step would get the trace's placeholder (a SymFloat whose float() is 0.0, a
    fake tensor): refused at the trace, saying to return it beside the loss."""
    seen = []

    class Counting(Net):
        def forward(self, x):
            out = super().forward(x)
            self.positive = (out > 0).float().mean().item()      # a statistic, kept on the module
            return out

    def closure_list(model, x, y):
        loss = _ce(model, x, y)
        seen.append(loss.item())
        return loss

    def global_list(model, x, y):
        loss = _ce(model, x, y)
        LOGGED.append(loss.item())
        return loss

    def closure_tensor(model, x, y):
        loss = _ce(model, x, y)
        seen.append(loss.detach())
        return loss
    fn, want = {"closure_list": (closure_list, r"a SymFloat \(a \.item\(\) read inside the step\) in the step "
                                              r"function's seen\[0\]"),
                "global_list": (global_list, r"a SymFloat .* in the global LOGGED\[0\]"),
                "method_self": (Logs().step, r"a SymFloat .* in Logs\.values\[0\]"),
                "module_attribute": (_ce, r"a SymFloat .* in model\.positive"),
                "closure_tensor": (closure_tensor, r"a tensor made inside the step .* in the step function's "
                                                   r"seen\[0\]")}[where]
    model = Counting() if where == "module_attribute" else Net()
    step = px.compile(model, optimizer=px.AdamW(**HYPER), device="cpu")(fn)
    try:
        with pytest.raises(px.UntraceableError, match=want + r".*Return it beside the loss"):
            step(*_batch(0))
    finally:
        LOGGED.clear()
    plain = px.compile(Net(), optimizer=px.AdamW(**HYPER), device="cpu")(_ce)     # a step keeping nothing: fine
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.isfinite(plain(*_batch(0)))


def test_what_the_ranks_compare_leaves_plain_values_out():
    """Ranks compare the portable key: a value holding the rank's number (in a module or a global the step reads for
    its logging) must not make them disagree; the collectives check catches graphs that differ."""
    model = _model()
    step = px.compile(model, optimizer=px.AdamW(**HYPER), device="cpu")(_ce)
    portable, local = step._compiler.model_key(portable=True), step._compiler.model_key()
    model.temperature = 3.0
    assert step._compiler.model_key(portable=True) == portable and step._compiler.model_key() != local


def test_a_bool_is_not_an_equal_int_and_a_decorated_step_is_followed():
    class Select(Net):
        def forward(self, x):
            out = super().forward(x)
            return out * 2 if self.sel is True else out
    model = Select()
    model.sel = 1
    key = closure_key(_ce), module_scalars(model)
    model.sel = True
    assert module_scalars(model) != key[1]

    def decorated(f):
        @functools.wraps(f)
        def wrapper(*args):
            return f(*args)
        return wrapper

    @decorated
    def scaled(model, x, y):
        return _ce(model, x, y) * SCALE
    assert ("SCALE", ("float", 1.0)) in closure_key(scaled)


def test_a_transformers_config_field_changed_between_steps_retraces_and_trains_as_eager():
    """transformers' forwards read `self.config` (Gemma-2's final logit soft-capping here): the held config's fields
    are part of the signature, read once however many modules hold it."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.Gemma2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                    num_key_value_heads=1, head_dim=16, vocab_size=97, final_logit_softcapping=30.0,
                                    attn_implementation="eager")
    model = transformers.Gemma2ForCausalLM(cfg)
    ref = copy.deepcopy(model)
    step = px.compile(model, optimizer=px.AdamW(**HYPER), device="cpu")(
        lambda m, ids: m(input_ids=ids, labels=ids).loss)
    opt = torch.optim.AdamW(ref.parameters(), **HYPER, fused=True)
    losses, ref_losses = [], []
    for i, cap in enumerate([30.0, 1.0, 1.0, None]):
        ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(i))
        model.config.final_logit_softcapping = ref.config.final_logit_softcapping = cap
        losses.append(step(ids).item())
        loss = ref(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        ref_losses.append(loss.item())
    assert rel_err(losses, ref_losses) <= 1e-6, (losses, ref_losses)
    assert_state_close(step.state_dict(), ref.state_dict(), rtol=1e-5)
    assert step._compiler.compiles == 3
    assert sum(1 for key in step._compiler.scalars.read() if key and key[0] == "config") == 1   # read once


class _Counter(nn.Module):
    """A metric kept on the model and updated between steps, outside the step (torchmetrics' idiom): no parameters,
    a private update count, a list of states."""

    def __init__(self):
        super().__init__()
        self._update_count = 0
        self.values = []

    def update(self, t):
        self._update_count += 1
        self.values.append(t)


def test_a_metrics_bookkeeping_between_steps_does_not_retrace():
    model = _model()
    model.metric = _Counter()
    step = px.compile(model, optimizer=px.AdamW(**HYPER), device="cpu")(
        lambda m, x, y: (_ce(m, x, y), m(x)))
    for i in range(4):
        loss, logits = step(*_batch(i))
        model.metric.update(logits)
    assert step._compiler.compiles == 1


def test_reading_the_keys_reuses_what_has_not_changed_and_sees_what_has():
    """Scalars that are the same objects keep their key; a new value, a container changed in place, an attribute
    deleted and another added are each seen."""
    from pstar_fx.frontend.python_state import ModuleScalars
    model = _model()
    scalars = ModuleScalars(model)
    first = scalars.read()
    assert scalars.read() == first
    model.temperature = 2.0
    second = scalars.read()
    assert second != first
    model.gains["fc1"] = 3.0
    third = scalars.read()
    assert third != second
    del model.temperature
    model.other = 1.0                       # the same number of attributes, another name
    assert scalars.read() != third and ("other", ("float", 1.0)) in module_scalars(model)


class _Skips(nn.Module):
    """A model whose forward reads a list attribute empty at the first call and filled in place later."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(12, 12) for _ in range(3))
        self.head = nn.Linear(12, 5)
        self.twice = []
        self.gains = {}

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            for _ in range(2 if i in self.twice else 1):
                x = torch.tanh(layer(x)) * self.gains.get(i, 1.0)
        return self.head(x)


def test_an_empty_list_or_dict_attribute_filled_in_place_later_retraces_and_trains_as_eager():
    def change(i, m):
        if i == 2:
            m.twice.append(1)
        if i == 3:
            m.gains[0] = 0.5
    step, losses, ref_losses, ref = _run_both(_ce, change, steps=5, make=_Skips)
    assert rel_err(losses, ref_losses) <= 1e-6, (losses, ref_losses)
    assert_state_close(step.state_dict(), ref.state_dict(), rtol=1e-6)
    assert step._compiler.compiles == 3


class _Scaled(nn.Module):
    """A forward reading the last scalar of a list attribute that first holds a tensor, then is emptied and refilled
    with floats; and an attribute, an empty list at the first compile, later set to a tensor nothing reads."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(12, 5)
        self.scales = []
        self.extra = []

    def forward(self, x):
        s = self.scales[-1] if self.scales and not isinstance(self.scales[-1], torch.Tensor) else 1.0
        return self.lin(x) * s


def test_a_list_attribute_emptied_and_refilled_with_scalars_retraces_and_one_set_to_a_tensor_is_no_error():
    def change(i, m):
        if i == 1:
            m.scales.append(torch.ones(()))     # not keyed: a tensor
        if i == 2:
            m.scales = []
        if i >= 3:
            m.scales.append(1.0 + i)
        if i == 4:
            m.extra = torch.ones(3)
    step, losses, ref_losses, ref = _run_both(_ce, change, steps=6, make=_Scaled)
    assert rel_err(losses, ref_losses) <= 1e-6, (losses, ref_losses)
    assert step._compiler.compiles == 4          # the first, then one per new scale


class _LayerScales(nn.Module):
    """A forward reading a list attribute of more items than a closure's containers are keyed by value up to."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(12, 5)
        self.scales = [1.0] * 100

    def forward(self, x):
        return self.lin(x) * self.scales[-1]


def test_a_long_list_attribute_changed_in_place_retraces_and_trains_as_eager():
    def change(i, m):
        m.scales[-1] = [1.0, 1.0, 0.5, 2.0][i]
        if i == 3:
            m.scales.append(3.0)
    step, losses, ref_losses, ref = _run_both(_ce, change, steps=4, make=_LayerScales)
    assert rel_err(losses, ref_losses) <= 1e-6, (losses, ref_losses)
    assert step._compiler.compiles == 3


class _Picks(nn.Module):
    """A forward indexing its output by the first item of a short and of a long list attribute: `h[:, 1]` takes a
    column, `h[:, True]` adds a dimension (so `True` and `1`, equal in Python, compute apart)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(12, 5)
        self.pick = [1, 0]
        self.picks = [1] * 100

    def forward(self, x):
        h = self.lin(x)
        a = h[:, self.pick[0]].reshape(h.shape[0], -1).sum(-1, keepdim=True)
        b = h[:, self.picks[0]].reshape(h.shape[0], -1).sum(-1, keepdim=True)
        return h * torch.sigmoid(a) * (1 + torch.sigmoid(b))        # (a row's scale: the loss sees it)


def test_an_item_of_a_list_attribute_changed_in_place_to_an_equal_value_of_another_type_retraces():
    def change(i, m):
        if i == 1:
            m.pick[0] = True            # == 1, but indexes otherwise
        if i == 2:
            m.picks[0] = True
        if i == 3:
            m.pick[0], m.picks[0] = 1, 1
    step, losses, ref_losses, ref = _run_both(_ce, change, steps=5, make=_Picks)
    assert rel_err(losses, ref_losses) <= 1e-6, (losses, ref_losses)
    assert_state_close(step.state_dict(), ref.state_dict(), rtol=1e-6)
    assert step._compiler.compiles == 3     # the first, True in the short list, True in both (then the first again)
