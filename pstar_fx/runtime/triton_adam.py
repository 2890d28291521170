"""The Triton kernels of runtime/device_adam.py (imported only where Triton is): Adam / AdamW on compressed moments,
one pass, adam.c's arithmetic (see device_adam's docstring)."""
import triton
import triton.language as tl


@triton.jit
def _pow(b, e):
    """b ** e (float64; e a non-negative int32) by repeated squaring."""
    r = b * 0.0 + 1.0
    while e > 0:
        if (e & 1) == 1:
            r = r * b
        b = b * b
        e = e >> 1
    return r


@triton.jit
def _scalars(step_ptr, lr_hi, lr_lo, b1_hi, b1_lo, b2_hi, b2_lo):
    """(step_size, sqrt(1 - beta2^t), t) from the step count t on the device: float64, then rounded to fp32."""
    t = tl.load(step_ptr)
    e = t.to(tl.int32)
    b1 = tl.cast(b1_hi, tl.float64) + tl.cast(b1_lo, tl.float64)
    b2 = tl.cast(b2_hi, tl.float64) + tl.cast(b2_lo, tl.float64)
    lr = tl.cast(lr_hi, tl.float64) + tl.cast(lr_lo, tl.float64)
    step_size = (lr / (1.0 - _pow(b1, e))).to(tl.float32)     # float64: / and sqrt are correctly rounded
    bc2 = tl.sqrt(1.0 - _pow(b2, e)).to(tl.float32)
    return step_size, bc2, e


@triton.jit
def _bits(index, seed, k1, k2, k3):
    """quantize.random_bits of chunk elements `index` (int32, wrapping) under `seed`: its multipliers k1-k3,
    each product followed by a logical right shift's xor."""
    x = index + seed
    x = x * k1
    x = x ^ ((x >> 16) & 0xFFFF)
    x = x * k2
    x = x ^ ((x >> 15) & 0x1FFFF)
    x = x * k3
    x = x ^ ((x >> 15) & 0x1FFFF)
    return x


@triton.jit
def _update(p, g, m, v, step_size, bc2, decay, wd, w1, b2, w2, eps, DECOUPLED: tl.constexpr,
            MAXIMIZE: tl.constexpr):
    """adam.c's update of fp32 values: (p, m, v) after it."""
    if MAXIMIZE:
        g = -g
    if DECOUPLED:
        p = p * decay
    else:
        g = g + p * wd
    m = m + w1 * (g - m)
    v = v * b2 + (g * g) * w2
    denom = tl.div_rn(tl.sqrt_rn(v), bc2) + eps
    p = p - tl.div_rn(step_size * m, denom)
    return p, m, v


@triton.jit
def adam_int8(p_ptr, g_ptr, qm_ptr, qv_ptr, sm_ptr, sv_ptr, step_ptr, n, first, seed_c, step_k, k1, k2, k3, tiny,
              lr_hi, lr_lo, b1_hi, b1_lo, b2_hi, b2_lo, decay, wd, w1, b2, w2, eps, DECOUPLED: tl.constexpr,
              MAXIMIZE: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    step_size, bc2, e = _scalars(step_ptr, lr_hi, lr_lo, b1_hi, b1_lo, b2_hi, b2_lo)
    seed = e * step_k + seed_c
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    offs = rows[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    mask = offs < n
    row_ok = rows * BLOCK < n
    p = tl.load(p_ptr + offs, mask=mask, other=0.0)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0)
    s = tl.load(sm_ptr + rows, mask=row_ok, other=0.0)
    t = tl.load(sv_ptr + rows, mask=row_ok, other=0.0)
    x = tl.load(qm_ptr + offs, mask=mask, other=0).to(tl.float32) * (1.0 / 127.0)
    m = (x * tl.abs(x)) * s[:, None]
    y = tl.load(qv_ptr + offs, mask=mask, other=0).to(tl.float32) * (1.0 / 255.0)
    y = y * y
    v = (y * y) * t[:, None]
    p, m, v = _update(p, g, m, v, step_size, bc2, decay, wd, w1, b2, w2, eps, DECOUPLED, MAXIMIZE)
    tl.store(p_ptr + offs, p, mask=mask)
    r = _bits(first + offs, seed, k1, k2, k3)
    # the blocks' largest magnitudes, NaN above inf: an integer maximum of the bits (codes.h's block_amax)
    am = tl.max(tl.where(mask, m.to(tl.int32, bitcast=True) & 0x7FFFFFFF, 0), axis=1).to(tl.float32,
                                                                                         bitcast=True)
    av = tl.max(tl.where(mask, v.to(tl.int32, bitcast=True) & 0x7FFFFFFF, 0), axis=1).to(tl.float32,
                                                                                         bitcast=True)
    tl.store(sm_ptr + rows, am, mask=row_ok)
    tl.store(sv_ptr + rows, av, mask=row_ok)
    im = tl.div_rn(1.0, tl.where(am < tiny, tiny, am))
    iv = tl.div_rn(1.0, tl.where(av < tiny, tiny, av))
    # m: codes.h's codes_m
    a = tl.sqrt_rn(tl.abs(m) * im[:, None]) * 127.0
    a = a + (r & 0xFF).to(tl.float32) * (1.0 / 256.0)
    a = tl.floor(a + 0.5 / 256.0)
    a = tl.where(a > 127.0, 127.0, a)
    a = tl.where(m < 0, -a, a)
    tl.store(qm_ptr + offs, tl.where(tl.abs(a) <= 127.0, a, 0.0).to(tl.int8), mask=mask)
    # v: codes_v
    a = tl.sqrt_rn(tl.sqrt_rn(tl.abs(v) * iv[:, None])) * 255.0
    a = a + ((r >> 8) & 0xFF).to(tl.float32) * (1.0 / 256.0)
    a = tl.floor(a + 0.5 / 256.0)
    a = tl.where(a > 255.0, 255.0, a)
    c = v * 1e38
    c = tl.ceil(tl.where(c > 1.0, 1.0, c))
    q = tl.where((a != a) | (c != c), 0.0, tl.where(a > c, a, c))
    tl.store(qv_ptr + offs, q.to(tl.uint8), mask=mask)


@triton.jit
def adam_bf16(p_ptr, g_ptr, qm_ptr, qv_ptr, step_ptr, n, first, seed_c, step_k, k1, k2, k3, lr_hi, lr_lo, b1_hi,
              b1_lo, b2_hi, b2_lo, decay, wd, w1, b2, w2, eps, DECOUPLED: tl.constexpr, MAXIMIZE: tl.constexpr,
              BLOCK: tl.constexpr):
    step_size, bc2, e = _scalars(step_ptr, lr_hi, lr_lo, b1_hi, b1_lo, b2_hi, b2_lo)
    seed = e * step_k + seed_c
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    p = tl.load(p_ptr + offs, mask=mask, other=0.0)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0)
    m = tl.load(qm_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(qv_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    p, m, v = _update(p, g, m, v, step_size, bc2, decay, wd, w1, b2, w2, eps, DECOUPLED, MAXIMIZE)
    tl.store(p_ptr + offs, p, mask=mask)
    r = _bits(first + offs, seed, k1, k2, k3)
    # quantize_bf16: 16 random bits added below bf16's last bit, then truncated (exact in bf16)
    # (a NaN takes no bits: its carry could run into the sign, 0x7FFFFFFF + r being -0.0)
    qm = ((m.to(tl.int32, bitcast=True) + tl.where(m != m, 0, r & 0xFFFF)) & -65536).to(tl.float32, bitcast=True)
    qv = ((v.to(tl.int32, bitcast=True) + tl.where(v != v, 0, (r >> 16) & 0xFFFF)) & -65536).to(tl.float32,
                                                                                                bitcast=True)
    tl.store(qm_ptr + offs, qm.to(tl.bfloat16), mask=mask)
    tl.store(qv_ptr + offs, qv.to(tl.bfloat16), mask=mask)

