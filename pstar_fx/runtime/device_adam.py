"""Adam / AdamW on compressed moments on the GPU in one Triton kernel (runtime/adam.py's compressed route there).

Each program takes ROWS int8 blocks (INT8_BLOCK elements each; bf16 moments have no blocks and take as many
elements): it reads the fp32 parameter (or master) and gradient and the codes, dequantises m and v, applies torch's
Adam formula in fp32, writes the parameter, and quantises m and v back with their random bits, the block's scale
from the new values; nothing is written to memory in between and no scratch is used. Before, the torch route did
this in about 40 kernels a block through fp32 scratch (bf16 2.45 and int8 0.87 Gparam/s on the H200 against 119
for exact states).

The arithmetic is adam.c's (runtime/native), operation for operation: divisions and square roots correctly rounded
(div_rn, sqrt_rn), and no multiply-add fused (the kernel is built with enable_fp_fusion=False), so the codes and
values are the native kernel's on the same inputs; the step-dependent scalars (lr / (1 - beta1^t),
sqrt(1 - beta2^t)) are computed in float64 inside the kernel from the step count on the device (no sync), then
rounded to fp32 once, as the native kernel's caller does in Python. Against torch's fused CUDA Adam (exact states)
the update agrees to fp32's last bits, not bit for bit.

Triton comes with torch's CUDA wheels; where it is missing (or `PSTAR_FX_NATIVE=0`, or `fused=False`) the torch
route serves. `why_not()` says why the kernel is not used.
"""
from __future__ import annotations

import contextlib
import functools
import os

import torch

from ..optim import INT8_BLOCK, AdamConfig
from .quantize import _CHUNK_K, _K1, _K2, _K3, _STEP_K, _TINY, _i32

_ROWS = 8        # int8 blocks per program (2048 elements)


def _split(x: float) -> tuple[float, float]:
    """x as two fp32 values whose sum in float64 is x to about 48 bits (Triton passes Python floats as fp32)."""
    hi = float(torch.tensor(x, dtype=torch.float32))
    return hi, x - hi


@functools.cache
def _triton():
    """The kernels' module (runtime/triton_adam.py), or the reason it is unavailable (a string)."""
    if os.environ.get("PSTAR_FX_NATIVE") == "0":
        return "PSTAR_FX_NATIVE=0"
    try:
        import triton.language as tl
    except ImportError as e:
        return f"triton is not importable ({e})"
    if not (hasattr(tl, "sqrt_rn") and hasattr(tl, "div_rn")):
        return "this Triton lacks sqrt_rn / div_rn"
    try:
        from . import triton_adam
    except Exception as e:       # a Triton that imports but cannot define the kernels
        return f"the Triton kernels could not be defined ({type(e).__name__}: {e})"
    return triton_adam


def why_not() -> str | None:
    """Why the Triton kernel is not used on the GPU (None: it is)."""
    k = _triton()
    return k if isinstance(k, str) else None


def takes(cfg: AdamConfig, param: torch.Tensor, grad: torch.Tensor) -> bool:
    """The kernel runs this update: CUDA tensors, fp32 parameter and gradient, the fused kernel asked for."""
    return (cfg.fused is not False and param.is_cuda and param.dtype == torch.float32
            and grad.dtype == torch.float32 and not isinstance(_triton(), str))


def adam(cfg: AdamConfig, param: torch.Tensor, grad: torch.Tensor, parts: dict, step: torch.Tensor, chunk: int,
         first: int) -> None:
    """One update of the fp32 parameter (or master) `param` from `grad` with the compressed moments of parts,
    step: the 0-d count after the update (on the device); chunk, first: the chunk's id and the chunk element the
    shard starts at (the random bits)."""
    k = _triton()
    n = param.numel()
    if n == 0:        # an empty shard: nothing to update (Triton takes no empty grid)
        return
    assert grad.numel() == n and param.is_contiguous() and grad.is_contiguous() and first + n < 1 << 31
    qm, qv = parts["exp_avg"], parts["exp_avg_sq"]
    lr, b1, b2 = _split(cfg.lr), _split(cfg.beta1), _split(cfg.beta2)
    scalars = dict(decay=1 - cfg.lr * cfg.weight_decay, wd=cfg.weight_decay, w1=1 - cfg.beta1, b2=cfg.beta2,
                   w2=1 - cfg.beta2, eps=cfg.eps)
    hashing = (_i32(chunk * _CHUNK_K + 0x27D4EB2F), _i32(_STEP_K), _i32(_K1), _i32(_K2), _i32(_K3))
    flags = dict(DECOUPLED=bool(cfg.decoupled), MAXIMIZE=bool(cfg.maximize), enable_fp_fusion=False)
    with torch.cuda.device(param.device) if param.is_cuda else contextlib.nullcontext():
        if qm.dtype == torch.bfloat16:
            block = _ROWS * INT8_BLOCK
            k.adam_bf16[(k.triton.cdiv(n, block),)](param, grad, qm, qv, step, n, first, *hashing, *lr, *b1, *b2,
                                                **scalars, BLOCK=block, **flags)
        else:
            k.adam_int8[(k.triton.cdiv(n, _ROWS * INT8_BLOCK),)](
                param, grad, qm, qv.view(torch.uint8), parts["exp_avg.scale"], parts["exp_avg_sq.scale"], step, n,
                first, *hashing, _TINY, *lr, *b1, *b2, **scalars, ROWS=_ROWS, BLOCK=INT8_BLOCK, **flags)
