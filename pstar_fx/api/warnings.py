"""Warnings about settings that work but waste: checked once a graph is compiled (or, for torch.compile wrappers, when
the step is made)."""
from __future__ import annotations

import os

import torch

from ..errors import warn
from ..ir.graph import ChunkGroup, StateHome, TrainGraph
from ..ir.needs import state_bytes, state_layout
from ..runtime.host_memory import local_ranks
from ..units import format_bytes

PADDING_WARN_FRACTION = 0.5        # padding above this share of all model data ...
PADDING_WARN_BYTES = 16 << 20      # ... and above this many bytes: warn


def chunk_padding(g: TrainGraph) -> tuple[int, int]:
    """(bytes of model data that are chunk padding, all model-data bytes): parameter, gradient and optimizer-state
    buffers of every chunk, each wasting the share of its chunk that holds no parameter."""
    wasted = total = 0
    prec = g.settings.precision
    for c in g.chunks:
        size = c.nbytes
        if c.group is ChunkGroup.TRAINABLE:
            size += (0 if c.grad_inplace else c.nbytes) + state_bytes(c, prec, 1, state_layout(g.settings))
        total += size
        wasted += size * (c.capacity - c.used) // c.capacity
    return wasted, total


def warn_chunk_padding(g: TrainGraph) -> None:
    """A chunk size far larger than the model (chunk_size=2e7 for 6k parameters) silently multiplies model data."""
    wasted, total = chunk_padding(g)
    if wasted > PADDING_WARN_FRACTION * total and wasted > PADDING_WARN_BYTES:
        used = sum(c.used for c in g.chunks)
        warn(
            f"pstar-fx: chunk_size={g.chunk_size} holds {used} parameter elements in {len(g.chunks)} chunk(s) of "
            f"{sum(c.capacity for c in g.chunks)} elements: {format_bytes(wasted)} of the {format_bytes(total)} of "
            "model data (parameters, gradients, optimizer states) is padding. Use chunk_size=None (the size that "
            "wastes least) or a smaller chunk_size.")


def warn_host_threads(g: TrainGraph) -> None:
    """Optimizer steps of chunks whose states live on the host run on torch's CPU threads; torchrun sets
    OMP_NUM_THREADS=1 unless it is set, which leaves them one core (measured: a 6.66B step on two H200s took 6.3 s,
    CPU-bound, with most states on the host). Warns where torch uses one thread and this process's share of the
    cores (the cores over the node's ranks, LOCAL_WORLD_SIZE under torchrun) is more: with as many ranks on the node
    as cores, one thread is each process's share."""
    on_host = sum(c.group is ChunkGroup.TRAINABLE and c.state_home is StateHome.HOST for c in g.chunks)
    cores = os.cpu_count() or 1
    ranks = 1 if g.settings.world == 1 else local_ranks(g.settings.world)
    share = max(1, cores // ranks)
    if on_host and torch.get_num_threads() == 1 and share > 1:
        on_node = f"{cores} cores over the {ranks} ranks on this node" if ranks > 1 else f"{cores} cores"
        warn(
            f"pstar-fx: the optimizer states of {on_host} chunk(s) live on the host and their updates run on torch's "
            f"CPU threads, but torch uses 1 thread here (torchrun sets OMP_NUM_THREADS=1 unless it is set), and this "
            f"process's share of the cores is {share} ({on_node}). Set OMP_NUM_THREADS={share} (the cores per "
            "process) or call torch.set_num_threads.")


class TorchCompileWarning(UserWarning):
    """A model, submodule or step function given to px.compile is wrapped by torch.compile, which pstar-fx does not
    use inside its step (see pstar_fx.frontend.torch_compile)."""


def warn_torch_compiled(modules: list[str], fn_compiled: bool) -> None:
    """Once per px.compile: torch.compile wrappers are traced through, so say what happens to them."""
    if not modules and not fn_compiled:
        return
    what = []
    if modules:
        names = ", ".join("the model" if n == "" else repr(n) for n in modules[:3])
        plural = "s" if len(modules) > 1 else ""
        what.append(f"{names}{' ...' if len(modules) > 3 else ''} (torch.compile'd module{plural})")
    if fn_compiled:
        what.append("the step function (torch.compile'd)")
    warn(f"pstar-fx: {' and '.join(what)}: pstar-fx compiles the whole training step itself (forward, backward and "
         "the update in one planned graph), so it traces the original code and torch.compile's wrapper is not used "
         "inside the step. Parameter names stay the ones the model reports (with the '_orig_mod.' prefix of a "
         "torch.compile'd module). Give px.compile the model and function without torch.compile to silence this.",
         TorchCompileWarning)
