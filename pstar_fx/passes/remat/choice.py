"""Which segments the remat pass recomputes.

Choice (cost model, `pstar_fx.cost`). Two figures of a candidate graph, both exact replays of liveness over it:
`need`, the least budget any schedule fits (every optimizer state on the host, each node's own chunk buffers: what
`step.min_device_memory` reports), and `comfort`, the device bytes at each node when nothing moves (every optimizer
state and parameter on the device, gradient buffers from their first write). A segment is worth recomputing when its
estimated recompute time is below the time to copy the bytes it frees once between host and device: memory the step
lacks must otherwise be moved every step (chunks evicted and fetched again, optimizer states updated on the host).
Segments are taken in forward order (the earliest blocks free memory for the longest time, and their recompute runs
when little else is live): a worthwhile segment is taken if it lowers (the need above the budget, then comfort's
highest excess over the budget, then the comfort bytes above the budget summed over nodes); one that is not
worthwhile only if it lowers the need above the budget; until comfort fits the budget. The peak comes before the
sum because optimizer states stay on the device all step: the room they have is the budget less the highest
everything else reaches, where backward starts with every block's forward values live (by the sum alone, the
17.26B GPT recomputed 38 of its 54 blocks, and kept 37 fewer chunks' states on the device than with all). Then
segments whose removal changes none of them are dropped, last first. If the need still exceeds the budget, the
segments that give the least need are used; if even that does not fit, BudgetError.
"""
from __future__ import annotations

from .replay import Replay
from .segments import Segment


def choose(replay: Replay, segments: tuple[Segment, ...], budget: int) -> tuple[int, ...]:
    """The segments to recompute under `budget` (see the module docstring); () when comfort fits without."""
    def key(chosen):
        f = replay.figures(chosen)
        return (max(0, f.need - budget), f.peak, f.excess)

    chosen: list[int] = []
    best = key(chosen)
    if best == (0, 0, 0):
        return ()
    for s in segments:
        trial = key(chosen + [s.id])
        better = trial < best if s.worthwhile else trial[0] < best[0]
        if better:
            chosen.append(s.id)
            best = trial
            if best == (0, 0, 0):
                break
    for sid in reversed(list(chosen)):
        trial = key([c for c in chosen if c != sid])
        if trial <= best:
            chosen.remove(sid)
            best = trial
    return tuple(chosen)


def least_need(replay: Replay, segments: tuple[Segment, ...]) -> tuple[int, ...]:
    """The segments that give the least need: taken in forward order while each lowers it, then those whose removal
    does not raise it dropped, last first."""
    chosen: list[int] = []
    best = replay.figures(chosen).need
    for s in segments:
        trial = replay.figures(chosen + [s.id]).need
        if trial < best:
            chosen.append(s.id)
            best = trial
    for sid in reversed(list(chosen)):
        trial = replay.figures([c for c in chosen if c != sid]).need
        if trial <= best:
            chosen.remove(sid)
            best = trial
    return tuple(chosen)
