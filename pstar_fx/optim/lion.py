"""Lion (Chen et al., 2023, "Symbolic Discovery of Optimization Algorithms"): a sign update of an interpolated
momentum. torch.optim has none, so `LionOptimizer` is one, written as a torch.optim.Optimizer that works in eager
PyTorch too, and `px.Lion(...)` runs it through the general route (optim/elementwise.py) like any elementwise torch
optimizer. It also shows the way for an update of your own: write it as a torch.optim.Optimizer subclass whose
step treats each element on its own, and pass the class to `px.optim_from_torch`.
"""
from __future__ import annotations

import torch

from .elementwise import optim_from_torch, refuse_state_dtype
from .spec import OptimizerSpec


class LionOptimizer(torch.optim.Optimizer):
    """Per element, with c = beta1 * m + (1 - beta1) * g: p <- p * (1 - lr * weight_decay) - lr * sign(c), then
    m <- beta2 * m + (1 - beta2) * g. State: 'exp_avg' (m), made at a parameter's first step, zero."""

    def __init__(self, params, lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99), weight_decay: float = 0.0,
                 *, maximize: bool = False):
        if not 0.0 <= lr:
            raise ValueError(f"Invalid learning rate: {lr}")
        for i, b in enumerate(betas):
            if not 0.0 <= b <= 1.0:
                raise ValueError(f"Invalid beta parameter at index {i}: {b}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay, maximize=maximize))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, (beta1, beta2), wd = group["lr"], group["betas"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = -p.grad if group["maximize"] else p.grad
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                m = state["exp_avg"]
                if wd != 0:
                    p.mul_(1 - lr * wd)
                p.add_(torch.sign(m.lerp(grad, 1 - beta1)), alpha=-lr)
                m.lerp_(grad, 1 - beta2)
        return loss


def Lion(params=None, lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99), weight_decay: float = 0.0, *,
         maximize: bool = False, state_dtype=None) -> OptimizerSpec:
    """Lion (LionOptimizer's arguments and meaning) on chunk views; one per-element state, no step count. A
    state_dtype is refused (ValueError): only px.Adam / px.AdamW compress their states."""
    if state_dtype is not None:
        refuse_state_dtype("px.Lion", "Lion")
    return optim_from_torch(LionOptimizer, params, lr=lr, betas=betas, weight_decay=weight_decay, maximize=maximize)
