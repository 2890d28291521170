"""rnn_kernels: recurrent layers traced through torch's own operations on CUDA, not through cuDNN's RNN kernel.

On CUDA, nn.LSTM, nn.GRU and nn.RNN call cuDNN's RNN kernel, which takes the weights as one flat buffer built from a
storage (`flatten_parameters`, `_cudnn_rnn`): an operation a trace cannot record. While the step is traced,
`without_cudnn` turns cuDNN off around the forward of each such module (`torch.backends.cudnn.enabled`, restored
right after it, and when the trace ends however it ends). The module then keeps its weights apart, and torch
decomposes aten.lstm / gru / rnn_tanh / rnn_relu into matmuls and pointwise operations, one set per time step
(torch._decomp), which the plan counts and the executor runs like any others. Only these modules' forward (and its
recompute under an activation checkpoint) is traced so; every other operation of the step (convolutions, batch norm)
is traced as before. On the CPU nothing changes: oneDNN's layer kernel traces (fake_fixes.py plans its workspace).

Numerics: the decomposition's kernels are not cuDNN's, so a step's results equal eager PyTorch's (cuDNN) to the
last bits only within a rounding tolerance, as two kernels of one formula do.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn as nn


@contextlib.contextmanager
def without_cudnn(model: nn.Module, device: torch.device):
    """While in it, each nn.RNNBase module of `model` runs its forward with cuDNN off (on a CUDA device; elsewhere
    this does nothing)."""
    rnns = [m for m in model.modules() if isinstance(m, nn.RNNBase)] if device.type == "cuda" else []
    if not rnns:
        yield
        return
    outer = torch.backends.cudnn.enabled
    saved: list[bool] = []            # one entry per forward under way (a module may call another)

    def enter(module, args):
        saved.append(torch.backends.cudnn.enabled)
        torch.backends.cudnn.enabled = False

    def leave(module, args, out):
        torch.backends.cudnn.enabled = saved.pop()

    handles = []
    try:
        for m in rnns:
            handles.append(m.register_forward_pre_hook(enter))
            handles.append(m.register_forward_hook(leave, always_call=True))
        yield
    finally:
        for h in handles:
            h.remove()
        torch.backends.cudnn.enabled = outer
