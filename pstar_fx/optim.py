"""Optimizer descriptions: `px.Adam` and `px.AdamW`.

They take torch.optim.Adam / torch.optim.AdamW's arguments (without `params`: pstar-fx owns the parameters) with the
same meaning, and are applied chunk-wise by the runtime (`runtime/adam.py`). Options pstar-fx does not support yet
raise a ValueError that says so, rather than being silently ignored.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AdamConfig:
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    decoupled: bool          # True: AdamW (decay the parameter), False: Adam (L2 added to the gradient)
    maximize: bool
    fused: bool | None       # None: torch's fused kernel where it exists; False: the reference formula

    @property
    def name(self) -> str:
        return "AdamW" if self.decoupled else "Adam"


def _is_real(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _make(name: str, decoupled: bool, lr, betas, eps, weight_decay, amsgrad, foreach, maximize, capturable,
          differentiable, fused) -> AdamConfig:
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2 and all(_is_real(b) for b in betas)):
        raise ValueError(f"px.{name}: betas must be a pair of floats such as (0.9, 0.999), got {betas!r}")
    for arg, value in (("eps", eps), ("weight_decay", weight_decay)):
        if not _is_real(value):
            raise ValueError(f"px.{name}: {arg} must be a float, got {value!r}")
    if fused not in (None, True, False):
        raise ValueError(f"px.{name}: fused must be None, True or False, got {fused!r}")
    if not _is_real(lr):
        raise ValueError(f"px.{name}: lr must be a Python float, got {type(lr).__name__} "
                         "(tensor learning rates are not supported yet)")
    if lr < 0.0:
        raise ValueError(f"px.{name}: invalid learning rate {lr}")
    if eps < 0.0:
        raise ValueError(f"px.{name}: invalid epsilon value {eps}")
    if not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"px.{name}: invalid betas {betas}: each must be in [0, 1)")
    if weight_decay < 0.0:
        raise ValueError(f"px.{name}: invalid weight_decay value {weight_decay}")
    if amsgrad:
        raise ValueError(f"px.{name}: amsgrad=True is not supported yet; use amsgrad=False")
    if capturable:
        raise ValueError(f"px.{name}: capturable=True is not supported (pstar-fx schedules the step itself)")
    if differentiable:
        raise ValueError(f"px.{name}: differentiable=True is not supported")
    if foreach:
        raise ValueError(f"px.{name}: foreach=True is not supported: pstar-fx updates whole flat chunks; "
                         "leave foreach=None")
    return AdamConfig(lr=float(lr), beta1=float(betas[0]), beta2=float(betas[1]), eps=float(eps),
                      weight_decay=float(weight_decay), decoupled=decoupled, maximize=bool(maximize),
                      fused=fused)


def Adam(lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
         weight_decay: float = 0.0, amsgrad: bool = False, *, foreach: bool | None = None,
         maximize: bool = False, capturable: bool = False, differentiable: bool = False,
         fused: bool | None = None) -> AdamConfig:
    """Adam with torch.optim.Adam's arguments and meaning (weight_decay is an L2 term added to the gradient)."""
    return _make("Adam", False, lr, betas, eps, weight_decay, amsgrad, foreach, maximize, capturable,
                 differentiable, fused)


def AdamW(lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
          weight_decay: float = 1e-2, amsgrad: bool = False, *, foreach: bool | None = None,
          maximize: bool = False, capturable: bool = False, differentiable: bool = False,
          fused: bool | None = None) -> AdamConfig:
    """AdamW with torch.optim.AdamW's arguments and meaning (decoupled weight decay)."""
    return _make("AdamW", True, lr, betas, eps, weight_decay, amsgrad, foreach, maximize, capturable,
                 differentiable, fused)
