"""The general route: any torch.optim optimizer whose update is elementwise, run by torch's own code on chunk views.

`px.optim_from_torch(torch.optim.RMSprop, lr=1e-3, alpha=0.9)` describes torch's optimizer with torch's arguments
(and `params` as for px.AdamW: None for one group of every parameter, or torch's tensors / group dicts).
pstar-fx packs parameters into flat chunks; an update that treats every element on its own (the element's value,
gradient and states, plus per-tensor scalars such as a step count) gives the same values on a chunk's flat slice
as on each parameter, so the runtime hands torch's optimizer the chunk's flat views (parameter, gradient, each
state) and calls its `step()` (runtime/torch_update.py). The states live in the chunk's state buffer like Adam's
moments, on the device or the host as the plan places them, and `step.optimizer` is a real object of that class.

Which optimizers qualify is checked, not assumed: `optim_from_torch` runs the class for a few steps on a small
2-D tensor and on the same values as two flat pieces; the two must agree, and every state must be of the
parameter's shape or 0-d. That also tells the state layout (which per-element and scalar states exist for the
groups' options). Optimizers that fail it (Adafactor's factored moments, Muon's orthogonalisation, LBFGS's
closure, SparseAdam's sparse gradients, any update that reads a whole tensor) raise a ValueError that says why.
Checked against eager torch in the tests: SGD, Adagrad, RMSprop, Adamax, NAdam, RAdam and px.Lion.

`px.SGD(...)` is this route over torch.optim.SGD with SGD's signature; `px.Lion(...)` over LionOptimizer
(optim/lion.py). Adam and AdamW given here use pstar-fx's own fused kernels (`px.Adam` / `px.AdamW`).
"""
from __future__ import annotations

import functools
import inspect
import math
from dataclasses import dataclass
from typing import Any, Mapping, NoReturn

import torch

from .adam import Adam, AdamW, refuse_torch_modes
from .spec import STEPS, OptimizerSpec, StateLayout, is_real, param_groups

# an update's time per element relative to torch's fused Adam: torch's single-tensor updates run op by op, a pass
# over memory each. Measured on a shared 2-core CPU (runtime.optimizers.host_update, 4M fp32 elements, against
# fused AdamW there): SGD with momentum 2.4x, Adamax 3.2x, Adagrad 3.4x, RMSprop 4.1x, NAdam 6.8x, RAdam 8.5x. One
# figure for all, their middle; not measured on the H200 machine's host nor on a GPU
TORCH_UPDATE_COST = 4.0

_WHY = {
    "LBFGS": "it needs a closure that re-evaluates the loss several times per step, over whole tensors (line "
             "search); a compiled step runs one forward and backward",
    "Adafactor": "its second moments are factored: row and column statistics of each 2-D parameter, states that "
                 "are not of the parameter's shape",
    "Muon": "it orthogonalises each 2-D parameter's update (Newton-Schulz iterations on the whole matrix)",
    "SparseAdam": "it takes sparse gradients",
}
_INSTEAD = ("Chunks hold flat, elementwise slices of parameters, so pstar-fx runs only updates that treat each "
            "element on its own. Use px.AdamW / px.Adam / px.SGD / px.Lion, or an elementwise torch optimizer "
            "through px.optim_from_torch (Adagrad, RMSprop, Adamax, NAdam, RAdam, ...)")


@dataclass(frozen=True)
class TorchConfig:
    """One group's options at one step, checked: what the runtime hands torch's optimizer (`kwargs`), and the
    states torch keeps for a parameter with these options (`vectors` of its shape, 0-d `scalars`)."""
    cls: type
    options: tuple[tuple[str, Any], ...]
    vectors: tuple[str, ...]
    scalars: tuple[str, ...]

    @property
    def kwargs(self) -> dict[str, Any]:
        """The constructor's options, single-tensor (foreach off): one flat tensor per call."""
        out = dict(self.options)
        if "foreach" in out:
            out["foreach"] = False
        return out

    @property
    def name(self) -> str:
        return self.cls.__name__

    @property
    def lr(self) -> float:
        """The group's learning rate (StepStats.lr reports it); NaN for a class without one."""
        return float(dict(self.options).get("lr", math.nan))


def _takes(cls: type, arg: str) -> bool:
    try:
        return arg in inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):
        return False


def _run(cls: type, opts: Mapping[str, Any], params: list[torch.Tensor], grads: list[list[torch.Tensor]]) -> Any:
    opt = cls(params, **opts)
    for step in grads:
        for p, g in zip(params, step):
            p.grad = g
        opt.step()
    return opt


def refuse_known(cls: type, where: str) -> None:
    """A ValueError saying why, for torch's optimizers known not to be elementwise."""
    if cls.__name__ in _WHY and getattr(torch.optim, cls.__name__, None) is cls:
        raise ValueError(f"{where}: torch.optim.{cls.__name__} cannot run on pstar-fx's chunks: {_WHY[cls.__name__]}. "
                         f"{_INSTEAD}")


def probe(cls: type, opts: Mapping[str, Any], where: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(per-element state keys, 0-d state keys) torch's `cls` keeps for a parameter with options `opts`, after
    checking that its update is elementwise: three steps on a 4x6 tensor and on the same values as two flat pieces
    (10 and 14 elements) agree, and every state is of the parameter's shape or 0-d. Raises ValueError otherwise."""
    refuse_known(cls, where)
    opts = dict(opts, **({"foreach": False} if _takes(cls, "foreach") else {}))
    gen = torch.Generator().manual_seed(0)
    start = torch.randn(4, 6, generator=gen)
    grads = [torch.randn(4, 6, generator=gen) for _ in range(3)]
    whole = start.clone()
    flat = start.clone().reshape(-1)
    pieces = [flat[:10], flat[10:]]
    try:
        a = _run(cls, opts, [whole], [[g.clone()] for g in grads])
        b = _run(cls, opts, pieces, [[g.reshape(-1)[:10].clone(), g.reshape(-1)[10:].clone()] for g in grads])
    except Exception as e:   # noqa: BLE001 - whatever the class raised on a plain tensor or on flat pieces
        raise ValueError(f"{where}: torch.optim-style {cls.__name__} failed on a flat slice of a tensor "
                         f"({type(e).__name__}: {e}), so it cannot run on pstar-fx's chunks. {_INSTEAD}") from None
    vectors, scalars = [], []
    state = a.state[whole]
    for k, v in state.items():
        if not isinstance(v, torch.Tensor):
            raise ValueError(f"{where}: {cls.__name__} keeps state {k!r} as a {type(v).__name__}, not a tensor; "
                             f"pstar-fx keeps optimizer states in fp32 chunk buffers. {_INSTEAD}")
        if tuple(v.shape) == tuple(whole.shape) and v.is_floating_point():
            vectors.append(k)
        elif v.dim() == 0 and v.is_floating_point():
            scalars.append(k)
        else:
            raise ValueError(f"{where}: {cls.__name__}'s state {k!r} has shape {tuple(v.shape)} ({v.dtype}) for a "
                             f"parameter of shape {tuple(whole.shape)}: not elementwise. {_INSTEAD}")
    same = torch.allclose(whole.reshape(-1), flat, rtol=1e-5, atol=1e-7) and all(
        set(b.state[p]) == set(state) for p in pieces)
    for k in vectors if same else ():
        joined = torch.cat([b.state[p][k].reshape(-1) for p in pieces])
        same = same and torch.allclose(state[k].reshape(-1), joined, rtol=1e-5, atol=1e-7)
    for k in scalars if same else ():
        same = same and all(torch.allclose(b.state[p][k].reshape(()), state[k]) for p in pieces)
    if not same:
        raise ValueError(f"{where}: {cls.__name__}'s update of a tensor differs from its update of the same values "
                         f"as flat pieces: it is not elementwise (it reads whole tensors). {_INSTEAD}")
    return tuple(vectors), tuple(scalars)


@functools.lru_cache(maxsize=64)
def _options_of(cls: type) -> frozenset[str] | None:
    """The keyword arguments cls's constructor takes besides the parameters (None: any, it takes **kwargs)."""
    try:
        params = inspect.signature(cls.__init__).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return frozenset(p.name for p in params) - {"self", "params"}


def check_group(cls: type, where: str, opts: Mapping[str, Any], *, construction: bool,
                strict: bool = False) -> dict[str, Any]:
    """One group's options (without 'params'), checked as torch's constructor checks them (its messages) plus
    what pstar-fx cannot honour; NaN and inf numbers are rejected. Returns them as a plain dict. A group's keys that
    the constructor does not take are left out, as torch's update never reads them: a scheduler's ('initial_lr',
    OneCycleLR's 'max_lr'), torch's own 'param_names', a user's ('name'). strict: the constructor's own keyword
    arguments, where an unknown one is the TypeError torch raises."""
    takes = None if strict else _options_of(cls)
    opts = {k: v for k, v in opts.items() if k != "params" and (takes is None or k in takes)}
    for k, v in opts.items():
        if isinstance(v, torch.Tensor):
            raise ValueError(f"{where}: {k} must be a Python number, got a tensor (tensor options are not "
                             "supported yet)")
        values = v if isinstance(v, (tuple, list)) else (v,)
        if any(is_real(x) and not math.isfinite(x) for x in values):
            raise ValueError(f"{where}: {k} must be finite, got {v!r}")
    refuse_torch_modes(where, opts, construction)
    if construction:
        if opts.get("fused"):
            raise ValueError(f"{where}: fused=True is not supported on this route: pstar-fx runs torch's "
                             "single-tensor update on flat chunk views; leave fused=None")
    try:
        cls([torch.zeros(1)], **opts)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{where}: {e}") from None
    return opts


def refuse_state_dtype(where: str, name: str) -> NoReturn:
    """The ValueError for a state_dtype given to an optimizer other than Adam's (`where` names the call)."""
    raise ValueError(f"{where}: state_dtype is supported by px.Adam and px.AdamW only (their moments are what it "
                     f"compresses); {name} keeps its states in fp32: drop state_dtype")


def optim_from_torch(torch_class: type, params=None, **options) -> OptimizerSpec:
    """A torch.optim optimizer class (or a torch.optim.Optimizer subclass of your own) with its constructor's
    arguments, for px.compile: its update runs on chunk views (module docstring). Raises a ValueError naming the
    reason when the class cannot run elementwise on flat chunks."""
    if isinstance(torch_class, torch.optim.Optimizer):
        raise TypeError(f"px.optim_from_torch takes the optimizer class, e.g. torch.optim.{type(torch_class).__name__}"
                        f", and its options as keywords, not an optimizer object")
    if not (isinstance(torch_class, type) and issubclass(torch_class, torch.optim.Optimizer)):
        raise TypeError(f"px.optim_from_torch: the first argument must be a torch.optim.Optimizer class, got "
                        f"{torch_class!r}")
    if torch_class is torch.optim.AdamW:
        return AdamW(params, **options)
    if torch_class is torch.optim.Adam:   # Adam(decoupled_weight_decay=True) is AdamW, as torch documents
        if options.pop("decoupled_weight_decay", False):
            return AdamW(params, **{"weight_decay": 0.0, **options})    # (torch.optim.Adam's default, not AdamW's)
        return Adam(params, **options)
    name = torch_class.__name__
    where = f"px.optim_from_torch({name})"
    if "state_dtype" in options:
        refuse_state_dtype(where, name)
    refuse_known(torch_class, where)
    groups = param_groups(name, params)
    defaults = check_group(torch_class, where, options, construction=True, strict=True)
    vectors, scalars = probe(torch_class, defaults, where)
    for i, g in enumerate(groups or ()):
        merged = check_group(torch_class, f"{where}: parameter group {i}", {**defaults, **g}, construction=True)
        v, s = probe(torch_class, merged, f"{where}: parameter group {i}")
        vectors += tuple(k for k in v if k not in vectors)
        scalars += tuple(k for k in s if k not in scalars)
    state = StateLayout(vectors=vectors, scalars=scalars, counter=STEPS if vectors or scalars else None,
                        update_cost=TORCH_UPDATE_COST, device_update_cost=TORCH_UPDATE_COST)
    return OptimizerSpec(torch_class=torch_class, defaults=defaults, groups=groups, state=state)


def SGD(params=None, lr: float = 1e-3, momentum: float = 0.0, dampening: float = 0.0, weight_decay: float = 0.0,
        nesterov: bool = False, *, maximize: bool = False, foreach: bool | None = None,
        differentiable: bool = False, fused: bool | None = None, state_dtype=None) -> OptimizerSpec:
    """SGD with torch.optim.SGD's arguments and meaning (torch's update, on chunk views). Without momentum it keeps
    no state: the plan counts 0 state bytes (in fp32; mixed precision keeps the fp32 master). A state_dtype is
    refused (ValueError): only px.Adam / px.AdamW compress their states."""
    if state_dtype is not None:
        refuse_state_dtype("px.SGD", "SGD")
    return optim_from_torch(torch.optim.SGD, params, lr=lr, momentum=momentum, dampening=dampening,
                            weight_decay=weight_decay, nesterov=nesterov, maximize=maximize, foreach=foreach,
                            differentiable=differentiable, fused=fused)
