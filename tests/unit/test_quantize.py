"""The compressed-moment quantisers (pstar_fx.runtime.quantize) and the compressed state layout (optim.spec): round
trips within their error bounds, stochastic rounding unbiased on average and deterministic without torch's global
generator, zeros, huge and tiny values, NaN and inf, and codes that survive a dequantise / quantise round trip."""
import pytest
import torch

from pstar_fx.optim import ADAM_STATE, INT8_BLOCK, StateDtype, parse_state_dtype
from pstar_fx.runtime import native
from pstar_fx.runtime.quantize import Packed, random_bits, seed

N = 3 * INT8_BLOCK + 100          # three whole blocks and a tail


def _packed(dtype: StateDtype, n: int = N, mixed: bool = False, chunk: int = 5, block: int | None = None):
    layout = ADAM_STATE.with_dtype(dtype)
    buf = torch.zeros(layout.floats(n, mixed))
    kw = {} if block is None else {"block": block}
    return buf, Packed(layout.parts(buf, n, mixed), chunk, **kw)


def _moments(n: int = N, gen_seed: int = 0):
    g = torch.Generator().manual_seed(gen_seed)
    m = torch.randn(n, generator=g) * torch.logspace(-5, 1, n)
    v = torch.rand(n, generator=g) * torch.logspace(-10, 2, n) + 1e-30
    return {"exp_avg": m, "exp_avg_sq": v}


def test_state_dtype_parses_the_users_strings_and_names_the_choices():
    assert parse_state_dtype("bf16", "x") is StateDtype.BF16 and parse_state_dtype("INT8", "x") is StateDtype.INT8
    assert parse_state_dtype(StateDtype.FP32, "x") is StateDtype.FP32
    for bad in ("fp16", "int4", 8, None, torch.bfloat16):
        with pytest.raises(ValueError, match="state_dtype must be one of 'fp32', 'bf16', 'int8'"):
            parse_state_dtype(bad, "px.AdamW")


def test_fp32_layout_is_the_exact_one_and_compressed_layouts_are_smaller_and_aligned():
    for mixed in (False, True):
        assert ADAM_STATE.floats(1000, mixed) == 1000 * (3 if mixed else 2) + 1
        assert ADAM_STATE.with_dtype(StateDtype.FP32) == ADAM_STATE
        n = 1 << 16
        sizes = {d: ADAM_STATE.with_dtype(d).floats(n, mixed) * 4 / n for d in StateDtype}
        extra = 4 if mixed else 0
        assert sizes[StateDtype.FP32] == pytest.approx(8 + extra, abs=0.01)
        assert sizes[StateDtype.BF16] == pytest.approx(4 + extra, abs=0.01)
        assert sizes[StateDtype.INT8] == pytest.approx(2 + 8 / INT8_BLOCK + extra, abs=0.01)
        for d in (StateDtype.BF16, StateDtype.INT8):
            layout = ADAM_STATE.with_dtype(d)
            buf = torch.zeros(layout.floats(N, mixed))
            parts = layout.parts(buf, N, mixed)
            base = buf.data_ptr()
            assert all((t.data_ptr() - base) % 64 == 0 for t in parts.values())
            ends = sorted((t.data_ptr() - base, t.data_ptr() - base + t.numel() * t.element_size())
                          for t in parts.values())
            assert all(a[1] <= b[0] for a, b in zip(ends, ends[1:])), "parts overlap"
            assert ends[-1][1] <= buf.numel() * 4
            assert parts["exp_avg_sq"].dtype == (torch.bfloat16 if d is StateDtype.BF16 else torch.uint8)
            assert ("master" in parts) == mixed and parts["step"].dim() == 0


def test_random_bits_are_a_fixed_hash_of_chunk_step_and_element():
    """The bits match a plain-Python reference (int32 products wrap), differ across chunks, steps and elements,
    and are uniform."""
    def ref(x):
        for k, shift in ((0x7FEB352D, 16), (0x2C1B3C6D, 15), (0x297A2D39, 15)):
            x = (x * k) & 0xFFFFFFFF
            x ^= x >> shift
        return x - (1 << 32) if x >= 1 << 31 else x

    n = 1 << 16
    out, tmp = torch.empty(n, dtype=torch.int32), torch.empty(n, dtype=torch.int32)
    s = seed(3, torch.tensor(7.0))
    bits = random_bits(out, tmp, s, 1000).clone()
    for i in (0, 1, 4097, n - 1):
        assert bits[i].item() == ref((1000 + i + s.item()) & 0xFFFFFFFF)
    assert not torch.equal(bits, random_bits(out, tmp, seed(4, torch.tensor(7.0)), 1000))
    assert not torch.equal(bits, random_bits(out, tmp, seed(3, torch.tensor(8.0)), 1000))
    low = (bits & 0xFFFF).double() / 65536
    assert abs(low.mean().item() - 0.5) < 0.01 and abs(low.std().item() - (1 / 12) ** 0.5) < 0.01


@pytest.mark.parametrize("dtype", [StateDtype.BF16, StateDtype.INT8])
def test_round_trip_error_is_within_the_codes_step(dtype):
    _, pk = _packed(dtype)
    want = _moments()
    pk.write(want, torch.tensor(1.0))
    got = pk.read()
    for k, x in want.items():
        y = got[k]
        if dtype is StateDtype.BF16:
            assert torch.all((y - x).abs() <= x.abs() * 2 ** -7), k      # one bf16 step: 2**-7 relative at most
            continue
        levels = 127 if k == "exp_avg" else 255
        s = x.abs().view(-1)[:3 * INT8_BLOCK].view(3, INT8_BLOCK).amax(1).repeat_interleave(INT8_BLOCK)
        s = torch.cat([s, x.abs()[3 * INT8_BLOCK:].amax().expand(100)])
        if k == "exp_avg":     # codes of sqrt(|m| / s): off by less than one code
            r = (x.abs() / s).sqrt() * levels
            bound = s * (2 * r + 1) / levels ** 2
        else:                  # codes of (v / s) ** (1/4), and a v > 0 codes as 1 at least
            r = (x / s).sqrt().sqrt() * levels
            bound = s * ((r + 1) ** 4 - r ** 4) / levels ** 4
        assert torch.all((y - x).abs() <= bound * (1 + 1e-5)), k
        # m keeps its sign or rounds to 0; no v > 0 becomes 0 (Adam divides by its root)
        assert torch.all((torch.sign(y) == torch.sign(x)) | ((y == 0) & (k == "exp_avg"))), k
    assert pk.parts["exp_avg.scale" if dtype is StateDtype.INT8 else "exp_avg"].isfinite().all()


@pytest.mark.parametrize("dtype", [StateDtype.BF16, StateDtype.INT8])
def test_stochastic_rounding_is_unbiased_on_average(dtype):
    n = 1 << 16
    _, pk = _packed(dtype, n)
    m = torch.full((n,), 0.3 + 2 ** -12 / 3)     # between two codes, nearer the lower one
    v = torch.full((n,), 0.0123)
    if dtype is StateDtype.INT8:                 # each block's largest value: 1 (m), 1 (v)
        m[::INT8_BLOCK] = 1.0
        v[::INT8_BLOCK] = 1.0
    pk.write({"exp_avg": m, "exp_avg_sq": v}, torch.tensor(3.0))
    got = pk.read()
    inner = torch.ones(n, dtype=torch.bool)
    inner[::INT8_BLOCK] = False
    for k, x in (("exp_avg", m), ("exp_avg_sq", v)):
        y, want = got[k][inner].double(), x[inner][0].item()
        assert len(set(y.tolist())) == 2, k                         # the two codes around the value
        stderr = y.std().item() / y.numel() ** 0.5
        assert abs(y.mean().item() - want) < 5 * stderr + 1e-6 * want, (k, y.mean().item(), want)


@pytest.mark.parametrize("dtype", [StateDtype.BF16, StateDtype.INT8])
def test_codes_are_deterministic_and_leave_the_global_generator_alone(dtype):
    before = torch.get_rng_state()
    buf1, pk1 = _packed(dtype)
    buf2, pk2 = _packed(dtype, block=INT8_BLOCK)      # other blocks: the bits are per element, not per block
    pk1.write(_moments(), torch.tensor(9.0))
    pk2.write(_moments(), torch.tensor(9.0))
    assert torch.equal(buf1.view(torch.uint8), buf2.view(torch.uint8))
    assert torch.equal(torch.get_rng_state(), before)
    buf3, pk3 = _packed(dtype)
    pk3.write(_moments(), torch.tensor(10.0))         # another step rounds with other bits
    assert not torch.equal(buf1.view(torch.uint8), buf3.view(torch.uint8))


@pytest.mark.parametrize("dtype", [StateDtype.BF16, StateDtype.INT8])
def test_dequantised_values_quantise_back_to_the_same_codes(dtype):
    """What state_dict() and checkpoints rely on: a state read out in fp32 and loaded again is the same state,
    whatever step count rounds it."""
    buf, pk = _packed(dtype, mixed=True)
    pk.write(_moments(gen_seed=1), torch.tensor(1.0))
    codes = buf.view(torch.uint8).clone()
    for step in (2.0, 77.0, 12345.0):
        pk.write(pk.read(), torch.tensor(step))
        assert torch.equal(buf.view(torch.uint8), codes), step


@pytest.mark.parametrize("dtype", [StateDtype.BF16, StateDtype.INT8])
def test_zeros_huge_and_tiny_values(dtype):
    _, pk = _packed(dtype)
    m, v = torch.zeros(N), torch.zeros(N)
    m[INT8_BLOCK:2 * INT8_BLOCK] = torch.linspace(-3e37, 3e37, INT8_BLOCK)
    v[INT8_BLOCK:2 * INT8_BLOCK] = torch.linspace(0, 3e37, INT8_BLOCK)
    m[2 * INT8_BLOCK:] = torch.linspace(-1e-36, 1e-36, N - 2 * INT8_BLOCK)
    v[2 * INT8_BLOCK:] = torch.logspace(-44, -36, N - 2 * INT8_BLOCK)       # down to fp32's subnormals
    pk.write({"exp_avg": m, "exp_avg_sq": v}, torch.tensor(1.0))
    got = pk.read()
    assert all(t.isfinite().all() for t in got.values())
    assert torch.equal(got["exp_avg"][:INT8_BLOCK], torch.zeros(INT8_BLOCK))   # an all-zero block stays zero
    assert torch.equal(got["exp_avg_sq"][:INT8_BLOCK], torch.zeros(INT8_BLOCK))
    big = slice(INT8_BLOCK, 2 * INT8_BLOCK)
    top = 2 / 127 * 3e37             # int8: a code's step at the block's largest value; bf16: far less
    assert torch.allclose(got["exp_avg"][big], m[big], rtol=0, atol=top)
    assert torch.allclose(got["exp_avg_sq"][big], v[big], rtol=0, atol=top)
    # int8: no v > 0 becomes 0 (it is relative to its block); bf16: none above bf16's subnormals (a v below them has
    # a root far below any eps, so Adam's step is the same with 0)
    tiny = v[2 * INT8_BLOCK:]
    kept = tiny > (0 if dtype is StateDtype.INT8 else torch.finfo(torch.bfloat16).tiny)
    assert kept.sum() > 10 and (got["exp_avg_sq"][2 * INT8_BLOCK:][kept] > 0).all(), "a tiny v > 0 became 0"


def test_nan_and_inf_poison_their_own_block_only():
    """An exact update's parameters turn NaN after a NaN gradient; compressed moments carry the NaN or inf on (bf16
    exactly, int8 as a non-finite block) and leave other blocks alone."""
    for dtype in (StateDtype.BF16, StateDtype.INT8):
        _, pk = _packed(dtype)
        want = _moments()
        m, v = want["exp_avg"].clone(), want["exp_avg_sq"].clone()
        m[5], v[5] = float("nan"), float("nan")
        m[INT8_BLOCK + 7], v[INT8_BLOCK + 7] = float("-inf"), float("inf")
        pk.write({"exp_avg": m, "exp_avg_sq": v}, torch.tensor(1.0))
        got = pk.read()
        for k in ("exp_avg", "exp_avg_sq"):
            assert got[k][5].isnan(), (dtype, k)
            assert got[k][INT8_BLOCK + 7].isinf() or got[k][INT8_BLOCK + 7].isnan(), (dtype, k)
            rest = got[k][2 * INT8_BLOCK:]
            assert rest.isfinite().all(), (dtype, k)
            assert torch.allclose(rest, want[k][2 * INT8_BLOCK:], rtol=0.2, atol=1e-3 * want[k].abs().max())


@pytest.mark.parametrize("use_native", [False, True])
def test_every_quiet_nan_stays_nan_in_bf16(use_native):
    """The random bits added below bf16's last bit must not carry out of a NaN: a GPU's NaN (0x7FFFFFFF) plus
    them would wrap to -0.0 and a negative one (0xFFFFFFFF) to +0.0, silently zeroing a poisoned moment."""
    if use_native and native.kernels() is None:
        pytest.skip(f"no native kernels here: {native.why_not()}")
    patterns = torch.tensor([0x7FFFFFFF, -1, 0x7FC00000, -0x400000, 0x7FFF0001], dtype=torch.int32)
    n = 4096 * len(patterns)
    layout = ADAM_STATE.with_dtype(StateDtype.BF16)
    pk = Packed(layout.parts(torch.zeros(layout.floats(n, False)), n, False), chunk=3, use_native=use_native)
    nan = patterns.repeat_interleave(4096).view(torch.float32)
    assert nan.isnan().all()
    pk.write({"exp_avg": nan.clone(), "exp_avg_sq": nan.clone()}, torch.tensor(9.0))
    got = pk.read()
    assert got["exp_avg"].isnan().all() and got["exp_avg_sq"].isnan().all()
