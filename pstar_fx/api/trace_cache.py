"""The cache of compiled steps, one per signature: bounded, least recently used first out, and loud about constants.

A signature is a tuple of parts (the batch's `BatchSignature` is one; the model's mode, for example, can be another).
A batch constant that changes every call (an epoch counter passed in the batch) makes every call a new signature: each
one traces and compiles again. The cache keeps at most `max_size` compiled steps, so memory stays bounded, and warns
once when more than `warn_after` signatures differ only in the values of constants, naming the batch leaf.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Generic, TypeVar

from ..errors import warn

V = TypeVar("V")

DEFAULT_MAX_SIZE = 8      # compiled signatures kept (each holds its graphs and executor, not model data)
DEFAULT_WARN_AFTER = 4    # distinct constant values of one shape family before the warning


def _family(key: tuple) -> tuple:
    """The key with every constant's value blanked out: signatures that differ only in constants share it."""
    return tuple(p.without_constants() if hasattr(p, "without_constants") else p for p in key)


def _constants(key: tuple) -> tuple:
    return tuple(c for p in key if hasattr(p, "without_constants") for c in p.constants)


class TraceCache(Generic[V]):
    """Compiled steps by signature key (a tuple), least recently used evicted past `max_size`."""

    def __init__(self, max_size: int = DEFAULT_MAX_SIZE, warn_after: int = DEFAULT_WARN_AFTER):
        if max_size < 1:
            raise ValueError(f"TraceCache: max_size must be >= 1, got {max_size}")
        self.max_size = max_size
        self.warn_after = warn_after
        self._entries: OrderedDict[tuple, V] = OrderedDict()
        # shape family -> distinct constant tuples seen (capped at warn_after + 1), bounded like the entries
        self._seen: OrderedDict[tuple, set[tuple]] = OrderedDict()
        self._warned: set[tuple] = set()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: tuple) -> bool:
        return key in self._entries

    def get(self, key: tuple) -> V | None:
        value = self._entries.get(key)
        if value is not None:
            self._entries.move_to_end(key)
        return value

    def put(self, key: tuple, value: V) -> None:
        self._entries[key] = value
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_size:
            self._entries.popitem(last=False)
        self._note(key)

    def _note(self, key: tuple) -> None:
        consts = _constants(key)
        if not consts:
            return
        family = _family(key)
        seen = self._seen.setdefault(family, set())
        self._seen.move_to_end(family)
        while len(self._seen) > 4 * self.max_size:
            self._seen.popitem(last=False)
        if len(seen) <= self.warn_after:
            seen.add(consts)
        if len(seen) > self.warn_after and family not in self._warned:
            self._warned.add(family)
            varying = [path for i, (path, _, _) in enumerate(consts) if len({c[i][2] for c in seen}) > 1]
            values = sorted({repr(c[[p for p, _, _ in consts].index(varying[0])][2]) for c in seen})
            warn(
                f"pstar-fx: the step was traced and compiled again for {len(seen)} batches that differ only in the "
                f"constant batch leaf {', '.join(varying)} (values {', '.join(values[:5])}): every new value "
                "retraces. Pass it as a tensor (torch.tensor(value)) or use it outside the step; at most "
                f"{self.max_size} compiled signatures are kept (least recently used dropped).")
