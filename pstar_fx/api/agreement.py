"""What the ranks of a sharded step must agree on before its collectives, checked where a disagreement would
otherwise train wrong values silently, or pair one rank's collective with another's different one.

- `check_same_step`, before the first collective of every step (a compile's own included): which function is called
  (a training step, or an evaluation: their collectives differ), the batch signature that selects a plan
  (structure, each tensor's shape and dtype, the constants), the model's train/eval modes and requires_grad flags,
  whether the step takes the model's values into its chunks now, and the optimizer's class and every group's
  options (lr, betas, eps, weight_decay, ...: what a scheduler or the user may change between steps). Ranks called with
  different batch sizes would otherwise train on the mean of the ranks' means, not the global batch's, or, where
  their graphs differ, pair different collectives; a rank that changes shape later compiles while the others do
  not, and its compile's own collectives pair with the others' step; ranks with different options would each
  update their own shard of every chunk under their own.
- `check_same_compile`, at every compile, before the compiled graph's first collective: the settings every rank must
  give alike (the optimizer's class, its groups and state_dtype, precision, max_grad_norm, accumulate, atomic), and
  the plan's collectives with the sizes of the chunks they move. Settings that may differ per rank (the budgets,
  chunk_size, prefetch, remat, fuse) are named where the plans then differ.
- `check_same_values`, where a step takes the model's values into its chunks: every rank holds the same values. A
  sharded step keeps only this rank's shard of every chunk, so ranks whose models were built from different seeds
  would train a model no rank built, each chunk's shards from different ranks.
- `compare_contents`, at step.load_state_dict() and step.optimizer.load_state_dict() where they run collectives or
  write into the chunks (and at the first compile, for optimizer states loaded before it): every rank loads the same
  state dict. Each rank writes its own shard of every chunk from the dict it was given, so dicts that differ would
  leave chunks whose shards come from different dicts, with no error.

Each runs on the Comm's CPU-side control group and costs one all-reduce of 16 bytes when the ranks agree (a 64-bit
digest each, `Comm.agree_on`); only on a mismatch a second round gathers what each rank has, so that every rank
raises the same `px.DistributedError` naming the ranks and what differs (the setting, the option, the functions
called), before any collective could pair wrongly.

Values are compared, not broadcast from rank 0 (as DDP does): comparing costs a hash of the values on every rank at
once and 16 bytes on the network, where a broadcast sends the whole model from one rank; it names the user's bug (a
rank seeded differently, a checkpoint loaded on one rank only) instead of silently replacing one rank's model. A
real tensor is hashed by its bytes (SHA-256, pieces of a large tensor on a few threads: hashlib releases the GIL); a
model built under px.init_empty() has no values yet, and every rank replays its whole recording and keeps its shard,
so what is compared is what the replay makes each value from (`init_empty.origin_digests`: the recorded ops, the RNG
states they draw from, the real tensors they read), which costs no replay.
"""
from __future__ import annotations

import hashlib
import os
import re
from concurrent.futures import ThreadPoolExecutor

import optree
import torch
import torch.nn as nn

from ..errors import DistributedError
from ..frontend.hook_keys import hook_count
from ..frontend.init_empty import is_empty, origin_digests
from ..frontend.trace import flatten_batch, leaf_name
from ..ir.graph import TrainGraph
from ..passes import collectives
from ..runtime.comm import CALLED, Comm
from ..units import format_bytes

HASH_PIECE_BYTES = 64 << 20      # a real tensor is hashed in pieces of this many bytes, on up to HASH_THREADS threads
HASH_THREADS = 8
SHOWN = 8                        # names listed in a message, then "and N more"
OPTIMIZER = "optimizer"          # the first word of what describes the optimizer's settings and options
PLAN = "the plan's collectives"  # what describes a compiled plan's collectives and the chunks they move
TRACING = "the step this call"   # whether a rank traces the step now


def check_same_step(comm: Comm, batch: tuple, model: nn.Module, model_key: tuple, taking: bool,
                    optimizer=None, tracing: bool = False) -> None:
    """Before a step's first collective: raise DistributedError on every rank unless every rank calls the same
    function (a training step with `optimizer`, its live optimizer; an evaluation without) with the same batch
    signature, model state and optimizer options (see the module docstring), including whether the step takes the
    model's values into its chunks now (`taking`: the model holds some of its own values, at the first step or
    after sync_model()), when the step checks those values (`check_same_values`, from ModelState.take).
    `model_key`: what of the model the step's plan depends on (Compiler.model_key). `tracing`: whether the step
    traces now (Compiler.will_trace: a trace makes collectives of its own). A collective: every rank calls it with
    its step."""
    shapes = tuple((n, tuple(p.shape)) for n, p in model.named_parameters())
    options = optimizer_options(optimizer)
    every = comm.agree_on(called(optimizer),
                          (flatten_batch(batch).signature, model_key, taking, shapes, options, tracing),
                          lambda: {**_describe_step(batch, model, taking, options), TRACING: _tracing(tracing)})
    if every is None:
        return
    differ = _differing(every)
    if OPTIMIZER in differ:       # another class: its options differ too
        differ = [k for k in differ if not k.startswith(OPTIMIZER)] + [OPTIMIZER]
    elif f"{OPTIMIZER} parameter groups" in differ:     # other groups: the options of those only some ranks have
        differ = [k for k in differ if all(k in d for d in every)]
    if differ == [TRACING]:
        advice = ("The step's plain Python values or hooks (its signature, docs/tracing.md) differ between the ranks "
                  "where only some trace: a value or hook that the step sets on some ranks only (`if rank == 0: "
                  "self.logged = True` in forward) or changes at every call on some. Set such state on every rank "
                  "alike, or keep it outside the step.")
    elif any(k.startswith(OPTIMIZER) for k in differ):
        advice = ("Give every rank the same optimizer and options: the same px.compile(optimizer=...), and an lr "
                  "scheduler made and stepped, or param_groups edited, on every rank alike.")
    else:
        advice = ("Every rank must call the step with batches of the same structure, shapes and dtypes (split the "
                  "global batch evenly; drop or pad a short last batch on every rank), on the same model (the same "
                  "parameters and shapes), in the same train/eval mode, with the same requires_grad flags and "
                  "hooks, and sync_model() on every rank or none.")
    raise DistributedError(
        f"pstar-fx: the ranks disagree on this step, so their collectives would not match or their shards would "
        f"train differently ({_shown(every, differ)}). {advice} Nothing ran: the step's values are as they were.")


def check_same_compile(comm: Comm, g: TrainGraph, optimizer=None, **knobs) -> None:
    """At a compile, before the first collective of its graph `g`: raise DistributedError on every rank unless
    every rank gave the settings every rank must give alike (`fixed_settings`), and every rank's plan issues the
    same collectives over chunks of the same sizes. Where only the plans differ, the message names the settings
    that may differ per rank and do (`tunable_settings`: the budgets, chunk_size, and `knobs`, px.compile's
    prefetch, remat, fuse), which made them differ. `optimizer`: the live optimizer (None: an evaluation). A
    collective."""
    st = g.settings
    fixed = fixed_settings(st, optimizer)
    plan = (collectives(g), tuple(c.capacity for c in g.chunks), st.precision.value)
    every = comm.agree_on(called(optimizer), (sorted(fixed.items()), plan),
                          lambda: {**fixed, **tunable_settings(st, **knobs), PLAN: _describe_plan(plan)})
    if every is None:
        return
    differ = [k for k in _differing(every) if k in fixed]
    if differ:
        raise DistributedError(
            f"pstar-fx: the ranks compiled the step with different settings ({_shown(every, differ)}): each rank "
            "would train its shard of every chunk under its own, or pair collectives that differ. Give px.compile "
            "the same optimizer (class, parameter groups, state_dtype), precision, max_grad_norm, "
            "accumulate and atomic on every rank. Nothing ran: the step's values are as they were.")
    tunable = [k for k in _differing(every) if k != PLAN and k not in fixed]
    why = (f"planned under different settings ({_shown(every, tunable)}): give every rank the same "
           f"{', '.join(tunable)}" if tunable else "planned under the same settings: give every rank the same model "
           "and batch shapes")
    raise DistributedError(
        f"pstar-fx: the ranks' compiled steps would issue different collectives ({_shown(every, [PLAN])}), "
        f"{why}. Nothing ran: the step's values are as they were.")


def called(optimizer) -> str:
    """The function a rank is in, as the ranks compare it (Comm.agree_on): a training step has an optimizer."""
    return "the training step" if optimizer is not None else "an evaluation function"


def optimizer_options(optimizer) -> tuple:
    """The optimizer's class, and every group's number of parameters and options (those of torch.optim's
    `defaults`: lr, betas, eps, weight_decay, ...; not the parameters, nor keys a scheduler adds such as
    initial_lr); () for none."""
    if optimizer is None:
        return ()
    keys = sorted(optimizer.defaults)
    return (optimizer.torch_class.__name__, tuple((len(g["params"]), tuple((k, _plain(g.get(k))) for k in keys))
                                                  for g in optimizer.param_groups))


def _plain(v):
    """A group option as a plain value whose repr is exact (a tensor lr's repr rounds it)."""
    if isinstance(v, torch.Tensor):
        return v.item() if v.numel() == 1 else tuple(v.flatten().tolist())
    if isinstance(v, (tuple, list)):
        return tuple(_plain(x) for x in v)
    return v


def fixed_settings(settings, optimizer) -> dict[str, str]:
    """What every rank must give px.compile alike, readable, by name: what each rank's shard of every chunk trains
    under, and what its collectives carry."""
    st = settings
    out = {"precision": st.precision.value, "device": st.device.type, "max_grad_norm": repr(st.max_grad_norm),
           "accumulate": repr(st.accumulate), "atomic": repr(st.atomic)}
    layout = st.optimizer
    if layout is not None:
        names = repr(layout.groups)
        out[OPTIMIZER] = optimizer.torch_class.__name__ if optimizer is not None else "?"
        out[f"{OPTIMIZER} state_dtype"] = layout.state.dtype.value
        out[f"{OPTIMIZER} parameter groups"] = (
            f"{len(layout.groups)} of {', '.join(str(len(g)) for g in layout.groups)} tensors "
            f"(names {hashlib.sha256(names.encode()).hexdigest()[:8]})")
    return out


def tunable_settings(settings, **knobs) -> dict[str, str]:
    """Settings the ranks may give differently (each rank's budgets, a chunk size the ranks' plans may agree on
    whichever is given), readable, by px.compile's names: named where the ranks' plans differ."""
    st = settings
    out = {"device_memory": _bytes(st.budget), "chunk_size": repr(st.chunk_size),
           "host_memory": _bytes(st.host_budget), "disk_memory": _bytes(st.disk_budget)}
    out.update({k: repr(v) for k, v in knobs.items()})
    return out


def _bytes(n: int | None) -> str:
    return "None" if n is None else f"{n:,} bytes ({format_bytes(n)})"


def _describe_plan(plan) -> str:
    """A plan's collectives and chunks, readable (the second round, on a mismatch)."""
    ops, capacities, precision = plan
    counts = {op: sum(1 for o, _ in ops if o == op) for op in ("all_gather", "reduce_scatter", "all_reduce")}
    return (", ".join(f"{n} {op}" for op, n in counts.items()) + f" over {len(capacities)} chunks of "
            f"{sum(capacities):,} {precision} elements (digest {hashlib.sha256(repr(plan).encode()).hexdigest()[:8]})")


def check_same_values(comm: Comm, tensors: dict[str, torch.Tensor]) -> None:
    """Raise DistributedError on every rank unless every rank holds the same value of each of these parameters and
    buffers (real tensors, or those of a model built under px.init_empty(); see the module docstring). A collective:
    every rank calls it with the same names."""
    digests = _value_digests(tensors)
    every = comm.agree_on("a compiled function taking the model's values", sorted(digests.items()),
                          lambda: {"values": digests})
    if every is None:
        return
    every = [d["values"] for d in every]
    names = sorted({n for d in every for n in d})
    differ = [n for n in names if len({d.get(n) for d in every}) > 1]
    shown = ", ".join(f"{n} ({_groups([d.get(n) for d in every])})" for n in differ[:SHOWN])
    more = f" and {len(differ) - SHOWN} more" if len(differ) > SHOWN else ""
    raise DistributedError(
        f"pstar-fx: the ranks start from different values of {len(differ)} of the model's {len(names)} parameters "
        f"and buffers: {shown}{more} (ranks separated by | hold different values). A sharded step keeps each rank's "
        "shard of every chunk, so it would train a mix of the ranks' models. Build the model from the same seed on "
        "every rank (torch.manual_seed(seed) before building it, under px.init_empty() too), or load the same "
        "state_dict on every rank before the first step.")


def compare_contents(comm: Comm, call: str, options: dict[str, object], values: dict[str, object], noun: str,
                     after: str) -> str | None:
    """Whether every rank is in `call` (a load: step.load_state_dict(), step.optimizer.load_state_dict()) with the
    same `options` (name -> a plain value, a group's lr; compared by its exact repr) and `values` (name -> a tensor,
    compared by a digest of its bytes, shape and dtype as `check_same_values` compares them, or a plain value): one
    agree on the control group where they are (Comm.agree_on; DistributedError on every rank where the ranks are in
    different functions). None where every rank has the same; else, on every rank, what differs, readable: the
    options with each rank's value, then the `noun` ("state dict entries") whose values differ, grouping the ranks
    that hold the same (a second round). A collective: every rank calls it."""
    shown = {k: _exact(v) for k, v in options.items()}
    digests = _value_digests({k: v for k, v in values.items() if isinstance(v, torch.Tensor)})
    digests.update({k: hashlib.sha256(_exact(v).encode()).digest()[:16] for k, v in values.items()
                    if not isinstance(v, torch.Tensor)})
    every = comm.agree_on(call, (sorted(shown.items()), sorted(digests.items())),
                          lambda: {"options": shown, "values": digests}, after=after)
    if every is None:
        return None
    opts = [d["options"] for d in every]
    vals = [d["values"] for d in every]
    differ = [k for k in dict.fromkeys(k for d in opts for k in d) if len({d.get(k, MISSING) for d in opts}) > 1]
    names = list(dict.fromkeys(k for d in vals for k in d))
    differ_values = [n for n in names if len({d.get(n) for d in vals}) > 1]
    out = [_shown(opts, differ)] if differ else []
    if differ_values:
        listed = ", ".join(f"{n} ({_groups([d.get(n) for d in vals])})" for n in differ_values[:SHOWN])
        more = f" and {len(differ_values) - SHOWN} more" if len(differ_values) > SHOWN else ""
        out.append(f"the values of {len(differ_values)} of {len(names)} {noun}: {listed}{more} (ranks separated by "
                   "| hold different values, or one has none)")
    return " | ".join(out) or "the digests of what they load"


def _exact(v) -> str:
    """A plain value's exact repr, the same in every process (no object addresses)."""
    return re.sub(r" at 0x[0-9a-fA-F]+", "", repr(_plain(v)))


def _value_digests(tensors: dict[str, torch.Tensor]) -> dict[str, bytes]:
    """name -> digest of its value: of its bytes (with shape and dtype) for a real tensor, of what its value is made
    from for one of a model built under px.init_empty(). A tensor on the meta device has no value (the step refuses
    it when it takes the model)."""
    out = origin_digests({n: t for n, t in tensors.items() if is_empty(t)})
    out.update({n: b"meta" for n, t in tensors.items() if not is_empty(t) and t.is_meta})
    # flat byte views where the values are (a GPU's tensor is copied to the host piece by piece, while hashed)
    flat = {n: t.detach().contiguous().reshape(-1).view(torch.uint8) for n, t in tensors.items()
            if not is_empty(t) and not t.is_meta}
    pieces = [(n, lo) for n, b in flat.items() for lo in range(0, max(b.numel(), 1), HASH_PIECE_BYTES)]

    def piece(p: tuple[str, int]) -> bytes:
        name, lo = p
        return hashlib.sha256(flat[name][lo:lo + HASH_PIECE_BYTES].cpu().numpy()).digest()

    parts: dict[str, list[bytes]] = {n: [] for n in flat}
    with ThreadPoolExecutor(max(1, min(HASH_THREADS, os.cpu_count() or 1, len(pieces)))) as pool:
        for (n, _), h in zip(pieces, pool.map(piece, pieces)):
            parts[n].append(h)
    for n, b in flat.items():
        t = tensors[n]
        out[n] = hashlib.sha256(repr((tuple(t.shape), t.dtype)).encode() + b"".join(parts[n])).digest()[:16]
    return out


def _tracing(tracing: bool) -> str:
    return "traces it (its signature is new, or was changed by its last trace)" if tracing else "runs it compiled"


def _describe_step(batch: tuple, model: nn.Module, taking: bool, options: tuple) -> dict[str, str]:
    """What a rank's step signature is made of, readable (the second round, on a mismatch)."""
    paths, leaves, spec = optree.tree_flatten_with_path(tuple(batch), none_is_leaf=True)
    tensors = [f"{leaf_name(p)} {tuple(x.shape)} {str(x.dtype).removeprefix('torch.')}"
               for p, x in zip(paths, leaves) if isinstance(x, torch.Tensor)]
    constants = [f"{leaf_name(p)}={x!r}" for p, x in zip(paths, leaves) if not isinstance(x, torch.Tensor)]
    eval_mode = [name or type(model).__name__ for name, m in model.named_modules() if not m.training]
    frozen = [name for name, p in model.named_parameters() if not p.requires_grad]
    params = list(model.named_parameters())
    shapes = repr([(n, tuple(p.shape)) for n, p in params])
    out = {
        "the model's parameters": (f"{len(params)} tensors of {sum(p.numel() for _, p in params):,} elements "
                                   f"(names and shapes {hashlib.sha256(shapes.encode()).hexdigest()[:8]})"),
        "hooks on the model": str(hook_count(model)),
        "batch shapes and dtypes": ", ".join(tensors) or "no tensors",
        "batch constants": ", ".join(constants) or "none",
        "batch structure": repr(spec),
        "modules in eval mode": _listed(eval_mode),
        "parameters with requires_grad=False": _listed(frozen),
        "the model's values": ("in the model: this step takes them into its chunks" if taking
                               else "held by a compiled step"),
    }
    if options:
        name, groups = options
        out[OPTIMIZER] = name
        out[f"{OPTIMIZER} parameter groups"] = f"{len(groups)} of {', '.join(str(n) for n, _ in groups)} tensors"
        for i, (_, group) in enumerate(groups):
            out.update({f"{OPTIMIZER} param_groups[{i}][{k!r}]": repr(v) for k, v in group})
    out["signature"] = repr((flatten_batch(batch).signature, [m.training for m in model.modules()],
                             [p.requires_grad for p in model.parameters()]))
    return out


def _differing(every: list[dict]) -> list[str]:
    """The keys of the ranks' descriptions whose values differ (one missing on some rank included), in order; the
    whole signature where the digests differ but no readable part does."""
    keys = list(dict.fromkeys(k for d in every for k in d if k not in ("signature", CALLED)))
    differ = [k for k in keys if len({d.get(k, MISSING) for d in every}) > 1]
    return differ or ["signature"]


def _shown(every: list[dict], keys: list[str]) -> str:
    """`what: rank 0: a; rank 1: b` for each of keys, joined by ' | '."""
    out = []
    for k in keys:
        by_value: dict[str, list[int]] = {}
        for r, d in enumerate(every):
            by_value.setdefault(d.get(k, MISSING), []).append(r)
        out.append(f"{k}: " + "; ".join(f"{_ranks(rs)}: {v}" for v, rs in by_value.items()))
    return " | ".join(out)


MISSING = "(none)"       # a description's value where a rank has no such key (an optimizer group it lacks)


def _groups(values: list) -> str:
    """Ranks grouped by equal value: 'ranks 0, 2 | rank 1'."""
    by_value: dict = {}
    for r, v in enumerate(values):
        by_value.setdefault(v, []).append(r)
    return " | ".join(_ranks(rs) for rs in by_value.values())


def _ranks(rs: list[int]) -> str:
    return ("rank " if len(rs) == 1 else "ranks ") + ", ".join(map(str, rs))


def _listed(names: list[str]) -> str:
    if not names:
        return "none"
    return ", ".join(names[:SHOWN]) + (f" and {len(names) - SHOWN} more" if len(names) > SHOWN else "")
