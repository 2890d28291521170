"""Adam / AdamW on whole flat chunks.

`fused=None` uses torch's fused kernel (`torch._fused_adam_` / `torch._fused_adamw_`, on CPU and CUDA) where the
dtype allows; `fused=False` applies torch.optim's single-tensor formula op by op, which reproduces
`torch.optim.AdamW(foreach=False)` bit for bit. Both work in place on (param, grad, m, v, step) views of the chunk.
Compressed moments (state_dtype bf16 / int8: `packed`, runtime/quantize.py) on the CPU go through the native
kernel (runtime/native/adam.c: torch's formula in one pass over the chunk, no scratch) where it is built, on the GPU
through the same arithmetic in one Triton kernel (runtime/device_adam.py) where Triton is installed; elsewhere block
by block through fp32 scratch around the same torch kernels as exact moments.
"""
from __future__ import annotations

import torch

from ..optim import AdamConfig
from . import device_adam, native
from .quantize import Packed, seed


def _fused_ok(cfg: AdamConfig, param: torch.Tensor) -> bool:
    if cfg.fused is False:
        return False
    return param.dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def adam_step(cfg: AdamConfig, param: torch.Tensor, grad: torch.Tensor, m: torch.Tensor | None,
              v: torch.Tensor | None, step: torch.Tensor, packed: Packed | None = None) -> None:
    """One update of a flat chunk. `step` is a 0-d fp32 tensor, incremented here (as torch.optim does).
    packed: compressed moments (m and v are then None), updated block by block through their scratch."""
    step += 1
    if packed is None:
        _apply(cfg, param, grad, m, v, step)
        return
    if _native(cfg, packed, param, None, grad, step, None, None):
        return
    if device_adam.takes(cfg, param, grad):
        device_adam.adam(cfg, param, grad, packed.parts, step, packed.chunk, packed.first)
        return
    for lo, hi in packed.blocks():
        pm, pv = packed.load(lo, hi)
        _apply(cfg, param[lo:hi], grad[lo:hi], pm, pv, step)
        packed.store(lo, hi, step)


# elements per block of a host-side update: a multiple of every vector width and of the CPU fused kernel's work
# unit, so a block's elements round exactly as in one call over the whole chunk. Each block costs three parallel
# regions and a few Python calls (about 0.1 ms with 14 threads), so it should not be small; its conversions and its
# update should share the cache, so it should not be large. On the H200 machine's host (14 threads, a 100M-element
# mixed-precision chunk, benchmarks/host_pin_and_update.py): 1M elements 2.54 Gparam/s, 2M 2.84, 4M 2.99, 8M 2.90.
HOST_BLOCK = 1 << 22


# a compressed host update's block on the torch route (no native kernels, or fused=False; a multiple of INT8_BLOCK).
# Each block runs about 40 ops, each a parallel region of its own, so the block must be large enough for every thread
# to have work: on the H200 machine's host (16 threads, a 16.8M-element chunk, benchmarks/state_update_rate.py with
# PSTAR_FX_NATIVE=0) blocks of 1M elements updated bf16 moments at 1.00 Gparam/s and int8 at 0.49, blocks of 256K at
# 0.35 and 0.17 (fp32: 3.5). Its scratch: 24 MiB (six fp32 values an element). Inductor-compiled quantisers (one
# loop for several ops) were slower there than these ops (0.41, 0.17).
HOST_PACKED_BLOCK = 1 << 20


def block_gradient(grad: torch.Tensor, lo: int, hi: int, g32: torch.Tensor | None, inv_scale: float | None,
                   coef: torch.Tensor | None) -> torch.Tensor:
    """Elements [lo, hi) of a host-side update's gradient as the update reads them: in mixed precision (`g32`, an
    fp32 scratch of at least a block) converted to fp32 and unscaled (fp16's `inv_scale`); clipped by `coef`. In
    fp32 a view of the gradient, clipped in place."""
    if g32 is None:
        g = grad[lo:hi]
    else:
        g = g32[:hi - lo]
        g.copy_(grad[lo:hi])
        if inv_scale is not None:
            g.mul_(inv_scale)
    if coef is not None:
        g.mul_(coef)
    return g


def host_step(cfg: AdamConfig, param: torch.Tensor, grad: torch.Tensor, m: torch.Tensor | None,
              v: torch.Tensor | None, step: torch.Tensor, *, master: torch.Tensor | None = None,
              inv_scale: float | None = None, coef: torch.Tensor | None = None, skip: bool = False,
              block: int = HOST_BLOCK, packed: Packed | None = None) -> None:
    """One host-side update of a flat chunk, block by block so that each block is read once from memory: in mixed
    precision (`master` given) the half-precision gradient is converted to fp32, unscaled (fp16) and clipped, the
    fp32 master stepped and the new half-precision parameters written from it, all while the block is in cache.
    The same operations, element by element, as converting, stepping and writing the whole chunk in turn.
    `skip` (fp16 overflow): no update; the parameters are rewritten from the masters.
    packed: compressed moments (m and v are then None), dequantised, updated and quantised back block by block."""
    if skip:
        if master is not None:
            param.copy_(master)
        return
    step += 1
    if packed is not None and _native(cfg, packed, param if master is None else master,
                                      None if master is None else param, grad, step,
                                      None if master is None else inv_scale, coef):   # as block_gradient
        return
    n = param.numel()
    done = 0 if packed is not None or master is None else _native_exact(cfg, param, grad, m, v, step, master,
                                                                           inv_scale, coef)
    spans = ((lo, min(n, lo + block)) for lo in range(done, n, block)) if packed is None else \
        packed.blocks()
    g32 = None
    if master is not None:
        g32 = torch.empty(min(block if packed is None else packed.block, n - done), dtype=torch.float32)
    for lo, hi in spans:
        bm, bv = (m[lo:hi], v[lo:hi]) if packed is None else packed.load(lo, hi)
        g = block_gradient(grad, lo, hi, g32, inv_scale, coef)
        _apply(cfg, param[lo:hi] if master is None else master[lo:hi], g, bm, bv, step)
        if master is not None:
            param[lo:hi].copy_(master[lo:hi])
        if packed is not None:
            packed.store(lo, hi, step)


def _native_exact(cfg: AdamConfig, param: torch.Tensor, grad: torch.Tensor, m: torch.Tensor, v: torch.Tensor,
                  step: torch.Tensor, master: torch.Tensor, inv_scale: float | None, coef: torch.Tensor | None) -> int:
    """A mixed-precision update of exact moments in the native kernel (runtime/native/adam.c pstar_adam_exact: one
    pass, where the torch route converts the gradient into scratch, runs torch's fused kernel and copies the master
    into the parameter), over the chunk's first n - n % 16 elements, which torch's kernel computes in its vector loop;
    the caller updates the rest. Taken only on the CPU where the kernels are built, torch's fused kernel is asked for
    (fused=False keeps torch.optim's formula op by op) and `native.reproduces_torch` found the kernel bit for bit
    torch's for this kind of update. Returns the elements updated (0: not taken)."""
    n = param.numel() - param.numel() % 16
    kernels = native.kernels() if param.device.type == "cpu" and n else None
    if (kernels is None or not _fused_ok(cfg, master) or master.dtype != torch.float32
            or m.dtype != torch.float32 or not kernels.takes(grad, param) or param.dtype == torch.float32
            or not all(t.is_contiguous() for t in (param, grad, m, v, master))
            or not native.reproduces_torch(kernels, cfg, grad.dtype, param.dtype, _exact_by_torch)):
        return 0
    kernels.adam_exact(cfg, float(step), master[:n], param[:n], grad[:n], m[:n], v[:n],
                       inv_scale=1.0 if inv_scale is None else inv_scale, coef=1.0 if coef is None else float(coef))
    return n


def _exact_by_torch(cfg: AdamConfig, param, grad, m, v, step: torch.Tensor, master, inv_scale: float,
                    coef: torch.Tensor) -> None:
    """The torch route of a mixed-precision update of exact moments (native.reproduces_torch compares with it)."""
    g = block_gradient(grad, 0, grad.numel(), torch.empty(grad.numel()), inv_scale, coef)
    _apply(cfg, master, g, m, v, step)
    param.copy_(master)


def _native(cfg: AdamConfig, packed: Packed, target: torch.Tensor, out: torch.Tensor | None, grad: torch.Tensor,
            step: torch.Tensor, inv_scale: float | None, coef: torch.Tensor | None) -> bool:
    """The whole update of compressed moments in the native kernel (runtime/native/adam.c: one pass, no scratch),
    where the moments are on the CPU, the kernels are built and the fused kernel is asked for (fused=False keeps
    torch.optim's formula op by op). target: the fp32 parameter or master; out: the half-precision parameter written
    from it. False: not taken."""
    if packed.native is None or not _fused_ok(cfg, target) or not packed.native.takes(grad, out):
        return False
    packed.native.adam(cfg, float(step), target, out, grad, packed.parts, packed.first,
                       int(seed(packed.chunk, step)), inv_scale=1.0 if inv_scale is None else inv_scale,
                       coef=1.0 if coef is None else float(coef))
    return True


def _apply(cfg: AdamConfig, param, grad, m, v, step: torch.Tensor) -> None:
    if _fused_ok(cfg, param):
        kernel = torch._fused_adamw_ if cfg.decoupled else torch._fused_adam_
        kernel([param], [grad], [m], [v], [], [step], lr=cfg.lr, beta1=cfg.beta1, beta2=cfg.beta2,
               weight_decay=cfg.weight_decay, eps=cfg.eps, amsgrad=False, maximize=cfg.maximize)
        return
    _reference_step(cfg, param, grad, m, v, float(step.item()))


def _reference_step(cfg: AdamConfig, param, grad, m, v, step: float) -> None:
    """torch.optim.adam._single_tensor_adam for one tensor (amsgrad off, real tensors, float lr)."""
    if cfg.maximize:
        grad = -grad
    if cfg.weight_decay != 0:
        if cfg.decoupled:
            param.mul_(1 - cfg.lr * cfg.weight_decay)
        else:
            grad = grad.add(param, alpha=cfg.weight_decay)
    m.lerp_(grad, 1 - cfg.beta1)
    v.mul_(cfg.beta2).addcmul_(grad, grad.conj(), value=1 - cfg.beta2)
    bias_correction1 = 1 - cfg.beta1 ** step
    bias_correction2 = 1 - cfg.beta2 ** step
    step_size = cfg.lr / bias_correction1
    bias_correction2_sqrt = bias_correction2 ** 0.5
    denom = (v.sqrt() / bias_correction2_sqrt).add_(cfg.eps)
    param.addcdiv_(m, denom, value=-step_size)
