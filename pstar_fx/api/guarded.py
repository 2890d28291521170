"""Running a step whose graph holds guards: a failed guard means another trace, and the step runs again.

A trace takes one outcome for every data-dependent decision of the step (frontend/guards.py) and its graph checks
each when it runs (ir/guards.py). A guard that sees another outcome raises GuardFailed before the commit point, so
the step has changed nothing (the executor's rollback ran). `run_guarded` then asks the compiler for the graph of
what was observed: the guards before the failed one passed, so their outcomes stand, and the failed one's is the one
seen; a graph cached for those outcomes is reused, else the step is traced again taking them. The random number
generators are put back as they were before the first attempt, so the step that completes draws what a single
eager run draws. Each attempt passes at least one more guard than the one before (the same data, the same
decisions up to the failed one), so the loop ends; MAX_ATTEMPTS bounds it in case a step decides differently on
the same data.

`GuardVariants` remembers, per signature, the outcome tuples compiled for it, the most recently run first: a step
starts from the graph its signature ran last.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Callable

import torch

from ..errors import PstarError, UntraceableError, warn
from ..ir.graph import Role, TrainGraph
from ..ir.guards import GuardFailed, GuardSpec

MAX_ATTEMPTS = 64           # runs of one call, at most
WARN_AFTER = 4              # retraces caused by one guard (op and line) before the warning
_MAX_SIGNATURES = 64        # signatures whose variants are remembered


class GuardVariants:
    """Per signature, the guard outcome tuples compiled for it, most recently run first; and how often each guard
    (its op and line) made the step trace again, warning once when one keeps doing so."""

    def __init__(self):
        self._by_base: OrderedDict[tuple, list[tuple]] = OrderedDict()
        self._retraces: dict[tuple[str, str], int] = {}
        self._warned: set[tuple[str, str]] = set()

    def candidates(self, base: tuple, prefix: tuple) -> list[tuple]:
        """The outcome tuples compiled for `base` that start with `prefix`, most recently run first."""
        return [o for o in self._by_base.get(base, ()) if o[:len(prefix)] == prefix]

    def note(self, base: tuple, outcomes: tuple) -> None:
        known = self._by_base.setdefault(base, [])
        if outcomes in known:
            known.remove(outcomes)
        known.insert(0, outcomes)
        del known[16:]
        self._by_base.move_to_end(base)
        while len(self._by_base) > _MAX_SIGNATURES:
            self._by_base.popitem(last=False)

    def retraced(self, spec: GuardSpec) -> None:
        """The step traced again because guard `spec` failed: warn once when one guard keeps doing so."""
        key = (spec.op, spec.where)
        self._retraces[key] = self._retraces.get(key, 0) + 1
        if self._retraces[key] > WARN_AFTER and key not in self._warned:
            self._warned.add(key)
            warn(f"pstar-fx: the step was traced and compiled again {self._retraces[key]} times because Python "
                 f"code decided differently on a value computed by {spec.op} ({spec.expr}) {spec.where}: every new "
                 "outcome retraces, and a decision on a value itself (int(), a size used as a number) has as many "
                 "as the values it takes. Compute it with tensor ops (torch.where, a fixed-size mask) to keep one "
                 "graph; the compiled graphs kept are bounded (least recently used dropped).")


def traced_outcomes(g: TrainGraph) -> tuple:
    """What a traced graph decided at each of its guards, in order. Several ranks would each need the same outcome
    of every decision: refused there."""
    specs = [n.kwargs["spec"] for n in g.nodes if g.ann[n.name].role is Role.GUARD]
    if specs and g.settings.world > 1:
        raise UntraceableError(
            "cannot trace the step: Python control flow depends on a tensor's value or a data-dependent size "
            f"({specs[0].expr}, from {specs[0].op} {specs[0].where}); with several ranks every rank would need the "
            "same outcome, so compute it with tensor ops (torch.where) or move it outside the step")
    return tuple(s.expected for s in specs)


class _RandomState:
    """The random number generators a step draws from (the CPU's and the compute device's), as they were."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda, self.device)


def run_guarded(compiler, batch, interrupts, run: Callable):
    """`run(compiled, flat)` on the compiled step for this batch, again on another trace after each failed guard.
    Returns (compiled, flat, what run returned) of the attempt that passed every guard. The random number generators
    are put back as they were before each attempt that fails (a guard, or any failure: the step changed nothing),
    and where this call traced, the model's Python state before its first trace (Compiler.undo,
    frontend/python_undo.py) before it traces again: the step's Python runs once per call, as eager code's does."""
    traces = compiler.compiles
    compiled, flat = compiler.get(batch, interrupts)
    undo = compiler.take_undo() if compiler.compiles != traces else None
    saved = _RandomState(compiler.settings.device)
    for _ in range(MAX_ATTEMPTS):
        try:
            return compiled, flat, run(compiled, flat)
        except GuardFailed as e:
            failed = e
        except BaseException:
            # a step that failed changed nothing, its random draws (dropout's masks) included: the next step draws
            # what it would have drawn had this one never run
            saved.restore()
            raise
        assert compiled.outcomes, "a guard failed in a graph without guards"
        saved.restore()
        prefix = compiled.outcomes[:failed.spec.index] + (failed.observed,)
        before = compiler.compiles
        if undo is not None:
            undo.restore()          # (the lookup and the trace that follow see the state this call found)
        compiled, flat = compiler.get(batch, interrupts, prefix=prefix)
        if compiler.compiles != before:
            compiler.variants.retraced(failed.spec)
            undo = undo or compiler.take_undo()
    raise PstarError(f"pstar-fx: the step was run {MAX_ATTEMPTS} times on one batch and a guard failed every time "
                     f"(last: {failed}); the step's Python code decides differently on the same data. Make its "
                     "decisions depend on the batch and the model only")
