"""px.compile's options: each checked (a clear ValueError or TypeError naming the option and what to pass) and
resolved (device, precision, budget), before anything is traced."""
from __future__ import annotations

import math
import os

import torch
import torch.nn as nn

from ..ir.graph import Precision
from ..optim import OptimizerSpec
from ..units import parse_bytes


def check_options(model, optimizer, *, chunk_size, prefetch, max_grad_norm, accumulate, remat, atomic,
                  cache_size=8) -> None:
    """Raise on a model that is not a module, an optimizer that is not px.Adam/AdamW (or None), or an option out of
    its range."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"px.compile: model must be a torch.nn.Module, got {type(model).__name__}")
    if optimizer is not None and not isinstance(optimizer, OptimizerSpec):
        raise TypeError("px.compile: optimizer must be px.Adam(...) or px.AdamW(...) (or None for a "
                        f"forward-only evaluation function), got {type(optimizer).__name__}")
    if chunk_size is not None and (not isinstance(chunk_size, int) or isinstance(chunk_size, bool)
                                   or chunk_size <= 0):
        raise ValueError(f"chunk_size must be a positive int number of elements, got {chunk_size!r}"
                         + (f" (a float: write {int(chunk_size)} or int({chunk_size!r}))"
                            if isinstance(chunk_size, float) and chunk_size.is_integer() and chunk_size > 0
                            else ""))
    if prefetch is not None and (not isinstance(prefetch, int) or isinstance(prefetch, bool) or prefetch < 0):
        raise ValueError(f"prefetch must be a number of nodes >= 0 (or None: as early as the budget allows), got "
                         f"{prefetch!r}")
    if max_grad_norm is not None and (not isinstance(max_grad_norm, (int, float)) or isinstance(max_grad_norm, bool)
                                      or not math.isfinite(max_grad_norm) or max_grad_norm <= 0):
        raise ValueError(f"max_grad_norm must be a positive finite number (or None), got {max_grad_norm!r}")
    if not isinstance(accumulate, int) or isinstance(accumulate, bool) or accumulate < 1:
        raise ValueError(f"accumulate must be a number of micro-batches >= 1, got {accumulate!r}")
    if remat not in ("auto", True, False):
        raise ValueError(f"remat must be 'auto' (recompute activations where the budget needs it) or False, "
                         f"got {remat!r}")
    if not isinstance(atomic, bool):
        raise ValueError(f"atomic must be True or False, got {atomic!r}")
    if not isinstance(cache_size, int) or isinstance(cache_size, bool) or cache_size < 1:
        raise ValueError(f"cache_size must be a number of compiled batch signatures to keep, an int >= 1, got "
                         f"{cache_size!r}")


def check_world(atomic: bool, world: int) -> None:
    if not atomic and world > 1:
        raise ValueError(f"atomic=False is not supported with more than one rank (this process group has "
                         f"{world}): leave atomic=True")


def resolve_device(device) -> torch.device:
    """None: CUDA when torch sees it, else the CPU; "cuda" without an index: the current CUDA device."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    d = torch.device(device)
    if d.type not in ("cuda", "cpu"):
        raise ValueError(f"device must be 'cuda' or 'cpu', got {device!r}")
    if d.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but torch sees no CUDA device; use device='cpu' or None")
    if d.type == "cuda" and d.index is None:
        d = torch.device("cuda", torch.cuda.current_device())
    return d


def resolve_precision(precision, device: torch.device) -> Precision:
    """None: bf16 on CUDA, fp32 on the CPU."""
    if precision is None:
        return Precision.BF16 if device.type == "cuda" else Precision.FP32
    try:
        return Precision(precision)
    except ValueError:
        raise ValueError(f"precision must be one of 'fp32', 'bf16', 'fp16', got {precision!r}") from None


def resolve_budget(device_memory, device: torch.device) -> int:
    """Bytes: device_memory parsed, or (None) the device's free memory (on the CPU, the available physical pages)."""
    if device_memory is not None:
        return parse_bytes(device_memory)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
