"""remat: recompute forward activations in backward where the budget needs it, a transformer block at a time.

Invariant after: the input graph's nodes are all present, in the same order, computing the same values; for every
chosen segment, copies of some of its forward nodes (tagged `node.meta[REMAT]`, a `RematTag`) run right before the
first backward node that reads one of the segment's saved values, applying the same ops to the same inputs, and every
backward use of such a value reads its copy, so the forward value dies in forward. Nothing random is recomputed.
Liveness annotations are those of the output graph. At an unlimited budget, or one the step fits without
recomputation (`comfort`, see choice.py), the graph is the input's. The one exception to the first sentence: where
no choice of segments fits the budget, the step's large cross-entropy losses are first computed in blocks of rows
(passes/loss_rows, which recomputes each block's log-softmax in backward; the same values), where the settings allow
it (`Settings.loss_rows`), and the segments chosen on that graph.

How (one module each): segments.py finds the candidate segments, a transformer block at a time, each whole and as
a light variant that keeps its matrix products' and attention's outputs; replay.py replays
liveness for any choice of them without building the graph; choice.py chooses by the cost model; rewrite.py builds
the graph with the chosen segments recomputed (and undoes the user's own checkpoints where they are not needed).
"""
from __future__ import annotations

import dataclasses

from ...cost import H200, Machine
from ...errors import BudgetError
from ...ir.graph import Choice, TrainGraph
from ...ir.needs import all_needs, buf_bytes, static_bytes
from ...units import format_bytes
from ..liveness import analyze, liveness
from ..loss_rows import loss_rows, may_split
from ..place_optimizer import min_need, place_optimizer
from .choice import choose, least_need
from .replay import Replay
from .rewrite import apply, keep_forward_values
from .segments import GraphFacts, Segment, block_paths, find_segments, light_segments


def remat(g: TrainGraph, *, enabled: bool = True, machine: Machine = H200) -> TrainGraph:
    """The pass (see the module docstring); enabled=False passes the graph through, the user's checkpoints kept.
    machine: the rates a segment's recompute and the copying it saves are weighed at."""
    budget = g.settings.budget
    unchanged = g.evolve(stage="remat", made_by="remat")
    if not enabled or g.settings.optimizer is None:
        return unchanged      # remat=False: nothing recomputed beyond the user's own checkpoints, which stay
    # the user's checkpoints are hints: where the step fits with their activations kept and nothing moving, keeping
    # them is faster than recomputing; otherwise they stay and more may be recomputed below
    undone = "remat (user checkpoints undone: the activations fit)"
    if budget is None:
        kept = keep_forward_values(g)
        return unchanged if kept is g else _chose(kept.evolve(stage="remat", made_by=undone),
                                                  "the user's checkpoints undone: no budget, every activation kept")
    G = GraphFacts(g)
    replay = Replay(g, G, budget)
    if replay.figures(()).excess == 0:         # comfort fits: nothing would move
        # keeping the forward values holds at every node at least what recomputing them does, so only a step that
        # fits with its checkpoints can fit without them: the graph without them is made only then
        kept = keep_forward_values(g)
        fits = f"at the budget {format_bytes(budget)} every activation fits beside every chunk on the device"
        if kept is g:
            return _chose(unchanged, f"nothing recomputed: {fits}")
        if Replay(kept, GraphFacts(kept), budget).figures(()).excess == 0:
            return _chose(kept.evolve(stage="remat", made_by=undone), f"the user's checkpoints undone: {fits}")
        return _chose(unchanged, f"the user's checkpoints kept and nothing more recomputed: at the budget "
                                 f"{format_bytes(budget)} the activations fit beside every chunk on the device "
                                 "with them, not without")
    segments = find_segments(g, G, machine)
    light = light_segments(g, G, segments, machine)
    replay.add(segments + light)
    chosen = choose(replay, segments, budget, light)
    rule = "each kept only where it saves more copying than its compute costs or lets the step fit"
    if replay.figures(chosen).need > budget:
        chosen = least_need(replay, segments)
        rule = "the least need: the budget holds no cheaper choice"
        if replay.figures(chosen).need > budget:
            split = _loss_in_rows(g)
            if split is not None:
                out = remat(split, enabled=enabled, machine=machine)
                why = Choice("remat", f"the cross-entropy loss computed in blocks of rows (passes/loss_rows): "
                                      f"without that the step needs at least "
                                      f"{format_bytes(replay.figures(chosen).need)}, more than the budget "
                                      f"{format_bytes(budget)}")
                at = len(g.choices)           # before what remat chose on the graph with the loss in blocks
                return out.evolve(choices=out.choices[:at] + (why,) + out.choices[at:])
            raise _budget_error(apply(g, [s for s in segments if s.id in chosen]), budget)
    out = apply(g, [s for s in segments + light if s.id in chosen])
    assert replay.live(chosen) == [out.ann[n.name].live_bytes for n in out.nodes], \
        "remat's replay of liveness disagrees with liveness on the rewritten graph"
    return _chose(out.evolve(stage="remat", made_by="remat"), _why(replay, segments + light, chosen, budget, rule))


def _loss_in_rows(g: TrainGraph) -> TrainGraph | None:
    """g with its large cross-entropy losses in blocks of rows, liveness annotated, where the settings let remat
    split them and one is not split yet; else None."""
    if not may_split(g):
        return None
    out = loss_rows(g, force=True)
    return None if out.gm is g.gm else liveness(out)


def _chose(g: TrainGraph, why: str) -> TrainGraph:
    return g.evolve(choices=g.choices + (Choice("remat", why),))


def _why(replay: Replay, segments: tuple[Segment, ...], chosen: tuple[int, ...], budget: int, rule: str) -> str:
    """What recomputing the chosen segments buys, in the figures the choice is made by."""
    before, after = replay.figures(()), replay.figures(chosen)
    picked = [s for s in segments if s.id in chosen]
    b = format_bytes(budget)
    over = f"with the activations as traced, everything on the device would exceed the budget {b} by " \
           f"{format_bytes(before.peak)} at its fullest (a node, or the updates at the step's end)"
    if not picked:
        none = ("no segment saves more copying than its compute costs" if not any(s.worthwhile for s in segments)
                else "no segment worth its compute lowers what exceeds it")
        return f"nothing recomputed: {over}, and {none}"
    light = sum(s.light for s in picked)
    whole = sum(not s.light for s in segments)
    part = f", {light} of them only their cheap operations (matrix products and attention kept)" if light else ""
    what = (f"recomputes {len(picked)} of {whole} candidate segments{part} ({sum(len(s.recompute) for s in picked)} "
            f"nodes, {sum(s.seconds for s in picked):.4g} s of compute estimated), {rule}")
    if before.need > budget:
        return (f"{what}: without them the step needs at least {format_bytes(before.need)}, more than the budget {b}; "
                f"with them {format_bytes(after.need)}")
    return f"{what}: {over}, by {format_bytes(after.peak)} with them recomputed (less to move)"


def least_need_graph(g: TrainGraph) -> TrainGraph:
    """g with the segments recomputed that give the least need (step.min_device_memory): the smallest budget the
    step compiles under with recomputation (and its large losses in blocks of rows, as remat's last resort)."""
    if g.settings.optimizer is None:
        return g
    g = _loss_in_rows(g) or g
    G = GraphFacts(g)
    segments = find_segments(g, G)
    replay = Replay(g, G, None)
    replay.add(segments)
    chosen = least_need(replay, segments)
    return apply(g, [s for s in segments if s.id in chosen])


def _budget_error(g: TrainGraph, budget: int) -> BudgetError:
    """The least budget with recomputation (what step.min_device_memory reports) and the node that needs it."""
    # (every state on the host, the host unbounded: the device's least need, whatever host_memory holds)
    host = place_optimizer(g.evolve(settings=dataclasses.replace(g.settings, budget=0, host_budget=None)))
    need = min_need(host)
    nodes = host.nodes
    lv = analyze(nodes, host.ann)
    nd = all_needs(host)
    own = [lv.live[i] + x.workspace + sum(buf_bytes(host, k) for k in x.resident) for i, x in enumerate(nd)]
    i = max(range(len(own)), key=own.__getitem__)
    chunks = sum(buf_bytes(host, k) for k in nd[i].resident)
    n = nodes[i]
    what = n.target.__name__ if callable(n.target) and hasattr(n.target, "__name__") else n.target
    return BudgetError(
        f"device_memory budget {format_bytes(budget)} ({budget} bytes) is too small: even recomputing activations "
        f"in backward (remat), this step needs at least {format_bytes(need)} ({need} bytes), at node '{n.name}' "
        f"({what}): live activations {format_bytes(lv.live[i])} + its chunk buffers {format_bytes(chunks)} + "
        f"workspace {format_bytes(nd[i].workspace)} + always-resident {format_bytes(static_bytes(host))} (module "
        "buffers and constants; every optimizer state on the host). Raise device_memory, or lower chunk_size or the "
        "batch size.", node=n.name, needed=need, available=budget)


__all__ = ["remat", "least_need_graph", "keep_forward_values", "apply", "choose", "least_need", "find_segments",
           "light_segments", "block_paths", "GraphFacts", "Replay", "Segment"]
