"""A step's batch as its tensor leaves plus what rebuilds it, and the signature a compiled trace is keyed by."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import optree
import torch

from .python_state import float_key


@dataclass(frozen=True)
class BatchSignature:
    """What a compiled trace of a batch is keyed by: its structure, each tensor's shape and dtype, each constant.

    `constants` are (leaf path, type, value) of the non-tensor leaves; `without_constants()` is the key of the
    family of signatures that differ only in them (the trace cache warns when such a family keeps growing)."""
    structure: object                # optree's PyTreeSpec (hashable, compared structurally)
    tensors: tuple[tuple[tuple[int, ...], torch.dtype], ...]
    constants: tuple[tuple[str, type, object], ...]

    def without_constants(self) -> tuple:
        return (self.structure, self.tensors, tuple(path for path, _, _ in self.constants))


@dataclass(frozen=True)
class FlatBatch:
    """A batch as its tensor leaves plus what rebuilds it: nested tuples, lists and dicts of tensors are allowed;
    other leaves (ints, strings, None) are constants of the trace and part of its signature."""
    tensors: tuple[torch.Tensor, ...]
    spec: object                     # optree's PyTreeSpec
    constants: tuple                 # every leaf, with the _TENSOR marker where a tensor goes
    signature: BatchSignature        # what a cached trace is keyed by

    def rebuild(self, tensors) -> tuple:
        it = iter(tensors)
        leaves = [next(it) if c is _TENSOR else c for c in self.constants]
        return tuple(optree.tree_unflatten(self.spec, leaves))


class _TensorSlot:
    def __repr__(self) -> str:
        return "<tensor>"


_TENSOR = _TensorSlot()


def leaf_name(path: tuple) -> str:
    """`batch[2]`, `batch[0]['epoch']`: where a leaf sits in step(*batch)."""
    return "batch" + "".join(f"[{k!r}]" for k in path)


def flatten_batch(batch: tuple) -> FlatBatch:
    # No optree namespace: torch registers its own pytree types in the "torch" namespace lazily (when make_fx first
    # runs), which would change the spec, and so the signature, of the same batch after the first trace.
    paths, leaves, spec = optree.tree_flatten_with_path(tuple(batch), none_is_leaf=True)
    tensors = tuple(x for x in leaves if isinstance(x, torch.Tensor))
    constants = tuple(_TENSOR if isinstance(x, torch.Tensor) else x for x in leaves)
    consts = []
    for path, x in zip(paths, leaves):
        if isinstance(x, torch.Tensor):
            if x.is_nested or x.layout != torch.strided:
                kind = "nested" if x.is_nested else str(x.layout).removeprefix("torch.")
                raise TypeError(f"step(*batch): {leaf_name(path)} is a {kind} tensor; pstar-fx steps take dense "
                                "(strided) tensors: pass x.to_dense(), or pad a nested tensor's rows into one "
                                "(torch.nested.to_padded_tensor)")
            continue
        try:
            hash(x)
        except TypeError:
            if isinstance(x, Mapping):
                raise TypeError(f"step(*batch): {leaf_name(path)} is a {type(x).__name__}, a mapping but not a "
                                "dict: pass dict(...) of it (a tokenizer's or collator's BatchEncoding too)") from None
            raise TypeError(f"step(*batch): {leaf_name(path)} is a {type(x).__name__}, neither a tensor nor "
                            "hashable; pass tensors (in tuples, lists or dicts) and plain constants") from None
        consts.append((leaf_name(path), type(x), float_key(x) if type(x) is float else x))   # (NaN, -0.0)
    sig = BatchSignature(spec, tuple((tuple(x.shape), x.dtype) for x in tensors), tuple(consts))
    return FlatBatch(tensors, spec, constants, sig)


def check_has_data(flat: FlatBatch, call: str) -> None:
    """A step runs on real batch tensors: one on the meta device (shape and dtype only, which px.plan accepts) raises
    ValueError naming it, before anything is traced or run."""
    meta = [i for i, t in enumerate(flat.tensors) if t.is_meta]
    if meta:
        raise ValueError(f"{call}: batch tensor {meta[0]} (of shape {tuple(flat.tensors[meta[0]].shape)}) is on the "
                         "meta device, which holds no data to run on: pass real tensors (px.plan takes meta "
                         "tensors, for planning without running)")
