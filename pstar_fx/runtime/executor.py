"""The executor: runs a scheduled TrainGraph node by node over a ChunkStore.

Values are freed right after their last use, the rule liveness plans with, and the executor measures what it holds:
after every node, the device pool's highest use during the node plus the bytes of the distinct activation storages
it holds. The largest such total is the step's measured peak, comparable to the plan's predicted peak.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.utils._pytree import tree_leaves, tree_map

from .. import ops
from ..ir import BufKind, Role, StateHome, TrainGraph
from ..passes.graph_utils import storage_bytes, tensors_of
from ..passes.liveness import last_uses
from ..passes.memory import BufKey, constants
from ..units import format_bytes
from .adam import adam_step
from .chunk_store import ChunkStore

_RUNTIME_OPS = frozenset(ops.RUNTIME_OPS)


@dataclass
class LossScaler:
    """fp16 dynamic loss scaling with torch.amp.GradScaler's defaults."""
    scale: float = 2.0 ** 16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    good_steps: int = 0

    def update(self, overflow: bool) -> None:
        if overflow:
            self.scale *= self.backoff_factor
            self.good_steps = 0
        else:
            self.good_steps += 1
            if self.good_steps == self.growth_interval:
                self.scale *= self.growth_factor
                self.good_steps = 0


@dataclass(frozen=True)
class StepStats:
    measured_peak: int               # device bytes: pool (chunks, states, buffers, workspace) + activations
    h2d_bytes: int
    d2h_bytes: int
    skipped: bool                    # fp16: the step was skipped on overflow


class Runtime:
    """The state the inserted operations act on during one step (see pstar_fx.ops)."""

    def __init__(self, g: TrainGraph, store: ChunkStore, scaler: LossScaler | None):
        self.g = g
        self.store = store
        self.scaler = scaler
        self.cfg = g.settings.optimizer
        self.precision = g.settings.precision
        self.params = {p.name: p for p in g.params}
        self.found_inf: torch.Tensor | None = None
        self.skip = False
        self.h2d = 0
        self.d2h = 0

    def param_view(self, name: str) -> torch.Tensor:
        p = self.params[name]
        return self.store.slots[BufKey(p.chunk, BufKind.PARAM)][p.offset:p.offset + p.numel].view(p.shape)

    def write_grad(self, name: str, grad: torch.Tensor) -> None:
        p = self.params[name]
        c = self.g.chunks[p.chunk]
        dst = self.store.slots[BufKey(c.id, c.grad_buf())][p.offset:p.offset + p.numel].view(p.shape)
        dst.copy_(grad)
        if self.found_inf is not None:
            # max and min propagate NaN and show inf: two reductions, no temporary the size of the gradient
            bad = ~torch.isfinite(grad.amax()) | ~torch.isfinite(grad.amin())
            self.found_inf |= bad

    def fetch(self, chunk: int, buf: BufKind) -> None:
        self.store.fetch(BufKey(chunk, buf))
        self.h2d += self.g.chunks[chunk].nbytes

    def alloc(self, chunk: int, buf: BufKind) -> None:
        self.store.alloc(BufKey(chunk, buf))

    def release(self, chunk: int, buf: BufKind, writeback: bool) -> None:
        self.store.release(BufKey(chunk, buf), writeback)
        if writeback:
            self.d2h += self.g.chunks[chunk].nbytes

    def unscale(self) -> None:
        self.skip = bool(self.found_inf.item())

    def optimizer_step(self, chunk: int) -> None:
        c = self.g.chunks[chunk]
        st = self.store
        parts = st.state_parts(chunk)
        if c.state_home is StateHome.DEVICE:
            param = st.slots[BufKey(chunk, BufKind.PARAM)]
            grad = st.slots[BufKey(chunk, c.grad_buf())]
        else:
            st.before_host_write(chunk)
            param = st.host_param[chunk]
            grad = st.host(BufKey(chunk, c.grad_buf()))
        if not self.precision.mixed:
            if not self.skip:
                adam_step(self.cfg, param, grad, parts["m"], parts["v"], parts["step"])
            return
        on_device = c.state_home is StateHome.DEVICE
        g32 = (st.pool.take(c.capacity, torch.float32, what=f"step workspace of chunk {chunk}") if on_device
               else torch.empty(c.capacity, dtype=torch.float32))
        try:
            if not self.skip:
                g32.copy_(grad)
                if self.scaler is not None:
                    g32.mul_(1.0 / self.scaler.scale)
                adam_step(self.cfg, parts["master"], g32, parts["m"], parts["v"], parts["step"])
            param.copy_(parts["master"])   # new half-precision parameters (also restores them after a skip)
        finally:
            if on_device:
                st.pool.give(g32)


def _source(n: fx.Node) -> str:
    """The user's source line that produced a node, as make_fx recorded it (when it did): the innermost frame
    outside torch and pstar-fx (make_fx's trace ends inside torch, e.g. in F.embedding)."""
    trace = n.meta.get("stack_trace")
    if not trace:
        return ""
    lines = [ln.strip() for ln in trace.strip().splitlines() if ln.strip()]
    frames = [(ln, lines[i + 1] if i + 1 < len(lines) and not lines[i + 1].startswith("File ") else "")
              for i, ln in enumerate(lines) if ln.startswith("File ")]
    libraries = (torch.__file__.rpartition("/")[0] + "/", __file__.rpartition("/runtime/")[0] + "/")
    user = [f for f in frames if not any(d in f[0] for d in libraries)]
    where, code = (user or frames or [(lines[-1], "")])[-1]
    return f" ({where}: {code})"


class Executor:
    """Runs one scheduled graph. Built once per compiled signature; `run` is one training step."""

    def __init__(self, g: TrainGraph, store: ChunkStore):
        assert g.plan is not None, "the executor runs scheduled graphs"
        self.g = g
        self.store = store
        self.nodes = g.nodes
        pos = {n: i for i, n in enumerate(self.nodes)}
        last = last_uses(self.nodes)
        self.free_after: list[list[int]] = [[] for _ in self.nodes]
        for i, n in enumerate(self.nodes):
            if n.op != "output":
                self.free_after[last[i]].append(i)
        self.roles = [g.ann[n.name].role for n in self.nodes]
        self.pos = pos
        # the storage size the plan assumed for each tensor a node makes (from its fake value)
        self.constants = constants(g)
        self.planned = [[storage_bytes(t) for t in tensors_of(n)] if n.op == "call_function" else None
                        for n in self.nodes]

    def run(self, inputs: list[torch.Tensor], scale: torch.Tensor | None, rt: Runtime,
            trace_peaks: list[int] | None = None) -> tuple[torch.Tensor, int]:
        env: list = [None] * len(self.nodes)
        pool = self.store.pool
        held: dict[int, list[int]] = {}      # storage data_ptr -> [refcount, nbytes]
        act = 0
        peak = 0
        input_iter = iter(inputs)
        pool.sample()

        def hold(v) -> int:
            added = 0
            for t in tree_leaves(v):
                if isinstance(t, torch.Tensor):
                    s = t.untyped_storage()
                    ptr = s.data_ptr()
                    if pool.owns(t) or ptr == 0:
                        continue
                    e = held.get(ptr)
                    if e is None:
                        held[ptr] = [1, s.nbytes()]
                        added += s.nbytes()
                    else:
                        e[0] += 1
            return added

        def drop(v) -> int:
            removed = 0
            for t in tree_leaves(v):
                if isinstance(t, torch.Tensor):
                    ptr = t.untyped_storage().data_ptr()
                    e = held.get(ptr)
                    if e is not None:
                        e[0] -= 1
                        if e[0] == 0:
                            removed += e[1]
                            del held[ptr]
            return removed

        def load(a):
            return env[self.pos[a]]

        # tensor constants: on the device, in the pool, for the length of the step
        consts, slots = {}, []
        try:
            for name, t in self.constants.items():
                if t.numel() == 0:
                    consts[name] = t.to(self.store.device)
                    continue
                slots.append(pool.take(t.numel(), t.dtype, what=f"constant {name}"))
                consts[name] = slots[-1].view(t.shape).copy_(t)
            result = None
            for i, n in enumerate(self.nodes):
                role = self.roles[i]
                if n.op == "get_attr":
                    val = consts[n.target]
                elif n.op == "placeholder":
                    if role is Role.BUFFER:
                        val = self.store.buffers[n.meta["buffer"]]
                    elif role is Role.SCALE:
                        val = scale
                    else:
                        val = next(input_iter)
                elif n.op == "output":
                    result = fx.node.map_arg(n.args[0], load)
                    val = None
                elif n.target in _RUNTIME_OPS:
                    args = fx.node.map_arg(n.args, load)
                    val = n.target(rt, *args, **n.kwargs)
                else:
                    args = fx.node.map_arg(n.args, load)
                    kwargs = fx.node.map_arg(n.kwargs, load)
                    try:
                        val = n.target(*args, **kwargs)
                    except Exception as e:
                        raise RuntimeError(f"pstar-fx: {n.target} failed at node {n.name}{_source(n)}: {e}") from e
                    val = self._compact(val, self.planned[i], pool)
                env[i] = val
                act += hold(val)
                total = pool.sample() + act
                peak = max(peak, total)
                if trace_peaks is not None:
                    trace_peaks.append(total)
                if pool.budget is not None and total > pool.budget:
                    raise RuntimeError(f"pstar-fx bug: node {n.name} holds {format_bytes(total)} on the device, "
                                       f"past the budget {format_bytes(pool.budget)} that the plan promised to keep")
                for j in self.free_after[i]:
                    act -= drop(env[j])
                    env[j] = None
        finally:
            for slot in slots:
                pool.give(slot)
        return result[0], peak

    @staticmethod
    def _compact(val, planned: list[int], pool):
        """A kernel may return a tensor whose storage is larger than the plan assumed (a CPU reduction can hand back
        a 0-d view of its unreduced buffer): copy such a value into a storage of the planned size. Views of chunk
        memory are left alone: their storage is the chunk."""
        leaves = [t for t in tree_leaves(val) if isinstance(t, torch.Tensor)]
        if len(leaves) != len(planned):
            return val
        fix = {id(t): t.clone() for t, p in zip(leaves, planned)
               if t.untyped_storage().nbytes() > p and not pool.owns(t)}
        if not fix:
            return val
        return tree_map(lambda t: fix.get(id(t), t) if isinstance(t, torch.Tensor) else t, val)


