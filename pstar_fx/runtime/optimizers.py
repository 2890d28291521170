"""The update of one flat chunk, for every optimizer: Adam / AdamW through adam.py (torch's fused kernels, the CPU
worker's blocked update), any other (the general route, pstar_fx/optim/elementwise.py) through torch's own
optimizer class on the chunk's flat views.

The general route, per chunk: torch's optimizer object is made for the call (a few microseconds), its one parameter
is the flat parameter view (the fp32 master in mixed precision) with the flat gradient as its `.grad`, and its state
is the chunk's state views under torch's keys, the 0-d ones as CPU copies (where torch keeps step counts); `step()`
updates them in place. At a chunk's first step (its counter is 0) torch starts from an empty state, as for a
parameter in eager PyTorch, and makes its states itself (SGD's momentum buffer is the first gradient; Adagrad's sum
starts at initial_accumulator_value); they are copied into the chunk's buffer. Long chunks go in blocks of
HOST_BLOCK elements, each block a call over the same starting 0-d states (so every block computes the same new
ones, written once at the end): the blocks' values are those of one call, element by element, and the temporaries
of a first step stay block-sized.
"""
from __future__ import annotations

import torch

from ..optim import STEPS, AdamConfig, TorchConfig
from .adam import HOST_BLOCK, HOST_PACKED_BLOCK, adam_step, block_gradient
from .adam import host_step as adam_host_step
from .quantize import Packed, is_packed


def device_step(cfg, param: torch.Tensor, grad: torch.Tensor, parts: dict[str, torch.Tensor],
                packed: Packed | None = None) -> None:
    """One update of a flat chunk (fp32 param or master, and its fp32 gradient) where its tensors are. packed:
    Adam's compressed moments (the views of parts, with their scratch)."""
    if isinstance(cfg, AdamConfig):
        if packed is not None:
            adam_step(cfg, param, grad, None, None, parts["step"], packed=packed)
        else:
            adam_step(cfg, param, grad, parts["exp_avg"], parts["exp_avg_sq"], parts["step"])
        return
    assert packed is None, "only Adam's states are compressed"
    run = _TorchRun(cfg, parts)
    n = param.numel()
    for lo in range(0, n, HOST_BLOCK):
        hi = min(n, lo + HOST_BLOCK)
        run.block(param[lo:hi], grad[lo:hi], lo, hi)
    run.finish()


def host_update(cfg, param: torch.Tensor, grad: torch.Tensor, parts: dict[str, torch.Tensor], *,
                master: torch.Tensor | None, inv_scale: float | None, coef: torch.Tensor | None, skip: bool,
                block: int = HOST_BLOCK, chunk: int = 0, first: int = 0,
                packed_block: int = HOST_PACKED_BLOCK, live: int | None = None) -> None:
    """One host-side update of a flat chunk, block by block (see adam.host_step, which Adam / AdamW run): in mixed
    precision the gradient block is converted to fp32, unscaled and clipped, the master stepped and the parameters
    written from it while the block is in cache. `skip` (fp16 overflow): no update. chunk, first: the chunk's id
    and the chunk element its shard starts at (compressed moments' random bits); packed_block: the elements of a
    compressed update's blocks.

    `live` (None: every element): the elements of the shard that can hold parameters lie in [0, live); past it is
    the chunk's padding, zero in the parameters, the gradient, the master and the moments. Adam / AdamW with exact
    moments then update only the prefix (live_prefix: live rounded up to LIVE_ALIGN, within the shard): Adam keeps a
    zero element with a zero gradient and zero moments at zero (+0.0), so the padding ends as it would have, and
    torch's fused CPU kernel computes every element of an aligned prefix exactly as in the call over the whole
    shard. Compressed moments (their scales span blocks) and the other optimizers (whose states need not stay zero)
    update every element."""
    if isinstance(cfg, AdamConfig) and live is not None and not is_packed(parts):
        n = live_prefix(live, param.numel())
        if n < param.numel():
            param, grad = param[:n], grad[:n]
            parts = {k: v[:n] if v.dim() == 1 else v for k, v in parts.items()}
            master = None if master is None else master[:n]
    if isinstance(cfg, AdamConfig):
        if is_packed(parts):
            adam_host_step(cfg, param, grad, None, None, parts["step"], master=master, inv_scale=inv_scale,
                           coef=coef, skip=skip, block=block,
                           packed=Packed(parts, chunk, first, block=packed_block))
            return
        adam_host_step(cfg, param, grad, parts["exp_avg"], parts["exp_avg_sq"], parts["step"], master=master,
                       inv_scale=inv_scale, coef=coef, skip=skip, block=block)
        return
    if skip:
        if master is not None:
            param.copy_(master)
        return
    run = _TorchRun(cfg, parts)
    n = param.numel()
    g32 = torch.empty(min(block, n), dtype=torch.float32) if master is not None else None
    for lo in range(0, n, block):
        hi = min(n, lo + block)
        g = block_gradient(grad, lo, hi, g32, inv_scale, coef)
        run.block(param[lo:hi] if master is None else master[lo:hi], g, lo, hi)
        if master is not None:
            param[lo:hi].copy_(master[lo:hi])
    run.finish()


# live_prefix's rounding: a multiple of every CPU vector width and of the fused CPU kernel's work unit (a cache
# line), so each element of the prefix takes the same vector path as in a call over the whole shard
LIVE_ALIGN = 4096


def live_prefix(live: int, numel: int) -> int:
    """The elements of a flat shard of `numel` whose first `live` can hold parameters that an update must cover:
    `live` rounded up to LIVE_ALIGN, at most numel."""
    return min(numel, max(0, -(-live // LIVE_ALIGN) * LIVE_ALIGN))


class _TorchRun:
    """One chunk's update through torch's optimizer class, block by block (module docstring)."""

    def __init__(self, cfg: TorchConfig, parts: dict[str, torch.Tensor]):
        self.cfg = cfg
        self.parts = parts
        counter = parts.get(STEPS)
        self.first = counter is None or float(counter) == 0
        self.before = {} if self.first else {k: parts[k].to("cpu", copy=True) for k in cfg.scalars}
        self.after: dict[str, torch.Tensor] = {}

    def block(self, p: torch.Tensor, g: torch.Tensor, lo: int, hi: int) -> None:
        cfg = self.cfg
        if self.first:
            opt = cfg.cls([p], **cfg.kwargs)      # with the states torch makes at construction (Adagrad's sum)
        else:
            opt = cfg.cls([torch.zeros(1, dtype=p.dtype)], **cfg.kwargs)
            opt.param_groups[0]["params"] = [p]
            opt.state.clear()
            opt.state[p] = {**{k: self.parts[k][lo:hi] for k in cfg.vectors},
                            **{k: v.clone() for k, v in self.before.items()}}
        p.grad = g
        try:
            opt.step()
        finally:
            p.grad = None
        state = opt.state[p]
        unknown = set(state) - set(cfg.vectors) - set(cfg.scalars)
        assert not unknown, f"{cfg.name} made states {sorted(unknown)} that its options' probe did not show"
        for k in cfg.vectors:
            if k in state:
                dst = self.parts[k][lo:hi]
                if state[k].data_ptr() != dst.data_ptr():
                    dst.copy_(state[k].reshape(-1))
        self.after = {k: state[k] for k in cfg.scalars if k in state}

    def finish(self) -> None:
        for k, v in self.after.items():
            self.parts[k].copy_(v.reshape(()))
        if STEPS in self.parts:
            self.parts[STEPS].add_(1)
