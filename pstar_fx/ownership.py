"""Who holds a model's values: the model itself, or a compiled step's chunks. Never both, so never a stale copy.

Once a compiled step has copied a model's parameters and buffers into its chunks, it *holds* the model: each of the
model's parameter and buffer objects is turned, in place (`torch.utils.swap_tensors`, so every reference the user
kept sees it too), into a `HeldTensor` with the same shape, dtype, device and requires_grad but no data. Using one
raises `ModelHeldError`, which says how to get the values; the model's own copy of the data is freed (pstar-fx keeps
one copy of the model, in its chunks). `release(model, values)` turns the same objects back into real tensors with
the given values: the model is the user's again, and the next step copies it into the chunks anew, so edits made in
between are seen.

What stays readable on a held model: shapes, dtypes, `requires_grad` (and `requires_grad_()`, which the next step
sees), module structure, `model.train()` / `model.eval()`.
"""
from __future__ import annotations

import weakref

import torch
import torch.nn as nn

from .errors import ModelHeldError

_METADATA_OPS = {torch.ops.aten.detach.default, torch.ops.aten.alias.default}


class HeldTensor(torch.Tensor):
    """A model tensor whose value lives in a compiled step's chunks (see the module docstring)."""

    @staticmethod
    def __new__(cls, like: torch.Tensor, name: str, owner):
        t = torch.Tensor._make_wrapper_subclass(cls, like.shape, dtype=like.dtype, device=like.device,
                                                requires_grad=like.requires_grad)
        t._pstar_name = name
        t._pstar_owner = owner          # a weakref to the holder
        return t

    def __repr__(self, *, tensor_contents=None) -> str:
        return (f"HeldTensor({self._pstar_name}, shape={tuple(self.shape)}, dtype={self.dtype}: held by a "
                "pstar-fx step; step.sync_model() gives it back)")

    def __reduce_ex__(self, protocol):
        raise _error(self._pstar_name, "saved")

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        held = [a for a in args if isinstance(a, HeldTensor)]
        if func in _METADATA_OPS and held:
            return HeldTensor(held[0], held[0]._pstar_name, held[0]._pstar_owner)
        name = held[0]._pstar_name if held else "?"
        raise _error(name, f"used by {func}")

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))


def _error(name: str, how: str) -> ModelHeldError:
    return ModelHeldError(
        f"'{name}' is held by a pstar-fx compiled step and was {how}: its current value lives in the step's chunks, "
        "not in the model. Call step.sync_model() to write the trained values back into the model (the next step "
        "takes them again, with any edits you made), or read step.state_dict().")


def holder(t: torch.Tensor):
    """The object holding a model tensor, or None when the tensor holds its own value."""
    if not isinstance(t, HeldTensor):
        return None
    return t._pstar_owner()


def model_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every distinct parameter and buffer of the model, by its first name (tied tensors once)."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, t in list(model.named_parameters(remove_duplicate=False)) + list(
            model.named_buffers(remove_duplicate=False)):
        if t is not None and id(t) not in seen:
            seen.add(id(t))
            out[name] = t
    return out


def hold(model: nn.Module, owner) -> None:
    """Turn the model's parameters and buffers into HeldTensors held by `owner` (their data is dropped)."""
    ref = weakref.ref(owner)
    for name, t in model_tensors(model).items():
        if isinstance(t, HeldTensor):
            t._pstar_owner = ref
            continue
        stand_in = HeldTensor(t, name, ref)
        if isinstance(t, nn.Parameter):
            stand_in = nn.Parameter(stand_in, requires_grad=t.requires_grad)
        torch.utils.swap_tensors(t, stand_in)


def release(model: nn.Module, values: dict[str, torch.Tensor]) -> None:
    """Give the model its values back: each HeldTensor becomes a real tensor (the same Python object)."""
    for name, t in model_tensors(model).items():
        if not isinstance(t, HeldTensor):
            continue
        v = values[name].detach().clone()
        real = nn.Parameter(v, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else v
        torch.utils.swap_tensors(t, real)
