"""The native CPU kernels of compressed moments (pstar_fx.runtime.native): built here, bit for bit the torch ops'
codes, scales and dequantised values (zeros, tiny, huge, NaN and inf, tails, any chunk offset and step); the
one-pass update following torch's fused Adam with every option; used by the CPU worker's update; refused with a
reason where they cannot be built or trusted."""
import dataclasses
import shutil

import pytest
import torch

from pstar_fx.optim import ADAM_STATE, INT8_BLOCK, AdamConfig, StateDtype
from pstar_fx.runtime import native
from pstar_fx.runtime.adam import host_step
from pstar_fx.runtime.optimizers import host_update
from pstar_fx.runtime.quantize import Packed

HAVE_CC = shutil.which("cc") is not None
X86_FMA = ("AVX2", "AVX512")    # torch's CPU kernels for x86-64 processors with fused multiply-adds
needs_cc = pytest.mark.skipif(not HAVE_CC, reason="no C compiler on this machine: the torch ops serve")
CFG = AdamConfig(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, decoupled=True, maximize=False,
                 fused=None)


def _moments(n: int, gen_seed: int) -> dict[str, torch.Tensor]:
    """Moments over many orders of magnitude, with zeros, fp32's subnormals, the largest floats, NaN and inf."""
    g = torch.Generator().manual_seed(gen_seed)
    m = torch.randn(n, generator=g) * torch.logspace(-30, 30, n)[torch.randperm(n, generator=g)]
    v = torch.rand(n, generator=g) ** 4 * torch.logspace(-30, 30, n)[torch.randperm(n, generator=g)]
    m[::97] = 0
    v[::89] = 0
    m[3], v[4], m[5], v[6] = -1e-40, 1e-41, 3e38, 3e38
    if n > 2 * INT8_BLOCK:
        m[INT8_BLOCK + 1], v[INT8_BLOCK + 2] = float("nan"), float("inf")
        m[2 * INT8_BLOCK - 1] = -float("inf")
    return {"exp_avg": m, "exp_avg_sq": v}


def _written(dtype: StateDtype, values, use_native: bool, first: int, step: float, block: int | None = None):
    n = values["exp_avg"].numel()
    layout = ADAM_STATE.with_dtype(dtype)
    buf = torch.zeros(layout.floats(n, False))
    kw = {} if block is None else {"block": block}
    packed = Packed(layout.parts(buf, n, False), chunk=11, first=first, use_native=use_native, **kw)
    assert (packed.native is not None) == use_native
    packed.write(values, torch.tensor(step))
    return buf.view(torch.int32).clone(), packed.read()


@needs_cc
def test_the_kernels_build_and_load_here():
    assert native.kernels() is not None, native.why_not()
    assert native.why_not() is None


@needs_cc
@pytest.mark.parametrize("dtype", [StateDtype.BF16, StateDtype.INT8])
@pytest.mark.parametrize("n, first, step", [(5 * INT8_BLOCK + 37, 0, 1.0), (3000, 1 << 20, 7.0),
                                            (INT8_BLOCK, 123 * INT8_BLOCK, 12345.0), (70_001, 4096, 2.0),
                                            (1 << 21, 0, 3.0)])
def test_native_codes_and_values_are_the_torch_ops_bit_for_bit(dtype, n, first, step):
    """The large case has narrowly spread moments, where an op rounded differently (torch's CPU sqrt is not
    correctly rounded) changes a code now and then."""
    values = _moments(n, n + int(step)) if n < 100_000 else {
        "exp_avg": torch.randn(n, generator=torch.Generator().manual_seed(0)),
        "exp_avg_sq": torch.rand(n, generator=torch.Generator().manual_seed(1)) * 1e-3}
    block = 2048 if n < 100_000 else None
    want_buf, want = _written(dtype, values, False, first, step, block)
    got_buf, got = _written(dtype, values, True, first, step, block)
    assert torch.equal(got_buf, want_buf)
    for k in want:     # NaN compares by its bits
        assert torch.equal(got[k].view(torch.int32), want[k].view(torch.int32)), k
    assert torch.isnan(got["exp_avg"]).any() == (2 * INT8_BLOCK < n < 100_000)


def _three_updates(dtype: StateDtype, cfg: AdamConfig, half: torch.dtype | None, use_native: bool):
    """Three host updates of one chunk (bf16 / fp16 parameters with an fp32 master, or fp32 parameters), with an
    inverse loss scale and a clipping coefficient: the states, and the parameters."""
    n = 3 * 4096 + 300
    layout = ADAM_STATE.with_dtype(dtype)
    buf = torch.zeros(layout.floats(n, half is not None))
    parts = layout.parts(buf, n, half is not None)
    start = torch.randn(n, generator=torch.Generator().manual_seed(1))
    if half is None:
        param, master = start, None
    else:
        parts["master"].copy_(start)
        param, master = start.to(half), parts["master"]
    for i in range(3):
        grad = torch.randn(n, generator=torch.Generator().manual_seed(10 + i)).to(half or torch.float32)
        host_step(cfg, param, grad, None, None, parts["step"], master=master, inv_scale=0.5 if master is not None
                  else None, coef=torch.tensor(0.7),
                  packed=Packed(parts, 3, 256, block=4096, use_native=use_native))
    return parts, param


@needs_cc
@pytest.mark.parametrize("dtype", [StateDtype.BF16, StateDtype.INT8])
@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16, None])
@pytest.mark.parametrize("options", [{}, {"decoupled": False}, {"maximize": True}])
def test_the_native_update_follows_torchs_fused_adam(dtype, half, options):
    """adam.c's one-pass update against the torch route (the same quantisers around torch._fused_adam(w)_), three
    steps: the fp32 masters (or parameters) agree to fp32's last bits, the half-precision parameters are the
    masters rounded to nearest even, and all but a few codes are the same (a moment a few ulps apart can round to
    the other code)."""
    cfg = dataclasses.replace(CFG, **options)
    (got, got_param), (want, want_param) = (_three_updates(dtype, cfg, half, u) for u in (True, False))
    target = "master" if half is not None else None
    g, w = (got[target], want[target]) if target else (got_param, want_param)
    torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    assert (g - w).abs().max() > 0 or half is None      # not the same route twice (fp32 params may agree exactly)
    if half is not None:
        assert torch.equal(got_param, got["master"].to(half))
    for k in ("exp_avg", "exp_avg_sq"):
        assert (got[k] != want[k]).float().mean() < 1e-3, k
    assert got["step"].item() == want["step"].item() == 3
    read = Packed(got, 3, 256).read()
    assert read["exp_avg"].abs().max() > 0 and read["exp_avg_sq"].min() >= 0


@needs_cc
def test_host_update_uses_them(monkeypatch):
    """optimizers.host_update's compressed route makes one call of the native update for the whole chunk; with
    fused=False (torch.optim's formula op by op) the blocks go through the native conversions around it."""
    n = 1 << 16
    layout = ADAM_STATE.with_dtype(StateDtype.INT8)
    parts = layout.parts(torch.zeros(layout.floats(n, False)), n, False)
    seen = []

    class Spy:
        def __getattr__(self, name):
            seen.append(name)
            return getattr(kernels, name)

    kernels = native.kernels()
    monkeypatch.setattr(native, "kernels", Spy)
    host_update(CFG, torch.randn(n), torch.randn(n), parts, master=None, inv_scale=None, coef=None, skip=False)
    assert [name for name in seen if name != "takes"] == ["adam"]
    seen.clear()
    host_update(dataclasses.replace(CFG, fused=False), torch.randn(n), torch.randn(n), parts, master=None,
                inv_scale=None, coef=None, skip=False)
    assert seen.count("quant_int8") == seen.count("dequant_int8") >= 1 and "adam" not in seen


def _exact_update(cfg, half, n: int, steps: int, use_native: bool, monkeypatch, inv_scale=None, coef=None):
    """`steps` mixed-precision host updates of exact moments (adam.host_step with a master) on values over many
    magnitudes, zeros, NaN and infinities among them; use_native=False: the torch route (no kernels). The values
    after each step."""
    g = torch.Generator().manual_seed(5)
    master = torch.randn(n, generator=g) * torch.logspace(-6, 2, n)[torch.randperm(n, generator=g)]
    m, v, step = torch.zeros(n), torch.zeros(n), torch.tensor(0.0)
    param = master.to(half)
    with monkeypatch.context() as patch:
        if not use_native:
            patch.setattr(native, "kernels", lambda: None)
        out = []
        for i in range(steps):
            grad = (torch.randn(n, generator=g) * torch.logspace(-8, 1, n)[torch.randperm(n, generator=g)]).to(half)
            grad[i::7] = 0
            if i == 0:       # NaN and infinities in the gradient, the master and the moments
                grad[1], grad[2], master[3], m[4] = float("nan"), -float("inf"), float("inf"), float("nan")
            host_step(cfg, param, grad, m, v, step, master=master, inv_scale=inv_scale,
                      coef=None if coef is None else torch.tensor(coef))
            out.append([t.clone() for t in (master, m, v, param, grad)])
    return out


@needs_cc
@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("options", [{}, {"decoupled": False}, {"maximize": True}, {"weight_decay": 0.0},
                                     {"beta1": 0.3, "beta2": 0.999, "lr": 0.03}])
@pytest.mark.parametrize("n, scaled", [(3 * 4096, False), (70_001, True), (5, False)])
def test_the_exact_one_pass_update_is_torchs_fused_adam_bit_for_bit(monkeypatch, half, options, n, scaled):
    """Mixed precision with exact moments: the native one-pass update (its first n - n % 16 elements; torch's route
    the rest) gives the masters, moments and parameters of the torch route (gradient into fp32 scratch, torch's
    fused kernel, the master copied into the parameter) to the last bit, over three steps, unscaled and clipped as
    fp16 and max_grad_norm do, with the tail torch's scalar loop takes, and a chunk too small for the kernel. NaN
    stays NaN where torch's is, its sign bit aside (IEEE leaves it to the implementation, and compilers turn a
    multiplication by -1 into a negation or not)."""
    cfg = dataclasses.replace(CFG, **options)
    kw = {"inv_scale": 1 / 1024, "coef": 0.37} if scaled else {}
    ours = _exact_update(cfg, half, n, 3, True, monkeypatch, **kw)
    if n >= 16 and torch.backends.cpu.get_cpu_capability() in X86_FMA:     # where it was written for, it is taken
        assert native.kernels().verified[native.exact_kind(cfg, half, half)] is True
    theirs = _exact_update(cfg, half, n, 3, False, monkeypatch, **kw)
    for step, (a, b) in enumerate(zip(ours, theirs)):
        for name, x, y in zip(("master", "m", "v", "param", "grad"), a, b):
            nan = x.isnan()
            assert torch.equal(nan, y.isnan()), (step, name)
            x, y = x.masked_fill(nan, 0), y.masked_fill(nan, 0)      # (a NaN's sign bit: either)
            assert torch.equal(x.view(torch.int32 if x.dtype == torch.float32 else torch.int16),
                               y.view(torch.int32 if y.dtype == torch.float32 else torch.int16)), (step, name)
    assert not torch.equal(ours[0][0], ours[-1][0]) and ours[-1][1].nan_to_num().abs().max() > 0   # they changed


@needs_cc
def test_the_exact_update_runs_natively_only_where_it_reproduces_torch(monkeypatch):
    """host_step takes the native kernel for a mixed-precision update of exact moments (one call, 16-aligned), and
    not where native.reproduces_torch finds its bits differ from the torch route's (a torch built otherwise),
    nor with fused=False (torch.optim's formula), fp32 parameters or packed moments."""
    kernels = native.kernels()
    n = 4096 + 21
    _exact_update(CFG, torch.bfloat16, n, 1, True, monkeypatch)     # (the check, once per process, made here)
    calls = []
    real = native.Kernels.adam_exact
    monkeypatch.setattr(native.Kernels, "adam_exact", lambda self, *a, **k: (calls.append(a[2].numel()),
                                                                             real(self, *a, **k)))
    _exact_update(CFG, torch.bfloat16, n, 1, True, monkeypatch)
    assert calls == [4096 + 16]
    # a route that disagrees: the check says so, and is asked once per kind of update
    assert not native.reproduces_torch(dataclasses.replace(kernels, verified={}), CFG, torch.bfloat16,
                                       torch.bfloat16, lambda *args: None)
    monkeypatch.setitem(kernels.verified, native.exact_kind(CFG, torch.bfloat16, torch.bfloat16), False)
    calls.clear()
    _exact_update(CFG, torch.bfloat16, n, 1, True, monkeypatch)
    _exact_update(dataclasses.replace(CFG, fused=False, decoupled=False), torch.float16, n, 1, True, monkeypatch)
    assert calls == []


def test_they_are_refused_with_a_reason(monkeypatch, tmp_path):
    load = native._load.__wrapped__
    monkeypatch.setenv("PSTAR_FX_NATIVE", "0")
    assert load() == (None, "PSTAR_FX_NATIVE=0")
    monkeypatch.delenv("PSTAR_FX_NATIVE")
    monkeypatch.setenv("CC", "no-such-compiler-here")
    kernels, why = load()
    assert kernels is None and "no C compiler" in why and "set CC" in why
    monkeypatch.setenv("CC", "false")        # a compiler that fails
    monkeypatch.setenv("PSTAR_FX_CACHE", str(tmp_path / "cache"))
    kernels, why = load()
    assert kernels is None and "false failed" in why
    assert list((tmp_path / "cache" / "native").iterdir()) == []      # nothing half-built is left
    shared = tmp_path / "shared"
    (shared / "native").mkdir(parents=True)
    (shared / "native").chmod(0o777)
    monkeypatch.setenv("PSTAR_FX_CACHE", str(shared))
    monkeypatch.setenv("CC", "cc")
    kernels, why = load()
    assert kernels is None and "not private to this user" in why
