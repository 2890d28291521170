"""The storage layer under pstar-fx's sharded checkpoints: torch.distributed.checkpoint's file system writer and
reader, with DCP's metadata kept as JSON in pstar-fx's manifest instead of a pickle, and byte entries read with
`torch.load(weights_only=True)`.

Why. DCP's FileSystemReader reads `.metadata` with `pickle.load`, and DefaultLoadPlanner reads byte entries with
`torch.load(weights_only=False)`: either runs whatever code a crafted file names. Here:
- `Writer.finish` (rank 0, after every rank has written its data files) keeps the Metadata instead of pickling it;
  pstar_fx.checkpoint writes it, with the files' checksums, as the manifest (pstar_fx.checkpoint.files).
- `Reader` hands DCP a Metadata rebuilt from that JSON by `metadata_from_json`, which checks every value (known
  dtypes only, sizes and offsets that are non-negative integers, chunks inside their tensor, every stored piece
  inside a file the manifest lists and verified) before DCP sees it.
- `SafeLoadPlanner.load_bytes` unpickles byte entries with `weights_only=True` and keeps them in `loaded` (the
  caller's state dict is not written: DCP copies it in some torch versions). Tensor pieces are read by DCP's own
  `torch.load(weights_only=True)`.
The data files (`__<rank>_<i>.distcp`) are DCP's own, unchanged. Uses `_StorageInfo`, the per-piece record of
torch's file system storage (present, with the same fields, in torch 2.11 through 2.14).
"""
from __future__ import annotations

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                   MetadataIndex, StorageMeta, TensorProperties,
                                                   TensorStorageMetadata)

from ..errors import CheckpointError

_DTYPES = {n: getattr(torch, n) for n in (
    "float64", "float32", "float16", "bfloat16", "complex128", "complex64", "int64", "int32", "int16", "int8",
    "uint8", "bool", "uint16", "uint32", "uint64", "float8_e4m3fn", "float8_e5m2") if hasattr(torch, n)}
_NAMES = {d: n for n, d in _DTYPES.items()}


class Writer(FileSystemWriter):
    """DCP's file system writer, except that `finish` keeps the metadata (`self.metadata`, on rank 0) instead of
    pickling it into `.metadata`."""

    metadata: Metadata | None = None

    def finish(self, metadata: Metadata, results) -> None:
        metadata.storage_data = {wr.index: wr.storage_data for wr_list in results for wr in wr_list}
        self.metadata = metadata


class Reader(FileSystemReader):
    """DCP's file system reader over metadata already read and checked (never `.metadata`'s pickle)."""

    def __init__(self, path: str, metadata: Metadata):
        super().__init__(path)
        self._metadata = metadata

    def read_metadata(self, *args, **kwargs) -> Metadata:
        self._metadata.storage_meta = StorageMeta(load_id=self.load_id)
        return self._metadata


class LazySavePlanner(DefaultSavePlanner):
    """DCP's save planner, where the state dict's entries named in `lazy` are placeholders (meta tensors of the
    entry's shape and dtype) and their values are made only when the writer asks for them, in the plan's order (the
    file system writer's one-thread loaders ask item by item): `lazy[fqn]()` returns the tensor."""

    def __init__(self, lazy: dict):
        super().__init__()
        self.lazy = lazy

    def lookup_object(self, index):
        make = self.lazy.get(index.fqn)
        return super().lookup_object(index) if make is None else make()


class SafeLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner whose byte entries are unpickled with weights_only=True, into `self.loaded`."""

    def __init__(self):
        super().__init__()
        self.loaded: dict[str, object] = {}

    def load_bytes(self, read_item, value) -> None:
        fqn = read_item.dest_index.fqn
        try:
            self.loaded[fqn] = torch.load(value, weights_only=True)
        except Exception as e:   # noqa: BLE001 - whatever the unpickler refused, named with its entry
            raise CheckpointError(f"the entry {fqn!r} holds something other than tensors and plain values "
                                  f"(torch.load(weights_only=True) refused it: {type(e).__name__}: {e})") from None


# -- DCP's metadata as JSON ------------------------------------------------------------------------------------------
def metadata_to_json(md: Metadata) -> dict:
    entries = {}
    for fqn, m in md.state_dict_metadata.items():
        if isinstance(m, BytesStorageMetadata):
            entries[fqn] = {"bytes": True}
            continue
        assert isinstance(m, TensorStorageMetadata), (fqn, type(m))
        p = m.properties
        assert p.layout == torch.strided and p.dtype in _NAMES, (fqn, p)
        entries[fqn] = {"dtype": _NAMES[p.dtype], "size": list(m.size),
                        "chunks": [[list(c.offsets), list(c.sizes)] for c in m.chunks]}
    items = []
    for index, info in md.storage_data.items():
        assert not getattr(info, "transform_descriptors", None), info
        items.append([index.fqn, None if index.offset is None else list(index.offset), index.index,
                      info.relative_path, info.offset, info.length])
    return {"entries": entries, "items": items}


def _ints(x, what: str) -> list[int]:
    if not isinstance(x, list) or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in x):
        raise ValueError(f"{what} must be a list of non-negative integers, got {x!r}"[:200])
    return x


def metadata_from_json(doc: dict, sizes: dict[str, int]) -> Metadata:
    """The Metadata `metadata_to_json` wrote, checked; `sizes`: the data files the manifest lists, and their sizes.
    Raises ValueError saying what is wrong."""
    if not isinstance(doc, dict) or set(doc) != {"entries", "items"} or not isinstance(doc["entries"], dict) \
            or not isinstance(doc["items"], list):
        raise ValueError("DCP's metadata has another structure")
    state: dict = {}
    for fqn, e in doc["entries"].items():
        if e == {"bytes": True}:
            state[fqn] = BytesStorageMetadata()
            continue
        if not isinstance(e, dict) or set(e) != {"dtype", "size", "chunks"} or e["dtype"] not in _DTYPES \
                or not isinstance(e["chunks"], list):
            raise ValueError(f"the entry {fqn!r} is malformed")
        size = _ints(e["size"], f"the size of {fqn!r}")
        chunks, volume = [], 0
        for c in e["chunks"]:
            if not isinstance(c, list) or len(c) != 2:
                raise ValueError(f"a chunk of {fqn!r} is malformed")
            offsets, sizes_ = _ints(c[0], f"a chunk offset of {fqn!r}"), _ints(c[1], f"a chunk size of {fqn!r}")
            if len(offsets) != len(size) or len(sizes_) != len(size) \
                    or any(o + s > n for o, s, n in zip(offsets, sizes_, size)):
                raise ValueError(f"a chunk of {fqn!r} lies outside its tensor of size {size}")
            chunks.append(ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes_)))
            volume += torch.Size(sizes_).numel()
        if volume != torch.Size(size).numel():
            raise ValueError(f"the chunks of {fqn!r} hold {volume} elements, the tensor has {torch.Size(size).numel()}")
        state[fqn] = TensorStorageMetadata(properties=TensorProperties(dtype=_DTYPES[e["dtype"]]),
                                           size=torch.Size(size), chunks=chunks)
    storage: dict = {}
    stored: dict[str, set] = {}
    for item in doc["items"]:
        if not isinstance(item, list) or len(item) != 6:
            raise ValueError("a stored piece is malformed")
        fqn, offset, index, rel, start, length = item
        if fqn not in state:
            raise ValueError(f"a stored piece names {fqn!r}, which has no entry")
        if offset is not None:
            _ints(offset, f"the offset of a piece of {fqn!r}")
        if not (index is None or isinstance(index, int) and not isinstance(index, bool) and index >= 0):
            raise ValueError(f"a stored piece of {fqn!r} is malformed")
        if rel not in sizes:
            raise ValueError(f"a piece of {fqn!r} is in {rel!r}, which the manifest does not list")
        _ints([start, length], f"the place of a piece of {fqn!r}")
        if start + length > sizes[rel]:
            raise ValueError(f"a piece of {fqn!r} lies past the end of {rel} ({start} + {length} > {sizes[rel]})")
        index = MetadataIndex(fqn, offset, index)
        storage[index] = _StorageInfo(relative_path=rel, offset=start, length=length)
        stored.setdefault(fqn, set()).add(None if offset is None else tuple(offset))
    for fqn, m in state.items():
        need = {tuple(c.offsets) for c in m.chunks} if isinstance(m, TensorStorageMetadata) else {None}
        if not need <= stored.get(fqn, set()):
            raise ValueError(f"the entry {fqn!r} has pieces that no file stores")
    return Metadata(state_dict_metadata=state, storage_data=storage)
