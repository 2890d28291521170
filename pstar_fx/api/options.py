"""px.compile's options: each checked (a clear ValueError or TypeError naming the option and what to pass) and
resolved (device, precision, budget), before anything is traced."""
from __future__ import annotations

import dataclasses
import math
import os
import shutil

import torch
import torch.nn as nn

from ..cost import H200, Machine, gpu_named, preset
from ..errors import warn
from ..ir.graph import LossRows, Precision
from ..optim import OptimizerSpec
from ..runtime import native
from ..runtime.comm import Comm
from ..runtime.disk import check_dir
from ..runtime.host_memory import host_limit_bytes, local_ranks, spare_host_bytes
from ..units import parse_bytes
from .device_budget import (
    ALLOCATOR_EXPANDABLE,
    DefaultBudget,
    default_cpu_budget,
    default_cuda_budget,
)


# px.compile's fuse=None: whether the compute between chunk operations is compiled (passes/regions.py), by device
# type and precision; a pair not named is unfused. Fused regions change the last bits (Inductor sums in its own
# order), so only mixed precision, held to autocast's tolerance (docs/design.md, "Numerics"), can take them by
# default, and only on CUDA (on the CPU Inductor's C++ kernels need a compiler and did not pay for their compile time
# on the example). CUDA bf16 and fp16 are fused (where the estimate agrees: FUSE_IF_FASTER below): the GPU test
# subset passes whole both ways, and fused steps ran faster on the H200 where compute decides the step
# (BENCHMARKS.md, "Fused regions"); several ranks stay unfused (resolve_fuse) until fused steps have run on several
# GPUs.
DEFAULT_FUSE: dict[tuple[str, Precision], bool] = {("cuda", Precision.BF16): True, ("cuda", Precision.FP16): True}

# fuse=None where DEFAULT_FUSE fuses: the regions are kept only where the cost model estimates the step faster with
# them (passes/regions.py fuse_if_faster): a step bound by the CPU worker's updates beside backward ran slower fused.
# The tests set it False to fuse every such step (tests/conftest.py, PSTAR_TEST_FUSE=1).
FUSE_IF_FASTER = True


# A CPU device of one rank is the host itself: its chunk slots are their host homes (nothing is copied), host-side
# updates run on the step's thread, and the planner streams no update to it (Settings.host_is_device). The tests set
# it False to take a GPU's paths on the CPU (tests/conftest.py).
CPU_DEVICE_IS_HOST = True


def host_is_device(device: torch.device, world: int) -> bool:
    return CPU_DEVICE_IS_HOST and device.type == "cpu" and world == 1


def resolve_fuse(fuse, device: torch.device, precision: Precision, world: int = 1) -> bool:
    """None: DEFAULT_FUSE for the device type and the precision, with one rank (False where it names none, with
    several ranks until fused steps have run on several GPUs, and on CUDA where Triton, which Inductor needs there, is
    not installed)."""
    if fuse is None:
        return default_fuse(device.type, precision, world) and (device.type != "cuda" or _has_triton())
    if not isinstance(fuse, bool):
        raise ValueError(f"fuse must be True, False or None (the default for the device), got {fuse!r}")
    return fuse


def default_fuse(device_type: str, precision: Precision, world: int) -> bool:
    """DEFAULT_FUSE's entry for the device type and the precision, with one rank (px.plan's fuse=None reads it for
    CUDA, whether or not this machine has Triton)."""
    return world == 1 and DEFAULT_FUSE.get((device_type, precision), False)


def fuse_by_estimate(fuse, resolved: bool) -> bool:
    """Whether px.compile's `fuse` (as given) leaves the choice to the cost model: None resolved to fused."""
    return fuse is None and resolved and FUSE_IF_FASTER


def _has_triton() -> bool:
    try:
        from torch.utils._triton import has_triton
    except ImportError:   # pragma: no cover - every supported torch has it
        return False
    return has_triton()


def _refuse_offloaded(model: nn.Module) -> None:
    """A model that accelerate dispatched with offloading (`from_pretrained(..., device_map=...)` with some weights on
    the disk or the CPU behind hooks): its offloaded tensors are meta placeholders that accelerate's hooks fill at
    each forward, which a trace cannot follow (it fails inside accelerate). Refused before anything is traced."""
    hooked = getattr(model, "hf_device_map", None) is not None or any(
        hasattr(m, "_hf_hook") for m in model.modules())
    if not hooked:
        return
    on_meta = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if on_meta:
        raise ValueError(
            f"px.compile: the model was dispatched by accelerate with offloaded weights ({len(on_meta)} tensors on "
            f"the meta device behind its hooks, such as {on_meta[0]!r}): pstar-fx does the offloading itself. "
            "Load the model without device_map (its weights on the CPU: from_pretrained(name)), or, where the host "
            "cannot hold them, build it under px.init_empty() and load its weights with step.load_state_dict after "
            "step.lower(*batch) (docs/init_empty.md)")


def check_options(model, optimizer, *, chunk_size, prefetch, max_grad_norm, accumulate, remat, atomic,
                  cache_size=8, debug=False) -> None:
    """Raise on a model that is not a module, an optimizer that is not a px optimizer description (or None), or an
    option out of its range."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"px.compile: model must be a torch.nn.Module, got {type(model).__name__}")
    if optimizer is not None and not isinstance(optimizer, OptimizerSpec):
        raise TypeError(_not_a_spec(optimizer))
    _refuse_offloaded(model)
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
    if not isinstance(debug, bool):
        raise ValueError(f"debug must be True or False, got {debug!r}")
    if not isinstance(cache_size, int) or isinstance(cache_size, bool) or cache_size < 1:
        raise ValueError(f"cache_size must be a number of compiled batch signatures to keep, an int >= 1, got "
                         f"{cache_size!r}")


def _not_a_spec(optimizer) -> str:
    """What to pass instead of `optimizer`: a torch.optim object or class names its px equivalent."""
    cls = type(optimizer) if isinstance(optimizer, torch.optim.Optimizer) else optimizer
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        return ("px.compile: optimizer must be a px optimizer description such as px.AdamW(lr=...), px.SGD(...) or "
                "px.optim_from_torch(torch.optim.RMSprop, lr=...) (or None for a forward-only evaluation function), "
                f"got {type(optimizer).__name__}")
    name = cls.__name__
    known = {"Adam": "px.Adam", "AdamW": "px.AdamW", "SGD": "px.SGD"}
    instead = (f"{known[name]}(lr=..., ...)" if getattr(torch.optim, name, None) is cls and name in known
               else f"px.optim_from_torch({cls.__module__}.{name}, lr=..., ...)")
    what = f"a {name} object" if isinstance(optimizer, torch.optim.Optimizer) else f"the class {name}"
    return (f"px.compile: optimizer must be a px optimizer description, got {what}; pass {instead} with the same "
            "arguments (params optional: the model's parameters by default). pstar-fx keeps the optimizer states in "
            "its chunks and builds step.optimizer, a real torch.optim object, itself")


def resolve_device(device) -> torch.device:
    """None: CUDA when torch sees it, else the CPU; "cuda" without an index: the current CUDA device."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        d = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device must be 'cuda', 'cuda:N', 'cpu' or a torch.device (or None), got {device!r}") \
            from None
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


def resolve_budget(device_memory, device: torch.device, world: int) -> tuple[int, DefaultBudget | None]:
    """Bytes: device_memory parsed, or (None) what the device can give pstar-fx's tensors: on a GPU its free memory
    less the room the process needs beside them (see api/device_budget.py; the DefaultBudget says how much), on the
    CPU the available physical memory."""
    if device_memory is not None:
        return parse_bytes(device_memory), None
    if device.type == "cuda":
        default = default_cuda_budget(device, world)
        if default.budget <= 0:
            raise ValueError(f"device_memory=None: {device} has {default.free} bytes free, less than the room the "
                             f"process needs beside pstar-fx's tensors ({default}); free device memory, or pass "
                             "device_memory explicitly")
        if default.allocator > ALLOCATOR_EXPANDABLE:
            warn("pstar-fx: torch's CUDA allocator uses fixed-size segments, which fragment without bound under a "
                 "plan that fills the device (on an H200 a 17B GPT planned to 125.8 GiB ran out of memory with 14 "
                 f"GiB in fragments). device_memory=None leaves {default.allocator / 2**30:.1f} GiB for them, which "
                 "may not be enough: set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True before the process "
                 "starts (see docs/memory.md)")
        return default.budget, default
    return default_cpu_budget(), None


def resolve_machine(device: torch.device, precision: Precision, configs: tuple = ()) -> Machine:
    """The rates px.compile's passes weigh their choices at and `step.summary()` estimates the step with: on a GPU
    the preset of its kind by name (pstar_fx.cost.preset: the H200's measured rates, the H100's assumed from them),
    the H200's for any other device (on a GPU the cost model has no rates of, the estimate is the H200's). In mixed
    precision, whether this host runs the native update of exact moments (`Machine.native_update`): the native
    kernels build and load here, and no optimizer group (`configs`, each group's options at compile time) asks for
    torch's reference formula (Adam's fused=False, which the runtime applies op by op: the whole step is then planned
    at the rate of torch's fused-kernel route, which that formula is slower than; no rate of its own is modelled).
    The native kernel's once-per-process check against torch's bits is not run ahead."""
    kind = gpu_named(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    machine = H200 if kind is None else preset(kind)
    if precision.mixed and (native.kernels() is None or any(getattr(c, "fused", None) is False for c in configs)):
        machine = dataclasses.replace(machine, native_update=False)
    return machine


# "not given" in the ranks' agreement on their tier budgets (an int64 larger than any budget)
_UNSET = 1 << 62


def host_spare(default: bool, world: int) -> int | None:
    """Settings.host_spare: with the default host budget (host_memory=None, no disk tier) on one rank, the host memory
    the system could give now less the margin (runtime/host_memory.spare_host_bytes), which bounds the undo buffers
    too; None otherwise."""
    return spare_host_bytes(1) if default and world == 1 else None


def resolve_tiers(host_memory, offload_dir, disk_memory, comm: Comm | None = None
                  ) -> tuple[int | None, str | None, int | None]:
    """(host budget, offload directory, disk budget) of this rank, from px.compile's host_memory, offload_dir and
    disk_memory.

    host_memory: bytes or a size string, for the node (with several ranks, each rank's budget is its share: divided
    by the ranks on the node, LOCAL_WORLD_SIZE, as px.plan divides a node's host memory among its GPUs); None: with
    a disk tier, the host memory the system could give now less a margin (runtime/host_memory.spare_host_bytes),
    and without one the host's whole memory less that margin (host_limit_bytes: what a plan can never exceed, so
    that a plan the host cannot hold raises BudgetError at compile time, not an out-of-memory kill), each shared
    among the node's ranks; not checked where /proc/meminfo cannot say, nor with several ranks and no
    LOCAL_WORLD_SIZE (launched otherwise than by torchrun: the ranks per node are not known). offload_dir: an
    existing, writable directory for the disk tier's files (None: no disk tier); ranks may share it, each making a
    directory of its own there. disk_memory: bytes of it each rank's disk tier may use (per rank, as px.plan's per
    GPU); None: the free space there now, shared among the node's ranks.

    With several ranks (comm), every rank must plan the same chunks on disk, since the schedule is collective: each
    rank's budgets are made the smallest over the ranks (one all-reduce on the control group), whether given or
    measured, and a disk tier given on some ranks only raises ValueError on every rank."""
    world = 1 if comm is None else comm.world
    local = 1 if comm is None else local_ranks(world)
    host = None if host_memory is None else parse_bytes(host_memory, "host_memory") // local
    if offload_dir is None and disk_memory is not None:
        raise ValueError("disk_memory bounds the disk tier, which needs offload_dir (a directory on a local disk "
                         "for optimizer states that do not fit host_memory); pass offload_dir too, or drop "
                         "disk_memory")
    path = disk = None
    if offload_dir is not None:
        path = check_dir(offload_dir)
        disk = (shutil.disk_usage(path).free // local if disk_memory is None
                else parse_bytes(disk_memory, "disk_memory"))
        if host is None:
            host = spare_host_bytes(local)
            if host <= 0:
                raise ValueError("host_memory=None with offload_dir: the host memory available could not be read "
                                 "(/proc/meminfo); pass host_memory")
    elif host is None and (world == 1 or "LOCAL_WORLD_SIZE" in os.environ):     # (else: ranks per node unknown)
        host = host_limit_bytes(local)
    if comm is not None:
        tier = int(path is not None)
        fewest_tiers, neg_most_tiers, host_min, disk_min = comm.smallest(
            [tier, -tier, _UNSET if host is None else host, _UNSET if disk is None else disk])
        if fewest_tiers != -neg_most_tiers:
            raise ValueError(f"offload_dir is given on some ranks and not on others (this is rank {comm.rank} of "
                             f"{world}, {'with' if tier else 'without'} one): every rank must plan the same chunks "
                             "on disk, so pass offload_dir on every rank or on none")
        host = None if host_min == _UNSET else host_min
        disk = None if disk_min == _UNSET else disk_min
    if host is not None and host <= 0:
        raise ValueError(f"host_memory {host_memory!r} is less than a byte for each of the {local} ranks on this "
                         "node (host_memory is per node, shared by its ranks): pass the node's host memory")
    return host, path, disk


def loss_rows_settings(when, block_bytes: int | None) -> dict:
    """Settings' loss_rows and loss_block_bytes from px.compile's private `_loss_rows` (a LossRows) and
    `_loss_block_bytes` (bytes > 0); None leaves each at its default."""
    out: dict = {}
    if when is not None:
        if not isinstance(when, LossRows):
            raise TypeError(f"_loss_rows must be a pstar_fx.ir.graph.LossRows, got {when!r}")
        out["loss_rows"] = when
    if block_bytes is not None:
        if block_bytes <= 0:
            raise ValueError(f"_loss_block_bytes must be a number of bytes > 0, got {block_bytes!r}")
        out["loss_block_bytes"] = block_bytes
    return out
