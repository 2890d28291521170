"""The cache of compiled steps, one per signature: bounded, least recently used first out, and loud about constants
and shapes.

A signature is a tuple of parts (the batch's `BatchSignature` is one; the model's mode, for example, can be another).
A batch constant that changes every call (an epoch counter passed in the batch) makes every call a new signature: each
one traces and compiles again. The cache keeps at most `max_size` compiled steps, so memory stays bounded, and warns
once when more than `warn_after` signatures differ only in the values of constants, naming the batch leaf. Batches of
varying shapes (sequence lengths) are a new signature each too: it warns once when the `shapes_warn_at`-th distinct
set of batch shapes is compiled, saying how to pad or bucket and how to keep more. A signature can be pinned
(`step.reserve`): no entry of its first part (the batch's signature) is evicted, whatever the rest of its key (a
model state the step's own trace set up: api/plan_reuse.py), but for entries never run again; with every place
pinned, the latest other signature is kept beside them.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Generic, TypeVar

from ..errors import warn
from ..frontend.trace import BatchSignature

V = TypeVar("V")

DEFAULT_MAX_SIZE = 8      # compiled signatures kept (each holds its graphs and executor, not model data)
DEFAULT_WARN_AFTER = 4    # distinct constant values of one shape family before the warning
DEFAULT_SHAPES_WARN_AT = 4   # the distinct set of batch shapes whose compile warns


def _family(key: tuple) -> tuple:
    """The key with every constant's value blanked out: signatures that differ only in constants share it."""
    return tuple(p.without_constants() if hasattr(p, "without_constants") else p for p in key)


def _constants(key: tuple) -> tuple:
    return tuple(c for p in key if hasattr(p, "without_constants") for c in p.constants)


class TraceCache(Generic[V]):
    """Compiled steps by signature key (a tuple), least recently used evicted past `max_size`."""

    def __init__(self, max_size: int = DEFAULT_MAX_SIZE, warn_after: int = DEFAULT_WARN_AFTER,
                 shapes_warn_at: int = DEFAULT_SHAPES_WARN_AT):
        if max_size < 1:
            raise ValueError(f"TraceCache: max_size must be >= 1, got {max_size}")
        self.max_size = max_size
        self.warn_after = warn_after
        self.shapes_warn_at = shapes_warn_at
        self._entries: OrderedDict[tuple, V] = OrderedDict()
        self._pinned: set = set()               # the first parts (batch signatures) of the pinned keys
        self.last: tuple | None = None          # the key most recently looked up with a hit, or put
        self._shapes: list[tuple] = []          # distinct batch shapes compiled, up to shapes_warn_at
        # shape family -> distinct constant tuples seen (capped at warn_after + 1), bounded like the entries
        self._seen: OrderedDict[tuple, set[tuple]] = OrderedDict()
        self._warned: set[tuple] = set()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: tuple) -> bool:
        return key in self._entries

    def items(self) -> list[tuple[tuple, V]]:
        """Every (key, compiled step), least recently used first."""
        return list(self._entries.items())

    def peek(self, key: tuple) -> V | None:
        """The entry for `key`, if any, as get() finds it but leaving the order and `last` as they are."""
        return self._entries.get(key)

    def get(self, key: tuple) -> V | None:
        value = self._entries.get(key)
        if value is not None:
            self._entries.move_to_end(key)
            self.last = key
        return value

    def put(self, key: tuple, value: V) -> None:
        self._entries[key] = value
        self._entries.move_to_end(key)
        self.last = key
        # the least recently used goes first; pinned entries stay, and so does the one just put (with max_size
        # pinned, the cache holds one more)
        while len(self._entries) > self.max_size:
            old = next((k for k in self._entries if not self._kept(k) and k != key), None)
            if old is None:
                break
            del self._entries[old]
        self._note(key)
        self._note_shapes(key)

    def _kept(self, key: tuple) -> bool:
        """Pinned: of a reserved batch signature, and not a step that is never run again (its trace changed the
        state it is keyed by), which would otherwise keep one entry per call of a step that counts its calls."""
        return key[0] in self._pinned and not getattr(self._entries[key], "writes_state", False)

    def check_room_to_pin(self) -> None:
        """Raise unless one more signature can be pinned: at most max_size are."""
        if len(self._pinned) >= self.max_size:
            raise ValueError(f"step.reserve: {len(self._pinned)} batch signatures are reserved already and the "
                             f"cache keeps {self.max_size} (cache_size): pass a larger px.compile(..., cache_size=N)")

    def pin(self, key: tuple) -> None:
        """Keep this compiled signature, and every later entry of its batch signature, however many others come
        (step.reserve)."""
        assert key in self._entries, "only a cached signature is pinned"
        self._pinned.add(key[0])

    def _note_shapes(self, key: tuple) -> None:
        shapes = tuple(tuple(shape for shape, _ in p.tensors) for p in key if isinstance(p, BatchSignature))
        if not shapes or shapes in self._shapes or len(self._shapes) >= self.shapes_warn_at:
            return
        self._shapes.append(shapes)
        if len(self._shapes) == self.shapes_warn_at:
            seen = "; ".join(", ".join(str(s) for s in sh[0]) for sh in self._shapes)
            warn(
                f"pstar-fx: the step was traced and compiled for {len(self._shapes)} different batch shapes "
                f"({seen}): every new shape traces and plans the step again. Pad batches to one length, or bucket "
                "them into a few (round each sequence length up to a multiple of 64, or to a power of two), and "
                "compile each bucket up front with step.reserve(*batch), the largest first: a batch that does not "
                f"fit the budget raises BudgetError there, not in the middle of training. At most {self.max_size} "
                "compiled signatures are kept (least recently used dropped, and traced again when it comes back): "
                "px.compile(..., cache_size=N) keeps more.")

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
