"""Where torch's fake (meta) kernels differ from the real ones, what the trace does so that the graph runs and its
plan holds.

- They refuse inputs the real kernel accepts: `torch._grouped_mm` (transformers' default Mixture-of-Experts
  implementation, `experts_implementation="grouped_mm"`) has a meta kernel that copies the CUDA kernel's checks and
  accepts bf16 only, while the CPU kernel also computes fp32; so an fp32 Mixtral cannot be traced over fake tensors
  although eager PyTorch runs it. While tracing, `FakeKernelFixes` sends such calls to `pstar::grouped_mm`, a custom
  op with a fake kernel for the shapes (the output shape does not depend on values: (S, N) for S grouped rows) whose
  real kernel is `torch._grouped_mm` itself, and whose backward is a second opaque op computing torch's own backward
  formula with the same kernel. The graph thus computes what eager computes, bit for bit.
- They lay out outputs otherwise (batch norm over a transposed input; the backward of some losses): the view traced
  after them would fail at run time, so their inputs or gradients are given a layout both agree on.
- They allocate otherwise (oneDNN's LSTM layer on the CPU): `real_allocations` corrects the traced values, so the plan
  counts what the real kernels hold.
Temporaries inside the kernels are not planned, as for any aten op.
The first two hold inside the backward too, where autograd's engine runs Python code of the step (an activation
checkpoint's recompute, hooks, custom backwards): `FakeKernelFixes` runs every call that enters the engine with
itself in force (where torch has `torch.overrides.redispatch_function`), so a recomputed op is traced as its forward
was.
"""
from __future__ import annotations

import operator

import torch
from torch.overrides import TorchFunctionMode

from .backward_calls import BACKWARD

_GROUPED_MM = tuple(f for f in (getattr(torch, "_grouped_mm", None),
                                getattr(torch.nn.functional, "grouped_mm", None)) if f is not None)


@torch.library.custom_op("pstar::grouped_mm", mutates_args=())
def grouped_mm(mat_a: torch.Tensor, mat_b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return torch._grouped_mm(mat_a, mat_b, offs=offs)


@grouped_mm.register_fake
def _(mat_a, mat_b, offs):
    assert mat_a.dim() == 2 and mat_b.dim() == 3, "pstar::grouped_mm: (S, K) x (G, K, N) only"
    return mat_a.new_empty((mat_a.shape[0], mat_b.shape[2]))


@torch.library.custom_op("pstar::grouped_mm_backward", mutates_args=())
def grouped_mm_backward(mat_a: torch.Tensor, mat_b: torch.Tensor, offs: torch.Tensor,
                        grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # torch's formula (derivatives.yaml: _grouped_mm_mat1_backward / _grouped_mm_mat2_backward), equal bit for bit
    # to autograd's on the CPU (tests/integration/test_moe.py checks it)
    ga = torch._grouped_mm(grad, mat_b.transpose(-2, -1), offs=offs)
    gb = torch._grouped_mm(mat_a.t(), grad, offs=offs)
    return ga, gb


@grouped_mm_backward.register_fake
def _(mat_a, mat_b, offs, grad):
    return torch.empty_like(mat_a), torch.empty_like(mat_b)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, grad):
    mat_a, mat_b, offs = ctx.saved_tensors
    ga, gb = grouped_mm_backward(mat_a, mat_b, offs, grad)
    return ga, gb, None


grouped_mm.register_autograd(_backward, setup_context=_setup)


def _meta_rejects(args, kwargs) -> bool:
    """The plain (S, K) x (G, K, N) form with offsets, in a dtype the meta kernel refuses."""
    a, b = args[0], args[1]
    offs = kwargs.get("offs", args[2] if len(args) > 2 else None)
    extra = {k: v for k, v in kwargs.items() if k != "offs" and v is not None} or len(args) > 3
    return (not extra and offs is not None and a.dim() == 2 and b.dim() == 3
            and a.dtype != torch.bfloat16)


_BATCH_NORMS = (torch.nn.functional.batch_norm, torch.batch_norm)


def _channels_last(x: torch.Tensor) -> bool:
    return x.dim() == 4 and not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last)


class _ContiguousGrad(torch.autograd.Function):
    """The identity, whose backward makes the gradient contiguous (for a leaf: `contiguous_grad`)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def _contiguous(grad: torch.Tensor) -> torch.Tensor:
    return grad.contiguous()


def contiguous_grad(t: torch.Tensor) -> torch.Tensor:
    """t, whose gradient arrives contiguous: batch norm's backward then gets a contiguous gradient, whose layout its
    fake and real kernels keep alike (given a transposed one, the fake kernel keeps its strides and the real ones
    return a contiguous gradient). A hook on t itself where t is computed, so that code after may still write t in
    place (`out += identity`, `ReLU(inplace=True)`: the hook sees the gradient of t's value before the write, the
    one the op that made t differentiates); a leaf (a parameter, which the step's own hooks must not outlive) goes
    through an identity Function instead."""
    if t.grad_fn is None:
        return _ContiguousGrad.apply(t)
    t.register_hook(_contiguous)
    return t


def _batch_norm(func, args, kwargs):
    """Batch norm over a contiguous input (a copy of one laid out otherwise, such as a transposed (B, T, C) ->
    (B, C, T) sequence: the fake kernel keeps such strides, the CPU kernel returns a contiguous output, and code after
    it decides view or reshape by the strides it sees while tracing), with a contiguous gradient into its backward.
    The same values; channels-last inputs, whose layout every kernel keeps, as they are."""
    x = args[0]
    if not isinstance(x, torch.Tensor) or _channels_last(x):
        return func(*args, **kwargs)
    out = func(x.contiguous(), *args[1:], **kwargs)
    return contiguous_grad(out) if out.requires_grad else out


# ops whose backward's fake kernel keeps a non-contiguous input's strides where the CPU kernel returns a contiguous
# gradient (so a view traced after it fails at run time): their gradients are made contiguous (`contiguous_grad`)
_F = torch.nn.functional
_CONTIGUOUS_GRADS = (_F.mse_loss, _F.smooth_l1_loss, _F.huber_loss, _F.softplus, _F.elu, _F.celu, _F.selu,
                     _F.hardtanh, _F.relu6, _F.hardswish, _F.hardsigmoid)


def _contiguous_grads(func, args, kwargs):
    """func as it is (the same kernels, the same sums), its non-contiguous inputs' gradients made contiguous."""
    def fix(a):
        if isinstance(a, torch.Tensor) and a.requires_grad and not a.is_contiguous():
            return contiguous_grad(a)
        return a
    return func(*map(fix, args), **{k: fix(v) for k, v in kwargs.items()})


# torch's way for a mode's handler to call a function's own implementation while the mode stays in force (torch 2.13
# has it); without it, a call entering autograd's engine runs with no mode in force, as any mode-handled call does
_REDISPATCH = getattr(torch.overrides, "redispatch_function", None)
# whether the fixes reach the Python that autograd's engine runs (a checkpoint's recompute): with this torch, yes
IN_BACKWARD = _REDISPATCH is not None


class FakeKernelFixes(TorchFunctionMode):
    """Active while a step is traced: routes the calls described in the module docstring to their opaque ops, batch
    norm through `_batch_norm` and the losses of `_CONTIGUOUS_GRADS` with contiguous gradients (layouts their fake
    and real kernels agree on).

    The calls that enter autograd's engine (`backward_calls.BACKWARD`: the tracer's own differentiation, a reentrant
    checkpoint's inner backward) run with this mode in force again, so that the Python the engine runs (a
    checkpoint's recompute, above all) gets the same fixes as the forward, and a recomputed value has its forward
    twin's layout. A mode handles a call with itself and every mode entered after it out of force, and the engine
    keeps the modes in force when it starts: the engine thus runs with the modes entered before this one and this
    one. Invariant for the tracer: enter this mode before (beneath) any mode that must see those calls itself or
    must stay out of the backward (the source recorder, which refuses a backward inside the step)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in BACKWARD and _REDISPATCH is not None:
            with self:
                return _REDISPATCH(func, types, args, kwargs)
        if func in _GROUPED_MM and _meta_rejects(args, kwargs):
            return grouped_mm(args[0], args[1], kwargs.get("offs", args[2] if len(args) > 2 else None))
        if func in _BATCH_NORMS and args:
            return _batch_norm(func, args, kwargs)
        if func in _CONTIGUOUS_GRADS:
            return _contiguous_grads(func, args, kwargs)
        return func(*args, **kwargs)


# ops whose fake kernel returns an empty workspace where the real one allocates: (op, index of the workspace output)
_WORKSPACES = tuple((op, i) for op, i in ((getattr(torch.ops.aten, "mkldnn_rnn_layer", None), 3),)
                    if op is not None)
# ops whose fake kernel returns one tensor twice where the real one returns two: (op, index of the second)
_SEPARATE = tuple((op, i) for op, i in ((getattr(torch.ops.aten, "mkldnn_rnn_layer_backward", None), 4),)
                  if op is not None)


def _set_output(n: torch.fx.Node, index: int, value: torch.Tensor) -> None:
    """Replace output `index` of a multi-output node in its traced value and in the getitem taking it."""
    val = n.meta["val"]
    n.meta["val"] = type(val)(value if i == index else v for i, v in enumerate(val))
    for user in n.users:
        if user.target is operator.getitem and user.args[1] == index:
            user.meta["val"] = value


def real_allocations(gm: torch.fx.GraphModule, backward: bool = True) -> None:
    """The traced values of oneDNN's LSTM layer on the CPU allocated as its real kernels allocate, so the plan counts
    what they hold: the forward's workspace (saved for backward: 0 bytes from the fake kernel, tens of KiB and more
    from the real one, whose size depends on the shapes only, so it is measured by running the real kernel once on
    zeros of the traced shapes, with grad mode as the graph runs: on for a training step, off for a forward-only
    one, `backward` False, where the kernel makes none) and the backward's two bias gradients (one tensor twice
    from the fake kernel, two from the real one); and a CPU convolution's backward that returns the weight's
    gradient it was not asked for (`_unasked_weight_grad`), and a CPU batch norm's backward that returns no input
    gradient where it was not asked for one (`_unasked_input_grad`)."""
    for n in gm.graph.nodes:
        val = n.meta.get("val")
        if not isinstance(val, (tuple, list)):
            continue
        index = next((i for op, i in _WORKSPACES if n.target is op.default), None)
        if index is not None and val[index].numel() == 0 and backward:
            _set_output(n, index, _real_workspace(n, index, val))
        index = next((i for op, i in _SEPARATE if n.target is op.default), None)
        if index is not None and val[index].untyped_storage()._cdata == val[index - 1].untyped_storage()._cdata:
            with val[index].fake_mode:
                _set_output(n, index, torch.empty_like(val[index]))
        if n.target is torch.ops.aten.native_batch_norm_backward.default and _unasked_input_grad(n, val):
            # (in fp32: in half precision the fake kernel's saved statistics are half, the real ones fp32)
            if _outputs_or_none(n, torch.float32)[0] is None:
                _set_output(n, 0, None)
        if n.target is torch.ops.aten.convolution_backward.default and _unasked_weight_grad(n, val):
            weight_grad = _outputs_or_none(n)[1]
            if weight_grad is not None:
                with val[0].fake_mode:
                    _set_output(n, 1, torch.empty_strided(weight_grad.shape, weight_grad.stride(),
                                                          dtype=weight_grad.dtype))


def _run_real(n: torch.fx.Node, floating: torch.dtype | None = None):
    """The node's real kernel run once on zeros of its traced shapes (on the CPU), grad mode on; `floating`: every
    floating-point input in that dtype instead of its traced one."""
    def real(a):
        v = a.meta.get("val") if isinstance(a, torch.fx.Node) else a
        if not isinstance(v, torch.Tensor):
            return v
        return torch.zeros(v.shape, dtype=floating if floating is not None and v.is_floating_point() else v.dtype)
    args = [[real(x) for x in a] if isinstance(a, (list, tuple)) else real(a) for a in n.args]
    with torch.enable_grad():      # (under no_grad, as a forward-only graph runs, the kernel makes none)
        return n.target(*args, **{k: real(v) for k, v in n.kwargs.items()})


def _outputs_or_none(n: torch.fx.Node, floating: torch.dtype | None = None) -> tuple:
    """The real kernel's outputs (_run_real), or, where it refuses the zeros (a layout or dtype its fake kernel
    traced otherwise), the traced ones: the plan then counts what the fake kernel said, as without the check."""
    try:
        return tuple(_run_real(n, floating))
    except Exception:
        return tuple(n.meta["val"])


def _real_workspace(n: torch.fx.Node, index: int, val) -> torch.Tensor:
    workspace = _run_real(n)[index]
    with val[index].fake_mode:
        return torch.empty(0 if workspace is None else workspace.numel(), dtype=val[index].dtype)


def _unasked_input_grad(n: torch.fx.Node, val) -> bool:
    """A CPU batch norm's backward not asked for the input's gradient (nothing before it trains): the fake kernel
    returns one anyway, the real one None (run once to say so)."""
    mask = n.args[9] if len(n.args) > 9 else n.kwargs.get("output_mask")
    return (isinstance(val[0], torch.Tensor) and val[0].device.type == "cpu" and mask is not None and not mask[0]
            and not any(u.target is operator.getitem and u.args[1] == 0 and u.users for u in n.users))


def _unasked_weight_grad(n: torch.fx.Node, val) -> bool:
    """A CPU convolution's backward that asks for the input's and the bias's gradients and not the weight's (a
    frozen weight, a trained bias): oneDNN's kernel computes the weight's anyway, with the bias's, and returns it,
    where the fake kernel returns None; the real kernel, run once, says (such nodes are few)."""
    mask = n.args[10] if len(n.args) > 10 else n.kwargs.get("output_mask")
    return (val[1] is None and isinstance(val[0], torch.Tensor) and val[0].device.type == "cpu"
            and mask is not None and tuple(mask) == (True, False, True))
