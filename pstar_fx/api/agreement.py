"""What the ranks of a sharded step must agree on before its collectives, checked where a disagreement would
otherwise train wrong values silently, or pair one rank's collective with another's different one.

- `check_same_step`, before the first collective of every step (a compile's own included): the batch signature that
  selects a plan (structure, each tensor's shape and dtype, the constants), the model's train/eval modes and
  requires_grad flags, and whether the step takes the model's values into its chunks now. Ranks called with
  different batch sizes would otherwise train on the mean of the ranks' means, not the global batch's, or, where
  their graphs differ, pair different collectives; a rank that changes shape later compiles while the others do
  not, and its compile's own collectives pair with the others' step.
- `check_same_values`, where a step takes the model's values into its chunks: every rank holds the same values. A
  sharded step keeps only this rank's shard of every chunk, so ranks whose models were built from different seeds
  would train a model no rank built, each chunk's shards from different ranks.

Both run on the Comm's CPU-side control group and cost one all-reduce of 16 bytes when the ranks agree (a 64-bit
digest each, `Comm.agree`); only on a mismatch a second round gathers what each rank has, so that every rank raises
the same `px.DistributedError` naming the ranks and what differs, before any collective could pair wrongly.

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
from concurrent.futures import ThreadPoolExecutor

import optree
import torch
import torch.nn as nn

from ..errors import DistributedError
from ..frontend.init_empty import is_empty, origin_digests
from ..frontend.model_tensors import hook_count
from ..frontend.trace import flatten_batch, leaf_name
from ..runtime.comm import Comm, digest64

HASH_PIECE_BYTES = 64 << 20      # a real tensor is hashed in pieces of this many bytes, on up to HASH_THREADS threads
HASH_THREADS = 8
SHOWN = 8                        # names listed in a message, then "and N more"


def check_same_step(comm: Comm, batch: tuple, model: nn.Module, model_key: tuple, taking: bool) -> None:
    """Before a step's first collective: raise DistributedError on every rank unless every rank calls it with the
    same batch signature and model state (see the module docstring), including whether the step takes the model's
    values into its chunks now (`taking`: the model holds some of its own values, at the first step or after
    sync_model()), when the step checks those values (`check_same_values`, from ModelState.take). `model_key`: what
    of the model the step's plan depends on (Compiler.model_key). A collective: every rank calls it with its step."""
    shapes = tuple((n, tuple(p.shape)) for n, p in model.named_parameters())
    if not comm.agree(digest64(flatten_batch(batch).signature, model_key, taking, shapes)):
        every = comm.gather_objects(_describe_step(batch, model, taking))
        raise DistributedError(
            f"pstar-fx: the ranks disagree on this step, so their collectives would not match ({_differences(every)}). "
            "Every rank must call the step with batches of the same structure, shapes and dtypes (split the global "
            "batch evenly; drop or pad a short last batch on every rank), on the same model (the same parameters "
            "and shapes), in the same train/eval mode, with the same requires_grad flags and hooks, and "
            "sync_model() on every rank or none. Nothing ran: the step's values are as they were.")


def check_same_values(comm: Comm, tensors: dict[str, torch.Tensor]) -> None:
    """Raise DistributedError on every rank unless every rank holds the same value of each of these parameters and
    buffers (real tensors, or those of a model built under px.init_empty(); see the module docstring). A collective:
    every rank calls it with the same names."""
    digests = _value_digests(tensors)
    if comm.agree(digest64(sorted(digests.items()))):
        return
    every = comm.gather_objects(digests)
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


def _describe_step(batch: tuple, model: nn.Module, taking: bool) -> dict[str, str]:
    """What a rank's step signature is made of, readable (the second round, on a mismatch)."""
    paths, leaves, spec = optree.tree_flatten_with_path(tuple(batch), none_is_leaf=True)
    tensors = [f"{leaf_name(p)} {tuple(x.shape)} {str(x.dtype).removeprefix('torch.')}"
               for p, x in zip(paths, leaves) if isinstance(x, torch.Tensor)]
    constants = [f"{leaf_name(p)}={x!r}" for p, x in zip(paths, leaves) if not isinstance(x, torch.Tensor)]
    eval_mode = [name or type(model).__name__ for name, m in model.named_modules() if not m.training]
    frozen = [name for name, p in model.named_parameters() if not p.requires_grad]
    params = list(model.named_parameters())
    shapes = repr([(n, tuple(p.shape)) for n, p in params])
    return {
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
        "signature": repr((flatten_batch(batch).signature, [m.training for m in model.modules()],
                           [p.requires_grad for p in model.parameters()])),
    }


def _differences(every: list[dict[str, str]]) -> str:
    """The parts of the ranks' descriptions that differ: `what: rank 0: a; rank 1: b`, joined by ' | '."""
    keys = [k for k in every[0] if k != "signature" and len({d[k] for d in every}) > 1]
    keys = keys or ["signature"]     # the digests differ where no readable part does: show all of it
    out = []
    for k in keys:
        by_value: dict[str, list[int]] = {}
        for r, d in enumerate(every):
            by_value.setdefault(d[k], []).append(r)
        out.append(f"{k}: " + "; ".join(f"{_ranks(rs)}: {v}" for v, rs in by_value.items()))
    return " | ".join(out)


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
