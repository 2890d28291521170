"""Small fx helpers every stage shares: op schema facts (what an op writes, whether it draws random numbers), storage
identity and size of fake values, and where in the user's source a node was made.

Data-dependent sizes. An op whose output size depends on tensor values (nonzero, boolean masking, unique) is traced
with an unbacked SymInt for that size (`u0`, `u1`, ... in the printed shapes), whose value range the tracer's ShapeEnv
knows (nonzero of n elements: 0..n). `storage_bytes` plans every storage of such a size at its upper bound, so the
plan holds whatever the data; at run time the storage is at most that large (the executor measures it), so measured
bytes are <= the plan at the nodes where one is alive (`bounded_live`) and equal elsewhere.
"""
from __future__ import annotations

import copy
import functools
import os
import re
from dataclasses import dataclass

import sympy
import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols
from torch.utils._pytree import tree_leaves

from ..errors import is_own_file


_TORCH_DIR = os.path.dirname(torch.__file__)
_FILE = re.compile(r'File "([^"]+)"')


def has_node(a) -> bool:
    """Whether an argument (a node, or a list, tuple or dict nesting them) refers to a node."""
    found = []
    fx.node.map_arg(a, found.append)
    return bool(found)


_GENERATED = ("<string>", "<eval_with_key")    # code torch generates (decompositions, fx modules): not the user's


@functools.lru_cache(maxsize=4096)
def is_user_file(filename: str) -> bool:
    """Whether a source file is the user's: outside torch, pstar-fx's own files (errors.is_own_file), contextlib,
    functools and code torch generates (a pure function of the name, memoised: tracing asks it at every torch-level
    call)."""
    if filename.startswith(_GENERATED):
        return False
    f = os.path.abspath(filename)
    return not (f.startswith(_TORCH_DIR) or is_own_file(f) or "/contextlib.py" in f or "/functools.py" in f)


def user_frame(node: fx.Node) -> tuple[str, str] | None:
    """The innermost frame of the user's code (is_user_file) in a node's recorded stack trace: its
    'File "...", line N, in f' line and the code line after it ("" if none); make_fx's own traces end inside torch,
    in F.embedding say. None when the trace has no such frame."""
    lines = [ln.strip() for ln in (node.meta.get("stack_trace") or "").splitlines() if ln.strip()]
    found = None
    for i, ln in enumerate(lines):
        m = _FILE.match(ln)
        if m and is_user_file(m.group(1)):
            found = (ln, lines[i + 1] if i + 1 < len(lines) and not lines[i + 1].startswith("File ") else "")
    return found


_NUMBERED = re.compile(r"^(.*)_\d+$")


def node_copy(graph: fx.Graph, node: fx.Node, arg_transform) -> fx.Node:
    """`graph.node_copy(node, arg_transform)` for a copy into the graph that holds `node` (whose name is taken):
    the copy is named as torch 2.13 names it, the next free "base_N" for node "base_7". torch 2.11 looks the taken
    name up by the whole candidate ("base_7") instead of its base, misses, and tries "base_1", "base_2", ... in turn,
    quadratic in the nodes sharing a base: at 17B, 3.0 of the 4.05 s assign_chunks took on the H200 machine's torch
    2.11. Handing it the base instead takes the path both versions count from."""
    m = _NUMBERED.match(node.name)
    args = fx.node.map_arg(node.args, arg_transform)
    kwargs = fx.node.map_arg(node.kwargs, arg_transform)
    out = graph.create_node(node.op, node.target, args, kwargs, m.group(1) if m else node.name, node.type)
    out.meta = copy.copy(node.meta)
    return out


# Ops that write to arguments their schema does not annotate as written: the positions they write.
_UNANNOTATED_WRITES = {
    torch.ops.aten.native_batch_norm.default: (3, 4),     # running_mean, running_var (in training)
    torch.ops.aten.cudnn_batch_norm.default: (3, 4),
    torch.ops.aten.miopen_batch_norm.default: (3, 4),
}


def mutated_args(node: fx.Node) -> list[fx.Node]:
    """The node's arguments that its op writes to, from the op schema's alias annotations (and, for ops whose
    schema leaves a write unannotated, from the table above)."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return []
    out = [node.args[i] for i in _UNANNOTATED_WRITES.get(node.target, ())
           if i < len(node.args) and isinstance(node.args[i], fx.Node)]
    for i, a in enumerate(schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            v = node.args[i] if i < len(node.args) else node.kwargs.get(a.name)
            if isinstance(v, fx.Node):
                out.append(v)
    return out


_SEED_SCALING = (torch.ops.aten.mul.Tensor, torch.ops.aten.div.Tensor)


def loss_seed(graph: fx.Graph, loss: fx.Node) -> fx.Node | None:
    """The `ones_like` that starts backward: applied to the loss, or to the loss scaled first (divided by the
    number of micro-batches with accumulation, multiplied by the fp16 loss scale, or both)."""
    candidates = [loss]
    for _ in range(2):
        candidates += [u for c in candidates for u in c.users if u.target in _SEED_SCALING and u not in candidates]
    for c in candidates:
        for u in c.users:
            if u.target is torch.ops.aten.ones_like.default:
                return u
    return None


def tensors_in(val) -> list[torch.Tensor]:
    """The tensors in a value (a tensor, None, or a pytree of them), in pytree order."""
    if isinstance(val, torch.Tensor):      # the common case, without a pytree walk
        return [val]
    if val is None:
        return []
    return [t for t in tree_leaves(val) if isinstance(t, torch.Tensor)]


def tensors_of(node: fx.Node) -> list[torch.Tensor]:
    """The (fake) tensors a node produces, from node.meta["val"]."""
    return tensors_in(node.meta.get("val"))


def storage_key(t: torch.Tensor) -> int:
    """Identity of a tensor's storage: views and in-place results share it."""
    return t.untyped_storage()._cdata


def _bound(shape_env, expr: sympy.Expr) -> int | None:
    up = shape_env.bound_sympy(expr).upper
    return int(up) if isinstance(up, sympy.Integer) else None


def upper_bound(n: int | torch.SymInt) -> int | None:
    """An int as it is; a data-dependent size: the largest value it can take, from the value ranges of its symbols
    (None: no finite bound is known)."""
    return n if isinstance(n, int) else _bound(n.node.shape_env, n.node.expr)


def storage_bytes(t: torch.Tensor) -> int:
    """The bytes of a tensor's storage; of a data-dependent size, its upper bound (see the module docstring)."""
    nbytes = t.untyped_storage().nbytes()
    bound = upper_bound(nbytes)
    assert bound is not None, f"unbounded data-dependent storage size {nbytes} (the tracer refuses these)"
    return bound


def is_data_dependent(t: torch.Tensor) -> bool:
    return not isinstance(t.untyped_storage().nbytes(), int)


@dataclass(frozen=True)
class DataDependentSize:
    """A size that depends on tensor values: its symbol (printed shapes show it: u0), its upper bound (None:
    unbounded), and the node that first produces a tensor of that size (the op that decides it: nonzero, ...)."""
    symbol: sympy.Symbol
    bound: int | None
    node: fx.Node


def data_dependent_sizes(nodes: list[fx.Node]) -> list[DataDependentSize]:
    """Every data-dependent size of the graph's tensors once, in the order they first appear."""
    seen: dict[sympy.Symbol, DataDependentSize] = {}
    for n in nodes:
        for t in tensors_of(n):
            for size in t.shape:
                for sym in free_unbacked_symbols(size):
                    if sym not in seen:
                        seen[sym] = DataDependentSize(sym, _bound(size.node.shape_env, sym), n)
    return list(seen.values())


def bounded_live(nodes: list[fx.Node]) -> list[bool]:
    """Per node position: whether a storage of data-dependent size is alive while it runs (liveness's rule: from the
    node that creates the storage to the last user of any value sharing it)."""
    last = last_uses(nodes)
    start: dict[int, int] = {}
    end: dict[int, int] = {}
    for i, n in enumerate(nodes):
        for t in tensors_of(n):
            k = storage_key(t)
            if k not in start and is_data_dependent(t):
                start[k] = i
            if k in start:
                end[k] = max(end.get(k, i), last[i])
    delta = [0] * (len(nodes) + 1)
    for k, s in start.items():
        delta[s] += 1
        delta[end[k] + 1] -= 1
    out, alive = [], 0
    for d in delta[:-1]:
        alive += d
        out.append(alive > 0)
    return out


def output_node(graph: fx.Graph) -> fx.Node:
    for n in reversed(graph.nodes):
        if n.op == "output":
            return n
    raise AssertionError("graph has no output node")


def last_uses(nodes: list[fx.Node]) -> list[int]:
    """Per node position: the position of its last user (itself when it has none); a value is freed after it."""
    index = {n: i for i, n in enumerate(nodes)}
    return [max((index[u] for u in n.users), default=i) for i, n in enumerate(nodes)]


# ops tagged nondeterministic_seeded that draw random numbers only through a dropout argument: name of that argument
_RANDOM_ONLY_WITH_DROPOUT = {
    getattr(torch.ops.aten, op).default: "dropout_p"
    for op in ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
               "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention")
    if hasattr(torch.ops.aten, op)
}


def draws_random(n: fx.Node) -> bool:
    """The op draws random numbers: tagged nondeterministic_seeded, unless its only randomness is a dropout argument
    that is 0 (torch's efficient attention, which CUDA traces use, is tagged random even then: a checkpoint's
    recompute of it needs no forward twin's random values)."""
    if n.op != "call_function":
        return False
    tags = getattr(n.target, "tags", ())
    if torch.Tag.nondeterministic_seeded not in tags:
        return False
    arg = _RANDOM_ONLY_WITH_DROPOUT.get(n.target)
    if arg is None:
        return True
    schema = n.target._schema
    i = next(k for k, a in enumerate(schema.arguments) if a.name == arg)
    p = n.args[i] if i < len(n.args) else n.kwargs.get(arg, schema.arguments[i].default_value)
    return p != 0


def storages_of(n: fx.Node) -> set[int]:
    """The storages of a node's tensors."""
    return {storage_key(t) for t in tensors_of(n)}


def private_chains(nodes: list[fx.Node]) -> set[int]:
    """Written storages whose values are well defined per node: one node creates the storage, then in-place ops each
    write the previous one's result (dropout on the CPU: empty_like, bernoulli_, div_), no view of it is taken, and
    every other reader reads the last write, after it."""
    chain: dict[int, list[fx.Node]] = {}
    readers: dict[int, list[fx.Node]] = {}
    bad: set[int] = set()
    for n in nodes:
        out = storages_of(n)
        ins = {k for a in n.all_input_nodes for k in storages_of(a)}
        muts = mutated_args(n)
        for k in out - ins:
            chain[k] = [n]
        for m in muts:
            for k in storages_of(m):
                if chain.get(k, [None])[-1] is not m or len(muts) != 1 or out != storages_of(m):
                    bad.add(k)
                else:
                    chain[k].append(n)
        for k in (out & ins) - {k for m in muts for k in storages_of(m)}:
            bad.add(k)              # a view of the storage, or an op returning an alias of its input
        for a in n.all_input_nodes:
            if a not in muts:
                for k in storages_of(a):
                    readers.setdefault(k, []).append(a)
    written = {k for n in nodes for m in mutated_args(n) for k in storages_of(m)}
    return {k for k in written - bad if k in chain and len(chain[k]) > 1
            and all(r is chain[k][-1] for r in readers.get(k, ()))}


def refresh_views(x: fx.Node, old_storage: int) -> None:
    """x replaced a node whose value had storage old_storage: recompute the fake values of the views of it (they
    now alias x's storage, which liveness and the schedule must see)."""
    mode = x.meta["val"].fake_mode
    stack = list(x.users)
    while stack:
        u = stack.pop()
        if u.op != "call_function" or not any(storage_key(t) == old_storage for t in tensors_of(u)):
            continue
        args, kwargs = fx.node.map_arg((u.args, u.kwargs), lambda a: a.meta["val"])
        with mode:
            u.meta["val"] = u.target(*args, **kwargs)
        stack.extend(u.users)


def is_plain_cast(n: fx.Node) -> bool:
    """`_to_copy` that changes only the dtype (same device, strided, no memory format)."""
    if n.op != "call_function" or n.target is not torch.ops.aten._to_copy.default or len(n.args) != 1:
        return False
    src = n.args[0].meta.get("val") if isinstance(n.args[0], fx.Node) else None
    kw = n.kwargs
    return (isinstance(src, torch.Tensor) and set(kw) <= {"dtype", "layout", "device"}
            and kw.get("layout", torch.strided) == torch.strided
            and torch.device(kw.get("device", src.device)) == src.device)
