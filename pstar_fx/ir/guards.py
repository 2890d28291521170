"""Guards: what a traced graph assumed about values it could not know while tracing, checked when the step runs.

Python control flow on a tensor's value or on a data-dependent size (`if mask.sum() > 0:`, `if x.item() > 0:`,
`if idx.size(0) > 0:` after `nonzero`, `int(n)` of a tensor) cannot be one static graph. The tracer takes one
outcome for each such decision (frontend/guards.py) and records it as a `guard` node, placed right after the nodes
that compute its inputs, before the commit point. At run time the node computes the same expression from the real
values; a different outcome raises `GuardFailed`, an internal exception: the step has changed nothing yet (the atomic
rollback runs) and is traced again for the outcome seen, then run again (pstar_fx/api/guarded.py).

A `GuardSpec` holds the sympy expression over the trace's data-dependent symbols (`u0`, `zuf0`: torch's ShapeEnv
names), the outcome assumed (a bool for a condition, a number where Python needed the value itself), and how each
symbol is read off a value the graph computes (`Bind`).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

import sympy


class Step(enum.Enum):
    """One step from a node's value towards a symbol's value (torch's unbacked-binding key paths, in short)."""
    SIZE = "size"              # t.size(arg)
    STRIDE = "stride"          # t.stride(arg)
    STORAGE_OFFSET = "storage_offset"   # t.storage_offset()
    INDEX = "index"            # v[arg]
    INT = "int"                # int(v): a bool read as 0 / 1
    FLOORDIV = "floordiv"      # v // arg


@dataclass(frozen=True)
class Bind:
    """Symbol `symbol` is the value of guard argument `arg` followed through `path` ((Step, argument) pairs)."""
    symbol: sympy.Symbol
    arg: int
    path: tuple[tuple[Step, int | None], ...] = ()

    def read(self, value):
        for step, k in self.path:
            if step is Step.SIZE:
                value = value.size(k)
            elif step is Step.STRIDE:
                value = value.stride(k)
            elif step is Step.STORAGE_OFFSET:
                value = value.storage_offset()
            elif step is Step.INDEX:
                value = value[k]
            elif step is Step.INT:
                value = int(value)
            else:
                assert step is Step.FLOORDIV, step
                value = value // k
        if hasattr(value, "item"):       # a 0-d tensor (a size read off a tensor stays an int)
            value = value.item()
        return value


@dataclass(frozen=True)
class GuardSpec:
    """The k-th data-dependent decision of a trace: `expr` (over the symbols of `binds`) took the value `expected`.
    `op` names the operation that made the value decided on, `where` the user's source line that decided."""
    index: int
    expr: sympy.Basic
    expected: bool | int | float
    binds: tuple[Bind, ...]
    op: str
    where: str

    def __repr__(self) -> str:      # what the printed graph shows
        return f"<#{self.index}: {self.expr} {'is' if isinstance(self.expected, bool) else '=='} {self.expected}>"

    def evaluate(self, values) -> bool | int | float:
        """The expression's value for the real values of the guard's arguments."""
        subs = {}
        for b in self.binds:
            v = b.read(values[b.arg])
            subs[b.symbol] = sympy.Float(v) if isinstance(v, float) else sympy.Integer(int(v))
        out = self.expr.xreplace(subs)
        if isinstance(self.expected, bool):
            assert out in (sympy.true, sympy.false), (self.expr, subs, out)
            return bool(out)
        assert out.is_number, (self.expr, subs, out)
        return float(out) if isinstance(self.expected, float) else int(out)


class GuardFailed(Exception):
    """Internal: guard `spec` saw `observed`, not the outcome the graph was traced for. Raised before the commit
    point, so the step changed nothing; the caller traces for `observed` and runs the step again."""

    def __init__(self, spec: GuardSpec, observed: bool | int | float):
        super().__init__(f"guard #{spec.index} ({spec.expr}) traced as {spec.expected}, was {observed} "
                         f"({spec.op} {spec.where})")
        self.spec = spec
        self.observed = observed


def check(spec: GuardSpec, values) -> None:
    """Raise GuardFailed unless the real values give the outcome the graph was traced for."""
    observed = spec.evaluate(values)
    if observed != spec.expected:
        raise GuardFailed(spec, observed)
