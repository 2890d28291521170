"""Compressed optimizer moments (px.Adam / px.AdamW `state_dtype="bf16"` or `"int8"`): the quantisers, and the
blocks a compressed update runs through (runtime/adam.py runs the update itself).

The update itself runs in one pass where it can: the native kernel on the CPU (runtime/native/adam.c), one Triton
kernel on the GPU (runtime/device_adam.py), each with these quantisers' arithmetic. Elsewhere (no C compiler, no
Triton, `PSTAR_FX_NATIVE=0`, fused=False) an update dequantises a block of m and v into fp32 scratch, runs the same
fused Adam as an exact update on it, and quantises the block back, through the plain torch ops here, each in place on
the scratch (`Packed`), so a device update allocates nothing beyond its counted workspace; nothing chunk-sized is made
in fp32. The conversions on the CPU go through runtime/native too (each one pass, the same bits: every operation is
correctly rounded, torch's CPU sqrt going through float64 here for it).

Rounding is stochastic and unbiased, and deterministic: the random bits of element i of chunk c at step t come from
a counter-based hash of (c, t, i) computed here (never torch's global generator, which stays untouched), so a rerun,
or a run resumed from a checkpoint, writes the same codes bit for bit, and the host and the device draw the same
bits. The quantisers divide by multiplying with a correctly rounded fp32 reciprocal (1/127, 1/255, 1/scale), which
every device computes alike and the CPU does faster than a division. A chunk's update is the same bit for bit
wherever the plan runs it, on the CPU and, through the Triton kernel, on the GPU; on the torch route a GPU's Adam
kernel rounds differently from the CPU's, so there a host and a device update can differ in the last bits, as exact
states do.

- bf16: m and v rounded to bfloat16 by adding 16 random bits below bf16's last bit and truncating (a NaN takes none).
- int8, per block of INT8_BLOCK elements with one fp32 scale s (the block's largest magnitude): m as signed codes
  q in [-127, 127] with m = sign(q) (q/127)^2 s (a square-root domain); v as unsigned codes in [0, 255] with
  v = (q/255)^4 s (a fourth-root domain, i.e. sqrt(v), which has m's units, in a square-root domain). The roots
  spread the codes over four (m) and nine (v) orders of magnitude below the block's largest value instead of two,
  where small moments sit; a v > 0 never codes as 0, since Adam divides by sqrt(v) (a v rounded to 0 under a
  non-zero m would turn the step into m / eps). Rounding adds (r + 1/2)/256 for 8 random bits r and floors.
- Dequantising then quantising again returns the same codes (the block's largest element maps to 1 within an ulp, and
  a dequantised value lies within a few ulps of its code, far closer than the 1/512 the rounding's offset keeps from
  it): a state read out in fp32 (optimizer.state_dict(), a checkpoint) and loaded back is the state it was.
- NaN or inf: a bf16 moment keeps it; an int8 block holding one gets a non-finite scale and dequantises to NaN (as
  an exact update's parameters turn NaN after such a gradient anyway).
"""
from __future__ import annotations

import functools

import torch

from ..optim import INT8_BLOCK, StateDtype
from ..optim.state_dtype import SCRATCH_BLOCK, SCRATCH_FLOATS
from . import native

_K1, _K2, _K3 = 0x7FEB352D, 0x2C1B3C6D, 0x297A2D39     # a 32-bit integer hash's multipliers (each below 2**31)
_STEP_K, _CHUNK_K = 0x5BD1E995, 0x1B873593
_TINY = torch.finfo(torch.float32).tiny
MOMENTS = ("exp_avg", "exp_avg_sq")      # Adam's m and v under torch's keys: what a compressed layout compresses


def _i32(x: int) -> int:
    x &= 0xFFFFFFFF
    return x - (1 << 32) if x >= 1 << 31 else x


def seed(chunk: int, step: torch.Tensor) -> torch.Tensor:
    """A 0-d int32 tensor on step's device mixing the chunk and its step count (no device sync)."""
    return step.to(torch.int32) * _STEP_K + _i32(chunk * _CHUNK_K + 0x27D4EB2F)


def random_bits(out: torch.Tensor, tmp: torch.Tensor, seed_: torch.Tensor, first: int) -> torch.Tensor:
    """32 random bits (int32) for elements first, first+1, ... of a chunk: a hash of (element + seed), into out
    (tmp: int32 scratch of out's size). int32 products wrap, as they do on every device torch runs on."""
    assert first + out.numel() < 1 << 31, "chunk elements are indexed in int32"
    torch.arange(first, first + out.numel(), dtype=torch.int32, device=out.device, out=out)
    out.add_(seed_)
    for k, shift in ((_K1, 16), (_K2, 15), (_K3, 15)):
        out.mul_(k)
        tmp.copy_(out)
        tmp.bitwise_right_shift_(shift).bitwise_and_((1 << (32 - shift)) - 1)   # a logical shift
        out.bitwise_xor_(tmp)
    return out


def _field(bits: torch.Tensor, shift: int, width: int, out: torch.Tensor) -> torch.Tensor:
    """bits >> shift & (2**width - 1), into out (int32)."""
    out.copy_(bits)
    if shift:
        out.bitwise_right_shift_(shift)
    return out.bitwise_and_((1 << width) - 1)


# -- bf16 ---------------------------------------------------------------------------------------------------------
def quantize_bf16(x: torch.Tensor, q: torch.Tensor, r16: torch.Tensor, t: torch.Tensor) -> None:
    """q (bfloat16) = x (fp32, overwritten) rounded stochastically with the 16 random bits r16 (int32 in
    [0, 65536); zeroed where x is NaN): adding them below bf16's last bit and truncating rounds up with probability
    equal to the fraction cut off. A value bf16 holds exactly is unchanged. A NaN takes no random bits: its carry
    could run into the sign (a GPU's NaN, 0x7FFFFFFF, plus the bits is -0.0), so it stays NaN (any quiet NaN; one
    with payload bits below bf16's only would truncate to inf). t: int32 scratch of x's size."""
    bits = x.view(torch.int32)
    t.copy_(bits).bitwise_and_(0x7FFFFFFF).sub_(0x7F800001).bitwise_right_shift_(31)     # -1, or 0 for a NaN
    r16.bitwise_and_(t)
    bits.add_(r16)
    bits.bitwise_and_(-65536)
    q.copy_(x)


def dequantize_bf16(q: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(q)


# -- int8 ---------------------------------------------------------------------------------------------------------
def _per_block(t: torch.Tensor, scale: torch.Tensor, op) -> None:
    """op(view, scale) on each block of t ((blocks, INT8_BLOCK) views, and the tail block)."""
    n = t.numel()
    full = n // INT8_BLOCK
    if full:
        op(t[:full * INT8_BLOCK].view(full, INT8_BLOCK), scale[:full].unsqueeze(1))
    if n > full * INT8_BLOCK:
        op(t[full * INT8_BLOCK:], scale[full])


def _levels(signed: bool) -> int:
    return 127 if signed else 255


def quantize_int8(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, r8: torch.Tensor, a: torch.Tensor,
                  u: torch.Tensor, signed: bool) -> None:
    """Codes q (int8 if signed, else uint8, x's size) and block scales of x (fp32; left as it was), rounded
    stochastically with the 8 random bits r8 (int32). a, u: fp32 scratch of x's size. x's first element starts a
    block."""
    levels = _levels(signed)
    torch.abs(x, out=a)
    n = x.numel()
    full = n // INT8_BLOCK
    if full:
        torch.amax(a[:full * INT8_BLOCK].view(full, INT8_BLOCK), dim=1, out=scale[:full])
    if n > full * INT8_BLOCK:
        scale[full] = a[full * INT8_BLOCK:].amax()
    _per_block(a, scale.clamp_min(_TINY).reciprocal_(), lambda t, s: t.mul_(s))   # an all-zero block stays 0
    _sqrt_(a)
    if not signed:
        _sqrt_(a)
    a.mul_(levels)
    u.copy_(r8)
    a.add_(u, alpha=1 / 256).add_(0.5 / 256).floor_().clamp_max_(levels)
    if signed:
        a.copysign_(x)
    else:    # a v > 0 codes as 1 at least (x * 1e38 reaches 1 for every x above fp32's subnormals' 1e-38 ...)
        torch.maximum(a, u.copy_(x).mul_(1e38).clamp_max_(1.0).ceil_(), out=a)   # (... and ceil for those)
    a.nan_to_num_(0.0, 0.0, 0.0)
    q.copy_(a)


def _sqrt_(a: torch.Tensor) -> None:
    """a's square roots, correctly rounded (as the native kernels and CUDA's sqrt round them): torch's vectorised
    CPU sqrt is within an ulp, not exact, so on the CPU it goes through float64 (whose root, rounded to fp32, is the
    correctly rounded fp32 root)."""
    if a.device.type == "cpu":
        a.copy_(a.double().sqrt_())
    else:
        a.sqrt_()


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, out: torch.Tensor, a: torch.Tensor, signed: bool) -> None:
    """out (fp32) = the values of codes q with their block scales; a: fp32 scratch of out's size."""
    out.copy_(q)
    out.mul_(1 / _levels(signed))
    if signed:
        out.mul_(torch.abs(out, out=a))
    else:
        out.square_().square_()
    _per_block(out, scale, lambda t, s: t.mul_(s))


# -- a chunk's compressed moments ---------------------------------------------------------------------------------
class Packed:
    """A chunk's (shard's) compressed m and v, worked on block by block through fp32 scratch.

    parts: the state buffer's views (StateLayout.parts of a compressed layout); chunk: the chunk's id; first: the
    chunk element the shard starts at (the random bits are per chunk element); scratch: a flat fp32 tensor of at
    least `scratch_floats(numel)` elements on the states' device (the device's counted workspace), or None to make
    it here (the host); block: the most elements a block has (the scratch holds SCRATCH_FLOATS values for each).
    `load(lo, hi)` dequantises elements [lo, hi) into (m, v) fp32 views of the scratch;
    `store(lo, hi, step)` quantises them back, rounded with step's random bits (step: the 0-d count after the
    update). On the CPU the conversions run through the native kernels (runtime/native: one pass each, the same
    bits) where they are built, unless `use_native` is False; elsewhere through the torch ops here."""

    def __init__(self, parts: dict[str, torch.Tensor], chunk: int, first: int = 0,
                 scratch: torch.Tensor | None = None, block: int = SCRATCH_BLOCK, use_native: bool = True):
        self.parts = parts
        m = parts["exp_avg"]
        self.dtype = StateDtype.BF16 if m.dtype == torch.bfloat16 else StateDtype.INT8
        self.numel = m.numel()
        self.chunk, self.first = chunk, first
        assert block % INT8_BLOCK == 0 and block <= SCRATCH_BLOCK, block
        self.block = min(self.numel, block)
        assert scratch is None or (scratch.numel() >= SCRATCH_FLOATS * self.block
                                   and scratch.dtype == torch.float32), scratch
        self._scratch = scratch
        self.native = native.kernels() if use_native and m.device.type == "cpu" else None

    @functools.cached_property
    def _views(self) -> tuple[torch.Tensor, ...]:
        """m32, v32, a, u (fp32) and bits, tmp (int32) views of the scratch, made here at first use if none was
        given (the native one-pass update needs none)."""
        b, scratch = self.block, self._scratch
        if scratch is None:
            scratch = torch.empty(SCRATCH_FLOATS * b, dtype=torch.float32, device=self.parts["exp_avg"].device)
        return (*(scratch[i * b:(i + 1) * b] for i in range(4)),
                *(scratch[i * b:(i + 1) * b].view(torch.int32) for i in (4, 5)))

    m32 = property(lambda self: self._views[0])
    v32 = property(lambda self: self._views[1])
    a = property(lambda self: self._views[2])
    u = property(lambda self: self._views[3])
    bits = property(lambda self: self._views[4])
    tmp = property(lambda self: self._views[5])

    def load(self, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        assert lo % INT8_BLOCK == 0 and hi - lo <= self.block, (lo, hi)
        p, n = self.parts, hi - lo
        m, v = self.m32[:n], self.v32[:n]
        if self.dtype is StateDtype.BF16:
            dequantize_bf16(p["exp_avg"][lo:hi], m)
            dequantize_bf16(p["exp_avg_sq"][lo:hi], v)
        elif self.native is not None:
            blocks = slice(lo // INT8_BLOCK, -(-hi // INT8_BLOCK))
            self.native.dequant_int8(p["exp_avg"][lo:hi], p["exp_avg_sq"][lo:hi], p["exp_avg.scale"][blocks],
                                     p["exp_avg_sq.scale"][blocks], m, v)
        else:
            blocks = slice(lo // INT8_BLOCK, -(-hi // INT8_BLOCK))
            dequantize_int8(p["exp_avg"][lo:hi], p["exp_avg.scale"][blocks], m, self.a[:n], True)
            dequantize_int8(p["exp_avg_sq"][lo:hi], p["exp_avg_sq.scale"][blocks], v, self.a[:n], False)
        return m, v

    def store(self, lo: int, hi: int, step: torch.Tensor) -> None:
        p, n = self.parts, hi - lo
        if self.native is not None:
            self._store_native(lo, hi, int(seed(self.chunk, step)))
            return
        bits, tmp = random_bits(self.bits[:n], self.tmp[:n], seed(self.chunk, step), self.first + lo), self.tmp[:n]
        if self.dtype is StateDtype.BF16:
            t = self.a[:n].view(torch.int32)
            quantize_bf16(self.m32[:n], p["exp_avg"][lo:hi], _field(bits, 0, 16, tmp), t)
            quantize_bf16(self.v32[:n], p["exp_avg_sq"][lo:hi], _field(bits, 16, 16, tmp), t)
            return
        blocks = slice(lo // INT8_BLOCK, -(-hi // INT8_BLOCK))
        quantize_int8(self.m32[:n], p["exp_avg"][lo:hi], p["exp_avg.scale"][blocks], _field(bits, 0, 8, tmp),
                      self.a[:n], self.u[:n], True)
        quantize_int8(self.v32[:n], p["exp_avg_sq"][lo:hi], p["exp_avg_sq.scale"][blocks], _field(bits, 8, 8, tmp),
                      self.a[:n], self.u[:n], False)

    def _store_native(self, lo: int, hi: int, seed_: int) -> None:
        p, n, first = self.parts, hi - lo, self.first + lo
        assert first + n < 1 << 31, "chunk elements are indexed in int32"
        if self.dtype is StateDtype.BF16:
            self.native.quant_bf16(self.m32[:n], self.v32[:n], p["exp_avg"][lo:hi], p["exp_avg_sq"][lo:hi], first,
                                   seed_)
            return
        blocks = slice(lo // INT8_BLOCK, -(-hi // INT8_BLOCK))
        self.native.quant_int8(self.m32[:n], self.v32[:n], p["exp_avg"][lo:hi], p["exp_avg_sq"][lo:hi],
                               p["exp_avg.scale"][blocks], p["exp_avg_sq.scale"][blocks], first, seed_)

    def blocks(self):
        """(lo, hi) over the shard in blocks of the scratch's size (block-aligned: INT8_BLOCK divides it)."""
        b = self.block
        for lo in range(0, self.numel, b):
            yield lo, min(self.numel, lo + b)

    # -- whole values, outside a step ----------------------------------------------------------------------------
    def read(self) -> dict[str, torch.Tensor]:
        """m and v of the whole shard, dequantised into new fp32 tensors."""
        out = {k: torch.empty(self.numel, dtype=torch.float32, device=self.parts["exp_avg"].device)
               for k in ("exp_avg", "exp_avg_sq")}
        for lo, hi in self.blocks():
            m, v = self.load(lo, hi)
            out["exp_avg"][lo:hi].copy_(m)
            out["exp_avg_sq"][lo:hi].copy_(v)
        return out

    def write(self, values: dict[str, torch.Tensor], step: torch.Tensor) -> None:
        """Quantise whole fp32 m and v (of the shard) into the codes, rounded with step's random bits."""
        for lo, hi in self.blocks():
            self.m32[:hi - lo].copy_(values["exp_avg"][lo:hi])
            self.v32[:hi - lo].copy_(values["exp_avg_sq"][lo:hi])
            self.store(lo, hi, step)


def scratch_floats(numel: int) -> int:
    """fp32 elements of a compressed update's scratch for a shard of `numel` elements (optim.state_dtype)."""
    return SCRATCH_FLOATS * min(numel, SCRATCH_BLOCK)


def is_packed(parts: dict[str, torch.Tensor]) -> bool:
    """The parts are a compressed layout's (Adam's m stored in bf16 or int8)."""
    m = parts.get("exp_avg")
    return m is not None and m.dtype in (torch.bfloat16, torch.int8)
