"""Backward called inside the user's step function: refused, since the compiled step differentiates the returned loss
itself (and runs the update). The tracer checks every torch-level call the step function makes (not pstar-fx's own
backward) against these."""
from __future__ import annotations

import torch

from ..errors import UntraceableError

BACKWARD = {torch.Tensor.backward, torch.autograd.backward, torch.autograd.grad}


def reject(func, kwargs: dict, where: str) -> None:
    """Raise UntraceableError for a backward call at `where` (the user's line). A gradient the step uses in its loss
    (torch.autograd.grad with create_graph=True, a gradient penalty) is differentiated through, and one taken with
    retain_graph=True leaves the graph intact: both trace."""
    if func is torch.autograd.grad and (kwargs.get("create_graph") or kwargs.get("retain_graph")):
        return
    call = "torch.autograd.grad" if func is torch.autograd.grad else (
        "loss.backward()" if func is torch.Tensor.backward else "torch.autograd.backward")
    raise UntraceableError(
        f"cannot trace the training step: the step function calls {call} {where}; a pstar-fx step runs backward and "
        "the optimizer update itself: return the loss instead (and drop optimizer.step() / zero_grad() from the "
        "step)" + ("; for a gradient used in the loss (a gradient penalty), pass create_graph=True"
                   if func is torch.autograd.grad else ""))
