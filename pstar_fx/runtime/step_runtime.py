"""The state of one step that the inserted operations act on (`Runtime`, see pstar_fx.ir.ops), the fp16 loss scaler
that carries over from step to step, and what a step measured (`StepStats`)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..ir.graph import BufKind, ChunkGroup, StateHome, TrainGraph, UpdateSite
from ..ir.needs import BufKey, shard_numel
from .chunk_store import ChunkStore
from .optimizers import device_step, host_update
from .quantize import Packed, is_packed, scratch_floats


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
    """What one step measured. Tensor-valued figures stay on the device until read (no sync in the step)."""
    measured_peak: int               # device bytes: pool (chunks, states, buffers, workspace) + activations, as
                                     # the graph's measured step found them (its first; every one with debug=True):
                                     # the later steps run the generated function, which does not measure
    h2d_bytes: int                   # the plan's bytes moved (on a CPU device of one rank parameters and gradients
    d2h_bytes: int                   # are not copied: their slots are their host homes)
    skipped: bool                    # fp16: the step was skipped on overflow
    seconds: float = 0.0             # wall time of the step, from call to return
    lr: tuple[float, ...] = ()       # the learning rate of each optimizer group during the step
    _grad_norm: torch.Tensor | None = None
    alloc_retries: int | None = None  # CUDA: the caching allocator's retries during the step (each frees its cache)
    disk_read_bytes: int = 0         # the disk tier: optimizer-state bytes read from and written to offload_dir
    disk_write_bytes: int = 0
    _events: tuple | None = None     # CUDA: timing events recorded before and after the step's work on the device

    @property
    def device_seconds(self) -> float | None:
        """CUDA: the step's time on the device, from its first operation to its last (the device may still be
        busy when the call returns: `seconds` counts to the return). None elsewhere. Reading it waits for the
        step's end on the device."""
        if self._events is None:
            return None
        start, end = self._events
        end.synchronize()
        return start.elapsed_time(end) / 1000

    @property
    def grad_norm(self) -> float | None:
        """The global L2 norm of the step's gradient (every rank's, unscaled in fp16), before clipping: what
        torch.nn.utils.clip_grad_norm_ returns. None for a forward-only step. Reading it waits for the device."""
        return None if self._grad_norm is None else float(self._grad_norm)


@dataclass(frozen=True)
class ParamSite:
    """Where the runtime's operations find a parameter: its chunk's buffers and its elements there."""
    key: BufKey              # the chunk's parameter buffer
    grad_key: BufKey | None  # the chunk's gradient buffer (the parameter buffer where gradients go in place; None:
                             # a frozen chunk's)
    start: int               # its elements in the chunk: [start, end)
    end: int
    shape: tuple[int, ...]
    index: int               # its place in the graph's parameters (the order the gradient norms are combined in)


class ParamSites:
    """Every parameter's ParamSite, and per chunk the end of its last parameter (past it the chunk is padding, which
    host updates skip): a graph's, the same at every step (the executor builds them once)."""

    def __init__(self, g: TrainGraph):
        self.of: dict[str, ParamSite] = {}
        self.live_end: dict[int, int] = {}
        for i, p in enumerate(g.params):
            c = g.chunks[p.chunk]
            grad = BufKey(c.id, c.grad_buf()) if c.group is ChunkGroup.TRAINABLE else None
            self.of[p.name] = ParamSite(BufKey(c.id, BufKind.PARAM), grad, p.offset, p.offset + p.numel, p.shape, i)
            self.live_end[p.chunk] = max(self.live_end.get(p.chunk, 0), p.offset + p.numel)


class Runtime:
    """The state the inserted operations act on during one step (see pstar_fx.ir.ops)."""

    def __init__(self, g: TrainGraph, store: ChunkStore, scaler: LossScaler | None, sites: ParamSites | None = None):
        """`sites`: the graph's ParamSites (the executor builds them once per graph); built here when None."""
        self.g = g
        self.store = store
        self.scaler = scaler
        opt = g.settings.optimizer   # each group's options, read and checked at every step (None: no optimizer)
        self.cfg = opt.configs() if opt is not None else ()
        self.precision = g.settings.precision
        self.sites = sites if sites is not None else ParamSites(g)
        self.found_inf: torch.Tensor | None = None
        self.comm = store.comm          # None with one rank
        # the gradient norm, every step, taken on the device where each gradient is complete: one rank, per
        # parameter, its gradient's norm at its final write (the order of torch.nn.utils.clip_grad_norm_, so the
        # norm and the clipped update are eager's bit for bit); sharded, per chunk, its reduced shard's squared norm
        self.norms: dict[int, torch.Tensor] | None = {} if opt is not None else None
        self._clip = g.settings.max_grad_norm is not None
        self._norm_pending: set[int] = set()    # sharded, no clipping: reduced chunks whose norm is still to take
        self.grad_norm: torch.Tensor | None = None
        self.clip_coef: torch.Tensor | None = None
        self._clip_coef_host: torch.Tensor | None = None
        self.skip = False
        self.committed = False
        self.stepped: list[int] = []         # chunks updated so far in this step (after the commit, or atomic=False)
        # chunks updated before the commit with their previous values kept (ChunkInfo.undo) -> the update's Future
        # (None where it ran inline): put back if the step fails before its commit (runtime/undo.py)
        self.undoable: dict[int, object] = {}
        self.h2d = 0
        self.d2h = 0

    def param_view(self, name: str) -> torch.Tensor:
        site = self.sites.of[name]
        return self.store.param_view(site.key, site.start, site.end, site.shape)

    def write_grad(self, name: str, grad: torch.Tensor, accumulate: bool, final: bool) -> None:
        site = self.sites.of[name]
        dst = self.store.grad_part(site.grad_key, site.start, site.end - site.start, accumulate).view(site.shape)
        self.store.mark_written(site.grad_key)
        if accumulate:
            dst.add_(grad)
        else:
            dst.copy_(grad)
        if final:
            self._completed(site, dst)

    def compute_grad(self, name: str, op, shape: tuple[int, ...], args: tuple, kwargs: dict, final: bool) -> None:
        """A first gradient write with its operation folded in: `op` (an out= overload) writes into the chunk."""
        site = self.sites.of[name]
        dst = self.store.grad_part(site.grad_key, site.start, site.end - site.start, False)
        self.store.mark_written(site.grad_key)
        op(*args, **kwargs, out=dst.view(shape))
        if final:
            self._completed(site, dst.view(site.shape))

    def _completed(self, site: ParamSite, dst: torch.Tensor) -> None:
        """A parameter's gradient is complete in `dst`: fp16's overflow check and, on one rank, its norm."""
        if self.found_inf is not None:
            # max and min propagate NaN and show inf: two reductions, no temporary the size of the gradient
            bad = ~torch.isfinite(dst.amax()) | ~torch.isfinite(dst.amin())
            self.found_inf |= bad
        if self.comm is None:
            self.norms[site.index] = torch.linalg.vector_norm(dst, dtype=torch.float32)

    def reduce_scatter(self, chunk: int) -> None:
        """Sharded: the chunk's final gradient, averaged over ranks, into this rank's shard (in place). Each rank
        divides its own contribution first, so the sum is the mean without waiting for the collective."""
        c = self.g.chunks[chunk]
        key = BufKey(chunk, c.grad_buf())
        slot = self.store.slot(key)
        slot.div_(self.comm.world)
        work = self.comm.reduce_scatter(slot)
        self.store.reduced.add(chunk)
        if self._clip:        # the commit needs the norm: the compute stream waits for the collective here
            work.wait()
            self.norms[chunk] = _squared_norm(self.comm.shard(slot))
        else:                 # taken where the step next reads the reduced shard, which waits for it anyway
            self.store.arriving(key, work)
            self._norm_pending.add(chunk)

    def _take_pending_norm(self, chunk: int) -> None:
        """Sharded, without clipping: the squared norm of the chunk's reduced gradient shard, at the first node
        that reads it after its reduce-scatter (its device-side update, or its write-back for a host-side one)."""
        if chunk in self._norm_pending:
            self._norm_pending.discard(chunk)
            key = BufKey(chunk, self.g.chunks[chunk].grad_buf())
            self.norms[chunk] = _squared_norm(self.comm.shard(self.store.slot(key)))

    def fetch(self, chunk: int, buf: BufKind) -> None:
        self.h2d += self.store.home_bytes(BufKey(chunk, buf))
        self.store.fetch(BufKey(chunk, buf))

    def alloc(self, chunk: int, buf: BufKind) -> None:
        self.store.alloc(BufKey(chunk, buf))

    def release(self, chunk: int, buf: BufKind, writeback: bool) -> None:
        if self._norm_pending and buf is self.g.chunks[chunk].grad_buf():
            self._take_pending_norm(chunk)
        if writeback:
            self.d2h += self.store.home_bytes(BufKey(chunk, buf))
        self.store.release(BufKey(chunk, buf), writeback, defer=True)

    def commit(self) -> None:
        with torch.profiler.record_function("pstar-fx commit"):    # for a profiler's trace (benchmarks/trace_steps.py)
            self._commit()

    def _commit(self) -> None:
        self._undoable_done()
        if self.comm is not None:
            self._commit_sharded()
        else:
            self._commit_local()
        self.committed = True
        self.store.undo.committed(self.undoable)
        self.stepped.extend(self.undoable)   # from here on they are the step's updates like any other

    def _undoable_done(self) -> None:
        """The updates ahead of the commit end before it (the plan has them end before the device gets here), and
        one that failed fails the step, which puts them all back. With several ranks before the commit's all-reduce:
        a rank whose update failed never joins it, so every other rank's commit fails too and is undone."""
        for chunk, done in self.undoable.items():
            failed = None if done is None else done.exception()
            if failed is not None:
                raise RuntimeError(f"pstar-fx: the host-side update of chunk {chunk}, run before the commit, failed "
                                   f"({type(failed).__name__}: {failed}); the step is undone") from failed

    def _commit_local(self) -> None:
        if self.found_inf is not None:
            self.skip = bool(self.found_inf.item())
        if self.norms is not None:
            # torch.nn.utils.clip_grad_norm_: the norm of the per-parameter norms, in parameter order
            norms = [self.norms[i] for i in sorted(self.norms)]
            self._set_grad_norm(torch.linalg.vector_norm(torch.stack(norms)) if norms
                                else torch.zeros((), device=self.store.device))

    def _squared_sum(self) -> torch.Tensor:
        """Sharded: the sum of the squared shard norms taken so far, in chunk order (fp32, on the device)."""
        norms = [self.norms[c] for c in sorted(self.norms)]
        return torch.stack(norms).sum() if norms else torch.zeros((), device=self.store.device)

    def _set_grad_norm(self, total: torch.Tensor) -> None:
        """The step's global gradient norm (of the scaled gradient in fp16: unscaled here); the clip coefficient of
        torch.nn.utils.clip_grad_norm_ when clipping."""
        if self.scaler is not None:
            total = total / self.scaler.scale
        self.grad_norm = total
        if self._clip:
            self.clip_coef = torch.clamp(self.g.settings.max_grad_norm / (total + 1e-6), max=1.0)

    def mean_over_ranks(self, loss: torch.Tensor) -> torch.Tensor:
        """Sharded, at the end of a training step: the loss averaged over the ranks; without clipping, the global
        gradient norm in the same all-reduce (the sum of every rank's squared shard norms, taken during the
        step)."""
        loss = loss.detach().float().to(self.store.device)
        if self.grad_norm is not None or self.norms is None:
            return self.comm.all_reduce(loss.clone()) / self.comm.world
        assert not self._norm_pending, f"gradient shards whose norm was never taken: {sorted(self._norm_pending)}"
        both = self.comm.all_reduce(torch.stack([loss, self._squared_sum().to(loss.device)]))
        self._set_grad_norm(both[1].sqrt())
        return both[0] / self.comm.world

    def _commit_sharded(self) -> None:
        """The commit across ranks, in one all-reduce (every rank issues it, whatever the settings): the count of
        ranks that saw an inf or NaN gradient (fp16; they agree to skip) and the sum of every shard's squared
        gradient norm (clipping: the global norm is its square root)."""
        dev = self.store.device
        bad = self.found_inf.float() if self.found_inf is not None else torch.zeros((), device=dev)
        sq = self._squared_sum() if self._clip else torch.zeros((), device=dev)
        both = self.comm.all_reduce(torch.stack([bad.to(dev), sq.to(dev)]))
        # NCCL returns once the all-reduce is queued: wait for it, so that a rank whose peer never joins fails here,
        # before its commit (its undo buffers put back), instead of counting the step committed
        self.comm.wait(both, "the commit's all_reduce")
        if self.found_inf is not None:
            self.skip = bool(both[0].item() > 0)
        if self._clip:        # without clipping the norms are summed over the ranks at the end (mean_over_ranks)
            self._set_grad_norm(both[1].sqrt())

    def _coef_on(self, device: torch.device) -> torch.Tensor:
        assert device == self.clip_coef.device
        return self.clip_coef

    def _host_coef(self):
        """The clip coefficient for host-side updates: copied to the host once, asynchronously, with the event the
        update waits for (the executor's thread never waits for it)."""
        if self.clip_coef is None:
            return None, None
        if self.clip_coef.device.type == "cpu":
            return self.clip_coef, None
        if self._clip_coef_host is None:
            host = torch.empty((), dtype=self.clip_coef.dtype, pin_memory=True)
            host.copy_(self.clip_coef, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self._clip_coef_host = (host, event)
        return self._clip_coef_host

    def disk_read(self, chunk: int, slot: int) -> None:
        self.store.disk_read(chunk, slot)

    def disk_write(self, chunk: int, slot: int) -> None:
        self.store.disk_write(chunk, slot)

    def _host_step(self, chunk: int, cfg, parts) -> None:
        """Queue the update of a chunk whose states live on the host (on the store's worker thread; inline without
        one). Everything it reads from this step is fixed now: the copies to wait for, the scale, the skip. A
        disk-homed chunk's states are its staging buffer's, once their read is done."""
        st = self.store
        c = self.g.chunks[chunk]
        events = st.take_host_events(chunk)
        if c.state_home is StateHome.DISK:
            parts, read = st.staged_parts(chunk)
            events.append(_Done(read))
        param, grad = st.host_param[chunk], st.host(BufKey(chunk, c.grad_buf()))
        coef, coef_ready = self._host_coef()
        inv_scale = 1.0 / self.scaler.scale if self.scaler is not None else None
        master = parts["master"] if self.precision.mixed else None
        skip = self.skip
        first = self._first(chunk)
        live = self.sites.live_end.get(chunk, 0) - first      # this shard's elements that can hold parameters

        waits = events + ([coef_ready] if coef_ready is not None else [])

        undo = c.undo and not self.committed       # (a plan's undo chunk steps before the commit: verify.py)
        states = st.states[chunk]

        def update() -> None:
            if undo:
                st.undo.keep(chunk, states, param)
            host_update(cfg, param, grad, parts, master=master, inv_scale=inv_scale, coef=coef, skip=skip,
                        chunk=chunk, first=first, live=live)

        if not undo:
            self.stepped.append(chunk)
        done = None
        if st.updates is None:
            if undo:
                self.undoable[chunk] = None
            for e in waits:
                e.synchronize()
            update()
        else:
            with torch.profiler.record_function(f"pstar-fx queue the host update of chunk {chunk}"):
                done = st.updates.submit(chunk, update, after=waits)
            if c.state_home is StateHome.DISK:
                st.gate_disk_write(chunk, done)       # its disk write waits for it
        if undo:
            self.undoable[chunk] = done

    def optimizer_step(self, chunk: int, gather: bool = False) -> None:
        c = self.g.chunks[chunk]
        cfg = self.cfg[c.opt_group]
        st = self.store
        if c.update_site is UpdateSite.CPU:
            self._host_step(chunk, cfg, None if c.state_home is StateHome.DISK else st.parts(chunk))
            return
        if self._norm_pending:
            self._take_pending_norm(chunk)
        if c.streamed:       # its states were fetched into a slot of their own; the plan writes them back after
            key = BufKey(chunk, BufKind.STATES)
            parts = st.parts(chunk, st.slot(key))
            st.mark_written(key)
        else:
            parts = st.parts(chunk)
        full = st.slot(BufKey(chunk, BufKind.PARAM))
        st.mark_written(BufKey(chunk, BufKind.PARAM))
        grad = st.slot(BufKey(chunk, c.grad_buf()))
        self.stepped.append(chunk)
        param = full
        if self.comm is not None:    # this rank's shard; the whole chunk is gathered again after the update
            param, grad = self.comm.shard(full), self.comm.shard(grad)
        self._device_step(chunk, cfg, parts, param, grad)
        if gather:
            st.arriving(BufKey(chunk, BufKind.PARAM), self.comm.all_gather(full))

    def _first(self, chunk: int) -> int:
        """The chunk element this rank's shard starts at."""
        return 0 if self.comm is None else self.comm.rank * shard_numel(self.g.chunks[chunk], self.comm.world)

    def _device_step(self, chunk: int, cfg, parts, param: torch.Tensor, grad: torch.Tensor) -> None:
        """The device's update of one chunk (its shard), in place: the parameters (param), from the gradient (grad,
        modified: clipped in place in fp32), the states' views (parts: the device-resident states, or a streamed
        update's slot). Compressed moments go through a scratch taken from the pool: part of the step's workspace
        (ir/needs.py step_workspace)."""
        st = self.store
        scratch = None
        if is_packed(parts):      # taken even when the step is skipped: the plan counts it at every step
            scratch = st.pool.take(scratch_floats(param.numel()), torch.float32,
                                   what=f"compressed-state scratch of chunk {chunk}")
        try:
            packed = None if scratch is None else Packed(parts, chunk, self._first(chunk), scratch)
            self._device_update(chunk, cfg, parts, param, grad, packed)
        finally:
            if scratch is not None:
                st.pool.give(scratch)

    def _device_update(self, chunk: int, cfg, parts, param: torch.Tensor, grad: torch.Tensor,
                       packed: Packed | None) -> None:
        st = self.store
        if not self.precision.mixed:
            if not self.skip:
                if self.clip_coef is not None:
                    grad.mul_(self._coef_on(grad.device))
                device_step(cfg, param, grad, parts, packed)
            return
        g32 = st.pool.take(param.numel(), torch.float32, what=f"step workspace of chunk {chunk}")
        try:
            if not self.skip:
                g32.copy_(grad)
                if self.scaler is not None:
                    g32.mul_(1.0 / self.scaler.scale)
                if self.clip_coef is not None:
                    g32.mul_(self._coef_on(g32.device))
                device_step(cfg, parts["master"], g32, parts, packed)
            param.copy_(parts["master"])   # new half-precision parameters (also restores them after a skip)
        finally:
            st.pool.give(g32)


class _Done:
    """A Future waited for like a CUDA event (`synchronize`), among the events a host-side update waits for."""

    def __init__(self, fut):
        self.fut = fut

    def synchronize(self) -> None:
        self.fut.result()


def _squared_norm(t: torch.Tensor) -> torch.Tensor:
    """The squared L2 norm of a gradient buffer, accumulated in fp32: one reduction on its device."""
    return torch.linalg.vector_norm(t, dtype=torch.float32).square()

