"""The compressed moments' quantisers as compiled CPU kernels, for the CPU worker's update (runtime/quantize.py
`Packed`, given a `CompiledCodecs`).

Why: op by op (quantize.py), quantising a block of m and v back is about 40 passes over it (the random bits' hash,
the rounding, the int8 scales), each a parallel region of its own; on a host with many threads their start-up and
the passes over memory cost 10-19x the time of the fused exact update. Compiled by Inductor (torch.compile over the
functions below, shapes dynamic: one compilation serves every block size), the dequantisation is one loop and the
quantisation one or two, each reading its inputs once and writing the codes in place.

The same values as op by op, bit for bit (tests/unit/test_quantize_compiled.py checks it over many sizes and
values): every step here is the operation quantize.py applies, each exactly rounded in IEEE arithmetic (no
contraction into fused multiply-adds: Inductor's CPU flags keep -ffp-contract off), int32 products wrap as in
torch's kernels, and where Inductor would turn a division by a constant into a multiplication by its reciprocal,
quantize.py multiplies by the reciprocal too. So a chunk updated here, on the device or after a streamed fetch
holds the same codes, and a process that cannot compile (no C++ compiler: `torch.compile` raises) goes on op by op
with the same results, after one warning.

Only int8 blocks of whole INT8_BLOCKs run here (a shard's last, partial block goes op by op); bf16 blocks of any
size do. Thread safety: the CPU worker calls these from its own thread; Dynamo compiles under its own lock. While
another thread traces a step (make_fx: a flag of the whole process, which compiled functions refuse to run under),
a block goes op by op.
"""
from __future__ import annotations

import torch
from torch.fx._symbolic_trace import is_fx_tracing

from ..errors import warn
from ..optim import INT8_BLOCK, StateDtype

MOMENTS = ("exp_avg", "exp_avg_sq")

_HASH = ((0x7FEB352D, 16), (0x2C1B3C6D, 15), (0x297A2D39, 15))   # quantize.random_bits' multipliers and shifts
_TINY = torch.finfo(torch.float32).tiny


def _bits(x: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """quantize.random_bits for as many elements as x has, the first's index and the seed summed in offset (a 0-d
    int32 tensor: a Python int would be specialised, compiling again for each block), as an expression."""
    h = torch.arange(x.numel(), dtype=torch.int32, device=x.device) + offset
    for k, shift in _HASH:
        h = h * k
        h = h ^ ((h >> shift) & ((1 << (32 - shift)) - 1))
    return h


def quantize_bf16(m_bits: torch.Tensor, v_bits: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """m and v (fp32 blocks, given as their int32 bits) rounded stochastically (quantize.quantize_bf16): the bits
    of fp32 values that bf16 holds exactly, stacked (2, n). In bits, not bf16: Inductor vectorises neither a
    bitcast to float nor a conversion to a 16-bit integer; the caller's conversion of the stacked values to bf16
    (exact) is one pass, and one loop computes both moments from the random bits."""
    r = _bits(m_bits, offset)
    return torch.stack([(m_bits + (r & 0xFFFF)) & -65536, (v_bits + ((r >> 16) & 0xFFFF)) & -65536])


def _codes_int8(x: torch.Tensor, scale: torch.Tensor, r8: torch.Tensor, signed: bool) -> torch.Tensor:
    """quantize.quantize_int8's codes of x ((blocks, INT8_BLOCK) fp32) with its blocks' scales (their largest
    magnitudes, (blocks,)) and 8 random bits r8 (int32, x's shape)."""
    levels = 127 if signed else 255
    a = x.abs() / scale.clamp_min(_TINY).unsqueeze(1)
    a = a.sqrt()
    if not signed:
        a = a.sqrt()
    a = ((a * levels + r8.to(torch.float32) * (1 / 256)) + 0.5 / 256).floor().clamp_max(levels)
    if signed:
        a = a.copysign(x)
    else:
        a = torch.maximum(a, (x * 1e38).clamp_max(1.0).ceil())
    # quantize.py's nan_to_num(0, 0, 0): a is NaN or at most `levels` in magnitude here, and a comparison
    # vectorises where isnan does not
    return torch.where(a == a, a, 0.0).view(-1).to(torch.int8 if signed else torch.uint8)


def quantize_int8(m: torch.Tensor, v: torch.Tensor, ms: torch.Tensor, vs: torch.Tensor,
                  offset: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """m and v (fp32 blocks of whole INT8_BLOCKs) with their blocks' scales (ms, vs: found before, op by op: a
    reduction in the same kernel keeps Inductor from running it on more than one thread): their codes."""
    r = _bits(m, offset).view(-1, INT8_BLOCK)
    return (_codes_int8(m.view(-1, INT8_BLOCK), ms, r & 0xFF, True),
            _codes_int8(v.view(-1, INT8_BLOCK), vs, (r >> 8) & 0xFF, False))


def dequantize_int8(mq: torch.Tensor, ms: torch.Tensor, vq: torch.Tensor,
                    vs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize.dequantize_int8 of both moments (blocks of whole INT8_BLOCKs): new fp32 m and v."""
    a = mq.to(torch.float32) * (1 / 127)
    a = a * a.abs()
    b = vq.to(torch.float32) * (1 / 255)
    b = b * b
    b = b * b
    return ((a.view(-1, INT8_BLOCK) * ms.unsqueeze(1)).view(-1),
            (b.view(-1, INT8_BLOCK) * vs.unsqueeze(1)).view(-1))


class CompiledCodecs:
    """The compiled quantisers of one owner (the chunk store of a compiled step).

    `warm()` compiles them, on the thread that runs the step, before the first host-side update: compiling on the CPU
    worker's thread would run Dynamo beside the step's own work, and Dynamo's and FX's tracing flags are the
    process's (a step traced meanwhile would see Dynamo compiling). The worker then only runs what was compiled
    (`torch._dynamo.run`: a block no compiled code fits runs the same functions eagerly, the same values).
    `store` and `load` return False / None where a block is not one they take (the caller goes op by op), before
    `warm()`, and after compiling failed (warned once). The kernels are functional: Inductor writes new tensors,
    copied into the state's views here (views of one buffer under other dtypes, which compiled code may not write
    in place)."""

    def __init__(self, compile=torch.compile):
        self._compile = compile          # torch.compile; a test gives one that fails
        self._run: dict[str, object] = {}
        self.failed = False
        self.calls = 0                   # blocks quantised or dequantised by compiled code

    def warm(self) -> None:
        """Compile the kernels (once; in a process that compiled them before, Dynamo finds them), over example
        blocks of every kind they take."""
        if self._run or self.failed:
            return
        n = 4 * INT8_BLOCK
        m, v, off = torch.randn(n), torch.rand(n), torch.zeros((), dtype=torch.int32)
        ms, vs = (x.abs().view(-1, INT8_BLOCK).amax(1) for x in (m, v))
        mq, vq = quantize_int8(m, v, ms, vs, off)
        examples = {quantize_bf16: (m.view(torch.int32), v.view(torch.int32), off),
                    quantize_int8: (m, v, ms, vs, off), dequantize_int8: (mq, ms, vq, vs)}
        try:
            with torch.enable_grad():        # as on the worker's thread: a new thread's grad mode
                for fn, args in examples.items():
                    self._compile(fn, dynamic=True, fullgraph=True)(*args)
        except Exception as e:  # noqa: BLE001 - no compiler, an Inductor failure: op by op, the same values
            self.failed = True
            warn(f"pstar-fx: the compressed optimizer states' compiled CPU kernels are unavailable "
                 f"({type(e).__name__}: {str(e)[:200]}); the CPU worker quantises op by op (the same values, "
                 "several times slower)")
            return
        self._run = {fn.__name__: torch._dynamo.run(fn) for fn in examples}

    def _call(self, fn, *args):
        run = self._run.get(fn.__name__)
        if run is None:
            return None
        try:
            out = run(*args)
        except RuntimeError:
            if is_fx_tracing():       # another thread is tracing a step: compiled code refuses to run meanwhile
                return None
            raise
        self.calls += 1
        return out

    def store(self, dtype: StateDtype, m: torch.Tensor, v: torch.Tensor, codes: dict[str, torch.Tensor],
              offset: torch.Tensor) -> bool:
        """Quantise the fp32 blocks m and v into codes (the block's views of the state parts: exp_avg, exp_avg_sq
        and, for int8, their .scale views); offset: the random bits' seed plus the block's first chunk element (a
        0-d int32 tensor, wrapping as quantize.random_bits does). False where it did not."""
        if m.device.type != "cpu":
            return False
        if dtype is StateDtype.BF16:
            out = self._call(quantize_bf16, m.view(torch.int32), v.view(torch.int32), offset)
            out = None if out is None else out.view(torch.float32).unbind(0)
            keys = MOMENTS
        elif m.numel() % INT8_BLOCK == 0:
            for x, k in ((m, "exp_avg"), (v, "exp_avg_sq")):      # the blocks' scales, where the codes take them
                torch.amax(x.view(-1, INT8_BLOCK).abs(), dim=1, out=codes[f"{k}.scale"])
            out = self._call(quantize_int8, m, v, codes["exp_avg.scale"], codes["exp_avg_sq.scale"], offset)
            keys = MOMENTS
        else:
            return False
        if out is None:
            return False
        for k, t in zip(keys, out):
            codes[k].copy_(t)
        return True

    def load(self, dtype: StateDtype, codes: dict[str, torch.Tensor],
             numel: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Codes (as for store) dequantised into new fp32 blocks m and v; None where not (bf16 goes op by op: two
        conversions)."""
        if dtype is not StateDtype.INT8 or codes["exp_avg"].device.type != "cpu" or numel % INT8_BLOCK:
            return None
        return self._call(dequantize_int8, codes["exp_avg"], codes["exp_avg.scale"], codes["exp_avg_sq"],
                          codes["exp_avg_sq.scale"])
