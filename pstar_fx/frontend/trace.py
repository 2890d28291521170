"""Tracing: a user's `step(model, *batch) -> loss` becomes one aten-level fx graph of forward + backward.

`torch.func.functional_call` runs the step with the model's tensors swapped for graph inputs, `torch.autograd.grad`
differentiates the loss with respect to the trainable parameters, and `make_fx` records both over fake tensors, so
nothing real is allocated. Placeholders come in this order: trainable parameters, frozen parameters, buffers, the fp16
loss scale (fp16 training steps only), then the batch tensors. The output is `[loss, aux..., grad_0, ..., grad_k]`:
the tensors the step returned beside the loss (aux_outputs.py, ir/outputs.py), then one gradient per trainable
parameter in table order (None for a parameter the loss does not reach).

Buffers are passed in as inputs (not closed over), so in-place buffer updates such as BatchNorm's running statistics
stay in the graph as in-place aten ops on the buffer placeholders; the runtime applies them to the real buffers.

Mixed precision is torch.autocast's: parameters are half-precision placeholders (the chunks hold them so), batch
tensors keep their own dtype, and the forward runs under `torch.autocast(device, half dtype)`, so the casts autocast
makes (half for matmuls and convolutions, fp32 for losses, softmax and norms) are recorded as aten ops. The backward
is differentiated outside autocast, as `loss.backward()` is in eager code.

Ops whose output size depends on values (nonzero, boolean masks) are traced with a symbolic size of known range,
planned at its upper bound (ir/fx_utils). Python control flow on a tensor's value or on a condition over such a size
(`if t.sum() > 0:`, `if idx.size(0) > 0:`) takes one outcome per trace, checked at run time by a guard node
(frontend/guards.py); a loop over such a size's rows is refused with the op and the line, except transformers' eager
experts loop, traced as an equal loop over every expert (moe_rewrites).

The model is never left changed by tracing: its parameter and buffer slots are swapped for fake tensors only while
the step runs, and every slot is put back (the same objects) whether the trace succeeds or fails.
"""
from __future__ import annotations

import contextlib
import dataclasses
import inspect
import operator
import os
import sys
import time
import traceback

import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback
import torch.nn as nn
from torch._subclasses.fake_tensor import (DataDependentOutputException, DynamicOutputShapeException,
                                           FakeTensorMode)
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode, ShapeEnv
from torch.overrides import TorchFunctionMode

from ..errors import UntraceableError, warn
from ..interrupts import DeferredInterrupt
from ..ir.fx_utils import (data_dependent_sizes, is_plain_cast, is_user_file, loss_seed, mutated_args, output_node,
                           refresh_views, storage_key, user_frame)
from ..ir.graph import (InputInfo, NodeAnn, Phase, Role, Settings, TrainGraph, lazy_modules,
                        to_module)
from ..ir.outputs import split_outputs
from . import (backward_calls, escaped_values, fake_fixes, freeze_calls, method_caches, moe_rewrites, rnn_kernels,
               torch_compile, torchscript, user_checkpoint)
from .aux_outputs import AuxCollector, describe_aux, own_aux_storage, split_returned
from .batch import BatchSignature, FlatBatch, flatten_batch, leaf_name  # noqa: F401 (re-exported)
from .graph_checks import check_reached, reject_generators, reject_sparse
from .guards import GuardingShapeEnv, insert_guards, tried_both_ways
from .python_undo import ModelUndo
from .model_tensors import (ModelTables, check_data_kept, gradient_hooks, model_restored, model_tables, slots,
                            storage_ids, write_rebound)
from .python_state import python_draws, torch_generators_set



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
        if is_user_file(fr.filename):
            user = fr
    return user


def _calling_user_frame() -> traceback.FrameSummary | None:
    """_user_frame of the current stack, without extracting it: the first user frame walking outwards, its source
    line read only when shown."""
    f = sys._getframe(1)
    while f is not None:
        if is_user_file(f.f_code.co_filename):
            return traceback.FrameSummary(f.f_code.co_filename, f.f_lineno, f.f_code.co_name, lookup_line=False)
        f = f.f_back
    return None


# Where the nodes' source lines come from. make_fx(record_stack_traces=True) extracts and formats the whole Python
# stack for every node (about 3 s of a 13 s trace at 17B); the user's innermost frame, which is all the error
# messages show, is found much more cheaply by _SourceRecorder at every torch-level call and handed to the nodes
# the call makes through torch.fx.traceback's preserved node meta (where this torch has it).
_CHEAP_SOURCES = all(hasattr(fx_traceback, f) for f in ("preserve_node_meta", "set_stack_trace", "get_current_meta"))


class _SourceRecorder(TorchFunctionMode):
    """At every torch-level call while tracing: the user's source line becomes the stack trace of the nodes the call
    makes (none outside the user's code: the backward's nodes); and the line of each in-place call is remembered,
    to name it if it turns out to mutate a parameter."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, traceback.FrameSummary | None]] = []
        self._formatted: dict[tuple[str, int], list[str]] = {}
        self._current: tuple[str, int] | None = None
        self.in_step = False           # the user's step function is running (not pstar-fx's own backward)
        self.model_names: dict[int, str] = {}    # id -> name of the tensors the model is called with

    @contextlib.contextmanager
    def user_step(self):
        self.in_step = True
        try:
            yield
        finally:
            self.in_step = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        frame = _calling_user_frame()
        self.set_source(frame)
        if self.in_step:
            if func in backward_calls.BACKWARD:
                backward_calls.reject(func, kwargs or {}, _where(frame))
            freeze_calls.reject(func, args, kwargs or {}, self.model_names, _where(frame))
        if name.endswith("_") and not name.startswith("_") or name in ("__iadd__", "__isub__", "__imul__",
                                                                       "__itruediv__", "copy_"):
            self.calls.append((name, frame))
        return func(*args, **(kwargs or {}))

    def set_source(self, frame: traceback.FrameSummary | None) -> None:
        """Nodes made from now on carry this frame as their stack trace (none: no stack trace). Without torch's
        preserved node meta, nothing: make_fx records the stacks itself then."""
        key = None if frame is None else (frame.filename, frame.lineno)
        if not _CHEAP_SOURCES or key == self._current:
            return
        self._current = key
        if key is None:
            # (set_stack_trace([]) clears only in newer torch)
            fx_traceback.get_current_meta().pop("stack_trace", None)
            return
        lines = self._formatted.get(key)
        if lines is None:
            lines = self._formatted[key] = traceback.format_list([frame])
        fx_traceback.set_stack_trace(lines)


def _where(frame: traceback.FrameSummary | None) -> str:
    if frame is None:
        return "at an unknown source line"
    return f"at {frame.filename}:{frame.lineno} ({frame.line})"


def _explain(exc: BaseException, flat: "FlatBatch | None" = None, shape_env: ShapeEnv | None = None
             ) -> UntraceableError:
    frame = _user_frame(traceback.extract_tb(exc.__traceback__))
    if isinstance(exc, GuardOnDataDependentSymNode):
        what = _explain_guard(exc, shape_env)
    elif isinstance(exc, DataDependentOutputException):
        what = (f"operation {exc.func} needs a tensor's value while tracing (for example .item(), .tolist(), or "
                "Python control flow such as `if tensor > 0:`); pstar-fx compiles one static graph, so compute "
                "it with tensor ops (torch.where) or move it outside the step")
    elif isinstance(exc, DynamicOutputShapeException) and "_ctc_loss" in str(exc.func):
        what = (f"operation {exc.func} (F.ctc_loss) has no kernel torch can trace without values (its fake kernel "
                "is missing, whatever the lengths): CTC loss cannot be compiled; compute it outside the step, or "
                "train with another loss")
    elif isinstance(exc, DynamicOutputShapeException):
        what = (f"operation {exc.func} returns a shape that depends on tensor values (boolean masking, nonzero, "
                "unique); pstar-fx compiles one static graph, so use fixed-shape ops such as torch.where")
    elif _packed_sequence_in(exc):
        what = (f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''} (a packed sequence: "
                "pack_padded_sequence computes its batch_sizes from the lengths' values, which a static graph does "
                "not have; feed the RNN the padded batch instead and leave the padded positions out of the loss, "
                "e.g. cross_entropy(..., ignore_index=...) or a mask)")
    elif "UntypedStorage" in str(exc) and any(f.filename.endswith(os.path.join("nn", "modules", "rnn.py"))
                                              for f in traceback.extract_tb(exc.__traceback__)):
        what = ("an nn.LSTM / nn.GRU / nn.RNN that is not a submodule of the model ran cuDNN's RNN kernel, which takes "
                "the weights as one buffer made from a storage, an operation the tracer cannot record (pstar-fx turns "
                "cuDNN off around the model's own recurrent modules only): make it a submodule of the model")
    elif "convert all Tensors to FakeTensors" in str(exc):
        what = ("the step uses a real tensor that is neither a parameter, a buffer nor an input (a plain tensor "
                "attribute or a global); register it with module.register_buffer(...) or pass it in the batch")
    else:
        what = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        if "_apply(): Couldn't swap" in str(exc):
            what += (" (a Module.to(), .float(), .half() or .cuda() inside the step converts the module's parameters, "
                     "which pstar-fx holds in its chunks, even where it would change nothing: convert the model "
                     "before px.compile and leave the call out of forward)")
        if "FakeTensor(" in str(exc):
            what += (" (the code compared or printed a tensor's value, which a trace does not have: a FakeTensor "
                     "stands in for it; eager code sees a number there. pstar-fx compiles one static graph, so "
                     "such checks must be on shapes, or outside the step)")
        doubles = [i for i, t in enumerate(flat.tensors) if t.dtype is torch.float64] if flat else []
        if doubles and "double" in str(exc).lower():
            what += (f" (batch tensor {doubles[0]} is float64: pstar-fx, like eager PyTorch, passes batch tensors in "
                     "their own dtype, so convert it to the model's dtype, e.g. x.float(), in or before the step)")
        if "grouped_mm" in "".join(traceback.format_tb(exc.__traceback__)) and "BF16" in str(exc):
            what += (" (transformers' grouped_mm experts in float32, recomputed by an activation checkpoint: "
                     "pstar-fx traces them outside checkpoints only; build the model with "
                     "experts_implementation=\"eager\" (traced as an equal loop), or train it without gradient "
                     "checkpointing)")
        empty = [(i, tuple(t.shape)) for i, t in enumerate(flat.tensors) if t.numel() == 0] if flat else []
        if empty:
            what += (f" (batch tensor {empty[0][0]} is empty, of shape {empty[0][1]}: a batch of no rows has nothing "
                     "to train on, and a mean over it divides by zero; leave empty batches out)")
    where = _where(frame)
    if frame is None and any(f"autograd{os.sep}" in f.filename for f in traceback.extract_tb(exc.__traceback__)):
        where = "in the backward pass (differentiating an op of the step's forward)"
    return UntraceableError(f"cannot trace the training step: {what}; {where}")


def _packed_sequence_in(exc: BaseException) -> bool:
    """The failure happened with a PackedSequence in hand (a local of one of the frames it passed through)."""
    from torch.nn.utils.rnn import PackedSequence
    tb = exc.__traceback__
    while tb is not None:
        if any(isinstance(v, PackedSequence) for v in tb.tb_frame.f_locals.values()):
            return True
        tb = tb.tb_next
    return False


def _made_by(shape_env: ShapeEnv | None, sym) -> tuple[str, traceback.FrameSummary | None]:
    """The op whose fake kernel created a data-dependent size symbol, and the user's line that called it (from the
    stack the ShapeEnv keeps for every such symbol)."""
    stack = getattr(shape_env, "var_to_stack", {}).get(sym)     # kept by torch for debugging: may be absent
    frames = list(stack.summary()) if stack is not None else []
    impl = [f.name for f in frames if f.filename.endswith(os.path.join("_subclasses", "fake_impls.py"))]
    return (f"aten.{impl[-1]}" if impl else "an operation"), _user_frame(frames)


def _explain_guard(exc: GuardOnDataDependentSymNode, shape_env: ShapeEnv | None) -> str:
    """Python code branched or looped on a data-dependent size: name the op that made the size and its line."""
    made = []
    for sym in sorted(exc.cond.free_symbols, key=str):
        op, frame = _made_by(shape_env, sym)
        made.append(f"{sym} is the size of the result of {op} {_where(frame)}")
    return (f"Python control flow uses a data-dependent size as a number (a loop over a tensor's rows, int(), len()) "
            f"({exc.cond}; {'; '.join(made)}); pstar-fx compiles one static graph per outcome: ops whose output "
            "size depends on values are supported (planned at their upper bound), and so are conditions on that "
            "size (`if n > 0:`, traced per outcome and checked at run time), but not its value as a number. Loop "
            "over a fixed range instead (ops on empty selections are fine)")


def _fake_like(mode: FakeTensorMode, shape, dtype, device) -> torch.Tensor:
    with mode:
        return torch.empty(shape, dtype=dtype, device=device)


def _compute_dtype(t_dtype: torch.dtype, settings: Settings) -> torch.dtype:
    """The dtype of a parameter's placeholder: the chunks' dtype for floating parameters."""
    return settings.precision.dtype if t_dtype.is_floating_point else t_dtype


def _check_arity(fn, batch: tuple) -> None:
    """A wrong number of batch arguments is the user's mistake: say so before tracing (not from inside make_fx)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return
    try:
        sig.bind(None, *batch)
    except TypeError as e:
        name = getattr(fn, "__qualname__", repr(fn))
        params = list(sig.parameters)
        raise TypeError(
            f"the step function {name}{sig} takes the model and then {', '.join(params[1:]) or 'no batch arguments'}"
            f"; step(...) was called with {len(batch)} batch argument{'s' if len(batch) != 1 else ''} "
            f"({', '.join(_describe_leaf(x) for x in batch)}): {e}") from None


def _describe_leaf(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"tensor{tuple(x.shape)} {str(x.dtype).removeprefix('torch.')}"
    return type(x).__name__


def _micro_batch_sizes(flat: "FlatBatch", micro: int) -> list[int]:
    """accumulate=K: the micro-batch size of every batch tensor (its dim 0 divided by K)."""
    if micro == 1:
        return [0] * len(flat.tensors)
    sizes = []
    for i, x in enumerate(flat.tensors):
        if x.dim() == 0 or x.shape[0] % micro != 0:
            raise ValueError(f"accumulate={micro} splits every batch tensor along dimension 0 into {micro} "
                             f"micro-batches, but batch tensor {i} has shape {tuple(x.shape)}; give it a first "
                             f"dimension divisible by {micro}")
        sizes.append(x.shape[0] // micro)
    return sizes


def trace_step(fn, model: nn.Module, batch: tuple, settings: Settings, assume: tuple = (),
               undo: ModelUndo | None = None) -> TrainGraph:
    """Trace `fn(model, *batch)` into the "traced" TrainGraph (forward + backward, nothing real allocated).
    `assume`: the outcomes to take for the step's first data-dependent decisions, in order (frontend/guards.py).
    The model is left exactly as it was (the same parameter and buffer objects), whether tracing succeeds or not.
    Ctrl-C is held while tracing (pstar_fx/interrupts.py) and delivered after it: a KeyboardInterrupt raised inside
    one of torch's C++ callbacks can abort the process. Plain Python values the step writes while traced (a
    counter in `forward`) are written as eager code writes them, once (a trace tried again puts back what the one
    before it wrote: frontend/python_undo.py, `undo` where the caller made it before the trace); the compiler keys
    the graph by the state before (api/plan_reuse.py)."""
    with DeferredInterrupt(), python_draws() as drawn, torch_generators_set() as seeded:
        graph = tried_both_ways(lambda taken, false_at: _trace_step(fn, model, batch, settings, taken, false_at),
                                assume, (undo or ModelUndo(model)).restore)
    if seeded:
        raise UntraceableError(
            f"the step function set the state of {' and '.join(seeded)} while it was traced (torch.manual_seed, "
            "torch.set_rng_state, ... inside it): a compiled step runs the traced graph, whose random operations "
            "draw from the generator as it runs, and does not seed it again, so every step after the first would "
            "draw otherwise than eager code. Seed in the training loop, before calling the step (and draw from "
            "torch's generators in no other thread while a step is compiled)")
    if drawn:
        warn(f"the global generator of {' and '.join(drawn)} moved while the step was traced: if the step drew from "
             "it (in your code or a library's: LayerDrop by random.random()), every compiled step replays the "
             "trace's draw, where eager code draws anew. A draw that decides nothing is harmless (transformers' "
             "MusicGen draws with its layer drop off); one that decides, draw with torch (torch.rand: traced, a "
             "new draw at every step) or outside the step, passing the value in as an argument.")
    escaped_values.reject(model, fn)
    return graph


# exceptions a check on values raises (the user's, or torch's own such as gaussian_nll_loss's): with every decision
# observed on real data, eager code would raise them too (guards.tried_both_ways)
_CHECK_ERRORS = (ValueError, AssertionError, FloatingPointError, ZeroDivisionError)


def _trace_step(fn, model: nn.Module, batch: tuple, settings: Settings, assume: tuple,
                false_at: frozenset = frozenset()) -> TrainGraph:
    t0 = time.perf_counter()
    _check_arity(fn, batch)
    tables = model_tables(model)
    if settings.optimizer is None:   # forward only: nothing trains
        tables = ModelTables(tuple(dataclasses.replace(p, trainable=False) for p in tables.params), tables.buffers)
    wrapper = _StepModule(model, fn)
    device = settings.device
    # a ShapeEnv gives ops whose output size depends on values (nonzero, boolean masks) a symbolic size with a known
    # range, planned at its upper bound (ir/fx_utils); .item() gives a symbol too; Python decisions on either take
    # one outcome each, guarded at run time (frontend/guards.py)
    mode = FakeTensorMode(allow_non_fake_inputs=False, static_shapes=True,
                          shape_env=GuardingShapeEnv(assume, false_at, allow_scalar_outputs=True,
                                                     allow_dynamic_output_shape_ops=True))
    fp16 = settings.precision.dtype is torch.float16
    half = settings.precision.dtype if settings.precision.mixed else None

    trainable = {p.name: _fake_like(mode, p.shape, _compute_dtype(p.dtype, settings), device)
                 for p in tables.params if p.trainable}
    frozen = {p.name: _fake_like(mode, p.shape, _compute_dtype(p.dtype, settings), device)
              for p in tables.params if not p.trainable}
    buffers = {b.name: _fake_like(mode, b.shape, b.dtype, device) for b in tables.buffers}
    flat = flatten_batch(batch)
    # batch tensors keep their dtype, as in eager code (autocast casts where it would; float64 stays float64)
    inputs = [InputInfo(i, tuple(x.shape), x.dtype) for i, x in enumerate(flat.tensors)]
    fake_batch = [_fake_like(mode, x.shape, x.dtype, device) for x in flat.tensors]
    # the loss scale, an input of fp16 training steps (a forward-only graph has no backward to scale)
    scale = [_fake_like(mode, (), torch.float32, device)] if fp16 and settings.optimizer is not None else []
    # one functional_call key per distinct slot, mapped to its tensor's table name (tied tensors: one placeholder)
    table_name: dict[int, str] = {}       # tensor -> its first name, the one the tables use
    hooks = gradient_hooks(model, list(trainable))
    named = list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False))
    for n, t in named:
        table_name.setdefault(id(t), n)
    model_slots = slots(model)
    slot_names = [(full, table_name[id(t)]) for full, _, _, _, t in model_slots]
    buffer_slots = {"m." + full: table_name[id(t)] for full, kind, _, _, t in model_slots if kind == "_buffers"}

    model_dtype = {p.name: p.dtype for p in tables.params}

    def substituted(tp, fp, bufs):
        # mixed precision: the step sees each parameter in the model's own dtype, as under eager autocast (an exact
        # upcast of the half-precision chunk value; _fold_param_casts drops the casts autocast reverses)
        values = {**{k: v.to(model_dtype[k]) for k, v in {**tp, **fp}.items()}, **bufs}
        return {"m." + full: values[name] for full, name in slot_names}

    micro = settings.accumulate
    splits = _micro_batch_sizes(flat, micro)

    aux = AuxCollector(micro)                         # what the step returns beside the loss (aux_outputs.py)

    def one_micro_batch(leaves, fp, bufs, scale_args, xs, k=0):
        autocast = (torch.autocast(device.type, dtype=half) if half is not None else contextlib.nullcontext())
        values = substituted(leaves, fp, bufs)
        given = dict(values)
        storages = storage_ids(given)
        recorder.model_names = {id(v): k.removeprefix("m.") for k, v in values.items()}
        # the model's tensors stay substituted through backward too: a checkpoint's recompute runs there
        with torch.enable_grad(), user_checkpoint.substituted(wrapper, values):
            with autocast, recorder.user_step():
                out, aux_k, returned = split_returned(wrapper(*flat.rebuild(xs)))
            if out.dim() != 0:
                raise UntraceableError(
                    f"the step function must return the loss as a 0-d tensor, got a tensor of shape "
                    f"{tuple(out.shape)}; return the loss alone or as (loss, aux)")
            if not out.is_floating_point():
                raise UntraceableError(f"the step function returned a loss of dtype {out.dtype}; it must be floating")
            if not out.requires_grad:
                raise UntraceableError(
                    "the loss does not depend on any trainable parameter, so a step would train nothing (eager "
                    "loss.backward() raises here too); check requires_grad and that the loss uses the model's output")
            aux.add(k, aux_k, returned)                # before this micro-batch's backward
            seeded = out / micro if micro > 1 else out       # eager accumulation: (loss / K).backward() per micro-batch
            seeded = seeded * scale_args[0] if scale_args else seeded
            recorder.set_source(None)      # the backward's nodes come from the engine, not from a user's line
            grads = user_checkpoint.gradients(seeded, list(leaves.values()))
        check_data_kept(given, storages, buffer_slots)
        write_rebound(given, values, buffer_slots, bufs)
        return out, list(grads)

    output_spec = []                                  # forward only: how to rebuild what fn returns

    def forward_only(tp, fp, bufs, scale_args, *xs):
        # evaluation (optimizer=None): the function's outputs, no backward, no update
        autocast = (torch.autocast(device.type, dtype=half) if half is not None else contextlib.nullcontext())
        values = substituted(tp, fp, bufs)
        given = dict(values)
        storages = storage_ids(given)
        with (torch.no_grad(), user_checkpoint.substituted(wrapper, values), autocast, recorder.user_step()):
            out = wrapper(*flat.rebuild(xs))
        check_data_kept(given, storages, buffer_slots)
        write_rebound(given, values, buffer_slots, bufs)
        layout, leaves = describe_aux(out, "output")   # constants (ints, None, ...) are returned as they are
        if not leaves:
            raise UntraceableError("a forward-only step (optimizer=None) must return a tensor or a tuple, list or "
                                   f"dict of tensors (and plain constants); it returned {type(out).__name__} "
                                   "without a tensor")
        output_spec.append(layout)
        return leaves

    def traced(tp, fp, bufs, scale_args, *xs):
        # Differentiate with the autograd engine itself, recorded by make_fx (as AOTAutograd does). torch.func.grad
        # would also work, but libraries that test `isinstance(t, FakeTensor)` to skip data-dependent checks
        # (transformers' mask utilities) do not recognise functorch's wrapped tensors, and fail to trace.
        # With accumulate=K the graph holds K forward + backward passes, one per micro-batch (a slice of every batch
        # tensor along dim 0), in order; outputs: [mean loss, loss_1..loss_K (K > 1 only), grads_1, ..., grads_K].
        leaves = {k: v.detach().requires_grad_(True) for k, v in tp.items()}
        for k, fns in hooks.items():          # the user's gradient hooks, applied as eager backward applies them
            for fn_hook in fns:
                leaves[k].register_hook(fn_hook)
        # The aux tensors come after the losses (ir/outputs.py).
        if micro == 1:
            out, grads = one_micro_batch(leaves, fp, bufs, scale_args, xs)
            check_reached(grads)
            return [out] + aux.outputs + grads
        losses, all_grads = [], []
        for k in range(micro):
            part = [x.narrow(0, k * b, b) for x, b in zip(xs, splits)]
            out, grads = one_micro_batch(leaves, fp, bufs, scale_args, part, k)
            losses.append(out)
            all_grads += grads
        check_reached(all_grads)
        total = losses[0]
        for loss_k in losses[1:]:
            total = total + loss_k
        return [total / micro] + losses + aux.outputs + all_grads

    recorder = _SourceRecorder()
    sources = fx_traceback.preserve_node_meta() if _CHEAP_SOURCES else contextlib.nullcontext()
    try:   # the fixes beneath the recorder: it sees a backward call first, and the engine runs with the fixes alone
        with (model_restored(model), sources, fake_fixes.FakeKernelFixes(), recorder,
              moe_rewrites.rewritten(model), lazy_modules(), torch_compile.traced_as_original(model),
              torchscript.scripted_as_python(model, fn), method_caches.emptied(model),
              rnn_kernels.without_cudnn(model, device)):
            gm = make_fx(traced if settings.optimizer is not None else forward_only, tracing_mode="fake",
                         record_stack_traces=not _CHEAP_SOURCES)(trainable, frozen, buffers, scale, *fake_batch)
    except UntraceableError as e:       # (the decisions taken before it: another way may trace, as below)
        if not hasattr(e, "decisions"):
            e.decisions = tuple((d.value, None if d.frame is None else (d.frame.filename, d.frame.lineno))
                                for d in mode.shape_env.decisions)
        raise
    except Exception as e:  # an unsupported construct deep inside torch: name it and the user's line
        error = _explain(e, flat, mode.shape_env)
        # what guards.tried_both_ways needs: the outcomes decided (and where), and the exception if code checking
        # values raised it (the user's own, or one of _CHECK_ERRORS from torch's checks)
        error.decisions = tuple((d.value, None if d.frame is None else (d.frame.filename, d.frame.lineno))
                                for d in mode.shape_env.decisions)
        tb = traceback.extract_tb(e.__traceback__)
        error.raised = e if (tb and is_user_file(tb[-1].filename)) or isinstance(e, _CHECK_ERRORS) else None
        raise error from e
    _reject_unbounded(gm, mode.shape_env)
    reject_sparse(gm)
    reject_generators(gm)
    fake_fixes.real_allocations(gm, backward=settings.optimizer is not None)
    guard_nodes = set(insert_guards(gm, mode.shape_env))

    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    roles: list[tuple[Role, str | None]] = (
        [(Role.PARAM, k) for k in trainable] + [(Role.PARAM, k) for k in frozen]
        + [(Role.BUFFER, k) for k in buffers] + [(Role.SCALE, None)] * len(scale)
        + [(Role.INPUT, None)] * len(fake_batch))
    assert len(roles) == len(placeholders), (len(roles), len(placeholders))
    if settings.optimizer is not None:
        parts = split_outputs(output_node(gm.graph).args[0], micro, aux.layout)
        user_checkpoint.mark_recompute(gm, [s for s in (loss_seed(gm.graph, n) for n in parts.micro_losses)
                                            if s is not None])
        first_aux = 1 + (micro if micro > 1 else 0)
        returned = range(first_aux, first_aux + len(parts.aux))
    else:
        returned = range(len(output_node(gm.graph).args[0]))     # an evaluation's outputs
    # a parameter or buffer returned (or a view of one) is returned as a copy
    own_aux_storage(gm, returned, {n: role for n, (role, _) in zip(placeholders, roles)})
    ann = {}
    for node, (role, name) in zip(placeholders, roles):
        ann[node.name] = NodeAnn(role=role, phase=Phase.INPUT, param=name if role is Role.PARAM else None)
        if role is Role.BUFFER:
            node.meta["buffer"] = name
    for node in gm.graph.nodes:
        if node.op == "call_function":
            ann[node.name] = NodeAnn(role=Role.GUARD if node in guard_nodes else Role.COMPUTE, phase=Phase.FORWARD)
        elif node.op == "get_attr":
            ann[node.name] = NodeAnn(role=Role.CONSTANT, phase=Phase.INPUT)
        elif node.op == "output":
            ann[node.name] = NodeAnn(role=Role.OUTPUT, phase=Phase.OUTPUT)
    _reject_param_mutation(gm, ann, recorder)
    if any(x.dtype is torch.float64 for x in flat.tensors):
        _reject_float64_mixing(gm, flat)
    if half is not None:
        _fold_param_casts(gm.graph, {n for n in placeholders if ann[n.name].role is Role.PARAM})
        gm.graph.lint()
        _fix_fake_values(gm.graph)
        ann = {n.name: ann.get(n.name, NodeAnn(role=Role.COMPUTE, phase=Phase.FORWARD)) for n in gm.graph.nodes}
    # Trainable first, then frozen, matching the placeholder order.
    ordered = tuple(p for p in tables.params if p.trainable) + tuple(p for p in tables.params if not p.trainable)
    graph = to_module(gm.graph, gm)
    return TrainGraph(gm=graph, stage="traced", made_by="trace_step", settings=settings, params=ordered,
                      buffers=tables.buffers, inputs=tuple(inputs), ann=ann, seconds=time.perf_counter() - t0,
                      output_spec=output_spec[0] if output_spec else None, aux=aux.layout)


def _reject_unbounded(gm: fx.GraphModule, shape_env: ShapeEnv) -> None:
    """Every data-dependent size must have a known upper bound: the plan reserves memory for it."""
    for d in data_dependent_sizes(list(gm.graph.nodes)):
        if d.bound is None:
            raise UntraceableError(
                f"cannot trace the training step: operation {d.node.target} returns a size ({d.symbol}) that depends "
                f"on tensor values and has no known upper bound {_where(_made_by(shape_env, d.symbol)[1])}; pstar-fx "
                "plans such sizes at their upper bound, so give the op one (for example repeat_interleave's "
                "output_size)")


def _reject_param_mutation(gm: fx.GraphModule, ann, recorder: _SourceRecorder) -> None:
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
        if node.target is _TO_COPY and node.args[0] in base and base[node.args[0]].op == "placeholder":
            base[node] = base[node.args[0]]   # mixed precision: the step's view of a parameter is its upcast
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
                # (an in-place call inside a torch function, such as F.embedding's max_norm, is not seen by the
                # recorder: the node's own source line, the user's call of that function, names it)
                where = _where(frame) if frame is not None else _stack_line(node)
                raise UntraceableError(
                    f"cannot trace the training step: operation {op} updates parameter "
                    f"'{ann[root.name].param}' in place {where}; pstar-fx owns the parameters and only its "
                    f"optimizer updates them. {_MUTATION_HINTS.get(short, _MUTATION_HINT)}")


_MUTATION_HINT = "Compute a new tensor instead of writing into the parameter."
_MUTATION_HINTS = {   # in-place parameter updates that torch functions make themselves, by the op's name
    "embedding_renorm_": (
        "nn.Embedding(max_norm=...) (F.embedding's max_norm) rescales the rows it looks up inside the weight "
        "itself at every forward: drop max_norm, or bound the rows' norms out of place in the forward (look up "
        "rows of weight * (max_norm / weight.norm(dim=1, keepdim=True)).clamp(max=1)), which trains differently "
        "from the in-place form."),
}


_TO_COPY = torch.ops.aten._to_copy.default
_EXACT_IN_FP32 = (torch.bfloat16, torch.float16)


def _fold_param_casts(graph: fx.Graph, params: set[fx.Node]) -> None:
    """Mixed precision, after tracing under autocast (in place, on the freshly traced graph).

    After: no cast round trip `x (bf16/fp16) -> float32 -> x.dtype` remains (its uses read x: exact, since float32
    holds every half-precision value; this is how a matmul reads the chunk's half-precision parameter directly,
    with no copy saved for backward), and every remaining upcast of a parameter sits right before its only user, a
    fresh copy per user, so a float32 copy of a parameter lives no longer than the op that reads it."""
    for n in list(graph.nodes):
        if not is_plain_cast(n) or n.kwargs.get("dtype") not in _EXACT_IN_FP32:
            continue
        mid = n.args[0]
        if not (is_plain_cast(mid) and mid.kwargs.get("dtype") == torch.float32):
            continue
        x = mid.args[0]
        if x.meta["val"].dtype == n.kwargs["dtype"]:
            old = storage_key(n.meta["val"])
            n.replace_all_uses_with(x)
            graph.erase_node(n)
            if not mid.users:
                graph.erase_node(mid)
            refresh_views(x, old)

    def of_param(n: fx.Node) -> bool:
        while n.op == "call_function" and n.target is torch.ops.aten.detach.default:
            n = n.args[0]
        return n in params

    for n in list(graph.nodes):
        if not (is_plain_cast(n) and of_param(n.args[0]) and len(n.users) > 0):
            continue
        val = n.meta["val"]
        for user in list(n.users):
            with graph.inserting_before(user):
                copy = graph.call_function(_TO_COPY, n.args, dict(n.kwargs))
            copy.meta = dict(n.meta)
            with val.fake_mode:
                copy.meta["val"] = torch.empty_strided(val.shape, val.stride(), dtype=val.dtype, device=val.device)
            user.replace_input_with(n, copy)
            refresh_views(copy, storage_key(val))
        graph.erase_node(n)


def _bn_stats_in_weight_dtype(n: fx.Node) -> None:
    """native_batch_norm with a half-precision input and float32 weight (autocast keeps norms' parameters float32):
    the real kernels return the saved mean and inverse std in float32, torch's fake kernel in the input's dtype."""
    x, w = n.args[0].meta["val"], n.args[1].meta["val"] if isinstance(n.args[1], fx.Node) else None
    out = n.meta["val"]
    if w is None or w.dtype == x.dtype or out[1].dtype == w.dtype:
        return
    with x.fake_mode:
        stats = [torch.empty(t.shape, dtype=w.dtype, device=t.device) for t in out[1:3]]
    n.meta["val"] = (out[0], *stats, *out[3:])
    for u in n.users:
        if u.target is operator.getitem and u.args[1] in (1, 2):
            u.meta["val"] = n.meta["val"][u.args[1]]


# ops whose fake kernel disagrees with the real one in mixed precision: corrected in the traced graph's values
_FAKE_FIXES = {torch.ops.aten.native_batch_norm.default: _bn_stats_in_weight_dtype,
               torch.ops.aten._native_batch_norm_legit.default: _bn_stats_in_weight_dtype,
               torch.ops.aten._native_batch_norm_legit_functional.default: _bn_stats_in_weight_dtype}


def _fix_fake_values(graph: fx.Graph) -> None:
    for n in graph.nodes:
        fix = _FAKE_FIXES.get(n.target)
        if fix is not None:
            fix(n)


def _stack_line(node: fx.Node) -> str:
    """Where the user's code made a node, for an error message (ir/fx_utils.user_frame)."""
    frame = user_frame(node)
    if frame is None:
        return "at an unknown source line"
    return f"at {frame[0]}" + (f" ({frame[1]})" if frame[1] else "")


def _reject_float64_mixing(gm: fx.GraphModule, flat: FlatBatch) -> None:
    """A float64 batch tensor meeting a lower-precision floating tensor in an op that does not promote to float64
    (a matmul with float32 weights): eager PyTorch raises there, the fake kernels do not, so say it now."""
    which = next(i for i, t in enumerate(flat.tensors) if t.dtype is torch.float64)
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        dts = {a.meta["val"].dtype for a in n.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)}
        pointwise = torch.Tag.pointwise in getattr(n.target, "tags", ())   # these promote, as in eager
        if (torch.float64 in dts and any(d.is_floating_point and d is not torch.float64 for d in dts)
                and not pointwise):
            raise UntraceableError(
                f"cannot trace the training step: operation {n.target} mixes float64 with "
                f"{', '.join(sorted(str(d).removeprefix('torch.') for d in dts if d is not torch.float64))} "
                f"{_stack_line(n)}; batch tensor {which} is float64: pstar-fx, like eager PyTorch, passes batch "
                "tensors in their own dtype, so convert it to the model's dtype, e.g. x.float(), in or before the "
                "step")
