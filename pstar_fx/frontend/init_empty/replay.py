"""Replaying a recording into the chunks of a compiled step (see pstar_fx.frontend.init_empty for the whole).

Replay (`fill_chunks`, at the compiled step's first use of the model). The recorded ops run again on the CPU, in
order, skipping those whose results nothing needs: every random op runs (it consumes the generator as in eager,
also for a tensor that was later replaced, such as a tied `lm_head.weight`); other ops run when what they write or
create is read later by an op that runs or ends up in a parameter or buffer. A parameter whose storage is exactly
that parameter, in the dtype of its chunk's full-precision home (the chunk's host buffer in fp32, the fp32 master in
mixed precision), is that home: its ops write in place there. Anything else (a buffer, an intermediate, a dead
tensor, a parameter of another dtype) lives in a temporary freed after its last use; parameters in one are copied
into their chunk then. So at most a few tensors exist beyond the chunks at a time, never the model. Random ops draw
from a `torch.Generator` set to the recorded state; a torch.nn.init call recorded whole runs with the global CPU RNG
set to that generator's state and restored right after (such a function may draw from the global generator whatever
its arguments: `sparse_`'s `randperm` does).

On a GPU: `px.init_empty(device="cuda")`. The CPU replay above runs every random op on the CPU's serial generator
(19 s for a 1.3B GPT in bf16 on the H200 machine's host: minutes at 16B). With a device, the recording takes the
RNG state of that GPU's generator instead (at the first random op, and again wherever `torch.manual_seed` or
`torch.cuda.manual_seed` set it), data constructors called without a device (`torch.tensor`) make real tensors on
that GPU, and the replay (`_replay_streamed`) runs there with a CUDA `torch.Generator` set to the recorded states,
storage by storage: a storage gets device memory at the first step that needs its memory and loses it after its
last, when each parameter in it is converted on the device and copied into its chunk's host homes (the fp32 master
and the half-precision chunk). Between two of its steps it keeps its memory only if the second is the very next step
run; otherwise its value is dropped if that step replaces it whole without reading it (per-op table
`_OVERWRITING_OPS`: Linear's kaiming_uniform_ overwritten by the model's own normal_), or else parked on the host (in
its chunk home if it is exactly one parameter) and brought back. So the GPU holds one tensor (and its bf16 copy) at a
time, not the model; the values equal an eager build under `with torch.device("cuda"):` from the same seed, bit for
bit (same kernels, same Philox offsets, on the same GPU), and a torch.nn.init call recorded whole runs with that GPU's
global generator set to the replay's state, under `torch.device(device)`. Measured on an H200: a 1.3B GPT in 0.3 s,
4.2B in 0.7 s (6 Gparam/s). After the block the GPU's RNG is where it was (or where a manual_seed in the block set
it), not advanced as an eager CUDA build advances it; the CPU's is untouched, as by an eager CUDA build. The model's
stand-ins still report device cpu (pstar-fx keeps the model on the host).
"""
from __future__ import annotations

import functools
import hashlib
import itertools
import re

import torch
import torch.nn as nn
from torch.utils._pytree import tree_leaves, tree_map

from ...errors import EmptyModelError
from .recording import (Const, Foreign, RecordedOp, Recording, Ref, Storage, device_rng_state, is_empty,
                        set_device_rng_state)

_aten = torch.ops.aten
_CPU = torch.device("cpu")


def fill_chunks(store, params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor]
                ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Initialise the EmptyTensors among `params` in the store's chunks (in place, see the module docstring) and
    compute those among `buffers`. Returns the parameters left to load (the real ones) and every buffer's value."""
    empty_params = {n: t for n, t in params.items() if is_empty(t)}
    empty_buffers = {n: t for n, t in buffers.items() if is_empty(t)}
    if not empty_params and not empty_buffers:
        return params, buffers
    store.evict_all()             # nothing of the chunks on the device: their host homes are written below
    recordings: dict[int, Recording] = {}
    for t in [*empty_params.values(), *empty_buffers.values()]:
        recordings[id(t._pstar_recording)] = t._pstar_recording
    values = {}
    in_place = False
    for rec in recordings.values():
        replay = _replay if rec.device is None else _replay_streamed
        in_place |= rec.device is None
        values.update(replay(rec, store,
                             {n: t._pstar_ref for n, t in empty_params.items() if t._pstar_recording is rec},
                             {n: t._pstar_ref for n, t in empty_buffers.items() if t._pstar_recording is rec}))
    if store.precision.mixed and in_place:
        # the half-precision chunks: the fp32 masters written above, rounded
        store.values.restore_params_from_masters()
    return ({n: t for n, t in params.items() if n not in empty_params},
            {n: values.get(n, t) for n, t in buffers.items()})


def origin_digests(tensors: dict[str, torch.Tensor]) -> dict[str, bytes]:
    """For each EmptyTensor among `tensors`, a digest of everything its value is made from at replay: the recorded
    ops its storage depends on (their arguments and the real tensors they read), the RNG state each random one draws
    from (the state recorded at or before it, advanced by every random op in between) and the device the recording
    replays on. The replay is deterministic, so equal digests mean equal values: the ranks of a sharded step, each of
    which replays the whole recording and keeps its shard, compare them (pstar_fx.api.agreement). One pass over each
    recording's ops."""
    out: dict[str, bytes] = {}
    recordings: dict[int, tuple[Recording, list[tuple[str, Ref]]]] = {}
    for name, t in tensors.items():
        if is_empty(t):
            recordings.setdefault(id(t._pstar_recording), (t._pstar_recording, []))[1].append((name, t._pstar_ref))
    for rec, refs in recordings.values():
        storages = _storage_digests(rec)
        for name, ref in refs:
            out[name] = _sha(_text((rec.device, ref)), storages.get(ref.storage, b""))
    return out


def _storage_digests(rec: Recording) -> dict[int, bytes]:
    """Each recorded storage's value after the last op writing it, as a digest (see origin_digests)."""
    digests: dict[int, bytes] = {}
    consts: dict[int, bytes] = {}

    def const(i: int) -> bytes:
        if i not in consts:
            t = rec.consts[i][0].detach().cpu().contiguous()
            consts[i] = _sha(_text((tuple(t.shape), t.dtype)), t.reshape(-1).view(torch.uint8).numpy().tobytes())
        return consts[i]

    def shape_of(x):          # an argument as the op sees its shape (what a random op's draws depend on)
        return ("const", const(x.index).hex()) if isinstance(x, Const) else x

    def value_of(x):          # an argument with the value it holds
        if isinstance(x, Ref):
            return (x, digests.get(x.storage, b"").hex())
        return shape_of(x)

    generator = b""
    for step in rec.steps:
        func = f"{step.func.__module__}.{step.func.__qualname__}" if step.call else str(step.func)
        d = _sha(_text((func, tree_map(value_of, (step.args, step.kwargs)), step.creates, step.undefined)))
        if step.random:
            if step.rng_state is not None:
                generator = _sha(step.rng_state.cpu().numpy().tobytes())
            d = _sha(d, generator)
            generator = _sha(generator, _text((func, tree_map(shape_of, (step.args, step.kwargs)))))
        for sid in step.writes:
            digests[sid] = _sha(d, b"writes %d" % sid)
        for j, sid in step.creates:
            digests[sid] = _sha(d, b"creates %d" % j)
    return digests


def _text(x) -> bytes:
    """repr as bytes, without object addresses (the same in every process)."""
    return re.sub(r" at 0x[0-9a-fA-F]+", "", repr(x)).encode()


def _sha(*parts: bytes) -> bytes:
    h = hashlib.sha256()
    for part in parts:
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.digest()[:16]


def _contiguous_whole(ref: Ref, storage: Storage) -> bool:
    numel = 1
    for s in ref.shape:
        numel *= s
    expect, stride = [], 1
    for s in reversed(ref.shape):
        expect.append(stride)
        stride *= s
    return (ref.offset == 0 and ref.dtype == storage.dtype and numel * ref.dtype.itemsize == storage.nbytes
            and all(st == e or sz == 1 for st, e, sz in zip(ref.stride, reversed(expect), ref.shape)))


def _touched(step: RecordedOp) -> frozenset[int]:
    return step.reads | step.writes | {sid for _, sid in step.creates}


def _plan(rec: Recording, targets: set[int]) -> tuple[list[int], dict[int, int]]:
    """The steps to run (every random one, and those whose writes or creations something run later, or a target,
    reads), and for each storage the last of them that touches it."""
    want = set(targets)
    needed = []
    for i in range(len(rec.steps) - 1, -1, -1):
        s = rec.steps[i]
        made = {sid for _, sid in s.creates}
        if s.random or (s.writes | made) & want:
            needed.append(i)
            want |= s.reads | s.writes
    needed.reverse()
    last = {}
    for i in needed:
        for sid in _touched(rec.steps[i]):
            last[sid] = i
    return needed, last


def _view(root: torch.Tensor, shape, stride, offset, dtype) -> torch.Tensor:
    base = root if root.dtype == dtype else root.view(dtype)
    return base.as_strided(shape, stride, base.storage_offset() + offset)   # as_strided's offset is absolute


def _targets(params: dict[str, Ref], buffers: dict[str, Ref]) -> dict[int, list[tuple[bool, str, Ref]]]:
    """For each recorded storage, the parameters and buffers that are views of it: (is a parameter, name, view)."""
    targets: dict[int, list[tuple[bool, str, Ref]]] = {}
    for name, ref in params.items():
        targets.setdefault(ref.storage, []).append((True, name, ref))
    for name, ref in buffers.items():
        targets.setdefault(ref.storage, []).append((False, name, ref))
    return targets


def _homes(rec: Recording, store, targets, *, cpu_only: bool) -> dict[int, torch.Tensor]:
    """The storages that are exactly one parameter, in the dtype of its chunk's full-precision home (the host chunk
    in fp32, the fp32 master in mixed precision, which is on the device where the plan put its chunk's optimizer
    states there): that home, flat; with cpu_only, only homes on the CPU. One rank only (sharded, a home is a part).
    A master on disk is not a home here (it is in memory only while load_params writes it, one chunk at a time)."""
    homes = {}
    for sid, ts in targets.items():
        is_param, name, ref = ts[0]
        if (store.world == 1 and len(ts) == 1 and is_param and _contiguous_whole(ref, rec.storages[sid])
                and not store.values.on_disk(name)):
            home = store.values.param_value(name)
            if (home.dtype == ref.dtype and tuple(home.shape) == ref.shape
                    and (home.device.type == "cpu" or not cpu_only)):
                homes[sid] = home.reshape(-1)
    return homes


def _resolve(x, step: RecordedOp, rec: Recording, roots: dict[int, torch.Tensor], device: torch.device):
    """A recorded argument as a real value: a view of its storage's root, a real tensor read while building (checked
    unchanged), and the meta device as the replay's device."""
    if isinstance(x, Ref):
        return _view(roots[x.storage], x.shape, x.stride, x.offset, x.dtype)
    if isinstance(x, Const):
        t, version = rec.consts[x.index]
        if t._version != version:
            raise EmptyModelError(
                f"px.init_empty(): the real tensor of shape {tuple(t.shape)} that {step.func} read {step.where} "
                "while the model was built has been modified since, so the model cannot be initialised as it "
                "was built; do not modify it until the first step has run (or clone it when building).")
        return t
    if isinstance(x, Foreign):
        raise EmptyModelError(
            f"px.init_empty(): {step.func} {step.where} reads a meta tensor of shape {x.shape} that was not made "
            "inside the px.init_empty() block, so its values are unknown; make it inside the block.")
    if isinstance(x, torch.device) and x.type == "meta":
        return device
    return x


def _replay(rec: Recording, store, params: dict[str, Ref], buffers: dict[str, Ref]) -> dict[str, torch.Tensor]:
    """Run the recording on the CPU: parameters into the store's chunks, buffers returned."""
    targets = _targets(params, buffers)
    # (one rank: the chunk's home is the parameter's whole value; sharded, load_params keeps this rank's part; a home
    # on the device, an fp32 master where the plan put the states there, is written through a temporary too)
    roots: dict[int, torch.Tensor] = _homes(rec, store, targets, cpu_only=True)
    direct: set[int] = set(roots)    # storages that are a parameter's chunk home itself
    needed, last = _plan(rec, set(targets))
    gen = torch.Generator()
    out: dict[str, torch.Tensor] = {}

    with torch.no_grad():
        for i in needed:
            step = rec.steps[i]
            if step.rng_state is not None:
                gen.set_state(step.rng_state)
            if not (step.undefined and all(sid in direct for _, sid in step.creates)):
                args, kwargs = tree_map(functools.partial(_resolve, step=step, rec=rec, roots=roots, device=_CPU),
                                        (step.args, step.kwargs))
                _run(step, args, kwargs, gen, rec, roots, direct)
            for sid in _touched(step):
                if last.get(sid) != i:
                    continue
                root = roots.pop(sid)          # its last use: a temporary is freed once its targets have it
                if sid in direct:
                    continue
                for is_param, name, ref in targets.get(sid, ()):
                    value = _view(root, ref.shape, ref.stride, ref.offset, ref.dtype)
                    if is_param:
                        store.values.load_params({name: value})
                    else:
                        out[name] = value.clone()
    return out


def _run(step: RecordedOp, args, kwargs, gen: torch.Generator, rec: Recording, roots: dict[int, torch.Tensor],
         direct: set[int], device: torch.device | None = None) -> None:
    """Run one recorded step on real tensors; the storages it creates become roots (or go into their chunk home)."""
    if step.call:
        _call_with_rng(step.func, args, kwargs, gen, device)
        return
    if step.random:
        args, kwargs = _with_generator(step.func, list(args), dict(kwargs), gen)
    result = tree_leaves(step.func(*args, **kwargs))
    for j, sid in step.creates:
        o = result[j]
        if sid in direct:
            if not step.undefined:
                _view(roots[sid], o.shape, o.stride(), o.storage_offset(), o.dtype).copy_(o)
            continue
        info = rec.storages[sid]
        assert o.untyped_storage().nbytes() == info.nbytes and o.dtype == info.dtype, (step.func, sid)
        roots[sid] = o.as_strided((info.nbytes // info.dtype.itemsize,), (1,), 0)


# ops that write every element of their first argument without reading it (per-op knowledge: a value they replace
# is dead, so the streamed replay drops it instead of keeping or parking it)
_OVERWRITING_OPS = {_aten.normal_, _aten.uniform_, _aten.fill_, _aten.zero_, _aten.random_, _aten.exponential_,
                    _aten.geometric_, _aten.log_normal_, _aten.cauchy_, _aten.bernoulli_, _aten.copy_}
# torch.nn.init functions recorded whole (the one that asks is_meta: trunc_normal_'s helper in torch 2.13) that write
# every element of their tensor, reading only its shape
_OVERWRITING_CALLS = {getattr(nn.init, name) for name in ("_no_grad_trunc_normal_", "trunc_normal_", "orthogonal_",
                                                          "sparse_", "dirac_") if hasattr(nn.init, name)}


def _overwrites(step: RecordedOp, sid: int, rec: Recording) -> bool:
    """Whether the step replaces every byte of storage `sid` without reading what was there."""
    if step.call:
        refs = [x for x in tree_leaves((step.args, step.kwargs)) if isinstance(x, Ref)]
        if step.func not in _OVERWRITING_CALLS or not refs:
            return False
        target, others = refs[0], refs[1:]
    else:
        if (step.func.overloadpacket not in _OVERWRITING_OPS or not step.args
                or not isinstance(step.args[0], Ref)):
            return False
        target = step.args[0]
        others = [x for x in tree_leaves((step.args[1:], step.kwargs)) if isinstance(x, Ref)]
    return (target.storage == sid and _contiguous_whole(target, rec.storages[sid])
            and all(r.storage != sid for r in others))


def _replay_streamed(rec: Recording, store, params: dict[str, Ref], buffers: dict[str, Ref]
                     ) -> dict[str, torch.Tensor]:
    """Run the recording on rec.device, storage by storage: parameters into the store's chunks, buffers returned
    (on the CPU). Invariant: a storage has device memory only from the step that first needs its memory to the end
    of its last step, and between two of its steps only if the second is the very next step run; otherwise its value
    is dropped (the next step touching it replaces it whole, without reading it) or parked on the host (in its
    parameter's chunk home where it is exactly one parameter, else in a host temporary) and brought back."""
    device = rec.device
    targets = _targets(params, buffers)
    homes = _homes(rec, store, targets, cpu_only=False)
    needed, last = _plan(rec, set(targets))
    following = dict(itertools.pairwise(needed))   # step -> the next step run
    later: dict[tuple[int, int], int] = {}        # (step, storage) -> the next step run that touches the storage
    seen: dict[int, int] = {}
    for i in reversed(needed):
        for sid in _touched(rec.steps[i]):
            if sid in seen:
                later[(i, sid)] = seen[sid]
            seen[sid] = i
    resident: dict[int, torch.Tensor] = {}        # storage -> its flat memory on the device
    parked: dict[int, torch.Tensor] = {}          # storage -> its value on the host, while it has no device memory
    gen = torch.Generator(device)
    out: dict[str, torch.Tensor] = {}

    def bring(sid: int, replaced: bool) -> None:
        value = parked.pop(sid, None)
        if value is not None and not replaced:
            resident[sid] = value.to(device, copy=True)
            return
        info = rec.storages[sid]
        # never written yet (made by torch.empty & co): undefined in eager; zeros, as the in-place replay's homes
        make = torch.empty if replaced else torch.zeros
        resident[sid] = make(info.nbytes // info.dtype.itemsize, dtype=info.dtype, device=device)

    def park(sid: int) -> None:
        value = resident.pop(sid)
        if sid in homes:
            homes[sid].copy_(value)
            parked[sid] = homes[sid]
        else:
            parked[sid] = value.to(_CPU, copy=True)

    def finish(sid: int) -> None:
        if targets.get(sid) and sid not in resident:
            bring(sid, replaced=False)
        root = resident.pop(sid, None)
        parked.pop(sid, None)
        for is_param, name, ref in targets.get(sid, ()):
            value = _view(root, ref.shape, ref.stride, ref.offset, ref.dtype)
            if is_param:
                store.values.load_params({name: value})       # converted on the device, then copied into the chunk
            else:
                out[name] = value.to(_CPU, copy=True)

    with torch.no_grad():
        for i in needed:
            step = rec.steps[i]
            if step.rng_state is not None:
                gen.set_state(step.rng_state)
            if not step.undefined:                      # torch.empty & co: memory comes with the first use
                for sid in sorted(step.reads):
                    if sid not in resident:
                        bring(sid, replaced=_overwrites(step, sid, rec))
                args, kwargs = tree_map(functools.partial(_resolve, step=step, rec=rec, roots=resident,
                                                          device=device), (step.args, step.kwargs))
                _run(step, args, kwargs, gen, rec, resident, set(), device)
                del args, kwargs                        # (views: they would keep a dropped storage alive)
            for sid in sorted(_touched(step)):
                if last[sid] == i:
                    finish(sid)
                elif sid not in resident:
                    continue
                elif _overwrites(rec.steps[later[(i, sid)]], sid, rec):
                    del resident[sid]                   # dead: the next step touching it replaces it whole
                elif later[(i, sid)] != following[i]:
                    park(sid)
    assert not resident and not parked, (sorted(resident), sorted(parked))
    return out


def _call_with_rng(fn, args, kwargs, gen: torch.Generator, device: torch.device | None = None) -> None:
    """Run a recorded torch.nn.init call drawing from `gen`. Such a function may draw from the global generator
    whatever its generator argument (sparse_'s randperm does), so the global RNG (the CPU's, or the replay device's)
    is set to gen's state for the call and restored after it. On a device, the call runs under torch.device(device),
    as the eager build it equals does: a tensor it makes without a device (sparse_'s randperm) is made there."""
    saved = device_rng_state(device)
    set_device_rng_state(device, gen.get_state())
    try:
        if device is None:
            fn(*args, **kwargs)
        else:
            with torch.device(device):
                fn(*args, **kwargs)
    finally:
        gen.set_state(device_rng_state(device))
        set_device_rng_state(device, saved)


def _with_generator(func, args: list, kwargs: dict, gen: torch.Generator) -> tuple[list, dict]:
    for i, a in enumerate(func._schema.arguments):
        if a.name == "generator":
            if i < len(args) and not a.kwarg_only:
                args[i] = gen
            else:
                kwargs["generator"] = gen
    return args, kwargs

