"""The public surface: arguments, their validation, Adam (L2) and AdamW options, the accounted device pool."""
import gc
import inspect
import weakref

import pytest
import torch
import torch.nn as nn

import pstar_fx as px
from pstar_fx.api.compiler import cycle_collection_paused
from pstar_fx.runtime.device_pool import DevicePool, PoolExhausted
from pstar_fx.units import format_bytes, parse_bytes

from models import CASES_BY_NAME, assert_state_close


@pytest.mark.parametrize("text,value", [("8GiB", 8 * 2**30), ("512MiB", 512 * 2**20), ("1.5GB", 1_500_000_000),
                                        ("4096", 4096), (" 2 kib ", 2048), (123, 123)])
def test_parse_bytes(text, value):
    assert parse_bytes(text) == value


@pytest.mark.parametrize("bad", ["abc", "8 GiBs", "-1GiB", 0, -5, True, 1.5, "0MiB"])
def test_parse_bytes_rejects(bad):
    with pytest.raises((ValueError, TypeError)):
        parse_bytes(bad)


@pytest.mark.parametrize("huge", [2 ** 64, "10000000TiB", "2000000000000000TB"])
def test_parse_bytes_refuses_more_than_any_machine_has(huge):
    """(It overflowed deep inside the planner, a 64-bit count, before.)"""
    with pytest.raises(ValueError, match="more than any machine has"):
        parse_bytes(huge)


def test_format_bytes():
    assert format_bytes(1536) == "1.50 KiB" and format_bytes(12) == "12 B" and format_bytes(3 * 2**30) == "3.00 GiB"


@pytest.mark.parametrize("kwargs,match", [(dict(amsgrad=True), "amsgrad"), (dict(lr=-1.0), "learning rate"),
                                          (dict(betas=(0.9, 1.0)), "betas"), (dict(eps=-1.0), "epsilon"),
                                          (dict(weight_decay=-0.1), "weight_decay"),
                                          (dict(foreach=True), "foreach"), (dict(capturable=True), "capturable"),
                                          (dict(lr=torch.tensor(0.1)), "tensor learning rates")])
def test_optimizer_arguments_are_checked(kwargs, match):
    with pytest.raises(ValueError, match=match):
        px.AdamW(**kwargs)


def test_optimizer_defaults_are_torchs():
    import inspect
    for ours, theirs in ((px.Adam, torch.optim.Adam), (px.AdamW, torch.optim.AdamW)):
        sig = inspect.signature(theirs).parameters
        spec = ours()
        for k in ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "foreach", "capturable",
                  "differentiable", "fused"):
            assert spec.defaults[k] == sig[k].default, k
        assert list(inspect.signature(ours).parameters)[:6] == list(sig)[:6]   # params first, as in torch


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(optimizer=torch.optim.AdamW), TypeError, "px.Adam"),
    (dict(device_memory="abc"), ValueError, "cannot read"),
    (dict(precision="fp8"), ValueError, "precision"),
    (dict(chunk_size=0), ValueError, "chunk_size"),
    (dict(device="mps"), ValueError, "device"),
])
def test_compile_arguments_are_checked(kwargs, exc, match):
    args = dict(optimizer=px.AdamW())
    args.update(kwargs)
    with pytest.raises(exc, match=match):
        px.compile(nn.Linear(2, 2), **args)(lambda m, x: m(x).sum())


def test_model_must_be_a_module():
    with pytest.raises(TypeError, match="nn.Module"):
        px.compile(lambda x: x, optimizer=px.AdamW())(lambda m, x: m(x).sum())


def test_adam_with_l2_weight_decay_and_maximize_match_torch():
    case = CASES_BY_NAME["mlp_ce"]
    hyper = dict(lr=1e-3, betas=(0.8, 0.99), eps=1e-7, weight_decay=0.05)
    for maximize in (False, True):
        model = case.build_model()
        opt = torch.optim.Adam(model.parameters(), **hyper, maximize=maximize, fused=True)
        ref = []
        for i in range(4):
            loss = case.loss_fn(model, *case.batch(i))
            loss.backward()
            opt.step()
            opt.zero_grad()
            ref.append(loss.item())
        step = px.compile(case.build_model(), optimizer=px.Adam(**hyper, maximize=maximize), device="cpu")(
            case.loss_fn)
        got = [step(*case.batch(i)).item() for i in range(4)]
        assert got == ref
        assert_state_close(step.state_dict(), model.state_dict(), rtol=1e-6)


def test_device_pool_refuses_past_its_budget():
    pool = DevicePool(torch.device("cpu"), budget=1000)
    a = pool.take(200, torch.float32)            # 800 bytes
    with pytest.raises(PoolExhausted, match="past the budget"):
        pool.take(100, torch.float32)
    with pytest.raises(PoolExhausted, match="chunk 7 param buffer of 400 B"):   # a callable is formatted only here
        pool.take(100, torch.float32, what=lambda: "chunk 7 param buffer")
    with pytest.raises(PoolExhausted, match="chunk 3 grad buffer"):
        pool.lend(torch.ones(100), what=lambda: "chunk 3 grad buffer")
    assert pool.in_use == 800, "a refused take or lend counts nothing"
    import weakref
    ref = weakref.ref(a)
    pool.give(a)
    del a
    assert pool.in_use == 0 and pool.cached == 800 and ref() is not None, "a slot given back is free-listed"
    pool.take(250, torch.float32)                # the whole budget is available again: the free list gives way
    assert pool.cached == 0 and ref() is None, "what the pool holds stays within its budget"


def test_device_pool_reuses_a_given_back_buffer_of_the_same_size_and_trims_to_a_bound():
    pool = DevicePool(torch.device("cpu"), budget=None)
    a = pool.take(64, torch.float32)
    ptr = a.data_ptr()
    pool.give(a)
    b = pool.take(64, torch.float32)
    assert b.data_ptr() == ptr and pool.in_use == 256 and pool.cached == 0
    c = pool.take(32, torch.bfloat16)
    pool.give(b)
    pool.give(c)
    assert pool.cached == 256 + 64 and pool.in_use == 0
    pool.trim(100)                               # the size with the most bytes cached goes first
    assert pool.cached == 64 and list(pool.free) == [(32, torch.bfloat16)]
    pool.trim(0)
    assert pool.cached == 0 and not pool.free


def test_step_before_compile_and_state_dict_before_step():
    model = nn.Linear(3, 1)
    step = px.compile(model, optimizer=px.AdamW(), device="cpu")(lambda m, x: m(x).sum())
    with pytest.raises(RuntimeError, match="nothing is compiled yet"):
        step.graphs
    sd = step.state_dict()
    assert torch.equal(sd["weight"], model.weight.detach())


def test_loss_that_does_not_depend_on_parameters_is_rejected():
    step = px.compile(nn.Linear(3, 1), optimizer=px.AdamW(lr=0.1), device="cpu")(lambda m, x: (x * 2).sum())
    with pytest.raises(px.UntraceableError, match="does not depend on any trainable parameter"):
        step(torch.randn(4, 3))


def test_model_without_parameters_is_rejected_as_torch_optim_does():
    with pytest.raises(ValueError, match="empty parameter list"):
        px.compile(nn.Identity(), optimizer=px.AdamW(lr=0.1), device="cpu")(lambda m, x: (x * 2).sum())


@pytest.mark.parametrize("kwargs", [dict(betas=0.9), dict(eps=None), dict(weight_decay="0.1"), dict(fused="yes")])
def test_optimizer_argument_types_are_checked(kwargs):
    with pytest.raises(ValueError, match="px.AdamW"):
        px.AdamW(**kwargs)


@pytest.mark.parametrize("kwargs", [dict(chunk_size=True), dict(prefetch=-1), dict(prefetch=1.5)])
def test_compile_integer_settings_are_checked(kwargs):
    with pytest.raises(ValueError):
        px.compile(nn.Linear(2, 2), optimizer=px.AdamW(), **kwargs)(lambda m, x: m(x).sum())


def test_a_failing_step_names_the_node_and_leaves_the_step_usable():
    """Integer inputs into a Linear trace (fake kernels do not check dtypes) but fail when run."""
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    line = inspect.currentframe().f_lineno + 1
    step = px.compile(model, optimizer=px.AdamW(), device="cpu", device_memory="1MiB")(lambda m, x: m(x).sum())
    with pytest.raises(RuntimeError, match="failed at node") as e:
        step(torch.ones(4, 3, dtype=torch.long))
    assert f'test_api.py", line {line}' in str(e.value)       # the user's source line of the failing node
    assert step._compiler.store.pool.in_use == step.graphs["scheduled"].plan.static_bytes   # nothing left on the device
    assert step(torch.randn(4, 3)).dim() == 0


def test_model_on_the_meta_device_is_rejected_clearly():
    with torch.device("meta"):
        model = nn.Linear(3, 2)
    step = px.compile(model, optimizer=px.AdamW(), device="cpu")(lambda m, x: m(x).sum())
    with pytest.raises(ValueError, match="meta device"):
        step(torch.randn(4, 3))


class _Cycle:
    def __init__(self):
        self.me = self


def test_the_compile_collects_cycles_when_asked_and_leaves_a_disabled_collector_alone():
    """cycle_collection_paused (around every compile): no automatic collection inside; collect_now() collects the
    cycles made so far (the compile calls it before the store waits for host memory); a collector the caller had
    turned off is neither collected nor turned on."""
    with cycle_collection_paused() as collect_now:
        assert not gc.isenabled()
        dropped = weakref.ref(_Cycle())
        assert dropped() is not None                 # a cycle: only the collector frees it
        collect_now()
        assert dropped() is None
    assert gc.isenabled()
    gc.disable()
    try:
        with cycle_collection_paused() as collect_now:
            kept = weakref.ref(_Cycle())
            collect_now()
            assert kept() is not None
        assert not gc.isenabled() and kept() is not None
    finally:
        gc.enable()
        gc.collect()


@pytest.mark.parametrize("dtype, fix", [(torch.float64, r"model.float\(\)"), (torch.int64, "register_buffer"),
                                        (torch.complex64, "view_as_real")])
def test_a_parameter_chunks_cannot_hold_exactly_is_refused_by_name(dtype, fix):
    """A float64, integer or complex parameter would be rounded or converted in fp32 chunks (and in the model after
    sync_model): refused at compile time, naming it, and the model is untouched."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 2))
    model.odd = torch.nn.Parameter(torch.tensor([16777217, 3], dtype=dtype), requires_grad=False)
    before = model.odd.detach().clone()
    with pytest.raises(TypeError, match=rf"parameter 'odd' is {dtype}: .*{fix}"):
        px.compile(model, optimizer=px.AdamW(lr=1e-3), device="cpu")(lambda m, x: m(x).sum())
    with pytest.raises(TypeError, match="parameter 'odd'"):
        px.compile(model, optimizer=None, device="cpu")(lambda m, x: m(x).sum())
    assert torch.equal(model.odd, before) and model.odd.dtype == dtype
    held = (before.real if dtype.is_complex else before).to(torch.bfloat16 if dtype.is_floating_point else torch.float32)
    model.odd = torch.nn.Parameter(held, requires_grad=False)
    px.compile(model, optimizer=px.AdamW(lr=1e-3), device="cpu")(lambda m, x: m(x).sum())   # held exactly: taken


def test_options_and_the_decorated_function_are_checked_by_name():
    model = torch.nn.Linear(4, 2)
    with pytest.raises(ValueError, match=r"device must be 'cuda', 'cuda:N', 'cpu' .* got 'gpu'"):
        px.compile(model, optimizer=px.AdamW(lr=1e-3), device="gpu")(lambda m, x: m(x).sum())
    with pytest.raises(ValueError, match="debug must be True or False, got 'yes'"):
        px.compile(model, optimizer=px.AdamW(lr=1e-3), device="cpu", debug="yes")(lambda m, x: m(x).sum())
    with pytest.raises(TypeError, match=r"decorates the step function, fn\(model, \*batch\); got int 5"):
        px.compile(model, optimizer=px.AdamW(lr=1e-3), device="cpu")(5)


def test_a_step_called_from_inside_its_own_function_is_refused_at_that_line():
    model = torch.nn.Linear(4, 2)
    step = None

    def fn(m, x):
        step(x)                  # the step calling itself
        return m(x).sum()
    step = px.compile(model, optimizer=px.AdamW(lr=1e-3), device="cpu")(fn)
    with pytest.raises(px.UntraceableError, match=r"called from inside a call of itself.*test_api.py.*step\(x\)"):
        step(torch.randn(3, 4))
    step._fn = step._compiler.fn = lambda m, x: m(x).sum()     # (the step works again once fn stops calling it)
    assert torch.isfinite(step(torch.randn(3, 4)))


def test_a_step_called_from_inside_another_steps_function_is_refused_at_that_line():
    model = torch.nn.Linear(4, 2)
    inner = px.compile(model, optimizer=px.AdamW(lr=1e-3), device="cpu")(lambda m, x: m(x).sum())
    evaluate = px.compile(model, optimizer=None, device="cpu")(lambda m, x: m(x))

    def calls_inner(m, x):
        return inner(x)
    outer = px.compile(model, optimizer=px.AdamW(lr=1e-3), device="cpu")(calls_inner)
    with pytest.raises(px.UntraceableError, match=r"called while a trace runs.*cannot run inside another step.*"
                                                   r"test_api.py.*return inner\(x\)"):
        outer(torch.randn(3, 4))
    with pytest.raises(px.PstarError, match="called while a trace runs"):
        evaluate(torch._subclasses.fake_tensor.FakeTensorMode().from_tensor(torch.randn(3, 4)))
    before = [p.detach().clone() for p in model.parameters()]
    assert torch.isfinite(inner(torch.randn(3, 4)))           # the inner step was never run by the failed trace
    assert any(not torch.equal(a, b) for a, b in zip(before, inner.state_dict().values()))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("how", ["method", "attribute"])
def test_requires_grad_set_inside_the_step_is_refused_naming_the_parameter_and_line(how, precision):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    model[1].bias.requires_grad_(False)

    def fn(m, x):
        if how == "method":
            m[0].weight.requires_grad_(False)
        else:
            m[1].bias.requires_grad = True
        m[0].bias.requires_grad_(True)          # (unchanged: allowed)
        return m(x).pow(2).mean()
    step = px.compile(model, optimizer=px.AdamW(lr=1e-3), device="cpu", precision=precision)(fn)
    name, flag = ("0.weight", False) if how == "method" else ("1.bias", True)
    with pytest.raises(px.UntraceableError, match=rf"sets requires_grad={flag} on {name} at .*test_api.py.*"
                                                   r"Set it before the first step"):
        step(torch.randn(3, 4))
    assert model[0].weight.requires_grad and not model[1].bias.requires_grad     # the model as it was


def test_a_model_accelerate_dispatched_with_offloaded_weights_is_refused_at_compile():
    """accelerate's device_map offload leaves meta placeholders behind hooks, which no trace can follow: refused
    before tracing, naming a tensor and saying how to load the model instead. Without the hooks, a model with real
    values compiles as ever."""
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    model.hf_device_map = {"0": "disk", "1": "cpu"}            # what from_pretrained(device_map=...) sets
    for opt in (px.AdamW(lr=1e-3), None):
        with pytest.raises(ValueError, match=r"dispatched by accelerate with offloaded weights \(4 tensors on the "
                                             r"meta device .* such as '0.weight'\).*without device_map"):
            px.compile(model, optimizer=opt, device="cpu")(lambda m, x: m(x).sum())
    real = torch.nn.Linear(4, 1)
    real.hf_device_map = {"": "cpu"}                           # dispatched whole onto the CPU: nothing offloaded
    step = px.compile(real, optimizer=px.AdamW(lr=1e-3), device="cpu")(lambda m, x: m(x).pow(2).sum())
    assert torch.isfinite(step(torch.randn(3, 4)))


def test_an_empty_batch_names_the_empty_tensor_and_the_backward():
    step = px.compile(torch.nn.Linear(4, 2), optimizer=px.AdamW(lr=1e-3), device="cpu")(
        lambda m, x, y: torch.nn.functional.mse_loss(m(x), y))
    with pytest.raises(px.UntraceableError, match=r"batch tensor 0 is empty, of shape \(0, 4\).*in the backward"):
        step(torch.randn(0, 4), torch.randn(0, 2))


def test_whose_source_a_frame_is_is_memoised_and_generated_code_is_not_the_users():
    from pstar_fx.ir import fx_utils
    assert hasattr(fx_utils.is_user_file, "cache_info") and not hasattr(fx_utils.has_node, "cache_info")
    assert not fx_utils.is_user_file("<string>") and not fx_utils.is_user_file("<eval_with_key>.3")
    assert fx_utils.is_user_file(__file__) and not fx_utils.is_user_file(fx_utils.__file__)


def test_the_steps_methods_name_a_wrong_argument():
    """A stage the step has not, a state dict that is not a mapping, a checkpoint path that is not a path, a save
    flag that is not a bool: each a clear error naming it (a bare KeyError or os.fspath's TypeError before)."""
    model = torch.nn.Linear(8, 4)
    step = px.compile(model, optimizer=px.AdamW(lr=1e-3), device="cpu")(
        lambda m, x, y: torch.nn.functional.cross_entropy(m(x), y))
    step(torch.randn(4, 8), torch.randint(0, 4, (4,)))
    with pytest.raises(KeyError, match="no stage 'nope': this step's stages are 'traced', 'canonical'"):
        step.graphs["nope"]
    assert list(step.graphs)[-1] == "scheduled" and step.graphs["traced"] is not None
    with pytest.raises(TypeError, match="load_state_dict takes a state dict .* not int"):
        step.load_state_dict(5)
    with pytest.raises(TypeError, match="must be a str or os.PathLike, not NoneType"):
        step.save(None)
    with pytest.raises(TypeError, match="sharded must be None, True or False"):
        step.save("unused", sharded="yes")
