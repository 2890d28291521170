"""What every optimizer description shares: the state layout of a chunk, the description `px.compile` takes
(`OptimizerSpec`), the part of it the plan depends on (`OptimizerLayout`), and torch's parameter-group forms."""
from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from .state_dtype import DEVICE_UPDATE_COST, INT8_BLOCK, UPDATE_COST, StateDtype

# the part of a general-route chunk's state buffer that counts the chunk's steps (torch keeps no such count for
# every optimizer: SGD's momentum buffer is made at the first step, so pstar-fx must know whether it exists)
STEPS = "pstar_fx_steps"


@dataclass(frozen=True)
class StateLayout:
    """The optimizer states of one chunk, all in one fp32 buffer, in this order: each of `vectors` (one element per
    chunk element: torch's per-parameter state of the parameter's shape, under torch's state-dict key such as
    'exp_avg' or 'momentum_buffer'), the fp32 master in mixed precision, then one element for each of `scalars`
    (torch's 0-d per-parameter states: 'step', NAdam's 'mu_product'), then the step counter when it is not one of
    them. A chunk has state once its counter is > 0 (as torch creates a parameter's state at its first step).
    An optimizer with no state (SGD without momentum) has no vectors, no scalars and no counter: 0 bytes per chunk
    in fp32. `update_cost` / `device_update_cost`: an update's time per element relative to torch's fused Adam's
    on the CPU / on the GPU (the cost model's rates).

    `dtype` other than FP32 (Adam's compressed moments, optim/state_dtype.py): the buffer is still one flat fp32
    buffer per chunk (what moves between host, device and disk as opaque bytes), now carved by bytes: each vector
    in the dtype's storage (bf16; int8 codes, the non-negative `unsigned` ones as uint8), then for int8 each
    vector's fp32 block scales (under '<name>.scale'), then the master and the 0-d parts in fp32, every part
    starting on a 64-byte boundary (vector loads; the typed views need it)."""
    vectors: tuple[str, ...] = ()
    scalars: tuple[str, ...] = ()
    counter: str | None = None
    update_cost: float = 1.0
    device_update_cost: float = 1.0
    dtype: StateDtype = StateDtype.FP32
    unsigned: tuple[str, ...] = ()          # vectors that are never negative (Adam's exp_avg_sq)

    def __post_init__(self):
        assert (self.counter is None) == (not self.vectors and not self.scalars), self
        assert len(set(self.vectors + self.scalars)) == len(self.vectors) + len(self.scalars), self
        assert set(self.unsigned) <= set(self.vectors), self

    def with_dtype(self, dtype: StateDtype) -> "StateLayout":
        """This layout with its vectors stored in `dtype` (and the update's cost scaled accordingly)."""
        return dataclasses.replace(self, dtype=dtype, update_cost=self.update_cost * UPDATE_COST[dtype],
                                   device_update_cost=self.device_update_cost * DEVICE_UPDATE_COST[dtype])

    @property
    def scalar_parts(self) -> tuple[str, ...]:
        """The 0-d parts: `scalars`, then the counter when it is not one of them."""
        extra = (self.counter,) if self.counter is not None and self.counter not in self.scalars else ()
        return self.scalars + extra

    def per_element(self, mixed: bool) -> int:
        """fp32 values of the buffer per chunk element in an FP32 layout: the vectors and the master."""
        return len(self.vectors) + (1 if mixed else 0)

    def bytes_per_element(self, mixed: bool) -> float:
        """Bytes of the buffer per chunk element (the 0-d parts and the alignment aside)."""
        scales = 4 / INT8_BLOCK if self.dtype is StateDtype.INT8 else 0.0
        return len(self.vectors) * (self.dtype.vector_bytes + scales) + (4 if mixed else 0)

    def _spans(self, numel: int, mixed: bool) -> tuple[dict[str, tuple[int, int, torch.dtype]], int]:
        """A compressed layout's parts: name -> (byte offset, elements, dtype), and the total bytes."""
        at, out = 0, {}

        def put(name: str, n: int, dtype: torch.dtype) -> None:
            nonlocal at
            out[name] = (at, n, dtype)
            at += -(-n * dtype.itemsize // 64) * 64

        for k in self.vectors:
            put(k, numel, torch.bfloat16 if self.dtype is StateDtype.BF16
                else torch.uint8 if k in self.unsigned else torch.int8)
        if self.dtype is StateDtype.INT8:
            for k in self.vectors:
                put(f"{k}.scale", -(-numel // INT8_BLOCK), torch.float32)
        if mixed:
            put("master", numel, torch.float32)
        for k in self.scalar_parts:
            put(k, 1, torch.float32)
        return out, at

    def floats(self, numel: int, mixed: bool) -> int:
        """The buffer's fp32 elements for a chunk (shard) of `numel` elements."""
        if self.dtype.compressed:
            return self._spans(numel, mixed)[1] // 4
        return numel * self.per_element(mixed) + len(self.scalar_parts)

    def parts(self, buffer: torch.Tensor, numel: int, mixed: bool) -> dict[str, torch.Tensor]:
        """Views into a chunk's state buffer by name: the vectors, 'master' (mixed precision) and the 0-d parts
        (compressed: the vectors' codes and '<name>.scale', in their storage dtypes)."""
        assert buffer.numel() == self.floats(numel, mixed), (buffer.numel(), numel, self)
        if self.dtype.compressed:
            raw = buffer.view(torch.uint8)
            spans = self._spans(numel, mixed)[0]
            out = {k: raw[a:a + n * dt.itemsize].view(dt) for k, (a, n, dt) in spans.items()}
            for k in self.scalar_parts:
                out[k] = out[k][0]
            return out
        out = {k: buffer[i * numel:(i + 1) * numel] for i, k in enumerate(self.vectors)}
        at = len(self.vectors) * numel
        if mixed:
            out["master"] = buffer[at:at + numel]
            at += numel
        for i, k in enumerate(self.scalar_parts):
            out[k] = buffer[at + i]
        return out


# torch.optim.Adam / AdamW: m, v, (master), step; the step doubles as the counter
ADAM_STATE = StateLayout(vectors=("exp_avg", "exp_avg_sq"), scalars=("step",), counter="step", update_cost=1.0,
                         unsigned=("exp_avg_sq",))
NO_STATE = StateLayout()


def is_adam(torch_class: type) -> bool:
    """The torch.optim classes pstar-fx updates with its own chunk kernels (Adam, AdamW: AdamW decoupled)."""
    return torch_class in (torch.optim.Adam, torch.optim.AdamW)


@dataclass(frozen=True, eq=False)
class OptimizerSpec:
    """What `px.Adam(...)`, `px.AdamW(...)`, `px.SGD(...)`, `px.Lion(...)` and `px.optim_from_torch(...)` return:
    the torch.optim class whose object `step.optimizer` is, its constructor options, torch's group form when one was
    given, and the chunk state layout. `px.compile` resolves it against the model into the live optimizer."""
    torch_class: type                                   # e.g. torch.optim.AdamW, torch.optim.RMSprop
    defaults: Mapping[str, Any]                         # torch's constructor options
    groups: tuple[dict, ...] | None = None              # torch's param groups (tensors, as given); None: all
    state: StateLayout = field(default=ADAM_STATE)
    config: Any = None                                  # Adam / AdamW: the defaults as checked values

    @property
    def is_adam(self) -> bool:
        """Adam / AdamW run pstar-fx's own (fused) chunk kernels; every other optimizer torch's update."""
        return is_adam(self.torch_class)

    @property
    def decoupled(self) -> bool:
        return self.torch_class is torch.optim.AdamW

    @property
    def name(self) -> str:
        return self.torch_class.__name__


@dataclass(frozen=True)
class OptimizerLayout:
    """The structural part of the optimizer that the plan depends on: which parameters form each group (names as
    in model.state_dict(), each tensor once), in torch's group order, and the chunk state layout (bytes per chunk).
    Option values are not part of it: they are read from `live` (the optimizer object) at every step, so changing
    them never retraces."""
    groups: tuple[tuple[str, ...], ...]
    state: StateLayout
    live: Any = field(default=None, compare=False, repr=False)   # has configs(): each group's checked options

    def group_of(self, name: str) -> int | None:
        for i, names in enumerate(self.groups):
            if name in names:
                return i
        return None

    def configs(self) -> tuple:
        """Each group's options for the step about to run, checked (a ValueError names a bad group and option)."""
        return self.live.configs()


def is_real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def param_groups(name: str, params) -> tuple[dict, ...] | None:
    """torch's `params` forms (None: every parameter of the model, one group) as a tuple of group dicts."""
    if params is None:
        return None
    if isinstance(params, torch.Tensor):
        raise TypeError(f"px.{name}: params must be an iterable of tensors or of parameter-group dicts (as for "
                        f"torch.optim.{name}), got a single tensor; wrap it in a list")
    if is_real(params):
        raise TypeError(f"px.{name}: the first positional argument is params, as in torch.optim.{name}; "
                        f"pass the learning rate as lr={params!r}")
    items = list(params)
    if not items:
        raise ValueError(f"px.{name}: optimizer got an empty parameter list")
    if not isinstance(items[0], dict):
        items = [{"params": items}]
    groups = []
    for i, g in enumerate(items):
        if not isinstance(g, dict) or "params" not in g:
            raise TypeError(f"px.{name}: parameter group {i} must be a dict with a 'params' entry, got "
                            f"{type(g).__name__}")
        if isinstance(g["params"], set):
            raise TypeError(f"px.{name}: optimizer parameters need to be organized in ordered collections, but "
                            "the ordering of tensors in sets will change between runs. Please use a list instead.")
        g = dict(g)
        g["params"] = [g["params"]] if isinstance(g["params"], torch.Tensor) else list(g["params"])
        groups.append(g)
    return tuple(groups)
