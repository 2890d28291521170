"""Values in and out of a ChunkStore, at full precision and keyed by parameter and buffer name: what state dicts,
checkpoints, the optimizer's state dict, `px.init_empty` and a model being taken into the chunks read and write.

Every reader first makes the host homes current (ChunkStore.flush) and every writer first sends every resident slot
home (ChunkStore.evict_all), so neither ever sees or leaves a stale copy on the device. With several ranks each holds
its shard of every chunk: a parameter's value is gathered from every rank (a collective), and a write keeps only
this rank's piece (`piece`). In mixed precision a trainable parameter's full-precision value is its fp32 master, and
a frozen one (no master) is kept whole (`frozen_full`).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..ir.graph import ChunkGroup, ChunkInfo, Role, StateHome
from ..ir.needs import shard_numel
from .quantize import MOMENTS, Packed, is_packed


def staged_copy(dst: torch.Tensor, src: torch.Tensor, stage: torch.Tensor) -> None:
    """dst (host) <- src (a device's, dst's dtype) through `stage` (host, pinned, any dtype, its contents lost):
    each piece as large as stage's bytes allow is copied from the device into the stage, then into dst by the CPU
    (torch's copy, on its intra-op threads). A device's copy into pageable memory runs at 6-7 GB/s on the H200
    machine (BENCHMARKS.md); into pinned memory at about 50. Without room for one element, a direct copy."""
    raw = stage.reshape(-1).view(torch.uint8)
    raw = raw[(-raw.data_ptr()) % dst.element_size():]              # aligned for dst's dtype
    room = raw.numel() // dst.element_size()
    if room == 0:
        dst.copy_(src)
        return
    buf = raw[:room * dst.element_size()].view(dst.dtype)
    for a in range(0, dst.numel(), room):
        b = min(dst.numel(), a + room)
        buf[:b - a].copy_(src[a:b])
        dst[a:b].copy_(buf[:b - a])


def half_precision(dtype: torch.dtype) -> bool:
    """A floating dtype of fewer bits than fp32 (bfloat16, float16): a parameter of it is held in fp32 by a step,
    and handed out so (full_dtype)."""
    return dtype.is_floating_point and torch.finfo(dtype).bits < 32


def full_dtype(value: torch.Tensor, like: torch.Tensor) -> torch.dtype:
    """The dtype a full-precision `value` (a parameter or an optimizer state, as the chunks hold it) is handed out in
    for a model tensor `like`: value's own where it is a floating dtype of more bits than like's (a half-precision
    model's parameter, held in fp32, and its fp32 states), else like's (or value's, for a non-floating `like`)."""
    if not like.is_floating_point():
        return value.dtype
    if value.is_floating_point() and torch.finfo(value.dtype).bits > torch.finfo(like.dtype).bits:
        return value.dtype
    return like.dtype


def full_where_rounded(full: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """`value`, except where it is `full` rounded to value's dtype (narrower than full's): there `full` (in full's
    dtype, on value's device)."""
    if not (value.is_floating_point() and full.is_floating_point()) or \
            torch.finfo(value.dtype).bits >= torch.finfo(full.dtype).bits:
        return value
    full = full.to(value.device)
    return torch.where(full.to(value.dtype) == value, full, value.to(full.dtype))


class StoreValues:
    """The values of one ChunkStore, `store.values` (made by the store, which this module does not import)."""

    def __init__(self, store):
        self.store = store
        self.frozen_full: dict[str, torch.Tensor] = {}   # mixed precision: frozen parameters at full precision

    def load_params(self, values: dict[str, torch.Tensor], keep_full: set[str] = frozenset()) -> None:
        """Fill the chunks (and the fp32 masters in mixed precision) from full-precision values. Resident slots go
        home first (the next step brings back what its plan starts from), so no slot keeps an old value.

        keep_full: parameters whose full-precision values the chunks hold and a half-precision model was given
        rounded (sync_model), unchanged since: wherever the given value is that rounding, the full-precision value
        stays (elementwise), and the rest is taken from `values` (writes the model's version counter missed)."""
        self.store.evict_all()
        for name, v in values.items():
            p = self.store.params[name]
            c = self.store.chunks[p.chunk]
            frozen_mixed = self.store.precision.mixed and c.group is not ChunkGroup.TRAINABLE
            if frozen_mixed and name in keep_full and name in self.frozen_full:     # (its full value is kept whole)
                v = full_where_rounded(self.frozen_full[name], v.detach())
            flat = v.detach().reshape(-1)
            lo, hi, src = self._own(c, p.offset, p.numel)
            if lo < hi:   # (converted where the value is: from a GPU, only the converted part is copied)
                value, home = flat[src:src + hi - lo], self.store.host_param[c.id]
                if self.store.precision.mixed and c.group is ChunkGroup.TRAINABLE:
                    master = self.store.master(c.id)[lo:hi]
                    self.store.states_written(c.id)       # (a disk chunk's: read in, written back before a step)
                    if name in keep_full:
                        value = full_where_rounded(master, value)
                    if self.store.pin and value.is_cuda and not master.is_cuda and home is not None:
                        # a host master is pageable (a GPU copies into it at 6-7 GB/s): staged through the
                        # pinned home, which is written after
                        staged_copy(master, value.to(torch.float32), home[lo:hi])
                    else:
                        master.copy_(value.to(torch.float32))
                    # (a disk chunk's states go back to their file when another is read in: one at a time)
                    self.store.let_go_when_another_opens(c.id)
                elif name in keep_full and home is not None:
                    value = full_where_rounded(home[lo:hi], value)
                if home is not None:
                    home[lo:hi].copy_(value.to(c.dtype))
            if frozen_mixed:
                # a frozen parameter has no master; keep its full-precision value for state_dict()
                self.frozen_full[name] = v.detach().to("cpu", copy=True)

    def _own(self, c: ChunkInfo, offset: int, numel: int) -> tuple[int, int, int]:
        """The part of chunk elements [offset, offset + numel) this rank holds: (lo, hi) in its shard's coordinates
        and where that part starts in the span (lo == hi: none of it)."""
        s = shard_numel(c, self.store.world)
        first = 0 if self.store.comm is None else self.store.comm.rank * s
        lo, hi = max(offset, first), min(offset + numel, first + s)
        return lo - first, max(lo, hi) - first, lo - offset

    def piece(self, name: str) -> tuple[int, int, int]:
        """This rank's piece of parameter `name`: (start, stop, at): it holds elements [start, stop) of the flattened
        parameter, at [at, at + stop - start) of its chunk's shard (host_param, the master and every state part).
        start == stop: none of it. Sharded checkpoints (pstar_fx.checkpoint.sharded) read and write these pieces in
        place."""
        p = self.store.params[name]
        lo, hi, src = self._own(self.store.chunks[p.chunk], p.offset, p.numel)
        return src, src + hi - lo, lo

    def full_chunk(self, t: torch.Tensor) -> torch.Tensor:
        """A chunk-sized flat host buffer made whole from every rank's shard (collective); the buffer itself with
        one rank."""
        return t if self.store.comm is None else self.store.comm.gather_full(t, self.store.device)

    def load_buffers(self, values: dict[str, torch.Tensor]) -> None:
        for name, v in values.items():
            if name not in self.store.buffers:
                t = self.store.pool.take(v.numel(), v.dtype, what=f"module buffer {name}")
                self.store.buffers[name] = t.view(v.shape)
            self.store.buffers[name].copy_(v.detach())

    def on_disk(self, name: str) -> bool:
        """The parameter's full-precision value is a disk-homed chunk's master (mixed precision): in host memory
        only while its chunk is read in (load_params writes it, marking it changed, one chunk at a time)."""
        st = self.store
        cid = st.params[name].chunk
        return (name not in self.frozen_full and st.precision.mixed and st.chunks[cid].group is ChunkGroup.TRAINABLE
                and st.state_home[cid] is StateHome.DISK)

    def param_value(self, name: str) -> torch.Tensor:
        """The full-precision value of a parameter (the fp32 master in mixed precision)."""
        if name in self.frozen_full:
            return self.frozen_full[name]
        return self.param_values([name])[name]

    def param_values(self, names) -> dict[str, torch.Tensor]:
        """Full-precision values of parameters (fp32 masters in mixed precision). Sharded, a collective: every rank
        calls it with the same names (each chunk concerned is gathered once)."""
        out = {n: self.frozen_full[n] for n in names if n in self.frozen_full}
        by_chunk: dict[int, list[str]] = {}
        for n in names:
            if n not in out:
                by_chunk.setdefault(self.store.params[n].chunk, []).append(n)
        for cid in sorted(by_chunk):
            c = self.store.chunks[cid]
            self.store.flush(cid)
            mixed = self.store.precision.mixed and c.group is ChunkGroup.TRAINABLE
            src = self.full_chunk(self.store.master(cid) if mixed else self.store.host_param[cid])
            for n in by_chunk[cid]:
                p = self.store.params[n]
                out[n] = src[p.offset:p.offset + p.numel].view(p.shape)
        return out

    def first(self, cid: int) -> int:
        """The chunk element this rank's shard starts at."""
        st = self.store
        return 0 if st.comm is None else st.comm.rank * shard_numel(st.chunks[cid], st.world)

    def moments(self, cid: int) -> dict[str, torch.Tensor]:
        """This rank's shard's states in fp32 by torch's keys, not made current first: views into the buffer, or,
        for compressed moments (state_dtype bf16 / int8), the other parts' views and m and v dequantised into new
        tensors, which `set_moments` quantises back."""
        parts = self.store.parts(cid)
        if not is_packed(parts):
            return parts
        out = {k: v for k, v in parts.items() if k not in MOMENTS and not k.endswith(".scale")}
        out.update(Packed(parts, cid, self.first(cid)).read())
        return out

    def set_moments(self, cid: int, values: dict[str, torch.Tensor]) -> None:
        """After changing m and v that `moments` returned (of this rank's shard): compressed, quantise them into
        the buffer (rounded with the chunk's step count's random bits: a value read out and written back unchanged
        keeps its codes); otherwise they were views, written already."""
        parts = self.store.parts(cid)
        if is_packed(parts):
            Packed(parts, cid, self.first(cid)).write(values, parts["step"])

    def state_parts(self, cid: int) -> dict[str, torch.Tensor]:
        """A chunk's states (ChunkStore.parts: the optimizer's per-element states, the master, the 0-d ones; m and v
        in fp32 whatever the state_dtype), for readers and writers outside a step: first made current (see flush).
        With one rank and exact states, views into the state buffer; sharded, whole-chunk copies gathered from
        every rank (a collective); compressed, m and v dequantised: `put_state_parts` writes them back."""
        self.store.flush(cid)
        parts = self.moments(cid)
        if self.store.comm is None:
            return parts
        return {k: v.clone() if v.dim() == 0 else self.full_chunk(v) for k, v in parts.items()}

    def put_state_parts(self, cid: int, parts: dict[str, torch.Tensor]) -> None:
        """After changing what state_parts returned: sharded, write this rank's shard of it back; compressed,
        quantise m and v (after the 0-d parts, whose step count picks the rounding's random bits); a disk-homed
        chunk's go back to their file now, and out of host memory (a load holds one disk chunk at a time)."""
        self.store.states_written(cid)
        own = self.store.parts(cid)
        packed = is_packed(own)
        shard = (lambda v: v) if self.store.comm is None else self.store.comm.shard
        if self.store.comm is not None:
            for k, v in parts.items():
                if not (packed and k in MOMENTS):
                    own[k].copy_(v if v.dim() == 0 else shard(v))
        if packed:
            self.set_moments(cid, {k: shard(parts[k]) for k in MOMENTS})
        self.store.close_state(cid)

    def restore_params_from_masters(self) -> None:
        """After a step failed before its commit point: in mixed precision a chunk's gradients may have overwritten
        its half-precision parameters (in place) and reached the host home; the fp32 masters are untouched, and the
        half-precision parameters are always the masters rounded, so they are rebuilt from them (a disk-homed
        chunk's read in and let go one at a time)."""
        if not self.store.precision.mixed:
            return
        st = self.store
        st.before_host_write()
        for c in st.chunks:
            if c.group is ChunkGroup.TRAINABLE and st.host_param[c.id] is not None:
                was_open = st.is_open(c.id)
                st.host_param[c.id].copy_(st.master(c.id))
                if not was_open:
                    st.close_state(c.id)        # a disk chunk read, not changed: one in memory at a time

    def value_source(self, name: str) -> torch.Tensor | None:
        """The flat buffer of this rank's shard holding the parameter's full-precision value; None where it is kept
        whole (a frozen parameter in mixed precision: `frozen_full`)."""
        st = self.store
        p = st.params[name]
        if name in self.frozen_full:
            return None
        if st.precision.mixed and st.chunks[p.chunk].group is ChunkGroup.TRAINABLE:
            return st.master(p.chunk)
        return st.host_param[p.chunk]

    def gather_to_rank0(self, names: dict[str, tuple[Role, str]], ref: dict[str, torch.Tensor]
                        ) -> dict[str, torch.Tensor]:
        """Several ranks (a collective): the state dict `ref` describes (its keys; `names` maps each to PARAM or
        BUFFER and the store's name), whole, on rank 0, each value copied to the device of ref's, in its dtype (fp32
        for a half-precision parameter: full_dtype); the other ranks get {}. Chunk by chunk, each rank's shard of
        the full-precision values goes to rank 0 only (torch.distributed.gather), so the other ranks never hold more
        than their own shards."""
        st = self.store
        comm = st.comm
        rank0 = comm.rank == 0
        st.flush()
        by_chunk: dict[int, list[str]] = {}
        for key in ref:
            kind, name = names[key]
            if kind is not Role.PARAM or name in self.frozen_full:
                continue
            names_in_chunk = by_chunk.setdefault(st.params[name].chunk, [])
            if name not in names_in_chunk:
                names_in_chunk.append(name)
        values = dict(self.frozen_full)
        dst = dist.get_global_rank(comm.group, 0)
        for cid in sorted(by_chunk):
            shard = self.value_source(by_chunk[cid][0])
            if comm.backend == "nccl":
                shard = shard.to(st.device)
            parts = [torch.empty_like(shard) for _ in range(comm.world)] if rank0 else None
            dist.gather(shard, parts, dst=dst, group=comm.group)
            if rank0:
                full = torch.cat(parts).cpu()
                for name in by_chunk[cid]:
                    p = st.params[name]
                    values[name] = full[p.offset:p.offset + p.numel].view(p.shape)
        if not rank0:
            return {}
        out = {}
        for key, like in ref.items():
            kind, name = names[key]
            src = values[name] if kind is Role.PARAM else st.buffers[name]
            out[key] = src.detach().to(device=like.device, dtype=full_dtype(src, like), copy=True)
        return out
