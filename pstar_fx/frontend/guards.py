"""Tracing Python control flow on data-dependent values: take one outcome, and guard it (ir/guards.py).

While tracing, a tensor's value (`.item()`, `bool(t)`, `int(t)`) is an unbacked symbol of torch's ShapeEnv (`u0`,
`zuf0` for a float) and so is a data-dependent size (`nonzero`, boolean-mask indexing). Python code that decides on
one (`if t.sum() > 0:`, `if idx.size(0) > 0:`, `range(int(n))`) makes the ShapeEnv evaluate an expression it cannot
know, which raises GuardOnDataDependentSymNode. `GuardingShapeEnv` answers instead: the k-th such decision takes
`assume[k]` when the caller gives one (the outcome a run of the step observed), else a default (True for a
condition; for a value, 1 within the symbol's range). A decision on the value of a size itself (a loop over the
rows `nonzero` found, `int(len(x[mask]))`) is left to raise: torch's ShapeEnv keeps a size symbolic even once it is
known to be 0 or 1 (it reasons about sizes as if they were at least 2), so tensors traced for that value would not
have the real shapes; a condition on a size (`if sel.size(0) > 0:`) is decided and guarded, the size itself stays
symbolic and planned at its upper bound. The answer becomes a runtime assertion of the ShapeEnv, so
the rest of the trace is consistent with it (a size specialised to a value gives tensors of that size, and the
same question is not asked twice). After make_fx, `insert_guards` adds one `guard` node per decision, right after
the nodes that compute its inputs and after the guard before it, so the guards run in the order they were decided.

A decision over a value the graph does not compute (none should exist) keeps the error the tracer raised before.
"""
from __future__ import annotations

import sys
import traceback
from typing import Callable, TypeVar

import sympy
import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import (CallMethodKey, ConvertIntKey, DivideByKey,
                                                   GuardOnDataDependentSymNode, ShapeEnv)
from torch.utils._pytree import SequenceKey

from ..errors import UntraceableError
from ..ir import ops
from ..ir.fx_utils import is_user_file
from ..ir.guards import Bind, GuardSpec, Step

T = TypeVar("T")


class _Decision:
    """One decision taken while tracing: the expression, the outcome taken, the user's frame that asked."""
    __slots__ = ("expr", "value", "frame")

    def __init__(self, expr: sympy.Basic, value, frame: traceback.FrameSummary | None):
        self.expr, self.value, self.frame = expr, value, frame


def _user_frame_now() -> traceback.FrameSummary | None:
    f = sys._getframe(2)
    while f is not None:
        if is_user_file(f.f_code.co_filename):
            return traceback.FrameSummary(f.f_code.co_filename, f.f_lineno, f.f_code.co_name)
        f = f.f_back
    return None


def _is_condition(expr: sympy.Basic) -> bool:
    """A condition (a relation, And / Or / Not), not a number (a sympy Symbol is both Boolean and Expr)."""
    return isinstance(expr, sympy.logic.boolalg.Boolean) and not isinstance(expr, sympy.Expr)


def _is_float(expr: sympy.Basic) -> bool:
    return any(s.name.startswith("zuf") for s in expr.free_symbols) or bool(expr.is_Float)


class GuardingShapeEnv(ShapeEnv):
    """A ShapeEnv that decides data-dependent questions instead of raising: `assume[k]` for the k-th, else a
    default; every decision is kept in `decisions`, in order."""

    def __init__(self, assume: tuple = (), false_at: frozenset = frozenset(), **kwargs):
        super().__init__(**kwargs)
        self.assume = tuple(assume)
        self.false_at = false_at     # (file, line) of conditions whose True branch raised: False by default there
        self.decisions: list[_Decision] = []

    def evaluate_expr(self, orig_expr, *args, **kwargs):
        try:
            return super().evaluate_expr(orig_expr, *args, **kwargs)
        except GuardOnDataDependentSymNode:
            if not _is_condition(orig_expr) and orig_expr.free_symbols & getattr(self, "size_like", set()):
                # the value of a size (a loop over the rows nonzero found, int(len(x[mask]))): torch keeps such a
                # size symbolic even once it is known to be 0 or 1, so the traced shapes would not be the real ones
                raise
        k = len(self.decisions)
        frame = _user_frame_now()
        if k < len(self.assume):
            value = self.assume[k]
        elif _is_condition(orig_expr) and frame is not None and (frame.filename, frame.lineno) in self.false_at:
            value = False
        else:
            value = self._default(orig_expr)
        if _is_condition(orig_expr):
            value = bool(value)
            answer = sympy.true if value else sympy.false
            fact = orig_expr if value else sympy.Not(orig_expr)
        else:
            value = float(value) if _is_float(orig_expr) else int(value)
            answer = sympy.Float(value) if isinstance(value, float) else sympy.Integer(value)
            fact = sympy.Eq(orig_expr, answer)
        self.decisions.append(_Decision(orig_expr, value, frame))
        defer = getattr(self, "guard_or_defer_runtime_assert", None) or self.defer_runtime_assert
        try:
            # the rest of the trace follows the decision: ranges refined, a size equal to a value replaced by it
            defer(fact, f"pstar-fx guard #{k}")
        except (AssertionError, TypeError):
            pass        # a compound condition torch does not record: asked again, it is decided (and guarded) again
        return answer

    def _default(self, expr: sympy.Basic):
        if _is_condition(expr):
            return True
        if _is_float(expr):
            return 0.0
        lo, hi = -sys.maxsize, sys.maxsize
        if isinstance(expr, sympy.Symbol):
            r = self.var_to_range.get(expr)
            if r is not None:
                lo = int(r.lower) if isinstance(r.lower, sympy.Integer) else lo     # (torch's int_oo is not)
                hi = int(r.upper) if isinstance(r.upper, sympy.Integer) else hi
        return max(lo, min(hi, 1))


def _path(keypath) -> tuple[tuple[Step, int | None], ...] | None:
    """torch's unbacked-binding key path as Steps (None: a kind this module does not read)."""
    out: list[tuple[Step, int | None]] = []
    pending_method = None
    for key in keypath:
        if isinstance(key, CallMethodKey):
            if key.name == "storage_offset":
                out.append((Step.STORAGE_OFFSET, None))
            elif key.name in ("size", "stride"):
                pending_method = key.name
            else:
                return None
        elif isinstance(key, SequenceKey):
            if pending_method is not None:
                out.append((Step.SIZE if pending_method == "size" else Step.STRIDE, key.idx))
                pending_method = None
            else:
                out.append((Step.INDEX, key.idx))
        elif isinstance(key, ConvertIntKey):
            out.append((Step.INT, None))
        elif isinstance(key, DivideByKey):
            out.append((Step.FLOORDIV, int(key.divisor)))
        else:
            return None
    return None if pending_method is not None else tuple(out)


def _op_name(n: fx.Node) -> str:
    t = n.target
    if isinstance(t, torch._ops.OpOverload):
        return f"aten.{t.overloadpacket.__name__}"
    return getattr(t, "__name__", str(t))


def _where(frame: traceback.FrameSummary | None) -> str:
    if frame is None:
        return "at an unknown source line"
    return f"at {frame.filename}:{frame.lineno} ({frame.line})"


def insert_guards(gm: fx.GraphModule, env: GuardingShapeEnv) -> list[fx.Node]:
    """One `guard` node per decision of the trace, in decision order, each right after the last node computing a
    symbol it reads and after the guard before it. Returns them."""
    if not env.decisions:
        return []
    nodes = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    binding: dict[sympy.Symbol, tuple[fx.Node, tuple]] = {}
    for n in nodes:
        for sym, keypath in (n.meta.get("unbacked_bindings") or {}).items():
            binding.setdefault(sym, (n, keypath))
    renamed = getattr(env, "unbacked_renamings", {})
    out: list[fx.Node] = []
    after: fx.Node | None = None
    for k, d in enumerate(env.decisions):
        expr = d.expr.xreplace(renamed) if renamed else d.expr
        args: list[fx.Node] = []
        binds = []
        for sym in sorted(expr.free_symbols, key=str):
            found = binding.get(sym)
            path = _path(found[1]) if found is not None else None
            if path is None:
                raise UntraceableError(
                    f"cannot trace the training step: Python control flow depends on a data-dependent value "
                    f"({d.expr}) that the traced graph does not compute {_where(d.frame)}; pstar-fx compiles one "
                    "static graph per outcome of such a decision, guarded at run time, and cannot check this one. "
                    "Compute it with tensor ops (torch.where) or move it outside the step")
            node = found[0]
            if node not in args:
                args.append(node)
            binds.append(Bind(sym, args.index(node), path))
        last = max(args, key=pos.__getitem__)
        if after is not None and pos[after] > pos[last]:
            last = after
        spec = GuardSpec(index=k, expr=expr, expected=d.value, binds=tuple(binds),
                         op=" and ".join(dict.fromkeys(_op_name(a) for a in args)), where=_where(d.frame))
        with gm.graph.inserting_after(last):
            g = gm.graph.call_function(ops.guard, tuple(args), {"spec": spec})
        pos[g] = pos[last] + 0.5       # (only compared with positions of earlier nodes and guards)
        after = g
        out.append(g)
    gm.graph.lint()
    gm.recompile()
    return out


MAX_FLIPS = 16   # source lines whose condition a failed trace may take the other way, one after the other


def tried_both_ways(trace: Callable[[tuple, frozenset], T], assume: tuple,
                    before_retry: Callable[[], None] = lambda: None) -> T:
    """trace(assume, false_at); a trace that fails (UntraceableError) after deciding a condition on a value by
    default (True: the tracer cannot know it) is tried again with that condition False, the conditions before it as
    taken, and every later condition asked at the same source line False too (a check in every layer costs one more
    trace, not one per layer): a sanity check such as `if torch.isnan(x).any(): raise ...` or torch's own `if
    torch.any(var < 0): raise` traces its passing branch, guarded (a step whose data makes it true retraces that
    branch and raises). A failure after conditions that a run observed (`assume`) is the code raising on real data:
    its own exception (the error's `raised`), as eager code raises it. The error carries `decisions`: (outcome,
    (file, line) or None) of each decision the failed trace took. `before_retry` runs before each trace after the
    first (the caller puts back what the failed trace's Python wrote: frontend/python_undo.py)."""
    false_at: frozenset = frozenset()
    observed = len(assume)          # outcomes a run observed (the flips below add outcomes no run saw)
    for _ in range(MAX_FLIPS):
        try:
            return trace(assume, false_at)
        except UntraceableError as e:
            taken = getattr(e, "decisions", ())
            by_default = [k for k in range(len(assume), len(taken)) if taken[k][0] is True]
            if not by_default:      # (the latest error: its trace went furthest)
                raised = getattr(e, "raised", None)
                if raised is not None and observed and len(taken) <= observed:
                    raise raised from None
                raise
            k = by_default[-1]
            assume = tuple(v for v, _ in taken[:k]) + (False,)
            if taken[k][1] is not None:
                false_at = false_at | {taken[k][1]}
            before_retry()
    return trace(assume, false_at)
