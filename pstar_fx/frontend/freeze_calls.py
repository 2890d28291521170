"""A model tensor's `requires_grad` changed inside the user's step function: refused, since which parameters train is
fixed when the step compiles (the chunk layout, the gradients and the optimizer's groups follow from it). The tracer
checks every torch-level call the step function makes against this, on the tensors the model is called with."""
from __future__ import annotations

import torch

from ..errors import UntraceableError

_SETTER = torch._C.TensorBase.__dict__["requires_grad"]


def _new_flag(func, args: tuple, kwargs: dict):
    """The flag a call sets, or None where the call sets none (`t.requires_grad_(flag)`, `t.requires_grad = flag`)."""
    if func is torch.Tensor.requires_grad_:
        return kwargs.get("requires_grad", args[1] if len(args) > 1 else True)
    if getattr(func, "__self__", None) is _SETTER and getattr(func, "__name__", "") == "__set__":
        return args[1] if len(args) > 1 else None
    return None


def reject(func, args: tuple, kwargs: dict, names: dict[int, str], where: str) -> None:
    """Raise UntraceableError where the call changes the `requires_grad` of a model tensor (`names`: id -> name)."""
    flag = _new_flag(func, args, kwargs)
    if flag is None or not args or id(args[0]) not in names or bool(flag) == args[0].requires_grad:
        return
    name = names[id(args[0])]
    raise UntraceableError(
        f"cannot trace the training step: the step function sets requires_grad={bool(flag)} on {name} {where}; which "
        "parameters train is fixed when the step compiles its first batch. Set it before the first step; to change "
        "it later, call step.sync_model(), set it on the model and compile a new step")
