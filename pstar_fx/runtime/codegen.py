"""The executor's steady-state loop as generated Python: one straight-line function per scheduled graph.

The executor's interpreter (Executor._run) walks the nodes with a list of values, and after every node measures what
the device holds (the pool's highest use, the distinct activation storages) to check it against the plan: about 8 us
of host time a node. Once a graph has run that way and matched its plan, its later steps run this function instead:
each node is one line (`v12 = mm(v10, v11)`), its inputs are local variables, and the values the plan frees after a
node are deleted there (`del v10`), so the memory each value holds is released at the same node as in the
interpreter. What the interpreter does between nodes that changes memory stays: slots being written back are given
back as each node's room needs (`ChunkStore.reclaim`) and the pool's free list is trimmed (`DevicePool.trim`);
before the first value written a pending Ctrl-C is delivered, and a test's before_node hook is called. It measures
nothing: the step reports the peak the measured run found, and `debug=True` keeps every step on the interpreter.

Invariant: for the same graph, inputs and store, the function calls the same callables on the same arguments in the
same order as the interpreter, frees each value after the same node, and fails with the same errors (an aten op's or
a fused region's failure wrapped with the node's name and source line; the node is found from the traceback's line).
"""
from __future__ import annotations

import itertools
import linecache
import os
import weakref

import torch
import torch.fx as fx

from ..ir.fx_utils import has_node

_BUILTIN_LITERALS = (bool, int, str, type(None))


class _Source:
    """The generated function's text and the objects its names refer to."""

    def __init__(self):
        self.lines: list[str] = []
        self.names: dict[str, object] = {}

    def bind(self, name: str, obj) -> str:
        self.names[name] = obj
        return name


def _callable(target):
    """An aten overload's C++ entry point (OpOverload.__call__ only forwards to it), else the target itself."""
    if isinstance(target, torch._ops.OpOverload) and type(target).__call__ is torch._ops.OpOverload.__call__:
        return getattr(target, "_op", target)
    return target


def _expr(a, src: _Source, pos: dict, tag: str) -> str:
    """Python source for an argument: a node's variable, a container of them, or a bound constant."""
    if isinstance(a, fx.Node):
        return f"v{pos[a]}"
    if not has_node(a):
        if type(a) in _BUILTIN_LITERALS and (type(a) is not str or a.isidentifier()):
            return repr(a)
        return src.bind(f"c_{tag}", a)
    if isinstance(a, list):
        return "[" + ", ".join(_expr(x, src, pos, f"{tag}_{k}") for k, x in enumerate(a)) + "]"
    if type(a) is tuple:
        return "(" + "".join(_expr(x, src, pos, f"{tag}_{k}") + ", " for k, x in enumerate(a)) + ")"
    if isinstance(a, dict):
        return "{" + ", ".join(f"{src.bind(f'k_{tag}_{k}', key)}: {_expr(x, src, pos, f'{tag}_{k}')}"
                               for k, (key, x) in enumerate(a.items())) + "}"
    raise NotImplementedError(f"pstar-fx: cannot generate code for an argument of type {type(a).__name__} that "
                              "holds nodes")


def _call(n: fx.Node, i: int, src: _Source, pos: dict, first: str | None) -> str:
    """`f(args, key=value)` for node n; `first` is a leading argument's source (the runtime's)."""
    fn = src.bind(f"f{i}", _callable(n.target))
    args = ([first] if first else []) + [_expr(a, src, pos, f"{i}_{k}") for k, a in enumerate(n.args)]
    assert all(key.isidentifier() for key in n.kwargs), n.kwargs
    args += [f"{key}={_expr(a, src, pos, f'{i}_{key}')}" for key, a in n.kwargs.items()]
    return f"{fn}({', '.join(args)})"


HEADER = ("def step(inputs, scale, rt, consts, interrupts, before_node, before, failed, compact):\n"
          "    hooked = before_node is not None\n"
          "    try:\n")
FIRST_LINE = HEADER.count("\n") + 1       # the line of the first node's code


def generate(ex, kinds: tuple[int, ...]) -> tuple[str, dict, list[int]]:
    """The source of the graph's step function, the names it refers to, and the node of each of its lines from
    FIRST_LINE on. `ex` is the Executor (its nodes, per-node recipes, rooms and frees); `kinds` its node-kind
    constants in the order (get_attr, buffer, scale, input, output, region, runtime, aten).

    The function, `step(inputs, scale, rt, consts, interrupts, before_node, before, failed, compact)`, returns the
    output node's value. `before(i)` does what the interpreter does before node i: the pool's housekeeping, the
    delivery of a pending Ctrl-C (up to the first value written) and the call of `before_node(i, node)` (fault
    injection in tests); it is called only where one of them has something to do: while slots are being written
    back, the pool's free list holds more than it keeps at the node, Ctrl-C is pending or before_node is not None.
    `failed(e)` turns a failure into the error to raise (the node it failed at found from the traceback's line);
    `compact(i, v)` is Executor._compact at a node whose value the measured run had to copy into a storage of the
    planned size."""
    GET_ATTR, BUFFER, SCALE, INPUT, OUTPUT, REGION, RUNTIME, ATEN = kinds
    src = _Source()
    pos = ex.pos
    body = src.lines
    node_of_line: list[int] = []
    for i, n in enumerate(ex.nodes):
        kind = ex.kinds[i]
        lines = [f"if store.draining or pool.cached > ({ex.room[i]} if pool.caches else 0) or hooked"
                 f"{' or interrupts.pending' if i <= ex.holds_from else ''}: before({i})"]
        if kind == ATEN:
            lines.append(f"v{i} = {_call(n, i, src, pos, None)}")
        elif kind == RUNTIME:
            lines.append(f"v{i} = {_call(n, i, src, pos, 'rt')}")
        elif kind == REGION:
            fn = src.bind(f"f{i}", ex.compiled[i])
            lines.append(f"v{i} = tuple({fn}([{', '.join(f'v{pos[a]}' for a in n.args)}]))")
        elif kind == GET_ATTR:
            lines.append(f"v{i} = consts[{src.bind(f'c_{i}', n.target)}]")
        elif kind == BUFFER:
            lines.append(f"v{i} = store.buffers[{src.bind(f'c_{i}', n.meta['buffer'])}]")
        elif kind == SCALE:
            lines.append(f"v{i} = scale")
        elif kind == INPUT:
            lines.append(f"v{i} = next(inputs)")
        else:
            assert kind == OUTPUT and i == len(ex.nodes) - 1, "the output node is the graph's last"
            lines.append(f"return {_expr(n.args[0], src, pos, str(i))}")
        if i in ex.compact_at:
            lines.append(f"v{i} = compact({i}, v{i})")
        if ex.free_after[i] and kind != OUTPUT:
            lines.append("del " + ", ".join(f"v{j}" for j in ex.free_after[i]))
        body.extend(lines)
        node_of_line.extend([i] * len(lines))
    text = (HEADER + "".join(f"        {line}\n" for line in body) +
            "    except BaseException as e:\n"
            "        raise failed(e)\n")
    return text, src.names, node_of_line


_serial = itertools.count()


def compile_step(ex, kinds: tuple[int, ...], store, pool):
    """The generated step function of executor `ex` (see generate), bound to its store and pool, and a function from
    a failure's traceback to the node it failed at (None where it did not fail inside the function). The source is
    registered with linecache while the function lives, so a traceback through it shows the node's line; its file
    name lies in this package's directory (as pstar-fx's own code does)."""
    text, names, node_of_line = generate(ex, kinds)
    scope = dict(names, store=store, pool=pool)
    filename = os.path.join(os.path.dirname(__file__), f"<generated step {next(_serial)}: {len(ex.nodes)} nodes>")
    code = compile(text, filename, "exec")
    linecache.cache[filename] = (len(text), None, text.splitlines(keepends=True), filename)
    exec(code, scope)   # noqa: S102 - the text is generated above from the graph, not read from anywhere
    fn = scope["step"]
    weakref.finalize(fn, linecache.cache.pop, filename, None)   # the source goes with the function (no leak)

    def node_at(tb) -> int | None:
        while tb is not None:
            if tb.tb_frame.f_code is fn.__code__:
                k = tb.tb_lineno - FIRST_LINE
                return node_of_line[k] if 0 <= k < len(node_of_line) else None
            tb = tb.tb_next
        return None
    return fn, node_at
