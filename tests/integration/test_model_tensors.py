"""What a step does with the model's tensors beyond reading them, as eager PyTorch does.

A step that rebinds a buffer (`self.count = self.count + 1`, a new tensor rather than an in-place write) trains what
eager PyTorch trains: the new value is the buffer's from then on (state_dict, sync_model, the next step), with
gradient accumulation and in evaluation too. A rebinding pstar-fx cannot hold (a parameter, or a buffer rebound to
another shape or dtype) is refused with the name, never dropped. Gradient hooks on parameters (`register_hook`)
shape the gradients as in eager backward; adding or removing one retraces; a post-accumulate-grad hook is refused."""
import copy
import functools
import gc
import types
import warnings

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


class Hooked(nn.Module):
    """Rows of a weight whose gradient a hook masks (training some rows only), a scaled bias gradient."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 8)
        self.b = nn.Linear(8, 3)
        self.register_buffer("mask", torch.zeros(8, 1))   # (a buffer: a real tensor closed over is refused)
        self.mask[::2] = 1
        self.a.weight.register_hook(lambda g: g * self.mask)
        self.a.bias.register_hook(lambda g: g * 0.25)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


@pytest.mark.parametrize("accumulate", [1, 2])
def test_gradient_hooks_shape_the_gradients_as_in_eager(accumulate):
    torch.manual_seed(0)
    eager = Hooked()
    torch.manual_seed(0)
    model = Hooked()          # (copy.deepcopy drops tensor hooks: built the same way instead)
    opt = torch.optim.AdamW(eager.parameters(), lr=1e-2, weight_decay=0.0)    # (masked rows then stay put)
    step = px.compile(model, optimizer=px.AdamW(lr=1e-2, weight_decay=0.0), device="cpu", accumulate=accumulate,
                      max_grad_norm=1.0)(_loss)
    w0 = model.a.weight.detach().clone()
    for x, y in _batches(3):
        for xs, ys in zip(x.chunk(accumulate), y.chunk(accumulate)):
            (_loss(eager, xs, ys) / accumulate).backward()
        torch.nn.utils.clip_grad_norm_(eager.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        step(x, y)
    sd = step.state_dict()
    for k, v in eager.state_dict().items():
        torch.testing.assert_close(sd[k], v, rtol=1e-6, atol=1e-7, msg=k)
    assert torch.equal(sd["a.weight"][1::2], w0[1::2]) and not torch.equal(sd["a.weight"][::2], w0[::2])


def test_adding_or_removing_a_gradient_hook_retraces():
    torch.manual_seed(0)
    model = Counting()
    step = px.compile(model, optimizer=px.SGD(lr=0.1), device="cpu")(_loss)
    x, y = _batches(1)[0]
    step(x, y)
    before = step.state_dict()["lin.weight"]
    handle = model.lin.weight.register_hook(lambda g: g * 0)
    step(x, y)
    assert torch.equal(step.state_dict()["lin.weight"], before), "the hook zeroed the weight's gradient"
    handle.remove()
    step(x, y)
    assert not torch.equal(step.state_dict()["lin.weight"], before)


def test_a_post_accumulate_grad_hook_is_refused_by_name():
    model = nn.Linear(6, 3)
    model.weight.register_post_accumulate_grad_hook(lambda p: p.grad.zero_())
    step = px.compile(model, optimizer=px.SGD(lr=0.1), device="cpu")(lambda m, x, y: F.mse_loss(m(x), y))
    with pytest.raises(px.UntraceableError, match="parameter 'weight' has a post-accumulate-grad hook"):
        step(*_batches(1)[0])


def test_a_post_accumulate_grad_hook_added_after_a_step_is_refused_at_the_next():
    model = nn.Linear(6, 3)
    step = px.compile(model, optimizer=px.SGD(lr=0.1), device="cpu")(lambda m, x, y: F.mse_loss(m(x), y))
    step(*_batches(1)[0])
    model.weight.register_post_accumulate_grad_hook(lambda p: None)
    with pytest.raises(px.UntraceableError, match="parameter 'weight' has a post-accumulate-grad hook"):
        step(*_batches(1)[0])


def test_a_forward_set_on_the_instance_after_a_step_retraces():
    """A wrapper replacing a module's forward on the instance (as accelerate's do): the step computes what eager
    computes with it, and again without it once it is deleted."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 3))
    eager = copy.deepcopy(model)
    step = px.compile(model, optimizer=px.SGD(lr=0.0), device="cpu")(_loss)
    x, y = _batches(1)[0]
    plain = step(x, y).item()
    for m in (model, eager):
        m[0].forward = types.MethodType(lambda self, t: 3 * nn.Linear.forward(self, t), m[0])
    assert step(x, y).item() == pytest.approx(_loss(eager, x, y).item(), rel=1e-6) != plain
    del model[0].forward
    assert step(x, y).item() == plain and step._compiler.compiles == 2


def test_a_forward_hook_registered_after_a_step_retraces():
    torch.manual_seed(0)
    model = Counting()
    eager = copy.deepcopy(model)
    step = px.compile(model, optimizer=px.SGD(lr=0.1), device="cpu")(_loss)
    x, y = _batches(1)[0]
    step(x, y)
    _loss(eager, x, y).backward()
    with torch.no_grad():
        for p in eager.parameters():
            p -= 0.1 * p.grad
    eager.zero_grad()

    def double(module, args, out):
        return out * 2
    handle = model.lin.register_forward_hook(double)
    eager.lin.register_forward_hook(double)
    assert step(x, y).item() == pytest.approx(_loss(eager, x, y).item(), rel=1e-6), "the hook is in the step"
    handle.remove()
    assert step._compiler.compiles == 2      # (traced again for the hook; the hook's removal finds the first trace)
    step(x, y)
    assert step._compiler.compiles == 2


def _scaled(k):
    return lambda module, args, out: out * k


def _grad_scaled(k):
    return lambda g: g * k


def _eager_sgd(model, x, y):
    """One eager step of SGD (lr 0.1, as the compiled steps below); returns its loss."""
    loss = _loss(model, x, y)
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.1 * p.grad
    model.zero_grad()
    return loss


def test_a_hook_replaced_by_another_at_the_freed_address_retraces():
    """A hook removed and another registered: CPython may give the new function the old one's address (a lambda of
    one factory, as here, mostly does: the old graph once served the new hook), so the step keys hooks by their
    handle's number, which torch never gives twice. Forward and gradient hooks, each step equal to eager's (fp32,
    CPU); and the key told apart even for the same function object registered again, which is what a new function
    at the old address looks like by id()."""
    torch.manual_seed(0)
    model = Counting()
    eager = copy.deepcopy(model)
    step = px.compile(model, optimizer=px.SGD(lr=0.1), device="cpu")(_loss)
    mine, theirs = (), ()
    for i, (x, y) in enumerate(_batches(6)):
        k = float(i + 2)
        for h in mine:
            h.remove()
        gc.collect()        # (the functions freed, the new ones made next)
        mine = (model.lin.register_forward_hook(_scaled(k)), model.lin.weight.register_hook(_grad_scaled(k / 4)))
        for h in theirs:
            h.remove()
        theirs = (eager.lin.register_forward_hook(_scaled(k)), eager.lin.weight.register_hook(_grad_scaled(k / 4)))
        want = _eager_sgd(eager, x, y)
        assert step(x, y).item() == pytest.approx(want.item(), rel=1e-6), i
    sd = step.state_dict()
    for name, v in eager.state_dict().items():
        torch.testing.assert_close(sd[name], v, rtol=1e-5, atol=1e-6, msg=name)
    assert step._compiler.compiles == 6
    fn, g = model.lin._forward_hooks[mine[0].id], model.lin.weight._backward_hooks[mine[1].id]
    before = step._compiler.model_key()
    for h in mine:
        h.remove()
    model.lin.register_forward_hook(fn)
    model.lin.weight.register_hook(g)
    assert step._compiler.model_key() != before     # (what another function at the old address looks like by id)


def test_hooks_registered_before_each_step_retrace_at_each_step_as_eager_and_are_warned_of():
    """A training loop that registers its hooks (made afresh by a factory, and a bound method) before each step and
    removes them after: each registration is another hook (its values are fixed at the trace), so each step traces,
    equal to eager's, and after 4 such compiles a warning says where the hooks changed and to register them once."""
    torch.manual_seed(0)
    model = Counting()
    eager = copy.deepcopy(model)
    step = px.compile(model, optimizer=px.SGD(lr=0.1), device="cpu")(_loss)

    class Scale:
        def __init__(self, k):
            self.k = k

        def hook(self, module, args, out):
            return out * self.k

    scale = Scale(1.5)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for i, (x, y) in enumerate(_batches(5)):
            k = 2.0 if i < 3 else 3.0
            got = None
            for m in (model, eager):
                handles = (m.lin.register_forward_hook(_scaled(k)), m.lin.weight.register_hook(_grad_scaled(k / 4)),
                           m.lin.register_forward_hook(scale.hook, always_call=True))
                if m is model:
                    got = step(x, y)
                else:
                    want = _eager_sgd(eager, x, y)
                for h in handles:
                    h.remove()
            assert got.item() == pytest.approx(want.item(), rel=1e-6), i
    assert step._compiler.compiles == 5
    said = [str(w.message) for w in seen if "compiled again" in str(w.message)]
    assert len(said) == 1 and "lin's forward hooks: 2 -> 2, another hook" in said[0] \
        and "Register hooks once" in said[0], said
    sd = step.state_dict()
    for name, v in eager.state_dict().items():
        torch.testing.assert_close(sd[name], v, rtol=1e-5, atol=1e-6, msg=name)


def test_what_ranks_compare_of_hooks_is_the_same_on_every_rank():
    """Hooks are part of the trace's key by their handles, but the ranks (processes of their own) compare their
    number."""
    keys = []
    for k in (2.0, 3.0):
        torch.manual_seed(0)
        model = Counting()
        model.lin.register_forward_hook(_scaled(k))
        model.lin.weight.register_hook(_grad_scaled(k / 4))
        step = px.compile(model, optimizer=px.SGD(lr=0.1), device="cpu")(_loss)
        keys.append((step._compiler.model_key(), step._compiler.model_key(portable=True)))
    assert keys[0][0] != keys[1][0] and keys[0][1] == keys[1][1]


@functools.lru_cache(maxsize=4)
def _centers(n: int) -> torch.Tensor:
    """A module-level cached function (DINOv3's patch centers)."""
    return torch.linspace(-1, 1, n)


class _CachedPositions(nn.Module):
    """A relative-position bias whose index a method caches for the life of the process (functools.lru_cache on the
    method, as transformers' BEiT and DINOv3 do)."""

    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.randn(9, 2))
        self.proj = nn.Linear(2, 2)

    @functools.lru_cache(maxsize=4)
    def index(self, n: int) -> torch.Tensor:
        pos = torch.arange(n)
        return (pos[:, None] - pos[None, :]) + n - 1

    def forward(self, x):                                     # x: (B, n, 2)
        bias = self.table[self.index(x.shape[1])]             # (n, n, 2)
        return self.proj(x + bias.mean(1) * _centers(x.shape[1])[:, None])


@pytest.mark.parametrize("order", ["eager_first", "compile_first"])
def test_a_method_cache_neither_feeds_the_trace_nor_keeps_what_it_traced(order):
    """Filled by an eager forward, the cache would hand the trace a real tensor; filled by the trace, it would keep a
    fake one that the next eager forward fails on. The trace empties it before and after: both orders train as eager
    and eager code still runs after."""
    torch.manual_seed(0)
    model = _CachedPositions()
    ref = copy.deepcopy(model)
    x = torch.randn(3, 5, 2)

    def loss(m, x):
        return m(x).square().mean()
    if order == "eager_first":
        loss(copy.deepcopy(model), x)
        assert _CachedPositions.index.cache_info().currsize > 0 and _centers.cache_info().currsize > 0
    step = px.compile(model, optimizer=px.AdamW(lr=1e-2), device="cpu")(loss)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    for i in range(2):
        got = step(x)
        if i == 0:                                            # traced: nothing of the trace kept
            assert _CachedPositions.index.cache_info().currsize == _centers.cache_info().currsize == 0
        want = loss(ref, x)
        want.backward()
        opt.step()
        opt.zero_grad()
        assert torch.equal(got, want.detach())
    assert torch.equal(loss(step.sync_model(), x), loss(ref, x))   # eager code runs after, on real values


HOOK_SCALE = 1.0


def _global_scaled(module, args, out):
    return out * HOOK_SCALE


class _Gain:
    def __init__(self):
        self.k, self.table = 1.0, {"k": [1.0]}

    def hook(self, module, args, out):
        return out * self.k

    def nested(self, module, args, out):
        return out * self.table["k"][0]


@pytest.mark.parametrize("reads", ["global", "bound_method_attribute", "nested_container", "global_full_flag"])
def test_a_hook_registered_again_after_what_it_reads_changed_retraces(reads):
    """A hook registered again before each step after a value it reads changed (a global, its object's attribute, an
    item of a nested container), or registered as an old-style and then as a full global backward hook: another
    hook, so each step traces and equals eager's (what a key by the function's code and values got wrong)."""
    global HOOK_SCALE
    torch.manual_seed(0)
    model = Counting()
    eager = copy.deepcopy(model)
    step = px.compile(model, optimizer=px.SGD(lr=0.1), device="cpu")(_loss)
    gain = _Gain()
    module_hooks = torch.nn.modules.module

    def full_bw(module, grad_in, grad_out):
        return tuple(None if g is None else g * 3.0 for g in grad_in) if isinstance(module, nn.Linear) else None

    def register(m, i):
        if reads == "global":
            return [m.lin.register_forward_hook(_global_scaled)]
        if reads == "bound_method_attribute":
            return [m.lin.register_forward_hook(gain.hook)]
        if reads == "nested_container":
            return [m.lin.register_forward_hook(gain.nested)]
        full = i % 2 == 1
        return [(module_hooks.register_module_full_backward_hook if full else
                 module_hooks.register_module_backward_hook)(full_bw)]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")          # (torch's warning for an old-style backward hook)
            for i, (x, y) in enumerate(_batches(4)):
                HOOK_SCALE = gain.k = gain.table["k"][0] = 1.0 + i
                results = []
                for m in (model, eager):
                    handles = register(m, i)
                    results.append(step(x, y).item() if m is model else _eager_sgd(eager, x, y).item())
                    for h in handles:
                        h.remove()
                    module_hooks._global_is_full_backward_hook = None
                assert results[0] == pytest.approx(results[1], rel=1e-6), (i, results)
    finally:
        HOOK_SCALE = 1.0
    assert step._compiler.compiles == 4


@pytest.mark.parametrize("reads", ["global", "closure"])
def test_a_hook_registered_once_retraces_when_a_plain_value_it_reads_changes(reads):
    """A forward hook registered once that reads a global or an item of a dict it closes over, changed between
    steps: keyed by value beside its handle, as the step function's reads are, so the step traces again and equals
    eager's."""
    global HOOK_SCALE
    torch.manual_seed(0)
    model = Counting()
    eager = copy.deepcopy(model)
    state = {"k": 1.0}
    step = px.compile(model, optimizer=px.SGD(lr=0.1), device="cpu")(_loss)
    for m in (model, eager):
        m.lin.register_forward_hook(_global_scaled if reads == "global" else
                                    (lambda module, args, out: out * state["k"]))
    try:
        for i, (x, y) in enumerate(_batches(4)):
            HOOK_SCALE = state["k"] = [1.0, 1.0, 0.5, 2.0][i]
            want = _eager_sgd(eager, x, y)
            assert step(x, y).item() == pytest.approx(want.item(), rel=1e-6), i
    finally:
        HOOK_SCALE = 1.0
    assert step._compiler.compiles == 3
