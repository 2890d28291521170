"""Values made inside the trace that the step function kept outside it: refused.

A compiled step runs no Python, so what the step function stores while it is traced (`seen.append(loss.item())` in
a closure's list, `self.z = z.item()` on a Trainer subclass, `self.n = mask.sum().item()` on a module) is the
trace's placeholder, not a number: a `torch.SymFloat` whose `float()` is 0.0, or a fake tensor with no data, and
eager code reading it after the step gets nothing it can use. `escaped(model, fn)` looks where such a value can be
seen after the trace (one level deep, and into lists, tuples, sets and dicts there):

- the step function's closure cells and the globals its code loads (functools.wraps and partial followed:
  python_state.read_values), and the attributes of the object a bound-method step function belongs to
  (PstarTrainer's `self`): symbolic numbers and fake tensors;
- every module's own attributes (torch's `nn.Module` fields aside): symbolic numbers only, since a module may keep
  a fake tensor as a cache of its own (rotary tables), which the compiled step never reads.
"""
from __future__ import annotations

from typing import Callable, Iterator

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensor

from ..errors import UntraceableError
from .python_state import _MODULE_FIELDS, read_values

_SYMBOLIC = (torch.SymInt, torch.SymFloat, torch.SymBool)
_ITEMS = 4096            # items of a container looked at


def _leaf_paths(value, path: str) -> Iterator[tuple[str, object]]:
    """The value, and the items of a list, tuple, set or dict it is (one level), with their paths."""
    yield path, value
    if isinstance(value, (list, tuple)):
        for i, x in enumerate(value[:_ITEMS]):
            yield f"{path}[{i}]", x
    elif isinstance(value, (set, frozenset)):
        for x in list(value)[:_ITEMS]:
            yield f"{path}{{...}}", x
    elif isinstance(value, dict):
        for i, (k, x) in enumerate(value.items()):
            if i >= _ITEMS:
                break
            yield f"{path}[{k!r}]", x


def _kind(x, tensors: bool) -> str | None:
    if isinstance(x, _SYMBOLIC):
        return f"a {type(x).__name__}" + (" (a .item() read inside the step)" if isinstance(x, torch.SymFloat) else "")
    if tensors and isinstance(x, FakeTensor):
        return "a tensor made inside the step (the trace's fake tensor, with no values)"
    return None


def escaped(model: nn.Module, fn: Callable) -> list[tuple[str, str]]:
    """(where, what) for each value made inside the trace that the step function left where eager code can reach
    it after the step (see the module docstring)."""
    label = {"closure": "the step function's {}", "global": "the global {}", "partial": "a functools.partial argument"}
    places: list[tuple[str, object, bool]] = [(label[kind].format(name), v, True)
                                              for kind, name, v in read_values(fn)]
    owner = getattr(fn, "__self__", None)
    if owner is not None and not isinstance(owner, nn.Module) and hasattr(owner, "__dict__"):
        kind = type(owner).__name__
        places.extend((f"{kind}.{name}", v, True) for name, v in vars(owner).items())
    for mname, m in model.named_modules():
        places.extend((f"model.{mname + '.' if mname else ''}{name}", v, False)
                      for name, v in vars(m).items() if name not in _MODULE_FIELDS)
    out = []
    for where, value, tensors in places:
        for path, x in _leaf_paths(value, where):
            what = _kind(x, tensors)
            if what is not None:
                out.append((path, what))
    return out


def reject(model: nn.Module, fn: Callable) -> None:
    """Raise UntraceableError naming where the step function kept a value made inside the trace (`escaped`)."""
    leaked = escaped(model, fn)
    if leaked:
        raise UntraceableError(
            f"the step function kept a value made inside the step where code outside it can read it: "
            f"{'; '.join(f'{what} in {where}' for where, what in leaked[:3])}{'; ...' if len(leaked) > 3 else ''}. "
            "A compiled step runs no Python, so what it stores is the trace's placeholder, not a value (a SymFloat's "
            "float() is 0.0). Return it beside the loss instead, `return loss, {\"z\": z.detach()}`, and read it "
            "from what the step returns (docs/api.md, Auxiliary outputs), or compute it outside the step")
