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
17.26B GPT recomputed 38 of its 54 blocks, and kept 37 fewer chunks' states on the device than with all).

Light variants (segments.light_segments) worth their compute go first: a segment that keeps its matrix products' and
attention's outputs and recomputes only the cheap operations between them frees less for a small share of the
compute, so where they make comfort fit, no whole block is recomputed. Then whole segments, by the same rule, each
in place of its light variant (worthwhile by the compute and the bytes it adds to the variant's): transformers'
Llama 8B shape at 4 x 2048 tokens on an H200 ends with 24 light and 8 whole, 0.105 s of recompute estimated, against
23 whole ones and 0.147 s without light variants. Then segments whose removal changes none of the figures are
dropped, last first, and a whole segment whose light variant does as well is made light, again until neither changes
anything. If the need still exceeds the budget, the (whole) segments that give the least need are used; if even that
does not fit, BudgetError.
"""
from __future__ import annotations

from .replay import Replay
from .segments import Segment


def choose(replay: Replay, segments: tuple[Segment, ...], budget: int,
           light: tuple[Segment, ...] = ()) -> tuple[int, ...]:
    """The segments to recompute under `budget` (see the module docstring), some of them as their light variants
    (`light`, segments.light_segments); () when comfort fits without."""
    def key(chosen):
        f = replay.figures(chosen)
        return (max(0, f.need - budget), f.peak, f.excess)

    def better(trial, best, worthwhile: bool) -> bool:
        return trial < best if worthwhile else trial[0] < best[0]

    chosen: list[int] = []
    best = key(chosen)
    if best == (0, 0, 0):
        return ()
    twin = {v.start: v for v in light}
    for v in light:                        # the cheap recomputes first, where worth their compute
        if not v.worthwhile:
            continue
        trial = key(chosen + [v.id])
        if trial < best:
            chosen.append(v.id)
            best = trial
            if best == (0, 0, 0):
                return _pruned(key, chosen, best, segments, twin)
    for s in segments:                     # then whole segments, in place of their light variants
        v = twin.get(s.start)
        was = v is not None and v.id in chosen
        base = [c for c in chosen if not (was and c == v.id)]
        trial = key(base + [s.id])
        worthwhile = (s.seconds - v.seconds <= s.copy_s - v.copy_s) if was else s.worthwhile
        if better(trial, best, worthwhile):
            chosen = base + [s.id]
            best = trial
            if best == (0, 0, 0):
                break
    return _pruned(key, chosen, best, segments, twin)


def _pruned(key, chosen: list[int], best, segments: tuple[Segment, ...], twin: dict[int, Segment]) -> tuple[int, ...]:
    """chosen less the segments whose removal changes none of the figures, last first; a whole segment whose light
    variant does as well is made light; again until neither changes anything (so that no segment of the result can
    be dropped or made light without raising a figure)."""
    by_id = {s.id: s for s in (*segments, *twin.values())}
    changed = True
    while changed:
        changed = False
        for sid in sorted(chosen, key=lambda c: (by_id[c].start, c), reverse=True):
            rest = [c for c in chosen if c != sid]
            trial = key(rest)
            if trial <= best:
                chosen, best, changed = rest, trial, True
                continue
            v = twin.get(by_id[sid].start)
            if v is not None and v.id != sid:
                trial = key(rest + [v.id])
                if trial <= best:
                    chosen, best, changed = rest + [v.id], trial, True
    return tuple(sorted(chosen, key=lambda c: (by_id[c].start, c)))


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
