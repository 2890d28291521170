"""Tracing: a user's `step(model, *batch) -> loss` becomes one aten-level fx graph of forward + backward.

`torch.func.functional_call` runs the step with the model's tensors swapped for graph inputs, `torch.autograd.grad`
differentiates the loss with respect to the trainable parameters, and `make_fx` records both over fake tensors, so
nothing real is allocated. Placeholders come in this order: trainable parameters, frozen parameters, buffers, the fp16
loss scale (fp16 only), then the batch tensors. The output is `[loss, grad_0, ..., grad_k]`, one gradient per
trainable parameter in table order (None for a parameter the loss does not reach).

Buffers are passed in as inputs (not closed over), so in-place buffer updates such as BatchNorm's running statistics
stay in the graph as in-place aten ops on the buffer placeholders; the runtime applies them to the real buffers.
"""
from __future__ import annotations

import os
import time
import traceback
from dataclasses import dataclass

import optree
import torch
import torch.fx as fx
import torch.nn as nn
from torch._subclasses.fake_tensor import (DataDependentOutputException, DynamicOutputShapeException,
                                           FakeTensorMode)
from torch.fx.experimental.proxy_tensor import make_fx
from torch.overrides import TorchFunctionMode

from . import fake_fixes, trace_hints
from .errors import UntraceableError
from .passes.graph_utils import mutated_args, storage_key
from .ir import BufferInfo, InputInfo, NodeAnn, ParamInfo, Phase, Role, Settings, TrainGraph, to_module

_TORCH_DIR = os.path.dirname(torch.__file__)
_OUR_DIR = os.path.dirname(__file__)


@dataclass(frozen=True)
class ModelTables:
    """The model's parameters and buffers, named as in model.state_dict(), shared (tied) tensors once."""
    params: tuple[ParamInfo, ...]
    buffers: tuple[BufferInfo, ...]


def model_tables(model: nn.Module) -> ModelTables:
    def collect(items):
        seen: dict[int, str] = {}
        names: dict[str, list[str]] = {}
        tensors: dict[str, torch.Tensor] = {}
        for name, t in items:
            if t is None:
                continue
            first = seen.setdefault(id(t), name)
            if first == name:
                names[name], tensors[name] = [], t
            else:
                names[first].append(name)
        return names, tensors

    pnames, ptensors = collect(model.named_parameters(remove_duplicate=False))
    bnames, btensors = collect(model.named_buffers(remove_duplicate=False))
    persistent = set(model.state_dict().keys())
    params = tuple(ParamInfo(n, tuple(t.shape), t.dtype, t.requires_grad and t.is_floating_point(),
                             tuple(pnames[n])) for n, t in ptensors.items())
    # Non-persistent buffers (e.g. rotary inv_freq) are graph inputs too, but not part of state_dict().
    buffers = tuple(BufferInfo(n, tuple(t.shape), t.dtype, tuple(bnames[n]), n in persistent)
                    for n, t in btensors.items())
    return ModelTables(params, buffers)


class _StepModule(nn.Module):
    """Lets functional_call run the user's step function with the model's tensors substituted."""

    def __init__(self, model: nn.Module, fn):
        super().__init__()
        self.m = model
        self._fn = fn

    def forward(self, *batch):
        return self._fn(self.m, *batch)


def _user_frame(tb_frames) -> traceback.FrameSummary | None:
    """The innermost frame outside torch and pstar-fx: the user's source line."""
    user = None
    for fr in tb_frames:
        f = os.path.abspath(fr.filename)
        if not (f.startswith(_TORCH_DIR) or f.startswith(_OUR_DIR) or "/contextlib.py" in f
                or "/functools.py" in f):
            user = fr
    return user


class _InplaceRecorder(TorchFunctionMode):
    """Remembers the user's source line of each in-place call, to name it if it turns out to mutate a parameter."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, traceback.FrameSummary | None]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name.endswith("_") and not name.startswith("_") or name in ("__iadd__", "__isub__", "__imul__",
                                                                       "__itruediv__", "copy_"):
            self.calls.append((name, _user_frame(traceback.extract_stack()[:-1])))
        return func(*args, **(kwargs or {}))


def _where(frame: traceback.FrameSummary | None) -> str:
    if frame is None:
        return "at an unknown source line"
    return f"at {frame.filename}:{frame.lineno} ({frame.line})"


def _explain(exc: BaseException) -> UntraceableError:
    frame = _user_frame(traceback.extract_tb(exc.__traceback__))
    if isinstance(exc, DataDependentOutputException):
        what = (f"operation {exc.func} needs a tensor's value while tracing (for example .item(), .tolist(), or "
                "Python control flow such as `if tensor > 0:`); pstar-fx compiles one static graph, so compute "
                "it with tensor ops (torch.where) or move it outside the step")
    elif isinstance(exc, DynamicOutputShapeException):
        what = (f"operation {exc.func} returns a shape that depends on tensor values (boolean masking, nonzero, "
                "unique); pstar-fx compiles one static graph, so use fixed-shape ops such as torch.where")
    elif "convert all Tensors to FakeTensors" in str(exc):
        what = ("the step uses a real tensor that is neither a parameter, a buffer nor an input (a plain tensor "
                "attribute or a global); register it with module.register_buffer(...) or pass it in the batch")
    else:
        what = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return UntraceableError(f"cannot trace the training step: {what}; {_where(frame)}")


def _fake_like(mode: FakeTensorMode, shape, dtype, device) -> torch.Tensor:
    with mode:
        return torch.empty(shape, dtype=dtype, device=device)


def _compute_dtype(t_dtype: torch.dtype, settings: Settings) -> torch.dtype:
    return settings.precision.dtype if t_dtype.is_floating_point else t_dtype


@dataclass(frozen=True)
class FlatBatch:
    """A batch as its tensor leaves plus what rebuilds it: nested tuples, lists and dicts of tensors are allowed;
    other leaves (ints, strings, None) are constants of the trace and part of its signature."""
    tensors: tuple[torch.Tensor, ...]
    spec: object                     # optree's PyTreeSpec
    constants: tuple                 # every leaf, with the _TENSOR marker where a tensor goes
    signature: tuple                 # what a cached trace is keyed by

    def rebuild(self, tensors) -> tuple:
        it = iter(tensors)
        leaves = [next(it) if c is _TENSOR else c for c in self.constants]
        return tuple(optree.tree_unflatten(self.spec, leaves))


class _TensorSlot:
    def __repr__(self) -> str:
        return "<tensor>"


_TENSOR = _TensorSlot()


def flatten_batch(batch: tuple) -> FlatBatch:
    leaves, spec = optree.tree_flatten(tuple(batch), none_is_leaf=True, namespace="torch")
    tensors = tuple(x for x in leaves if isinstance(x, torch.Tensor))
    constants = tuple(_TENSOR if isinstance(x, torch.Tensor) else x for x in leaves)
    sig = []
    for x in leaves:
        if isinstance(x, torch.Tensor):
            sig.append((tuple(x.shape), x.dtype))
        else:
            try:
                hash(x)
            except TypeError:
                raise TypeError(f"step(*batch): a batch leaf of type {type(x).__name__} is neither a tensor nor "
                                "hashable; pass tensors (in tuples, lists or dicts) and plain constants") from None
            sig.append((type(x), x))
    return FlatBatch(tensors, spec, constants, (str(spec), tuple(sig)))


def trace_step(fn, model: nn.Module, batch: tuple, settings: Settings) -> TrainGraph:
    """Trace `fn(model, *batch)` into the "traced" TrainGraph (forward + backward, nothing real allocated)."""
    t0 = time.perf_counter()
    tables = model_tables(model)
    wrapper = _StepModule(model, fn)
    named_p = dict(model.named_parameters())
    named_b = dict(model.named_buffers())
    device = settings.device
    mode = FakeTensorMode(allow_non_fake_inputs=False)
    fp16 = settings.precision.dtype is torch.float16

    trainable = {p.name: _fake_like(mode, p.shape, _compute_dtype(p.dtype, settings), device)
                 for p in tables.params if p.trainable}
    frozen = {p.name: _fake_like(mode, p.shape, _compute_dtype(p.dtype, settings), device)
              for p in tables.params if not p.trainable}
    buffers = {b.name: _fake_like(mode, b.shape, b.dtype, device) for b in tables.buffers}
    flat = flatten_batch(batch)
    inputs, fake_batch = [], []
    for i, x in enumerate(flat.tensors):
        dt = _compute_dtype(x.dtype, settings)
        inputs.append(InputInfo(i, tuple(x.shape), dt))
        fake_batch.append(_fake_like(mode, x.shape, dt, device))
    scale = [_fake_like(mode, (), torch.float32, device)] if fp16 else []
    del named_p, named_b

    def prefixed(d):
        return {"m." + k: v for k, v in d.items()}

    def traced(tp, fp, bufs, scale_args, *xs):
        # Differentiate with the autograd engine itself, recorded by make_fx (as AOTAutograd does). torch.func.grad
        # would also work, but libraries that test `isinstance(t, FakeTensor)` to skip data-dependent checks
        # (transformers' mask utilities) do not recognise functorch's wrapped tensors, and fail to trace.
        leaves = {k: v.detach().requires_grad_(True) for k, v in tp.items()}
        with torch.enable_grad(), trace_hints.substituted(
                wrapper, {**prefixed(leaves), **prefixed(fp), **prefixed(bufs)}):
            out = torch.func.functional_call(wrapper, (prefixed(leaves), prefixed(fp), prefixed(bufs)),
                                             flat.rebuild(xs), strict=False, tie_weights=True)
            if not isinstance(out, torch.Tensor) or out.dim() != 0:
                raise UntraceableError(
                    "the step function must return the loss as a 0-d tensor, got "
                    + (f"a tensor of shape {tuple(out.shape)}" if isinstance(out, torch.Tensor)
                       else type(out).__name__))
            if not out.is_floating_point():
                raise UntraceableError(f"the step function returned a loss of dtype {out.dtype}; it must be floating")
            if not out.requires_grad:
                raise UntraceableError(
                    "the loss does not depend on any trainable parameter, so a step would train nothing (eager "
                    "loss.backward() raises here too); check requires_grad and that the loss uses the model's output")
            seeded = out * scale_args[0] if scale_args else out
            grads = trace_hints.gradients(seeded, list(leaves.values()))
        return [out] + list(grads)

    recorder = _InplaceRecorder()
    try:
        with recorder, fake_fixes.FakeKernelFixes():
            gm = make_fx(traced, tracing_mode="fake", record_stack_traces=True)(
                trainable, frozen, buffers, scale, *fake_batch)
    except UntraceableError:
        raise
    except (DataDependentOutputException, DynamicOutputShapeException) as e:
        raise _explain(e) from e
    except Exception as e:  # an unsupported construct deep inside torch: name it and the user's line
        raise _explain(e) from e

    trace_hints.mark_recompute(gm)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    roles: list[tuple[Role, str | None]] = (
        [(Role.PARAM, k) for k in trainable] + [(Role.PARAM, k) for k in frozen]
        + [(Role.BUFFER, k) for k in buffers] + [(Role.SCALE, None)] * len(scale)
        + [(Role.INPUT, None)] * len(fake_batch))
    assert len(roles) == len(placeholders), (len(roles), len(placeholders))
    ann = {}
    for node, (role, name) in zip(placeholders, roles):
        ann[node.name] = NodeAnn(role=role, phase=Phase.INPUT, param=name if role is Role.PARAM else None)
        if role is Role.BUFFER:
            node.meta["buffer"] = name
    for node in gm.graph.nodes:
        if node.op == "call_function":
            ann[node.name] = NodeAnn(role=Role.COMPUTE, phase=Phase.FORWARD)
        elif node.op == "get_attr":
            ann[node.name] = NodeAnn(role=Role.CONSTANT, phase=Phase.INPUT)
        elif node.op == "output":
            ann[node.name] = NodeAnn(role=Role.OUTPUT, phase=Phase.OUTPUT)
    _reject_param_mutation(gm, ann, recorder)
    # Trainable first, then frozen, matching the placeholder order.
    ordered = tuple(p for p in tables.params if p.trainable) + tuple(p for p in tables.params if not p.trainable)
    graph = to_module(gm.graph, gm)
    return TrainGraph(gm=graph, stage="traced", made_by="trace_step", settings=settings, params=ordered,
                      buffers=tables.buffers, inputs=tuple(inputs), ann=ann, seconds=time.perf_counter() - t0)


def _reject_param_mutation(gm: fx.GraphModule, ann, recorder: _InplaceRecorder) -> None:
    """In-place updates of parameters cannot be compiled: pstar-fx owns the parameters and only its optimizer writes
    them. Follow views back to the placeholder and name the op and the user's line."""
    base: dict[fx.Node, fx.Node] = {}
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            base[node] = node
            continue
        if node.op != "call_function":
            continue
        val = node.meta.get("val")
        for a in node.all_input_nodes:
            av = a.meta.get("val")
            if (isinstance(val, torch.Tensor) and isinstance(av, torch.Tensor) and a in base
                    and storage_key(val) == storage_key(av)):
                base[node] = base[a]
        for m in mutated_args(node):
            root = base.get(m)
            if root is not None and ann[root.name].role is Role.PARAM:
                op = node.target
                short = getattr(getattr(op, "overloadpacket", None), "__name__", "")
                frame = next((f for name, f in recorder.calls if name == short and f is not None), None)
                raise UntraceableError(
                    f"cannot trace the training step: operation {op} updates parameter "
                    f"'{ann[root.name].param}' in place {_where(frame)}; pstar-fx owns the parameters and only its "
                    "optimizer updates them. Compute a new tensor instead of writing into the parameter.")
