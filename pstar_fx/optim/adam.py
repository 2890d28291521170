"""`px.Adam` and `px.AdamW`, which run pstar-fx's own chunk kernels (runtime/adam.py: torch's fused Adam), and
the checks torch.optim applies to their options.

They take torch.optim.Adam / torch.optim.AdamW's arguments with the same meaning. `params` is optional: without it
one group holds every parameter of the model given to `px.compile`; with it (torch's forms: an iterable of tensors,
or of `{"params": [...], "lr": ..., ...}` dicts) the groups hold the model's tensors and each group's unspecified
options take the constructor's values, as in torch. The description is resolved against the model by `px.compile`,
which builds the live optimizer (`pstar_fx/api/live_optimizer.py`, `step.optimizer`). Options pstar-fx does not
support raise a ValueError that says so, rather than being silently ignored.

`state_dtype` ("fp32", the default and exact; "bf16"; "int8") is how the moments m and v are stored (see
optim/state_dtype.py): it changes the chunk state layout, hence the plan's bytes, not torch's options (the live
optimizer and its state_dict() show fp32 moments whatever it is).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from .spec import ADAM_STATE, OptimizerSpec, is_real, param_groups
from .state_dtype import StateDtype, parse_state_dtype


@dataclass(frozen=True)
class AdamConfig:
    """The option values of one parameter group at one step: what the chunk kernels read."""
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


def refuse_torch_modes(where: str, opts: Mapping[str, Any], construction: bool) -> None:
    """torch.optim's modes pstar-fx does not run: differentiable=True always; at construction also capturable=True
    (pstar-fx schedules the step) and foreach=True (it updates whole flat chunks)."""
    if opts.get("differentiable"):
        raise ValueError(f"{where}: differentiable=True is not supported")
    if construction:
        if opts.get("capturable"):
            raise ValueError(f"{where}: capturable=True is not supported (pstar-fx schedules the step itself)")
        if opts.get("foreach"):
            raise ValueError(f"{where}: foreach=True is not supported: pstar-fx updates whole flat chunks; "
                             "leave foreach=None")


def check_options(where: str, opts: Mapping[str, Any], decoupled: bool, *, construction: bool) -> AdamConfig:
    """torch.optim.Adam's checks on one group's options (with its messages, e.g. "Invalid learning rate: nan"),
    plus what torch accepts but pstar-fx cannot honour; NaN and inf are rejected everywhere (torch accepts an inf
    lr, eps or weight_decay, which turns every parameter into NaN or inf at the first step). `where` prefixes the
    messages. construction=False: the checks made at every step, on options possibly set through param_groups or
    loaded from a state dict (foreach and capturable are then how torch would have run; pstar-fx's chunk kernels
    give the same values, so they are accepted)."""
    missing = [k for k in ("lr", "betas", "eps", "weight_decay") if k not in opts]
    if missing:
        raise ValueError(f"{where}: the group has no {', '.join(missing)}: not an Adam group (another optimizer's "
                         "state dict?)")
    lr, betas, eps, wd = opts["lr"], opts["betas"], opts["eps"], opts["weight_decay"]
    if isinstance(lr, torch.Tensor):
        raise ValueError(f"{where}: lr must be a Python float, got a tensor (tensor learning rates are not "
                         "supported yet)")
    if not is_real(lr):
        raise ValueError(f"{where}: lr must be a float, got {lr!r}")
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2 and all(is_real(b) for b in betas)):
        raise ValueError(f"{where}: betas must be a pair of floats such as (0.9, 0.999), got {betas!r}")
    for arg, value in (("eps", eps), ("weight_decay", wd)):
        if not is_real(value):
            raise ValueError(f"{where}: {arg} must be a float, got {value!r}")
    if not (0.0 <= lr < math.inf):
        raise ValueError(f"{where}: Invalid learning rate: {lr}")
    if not (0.0 <= eps < math.inf):
        raise ValueError(f"{where}: Invalid epsilon value: {eps}")
    for i, b in enumerate(betas):
        if not 0.0 <= b < 1.0:
            raise ValueError(f"{where}: Invalid beta parameter at index {i}: {b} (betas must be in [0, 1))")
    if not (0.0 <= wd < math.inf):
        raise ValueError(f"{where}: Invalid weight_decay value: {wd}")
    fused = opts.get("fused")
    if fused not in (None, True, False):
        raise ValueError(f"{where}: fused must be None, True or False, got {fused!r}")
    if opts.get("amsgrad"):
        raise ValueError(f"{where}: amsgrad=True is not supported yet; use amsgrad=False")
    refuse_torch_modes(where, opts, construction)
    return AdamConfig(lr=float(lr), beta1=float(betas[0]), beta2=float(betas[1]), eps=float(eps),
                      weight_decay=float(wd), decoupled=bool(opts.get("decoupled_weight_decay", decoupled)),
                      maximize=bool(opts.get("maximize", False)), fused=fused)


def _make(name: str, decoupled: bool, params, lr, betas, eps, weight_decay, amsgrad, foreach, maximize,
          capturable, differentiable, fused, state_dtype) -> OptimizerSpec:
    dtype = parse_state_dtype(state_dtype, f"px.{name}")
    groups = param_groups(name, params)
    defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, foreach=foreach,
                    maximize=maximize, capturable=capturable, differentiable=differentiable, fused=fused)
    config = check_options(f"px.{name}", defaults, decoupled, construction=True)
    defaults["betas"] = (config.beta1, config.beta2)      # torch requires both floats (or both tensors)
    for i, g in enumerate(groups or ()):
        merged = {**defaults, **{k: v for k, v in g.items() if k != "params"}}
        check_options(f"px.{name}: parameter group {i}", merged, decoupled, construction=True)
        if "betas" in g:
            g["betas"] = tuple(float(b) for b in g["betas"])
    return OptimizerSpec(torch_class=torch.optim.AdamW if decoupled else torch.optim.Adam, defaults=defaults,
                         groups=groups, state=ADAM_STATE.with_dtype(dtype), config=config)


def Adam(params=None, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
         weight_decay: float = 0.0, amsgrad: bool = False, *, foreach: bool | None = None,
         maximize: bool = False, capturable: bool = False, differentiable: bool = False,
         fused: bool | None = None, state_dtype: str | StateDtype = "fp32") -> OptimizerSpec:
    """Adam with torch.optim.Adam's arguments and meaning (weight_decay is an L2 term added to the gradient).
    params: None (every parameter of the model, one group) or torch's tensors / parameter-group dicts.
    state_dtype: "fp32" (exact), "bf16" or "int8": how m and v are stored (module docstring)."""
    return _make("Adam", False, params, lr, betas, eps, weight_decay, amsgrad, foreach, maximize, capturable,
                 differentiable, fused, state_dtype)


def AdamW(params=None, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
          weight_decay: float = 1e-2, amsgrad: bool = False, *, foreach: bool | None = None,
          maximize: bool = False, capturable: bool = False, differentiable: bool = False,
          fused: bool | None = None, state_dtype: str | StateDtype = "fp32") -> OptimizerSpec:
    """AdamW with torch.optim.AdamW's arguments and meaning (decoupled weight decay).
    params: None (every parameter of the model, one group) or torch's tensors / parameter-group dicts.
    state_dtype: "fp32" (exact), "bf16" or "int8": how m and v are stored (module docstring)."""
    return _make("AdamW", True, params, lr, betas, eps, weight_decay, amsgrad, foreach, maximize, capturable,
                 differentiable, fused, state_dtype)
