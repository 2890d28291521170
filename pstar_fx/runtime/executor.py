"""The executor: runs a scheduled TrainGraph node by node over a ChunkStore.

Values are freed right after their last use, the rule liveness plans with, and the executor measures what it holds:
after every node, the device pool's highest use during the node plus the bytes of the distinct activation storages
it holds (plus, at a fused region, the bound the plan holds for the buffers its compiled code makes and frees inside
it, which no pool sees). The largest such total is the step's measured peak, comparable to the plan's predicted peak.
"""
from __future__ import annotations

import re
from typing import Callable

import torch
import torch.fx as fx
from torch.utils._pytree import tree_map

from ..errors import CommitError, DeviceMemoryError
from ..interrupts import DeferredInterrupt
from ..ir import ops
from ..ir.fx_utils import has_node, last_uses, mutated_args, storage_bytes, tensors_in, tensors_of, user_frame
from ..ir.graph import Role, TrainGraph
from ..ir.needs import BufKey, constants
from ..units import format_bytes, parse_bytes
from .chunk_store import ChunkStore
from .codegen import compile_step
from .compiled_regions import RegionCompiler
from .step_runtime import ParamSites, Runtime

_RUNTIME_OPS = frozenset(ops.RUNTIME_OPS)

# what the executor does at a node, decided once per graph (the loop compares small ints, not strings and ops)
_GET_ATTR, _BUFFER, _SCALE, _INPUT, _OUTPUT, _REGION, _RUNTIME, _ATEN = _KINDS = tuple(range(8))


def _kind(n: fx.Node, role: Role) -> int:
    if n.op == "get_attr":
        return _GET_ATTR
    if n.op == "placeholder":
        return _BUFFER if role is Role.BUFFER else _SCALE if role is Role.SCALE else _INPUT
    if n.op == "output":
        return _OUTPUT
    if role is Role.REGION:
        return _REGION
    return _RUNTIME if n.target in _RUNTIME_OPS else _ATEN


def _template(args, pos: dict) -> list | None:
    """A flat argument list's recipe: for each argument, (the position of the node whose value it is, or -1, and
    the constant otherwise); None where an argument nests nodes in a list or tuple (fx's map_arg builds those)."""
    out = []
    for a in args:
        if isinstance(a, fx.Node):
            out.append((pos[a], None))
        elif has_node(a):
            return None
        else:
            out.append((-1, a))
    return out


def _flat_tensors(val) -> list[torch.Tensor]:
    """tensors_in, without a pytree walk for a tuple or list of tensors and None (multi-output ops)."""
    if type(val) is torch.Tensor:
        return [val]
    if val is None:
        return []
    if type(val) in (tuple, list) and all(t is None or type(t) is torch.Tensor for t in val):
        return [t for t in val if t is not None]
    return tensors_in(val)


def mutated_buffers(g: TrainGraph) -> list[str]:
    """Module buffers the step writes in place (BatchNorm's running statistics): put back if a step fails."""
    owner: dict[fx.Node, str] = {}
    out: list[str] = []
    for n in g.gm.graph.nodes:
        if n.op == "placeholder" and g.ann[n.name].role is Role.BUFFER:
            owner[n] = n.meta["buffer"]
        elif n.op == "call_function":
            for a in n.all_input_nodes:       # views of a buffer (and in-place results) write into it too
                if a in owner:
                    owner.setdefault(n, owner[a])
            for m in mutated_args(n):
                if m in owner and owner[m] not in out:
                    out.append(owner[m])
    return out


def _source(n: fx.Node) -> str:
    """The user's source line that produced a node, as the trace recorded it (ir/fx_utils.user_frame), for an
    error message; "" when it recorded none."""
    frame = user_frame(n)
    return "" if frame is None else f" ({frame[0]}: {frame[1]})"


def out_of_memory(e: BaseException) -> torch.OutOfMemoryError | None:
    """The device's out-of-memory error behind a failed node, if that is what failed."""
    for err in (e, e.__cause__):
        if isinstance(err, torch.OutOfMemoryError):
            return err
    return None


def device_memory_error(n: fx.Node, oom: torch.OutOfMemoryError, store: ChunkStore) -> DeviceMemoryError:
    """A BudgetError for an allocation the device refused at node n, though the plan kept within the budget."""
    m = re.search(r"Tried to allocate ([0-9.]+ [KMGT]?i?B)", str(oom))
    asked = parse_bytes(m.group(1).replace(" ", "")) if m else 0
    free = torch.cuda.mem_get_info(store.device)[0] if store.device.type == "cuda" else 0
    budget = store.pool.budget
    return DeviceMemoryError(
        f"pstar-fx: the device ran out of memory at node {n.name}{_source(n)}: "
        f"{format_bytes(asked) if asked else 'an allocation'} asked, {format_bytes(free)} free on {store.device}, "
        f"though the plan kept this step within its budget "
        f"({'unlimited' if budget is None else format_bytes(budget)}). Memory the plan does not see took the rest "
        "(another process, tensors kept outside the step, the allocator's fragmentation). The step changed nothing: "
        "pass a smaller device_memory, free that memory, or set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True "
        "before the process starts.", node=n.name, needed=asked, available=free)


class Executor:
    """Runs one scheduled graph. Built once per compiled signature; `run` is one training step."""

    def __init__(self, g: TrainGraph, store: ChunkStore, regions: RegionCompiler | None = None,
                 between: Callable[[], None] | None = None):
        """`regions` compiles the graph's fused regions (fuse=True), here, once; a compiler of one's own when
        None. `between()` runs after each region compiled (the caller's safe point for a pending Ctrl-C)."""
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
        self.mutated_buffers = mutated_buffers(g)
        self.sites = ParamSites(g)       # where the runtime's operations find each parameter, for every step
        # fused regions: per node position, the compiled callable of a region node
        at = [i for i, r in enumerate(self.roles) if r is Role.REGION]
        fns, self.region_stats = (regions or RegionCompiler()).compile_all([self.nodes[i].kwargs["spec"] for i in at],
                                                                           between)
        self.compiled: list = [None] * len(self.nodes)
        # a region's internal buffers, which its compiled code allocates and frees itself where the pool cannot see
        # them: counted at its node as the plan's bound on them (passes/regions.py)
        self.workspace = [g.ann[n.name].workspace_bytes if r is Role.REGION else 0
                          for n, r in zip(self.nodes, self.roles)]
        for i, fn in zip(at, fns):
            self.compiled[i] = fn
        # per node: how far its planned bytes stay below the plan's peak (room for slots still being written back)
        plan = g.plan
        # per node: the (numel, dtype) of the slot it takes from the pool (a fetch or an alloc), else None
        self.takes = [store.slot_spec(BufKey(n.kwargs["chunk"], n.kwargs["buf"]))
                      if n.target is ops.fetch or n.target is ops.alloc else None for n in self.nodes]
        self.room = [plan.predicted_peak - (plan.static_bytes + a.resident_bytes + a.live_bytes + a.workspace_bytes)
                     for a in (g.ann[n.name] for n in self.nodes)]
        # per node: what to do, its arguments' recipe (None: fx's map_arg), its keyword arguments when constant
        self.kinds = [_kind(n, r) for n, r in zip(self.nodes, self.roles)]
        self.arg_recipes = [_template(n.args, pos) if k in (_RUNTIME, _ATEN) else None
                            for n, k in zip(self.nodes, self.kinds)]
        self.const_kwargs = [None if has_node(n.kwargs) else n.kwargs for n in self.nodes]
        # the first value written that cannot be put back (the commit, or an earlier host-side step with
        # atomic=False; an undo chunk's can): from after its delivery check on, Ctrl-C waits for the step's end
        self.holds_from = next((i for i, (n, r) in enumerate(zip(self.nodes, self.roles)) if r is Role.COMMIT or
                                r is Role.OPTIMIZER_STEP and not g.chunks[g.ann[n.name].chunk].undo), len(self.nodes))
        # the generated loop (runtime/codegen.py), once a measured run has matched the plan: the nodes whose value
        # that run copied into a storage of the planned size, and the peak it measured
        self.compact_at: set[int] = set()
        self.verified_peak: int | None = None
        self._generated = None          # the function; False where the graph cannot be generated

    def run(self, inputs: list[torch.Tensor], scale: torch.Tensor | None, rt: Runtime, interrupts: DeferredInterrupt,
            trace_peaks: list[int] | None = None, before_node=None) -> tuple[list[torch.Tensor], int]:
        """One step; returns the graph's outputs (a training step's: [loss]) and the measured peak. Atomic: if any
        node before the commit point fails, every value is put back as it was before the step and the error
        propagates (the values of chunks updated ahead of the commit from their undo buffers, runtime/undo.py). With
        atomic=False a host-side step may come before the commit: the step is then atomic up to the first step node
        only.

        Ctrl-C: the caller holds SIGINT in `interrupts` (active over its whole call, see pstar_fx/interrupts.py), so no
        KeyboardInterrupt lands inside the store's bookkeeping. Before the commit point (or the first step node),
        one that arrived is delivered between nodes, and the step is rolled back as for any failure; from there on
        it stays pending until the step is complete, and the caller delivers it after its own bookkeeping (the step
        counts as done). `before_node(i, node)` is called before every node (fault injection in tests)."""
        saved = {name: self.store.buffers[name].clone() for name in self.mutated_buffers}
        self._at = 0                    # the node running (an out-of-memory error names it)
        try:
            h2d, d2h = self.store.enter(self.g.plan.carried)   # the prologue: nothing moves in the steady state
            rt.h2d += h2d
            rt.d2h += d2h
            generated = bool(self._generated) and trace_peaks is None
            if generated:
                outputs, peak = self._run_generated(inputs, scale, rt, interrupts, before_node)
            else:
                outputs, peak = self._run(inputs, scale, rt, trace_peaks, before_node, interrupts)
            self.store.finish_disk()    # the disk tier's writes of this step (after its commit)
        except BaseException as e:
            self.store.abandon_disk()   # reads in flight finish (into staging buffers only) before anything else
            undone = [] if rt.committed else list(rt.undoable)
            # an update begun (after the commit, a host-side one before it with atomic=False, or an undo chunk's
            # once committed), or with several ranks the commit passed (the others go on), or with atomic=False a
            # reduce-scatter passed (the others may have begun their updates of its chunk): nothing is put back. On
            # one rank, past the commit with no update begun, nothing was written yet: put back as before it
            others = rt.comm is not None and self.g.settings.early_updates and bool(self.store.reduced)
            broken = bool(rt.stepped) or (rt.committed and rt.comm is not None) or others
            if undone:
                self.store.settle(undone)     # updates ahead of the commit end (a failure is this step's)
            try:
                self.store.reclaim()        # slots still being written back
                # before the commit no parameter slot was written except by in-place gradients (mixed precision,
                # whose host homes are rebuilt from the masters below): what goes home is what the step started from
                self.store.evict_all()
                self.store.recount()        # an allocation that failed half-way leaves no count behind
                self.store.pool.trim(0)
            finally:
                if not broken:
                    self._put_back(undone, saved)
            if broken:
                where = ("its commit point" if rt.committed else "its first update" if rt.stepped else
                         "a reduce-scatter, after which the other ranks may have begun their updates (atomic=False)")
                raise CommitError(
                    f"pstar-fx: the step failed after {where} "
                    f"({type(e).__name__}: {e}), with the updates of "
                    f"{len(rt.stepped)} of {sum(1 for r in self.roles if r is Role.OPTIMIZER_STEP)} chunks "
                    "begun (the last possibly unfinished); the compiled step's values are no longer consistent. "
                    "Load a checkpoint with step.load(path) to continue.") from e
            oom = out_of_memory(e)
            if oom is not None:
                raise device_memory_error(self.nodes[self._at], oom, self.store) from e
            raise
        if not generated:
            # the plan held: later steps take the generated loop, made now (in the call that measured, not the
            # first that uses it); not with debug=True (trace_peaks), whose steps all measure
            self.verified_peak = peak
            if self._generated is None and trace_peaks is None:
                try:
                    self._generated, self._node_at = compile_step(self, _KINDS, self.store, self.store.pool)
                except NotImplementedError:
                    self._generated = False      # an argument codegen cannot write: this graph is interpreted
        return outputs, peak

    def _put_back(self, undone: list[int], saved: dict) -> None:
        """After a step failed before its commit: the values of chunks updated ahead of it from their undo buffers,
        the module buffers the step writes in place, and in mixed precision the half-precision parameters from the
        masters."""
        self.store.undo.put_back(undone, self.store.states, self.store.host_param)
        for name, value in saved.items():
            self.store.buffers[name].copy_(value)
        self.store.values.restore_params_from_masters()

    def _run(self, inputs, scale, rt: Runtime, trace_peaks, before_node, interrupts) -> tuple[list, int]:
        env: list = [None] * len(self.nodes)
        pool = self.store.pool
        held: dict[int, list[int]] = {}      # storage data_ptr -> [refcount, nbytes]
        act = 0
        peak = 0
        input_iter = iter(inputs)
        pool.sample()

        owned = pool.storages              # data_ptrs of the pool's slots (chunk memory, counted by the pool)

        def hold(v) -> int:
            added = 0
            for t in _flat_tensors(v):
                s = t.untyped_storage()
                ptr = s.data_ptr()
                if ptr == 0 or ptr in owned:
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
            for t in _flat_tensors(v):
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

        consts, slots = {}, []
        try:
            self._take_constants(consts, slots)
            result = None
            store = self.store
            nodes, kinds, recipes, const_kwargs = self.nodes, self.kinds, self.arg_recipes, self.const_kwargs
            workspace, free_after = self.workspace, self.free_after
            budget, plan_peak = pool.budget, self.g.plan.predicted_peak
            for i, n in enumerate(nodes):
                self._at = i
                kind = kinds[i]
                # released slots still being written back (device bytes the plan freed), after giving back as many
                # as this node's room needs; this node's window of the pool's use starts after those given back
                had_draining = bool(store.draining)
                draining = self._before(i, interrupts, before_node)
                if had_draining:
                    pool.sample()
                if kind == _ATEN or kind == _RUNTIME:
                    recipe = recipes[i]
                    args = (fx.node.map_arg(n.args, load) if recipe is None else
                            [env[p] if p >= 0 else c for p, c in recipe])
                    if kind == _RUNTIME:
                        val = n.target(rt, *args, **n.kwargs)
                    else:
                        kwargs = const_kwargs[i]
                        if kwargs is None:
                            kwargs = fx.node.map_arg(n.kwargs, load)
                        try:
                            val = n.target(*args, **kwargs)
                        except Exception as e:
                            raise self._node_error(i, e) from e
                        val = self._compacted(i, val, pool)
                elif kind == _REGION:
                    args = [env[self.pos[a]] for a in n.args]
                    try:
                        val = tuple(self.compiled[i](args))
                    except Exception as e:
                        raise self._node_error(i, e) from e
                    val = self._compacted(i, val, pool)
                elif kind == _GET_ATTR:
                    val = consts[n.target]
                elif kind == _BUFFER:
                    val = store.buffers[n.meta["buffer"]]
                elif kind == _SCALE:
                    val = scale
                elif kind == _INPUT:
                    val = next(input_iter)
                else:                     # the output
                    result = fx.node.map_arg(n.args[0], load)
                    val = None
                env[i] = val
                act += hold(val)
                total = pool.sample() + act + workspace[i]
                if total > peak:
                    peak = total
                if trace_peaks is not None:
                    trace_peaks.append(total - draining)     # what the plan counts at this node
                if budget is not None and total > budget:
                    raise RuntimeError(f"pstar-fx bug: node {n.name} holds {format_bytes(total)} on the device, "
                                       f"past the budget {format_bytes(budget)} that the plan promised to keep")
                if draining and total > plan_peak:
                    raise RuntimeError(f"pstar-fx bug: node {n.name} holds {format_bytes(total)} on the device "
                                       f"({format_bytes(draining)} of slots being written back), past the plan's "
                                       f"peak {format_bytes(plan_peak)}")
                for j in free_after[i]:
                    act -= drop(env[j])
                    env[j] = None
        finally:
            for slot in slots:
                pool.give(slot)
        return result, peak

    def _take_constants(self, consts: dict, slots: list) -> None:
        """The graph's tensor constants on the device, in the pool for the length of the step (`slots`: the pool's
        buffers to give back after it)."""
        for name, t in self.constants.items():
            if t.numel() == 0:
                consts[name] = t.to(self.store.device)
                continue
            slots.append(self.store.pool.take(t.numel(), t.dtype, what=f"constant {name}"))
            consts[name] = slots[-1].view(t.shape).copy_(t)

    def _node_error(self, i: int, e: Exception) -> RuntimeError:
        """An aten op's or a fused region's failure at node i, naming the node (and the op's source line)."""
        n = self.nodes[i]
        if self.kinds[i] == _REGION:
            return RuntimeError(f"pstar-fx: {n.kwargs['spec']!r} failed at node {n.name}: {e}")
        return RuntimeError(f"pstar-fx: {n.target} failed at node {n.name}{_source(n)}: {e}")

    def _compacted(self, i: int, val, pool):
        """_compact at node i, remembering the nodes where it copied (the generated loop compacts only those)."""
        out = self._compact(val, self.planned[i], pool)
        if out is not val and i not in self.compact_at:
            self.compact_at.add(i)
            self._generated = None
        return out

    # -- the generated loop -----------------------------------------------------------------------------------
    def _run_generated(self, inputs, scale, rt: Runtime, interrupts, before_node) -> tuple[list, int]:
        """One step through the generated function (runtime/codegen.py): what `_run` does, without measuring."""
        pool = self.store.pool
        consts, slots = {}, []
        try:
            self._take_constants(consts, slots)
            result = self._generated(iter(inputs), scale, rt, consts, interrupts, before_node,
                                     lambda i: self._before(i, interrupts, before_node), self._failed,
                                     lambda i, v: self._compact(v, self.planned[i], pool))
        finally:
            for slot in slots:
                pool.give(slot)
        return result, self.verified_peak

    def _before(self, i: int, interrupts: DeferredInterrupt, before_node) -> int:
        """Before node i (both loops): give back slots written back as far as the node's room needs (all of them at
        the end; first, one whose write-back is done, of the size the node takes, where the free list has none),
        trim the pool's free list to the room beside those still draining (on CUDA to nothing: DevicePool.caches),
        a slot the node takes from the list kept (the plan counts it already), deliver a pending Ctrl-C before the
        first value written (a KeyboardInterrupt rolls back), call before_node. Returns the bytes still being
        written back."""
        store, pool = self.store, self.store.pool
        draining = 0
        spec = self.takes[i]
        if store.draining:
            store.reclaim(0 if self.kinds[i] == _OUTPUT else self.room[i], want=spec)
            draining = store.draining_bytes
        if pool.cached:
            taken = spec[0] * spec[1].itemsize if spec is not None and pool.free.get(spec) else 0
            pool.trim(self.room[i] + taken - draining if pool.caches else taken, spare=spec)
        if interrupts.pending and i <= self.holds_from:
            interrupts.deliver()
        if before_node is not None:
            before_node(i, self.nodes[i])
        return draining

    def _failed(self, e: BaseException) -> BaseException:
        """The error to raise for a failure in the generated function: at an aten op or a fused region wrapped as
        `_run` wraps it (the rest as it is); `run` names the node where the device ran out of memory."""
        i = self._node_at(e.__traceback__)
        if i is not None:
            self._at = i
            if isinstance(e, Exception) and self.kinds[i] in (_ATEN, _REGION):
                err = self._node_error(i, e)
                err.__cause__ = e
                return err
        return e

    @staticmethod
    def _compact(val, planned: list[int], pool):
        """A kernel may return a tensor whose storage is larger than the plan assumed (a CPU reduction can hand back
        a 0-d view of its unreduced buffer): copy such a value into a storage of the planned size. Views of chunk
        memory are left alone: their storage is the chunk."""
        if type(val) is torch.Tensor:        # most nodes: one plain tensor
            if len(planned) != 1 or val.untyped_storage().nbytes() <= planned[0] or pool.owns(val):
                return val
            return val.clone()
        leaves = tensors_in(val)
        if len(leaves) != len(planned):
            return val
        fix = {id(t): t.clone() for t, p in zip(leaves, planned)
               if t.untyped_storage().nbytes() > p and not pool.owns(t)}
        if not fix:
            return val
        return tree_map(lambda t: fix.get(id(t), t) if isinstance(t, torch.Tensor) else t, val)


