"""The compiled quantisers of compressed moments (pstar_fx.runtime.quantize_compiled): the CPU worker's update
through them writes the codes the op-by-op quantisers write, bit for bit, over block sizes, tails, huge, tiny, zero,
NaN and inf values; without a compiler the update goes on op by op with one warning and the same values."""
import warnings

import pytest
import torch

from pstar_fx.optim import ADAM_STATE, INT8_BLOCK, AdamConfig, StateDtype
from pstar_fx.runtime.optimizers import host_update
from pstar_fx.runtime.quantize import Packed
from pstar_fx.runtime.quantize_compiled import CompiledCodecs

CFG = AdamConfig(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, decoupled=True, maximize=False,
                 fused=None)


def _moments(n: int, seed: int) -> dict[str, torch.Tensor]:
    """Moments over many orders of magnitude, with zeros, fp32 subnormals, a huge value, NaN and inf."""
    g = torch.Generator().manual_seed(seed)
    m = torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * 6)
    v = torch.rand(n, generator=g) ** 4 * torch.exp(torch.randn(n, generator=g) * 6)
    m[::97], v[::89] = 0.0, 0.0
    m[5], v[7] = 1e-40, 3e-42
    if n > 3000:
        m[2000], v[2500], m[2700] = float("nan"), float("inf"), 3e38
    return {"exp_avg": m, "exp_avg_sq": v}


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bits, NaN's sign and payload aside."""
    if a.dtype == torch.float32:
        return bool(((a.view(torch.int32) == b.view(torch.int32)) | (a.isnan() & b.isnan())).all())
    return torch.equal(a, b)


@pytest.fixture(scope="module")
def codecs():
    c = CompiledCodecs()
    c.warm()
    return c


@pytest.mark.parametrize("dtype", [StateDtype.BF16, StateDtype.INT8])
@pytest.mark.parametrize("n", [77, 4 * INT8_BLOCK, 4 * INT8_BLOCK + 100, (1 << 14) + 300])
def test_compiled_codes_are_the_op_by_op_codes(codecs, dtype, n):
    """Quantising (two step counts: other random bits) and dequantising, in blocks of 4096 elements (a shard
    starting at element 12345 of its chunk), give the op-by-op quantisers' bits."""
    layout = ADAM_STATE.with_dtype(dtype)
    results = []
    calls = codecs.calls
    for c in (None, codecs):
        buf = torch.zeros(layout.floats(n, True))
        pk = Packed(layout.parts(buf, n, True), 5, 12345, block=16 * INT8_BLOCK, codecs=c)
        out = []
        for step in (3.0, 4.0):
            pk.write(_moments(n, int(step)), torch.tensor(step))
            got = pk.read()
            out += [buf.view(torch.uint8).clone(), got["exp_avg"], got["exp_avg_sq"]]
        results.append(out)
    whole = dtype is StateDtype.BF16 or n >= INT8_BLOCK          # int8 compiles whole blocks only
    assert (codecs.calls > calls) == whole and not codecs.failed
    for i, (a, b) in enumerate(zip(*results)):
        assert _same(a, b), (dtype, n, i)


@pytest.mark.parametrize("dtype", [StateDtype.BF16, StateDtype.INT8])
def test_the_cpu_workers_update_through_compiled_codes_is_the_op_by_op_update(codecs, dtype):
    """host_update (mixed precision: bf16 parameters and gradient, fp32 master), three steps, with and without the
    compiled quantisers: the same parameters, masters and codes."""
    n = 3 * 4096 + 300
    layout = ADAM_STATE.with_dtype(dtype)
    g = torch.Generator().manual_seed(1)
    master0 = torch.randn(n, generator=g)
    grads = [torch.randn(n, generator=g).to(torch.bfloat16) for _ in range(3)]
    results = []
    for c in (None, codecs):
        buf = torch.zeros(layout.floats(n, True))
        parts = layout.parts(buf, n, True)
        parts["master"].copy_(master0)
        param = master0.to(torch.bfloat16)
        for grad in grads:
            host_update(CFG, param, grad, parts, master=parts["master"], inv_scale=None, coef=None, skip=False,
                        chunk=3, first=0, codecs=c, packed_block=4096)
        results.append((param, buf.view(torch.uint8)))
    assert torch.equal(results[0][0], results[1][0])
    assert torch.equal(results[0][1], results[1][1])
    assert not torch.equal(results[0][0], master0.to(torch.bfloat16))     # it did update


def test_without_a_compiler_the_update_goes_op_by_op_with_one_warning():
    def no_compiler(fn, **kw):
        def fail(*args):
            raise RuntimeError("no C++ compiler")
        return fail

    broken = CompiledCodecs(compile=no_compiler)
    with pytest.warns(UserWarning, match=r"compiled CPU kernels are unavailable \(RuntimeError: no C\+\+ compiler"):
        broken.warm()
    with warnings.catch_warnings():
        warnings.simplefilter("error")           # once only
        broken.warm()
    layout = ADAM_STATE.with_dtype(StateDtype.INT8)
    n = 8 * INT8_BLOCK
    bufs = []
    for c in (None, broken, broken):
        buf = torch.zeros(layout.floats(n, False))
        pk = Packed(layout.parts(buf, n, False), 2, block=4 * INT8_BLOCK, codecs=c)
        pk.write(_moments(n, 0), torch.tensor(1.0))
        bufs.append(buf.view(torch.uint8))
    assert broken.failed and broken.calls == 0
    assert torch.equal(bufs[0], bufs[1]) and torch.equal(bufs[0], bufs[2])
